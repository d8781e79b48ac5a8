//! A persistent, warp-specialised grouped GEMM for Hopper (sm_90a).
//!
//! Block = 384 threads: warpgroup 0 is the producer (its first thread fills a ring of
//! [`STAGES`] shared-memory stages with TMA tensor copies), warpgroups 1 and 2 are consumers
//! (each owns 64 rows of the 128 × 256 block tile and issues `wgmma.m64n256k16`; `setmaxnreg`
//! moves registers from the producer to them). Stages are handed over through two mbarriers
//! each: `full` (the producer's copies have landed) and `empty` (every consumer warp has finished
//! reading). While the consumers run a tile's epilogue, the producer is already loading the next
//! tile's stages; the epilogue itself leaves through shared memory and TMA stores that drain
//! while the next tile's MMAs run.
//!
//! The flat tile list comes from device-written group offsets, so the host never learns the
//! group sizes. Row-grouped variants run in 2-block clusters (pairs, see [`pair_tile`]): the
//! first block's producer takes the next entry of the list from a device counter and hands it
//! to its partner's producer through a mailbox barrier; weight gradients run alone and walk
//! `blockIdx.x, blockIdx.x + gridDim.x, ...`. Each producer names the tile to its consumers in
//! a shared slot of the tile's first stage, published by that stage's `full` arrival; a tile without K blocks (an empty group's weight gradient) gets a stage without
//! copies, and [`NO_TILE`] ends the walk. A group's M tiles are walked in bands, M fastest
//! ([`banded_row_tile`]), so blocks that take neighbouring tiles at the same moment read the same
//! weight tile and all but the first find it in L2; a band is cut into blocks of a few N tiles,
//! which bounds the panels a large group keeps in L2 at once. Every stage of a tile
//! with K blocks is whole TMA copies: a tile that would read past the end of its group (a ragged last M tile, or the
//! last K block of a weight gradient) is loaded through a tensor map cut at that group's last
//! row ([`group_maps`](super::group_maps), rewritten on the device before each launch), so the
//! copy engine fills those rows with zeros and rows of a neighbouring group are never read (the
//! output rows are stored through a cut map the same way, so they are never written).
//! Each output element is produced by one thread of one tile with a K loop in fixed order:
//! results do not depend on the grid size.
//!
//! Variants ([`Variant`]):
//! - `GATE_UP`: `rows[R][H] · [w_gate; w_up][g]ᵀ` with SwiGLU in registers → hidden bf16 (and
//!   optionally the f32 pre-activations). B tile = 128 gate rows + 128 up rows of the same columns.
//! - `ROWS_NT`: `rows[R][K] · w[g][N][K]ᵀ` → f32 rows (down projection); `ROWS_NT_BF16` the same
//!   → bf16 rows (a plain grouped GEMM with the output type of `torch._grouped_mm`).
//! - `ROWS_NN`: `a[R][K] · w[g][K][N]` (+ a second segment) → f32 rows (data gradients).
//! - `WGRAD`: `Σ_{r in g} a[r][M]ᵀ b[r][N]` → `[G][M][N]` bf16, or added into f32;
//!   `WGRAD_IN_PAIR` the same on a persistent kernel's paired ring.

use crate::gemm_layout::{
    CONSUMER_REGISTERS, ENGINE_THREADS, GemmParams, MEGAKERNEL_PRODUCER_REGISTERS, NO_TILE, PAIRED_CONSUMER_REGISTERS,
    PAIRED_PRODUCER_REGISTERS, PRODUCER_REGISTERS, cluster_blocks, is_wgrad, ring_stages, staging_boxes,
};
use crate::ptx::memory::{ld_shared_u32, ld_shared_v4, ld_volatile_shared_u32, st_shared_u32};
use crate::ptx::{bulk, cluster, mbarrier, sreg, sync};

pub(crate) use super::epilogue::for_each_pair;
use super::epilogue::*;
use super::gather::{GATHER_LANES, GATHER_WARPS, Gatherers, full_arrivals, produce_gathering};
use super::hooks::{BackwardHandover, ForwardHandover, TileHooks, carries_m_tile, hooked};
use super::mainloop::*;
use super::producer::*;
use super::ring::{Ring, Walk};
use super::source::*;
pub use crate::gemm_layout::Variant;

/// The [`Work`] of the tile whose first K block `stage` holds, as its block's producer wrote it
/// into the stage's work slot before the `full` arrival ([`name_work`]). In a persistent kernel
/// the consumers' own lookup (for a row-grouped tile a binary search over the groups, through
/// the plan in global memory) would go to L2 at every step of every tile: each tile's acquires
/// and async-proxy fences invalidate the SM's L1. Lane 0 alone reads the slot and shuffles the
/// words to its warp, as for the tile slot (the padding words are loaded with the last vector,
/// and not shuffled); the M tile only where the tile carries it ([`carries_m_tile`]).
///
/// # Safety
/// All 32 lanes of each warp of the consumer warpgroup call it, after the stage's `full` wait
/// of the phase whose tile it names and before lane 0 releases the stage; `V` uses the work slot
/// ([`uses_work_slot`]), which its producer (`produce` or `produce_gathering`, with hooks `H`)
/// filled.
#[inline(always)]
unsafe fn work_from_slot<const V: u32, H: TileHooks>(ring: Ring, stage: u32, thread_in_wg: u32) -> Work {
    let slot = ring.work_slot::<V>(stage);
    let lane_0 = thread_in_wg % 32 == 0;
    // SAFETY: the slot is 16-byte aligned in this block's ring and published by the `full`
    // arrival the caller waited for.
    let read = |v: u32| if lane_0 { unsafe { ld_shared_v4(slot + 16 * v) } } else { [0; 4] };
    let ([a, b, c, d], [e, f, g, h], [i, j, ..]) = (read(0), read(1), read(2));
    // SAFETY: all 32 lanes (caller contract).
    let bcast = |word| unsafe { sync::shfl_idx_u32(word, 0) };
    let [a, b, c, d, e, f, g, h, i] = [a, b, c, d, e, f, g, h, i].map(bcast);
    let j = if carries_m_tile::<V, H>() { bcast(j) } else { UNKNOWN_M_TILE };
    Work::unpacked([a, b, c, d, e, f, g, h, i, j, 0, 0])
}

/// A consumer warpgroup: MMAs over the stages, then the epilogue, tile after tile, from `walk`
/// until the stage that names [`NO_TILE`]. Returns the walk at that stage, which it has not
/// released: the last phase of a kernel leaves it so; [`next_phase`] releases it before another.
///
/// # Safety
/// The whole consumer warpgroup `wg` (`thread_in_wg` its thread's index) calls it in uniform
/// control flow, in a block of [`ENGINE_THREADS`] threads with the engine's dynamic shared memory;
/// the ring's barriers are initialised (`init_barriers`, in both blocks of a pair); `p` is a valid
/// parameter block of variant `V` (outputs and maps as the host contract of [`run`] states) whose
/// tiles the producer hands out with [`produce`] (or `produce_gathering`: either fills the work
/// slots) from the same `walk`; the hooks' contracts hold.
#[inline(always)]
pub(super) unsafe fn consume<const V: u32, H: TileHooks>(
    p: &GemmParams,
    ring: Ring,
    wg: u32,
    thread_in_wg: u32,
    hooks: H,
    walk: Walk,
) -> Walk {
    let Walk { mut stage, mut phase, .. } = walk;
    loop {
        // The producer names each tile in the stage holding its first K block (the waits in the
        // loops below pass again at once: the stage is not released before them).
        // Only lane 0 reads the slot and hands the tile to its warp in a register: lane 0 is the
        // lane that later arrives on `empty`, after which the producer may rewrite the slot, so
        // its read is ordered before that by program order. (Reads by the other lanes would not
        // be: nothing between them and lane 0's arrival orders memory, and racecheck reports
        // that write-after-read; a `bar.warp.sync` there is dropped by ptxas.)
        // SAFETY: initialised barrier of this block; the slot is published by the arrival. All 32
        // lanes reach the shuffle: the whole warpgroup calls this (caller contract) and every
        // lane takes the same iterations (the loop ends only on the broadcast tile).
        let tile = unsafe {
            mbarrier::wait_parity(ring.full(stage), phase);
            let slot = if thread_in_wg % 32 == 0 { ld_shared_u32(ring.tile_slot::<V>(stage)) } else { 0 };
            sync::shfl_idx_u32(slot, 0)
        };
        if tile == NO_TILE {
            break;
        }
        // The tile's lookup: from the work slot where the producer wrote it (`work_from_slot`),
        // or for the standalone weight gradient its own (`uses_work_slot`).
        let w = if uses_work_slot(V) {
            // SAFETY: the whole warpgroup, right after the stage's `full` wait (as the tile).
            unsafe { work_from_slot::<V, H>(ring, stage, thread_in_wg) }
        } else {
            // SAFETY: the producer hands out only tiles < total.
            unsafe { work_of::<V>(p, tile) }
        };
        if !is_wgrad(V) && (wg * 64 >= w.rows || !w.has_columns) {
            // A ragged tile with no rows in this warpgroup's half (a group's last ≤ 64 rows), or
            // a pair's second block without an N tile (an odd tile count):
            // skip the MMAs, so the other warpgroup has the tensor cores to itself, but keep
            // step with the ring — wait for each stage, then release it (a tile without K blocks
            // still has its one copy-less stage).
            for _ in 0..w.k_blocks.max(1) {
                // SAFETY: initialised barrier of this block.
                unsafe { mbarrier::wait_parity(ring.full(stage), phase) };
                // SAFETY: initialised barriers (caller contract); the stage's `full` phase passed
                // and nothing reads it.
                unsafe { release::<V>(ring, stage, thread_in_wg) };
                ring.advance::<V>(&mut stage, &mut phase);
            }
            continue;
        }
        let mut acc = [0.0f32; ACCUMULATORS];
        if w.k_blocks == 0 {
            // An empty group's weight gradient: the tile's stage carried only its name.
            // SAFETY: initialised barriers (caller contract); the name was read after the
            // stage's `full` wait above.
            unsafe { release::<V>(ring, stage, thread_in_wg) };
            ring.advance::<V>(&mut stage, &mut phase);
        } else {
            // Only the path that issued MMAs waits for them: a zero-trip path reaching the wait
            // lets LLVM place the zeroing of `acc` inside the wgmma pipeline, and ptxas then
            // serialises every wgmma of the kernel (C7515).
            // SAFETY: caller contract: initialised barriers, a whole warpgroup in uniform flow,
            // and the producer fills this tile's `k_blocks` stages from here.
            unsafe {
                let fence_rows = hooks.row_gather().is_some();
                mainloop::<V>(&mut acc, ring, (&mut stage, &mut phase), (w.k_blocks, fence_rows), wg, thread_in_wg)
            };
        }
        // SAFETY: outputs sized by the host contract; the hooks' contract.
        unsafe {
            let scatter = if hooked(V) && !is_wgrad(V) { hooks.row_scatter() } else { None };
            epilogue::<V>(p, &w, &acc, ring.staging::<V>(wg), (wg, thread_in_wg), scatter)
        };
        if hooked(V) && thread_in_wg == 0 {
            // SAFETY: this warpgroup's leader, which issued the tile's stores.
            unsafe { hooks.after_store(p, &w, wg) };
        }
    }
    if thread_in_wg == 0 {
        // Shared memory must outlive the bulk stores that read it.
        bulk::wait_group_read_all();
    }
    Walk { stage, phase, mail_phases: 0 }
}

/// A consumer warpgroup between two engine phases of one kernel: releases the stage that named
/// [`NO_TILE`] (the producers wait for it like for any other) and steps past it.
///
/// # Safety
/// As [`release`]: the ring's barriers are initialised; every thread of the consumer warpgroup
/// calls it with the walk [`consume`] returned.
#[inline(always)]
pub(super) unsafe fn next_phase<const V: u32>(ring: Ring, walk: Walk, thread_in_wg: u32) -> Walk {
    let Walk { mut stage, mut phase, mail_phases } = walk;
    // SAFETY: caller contract; `consume` waited for the stage's `full` phase and is done with it.
    unsafe { release::<V>(ring, stage, thread_in_wg) };
    ring.advance::<V>(&mut stage, &mut phase);
    Walk { stage, phase, mail_phases }
}

/// One thread per block initialises the ring's barriers before any use: `full` completes on
/// [`full_arrivals`] arrivals (the producer's, with the bytes it expects, and where the hooks `H`
/// may gather one per gathering thread, [`super::gather`]), `empty` on `empty_arrivals`
/// consumer warps
/// (8 per block sharing the stage: 16 in a pair), the mailbox on one arrival; then the fence
/// that makes the initialisation visible to the cluster.
///
/// # Safety
/// `ring` is `Ring::new::<V>()` in a block with the engine's dynamic shared memory; one thread of
/// the block calls it, once, before any thread uses the ring's barriers.
#[inline(always)]
unsafe fn init_barriers<const V: u32, H: TileHooks>(ring: Ring, empty_arrivals: u32) {
    for s in 0..ring_stages(V) {
        // SAFETY: the ring's barrier slots: 8-byte aligned shared memory of this block that
        // nothing uses yet (caller contract).
        unsafe {
            mbarrier::init(ring.full(s), const { full_arrivals(H::MAY_GATHER_ROWS) });
            mbarrier::init(ring.empty::<V>(s), empty_arrivals);
            mbarrier::init(ring.mail::<V>(s), 1);
        }
    }
    mbarrier::fence_mbarrier_init();
}

/// The shared-memory address of the word where a megakernel hosting ranks keeps its block's
/// rank for the whole launch (the default ring's slot, which no phase touches); unused by every
/// other kernel.
#[inline(always)]
pub fn rank_slot() -> u32 {
    // Every megakernel phase's ring has this shape, so the word lies past all of their slots.
    const fn default_shape(v: u32) -> bool {
        ring_stages(v) == ring_stages(Variant::GATE_UP) && staging_boxes(v) == staging_boxes(Variant::GATE_UP)
    }
    const {
        assert!(
            default_shape(Variant::ROWS_NT) && default_shape(Variant::ROWS_NN) && default_shape(Variant::WGRAD_IN_PAIR)
        )
    };
    Ring::new::<{ Variant::GATE_UP }>().rank::<{ Variant::GATE_UP }>()
}

/// The shared-memory address where the backward megakernel (one GPU, or a launch hosting one
/// rank) keeps its copy of its parameter block and routed plans
/// ([`PARAMS_COPY_BYTES`](crate::gemm_layout::PARAMS_COPY_BYTES)); unused by the other kernels.
#[inline(always)]
pub fn params_copy_address() -> u32 {
    Ring::new::<{ Variant::ROWS_NN }>().params_copy::<{ Variant::ROWS_NN }>()
}

/// The engine body shared by every entry point: [`ENGINE_THREADS`](crate::gemm_layout::ENGINE_THREADS)
/// threads, [`ENGINE_SMEM_BYTES`](crate::gemm_layout::ENGINE_SMEM_BYTES) of dynamic shared memory.
///
/// # Safety
/// `params` points at a valid [`GemmParams`] whose tensors match the variant's contract; every
/// thread of the block calls it (of both blocks of the cluster, for a paired variant). When
/// `hooks.row_gather()` names rows, the variant is one [`produce_gathering`] takes and the rows
/// are as it requires (the map of the operand it gathers is then unused).
#[inline(always)]
pub unsafe fn run<const V: u32, H: TileHooks>(params: *const GemmParams, hooks: H) {
    // Register budgets below assume exactly this block size (`.maxntid`); row-grouped variants
    // run in pairs (`.reqnctapercluster 2`).
    crate::ptx::declare_block_threads::<ENGINE_THREADS>();
    let paired = cluster_blocks(V) > 1;
    if paired {
        crate::ptx::declare_cluster_blocks::<2>();
    }
    // SAFETY: caller contract; the parameter block is read-only for the whole launch. Fields are
    // read where used (not copied up front) so they do not hold registers across the main loop.
    let p = unsafe { *params };
    let ring = Ring::new::<V>();
    let thread = sreg::thread_idx_x();
    if thread == 0 {
        // SAFETY: one thread, before any use; the launch gives the engine's shared memory.
        unsafe { init_barriers::<V, H>(ring, 8 * cluster_blocks(V)) };
    }
    // The partner multicasts into this block's stages and arrives on its barriers: both blocks'
    // barriers must be initialised before either starts.
    if paired {
        // SAFETY: every thread of both blocks of the pair (caller contract; `paired` is the
        // variant's constant; thread 0's branch above rejoins).
        unsafe { cluster::cluster_sync() };
    } else {
        // SAFETY: every thread of the block runs the engine body to here (`paired` is the
        // variant's constant; thread 0's branch above rejoins).
        unsafe { sync::block_barrier() };
    }
    let warpgroup = thread / 128;
    if warpgroup == 0 {
        // The producer needs a handful of registers; the consumers' m64n256 accumulators need
        // 128 each. Warpgroup-uniform, as setmaxnreg requires.
        if paired {
            // SAFETY: the whole producer warpgroup (`paired` is a constant), its one
            // `setmaxnreg`, down from the launch's 168 per thread (`.maxntid 384`).
            unsafe { sync::release_registers::<PAIRED_PRODUCER_REGISTERS>() };
        } else {
            // SAFETY: as above.
            unsafe { sync::release_registers::<PRODUCER_REGISTERS>() };
        }
        if let Some(rows) = hooks.row_gather() {
            if thread < GATHER_LANES * GATHER_WARPS {
                // SAFETY: the producer warpgroup's `GATHER_WARPS` warps, every lane, on a
                // fresh ring; `rows` valid (caller contract).
                unsafe { produce_gathering::<V, H>(&p, ring, (rows, hooks), thread, Walk::START) };
            }
        } else if thread == 0 {
            // SAFETY: one producer thread.
            unsafe { produce::<V, H>(&p, ring, hooks, Walk::START) };
        }
    } else {
        if paired {
            // SAFETY: a whole consumer warpgroup, its one `setmaxnreg`, up from the launch's 168
            // per thread; the pool holds enough (gemm_layout's `fits`).
            unsafe { sync::claim_registers::<PAIRED_CONSUMER_REGISTERS>() };
        } else {
            // SAFETY: as above.
            unsafe { sync::claim_registers::<CONSUMER_REGISTERS>() };
        }
        // SAFETY: a whole consumer warpgroup.
        unsafe { consume::<V, H>(&p, ring, warpgroup - 1, thread % 128, hooks, Walk::START) };
    }
    if paired {
        // No block may leave while its partner can still write into it or arrive on its
        // barriers.
        // SAFETY: as at the start: every thread comes here once its role above is done.
        unsafe { cluster::cluster_sync() };
    }
}

/// Thread 0's walk, in every gathering thread (the producer warpgroup's, through the ring's
/// hand-out words and a named barrier): where a gathering phase starts, after phases thread 0
/// produced alone.
///
/// # Safety
/// Every gathering thread calls it, once; no gathering thread still reads
/// the hand-out words from an earlier call or a tile hand-out (each gathering phase ends with
/// the gathering threads meeting).
#[inline(always)]
unsafe fn share_walk<const V: u32>(ring: Ring, walk: Walk, thread: u32) -> Walk {
    // Three words after the tile hand-out word (`ring_smem_bytes` leaves 16 bytes there).
    let words = ring.handout::<V>() + 4;
    // SAFETY: caller contract: written before the meeting, read after it, nothing else using
    // these words meanwhile.
    unsafe {
        if thread == 0 {
            st_shared_u32(words, walk.stage);
            st_shared_u32(words + 4, walk.phase);
            st_shared_u32(words + 8, walk.mail_phases);
        }
        Gatherers { thread }.meet();
        // Volatile: three plain loads get merged into one 16-byte load that also reads the
        // tile hand-out word, which thread 0 writes next without a meeting in between.
        Walk {
            stage: ld_volatile_shared_u32(words),
            phase: ld_volatile_shared_u32(words + 4),
            mail_phases: ld_volatile_shared_u32(words + 8),
        }
    }
}

/// The compute role of the forward megakernel, in a 2-block cluster of [`ENGINE_THREADS`]
/// threads with [`ENGINE_SMEM_BYTES`](crate::gemm_layout::ENGINE_SMEM_BYTES) of dynamic shared
/// memory: four phases on one ring — the shared expert's gate/up, the routed gate/up
/// ([`Variant::GATE_UP`]), the shared expert's down, the routed down ([`Variant::ROWS_NT`]) —
/// each run for the ranks the walk `first_rank()`, `next_rank(q)`, … names (this block's rank
/// alone, or every rank of the launch in turn): phase `i` of rank `q` runs the tiles of the plan
/// `plan(i, q)` returns (null: the phase is left out) with the hooks `hooks(i, q)`. (A rank is
/// named by whatever the caller reads its plans through, its parameter block: one value live
/// across the phases.) A block moves on (to the next rank's
/// tiles, or to the next phase) when the tile counter it drew from is spent, i.e. once every
/// tile of it is held by a running block — so a down tile only ever waits for work that is
/// already being done. The producer warpgroup's three spare warps (its first warp's thread 0
/// is the producer) run `spare_warps` (the dispatch) meanwhile; in a routed gate/up whose hooks
/// gather the rows ([`TileHooks::row_gather`]) the whole warpgroup produces, the first warp and,
/// after their dispatch, the spare warps (`gather::GATHER_WARPS`). Ends with the pair's final
/// cluster barrier. Returns `Some(())` for the threads of the consumer warpgroups, free for
/// further work, and `None` for the producer warpgroup, which holds too few registers for more.
///
/// `plan` is called where each phase starts (a load from the caller's parameter block), so no
/// plan address is held across phases or across the register hand-over: the consumers'
/// accumulators leave no room for more live values.
///
/// # Safety
/// Every non-null plan `plan` returns is a valid parameter block of its phase's variant, its
/// tile counter zeroed before the launch; the routed experts' phases (`ForwardHandover::GATE_UP`,
/// `DOWN`) are never null, and the shared expert's null for every rank or for none;
/// each down phase runs over the row groups of the gate/up phase of the same experts; `plan`
/// and the rank walk are the same for every block of the cluster, and the walk ends; the hooks'
/// contracts hold for every rank of the walk; every spare producer warp (with
/// [`MEGAKERNEL_PRODUCER_REGISTERS`] registers) calling `spare_warps` is safe, and it waits for
/// nothing; a walk over several ranks is the same for every block of the launch; every thread
/// of both blocks of the cluster calls it.
#[inline(always)]
pub unsafe fn run_forward_phases<H: TileHooks, R: Copy>(
    plan: impl Fn(u32, R) -> *const GemmParams + Copy,
    hooks: impl Fn(u32, R) -> H + Copy,
    spare_warps: impl Fn(),
    (first_rank, next_rank): (impl Fn() -> R + Copy, impl Fn(R) -> Option<R> + Copy),
) -> Option<()> {
    const { assert!(cluster_blocks(Variant::GATE_UP) == 2 && cluster_blocks(Variant::ROWS_NT) == 2) };
    const G: u32 = Variant::GATE_UP;
    const D: u32 = Variant::ROWS_NT;
    // Every phase walks one ring: the variants' ring shapes must agree.
    const { assert!(ring_stages(G) == ring_stages(D) && staging_boxes(G) == staging_boxes(D)) };
    // The phases are numbered as `ForwardHandover`'s.
    type F = ForwardHandover<false>;
    // Whether the pass has a shared expert (read again where used: no register held for it).
    let shared = move || !plan(F::SHARED_GATE_UP, first_rank()).is_null();
    let ring = Ring::new::<G>();
    let thread = sreg::thread_idx_x();
    if thread == 0 {
        // SAFETY: one thread, before any use; the launch gives the engine's shared memory.
        unsafe { init_barriers::<G, H>(ring, 16) };
    }
    // Both blocks' barriers initialised before either multicasts into the other.
    // SAFETY: every thread of both blocks of the pair (caller contract; thread 0's branch above
    // rejoins).
    unsafe { cluster::cluster_sync() };
    let warpgroup = thread / 128;
    let role = if warpgroup == 0 {
        // SAFETY: the whole producer warpgroup, its one `setmaxnreg`, down from the launch's 168
        // per thread (`.maxntid 384`, declared by the megakernels).
        unsafe { sync::release_registers::<MEGAKERNEL_PRODUCER_REGISTERS>() };
        // The producer: thread 0, which produces every phase, or, where the hooks may gather
        // the token rows, the whole first warp: the routed gate/up of a rank whose hooks
        // gather (`TileHooks::row_gather`: one GPU, `ForwardParams::gather_in_producer`) is
        // produced by all of it and the spare warps (`produce_gathering`), its other lanes
        // waiting for lane 0 until then.
        let producer_lanes = if H::MAY_GATHER_ROWS { GATHER_LANES } else { 1 };
        if thread < producer_lanes {
            let lane = thread;
            // SAFETY: the producer warp; the phases share the ring walk (a phase left out is
            // left out by the consumers too: `plan` is the same for the whole cluster). One loop
            // per phase over the ranks, so each call's hooks keep a constant phase.
            unsafe {
                let mut walk = Walk::START;
                let mut rank;
                // One phase's tiles over the ranks from `$first`, by lane 0 (written out per
                // phase: a function over the phases changed the kernels' code, a macro does not).
                macro_rules! produce_ranks {
                    ($v:ident, $phase:expr, $first:expr) => {
                        rank = $first;
                        while let Some(q) = rank {
                            walk = produce::<$v, H>(&*plan($phase, q), ring, hooks($phase, q), walk);
                            rank = next_rank(q);
                        }
                    };
                }
                if lane == 0 {
                    produce_ranks!(G, F::SHARED_GATE_UP, if shared() { Some(first_rank()) } else { None });
                }
                rank = Some(first_rank());
                while let Some(q) = rank {
                    let (p, phase_hooks) = (&*plan(F::GATE_UP, q), hooks(F::GATE_UP, q));
                    if let Some(rows) = phase_hooks.row_gather() {
                        // Every gathering thread learns where lane 0's walk stands (this whole
                        // warp is here: the branches above rejoin, and the trip count is the
                        // cluster's; the spare warps, if they gather, after their dispatch).
                        walk = share_walk::<G>(ring, walk, lane);
                        walk = produce_gathering::<G, H>(p, ring, (rows, phase_hooks), lane, walk);
                    } else if lane == 0 {
                        walk = produce::<G, H>(p, ring, phase_hooks, walk);
                    }
                    rank = next_rank(q);
                }
                if lane == 0 {
                    produce_ranks!(D, F::SHARED_DOWN, if shared() { Some(first_rank()) } else { None });
                    produce_ranks!(D, F::DOWN, Some(first_rank()));
                }
            }
        } else if thread >= GATHER_LANES {
            // The spare warps: the dispatch, under the gate/up MMAs. It waits for nothing, so
            // no tile ever waits on these warps for work they have not started.
            spare_warps();
            if H::MAY_GATHER_ROWS {
                // Then the routed gate/up's gathering, with the first warp, on the ranks whose
                // hooks gather (the first warp's loop above, step for step). The first warp
                // meets them there after producing the shared expert's gate/up, whose rows the
                // dispatch (which waits for nothing) writes, so no wait here is on work not
                // started.
                let mut rank = Some(first_rank());
                while let Some(q) = rank {
                    let phase_hooks = hooks(F::GATE_UP, q);
                    if let Some(rows) = phase_hooks.row_gather() {
                        // SAFETY: the gathering threads (this warpgroup's four warps), as the first
                        // warp's loop; the plan of a rank of the walk (caller contract).
                        unsafe {
                            let walk = share_walk::<G>(ring, Walk::START, thread);
                            produce_gathering::<G, H>(&*plan(F::GATE_UP, q), ring, (rows, phase_hooks), thread, walk);
                        }
                    }
                    rank = next_rank(q);
                }
            }
        }
        None
    } else {
        // SAFETY: a whole consumer warpgroup, its one `setmaxnreg`, up from the launch's 168 per
        // thread; the pool holds enough (gemm_layout's `fits`).
        unsafe { sync::claim_registers::<PAIRED_CONSUMER_REGISTERS>() };
        let (wg, t) = (warpgroup - 1, thread % 128);
        // SAFETY: a whole consumer warpgroup; both blocks' barriers initialised above.
        unsafe {
            let mut walk = Walk::START;
            let mut rank;
            // As the producer's `produce_ranks`, each phase's tiles then its closing stage.
            macro_rules! consume_ranks {
                ($v:ident, $phase:expr, $first:expr) => {
                    rank = $first;
                    while let Some(q) = rank {
                        walk = consume::<$v, H>(&*plan($phase, q), ring, wg, t, hooks($phase, q), walk);
                        walk = next_phase::<$v>(ring, walk, t);
                        rank = next_rank(q);
                    }
                };
            }
            consume_ranks!(G, F::SHARED_GATE_UP, if shared() { Some(first_rank()) } else { None });
            consume_ranks!(G, F::GATE_UP, Some(first_rank()));
            consume_ranks!(D, F::SHARED_DOWN, if shared() { Some(first_rank()) } else { None });
            // The last phase's final stage stays unreleased (as every kernel's last phase), so
            // every routed down phase after the first rank's starts by releasing the one before.
            rank = Some(first_rank());
            while let Some(q) = rank {
                walk = consume::<D, H>(&*plan(F::DOWN, q), ring, wg, t, hooks(F::DOWN, q), walk);
                rank = next_rank(q);
                if rank.is_some() {
                    walk = next_phase::<D>(ring, walk, t);
                }
            }
        }
        Some(())
    };
    // No block may leave its engine phases while its partner can still write into it.
    // SAFETY: as at the start: every thread comes here once its role above is done.
    unsafe { cluster::cluster_sync() };
    role
}

/// The compute role of the backward megakernel, in a 2-block cluster as
/// [`run_forward_phases`]: on one ring, ten phases — the shared expert's and then the routed
/// experts' down data gradient (d_hidden), then, after the consumer warps have run
/// `between_dgrads` (the SwiGLU backward: d_gate and d_up from d_hidden), the shared
/// expert's and then the routed experts' gate/up data gradient (all four [`Variant::ROWS_NN`]), the
/// routed experts' three weight gradients (down, gate, up), then the shared expert's three
/// ([`Variant::WGRAD_IN_PAIR`], each block walking its own share of the tiles) — phase `i`
/// running the tiles of the plan `plan(i, own)` returns (null: the phase is left out; only the
/// shared expert's are) with the hooks `hooks(i, own)`. Each
/// data gradient runs for rank `own` of the launch only (`tile_ranks` 1) or for each of its
/// `tile_ranks` ranks in turn, `plan(i, q)` and `hooks(i, q)` for q = 0, 1, … (taking tiles
/// from each rank's counter); each routed weight gradient likewise over `wgrad_ranks` ranks
/// (the hooks' walk then takes this block's share of every rank's tiles). A block moves on
/// (to the next rank's tiles or the next phase) only when it has no more tiles where it is
/// (the data gradients: the counter is spent), and a tile waits only for earlier phases of its
/// own rank, so it only ever waits for work a running block already holds
/// (docs/ARCHITECTURE.md); the consumers run `between_dgrads` after every rank's down dgrad.
/// The producer warpgroup's three spare warps (its first warp's thread 0 is the producer) run
/// `spare_warps` from the start, under the consumers' MMAs (the gather, then the SwiGLU
/// backward); in the gate and up weight gradients whose hooks gather B
/// ([`TileHooks::row_gather`]) the whole warpgroup produces, the first warp and, after
/// `spare_warps` returns, the spare warps (`gather::GATHER_WARPS`). Returns `Some(())` for
/// the consumer warpgroups' threads, `None` for the producer warpgroup's.
///
/// # Safety
/// Every non-null plan `plan` returns is a valid parameter block of its phase's variant, its
/// tile counter zeroed before the launch; the routed experts' phases are never null, and the
/// shared expert's (`BackwardHandover::SHARED_*`) all null or none; each expert set's plans are
/// over the same row groups; every consumer warp calling `between_dgrads` is safe, and it
/// waits only for down-dgrad tiles; every spare producer warp (with
/// [`MEGAKERNEL_PRODUCER_REGISTERS`] registers) calling `spare_warps` is safe, and it waits only
/// for down-dgrad tiles, after every gather unit it waits on has been taken by a warp that
/// waits for nothing, every wait bounded, and it returns (the spare warps then meet the first
/// warp at named barrier 3) without using that barrier or the ring's hand-out words; `plan`
/// returns the same for every block of the cluster; the hooks' contracts hold;
/// with `tile_ranks` or `wgrad_ranks` > 1 the same holds for every q below it, and every block
/// of the launch runs these phases with the same `tile_ranks` and `wgrad_ranks`; every thread of
/// both blocks of the cluster calls it.
#[inline(always)]
pub unsafe fn run_backward_phases<H: TileHooks>(
    plan: impl Fn(u32, u32) -> *const GemmParams + Copy,
    hooks: impl Fn(u32, u32) -> H + Copy,
    (spare_warps, between_dgrads): (impl Fn(), impl Fn()),
    own: u32,
    (tile_ranks, wgrad_ranks): (u32, u32),
) -> Option<()> {
    const { assert!(cluster_blocks(Variant::ROWS_NN) == 2) };
    const N: u32 = Variant::ROWS_NN;
    const W: u32 = Variant::WGRAD_IN_PAIR;
    // Every phase walks one ring: the variants' ring shapes must agree.
    const { assert!(ring_stages(N) == ring_stages(W) && staging_boxes(N) == staging_boxes(W)) };
    let ring = Ring::new::<N>();
    let thread = sreg::thread_idx_x();
    if thread == 0 {
        // SAFETY: one thread, before any use; the launch gives the engine's shared memory.
        unsafe { init_barriers::<N, H>(ring, 16) };
    }
    // SAFETY: every thread of both blocks of the pair (caller contract; thread 0's branch above
    // rejoins).
    unsafe { cluster::cluster_sync() };
    let warpgroup = thread / 128;
    // The four data gradients run as one loop (a runtime trip count: one inlined copy of the
    // variant, where a call per phase spilled the consumers' registers), the consumers leaving
    // it once for the SwiGLU backward after the down dgrads; the routed weight gradients are
    // three loops over the ranks whose tiles this block walks, one call each with a constant
    // phase in its hooks (short tiles, where a per-tile choice between expert sets cost 2–4 % of
    // the backward), the shared expert's a loop after them.
    // The phases are numbered as `BackwardHandover`'s; each routed data gradient follows the
    // shared expert's of the same product.
    type B = BackwardHandover<false>;
    let (plan_of, hooks_of) = (plan, hooks);
    let (plan, hooks) = (move |phase| plan_of(phase, own), move |phase| hooks_of(phase, own));
    let shared = !plan(B::SHARED_DOWN_DGRAD).is_null();
    // The ranks whose data-gradient tiles and routed weight gradients this block walks.
    let (tile_first, tile_end) = if tile_ranks > 1 { (0, tile_ranks) } else { (own, own + 1) };
    let (wgrad_first, wgrad_end) = if wgrad_ranks > 1 { (0, wgrad_ranks) } else { (own, own + 1) };
    let first = |shared_phase: u32| if shared { shared_phase } else { shared_phase + 1 };
    let end = if shared { B::PHASES } else { B::SHARED_WGRAD_DOWN };
    let role = if warpgroup == 0 {
        // SAFETY: the whole producer warpgroup, its one `setmaxnreg`, down from the launch's 168
        // per thread (`.maxntid 384`, declared by the megakernels).
        unsafe { sync::release_registers::<MEGAKERNEL_PRODUCER_REGISTERS>() };
        // The producer: thread 0, or where the hooks may gather the token rows the whole first
        // warp, which produces the routed gate and up weight gradients of a rank whose hooks
        // gather B (`TileHooks::row_gather`: one GPU, `BackwardParams::gather_in_producer`),
        // its other lanes waiting for lane 0 until then.
        let producer_lanes = if H::MAY_GATHER_ROWS { GATHER_LANES } else { 1 };
        if thread < producer_lanes {
            let lane = thread;
            // SAFETY: the producer warp; the phases share the ring walk (a phase left out is
            // left out by the consumers too). Each plan is read where its phase starts.
            unsafe {
                let mut walk = Walk::START;
                if lane == 0 {
                    let mut phase = first(B::SHARED_DOWN_DGRAD);
                    while phase <= B::GATE_UP_DGRAD {
                        let mut q = tile_first;
                        while q < tile_end {
                            walk = produce::<N, H>(&*plan_of(phase, q), ring, hooks_of(phase, q), walk);
                            q += 1;
                        }
                        // Without a shared expert its gate/up dgrad is skipped too.
                        phase += if phase == B::DOWN_DGRAD && !shared { 2 } else { 1 };
                    }
                    // One loop per product, so each call's hooks keep a constant phase.
                    let mut q = wgrad_first;
                    while q < wgrad_end {
                        walk = produce::<W, H>(&*plan_of(B::WGRAD_DOWN, q), ring, hooks_of(B::WGRAD_DOWN, q), walk);
                        q += 1;
                    }
                }
                // The gate and up weight gradients, B gathered by the whole warp with the spare
                // warps (below) or loaded by lane 0 (written out per product: the hooks keep a
                // constant phase).
                macro_rules! produce_gathered_b {
                    ($phase:expr) => {
                        let mut q = wgrad_first;
                        while q < wgrad_end {
                            let (p, phase_hooks) = (&*plan_of($phase, q), hooks_of($phase, q));
                            if let Some(rows) = phase_hooks.row_gather() {
                                // Every gathering thread learns where lane 0's walk stands (this
                                // whole warp is here: the branches above rejoin, the trip count
                                // is the launch's; the spare warps after their chunks), as in
                                // the forward.
                                walk = share_walk::<W>(ring, walk, lane);
                                walk = produce_gathering::<W, H>(p, ring, (rows, phase_hooks), lane, walk);
                            } else if lane == 0 {
                                walk = produce::<W, H>(p, ring, phase_hooks, walk);
                            }
                            q += 1;
                        }
                    };
                }
                produce_gathered_b!(B::WGRAD_GATE);
                produce_gathered_b!(B::WGRAD_UP);
                if lane == 0 {
                    let mut phase = B::SHARED_WGRAD_DOWN;
                    while phase < end {
                        walk = produce::<W, H>(&*plan(phase), ring, hooks(phase), walk);
                        phase += 1;
                    }
                }
            }
        } else if thread >= GATHER_LANES {
            // The spare warps: the gather and then the SwiGLU backward, under the MMAs. The
            // gather waits for nothing; the SwiGLU chunks wait on down-dgrad tiles alone, and
            // every gather chunk a down-dgrad tile waits on is held by a warp that finishes it
            // without waiting.
            spare_warps();
            if H::MAY_GATHER_ROWS {
                // Then the gate and up weight gradients' gathering, with the first warp, on the
                // ranks whose hooks gather (the first warp's `produce_gathered_b!` loops, step
                // for step). The first warp meets them there after producing every data
                // gradient and the down weight gradient: by then every down-dgrad tile has been
                // taken by a producer that finishes it without meeting anyone, so the SwiGLU
                // chunks these warps finished first waited on nothing that waits for them, and
                // once here they hold no chunk that any tile waits on.
                for phase in [B::WGRAD_GATE, B::WGRAD_UP] {
                    let mut q = wgrad_first;
                    while q < wgrad_end {
                        let phase_hooks = hooks_of(phase, q);
                        if let Some(rows) = phase_hooks.row_gather() {
                            // SAFETY: the gathering threads (this warpgroup's four warps), as
                            // the first warp's loops; the plan of a rank of the walk (caller
                            // contract).
                            unsafe {
                                let walk = share_walk::<W>(ring, Walk::START, thread);
                                produce_gathering::<W, H>(&*plan_of(phase, q), ring, (rows, phase_hooks), thread, walk);
                            }
                        }
                        q += 1;
                    }
                }
            }
        }
        None
    } else {
        // SAFETY: a whole consumer warpgroup, its one `setmaxnreg`, up from the launch's 168 per
        // thread; the pool holds enough (gemm_layout's `fits`).
        unsafe { sync::claim_registers::<PAIRED_CONSUMER_REGISTERS>() };
        let (wg, t) = (warpgroup - 1, thread % 128);
        // SAFETY: a whole consumer warpgroup; both blocks' barriers initialised above.
        unsafe {
            let mut walk = Walk::START;
            let mut phase = first(B::SHARED_DOWN_DGRAD);
            while phase <= B::GATE_UP_DGRAD {
                let mut q = tile_first;
                while q < tile_end {
                    walk = consume::<N, H>(&*plan_of(phase, q), ring, wg, t, hooks_of(phase, q), walk);
                    walk = next_phase::<N>(ring, walk, t);
                    q += 1;
                }
                // After every rank's down dgrad: SwiGLU chunks (across ranks with shared tiles,
                // every rank's in the walk's order; else this rank's).
                if phase == B::DOWN_DGRAD {
                    between_dgrads();
                }
                phase += if phase == B::DOWN_DGRAD && !shared { 2 } else { 1 };
            }
            // The last phase's final stage stays unreleased (as every kernel's last phase), so
            // every weight-gradient phase but the first starts by releasing the one before.
            let mut q = wgrad_first;
            while q < wgrad_end {
                if q != wgrad_first {
                    walk = next_phase::<W>(ring, walk, t);
                }
                walk = consume::<W, H>(&*plan_of(B::WGRAD_DOWN, q), ring, wg, t, hooks_of(B::WGRAD_DOWN, q), walk);
                q += 1;
            }
            q = wgrad_first;
            while q < wgrad_end {
                walk = next_phase::<W>(ring, walk, t);
                walk = consume::<W, H>(&*plan_of(B::WGRAD_GATE, q), ring, wg, t, hooks_of(B::WGRAD_GATE, q), walk);
                q += 1;
            }
            q = wgrad_first;
            while q < wgrad_end {
                walk = next_phase::<W>(ring, walk, t);
                walk = consume::<W, H>(&*plan_of(B::WGRAD_UP, q), ring, wg, t, hooks_of(B::WGRAD_UP, q), walk);
                q += 1;
            }
            phase = B::SHARED_WGRAD_DOWN;
            while phase < end {
                walk = next_phase::<W>(ring, walk, t);
                walk = consume::<W, H>(&*plan(phase), ring, wg, t, hooks(phase), walk);
                phase += 1;
            }
        }
        Some(())
    };
    // No block may leave its engine phases while its partner can still write into it.
    // SAFETY: as at the start: every thread comes here once its role above is done.
    unsafe { cluster::cluster_sync() };
    role
}
