//! GPU tests of the public layer, `MoeLayer`, written against the public API alone (feature
//! `gpu-tests`): caller-owned device memory in and out through views, every backend this GPU
//! has giving the same bits, the weight gradients fresh or added into the caller's f32 buffers,
//! a captured step replayed as a CUDA graph, the layer over P virtual ranks giving the one-GPU
//! bits, and the errors a framework can hit.
#![cfg(feature = "gpu-tests")]

mod common;

use common::{Case, Routing, fingerprint, grad_views, random_case};
use half::bf16;
use mok::driver::{CapturedGraph, DeviceBuffer, DeviceSlice, DeviceSliceMut, Gpu};
use mok::moe::{Backend, LayerOptions, MoeGradients, MoeInputs};
use mok::unfused::{DeviceExperts, DeviceSharedExpert, DeviceTokens, WeightGradTarget};
use mok::{MoeConfig, MoeLayer, MokError};

fn gpu() -> Gpu {
    mok::open_gpu(0).unwrap_or_else(|e| {
        panic!("GPU tests need an NVIDIA Hopper or Blackwell GPU with its driver; this machine: {e}")
    })
}

/// The caller's memory: inputs, weights, and where the outputs and gradients go.
struct Caller {
    tokens: DeviceTokens,
    experts: DeviceExperts,
    shared: Option<DeviceSharedExpert>,
    dy: DeviceBuffer<bf16>,
    y: DeviceBuffer<bf16>,
    dx: DeviceBuffer<bf16>,
    d_topk_weights: DeviceBuffer<f32>,
    /// Fresh bf16 weight gradients (dw_gate, dw_up, dw_down, then the shared expert's).
    dw: Vec<DeviceBuffer<bf16>>,
    /// f32 main gradients, same order.
    main_grads: Vec<DeviceBuffer<f32>>,
}

impl Caller {
    fn new(gpu: &Gpu, case: &Case) -> Self {
        let c = &case.config;
        let (t, h, i, e, k) = (c.tokens_per_rank, c.hidden, c.intermediate, c.num_experts, c.top_k);
        let mut sizes = vec![e * i * h; 3];
        if let Some(is) = c.shared_intermediate {
            sizes.extend([is * h; 3]);
        }
        let poisoned_bf16 = |n| {
            let mut b = DeviceBuffer::<bf16>::alloc(gpu, n).unwrap();
            b.fill_bytes(0xff).unwrap();
            b
        };
        Caller {
            tokens: DeviceTokens::upload(gpu, c, &case.tokens).unwrap(),
            experts: DeviceExperts::upload(gpu, c, &case.experts).unwrap(),
            shared: case.shared.as_ref().map(|s| DeviceSharedExpert::upload(gpu, c, s).unwrap()),
            dy: DeviceBuffer::from_slice(gpu, &case.dy).unwrap(),
            y: poisoned_bf16(t * h),
            dx: poisoned_bf16(t * h),
            d_topk_weights: DeviceBuffer::from_slice(gpu, &vec![f32::NAN; t * k]).unwrap(),
            dw: sizes.iter().map(|&n| poisoned_bf16(n)).collect(),
            main_grads: sizes.iter().map(|&n| DeviceBuffer::from_slice(gpu, &vec![0.0f32; n]).unwrap()).collect(),
        }
    }
}

impl Caller {
    /// Poisons every output and fresh gradient again (NaN bytes), as before a step.
    fn poison(&mut self) {
        for buffer in [&mut self.y, &mut self.dx].into_iter().chain(self.dw.iter_mut()) {
            buffer.fill_bytes(0xff).unwrap();
        }
        self.d_topk_weights.fill_bytes(0xff).unwrap();
    }
}

/// The forward's inputs: views of the caller's tokens, experts and shared expert.
fn inputs_of<'a>(
    tokens: &'a DeviceTokens,
    experts: &'a DeviceExperts,
    shared: &'a Option<DeviceSharedExpert>,
) -> MoeInputs<'a> {
    MoeInputs { tokens: tokens.into(), experts: experts.into(), shared: shared.as_ref().map(Into::into) }
}

/// One training step through the public API; fresh bf16 weight gradients into the caller's
/// buffers, or added into its f32 main gradients.
fn step(gpu: &Gpu, layer: &mut MoeLayer, caller: &mut Caller, accumulate: bool) {
    step_into(gpu, layer, caller, if accumulate { Target::CallerF32 } else { Target::CallerBf16 });
}

/// Where a step's weight gradients go.
#[derive(Clone, Copy)]
enum Target {
    /// The caller's bf16 gradients, fresh.
    CallerBf16,
    /// Added into the caller's f32 main gradients.
    CallerF32,
    /// The layer's own bf16 gradients.
    Layer,
}

fn step_into(gpu: &Gpu, layer: &mut MoeLayer, caller: &mut Caller, target: Target) {
    let Caller { tokens, experts, shared, dy, y, dx, d_topk_weights, dw, main_grads } = caller;
    let inputs = inputs_of(tokens, experts, shared);
    let pass = layer.forward(gpu, &inputs, y.into()).unwrap();
    let weights = match target {
        Target::CallerF32 => WeightGradTarget::AccumulateF32(grad_views(main_grads)),
        Target::CallerBf16 => WeightGradTarget::Bf16(grad_views(dw)),
        Target::Layer => WeightGradTarget::Layer,
    };
    let grads = MoeGradients { dx: dx.into(), d_topk_weights: d_topk_weights.into(), weights };
    pass.backward(gpu, &inputs, (&*dy).into(), grads).unwrap();
    layer.check().unwrap();
}

/// Fingerprints of y, dx, d_topk_weights and the fresh weight gradients.
fn outputs(caller: &Caller) -> Vec<u64> {
    let mut prints = vec![
        fingerprint(&caller.y.download().unwrap()),
        fingerprint(&caller.dx.download().unwrap()),
        fingerprint(&caller.d_topk_weights.download().unwrap()),
    ];
    prints.extend(caller.dw.iter().map(|b| fingerprint(&b.download().unwrap())));
    prints
}

/// Gradients into the caller's dx and d_topk_weights, and fresh bf16 weight gradients into `dw`.
fn bf16_grads<'a>(
    dx: &'a mut DeviceBuffer<bf16>,
    d_topk_weights: &'a mut DeviceBuffer<f32>,
    dw: &'a mut [DeviceBuffer<bf16>],
) -> MoeGradients<'a> {
    MoeGradients {
        dx: dx.into(),
        d_topk_weights: d_topk_weights.into(),
        weights: WeightGradTarget::Bf16(grad_views(dw)),
    }
}

fn config() -> MoeConfig {
    MoeConfig { shared_intermediate: Some(256), swiglu_limit: Some(1.0), ..MoeConfig::new(400, 512, 256, 32, 8) }
}

#[test]
fn moe_layer_gives_every_backend_the_same_bits_over_caller_memory() {
    let gpu = gpu();
    let c = config();
    let case = random_case(&c, 700, Routing { drop_probability: 0.05, empty_experts: &[3] });
    let auto = MoeLayer::new(&gpu, c.clone(), LayerOptions::default()).unwrap();
    println!("  fastest backend here: {:?}", auto.backend());
    assert_eq!(auto.backend(), Backend::fastest_on(&gpu));
    // Gathering in the producers, the default takes the engine path over the forward megakernel.
    if auto.backend() != Backend::MmaSync {
        let gathering = LayerOptions { gather_in_producer: true, ..LayerOptions::default() };
        let expected = if auto.backend() == Backend::ForwardMegakernel { Backend::Engine } else { auto.backend() };
        assert_eq!(MoeLayer::new(&gpu, c.clone(), gathering).unwrap().backend(), expected);
    }
    // Gathering in the producers: refused on mma.sync and over ranks, before anything runs.
    for (backend, ranks) in [(Backend::MmaSync, 1), (Backend::Megakernel, 2)] {
        let options = LayerOptions { backend: Some(backend), gather_in_producer: true, ..LayerOptions::default() };
        let config = MoeConfig { ep_ranks: ranks, tokens_per_rank: c.tokens_per_rank / ranks, ..c.clone() };
        match MoeLayer::new(&gpu, config, options) {
            // Refused by `MoeLayer::new` itself (its message names the backend).
            Err(MokError::InvalidInput { tensor: "gather_in_producer", problem })
                if problem.contains(&format!("{backend:?}")) =>
            {
                println!("  {problem}")
            }
            Err(other) => panic!("{backend:?} over {ranks}: expected gathering refused, got {other:?}"),
            Ok(_) => panic!("{backend:?} over {ranks}: expected gathering refused, got a layer"),
        }
    }
    let mut expected = None;
    let runs = [
        (Backend::MmaSync, false),
        (Backend::Engine, false),
        (Backend::Megakernel, false),
        (Backend::ForwardMegakernel, false),
        (Backend::Engine, true),
        (Backend::Megakernel, true),
        (Backend::ForwardMegakernel, true),
    ];
    for (backend, gather_in_producer) in runs {
        let options = LayerOptions { backend: Some(backend), gather_in_producer, ..LayerOptions::default() };
        let mut layer = match MoeLayer::new(&gpu, c.clone(), options) {
            Ok(layer) => layer,
            Err(e) => {
                println!("  NOT RUN on {backend:?}: {e}");
                assert_ne!(gpu.compute_capability().0, 9, "an sm_90 GPU must run {backend:?}: {e}");
                continue;
            }
        };
        let mut caller = Caller::new(&gpu, &case);
        step(&gpu, &mut layer, &mut caller, false);
        let got = outputs(&caller);
        match &expected {
            None => expected = Some(got),
            Some(e) => assert_eq!(&got, e, "{backend:?} (gathering: {gather_in_producer}) differs from mma.sync"),
        }
        // f32 accumulation: from zero, one step's f32 sums round to the fresh bf16 bits; a second
        // step adds the same sums again, doubling every element exactly.
        step(&gpu, &mut layer, &mut caller, true);
        let once: Vec<Vec<f32>> = caller.main_grads.iter().map(|b| b.download().unwrap()).collect();
        for (n, (sums, fresh)) in once.iter().zip(&caller.dw).enumerate() {
            let rounded: Vec<bf16> = sums.iter().map(|&v| bf16::from_f32(v)).collect();
            assert_eq!(fingerprint(&rounded), fingerprint(&fresh.download().unwrap()), "{backend:?}: gradient {n}");
        }
        step(&gpu, &mut layer, &mut caller, true);
        for (n, (buffer, sums)) in caller.main_grads.iter().zip(&once).enumerate() {
            let twice: Vec<f32> = sums.iter().map(|v| 2.0 * v).collect();
            assert_eq!(
                fingerprint(&buffer.download().unwrap()),
                fingerprint(&twice),
                "{backend:?}: gradient {n} twice"
            );
        }
        println!(
            "  {backend:?} (gathering in the producers: {gather_in_producer}): same bits as mma.sync; f32 accumulation \
             = fresh sums, twice = doubled"
        );
    }
}

/// A forward + backward into the caller's bf16 gradients, captured as a graph.
fn capture_step(gpu: &Gpu, layer: &mut MoeLayer, caller: &mut Caller) -> CapturedGraph {
    gpu.capture(|| {
        let Caller { tokens, experts, shared, dy, y, dx, d_topk_weights, dw, .. } = caller;
        let inputs = inputs_of(tokens, experts, shared);
        let pass = layer.forward(gpu, &inputs, y.into())?;
        let grads = bf16_grads(dx, d_topk_weights, dw);
        pass.backward(gpu, &inputs, (&*dy).into(), grads)
    })
    .unwrap()
}

#[test]
fn a_captured_moe_layer_step_replays_the_eager_bits() {
    let gpu = gpu();
    let c = config();
    let case = random_case(&c, 701, Routing { drop_probability: 0.05, empty_experts: &[] });
    // The default backend, then the engine path and both megakernels where they differ from it:
    // the eager steps between the replays take other buffers, whose plans and megakernel passes
    // the layer builds beside the captured ones.
    let mut backends = vec![Backend::fastest_on(&gpu)];
    for other in [Backend::Engine, Backend::Megakernel] {
        if !backends.contains(&other) {
            backends.push(other);
        }
    }
    for backend in backends {
        let options = LayerOptions { backend: Some(backend), ..LayerOptions::default() };
        let mut layer = match MoeLayer::new(&gpu, c.clone(), options) {
            Ok(layer) => layer,
            Err(e) => {
                assert_ne!(gpu.compute_capability().0, 9, "{backend:?} must run here: {e}");
                println!("  NOT RUN on {backend:?}: {e}");
                continue;
            }
        };
        let mut caller = Caller::new(&gpu, &case);
        step(&gpu, &mut layer, &mut caller, false);
        let eager = outputs(&caller);
        let graph = capture_step(&gpu, &mut layer, &mut caller);
        // Between replays, eager steps of a shorter T on other buffers (the layer keeps the plans
        // of the buffers before): the replays must still give the captured step's bits (the shared
        // expert's token count is rewritten in every pass, so a replay sets its own).
        let short = MoeConfig { tokens_per_rank: 137, ..c.clone() };
        let short_case = random_case(&short, 705, Routing { drop_probability: 0.05, empty_experts: &[] });
        let mut short_caller = Caller::new(&gpu, &short_case);
        let mut short_eager = None;
        for replay in 0..10 {
            caller.poison();
            // SAFETY: the layer and the caller's tensors, whose buffers the capture recorded,
            // outlive the replays, and `check` waits for each.
            unsafe { graph.launch() }.unwrap();
            layer.check().unwrap();
            assert_eq!(outputs(&caller), eager, "replay {replay}");
            if replay % 2 == 0 {
                step(&gpu, &mut layer, &mut short_caller, false);
                let got = outputs(&short_caller);
                assert_eq!(short_eager.get_or_insert_with(|| got.clone()), &got, "eager T = 137 after replay {replay}");
            }
        }
        // A graph over the caller's bf16 gradients while eager steps add into its f32 ones: the
        // same weights, another target, whose routed and shared-expert plans and backward pass
        // the layer keeps beside the captured ones. A step into the layer's own gradients comes
        // first, so the eager steps' plans drop that third target's, and only the passes over
        // them go too.
        step_into(&gpu, &mut layer, &mut caller, Target::Layer);
        step(&gpu, &mut layer, &mut caller, false);
        drop(graph);
        let graph = capture_step(&gpu, &mut layer, &mut caller);
        for replay in 0..4 {
            caller.poison();
            // SAFETY: as above.
            unsafe { graph.launch() }.unwrap();
            layer.check().unwrap();
            assert_eq!(outputs(&caller), eager, "replay {replay} between accumulating steps");
            step(&gpu, &mut layer, &mut caller, true);
        }
        println!(
            "  {:?}: 10 graph replays of a training step bitwise equal to the eager step, eager steps of T = 137 \
             between them; 4 more between steps adding into f32 gradients",
            layer.backend()
        );
    }
}

#[test]
fn moe_layer_rejects_what_it_cannot_run() {
    let gpu = gpu();
    let c = config();
    let case = random_case(&c, 702, Routing { drop_probability: 0.0, empty_experts: &[] });
    // Over ranks there is no engine path of separate launches, nor the forward megakernel
    // before one.
    let p2 = MoeConfig { ep_ranks: 2, tokens_per_rank: c.tokens_per_rank / 2, ..c.clone() };
    for one_gpu in [Backend::Engine, Backend::ForwardMegakernel] {
        let options = LayerOptions { backend: Some(one_gpu), ..Default::default() };
        assert!(matches!(
            MoeLayer::new(&gpu, p2.clone(), options),
            Err(MokError::InvalidConfig { field: "ep_ranks", .. })
        ));
    }
    let mut layer = MoeLayer::new(&gpu, c.clone(), LayerOptions::default()).unwrap();
    let mut caller = Caller::new(&gpu, &case);
    let other_x = DeviceBuffer::from_slice(&gpu, &case.tokens.x).unwrap();
    let Caller { tokens, experts, shared, dy, y, dx, d_topk_weights, dw, .. } = &mut caller;
    let inputs = inputs_of(tokens, experts, shared);
    // A y view of the wrong length.
    // SAFETY: a sub-range of a live allocation of the caller's.
    let short_y = unsafe { DeviceSliceMut::<bf16>::from_raw_parts(y.device_ptr(), 10) };
    assert!(matches!(layer.forward(&gpu, &inputs, short_y), Err(MokError::InvalidInput { tensor: "y", .. })));
    // A backward given other inputs than its forward's.
    let pass = layer.forward(&gpu, &inputs, y.into()).unwrap();
    let mut swapped = inputs;
    swapped.tokens.x = DeviceSlice::from(&other_x);
    let grads = bf16_grads(dx, d_topk_weights, dw);
    match pass.backward(&gpu, &swapped, (&*dy).into(), grads) {
        Err(MokError::InvalidInput { tensor, problem }) => println!("  {tensor}: {problem}"),
        other => panic!("expected InvalidInput, got {other:?}"),
    }
    // Gradient views of the wrong size, and the shared expert's missing.
    let pass = layer.forward(&gpu, &inputs, y.into()).unwrap();
    let mut views = grad_views(dw);
    views.shared = None;
    let grads =
        MoeGradients { dx: dx.into(), d_topk_weights: d_topk_weights.into(), weights: WeightGradTarget::Bf16(views) };
    match pass.backward(&gpu, &inputs, (&*dy).into(), grads) {
        Err(MokError::InvalidInput { tensor, problem }) => println!("  {tensor}: {problem}"),
        other => panic!("expected InvalidInput, got {other:?}"),
    }
    // The same device opened again: another stream, which would not order the layer's work.
    let again = mok::open_gpu(0).unwrap();
    match layer.forward(&again, &inputs, y.into()) {
        Err(MokError::InvalidInput { tensor: "gpu", problem }) => println!("  gpu: {problem}"),
        Err(other) => panic!("expected the other Gpu refused, got {other:?}"),
        Ok(_) => panic!("expected the other Gpu refused, got a pass"),
    }
    // Two Gpus opened on one caller stream: a layer built on the first refuses the second (it
    // loaded its own kernels, whose launch attributes the layer's plans never set), and runs on
    // the first.
    {
        gpu.synchronize().unwrap();
        let context = mok::cudarc::driver::CudaContext::new(0).unwrap();
        let stream = context.new_stream().unwrap();
        let first = mok::open_gpu_on_stream(stream.clone()).unwrap();
        let second = mok::open_gpu_on_stream(stream.clone()).unwrap();
        let mut on_stream = MoeLayer::new(&first, c.clone(), LayerOptions::default()).unwrap();
        match on_stream.forward(&second, &inputs, y.into()) {
            Err(MokError::InvalidInput { tensor: "gpu", problem }) => {
                println!("  a second Gpu on one stream: {problem}")
            }
            Err(other) => panic!("expected a second Gpu on the same stream refused, got {other:?}"),
            Ok(_) => panic!("expected a second Gpu on the same stream refused, got a pass"),
        }
        drop(on_stream.forward(&first, &inputs, y.into()).unwrap());
        first.synchronize().unwrap();
        on_stream.check().unwrap();
    }
    // A token of another layer's forward (refused as another layer's, not as a stale pass: the
    // pass counts of the two layers differ, so the message must name the layer).
    let mut twin = MoeLayer::new(&gpu, c.clone(), LayerOptions::default()).unwrap();
    let token = layer.forward_token(&gpu, &inputs, y.into()).unwrap();
    let twin_token = twin.forward_token(&gpu, &inputs, y.into()).unwrap();
    let grads = bf16_grads(dx, d_topk_weights, dw);
    match layer.backward(&gpu, twin_token, &inputs, (&*dy).into(), grads) {
        Err(MokError::InvalidInput { tensor: "pass token", problem }) if problem.contains("another layer") => {
            println!("  another layer's token: {problem}")
        }
        other => panic!("expected another layer's token refused as such, got {other:?}"),
    }
    drop(token);
    twin.check().unwrap();
    layer.check().unwrap();
}

#[test]
fn moe_layer_takes_any_token_count_up_to_its_capacity() {
    // One layer sized for 400 tokens runs passes of 137, 1 and 400 tokens (T read from x's
    // length), each bitwise equal to a layer built for exactly that T, on the fastest backend
    // and the megakernel; then a pass longer than the capacity is rejected.
    let gpu = gpu();
    let capacity = config();
    let mut backends = vec![None];
    if gpu.compute_capability().0 == 9 {
        backends.push(Some(Backend::Megakernel));
    } else {
        println!("  NOT RUN on the megakernels (they need sm_90a): the fastest backend only on this GPU");
    }
    for backend in backends {
        let options = || LayerOptions { backend, ..LayerOptions::default() };
        let mut layer = MoeLayer::new(&gpu, capacity.clone(), options()).unwrap();
        for t in [137, 1, 400] {
            let exact = MoeConfig { tokens_per_rank: t, ..capacity.clone() };
            let case = random_case(&exact, 800 + t as u64, Routing { drop_probability: 0.05, empty_experts: &[2] });
            let mut caller = Caller::new(&gpu, &case);
            step(&gpu, &mut layer, &mut caller, false);
            let got = outputs(&caller);
            let mut reference = MoeLayer::new(&gpu, exact, options()).unwrap();
            let mut reference_caller = Caller::new(&gpu, &case);
            step(&gpu, &mut reference, &mut reference_caller, false);
            assert_eq!(got, outputs(&reference_caller), "{:?}: T = {t} on a layer for 400", layer.backend());
        }
        println!(
            "  {:?}: T = 137, 1, 400 on one layer for 400 tokens: the bits of layers built for each T",
            layer.backend()
        );
        let too_many = MoeConfig { tokens_per_rank: 401, ..capacity.clone() };
        let case = random_case(&too_many, 900, Routing { drop_probability: 0.0, empty_experts: &[] });
        let mut caller = Caller::new(&gpu, &case);
        let Caller { tokens, experts, shared, y, .. } = &mut caller;
        let inputs = inputs_of(tokens, experts, shared);
        match layer.forward(&gpu, &inputs, y.into()) {
            Err(MokError::InvalidInput { tensor: "x", problem }) => println!("  401 tokens: {problem}"),
            Err(other) => panic!("expected InvalidInput for x, got {other:?}"),
            Ok(_) => panic!("expected InvalidInput for x, got a pass"),
        }
    }
}

#[test]
fn workspace_bytes_is_what_a_layer_allocates() {
    // `moe::workspace_bytes`, the most a layer holds, against mok's own count of live device
    // bytes around a layer's creation and steps that reach that most: fresh gradients, then
    // added into f32 (a second gradient target), then other weight and gradient buffers (a
    // second weight set, a third target: the layer keeps the plans of the current buffers and
    // of the ones before, no more), on each backend, gathering the rows in the producers or not.
    let gpu = gpu();
    let c = config();
    let case = random_case(&c, 703, Routing { drop_probability: 0.0, empty_experts: &[] });
    let runs = [Backend::MmaSync, Backend::Engine, Backend::ForwardMegakernel, Backend::Megakernel]
        .into_iter()
        .flat_map(|backend| [(backend, false), (backend, true)])
        .filter(|&(backend, gathering)| !(gathering && backend == Backend::MmaSync));
    for (backend, gather_in_producer) in runs {
        let mut callers = [Caller::new(&gpu, &case), Caller::new(&gpu, &case)];
        let (_, before) = mok::driver::live_device_buffers();
        let options = LayerOptions { backend: Some(backend), gather_in_producer, ..LayerOptions::default() };
        let mut layer = match MoeLayer::new(&gpu, c.clone(), options) {
            Ok(layer) => layer,
            Err(e) => {
                // Every backend runs on sm_90; elsewhere only mma.sync must.
                assert!(
                    gpu.compute_capability().0 != 9 && backend != Backend::MmaSync,
                    "{backend:?} (gathering: {gather_in_producer}) must run here: {e}"
                );
                println!("  NOT RUN on {backend:?} (gathering: {gather_in_producer}): {e}");
                continue;
            }
        };
        step(&gpu, &mut layer, &mut callers[0], false);
        step(&gpu, &mut layer, &mut callers[0], true);
        step(&gpu, &mut layer, &mut callers[1], false);
        step(&gpu, &mut layer, &mut callers[0], true);
        // The second caller's f32 target too: two weight sets, two gradient targets per shared
        // weight set, and the megakernel passes over each, all held at once.
        step(&gpu, &mut layer, &mut callers[1], true);
        let (_, after) = mok::driver::live_device_buffers();
        let predicted = mok::moe::workspace_bytes(&c, backend, gather_in_producer).unwrap() as u64;
        let what = format!("{backend:?} (gathering: {gather_in_producer})");
        assert_eq!(after - before, predicted, "{what}: allocated {} bytes, predicted {predicted}", after - before);
        println!("  {what}: {predicted} bytes, as predicted");
    }
}

#[test]
fn a_pass_token_gives_the_borrowed_pass_bits_and_only_for_the_last_forward() {
    // The owned token (for a framework's graph) runs the same backward as `ForwardPass`, and a
    // token of an earlier forward is refused: the workspace holds only the last pass.
    let gpu = gpu();
    let c = config();
    let case = random_case(&c, 704, Routing { drop_probability: 0.05, empty_experts: &[] });
    let mut layer = MoeLayer::new(&gpu, c.clone(), LayerOptions::default()).unwrap();
    let mut borrowed = Caller::new(&gpu, &case);
    step(&gpu, &mut layer, &mut borrowed, false);
    let expected = outputs(&borrowed);
    let mut caller = Caller::new(&gpu, &case);
    let Caller { tokens, experts, shared, dy, y, dx, d_topk_weights, dw, .. } = &mut caller;
    let inputs = inputs_of(tokens, experts, shared);
    let stale = layer.forward_token(&gpu, &inputs, y.into()).unwrap();
    let token = layer.forward_token(&gpu, &inputs, y.into()).unwrap();
    match layer.backward(&gpu, stale, &inputs, (&*dy).into(), bf16_grads(&mut *dx, &mut *d_topk_weights, dw)) {
        Err(MokError::InvalidInput { tensor: "pass token", problem }) => println!("  stale token: {problem}"),
        other => panic!("expected the stale token refused, got {other:?}"),
    }
    layer.backward(&gpu, token, &inputs, (&*dy).into(), bf16_grads(&mut *dx, &mut *d_topk_weights, dw)).unwrap();
    layer.check().unwrap();
    assert_eq!(outputs(&caller), expected, "token backward differs from the borrowed pass");
    println!("  pass token: the borrowed pass's bits; an earlier forward's token refused");
    // A backward given longer views at the forward's addresses (a forward over the first T - 1
    // tokens, its backward over all T) is refused: it would leave dx's last row unwritten.
    let Caller { tokens, experts, shared, dy, y, dx, d_topk_weights, dw, .. } = &mut caller;
    let inputs = inputs_of(tokens, experts, shared);
    let (h, k) = (layer.config().hidden, layer.config().top_k);
    let t = inputs.tokens.x.len() / h;
    let mut shorter = inputs;
    shorter.tokens.x = inputs.tokens.x.sub(0, (t - 1) * h).unwrap();
    shorter.tokens.topk_ids = inputs.tokens.topk_ids.sub(0, (t - 1) * k).unwrap();
    shorter.tokens.topk_weights = inputs.tokens.topk_weights.sub(0, (t - 1) * k).unwrap();
    let mut y_view: DeviceSliceMut<'_, bf16> = y.into();
    let token = layer.forward_token(&gpu, &shorter, y_view.sub_mut(0, (t - 1) * h).unwrap()).unwrap();
    let grads = bf16_grads(&mut *dx, &mut *d_topk_weights, dw);
    match layer.backward(&gpu, token, &inputs, (&*dy).into(), grads) {
        Err(MokError::InvalidInput { tensor: "backward inputs", problem }) => {
            println!("  longer views at the forward's addresses: {problem}")
        }
        other => panic!("a backward over longer views than its forward's must be refused, got {other:?}"),
    }
    // A forward that fails after it began (more tokens than the layer holds) also retires the
    // last forward's token: the workspace may no longer hold that pass.
    let Caller { tokens, experts, shared, dy, y, dx, d_topk_weights, dw, .. } = &mut caller;
    let inputs = inputs_of(tokens, experts, shared);
    let token = layer.forward_token(&gpu, &inputs, y.into()).unwrap();
    let h = layer.config().hidden;
    let too_many = DeviceBuffer::<bf16>::alloc(&gpu, inputs.tokens.x.len() + h).unwrap();
    let mut too_many_y = DeviceBuffer::<bf16>::alloc(&gpu, inputs.tokens.x.len() + h).unwrap();
    let mut failing = inputs;
    failing.tokens.x = (&too_many).into();
    match layer.forward_token(&gpu, &failing, (&mut too_many_y).into()) {
        Err(MokError::InvalidInput { tensor: "x", .. }) => {}
        other => panic!("T above the capacity must be refused on x, got {:?}", other.map(|_| "a token")),
    }
    let grads = bf16_grads(&mut *dx, &mut *d_topk_weights, dw);
    match layer.backward(&gpu, token, &inputs, (&*dy).into(), grads) {
        Err(MokError::InvalidInput { tensor: "pass token", problem }) => {
            println!("  after a failed forward: {problem}")
        }
        other => panic!("the token of the forward before a failed one must be refused, got {other:?}"),
    }
}

#[test]
fn a_moe_layer_ring_too_small_is_a_reported_capacity_error_then_a_right_step() {
    // `LayerOptions::ring_rows` sizes the receive rings of a layer over ranks: a routing that
    // overflows one is `MokError::Capacity` from `check` (the rows needed, above the ring's),
    // the layer's next step with a routing that fits is right, on every backend over ranks.
    let gpu = gpu();
    // The whole problem (the views), one GPU; the layer over 2 ranks takes T / 2 per rank.
    let global = MoeConfig { shared_intermediate: None, ..config() };
    let c = MoeConfig { ep_ranks: 2, tokens_per_rank: global.tokens_per_rank / 2, ..global.clone() };
    // Every token's slots on experts 0..k (rank 0's): rank 0's ring needs all T · k slots.
    let mut hot = random_case(&global, 706, Routing { drop_probability: 0.0, empty_experts: &[] });
    assert!(global.top_k <= global.num_experts / 2);
    for token in hot.tokens.topk_ids.chunks_mut(global.top_k) {
        token.iter_mut().enumerate().for_each(|(j, id)| *id = j as i32);
    }
    let fitting = random_case(&global, 707, Routing { drop_probability: 0.0, empty_experts: &[] });
    // Room for a random routing's share (about T · k / 2 rows), not for every slot.
    let ring = global.tokens_per_rank * global.top_k * 3 / 4;
    let mut backends = vec![Backend::MmaSync];
    if Backend::fastest_for(&gpu, 2) == Backend::Megakernel {
        backends.insert(0, Backend::Megakernel);
    } else {
        assert_ne!(gpu.compute_capability().0, 9, "an sm_90 GPU must run the megakernels over 2 ranks");
        println!("  NOT RUN on the megakernels (they need sm_90a): mma.sync only on this GPU");
    }
    for backend in backends {
        let options = LayerOptions { backend: Some(backend), ring_rows: Some(ring), ..Default::default() };
        let mut layer = MoeLayer::new(&gpu, c.clone(), options).unwrap();
        let mut caller = Caller::new(&gpu, &hot);
        let Caller { tokens, experts, shared, y, .. } = &mut caller;
        drop(layer.forward(&gpu, &inputs_of(tokens, experts, shared), y.into()).unwrap());
        match layer.check() {
            Err(MokError::Capacity { needed, capacity, .. }) => {
                assert!(needed > capacity && capacity == ring, "{backend:?}: needed {needed}, capacity {capacity}");
                println!("  {backend:?}: ring of {ring} rows: Capacity, {needed} needed");
            }
            other => panic!("{backend:?}: expected a capacity error, got {other:?}"),
        }
        // A routing that fits: the one-GPU layer's bits.
        let mut one = MoeLayer::new(&gpu, global.clone(), LayerOptions::default()).unwrap();
        let mut reference = Caller::new(&gpu, &fitting);
        step(&gpu, &mut one, &mut reference, false);
        let mut again = Caller::new(&gpu, &fitting);
        step(&gpu, &mut layer, &mut again, false);
        // No shared expert: every output, the routed weight gradients included, is bitwise
        // the one GPU's.
        assert_eq!(outputs(&again), outputs(&reference), "{backend:?}: y, dx, d_topk_weights, weight gradients after");
    }
}

#[test]
fn moe_layer_over_virtual_ranks_gives_the_one_gpu_bits() {
    // The same views (the whole problem) through a layer over P virtual ranks, on the
    // megakernel and on mma.sync: y, dx, d_topk_weights and the routed weight gradients (fresh
    // and added into f32) are the one-GPU layer's bits; the shared expert's f32 gradient is a
    // sum over ranks (close, and the same bits every run).
    let gpu = gpu();
    let ranks = common::sized("rank counts", vec![2, 3, 4, 8], vec![2]);
    let mut backends = vec![Backend::MmaSync];
    if Backend::fastest_for(&gpu, 2) == Backend::Megakernel {
        backends.insert(0, Backend::Megakernel);
    } else {
        assert_ne!(gpu.compute_capability().0, 9, "an sm_90 GPU must run the megakernels over 2 ranks");
        println!("  NOT RUN on the megakernels (they need sm_90a): mma.sync only on this GPU");
    }
    for with_shared in [false, true] {
        let c = MoeConfig {
            shared_intermediate: with_shared.then_some(64),
            swiglu_limit: Some(2.0),
            ..MoeConfig::new(240, 136, 96, 24, 4)
        };
        let case = random_case(&c, 710 + with_shared as u64, Routing { drop_probability: 0.1, empty_experts: &[7] });
        let on = |backend| LayerOptions { backend: Some(backend), ..Default::default() };
        // Fresh bf16 gradients (not with a shared expert across ranks), then added into f32.
        let run = |layer: &mut MoeLayer| {
            let mut caller = Caller::new(&gpu, &case);
            if !with_shared {
                step(&gpu, layer, &mut caller, false);
            }
            step(&gpu, layer, &mut caller, true);
            let main: Vec<Vec<f32>> = caller.main_grads.iter().map(|b| b.download().unwrap()).collect();
            // With a shared expert no step wrote fresh gradients: y, dx and d_topk_weights only.
            let mut prints = outputs(&caller);
            if with_shared {
                prints.truncate(3);
            }
            (prints, main)
        };
        let mut one = MoeLayer::new(&gpu, c.clone(), on(Backend::MmaSync)).unwrap();
        let (want, want_main) = run(&mut one);
        for &p in &ranks {
            for &backend in &backends {
                let config = MoeConfig { ep_ranks: p, tokens_per_rank: c.tokens_per_rank / p, ..c.clone() };
                let mut layer = MoeLayer::new(&gpu, config, on(backend)).unwrap();
                let (got, main) = run(&mut layer);
                let what = format!("P = {p}, {backend:?}, shared expert {with_shared}");
                assert_eq!(
                    got, want,
                    "{what}: y, dx, d_topk_weights (and without a shared expert the fresh gradients)"
                );
                for (n, (g, w)) in main.iter().zip(&want_main).enumerate().take(3) {
                    assert!(g.iter().map(|v| v.to_bits()).eq(w.iter().map(|v| v.to_bits())), "{what}: f32 grad {n}");
                }
                for (n, (g, w)) in main.iter().zip(&want_main).enumerate().skip(3) {
                    let w64: Vec<f64> = w.iter().map(|&v| v as f64).collect();
                    let error = common::rel_err(g, &w64);
                    assert!(error < 1e-2, "{what}: shared f32 grad {n}: rel err {error:e}");
                }
                let (again, again_main) = run(&mut layer);
                assert_eq!(again, got, "{what}: a second run");
                assert!(
                    again_main.iter().flatten().map(|v| v.to_bits()).eq(main.iter().flatten().map(|v| v.to_bits()))
                );
                println!("  {what}: the one-GPU bits (shared f32 gradient within 1e-2, bitwise the same twice)");
            }
        }
        // What the layer over ranks refuses: fresh bf16 shared gradients, and a token count
        // other than P · T.
        let config = MoeConfig { ep_ranks: 2, tokens_per_rank: c.tokens_per_rank / 2, ..c.clone() };
        let mut layer = MoeLayer::new(&gpu, config, on(backends[0])).unwrap();
        let mut caller = Caller::new(&gpu, &case);
        let Caller { tokens, experts, shared, dy, y, dx, d_topk_weights, dw, .. } = &mut caller;
        let inputs = inputs_of(tokens, experts, shared);
        let mut short = inputs;
        short.tokens.x = inputs.tokens.x.sub(0, inputs.tokens.x.len() - c.hidden).unwrap();
        let mut y_view = DeviceSliceMut::from(&mut *y);
        let y_short = y_view.sub_mut(0, short.tokens.x.len()).unwrap();
        match layer.forward(&gpu, &short, y_short) {
            Err(MokError::InvalidInput { tensor, problem }) => println!("  {tensor}: {problem}"),
            other => panic!("239 tokens over 2 ranks of 120: expected InvalidInput, got {:?}", other.err()),
        }
        if with_shared {
            let pass = layer.forward(&gpu, &inputs, y.into()).unwrap();
            let grads = bf16_grads(dx, d_topk_weights, dw);
            match pass.backward(&gpu, &inputs, (&*dy).into(), grads) {
                Err(MokError::InvalidInput { tensor: "shared expert gradients", problem }) => println!("  {problem}"),
                other => panic!("fresh bf16 shared gradients over ranks: expected InvalidInput, got {other:?}"),
            }
        }
        layer.check().unwrap();
    }
}

#[test]
fn the_shipped_cubin_loads_and_gives_the_ptx_jit_bits() {
    // `open_gpu` loads ptxas's cubin (no JIT) where the driver takes it; the PTX through the
    // driver's JIT must give the same bits on every backend, since a driver older than the
    // cubin's ptxas falls back to it.
    use mok::driver::LoadedKernels;
    assert!(
        !mok::CUBIN_SM90A.is_empty(),
        "this build embeds no cubin (a kernel build without MOK_PTXAS): build from the shipped files or with ptxas"
    );
    let cubin_gpu = gpu();
    let mut driver_version = 0;
    // SAFETY: a plain query into a local; the driver was initialised by `open_gpu`.
    let status = unsafe { mok::cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) };
    assert_eq!(status, mok::cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    let loaded = cubin_gpu.loaded_kernels().clone();
    println!("  driver {driver_version}, {:?}: {loaded:?}", cubin_gpu.compute_capability());
    let cubin_applies =
        mok::KERNEL_IMAGES.iter().any(|image| image.compute_capability == cubin_gpu.compute_capability());
    if cubin_applies && driver_version >= 13000 {
        assert_eq!(loaded, LoadedKernels::Cubin, "a CUDA 13 driver must take the CUDA 13.0 ptxas's cubin");
    }
    let jit_gpu = mok::open_gpu_jit(0).unwrap();
    assert_eq!(jit_gpu.loaded_kernels(), &LoadedKernels::Ptx { cubin_refused: None });
    let c = config();
    let case = random_case(&c, 720, Routing { drop_probability: 0.05, empty_experts: &[5] });
    for backend in [Backend::MmaSync, Backend::Engine, Backend::Megakernel] {
        let options = LayerOptions { backend: Some(backend), ..LayerOptions::default() };
        let run = |gpu: &Gpu| -> Option<Vec<u64>> {
            let mut layer = MoeLayer::new(gpu, c.clone(), options.clone()).ok()?;
            let mut caller = Caller::new(gpu, &case);
            step(gpu, &mut layer, &mut caller, false);
            Some(outputs(&caller))
        };
        let Some(from_cubin) = run(&cubin_gpu) else {
            assert_ne!(cubin_gpu.compute_capability().0, 9, "an sm_90 GPU must run {backend:?}");
            println!("  NOT RUN on {backend:?}: not on this GPU");
            continue;
        };
        let from_ptx = run(&jit_gpu).expect("the same backend over the JIT-compiled PTX");
        assert_eq!(from_cubin, from_ptx, "{backend:?}: the cubin's bits differ from the PTX's");
        println!("  {backend:?}: the cubin's bits are the PTX JIT's (y, dx, d_topk_weights, weight gradients)");
    }
}

#[test]
fn moe_layer_given_alternating_buffers_gives_each_step_its_own_bits() {
    // An optimizer that hands the layer new weight and gradient buffers every step usually
    // alternates between two sets; the layer keeps the plans of the set before the current one.
    // Two problems with different weights, inputs and gradient buffers, run alternately on one
    // layer (outputs poisoned before each step), must each give a fresh layer's bits every time.
    // Also over P = 2 virtual ranks (no shared expert there: its fresh bf16 gradient is refused
    // across ranks), where the layer builds its plans and passes again for other buffers.
    let gpu = gpu();
    let routing = Routing { drop_probability: 0.05, empty_experts: &[2] };
    let one_gpu = config();
    let two_ranks = MoeConfig { ep_ranks: 2, tokens_per_rank: 200, shared_intermediate: None, ..config() };
    let runs = [
        (one_gpu.clone(), Backend::Engine),
        (one_gpu.clone(), Backend::Megakernel),
        (one_gpu, Backend::MmaSync),
        (two_ranks.clone(), Backend::Megakernel),
        (two_ranks, Backend::MmaSync),
    ];
    for (c, backend) in runs {
        let whole = MoeConfig { ep_ranks: 1, tokens_per_rank: c.tokens_per_rank * c.ep_ranks, ..c.clone() };
        let cases = [random_case(&whole, 730, routing), random_case(&whole, 731, routing)];
        let options = LayerOptions { backend: Some(backend), ..LayerOptions::default() };
        let mut layer = match MoeLayer::new(&gpu, c.clone(), options.clone()) {
            Ok(layer) => layer,
            Err(e) => {
                // mma.sync runs on every GPU mok supports; the others need sm_90a.
                assert!(backend != Backend::MmaSync && gpu.compute_capability().0 != 9, "{backend:?}: {e}");
                println!("  NOT RUN at P = {} on {backend:?}: not on this GPU ({e})", c.ep_ranks);
                continue;
            }
        };
        let expected: Vec<Vec<u64>> = cases
            .iter()
            .map(|case| {
                let mut fresh = MoeLayer::new(&gpu, c.clone(), options.clone()).unwrap();
                let mut caller = Caller::new(&gpu, case);
                step(&gpu, &mut fresh, &mut caller, false);
                outputs(&caller)
            })
            .collect();
        assert_ne!(expected[0], expected[1], "the two problems must differ");
        let mut callers = [Caller::new(&gpu, &cases[0]), Caller::new(&gpu, &cases[1])];
        for round in 0..3 {
            for (n, caller) in callers.iter_mut().enumerate() {
                caller.poison();
                step(&gpu, &mut layer, caller, false);
                assert_eq!(outputs(caller), expected[n], "P = {}, {backend:?}: round {round}, buffers {n}", c.ep_ranks);
            }
        }
        println!(
            "  P = {}, {backend:?}: two buffer sets alternated three times, each step a fresh layer's bits",
            c.ep_ranks
        );
    }
}
