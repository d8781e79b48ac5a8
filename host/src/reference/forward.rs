//! Forward pass: routing rows grouped by expert, per-block expert MLPs in parallel, then the
//! per-token combine in fixed order.

use rayon::prelude::*;

use super::math::{dot, load_row, round_to_bf16, swiglu};
use super::{Element, Problem, ReferenceForward, ReferenceOptions};
use crate::config::MoeConfig;

/// Token rows per parallel task. Each weight row is converted to f64 once per block, so larger
/// blocks convert less; smaller ones balance better. 32 keeps conversion at ~3% of the work.
const BLOCK_ROWS: usize = 32;

/// One (token, slot) pair routed to a group (a local expert or the shared expert).
#[derive(Clone, Copy, Debug)]
pub(super) struct Row {
    /// Token index t.
    pub token: usize,
    /// Index into the group's per-row buffers: `t * k + j` for routed experts, `t` for the
    /// shared expert.
    pub slot: usize,
    /// Combine weight: `topk_weights[t, j]` for routed experts, 1 for the shared expert.
    pub scale: f64,
}

/// Which rows each group processes, each list in increasing token order (the spec's row order).
pub(super) struct Routing {
    /// Rows of each local expert; empty for experts without tokens.
    pub per_expert: Vec<Vec<Row>>,
    /// One row per token if the layer has a shared expert, else empty.
    pub shared: Vec<Row>,
}

impl Routing {
    fn new<E: Element>(config: &MoeConfig, p: &Problem<'_, E>) -> Self {
        let (t, k) = (config.tokens_per_rank, config.top_k);
        let mut per_expert = vec![Vec::new(); config.local_experts()];
        // Token-major scan, so each expert's list comes out sorted by token.
        for (slot, (&id, &w)) in p.topk_ids.iter().zip(p.topk_weights).enumerate() {
            if id >= 0 {
                per_expert[id as usize].push(Row { token: slot / k, slot, scale: w });
            }
        }
        let shared = if p.shared.is_some() {
            (0..t).map(|token| Row { token, slot: token, scale: 1.0 }).collect()
        } else {
            Vec::new()
        };
        Self { per_expert, shared }
    }
}

/// Whether a group's per-row results belong to the routed `[T, k, ·]` buffers or the shared
/// `[T, ·]` ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Routed,
    Shared,
}

/// One group's weights, `nn.Linear` layout: gate and up `[inter, H]`, down `[H, inter]`.
#[derive(Clone, Copy)]
pub(super) struct GroupWeights<'a, E: Element> {
    pub gate: &'a [E],
    pub up: &'a [E],
    pub down: &'a [E],
    pub inter: usize,
}

/// A unit of parallel work: one block of one group's rows.
pub(super) struct Task<'a, E: Element> {
    pub kind: Kind,
    pub weights: GroupWeights<'a, E>,
    pub rows: &'a [Row],
}

/// Every group's rows cut into blocks of [`BLOCK_ROWS`]; experts in order, then the shared one.
/// Experts without rows produce no task.
pub(super) fn tasks<'a, E: Element>(config: &MoeConfig, p: &Problem<'a, E>, routing: &'a Routing) -> Vec<Task<'a, E>> {
    let (h, i) = (config.hidden, config.intermediate);
    let mut tasks = Vec::new();
    for (e, rows) in routing.per_expert.iter().enumerate() {
        let weights = GroupWeights {
            gate: &p.w_gate[e * i * h..(e + 1) * i * h],
            up: &p.w_up[e * i * h..(e + 1) * i * h],
            down: &p.w_down[e * h * i..(e + 1) * h * i],
            inter: i,
        };
        tasks.extend(rows.chunks(BLOCK_ROWS).map(|rows| Task { kind: Kind::Routed, weights, rows }));
    }
    if let (Some(s), Some(is)) = (&p.shared, config.shared_intermediate) {
        let weights = GroupWeights { gate: s.ws_gate, up: s.ws_up, down: s.ws_down, inter: is };
        tasks.extend(routing.shared.chunks(BLOCK_ROWS).map(|rows| Task { kind: Kind::Shared, weights, rows }));
    }
    tasks
}

/// Per-row forward values of one group kind (or one block): `[rows, inter]` and `[rows, H]`.
pub(super) struct Activations {
    pub gate_pre: Vec<f64>,
    pub up_pre: Vec<f64>,
    pub hidden: Vec<f64>,
    pub out: Vec<f64>,
    pub inter: usize,
    pub hidden_width: usize,
}

impl Activations {
    fn zeros(rows: usize, inter: usize, h: usize) -> Self {
        Self {
            gate_pre: vec![0.0; rows * inter],
            up_pre: vec![0.0; rows * inter],
            hidden: vec![0.0; rows * inter],
            out: vec![0.0; rows * h],
            inter,
            hidden_width: h,
        }
    }

    /// Copies block row `r` to row `rows[r].slot`.
    fn scatter(&mut self, rows: &[Row], block: &Activations) {
        let (n, h) = (self.inter, self.hidden_width);
        for (r, row) in rows.iter().enumerate() {
            let (dst, src) = (row.slot * n..(row.slot + 1) * n, r * n..(r + 1) * n);
            self.gate_pre[dst.clone()].copy_from_slice(&block.gate_pre[src.clone()]);
            self.up_pre[dst.clone()].copy_from_slice(&block.up_pre[src.clone()]);
            self.hidden[dst].copy_from_slice(&block.hidden[src]);
            self.out[row.slot * h..(row.slot + 1) * h].copy_from_slice(&block.out[r * h..(r + 1) * h]);
        }
    }
}

/// Everything backward needs from forward.
pub(super) struct ForwardState {
    pub public: ReferenceForward,
    pub routing: Routing,
    /// `x` widened to f64, `[T, H]` (activations only; weights stay in their own type).
    pub x64: Vec<f64>,
    /// The shared expert's `gate_pre`, `up_pre`, `hidden` `[T, Is]` (its `out` is moved into
    /// `public.shared_out`, leaving an empty vector here).
    pub shared: Option<Activations>,
}

impl ForwardState {
    /// `(gate_pre, up_pre, hidden)` of a group kind, indexed by `Row::slot`.
    pub fn activations(&self, kind: Kind) -> (&[f64], &[f64], &[f64]) {
        match kind {
            Kind::Routed => (&self.public.gate_pre, &self.public.up_pre, &self.public.hidden),
            Kind::Shared => {
                let s = self.shared.as_ref().expect("shared rows exist only with a shared expert");
                (&s.gate_pre, &s.up_pre, &s.hidden)
            }
        }
    }
}

/// One block of a group's MLP: pre-activations, SwiGLU (clamped, optionally rounded) and the down
/// projection, for each row of the block.
fn forward_block<E: Element>(
    task: &Task<'_, E>,
    x64: &[f64],
    h: usize,
    limit: Option<f64>,
    round: bool,
) -> Activations {
    let (rows, w, n) = (task.rows, task.weights, task.weights.inter);
    let mut a = Activations::zeros(rows.len(), n, h);
    let (mut gate_row, mut up_row) = (vec![0.0; h], vec![0.0; h]);
    for i in 0..n {
        load_row(&w.gate[i * h..(i + 1) * h], &mut gate_row);
        load_row(&w.up[i * h..(i + 1) * h], &mut up_row);
        for (r, row) in rows.iter().enumerate() {
            let x = &x64[row.token * h..(row.token + 1) * h];
            a.gate_pre[r * n + i] = dot(&gate_row, x);
            a.up_pre[r * n + i] = dot(&up_row, x);
        }
    }
    for ((hid, &g), &u) in a.hidden.iter_mut().zip(&a.gate_pre).zip(&a.up_pre) {
        let v = swiglu(g, u, limit);
        *hid = if round { round_to_bf16(v) } else { v };
    }
    let mut down_row = vec![0.0; n];
    for c in 0..h {
        load_row(&w.down[c * n..(c + 1) * n], &mut down_row);
        for r in 0..rows.len() {
            a.out[r * h + c] = dot(&down_row, &a.hidden[r * n..(r + 1) * n]);
        }
    }
    a
}

/// The full forward pass on a validated problem.
pub(super) fn run<E: Element>(config: &MoeConfig, p: &Problem<'_, E>, options: ReferenceOptions) -> ForwardState {
    let (t, h, k) = (config.tokens_per_rank, config.hidden, config.top_k);
    let limit = config.swiglu_limit.map(f64::from);
    let x64: Vec<f64> = p.x.iter().map(|v| v.to_f64()).collect();
    let routing = Routing::new(config, p);

    let tasks = tasks(config, p, &routing);
    let blocks: Vec<Activations> =
        tasks.par_iter().map(|task| forward_block(task, &x64, h, limit, options.round_hidden_to_bf16)).collect();
    let mut routed = Activations::zeros(t * k, config.intermediate, h);
    let mut shared = config.shared_intermediate.map(|is| Activations::zeros(t, is, h));
    for (task, block) in tasks.iter().zip(&blocks) {
        let dest = match task.kind {
            Kind::Routed => &mut routed,
            Kind::Shared => shared.as_mut().expect("shared tasks exist only with a shared expert"),
        };
        dest.scatter(task.rows, block);
    }
    drop(blocks);
    drop(tasks);

    // Combine: each token's row is one task; shared term first, then slots in order, dropped
    // slots skipped (they contribute exactly nothing, whatever their weight).
    let mut y = vec![0.0; t * h];
    y.par_chunks_mut(h).enumerate().for_each(|(token, y_t)| {
        if let Some(s) = &shared {
            y_t.copy_from_slice(&s.out[token * h..(token + 1) * h]);
        }
        for j in 0..k {
            let slot = token * k + j;
            if p.topk_ids[slot] < 0 {
                continue;
            }
            let w = p.topk_weights[slot];
            for (acc, &f) in y_t.iter_mut().zip(&routed.out[slot * h..(slot + 1) * h]) {
                *acc += w * f;
            }
        }
    });

    let shared_out = shared.as_mut().map(|s| std::mem::take(&mut s.out));
    ForwardState {
        public: ReferenceForward {
            y,
            slot_outputs: routed.out,
            gate_pre: routed.gate_pre,
            up_pre: routed.up_pre,
            hidden: routed.hidden,
            shared_out,
        },
        routing,
        x64,
        shared,
    }
}
