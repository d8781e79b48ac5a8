//! The token owner's side of a push (device only): wait until every expert owner's rows of a
//! token tile have landed ([`wait_arrivals`]), then sum each token's slots in fixed order
//! ([`sum_slots`]). The two are separate so the sum can use the whole GPU: one thread per
//! (token tile, owner) waits, every thread of a wide grid sums.
//!
//! `out[t] = bf16(base[t] + Σ_j w[t,j] · slots[t·k + j])` in f32: the base (the shared expert's
//! output, or its dx contribution) first, then slots j = 0..k in order, dropped slots skipped,
//! one rounding — the same operations in the same order as the single-rank combine
//! (`mok_combine_slots`), on the same f32 rows, so the bits do not depend on how many ranks the
//! rows came from.

use super::error;
use super::schedule::{arrivals_reached, chunk_rows_for_rank};
use super::wait::wait_until;
use super::{Pass, RankView};
use crate::layout::{NO_ROW, ROUTE_CHUNK_TOKENS};
use crate::ptx::convert::f32x2_to_bf16x2;
use crate::ptx::memory::ld_global_v4;

/// Slots whose rows one thread loads together in [`sum_slots`].
const SUM_BATCH: usize = 8;

/// One thread: waits (bounded) until expert owner `owner` has pushed every row of token tile
/// `chunk` for `pass`, then advances this rank's baseline for that counter by the rows consumed.
/// Returns `false` after recording a timeout (naming the owner, the tile, the rows expected and
/// the rows that arrived) or when the rank's record already holds an error.
///
/// Exactly one thread handles each (tile, owner) per pass: the baseline is read, waited against
/// and advanced by it alone.
///
/// # Safety
/// `view` describes a laid-out heap whose routing layout is current; `chunk < chunks`,
/// `owner < world`.
pub unsafe fn wait_arrivals(view: &RankView, pass: Pass, epoch: u32, chunk: u32, owner: u32) -> bool {
    let p = view.params;
    let r = &p.regions;
    // SAFETY: this rank's record.
    if unsafe { error::has_error(view.error()) } {
        return false;
    }
    let k = p.top_k as usize;
    let first_token = chunk * ROUTE_CHUNK_TOKENS;
    let tile_tokens = (p.tokens - first_token).min(ROUTE_CHUNK_TOKENS) as usize;
    // SAFETY: the tile's ids lie inside this rank's T·k ids.
    let ids = unsafe {
        core::slice::from_raw_parts(view.local::<i32>(r.topk_ids).add(first_token as usize * k), tile_tokens * k)
    };
    let (arrived_region, seen_region, waited_for) = match pass {
        Pass::Forward => (r.combine_arrived, r.combine_seen, error::WAIT_COMBINE_ROWS),
        Pass::Backward => (r.dx_arrived, r.dx_seen, error::WAIT_DX_ROWS),
    };
    let expected = chunk_rows_for_rank(ids, k, p.num_experts, p.local_experts, owner);
    let index = (chunk * p.world + owner) as usize;
    let (arrived, seen): (*const u32, *mut u32) = (view.local(arrived_region), view.local(seen_region));
    // SAFETY: index < chunks·P; only this thread touches this baseline during the pass.
    unsafe {
        let baseline = *seen.add(index);
        let waited = wait_until(arrived.add(index), view.sys(), p.timeout_ns, view.error(), |v| {
            arrivals_reached(v, baseline, expected)
        });
        match waited {
            Ok(_) => {
                *seen.add(index) = baseline.wrapping_add(expected);
                true
            }
            Err(value) => {
                view.record_timeout(waited_for, owner, chunk, expected, value.wrapping_sub(baseline), epoch);
                false
            }
        }
    }
}

/// Grid-stride over this rank's `T · H/4` output quads from `first` by `stride` (token-major):
/// `out = bf16(base + Σ_j w_j · slot_j)`, f32, base first, slots in order, dropped slots
/// skipped; forward weights from `topk_weights`, backward weight 1. `base` is `[T][H]` f32 or
/// null. The caller has made every summed tile's rows visible ([`wait_arrivals`] in an earlier
/// launch, or a tile's waits then a barrier in a persistent kernel).
///
/// # Safety
/// `view` describes a laid-out heap; `out` holds `[T][H]` bf16.
pub unsafe fn sum_slots(view: &RankView, pass: Pass, base: *const f32, out: *mut u16, first: usize, stride: usize) {
    let p = view.params;
    let r = &p.regions;
    // SAFETY: this rank's record.
    if unsafe { error::has_error(view.error()) } {
        return;
    }
    let (k, h) = (p.top_k as usize, p.hidden as usize);
    let slot_rows: *const f32 = view.local(match pass {
        Pass::Forward => r.combine_slots,
        Pass::Backward => r.dx_slots,
    });
    let weights: *const f32 = match pass {
        Pass::Forward => view.local(r.topk_weights),
        Pass::Backward => core::ptr::null(),
    };
    let slot_row: *const u32 = view.local(r.slot_row);
    let quads_per_row = h / 4;
    let mut q = first;
    while q < p.tokens as usize * quads_per_row {
        let token = q / quads_per_row;
        let column = q % quads_per_row * 4;
        let (mut a0, mut a1, mut a2, mut a3) = (0.0f32, 0.0f32, 0.0f32, 0.0f32);
        if !base.is_null() {
            // SAFETY: token < T, column + 4 ≤ H.
            let v = unsafe { ld_global_v4(base.add(token * h + column) as *const u32) };
            (a0, a1, a2, a3) = (f32::from_bits(v[0]), f32::from_bits(v[1]), f32::from_bits(v[2]), f32::from_bits(v[3]));
        }
        // Slots in batches: a batch's loads are all issued before its sums, so they are in
        // flight together; the sums then run in slot order, as the single-rank combine's do.
        let mut first_slot = 0;
        while first_slot < k {
            let mut rows = [[0u32; 4]; SUM_BATCH];
            let mut weight = [0.0f32; SUM_BATCH];
            let mut present = [false; SUM_BATCH];
            for b in 0..SUM_BATCH {
                let slot = token * k + first_slot + b;
                // SAFETY: slot < T·k when first_slot + b < k.
                if first_slot + b < k && unsafe { *slot_row.add(slot) } != NO_ROW {
                    present[b] = true;
                    // SAFETY: as above; the slot's row landed (caller contract).
                    unsafe {
                        weight[b] = if weights.is_null() { 1.0 } else { *weights.add(slot) };
                        rows[b] = ld_global_v4(slot_rows.add(slot * h + column) as *const u32);
                    }
                }
            }
            for b in 0..SUM_BATCH {
                if present[b] {
                    let (w, v) = (weight[b], rows[b]);
                    a0 += w * f32::from_bits(v[0]);
                    a1 += w * f32::from_bits(v[1]);
                    a2 += w * f32::from_bits(v[2]);
                    a3 += w * f32::from_bits(v[3]);
                }
            }
            first_slot += SUM_BATCH;
        }
        // SAFETY: token < T, column + 4 ≤ H; 8-byte aligned.
        unsafe {
            let at = out.add(token * h + column) as *mut u32;
            *at = f32x2_to_bf16x2(a0, a1);
            *at.add(1) = f32x2_to_bf16x2(a2, a3);
        }
        q += stride;
    }
}
