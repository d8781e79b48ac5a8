//! The engine's shared-memory carve and its stage ring: `stages` stages of an A and a B tile,
//! each consumer warpgroup's output staging, and per stage a `full` and an `empty` barrier, a
//! tile slot and a pair mailbox. The ring walk (stage, phase) is the same in every role.

use crate::gemm_layout::{A_TILE_BYTES, BLOCK_64_BYTES, STAGE_BYTES, STAGES, STAGING_BOXES, ring_stages, staging_boxes};
use crate::ptx::smem;

/// Shared-memory addresses of the ring, the output staging and the barriers, and the ring's
/// shape (constants once inlined: each kernel builds its ring from compile-time values).
#[derive(Clone, Copy)]
pub(super) struct Ring {
    pub(super) base: u32,
    pub(super) staging: u32,
    pub(super) bars: u32,
    /// Stages of the ring.
    pub(super) stages: u32,
    /// Bytes of output staging per consumer warpgroup.
    staging_bytes: u32,
}

impl Ring {
    /// The ring every megakernel runs its phases on: [`STAGES`] and [`STAGING_BOXES`].
    #[inline(always)]
    pub(super) fn new() -> Self {
        Self::with_shape(STAGES, STAGING_BOXES)
    }
    /// The ring of variant `V`'s standalone kernel ([`ring_stages`], [`staging_boxes`]).
    #[inline(always)]
    pub(super) fn of_variant<const V: u32>() -> Self {
        Self::with_shape(ring_stages(V), staging_boxes(V))
    }
    #[inline(always)]
    fn with_shape(stages: u32, boxes: u32) -> Self {
        // The window is 1024-aligned by its declaration; round up anyway so a change there
        // cannot silently break the swizzle (the host adds 1 KiB of slack).
        let base = (smem::dynamic_smem_base() + 1023) & !1023;
        let staging = base + stages * STAGE_BYTES;
        let staging_bytes = boxes * BLOCK_64_BYTES;
        Ring { base, staging, bars: staging + 2 * staging_bytes, stages, staging_bytes }
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
    pub(super) fn empty(self, stage: u32) -> u32 {
        self.bars + (self.stages + stage) * 8
    }
    /// The tile whose first K block a stage holds (or [`NO_TILE`]), written by the producer (the
    /// partner's, through [`cluster::st_async_u32`], in a pair's second block) before the
    /// stage's `full` arrival, which publishes it to the consumers.
    pub(super) fn tile_slot(self, stage: u32) -> u32 {
        self.bars + (2 * self.stages + stage) * 8
    }
    /// The second block of a pair learns the tile of a stage's slot through this barrier: the
    /// first block's producer writes the slot remotely ([`cluster::st_async_u32`]), which
    /// completes its 4 bytes here.
    pub(super) fn mail(self, stage: u32) -> u32 {
        self.bars + (3 * self.stages + stage) * 8
    }
    /// Consumer warpgroup `wg`'s output staging (1024-byte aligned).
    pub(super) fn staging(self, wg: u32) -> u32 {
        self.staging + wg * self.staging_bytes
    }
    /// The next (stage, phase) of the ring walk.
    #[inline(always)]
    pub(super) fn advance(self, stage: &mut u32, phase: &mut u32) {
        *stage += 1;
        if *stage == self.stages {
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
