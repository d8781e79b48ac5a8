//! The exchange's error record: what a kernel writes instead of trapping when a wait runs out
//! of time or the ring is too small, and the host decodes into an error after the pass.
//!
//! Each rank has one record of [`super::params::ERROR_WORDS`] u32 in its own slice of the heap.
//! The first problem wins (a compare-and-swap on word 0); later kernels of the rank read word 0
//! and skip their work, so one lost peer costs one timeout per pass, not one per wait.

/// Word 0: what happened ([`ERROR_NONE`], [`ERROR_TIMEOUT`], [`ERROR_CAPACITY`]).
pub const WORD_CODE: usize = 0;
/// Word 1: what was waited for ([`WAIT_PEER_PUBLISHED`], ...); 0 for a capacity error.
pub const WORD_WAITED_FOR: usize = 1;
/// Word 2: the rank expected to signal (a timeout) or this rank (a capacity error).
pub const WORD_PEER: usize = 2;
/// Word 3: the counter's index (token tile, M tile; 0 for the publish flag).
pub const WORD_INDEX: usize = 3;
/// Word 4: the value waited for (a count or an epoch), or the rows the ring needs.
pub const WORD_EXPECTED: usize = 4;
/// Word 5: the value last seen, or the ring's capacity.
pub const WORD_SEEN: usize = 5;
/// Word 6: the rank that waited (whose record this is).
pub const WORD_RANK: usize = 6;
/// Word 7: the epoch of the pass.
pub const WORD_EPOCH: usize = 7;

/// No error.
pub const ERROR_NONE: u32 = 0;
/// A bounded wait expired.
pub const ERROR_TIMEOUT: u32 = 1;
/// The receive ring cannot hold the rows routed to this rank's experts.
pub const ERROR_CAPACITY: u32 = 2;

/// Waited for a peer to publish its inputs and routing layout for the epoch (`published`).
pub const WAIT_PEER_PUBLISHED: u32 = 1;
/// Waited for an expert owner's forward-combine rows of a token tile (`combine_arrived`).
pub const WAIT_COMBINE_ROWS: u32 = 2;
/// Waited for an expert owner's reverse-dispatch rows of a token tile (`dx_arrived`).
pub const WAIT_DX_ROWS: u32 = 3;
/// Waited for the dispatched x rows of an M tile (`tile_ready`).
pub const WAIT_X_TILE_ROWS: u32 = 4;
/// Waited for the pulled dy rows of an M tile (`dy_tile_ready`).
pub const WAIT_DY_TILE_ROWS: u32 = 5;

/// Waited for this rank's own bulk copy of a ring row to land (index = the ring row).
pub const WAIT_BULK_COPY: u32 = 6;

/// A hooked engine launch waited for the rows of an engine M tile to land (index = the M tile,
/// expected = the pass's epoch; `TileCounters::rows_landed`).
pub const WAIT_ENGINE_TILE_ROWS: u32 = 7;

/// The forward megakernel's down tile waited for the hidden rows of its M tile: every gate/up
/// part of the tile stored (index = the M tile, expected and seen = stored parts;
/// `ForwardParams::gate_up_stored`).
pub const WAIT_ENGINE_TILE_HIDDEN: u32 = 8;

/// The forward megakernel's combine waited for the down-projection rows of an M tile holding one
/// of the token's slots (index = the M tile, expected and seen = stored parts;
/// `ForwardParams::down_stored`).
pub const WAIT_ENGINE_TILE_OUTPUT: u32 = 9;

/// The forward megakernel's gate/up tile waited for the dispatch of its M tile's rows (index =
/// the M tile, expected and seen = dispatch chunks copied, `row_chunks_complete`;
/// `ForwardParams::rows_dispatched`).
pub const WAIT_ENGINE_TILE_DISPATCHED: u32 = 10;

/// A megakernel's combine, across ranks, waited for the row of one of the token's slots to be
/// pushed by its expert owner's epilogues — the down-projection row in the forward, the dx row
/// in the backward (index = the slot `t·k + j`, peer = the owner, expected = the row's N tiles,
/// one flag raise each, `gemm::hooks::slot_row_complete`; `HeapRegions::slot_ready`).
pub const WAIT_SLOT_READY: u32 = 11;

/// The backward megakernel's down-dgrad tile (or a down weight-gradient tile) waited for the
/// gathered dy rows of an M tile (index = the M tile, expected and seen = row chunks gathered,
/// `row_chunks_complete`; `BackwardParams::rows_gathered`).
pub const WAIT_ENGINE_TILE_GATHERED: u32 = 12;

/// The backward megakernel's SwiGLU-backward chunk waited for every down-dgrad part (d_hidden)
/// of an M tile to be stored, or its gate/up dgrad tile (or a gate/up weight-gradient tile) for
/// the parts and then every SwiGLU chunk (d_gate, d_up) of the tile (index = the M tile,
/// expected and seen = parts and chunks counted; `BackwardParams::down_dgrad_stored`).
pub const WAIT_ENGINE_TILE_DOWN_DGRAD: u32 = 13;

/// The backward megakernel's dx combine waited for the gate/up dgrad rows of an M tile holding
/// one of the token's slots (index = the M tile, expected and seen = stored parts;
/// `BackwardParams::gate_up_dgrad_stored`).
pub const WAIT_ENGINE_TILE_GATE_UP_DGRAD: u32 = 14;

/// The forward megakernel's shared-expert gate/up tile waited for the copy of its token rows
/// (index = the shared expert's M tile, tokens 128·index.., expected and seen = dispatch chunks
/// copied; `ForwardParams::shared_dispatched`).
pub const WAIT_SHARED_TILE_DISPATCHED: u32 = 15;

/// The forward megakernel's shared-expert down tile waited for the shared hidden rows of its M
/// tile (index = the shared M tile, expected and seen = stored parts;
/// `ForwardParams::shared_gate_up_stored`).
pub const WAIT_SHARED_TILE_HIDDEN: u32 = 16;

/// The forward megakernel's combine waited for the shared expert's output rows of its token's
/// M tile (index = the shared M tile, expected and seen = stored parts;
/// `ForwardParams::shared_down_stored`).
pub const WAIT_SHARED_TILE_OUTPUT: u32 = 17;

/// The backward megakernel's shared-expert down-dgrad tile (or its down weight-gradient tile)
/// waited for the copy of its dy rows (index = the shared M tile, expected and seen = row
/// chunks copied; `BackwardParams::shared_gathered`).
pub const WAIT_SHARED_TILE_GATHERED: u32 = 18;

/// As [`WAIT_ENGINE_TILE_DOWN_DGRAD`] for the shared expert: its SwiGLU chunk waited for the
/// down-dgrad parts of an M tile, or its gate/up dgrad tile (or its gate or up weight-gradient
/// tile) for the parts and then the chunks (index = the shared M tile, expected and seen = parts
/// and chunks counted; `BackwardParams::shared_down_dgrad_stored`).
pub const WAIT_SHARED_TILE_DOWN_DGRAD: u32 = 19;

/// The backward megakernel's dx combine waited for the shared expert's dx rows of its token's
/// M tile (index = the shared M tile, expected and seen = stored parts;
/// `BackwardParams::shared_gate_up_dgrad_stored`).
pub const WAIT_SHARED_TILE_GATE_UP_DGRAD: u32 = 20;

/// A name for a `WAIT_*` code, for messages.
pub fn waited_for_name(code: u32) -> &'static str {
    match code {
        WAIT_PEER_PUBLISHED => "the peer's publish flag (its inputs and routing layout for this pass)",
        WAIT_COMBINE_ROWS => "forward-combine rows pushed by the expert owner (combine_arrived)",
        WAIT_DX_ROWS => "reverse-dispatch dx rows pushed by the expert owner (dx_arrived)",
        WAIT_X_TILE_ROWS => "dispatched x rows of a GEMM tile (tile_ready)",
        WAIT_DY_TILE_ROWS => "pulled dy rows of a GEMM tile (dy_tile_ready)",
        WAIT_BULK_COPY => "a bulk copy of a ring row (its mbarrier)",
        WAIT_ENGINE_TILE_ROWS => "the rows of an engine M tile to land (TileCounters::rows_landed)",
        WAIT_ENGINE_TILE_DISPATCHED => "the rows of an engine M tile to be dispatched (rows_dispatched)",
        WAIT_ENGINE_TILE_HIDDEN => "the gate/up tiles of an engine M tile to be stored (gate_up_stored)",
        WAIT_ENGINE_TILE_OUTPUT => "the down tiles of an engine M tile to be stored (down_stored)",
        WAIT_SLOT_READY => {
            "a slot's row pushed by the expert owner (slot_ready: the down-projection row forward, the dx row backward)"
        }
        WAIT_ENGINE_TILE_GATHERED => "the dy rows of an engine M tile to be gathered (rows_gathered)",
        WAIT_ENGINE_TILE_DOWN_DGRAD => {
            "the down-dgrad tiles of an engine M tile to be stored, then its SwiGLU backward (d_gate, d_up) (down_dgrad_stored)"
        }
        WAIT_ENGINE_TILE_GATE_UP_DGRAD => {
            "the gate/up dgrad tiles of an engine M tile to be stored (gate_up_dgrad_stored)"
        }
        WAIT_SHARED_TILE_DISPATCHED => "the token rows of a shared-expert M tile to be copied (shared_dispatched)",
        WAIT_SHARED_TILE_HIDDEN => {
            "the shared expert's gate/up tiles of an M tile to be stored (shared_gate_up_stored)"
        }
        WAIT_SHARED_TILE_OUTPUT => "the shared expert's down tiles of an M tile to be stored (shared_down_stored)",
        WAIT_SHARED_TILE_GATHERED => "the dy rows of a shared-expert M tile to be copied (shared_gathered)",
        WAIT_SHARED_TILE_DOWN_DGRAD => {
            "the shared expert's down-dgrad tiles of an M tile to be stored, then its SwiGLU backward (d_gate, d_up) (shared_down_dgrad_stored)"
        }
        WAIT_SHARED_TILE_GATE_UP_DGRAD => {
            "the shared expert's gate/up dgrad tiles of an M tile to be stored (shared_gate_up_dgrad_stored)"
        }
        _ => "an unknown counter",
    }
}

/// Writes `words` into the record at `record` unless an earlier problem is already there. The
/// code word is claimed at system scope, so a peer GPU that polls this record ([`has_error_at`]
/// with `sys`) may see it (an error path: its cost does not matter).
///
/// # Safety
/// `record` must point at this rank's `ERROR_WORDS` u32 in global memory.
#[cfg(target_arch = "nvptx64")]
pub unsafe fn record(record: *mut u32, words: [u32; super::params::ERROR_WORDS]) {
    use crate::ptx::memory::atom_cas_acq_rel_sys_u32;
    // SAFETY: caller contract; the CAS makes the first reporter the only writer of words 1..
    unsafe {
        if atom_cas_acq_rel_sys_u32(record.add(WORD_CODE), ERROR_NONE, words[WORD_CODE]) == ERROR_NONE {
            for (i, &word) in words.iter().enumerate().skip(1) {
                *record.add(i) = word;
            }
        }
    }
}

/// Whether this rank's record already holds a problem (a relaxed GPU-scope read: other blocks
/// of this rank may have written it during this kernel).
///
/// # Safety
/// As [`record`].
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub unsafe fn has_error(record: *const u32) -> bool {
    // SAFETY: caller contract.
    unsafe { has_error_at(record, false) }
}

/// Whether the record at `record` holds a problem, read at system scope when `sys` (the record
/// may be a peer GPU's: an expert owner's, read by the token owner's combine) or at GPU scope.
///
/// # Safety
/// `record` must point at a rank's `ERROR_WORDS` u32 in global memory (local or peer-mapped).
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub unsafe fn has_error_at(record: *const u32, sys: bool) -> bool {
    use crate::ptx::memory::{ld_relaxed_gpu_u32, ld_relaxed_sys_u32};
    // SAFETY: caller contract.
    unsafe { (if sys { ld_relaxed_sys_u32(record) } else { ld_relaxed_gpu_u32(record) }) != ERROR_NONE }
}
