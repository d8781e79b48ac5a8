//! GPU tests of the expert-parallel exchange with virtual ranks (P ranks in one GPU; feature
//! `gpu-tests`). Every comparison here is exact: the exchange moves bits, the schedule is integer
//! logic, and the combine sums in a fixed order that the CPU repeats in f32.
//!
//! - the device schedule equals the CPU schedule written from its definition, for P in
//!   {1, 2, 3, 4, 8};
//! - dispatch then combine (and reverse-combine then reverse-dispatch) of random rows equal the
//!   CPU permutation and the CPU's f32 sums bitwise, over two passes through the same counters;
//! - the layer over P ranks (exchange + the unfused expert compute) gives the P = 1 unfused
//!   path's bits for every output and routed gradient (the shared expert's, a sum over ranks,
//!   is not compared bitwise), for every P, and across runs;
//! - a ring too small reports the rows it needs; a peer that never signals is reported as a
//!   timeout naming the counter, the expected value and the rank — not a hang;
//! - the forward megakernel hosting every rank in one launch gives the P = 1 unfused bits for
//!   P in {1, 2, 3, 4, 6, 8}, every comm split and grid tried, 20 repeats; its faults (a tile
//!   never dispatched, a tile never stored, pushes never flagged, a rank that never publishes)
//!   are timeouts within twice the deadline, and the next pass is right.
//!
//! Tests whose name contains `bulk` use the bulk-copy movers (`cp.async.bulk` through shared
//! memory); the others the 16-byte vector movers.
#![cfg(feature = "gpu-tests")]

mod common;

use std::time::{Duration, Instant};

use common::{
    Routing, fingerprint, random_bf16, random_case, random_routing, rank_config, share, split_weights,
    upload_rank_inputs,
};
use half::bf16;
use mok::MoeConfig;
use mok::MokError;
use mok::driver::{DeviceBuffer, Gpu};
use mok::ep::EpLayer;
use mok::exchange::reference::{OwnerSchedule, reference_schedule};
use mok::exchange::{Exchange, ExchangeOptions, Silence};
use mok::kernels::layout::NO_ROW;
use mok::kernels::num::{f32_to_bf16_rne, random_uniform};
use mok::megakernel::{MegakernelFaults, MegakernelOptions};
use mok::problem::RoutedTokens;
use mok::unfused::{DeviceExperts, DeviceSharedExpert, DeviceTokens, UnfusedLayer};

fn gpu() -> Gpu {
    mok::open_gpu(0).unwrap_or_else(|e| {
        panic!("GPU tests need an NVIDIA Hopper or Blackwell GPU with its driver; this machine: {e}")
    })
}

const RANK_COUNTS: [usize; 5] = [1, 2, 3, 4, 8];

fn random_f32(count: usize, seed: u64) -> Vec<f32> {
    (0..count).map(|i| random_uniform(seed, i as u64)).collect()
}

/// Reads `len` elements of `region` of `rank`'s slice.
fn read<T: bytemuck::Pod>(exchange: &Exchange, gpu: &Gpu, rank: usize, region: u64, len: usize) -> Vec<T> {
    // SAFETY: every caller names a region of the exchange's layout with at most its length.
    unsafe { exchange.download_region(gpu, rank, region, len) }.unwrap()
}

/// The owner schedule as the device wrote it.
fn device_schedule(exchange: &Exchange, gpu: &Gpu, rank: usize) -> OwnerSchedule {
    let s = *exchange.shape();
    let (p, l) = (s.world as usize, s.local_experts() as usize);
    let r = *exchange.regions();
    let row_offsets: Vec<u32> = read(exchange, gpu, rank, r.ring_row_offsets, l + 1);
    let rows = row_offsets[l] as usize;
    let ranks: Vec<u32> = read(exchange, gpu, rank, r.ring_source_rank, rows);
    let slots: Vec<u32> = read(exchange, gpu, rank, r.ring_source_slot, rows);
    OwnerSchedule {
        counts: read(exchange, gpu, rank, r.peer_counts, p * l),
        tile_offsets: read(exchange, gpu, rank, r.ring_tile_offsets, l + 1),
        recv_base: read(exchange, gpu, rank, r.recv_base, l * p + 1),
        ring_source: ranks.into_iter().zip(slots).collect(),
        row_offsets,
    }
}

/// The mover tests' problem: T = 240 global tokens (every P in RANK_COUNTS divides it), E = 24,
/// k = 4, H = 264 (not a multiple of the 32-lane stride), dropped slots and an empty expert.
fn mover_config() -> MoeConfig {
    MoeConfig::new(240, 264, 64, 24, 4)
}

const MOVER_ROUTING: Routing<'static> = Routing { drop_probability: 0.1, empty_experts: &[5] };

/// Per-rank tokens of a random global routing.
fn rank_tokens(global: &MoeConfig, p: usize, seed: u64) -> Vec<RoutedTokens> {
    let (ids, weights) = random_routing(global, seed, MOVER_ROUTING);
    let (t, h, k) = (global.tokens_per_rank, global.hidden, global.top_k);
    let x = random_bf16(t * h, seed ^ 0x77, 1.0);
    (0..p)
        .map(|rank| RoutedTokens {
            x: share(&x, p, rank, h),
            topk_ids: share(&ids, p, rank, k),
            topk_weights: share(&weights, p, rank, k),
        })
        .collect()
}

#[test]
fn schedule_equals_the_cpu_definition_for_every_p() {
    let gpu = gpu();
    let global = mover_config();
    for p in RANK_COUNTS {
        let config = rank_config(&global, p);
        let mut exchange = Exchange::new_virtual(&gpu, &config, ExchangeOptions::default()).unwrap();
        let tokens = rank_tokens(&global, p, 11 + p as u64);
        for (rank, t) in tokens.iter().enumerate() {
            exchange.upload_tokens(&gpu, rank, &config, t).unwrap();
        }
        exchange.schedule(&[&gpu]).unwrap();
        exchange.check_errors(&[&gpu]).unwrap();
        let ids: Vec<&[i32]> = tokens.iter().map(|t| t.topk_ids.as_slice()).collect();
        let expected = reference_schedule(&ids, config.top_k, config.num_experts).unwrap();
        let total: usize = expected.iter().map(|s| s.ring_source.len()).sum();
        let r = *exchange.regions();
        let l = config.local_experts();
        for (rank, want) in expected.iter().enumerate() {
            assert_eq!(device_schedule(&exchange, &gpu, rank), *want, "P = {p}, owner {rank}");
            // The engine's tiles of 128 rows, then the odd-tile counts before each expert.
            let engine_tiles: Vec<u32> = read(&exchange, &gpu, rank, r.ring_engine_tile_offsets, 2 * (l + 1));
            let tiles: Vec<u32> = want.row_offsets.windows(2).map(|w| (w[1] - w[0]).div_ceil(128)).collect();
            let mut expected_tiles = vec![0u32; 2 * (l + 1)];
            for e in 0..l {
                expected_tiles[e + 1] = expected_tiles[e] + tiles[e];
                expected_tiles[l + 2 + e] = expected_tiles[l + 1 + e] + tiles[e] % 2;
            }
            assert_eq!(engine_tiles, expected_tiles, "P = {p}, owner {rank}: engine tile offsets");
        }
        println!("  P = {p}: schedule of {total} rows (engine tile offsets included) equals the CPU definition");
    }
}

/// One pass of all four movers with random payloads, checked bitwise against the CPU.
fn check_movers(gpu: &Gpu, global: &MoeConfig, p: usize, options: ExchangeOptions, passes: usize) {
    let config = rank_config(global, p);
    let (t, h, k) = (config.tokens_per_rank, config.hidden, config.top_k);
    let mut exchange = Exchange::new_virtual(gpu, &config, options).unwrap();
    let capacity = exchange.shape().capacity as usize;
    let r = *exchange.regions();
    for pass in 0..passes {
        let seed = 100 * p as u64 + pass as u64;
        let tokens = rank_tokens(global, p, seed);
        for (rank, tok) in tokens.iter().enumerate() {
            exchange.upload_tokens(gpu, rank, &config, tok).unwrap();
        }
        let ids: Vec<&[i32]> = tokens.iter().map(|t| t.topk_ids.as_slice()).collect();
        let schedule = reference_schedule(&ids, k, config.num_experts).unwrap();
        let gpus = [gpu];
        exchange.schedule(&gpus).unwrap();
        exchange.dispatch(&gpus).unwrap();
        // Forward combine: random f32 result rows per owner, random shared terms on even ranks.
        let rows: Vec<Vec<f32>> = (0..p).map(|o| random_f32(capacity * h, seed ^ (0x1000 + o as u64))).collect();
        let bases: Vec<Option<Vec<f32>>> =
            (0..p).map(|s| (s % 2 == 0).then(|| random_f32(t * h, seed ^ (0x2000 + s as u64)))).collect();
        let row_buffers: Vec<DeviceBuffer<f32>> =
            rows.iter().map(|v| DeviceBuffer::from_slice(gpu, v).unwrap()).collect();
        let base_buffers: Vec<Option<DeviceBuffer<f32>>> =
            bases.iter().map(|b| b.as_ref().map(|v| DeviceBuffer::from_slice(gpu, v).unwrap())).collect();
        let outs: Vec<DeviceBuffer<bf16>> = (0..p).map(|_| DeviceBuffer::alloc(gpu, t * h).unwrap()).collect();
        let ptrs = |b: &[DeviceBuffer<f32>]| b.iter().map(|x| x.device_ptr()).collect::<Vec<_>>();
        let base_ptrs: Vec<u64> = base_buffers.iter().map(|b| b.as_ref().map_or(0, |x| x.device_ptr())).collect();
        let out_ptrs: Vec<u64> = outs.iter().map(|b| b.device_ptr()).collect();
        // SAFETY: ring-sized f32 rows, [T][H] f32 bases (or 0) and [T][H] bf16 outputs of this
        // scope, alive past the check below, which waits for the stream.
        unsafe { exchange.combine(&gpus, &ptrs(&row_buffers), &base_ptrs, &out_ptrs) }.unwrap();
        // Backward: dy, then the reverse movers with other random rows.
        let dys: Vec<Vec<bf16>> = (0..p).map(|s| random_bf16(t * h, seed ^ (0x3000 + s as u64), 1.0)).collect();
        for (rank, dy) in dys.iter().enumerate() {
            exchange.upload_dy(gpu, rank, dy).unwrap();
        }
        exchange.begin_backward(&gpus).unwrap();
        exchange.reverse_combine(&gpus).unwrap();
        let dx_rows: Vec<Vec<f32>> = (0..p).map(|o| random_f32(capacity * h, seed ^ (0x4000 + o as u64))).collect();
        let dx_buffers: Vec<DeviceBuffer<f32>> =
            dx_rows.iter().map(|v| DeviceBuffer::from_slice(gpu, v).unwrap()).collect();
        let dx_outs: Vec<DeviceBuffer<bf16>> = (0..p).map(|_| DeviceBuffer::alloc(gpu, t * h).unwrap()).collect();
        let dx_ptrs: Vec<u64> = dx_outs.iter().map(|b| b.device_ptr()).collect();
        // SAFETY: as for the combine above.
        unsafe { exchange.reverse_dispatch(&gpus, &ptrs(&dx_buffers), &base_ptrs, &dx_ptrs) }.unwrap();
        exchange.check_errors(&gpus).unwrap();

        // Dispatch and reverse-combine: the CPU permutation of x and of weight-scaled dy.
        for (owner, sched) in schedule.iter().enumerate() {
            let n = sched.ring_source.len();
            let ring_x: Vec<bf16> = read(&exchange, gpu, owner, r.ring_x, n * h);
            let ring_dy: Vec<bf16> = read(&exchange, gpu, owner, r.ring_dy, n * h);
            for (row, &(source, slot)) in sched.ring_source.iter().enumerate() {
                let (s, slot) = (source as usize, slot as usize);
                let token = slot / k;
                let x = &tokens[s].x[token * h..(token + 1) * h];
                assert!(ring_x[row * h..(row + 1) * h] == *x, "P = {p}, owner {owner}: ring_x row {row} differs");
                let w = tokens[s].topk_weights[slot];
                let scaled: Vec<u16> =
                    dys[s][token * h..(token + 1) * h].iter().map(|v| f32_to_bf16_rne(w * v.to_f32())).collect();
                let got: Vec<u16> = ring_dy[row * h..(row + 1) * h].iter().map(|v| v.to_bits()).collect();
                assert!(got == scaled, "P = {p}, owner {owner}: ring_dy row {row} differs");
            }
        }
        // Combine and reverse-dispatch: the slots hold the owners' rows, the sums the CPU's.
        for s in 0..p {
            let mut expected_slots = vec![f32::NAN; t * k * h];
            let mut expected_dx_slots = vec![f32::NAN; t * k * h];
            for (owner, sched) in schedule.iter().enumerate() {
                for (row, &(source, slot)) in sched.ring_source.iter().enumerate() {
                    if source as usize == s {
                        let slot = slot as usize;
                        expected_slots[slot * h..(slot + 1) * h].copy_from_slice(&rows[owner][row * h..(row + 1) * h]);
                        expected_dx_slots[slot * h..(slot + 1) * h]
                            .copy_from_slice(&dx_rows[owner][row * h..(row + 1) * h]);
                    }
                }
            }
            let slots: Vec<f32> = read(&exchange, gpu, s, r.combine_slots, t * k * h);
            let dx_slots: Vec<f32> = read(&exchange, gpu, s, r.dx_slots, t * k * h);
            let slot_row: Vec<u32> = read(&exchange, gpu, s, r.slot_row, t * k);
            // A slot has no row exactly when the CPU's ids drop it (-1): every live slot sums.
            for (slot, (&row, &id)) in slot_row.iter().zip(&tokens[s].topk_ids).enumerate() {
                assert_eq!(row == NO_ROW, id < 0, "P = {p}, rank {s}: slot {slot} (id {id}) has row {row}");
            }
            let (mut y, mut dx) = (Vec::with_capacity(t * h), Vec::with_capacity(t * h));
            for token in 0..t {
                for c in 0..h {
                    let base = bases[s].as_ref().map_or(0.0, |b| b[token * h + c]);
                    let (mut acc, mut acc_dx) = (base, base);
                    for j in 0..k {
                        let slot = token * k + j;
                        if slot_row[slot] == NO_ROW {
                            continue;
                        }
                        assert_eq!(slots[slot * h + c].to_bits(), expected_slots[slot * h + c].to_bits());
                        assert_eq!(dx_slots[slot * h + c].to_bits(), expected_dx_slots[slot * h + c].to_bits());
                        acc += tokens[s].topk_weights[slot] * expected_slots[slot * h + c];
                        acc_dx += 1.0 * expected_dx_slots[slot * h + c];
                    }
                    y.push(f32_to_bf16_rne(acc));
                    dx.push(f32_to_bf16_rne(acc_dx));
                }
            }
            let got_y: Vec<u16> = outs[s].download().unwrap().iter().map(|v| v.to_bits()).collect();
            let got_dx: Vec<u16> = dx_outs[s].download().unwrap().iter().map(|v| v.to_bits()).collect();
            assert!(got_y == y, "P = {p}, rank {s}: combined y differs from the CPU's f32 sum");
            assert!(got_dx == dx, "P = {p}, rank {s}: combined dx differs from the CPU's f32 sum");
        }
        let moved: usize = schedule.iter().map(|s| s.ring_source.len()).sum();
        println!("  P = {p}, pass {pass}: {moved} rows dispatched, combined, pulled and pushed back bitwise");
    }
}

#[test]
fn movers_equal_the_cpu_permutation_bitwise() {
    let gpu = gpu();
    for p in RANK_COUNTS {
        // Two passes through the same heap: the arrival counters are monotonic and the
        // baselines must carry over.
        check_movers(&gpu, &mover_config(), p, ExchangeOptions::default(), 2);
    }
}

#[test]
fn bulk_movers_equal_the_cpu_permutation_bitwise() {
    let gpu = gpu();
    for p in [1, 3, 8] {
        check_movers(&gpu, &mover_config(), p, ExchangeOptions { bulk_copies: true, ..Default::default() }, 2);
    }
}

/// The layer's outputs on the host, concatenated over ranks in rank order.
struct LayerBits {
    y: Vec<bf16>,
    dx: Vec<bf16>,
    d_topk_weights: Vec<f32>,
    dw: [Vec<bf16>; 3],
}

impl LayerBits {
    fn prints(&self) -> [u64; 6] {
        [
            fingerprint(&self.y),
            fingerprint(&self.dx),
            fingerprint(&self.d_topk_weights),
            fingerprint(&self.dw[0]),
            fingerprint(&self.dw[1]),
            fingerprint(&self.dw[2]),
        ]
    }
}

fn ep_config() -> MoeConfig {
    MoeConfig { shared_intermediate: Some(64), swiglu_limit: Some(2.0), ..MoeConfig::new(240, 136, 96, 24, 4) }
}

fn run_ep(gpu: &Gpu, case: &common::Case, p: usize, options: ExchangeOptions) -> LayerBits {
    let config = rank_config(&case.config, p);
    let mut layer = EpLayer::new_virtual(gpu, config.clone(), options).unwrap();
    layer.poison(gpu).unwrap();
    let experts: Vec<DeviceExperts> =
        split_weights(&case.experts, p).iter().map(|w| DeviceExperts::upload(gpu, &config, w).unwrap()).collect();
    let shared = case.shared.as_ref().map(|s| DeviceSharedExpert::upload(gpu, &config, s).unwrap());
    upload_rank_inputs(gpu, &layer, case);
    layer.forward(gpu, &experts, shared.as_ref()).unwrap();
    layer.backward(gpu, &experts, shared.as_ref()).unwrap();
    layer.check_errors(gpu).unwrap();
    let mut bits = LayerBits { y: vec![], dx: vec![], d_topk_weights: vec![], dw: [vec![], vec![], vec![]] };
    for rank in 0..p {
        let out = layer.outputs(rank).unwrap();
        bits.y.extend(out.y.download().unwrap());
        bits.dx.extend(out.dx.download().unwrap());
        bits.d_topk_weights.extend(out.d_topk_weights.download().unwrap());
        for (all, part) in bits.dw.iter_mut().zip(out.dw) {
            all.extend(part.download().unwrap());
        }
    }
    bits
}

fn assert_same_bits(what: &str, got: &LayerBits, want: &LayerBits) {
    let same = |a: &[bf16], b: &[bf16]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()) && a.len() == b.len();
    assert!(same(&got.y, &want.y), "{what}: y differs");
    assert!(same(&got.dx, &want.dx), "{what}: dx differs");
    assert!(
        got.d_topk_weights.iter().map(|v| v.to_bits()).eq(want.d_topk_weights.iter().map(|v| v.to_bits())),
        "{what}: d_topk_weights differ"
    );
    for (name, (g, w)) in ["dw_gate", "dw_up", "dw_down"].iter().zip(got.dw.iter().zip(&want.dw)) {
        assert!(same(g, w), "{what}: {name} differs");
    }
}

/// The P = 1 unfused path's bits for `case`: the foundation's oracle.
fn unfused_bits(gpu: &Gpu, case: &common::Case) -> LayerBits {
    let global = &case.config;
    let mut unfused = UnfusedLayer::new(gpu, global.clone()).unwrap();
    unfused.poison().unwrap();
    let tokens = DeviceTokens::upload(gpu, global, &case.tokens).unwrap();
    let experts = DeviceExperts::upload(gpu, global, &case.experts).unwrap();
    let shared = case.shared.as_ref().map(|s| DeviceSharedExpert::upload(gpu, global, s).unwrap());
    let dy = DeviceBuffer::from_slice(gpu, &case.dy).unwrap();
    unfused.forward(gpu, &tokens, &experts, shared.as_ref()).unwrap();
    unfused.backward(gpu, &tokens, &experts, shared.as_ref(), &dy).unwrap();
    gpu.synchronize().unwrap();
    unfused.check_device_errors().unwrap();
    let g = &unfused.grads();
    let bits = LayerBits {
        y: unfused.y().download().unwrap(),
        dx: g.dx.download().unwrap(),
        d_topk_weights: g.d_topk_weights.download().unwrap(),
        dw: [g.dw_gate.download().unwrap(), g.dw_up.download().unwrap(), g.dw_down.download().unwrap()],
    };
    assert!(bits.y.iter().chain(&bits.dx).all(|v| v.is_finite()), "the unfused run left NaN");
    bits
}

fn ep_case() -> common::Case {
    random_case(&ep_config(), 2026, Routing { drop_probability: 0.1, empty_experts: &[7] })
}

#[test]
fn ep_layer_matches_the_single_rank_path_bitwise_for_every_p() {
    let gpu = gpu();
    let case = ep_case();
    let want = unfused_bits(&gpu, &case);
    for p in RANK_COUNTS {
        let got = run_ep(&gpu, &case, p, ExchangeOptions::default());
        assert_same_bits(&format!("P = {p}"), &got, &want);
        println!("  P = {p}: y, dx, d_topk_weights, dW_gate, dW_up, dW_down equal the P = 1 unfused bits");
    }
    let again = run_ep(&gpu, &case, 4, ExchangeOptions::default());
    assert_eq!(again.prints(), want.prints(), "P = 4 run again");
    println!("  P = 4 again: fingerprints {:016x?}", again.prints());
}

#[test]
fn a_backward_without_a_whole_forward_is_refused() {
    // Before any forward a layer's routing and rows are uninitialised memory: its backward must
    // be an error, not kernels indexing with garbage. Then a forward makes it allowed; a forward
    // refused for bad input makes it refused again (the last forward did not run), and so do a
    // routing enqueued on its own (`UnfusedLayer::route`) and new tokens (`upload_tokens`).
    let gpu = gpu();
    let case = ep_case();
    let global = &case.config;
    let tokens = DeviceTokens::upload(&gpu, global, &case.tokens).unwrap();
    let weights = DeviceExperts::upload(&gpu, global, &case.experts).unwrap();
    let shared_weights = case.shared.as_ref().map(|s| DeviceSharedExpert::upload(&gpu, global, s).unwrap());
    let dy = DeviceBuffer::from_slice(&gpu, &case.dy).unwrap();
    let mut one = UnfusedLayer::new(&gpu, global.clone()).unwrap();
    let backward = |layer: &mut UnfusedLayer| layer.backward(&gpu, &tokens, &weights, shared_weights.as_ref(), &dy);
    let refused = |result: mok::Result<()>, what: &str| match result {
        Err(MokError::InvalidInput { tensor: "backward", problem }) => {
            assert!(problem.contains("forward"), "{what}: {problem}")
        }
        other => panic!("{what}: expected the backward refused, got {other:?}"),
    };
    refused(backward(&mut one), "UnfusedLayer before any forward");
    one.forward(&gpu, &tokens, &weights, shared_weights.as_ref()).unwrap();
    backward(&mut one).unwrap();
    let short = DeviceBuffer::<bf16>::alloc(&gpu, global.hidden - 8).unwrap();
    let bad = mok::unfused::TokensView { x: (&short).into(), ..(&tokens).into() };
    let shared_view = shared_weights.as_ref().map(Into::into);
    assert!(matches!(
        one.forward_views(&gpu, bad, (&weights).into(), shared_view),
        Err(MokError::InvalidInput { tensor: "x", .. })
    ));
    refused(backward(&mut one), "UnfusedLayer after a refused forward");
    // A routing enqueued on its own replaces the layout the backward would read.
    one.forward(&gpu, &tokens, &weights, shared_weights.as_ref()).unwrap();
    one.route(&gpu, (&tokens.topk_ids).into()).unwrap();
    refused(backward(&mut one), "UnfusedLayer after a routing of its own");
    gpu.synchronize().unwrap();
    one.check_device_errors().unwrap();

    let p = 2;
    let config = rank_config(global, p);
    let mut ep = EpLayer::new_virtual(&gpu, config.clone(), ExchangeOptions::default()).unwrap();
    let experts: Vec<DeviceExperts> =
        split_weights(&case.experts, p).iter().map(|w| DeviceExperts::upload(&gpu, &config, w).unwrap()).collect();
    let shared = case.shared.as_ref().map(|s| DeviceSharedExpert::upload(&gpu, &config, s).unwrap());
    upload_rank_inputs(&gpu, &ep, &case);
    refused(ep.backward(&gpu, &experts, shared.as_ref()), "EpLayer before any forward");
    ep.forward(&gpu, &experts, shared.as_ref()).unwrap();
    ep.backward(&gpu, &experts, shared.as_ref()).unwrap();
    // New tokens for the next forward replace what the backward would read.
    upload_rank_inputs(&gpu, &ep, &case);
    refused(ep.backward(&gpu, &experts, shared.as_ref()), "EpLayer after new tokens");
    ep.forward(&gpu, &experts, shared.as_ref()).unwrap();
    ep.backward(&gpu, &experts, shared.as_ref()).unwrap();
    ep.check_errors(&gpu).unwrap();
    println!(
        "  a backward before any whole forward, or after new routing or tokens: refused on both layers; allowed after \
         a forward"
    );
}

#[test]
fn bulk_ep_layer_matches_the_single_rank_path_bitwise() {
    let gpu = gpu();
    let case = ep_case();
    let want = unfused_bits(&gpu, &case);
    for p in [2, 8] {
        let got = run_ep(&gpu, &case, p, ExchangeOptions { bulk_copies: true, ..Default::default() });
        assert_same_bits(&format!("bulk movers, P = {p}"), &got, &want);
        println!("  bulk movers, P = {p}: every output and routed gradient equals the P = 1 unfused bits");
    }
}

#[test]
fn ring_overflow_reports_the_rows_needed() {
    let gpu = gpu();
    let global = mover_config();
    let p = 4;
    let config = rank_config(&global, p);
    let options = ExchangeOptions { capacity_rows: Some(20), timeout: Duration::from_millis(50), ..Default::default() };
    let mut exchange = Exchange::new_virtual(&gpu, &config, options).unwrap();
    let tokens = rank_tokens(&global, p, 5);
    for (rank, t) in tokens.iter().enumerate() {
        exchange.upload_tokens(&gpu, rank, &config, t).unwrap();
    }
    let ids: Vec<&[i32]> = tokens.iter().map(|t| t.topk_ids.as_slice()).collect();
    let schedule = reference_schedule(&ids, config.top_k, config.num_experts).unwrap();
    let first_overflow = schedule.iter().position(|s| s.ring_source.len() > 20).expect("some owner overflows");
    // The whole forward runs on: movers skip the empty ring, the combine reports, nothing faults.
    let start = Instant::now();
    exchange.schedule(&[&gpu]).unwrap();
    exchange.dispatch(&[&gpu]).unwrap();
    let h = config.hidden;
    let rows = DeviceBuffer::<f32>::alloc(&gpu, 20 * h).unwrap();
    let outs: Vec<DeviceBuffer<bf16>> =
        (0..p).map(|_| DeviceBuffer::alloc(&gpu, config.tokens_per_rank * h).unwrap()).collect();
    // SAFETY: ring-sized (20-row) f32 rows shared by the ranks and [T][H] bf16 outputs, alive to
    // the end of the test.
    unsafe {
        exchange.combine(
            &[&gpu],
            &vec![rows.device_ptr(); p],
            &vec![0; p],
            &outs.iter().map(|o| o.device_ptr()).collect::<Vec<_>>(),
        )
    }
    .unwrap();
    match exchange.check_errors(&[&gpu]) {
        Err(MokError::Capacity { rank, needed, capacity, .. }) => {
            assert_eq!((rank, needed, capacity), (first_overflow, schedule[first_overflow].ring_source.len(), 20));
            println!("  reported: {}", exchange.check_errors(&[&gpu]).unwrap_err());
        }
        other => panic!("expected a capacity error, got {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(10), "the failed pass took {:?}", start.elapsed());
}

#[test]
fn a_silent_peer_is_a_reported_timeout_not_a_hang() {
    let gpu = gpu();
    let global = mover_config();
    let p = 2;
    let config = rank_config(&global, p);
    let (t, h) = (config.tokens_per_rank, config.hidden);
    let options = ExchangeOptions { timeout: Duration::from_millis(50), ..Default::default() };
    let tokens = rank_tokens(&global, p, 9);
    let new_exchange = || {
        let exchange = Exchange::new_virtual(&gpu, &config, options).unwrap();
        for (rank, tok) in tokens.iter().enumerate() {
            exchange.upload_tokens(&gpu, rank, &config, tok).unwrap();
        }
        exchange
    };
    let mut exchange = new_exchange();
    let capacity = exchange.shape().capacity as usize;
    let rows: Vec<DeviceBuffer<f32>> =
        (0..p).map(|o| DeviceBuffer::from_slice(&gpu, &random_f32(capacity * h, o as u64)).unwrap()).collect();
    let row_ptrs: Vec<u64> = rows.iter().map(|r| r.device_ptr()).collect();
    let new_outs =
        || -> Vec<DeviceBuffer<bf16>> { (0..p).map(|_| DeviceBuffer::alloc(&gpu, t * h).unwrap()).collect() };
    // One pass: schedule, dispatch, combine into `outs`, then the error records.
    let pass = |exchange: &mut Exchange, outs: &[DeviceBuffer<bf16>]| {
        let out_ptrs: Vec<u64> = outs.iter().map(|o| o.device_ptr()).collect();
        exchange.schedule(&[&gpu]).unwrap();
        exchange.dispatch(&[&gpu]).unwrap();
        // SAFETY: ring-sized f32 rows and [T][H] bf16 outputs of the test's scope, which
        // outlives every pass.
        unsafe { exchange.combine(&[&gpu], &row_ptrs, &[0, 0], &out_ptrs) }.unwrap();
        exchange.check_errors(&[&gpu])
    };
    // What a fresh exchange, which never saw a fault, gives for the same tokens and rows.
    let fresh: Vec<Vec<bf16>> = {
        let clean_outs = new_outs();
        pass(&mut new_exchange(), &clean_outs).unwrap();
        clean_outs.iter().map(|o| o.download().unwrap()).collect()
    };
    let mut outs = new_outs();

    // 1. Rank 1 never publishes: rank 0's schedule waits for its flag.
    exchange.set_silent_rank(Some((1, Silence::Publish)));
    let start = Instant::now();
    let error = pass(&mut exchange, &outs).unwrap_err();
    println!("  silent publish ({:?}): {error}", start.elapsed());
    match &error {
        MokError::Timeout { rank: Some(0), peer: Some(1), waited_for, detail } => {
            assert!(waited_for.contains("publish"), "{waited_for}");
            assert!(detail.contains("expected epoch 1"), "{detail}");
        }
        other => panic!("expected rank 0 to time out on rank 1's publish flag, got {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());

    // 2. After a reset, rank 1 publishes but never pushes: rank 0's combine waits for its rows.
    exchange.reset(&[&gpu]).unwrap();
    exchange.set_silent_rank(Some((1, Silence::Push)));
    let start = Instant::now();
    let error = pass(&mut exchange, &outs).unwrap_err();
    println!("  silent push ({:?}): {error}", start.elapsed());
    match &error {
        MokError::Timeout { rank: Some(0), peer: Some(1), waited_for, detail } => {
            assert!(waited_for.contains("combine"), "{waited_for}");
            assert!(detail.contains("0 arrived"), "{detail}");
        }
        other => panic!("expected rank 0 to time out on rank 1's combine rows, got {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());

    // 3. After a reset with everyone talking, the exchange works again: every rank's output
    // (poisoned first) is the fresh exchange's.
    exchange.reset(&[&gpu]).unwrap();
    exchange.set_silent_rank(None);
    for out in &mut outs {
        out.fill_bytes(0xff).unwrap();
    }
    pass(&mut exchange, &outs).unwrap();
    for (rank, (out, want)) in outs.iter().zip(&fresh).enumerate() {
        assert!(
            same_bf16(&out.download().unwrap(), want),
            "rank {rank}'s y after recovery differs from a fresh exchange's"
        );
    }
}

#[test]
fn bad_ids_on_the_device_are_reported_by_the_chunk_ranking() {
    let gpu = gpu();
    let global = mover_config();
    let p = 2;
    let config = rank_config(&global, p);
    let mut exchange = Exchange::new_virtual(&gpu, &config, ExchangeOptions::default()).unwrap();
    let mut tokens = rank_tokens(&global, p, 21);
    for (rank, t) in tokens.iter().enumerate() {
        exchange.upload_tokens(&gpu, rank, &config, t).unwrap();
    }
    // Rank 1, token 70 (the second 64-token chunk): slot 1 repeats slot 0's expert. Written
    // straight into the heap, past the host's validation, as a device-side producer could.
    let k = config.top_k;
    tokens[1].topk_ids[70 * k] = 3;
    tokens[1].topk_ids[70 * k + 1] = 3;
    // SAFETY: the ids region holds T·k ids.
    unsafe { exchange.upload_region(&gpu, 1, exchange.regions().topk_ids, &tokens[1].topk_ids) }.unwrap();
    exchange.schedule(&[&gpu]).unwrap();
    let error = exchange.check_errors(&[&gpu]).unwrap_err();
    println!("  reported: {error}");
    match &error {
        MokError::Device { message, .. } => {
            assert!(message.contains("rank 1: token 70 slot 1 has bad expert id 3"), "{message}")
        }
        other => panic!("expected a device error naming the slot, got {other:?}"),
    }
    // The slot was dropped: the schedule is the CPU's with that slot dropped.
    tokens[1].topk_ids[70 * k + 1] = -1;
    let ids: Vec<&[i32]> = tokens.iter().map(|t| t.topk_ids.as_slice()).collect();
    let expected = reference_schedule(&ids, k, config.num_experts).unwrap();
    for (rank, want) in expected.iter().enumerate() {
        assert_eq!(device_schedule(&exchange, &gpu, rank), *want, "owner {rank}");
    }
}

/// The forward megakernel over ranks (`None` when this GPU cannot run it, which is said; an
/// sm_90 GPU must run it).
fn megakernel_ep_layer(gpu: &Gpu, config: &MoeConfig, options: ExchangeOptions) -> Option<EpLayer> {
    let mut layer = EpLayer::new_virtual(gpu, config.clone(), options).unwrap();
    match layer.set_forward_megakernel(gpu, Some(MegakernelOptions::default())) {
        Ok(()) => Some(layer),
        Err(e) => {
            assert_ne!(gpu.compute_capability().0, 9, "an sm_90 GPU must run the forward megakernel: {e}");
            println!("  NOT RUN on this GPU (the forward megakernel needs sm_90a): {e}");
            None
        }
    }
}

/// Uploads `case`'s weights split over the layer's ranks.
fn rank_weights(
    gpu: &Gpu,
    config: &MoeConfig,
    case: &common::Case,
) -> (Vec<DeviceExperts>, Option<DeviceSharedExpert>) {
    let experts = split_weights(&case.experts, config.ep_ranks)
        .iter()
        .map(|w| DeviceExperts::upload(gpu, config, w).unwrap())
        .collect();
    (experts, case.shared.as_ref().map(|s| DeviceSharedExpert::upload(gpu, config, s).unwrap()))
}

/// Every rank's y after one poisoned forward, in rank order.
fn ep_forward_y(
    gpu: &Gpu,
    layer: &mut EpLayer,
    weights: &(Vec<DeviceExperts>, Option<DeviceSharedExpert>),
) -> Vec<bf16> {
    layer.poison(gpu).unwrap();
    layer.forward(gpu, &weights.0, weights.1.as_ref()).unwrap();
    layer.check_errors(gpu).unwrap();
    (0..layer.config().ep_ranks).flat_map(|r| layer.outputs(r).unwrap().y.download().unwrap()).collect()
}

/// Every output and gradient of the layer's last forward + backward, in rank order.
fn ep_bits(gpu: &Gpu, layer: &mut EpLayer, weights: &(Vec<DeviceExperts>, Option<DeviceSharedExpert>)) -> LayerBits {
    let y = ep_forward_y(gpu, layer, weights);
    layer.backward(gpu, &weights.0, weights.1.as_ref()).unwrap();
    layer.check_errors(gpu).unwrap();
    let mut bits = LayerBits { y, dx: vec![], d_topk_weights: vec![], dw: [vec![], vec![], vec![]] };
    for rank in 0..layer.config().ep_ranks {
        let out = layer.outputs(rank).unwrap();
        bits.dx.extend(out.dx.download().unwrap());
        bits.d_topk_weights.extend(out.d_topk_weights.download().unwrap());
        for (all, part) in bits.dw.iter_mut().zip(out.dw) {
            all.extend(part.download().unwrap());
        }
    }
    bits
}

fn same_bf16(a: &[bf16], b: &[bf16]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Per-rank comm blocks and grids to try for `p` ranks when `resident` blocks fit at once:
/// `(comm blocks per rank, blocks or None for all)`, each leaving every rank a compute pair.
fn ep_geometries(resident: u32, p: u32) -> Vec<(u32, Option<u32>)> {
    let share = 2 * (resident / 2 / p);
    let fits = |comm: u32, blocks: u32| comm.next_multiple_of(2) + 2 <= 2 * (blocks / 2 / p);
    let mut all: Vec<(u32, Option<u32>)> =
        [0, 1, 2, 3, share / 4, share / 2, share - 2].into_iter().map(|c| (c, None)).collect();
    // Smaller grids: one compute pair per rank alone, one comm block beside one pair, and a
    // grid a pair short of the resident one.
    all.extend([(0, Some(2 * p)), (1, Some(4 * p)), (2, Some(6 * p + 2)), (1, Some(resident - 2))]);
    all.retain(|&(c, b)| fits(c, b.unwrap_or(resident)) && b.is_none_or(|b| b <= resident));
    all.dedup();
    all
}

/// The expert-parallel megakernel tests' shapes, per rank (global T = that × P): ragged with
/// dropped slots, an empty expert, the shared expert and a limit; T = 1 with k = 1; k = 10 with
/// two empty experts; every token on three experts; k = 8 with the shared expert; k = 40, so the
/// combines' warps hold slots 32 and up in their lanes' second word.
fn ep_megakernel_cases() -> [(MoeConfig, Routing<'static>); 6] {
    const HOT: &[usize] = &[0, 1, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 21, 22, 23];
    let config = |t, h, i, e, k, shared, limit| MoeConfig {
        shared_intermediate: shared,
        swiglu_limit: limit,
        ..MoeConfig::new(t, h, i, e, k)
    };
    [
        (config(37, 136, 96, 24, 4, Some(64), Some(2.0)), Routing { drop_probability: 0.1, empty_experts: &[7] }),
        (config(1, 64, 64, 24, 1, None, None), common::PLAIN_ROUTING),
        (config(29, 72, 40, 24, 10, None, Some(1.5)), Routing { drop_probability: 0.05, empty_experts: &[0, 13] }),
        (config(64, 256, 192, 24, 3, Some(128), None), Routing { drop_probability: 0.0, empty_experts: HOT }),
        (config(128, 512, 256, 24, 8, Some(256), Some(1.0)), Routing { drop_probability: 0.02, empty_experts: &[5] }),
        (config(24, 64, 64, 48, 40, None, None), Routing { drop_probability: 0.1, empty_experts: &[11] }),
    ]
}

/// One expert-parallel megakernel case: `per_rank`'s shape over `p` virtual ranks (global T =
/// tokens per rank × p) with random inputs from `seed`, the P = 1 unfused bits it must give,
/// its name, and a layer on the forward megakernel (`backward_too`: and the backward one) with
/// the case's inputs and weights uploaded; `None` where this GPU has no megakernel (the layer
/// constructor says so).
struct RankCase {
    want: LayerBits,
    what: String,
    layer: EpLayer,
    weights: (Vec<DeviceExperts>, Option<DeviceSharedExpert>),
}

fn rank_case(
    gpu: &Gpu,
    (per_rank, p): (&MoeConfig, usize),
    seed: u64,
    routing: Routing,
    backward_too: bool,
) -> Option<RankCase> {
    let global = MoeConfig { tokens_per_rank: per_rank.tokens_per_rank * p, ..per_rank.clone() };
    let case = random_case(&global, seed, routing);
    let want = unfused_bits(gpu, &case);
    let c = rank_config(&global, p);
    let layer = if backward_too {
        megakernels_ep_layer(gpu, &c, ExchangeOptions::default())?
    } else {
        megakernel_ep_layer(gpu, &c, ExchangeOptions::default())?
    };
    upload_rank_inputs(gpu, &layer, &case);
    let weights = rank_weights(gpu, &c, &case);
    Some(RankCase { want, what: rank_case_name(&c, p), layer, weights })
}

/// How the megakernel tests name a case: P and the per-rank shape.
fn rank_case_name(c: &MoeConfig, p: usize) -> String {
    format!("P={p} T={}·{p} H={} I={} E={} k={}", c.tokens_per_rank, c.hidden, c.intermediate, c.num_experts, c.top_k)
}

#[test]
fn ep_forward_megakernel_is_bitwise_the_single_rank_path() {
    // One launch hosting every virtual rank (pull dispatch from the token owners, the engine's
    // gate/up and down tiles, push of the rows back to their owners, the owners' combine) must
    // give the P = 1 unfused path's bits — for y, and, through the unchanged backward, for
    // everything the backward reads — for every P, comm split and grid, on ragged, empty and
    // hot experts, T = 1 and T not a multiple of anything, dropped slots, k = 1, 10 and 40, the
    // shared expert on and off and the SwiGLU limit.
    let gpu = gpu();
    let cases = ep_megakernel_cases();
    let rank_counts = common::sized("megakernel rank counts", vec![1, 2, 3, 4, 6, 8], vec![1, 3]);
    let shapes = common::sized("megakernel shapes", cases.len(), 2);
    let mut runs = 0;
    for (seed, (per_rank, routing)) in cases.into_iter().take(shapes).enumerate() {
        for &p in &rank_counts {
            let seed = 700 + 10 * seed as u64 + p as u64;
            let Some(RankCase { want, what, mut layer, weights }) =
                rank_case(&gpu, (&per_rank, p), seed, routing, false)
            else {
                return;
            };
            // The default geometry, then the backward on what it saved.
            assert_same_bits(&format!("{what}, default"), &ep_bits(&gpu, &mut layer, &weights), &want);
            let (resident, _) = layer.forward_megakernel_geometry().unwrap();
            let geometries = ep_geometries(resident, p as u32);
            let geometries = if common::sanitizing() { &geometries[..2] } else { &geometries[..] };
            for (i, &(comm, blocks)) in geometries.iter().enumerate() {
                // Every other geometry with each rank's tiles on its own blocks.
                let share_rank_tiles = i % 2 == 0;
                let options =
                    MegakernelOptions { comm_blocks: Some(comm), blocks, share_rank_tiles, ..Default::default() };
                layer.set_forward_megakernel(&gpu, Some(options)).unwrap();
                let y = ep_forward_y(&gpu, &mut layer, &weights);
                assert_eq!(layer.forward_megakernel_geometry(), Some((blocks.unwrap_or(resident), comm)));
                assert!(
                    same_bf16(&y, &want.y),
                    "{what}: y differs with {comm} comm blocks per rank of {blocks:?} (tiles shared across ranks: \
                     {share_rank_tiles})"
                );
                runs += 1;
            }
            println!(
                "  {what}: every output and routed gradient equal to the P = 1 unfused bits; y equal over {} geometries \
                 (resident {resident} blocks)",
                geometries.len()
            );
        }
    }
    assert!(runs > 0);
}

#[test]
fn ep_forward_megakernel_repeats_bitwise_and_rejects_bad_geometry() {
    let gpu = gpu();
    let p = 4;
    let global =
        MoeConfig { shared_intermediate: Some(64), swiglu_limit: Some(2.0), ..MoeConfig::new(4 * 37, 136, 96, 24, 4) };
    let c = rank_config(&global, p);
    let case = random_case(&global, 901, Routing { drop_probability: 0.1, empty_experts: &[7] });
    let Some(mut layer) = megakernel_ep_layer(&gpu, &c, ExchangeOptions::default()) else { return };
    upload_rank_inputs(&gpu, &layer, &case);
    let weights = rank_weights(&gpu, &c, &case);
    let first = ep_forward_y(&gpu, &mut layer, &weights);
    let repeats = common::sized("repeats", 20, 3);
    for i in 1..repeats {
        assert!(same_bf16(&ep_forward_y(&gpu, &mut layer, &weights), &first), "repeat {i} differs");
    }
    println!("  {repeats} passes at P = {p} on one layer: bitwise identical");
    let (resident, _) = layer.forward_megakernel_geometry().unwrap();
    for (comm, blocks, why) in [
        (Some(resident / p as u32), None, "no compute pair in a rank"),
        (Some(0), Some(2 * p as u32 - 2), "fewer pairs than ranks"),
        (Some(0), Some(resident + 2), "more blocks than fit at once"),
        (Some(0), Some(2 * p as u32 + 1), "an odd block count"),
    ] {
        // The geometry is checked when it is set, before any pass runs with it.
        let options = MegakernelOptions { comm_blocks: comm, blocks, ..Default::default() };
        match layer.set_forward_megakernel(&gpu, Some(options)) {
            Err(MokError::InvalidInput { tensor, problem }) => println!("  {why}: {tensor}: {problem}"),
            other => panic!("{why}: expected InvalidInput, got {other:?}"),
        }
        // A refused geometry leaves the layer as it was.
        assert!(same_bf16(&ep_forward_y(&gpu, &mut layer, &weights), &first), "after refusing: {why}");
    }
    layer.set_forward_megakernel(&gpu, Some(MegakernelOptions::default())).unwrap();
    assert!(same_bf16(&ep_forward_y(&gpu, &mut layer, &weights), &first), "after the rejected geometries");
}

/// Every injected fault must be reported within twice the deadline (under compute-sanitizer
/// the instrumented pass itself takes seconds: more slack).
fn assert_reported_in_time(took: Duration, deadline: Duration) {
    let slack = Duration::from_millis(common::sized("fault slack (ms)", 100, 4000));
    assert!(took < 2 * deadline + slack, "reported after {took:?}");
}

/// After a fault: no rank silent, and the exchange's counters and error records reset.
fn silence_off_and_reset(gpu: &Gpu, layer: &mut EpLayer) {
    layer.exchange_mut().set_silent_rank(None);
    layer.exchange_mut().reset(&[gpu]).unwrap();
}

#[test]
fn ep_forward_megakernel_faults_are_reported_timeouts_and_the_next_pass_is_right() {
    let gpu = gpu();
    let p = 4;
    let global = MoeConfig { shared_intermediate: Some(64), ..MoeConfig::new(4 * 64, 136, 96, 24, 4) };
    let c = rank_config(&global, p);
    let case = random_case(&global, 902, common::PLAIN_ROUTING);
    // Under compute-sanitizer every kernel runs many times slower: a longer deadline keeps the
    // bound about the waits, not the tool.
    let deadline = Duration::from_millis(common::sized("fault deadline (ms)", 200, 2000));
    let options = ExchangeOptions { timeout: deadline, ..Default::default() };
    let Some(mut layer) = megakernel_ep_layer(&gpu, &c, options) else { return };
    upload_rank_inputs(&gpu, &layer, &case);
    let weights = rank_weights(&gpu, &c, &case);
    let want = ep_forward_y(&gpu, &mut layer, &weights);
    // The fault-free pass is the oracle's, so "the next pass is right" means right.
    assert!(same_bf16(&want, &unfused_bits(&gpu, &case).y), "the fault-free pass differs from the P = 1 unfused y");
    /// A fault of one rank, what the error must say, and which rank's record names the cause
    /// (`None`: any — every token owner waiting on a silent pusher times out on its own, at about
    /// the same moment, and the error is the lowest-numbered such rank's record).
    struct Fault {
        rank: usize,
        megakernel: MegakernelFaults,
        exchange: Option<Silence>,
        waited_for: &'static str,
        reporter: Option<usize>,
    }
    let fault =
        |rank, megakernel, exchange, waited_for, reporter| Fault { rank, megakernel, exchange, waited_for, reporter };
    let faults = [
        fault(2, MegakernelFaults { silent_rows_tile: Some(0), ..Default::default() }, None, "dispatched", Some(2)),
        fault(
            3,
            MegakernelFaults { silent_hidden_tile: Some(1), ..Default::default() },
            None,
            "gate/up tiles",
            Some(3),
        ),
        fault(1, MegakernelFaults::default(), Some(Silence::Push), "pushed by the expert owner", None),
        // The schedule's own wait (before the megakernel): rank 1 never publishes its pass.
        fault(1, MegakernelFaults::default(), Some(Silence::Publish), "publish flag", Some(0)),
    ];
    // Both tile walks: every rank's tiles on every compute block, and each rank's on its own.
    for share_rank_tiles in [true, false] {
        // A new walk starts with a clean pass (faults are set on the pass it builds).
        let options = MegakernelOptions { timeout: deadline, share_rank_tiles, ..Default::default() };
        layer.set_forward_megakernel(&gpu, Some(options)).unwrap();
        assert!(same_bf16(&ep_forward_y(&gpu, &mut layer, &weights), &want), "tiles shared: {share_rank_tiles}");
        for &Fault { rank, megakernel, exchange, waited_for: waited, reporter } in &faults {
            layer.set_forward_megakernel_faults(rank, megakernel).unwrap();
            layer.exchange_mut().set_silent_rank(exchange.map(|s| (rank, s)));
            let start = Instant::now();
            layer.forward(&gpu, &weights.0, weights.1.as_ref()).unwrap();
            let error = layer.check_errors(&gpu).unwrap_err();
            let took = start.elapsed();
            println!(
                "  rank {rank} {megakernel:?} {exchange:?} (tiles shared: {share_rank_tiles}): {error} (after {took:?})"
            );
            match &error {
                MokError::Timeout { rank: r, waited_for, .. } => {
                    assert!(waited_for.contains(waited), "{waited_for}");
                    assert!(reporter.is_none_or(|want| *r == Some(want)), "the record that names the cause: {r:?}");
                }
                other => panic!("expected a timeout, got {other:?}"),
            }
            if exchange == Some(Silence::Push) {
                assert!(matches!(error, MokError::Timeout { peer: Some(1), .. }), "names the silent owner: {error}");
            }
            // The megakernel's waits, and the schedule's waits on a silent publisher (every
            // rank's in one launch, side by side).
            assert_reported_in_time(took, deadline);
            // Back to a clean state: no faults, counters reset, and the next pass is right.
            layer.set_forward_megakernel_faults(rank, MegakernelFaults::default()).unwrap();
            silence_off_and_reset(&gpu, &mut layer);
            assert!(
                same_bf16(&ep_forward_y(&gpu, &mut layer, &weights), &want),
                "the pass after {megakernel:?} {exchange:?}"
            );
        }
    }
}

/// Both megakernels over ranks (`None` when this GPU cannot run them, which is said; an sm_90
/// GPU must run them).
fn megakernels_ep_layer(gpu: &Gpu, config: &MoeConfig, options: ExchangeOptions) -> Option<EpLayer> {
    let mut layer = megakernel_ep_layer(gpu, config, options)?;
    match layer.set_backward_megakernel(gpu, Some(MegakernelOptions::default())) {
        Ok(()) => Some(layer),
        Err(e) => {
            assert_ne!(gpu.compute_capability().0, 9, "an sm_90 GPU must run the backward megakernel: {e}");
            println!("  NOT RUN on this GPU (the backward megakernel needs sm_90a): {e}");
            None
        }
    }
}

#[test]
fn ep_backward_megakernel_is_bitwise_the_single_rank_path() {
    // One backward launch hosting every virtual rank (pull of dy from the token owners, the
    // engine's data- and weight-gradient tiles on each ring, push of the dx rows back to their
    // owners, the owners' dx combine and slot-weight gradients) must give the P = 1 unfused
    // path's dx, d_topk_weights and routed weight gradients for every P, comm split and grid,
    // after the forward megakernel and after the separate forward.
    let gpu = gpu();
    // The forward test's shapes but its k = 8 one (the largest): k = 40 stays, for the combine's
    // slots 32 and up.
    let cases: Vec<_> =
        ep_megakernel_cases().into_iter().enumerate().filter(|&(i, _)| i != 4).map(|(_, case)| case).collect();
    let rank_counts = common::sized("backward megakernel rank counts", vec![1, 2, 3, 4, 6, 8], vec![1, 3]);
    let shapes = common::sized("backward megakernel shapes", cases.len(), 2);
    let mut runs = 0;
    for (seed, (per_rank, routing)) in cases.into_iter().take(shapes).enumerate() {
        for &p in &rank_counts {
            let seed = 1700 + 10 * seed as u64 + p as u64;
            let Some(RankCase { want, what, mut layer, weights }) =
                rank_case(&gpu, (&per_rank, p), seed, routing, true)
            else {
                return;
            };
            assert_same_bits(&format!("{what}, both megakernels"), &ep_bits(&gpu, &mut layer, &weights), &want);
            // The same pass object again: counters cleared between passes, flags cleared again.
            for repeat in 1..3 {
                let got = ep_bits(&gpu, &mut layer, &weights);
                assert_same_bits(&format!("{what}, both megakernels, repeat {repeat}"), &got, &want);
            }
            let (resident, _) = layer.backward_megakernel_geometry().unwrap();
            let geometries = ep_geometries(resident, p as u32);
            let geometries = if common::sanitizing() { &geometries[..2] } else { &geometries[..] };
            for (i, &(comm, blocks)) in geometries.iter().enumerate() {
                // Every other geometry with each rank's tiles on its own blocks; the slot-weight
                // gradients early in the first two of every four (these shapes' default is in the
                // combine: the runs above).
                // The row totals (off by these shapes' default) in the first and last of every four.
                let share_rank_tiles = i % 2 == 0;
                let early = i % 4 < 2;
                let row_totals = i % 4 == 0 || i % 4 == 3;
                let options = MegakernelOptions {
                    comm_blocks: Some(comm),
                    blocks,
                    share_rank_tiles,
                    early_slot_weight_gradients: Some(early),
                    row_totals: Some(row_totals),
                    ..Default::default()
                };
                layer.set_backward_megakernel(&gpu, Some(options)).unwrap();
                let got = ep_bits(&gpu, &mut layer, &weights);
                assert_eq!(layer.backward_megakernel_geometry(), Some((blocks.unwrap_or(resident), comm)));
                let how = format!(
                    "{comm} comm blocks per rank of {blocks:?}, tiles shared across ranks: {share_rank_tiles}, slot-weight gradients early: {early}, row totals: {row_totals}"
                );
                assert_same_bits(&format!("{what}, {how}"), &got, &want);
                runs += 1;
            }
            // After the separate forward (mma.sync expert compute, the exchange's movers).
            layer.set_forward_megakernel(&gpu, None).unwrap();
            layer.set_backward_megakernel(&gpu, Some(MegakernelOptions::default())).unwrap();
            assert_same_bits(
                &format!("{what}, after the separate forward"),
                &ep_bits(&gpu, &mut layer, &weights),
                &want,
            );
            println!(
                "  {what}: the backward megakernel gives the P = 1 unfused bits over {} geometries and after either forward",
                geometries.len()
            );
        }
    }
    assert!(runs > 0);
}

#[test]
fn ep_megakernels_at_odd_rank_counts_give_the_single_rank_bits() {
    // Rank counts the other tests leave out (5 and 7, E = 35: uneven shares of the grid's pairs),
    // both megakernels, a shared expert, a limit, dropped slots, an empty expert and H = 136 (a
    // partial N tile): every output and routed gradient equal to the P = 1 unfused bits, with the GEMM
    // tiles shared across ranks (the default) and on each rank's own blocks, at the default
    // geometry and at one pair per rank.
    let gpu = gpu();
    let per_rank =
        MoeConfig { shared_intermediate: Some(64), swiglu_limit: Some(2.5), ..MoeConfig::new(19, 136, 96, 35, 3) };
    let routing = Routing { drop_probability: 0.05, empty_experts: &[11] };
    let rank_counts = common::sized("odd rank counts", vec![5, 7], vec![5]);
    for &p in &rank_counts {
        let Some(RankCase { want, what, mut layer, weights }) =
            rank_case(&gpu, (&per_rank, p), 2300 + p as u64, routing, true)
        else {
            return;
        };
        for share_rank_tiles in [true, false] {
            for blocks in [None, Some(2 * p as u32)] {
                // The slot-weight gradients early and the row totals kept on the default grid,
                // neither on the other.
                let early = blocks.is_none();
                let options = MegakernelOptions {
                    comm_blocks: Some(0),
                    blocks,
                    share_rank_tiles,
                    early_slot_weight_gradients: Some(early),
                    row_totals: Some(early),
                    ..Default::default()
                };
                layer.set_forward_megakernel(&gpu, Some(options.clone())).unwrap();
                layer.set_backward_megakernel(&gpu, Some(options)).unwrap();
                let how = format!(
                    "{what}, grid {blocks:?}, tiles shared across ranks: {share_rank_tiles}, slot-weight gradients early and row totals: {early}"
                );
                assert_same_bits(&how, &ep_bits(&gpu, &mut layer, &weights), &want);
            }
        }
        println!("  {what}: both megakernels give the P = 1 unfused bits, both tile walks, two grids");
    }
}

#[test]
fn ep_backward_megakernel_faults_are_reported_timeouts_and_the_next_pass_is_right() {
    // Four ranks in one launch (every block reads global parameter blocks), then one (its
    // blocks read their shared-memory copy, as with one rank per process).
    backward_megakernel_faults_at(4, [2, 3, 1]);
    backward_megakernel_faults_at(1, [0, 0, 0]);
}

/// The backward megakernel's three faults over `p` virtual ranks, each injected at its rank of
/// `ranks`: a timeout naming what was waited for, within the deadline, then a correct pass.
fn backward_megakernel_faults_at(p: usize, ranks: [usize; 3]) {
    let gpu = gpu();
    let global = MoeConfig { shared_intermediate: Some(64), ..MoeConfig::new(4 * 64, 136, 96, 24, 4) };
    let c = rank_config(&global, p);
    let case = random_case(&global, 1902, common::PLAIN_ROUTING);
    let deadline = Duration::from_millis(common::sized("fault deadline (ms)", 200, 2000));
    let options = ExchangeOptions { timeout: deadline, ..Default::default() };
    let Some(mut layer) = megakernels_ep_layer(&gpu, &c, options) else { return };
    upload_rank_inputs(&gpu, &layer, &case);
    let weights = rank_weights(&gpu, &c, &case);
    let want = unfused_bits(&gpu, &case);
    let faults: [(usize, MegakernelFaults, Option<Silence>, &str); 3] = [
        (ranks[0], MegakernelFaults { silent_rows_tile: Some(0), ..Default::default() }, None, "gathered"),
        (ranks[1], MegakernelFaults { silent_hidden_tile: Some(1), ..Default::default() }, None, "down_dgrad_stored"),
        (ranks[2], MegakernelFaults::default(), Some(Silence::Push), "pushed by the expert owner"),
    ];
    // Both tile walks: every rank's tiles on every compute block, and each rank's on its own
    // (one walk where one rank has every block).
    let walks: &[bool] = if p == 1 { &[false] } else { &[true, false] };
    for &share_rank_tiles in walks {
        // Row totals (off by this shape's default) with the shared walk and with one rank: a
        // silent tile's total never completes, so its weight gradient waits per tile as without.
        let row_totals = share_rank_tiles || p == 1;
        let megakernel = MegakernelOptions {
            timeout: deadline,
            share_rank_tiles,
            row_totals: Some(row_totals),
            ..Default::default()
        };
        layer.set_forward_megakernel(&gpu, Some(megakernel.clone())).unwrap();
        layer.set_backward_megakernel(&gpu, Some(megakernel)).unwrap();
        let what = format!("P = {p}, before the faults (tiles shared: {share_rank_tiles}, row totals: {row_totals})");
        assert_same_bits(&what, &ep_bits(&gpu, &mut layer, &weights), &want);
        for &(rank, fault, silence, waited) in &faults {
            ep_forward_y(&gpu, &mut layer, &weights);
            layer.set_backward_megakernel_faults(rank, fault).unwrap();
            layer.exchange_mut().set_silent_rank(silence.map(|s| (rank, s)));
            let start = Instant::now();
            layer.backward(&gpu, &weights.0, weights.1.as_ref()).unwrap();
            let error = layer.check_errors(&gpu).unwrap_err();
            let took = start.elapsed();
            println!("  P = {p}, rank {rank} {fault:?} {silence:?}: {error} (after {took:?})");
            match &error {
                MokError::Timeout { waited_for, .. } => assert!(waited_for.contains(waited), "{waited_for}"),
                other => panic!("expected a timeout, got {other:?}"),
            }
            assert_reported_in_time(took, deadline);
            layer.set_backward_megakernel_faults(rank, MegakernelFaults::default()).unwrap();
            silence_off_and_reset(&gpu, &mut layer);
            assert_same_bits(
                &format!("P = {p}: the pass after {fault:?} {silence:?}"),
                &ep_bits(&gpu, &mut layer, &weights),
                &want,
            );
        }
    }
}
