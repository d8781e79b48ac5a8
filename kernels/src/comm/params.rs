//! The symmetric heap's layout and the parameter block every exchange kernel reads.
//!
//! Every rank owns one slice of the symmetric heap, laid out identically on all ranks: a region
//! is a byte offset ([`HeapRegions`]), and the address of region `R` on rank `r` is
//! `peer_bases[r] + R` ([`ExchangeParams::map`]) — DeepGEMM's `sym_buffer` idea. A kernel can
//! therefore name any rank's copy of any buffer with one table lookup, whichever backend made the
//! mapping (virtual ranks in one allocation, CUDA VMM across GPUs, imported handles across
//! processes).
//!
//! Compiled for the host too: the host computes the layout with [`HeapRegions::new`] and uploads
//! an [`ExchangeParams`] (a `#[repr(C)]` block of integers, no padding) that the device reads.

use crate::layout::chunk_count;
use crate::tiles::max_m_tiles;

/// Most ranks one symmetric heap spans (the peer table is a fixed array in the parameter block).
/// 128 covers an NVL72 domain with room to spare.
pub const MAX_EP_RANKS: usize = 128;

/// Every region starts on this many bytes, so 16-byte vectors and bulk copies (16-byte aligned)
/// and 128-byte cache lines never straddle two regions.
pub const REGION_ALIGN: u64 = 256;

/// Words of a rank's exchange error record (see [`super::error`]).
pub const ERROR_WORDS: usize = 8;

/// Bytes of one bulk-copy stage in shared memory (a row is moved in pieces of at most this).
pub const BULK_STAGE_BYTES: u32 = 8192;
/// Stages in flight per block on the bulk path.
pub const BULK_STAGES: u32 = 4;
/// Shared bytes before the first stage (the mbarriers; 128 keeps stages 128-byte aligned).
pub const BULK_HEADER_BYTES: u32 = 128;
/// Dynamic shared memory of a bulk-mover block: the mbarriers, then the stages.
pub const BULK_SMEM_BYTES: u32 = BULK_HEADER_BYTES + BULK_STAGES * BULK_STAGE_BYTES;
/// Threads of a bulk-mover block: one warp (thread 0 drives the copies; the warp joins the
/// publish wait).
pub const BULK_THREADS: u32 = 32;

/// The sizes a heap is laid out for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExchangeShape {
    /// Ranks P.
    pub world: u32,
    /// Tokens per rank T.
    pub tokens: u32,
    /// Slots per token k.
    pub top_k: u32,
    /// Experts in total E (E % P == 0).
    pub num_experts: u32,
    /// Model width H (a multiple of 8).
    pub hidden: u32,
    /// Rows an expert owner's receive ring holds (all its local experts together).
    pub capacity: u32,
}

impl ExchangeShape {
    /// Experts per rank, E / P.
    pub const fn local_experts(&self) -> u32 {
        self.num_experts / self.world
    }

    /// Token tiles (of [`crate::layout::ROUTE_CHUNK_TOKENS`]) per rank: the granularity of the
    /// combine counters.
    pub const fn chunks(&self) -> u32 {
        chunk_count(self.tokens)
    }

    /// Upper bound on the GEMM M tiles of a full ring: one counter each.
    pub const fn max_tiles(&self) -> u32 {
        max_m_tiles(self.capacity, self.local_experts())
    }
}

/// Byte offsets of every region inside one rank's slice of the heap (identical on all ranks).
///
/// Token-owner role (this rank's tokens and what comes back to them), then signals this rank
/// receives, then the expert-owner role (the receive ring and its schedule).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeapRegions {
    /// `[T][H]` bf16: this rank's tokens (pulled by expert owners in dispatch).
    pub x: u64,
    /// `[T][H]` bf16: output gradient (pulled by expert owners in reverse-combine).
    pub dy: u64,
    /// `[T·k]` i32.
    pub topk_ids: u64,
    /// `[T·k]` f32 (read by expert owners to scale pulled dy rows).
    pub topk_weights: u64,
    /// `[chunks·E]` u32: the local routing layout's chunk counts, then chunk bases.
    pub chunk_counts: u64,
    /// `[T·k]` u32: rank of each slot within its chunk and expert.
    pub slot_rank: u64,
    /// `[E]` u32: rows this rank sends to each expert (read by every expert owner).
    pub expert_counts: u64,
    /// `[E+1]` u32: first local-layout row of each expert (read by expert owners).
    pub row_offsets: u64,
    /// `[E+1]` u32: written by the local routing scan, unused by the exchange.
    pub tile_offsets: u64,
    /// `[T·k]` u32: local-layout row of each slot, `NO_ROW` when dropped.
    pub slot_row: u64,
    /// `[T·k]` u32: slot of each local-layout row (read by expert owners).
    pub row_source: u64,
    /// `[4]` u32: the local routing kernels' error record.
    pub route_error: u64,
    /// `[T·k]` u32: `t·k+j` for a slot with a row, `NO_ROW` otherwise (addresses the slot
    /// buffers by slot for the combine sum and `d_topk_weights`).
    pub slot_self: u64,
    /// `[T·k][H]` f32: forward combine lands here, one row per slot (pushed by expert owners).
    pub combine_slots: u64,
    /// `[T·k][H]` f32: backward reverse-dispatch lands here.
    pub dx_slots: u64,
    /// `[T·k]` u32: raised by 1 (a release) each time one of the forward megakernel's down
    /// tiles on the expert owner has pushed its columns of the slot's row into `combine_slots`:
    /// the row is whole at ⌈H / 256⌉ (`gemm::hooks::slot_row_complete`); cleared by this rank
    /// before it publishes a pass, so no peer can push into a pass whose flags are still being
    /// cleared. The backward megakernel (virtual ranks, one launch) clears them again before
    /// its launch and its gate/up-dgrad tiles flag the dx rows in `dx_slots` the same way.
    pub slot_ready: u64,
    /// `[4]` u32: word 0 = the last epoch this rank published (its inputs and layout are ready).
    pub published: u64,
    /// `[chunks][P]` u32: rows pushed into `combine_slots` by each expert owner, per token tile
    /// (monotonic: never reset while ranks run).
    pub combine_arrived: u64,
    /// `[chunks][P]` u32: the same for `dx_slots`.
    pub dx_arrived: u64,
    /// `[chunks][P]` u32: what this rank has consumed of `combine_arrived` (its own baseline).
    pub combine_seen: u64,
    /// `[chunks][P]` u32: the same for `dx_arrived`.
    pub dx_seen: u64,
    /// `[P][L]` u32: rows each source rank sends to each local expert (the exchanged counts).
    pub peer_counts: u64,
    /// `[L+1]` u32: first ring row of each local expert; the last entry is the ring's row count.
    pub ring_row_offsets: u64,
    /// `[L+1]` u32: first GEMM M tile of each local expert (each expert's rows padded to whole
    /// tiles in tile space).
    pub ring_tile_offsets: u64,
    /// `[2·(L+1)]` u32: the sm_90 engine's tile offsets of the ring's experts (tiles of
    /// `gemm_layout::TILE_M` rows, then the odd-tile counts: `tiles::engine_tile_offsets`), which
    /// the megakernels' plans read.
    pub ring_engine_tile_offsets: u64,
    /// `[L·P+1]` u32: first ring row of segment (local expert, source rank), in that order.
    pub recv_base: u64,
    /// `[C]` u32: source rank of each ring row (the inverse map).
    pub ring_source_rank: u64,
    /// `[C]` u32: source slot `t·k+j` of each ring row on its source rank.
    pub ring_source_slot: u64,
    /// `[C][H]` bf16: dispatched x rows, in expert then global-token order.
    pub ring_x: u64,
    /// `[C][H]` bf16: pulled dy rows scaled by their slot weight.
    pub ring_dy: u64,
    /// `[max_tiles]` u32: rows of each M tile of `ring_x` that have landed (local signal).
    pub tile_ready: u64,
    /// `[max_tiles]` u32: the same for `ring_dy`.
    pub dy_tile_ready: u64,
    /// `[ERROR_WORDS]` u32: this rank's exchange error record.
    pub error: u64,
    /// Bytes of one rank's slice (a multiple of [`REGION_ALIGN`]).
    pub bytes: u64,
}

/// Bump allocator over one rank's slice.
struct Carver(u64);

impl Carver {
    fn take(&mut self, bytes: u64) -> u64 {
        let at = self.0;
        self.0 = (at + bytes.max(1)).div_ceil(REGION_ALIGN) * REGION_ALIGN;
        at
    }
}

impl HeapRegions {
    /// Lays out one rank's slice for `shape`.
    pub fn new(shape: &ExchangeShape) -> Self {
        let (p, t, k, e, h, c) = (
            shape.world as u64,
            shape.tokens as u64,
            shape.top_k as u64,
            shape.num_experts as u64,
            shape.hidden as u64,
            shape.capacity as u64,
        );
        let l = e / p.max(1);
        let slots = t * k;
        let chunks = shape.chunks() as u64;
        let tiles = shape.max_tiles() as u64;
        let mut heap = Carver(0);
        let mut regions = Self {
            x: heap.take(t * h * 2),
            dy: heap.take(t * h * 2),
            topk_ids: heap.take(slots * 4),
            topk_weights: heap.take(slots * 4),
            chunk_counts: heap.take(chunks * e * 4),
            slot_rank: heap.take(slots * 4),
            expert_counts: heap.take(e * 4),
            row_offsets: heap.take((e + 1) * 4),
            tile_offsets: heap.take((e + 1) * 4),
            slot_row: heap.take(slots * 4),
            row_source: heap.take(slots * 4),
            route_error: heap.take(16),
            slot_self: heap.take(slots * 4),
            combine_slots: heap.take(slots * h * 4),
            dx_slots: heap.take(slots * h * 4),
            slot_ready: heap.take(slots * 4),
            published: heap.take(16),
            combine_arrived: heap.take(chunks * p * 4),
            dx_arrived: heap.take(chunks * p * 4),
            combine_seen: heap.take(chunks * p * 4),
            dx_seen: heap.take(chunks * p * 4),
            peer_counts: heap.take(p * l * 4),
            ring_row_offsets: heap.take((l + 1) * 4),
            ring_tile_offsets: heap.take((l + 1) * 4),
            ring_engine_tile_offsets: heap.take(2 * (l + 1) * 4),
            recv_base: heap.take((l * p + 1) * 4),
            ring_source_rank: heap.take(c * 4),
            ring_source_slot: heap.take(c * 4),
            ring_x: heap.take(c * h * 2),
            ring_dy: heap.take(c * h * 2),
            tile_ready: heap.take(tiles * 4),
            dy_tile_ready: heap.take(tiles * 4),
            error: heap.take(ERROR_WORDS as u64 * 4),
            bytes: 0,
        };
        regions.bytes = heap.0;
        regions
    }
}

/// What `mok_ep_clear_signals` clears (a bit of its `what`): the megakernels' `slot_ready`
/// flags. (The routing kernels' error record is cleared by the host's `reset` only: it keeps
/// the first bad id until a check has reported it.)
pub const CLEAR_SLOT_READY: u32 = 2;

/// What every exchange kernel reads: the shape, the layout, the timeout and the peer table.
/// `#[repr(C)]` of u32 then u64 fields with no padding, so the host uploads its bytes as they are.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExchangeParams {
    /// Ranks P.
    pub world: u32,
    /// Tokens per rank T.
    pub tokens: u32,
    /// Slots per token k.
    pub top_k: u32,
    /// Experts in total E.
    pub num_experts: u32,
    /// Experts per rank L = E / P.
    pub local_experts: u32,
    /// Model width H.
    pub hidden: u32,
    /// Ring capacity C in rows.
    pub capacity: u32,
    /// Token tiles per rank.
    pub chunks: u32,
    /// Length of the tile counter arrays.
    pub max_tiles: u32,
    /// 1: signal at `.sys` scope (ranks on different GPUs); 0: `.gpu` scope (every rank on this
    /// GPU: virtual ranks).
    pub sys_scope: u32,
    /// How long any wait may take before it is reported, in nanoseconds of `%globaltimer`.
    pub timeout_ns: u64,
    /// Region offsets, identical on every rank.
    pub regions: HeapRegions,
    /// Base address of each rank's slice as this GPU sees it; entries past `world` are 0.
    pub peer_bases: [u64; MAX_EP_RANKS],
}

const _: () = assert!(
    core::mem::size_of::<ExchangeParams>() == 10 * 4 + 8 + core::mem::size_of::<HeapRegions>() + 8 * MAX_EP_RANKS,
    "ExchangeParams must have no padding: the host uploads its bytes"
);

impl ExchangeParams {
    /// Parameters for `shape` with the given peer bases (one per rank) and timeout.
    pub fn new(shape: &ExchangeShape, bases: &[u64], timeout_ns: u64, sys_scope: bool) -> Self {
        let mut peer_bases = [0u64; MAX_EP_RANKS];
        peer_bases[..bases.len()].copy_from_slice(bases);
        Self {
            world: shape.world,
            tokens: shape.tokens,
            top_k: shape.top_k,
            num_experts: shape.num_experts,
            local_experts: shape.local_experts(),
            hidden: shape.hidden,
            capacity: shape.capacity,
            chunks: shape.chunks(),
            max_tiles: shape.max_tiles(),
            sys_scope: sys_scope as u32,
            timeout_ns,
            regions: HeapRegions::new(shape),
            peer_bases,
        }
    }

    /// `map(region, rank)`: the address of `region` in `rank`'s slice.
    #[inline(always)]
    pub fn map(&self, region: u64, rank: u32) -> u64 {
        self.peer_bases[rank as usize] + region
    }

    /// The parameter block as bytes, for the upload.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: `ExchangeParams` is `#[repr(C)]` of integers with no padding (checked by the
        // const assertion above), so every byte is initialised; the slice borrows `self`.
        unsafe { core::slice::from_raw_parts(self as *const Self as *const u8, core::mem::size_of::<Self>()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> ExchangeShape {
        ExchangeShape { world: 3, tokens: 130, top_k: 4, num_experts: 12, hidden: 72, capacity: 500 }
    }

    #[test]
    fn regions_are_aligned_disjoint_and_large_enough() {
        let s = shape();
        let r = HeapRegions::new(&s);
        let (t, k, e, h, c, p, l) = (130u64, 4u64, 12u64, 72u64, 500u64, 3u64, 4u64);
        let chunks = 3u64;
        let tiles = s.max_tiles() as u64;
        let sizes = [
            (r.x, t * h * 2),
            (r.dy, t * h * 2),
            (r.topk_ids, t * k * 4),
            (r.topk_weights, t * k * 4),
            (r.chunk_counts, chunks * e * 4),
            (r.slot_rank, t * k * 4),
            (r.expert_counts, e * 4),
            (r.row_offsets, (e + 1) * 4),
            (r.tile_offsets, (e + 1) * 4),
            (r.slot_row, t * k * 4),
            (r.row_source, t * k * 4),
            (r.route_error, 16),
            (r.slot_self, t * k * 4),
            (r.combine_slots, t * k * h * 4),
            (r.dx_slots, t * k * h * 4),
            (r.slot_ready, t * k * 4),
            (r.published, 16),
            (r.combine_arrived, chunks * p * 4),
            (r.dx_arrived, chunks * p * 4),
            (r.combine_seen, chunks * p * 4),
            (r.dx_seen, chunks * p * 4),
            (r.peer_counts, p * l * 4),
            (r.ring_row_offsets, (l + 1) * 4),
            (r.ring_tile_offsets, (l + 1) * 4),
            (r.ring_engine_tile_offsets, 2 * (l + 1) * 4),
            (r.recv_base, (l * p + 1) * 4),
            (r.ring_source_rank, c * 4),
            (r.ring_source_slot, c * 4),
            (r.ring_x, c * h * 2),
            (r.ring_dy, c * h * 2),
            (r.tile_ready, tiles * 4),
            (r.dy_tile_ready, tiles * 4),
            (r.error, ERROR_WORDS as u64 * 4),
        ];
        let mut sorted = sizes.to_vec();
        sorted.sort();
        for pair in sorted.windows(2) {
            assert!(pair[0].0 + pair[0].1 <= pair[1].0, "regions overlap: {pair:?}");
        }
        for (offset, _) in sizes {
            assert_eq!(offset % REGION_ALIGN, 0);
        }
        let (last, size) = sorted[sorted.len() - 1];
        assert!(last + size <= r.bytes && r.bytes.is_multiple_of(REGION_ALIGN));
    }

    #[test]
    fn params_map_regions_per_rank() {
        let s = shape();
        let params = ExchangeParams::new(&s, &[0x1000, 0x9000, 0x20000], 5, true);
        assert_eq!(params.local_experts, 4);
        assert_eq!(params.chunks, 3);
        assert_eq!(params.map(params.regions.dy, 2), 0x20000 + params.regions.dy);
        assert_eq!(params.as_bytes().len(), core::mem::size_of::<ExchangeParams>());
        // The first word of the bytes is `world`, little-endian.
        assert_eq!(params.as_bytes()[..4], 3u32.to_le_bytes());
    }
}
