//! Soak test (feature `gpu-tests`): many forward + backward passes over random shapes, routings,
//! rank counts and options, every result compared bit for bit with the oracle path, device memory
//! read before and after, and faults injected between correct passes.
//!
//! - Oracle: the single-rank `mma.sync` path (`UnfusedLayer`, engine off), which the other GPU
//!   tests check against the f64 reference; every 25th pass (up to 4 GFLOP of forward) its `y`
//!   is checked against the f64 reference here too.
//! - Subjects: for P = 1 the same layer with the routed GEMMs on the tensor-core engine (where the
//!   GPU has it), in half the blocks with the forward and the backward as the megakernels (0–8
//!   comm blocks), and independently in half the blocks with the gathering producers
//!   (`set_gather_in_producer`: the engine path's gate/up and weight gradients, or the forward
//!   megakernel's gate/up); for
//!   P > 1 the expert-parallel layer over P virtual ranks (`EpLayer`), with vector or bulk
//!   movers, in the same share of blocks with the forward and the backward as the megakernels
//!   hosting every rank in one launch (0–8 comm blocks per rank). y, dx, d_topk_weights and every routed weight gradient must equal the oracle's
//!   bits (for P = 1 the shared expert's weight gradients too; for P > 1 those are per-rank partial
//!   sums that the data-parallel all-reduce finishes, so they are not comparable bit for bit).
//! - Shapes: P in 1..=8; T per rank 1..=48, H and I multiples of 8 up to 256 / 192, E = P ·
//!   (1..=4) local experts; one block in six large: T per rank 64..=320, H up to 1080 (not always
//!   a multiple of 64), I 64..=512, E = P · (1..=2), so groups span several 128-row M tiles;
//!   k 1..=min(E, 10), shared expert and SwiGLU limit on or off.
//! - Routings: uniform; all-to-one (every token sends a slot to one hot expert, so one group holds
//!   every token); empty experts; 0-30 % dropped slots.
//! - Objects: each configuration runs a block of passes on one long-lived layer object, and every
//!   third pass on a fresh one; the oracle layer is reused across the block.
//! - Faults, interleaved with the passes (P > 1, once per block): a rank that never publishes, a
//!   rank that never pushes (each must be a `MokError::Timeout` naming that rank, within one
//!   deadline per wait the virtual ranks' launches make in turn), a ring too small for an all-to-one routing (`MokError::Capacity` with the rows the
//!   CPU schedule needs); after each, `reset`, and the next pass on the same layer must be correct.
//! - Memory: `live_device_buffers()` (every mok allocation) must return exactly to its value
//!   before the soak, and the driver's free memory may not shrink by more than 16 MiB (lazy module
//!   loading and driver pools may keep a little; a leaked workspace per pass would be far more;
//!   not compared under `run.sh --sanitize`, whose parallel tools share the GPU).
//!
//! Under compute-sanitizer (`MOK_SANITIZE=1`) it runs 12 passes instead of 1000.
#![cfg(feature = "gpu-tests")]

mod common;

use std::time::{Duration, Instant};

use common::{Case, random_bf16, rank_config, split_weights, upload_rank_inputs, weight_scale};
use half::bf16;
use mok::driver::{DeviceBuffer, Gpu, live_device_buffers};
use mok::ep::EpLayer;
use mok::exchange::{ExchangeOptions, Silence};
use mok::megakernel::MegakernelOptions;
use mok::problem::{ExpertWeights, RoutedTokens, SharedExpertWeights};
use mok::reference::{self, ReferenceOptions};
use mok::unfused::{DeviceExperts, DeviceSharedExpert, DeviceTokens, UnfusedLayer};
use mok::{MoeConfig, MokError};

fn gpu() -> Gpu {
    mok::open_gpu(0).unwrap_or_else(|e| {
        panic!("GPU tests need an NVIDIA Hopper or Blackwell GPU with its driver; this machine: {e}")
    })
}

/// splitmix64: the soak's own stream of choices (the data comes from the shared generators).
struct Choices(u64);

impl Choices {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn chance(&mut self, p: f32) -> bool {
        self.unit() < p
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum RoutingKind {
    Uniform,
    /// Every token sends one slot (slot 0) to `hot`, the others anywhere else.
    AllToOne {
        hot: usize,
    },
    /// Experts `0..empty` receive nothing (E > k guaranteed).
    EmptyExperts {
        empty: usize,
    },
}

/// Random distinct top-k ids for `t` tokens of `config` (global experts), weights in (0.05, 0.95).
fn routing(config: &MoeConfig, t: usize, kind: RoutingKind, drop: f32, c: &mut Choices) -> (Vec<i32>, Vec<f32>) {
    let (k, e) = (config.top_k, config.num_experts);
    let mut ids = Vec::with_capacity(t * k);
    let mut weights = Vec::with_capacity(t * k);
    for _ in 0..t {
        let mut row: Vec<usize> = Vec::with_capacity(k);
        if let RoutingKind::AllToOne { hot } = kind {
            row.push(hot);
        }
        let low = if let RoutingKind::EmptyExperts { empty } = kind { empty } else { 0 };
        while row.len() < k {
            let pick = c.range(low, e - 1);
            if !row.contains(&pick) {
                row.push(pick);
            }
        }
        for id in row {
            ids.push(if c.chance(drop) { -1 } else { id as i32 });
            weights.push(0.05 + 0.9 * c.unit());
        }
    }
    (ids, weights)
}

/// One configuration of the soak: the global problem, P and the options.
#[derive(Clone, Debug)]
struct Block {
    /// Global config (P = 1, T = P · T per rank).
    global: MoeConfig,
    ranks: usize,
    bulk_copies: bool,
    engine: bool,
    /// P = 1 with the engine: the forward as the megakernel with this many comm blocks.
    megakernel: Option<u32>,
    /// P = 1 with the engine: the gathering producers (`UnfusedLayer::set_gather_in_producer`).
    gathering: bool,
    kind: RoutingKind,
    drop: f32,
}

fn random_block(c: &mut Choices) -> Block {
    let ranks = c.range(1, 8);
    // One block in six is large: groups of several 128-row M tiles (the engine's M-pairs),
    // several N tiles and K blocks with a ragged tail (H not always a multiple of 64).
    let large = c.chance(1.0 / 6.0);
    let local = if large { c.range(1, 2) } else { c.range(1, 4) };
    let e = ranks * local;
    let k = c.range(1, e.min(10));
    let (t, h, i) = if large {
        (ranks * c.range(64, 320), 64 * c.range(1, 16) + 8 * c.range(0, 7), 8 * c.range(8, 64))
    } else {
        (ranks * c.range(1, 48), 8 * c.range(1, 32), 8 * c.range(1, 24))
    };
    let mut global = MoeConfig::new(t, h, i, e, k);
    if c.chance(0.5) {
        global.shared_intermediate = Some(8 * c.range(1, 16));
    }
    if c.chance(0.5) {
        global.swiglu_limit = Some(0.5 + 2.5 * c.unit());
    }
    let kind = match c.range(0, 2) {
        0 => RoutingKind::Uniform,
        1 => RoutingKind::AllToOne { hot: c.range(0, e - 1) },
        _ if e > k => RoutingKind::EmptyExperts { empty: c.range(1, e - k) },
        _ => RoutingKind::Uniform,
    };
    let drop = if c.chance(0.5) { 0.0 } else { 0.3 * c.unit() };
    let (bulk_copies, engine) = (c.chance(0.5), c.chance(0.8));
    let megakernel = if c.chance(0.5) { Some(c.range(0, 8) as u32) } else { None };
    let gathering = c.chance(0.5);
    Block { global, ranks, bulk_copies, engine, megakernel, gathering, kind, drop }
}

/// The block's weights (global, all experts), generated once per block.
struct Weights {
    experts: ExpertWeights,
    shared: Option<SharedExpertWeights>,
}

fn random_weights(config: &MoeConfig, seed: u64) -> Weights {
    let (h, i, e) = (config.hidden, config.intermediate, config.num_experts);
    let experts = ExpertWeights {
        w_gate: random_bf16(e * i * h, seed ^ 1, weight_scale(h)),
        w_up: random_bf16(e * i * h, seed ^ 2, weight_scale(h)),
        w_down: random_bf16(e * h * i, seed ^ 3, weight_scale(i)),
    };
    let shared = config.shared_intermediate.map(|is| SharedExpertWeights {
        ws_gate: random_bf16(is * h, seed ^ 4, weight_scale(h)),
        ws_up: random_bf16(is * h, seed ^ 5, weight_scale(h)),
        ws_down: random_bf16(h * is, seed ^ 6, weight_scale(is)),
    });
    Weights { experts, shared }
}

/// A pass's fresh inputs around the block's weights.
fn random_pass(block: &Block, weights: &Weights, kind: RoutingKind, seed: u64, c: &mut Choices) -> Case {
    let g = &block.global;
    let (t, h) = (g.tokens_per_rank, g.hidden);
    let (topk_ids, topk_weights) = routing(g, t, kind, block.drop, c);
    Case {
        config: g.clone(),
        tokens: RoutedTokens { x: random_bf16(t * h, seed ^ 7, 1.0), topk_ids, topk_weights },
        experts: weights.experts.clone(),
        shared: weights.shared.clone(),
        dy: random_bf16(t * h, seed ^ 8, 1.0),
    }
}

/// Every result of one pass, on the host, as bits.
#[derive(Debug, PartialEq)]
struct Bits {
    y: Vec<u16>,
    dx: Vec<u16>,
    d_topk_weights: Vec<u32>,
    dw: [Vec<u16>; 3],
    /// P = 1 only.
    dws: Option<[Vec<u16>; 3]>,
}

fn bits16(v: Vec<bf16>) -> Vec<u16> {
    v.into_iter().map(bf16::to_bits).collect()
}

/// What differs between two results (empty when equal).
fn differences(got: &Bits, want: &Bits, with_shared: bool) -> Vec<&'static str> {
    let mut out = Vec::new();
    if got.y != want.y {
        out.push("y");
    }
    if got.dx != want.dx {
        out.push("dx");
    }
    if got.d_topk_weights != want.d_topk_weights {
        out.push("d_topk_weights");
    }
    for (name, (a, b)) in ["dw_gate", "dw_up", "dw_down"].into_iter().zip(got.dw.iter().zip(&want.dw)) {
        if a != b {
            out.push(name);
        }
    }
    if with_shared && got.dws != want.dws {
        out.push("shared dws");
    }
    out
}

/// Uploads of a pass for the single-rank layers.
struct DeviceCase {
    tokens: DeviceTokens,
    dy: DeviceBuffer<bf16>,
}

/// Runs one forward + backward on a single-rank layer (poisoned first) and reads everything back.
fn run_unfused(
    gpu: &Gpu,
    layer: &mut UnfusedLayer,
    device: &DeviceCase,
    experts: &DeviceExperts,
    shared: Option<&DeviceSharedExpert>,
) -> Bits {
    layer.poison().unwrap();
    layer.forward(gpu, &device.tokens, experts, shared).unwrap();
    layer.backward(gpu, &device.tokens, experts, shared, &device.dy).unwrap();
    gpu.synchronize().unwrap();
    layer.check_device_errors().unwrap();
    let g = &layer.grads();
    Bits {
        y: bits16(layer.y().download().unwrap()),
        dx: bits16(g.dx.download().unwrap()),
        d_topk_weights: g.d_topk_weights.download().unwrap().into_iter().map(f32::to_bits).collect(),
        dw: [
            bits16(g.dw_gate.download().unwrap()),
            bits16(g.dw_up.download().unwrap()),
            bits16(g.dw_down.download().unwrap()),
        ],
        dws: g.shared.as_ref().map(|s| {
            [bits16(s[0].download().unwrap()), bits16(s[1].download().unwrap()), bits16(s[2].download().unwrap())]
        }),
    }
}

/// Rank r's local experts' weights on the device, for every rank.
fn split_experts(gpu: &Gpu, config: &MoeConfig, weights: &ExpertWeights) -> Vec<DeviceExperts> {
    split_weights(weights, config.ep_ranks)
        .iter()
        .map(|part| DeviceExperts::upload(gpu, config, part).unwrap())
        .collect()
}

fn upload_ranks(gpu: &Gpu, layer: &mut EpLayer, case: &Case) {
    layer.poison(gpu).unwrap();
    upload_rank_inputs(gpu, layer, case);
}

/// One forward + backward of the expert-parallel layer; results concatenated in rank order.
fn run_ep(
    gpu: &Gpu,
    layer: &mut EpLayer,
    case: &Case,
    experts: &[DeviceExperts],
    shared: Option<&DeviceSharedExpert>,
) -> Bits {
    upload_ranks(gpu, layer, case);
    layer.forward(gpu, experts, shared).unwrap();
    layer.backward(gpu, experts, shared).unwrap();
    layer.check_errors(gpu).unwrap();
    let mut bits = Bits { y: vec![], dx: vec![], d_topk_weights: vec![], dw: [vec![], vec![], vec![]], dws: None };
    for rank in 0..layer.config().ep_ranks {
        let out = layer.outputs(rank).unwrap();
        bits.y.extend(bits16(out.y.download().unwrap()));
        bits.dx.extend(bits16(out.dx.download().unwrap()));
        bits.d_topk_weights.extend(out.d_topk_weights.download().unwrap().into_iter().map(f32::to_bits));
        for (all, part) in bits.dw.iter_mut().zip(out.dw) {
            all.extend(bits16(part.download().unwrap()));
        }
    }
    bits
}

/// The subject of a block: the engine path (P = 1) or the expert-parallel layer (P > 1).
enum Subject {
    Engine(Box<UnfusedLayer>),
    Ep(Box<EpLayer>),
}

/// The exchange options of a block's expert-parallel layers.
fn ep_options(block: &Block, deadline: Duration, capacity_rows: Option<usize>) -> ExchangeOptions {
    ExchangeOptions { capacity_rows, timeout: deadline, bulk_copies: block.bulk_copies }
}

fn new_subject(gpu: &Gpu, block: &Block, deadline: Duration) -> Subject {
    if block.ranks == 1 {
        let mut layer = UnfusedLayer::new(gpu, block.global.clone()).unwrap();
        if block.engine {
            // Only sm_90 has the engine; elsewhere the block runs the mma.sync path twice.
            if let Err(e) = layer.set_gemm_engine(gpu, true) {
                assert_ne!(gpu.compute_capability().0, 9, "an sm_90 GPU must run the engine: {e}");
            }
            if let (Some(comm_blocks), true) = (block.megakernel, layer.uses_gemm_engine()) {
                let options = MegakernelOptions {
                    comm_blocks: Some(comm_blocks),
                    blocks: None,
                    timeout: deadline,
                    ..Default::default()
                };
                layer.set_forward_megakernel(gpu, Some(options.clone())).unwrap();
                layer.set_backward_megakernel(gpu, Some(options)).unwrap();
            }
            if block.gathering && layer.uses_gemm_engine() {
                layer.set_gather_in_producer(gpu, true).unwrap();
            }
        }
        Subject::Engine(Box::new(layer))
    } else {
        let config = rank_config(&block.global, block.ranks);
        let mut layer = EpLayer::new_virtual(gpu, config, ep_options(block, deadline, None)).unwrap();
        if let (true, Some(comm_blocks)) = (block.engine, block.megakernel) {
            // The forward as one launch for every rank (sm_90a only; elsewhere the separate path).
            let options = MegakernelOptions {
                comm_blocks: Some(comm_blocks),
                blocks: None,
                timeout: deadline,
                ..Default::default()
            };
            if let Err(e) = layer.set_forward_megakernel(gpu, Some(options.clone())) {
                assert_ne!(gpu.compute_capability().0, 9, "an sm_90 GPU must run the megakernel: {e}");
            }
            if let Err(e) = layer.set_backward_megakernel(gpu, Some(options)) {
                assert_ne!(gpu.compute_capability().0, 9, "an sm_90 GPU must run the backward megakernel: {e}");
            }
        }
        Subject::Ep(Box::new(layer))
    }
}

/// Rows an all-to-one routing sends to each owner's ring: `counts[o]` = slots with an expert of
/// owner `o`, over every rank.
fn owner_loads(ids: &[i32], num_experts: usize, ranks: usize) -> Vec<usize> {
    let local = num_experts / ranks;
    let mut counts = vec![0; ranks];
    for &id in ids.iter().filter(|&&id| id >= 0) {
        counts[id as usize / local] += 1;
    }
    counts
}

#[derive(Default)]
struct Tally {
    passes: usize,
    fresh_layers: usize,
    /// P = 1 passes on the tensor-core engine, and on the oracle's own `mma.sync` path.
    engine_passes: usize,
    mma_sync_passes: usize,
    megakernel_passes: usize,
    backward_megakernel_passes: usize,
    /// P = 1 passes whose gate/up gathered its rows in its producers.
    gathering_passes: usize,
    ep_passes: usize,
    reference_checks: usize,
    silent_publish: usize,
    silent_push: usize,
    ring_overflow: usize,
    recovered: usize,
    routings: [usize; 3],
    ranks_seen: [usize; 9],
    /// Blocks whose groups average more than one 128-row M tile.
    large_blocks: usize,
}

#[test]
fn soak_thousand_passes_bitwise_against_the_oracle_with_faults() {
    let gpu = gpu();
    let passes = common::sized("passes", 1000, 12);
    let per_block = 10;
    // Every device-side wait of the expert-parallel layers: short, so the injected faults cost
    // little (a correct pass waits microseconds); long under the sanitizer's slow kernels.
    let deadline = common::sized("deadline", Duration::from_millis(100), Duration::from_secs(20));
    let mut c = Choices(0x50a4_2026);

    // Warm-up: one P = 1 and one P = 2 pass, dropped, so lazily loaded kernels and driver pools
    // exist before the baseline is read.
    for ranks in [1, 2] {
        let mut block = random_block(&mut c);
        block.ranks = ranks;
        block.global = MoeConfig::new(2 * 16, 64, 64, 4, 2);
        block.global.shared_intermediate = Some(32);
        let weights = random_weights(&block.global, 1);
        let case = random_pass(&block, &weights, RoutingKind::Uniform, 2, &mut c);
        run_block_pass(&gpu, &block, &weights, &case, deadline, &mut Tally::default());
    }
    let (buffers_before, bytes_before) = live_device_buffers();
    let (free_before, total) = gpu.memory_info().unwrap();
    println!(
        "  before: {buffers_before} mok buffers ({bytes_before} B), driver free {:.1} MiB of {:.1} MiB",
        free_before as f64 / 1048576.0,
        total as f64 / 1048576.0
    );

    let start = Instant::now();
    let mut tally = Tally::default();
    let mut pass = 0;
    let mut block_index = 0;
    while pass < passes {
        let block = random_block(&mut c);
        block_index += 1;
        let seed = 1000 * block_index as u64;
        let weights = random_weights(&block.global, seed);
        let g = &block.global;
        let oracle_experts = DeviceExperts::upload(&gpu, g, &weights.experts).unwrap();
        let oracle_shared = weights.shared.as_ref().map(|s| DeviceSharedExpert::upload(&gpu, g, s).unwrap());
        let rank_experts =
            (block.ranks > 1).then(|| split_experts(&gpu, &rank_config(g, block.ranks), &weights.experts));
        let mut oracle = UnfusedLayer::new(&gpu, g.clone()).unwrap();
        let mut subject = new_subject(&gpu, &block, deadline);
        tally.ranks_seen[block.ranks] += 1;
        tally.large_blocks += (g.tokens_per_rank * g.top_k > 128 * g.num_experts) as usize;
        for step in 0..per_block.min(passes - pass) {
            pass += 1;
            let case = random_pass(&block, &weights, block.kind, seed + step as u64, &mut c);
            tally.routings[match block.kind {
                RoutingKind::Uniform => 0,
                RoutingKind::AllToOne { .. } => 1,
                RoutingKind::EmptyExperts { .. } => 2,
            }] += 1;
            let device = DeviceCase {
                tokens: DeviceTokens::upload(&gpu, g, &case.tokens).unwrap(),
                dy: DeviceBuffer::from_slice(&gpu, &case.dy).unwrap(),
            };
            let want = run_unfused(&gpu, &mut oracle, &device, &oracle_experts, oracle_shared.as_ref());
            assert!(
                want.y.iter().chain(&want.dx).all(|&b| bf16::from_bits(b).is_finite()),
                "pass {pass}: the oracle left NaN ({block:?})"
            );
            // The f64 reference runs on the CPU: every 25th pass, where its FLOPs stay small.
            let flops = 6 * g.tokens_per_rank * g.top_k * g.hidden * g.intermediate;
            if pass % 25 == 0 && flops <= 4_000_000_000 {
                let fwd = reference::forward(
                    g,
                    &case.tokens,
                    &case.experts,
                    case.shared.as_ref(),
                    ReferenceOptions::MATCH_GPU,
                )
                .unwrap();
                let y: Vec<bf16> = want.y.iter().map(|&b| bf16::from_bits(b)).collect();
                let error = common::rel_err(&y, &fwd.y);
                assert!(error < 5e-3, "pass {pass}: oracle y vs f64 reference: rel err {error:e} ({block:?})");
                tally.reference_checks += 1;
            }
            // Every third pass on a fresh subject object; the others on the block's long-lived one.
            let fresh = step % 3 == 2;
            let mut fresh_subject = fresh.then(|| new_subject(&gpu, &block, deadline));
            tally.fresh_layers += fresh as usize;
            let target = fresh_subject.as_mut().unwrap_or(&mut subject);
            let (got, with_shared) = match target {
                Subject::Engine(layer) => {
                    // A P = 1 block without the engine runs the oracle's own path: not counted
                    // as an engine pass.
                    tally.engine_passes += layer.uses_gemm_engine() as usize;
                    tally.mma_sync_passes += !layer.uses_gemm_engine() as usize;
                    tally.megakernel_passes += layer.uses_forward_megakernel() as usize;
                    tally.backward_megakernel_passes += layer.uses_backward_megakernel() as usize;
                    tally.gathering_passes += layer.gathers_in_producer() as usize;
                    (run_unfused(&gpu, layer, &device, &oracle_experts, oracle_shared.as_ref()), true)
                }
                Subject::Ep(layer) => {
                    tally.ep_passes += 1;
                    tally.megakernel_passes += layer.uses_forward_megakernel() as usize;
                    tally.backward_megakernel_passes += layer.uses_backward_megakernel() as usize;
                    let experts = rank_experts.as_ref().expect("rank weights");
                    (run_ep(&gpu, layer, &case, experts, oracle_shared.as_ref()), false)
                }
            };
            let diff = differences(&got, &want, with_shared);
            assert!(diff.is_empty(), "pass {pass} (block {block_index}, step {step}, {block:?}): {diff:?} differ");
            tally.passes += 1;

            // Faults on the block's long-lived expert-parallel layer, then a correct pass on it.
            if let Subject::Ep(layer) = &mut subject
                && step == 5
            {
                let fault = (block_index + step) % 3;
                let experts = rank_experts.as_ref().expect("rank weights");
                if fault < 2 {
                    // Counted only where the silence was noticed (a silent pusher that owns no
                    // row is not).
                    if inject_silence(&gpu, layer, &case, experts, oracle_shared.as_ref(), fault, deadline, &mut c) {
                        if fault == 0 {
                            tally.silent_publish += 1;
                        } else {
                            tally.silent_push += 1;
                        }
                    }
                } else if inject_overflow(&gpu, &block, &weights, oracle_shared.as_ref(), deadline, &mut c) {
                    tally.ring_overflow += 1;
                }
                // The next pass on the faulted layer: correct, bit for bit.
                let again = run_ep(&gpu, layer, &case, experts, oracle_shared.as_ref());
                let diff = differences(&again, &want, false);
                assert!(diff.is_empty(), "pass {pass}: after a fault, {diff:?} differ ({block:?})");
                tally.recovered += 1;
            }
        }
        if block_index % 10 == 0 {
            let (buffers, bytes) = live_device_buffers();
            println!(
                "  after {pass} passes ({:.1} s): {buffers} mok buffers alive ({bytes} B) during block {block_index}",
                start.elapsed().as_secs_f64()
            );
        }
    }
    let (buffers_after, bytes_after) = live_device_buffers();
    let (free_after, _) = gpu.memory_info().unwrap();
    println!(
        "  {} passes in {:.1} s over {block_index} blocks: {} engine and {} mma.sync (P = 1), {} expert-parallel; {} with the megakernel forward, {} with the megakernel backward; {} gathering in the producers (P = 1); {} on \
         fresh layer objects; P seen (blocks) {:?}; routings uniform / all-to-one / empty experts {:?} passes; \
         {} blocks with groups of more than 128 rows on average; {} f64 reference checks",
        tally.passes,
        start.elapsed().as_secs_f64(),
        tally.engine_passes,
        tally.mma_sync_passes,
        tally.ep_passes,
        tally.megakernel_passes,
        tally.backward_megakernel_passes,
        tally.gathering_passes,
        tally.fresh_layers,
        tally.ranks_seen.iter().enumerate().filter(|(_, n)| **n > 0).map(|(p, n)| (p, *n)).collect::<Vec<_>>(),
        tally.routings,
        tally.large_blocks,
        tally.reference_checks,
    );
    println!(
        "  faults: {} silent publish, {} silent push, {} ring overflow; {} correct passes right after a fault",
        tally.silent_publish, tally.silent_push, tally.ring_overflow, tally.recovered
    );
    println!(
        "  after: {buffers_after} mok buffers ({bytes_after} B), driver free {:.1} MiB (before {:.1} MiB, change {:+.3} MiB)",
        free_after as f64 / 1048576.0,
        free_before as f64 / 1048576.0,
        (free_after as f64 - free_before as f64) / 1048576.0
    );
    assert_eq!(tally.passes, passes);
    assert_eq!((buffers_after, bytes_after), (buffers_before, bytes_before), "mok allocations leaked");
    if common::sanitizing() {
        // run.sh --sanitize runs the tools in parallel, so other processes allocate on this GPU
        // meanwhile: the device-wide figure says nothing then (mok's own count above still does).
        println!("  driver free memory not compared: other sanitizer processes share the GPU");
    } else {
        assert!(
            free_after + (16 << 20) >= free_before,
            "driver free memory shrank by {} bytes over the soak",
            free_before - free_after
        );
    }
    if !common::sanitizing() {
        assert!(tally.silent_publish > 0 && tally.silent_push > 0 && tally.ring_overflow > 0, "every fault ran");
        if gpu.compute_capability().0 == 9 {
            assert!(tally.engine_passes > 0 && tally.megakernel_passes > 0, "the engine and the megakernels ran");
        }
        assert!(tally.routings.iter().all(|&n| n > 0), "every routing kind ran");
        assert!(tally.ranks_seen[1..].iter().all(|&n| n > 0), "every P in 1..=8 ran: {:?}", tally.ranks_seen);
        assert!(tally.large_blocks > 0, "a block with multi-tile groups ran");
    }
}

/// The warm-up's pass (no fault, no tally that matters).
fn run_block_pass(gpu: &Gpu, block: &Block, weights: &Weights, case: &Case, deadline: Duration, tally: &mut Tally) {
    let g = &block.global;
    let experts = DeviceExperts::upload(gpu, g, &weights.experts).unwrap();
    let shared = weights.shared.as_ref().map(|s| DeviceSharedExpert::upload(gpu, g, s).unwrap());
    let device = DeviceCase {
        tokens: DeviceTokens::upload(gpu, g, &case.tokens).unwrap(),
        dy: DeviceBuffer::from_slice(gpu, &case.dy).unwrap(),
    };
    let mut oracle = UnfusedLayer::new(gpu, g.clone()).unwrap();
    let want = run_unfused(gpu, &mut oracle, &device, &experts, shared.as_ref());
    let got = match new_subject(gpu, block, deadline) {
        Subject::Engine(mut layer) => run_unfused(gpu, &mut layer, &device, &experts, shared.as_ref()),
        Subject::Ep(mut layer) => {
            let rank_experts = split_experts(gpu, layer.config(), &weights.experts);
            run_ep(gpu, &mut layer, case, &rank_experts, shared.as_ref())
        }
    };
    let diff = differences(&got, &want, block.ranks == 1);
    assert!(diff.is_empty(), "warm-up ({block:?}): {diff:?} differ");
    tally.passes += 1;
}

/// A rank that never publishes (`fault` 0) or never pushes (1): the forward must fail with a
/// timeout naming that rank as the peer, in bounded time; then the layer is reset. False when the
/// silent pusher owned no row, so nobody waited for it (no fault ran).
#[allow(clippy::too_many_arguments)]
fn inject_silence(
    gpu: &Gpu,
    layer: &mut EpLayer,
    case: &Case,
    experts: &[DeviceExperts],
    shared: Option<&DeviceSharedExpert>,
    fault: usize,
    deadline: Duration,
    c: &mut Choices,
) -> bool {
    let p = layer.config().ep_ranks;
    // Not rank 0: the error reported is the first in rank order, and rank 0's first failed wait
    // is then the one on the silent rank (a silent rank 0 would be reported through the ranks
    // that waited on its missing rows instead).
    let silent = c.range(1, p - 1);
    let kind = if fault == 0 { Silence::Publish } else { Silence::Push };
    upload_ranks(gpu, layer, case);
    layer.exchange_mut().set_silent_rank(Some((silent, kind)));
    let start = Instant::now();
    let forward = layer.forward(gpu, experts, shared);
    let result = forward.and_then(|()| layer.check_errors(gpu));
    let took = start.elapsed();
    layer.exchange_mut().set_silent_rank(None);
    let noticed = match result {
        Err(MokError::Timeout { peer, rank, .. }) => {
            // A silent pusher is only waited on when it owns rows for someone; a silent publisher
            // always is (every schedule reads every rank's flag).
            assert_eq!(peer, Some(silent), "{kind:?}: the timeout names rank {rank:?} waiting for {peer:?}");
            true
        }
        Ok(()) if kind == Silence::Push => {
            // Allowed only when no slot of any rank routes to the silent rank's experts: then it
            // owns no row, and nobody waits for a push from it.
            let loads = owner_loads(&case.tokens.topk_ids, layer.config().num_experts, p);
            assert_eq!(
                loads[silent], 0,
                "rank {silent} owns {} rows but its silent push was not noticed",
                loads[silent]
            );
            false
        }
        other => panic!("{kind:?} of rank {silent}: expected a timeout, got {other:?}"),
    };
    // Virtual ranks' launches run one after another, so each rank's schedule, dispatch and
    // combine may each wait out the deadline once; all are bounded.
    let bound = deadline * (3 * p as u32 + 2) + Duration::from_secs(2);
    assert!(took < bound, "{kind:?}: the failed pass took {took:?} (bound {bound:?})");
    layer.exchange_mut().reset(&[gpu]).unwrap();
    noticed
}

/// A ring too small for an all-to-one routing: `MokError::Capacity` naming the owner and the rows
/// the CPU count says it needs; then a fitting pass on the same layer must be correct. False when
/// the draw dropped every hot slot, so nothing could overflow (no fault ran).
fn inject_overflow(
    gpu: &Gpu,
    block: &Block,
    weights: &Weights,
    shared: Option<&DeviceSharedExpert>,
    deadline: Duration,
    c: &mut Choices,
) -> bool {
    let g = &block.global;
    let p = block.ranks;
    let hot = c.range(0, g.num_experts - 1);
    let hot_case = random_pass(block, weights, RoutingKind::AllToOne { hot }, 77, c);
    let loads = owner_loads(&hot_case.tokens.topk_ids, g.num_experts, p);
    let hot_owner = hot / (g.num_experts / p);
    // One row short of what the hot owner needs.
    let capacity = loads[hot_owner].saturating_sub(1).max(1);
    if loads[hot_owner] <= capacity {
        return false;
    }
    let config = rank_config(g, p);
    let mut small = EpLayer::new_virtual(gpu, config.clone(), ep_options(block, deadline, Some(capacity))).unwrap();
    let experts = split_experts(gpu, &config, &weights.experts);
    upload_ranks(gpu, &mut small, &hot_case);
    small.forward(gpu, &experts, shared).unwrap();
    match small.check_errors(gpu) {
        Err(MokError::Capacity { rank, needed, capacity: reported, .. }) => {
            let first = loads.iter().position(|&n| n > capacity).expect("an owner overflows");
            assert_eq!((rank, needed, reported), (first, loads[first], capacity), "capacity error");
        }
        other => panic!("expected a capacity error for ring capacity {capacity}, got {other:?}"),
    }
    small.exchange_mut().reset(&[gpu]).unwrap();
    // A routing that fits this ring: every slot dropped but those on tokens whose share fits.
    let mut fitting = hot_case;
    let mut kept = vec![0usize; p];
    let local = g.num_experts / p;
    for id in fitting.tokens.topk_ids.iter_mut() {
        if *id >= 0 {
            let owner = *id as usize / local;
            if kept[owner] < capacity {
                kept[owner] += 1;
            } else {
                *id = -1;
            }
        }
    }
    let oracle_experts = DeviceExperts::upload(gpu, g, &weights.experts).unwrap();
    let device = DeviceCase {
        tokens: DeviceTokens::upload(gpu, g, &fitting.tokens).unwrap(),
        dy: DeviceBuffer::from_slice(gpu, &fitting.dy).unwrap(),
    };
    let mut oracle = UnfusedLayer::new(gpu, g.clone()).unwrap();
    let want = run_unfused(gpu, &mut oracle, &device, &oracle_experts, shared);
    let got = run_ep(gpu, &mut small, &fitting, &experts, shared);
    let diff = differences(&got, &want, false);
    assert!(diff.is_empty(), "after a ring overflow, the fitting pass: {diff:?} differ");
    true
}
