//! Reproducible random test and benchmark data, from the counter-based generator the device's
//! `mok_fill_random_bf16` uses (`mok_kernels::num::random_uniform`), so host and device agree
//! for the same seed. Never zeros: tests and benchmarks must not run on them.

use half::bf16;
use mok_kernels::num::random_uniform;

/// `count` bf16 values uniform in ±`scale`; element i is `bf16(scale · u(seed, i))`, the same as
/// `unfused::random_bf16` generates on the device.
pub fn bf16_values(count: usize, seed: u64, scale: f32) -> Vec<bf16> {
    (0..count).map(|i| bf16::from_f32(scale * random_uniform(seed, i as u64))).collect()
}

/// Uniform random top-k routing: for each of `tokens` tokens, `k` distinct expert ids in
/// `[0, experts)` (no dropped slots) and weights in `(0, 1/k]`.
///
/// # Panics
/// If `k > experts` (no k distinct ids exist).
pub fn topk_routing(tokens: usize, k: usize, experts: usize, seed: u64) -> (Vec<i32>, Vec<f32>) {
    assert!(k <= experts, "top-{k} routing needs at least {k} experts, got {experts}");
    let mut draw = 0u64;
    let mut ids = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        let start = ids.len();
        while ids.len() < start + k {
            draw += 1;
            let id = (((random_uniform(seed, draw) + 1.0) / 2.0 * experts as f32) as i32).min(experts as i32 - 1);
            if !ids[start..].contains(&id) {
                ids.push(id);
            }
        }
    }
    let weights = (0..tokens * k).map(|i| (random_uniform(seed ^ 3, i as u64) + 1.0) / (2.0 * k as f32)).collect();
    (ids, weights)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_ids_are_distinct_in_range_and_reproducible() {
        let (ids, weights) = topk_routing(50, 4, 6, 9);
        assert_eq!((ids.len(), weights.len()), (200, 200));
        for row in ids.chunks(4) {
            assert!(row.iter().all(|&id| (0..6).contains(&id)));
            for (j, id) in row.iter().enumerate() {
                assert!(!row[..j].contains(id));
            }
        }
        assert!(weights.iter().all(|&w| w > 0.0 && w <= 0.25));
        assert_eq!(topk_routing(50, 4, 6, 9), (ids, weights));
        assert_ne!(topk_routing(50, 4, 6, 10).0, topk_routing(50, 4, 6, 9).0);
    }

    #[test]
    fn bf16_values_are_never_all_zero() {
        let v = bf16_values(1000, 1, 0.5);
        assert!(v.iter().all(|x| x.to_f32().abs() <= 0.5));
        assert!(v.iter().filter(|x| x.to_f32() != 0.0).count() > 990);
    }
}
