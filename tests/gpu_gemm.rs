//! GPU tests of the sm_90a tensor-core GEMM engine (feature `gpu-tests`): first each primitive
//! on its own (TMA load, mbarrier ring, one wgmma K block per operand major-ness), then every
//! engine variant against the unfused path's kernels (themselves checked against the f64 CPU
//! reference in gpu_unfused.rs) and against f64 on the CPU, with ragged and empty groups, at
//! small and frontier dimensions; and bitwise equality across grid sizes and runs.
#![cfg(feature = "gpu-tests")]

mod common;

use common::{PLAIN_ROUTING, Routing, check, fingerprint, random_bf16, random_case, rel_err};
use half::bf16;
use mok::MoeConfig;
use mok::driver::{DeviceBuffer, Gpu};
use mok::gemm::{EnginePlan, Pairing, RowGroups, RowsOut, WgradOut, tile_offsets};
use mok::kernels::gemm_layout::swizzled_chunk_offset;
use mok::tensor_map::TensorMap;
use mok::unfused::{DeviceExperts, DeviceTokens, UnfusedLayer};

fn gpu() -> Gpu {
    let gpu =
        mok::open_gpu(0).unwrap_or_else(|e| panic!("GPU tests need an NVIDIA GPU with its driver; this machine: {e}"));
    assert_eq!(gpu.compute_capability().0, 9, "the sm_90a engine tests need a Hopper GPU");
    gpu
}

fn f64s<T: Copy + Into<f64>>(v: &[T]) -> Vec<f64> {
    v.iter().map(|&x| x.into()).collect()
}

/// Relative L2 error of two bf16 tensors without materialising f64 copies (frontier weight
/// gradients have billions of elements). NaN anywhere gives NaN.
fn rel_err_bf16(actual: &[bf16], expected: &[bf16]) -> f64 {
    use rayon::prelude::*;
    assert_eq!(actual.len(), expected.len());
    // Per-chunk sums in parallel, added in chunk order.
    const CHUNK: usize = 1 << 20;
    let partial: Vec<(f64, f64)> = actual
        .par_chunks(CHUNK)
        .zip(expected.par_chunks(CHUNK))
        .map(|(a, e)| {
            a.iter().zip(e).fold((0.0, 0.0), |(diff, norm), (a, e)| {
                let (a, e) = (a.to_f64(), e.to_f64());
                (diff + (a - e) * (a - e), norm + e * e)
            })
        })
        .collect();
    let (diff, norm) = partial.into_iter().fold((0.0f64, 0.0f64), |(d, n), (pd, pn)| (d + pd, n + pn));
    if norm == 0.0 { if diff == 0.0 { 0.0 } else { f64::INFINITY } } else { (diff / norm).sqrt() }
}

fn bf(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

#[test]
fn primitive_tma_load_swizzles_and_zero_fills() {
    let gpu = gpu();
    let (rows, cols) = (200usize, 128usize);
    let src = random_bf16(rows * cols, 31, 1.0);
    let device = DeviceBuffer::from_slice(&gpu, &src).unwrap();
    let map =
        TensorMap::bf16(&gpu, device.device_ptr(), &[cols as u64, rows as u64], &[2 * cols as u64], &[64, 64]).unwrap();
    for (c0, c1) in [(64i32, 100i32), (0, 180)] {
        let mut out = DeviceBuffer::<u32>::alloc(&gpu, 64 * 32).unwrap();
        out.fill_bytes(0xff).unwrap();
        // SAFETY: `map` covers `device`, alive to the end of the test.
        unsafe { mok::testing::probe_tma_load(&gpu, &map, (c0, c1), &out) }.unwrap();
        let words = out.download().unwrap();
        let halves: &[u16] = bytemuck::cast_slice(&words);
        for r in 0..64usize {
            for c in 0..8usize {
                let at = (swizzled_chunk_offset(r as u32, c as u32) / 2) as usize;
                for e in 0..8 {
                    let (row, col) = (c1 as usize + r, c0 as usize + c * 8 + e);
                    let expected = if row < rows { src[row * cols + col].to_bits() } else { 0 };
                    assert_eq!(halves[at + e], expected, "box ({c0},{c1}) row {r} chunk {c} element {e}");
                }
            }
        }
    }
    println!("  TMA 2-D load: 128B swizzle layout and out-of-bounds zero fill exact");
}

#[test]
fn primitive_tma_store_writes_its_box_into_fresh_memory() {
    // The only write the destination gets is the TMA store (the buffer is allocated, never
    // filled): every byte read back must be the box's, through the 128B swizzle. Under initcheck this is also the minimal check of
    // whether the tool counts TMA stores as initialising memory (docs/TESTING.md).
    let gpu = gpu();
    let (rows, cols) = (64usize, 64usize);
    let dst = DeviceBuffer::<bf16>::alloc(&gpu, rows * cols).unwrap();
    let map =
        TensorMap::bf16(&gpu, dst.device_ptr(), &[cols as u64, rows as u64], &[2 * cols as u64], &[64, 64]).unwrap();
    let values: Vec<u32> = (0..64 * 32u32).map(|w| w.wrapping_mul(2_654_435_761) ^ 0x1234_5678).collect();
    let device_values = DeviceBuffer::from_slice(&gpu, &values).unwrap();
    // SAFETY: `map` covers `dst`, alive to the end of the test and used by nothing else.
    unsafe { mok::testing::probe_tma_store(&gpu, &map, (0, 0), &device_values) }.unwrap();
    let got = dst.download().unwrap();
    let staged: &[u16] = bytemuck::cast_slice(&values);
    for r in 0..rows {
        for c in 0..8usize {
            let from = (swizzled_chunk_offset(r as u32, c as u32) / 2) as usize;
            for e in 0..8 {
                assert_eq!(got[r * cols + c * 8 + e].to_bits(), staged[from + e], "row {r} chunk {c} element {e}");
            }
        }
    }
    println!("  TMA 2-D store: every byte of fresh memory written from the 128B-swizzled box");
}

#[test]
fn primitive_mbarrier_ring_hands_over_every_round() {
    let gpu = gpu();
    let rounds = 1000usize;
    let mut out = DeviceBuffer::<u32>::alloc(&gpu, rounds).unwrap();
    out.fill_bytes(0xff).unwrap();
    mok::testing::probe_mbarrier_ring(&gpu, 3, rounds as u32, &out).unwrap();
    let got = out.download().unwrap();
    for (round, &value) in got.iter().enumerate() {
        assert_eq!(value, (round as u32).wrapping_mul(2_654_435_761) ^ 0x5a5a, "round {round}");
    }
    println!("  mbarrier ring: 3 stages, {rounds} rounds, every value handed over in order");
}

#[test]
fn primitive_wgmma_tile_in_each_major_ness() {
    let gpu = gpu();
    let a = random_bf16(64 * 64, 41, 1.0);
    let b = random_bf16(256 * 64, 42, 1.0);
    let (da, db) = (DeviceBuffer::from_slice(&gpu, &a).unwrap(), DeviceBuffer::from_slice(&gpu, &b).unwrap());
    for (mode, name) in [(0u32, "A K-major, B K-major"), (1, "A K-major, B N-major"), (2, "A M-major, B N-major")] {
        let mut out = DeviceBuffer::<f32>::alloc(&gpu, 64 * 256).unwrap();
        out.fill_bytes(0xff).unwrap();
        mok::testing::probe_wgmma_tile(&gpu, &da, &db, mode, &out).unwrap();
        let got = out.download().unwrap();
        let a_at = |m: usize, k: usize| if mode == 2 { a[k * 64 + m] } else { a[m * 64 + k] }.to_f64();
        let b_at = |n: usize, k: usize| if mode == 0 { b[n * 64 + k] } else { b[k * 256 + n] }.to_f64();
        let mut expected = vec![0.0; 64 * 256];
        for m in 0..64 {
            for n in 0..256 {
                expected[m * 256 + n] = (0..64).map(|k| a_at(m, k) * b_at(n, k)).sum();
            }
        }
        check(&format!("wgmma m64n256k64 ({name})"), rel_err(&got, &expected), 1e-5);
    }
}

/// A routed problem run through the unfused path, whose buffers feed the engine.
struct Setup {
    layer: UnfusedLayer,
    tokens: DeviceTokens,
    experts: DeviceExperts,
    config: MoeConfig,
    tiles: DeviceBuffer<u32>,
    rows: usize,
}

fn setup(gpu: &Gpu, config: MoeConfig, seed: u64, routing: Routing<'_>) -> Setup {
    // Expert weights are generated on the device (frontier sizes would take a minute on the
    // host); the tokens and routing on the host.
    let (e, h, i) = (config.num_experts, config.hidden, config.intermediate);
    let small = MoeConfig { num_experts: config.num_experts, hidden: h, intermediate: 8, ..config.clone() };
    let case = random_case(&small, seed, routing);
    let tokens = DeviceTokens::upload(gpu, &config, &case.tokens).unwrap();
    let random = |n, s, scale| mok::unfused::random_bf16(gpu, n, s, scale).unwrap();
    let experts = DeviceExperts {
        w_gate: random(e * i * h, seed ^ 12, common::weight_scale(h)),
        w_up: random(e * i * h, seed ^ 13, common::weight_scale(h)),
        w_down: random(e * h * i, seed ^ 14, common::weight_scale(i)),
    };
    let dy = DeviceBuffer::from_slice(gpu, &case.dy).unwrap();
    let mut layer = UnfusedLayer::new(gpu, config.clone()).unwrap();
    // Poisoned first: the checks download whole capacity-sized buffers, whose rows past the
    // routed ones no kernel writes (initcheck reported those copies of never-written memory).
    layer.poison().unwrap();
    layer.forward(gpu, &tokens, &experts, None).unwrap();
    layer.backward(gpu, &tokens, &experts, None, &dy).unwrap();
    layer.check_device_errors().unwrap();
    let tiles = tile_offsets(gpu, &layer.routing().row_offsets, config.num_experts).unwrap();
    let rows = *layer.routing().row_offsets.download().unwrap().last().unwrap() as usize;
    Setup { layer, tokens, experts, config, tiles, rows }
}

fn poisoned<T: bytemuck::Pod>(gpu: &Gpu, len: usize) -> DeviceBuffer<T> {
    let mut buffer = DeviceBuffer::alloc(gpu, len).unwrap();
    buffer.fill_bytes(0xff).unwrap();
    buffer
}

/// Every engine variant against the unfused kernels on the same device inputs.
fn check_engine_against_unfused(gpu: &Gpu, s: &Setup) {
    let c = &s.config;
    let (h, i, e, cap) = (c.hidden, c.intermediate, c.num_experts, c.slots_per_rank());
    let (rows, layer) = (s.rows, &s.layer);
    println!("engine vs unfused: rows {rows} of {cap}, H={h} I={i} E={e}");
    let groups = RowGroups {
        row_offsets: (&layer.routing().row_offsets).into(),
        tile_offsets: (&s.tiles).into(),
        groups: e,
        capacity: cap,
    };
    let (gate, up, hidden, down) = layer.routed_intermediates();
    let back = layer.routed_backward_intermediates();

    // Forward gate/up + SwiGLU.
    let (mut hidden_out, mut gate_out, mut up_out) =
        (poisoned::<bf16>(gpu, cap * i), poisoned::<f32>(gpu, cap * i), poisoned::<f32>(gpu, cap * i));
    let mut plan = EnginePlan::gate_up(
        gpu,
        layer.gathered_rows(),
        &groups,
        &s.experts.w_gate,
        &s.experts.w_up,
        (h, i),
        c.swiglu_limit,
        &hidden_out,
        Some((&gate_out, &up_out)),
    )
    .unwrap();
    // The persistent grid: whole pairs, as many as the driver says fit at once, at most one
    // block per SM (132 SMs on the H200: 66 pairs).
    let resident = plan.resident_blocks();
    println!("gate_up plan: {resident} resident blocks on {} SMs", gpu.multiprocessors());
    assert!(resident >= 2 && resident.is_multiple_of(2), "{resident} blocks: not whole pairs");
    assert!(
        resident <= gpu.multiprocessors().next_multiple_of(2),
        "{resident} blocks for {} SMs",
        gpu.multiprocessors()
    );
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { plan.launch(gpu) }.unwrap();
    let valid = rows * i;
    check(
        "gate pre-activation (engine gate_up)",
        rel_err(&gate_out.download().unwrap()[..valid], &f64s(&gate.download().unwrap()[..valid])),
        1e-5,
    );
    check(
        "up pre-activation (engine gate_up)",
        rel_err(&up_out.download().unwrap()[..valid], &f64s(&up.download().unwrap()[..valid])),
        1e-5,
    );
    let got_hidden = hidden_out.download().unwrap();
    check(
        "hidden bf16 (engine SwiGLU)",
        rel_err(&bf(&got_hidden[..valid]), &bf(&hidden.download().unwrap()[..valid])),
        2e-3,
    );
    // Grid size and repetition do not change a bit (each launch after the first writes
    // poisoned outputs again: one that wrote nothing could not match).
    for buffer in [&mut gate_out, &mut up_out] {
        buffer.fill_bytes(0xff).unwrap();
    }
    hidden_out.fill_bytes(0xff).unwrap();
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { plan.launch_with_blocks(gpu, 7) }.unwrap();
    assert_eq!(
        fingerprint(&hidden_out.download().unwrap()[..valid]),
        fingerprint(&got_hidden[..valid]),
        "gate_up differs with 7 blocks (rounded up to 4 pairs)"
    );
    // Nor does the way blocks pair up (default: M-pairs where possible; here N-pairs only).
    plan.set_pairing(gpu, Pairing::NOnly).unwrap();
    for buffer in [&mut gate_out, &mut up_out] {
        buffer.fill_bytes(0xff).unwrap();
    }
    hidden_out.fill_bytes(0xff).unwrap();
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { plan.launch_with_blocks(gpu, 9) }.unwrap();
    assert_eq!(
        fingerprint(&hidden_out.download().unwrap()[..valid]),
        fingerprint(&got_hidden[..valid]),
        "gate_up differs with N-pairs only"
    );
    // The gathering gate/up (rows read from the tokens through the routing layout in its
    // producer): the same bits, with either pairing and any grid; it refuses a plain launch.
    let (mut gathering_hidden, mut gathering_gate, mut gathering_up) =
        (poisoned::<bf16>(gpu, cap * i), poisoned::<f32>(gpu, cap * i), poisoned::<f32>(gpu, cap * i));
    let mut plan = EnginePlan::gate_up_gathering(
        gpu,
        &groups,
        &s.experts.w_gate,
        &s.experts.w_up,
        (h, i),
        c.swiglu_limit,
        &gathering_hidden,
        Some((&gathering_gate, &gathering_up)),
    )
    .unwrap();
    assert!(plan.gathers_rows());
    // SAFETY: as above (a refused launch enqueues nothing).
    let refused = unsafe { plan.launch(gpu) }.unwrap_err().to_string();
    assert!(refused.contains("launch_gathering"), "{refused}");
    let (x, row_source, k) = ((&s.tokens.x).into(), (&layer.routing().row_source).into(), c.top_k);
    for (pairing, blocks) in [(Pairing::MAndN, None), (Pairing::NOnly, Some(5)), (Pairing::MAndN, Some(2))] {
        plan.set_pairing(gpu, pairing).unwrap();
        for buffer in [&mut gathering_gate, &mut gathering_up] {
            buffer.fill_bytes(0xff).unwrap();
        }
        gathering_hidden.fill_bytes(0xff).unwrap();
        // SAFETY: the plan's buffers and the tokens live in this scope, past the stream's work on
        // them; the layer's routing layout holds this problem's slots.
        unsafe {
            match blocks {
                None => plan.launch_gathering(gpu, x, row_source, k),
                Some(blocks) => plan.launch_gathering_with_blocks(gpu, (x, row_source, k), blocks),
            }
        }
        .unwrap();
        let what = format!("gathering gate_up, {pairing:?}, {blocks:?} blocks");
        assert_eq!(
            fingerprint(&gathering_hidden.download().unwrap()[..valid]),
            fingerprint(&got_hidden[..valid]),
            "{what}: hidden"
        );
        assert_eq!(
            fingerprint(&gathering_gate.download().unwrap()[..valid]),
            fingerprint(&gate_out.download().unwrap()[..valid]),
            "{what}: gate pre-activations"
        );
        assert_eq!(
            fingerprint(&gathering_up.download().unwrap()[..valid]),
            fingerprint(&up_out.download().unwrap()[..valid]),
            "{what}: up pre-activations"
        );
    }

    // Down projection on the unfused path's hidden.
    let mut down_out = poisoned::<f32>(gpu, cap * h);
    let mut plan =
        EnginePlan::rows_nt(gpu, hidden, &groups, &s.experts.w_down, (h, i), RowsOut::F32(&down_out)).unwrap();
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { plan.launch(gpu) }.unwrap();
    let got_down = down_out.download().unwrap();
    check(
        "down output (engine rows_nt)",
        rel_err(&got_down[..rows * h], &f64s(&down.download().unwrap()[..rows * h])),
        1e-5,
    );
    // The other pairing (default for rows_nt: N-pairs only) gives the same bits.
    plan.set_pairing(gpu, Pairing::MAndN).unwrap();
    down_out.fill_bytes(0xff).unwrap();
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { plan.launch(gpu) }.unwrap();
    assert_eq!(
        fingerprint(&down_out.download().unwrap()[..rows * h]),
        fingerprint(&got_down[..rows * h]),
        "rows_nt differs with M-pairs"
    );
    // bf16 rows: each element is its f32 sum rounded once (to nearest even), and no row past the
    // routed rows is written.
    let down_bf16 = poisoned::<bf16>(gpu, cap * h);
    let plan = EnginePlan::rows_nt(gpu, hidden, &groups, &s.experts.w_down, (h, i), RowsOut::Bf16(&down_bf16)).unwrap();
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { plan.launch_with_blocks(gpu, 11) }.unwrap();
    let got_bf16 = down_bf16.download().unwrap();
    let mismatches = (0..rows * h).filter(|&j| got_bf16[j].to_bits() != bf16::from_f32(got_down[j]).to_bits()).count();
    assert_eq!(mismatches, 0, "rows_nt bf16 out: {mismatches} elements differ from the rounded f32 rows");
    assert!(got_bf16[rows * h..].iter().all(|v| v.to_bits() == 0xffff), "rows_nt bf16 out wrote past the routed rows");

    // Data gradients: one segment (down dgrad), two segments (gate/up dgrad).
    let d_hidden = poisoned::<f32>(gpu, cap * i);
    let plan =
        EnginePlan::rows_nn(gpu, (back.d_rows.into(), (&s.experts.w_down).into()), None, &groups, (i, h), &d_hidden)
            .unwrap();
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { plan.launch(gpu) }.unwrap();
    check(
        "d_hidden (engine rows_nn, 1 segment)",
        rel_err(&d_hidden.download().unwrap()[..valid], &f64s(&back.d_hidden.download().unwrap()[..valid])),
        1e-5,
    );
    let mut d_in = poisoned::<f32>(gpu, cap * h);
    let mut plan = EnginePlan::rows_nn(
        gpu,
        (back.d_gate.into(), (&s.experts.w_gate).into()),
        Some((back.d_up.into(), (&s.experts.w_up).into())),
        &groups,
        (h, i),
        &d_in,
    )
    .unwrap();
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { plan.launch(gpu) }.unwrap();
    let got_d_in = d_in.download().unwrap();
    check(
        "d_rows_in (engine rows_nn, 2 segments)",
        rel_err(&got_d_in[..rows * h], &f64s(&back.d_in.download().unwrap()[..rows * h])),
        1e-5,
    );
    plan.set_pairing(gpu, Pairing::NOnly).unwrap();
    d_in.fill_bytes(0xff).unwrap();
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { plan.launch_with_blocks(gpu, 3) }.unwrap();
    assert_eq!(
        fingerprint(&d_in.download().unwrap()[..rows * h]),
        fingerprint(&got_d_in[..rows * h]),
        "rows_nn differs with N-pairs only"
    );

    // Weight gradients: bf16 against the unfused bf16; f32 accumulation against f64.
    let mut dw_down = poisoned::<bf16>(gpu, e * h * i);
    let mut plan = EnginePlan::wgrad(
        gpu,
        back.d_rows,
        hidden,
        &layer.routing().row_offsets,
        (e, cap),
        (h, i),
        WgradOut::Bf16((&dw_down).into()),
    )
    .unwrap();
    let refused = plan.set_pairing(gpu, Pairing::NOnly).unwrap_err().to_string();
    assert!(refused.contains("alone"), "a weight-gradient plan must refuse a pairing: {refused}");
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { plan.launch(gpu) }.unwrap();
    let got = dw_down.download().unwrap();
    check("dw_down bf16 (engine wgrad)", rel_err_bf16(&got, &layer.grads().dw_down.download().unwrap()), 3e-3);
    dw_down.fill_bytes(0xff).unwrap();
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { plan.launch_with_blocks(gpu, 5) }.unwrap();
    assert_eq!(fingerprint(&dw_down.download().unwrap()), fingerprint(&got), "wgrad differs with 5 blocks");
    let counts = layer.routing().expert_counts.download().unwrap();
    for (expert, &count) in counts.iter().enumerate() {
        if count == 0 {
            assert!(
                got[expert * h * i..(expert + 1) * h * i].iter().all(|v| v.to_bits() == 0),
                "empty expert {expert} got a nonzero gradient"
            );
        }
    }
    let mut dw_gate = DeviceBuffer::<f32>::alloc(gpu, e * i * h).unwrap();
    dw_gate.fill_bytes(0).unwrap();
    let plan = EnginePlan::wgrad(
        gpu,
        back.d_gate,
        layer.gathered_rows(),
        &layer.routing().row_offsets,
        (e, cap),
        (i, h),
        WgradOut::AccumulateF32((&dw_gate).into()),
    )
    .unwrap();
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { plan.launch(gpu) }.unwrap();
    let (dg, xs, offsets) = (
        back.d_gate.download().unwrap(),
        layer.gathered_rows().download().unwrap(),
        layer.routing().row_offsets.download().unwrap(),
    );
    let mut expected = vec![0.0f64; e * i * h];
    {
        use rayon::prelude::*;
        // Each (group, m) output row reduces over the group's rows in f64; the first 8 groups
        // are checked (all of them at small shapes; a sample at frontier sizes).
        expected.par_chunks_mut(h).enumerate().take(8.min(e) * i).for_each(|(gm, out_row)| {
            let (g, m) = (gm / i, gm % i);
            for r in offsets[g] as usize..offsets[g + 1] as usize {
                let a = dg[r * i + m].to_f64();
                if a != 0.0 {
                    for (n, value) in out_row.iter_mut().enumerate() {
                        *value += a * xs[r * h + n].to_f64();
                    }
                }
            }
        });
    }
    let checked = 8.min(e) * i * h;
    let dw_gate_f32 = dw_gate.download().unwrap();
    check("dw_gate f32 accumulate (engine wgrad)", rel_err(&dw_gate_f32[..checked], &expected[..checked]), 1e-5);
    // At frontier sizes each of these is tens of GB, on the device and here: only the plain
    // plan's f32 gradient is kept (here) for what follows.
    drop((expected, dg, xs, dw_gate, dw_down, got));
    // The gathering weight gradient (B's rows read from the tokens in its producer): the same
    // bits, added into f32 and fresh bf16, with any grid.
    let mut gathering_f32 = DeviceBuffer::<f32>::alloc(gpu, e * i * h).unwrap();
    gathering_f32.fill_bytes(0).unwrap();
    let plan = EnginePlan::wgrad_gathering(
        gpu,
        back.d_gate,
        &layer.routing().row_offsets,
        (e, cap),
        (i, h),
        WgradOut::AccumulateF32((&gathering_f32).into()),
    )
    .unwrap();
    let (x, row_source, k) = ((&s.tokens.x).into(), (&layer.routing().row_source).into(), c.top_k);
    // SAFETY: as for the gathering gate/up above.
    unsafe { plan.launch_gathering(gpu, x, row_source, k) }.unwrap();
    let first = gathering_f32.download().unwrap();
    assert_same_wgrad_bits("gathering wgrad: f32 accumulate", &first, &dw_gate_f32, (i, h), &offsets);
    drop((first, dw_gate_f32, offsets, gathering_f32));
    let plain_bf16 = poisoned::<bf16>(gpu, e * i * h);
    let plan = EnginePlan::wgrad(
        gpu,
        back.d_up,
        layer.gathered_rows(),
        &layer.routing().row_offsets,
        (e, cap),
        (i, h),
        WgradOut::Bf16((&plain_bf16).into()),
    )
    .unwrap();
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { plan.launch(gpu) }.unwrap();
    let plain_bf16_print = fingerprint(&plain_bf16.download().unwrap());
    // The plan's stream work is done (the download synchronises); the plan goes first.
    drop(plan);
    drop(plain_bf16);
    let gathering_bf16 = poisoned::<bf16>(gpu, e * i * h);
    let plan = EnginePlan::wgrad_gathering(
        gpu,
        back.d_up,
        &layer.routing().row_offsets,
        (e, cap),
        (i, h),
        WgradOut::Bf16((&gathering_bf16).into()),
    )
    .unwrap();
    // SAFETY: as for the gathering gate/up above.
    unsafe { plan.launch_gathering_with_blocks(gpu, (x, row_source, k), 3) }.unwrap();
    assert_eq!(fingerprint(&gathering_bf16.download().unwrap()), plain_bf16_print, "gathering wgrad: bf16, 3 blocks");
    println!("  gathering gate_up (3 pairings × grids) and wgrad (f32, bf16): the plain plans' bits");
}

/// Asserts that two weight gradients (`[groups][m][n]`) hold the same bits; else names how many
/// elements and which groups (with their rows) differ, and the first few elements, so a failure
/// tells a tail, a group or a race apart.
fn assert_same_wgrad_bits(what: &str, got: &[f32], expected: &[f32], (m, n): (usize, usize), row_offsets: &[u32]) {
    assert_eq!(got.len(), expected.len(), "{what}: lengths");
    // Counted, with the groups and the first few kept: a mass mismatch at frontier sizes must
    // not allocate per element.
    let (mut count, mut groups, mut firsts) = (0usize, Vec::new(), Vec::new());
    for j in (0..got.len()).filter(|&j| got[j].to_bits() != expected[j].to_bits()) {
        count += 1;
        if groups.last() != Some(&(j / (m * n))) {
            groups.push(j / (m * n));
        }
        if firsts.len() < 6 {
            firsts.push(format!("[{}][{}][{}] {:e} vs {:e}", j / (m * n), j / n % m, j % n, got[j], expected[j]));
        }
    }
    if count == 0 {
        return;
    }
    let rows = |g: usize| row_offsets[g + 1] - row_offsets[g];
    let group_list: Vec<String> = groups.iter().take(12).map(|&g| format!("{g} ({} rows)", rows(g))).collect();
    panic!(
        "{what}: {} of {} elements differ, in {} groups: {}; first: {}",
        count,
        got.len(),
        groups.len(),
        group_list.join(", "),
        firsts.join("; ")
    );
}

#[test]
fn engine_matches_unfused_on_ragged_and_empty_groups() {
    let gpu = gpu();
    let config = MoeConfig { swiglu_limit: Some(1.5), ..MoeConfig::new(300, 256, 192, 8, 4) };
    let s = setup(&gpu, config, 51, Routing { drop_probability: 0.1, empty_experts: &[2, 5] });
    check_engine_against_unfused(&gpu, &s);
}

#[test]
fn engine_matches_unfused_on_groups_of_several_tiles() {
    // Groups of several M tiles, an empty expert and dropped slots, ~2500 rows over E − 1 groups:
    // E = 4, ~830 rows, 7 M tiles — three M-pair entries and an N-paired last tile; E = 5,
    // ~610–660 rows, 5 or 6 tiles; E = 6, ~500 rows, 4 tiles, often with a last tile of more
    // than 64 rows (M-pairs alone, the last pair's second block ragged in both warpgroups);
    // E = 7, ~420 rows, 4 tiles, often with a last tile of ≤ 64 rows (the last pair's second
    // block has rows for one warpgroup only, the other skips its MMAs).
    let gpu = gpu();
    let mut group_rows = Vec::new();
    for experts in [4, 5, 6, 7] {
        let routing = Routing { drop_probability: 0.02, empty_experts: &[1] };
        let s = setup(&gpu, MoeConfig::new(853, 256, 192, experts, 3), 55, routing);
        let offsets = s.layer.routing().row_offsets.download().unwrap();
        group_rows.extend(offsets.windows(2).map(|w| w[1] - w[0]));
        check_engine_against_unfused(&gpu, &s);
    }
    // The cases the comment names did occur (the routing is random).
    println!("rows per group: {group_rows:?}");
    let tiles = |rows: u32| rows.div_ceil(128);
    let short_last = |rows: u32| !rows.is_multiple_of(128) && rows % 128 <= 64;
    assert!(
        group_rows.iter().any(|&r| tiles(r) >= 3 && tiles(r) % 2 == 1),
        "no group of an odd number (≥ 3) of M tiles"
    );
    assert!(
        group_rows.iter().any(|&r| tiles(r) >= 4 && tiles(r) % 2 == 0 && !short_last(r)),
        "no group of an even number (≥ 4) of M tiles whose last has > 64 rows"
    );
    assert!(
        group_rows.iter().any(|&r| tiles(r) >= 4 && tiles(r) % 2 == 0 && short_last(r)),
        "no group of an even number (≥ 4) of M tiles whose last has ≤ 64 rows"
    );
}

#[test]
fn engine_matches_unfused_on_odd_widths() {
    // H, I multiples of 8 but not of 64: the weight maps' out-of-bounds columns read as zero.
    let gpu = gpu();
    let s = setup(&gpu, MoeConfig::new(77, 72, 40, 3, 2), 52, PLAIN_ROUTING);
    check_engine_against_unfused(&gpu, &s);
}

#[test]
fn engine_matches_unfused_on_tiny_and_sparse_problems() {
    // The edges no frontier shape reaches: one token, one expert, the narrowest widths (8); every
    // token routed to every expert; far more experts than rows (nearly every group empty).
    let gpu = gpu();
    for (config, seed) in [
        (MoeConfig::new(1, 8, 8, 1, 1), 56),
        (MoeConfig::new(5, 16, 24, 3, 3), 57),
        (MoeConfig::new(3, 64, 64, 1024, 2), 58),
    ] {
        let s = setup(&gpu, config, seed, PLAIN_ROUTING);
        check_engine_against_unfused(&gpu, &s);
    }
}

#[test]
fn engine_matches_unfused_at_frontier_dimensions() {
    // qwen3.5-397b's H, I, E, k (T reduced) and kimi-k2.7's.
    // Under compute-sanitizer: the same widths, 16 tokens over 16 and 8 experts (the weights are
    // 16-34 GB, and racecheck instruments every shared-memory access of the mma.sync oracle).
    let gpu = gpu();
    let [(t_qwen, e_qwen), (t_kimi, e_kimi)] = common::sized("(T, E)", [(256, 512), (128, 384)], [(16, 16), (16, 8)]);
    // One shape's weights and gradients at a time (tens of GB each).
    {
        let s = setup(&gpu, MoeConfig::new(t_qwen, 4096, 1024, e_qwen, 10), 53, PLAIN_ROUTING);
        check_engine_against_unfused(&gpu, &s);
    }
    // kimi's weights, their bf16 gradients and one f32 gradient take ~16 · E · I · H bytes (90 GB
    // at E = 384): on a GPU with less free memory (an 80 GB H100) halve E, keeping the frontier
    // widths and at least top_k = 8 experts, and say so.
    let (h, i) = (7168, 2048);
    let (free, _) = gpu.memory_info().unwrap();
    let mut e = e_kimi;
    while e >= 16 && 16 * e * i * h > free / 10 * 9 {
        e /= 2;
    }
    if e != e_kimi {
        println!("  kimi with E = {e}, not {e_kimi}: {} GiB of device memory free", free >> 30);
    }
    let s = setup(&gpu, MoeConfig::new(t_kimi, h, i, e, 8), 54, PLAIN_ROUTING);
    check_engine_against_unfused(&gpu, &s);
}

/// The parts of M tile `t`'s output that a hooked launch counts: per group, each of its M tiles
/// (`tile_offsets[g] + j`) gets `n_tiles × ⌈rows in the tile / 64⌉` (one per N tile and consumer
/// warpgroup with rows).
fn expected_stored_parts(row_offsets: &[u32], tile_offsets: &[u32], n_tiles: u32, m_tiles: usize) -> Vec<u32> {
    let mut parts = vec![0u32; m_tiles];
    for g in 0..row_offsets.len() - 1 {
        let rows = row_offsets[g + 1] - row_offsets[g];
        for j in 0..rows.div_ceil(128) {
            let in_tile = (rows - 128 * j).min(128);
            parts[(tile_offsets[g] + j) as usize] = n_tiles * in_tile.div_ceil(64);
        }
    }
    parts
}

#[test]
fn hooked_engine_kernels_equal_the_standalone_ones_and_count_every_tile() {
    // The persistent forward's hand-over (`TileHooks::Counters`) on gate/up and the down
    // projection: with every tile's rows landed the outputs are the standalone kernels' bits and
    // each M tile's stored parts are counted exactly; with one tile's rows never landing, the
    // launch ends within its deadline and reports that tile, and the next launch is correct.
    use mok::gemm::TileReadiness;
    use std::time::{Duration, Instant};
    let gpu = gpu();
    let config = MoeConfig { swiglu_limit: Some(1.5), ..MoeConfig::new(300, 256, 192, 8, 4) };
    let s = setup(&gpu, config, 61, Routing { drop_probability: 0.1, empty_experts: &[2] });
    let c = &s.config;
    let (h, i, e, cap) = (c.hidden, c.intermediate, c.num_experts, c.slots_per_rank());
    let layer = &s.layer;
    let groups = RowGroups {
        row_offsets: (&layer.routing().row_offsets).into(),
        tile_offsets: (&s.tiles).into(),
        groups: e,
        capacity: cap,
    };
    let row_offsets = layer.routing().row_offsets.download().unwrap();
    let tile_offsets = s.tiles.download().unwrap();
    let m_tiles = tile_offsets[e] as usize;
    // Counters for every M tile the groups could hold (what launch_counted demands).
    let slots = cap.div_ceil(128) + e;
    let hidden_rows = layer.routed_intermediates().2;

    let standalone = poisoned::<bf16>(&gpu, cap * i);
    let mut hooked = poisoned::<bf16>(&gpu, cap * i);
    let plan_of = |out: &DeviceBuffer<bf16>| {
        EnginePlan::gate_up(
            &gpu,
            layer.gathered_rows(),
            &groups,
            &s.experts.w_gate,
            &s.experts.w_up,
            (h, i),
            c.swiglu_limit,
            out,
            None,
        )
        .unwrap()
    };
    let (plan, hooked_plan) = (plan_of(&standalone), plan_of(&hooked));
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { plan.launch(&gpu) }.unwrap();
    let mut readiness = TileReadiness::new(&gpu, slots, Duration::from_secs(2), 1).unwrap();
    readiness.land_all().unwrap();
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { hooked_plan.launch_counted(&gpu, &readiness) }.unwrap();
    readiness.check(&gpu).unwrap();
    let valid = s.rows * i;
    assert_eq!(
        fingerprint(&hooked.download().unwrap()[..valid]),
        fingerprint(&standalone.download().unwrap()[..valid]),
        "hooked gate/up differs from the standalone kernel"
    );
    let n_gate_up = (i as u32).div_ceil(128);
    let want = expected_stored_parts(&row_offsets, &tile_offsets, n_gate_up, slots);
    assert_eq!(readiness.tiles_stored.download().unwrap(), want, "gate/up stored parts per M tile");
    println!("  gate/up hooked: bitwise the standalone kernel; {m_tiles} M tiles counted {want:?}");

    // The down projection on the hidden rows, likewise.
    let down_standalone = poisoned::<f32>(&gpu, cap * h);
    let down_hooked = poisoned::<f32>(&gpu, cap * h);
    let down_plan =
        EnginePlan::rows_nt(&gpu, hidden_rows, &groups, &s.experts.w_down, (h, i), RowsOut::F32(&down_standalone))
            .unwrap();
    let down_hooked_plan =
        EnginePlan::rows_nt(&gpu, hidden_rows, &groups, &s.experts.w_down, (h, i), RowsOut::F32(&down_hooked)).unwrap();
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { down_plan.launch(&gpu) }.unwrap();
    let mut down_ready = TileReadiness::new(&gpu, slots, Duration::from_secs(2), 3).unwrap();
    down_ready.land_all().unwrap();
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { down_hooked_plan.launch_counted(&gpu, &down_ready) }.unwrap();
    down_ready.check(&gpu).unwrap();
    assert_eq!(
        fingerprint(&down_hooked.download().unwrap()[..s.rows * h]),
        fingerprint(&down_standalone.download().unwrap()[..s.rows * h]),
        "hooked down projection differs from the standalone kernel"
    );
    let n_down = (h as u32).div_ceil(256);
    assert_eq!(
        down_ready.tiles_stored.download().unwrap(),
        expected_stored_parts(&row_offsets, &tile_offsets, n_down, slots),
        "down stored parts per M tile"
    );

    // One M tile's rows never land: a bounded wait, the tile named, then a correct launch.
    let silent_tile = m_tiles / 2;
    let deadline = Duration::from_millis(50);
    let mut faulty = TileReadiness::new(&gpu, slots, deadline, 1).unwrap();
    let mut landed = vec![1u32; slots];
    landed[silent_tile] = 0;
    faulty.rows_landed.upload(&landed).unwrap();
    let start = Instant::now();
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { hooked_plan.launch_counted(&gpu, &faulty) }.unwrap();
    let error = faulty.check(&gpu).unwrap_err();
    let took = start.elapsed();
    println!("  a tile whose rows never land ({took:?}): {error}");
    match &error {
        mok::MokError::Timeout { detail, .. } => {
            assert!(detail.contains(&format!("M tile {silent_tile}:")), "{detail}")
        }
        other => panic!("expected a timeout naming M tile {silent_tile}, got {other:?}"),
    }
    let bound = common::sized("bound", Duration::from_secs(2), Duration::from_secs(60));
    assert!(took < bound, "the failed launch took {took:?} for a {deadline:?} deadline");
    // Poisoned again, so the next launch must write every row itself.
    hooked.fill_bytes(0xff).unwrap();
    let mut again = TileReadiness::new(&gpu, slots, Duration::from_secs(2), 2).unwrap();
    again.land_all().unwrap();
    // SAFETY: the plan's buffers live in this scope, past the stream's work on them.
    unsafe { hooked_plan.launch_counted(&gpu, &again) }.unwrap();
    again.check(&gpu).unwrap();
    assert_eq!(
        fingerprint(&hooked.download().unwrap()[..valid]),
        fingerprint(&standalone.download().unwrap()[..valid]),
        "the launch after a timeout"
    );
}
