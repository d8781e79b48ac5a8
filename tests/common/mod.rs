//! Test support shared by the GPU test binaries: random problems and comparisons.
#![allow(dead_code)]

use half::bf16;
use mok::MoeConfig;
use mok::driver::Gpu;
use mok::driver::{DeviceBuffer, DeviceSliceMut};
use mok::ep::EpLayer;
use mok::kernels::num::random_uniform;
use mok::problem::{ExpertWeights, RoutedTokens, SharedExpertWeights};
use mok::unfused::WeightGradViews;

/// Whether the tests run under compute-sanitizer (`run.sh --sanitize` sets `MOK_SANITIZE=1`).
/// Instrumented kernels run 10-100× slower, so tests with frontier-sized data use their reduced
/// variant then (fewer experts, the same widths) and say so; every test still runs.
pub fn sanitizing() -> bool {
    std::env::var_os("MOK_SANITIZE").is_some_and(|v| v == "1")
}

/// `full` normally, `reduced` under compute-sanitizer (printed, so a log shows which ran).
pub fn sized<T: std::fmt::Debug>(what: &str, full: T, reduced: T) -> T {
    if sanitizing() {
        println!("  {what}: reduced size for compute-sanitizer: {reduced:?} (normally {full:?})");
        reduced
    } else {
        full
    }
}

/// One random problem: inputs, weights and an output gradient.
pub struct Case {
    pub config: MoeConfig,
    pub tokens: RoutedTokens,
    pub experts: ExpertWeights,
    pub shared: Option<SharedExpertWeights>,
    pub dy: Vec<bf16>,
}

/// How slots are routed in a random case.
#[derive(Clone, Copy)]
pub struct Routing<'a> {
    /// Probability that a slot is dropped (id -1).
    pub drop_probability: f32,
    /// Experts that never receive a token.
    pub empty_experts: &'a [usize],
}

pub const PLAIN_ROUTING: Routing<'static> = Routing { drop_probability: 0.0, empty_experts: &[] };

/// `count` bf16 uniform in ±`scale` from `seed` (the same values `mok_fill_random_bf16` makes).
pub fn random_bf16(count: usize, seed: u64, scale: f32) -> Vec<bf16> {
    mok::random::bf16_values(count, seed, scale)
}

/// Weight scale that keeps a dot product of `fan_in` U(-1,1)-sized terms at about unit size.
pub fn weight_scale(fan_in: usize) -> f32 {
    3.0 / (fan_in as f32).sqrt()
}

/// Random top-k ids (distinct per token, never an empty expert), weights in (0, 1).
pub fn random_routing(config: &MoeConfig, seed: u64, routing: Routing<'_>) -> (Vec<i32>, Vec<f32>) {
    let (t, k, e) = (config.tokens_per_rank, config.top_k, config.num_experts);
    let allowed: Vec<i32> = (0..e).filter(|x| !routing.empty_experts.contains(x)).map(|x| x as i32).collect();
    assert!(allowed.len() >= k, "not enough non-empty experts for top-k");
    let mut draw = 0u64;
    let mut next = || {
        draw += 1;
        (random_uniform(seed ^ 0x5eed, draw) + 1.0) / 2.0
    };
    let mut ids = Vec::with_capacity(t * k);
    let mut weights = Vec::with_capacity(t * k);
    for _ in 0..t {
        let mut row: Vec<i32> = Vec::with_capacity(k);
        while row.len() < k {
            let pick = allowed[((next() * allowed.len() as f32) as usize).min(allowed.len() - 1)];
            if !row.contains(&pick) {
                row.push(pick);
            }
        }
        for id in row {
            ids.push(if next() < routing.drop_probability { -1 } else { id });
            weights.push(0.05 + 0.9 * next());
        }
    }
    (ids, weights)
}

/// A whole random case generated on the host.
pub fn random_case(config: &MoeConfig, seed: u64, routing: Routing<'_>) -> Case {
    let (h, i, e) = (config.hidden, config.intermediate, config.local_experts());
    let experts = ExpertWeights {
        w_gate: random_bf16(e * i * h, seed ^ 12, weight_scale(h)),
        w_up: random_bf16(e * i * h, seed ^ 13, weight_scale(h)),
        w_down: random_bf16(e * h * i, seed ^ 14, weight_scale(i)),
    };
    random_case_with_experts(config, seed, routing, experts)
}

/// A random case around given routed-expert weights.
pub fn random_case_with_experts(config: &MoeConfig, seed: u64, routing: Routing<'_>, experts: ExpertWeights) -> Case {
    let (t, h) = (config.tokens_per_rank, config.hidden);
    let (topk_ids, topk_weights) = random_routing(config, seed, routing);
    let tokens = RoutedTokens { x: random_bf16(t * h, seed ^ 11, 1.0), topk_ids, topk_weights };
    let shared = config.shared_intermediate.map(|is| SharedExpertWeights {
        ws_gate: random_bf16(is * h, seed ^ 15, weight_scale(h)),
        ws_up: random_bf16(is * h, seed ^ 16, weight_scale(h)),
        ws_down: random_bf16(h * is, seed ^ 17, weight_scale(is)),
    });
    let dy = random_bf16(t * h, seed ^ 18, 1.0);
    Case { config: config.clone(), tokens, experts, shared, dy }
}

/// `‖actual − expected‖ / ‖expected‖`, NaN if anything is NaN (never passes a `<` check).
pub fn rel_err<T: Copy + Into<f64>>(actual: &[T], expected: &[f64]) -> f64 {
    mok::reference::relative_error(actual.iter().map(|&v| v.into()), expected)
}

/// bf16 slice as f64.
pub fn bf16_f64(values: &[bf16]) -> Vec<f64> {
    values.iter().map(|v| v.to_f64()).collect()
}

/// A cheap bitwise fingerprint for determinism checks: FNV-1a steps over the slice's bytes taken
/// 8 at a time, per 1 MiB chunk in parallel, the chunk values combined in order (frontier weight
/// gradients are tens of GB; the value does not depend on the thread count).
pub fn fingerprint<T: bytemuck::Pod>(values: &[T]) -> u64 {
    use rayon::prelude::*;
    const BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    let fnv = |h: u64, word: u64| (h ^ word).wrapping_mul(0x0100_0000_01b3);
    let chunk_value = |chunk: &[u8]| {
        let words = chunk.chunks_exact(8);
        let tail = words.remainder().iter().fold(BASIS, |h, &b| fnv(h, b as u64));
        words.fold(tail, |h, w| fnv(h, u64::from_le_bytes(w.try_into().expect("8 bytes"))))
    };
    let bytes = bytemuck::cast_slice::<T, u8>(values);
    let chunks: Vec<u64> = bytes.par_chunks(1 << 20).map(chunk_value).collect();
    chunks.into_iter().fold(fnv(BASIS, bytes.len() as u64), fnv)
}

/// Asserts `error < tolerance` and prints the measurement (the docs quote these lines).
pub fn check(what: &str, error: f64, tolerance: f64) {
    println!("  {what:<34} rel err {error:.3e}  (tolerance {tolerance:.0e})");
    assert!(error < tolerance, "{what}: relative error {error:e} is not below {tolerance:e}");
}

/// The per-rank config of a global problem split over `p` virtual ranks (T / p tokens each).
pub fn rank_config(global: &MoeConfig, p: usize) -> MoeConfig {
    MoeConfig { tokens_per_rank: global.tokens_per_rank / p, ep_ranks: p, ..global.clone() }
}

/// Rank `rank`'s share of global per-token data of `width` elements per token.
pub fn share<T: Copy>(data: &[T], p: usize, rank: usize, width: usize) -> Vec<T> {
    let per = data.len() / p;
    assert_eq!(per % width, 0);
    data[rank * per..(rank + 1) * per].to_vec()
}

/// Each rank's local experts of the global `weights` (rank r holds experts r·E/P ..).
pub fn split_weights(weights: &ExpertWeights, p: usize) -> Vec<ExpertWeights> {
    (0..p)
        .map(|r| ExpertWeights {
            w_gate: share(&weights.w_gate, p, r, 1),
            w_up: share(&weights.w_up, p, r, 1),
            w_down: share(&weights.w_down, p, r, 1),
        })
        .collect()
}

/// Uploads each rank's share of `case`'s tokens and output gradient into `layer`.
pub fn upload_rank_inputs(gpu: &Gpu, layer: &EpLayer, case: &Case) {
    let config = layer.config();
    let (p, h, k) = (config.ep_ranks, config.hidden, config.top_k);
    for rank in 0..p {
        let tokens = RoutedTokens {
            x: share(&case.tokens.x, p, rank, h),
            topk_ids: share(&case.tokens.topk_ids, p, rank, k),
            topk_weights: share(&case.tokens.topk_weights, p, rank, k),
        };
        layer.upload_tokens(gpu, rank, &tokens).unwrap();
        layer.upload_dy(gpu, rank, &share(&case.dy, p, rank, h)).unwrap();
    }
}

/// Views of `buffers` as weight-gradient targets (routed three, then the shared three if any).
pub fn grad_views<T: bytemuck::Pod>(buffers: &mut [DeviceBuffer<T>]) -> WeightGradViews<'_, T> {
    let mut views: Vec<DeviceSliceMut<'_, T>> = buffers.iter_mut().map(Into::into).collect();
    let shared = (views.len() == 6).then(|| {
        let s: Vec<_> = views.drain(3..).collect();
        let [a, b, c]: [DeviceSliceMut<'_, T>; 3] = s.try_into().ok().unwrap();
        [a, b, c]
    });
    let mut routed = views.into_iter();
    WeightGradViews {
        dw_gate: routed.next().unwrap(),
        dw_up: routed.next().unwrap(),
        dw_down: routed.next().unwrap(),
        shared,
    }
}
