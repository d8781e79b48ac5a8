//! The forward megakernel from the host (`mok_sm90_forward`, kernels/src/megakernel/): its
//! parameter block, its counters and its launch. A layer switches it on with
//! [`UnfusedLayer::set_forward_megakernel`](crate::unfused::UnfusedLayer::set_forward_megakernel);
//! the pass reads the same engine plans (tile lists, tensor maps) as the engine path and writes
//! the same buffers, so the backward reads what it always reads.

use std::time::Duration;

use mok_kernels::comm::params::ERROR_WORDS;
use mok_kernels::gemm_layout::{ENGINE_SMEM_BYTES, ENGINE_THREADS};
use mok_kernels::megakernel_layout::{ForwardParams, NO_FAULT, WORK_ALL, first_compute_block};

use crate::driver::{DeviceBuffer, Gpu, KernelArg, LaunchShape};
use crate::error::{MokError, Result};
use crate::gemm::{EnginePlan, engine_error, plain_bytes};

/// The forward megakernel's entry point.
pub const FORWARD_KERNEL: &str = "mok_sm90_forward";

/// How a forward megakernel pass is laid out on the GPU. Results do not depend on any of it.
#[derive(Clone, Debug, PartialEq)]
pub struct MegakernelOptions {
    /// Blocks that only move rows (dispatch and combine; every other block also computes); `None`:
    /// [`DEFAULT_COMM_BLOCKS`].
    pub comm_blocks: Option<u32>,
    /// Blocks of the whole launch; `None`: as many 2-block clusters as can be resident at once.
    /// Must be co-resident (at most that many) and leave at least one compute pair.
    pub blocks: Option<u32>,
    /// How long any one wait of the pass may take before it is reported as
    /// [`MokError::Timeout`].
    pub timeout: Duration,
}

impl Default for MegakernelOptions {
    fn default() -> Self {
        Self { comm_blocks: None, blocks: None, timeout: Duration::from_secs(5) }
    }
}

/// The comm blocks used when the options name none: 0 on one GPU, where every block dispatches,
/// computes and combines (measured fastest of 0, 2, 4, 8 and 16 comm blocks on the frontier
/// shapes, docs/PERF.md).
pub const DEFAULT_COMM_BLOCKS: u32 = 0;

/// Faults a test can inject into the next passes (feature `testing`): an M tile whose rows are
/// gathered but never published, and one whose gate/up parts are stored but never counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MegakernelFaults {
    /// The comm side never publishes this M tile's rows.
    pub silent_rows_tile: Option<u32>,
    /// The compute side never counts this M tile's gate/up parts (its down tiles wait).
    pub silent_hidden_tile: Option<u32>,
}

/// Which work a megakernel pass does (set with `UnfusedLayer::set_megakernel_work`, feature
/// `testing`; the benchmark's overlap measurement). Only [`MegakernelWork::ALL`] computes the
/// layer; the others time one side of the pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MegakernelWork(pub(crate) u32);

impl MegakernelWork {
    /// A real pass.
    pub const ALL: Self = Self(WORK_ALL);
    /// Only the row moving: the dispatch copies and the combine (which then does not wait for
    /// GEMM tiles and sums whatever the down rows hold).
    pub const COMM_ONLY: Self =
        Self(mok_kernels::megakernel_layout::WORK_COPY_ROWS | mok_kernels::megakernel_layout::WORK_COMBINE);
    /// Only the GEMM tiles, on rows left in place by an earlier pass (the dispatch publishes
    /// without copying; no combine).
    pub const COMPUTE_ONLY: Self = Self(mok_kernels::megakernel_layout::WORK_GEMMS);
    /// Nothing but the hand-out of the dispatch queue: the schedule and an empty launch.
    pub const NONE: Self = Self(0);
}

/// A layer's forward megakernel: the parameter block (fixed for the layer's buffers and plans),
/// the counters and the launch geometry.
pub(crate) struct ForwardMegakernel {
    host: ForwardParams,
    params: DeviceBuffer<u8>,
    /// `[M tiles]` dispatched flags, `[M tiles]` gate/up parts, `[M tiles]` down parts, the
    /// combine's next token, the dispatch's next M tile: cleared together (one memset) before
    /// each pass.
    pass_counters: DeviceBuffer<u32>,
    error: DeviceBuffer<u32>,
    blocks: u32,
    /// The plans the parameter block points at (their parameter blocks' addresses).
    built_for: [u64; 2],
}

/// The layer buffers a pass reads and writes, besides the plans'.
pub(crate) struct PassBuffers {
    /// `[R]` the slot each expert-ordered row holds.
    pub row_source: u64,
    /// `[T·k]` the row of each slot.
    pub slot_row: u64,
    /// `[cap][H]` bf16 dispatched rows (the gate/up plan's A).
    pub rows: u64,
    /// `[cap][H]` f32 down rows (the down plan's output).
    pub down_rows: u64,
    /// `[T][H]` bf16 output.
    pub y: u64,
    /// k, H.
    pub top_k: u32,
    pub hidden: u32,
}

impl ForwardMegakernel {
    pub(crate) fn new(
        gpu: &Gpu,
        plans: [&EnginePlan; 2],
        buffers: &PassBuffers,
        options: &MegakernelOptions,
    ) -> Result<Self> {
        if !gpu.has_kernel(FORWARD_KERNEL) {
            return Err(MokError::InvalidInput {
                tensor: "megakernel",
                problem: format!("the loaded PTX has no {FORWARD_KERNEL} (it needs sm_90a)"),
            });
        }
        if plans[0].kernel() != "mok_sm90_gemm_gate_up" || plans[1].kernel() != "mok_sm90_gemm_rows_nt" {
            return Err(MokError::InvalidInput {
                tensor: "megakernel",
                problem: format!(
                    "runs a gate/up and an f32 down plan, not {} and {}",
                    plans[0].kernel(),
                    plans[1].kernel()
                ),
            });
        }
        gpu.set_max_dynamic_smem(FORWARD_KERNEL, ENGINE_SMEM_BYTES)?;
        let clusters = gpu.max_active_clusters(FORWARD_KERNEL, ENGINE_THREADS, ENGINE_SMEM_BYTES, 2)?;
        let resident = (2 * clusters).min(gpu.multiprocessors().next_multiple_of(2));
        let blocks = options.blocks.unwrap_or(resident);
        let comm_blocks = options.comm_blocks.unwrap_or(DEFAULT_COMM_BLOCKS);
        if blocks > resident || !blocks.is_multiple_of(2) {
            return Err(MokError::InvalidInput {
                tensor: "megakernel blocks",
                problem: format!(
                    "{blocks}: the pass needs every block resident at once, in 2-block clusters (at most {resident} here, even)"
                ),
            });
        }
        if first_compute_block(comm_blocks) + 2 > blocks {
            return Err(MokError::InvalidInput {
                tensor: "megakernel comm blocks",
                problem: format!(
                    "{comm_blocks} of {blocks} blocks: the comm blocks, rounded up to a pair, must leave at least one compute pair"
                ),
            });
        }
        let m_tiles = plans[0].max_m_tiles().max(plans[1].max_m_tiles()).max(1);
        let pass_counters = DeviceBuffer::from_slice(gpu, &vec![0u32; 3 * m_tiles + 2])?;
        let error = DeviceBuffer::from_slice(gpu, &[0u32; ERROR_WORDS])?;
        let counters = pass_counters.device_ptr();
        let host = ForwardParams {
            gate_up: plans[0].params_ptr(),
            down: plans[1].params_ptr(),
            row_source: buffers.row_source,
            slot_row: buffers.slot_row,
            rows: buffers.rows,
            down_rows: buffers.down_rows,
            y: buffers.y,
            rows_dispatched: counters,
            gate_up_stored: counters + 4 * m_tiles as u64,
            down_stored: counters + 8 * m_tiles as u64,
            combine_next: counters + 12 * m_tiles as u64,
            dispatch_next: counters + 12 * m_tiles as u64 + 4,
            error: error.device_ptr(),
            timeout_ns: options.timeout.as_nanos().min(u64::MAX as u128) as u64,
            top_k: buffers.top_k,
            hidden: buffers.hidden,
            comm_blocks,
            silent_rows_tile: NO_FAULT,
            silent_hidden_tile: NO_FAULT,
            work: WORK_ALL,
        };
        // SAFETY: ForwardParams is repr(C) plain data: fourteen u64 and six u32, no padding (136
        // bytes, asserted in megakernel_layout).
        let params = DeviceBuffer::from_slice(gpu, unsafe { plain_bytes(&host) })?;
        Ok(Self {
            host,
            params,
            pass_counters,
            error,
            blocks,
            built_for: [plans[0].params_ptr(), plans[1].params_ptr()],
        })
    }

    /// Whether this pass was built for these plans.
    pub(crate) fn built_for(&self, plans: [&EnginePlan; 2]) -> bool {
        self.built_for == [plans[0].params_ptr(), plans[1].params_ptr()]
    }

    /// Blocks of the launch, and of them the comm blocks.
    pub(crate) fn geometry(&self) -> (u32, u32) {
        (self.blocks, self.host.comm_blocks)
    }

    /// Sets the work of the following passes (benchmarks).
    #[cfg(feature = "testing")]
    pub(crate) fn set_work(&mut self, work: MegakernelWork) -> Result<()> {
        self.host.work = work.0;
        self.upload_params()
    }

    /// Uploads the parameter block again after a test hook changed it.
    #[cfg(feature = "testing")]
    fn upload_params(&mut self) -> Result<()> {
        // SAFETY: as in `new`.
        self.params.upload(unsafe { plain_bytes(&self.host) })
    }

    /// Sets the faults of the following passes (tests).
    #[cfg(feature = "testing")]
    pub(crate) fn set_faults(&mut self, faults: MegakernelFaults) -> Result<()> {
        self.host.silent_rows_tile = faults.silent_rows_tile.unwrap_or(NO_FAULT);
        self.host.silent_hidden_tile = faults.silent_hidden_tile.unwrap_or(NO_FAULT);
        self.upload_params()
    }

    /// Enqueues one pass of `tokens` tokens (at most the layer's capacity): cuts both plans'
    /// group maps (zeroing their tile counters), clears the pass counters, then the megakernel.
    /// `x` `[T][H]` bf16, `topk_weights` `[T·k]` f32 and `shared_rows` `[T][H]` f32 (0 for none)
    /// must stay allocated until the stream has run it.
    pub(crate) fn launch(
        &mut self,
        gpu: &Gpu,
        plans: [&EnginePlan; 2],
        x: u64,
        topk_weights: u64,
        shared_rows: u64,
        tokens: u32,
    ) -> Result<()> {
        if !self.built_for(plans) {
            return Err(MokError::InvalidInput {
                tensor: "megakernel",
                problem: "built for other engine plans".into(),
            });
        }
        for plan in plans {
            plan.cut_group_maps(gpu)?;
        }
        self.pass_counters.fill_bytes(0)?;
        let shape = LaunchShape { grid: (self.blocks, 1, 1), threads: ENGINE_THREADS, smem_bytes: ENGINE_SMEM_BYTES };
        let args = [
            KernelArg::Ptr(self.params.device_ptr()),
            KernelArg::Ptr(x),
            KernelArg::Ptr(topk_weights),
            KernelArg::Ptr(shared_rows),
            KernelArg::U32(tokens),
        ];
        // SAFETY: `mok_sm90_forward`'s parameters in order and type; the parameter block points
        // at the layer's live buffers and the plans' parameter blocks (checked above), its
        // counters hold an entry per M tile the plans' groups can have, cleared above on the
        // stream; the grid is co-resident (checked in `new`); the caller keeps x, the weights
        // and the shared rows alive until the stream has run the pass.
        unsafe { gpu.launch(FORWARD_KERNEL, shape, &args) }
    }

    /// Waits for the stream (the download does) and reports the first failure of the last
    /// pass, clearing it so the next pass starts clean.
    pub(crate) fn check(&mut self) -> Result<()> {
        let words = self.error.download()?;
        match engine_error(&words, None) {
            None => Ok(()),
            Some(error) => {
                self.error.upload(&[0; ERROR_WORDS])?;
                Err(error)
            }
        }
    }
}

#[cfg(test)]
mod work_order_model {
    //! A model of the forward megakernel's work order, run on the CPU over many random
    //! geometries, routings and interleavings: blocks take dispatch tiles, gate/up tiles, down
    //! tiles and combine tokens from four queues in that order; a compute pair's producer takes
    //! the next GEMM tile while its consumers still finish the one before (its rows already
    //! loaded, so it never waits); every unit waits only on the counters it reads in the kernel.
    //! The property checked is the one docs/ARCHITECTURE.md argues: whatever the interleaving,
    //! every unit completes (no state where every unfinished agent waits).

    /// Deterministic xorshift for the interleavings.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    #[derive(Clone, Copy, PartialEq, Debug)]
    enum Unit {
        Dispatch(usize),
        GateUp(usize),
        Down(usize),
        Combine(usize),
    }

    struct World {
        /// Per M tile: dispatched, gate/up tiles stored, down tiles stored.
        dispatched: Vec<bool>,
        gate_up_done: Vec<usize>,
        down_done: Vec<usize>,
        /// Tiles per M tile of each GEMM (N tiles), and the M tiles each token's slots sit in.
        n_gate_up: usize,
        n_down: usize,
        token_tiles: Vec<Vec<usize>>,
        /// Next unit of each queue.
        next: [usize; 4],
        combined: usize,
    }

    impl World {
        fn m_tiles(&self) -> usize {
            self.dispatched.len()
        }
        /// Takes the next unit of queue `q` (dispatch, gate/up, down, combine), `None` when spent.
        fn take(&mut self, q: usize) -> Option<Unit> {
            let len =
                [self.m_tiles(), self.m_tiles() * self.n_gate_up, self.m_tiles() * self.n_down, self.token_tiles.len()]
                    [q];
            let i = self.next[q];
            if i >= len {
                return None;
            }
            self.next[q] += 1;
            Some(match q {
                0 => Unit::Dispatch(i),
                1 => Unit::GateUp(i / self.n_gate_up),
                2 => Unit::Down(i / self.n_down),
                _ => Unit::Combine(i),
            })
        }
        /// Whether `unit`'s inputs are ready (what its wait in the kernel reads).
        fn ready(&self, unit: Unit) -> bool {
            match unit {
                Unit::Dispatch(_) => true,
                Unit::GateUp(m) => self.dispatched[m],
                Unit::Down(m) => self.gate_up_done[m] == self.n_gate_up,
                Unit::Combine(t) => self.token_tiles[t].iter().all(|&m| self.down_done[m] == self.n_down),
            }
        }
        fn finish(&mut self, unit: Unit) {
            match unit {
                Unit::Dispatch(m) => self.dispatched[m] = true,
                Unit::GateUp(m) => self.gate_up_done[m] += 1,
                Unit::Down(m) => self.down_done[m] += 1,
                Unit::Combine(_) => self.combined += 1,
            }
        }
    }

    /// An agent: a comm block (dispatch, then combine), or a compute pair, whose producer may
    /// hold the next GEMM tile (waiting on it) while its consumers hold the current one (whose
    /// rows are loaded: it completes without waiting).
    struct Agent {
        /// The queues it takes from, in order.
        queues: Vec<usize>,
        phase: usize,
        /// The producer's next tile (loaded once ready) and the consumers' current one.
        next: Option<Unit>,
        current: Option<Unit>,
        done: bool,
    }

    impl Agent {
        /// One step; `true` if anything changed.
        fn step(&mut self, world: &mut World, rng: &mut Rng) -> bool {
            if self.done {
                return false;
            }
            // Consumers: the current tile's rows are loaded, so it finishes.
            if let Some(unit) = self.current
                && rng.below(2) == 0
            {
                world.finish(unit);
                self.current = None;
                return true;
            }
            // Producer: load the next tile once its inputs are ready (the bounded wait), handing
            // it to the consumers when they are free; else take one.
            if let Some(unit) = self.next {
                if world.ready(unit) && self.current.is_none() {
                    let gemm = matches!(unit, Unit::GateUp(_) | Unit::Down(_));
                    if gemm {
                        self.current = Some(unit);
                    } else {
                        // Dispatch and combine run on the whole block, not pipelined.
                        world.finish(unit);
                    }
                    self.next = None;
                    return true;
                }
                return false;
            }
            while self.phase < self.queues.len() {
                if let Some(unit) = world.take(self.queues[self.phase]) {
                    self.next = Some(unit);
                    return true;
                }
                self.phase += 1;
            }
            if self.current.is_none() {
                self.done = true;
                return true;
            }
            false
        }
    }

    #[test]
    fn every_geometry_and_interleaving_completes() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for case in 0..400 {
            let m_tiles = 1 + rng.below(40);
            let (n_gate_up, n_down) = (1 + rng.below(4), 1 + rng.below(4));
            let tokens = 1 + rng.below(60);
            let k = 1 + rng.below(4).min(m_tiles - 1);
            let token_tiles = (0..tokens).map(|_| (0..k).map(|_| rng.below(m_tiles)).collect()).collect();
            let comm_blocks = rng.below(4);
            let pairs = 1 + rng.below(6);
            let mut world = World {
                dispatched: vec![false; m_tiles],
                gate_up_done: vec![0; m_tiles],
                down_done: vec![0; m_tiles],
                n_gate_up,
                n_down,
                token_tiles,
                next: [0; 4],
                combined: 0,
            };
            let agent = |queues: Vec<usize>| Agent { queues, phase: 0, next: None, current: None, done: false };
            let mut agents: Vec<Agent> = (0..comm_blocks).map(|_| agent(vec![0, 3])).collect();
            agents.extend((0..pairs).map(|_| agent(vec![0, 1, 2, 3])));
            let mut idle_rounds = 0;
            while agents.iter().any(|a| !a.done) {
                let i = rng.below(agents.len());
                if agents[i].step(&mut world, &mut rng) {
                    idle_rounds = 0;
                } else {
                    idle_rounds += 1;
                    // Every agent stuck for long: try each once deterministically before calling it a deadlock.
                    if idle_rounds > 10_000 {
                        let progress = (0..agents.len()).any(|j| (0..4).any(|_| agents[j].step(&mut world, &mut rng)));
                        assert!(
                            progress,
                            "case {case}: deadlock with {comm_blocks} comm blocks, {pairs} pairs, {m_tiles} M tiles"
                        );
                        idle_rounds = 0;
                    }
                }
            }
            assert!(world.dispatched.iter().all(|&d| d), "case {case}: a tile never dispatched");
            assert!(world.gate_up_done.iter().all(|&n| n == n_gate_up), "case {case}");
            assert!(world.down_done.iter().all(|&n| n == n_down), "case {case}");
            assert_eq!(world.combined, tokens, "case {case}");
        }
    }

    #[test]
    fn taking_a_later_queue_early_can_deadlock() {
        // The order matters: an agent that took a down tile before the gate/up queue was spent
        // could wait on gate/up work nobody holds. One pair whose producer takes the down tile of
        // an M tile first waits forever: the only agent, and its wait is on work not yet taken.
        let mut world = World {
            dispatched: vec![true],
            gate_up_done: vec![0],
            down_done: vec![0],
            n_gate_up: 1,
            n_down: 1,
            token_tiles: vec![vec![0]],
            next: [1, 0, 0, 0],
            combined: 0,
        };
        let mut rng = Rng(7);
        let mut wrong = Agent { queues: vec![2, 1, 3], phase: 0, next: None, current: None, done: false };
        let progress = (0..100).filter(|_| wrong.step(&mut world, &mut rng)).count();
        assert_eq!(progress, 1, "only the take of the down tile happens; then it waits forever");
        assert!(!wrong.done && world.down_done[0] == 0);
    }
}
