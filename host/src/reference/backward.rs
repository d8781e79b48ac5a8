//! Backward pass, in three parallel phases whose outputs never overlap:
//! 1. per block of a group's rows: `d_hidden`, the SwiGLU backward, and each row's `dx`
//!    contribution;
//! 2. per block of weight-gradient rows: the sum over the group's rows in token order (no
//!    split-K, so each element has one fixed summation order);
//! 3. per token: `dx` (shared contribution first, then slots in order) and `d_topk_weights`.

use rayon::prelude::*;

use super::forward::{self, ForwardState, Kind, Row, Task};
use super::math::{axpy, dot, load_row, swiglu_grad};
use super::{Element, Problem, ReferenceGrads, ReferenceSharedGrads};
use crate::config::MoeConfig;

/// Weight-gradient rows per parallel task in phase 2. The row counts (I, H, Is) are multiples of
/// 8 (`ROW_ALIGN_ELEMS`), so a task never straddles two experts.
const GRAD_ROWS: usize = 8;

/// Per-row gradients of one group kind (or one block): the pre-activations' gradients
/// `[rows, inter]` and the row's `dx` contribution `[rows, H]`.
struct RowGrads {
    d_gate: Vec<f64>,
    d_up: Vec<f64>,
    dx: Vec<f64>,
    inter: usize,
    hidden_width: usize,
}

impl RowGrads {
    fn zeros(rows: usize, inter: usize, h: usize) -> Self {
        Self {
            d_gate: vec![0.0; rows * inter],
            d_up: vec![0.0; rows * inter],
            dx: vec![0.0; rows * h],
            inter,
            hidden_width: h,
        }
    }

    /// Copies block row `r` to row `rows[r].slot`.
    fn scatter(&mut self, rows: &[Row], block: &RowGrads) {
        let (n, h) = (self.inter, self.hidden_width);
        for (r, row) in rows.iter().enumerate() {
            let (dst, src) = (row.slot * n..(row.slot + 1) * n, r * n..(r + 1) * n);
            self.d_gate[dst.clone()].copy_from_slice(&block.d_gate[src.clone()]);
            self.d_up[dst].copy_from_slice(&block.d_up[src]);
            self.dx[row.slot * h..(row.slot + 1) * h].copy_from_slice(&block.dx[r * h..(r + 1) * h]);
        }
    }
}

/// Phase 1 for one block: `dF = scale * dy[t]`, `d_hidden = W_down^T dF`, SwiGLU backward
/// (straight-through over the bf16 rounding), `dx_row = W_gate^T d_gate + W_up^T d_up`.
fn backward_block<E: Element>(
    task: &Task<'_, E>,
    state: &ForwardState,
    dy64: &[f64],
    h: usize,
    limit: Option<f64>,
) -> RowGrads {
    let (rows, w, n) = (task.rows, task.weights, task.weights.inter);
    let (gate_pre, up_pre, _) = state.activations(task.kind);
    let mut g = RowGrads::zeros(rows.len(), n, h);

    let mut d_hidden = vec![0.0; rows.len() * n];
    let mut down_row = vec![0.0; n];
    for c in 0..h {
        load_row(&w.down[c * n..(c + 1) * n], &mut down_row);
        for (r, row) in rows.iter().enumerate() {
            let d_out = row.scale * dy64[row.token * h + c];
            axpy(&mut d_hidden[r * n..(r + 1) * n], d_out, &down_row);
        }
    }
    for (r, row) in rows.iter().enumerate() {
        for i in 0..n {
            let (pre, local) = (row.slot * n + i, r * n + i);
            let (dg, du) = swiglu_grad(gate_pre[pre], up_pre[pre], d_hidden[local], limit);
            g.d_gate[local] = dg;
            g.d_up[local] = du;
        }
    }
    let (mut gate_row, mut up_row) = (vec![0.0; h], vec![0.0; h]);
    for i in 0..n {
        load_row(&w.gate[i * h..(i + 1) * h], &mut gate_row);
        load_row(&w.up[i * h..(i + 1) * h], &mut up_row);
        for r in 0..rows.len() {
            let dx = &mut g.dx[r * h..(r + 1) * h];
            axpy(dx, g.d_gate[r * n + i], &gate_row);
            axpy(dx, g.d_up[r * n + i], &up_row);
        }
    }
    g
}

/// Phase 2: `out[g, o, :] = sum over rows of group g (token order) coef(row, o) * vector(row)`,
/// for `out` laid out `[groups, rows_per_group, width]`. A group without rows stays exactly 0.
fn weight_grad<'v>(
    out: &mut [f64],
    rows_per_group: usize,
    width: usize,
    groups: &[&[Row]],
    coef: impl Fn(&Row, usize) -> f64 + Sync,
    vector: impl Fn(&Row) -> &'v [f64] + Sync,
) {
    let chunk_rows = if rows_per_group.is_multiple_of(GRAD_ROWS) { GRAD_ROWS } else { 1 };
    out.par_chunks_mut(chunk_rows * width).enumerate().for_each(|(c, chunk)| {
        let first = c * chunk_rows;
        let (group, o0) = (first / rows_per_group, first % rows_per_group);
        for row in groups[group] {
            let v = vector(row);
            for (oo, dst) in chunk.chunks_exact_mut(width).enumerate() {
                axpy(dst, coef(row, o0 + oo), v);
            }
        }
    });
}

/// The three weight gradients of one group kind: `(d_gate, d_up, d_down)`.
fn group_weight_grads(
    groups: &[&[Row]],
    grads: &RowGrads,
    hidden: &[f64],
    x64: &[f64],
    dy64: &[f64],
    inter: usize,
    h: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let size = groups.len() * inter * h;
    let x_row = |row: &Row| &x64[row.token * h..(row.token + 1) * h];
    let mut d_gate = vec![0.0; size];
    weight_grad(&mut d_gate, inter, h, groups, |row, i| grads.d_gate[row.slot * inter + i], x_row);
    let mut d_up = vec![0.0; size];
    weight_grad(&mut d_up, inter, h, groups, |row, i| grads.d_up[row.slot * inter + i], x_row);
    // The same `scale * dy` product as phase 1, so dF is bit-identical in both places.
    let mut d_down = vec![0.0; size];
    weight_grad(
        &mut d_down,
        h,
        inter,
        groups,
        |row, c| row.scale * dy64[row.token * h + c],
        |row| &hidden[row.slot * inter..(row.slot + 1) * inter],
    );
    (d_gate, d_up, d_down)
}

/// The full backward pass on a validated problem, given its forward state.
pub(super) fn run<E: Element, D: Element>(
    config: &MoeConfig,
    p: &Problem<'_, E>,
    state: &ForwardState,
    dy: &[D],
) -> ReferenceGrads {
    let (t, h, k, i) = (config.tokens_per_rank, config.hidden, config.top_k, config.intermediate);
    let limit = config.swiglu_limit.map(f64::from);
    let dy64: Vec<f64> = dy.iter().map(|v| v.to_f64()).collect();

    // Phase 1.
    let tasks = forward::tasks(config, p, &state.routing);
    let blocks: Vec<RowGrads> = tasks.par_iter().map(|task| backward_block(task, state, &dy64, h, limit)).collect();
    let mut routed = RowGrads::zeros(t * k, i, h);
    let mut shared = config.shared_intermediate.map(|is| RowGrads::zeros(t, is, h));
    for (task, block) in tasks.iter().zip(&blocks) {
        let dest = match task.kind {
            Kind::Routed => &mut routed,
            Kind::Shared => shared.as_mut().expect("shared tasks exist only with a shared expert"),
        };
        dest.scatter(task.rows, block);
    }
    drop(blocks);

    // Phase 2.
    let experts: Vec<&[Row]> = state.routing.per_expert.iter().map(Vec::as_slice).collect();
    let (dw_gate, dw_up, dw_down) =
        group_weight_grads(&experts, &routed, &state.public.hidden, &state.x64, &dy64, i, h);
    let shared_weight_grads = match (&shared, config.shared_intermediate) {
        (Some(sg), Some(is)) => {
            let (_, _, hidden) = state.activations(Kind::Shared);
            let (dws_gate, dws_up, dws_down) =
                group_weight_grads(&[&state.routing.shared], sg, hidden, &state.x64, &dy64, is, h);
            Some(ReferenceSharedGrads { dws_gate, dws_up, dws_down })
        }
        _ => None,
    };

    // Phase 3.
    let mut dx = vec![0.0; t * h];
    let mut d_topk_weights = vec![0.0; t * k];
    dx.par_chunks_mut(h).zip(d_topk_weights.par_chunks_mut(k)).enumerate().for_each(|(token, (dx_t, dtw_t))| {
        if let Some(sg) = &shared {
            dx_t.copy_from_slice(&sg.dx[token * h..(token + 1) * h]);
        }
        let dy_t = &dy64[token * h..(token + 1) * h];
        for (j, dtw) in dtw_t.iter_mut().enumerate() {
            let slot = token * k + j;
            if p.topk_ids[slot] < 0 {
                // Dropped: no gradient anywhere, exactly.
                *dtw = 0.0;
                continue;
            }
            *dtw = dot(dy_t, &state.public.slot_outputs[slot * h..(slot + 1) * h]);
            for (acc, &d) in dx_t.iter_mut().zip(&routed.dx[slot * h..(slot + 1) * h]) {
                *acc += d;
            }
        }
    });

    ReferenceGrads { dx, d_topk_weights, dw_gate, dw_up, dw_down, shared: shared_weight_grads }
}
