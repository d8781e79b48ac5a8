//! No public CPU-side function of mok panics, whatever it is given: 100 000 random
//! configurations and inputs, mostly near the edges (zeros, one-off lengths, ids out of range,
//! huge sizes, non-finite limits), go through config validation, input validation, the routing
//! layout, the exchange schedule and shape, the cost model, the layer's workspace count and the
//! f64 reference. Each call must
//! return (`Ok` or `Err`); a valid input must also give results of the right size.

use half::bf16;
use mok_host::MoeConfig;
use mok_host::exchange::reference::reference_schedule;
use mok_host::exchange::{Exchange, ExchangeOptions};
use mok_host::layout::RoutingLayout;
use mok_host::moe::{Backend, workspace_bytes};
use mok_host::problem::{ExpertWeights, RoutedTokens, SharedExpertWeights, validate_topk_ids};
use mok_host::reference::{self, ReferenceOptions};
use mok_host::shapes;
use proptest::prelude::*;

/// A size: mostly small, sometimes zero, sometimes enormous.
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 0usize..=12,
        3 => (1usize..=8).prop_map(|n| 8 * n),
        1 => Just(usize::MAX),
        1 => (1usize << 28)..=(1usize << 40),
    ]
}

fn limit() -> impl Strategy<Value = Option<f32>> {
    prop_oneof![
        3 => Just(None),
        3 => (0.01f32..10.0).prop_map(Some),
        1 => prop::sample::select(vec![0.0, -1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MIN_POSITIVE])
            .prop_map(Some),
    ]
}

fn config() -> impl Strategy<Value = MoeConfig> {
    (
        size(),
        size(),
        size(),
        size(),
        size(),
        prop_oneof![4 => 1usize..=4, 1 => Just(0usize), 1 => size()],
        prop::option::of(size()),
        limit(),
    )
        .prop_map(|(t, h, i, e, k, p, is, limit)| MoeConfig {
            tokens_per_rank: t,
            hidden: h,
            intermediate: i,
            num_experts: e,
            top_k: k,
            ep_ranks: p,
            shared_intermediate: is,
            swiglu_limit: limit,
        })
}

/// A length near `expected` (exact most of the time), capped so nothing huge is allocated.
fn near(expected: usize, jitter: i64) -> usize {
    const CAP: usize = 1 << 14;
    let n = expected.min(CAP) as i64 + jitter;
    n.clamp(0, CAP as i64) as usize
}

#[derive(Debug, Clone)]
struct Inputs {
    config: MoeConfig,
    /// Length jitter per tensor (0 = exact).
    jitter: [i64; 9],
    /// Raw id draws, mapped into [-3, E + 2].
    ids: Vec<u32>,
    seed: u64,
}

fn inputs() -> impl Strategy<Value = Inputs> {
    (
        config(),
        prop::array::uniform9(prop_oneof![8 => Just(0i64), 1 => -2i64..=2]),
        prop::collection::vec(any::<u32>(), 0..64),
        any::<u64>(),
    )
        .prop_map(|(config, jitter, ids, seed)| Inputs { config, jitter, ids, seed })
}

fn values(len: usize, seed: u64) -> Vec<bf16> {
    (0..len).map(|n| bf16::from_f32(((n as u64 ^ seed) % 17) as f32 / 8.0 - 1.0)).collect()
}

fn check(input: &Inputs) {
    let c = &input.config;
    let valid = c.validate().is_ok();
    let _ = c.local_experts();
    let _ = c.slots_per_rank();
    let _ = shapes::forward_flops(c);
    let _ = shapes::forward_min_bytes(c);
    let _ = shapes::backward_min_bytes(c);
    let options = ExchangeOptions::default();
    let shape = Exchange::shape_for(c, &options);
    let heap = Exchange::heap_bytes_per_rank(c, &options);
    if !valid {
        assert!(shape.is_err() && heap.is_err(), "an invalid config passed the exchange: {c:?}");
    }
    for backend in [Backend::MmaSync, Backend::Engine, Backend::ForwardMegakernel, Backend::Megakernel] {
        for gathering in [false, true] {
            let bytes = workspace_bytes(c, backend, gathering);
            // Counted for a valid one-GPU config on a backend that can gather when asked to.
            let countable = valid && c.ep_ranks == 1 && !(gathering && backend == Backend::MmaSync);
            assert_eq!(bytes.is_ok(), countable, "workspace_bytes({backend:?}, gathering {gathering}) of {c:?}");
        }
    }

    let (t, h, i, k, e) = (c.tokens_per_rank, c.hidden, c.intermediate, c.top_k, c.num_experts);
    let local = c.local_experts();
    let j = input.jitter;
    let span = e.min(1 << 20) as u64 + 6;
    let slots = near(t.saturating_mul(k), j[1]);
    let topk_ids: Vec<i32> = (0..slots)
        .map(|n| {
            let draw = input.ids.get(n % input.ids.len().max(1)).copied().unwrap_or(n as u32) as u64;
            ((draw.wrapping_add(n as u64 * 7919)) % span) as i32 - 3
        })
        .collect();
    let tokens = RoutedTokens {
        x: values(near(t.saturating_mul(h), j[0]), input.seed),
        topk_ids: topk_ids.clone(),
        topk_weights: (0..near(t.saturating_mul(k), j[2])).map(|n| (n % 5) as f32 / 4.0).collect(),
    };
    let experts = ExpertWeights {
        w_gate: values(near(local.saturating_mul(i).saturating_mul(h), j[3]), input.seed ^ 1),
        w_up: values(near(local.saturating_mul(i).saturating_mul(h), j[4]), input.seed ^ 2),
        w_down: values(near(local.saturating_mul(h).saturating_mul(i), j[5]), input.seed ^ 3),
    };
    let shared = c.shared_intermediate.map(|is| SharedExpertWeights {
        ws_gate: values(near(is.saturating_mul(h), j[6]), input.seed ^ 4),
        ws_up: values(near(is.saturating_mul(h), j[7]), input.seed ^ 5),
        ws_down: values(near(h.saturating_mul(is), j[8]), input.seed ^ 6),
    });

    let tokens_ok = tokens.validate(c).is_ok();
    let experts_ok = experts.validate(c).is_ok();
    let shared_ok = shared.as_ref().map(|s| s.validate(c).is_ok());
    if !valid {
        assert!(!tokens_ok && !experts_ok && shared_ok != Some(true), "invalid config, valid inputs: {c:?}");
    }
    let _ = validate_topk_ids(&topk_ids, e, k);
    let _ = validate_topk_ids(&topk_ids, e.saturating_add(1), k.saturating_sub(1));

    match RoutingLayout::compute(&topk_ids, k, e) {
        Ok(layout) => {
            assert_eq!(layout.slot_row.len(), topk_ids.len());
            assert_eq!(layout.row_offsets.len(), e + 1);
        }
        Err(_) => assert!(
            k == 0
                || k > mok_host::config::MAX_TOP_K
                || !topk_ids.len().is_multiple_of(k)
                || e > mok_host::config::MAX_EXPERTS
        ),
    }
    let p = c.ep_ranks.min(8);
    if p > 0 && topk_ids.len().is_multiple_of(p) {
        let per = topk_ids.len() / p;
        let ranks: Vec<&[i32]> = (0..p).map(|r| &topk_ids[r * per..(r + 1) * per]).collect();
        if let Ok(schedule) = reference_schedule(&ranks, k, e) {
            assert_eq!(schedule.len(), p);
            let rows: usize = schedule.iter().map(|s| s.ring_source.len()).sum();
            assert!(rows <= topk_ids.len());
        }
    } else {
        assert!(reference_schedule(&[], k, e).is_err());
    }

    // The f64 reference runs only where it is cheap; it validates everything first.
    let work = t.saturating_mul(k.max(1)).saturating_mul(h).saturating_mul(i.max(c.shared_intermediate.unwrap_or(0)));
    if work <= 1 << 14 {
        let forward = reference::forward(c, &tokens, &experts, shared.as_ref(), ReferenceOptions::MATCH_GPU);
        let all_ok = valid && tokens_ok && experts_ok && shared_ok.unwrap_or(true) && c.ep_ranks == 1;
        if let Ok(f) = &forward {
            assert_eq!(f.y.len(), t * h);
        }
        if all_ok && validate_topk_ids(&topk_ids, e, k).is_ok() {
            assert!(forward.is_ok(), "valid problem refused: {c:?}: {:?}", forward.err());
        }
        let dy = values(near(t.saturating_mul(h), j[0]), input.seed ^ 9);
        let _ = reference::backward(c, &tokens, &experts, shared.as_ref(), &dy, ReferenceOptions::EXACT);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 100_000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn no_public_cpu_function_panics(input in inputs()) {
        check(&input);
    }
}
