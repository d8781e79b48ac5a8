//! The expert-parallel exchange, driven from the host: the symmetric heap, the device-side
//! schedule, and the movers of both passes, as standalone kernels enqueued per rank.
//!
//! One pass, per rank (each step is a launch on the rank's GPU's stream — the schedule's steps
//! one launch for every virtual rank of a GPU, one grid row each, the movers one per rank; a
//! kernel boundary separates the steps, so every wait is on a signal an earlier launch gave —
//! see `docs/ARCHITECTURE.md`):
//!
//! ```text
//! forward:  schedule()         route own slots, prepare, publish epoch, exchange counts, ring map
//!           dispatch()         pull x rows from token owners into the ring; count rows per tile
//!           (compute)          the expert GEMMs read the ring (unfused::ExpertCompute)
//!           combine(rows)      push f32 result rows into token owners' slots; owners wait, sum
//! backward: begin_backward()   publish epoch: dy is ready
//!           reverse_combine()  pull dy rows scaled by the slot weight into the ring
//!           (compute)
//!           reverse_dispatch() push f32 dx rows into token owners' slots; owners wait, sum
//! ```
//!
//! The host never waits inside a pass: errors (a wait that ran out of time, a ring too small)
//! are written by the kernels to each rank's error record and read by [`Exchange::check_errors`]
//! after the pass.

pub mod reference;

use std::time::Duration;

use bytemuck::Pod;
use half::bf16;
use mok_kernels::comm::error as codes;
use mok_kernels::comm::params::{
    BULK_SMEM_BYTES, BULK_THREADS, CLEAR_SLOT_READY, ERROR_WORDS, ExchangeParams, ExchangeShape, HeapRegions,
};
use mok_kernels::layout;

use crate::config::MoeConfig;
use crate::driver::{DeviceBuffer, DeviceSlice, Gpu, KernelArg, LaunchShape};
use crate::error::{MokError, Result};
use crate::problem::RoutedTokens;
use crate::symmetric::{HeapRequest, SymmetricHeap};
use crate::unfused::{RANK_CHUNK_THREADS, ROW_KERNEL_THREADS, grid_stride_blocks};

use KernelArg::{Ptr, U32};

/// Threads of the warp-based movers' blocks.
const MOVER_THREADS: u32 = 256;

/// How an exchange is built.
#[derive(Clone, Copy, Debug)]
pub struct ExchangeOptions {
    /// Rows each expert owner's receive ring holds; `None` sizes it for the worst case
    /// (`P · T · min(k, E/P)`: every slot of every rank routed to one owner). `Some(0)` is
    /// refused.
    pub capacity_rows: Option<usize>,
    /// How long any device-side wait may take before the pass reports it (at most
    /// [`crate::config::MAX_WAIT_NS`], about 36 years; a longer one is that).
    pub timeout: Duration,
    /// Move unscaled rows (forward dispatch, both pushes) with bulk copies through shared memory
    /// instead of 16-byte vector loads and stores.
    pub bulk_copies: bool,
}

impl Default for ExchangeOptions {
    fn default() -> Self {
        Self { capacity_rows: None, timeout: Duration::from_secs(5), bulk_copies: false }
    }
}

/// A rank made silent on purpose, to test that waits on it are bounded and reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Silence {
    /// The rank never publishes its epoch (the schedule, the reverse-combine and, across
    /// processes, the wait before the backward megakernel wait on it).
    Publish,
    /// The rank never pushes its rows (its token owners' combines wait on it).
    Push,
}

/// The exchange of P ranks over one symmetric heap.
pub struct Exchange {
    shape: ExchangeShape,
    params: ExchangeParams,
    /// The parameter block on each GPU (one entry when every rank shares one GPU).
    params_on_gpu: Vec<DeviceBuffer<u8>>,
    heap: SymmetricHeap,
    epoch: u32,
    options: ExchangeOptions,
    silent: Option<(usize, Silence)>,
}

/// The GPU that drives local rank `i` of `local_ranks`: `gpus` holds one GPU for every local
/// rank, or a single GPU that drives them all; any other list is an `InvalidInput`, whatever
/// `i`, so a step refuses it before its first launch.
fn gpu_of<'a, G>(gpus: &[&'a G], local_ranks: usize, i: usize) -> Result<&'a G> {
    match gpus {
        [only] => Ok(only),
        _ if gpus.len() == local_ranks && i < local_ranks => Ok(gpus[i]),
        _ => Err(MokError::InvalidInput {
            tensor: "gpus",
            problem: format!("{} GPUs for {local_ranks} local ranks (one, or one per local rank)", gpus.len()),
        }),
    }
}

/// Consecutive local ranks one launch of an exchange step acts for ([`Exchange::rank_runs`]).
#[derive(Debug, PartialEq, Eq)]
struct RankRun {
    /// Local index of the first (its GPU and parameter block serve the run).
    local: usize,
    first_rank: u32,
    ranks: u32,
}

/// [`Exchange::rank_runs`] for local ranks `locals` (in local order), which one launch can serve
/// together only when `shared_launch` (one GPU and one parameter block for all of them).
fn rank_runs(locals: &[usize], shared_launch: bool, skip: Option<usize>) -> Vec<RankRun> {
    let mut runs: Vec<RankRun> = Vec::new();
    for (i, &rank) in locals.iter().enumerate() {
        if skip == Some(rank) {
            continue;
        }
        match runs.last_mut() {
            Some(run) if shared_launch && run.first_rank + run.ranks == rank as u32 => run.ranks += 1,
            _ => runs.push(RankRun { local: i, first_rank: rank as u32, ranks: 1 }),
        }
    }
    runs
}

impl Exchange {
    /// The shape of the exchange for `config` (P = `config.ep_ranks`).
    pub fn shape_for(config: &MoeConfig, options: &ExchangeOptions) -> Result<ExchangeShape> {
        config.validate()?;
        let (p, t, k, e) = (config.ep_ranks, config.tokens_per_rank, config.top_k, config.num_experts);
        let worst = p * t * k.min(e / p);
        let capacity = options.capacity_rows.unwrap_or(worst);
        if p * t * k > i32::MAX as usize {
            return Err(MokError::InvalidConfig {
                field: "tokens_per_rank",
                value: t.to_string(),
                rule: "ep_ranks * tokens_per_rank * top_k must fit in i32".into(),
            });
        }
        if capacity == 0 || capacity > i32::MAX as usize {
            return Err(MokError::InvalidConfig {
                field: "capacity_rows",
                value: capacity.to_string(),
                rule: "a ring holds 1 to i32::MAX rows (the layer's `ring_rows`)".into(),
            });
        }
        Ok(ExchangeShape {
            world: p as u32,
            tokens: t as u32,
            top_k: k as u32,
            num_experts: e as u32,
            hidden: config.hidden as u32,
            capacity: capacity as u32,
        })
    }

    /// Bytes of one rank's slice of the heap for `config` (to build a heap of another backend).
    pub fn heap_bytes_per_rank(config: &MoeConfig, options: &ExchangeOptions) -> Result<u64> {
        Ok(HeapRegions::new(&Self::shape_for(config, options)?).bytes)
    }

    /// What each rank's heap is asked for in a job of one process per rank
    /// ([`SymmetricHeap::multi_process`]): [`Self::heap_bytes_per_rank`], and a layout digest of
    /// `config` and the heap's regions, so ranks whose layers differ in anything (a width, the
    /// ring, the SwiGLU limit) are refused when their heaps are built instead of exchanging rows
    /// laid out differently.
    pub fn heap_request(config: &MoeConfig, options: &ExchangeOptions) -> Result<HeapRequest> {
        let shape = Self::shape_for(config, options)?;
        Ok(Self::request_for(config, &shape, &HeapRegions::new(&shape)))
    }

    /// [`Self::heap_request`] from the shape and regions worked out of `config`.
    fn request_for(config: &MoeConfig, shape: &ExchangeShape, regions: &HeapRegions) -> HeapRequest {
        HeapRequest::described(regions.bytes, &format!("{config:?}|{shape:?}|{regions:?}"))
    }

    /// Virtual ranks: every rank of `config` in one heap on `gpu` (backend (a)).
    pub fn new_virtual(gpu: &Gpu, config: &MoeConfig, options: ExchangeOptions) -> Result<Self> {
        let heap = SymmetricHeap::virtual_ranks(gpu, config.ep_ranks, Self::heap_bytes_per_rank(config, &options)?)?;
        Self::with_heap(&[gpu], config, options, heap)
    }

    /// An exchange over an existing heap (any backend) whose slices hold
    /// [`Self::heap_bytes_per_rank`]; `gpus` drive the heap's local ranks (one GPU for all, or
    /// one per local rank).
    pub fn with_heap(gpus: &[&Gpu], config: &MoeConfig, options: ExchangeOptions, heap: SymmetricHeap) -> Result<Self> {
        let shape = Self::shape_for(config, &options)?;
        let regions = HeapRegions::new(&shape);
        if heap.world() != config.ep_ranks || heap.bytes_per_rank() < regions.bytes {
            return Err(MokError::InvalidInput {
                tensor: "symmetric heap",
                problem: format!(
                    "{} ranks of {} bytes, the exchange needs {} ranks of {} bytes",
                    heap.world(),
                    heap.bytes_per_rank(),
                    config.ep_ranks,
                    regions.bytes
                ),
            });
        }
        let asked = Self::request_for(config, &shape, &regions);
        if heap.layout() != 0 && heap.layout() != asked.layout {
            return Err(MokError::InvalidInput {
                tensor: "symmetric heap",
                problem: format!(
                    "asked for layout {:#018x}, this layer lays it out as {:#018x}: build the heap with \
                     Exchange::heap_request of this layer's config and options",
                    heap.layout(),
                    asked.layout
                ),
            });
        }
        if gpus.len() != 1 && gpus.len() != heap.local_ranks().len() {
            return Err(MokError::InvalidInput {
                tensor: "gpus",
                problem: format!("{} GPUs for {} local ranks", gpus.len(), heap.local_ranks().len()),
            });
        }
        let timeout_ns = crate::config::wait_ns(options.timeout);
        let params = ExchangeParams::new(&shape, heap.bases(), timeout_ns, !heap.single_gpu());
        let params_on_gpu =
            gpus.iter().map(|gpu| DeviceBuffer::from_slice(gpu, params.as_bytes())).collect::<Result<Vec<_>>>()?;
        Ok(Self { shape, params, params_on_gpu, heap, epoch: 0, options, silent: None })
    }

    /// The shape the heap was laid out for.
    pub fn shape(&self) -> &ExchangeShape {
        &self.shape
    }

    /// Region offsets of the heap.
    pub fn regions(&self) -> &HeapRegions {
        &self.params.regions
    }

    /// The heap.
    pub fn heap(&self) -> &SymmetricHeap {
        &self.heap
    }

    /// The epoch of the last publish (each forward takes one, and each backward except the
    /// backward megakernel's over virtual ranks, which one stream orders without a publish).
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// Address of `region` (an offset from [`Self::regions`]) in `rank`'s slice.
    pub(crate) fn address(&self, rank: usize, region: u64) -> u64 {
        self.heap.map(region, rank)
    }

    /// `Err` naming `rank` unless it is one of the exchange's ranks.
    pub fn check_rank(&self, rank: usize) -> Result<()> {
        if rank < self.shape.world as usize {
            Ok(())
        } else {
            Err(MokError::InvalidInput {
                tensor: "rank",
                problem: format!("rank {rank} is not below the exchange's {} ranks", self.shape.world),
            })
        }
    }

    /// Switches between the bulk-copy and the vector movers for later passes.
    pub fn set_bulk_copies(&mut self, bulk: bool) {
        self.options.bulk_copies = bulk;
    }

    /// Test hook: make `rank` silent in the given way from now on (`None`: everyone talks;
    /// feature `testing`).
    #[cfg(feature = "testing")]
    pub fn set_silent_rank(&mut self, silent: Option<(usize, Silence)>) {
        self.silent = silent;
    }

    /// Whether `rank` is set silent in the way `what` ([`Self::set_silent_rank`]; the forward
    /// megakernel reads [`Silence::Push`] too, its pushes being its own).
    pub(crate) fn silent(&self, rank: usize, what: Silence) -> bool {
        self.silent == Some((rank, what))
    }

    fn params_ptr(&self, i: usize) -> u64 {
        self.params_on_gpu[if self.params_on_gpu.len() == 1 { 0 } else { i }].device_ptr()
    }

    /// `(local index, rank)` of every rank this process drives.
    fn local(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.heap.local_ranks().iter().copied().enumerate()
    }

    /// Copies `data` into `region` of `rank`'s slice (synchronously).
    ///
    /// # Safety
    /// `region` must be one of [`Self::regions`]'s offsets and `data` no longer than the region.
    pub unsafe fn upload_region<T: Pod>(&self, gpu: &Gpu, rank: usize, region: u64, data: &[T]) -> Result<()> {
        // SAFETY: caller contract; the heap slice holds the region.
        unsafe { gpu.copy_to_device(self.address(rank, region), data) }
    }

    /// Copies `len` elements of `region` of `rank`'s slice out, after the stream's earlier work.
    ///
    /// # Safety
    /// As [`Self::upload_region`], with `len` elements.
    pub unsafe fn download_region<T: Pod>(&self, gpu: &Gpu, rank: usize, region: u64, len: usize) -> Result<Vec<T>> {
        // SAFETY: caller contract.
        unsafe { gpu.copy_from_device(self.address(rank, region), len) }
    }

    /// Uploads `rank`'s tokens (x, ids, weights) into its slice after validating them.
    pub fn upload_tokens(&self, gpu: &Gpu, rank: usize, config: &MoeConfig, tokens: &RoutedTokens) -> Result<()> {
        self.check_rank(rank)?;
        let s = &self.shape;
        let shape_of = |c: &MoeConfig| (c.tokens_per_rank, c.hidden, c.top_k, c.num_experts, c.ep_ranks);
        let own = (s.tokens as usize, s.hidden as usize, s.top_k as usize, s.num_experts as usize, s.world as usize);
        if shape_of(config) != own {
            return Err(MokError::InvalidInput {
                tensor: "config",
                problem: format!(
                    "(T, H, k, E, P) = {:?} is not the exchange's {own:?}: the heap regions are sized for it",
                    shape_of(config)
                ),
            });
        }
        let mut single = config.clone();
        single.ep_ranks = 1;
        tokens.validate(&single)?;
        let r = self.regions();
        // SAFETY: each tensor has exactly its region's size (validated above against the shape).
        unsafe {
            self.upload_region(gpu, rank, r.x, &tokens.x)?;
            self.upload_region(gpu, rank, r.topk_ids, &tokens.topk_ids)?;
            self.upload_region(gpu, rank, r.topk_weights, &tokens.topk_weights)
        }
    }

    /// Uploads `rank`'s output gradient dy (`[T, H]`).
    pub fn upload_dy(&self, gpu: &Gpu, rank: usize, dy: &[bf16]) -> Result<()> {
        self.check_rank(rank)?;
        let expected = self.shape.tokens as usize * self.shape.hidden as usize;
        if dy.len() != expected {
            return Err(MokError::InvalidInput {
                tensor: "dy",
                problem: format!("has {} elements, expected {expected} ([T, H])", dy.len()),
            });
        }
        // SAFETY: `dy` has exactly the region's size.
        unsafe { self.upload_region(gpu, rank, self.regions().dy, dy) }
    }

    fn fill_words(&self, gpu: &Gpu, rank: usize, region: u64, words: u64) -> Result<()> {
        // SAFETY: the region lies in `rank`'s slice with `words` u32.
        unsafe { gpu.fill_device_bytes(self.address(rank, region), 0, (words * 4) as usize) }
    }

    /// Clears every local rank's `slot_ready` flags (the megakernels' push signals), in stream
    /// order: before the next [`Self::schedule`]'s publish in the forward — no peer can push into
    /// a pass before its owner has published it, so no push can race the clearing — and before
    /// the backward megakernel's launch (virtual ranks: every pusher is in that later launch;
    /// across processes: before the backward's publish, which every pusher waits for).
    pub(crate) fn clear_slot_ready(&self, gpus: &[&Gpu]) -> Result<()> {
        self.clear_signals(gpus, CLEAR_SLOT_READY)
    }

    fn clear_signals(&self, gpus: &[&Gpu], what: u32) -> Result<()> {
        let slots = (self.shape.tokens * self.shape.top_k) as usize;
        // SAFETY: `mok_ep_clear_signals`' parameters after (params, first_rank): what.
        unsafe {
            self.launch_step(
                gpus,
                "mok_ep_clear_signals",
                |gpu| grid_stride_blocks(gpu, slots),
                ROW_KERNEL_THREADS,
                0,
                None,
                &[U32(what)],
            )
        }
    }

    /// The parameter block of `rank` on the GPU driving it (device address); `Err` for a rank
    /// this process does not drive.
    pub(crate) fn params_address(&self, rank: usize) -> Result<u64> {
        self.check_rank(rank)?;
        match self.heap.local_ranks().iter().position(|&r| r == rank) {
            Some(local) => Ok(self.params_ptr(local)),
            None => Err(MokError::InvalidInput {
                tensor: "rank",
                problem: format!(
                    "rank {rank} is not driven by this process (its ranks: {:?})",
                    self.heap.local_ranks()
                ),
            }),
        }
    }

    /// The local ranks in runs that one launch of an exchange step acts for (its grid row y is
    /// rank `first_rank + y`, kernels/src/entry/exchange.rs): consecutive ranks driven by one GPU
    /// through one parameter block. Every virtual rank of a GPU is one run; with one rank per
    /// GPU each rank is its own. `skip` leaves a rank out (a silent one), splitting its run.
    fn rank_runs(&self, gpus: &[&Gpu], skip: Option<usize>) -> Vec<RankRun> {
        rank_runs(self.heap.local_ranks(), gpus.len() == 1 && self.params_on_gpu.len() == 1, skip)
    }

    /// Enqueues one step of the exchange for every local rank: `kernel` once per run of ranks
    /// ([`Self::rank_runs`], leaving out `skip`), `grid_x(gpu)` blocks per rank, with arguments
    /// `(params, first_rank)` then `rest`.
    ///
    /// # Safety
    /// `kernel` is an exchange entry point (kernels/src/entry/exchange.rs) whose parameters after
    /// `(params, first_rank)` are `rest`, in order and type, every pointer in it live and of the
    /// size the kernel documents; `threads` and `smem_bytes` are what it documents.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_step(
        &self,
        gpus: &[&Gpu],
        kernel: &'static str,
        grid_x: impl Fn(&Gpu) -> u32,
        threads: u32,
        smem_bytes: u32,
        skip: Option<usize>,
        rest: &[KernelArg<'_>],
    ) -> Result<()> {
        for run in self.rank_runs(gpus, skip) {
            let gpu = gpu_of(gpus, self.heap.local_ranks().len(), run.local)?;
            let mut args = vec![Ptr(self.params_ptr(run.local)), U32(run.first_rank)];
            args.extend_from_slice(rest);
            let shape = LaunchShape { grid: (grid_x(gpu).max(1), run.ranks, 1), threads, smem_bytes };
            // SAFETY: caller contract; the parameter block is this run's and every rank in the
            // run is below the world size.
            unsafe { gpu.launch(kernel, shape, &args) }?;
        }
        Ok(())
    }

    /// Forward schedule: route every local rank's slots, publish a new epoch, then (each rank
    /// as expert owner) exchange counts, place the segments and build the inverse map. Each step
    /// is one launch for every virtual rank of a GPU.
    pub fn schedule(&mut self, gpus: &[&Gpu]) -> Result<()> {
        self.route_and_publish(gpus)?;
        self.place(gpus)
    }

    /// [`Self::schedule`] after clearing the megakernels' `slot_ready` flags
    /// ([`Self::clear_slot_ready`] says why that is in time).
    pub(crate) fn schedule_clearing_slot_ready(&mut self, gpus: &[&Gpu]) -> Result<()> {
        self.route_and_publish_clearing(gpus, true)?;
        self.place(gpus)
    }

    /// The first half of [`Self::schedule`]: every local rank lays out its own slots (the
    /// single-rank routing steps over its heap regions) and publishes a new epoch.
    pub fn route_and_publish(&mut self, gpus: &[&Gpu]) -> Result<()> {
        self.route_and_publish_clearing(gpus, false)
    }

    fn route_and_publish_clearing(&mut self, gpus: &[&Gpu], clear_slot_ready: bool) -> Result<()> {
        self.epoch = self.epoch.wrapping_add(1).max(1);
        let s = self.shape;
        let (t, k, e) = (s.tokens, s.top_k, s.num_experts);
        // The routing error records are not cleared here: a bad id of an unchecked pass stays
        // recorded (the first one) until `check_errors` has reported it and `reset` cleared it.
        if clear_slot_ready {
            self.clear_slot_ready(gpus)?;
        }
        // SAFETY (all four): each kernel's parameters after (params, first_rank) are the ones
        // given (none), with the block shapes they document; the regions they touch are the
        // heap's, sized for this shape.
        unsafe {
            self.launch_step(
                gpus,
                "mok_ep_route_chunks",
                |_| layout::chunk_count(t),
                RANK_CHUNK_THREADS,
                4 * e,
                None,
                &[],
            )?;
            self.launch_step(gpus, "mok_ep_route_scan", |_| 1, 1024, 0, None, &[])?;
            self.launch_step(
                gpus,
                "mok_ep_route_place",
                |_| t.div_ceil(ROW_KERNEL_THREADS),
                ROW_KERNEL_THREADS,
                0,
                None,
                &[],
            )?;
            self.launch_step(
                gpus,
                "mok_ep_prepare_tokens",
                |gpu| grid_stride_blocks(gpu, (t * k) as usize),
                ROW_KERNEL_THREADS,
                0,
                None,
                &[],
            )?;
        }
        self.publish_all(gpus)
    }

    /// The second half of [`Self::schedule`]: every local rank, as expert owner, waits for the
    /// epoch, exchanges counts, places the segments (capacity checked), writes its ring's engine
    /// tile offsets and builds the inverse map.
    pub fn place(&self, gpus: &[&Gpu]) -> Result<()> {
        let capacity = self.shape.capacity as usize;
        // SAFETY: `mok_ep_schedule`'s parameters after (params, first_rank): the epoch, with 16
        // bytes of shared memory (it uses 4); `mok_ep_ring_map`'s: none.
        unsafe {
            self.launch_step(gpus, "mok_ep_schedule", |_| 1, 256, 16, None, &[U32(self.epoch)])?;
            self.launch_step(
                gpus,
                "mok_ep_ring_map",
                |gpu| grid_stride_blocks(gpu, capacity),
                ROW_KERNEL_THREADS,
                0,
                None,
                &[],
            )
        }
    }

    fn publish_all(&self, gpus: &[&Gpu]) -> Result<()> {
        let silent = self.local().map(|(_, rank)| rank).find(|&rank| self.silent(rank, Silence::Publish));
        // SAFETY: `mok_ep_publish`'s parameters after (params, first_rank): the epoch.
        unsafe { self.launch_step(gpus, "mok_ep_publish", |_| 1, 32, 0, silent, &[U32(self.epoch)]) }
    }

    fn mover_blocks(&self, gpu: &Gpu) -> u32 {
        // Enough warps for one row each up to the ring's capacity, at most 8 blocks per SM.
        let rows = self.shape.capacity;
        rows.div_ceil(MOVER_THREADS / 32).clamp(1, gpu.multiprocessors() * 8)
    }

    fn bulk_blocks(&self, gpu: &Gpu) -> u32 {
        // Six 33 KiB blocks fit an SM's shared memory.
        self.shape.capacity.clamp(1, gpu.multiprocessors() * 6)
    }

    fn pull(&self, gpus: &[&Gpu], pass: u32) -> Result<()> {
        let r = *self.regions();
        let max_tiles = self.shape.max_tiles() as u64;
        let counters = if pass == 0 { r.tile_ready } else { r.dy_tile_ready };
        for (i, rank) in self.local() {
            let gpu = gpu_of(gpus, self.heap.local_ranks().len(), i)?;
            self.fill_words(gpu, rank, counters, max_tiles)?;
            let params = Ptr(self.params_ptr(i));
            if pass == 0 && self.options.bulk_copies {
                // SAFETY: the arguments are `mok_ep_pull_bulk`'s parameters, in order and type (its entry point in
                // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
                unsafe {
                    gpu.launch(
                        "mok_ep_pull_bulk",
                        LaunchShape {
                            grid: (self.bulk_blocks(gpu), 1, 1),
                            threads: BULK_THREADS,
                            smem_bytes: BULK_SMEM_BYTES,
                        },
                        &[params, U32(rank as u32), U32(self.epoch)],
                    )
                }?;
            } else {
                // SAFETY: the arguments are `mok_ep_pull`'s parameters, in order and type (its entry point in
                // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
                unsafe {
                    gpu.launch(
                        "mok_ep_pull",
                        LaunchShape { grid: (self.mover_blocks(gpu), 1, 1), threads: MOVER_THREADS, smem_bytes: 16 },
                        &[params, U32(rank as u32), U32(pass), U32(self.epoch)],
                    )
                }?;
            }
        }
        for (i, rank) in self.local() {
            let gpu = gpu_of(gpus, self.heap.local_ranks().len(), i)?;
            // SAFETY: the arguments are `mok_ep_wait_tiles`'s parameters, in order and type (its entry point in
            // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
            unsafe {
                gpu.launch(
                    "mok_ep_wait_tiles",
                    LaunchShape::linear(grid_stride_blocks(gpu, max_tiles as usize), ROW_KERNEL_THREADS),
                    &[Ptr(self.params_ptr(i)), U32(rank as u32), U32(pass), U32(self.epoch)],
                )
            }?;
        }
        Ok(())
    }

    /// Forward dispatch: every local rank pulls its experts' x rows from their token owners
    /// into its ring (`regions().ring_x`), then checks (bounded) that every M tile is complete.
    pub fn dispatch(&self, gpus: &[&Gpu]) -> Result<()> {
        self.pull(gpus, 0)
    }

    /// Backward: publishes a new epoch — every local rank's dy is in its slice.
    pub fn begin_backward(&mut self, gpus: &[&Gpu]) -> Result<()> {
        self.epoch = self.epoch.wrapping_add(1).max(1);
        self.publish_all(gpus)
    }

    /// Waits on the device (bounded) until every rank has published the current epoch: before a
    /// launch that reads the peers' inputs without waiting itself, when the ranks run in
    /// separate processes (the backward megakernel after [`Self::begin_backward`]). A rank that
    /// never publishes is a timeout in the error record, naming it.
    pub(crate) fn wait_published(&self, gpus: &[&Gpu]) -> Result<()> {
        // SAFETY: `mok_ep_wait_published`'s parameters after (params, first_rank): the epoch,
        // with 4 bytes of shared memory.
        unsafe { self.launch_step(gpus, "mok_ep_wait_published", |_| 1, 32, 4, None, &[U32(self.epoch)]) }
    }

    /// Backward reverse-combine: every local rank pulls dy rows of its experts' slots, scaled by
    /// the slot weight, into `regions().ring_dy`.
    pub fn reverse_combine(&self, gpus: &[&Gpu]) -> Result<()> {
        self.pull(gpus, 1)
    }

    fn check_per_rank(&self, what: &'static str, addresses: &[u64]) -> Result<()> {
        let locals = self.heap.local_ranks().len();
        if addresses.len() != locals {
            return Err(MokError::InvalidInput {
                tensor: what,
                problem: format!("{} addresses for {locals} local ranks (one each)", addresses.len()),
            });
        }
        Ok(())
    }

    /// The push half of [`Self::combine`] (`backward == false`) or [`Self::reverse_dispatch`]:
    /// every local rank writes its ring's f32 rows `rows[i]` into the token owners' slot buffers
    /// and signals them. Separate so a benchmark can time the movers alone.
    ///
    /// # Safety
    /// Each `rows[i]` must be a live `[ring rows][H]` f32 allocation (the ring's capacity),
    /// allocated until the stream has run the launches: the movers read it unchecked.
    pub unsafe fn push(&self, gpus: &[&Gpu], backward: bool, rows: &[u64]) -> Result<()> {
        self.check_per_rank("rows", rows)?;
        let pass = backward as u32;
        for (i, rank) in self.local() {
            if self.silent(rank, Silence::Push) {
                continue;
            }
            let gpu = gpu_of(gpus, self.heap.local_ranks().len(), i)?;
            let params = Ptr(self.params_ptr(i));
            if self.options.bulk_copies {
                // SAFETY: the arguments are `mok_ep_push_bulk`'s parameters, in order and type (its entry point in
                // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
                unsafe {
                    gpu.launch(
                        "mok_ep_push_bulk",
                        LaunchShape {
                            grid: (self.bulk_blocks(gpu), 1, 1),
                            threads: BULK_THREADS,
                            smem_bytes: BULK_SMEM_BYTES,
                        },
                        &[params, U32(rank as u32), U32(pass), Ptr(rows[i])],
                    )
                }?;
            } else {
                // SAFETY: the arguments are `mok_ep_push`'s parameters, in order and type (its entry point in
                // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
                unsafe {
                    gpu.launch(
                        "mok_ep_push",
                        LaunchShape { grid: (self.mover_blocks(gpu), 1, 1), threads: MOVER_THREADS, smem_bytes: 0 },
                        &[params, U32(rank as u32), U32(pass), Ptr(rows[i])],
                    )
                }?;
            }
        }
        Ok(())
    }

    /// The token-owner half of [`Self::combine`] / [`Self::reverse_dispatch`]: every local rank
    /// waits (bounded) for each token tile's rows from every expert owner, then writes
    /// `outs[i]` from `bases[i]` and its slots in fixed order.
    ///
    /// # Safety
    /// Each `bases[i]` must be 0 or a live `[T][H]` f32 allocation, each `outs[i]` a live `[T][H]`
    /// bf16 allocation nothing else writes meanwhile, all allocated until the stream has run the
    /// launches: the kernels read and write them unchecked.
    pub unsafe fn sum(&self, gpus: &[&Gpu], backward: bool, bases: &[u64], outs: &[u64]) -> Result<()> {
        self.check_per_rank("bases", bases)?;
        self.check_per_rank("outs", outs)?;
        let pass = backward as u32;
        let s = self.shape;
        for (i, rank) in self.local() {
            let gpu = gpu_of(gpus, self.heap.local_ranks().len(), i)?;
            let (params, rank) = (Ptr(self.params_ptr(i)), U32(rank as u32));
            // SAFETY: the arguments are `mok_ep_wait_arrivals`'s parameters, in order and type (its entry point in
            // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
            unsafe {
                gpu.launch(
                    "mok_ep_wait_arrivals",
                    LaunchShape::linear(grid_stride_blocks(gpu, (s.chunks() * s.world) as usize), ROW_KERNEL_THREADS),
                    &[params, rank, U32(pass), U32(self.epoch)],
                )
            }?;
            let quads = s.tokens as usize * s.hidden as usize / 4;
            // SAFETY: the arguments are `mok_ep_combine`'s parameters, in order and type (its entry point in
            // kernels/src/entry/), and every pointer is a live allocation of the sizes it documents.
            unsafe {
                gpu.launch(
                    "mok_ep_combine",
                    LaunchShape::linear(grid_stride_blocks(gpu, quads), ROW_KERNEL_THREADS),
                    &[params, rank, U32(pass), Ptr(bases[i]), Ptr(outs[i])],
                )
            }?;
        }
        Ok(())
    }

    /// Forward combine: each local rank (as expert owner) pushes its ring's f32 result rows
    /// (`rows[i]`, `[ring rows][H]`) to the token owners; each local rank (as token owner) then
    /// waits for its tiles and writes `outs[i]` = `bf16(base + Σ_j w_j · slot_j)` (`[T][H]` bf16;
    /// `bases[i]` the shared expert's f32 output or 0).
    ///
    /// # Safety
    /// As [`Self::push`] for `rows` and [`Self::sum`] for `bases` and `outs`.
    pub unsafe fn combine(&self, gpus: &[&Gpu], rows: &[u64], bases: &[u64], outs: &[u64]) -> Result<()> {
        // SAFETY: this function's contract is `push`'s and `sum`'s, which the caller upholds.
        unsafe {
            self.push(gpus, false, rows)?;
            self.sum(gpus, false, bases, outs)
        }
    }

    /// Backward reverse-dispatch: like [`Self::combine`] for the f32 dx rows, summed unweighted.
    ///
    /// # Safety
    /// As [`Self::combine`].
    pub unsafe fn reverse_dispatch(&self, gpus: &[&Gpu], rows: &[u64], bases: &[u64], outs: &[u64]) -> Result<()> {
        // SAFETY: this function's contract is `push`'s and `sum`'s, which the caller upholds.
        unsafe {
            self.push(gpus, true, rows)?;
            self.sum(gpus, true, bases, outs)
        }
    }

    /// `rank`'s ring row offsets (`[L + 1]`, written by the schedule), as a view that lives as long
    /// as the exchange (and so its heap).
    pub(crate) fn ring_row_offsets(&self, rank: usize) -> DeviceSlice<'_, u32> {
        let words = self.shape.local_experts() as usize + 1;
        // SAFETY: the region lies in `rank`'s slice of the heap with L + 1 words, and the heap
        // lives as long as `self`, which the view borrows.
        unsafe { DeviceSlice::from_raw_parts(self.address(rank, self.regions().ring_row_offsets), words) }
    }

    /// `rank`'s ring engine tile offsets (`[2 · (L + 1)]`, written by the schedule: the plans of
    /// a megakernel over the ring read them), as a view that lives as long as the exchange.
    pub(crate) fn ring_engine_tile_offsets(&self, rank: usize) -> DeviceSlice<'_, u32> {
        let words = 2 * (self.shape.local_experts() as usize + 1);
        // SAFETY: the region lies in `rank`'s slice of the heap with 2 · (L + 1) words, and the
        // heap lives as long as `self`, which the view borrows.
        unsafe { DeviceSlice::from_raw_parts(self.address(rank, self.regions().ring_engine_tile_offsets), words) }
    }

    /// Device address of `rank`'s ring row count (`ring_row_offsets[L]`), for the compute.
    pub(crate) fn ring_row_count_ptr(&self, rank: usize) -> u64 {
        self.address(rank, self.regions().ring_row_offsets) + 4 * self.shape.local_experts() as u64
    }

    /// Waits for every local rank's stream and turns the kernels' error records into an error:
    /// a capacity problem first (the cause), then the first timeout in rank order, then a bad id
    /// found by the routing kernels.
    ///
    /// Across processes the other ranks' records are read too, after the local ones. A wait on a
    /// peer stops early, recording nothing, once that peer's record holds an error (the cause is
    /// there, and a second record would hide it), so a pass whose local records are clean can
    /// still be void through a peer; the wait saw the peer's record set, and records are only
    /// cleared by a collective reset, so this read finds it.
    pub fn check_errors(&self, gpus: &[&Gpu]) -> Result<()> {
        // Each local rank's records read through its GPU once that GPU is idle; across processes
        // every peer's after them, through the first GPU.
        let mut sources = Vec::new();
        for (i, rank) in self.local() {
            let gpu = gpu_of(gpus, self.heap.local_ranks().len(), i)?;
            gpu.synchronize()?;
            sources.push((gpu, rank));
        }
        if !self.heap.single_gpu() {
            let peers = (0..self.shape.world as usize).filter(|r| !self.heap.local_ranks().contains(r));
            let first = gpu_of(gpus, self.heap.local_ranks().len(), 0)?;
            sources.extend(peers.map(|peer| (first, peer)));
        }
        let mut records = Vec::with_capacity(sources.len());
        for (gpu, rank) in sources {
            let read = || {
                // SAFETY: both records are regions of `rank`'s slice (a peer's mapped into this
                // process for this device by the multi-process heap).
                unsafe {
                    Ok::<_, MokError>((
                        self.download_region::<u32>(gpu, rank, self.regions().error, ERROR_WORDS)?,
                        self.download_region::<u32>(gpu, rank, self.regions().route_error, 4)?,
                    ))
                }
            };
            let (mut words, mut route) = read()?;
            if !self.heap.local_ranks().contains(&rank)
                && (words[codes::WORD_CODE] != codes::ERROR_NONE || route[0] != 0)
            {
                // A peer's kernel may still be writing its record (it claims the code word first,
                // then stores the rest): read it again once those stores have surely landed.
                std::thread::sleep(std::time::Duration::from_millis(1));
                (words, route) = read()?;
            }
            records.push((rank, words, route));
        }
        if let Some((rank, words, _)) = records.iter().find(|(_, w, _)| w[codes::WORD_CODE] == codes::ERROR_CAPACITY) {
            return Err(MokError::Capacity {
                what: "the receive ring (ExchangeOptions::capacity_rows)",
                rank: *rank,
                needed: words[codes::WORD_EXPECTED] as usize,
                capacity: words[codes::WORD_SEEN] as usize,
            });
        }
        if let Some((rank, words, _)) = records.iter().find(|(_, w, _)| w[codes::WORD_CODE] != codes::ERROR_NONE) {
            return Err(decode_timeout(Some(*rank), words));
        }
        if let Some((rank, _, route)) = records.iter().find(|(_, _, r)| r[0] != 0) {
            let k = self.shape.top_k;
            return Err(MokError::Device {
                kernel: "mok_ep_route_chunks",
                message: format!(
                    "rank {rank}: token {} slot {} has bad expert id {} (error code {}); the slot was dropped",
                    route[1] / k,
                    route[1] % k,
                    route[2] as i32,
                    route[0]
                ),
            });
        }
        Ok(())
    }

    /// Clears every counter, flag, baseline and error record of the local ranks and restarts
    /// the epochs: the way back after an error. Every rank must be idle (and, across processes,
    /// reset before any rank starts the next pass).
    pub fn reset(&mut self, gpus: &[&Gpu]) -> Result<()> {
        let r = *self.regions();
        let s = self.shape;
        let chunk_words = (s.chunks() * s.world) as u64;
        for (i, rank) in self.local() {
            let gpu = gpu_of(gpus, self.heap.local_ranks().len(), i)?;
            gpu.synchronize()?;
            for (region, words) in [
                (r.published, 4),
                (r.combine_arrived, chunk_words),
                (r.dx_arrived, chunk_words),
                (r.combine_seen, chunk_words),
                (r.dx_seen, chunk_words),
                (r.error, ERROR_WORDS as u64),
                (r.route_error, 4),
                (r.slot_ready, (s.tokens * s.top_k) as u64),
            ] {
                self.fill_words(gpu, rank, region, words)?;
            }
            gpu.synchronize()?;
        }
        self.epoch = 0;
        Ok(())
    }
}

/// The error a timeout record describes.
/// The timeout a device error record describes (`comm::error` format; exchange kernels and the
/// hooked engine kernels write it). `rank`: whose record it is, when the pass has ranks.
pub(crate) fn decode_timeout(rank: Option<usize>, words: &[u32]) -> MokError {
    let waited = words[codes::WORD_WAITED_FOR];
    let (peer, index, expected, seen, epoch) = (
        words[codes::WORD_PEER] as usize,
        words[codes::WORD_INDEX],
        words[codes::WORD_EXPECTED],
        words[codes::WORD_SEEN],
        words[codes::WORD_EPOCH],
    );
    let detail = match waited {
        codes::WAIT_PEER_PUBLISHED => format!("expected epoch {expected}, the flag held {seen}"),
        codes::WAIT_COMBINE_ROWS | codes::WAIT_DX_ROWS => format!(
            "token tile {index} (tokens {}..): expected {expected} rows from rank {peer}, {seen} arrived (epoch {epoch})",
            index * layout::ROUTE_CHUNK_TOKENS
        ),
        codes::WAIT_X_TILE_ROWS | codes::WAIT_DY_TILE_ROWS => {
            format!("M tile {index} of the ring: expected {expected} rows, {seen} landed (epoch {epoch})")
        }
        codes::WAIT_BULK_COPY => format!("ring row {index}"),
        codes::WAIT_ENGINE_TILE_ROWS => format!("M tile {index}: expected epoch {expected}, the flag held {seen}"),
        codes::WAIT_ENGINE_TILE_DOWN_DGRAD => {
            format!(
                "M tile {index}: expected {expected} counted (its stored tile parts, then its SwiGLU chunks), {seen} counted"
            )
        }
        codes::WAIT_SHARED_TILE_DOWN_DGRAD => format!(
            "shared-expert M tile {index} (tokens {}..): expected {expected} counted (its stored tile parts, then its SwiGLU chunks), {seen} counted",
            index * mok_kernels::gemm_layout::TILE_M
        ),
        codes::WAIT_ENGINE_TILE_HIDDEN | codes::WAIT_ENGINE_TILE_OUTPUT | codes::WAIT_ENGINE_TILE_GATE_UP_DGRAD => {
            format!("M tile {index}: expected {expected} stored tile parts, {seen} counted")
        }
        codes::WAIT_SHARED_TILE_HIDDEN | codes::WAIT_SHARED_TILE_OUTPUT | codes::WAIT_SHARED_TILE_GATE_UP_DGRAD => {
            format!(
                "shared-expert M tile {index} (tokens {}..): expected {expected} stored tile parts, {seen} counted",
                index * mok_kernels::gemm_layout::TILE_M
            )
        }
        codes::WAIT_SHARED_TILE_DISPATCHED | codes::WAIT_SHARED_TILE_GATHERED => format!(
            "shared-expert M tile {index} (tokens {}..): expected {expected} row chunks copied ({} rows each), {seen} counted",
            index * mok_kernels::gemm_layout::TILE_M,
            mok_kernels::megakernel_layout::ROW_CHUNK_ROWS
        ),
        codes::WAIT_ENGINE_TILE_DISPATCHED | codes::WAIT_ENGINE_TILE_GATHERED => {
            let what = if waited == codes::WAIT_ENGINE_TILE_DISPATCHED { "dispatched" } else { "gathered" };
            let rows = mok_kernels::megakernel_layout::ROW_CHUNK_ROWS;
            format!("M tile {index}: expected {expected} row chunks {what} ({rows} rows each), {seen} counted")
        }
        codes::WAIT_SLOT_READY => {
            format!(
                "slot t·k + j = {index}: expected its row pushed by rank {peer} (flag {expected}: one raise per N tile \
                 of the row), the flag held {seen}"
            )
        }
        _ => format!("record {words:?}"),
    };
    let peer = match waited {
        codes::WAIT_PEER_PUBLISHED | codes::WAIT_COMBINE_ROWS | codes::WAIT_DX_ROWS | codes::WAIT_SLOT_READY => {
            Some(peer)
        }
        _ => None,
    };
    MokError::Timeout { rank, peer, waited_for: codes::waited_for_name(waited).into(), detail }
}

/// Every kernel the exchange launches.
pub const KERNEL_NAMES: &[&str] = &[
    "mok_ep_clear_signals",
    "mok_ep_route_chunks",
    "mok_ep_route_scan",
    "mok_ep_route_place",
    "mok_ep_prepare_tokens",
    "mok_ep_publish",
    "mok_ep_wait_published",
    "mok_ep_schedule",
    "mok_ep_ring_map",
    "mok_ep_pull",
    "mok_ep_pull_bulk",
    "mok_ep_push",
    "mok_ep_push_bulk",
    "mok_ep_wait_tiles",
    "mok_ep_wait_arrivals",
    "mok_ep_combine",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_takes_one_gpu_or_one_per_local_rank_and_refuses_other_lists() {
        let (a, b, c) = (0, 1, 2);
        assert_eq!(gpu_of(&[&a], 4, 3).unwrap(), &a);
        assert_eq!(gpu_of(&[&a, &b, &c], 3, 2).unwrap(), &c);
        for (gpus, i) in [(&[][..], 0), (&[&a, &b][..], 0), (&[&a, &b, &c][..], 3)] {
            let refused = gpu_of(gpus, 3, i);
            assert!(matches!(refused, Err(MokError::InvalidInput { tensor: "gpus", .. })), "{} GPUs, {i}", gpus.len());
        }
    }

    fn run(local: usize, first_rank: u32, ranks: u32) -> RankRun {
        RankRun { local, first_rank, ranks }
    }

    #[test]
    fn one_launch_serves_consecutive_ranks_of_one_gpu_only() {
        // Every virtual rank of a GPU: one run; a silent rank splits it.
        assert_eq!(rank_runs(&[0, 1, 2, 3], true, None), [run(0, 0, 4)]);
        assert_eq!(rank_runs(&[0, 1, 2, 3], true, Some(1)), [run(0, 0, 1), run(2, 2, 2)]);
        assert_eq!(rank_runs(&[0, 1, 2, 3], true, Some(3)), [run(0, 0, 3)]);
        assert_eq!(rank_runs(&[0], true, Some(0)), []);
        // Ranks that are not consecutive, or out of order, are separate runs.
        assert_eq!(rank_runs(&[2, 3, 5, 4], true, None), [run(0, 2, 2), run(2, 5, 1), run(3, 4, 1)]);
        // One rank per GPU (or a parameter block each): a run per rank.
        assert_eq!(rank_runs(&[4, 5], false, None), [run(0, 4, 1), run(1, 5, 1)]);
    }

    #[test]
    fn heap_requests_tell_layers_apart_that_ask_for_the_same_bytes() {
        let mut config = MoeConfig::new(100, 64, 32, 12, 4);
        config.ep_ranks = 3;
        let options = ExchangeOptions::default();
        let asked = Exchange::heap_request(&config, &options).unwrap();
        assert_eq!(asked, Exchange::heap_request(&config.clone(), &options).unwrap());
        assert_eq!(asked.bytes_per_rank, Exchange::heap_bytes_per_rank(&config, &options).unwrap());
        assert_ne!(asked.layout, 0);
        // Another SwiGLU limit, or another intermediate width: the heap's bytes are the same (the
        // rows exchanged are H wide), its layer is not.
        for other in
            [MoeConfig { swiglu_limit: Some(7.0), ..config.clone() }, MoeConfig { intermediate: 48, ..config.clone() }]
        {
            let theirs = Exchange::heap_request(&other, &options).unwrap();
            assert_eq!(theirs.bytes_per_rank, asked.bytes_per_rank);
            assert_ne!(theirs.layout, asked.layout);
        }
        // Another ring: other bytes and another layout.
        let ring = ExchangeOptions { capacity_rows: Some(7), ..Default::default() };
        assert_ne!(Exchange::heap_request(&config, &ring).unwrap().layout, asked.layout);
    }

    #[test]
    fn capacity_defaults_to_the_worst_case() {
        let mut config = MoeConfig::new(100, 64, 32, 12, 4);
        config.ep_ranks = 3;
        let shape = Exchange::shape_for(&config, &ExchangeOptions::default()).unwrap();
        assert_eq!(shape.capacity, 3 * 100 * 4);
        let options = ExchangeOptions { capacity_rows: Some(7), ..Default::default() };
        assert_eq!(Exchange::shape_for(&config, &options).unwrap().capacity, 7);
        // A ring of no rows is refused, named, not raised to one row.
        let empty = ExchangeOptions { capacity_rows: Some(0), ..Default::default() };
        assert!(matches!(
            Exchange::shape_for(&config, &empty),
            Err(MokError::InvalidConfig { field: "capacity_rows", .. })
        ));
        // 12 experts do not split over 5 ranks.
        config.ep_ranks = 5;
        assert!(matches!(
            Exchange::shape_for(&config, &options),
            Err(MokError::InvalidConfig { field: "num_experts", .. })
        ));
    }

    #[test]
    fn timeouts_name_the_peer_and_the_counter() {
        let mut words = [0u32; ERROR_WORDS];
        words[codes::WORD_CODE] = codes::ERROR_TIMEOUT;
        words[codes::WORD_WAITED_FOR] = codes::WAIT_COMBINE_ROWS;
        words[codes::WORD_PEER] = 2;
        words[codes::WORD_INDEX] = 3;
        words[codes::WORD_EXPECTED] = 40;
        words[codes::WORD_SEEN] = 7;
        let text = decode_timeout(Some(1), &words).to_string();
        assert!(text.contains("on rank 1") && text.contains("from rank 2"), "{text}");
        assert!(
            text.contains("token tile 3 (tokens 192..)") && text.contains("expected 40") && text.contains("7 arrived")
        );
        match decode_timeout(Some(1), &words) {
            MokError::Timeout { peer: Some(2), rank: Some(1), .. } => {}
            other => panic!("{other}"),
        }
    }
}
