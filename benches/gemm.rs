//! Benchmark of the sm_90a tensor-core GEMM engine next to PyTorch measured in the same device
//! call (`benches/torch_gemm.py`, passed with `--baseline FILE`): TFLOP/s of every variant for
//! 8 groups of [8192 × 7168] × [7168 × 4096] and for the frontier shapes' projections, all
//! experts on one GPU, uniform random top-k routing, random data; with the floors (FLOPs at the
//! matmul ceiling, bytes at the copy ceiling).
//!
//! `gemm [--cases kimi:8192,...|""] [--baseline FILE] [--matmul-tflops R] [--copy-tbps B]
//! [--pairing m|n] [--gathering]` (`--pairing`: every row-grouped plan with M-pairs where
//! possible, or N-pairs only, instead of each plan's default; `mok::gemm::Pairing`.
//! `--gathering`: also the gate/up and the gate and up weight gradients whose producers gather the
//! token rows through the routing layout, `…:gathered`, each timed right after its plain
//! counterpart, which reads a gathered copy).

use std::collections::HashMap;

use anyhow::{Context, Result};
use half::bf16;
use mok::driver::{DeviceBuffer, Gpu};
use mok::gemm::{EnginePlan, Pairing, RowGroups, RowsOut, WgradOut, tile_offsets};
use mok::layout::RoutingLayout;
use mok::shapes::FrontierShape;
use mok::unfused::random_bf16;

struct Row {
    name: String,
    ms: f64,
    flop: f64,
    bytes: f64,
}

fn time_ms(gpu: &Gpu, mut launch: impl FnMut() -> mok::Result<()>) -> Result<f64> {
    // Warm up for at least WARMUP_MS of device time, so clocks and caches are in the steady state
    // the repetitions measure (the first case otherwise runs on a cold chip).
    let timer = gpu.timer()?;
    let mut warm = 0.0;
    let mut launches = 0;
    while warm < WARMUP_MS || launches < 3 {
        timer.start()?;
        launch()?;
        warm += timer.stop_ms()? as f64;
        launches += 1;
    }
    let mut times = Vec::new();
    for _ in 0..REPETITIONS {
        timer.start()?;
        launch()?;
        times.push(timer.stop_ms()? as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Times `launch` ([`time_ms`]) and returns the table row of case `name`.
fn timed_row(gpu: &Gpu, name: String, flop: f64, bytes: f64, launch: impl FnMut() -> mok::Result<()>) -> Result<Row> {
    Ok(Row { name, ms: time_ms(gpu, launch)?, flop, bytes })
}

/// The dense case with bf16 rows out, the output type of the torch baseline.
const DENSE_BF16: &str = "dense8:bf16_out";

/// Device time spent on warm-up launches before each case is timed (as in `torch_timing.py`).
const WARMUP_MS: f64 = 200.0;
/// Timed launches per case; the median is reported.
const REPETITIONS: usize = 20;

/// The dense case: 8 groups of 8192 rows, K = 7168, N = 4096 through `rows_nt`, with f32 rows
/// out (the down projection's epilogue) or bf16 rows out (what `matmul` and `_grouped_mm` return).
fn dense_row(gpu: &Gpu, bf16_out: bool, pairing: Option<Pairing>) -> Result<Row> {
    let (g, m, k, n) = (8usize, 8192usize, 7168usize, 4096usize);
    let a = random_bf16(gpu, g * m * k, 1, 1.0)?;
    let w = random_bf16(gpu, g * n * k, 2, 0.02)?;
    let offsets: Vec<u32> = (0..=g as u32).map(|i| i * m as u32).collect();
    let row_offsets = DeviceBuffer::from_slice(gpu, &offsets)?;
    let tiles = tile_offsets(gpu, &row_offsets, g)?;
    let groups =
        RowGroups { row_offsets: (&row_offsets).into(), tile_offsets: (&tiles).into(), groups: g, capacity: g * m };
    let flop = 2.0 * (g * m * k * n) as f64;
    let operands = 2.0 * (g * (m * k + k * n)) as f64;
    if bf16_out {
        let out = DeviceBuffer::<bf16>::alloc(gpu, g * m * n)?;
        let plan = paired(gpu, EnginePlan::rows_nt(gpu, &a, &groups, &w, (n, k), RowsOut::Bf16(&out))?, pairing)?;
        // SAFETY: the plan's buffers live in this scope, past the timed launches.
        timed_row(gpu, DENSE_BF16.into(), flop, operands + 2.0 * (g * m * n) as f64, || unsafe { plan.launch(gpu) })
    } else {
        let out = DeviceBuffer::<f32>::alloc(gpu, g * m * n)?;
        let plan = paired(gpu, EnginePlan::rows_nt(gpu, &a, &groups, &w, (n, k), RowsOut::F32(&out))?, pairing)?;
        // SAFETY: as above.
        timed_row(gpu, "dense8".into(), flop, operands + 4.0 * (g * m * n) as f64, || unsafe { plan.launch(gpu) })
    }
}

/// `plan` with `pairing` set, if one was asked for.
fn paired(gpu: &Gpu, mut plan: EnginePlan, pairing: Option<Pairing>) -> Result<EnginePlan> {
    if let Some(pairing) = pairing {
        plan.set_pairing(gpu, pairing)?;
    }
    Ok(plan)
}

/// A random routing's layout: its group offsets and each row's slot `t · k + j`.
fn random_layout(tokens: usize, experts: usize, k: usize, seed: u64) -> RoutingLayout {
    let (ids, _) = mok::random::topk_routing(tokens, k, experts, seed);
    RoutingLayout::compute(&ids, k, experts).expect("whole tokens of k ids")
}

fn main() -> Result<()> {
    let mut cases = "kimi:8192,glm:8192,qwen:8192,deepseek:8192".to_string();
    let (mut baseline_file, mut matmul, mut copy, mut pairing) = (None, 783.0, 4.23, None);
    let mut gathering = false;
    let mut args = std::env::args().skip(1).filter(|a| a != "--bench");
    while let Some(arg) = args.next() {
        let mut value = || args.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--cases" => cases = value()?,
            "--baseline" => baseline_file = Some(value()?),
            "--matmul-tflops" => matmul = value()?.parse()?,
            "--copy-tbps" => copy = value()?.parse()?,
            "--pairing" => {
                pairing = Some(match value()?.as_str() {
                    "m" => Pairing::MAndN,
                    "n" => Pairing::NOnly,
                    other => anyhow::bail!("--pairing is m or n, not {other}"),
                })
            }
            "--gathering" => gathering = true,
            other => anyhow::bail!("unknown argument {other}"),
        }
    }
    let gpu = match mok::open_gpu(0) {
        Ok(gpu) if gpu.compute_capability().0 == 9 => gpu,
        Ok(gpu) => {
            println!("gemm benchmark: the engine is sm_90a; this GPU is {}; nothing measured.", gpu.name());
            return Ok(());
        }
        Err(e) => {
            println!("gemm benchmark: no usable GPU ({e}); nothing measured.");
            return Ok(());
        }
    };
    let mut baseline: HashMap<String, (f64, f64)> = HashMap::new();
    if let Some(path) = baseline_file {
        for line in std::fs::read_to_string(&path)?.lines().filter(|l| l.starts_with("TORCHGEMM ")) {
            let f: Vec<&str> = line.split_whitespace().collect();
            baseline.insert(f[1].to_string(), (f[2].parse()?, f[3].parse()?));
        }
    }
    let mut rows_out: Vec<Row> = Vec::new();

    // Dense first, with f32 rows out (as the down projection); the same with bf16 rows out runs
    // last, so that it does not change the thermal state the other cases are measured in.
    rows_out.push(dense_row(&gpu, false, pairing)?);

    for case in cases.split(',').filter(|c| !c.is_empty()) {
        let (name, tokens) = case.split_once(':').context("case is shape:tokens")?;
        let shape = FrontierShape::by_name(name).context("unknown shape")?;
        let tokens: usize = tokens.parse()?;
        let (e, h, i, k) = (shape.experts, shape.hidden, shape.intermediate, shape.top_k);
        let cap = tokens * k;
        let layout = random_layout(tokens, e, k, 9);
        let offsets = layout.row_offsets.clone();
        let rows = offsets[e] as usize;
        let row_offsets = DeviceBuffer::from_slice(&gpu, &offsets)?;
        let tiles = tile_offsets(&gpu, &row_offsets, e)?;
        let groups =
            RowGroups { row_offsets: (&row_offsets).into(), tile_offsets: (&tiles).into(), groups: e, capacity: cap };
        let x = random_bf16(&gpu, cap * h, 3, 1.0)?;
        let w_gate = random_bf16(&gpu, e * i * h, 4, 0.02)?;
        let w_up = random_bf16(&gpu, e * i * h, 5, 0.02)?;
        let w_down = random_bf16(&gpu, e * h * i, 6, 0.02)?;
        let hidden = DeviceBuffer::<bf16>::alloc(&gpu, cap * i)?;
        let out_h = DeviceBuffer::<f32>::alloc(&gpu, cap * h)?;
        let out_i = DeviceBuffer::<f32>::alloc(&gpu, cap * i)?;
        let dy = random_bf16(&gpu, cap * h, 7, 1.0)?;
        let d_gate = random_bf16(&gpu, cap * i, 8, 1.0)?;
        let d_up = random_bf16(&gpu, cap * i, 10, 1.0)?;
        let dw = DeviceBuffer::<bf16>::alloc(&gpu, e * h * i)?;
        let dw2 = DeviceBuffer::<bf16>::alloc(&gpu, e * h * i)?;
        let weights = 2.0 * (e * h * i) as f64;
        let (r, hf, inf) = (rows as f64, h as f64, i as f64);
        let tag = |what: &str| format!("{name}:{tokens}:{what}");

        // (case, FLOPs, fewest bytes, plan) of the single-launch variants.
        let single = [
            (
                "gate_up",
                4.0 * r * hf * inf,
                2.0 * weights + 2.0 * r * hf + 2.0 * r * inf,
                paired(
                    &gpu,
                    EnginePlan::gate_up(&gpu, &x, &groups, &w_gate, &w_up, (h, i), None, &hidden, None)?,
                    pairing,
                )?,
            ),
            (
                "down",
                2.0 * r * hf * inf,
                weights + 2.0 * r * inf + 4.0 * r * hf,
                paired(
                    &gpu,
                    EnginePlan::rows_nt(&gpu, &hidden, &groups, &w_down, (h, i), RowsOut::F32(&out_h))?,
                    pairing,
                )?,
            ),
            (
                "dgrad_down",
                2.0 * r * hf * inf,
                weights + 2.0 * r * hf + 4.0 * r * inf,
                paired(
                    &gpu,
                    EnginePlan::rows_nn(&gpu, ((&dy).into(), (&w_down).into()), None, &groups, (i, h), &out_i)?,
                    pairing,
                )?,
            ),
            (
                "dgrad_gate_up",
                4.0 * r * hf * inf,
                2.0 * weights + 4.0 * r * inf + 4.0 * r * hf,
                paired(
                    &gpu,
                    EnginePlan::rows_nn(
                        &gpu,
                        ((&d_gate).into(), (&w_gate).into()),
                        Some(((&d_up).into(), (&w_up).into())),
                        &groups,
                        (h, i),
                        &out_h,
                    )?,
                    pairing,
                )?,
            ),
            (
                "wgrad_down",
                2.0 * r * hf * inf,
                weights + 2.0 * r * (hf + inf),
                EnginePlan::wgrad(&gpu, &dy, &hidden, &row_offsets, (e, cap), (h, i), WgradOut::Bf16((&dw).into()))?,
            ),
        ];
        // The gathering plans read the tokens (`[T][h]`) through each row's slot.
        let gathering_plans = if gathering {
            let mut row_source = layout.row_source.clone();
            row_source.resize(cap, 0);
            let row_source = DeviceBuffer::from_slice(&gpu, &row_source)?;
            let tokens_x = random_bf16(&gpu, tokens * h, 11, 1.0)?;
            let gate_up = EnginePlan::gate_up_gathering(&gpu, &groups, &w_gate, &w_up, (h, i), None, &hidden, None)?;
            Some((row_source, tokens_x, paired(&gpu, gate_up, pairing)?))
        } else {
            None
        };
        for (what, flop, bytes, plan) in &single {
            // SAFETY: the plans' buffers live in this scope, past the timed launches.
            rows_out.push(timed_row(&gpu, tag(what), *flop, *bytes, || unsafe { plan.launch(&gpu) })?);
            if let (Some((row_source, tokens_x, plan)), &"gate_up") = (&gathering_plans, what) {
                let name = tag("gate_up:gathering");
                rows_out.push(timed_row(&gpu, name, *flop, *bytes, || {
                    // SAFETY: as above; the slots are this routing's, below T · k.
                    unsafe { plan.launch_gathering(&gpu, tokens_x.into(), row_source.into(), k) }
                })?);
            }
        }
        let plan_g =
            EnginePlan::wgrad(&gpu, &d_gate, &x, &row_offsets, (e, cap), (i, h), WgradOut::Bf16((&dw).into()))?;
        let plan_u = EnginePlan::wgrad(&gpu, &d_up, &x, &row_offsets, (e, cap), (i, h), WgradOut::Bf16((&dw2).into()))?;
        let (flop, bytes) = (4.0 * r * hf * inf, 2.0 * weights + 2.0 * r * (hf + 2.0 * inf));
        rows_out.push(timed_row(&gpu, tag("wgrad_gate_up"), flop, bytes, || {
            // SAFETY: as above.
            unsafe {
                plan_g.launch(&gpu)?;
                plan_u.launch(&gpu)
            }
        })?);
        if let Some((row_source, tokens_x, _)) = &gathering_plans {
            let (out_g, out_u) = (WgradOut::Bf16((&dw).into()), WgradOut::Bf16((&dw2).into()));
            let plan_g = EnginePlan::wgrad_gathering(&gpu, &d_gate, &row_offsets, (e, cap), (i, h), out_g)?;
            let plan_u = EnginePlan::wgrad_gathering(&gpu, &d_up, &row_offsets, (e, cap), (i, h), out_u)?;
            rows_out.push(timed_row(&gpu, tag("wgrad_gate_up:gathering"), flop, bytes, || {
                // SAFETY: as above; the slots are this routing's, below T · k.
                unsafe {
                    plan_g.launch_gathering(&gpu, tokens_x.into(), row_source.into(), k)?;
                    plan_u.launch_gathering(&gpu, tokens_x.into(), row_source.into(), k)
                }
            })?);
        }
    }

    if gpu.has_kernel("mok_sm90_gemm_rows_nt_bf16") {
        rows_out.push(dense_row(&gpu, true, pairing)?);
    } else {
        // A PTX from before that kernel, loaded through MOK_PTX (compare_ptx.sh with an older
        // build): keep the table of everything else.
        println!("gemm benchmark: {DENSE_BF16} not measured: the loaded PTX has no mok_sm90_gemm_rows_nt_bf16");
    }

    // One machine-readable line per case, for benches/ratio_table.py, which pairs the runs of a
    // call that alternates torch and mok (run_gemm_bench.sh).
    for row in &rows_out {
        println!("MOKGEMM {} {:.4} {:.6e} {:.6e}", row.name, row.ms, row.flop, row.bytes);
    }
    println!("| case | mok ms | mok TFLOP/s | torch ms | torch TFLOP/s | mok / torch | floor ms (FLOP / bytes) |");
    println!("|---|---|---|---|---|---|---|");
    for row in &rows_out {
        let tflops = row.flop / row.ms / 1e9;
        let dense = row.name == "dense8" || row.name == DENSE_BF16;
        let key = if dense { "dense8-matmul".to_string() } else { row.name.clone() };
        let (tms, ttf, ratio) = match baseline.get(&key) {
            Some(&(ms, tf)) => (format!("{ms:.3}"), format!("{tf:.0}"), format!("{:.2}x", ms / row.ms)),
            None => ("-".into(), "-".into(), "-".into()),
        };
        let (ff, fb) = (row.flop / (matmul * 1e9), row.bytes / (copy * 1e9));
        println!(
            "| {} | {:.3} | {tflops:.0} | {tms} | {ttf} | {ratio} | {:.3} ({ff:.3} / {fb:.3}) |",
            row.name,
            row.ms,
            ff.max(fb)
        );
        if dense && let Some(&(ms, tf)) = baseline.get("dense8-grouped_mm") {
            println!("| {} vs _grouped_mm | | | {ms:.3} | {tf:.0} | {:.2}x | |", row.name, ms / row.ms);
        }
    }
    Ok(())
}
