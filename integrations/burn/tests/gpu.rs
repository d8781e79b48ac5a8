//! GPU tests of mok-burn (feature `gpu-tests`; built into the GPU bundle): the op's outputs and
//! gradients against the same layer written in burn's own tensor ops (gather the experts'
//! weights per slot, batched matmuls, SwiGLU, the weighted sum), and bitwise repeats.
#![cfg(feature = "gpu-tests")]

use burn::backend::cuda::CudaDevice;
use burn::tensor::{Int, Tensor, TensorData};
use mok::MoeConfig;
use mok_burn::{Backend, MokMoe, bf16_tensor, deterministic_values, moe_in_burn_ops};

fn tensor<const D: usize>(data: Vec<f32>, shape: [usize; D], device: &CudaDevice) -> Tensor<Backend, D> {
    bf16_tensor(data, shape, device).require_grad()
}

fn host(t: Tensor<burn_autodiff::Autodiff<mok_burn::Inner>, 2>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

fn host_inner<const D: usize>(t: Tensor<mok_burn::Inner, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((*x - *y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

struct Run {
    y: Vec<f32>,
    grads: Vec<Vec<f32>>,
}

fn run(moe: Option<&MokMoe>, c: &MoeConfig, seed: u64, device: &CudaDevice) -> Run {
    let (t, h, i, e, k) = (c.tokens_per_rank, c.hidden, c.intermediate, c.num_experts, c.top_k);
    let x = tensor(deterministic_values(t * h, seed, 1.0), [t, h], device);
    // Distinct experts per token: token n takes experts (n·7 + j) mod E.
    let ids: Vec<i32> = (0..t * k).map(|s| ((s / k * 7 + s % k) % e) as i32).collect();
    let ids = Tensor::<Backend, 2, Int>::from_data(TensorData::new(ids, [t, k]), device);
    let w = tensor(deterministic_values(t * k, seed ^ 1, 0.5).iter().map(|v| v.abs() + 0.05).collect(), [t, k], device);
    let scale = 3.0 / (h as f32).sqrt();
    let wg = tensor(deterministic_values(e * i * h, seed ^ 2, scale), [e, i, h], device);
    let wu = tensor(deterministic_values(e * i * h, seed ^ 3, scale), [e, i, h], device);
    let wd = tensor(deterministic_values(e * h * i, seed ^ 4, 3.0 / (i as f32).sqrt()), [e, h, i], device);
    let dy = tensor(deterministic_values(t * h, seed ^ 5, 1.0), [t, h], device).detach();
    let weights = (wg.clone(), wu.clone(), wd.clone());
    let y = match moe {
        Some(moe) => moe.forward(x.clone(), ids, w.clone(), weights).unwrap(),
        None => moe_in_burn_ops(x.clone(), ids, w.clone(), weights),
    };
    let grads = (y.clone() * dy).sum().backward();
    let g2 = |t: &Tensor<Backend, 2>| host_inner(t.grad(&grads).expect("a gradient"));
    let g3 = |t: &Tensor<Backend, 3>| host_inner(t.grad(&grads).expect("a gradient"));
    Run { y: host(y), grads: vec![g2(&x), g2(&w), g3(&wg), g3(&wu), g3(&wd)] }
}

#[test]
fn the_op_matches_burns_own_layer_and_repeats_bitwise() {
    let device = CudaDevice::default();
    for (t, h, i, e, k) in [(64, 128, 64, 8, 2), (300, 256, 128, 16, 4)] {
        let c = MoeConfig::new(t, h, i, e, k);
        let moe = MokMoe::new(0, c.clone()).unwrap();
        let got = run(Some(&moe), &c, 11, &device);
        let want = run(None, &c, 11, &device);
        let names = ["dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down"];
        let err = rel_l2(&got.y, &want.y);
        println!("  T={t} H={h} I={i} E={e} k={k}: y rel L2 {err:.2e}");
        assert!(err <= 1e-2, "y: {err}");
        for (n, (g, w)) in got.grads.iter().zip(&want.grads).enumerate() {
            let err = rel_l2(g, w);
            println!("    {}: rel L2 {err:.2e}", names[n]);
            assert!(err <= 1e-2, "{}: {err}", names[n]);
        }
        let again = run(Some(&moe), &c, 11, &device);
        assert_eq!(again.y, got.y, "y differs between two runs");
        assert_eq!(again.grads, got.grads, "gradients differ between two runs");
        println!("    two runs bitwise identical");
    }
}
