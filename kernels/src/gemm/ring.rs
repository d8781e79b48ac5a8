//! The engine's shared-memory carve and its stage ring: `ring_stages(V)` stages of an A and a B
//! tile, each consumer warpgroup's output staging, and per stage a `full` and an `empty`
//! barrier, a tile slot and a pair mailbox, then the gathering warps' tile hand-out word, then per
//! stage a work slot (the tile's lookup, packed), then a word for a megakernel hosting ranks
//! (its block's rank), then the backward megakernel's copy of its parameter block and plans
//! (one GPU, or a launch hosting one rank). The ring walk (stage, phase) is the same in every role.

use crate::gemm_layout::{A_TILE_BYTES, BLOCK_64_BYTES, STAGE_BYTES, WORK_SLOT_WORDS, ring_stages, staging_boxes};
use crate::ptx::smem;

/// Shared-memory addresses of the ring, the output staging and the barriers. The ring's shape
/// is that of the kernel's variant `V` ([`ring_stages`], [`staging_boxes`]: compile-time
/// constants), named where it matters; the megakernels' phases all share the default shape.
#[derive(Clone, Copy)]
pub(super) struct Ring {
    pub(super) base: u32,
    pub(super) staging: u32,
    pub(super) bars: u32,
}

impl Ring {
    pub(super) fn new<const V: u32>() -> Self {
        // The window is 1024-aligned by its declaration; round up anyway so a change there
        // cannot silently break the swizzle (the host adds 1 KiB of slack).
        let base = (smem::dynamic_smem_base() + 1023) & !1023;
        let staging = base + const { ring_stages(V) * STAGE_BYTES };
        Ring { base, staging, bars: staging + const { 2 * staging_boxes(V) * BLOCK_64_BYTES } }
    }
    pub(super) fn a_tile(self, stage: u32) -> u32 {
        self.base + stage * STAGE_BYTES
    }
    pub(super) fn b_tile(self, stage: u32) -> u32 {
        self.a_tile(stage) + A_TILE_BYTES
    }
    pub(super) fn full(self, stage: u32) -> u32 {
        self.bars + stage * 8
    }
    pub(super) fn empty<const V: u32>(self, stage: u32) -> u32 {
        self.bars + (const { ring_stages(V) } + stage) * 8
    }
    /// The tile whose first K block a stage holds (or [`NO_TILE`]), written by the producer (the
    /// partner's, through [`cluster::st_async_u32`], in a pair's second block) before the
    /// stage's `full` arrival, which publishes it to the consumers.
    pub(super) fn tile_slot<const V: u32>(self, stage: u32) -> u32 {
        self.bars + (const { 2 * ring_stages(V) } + stage) * 8
    }
    /// The second block of a pair learns the tile of a stage's slot through this barrier: the
    /// first block's producer writes the slot remotely ([`cluster::st_async_u32`]), which
    /// completes its 4 bytes here.
    pub(super) fn mail<const V: u32>(self, stage: u32) -> u32 {
        self.bars + (const { 3 * ring_stages(V) } + stage) * 8
    }
    /// A word through which the leading gathering thread hands each tile to the other
    /// gathering threads ([`Gatherers`](super::gather::Gatherers)); the
    /// three words after it carry the ring walk to them where a persistent kernel's gathering
    /// phase starts (`share_walk`).
    pub(super) fn handout<const V: u32>(self) -> u32 {
        self.bars + const { 4 * ring_stages(V) } * 8
    }
    /// A tile's [`Work`](super::source::Work), packed ([`WORK_SLOT_WORDS`] words, 16-byte
    /// aligned; every variant but the standalone weight gradient, `source::uses_work_slot`), in
    /// the stage that holds its first K block: each block's producer writes
    /// its own block's before that stage's `full` arrival, so the consumers read it from shared
    /// memory instead of looking the tile up in global memory (whose L1 lines every acquire and
    /// async-proxy fence of a persistent kernel invalidates).
    pub(super) fn work_slot<const V: u32>(self, stage: u32) -> u32 {
        self.handout::<V>() + 16 + stage * 4 * WORK_SLOT_WORDS
    }
    /// Where a megakernel hosting ranks keeps its block's rank (a word, 16-byte aligned), after
    /// the work slots: see [`rank_slot`](super::engine::rank_slot).
    pub(super) fn rank<const V: u32>(self) -> u32 {
        self.work_slot::<V>(const { ring_stages(V) })
    }
    /// The backward megakernel's copy of its parameter block and routed plans (one GPU, or a
    /// launch hosting one rank; [`PARAMS_COPY_BYTES`](crate::gemm_layout::PARAMS_COPY_BYTES),
    /// 16-byte aligned), after the rank word (16 bytes).
    pub(super) fn params_copy<const V: u32>(self) -> u32 {
        self.rank::<V>() + 16
    }
    /// Consumer warpgroup `wg`'s output staging (1024-byte aligned).
    pub(super) fn staging<const V: u32>(self, wg: u32) -> u32 {
        self.staging + wg * const { staging_boxes(V) * BLOCK_64_BYTES }
    }
    /// The next (stage, phase) of the ring walk.
    #[inline(always)]
    pub(super) fn advance<const V: u32>(self, stage: &mut u32, phase: &mut u32) {
        *stage += 1;
        if *stage == const { ring_stages(V) } {
            *stage = 0;
            *phase ^= 1;
        }
    }
}

/// Where a role stands in the ring walk: the stage its next tile starts in and that stage's
/// phase parity; for a pair's second producer also the parity of each stage's mailbox (bit s).
/// A standalone kernel starts at [`Walk::START`]; a persistent kernel that runs one engine phase
/// after another carries it from each phase into the next, so the barriers' phases stay in step.
#[derive(Clone, Copy)]
pub struct Walk {
    pub(super) stage: u32,
    pub(super) phase: u32,
    pub(super) mail_phases: u32,
}

impl Walk {
    /// A fresh ring: stage 0, phase 0, every mailbox at parity 0.
    pub const START: Walk = Walk { stage: 0, phase: 0, mail_phases: 0 };
}
