//! `cargo xtask demo`: one forward and backward of a frontier shape at reduced T on the GPU,
//! checked against the f64 CPU reference, with timings. Without a GPU, the same at a tiny shape
//! on the CPU reference only, and it says so.
//!
//! Options: `--shape kimi|glm|qwen|deepseek` (default qwen: the largest shape whose f64
//! reference gradients fit a 128 GiB host), `--tokens T` (default 128),
//! `--shared` (add a shared expert of the routed width), `--limit L` (SwiGLU clamp).

use std::time::Instant;

use anyhow::{Context, Result, bail};
use half::bf16;
use mok::problem::{ExpertWeights, RoutedTokens, SharedExpertWeights};
use mok::random::bf16_values;
use mok::reference::{self, ReferenceOptions};
use mok::shapes::{FrontierShape, forward_flops};
use mok::unfused::{DeviceExperts, DeviceSharedExpert, DeviceTokens, UnfusedLayer, random_bf16};
use mok::{MoeConfig, MokError};

struct Options {
    shape: FrontierShape,
    tokens: usize,
    shared: bool,
    limit: Option<f32>,
}

fn parse_options() -> Result<Options> {
    let mut options = Options {
        shape: FrontierShape::by_name("qwen").expect("known shape"),
        tokens: 128,
        shared: false,
        limit: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().with_context(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--shape" => {
                let name = value("--shape")?;
                options.shape = FrontierShape::by_name(&name)
                    .with_context(|| format!("unknown shape {name}: use kimi, glm, qwen or deepseek"))?;
            }
            "--tokens" => options.tokens = value("--tokens")?.parse().context("--tokens takes a positive integer")?,
            "--shared" => options.shared = true,
            "--limit" => options.limit = Some(value("--limit")?.parse().context("--limit takes a number")?),
            "--help" | "-h" => {
                println!("mok-demo [--shape kimi|glm|qwen|deepseek] [--tokens T] [--shared] [--limit L]");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other} (try --help)"),
        }
    }
    Ok(options)
}

fn random_tokens(config: &MoeConfig, seed: u64) -> RoutedTokens {
    let (t, h, k, e) = (config.tokens_per_rank, config.hidden, config.top_k, config.num_experts);
    let (topk_ids, topk_weights) = mok::random::topk_routing(t, k, e, seed);
    RoutedTokens { x: bf16_values(t * h, seed ^ 1, 1.0), topk_ids, topk_weights }
}

/// Host memory in GB from /proc/meminfo (MemTotal), or infinity where it cannot be read.
fn host_memory_gb() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
            line.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map_or(f64::INFINITY, |kib| kib * 1024.0 / 1e9)
}

fn scale(fan_in: usize) -> f32 {
    3.0 / (fan_in as f32).sqrt()
}

fn main() -> Result<()> {
    let options = parse_options()?;
    match mok::open_gpu(0) {
        Ok(gpu) => gpu_demo(&gpu, &options),
        Err(error @ (MokError::NoDriver(_) | MokError::UnsupportedGpu { .. })) => cpu_demo(&error),
        Err(other) => Err(other.into()),
    }
}

fn cpu_demo(why: &MokError) -> Result<()> {
    println!("mok demo: no usable GPU ({why}).");
    println!("Running the f64 CPU reference only, at a tiny shape (the GPU path needs an sm_90a/sm_100a GPU).");
    let config =
        MoeConfig { shared_intermediate: Some(128), swiglu_limit: Some(7.0), ..MoeConfig::new(32, 256, 128, 16, 4) };
    let (t, h, i, e) = (config.tokens_per_rank, config.hidden, config.intermediate, config.num_experts);
    let tokens = random_tokens(&config, 1);
    let experts = ExpertWeights {
        w_gate: bf16_values(e * i * h, 2, scale(h)),
        w_up: bf16_values(e * i * h, 3, scale(h)),
        w_down: bf16_values(e * h * i, 4, scale(i)),
    };
    let shared = SharedExpertWeights {
        ws_gate: bf16_values(128 * h, 5, scale(h)),
        ws_up: bf16_values(128 * h, 6, scale(h)),
        ws_down: bf16_values(h * 128, 7, scale(128)),
    };
    let dy = bf16_values(t * h, 8, 1.0);
    let start = Instant::now();
    let (fwd, grads) =
        reference::backward(&config, &tokens, &experts, Some(&shared), &dy, ReferenceOptions::MATCH_GPU)?;
    let rms = |v: &[f64]| (v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64).sqrt();
    println!(
        "CPU reference T={t} H={h} I={i} E={e} k=4 shared=128: forward + backward in {:.1} ms",
        start.elapsed().as_secs_f64() * 1e3
    );
    println!(
        "  rms(y) = {:.4}, rms(dx) = {:.4}, rms(dw_gate) = {:.3e}",
        rms(&fwd.y),
        rms(&grads.dx),
        rms(&grads.dw_gate)
    );
    Ok(())
}

fn gpu_demo(gpu: &mok::driver::Gpu, options: &Options) -> Result<()> {
    let shape = options.shape;
    let mut config = shape.config(options.tokens);
    if options.shared {
        config.shared_intermediate = Some(shape.intermediate);
    }
    config.swiglu_limit = options.limit;
    config.validate()?;
    let (t, h, i, e) = (config.tokens_per_rank, config.hidden, config.intermediate, config.num_experts);
    println!(
        "mok demo on {} (sm_{}{}, {} SMs): {} at T={t} (H={h} I={i} E={e} k={})",
        gpu.name(),
        gpu.compute_capability().0,
        gpu.compute_capability().1,
        gpu.multiprocessors(),
        shape.model,
        config.top_k
    );

    let host_tokens = random_tokens(&config, 11);
    let tokens = DeviceTokens::upload(gpu, &config, &host_tokens)?;
    let n = e * i * h;
    let experts = DeviceExperts {
        w_gate: random_bf16(gpu, n, 21, scale(h))?,
        w_up: random_bf16(gpu, n, 22, scale(h))?,
        w_down: random_bf16(gpu, n, 23, scale(i))?,
    };
    let shared = match config.shared_intermediate {
        Some(is) => Some(DeviceSharedExpert {
            ws_gate: random_bf16(gpu, is * h, 24, scale(h))?,
            ws_up: random_bf16(gpu, is * h, 25, scale(h))?,
            ws_down: random_bf16(gpu, h * is, 26, scale(is))?,
        }),
        None => None,
    };
    let dy_host = bf16_values(t * h, 27, 1.0);
    let dy = mok::driver::DeviceBuffer::from_slice(gpu, &dy_host)?;
    let mut layer = UnfusedLayer::new(gpu, config.clone())?;

    // Warm-up (module JIT and first-touch), then timed passes.
    layer.forward(gpu, &tokens, &experts, shared.as_ref())?;
    layer.backward(gpu, &tokens, &experts, shared.as_ref(), &dy)?;
    layer.check_device_errors()?;
    let timer = gpu.timer()?;
    let mut forward_ms = Vec::new();
    let mut step_ms = Vec::new();
    for _ in 0..5 {
        timer.start()?;
        layer.forward(gpu, &tokens, &experts, shared.as_ref())?;
        forward_ms.push(timer.stop_ms()?);
        timer.start()?;
        layer.forward(gpu, &tokens, &experts, shared.as_ref())?;
        layer.backward(gpu, &tokens, &experts, shared.as_ref(), &dy)?;
        step_ms.push(timer.stop_ms()?);
    }
    layer.poison()?;
    layer.forward(gpu, &tokens, &experts, shared.as_ref())?;
    layer.backward(gpu, &tokens, &experts, shared.as_ref(), &dy)?;
    gpu.synchronize()?;
    layer.check_device_errors()?;
    let median = |v: &mut Vec<f32>| {
        v.sort_by(f32::total_cmp);
        v[v.len() / 2] as f64
    };
    let (fwd_ms, step_ms) = (median(&mut forward_ms), median(&mut step_ms));
    let flops = forward_flops(&config);
    println!(
        "unfused GPU path: forward {fwd_ms:.3} ms ({:.0} TFLOP/s), forward+backward {step_ms:.3} ms ({:.0} TFLOP/s)",
        flops / fwd_ms / 1e9,
        3.0 * flops / step_ms / 1e9
    );

    // The reference holds bf16 weights and f64 weight gradients on the host: 30 bytes a weight.
    let needed = 30.0 * (n as f64) / 1e9;
    let total = host_memory_gb();
    if needed > 0.85 * total {
        bail!(
            "the CPU reference check of {} needs about {needed:.0} GB of host memory and this host has {total:.0} GB; \
             run --shape qwen (or glm) for a checked demo; the GPU timings above stand",
            shape.model
        );
    }
    println!(
        "checking against the f64 CPU reference (copying {:.1} GB of weights back)...",
        3.0 * n as f64 * 2.0 / 1e9
    );
    let start = Instant::now();
    let host_experts = experts.download()?;
    let host_shared = shared.as_ref().map(|s| s.download()).transpose()?;
    let (fwd, grads) = reference::backward(
        &config,
        &host_tokens,
        &host_experts,
        host_shared.as_ref(),
        &dy_host,
        ReferenceOptions::MATCH_GPU,
    )?;
    let as_f64 = |v: Vec<bf16>| v.into_iter().map(|x| x.to_f64()).collect::<Vec<_>>();
    let report = [
        ("y", reference::relative_error(as_f64(layer.y().download()?), &fwd.y), 5e-3),
        ("dx", reference::relative_error(as_f64(layer.grads().dx.download()?), &grads.dx), 5e-3),
        (
            "d_topk_weights",
            reference::relative_error(
                layer.grads().d_topk_weights.download()?.into_iter().map(f64::from),
                &grads.d_topk_weights,
            ),
            2e-3,
        ),
        ("dw_gate", reference::relative_error(as_f64(layer.grads().dw_gate.download()?), &grads.dw_gate), 5e-3),
        ("dw_up", reference::relative_error(as_f64(layer.grads().dw_up.download()?), &grads.dw_up), 5e-3),
        ("dw_down", reference::relative_error(as_f64(layer.grads().dw_down.download()?), &grads.dw_down), 5e-3),
    ];
    println!("reference done in {:.1} s", start.elapsed().as_secs_f64());
    let mut failed = false;
    for (name, error, tolerance) in report {
        let verdict = if error < tolerance { "ok" } else { "FAILED" };
        failed |= error >= tolerance;
        println!("  {name:<16} relative error {error:.2e} (tolerance {tolerance:.0e}) {verdict}");
    }
    if failed {
        bail!("the GPU result does not match the reference");
    }
    println!("demo passed");
    Ok(())
}
