//! Benchmark of the expert-parallel exchange with virtual ranks (P ranks in one GPU): bytes per
//! second moved by dispatch (pull of bf16 x rows) and by combine (push of f32 result rows), with
//! the vector and the bulk-copy movers, next to a plain device copy of the same bytes in the same
//! run; and the schedule's time as a share of the unfused layer's time on the same global tokens.
//!
//! `exchange [--shape kimi] [--tokens 8192] [--ranks 8] [--reps 10]` (`--tokens` is global: each
//! rank holds tokens / ranks). Without a GPU it says so and exits 0.
//!
//! Accounting: a mover reads each payload byte once and writes it once, like a device copy; the
//! GB/s figures are payload bytes over time for both, so their ratio is the movers' efficiency.
//! Virtual ranks share one GPU's HBM: these are not NVLink numbers (the multi-GPU run gives those).

use anyhow::{Context, Result, bail};
use half::bf16;
use mok::driver::{DeviceBuffer, Gpu};
use mok::exchange::reference::reference_schedule;
use mok::exchange::{Exchange, ExchangeOptions};
use mok::problem::RoutedTokens;
use mok::shapes::FrontierShape;
use mok::unfused::{DeviceExperts, DeviceTokens, UnfusedLayer, random_bf16};

struct Args {
    shape: FrontierShape,
    tokens: usize,
    ranks: usize,
    reps: usize,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        shape: FrontierShape::by_name("kimi").expect("kimi is a frontier shape"),
        tokens: 8192,
        ranks: 8,
        reps: 10,
    };
    let mut it = std::env::args().skip(1).filter(|a| a != "--bench");
    while let Some(arg) = it.next() {
        let mut value = || it.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--shape" => {
                let name = value()?;
                args.shape = FrontierShape::by_name(&name).with_context(|| format!("unknown shape {name}"))?;
            }
            "--tokens" => args.tokens = value()?.parse()?,
            "--ranks" => args.ranks = value()?.parse()?,
            "--reps" => args.reps = value()?.parse()?,
            other => bail!("unknown argument {other}"),
        }
    }
    if !args.tokens.is_multiple_of(args.ranks) || !args.shape.experts.is_multiple_of(args.ranks) {
        bail!("--tokens and the shape's experts must be multiples of --ranks");
    }
    Ok(args)
}

fn median(mut v: Vec<f32>) -> f64 {
    v.sort_by(f32::total_cmp);
    v[v.len() / 2] as f64
}

/// Median milliseconds of `reps` runs of `work` (after one warm-up run), timed with events.
fn time(gpu: &Gpu, reps: usize, mut work: impl FnMut() -> Result<()>) -> Result<f64> {
    work()?;
    gpu.synchronize()?;
    let timer = gpu.timer()?;
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        timer.start()?;
        work()?;
        samples.push(timer.stop_ms()?);
    }
    Ok(median(samples))
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let gpu = match mok::open_gpu(0) {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("exchange benchmark: no usable GPU ({e}); nothing measured.");
            return Ok(());
        }
    };
    let global = args.shape.config(args.tokens);
    let p = args.ranks;
    let mut config = global.clone();
    config.ep_ranks = p;
    config.tokens_per_rank = args.tokens / p;
    let (t, h, k, e) = (config.tokens_per_rank, config.hidden, config.top_k, config.num_experts);
    println!(
        "exchange benchmark on {}: {} (E {e}, H {h}, k {k}), {} tokens over {p} virtual ranks ({t} each), {} reps",
        gpu.name(),
        args.shape.model,
        args.tokens,
        args.reps
    );

    // Inputs, and the ring sized from the CPU schedule (the worst case would be 8x larger).
    let (ids, weights) = mok::random::topk_routing(args.tokens, k, e, 7);
    let x: Vec<bf16> = mok::random::bf16_values(args.tokens * h, 5, 1.0);
    let rank_ids: Vec<&[i32]> = ids.chunks(t * k).collect();
    let schedule = reference_schedule(&rank_ids, k, e)?;
    let ring_rows: Vec<usize> = schedule.iter().map(|s| s.ring_source.len()).collect();
    let total_rows: usize = ring_rows.iter().sum();
    let capacity = *ring_rows.iter().max().expect("at least one rank");
    let options = ExchangeOptions { capacity_rows: Some(capacity), ..Default::default() };
    let mut exchange = Exchange::new_virtual(&gpu, &config, options)?;
    for rank in 0..p {
        let tokens = RoutedTokens {
            x: x[rank * t * h..(rank + 1) * t * h].to_vec(),
            topk_ids: ids[rank * t * k..(rank + 1) * t * k].to_vec(),
            topk_weights: weights[rank * t * k..(rank + 1) * t * k].to_vec(),
        };
        exchange.upload_tokens(&gpu, rank, &config, &tokens)?;
    }
    let gpus = [&gpu];
    // Result rows to push: non-zero bytes (never time on zeros).
    let mut rows: Vec<DeviceBuffer<f32>> = Vec::with_capacity(p);
    for _ in 0..p {
        let mut buffer = DeviceBuffer::alloc(&gpu, capacity * h)?;
        buffer.fill_bytes(0x3c)?;
        rows.push(buffer);
    }
    let row_ptrs: Vec<u64> = rows.iter().map(|b| b.device_ptr()).collect();
    let outs: Vec<DeviceBuffer<bf16>> = (0..p).map(|_| DeviceBuffer::alloc(&gpu, t * h)).collect::<mok::Result<_>>()?;
    let out_ptrs: Vec<u64> = outs.iter().map(|b| b.device_ptr()).collect();
    exchange.schedule(&gpus)?;
    exchange.dispatch(&gpus)?;
    // SAFETY: ring-sized f32 rows and [T][H] bf16 outputs that live to the end of `main`.
    unsafe { exchange.combine(&gpus, &row_ptrs, &vec![0; p], &out_ptrs) }?;
    exchange.check_errors(&gpus)?;

    let reps = args.reps;
    let schedule_ms = time(&gpu, reps, || Ok(exchange.schedule(&gpus)?))?;
    // Its two halves: the single-rank routing layout + publish, and the count exchange,
    // placement and inverse map (re-run on the same epoch: its waits are already satisfied).
    let route_ms = time(&gpu, reps, || Ok(exchange.route_and_publish(&gpus)?))?;
    let place_ms = time(&gpu, reps, || Ok(exchange.place(&gpus)?))?;
    let dispatch_ms = time(&gpu, reps, || Ok(exchange.dispatch(&gpus)?))?;
    // SAFETY: the buffers of the combine above, alive to the end of `main`.
    let push_ms = time(&gpu, reps, || Ok(unsafe { exchange.push(&gpus, false, &row_ptrs) }?))?;
    // SAFETY: as above.
    let sum_ms = time(&gpu, reps, || Ok(unsafe { exchange.sum(&gpus, false, &vec![0; p], &out_ptrs) }?))?;
    exchange.set_bulk_copies(true);
    let dispatch_bulk_ms = time(&gpu, reps, || Ok(exchange.dispatch(&gpus)?))?;
    // SAFETY: as above.
    let push_bulk_ms = time(&gpu, reps, || Ok(unsafe { exchange.push(&gpus, false, &row_ptrs) }?))?;
    exchange.set_bulk_copies(false);
    // The sums above ran without fresh pushes each time: their waits were satisfied by the
    // counters' earlier growth, so the error check also proves no wait timed out.
    exchange.check_errors(&gpus)?;

    // A plain device copy of the same payload bytes, in the same run.
    let dispatch_bytes = total_rows * h * 2;
    let combine_bytes = total_rows * h * 4;
    let copy_src = DeviceBuffer::<u8>::alloc(&gpu, combine_bytes)?;
    let copy_dst = DeviceBuffer::<u8>::alloc(&gpu, combine_bytes)?;
    let copy = |bytes: usize| -> Result<()> {
        // SAFETY: both buffers hold `combine_bytes` ≥ `bytes`.
        unsafe { gpu.copy_device_to_device(copy_dst.device_ptr(), copy_src.device_ptr(), bytes)? };
        Ok(())
    };
    let copy_dispatch_ms = time(&gpu, reps, || copy(dispatch_bytes))?;
    let copy_combine_ms = time(&gpu, reps, || copy(combine_bytes))?;

    // The unfused layer on the same global tokens (one GPU, every expert local).
    let (i, scale_h) = (global.intermediate, 3.0 / (h as f32).sqrt());
    let experts = DeviceExperts {
        w_gate: random_bf16(&gpu, e * i * h, 1, scale_h)?,
        w_up: random_bf16(&gpu, e * i * h, 2, scale_h)?,
        w_down: random_bf16(&gpu, e * h * i, 3, 3.0 / (i as f32).sqrt())?,
    };
    let global_tokens = DeviceTokens::upload(&gpu, &global, &RoutedTokens { x, topk_ids: ids, topk_weights: weights })?;
    let dy = random_bf16(&gpu, args.tokens * h, 4, 1.0)?;
    let mut layer = UnfusedLayer::new(&gpu, global.clone())?;
    let layer_reps = reps.min(3);
    let fwd_ms = time(&gpu, layer_reps, || Ok(layer.forward(&gpu, &global_tokens, &experts, None)?))?;
    let step_ms = time(&gpu, layer_reps, || {
        layer.forward(&gpu, &global_tokens, &experts, None)?;
        Ok(layer.backward(&gpu, &global_tokens, &experts, None, &dy)?)
    })?;
    layer.check_device_errors()?;

    let gbps = |bytes: usize, ms: f64| bytes as f64 / (ms * 1e6);
    println!();
    println!("| what | payload | time ms | GB/s | device copy of the same bytes, GB/s | share of copy rate |");
    println!("|---|---|---|---|---|---|");
    let copy_dispatch = gbps(dispatch_bytes, copy_dispatch_ms);
    let copy_combine = gbps(combine_bytes, copy_combine_ms);
    for (what, bytes, ms, copy_rate) in [
        ("dispatch, pull (16-byte vectors)", dispatch_bytes, dispatch_ms, copy_dispatch),
        ("dispatch, pull (bulk copies)", dispatch_bytes, dispatch_bulk_ms, copy_dispatch),
        ("combine, push (16-byte vectors)", combine_bytes, push_ms, copy_combine),
        ("combine, push (bulk copies)", combine_bytes, push_bulk_ms, copy_combine),
    ] {
        let rate = gbps(bytes, ms);
        println!(
            "| {what} | {:.1} MB | {ms:.3} | {rate:.0} | {copy_rate:.0} | {:.0}% |",
            bytes as f64 / 1e6,
            100.0 * rate / copy_rate
        );
    }
    println!("| combine, token-owner sum of {} slots | - | {sum_ms:.3} | - | - | - |", t * k * p);
    println!();
    println!("rows moved: {total_rows} ({} per rank on average, ring capacity {capacity})", total_rows / p);
    println!(
        "schedule (route + publish + count exchange + offsets + ring map, all {p} ranks): {schedule_ms:.3} ms = \
         {:.2}% of the unfused forward ({fwd_ms:.2} ms), {:.2}% of forward + backward ({step_ms:.2} ms); \
         halves: route + publish {route_ms:.3} ms, exchange + place + ring map {place_ms:.3} ms",
        100.0 * schedule_ms / fwd_ms,
        100.0 * schedule_ms / step_ms
    );
    println!(
        "RESULT exchange {} {} ranks {p} schedule_ms {schedule_ms:.4} route_ms {route_ms:.4} place_ms {place_ms:.4} dispatch_ms {dispatch_ms:.4} dispatch_bulk_ms \
         {dispatch_bulk_ms:.4} push_ms {push_ms:.4} push_bulk_ms {push_bulk_ms:.4} sum_ms {sum_ms:.4} copy_dispatch_ms \
         {copy_dispatch_ms:.4} copy_combine_ms {copy_combine_ms:.4} unfused_fwd_ms {fwd_ms:.3} unfused_step_ms {step_ms:.3}",
        args.shape.name, args.tokens
    );
    Ok(())
}
