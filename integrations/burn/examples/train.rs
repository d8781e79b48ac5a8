//! Trains a small model whose middle layer is mok's MoE, on a task where experts must
//! specialise: each token belongs to one of E clusters (the largest of its first E features) and
//! its target is that cluster's own linear function of the token. Router → top-k → MoE → head,
//! burn's Adam. Runs the mok model twice with the same seed (the losses must be bitwise equal,
//! printed side by side), then the same model with the MoE written in burn's own tensor ops, and
//! prints the time per step of both (the mok model's second run, after warm-up steps: the first
//! steps of a process compile CubeCL's kernels).
//!
//! `cargo run --release --example train -- [--steps N]` (an NVIDIA GPU, its driver and NVRTC).

use std::time::Instant;

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend as _;
use mok::MoeConfig;
use mok_burn::{Backend, MokMoe, bf16_tensor, deterministic_values, moe_in_burn_ops};

type Device = burn::backend::cuda::CudaDevice;

const TOKENS: usize = 512;
const HIDDEN: usize = 64;
const INTER: usize = 64;
const EXPERTS: usize = 8;
const TOP_K: usize = 2;

#[derive(Module, Debug)]
struct Model<B: burn::tensor::backend::Backend> {
    router: Linear<B>,
    head: Linear<B>,
    w_gate: Param<Tensor<B, 3>>,
    w_up: Param<Tensor<B, 3>>,
    w_down: Param<Tensor<B, 3>>,
}

fn model(device: &Device) -> Model<Backend> {
    let scale = 3.0 / (HIDDEN as f32).sqrt();
    Model {
        router: LinearConfig::new(HIDDEN, EXPERTS).init(device),
        head: LinearConfig::new(HIDDEN, 1).init(device),
        w_gate: Param::from_tensor(bf16_tensor(
            deterministic_values(EXPERTS * INTER * HIDDEN, 1, scale),
            [EXPERTS, INTER, HIDDEN],
            device,
        )),
        w_up: Param::from_tensor(bf16_tensor(
            deterministic_values(EXPERTS * INTER * HIDDEN, 2, scale),
            [EXPERTS, INTER, HIDDEN],
            device,
        )),
        w_down: Param::from_tensor(bf16_tensor(
            deterministic_values(EXPERTS * HIDDEN * INTER, 3, scale),
            [EXPERTS, HIDDEN, INTER],
            device,
        )),
    }
}

impl Model<Backend> {
    fn forward(&self, x: Tensor<Backend, 2>, moe: Option<&MokMoe>) -> Tensor<Backend, 2> {
        let probs = softmax(self.router.forward(x.clone()), 1);
        let (w, ids) = probs.topk_with_indices(TOP_K, 1);
        let weights = (self.w_gate.val(), self.w_up.val(), self.w_down.val());
        let y = match moe {
            Some(moe) => moe.forward(x, ids, w, weights).expect("mok forward"),
            None => moe_in_burn_ops(x, ids, w, weights),
        };
        self.head.forward(y)
    }
}

/// The batch of `step`: tokens, and each one's target (its cluster's linear function).
fn batch(step: usize, device: &Device) -> (Tensor<Backend, 2>, Tensor<Backend, 2>) {
    let x = deterministic_values(TOKENS * HIDDEN, 1000 + step as u64, 1.0);
    let maps = deterministic_values(EXPERTS * HIDDEN, 7, 1.0);
    let target: Vec<f32> = (0..TOKENS)
        .map(|n| {
            let row = &x[n * HIDDEN..(n + 1) * HIDDEN];
            let cluster = (0..EXPERTS).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap();
            row.iter().zip(&maps[cluster * HIDDEN..(cluster + 1) * HIDDEN]).map(|(a, b)| a * b).sum::<f32>() / 4.0
        })
        .collect();
    (bf16_tensor(x, [TOKENS, HIDDEN], device), bf16_tensor(target, [TOKENS, 1], device))
}

/// Steps left out of the time per step: the first ones compile CubeCL's kernels for this model.
const WARMUP_STEPS: usize = 10;

/// Trains `steps` steps; returns the loss of each and the seconds per step after the first
/// [`WARMUP_STEPS`].
fn train(steps: usize, use_mok: bool, device: &Device) -> (Vec<f32>, f64) {
    Backend::seed(device, 42);
    let mut model = model(device);
    let moe =
        use_mok.then(|| MokMoe::new(0, MoeConfig::new(TOKENS, HIDDEN, INTER, EXPERTS, TOP_K)).expect("mok layer"));
    let mut optim = AdamConfig::new().init();
    let mut losses = Vec::with_capacity(steps);
    let mut start = Instant::now();
    for step in 0..steps {
        if step == WARMUP_STEPS {
            start = Instant::now();
        }
        let (x, target) = batch(step, device);
        let pred = model.forward(x, moe.as_ref());
        let diff = pred - target;
        let loss = (diff.clone() * diff).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        losses.push(loss.into_scalar().to_f32());
        model = optim.step(1e-2, model, grads);
    }
    (losses, start.elapsed().as_secs_f64() / (steps - WARMUP_STEPS) as f64)
}

fn main() {
    let mut steps = 200;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--steps" => steps = args.next().and_then(|v| v.parse().ok()).expect("--steps N"),
            other => panic!("unknown argument {other}"),
        }
    }
    assert!(steps > WARMUP_STEPS, "--steps must exceed the {WARMUP_STEPS} warm-up steps");
    let device = Device::default();
    let (first, first_step) = train(steps, true, &device);
    let (second, mok_step) = train(steps, true, &device);
    let (pure, burn_step) = train(steps, false, &device);
    println!("step | loss (mok, run 1) | loss (mok, run 2) | loss (burn's own MoE)");
    for s in (0..steps).filter(|s| s % 10 == 0 || *s == steps - 1) {
        println!("{s:4} | {:.6} | {:.6} | {:.6}", first[s], second[s], pure[s]);
    }
    let identical = first.iter().zip(&second).all(|(a, b)| a.to_bits() == b.to_bits());
    println!("two mok runs with one seed: losses bitwise {}", if identical { "identical" } else { "DIFFERENT" });
    println!("loss: {:.6} → {:.6} (mok), {:.6} → {:.6} (burn)", first[0], first[steps - 1], pure[0], pure[steps - 1]);
    println!(
        "time per step after {WARMUP_STEPS} warm-up steps: mok {:.2} ms (its first run {:.2} ms), burn's own MoE {:.2} ms",
        1e3 * mok_step,
        1e3 * first_step,
        1e3 * burn_step
    );
    assert!(identical, "the two runs differ");
}
