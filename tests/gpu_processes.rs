//! GPU test of the layer across processes (feature `gpu-tests`): two, three and four processes,
//! one rank each, through `SymmetricHeap::multi_process` and `MoeLayer::with_heap` — the path a
//! job with one process per GPU takes — here with every process on the test machine's one GPU.
//!
//! Each process `cuMemCreate`s its heap slice with a POSIX-fd handle, exports it, duplicates the
//! others' descriptors with `pidfd_getfd`, imports and maps them; its kernels then read and write the
//! others' slices and wait on their signals at system scope. The processes' contexts
//! share the GPU by time slicing, so every wait across ranks is a wait across contexts, as it is
//! across GPUs. What this cannot show: NVLink, several GPUs, and the NCCL all-gather of the
//! handle records (NCCL refuses two ranks on one GPU), which here goes through files
//! (`symmetric::rendezvous::FileRendezvous`).
//!
//! The parent tests start the ranks as child processes of this binary (the ignored test
//! [`one_rank_of_the_layer_across_processes`], with torchrun's variables), and compare what they
//! wrote with the one-GPU layer's bits. One of them first has a peer that stalls (before its pass,
//! or between its forward and its backward): the others must report a timeout naming it, then
//! rebuilt layers must give the right bits. A heap asked for another layer's layout is refused.
#![cfg(feature = "gpu-tests")]

mod common;

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::{Case, Routing, grad_views, random_case, rank_config, share, split_weights};
use half::bf16;
use mok::driver::vmm::ShareableKind;
use mok::driver::{DeviceBuffer, Gpu};
use mok::exchange::{Exchange, ExchangeOptions};
use mok::megakernel::MegakernelOptions;
use mok::moe::{Backend, LayerOptions, MoeGradients, MoeInputs};
use mok::problem::RoutedTokens;
use mok::symmetric::rendezvous::FileRendezvous;
use mok::symmetric::{LaunchEnv, SymmetricHeap};
use mok::unfused::{DeviceExperts, DeviceSharedExpert, DeviceTokens, WeightGradTarget};
use mok::{MoeConfig, MoeLayer, MokError};

/// Process counts (one rank each) the test runs; the cases' T and E split evenly over each.
const WORLDS: [usize; 3] = [2, 3, 4];
/// The child test's name, and the variables through which the parent tells it what to run.
const CHILD_TEST: &str = "one_rank_of_the_layer_across_processes";
const DIR_VAR: &str = "MOK_PROCESS_TEST_DIR";
const CASE_VAR: &str = "MOK_PROCESS_TEST_CASE";
const BACKEND_VAR: &str = "MOK_PROCESS_TEST_BACKEND";
const FAULT_VAR: &str = "MOK_PROCESS_TEST_FAULT";
/// How long the parent waits for all its ranks, and a rank for the others' handle records.
const CHILDREN_DEADLINE: Duration = Duration::from_secs(300);
const GATHER_DEADLINE: Duration = Duration::from_secs(120);
/// The megakernel's and the exchange's wait deadline in the ranks: the other processes' kernels
/// run only in their time slices, and the processes start their passes up to seconds apart.
const WAIT_DEADLINE: Duration = Duration::from_secs(60);

fn gpu() -> Gpu {
    mok::open_gpu(0).unwrap_or_else(|e| {
        panic!("GPU tests need an NVIDIA Hopper or Blackwell GPU with its driver; this machine: {e}")
    })
}

/// Cases the tests run ([`case`]).
const CASES: usize = 2;

/// Whole problem `n` over all the ranks: 0 a ragged one with a shared expert, the SwiGLU limit,
/// dropped slots and an empty expert; 1 one whose groups span several 128-row tiles. Its
/// `alternate` has the same shapes and other values (tokens, routing, weights, dy): the ranks
/// run it between two steps of the case, so a step that read anything a previous step left
/// behind (a counter, a ring row, a flag) would give other bits, which identical steps hide.
fn case(n: usize, alternate: bool) -> Case {
    let seed = 740 + n as u64 + if alternate { 100 } else { 0 };
    match n {
        0 => random_case(
            &MoeConfig {
                shared_intermediate: Some(64),
                swiglu_limit: Some(2.0),
                ..MoeConfig::new(240, 136, 96, 24, 4)
            },
            seed,
            Routing { drop_probability: 0.1, empty_experts: if alternate { &[2, 19] } else { &[7] } },
        ),
        1 => random_case(
            &MoeConfig::new(1200, 256, 128, 12, 2),
            seed,
            Routing { drop_probability: 0.0, empty_experts: &[] },
        ),
        _ => panic!("case {n}: there are {CASES}"),
    }
}

/// The names a rank writes the outputs of a case's step (`""`) or of its alternate's under.
const STEP_PREFIXES: [&str; 2] = ["", "alternate-"];

fn backend_name(backend: Backend) -> &'static str {
    match backend {
        Backend::Megakernel => "megakernel",
        Backend::ForwardMegakernel => "forward-megakernel",
        Backend::Engine => "engine",
        Backend::MmaSync => "mma",
    }
}

/// Outputs of one step, in order: y, dx, d_topk_weights (their bytes), then the routed weight
/// gradients and the shared expert's, added into zeroed f32 buffers.
struct Outputs {
    rows: [Vec<u8>; 3],
    grads: Vec<Vec<f32>>,
    /// Kernels the forward and the backward launched.
    launches: (u64, u64),
}

const ROW_NAMES: [&str; 3] = ["y", "dx", "d_topk_weights"];

/// Zeroed f32 main gradients for `experts` (gate, up, down) and `shared`'s three.
fn zeroed_grads(gpu: &Gpu, experts: &DeviceExperts, shared: Option<&DeviceSharedExpert>) -> Vec<DeviceBuffer<f32>> {
    let mut sizes = vec![experts.w_gate.len(); 3];
    if let Some(s) = shared {
        sizes.extend([s.ws_gate.len(); 3]);
    }
    sizes.iter().map(|&n| DeviceBuffer::from_slice(gpu, &vec![0.0f32; n]).unwrap()).collect()
}

/// One forward + backward of `layer` over the inputs in `tokens` (tokens, dy), `experts` and
/// `shared`, into poisoned outputs and zeroed f32 gradients.
fn step(
    gpu: &Gpu,
    layer: &mut MoeLayer,
    config: &MoeConfig,
    (tokens, dy): (&DeviceTokens, &DeviceBuffer<bf16>),
    experts: &DeviceExperts,
    shared: Option<&DeviceSharedExpert>,
) -> Outputs {
    let (t, h, k) = (dy.len() / config.hidden, config.hidden, config.top_k);
    let poisoned = |n| {
        let mut b = DeviceBuffer::<bf16>::alloc(gpu, n).unwrap();
        b.fill_bytes(0xff).unwrap();
        b
    };
    let (mut y, mut dx) = (poisoned(t * h), poisoned(t * h));
    let mut d_topk = DeviceBuffer::from_slice(gpu, &vec![f32::NAN; t * k]).unwrap();
    let mut main = zeroed_grads(gpu, experts, shared);
    let inputs = MoeInputs { tokens: tokens.into(), experts: experts.into(), shared: shared.map(Into::into) };
    let before = gpu.kernel_launches();
    let pass = layer.forward(gpu, &inputs, (&mut y).into()).unwrap();
    let forward_launches = gpu.kernel_launches() - before;
    let grads = MoeGradients {
        dx: (&mut dx).into(),
        d_topk_weights: (&mut d_topk).into(),
        weights: WeightGradTarget::AccumulateF32(grad_views(&mut main)),
    };
    pass.backward(gpu, &inputs, dy.into(), grads).unwrap();
    let launches = (forward_launches, gpu.kernel_launches() - before - forward_launches);
    layer.check().unwrap();
    let bytes_of = |b: &DeviceBuffer<bf16>| bytemuck::cast_slice(&b.download().unwrap()).to_vec();
    Outputs {
        rows: [bytes_of(&y), bytes_of(&dx), bytemuck::cast_slice(&d_topk.download().unwrap()).to_vec()],
        grads: main.iter().map(|b| b.download().unwrap()).collect(),
        launches,
    }
}

fn output_path(dir: &Path, rank: usize, name: &str) -> PathBuf {
    dir.join(format!("rank{rank}-{name}.bin"))
}

/// A fault the last rank plays before the ranks run the case: it builds its heap and layer like
/// the others, then stalls (a peer process that hung or died).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    /// It never runs its pass: the others' forward waits on its publish.
    NoPass,
    /// It runs its forward but never its backward: the others' backward waits on its publish.
    NoBackward,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::NoPass => "no-pass",
            Fault::NoBackward => "no-backward",
        }
    }
}

/// What the parent tells a rank: where to write, which case and backend, and the fault the last
/// rank plays first, if any.
struct RankTask {
    dir: PathBuf,
    case: usize,
    backend: Backend,
    fault: Option<Fault>,
}

impl RankTask {
    fn from_env() -> Self {
        let var = |name: &str| {
            std::env::var(name).unwrap_or_else(|_| panic!("{name} unset: this test is one rank, run by a parent test"))
        };
        let backend = match var(BACKEND_VAR).as_str() {
            "megakernel" => Backend::Megakernel,
            "mma" => Backend::MmaSync,
            other => panic!("{BACKEND_VAR}={other}"),
        };
        let fault = std::env::var(FAULT_VAR).ok().map(|f| match f.as_str() {
            "no-pass" => Fault::NoPass,
            "no-backward" => Fault::NoBackward,
            other => panic!("{FAULT_VAR}={other}"),
        });
        RankTask { dir: PathBuf::from(var(DIR_VAR)), case: var(CASE_VAR).parse().unwrap(), backend, fault }
    }
}

/// A rank's layer over a fresh multi-process heap (its slice exported, the peers' imported).
fn rank_layer(
    gpu: &Gpu,
    env: &LaunchEnv,
    config: &MoeConfig,
    backend: Backend,
    deadline: Duration,
    gather: &mut FileRendezvous,
) -> MoeLayer {
    let request = Exchange::heap_request(config, &ExchangeOptions::default()).unwrap();
    let heap =
        SymmetricHeap::multi_process(gpu, env, 0, request, ShareableKind::PosixFd, &mut |mine| gather.all_gather(mine))
            .unwrap();
    assert_eq!(heap.local_ranks(), [env.rank]);
    let options = LayerOptions {
        backend: Some(backend),
        megakernel: MegakernelOptions { timeout: deadline, ..MegakernelOptions::default() },
        ..LayerOptions::default()
    };
    MoeLayer::with_heap(gpu, config.clone(), options, heap).unwrap()
}

/// A rank's share of a case on the device: its T tokens and their dy, its E/P experts, the
/// whole shared expert.
struct RankInputs {
    tokens: DeviceTokens,
    dy: DeviceBuffer<bf16>,
    experts: DeviceExperts,
    shared: Option<DeviceSharedExpert>,
}

impl RankInputs {
    fn upload(gpu: &Gpu, config: &MoeConfig, case: &Case, (rank, world): (usize, usize)) -> Self {
        let (h, k) = (config.hidden, config.top_k);
        let tokens = RoutedTokens {
            x: share(&case.tokens.x, world, rank, h),
            topk_ids: share(&case.tokens.topk_ids, world, rank, k),
            topk_weights: share(&case.tokens.topk_weights, world, rank, k),
        };
        RankInputs {
            tokens: DeviceTokens::upload(gpu, config, &tokens).unwrap(),
            dy: DeviceBuffer::from_slice(gpu, &share(&case.dy, world, rank, h)).unwrap(),
            experts: DeviceExperts::upload(gpu, config, &split_weights(&case.experts, world)[rank]).unwrap(),
            shared: case.shared.as_ref().map(|s| DeviceSharedExpert::upload(gpu, config, s).unwrap()),
        }
    }

    fn step(&self, gpu: &Gpu, layer: &mut MoeLayer, config: &MoeConfig) -> Outputs {
        step(gpu, layer, config, (&self.tokens, &self.dy), &self.experts, self.shared.as_ref())
    }
}

/// The fault: the last rank stalls where `fault` says. Every other rank's pass must come back
/// from `check` as a timeout naming it, waiting for its publish, within twice the deadline.
fn stalled_peer(
    gpu: &Gpu,
    env: &LaunchEnv,
    (config, inputs): (&MoeConfig, &RankInputs),
    (backend, fault): (Backend, Fault),
    gather: &mut FileRendezvous,
) {
    // `NoBackward` needs its forward whole on every rank first: the first pass of fresh
    // processes taking turns on the GPU, so a longer deadline than a wait that must fail alone.
    let deadline = match fault {
        Fault::NoPass => Duration::from_millis(common::sized("fault deadline (ms)", 500, 5000)),
        Fault::NoBackward => Duration::from_millis(common::sized("fault deadline (ms)", 2000, 30000)),
    };
    let mut layer = rank_layer(gpu, env, config, backend, deadline, gather);
    let stalled = env.world - 1;
    let view = MoeInputs {
        tokens: (&inputs.tokens).into(),
        experts: (&inputs.experts).into(),
        shared: inputs.shared.as_ref().map(Into::into),
    };
    let mut y = DeviceBuffer::<bf16>::alloc(gpu, inputs.dy.len()).unwrap();
    // With `NoBackward` every rank's forward is whole first; then the stalled rank stops. The
    // ranks start the forward together, and no backward starts before every rank has checked
    // its forward (a check reads the peers' records: a backward's timeout recorded by then
    // would void the forward's check).
    let token = (fault == Fault::NoBackward).then(|| {
        gather.all_gather(&[1]).unwrap();
        let token = layer.forward_token(gpu, &view, (&mut y).into()).unwrap();
        layer.check().unwrap();
        gather.all_gather(&[1]).unwrap();
        token
    });
    if env.rank != stalled {
        let start = Instant::now();
        match token {
            None => drop(layer.forward(gpu, &view, (&mut y).into()).unwrap()),
            Some(token) => {
                let t = inputs.dy.len() / config.hidden;
                let mut dx = DeviceBuffer::<bf16>::alloc(gpu, t * config.hidden).unwrap();
                let mut d_topk = DeviceBuffer::<f32>::alloc(gpu, t * config.top_k).unwrap();
                let mut main = zeroed_grads(gpu, &inputs.experts, inputs.shared.as_ref());
                let grads = MoeGradients {
                    dx: (&mut dx).into(),
                    d_topk_weights: (&mut d_topk).into(),
                    weights: WeightGradTarget::AccumulateF32(grad_views(&mut main)),
                };
                layer.backward(gpu, token, &view, (&inputs.dy).into(), grads).unwrap();
            }
        }
        let error = layer.check().unwrap_err();
        let took = start.elapsed();
        match &error {
            MokError::Timeout { peer, waited_for, .. } => {
                assert_eq!(*peer, Some(stalled), "the timeout must name the stalled rank: {error}");
                assert!(waited_for.contains("publish"), "{error}");
            }
            other => panic!("rank {}: expected a timeout naming rank {stalled}, got {other:?}", env.rank),
        }
        let slack = Duration::from_millis(common::sized("fault slack (ms)", 100, 4000));
        assert!(took < 2 * deadline + slack, "rank {}: reported after {took:?}", env.rank);
        println!(
            "rank {}: rank {stalled} stalled ({}): {error} (after {took:?}); layers rebuilt",
            env.rank,
            fault.name()
        );
    }
    // Every rank is done with the faulted layers before any frees its slice; after an error
    // every rank's layer is rebuilt (a reset across processes is collective).
    gather.all_gather(&[1]).unwrap();
    drop(layer);
}

#[test]
#[ignore = "one rank of the tests across processes, which run it in child processes"]
fn one_rank_of_the_layer_across_processes() {
    let task = RankTask::from_env();
    let env = LaunchEnv::from_env().unwrap();
    let (rank, world, backend, dir) = (env.rank, env.world, task.backend, &task.dir);
    let gpu = gpu();
    let config = rank_config(&case(task.case, false).config, world);
    let [inputs, alternate] =
        [false, true].map(|alternate| RankInputs::upload(&gpu, &config, &case(task.case, alternate), (rank, world)));
    let mut gather = FileRendezvous::new(dir, &env, GATHER_DEADLINE).unwrap();
    if let Some(fault) = task.fault {
        stalled_peer(&gpu, &env, (&config, &inputs), (backend, fault), &mut gather);
    }

    // The case, its alternate, the case again on one layer: the third step must give the
    // first's bits.
    let mut layer = rank_layer(&gpu, &env, &config, backend, WAIT_DEADLINE, &mut gather);
    let first = inputs.step(&gpu, &mut layer, &config);
    let between = alternate.step(&gpu, &mut layer, &config);
    let again = inputs.step(&gpu, &mut layer, &config);
    assert!(first.rows == again.rows, "rank {rank}: y, dx or d_topk_weights differ between two steps of one case");
    let bits = |g: &[Vec<f32>]| g.iter().flatten().map(|v| v.to_bits()).collect::<Vec<u32>>();
    assert!(bits(&first.grads) == bits(&again.grads), "rank {rank}: weight gradients differ between two steps");

    for (prefix, outputs) in STEP_PREFIXES.iter().zip([&first, &between]) {
        for (name, bytes) in ROW_NAMES.iter().zip(&outputs.rows) {
            std::fs::write(output_path(dir, rank, &format!("{prefix}{name}")), bytes).unwrap();
        }
        for (n, grad) in outputs.grads.iter().enumerate() {
            std::fs::write(output_path(dir, rank, &format!("{prefix}grad{n}")), bytemuck::cast_slice(grad)).unwrap();
        }
    }
    // No process frees its slice while another may still read it.
    gather.all_gather(&[1]).unwrap();
    drop(layer);
    let (forward, backward) = first.launches;
    println!(
        "rank {rank} of {world} ({backend:?}): the case, its alternate, the case: the same bits twice; \
         {forward} kernels per forward, {backward} per backward; outputs written"
    );
}

/// Waits for every child up to the deadline (killing them all past it); panics with the logs of
/// any that failed.
fn wait_for(children: Vec<Child>, logs: &[PathBuf], what: &str) {
    let start = Instant::now();
    let mut children: Vec<(Child, Option<std::process::ExitStatus>)> =
        children.into_iter().map(|c| (c, None)).collect();
    while children.iter().any(|(_, status)| status.is_none()) {
        for (child, status) in &mut children {
            if status.is_none() {
                *status = child.try_wait().unwrap();
            }
        }
        if start.elapsed() > CHILDREN_DEADLINE {
            for (child, status) in &mut children {
                if status.is_none() {
                    let _ = child.kill();
                    *status = child.wait().ok();
                }
            }
            let logs: Vec<String> = logs.iter().map(|p| std::fs::read_to_string(p).unwrap_or_default()).collect();
            panic!(
                "{what}: the ranks did not finish within {CHILDREN_DEADLINE:?}; their output:\n{}",
                logs.join("\n---\n")
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for (rank, ((_, status), log)) in children.iter().zip(logs).enumerate() {
        let output = std::fs::read_to_string(log).unwrap_or_default();
        assert!(status.is_some_and(|s| s.success()), "{what}: rank {rank} failed ({status:?}); its output:\n{output}");
        // The rank's summary line, and anything compute-sanitizer printed into its output: under
        // `run.sh --sanitize` the tool follows the children (`--target-processes all`) and their
        // reports reach the parent's log, where run.sh counts them (docs/TESTING.md). Written
        // straight to stdout, past the harness's capture.
        let kept: String = output
            .lines()
            .filter(|l| l.starts_with("=========") || l.contains("outputs written") || l.contains(" stalled ("))
            .map(|l| format!("    rank {rank}: {l}\n"))
            .collect();
        std::io::stdout().write_all(kept.as_bytes()).unwrap();
    }
}

/// The backends that run over ranks on this GPU (the megakernel needs sm_90a: said if not).
fn rank_backends(gpu: &Gpu) -> Vec<Backend> {
    let mut backends = vec![Backend::MmaSync];
    if Backend::fastest_for(gpu, 2) == Backend::Megakernel {
        backends.insert(0, Backend::Megakernel);
    } else {
        assert_ne!(gpu.compute_capability().0, 9, "an sm_90 GPU must run the megakernels over 2 ranks");
        println!("  NOT RUN on the megakernels: they need sm_90a; mma.sync only on this GPU");
    }
    backends
}

/// The one-GPU `mma.sync` layer's outputs over the whole case.
fn one_gpu_outputs(gpu: &Gpu, case: &Case) -> Outputs {
    let c = &case.config;
    let mut one =
        MoeLayer::new(gpu, c.clone(), LayerOptions { backend: Some(Backend::MmaSync), ..Default::default() }).unwrap();
    let tokens = DeviceTokens::upload(gpu, c, &case.tokens).unwrap();
    let dy = DeviceBuffer::from_slice(gpu, &case.dy).unwrap();
    let experts = DeviceExperts::upload(gpu, c, &case.experts).unwrap();
    let shared = case.shared.as_ref().map(|s| DeviceSharedExpert::upload(gpu, c, s).unwrap());
    step(gpu, &mut one, c, (&tokens, &dy), &experts, shared.as_ref())
}

/// Runs case `n` over `world` child processes on `backend` (the last rank first playing the
/// stalled peer of `fault` first), and holds what the ranks wrote for the case and for its
/// alternate to `want` (the one-GPU outputs of each): y, dx, d_topk_weights and the routed f32
/// weight gradients bitwise; the shared expert's f32 gradient, which each rank holds for its own
/// tokens (the data-parallel all-reduce sums them), summed over the ranks within 1e-2.
fn run_ranks(n: usize, want: &[Outputs; 2], (backend, world): (Backend, usize), fault: Option<Fault>) {
    let faulted = fault.map_or(String::new(), |f| format!(" after a stalled peer ({})", f.name()));
    let tokens = case(n, false).config.tokens_per_rank;
    let what = format!("case {n} (T = {tokens} over {world} processes), {backend:?}{faulted}");
    let dir = std::env::temp_dir().join(format!(
        "mok-processes-{}-{n}-{}-{world}-{}",
        std::process::id(),
        backend_name(backend),
        fault.map_or("none", Fault::name)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let logs: Vec<PathBuf> = (0..world).map(|rank| dir.join(format!("rank{rank}.log"))).collect();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<Child> = (0..world)
        .map(|rank| {
            let log = File::create(&logs[rank]).unwrap();
            let mut command = Command::new(&exe);
            command
                .args(["--exact", CHILD_TEST, "--ignored", "--nocapture", "--test-threads=1"])
                .env(DIR_VAR, &dir)
                .env(CASE_VAR, n.to_string())
                .env(BACKEND_VAR, backend_name(backend))
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env_remove(FAULT_VAR)
                .stdout(log.try_clone().unwrap())
                .stderr(log);
            if let Some(fault) = fault {
                command.env(FAULT_VAR, fault.name());
            }
            command.spawn().unwrap()
        })
        .collect();
    wait_for(children, &logs, &what);

    let read = |rank: usize, name: &str| std::fs::read(output_path(&dir, rank, name)).unwrap();
    for (prefix, want) in STEP_PREFIXES.iter().zip(want) {
        let step = if prefix.is_empty() { "the case" } else { "its alternate" };
        for (i, name) in ROW_NAMES.iter().enumerate() {
            let got: Vec<u8> = (0..world).flat_map(|rank| read(rank, &format!("{prefix}{name}"))).collect();
            assert!(got == want.rows[i], "{what}, {step}: {name} differs from the one-GPU bits");
        }
        let grad = |rank: usize, g: usize| -> Vec<f32> {
            let bytes = read(rank, &format!("{prefix}grad{g}"));
            bytes.chunks_exact(4).map(|b| f32::from_ne_bytes(b.try_into().unwrap())).collect()
        };
        for g in 0..3 {
            // Rank r holds experts r·E/P ..: its gradients are that slice of the whole.
            let got: Vec<f32> = (0..world).flat_map(|rank| grad(rank, g)).collect();
            assert!(
                got.iter().map(|v| v.to_bits()).eq(want.grads[g].iter().map(|v| v.to_bits())),
                "{what}, {step}: routed f32 weight gradient {g} differs from the one-GPU bits"
            );
        }
        for g in 3..want.grads.len() {
            let parts: Vec<Vec<f32>> = (0..world).map(|rank| grad(rank, g)).collect();
            let summed: Vec<f32> = (0..parts[0].len()).map(|i| parts.iter().map(|p| p[i]).sum()).collect();
            let expected: Vec<f64> = want.grads[g].iter().map(|&v| v as f64).collect();
            let error = common::rel_err(&summed, &expected);
            assert!(
                error < 1e-2,
                "{what}, {step}: the shared expert's f32 gradient {g} summed over the ranks: rel err {error:e}"
            );
        }
    }
    println!(
        "  {what}: the one-GPU bits for the case and its alternate (y, dx, d_topk_weights, routed f32 gradients{})",
        if want[0].grads.len() > 3 { "; the shared expert's gradient summed over the ranks within 1e-2" } else { "" }
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A heap asked for another layer's layout (here: another SwiGLU limit, the same bytes) is
/// refused by the layer, naming the heap; one asked for its own layout is taken. One process, a
/// world of one: the records go round through the closure.
#[test]
fn a_heap_asked_for_another_layout_is_refused() {
    let gpu = gpu();
    let env = LaunchEnv::from_vars(|name| match name {
        "RANK" | "LOCAL_RANK" => Some("0".into()),
        "WORLD_SIZE" => Some("1".into()),
        _ => None,
    })
    .unwrap();
    let config = MoeConfig::new(64, 256, 128, 8, 2);
    let other = MoeConfig { swiglu_limit: Some(7.0), ..config.clone() };
    let options = ExchangeOptions::default();
    let heap_for = |config: &MoeConfig| {
        let request = Exchange::heap_request(config, &options).unwrap();
        let heap =
            SymmetricHeap::multi_process(&gpu, &env, 0, request, ShareableKind::PosixFd, &mut |mine| Ok(mine.to_vec()))
                .unwrap();
        assert_eq!(heap.layout(), request.layout);
        heap
    };
    let layer_options = || LayerOptions { backend: Some(Backend::MmaSync), ..LayerOptions::default() };
    match MoeLayer::with_heap(&gpu, config.clone(), layer_options(), heap_for(&other)) {
        Err(MokError::InvalidInput { tensor: "symmetric heap", problem }) => {
            assert!(problem.contains("Exchange::heap_request"), "{problem}")
        }
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("a heap asked for another layout was taken"),
    }
    MoeLayer::with_heap(&gpu, config.clone(), layer_options(), heap_for(&config)).unwrap();
}

#[test]
fn moe_layer_across_processes_gives_the_one_gpu_bits() {
    // Every case over 2, 3 and 4 processes, on both backends that run over ranks.
    let gpu = gpu();
    let backends = rank_backends(&gpu);
    // Under compute-sanitizer (each process's contexts instrumented and time-sliced on one
    // GPU): the first case over 2 processes.
    let (cases, worlds) = common::sized("(cases, process counts)", (CASES, &WORLDS[..]), (1, &WORLDS[..1]));
    for n in 0..cases {
        let want = [false, true].map(|alternate| one_gpu_outputs(&gpu, &case(n, alternate)));
        for &backend in &backends {
            for &world in worlds {
                run_ranks(n, &want, (backend, world), None);
            }
        }
    }
}

#[test]
fn a_stalled_peer_process_is_a_reported_timeout_then_rebuilt_layers_are_right() {
    // The last process builds its heap and layer but never runs its pass, or runs its forward
    // but never its backward. The others' pass comes back as a timeout naming it within twice
    // the deadline (checked in each rank); then every process builds its layer again and the
    // step gives the one-GPU bits. Over 2 and 3 processes, on both backends.
    let gpu = gpu();
    let n = 0;
    let want = [false, true].map(|alternate| one_gpu_outputs(&gpu, &case(n, alternate)));
    for backend in rank_backends(&gpu) {
        for fault in [Fault::NoPass, Fault::NoBackward] {
            // Under compute-sanitizer: 2 processes.
            for &world in common::sized("stalled-peer process counts", &[2, 3][..], &[2][..]) {
                run_ranks(n, &want, (backend, world), Some(fault));
            }
        }
    }
}
