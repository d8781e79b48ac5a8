//! Tests of the reference: finite differences on every input, edge semantics, validation,
//! determinism, the bf16 entry point, and an independent naive implementation at a medium shape.

use half::bf16;

use super::*;
use crate::problem::{ExpertWeights, RoutedTokens, SharedExpertWeights};

// Section: inputs

/// splitmix64: tiny, seeded, good enough to fill test tensors.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi)`.
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    fn vec(&mut self, len: usize, scale: f64) -> Vec<f64> {
        (0..len).map(|_| scale * self.uniform(-1.0, 1.0)).collect()
    }
}

/// An owned f64 problem; `view()` lends it to the generic entry points.
#[derive(Clone)]
struct Owned {
    config: MoeConfig,
    x: Vec<f64>,
    ids: Vec<i32>,
    tw: Vec<f64>,
    wg: Vec<f64>,
    wu: Vec<f64>,
    wd: Vec<f64>,
    /// `[ws_gate, ws_up, ws_down]`.
    shared: Option<[Vec<f64>; 3]>,
}

impl Owned {
    /// Random inputs scaled so activations are O(1): x ~ U(-1,1), weights ~ U(-1,1)/sqrt(fan_in),
    /// distinct random ids per token, and `dropped` (token, slot) pairs set to -1.
    fn random(config: MoeConfig, seed: u64, dropped: &[(usize, usize)]) -> Self {
        let mut rng = Rng(seed);
        let (t, h, i, e, k) =
            (config.tokens_per_rank, config.hidden, config.intermediate, config.num_experts, config.top_k);
        let x = rng.vec(t * h, 1.0);
        let mut ids = Vec::with_capacity(t * k);
        for _ in 0..t {
            // Partial Fisher-Yates: k distinct experts.
            let mut pool: Vec<i32> = (0..e as i32).collect();
            for j in 0..k {
                let pick = j + rng.below(e - j);
                pool.swap(j, pick);
                ids.push(pool[j]);
            }
        }
        for &(token, slot) in dropped {
            ids[token * k + slot] = -1;
        }
        let tw = (0..t * k).map(|_| rng.uniform(0.1, 1.0)).collect();
        let (sh, si) = (1.0 / (h as f64).sqrt(), 1.0 / (i as f64).sqrt());
        let wg = rng.vec(e * i * h, sh);
        let wu = rng.vec(e * i * h, sh);
        let wd = rng.vec(e * h * i, si);
        let shared = config.shared_intermediate.map(|is| {
            let ss = 1.0 / (is as f64).sqrt();
            [rng.vec(is * h, sh), rng.vec(is * h, sh), rng.vec(h * is, ss)]
        });
        Self { config, x, ids, tw, wg, wu, wd, shared }
    }

    fn view(&self) -> Problem<'_, f64> {
        Problem {
            x: &self.x,
            topk_ids: &self.ids,
            topk_weights: &self.tw,
            w_gate: &self.wg,
            w_up: &self.wu,
            w_down: &self.wd,
            shared: self.shared.as_ref().map(|[g, u, d]| SharedSlices { ws_gate: g, ws_up: u, ws_down: d }),
        }
    }

    /// The same problem with x and weights rounded to bf16 values and topk weights to f32, so the
    /// bf16 tensors below hold exactly these values.
    fn rounded(&self) -> Self {
        let r = |v: &Vec<f64>| v.iter().map(|&a| f64::from(bf16::from_f64(a))).collect::<Vec<f64>>();
        Self {
            config: self.config.clone(),
            x: r(&self.x),
            ids: self.ids.clone(),
            tw: self.tw.iter().map(|&w| f64::from(w as f32)).collect(),
            wg: r(&self.wg),
            wu: r(&self.wu),
            wd: r(&self.wd),
            shared: self.shared.as_ref().map(|[g, u, d]| [r(g), r(u), r(d)]),
        }
    }

    /// bf16 tensors of a `rounded()` problem (conversion is exact there).
    fn bf16_tensors(&self) -> (RoutedTokens, ExpertWeights, Option<SharedExpertWeights>) {
        let b = |v: &Vec<f64>| v.iter().map(|&a| bf16::from_f64(a)).collect::<Vec<bf16>>();
        (
            RoutedTokens {
                x: b(&self.x),
                topk_ids: self.ids.clone(),
                topk_weights: self.tw.iter().map(|&w| w as f32).collect(),
            },
            ExpertWeights { w_gate: b(&self.wg), w_up: b(&self.wu), w_down: b(&self.wd) },
            self.shared.as_ref().map(|[g, u, d]| SharedExpertWeights { ws_gate: b(g), ws_up: b(u), ws_down: b(d) }),
        )
    }
}

fn config(t: usize, h: usize, i: usize, e: usize, k: usize, shared: Option<usize>, limit: Option<f32>) -> MoeConfig {
    MoeConfig { shared_intermediate: shared, swiglu_limit: limit, ..MoeConfig::new(t, h, i, e, k) }
}

// Section: an independent, naive implementation (per token, per slot, plain loops)

struct Naive {
    y: Vec<f64>,
    slot_outputs: Vec<f64>,
    dx: Vec<f64>,
    d_topk_weights: Vec<f64>,
    dw_gate: Vec<f64>,
    dw_up: Vec<f64>,
    dw_down: Vec<f64>,
    dws: Option<[Vec<f64>; 3]>,
}

/// `(hidden, d hidden / d gate, d hidden / d up)` with the clamp, written out independently.
fn naive_act(g: f64, u: f64, limit: Option<f64>) -> (f64, f64, f64) {
    let gc = match limit {
        Some(l) if g > l => l,
        _ => g,
    };
    let uc = match limit {
        Some(l) => u.max(-l).min(l),
        None => u,
    };
    let sig = 1.0 / (1.0 + (-gc).exp());
    let d_g = if limit.is_some_and(|l| g > l) { 0.0 } else { uc * (sig + gc * sig * (1.0 - sig)) };
    let d_u = if limit.is_some_and(|l| u.abs() > l) { 0.0 } else { gc * sig };
    (gc * sig * uc, d_g, d_u)
}

/// One MLP application on one token with its backward, accumulating weight grads and dx.
#[allow(clippy::too_many_arguments)]
fn naive_mlp(
    (wg, wu, wd): (&[f64], &[f64], &[f64]),
    grads: (&mut [f64], &mut [f64], &mut [f64]),
    x: &[f64],
    d_out_dir: &[f64],
    scale: f64,
    limit: Option<f64>,
    round: bool,
    dx: &mut [f64],
) -> Vec<f64> {
    let (h, n) = (x.len(), wg.len() / x.len());
    let mut hid = vec![0.0; n];
    let mut dact = vec![(0.0, 0.0); n];
    for i in 0..n {
        let (mut g, mut u) = (0.0, 0.0);
        for c in 0..h {
            g += wg[i * h + c] * x[c];
            u += wu[i * h + c] * x[c];
        }
        let (a, dg, du) = naive_act(g, u, limit);
        hid[i] = if round { round_to_bf16(a) } else { a };
        dact[i] = (dg, du);
    }
    let out: Vec<f64> = (0..h).map(|c| (0..n).map(|i| wd[c * n + i] * hid[i]).sum()).collect();
    let (dwg, dwu, dwd) = grads;
    for i in 0..n {
        let mut dh = 0.0;
        for c in 0..h {
            let d_out = scale * d_out_dir[c];
            dh += wd[c * n + i] * d_out;
            dwd[c * n + i] += d_out * hid[i];
        }
        let (dg, du) = (dh * dact[i].0, dh * dact[i].1);
        for c in 0..h {
            dwg[i * h + c] += dg * x[c];
            dwu[i * h + c] += du * x[c];
            dx[c] += wg[i * h + c] * dg + wu[i * h + c] * du;
        }
    }
    out
}

fn naive(p: &Owned, dy: &[f64], round: bool) -> Naive {
    let c = &p.config;
    let (t, h, i, k) = (c.tokens_per_rank, c.hidden, c.intermediate, c.top_k);
    let limit = c.swiglu_limit.map(f64::from);
    let mut n = Naive {
        y: vec![0.0; t * h],
        slot_outputs: vec![0.0; t * k * h],
        dx: vec![0.0; t * h],
        d_topk_weights: vec![0.0; t * k],
        dw_gate: vec![0.0; p.wg.len()],
        dw_up: vec![0.0; p.wu.len()],
        dw_down: vec![0.0; p.wd.len()],
        dws: p.shared.as_ref().map(|[g, u, d]| [vec![0.0; g.len()], vec![0.0; u.len()], vec![0.0; d.len()]]),
    };
    for tok in 0..t {
        let x = &p.x[tok * h..(tok + 1) * h];
        let dy_t = &dy[tok * h..(tok + 1) * h];
        let mut dx = vec![0.0; h];
        if let (Some([g, u, d]), Some([dg, du, dd])) = (&p.shared, &mut n.dws) {
            let out = naive_mlp((g, u, d), (dg, du, dd), x, dy_t, 1.0, limit, round, &mut dx);
            n.y[tok * h..(tok + 1) * h].copy_from_slice(&out);
        }
        for j in 0..k {
            let slot = tok * k + j;
            let Ok(e) = usize::try_from(p.ids[slot]) else {
                continue;
            };
            let (wi, wo) = (e * i * h..(e + 1) * i * h, e * h * i..(e + 1) * h * i);
            let out = naive_mlp(
                (&p.wg[wi.clone()], &p.wu[wi.clone()], &p.wd[wo.clone()]),
                (&mut n.dw_gate[wi.clone()], &mut n.dw_up[wi], &mut n.dw_down[wo]),
                x,
                dy_t,
                p.tw[slot],
                limit,
                round,
                &mut dx,
            );
            for (acc, &o) in n.y[tok * h..(tok + 1) * h].iter_mut().zip(&out) {
                *acc += p.tw[slot] * o;
            }
            n.d_topk_weights[slot] = dy_t.iter().zip(&out).map(|(d, o)| d * o).sum();
            n.slot_outputs[slot * h..(slot + 1) * h].copy_from_slice(&out);
        }
        n.dx[tok * h..(tok + 1) * h].copy_from_slice(&dx);
    }
    n
}

// Section: finite differences

#[derive(Clone, Copy, Debug)]
enum Param {
    X,
    TopkWeights,
    WGate,
    WUp,
    WDown,
    WsGate,
    WsUp,
    WsDown,
}

const ALL_PARAMS: [Param; 8] =
    [Param::X, Param::TopkWeights, Param::WGate, Param::WUp, Param::WDown, Param::WsGate, Param::WsUp, Param::WsDown];

impl Param {
    fn values_mut(self, p: &mut Owned) -> Option<&mut Vec<f64>> {
        Some(match self {
            Param::X => &mut p.x,
            Param::TopkWeights => &mut p.tw,
            Param::WGate => &mut p.wg,
            Param::WUp => &mut p.wu,
            Param::WDown => &mut p.wd,
            Param::WsGate => &mut p.shared.as_mut()?[0],
            Param::WsUp => &mut p.shared.as_mut()?[1],
            Param::WsDown => &mut p.shared.as_mut()?[2],
        })
    }

    fn grad(self, g: &ReferenceGrads) -> Option<&[f64]> {
        Some(match self {
            Param::X => &g.dx,
            Param::TopkWeights => &g.d_topk_weights,
            Param::WGate => &g.dw_gate,
            Param::WUp => &g.dw_up,
            Param::WDown => &g.dw_down,
            Param::WsGate => &g.shared.as_ref()?.dws_gate,
            Param::WsUp => &g.shared.as_ref()?.dws_up,
            Param::WsDown => &g.shared.as_ref()?.dws_down,
        })
    }
}

/// Finite-difference step. Perturbing any input by `FD_EPS` moves a pre-activation by at most
/// `FD_EPS` (|x| ≤ 1, |w| ≤ 1), far inside the clamp margin [`CLAMP_MARGIN`].
const FD_EPS: f64 = 1e-5;
const CLAMP_MARGIN: f64 = 1e-3;

fn loss(p: &Owned, dy: &[f64]) -> f64 {
    let fwd = forward_generic(&p.config, &p.view(), ReferenceOptions::EXACT).unwrap();
    fwd.y.iter().zip(dy).map(|(a, b)| a * b).sum()
}

/// Central differences of `sum(dy * y)` against the analytic gradient, for every element of every
/// input. Returns the number of elements checked.
fn check_finite_differences(p: &Owned, seed: u64) -> usize {
    let (t, h) = (p.config.tokens_per_rank, p.config.hidden);
    let dy = Rng(seed).vec(t * h, 1.0);
    let (_, grads) = backward_generic(&p.config, &p.view(), &dy, ReferenceOptions::EXACT).unwrap();
    let mut checked = 0;
    let mut worst = (0.0f64, String::new());
    for param in ALL_PARAMS {
        let mut probe = p.clone();
        let Some(len) = param.values_mut(&mut probe).map(|v| v.len()) else {
            assert!(param.grad(&grads).is_none(), "{param:?}: gradient without a tensor");
            continue;
        };
        let analytic = param.grad(&grads).unwrap_or_else(|| panic!("{param:?}: no gradient"));
        assert_eq!(analytic.len(), len, "{param:?}");
        for (idx, &an) in analytic.iter().enumerate() {
            let v0 = param.values_mut(&mut probe).unwrap()[idx];
            param.values_mut(&mut probe).unwrap()[idx] = v0 + FD_EPS;
            let plus = loss(&probe, &dy);
            param.values_mut(&mut probe).unwrap()[idx] = v0 - FD_EPS;
            let minus = loss(&probe, &dy);
            param.values_mut(&mut probe).unwrap()[idx] = v0;
            let fd = (plus - minus) / (2.0 * FD_EPS);
            // Truncation error ~eps²·|f'''| ≈ 1e-10, cancellation ~1e-16/eps ≈ 1e-11.
            let err = (fd - an).abs() / (1e-3 + an.abs());
            assert!(err < 1e-7, "{param:?}[{idx}]: finite difference {fd:e}, analytic {an:e}");
            if err > worst.0 {
                worst = (err, format!("{param:?}[{idx}]"));
            }
            checked += 1;
        }
    }
    eprintln!("finite differences: {checked} elements, worst scaled error {:e} at {}", worst.0, worst.1);
    checked
}

/// Pre-activations of every live (token, slot) and of the shared expert: `(gates, ups)`.
fn pre_activations(p: &Owned) -> (Vec<f64>, Vec<f64>) {
    let state = forward::run(&p.config, &p.view(), ReferenceOptions::EXACT);
    let i = p.config.intermediate;
    let mut gates = Vec::new();
    let mut ups = Vec::new();
    for (slot, &id) in p.ids.iter().enumerate() {
        if id >= 0 {
            gates.extend_from_slice(&state.public.gate_pre[slot * i..(slot + 1) * i]);
            ups.extend_from_slice(&state.public.up_pre[slot * i..(slot + 1) * i]);
        }
    }
    if let Some(s) = &state.shared {
        gates.extend_from_slice(&s.gate_pre);
        ups.extend_from_slice(&s.up_pre);
    }
    (gates, ups)
}

/// Sets a SwiGLU limit that clamps some gates and some ups (routed and shared) while no
/// pre-activation lies within [`CLAMP_MARGIN`] of a clamp boundary.
fn set_limit_with_margin(p: &mut Owned) {
    let (gates, ups) = pre_activations(p);
    let mut limit = 0.3f32;
    while gates.iter().chain(ups.iter()).any(|&g| (g - f64::from(limit)).abs() < CLAMP_MARGIN)
        || ups.iter().any(|&u| (u.abs() - f64::from(limit)).abs() < CLAMP_MARGIN)
    {
        limit += 0.0071;
    }
    let l = f64::from(limit);
    assert!(gates.iter().filter(|&&g| g > l).count() > 0, "no gate clamped at L = {l}");
    assert!(ups.iter().filter(|&&u| u.abs() > l).count() > 0, "no up clamped at L = {l}");
    assert!(gates.iter().filter(|&&g| g < l).count() > 0, "every gate clamped at L = {l}");
    assert!(ups.iter().filter(|&&u| u.abs() < l).count() > 0, "every up clamped at L = {l}");
    p.config.swiglu_limit = Some(limit);
}

#[test]
fn finite_differences_without_limit() {
    let p = Owned::random(config(3, 8, 8, 4, 2, Some(8), None), 1, &[]);
    assert_eq!(check_finite_differences(&p, 101), 24 + 6 + 3 * 256 + 3 * 64);
}

#[test]
fn finite_differences_with_limit_some_clamped() {
    let mut p = Owned::random(config(3, 8, 8, 4, 2, Some(8), None), 2, &[]);
    set_limit_with_margin(&mut p);
    check_finite_differences(&p, 102);
}

#[test]
fn finite_differences_with_dropped_slot_and_limit() {
    let mut p = Owned::random(config(3, 8, 8, 4, 2, Some(8), None), 3, &[(1, 0)]);
    set_limit_with_margin(&mut p);
    check_finite_differences(&p, 103);
}

#[test]
fn finite_differences_k1_t1_without_shared() {
    let p = Owned::random(config(1, 8, 16, 3, 1, None, None), 4, &[]);
    check_finite_differences(&p, 104);
    let mut p = Owned::random(config(1, 16, 8, 2, 1, None, None), 5, &[]);
    set_limit_with_margin(&mut p);
    check_finite_differences(&p, 105);
}

// Section: edge semantics

fn assert_bits_eq(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (idx, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}[{idx}]: {x:e} vs {y:e}");
    }
}

fn assert_results_bits_eq(a: &(ReferenceForward, ReferenceGrads), b: &(ReferenceForward, ReferenceGrads)) {
    let (fa, ga) = a;
    let (fb, gb) = b;
    assert_bits_eq(&fa.y, &fb.y, "y");
    assert_bits_eq(&fa.slot_outputs, &fb.slot_outputs, "slot_outputs");
    assert_bits_eq(&fa.gate_pre, &fb.gate_pre, "gate_pre");
    assert_bits_eq(&fa.up_pre, &fb.up_pre, "up_pre");
    assert_bits_eq(&fa.hidden, &fb.hidden, "hidden");
    assert_eq!(fa.shared_out.is_some(), fb.shared_out.is_some());
    if let (Some(a), Some(b)) = (&fa.shared_out, &fb.shared_out) {
        assert_bits_eq(a, b, "shared_out");
    }
    assert_bits_eq(&ga.dx, &gb.dx, "dx");
    assert_bits_eq(&ga.d_topk_weights, &gb.d_topk_weights, "d_topk_weights");
    assert_bits_eq(&ga.dw_gate, &gb.dw_gate, "dw_gate");
    assert_bits_eq(&ga.dw_up, &gb.dw_up, "dw_up");
    assert_bits_eq(&ga.dw_down, &gb.dw_down, "dw_down");
    assert_eq!(ga.shared.is_some(), gb.shared.is_some());
    if let (Some(a), Some(b)) = (&ga.shared, &gb.shared) {
        assert_bits_eq(&a.dws_gate, &b.dws_gate, "dws_gate");
        assert_bits_eq(&a.dws_up, &b.dws_up, "dws_up");
        assert_bits_eq(&a.dws_down, &b.dws_down, "dws_down");
    }
}

fn run_exact(p: &Owned, dy: &[f64]) -> (ReferenceForward, ReferenceGrads) {
    backward_generic(&p.config, &p.view(), dy, ReferenceOptions::EXACT).unwrap()
}

#[test]
fn dropped_slot_contributes_exactly_zero() {
    let mut p = Owned::random(config(4, 16, 8, 4, 2, Some(8), Some(0.5)), 6, &[(1, 0), (2, 1)]);
    let dy = Rng(106).vec(4 * 16, 1.0);
    let base = run_exact(&p, &dy);
    let (fwd, grads) = &base;
    for slot in [2, 5] {
        assert!(fwd.slot_outputs[slot * 16..(slot + 1) * 16].iter().all(|&v| v.to_bits() == 0));
        for v in [&fwd.gate_pre, &fwd.up_pre, &fwd.hidden] {
            assert!(v[slot * 8..(slot + 1) * 8].iter().all(|&v| v.to_bits() == 0));
        }
        assert_eq!(grads.d_topk_weights[slot].to_bits(), 0, "d_topk_weights of a dropped slot");
    }
    // A dropped slot's weight is never read: huge or NaN weights change no bit anywhere.
    for w in [1e30, f64::NAN, -0.0] {
        p.tw[2] = w;
        p.tw[5] = w;
        assert_results_bits_eq(&run_exact(&p, &dy), &base);
    }
}

#[test]
fn dropped_slots_equal_smaller_top_k() {
    // k = 2 with every slot 1 dropped is bitwise the k = 1 problem of the slot-0 ids.
    let t = 5;
    let p2 =
        Owned::random(config(t, 16, 8, 4, 2, Some(16), Some(0.6)), 7, &(0..t).map(|tok| (tok, 1)).collect::<Vec<_>>());
    let mut p1 = p2.clone();
    p1.config.top_k = 1;
    p1.ids = p2.ids.iter().step_by(2).copied().collect();
    p1.tw = p2.tw.iter().step_by(2).copied().collect();
    let dy = Rng(107).vec(t * 16, 1.0);
    let (f2, g2) = run_exact(&p2, &dy);
    let (f1, g1) = run_exact(&p1, &dy);
    assert_bits_eq(&f2.y, &f1.y, "y");
    assert_bits_eq(&g2.dx, &g1.dx, "dx");
    assert_bits_eq(&g2.dw_gate, &g1.dw_gate, "dw_gate");
    assert_bits_eq(&g2.dw_up, &g1.dw_up, "dw_up");
    assert_bits_eq(&g2.dw_down, &g1.dw_down, "dw_down");
    let (s2, s1) = (g2.shared.unwrap(), g1.shared.unwrap());
    assert_bits_eq(&s2.dws_down, &s1.dws_down, "dws_down");
    let slot0: Vec<f64> = g2.d_topk_weights.iter().step_by(2).copied().collect();
    assert_bits_eq(&slot0, &g1.d_topk_weights, "d_topk_weights");
    assert!(g2.d_topk_weights.iter().skip(1).step_by(2).all(|&v| v.to_bits() == 0));
}

#[test]
fn expert_without_tokens_has_exactly_zero_grads() {
    let mut p = Owned::random(config(6, 16, 8, 8, 2, None, None), 8, &[]);
    // Route only to experts 0..4 (ids within a token stay distinct: 2j and 2j+1 shifted).
    for tok in 0..6 {
        p.ids[tok * 2] = (tok % 2) as i32;
        p.ids[tok * 2 + 1] = 2 + (tok % 2) as i32;
    }
    let dy = Rng(108).vec(6 * 16, 1.0);
    let (_, g) = run_exact(&p, &dy);
    let per = 8 * 16;
    for e in 0..8 {
        let blocks =
            [&g.dw_gate[e * per..(e + 1) * per], &g.dw_up[e * per..(e + 1) * per], &g.dw_down[e * per..(e + 1) * per]];
        for (name, block) in ["dw_gate", "dw_up", "dw_down"].iter().zip(blocks) {
            if e < 4 {
                assert!(block.iter().any(|&v| v != 0.0), "expert {e} {name} is all zero but has tokens");
            } else {
                assert!(block.iter().all(|&v| v.to_bits() == 0), "expert {e} {name} has no tokens but a gradient");
            }
        }
    }
}

#[test]
fn single_token_and_single_slot_match_naive() {
    for (t, k) in [(1, 1), (1, 3), (7, 1)] {
        let p = Owned::random(config(t, 16, 8, 4, k, Some(8), Some(0.5)), 9 + t as u64, &[]);
        let dy = Rng(109).vec(t * 16, 1.0);
        let (f, g) = backward_generic(&p.config, &p.view(), &dy, ReferenceOptions::MATCH_GPU).unwrap();
        assert_matches_naive(&format!("T={t} k={k}"), (&f, &g), &naive(&p, &dy, true), 1e-13);
    }
}

/// Every output and gradient of the reference (with a shared expert) within `tolerance`
/// (relative) of the naive implementation's.
fn assert_matches_naive(what: &str, (f, g): (&ReferenceForward, &ReferenceGrads), n: &Naive, tolerance: f64) {
    let check = |name: &str, got: &[f64], want: &[f64]| {
        let err = relative_error(got.iter().copied(), want);
        assert!(err < tolerance, "{what} {name}: relative error {err:e}");
    };
    check("y", &f.y, &n.y);
    check("slot_outputs", &f.slot_outputs, &n.slot_outputs);
    check("dx", &g.dx, &n.dx);
    check("d_topk_weights", &g.d_topk_weights, &n.d_topk_weights);
    check("dw_gate", &g.dw_gate, &n.dw_gate);
    check("dw_up", &g.dw_up, &n.dw_up);
    check("dw_down", &g.dw_down, &n.dw_down);
    let (sg, [nsg, nsu, nsd]) = (g.shared.as_ref().unwrap(), n.dws.as_ref().unwrap());
    check("dws_gate", &sg.dws_gate, nsg);
    check("dws_up", &sg.dws_up, nsu);
    check("dws_down", &sg.dws_down, nsd);
}

// Section: validation

fn invalid_input_tensor(err: MokError) -> (&'static str, String) {
    match err {
        MokError::InvalidInput { tensor, problem } => (tensor, problem),
        other => panic!("expected InvalidInput, got {other}"),
    }
}

fn small_bf16() -> (MoeConfig, RoutedTokens, ExpertWeights, Option<SharedExpertWeights>) {
    let p = Owned::random(config(4, 16, 8, 4, 2, Some(8), None), 10, &[]).rounded();
    let (tokens, experts, shared) = p.bf16_tensors();
    (p.config, tokens, experts, shared)
}

#[test]
fn bad_topk_ids_are_rejected() {
    let (c, tokens, experts, shared) = small_bf16();
    let dy = vec![bf16::ONE; 4 * 16];
    let cases: [(usize, i32, &str); 3] = [(3, tokens.topk_ids[2], "twice"), (5, 4, "outside"), (0, -2, "outside")];
    for (slot, id, phrase) in cases {
        let mut bad = tokens.clone();
        bad.topk_ids[slot] = id;
        let fwd_err = forward(&c, &bad, &experts, shared.as_ref(), ReferenceOptions::MATCH_GPU).unwrap_err();
        let bwd_err = backward(&c, &bad, &experts, shared.as_ref(), &dy, ReferenceOptions::MATCH_GPU).unwrap_err();
        for err in [fwd_err, bwd_err] {
            let (tensor, problem) = invalid_input_tensor(err);
            assert_eq!(tensor, "topk_ids");
            assert!(problem.contains(phrase), "{problem}");
        }
        // The generic path checks too.
        let mut p = Owned::random(c.clone(), 10, &[]);
        p.ids[slot] = if phrase == "twice" { p.ids[slot - 1] } else { id };
        let (tensor, _) = invalid_input_tensor(forward_generic(&c, &p.view(), ReferenceOptions::EXACT).unwrap_err());
        assert_eq!(tensor, "topk_ids");
    }
}

#[test]
fn wrong_lengths_are_rejected() {
    let (c, tokens, experts, shared) = small_bf16();
    let dy = [bf16::ONE; 4 * 16];
    let opts = ReferenceOptions::MATCH_GPU;
    let sh = shared.as_ref();
    let mut t = tokens.clone();
    t.x.pop();
    assert_eq!(invalid_input_tensor(forward(&c, &t, &experts, sh, opts).unwrap_err()).0, "x");
    let mut t = tokens.clone();
    t.topk_weights.push(1.0);
    assert_eq!(invalid_input_tensor(forward(&c, &t, &experts, sh, opts).unwrap_err()).0, "topk_weights");
    let mut t = tokens.clone();
    t.topk_ids.truncate(6);
    assert_eq!(invalid_input_tensor(forward(&c, &t, &experts, sh, opts).unwrap_err()).0, "topk_ids");
    let mut w = experts.clone();
    w.w_down.pop();
    assert_eq!(invalid_input_tensor(forward(&c, &tokens, &w, sh, opts).unwrap_err()).0, "w_down");
    let mut s = shared.clone().unwrap();
    s.ws_up.push(bf16::ZERO);
    assert_eq!(invalid_input_tensor(forward(&c, &tokens, &experts, Some(&s), opts).unwrap_err()).0, "ws_up");
    let (tensor, problem) = invalid_input_tensor(backward(&c, &tokens, &experts, sh, &dy[1..], opts).unwrap_err());
    assert_eq!((tensor, problem.contains("expected 64")), ("dy", true), "{problem}");
    // Shared weights must be given exactly when the config has a shared expert.
    assert_eq!(invalid_input_tensor(forward(&c, &tokens, &experts, None, opts).unwrap_err()).0, "shared expert");
    let no_shared = MoeConfig { shared_intermediate: None, ..c.clone() };
    assert_eq!(invalid_input_tensor(forward(&no_shared, &tokens, &experts, sh, opts).unwrap_err()).0, "shared expert");
    // The generic path checks lengths too.
    let p = Owned::random(c.clone(), 11, &[]);
    let mut view = p.view();
    view.w_gate = &p.wg[1..];
    assert_eq!(invalid_input_tensor(forward_generic(&c, &view, opts).unwrap_err()).0, "w_gate");
    assert_eq!(invalid_input_tensor(backward_generic(&c, &p.view(), &[0.0f64; 3], opts).unwrap_err()).0, "dy");
}

#[test]
fn bad_configs_are_rejected() {
    let (c, tokens, experts, shared) = small_bf16();
    let field = |config: &MoeConfig| match forward(config, &tokens, &experts, shared.as_ref(), ReferenceOptions::EXACT)
    {
        Err(MokError::InvalidConfig { field, rule, .. }) => (field, rule),
        other => panic!("expected InvalidConfig, got {other:?}"),
    };
    let (f, rule) = field(&MoeConfig { ep_ranks: 2, ..c.clone() });
    assert_eq!(f, "ep_ranks");
    assert!(rule.contains("one rank holding all experts"), "{rule}");
    assert_eq!(field(&MoeConfig { hidden: 12, ..c.clone() }).0, "hidden");
}

// Section: determinism and entry points

#[test]
fn results_are_bitwise_identical_across_runs_and_thread_counts() {
    let p = Owned::random(config(80, 64, 32, 8, 3, Some(32), Some(0.4)), 12, &[(3, 1), (40, 0)]);
    let dy = Rng(112).vec(80 * 64, 1.0);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| backward_generic(&p.config, &p.view(), &dy, ReferenceOptions::MATCH_GPU).unwrap())
    };
    let first = run(1);
    assert_results_bits_eq(&run(1), &first);
    assert_results_bits_eq(&run(3), &first);
    assert_results_bits_eq(&run(8), &first);
}

#[test]
fn bf16_entry_points_equal_generic_f64_path() {
    let p = Owned::random(config(24, 32, 16, 6, 2, Some(16), Some(0.5)), 13, &[(5, 1)]).rounded();
    let (tokens, experts, shared) = p.bf16_tensors();
    let dy_bf16: Vec<bf16> = Rng(113).vec(24 * 32, 1.0).into_iter().map(bf16::from_f64).collect();
    let dy_f64: Vec<f64> = dy_bf16.iter().map(|&v| f64::from(v)).collect();
    for options in [ReferenceOptions::MATCH_GPU, ReferenceOptions::EXACT] {
        let bf = backward(&p.config, &tokens, &experts, shared.as_ref(), &dy_bf16, options).unwrap();
        let generic = backward_generic(&p.config, &p.view(), &dy_f64, options).unwrap();
        assert_results_bits_eq(&bf, &generic);
        let fwd = forward(&p.config, &tokens, &experts, shared.as_ref(), options).unwrap();
        assert_eq!(fwd, generic.0);
    }
}

#[test]
fn medium_shape_matches_naive_implementation() {
    let (t, h, i, e, k, is) = (64, 256, 128, 16, 4, 128);
    let p = Owned::random(config(t, h, i, e, k, Some(is), Some(0.35)), 14, &[(0, 3), (17, 0), (63, 2)]).rounded();
    let (tokens, experts, shared) = p.bf16_tensors();
    let dy_bf16: Vec<bf16> = Rng(114).vec(t * h, 1.0).into_iter().map(bf16::from_f64).collect();
    let dy: Vec<f64> = dy_bf16.iter().map(|&v| f64::from(v)).collect();
    let (f, g) =
        backward(&p.config, &tokens, &experts, shared.as_ref(), &dy_bf16, ReferenceOptions::MATCH_GPU).unwrap();
    assert_matches_naive("medium shape", (&f, &g), &naive(&p, &dy, true), 1e-12);

    // The hidden activation is bf16-valued, and the clamp is active somewhere.
    assert!(f.hidden.iter().all(|&v| round_to_bf16(v) == v));
    let l = f64::from(p.config.swiglu_limit.unwrap());
    assert!(f.gate_pre.iter().any(|&v| v > l) && f.up_pre.iter().any(|&v| v.abs() > l));
    // Activations are O(1), so the tolerances above mean something.
    let rms = (f.y.iter().map(|v| v * v).sum::<f64>() / f.y.len() as f64).sqrt();
    assert!((0.01..10.0).contains(&rms), "rms(y) = {rms}");

    let lg = g.to_layer_grads();
    assert_eq!(lg.dx.len(), t * h);
    assert_eq!(lg.dw_down[7], g.dw_down[7] as f32);
    assert_eq!(lg.shared.as_ref().unwrap().2.len(), h * is);
}

// Section: helpers

#[test]
fn round_to_bf16_is_correctly_rounded() {
    // Against half's f32 -> bf16 conversion (round to nearest even) on random f32 bit patterns.
    let mut rng = Rng(15);
    for _ in 0..200_000 {
        let v = f32::from_bits(rng.next_u64() as u32);
        if v.is_nan() {
            continue;
        }
        let want = f64::from(bf16::from_f32(v));
        assert_eq!(round_to_bf16(f64::from(v)).to_bits(), want.to_bits(), "{v:e}");
    }
    // Ties go to even; just above a tie rounds up even when the excess is below f32 precision.
    assert_eq!(round_to_bf16(1.0 + 2f64.powi(-8)), 1.0);
    assert_eq!(round_to_bf16(1.0 + 3.0 * 2f64.powi(-8)), 1.0 + 2.0 * 2f64.powi(-7));
    assert_eq!(round_to_bf16(1.0 + 2f64.powi(-8) + 2f64.powi(-40)), 1.0 + 2f64.powi(-7));
    let max = f64::from(bf16::MAX);
    assert_eq!(round_to_bf16(max), max);
    assert_eq!(round_to_bf16(max + 2f64.powi(119)), f64::INFINITY);
    assert_eq!(round_to_bf16(-(max + 2f64.powi(118))), -max);
    assert_eq!(round_to_bf16(2f64.powi(-134)), 0.0);
    assert_eq!(round_to_bf16(2f64.powi(-134) * 1.5), 2f64.powi(-133));
    assert!(round_to_bf16(f64::NAN).is_nan());
}

#[test]
fn relative_error_semantics() {
    assert_eq!(relative_error([0.0, 0.0], &[0.0, 0.0]), 0.0);
    assert_eq!(relative_error([1.0, 0.0], &[0.0, 0.0]), f64::INFINITY);
    assert!((relative_error([3.0, 4.0 + 0.5], &[3.0, 4.0]) - 0.1).abs() < 1e-15);
    let nan = relative_error([f64::NAN, 0.0], &[1.0, 0.0]);
    let passes_tolerance = nan < 1.0;
    assert!(nan.is_nan() && !passes_tolerance);
    assert!(relative_error([f64::NAN], &[0.0]).is_nan());
    assert!(relative_error([1.0], &[f64::NAN]).is_nan());
    assert_eq!(relative_error([2.0f32].map(f64::from), &[2.0]), 0.0);
}

#[test]
#[should_panic(expected = "relative_error")]
fn relative_error_rejects_length_mismatch() {
    relative_error([1.0], &[1.0, 2.0]);
}
