//! Benchmark of the whole MoE layer (on one GPU, all experts local, or across processes; random
//! top-k routing):
//! mok's unfused path, forward and forward + backward, next to the PyTorch baseline measured in
//! the same device call (`benches/torch_moe.py`, passed with `--baseline FILE`) and the two
//! floors (FLOPs at the measured bf16 matmul rate, minimum bytes at the measured copy rate).
//!
//! `layer [--cases kimi:8192,qwen:32768] [--reps N] [--baseline FILE] [--matmul-tflops R]
//! [--copy-tbps B] [--gemm BACKEND,...]`. Backends, each case run on each in turn: `mma` (the
//! routed experts' GEMMs on the `mma.sync` kernels, the bench's default), `engine` (on the
//! tensor-core engine, sm_90 only), `engine-gathering` (the engine with its gate/up and its gate
//! and up weight gradients gathering the token rows in their producers: no gathered copy of the
//! rows is written; `-gathering-forward`: the gate/up alone, the backward writing the copy for
//! its weight gradients), `megakernel` (the forward as one
//! persistent launch over the engine, with its default comm blocks), `megakernel:N` (N comm
//! blocks) and `megakernels[:N]` (the forward and the backward megakernels; `megakernels:F/B`: F
//! comm blocks in the forward, B in the backward); `megakernel[s][:N]-gathering`
//! has the forward megakernel's gate/up gather its rows in its producers too, and the weight
//! gradients theirs (the engine path's, or the backward megakernel's tiles), and
//! `-gathering-forward` the gate/up alone (one GPU; the forward megakernel's dispatch, by comm
//! blocks and spare warps, then copies only the shared expert's rows). Each
//! table row names its backend. `--ranks P` (P > 1; any P with `--ranks-path`) runs the expert-parallel layer over P virtual ranks on this GPU
//! instead (the tokens of a case split over the ranks), on `mma` (`epP:mma`: the exchange's
//! separate launches, `mma.sync` expert compute), `megakernel[:N]` (`epP:megakernel`: the
//! forward as one launch hosting every rank, N comm blocks per rank) or `megakernels[:N]`
//! (`epP:megakernels`: the backward as one such launch too); `--ring-factor F` sizes each rank's
//! receive ring at F times an even split's rows (default: the worst case), and
//! `--own-rank-tiles` runs each rank's GEMM tiles on its own blocks (`epP:…/own-tiles`; by default
//! every compute block takes every rank's tiles), and `--early-slot-weight-gradients on|off`
//! forces where the backward megakernel computes the slot-weight gradients, one GPU or across
//! ranks (`MegakernelOptions::early_slot_weight_gradients`; `…/slot-weight-gradients-early` or
//! `-late`; by default the option's rule), and `--row-totals on|off` whether it keeps row totals
//! (`MegakernelOptions::row_totals`; `…/row-totals-on` or `-off`; by default the option's rule).
//! `--ranks-path` runs the cases through that
//! layer at any P, P = 1 included (`ep1:…`; on the megakernel backends its ranks kernels: what
//! they cost against the one-GPU kernels, apart from what hosting several ranks on one GPU
//! costs).
//! `--swap-weights` (one GPU) also times steps
//! whose weights alternate between two copies (`MOKSWAP` lines), as under an optimizer that hands
//! the layer new buffers every step. Launched by torchrun or srun with more
//! than one process, it runs the layer across the processes instead, one rank per GPU
//! (`procsP:mma`, `procsP:megakernel` or `procsP:megakernels`, both passes as megakernels hosting
//! the process's rank; rank 0 prints the results). The processes all-gather through NCCL (the
//! `nccl` feature, as the GPU bundle is built), or through files in `MOK_RENDEZVOUS_DIR` when it
//! is set, which also lets processes share one GPU (NCCL refuses that; their timings then mean
//! nothing, as the processes take turns on it; `MOK_BENCH_WAIT_S` then lengthens the waits'
//! deadline, as `run_process_bench.sh` does: the all-gathers' and the layer's; NCCL's too: its
//! communicator is nonblocking and aborted when a wait expires). Neither has run with more than one GPU (no multi-GPU machine has been lent).
//! Every run also prints one `RESULT` line of name–value pairs (what `cargo xtask bench` reads).
//! On one GPU, without a driver or a device it says so and exits 0 (a benchmark is not a test);
//! a GPU that will not open is an error, as is every failure across processes.

use std::collections::HashMap;

use anyhow::{Context, Result, bail};
use mok::driver::Gpu;
use mok::ep::EpLayer;
use mok::exchange::ExchangeOptions;
use mok::megakernel::{MegakernelOptions, MegakernelWork};
use mok::problem::RoutedTokens;
use mok::shapes::{FrontierShape, backward_min_bytes, forward_flops, forward_min_bytes};
use mok::unfused::{DeviceExperts, DeviceTokens, UnfusedLayer, random_bf16};

struct Args {
    cases: Vec<(FrontierShape, usize)>,
    reps: usize,
    baseline: HashMap<(String, usize), (f64, f64)>,
    matmul_tflops: f64,
    copy_tbps: f64,
    /// The backends to run each case on.
    backends: Vec<Backend>,
    /// P > 1 (any P with `ranks_path`): the expert-parallel layer over P virtual ranks on this GPU (the tokens of a case
    /// split evenly over the ranks), on the backends that support it (`mma`, `megakernel`,
    /// `megakernels`).
    ranks: usize,
    /// With ranks: each rank's receive ring holds this many times the rows of an even split
    /// (T/P tokens · k slots); `None`: the exchange's default, the worst case (every slot of
    /// every rank on one rank), which at P = 8 does not fit the largest cases in one GPU.
    ring_factor: Option<f64>,
    /// With ranks: each rank's GEMM tiles on its own blocks (`MegakernelOptions::share_rank_tiles`
    /// false) instead of every compute block taking every rank's tiles.
    own_rank_tiles: bool,
    /// The backward megakernel's choices the flags force (`None`: the options' rules).
    backward_choices: BackwardChoices,
    /// Run the cases through the expert-parallel layer and its ranks kernels even at P = 1
    /// (`--ranks-path`): at P = 1 this separates what the ranks kernels cost against the one-GPU
    /// kernels from what hosting P ranks on one GPU costs.
    ranks_path: bool,
    /// One GPU: also time steps whose weights alternate between two copies (a training
    /// framework whose optimizer hands the layer new buffers), so the layer builds its plans
    /// again every step.
    swap_weights: bool,
}

/// What the flags force of the backward megakernel's options (`None`: the options' rules).
#[derive(Clone, Copy, Debug, Default)]
struct BackwardChoices {
    /// `MegakernelOptions::early_slot_weight_gradients` (`--early-slot-weight-gradients`).
    early_slot_weight_gradients: Option<bool>,
    /// `MegakernelOptions::row_totals` (`--row-totals`).
    row_totals: Option<bool>,
}

impl BackwardChoices {
    /// `options` with these choices.
    fn apply(self, options: MegakernelOptions) -> MegakernelOptions {
        MegakernelOptions {
            early_slot_weight_gradients: self.early_slot_weight_gradients,
            row_totals: self.row_totals,
            ..options
        }
    }
}

impl Args {
    /// Whether the cases run through the expert-parallel layer (P > 1, or `--ranks-path`).
    fn over_ranks(&self) -> bool {
        self.ranks > 1 || self.ranks_path
    }
}

/// How the layer runs (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Backend {
    Mma,
    /// The engine, its producers gathering the token rows or not.
    Engine(Gather),
    /// The forward megakernel with this many comm blocks (`None`: its default).
    Megakernel(Option<u32>, Gather),
    /// The forward and the backward megakernels (one GPU, every virtual rank in one launch, or
    /// across processes the process's rank), with these comm blocks (per rank over ranks).
    Megakernels(Option<PassCommBlocks>, Gather),
}

/// Which producers gather the token rows from x (`UnfusedLayer::set_gather_in_producers`; one
/// GPU) instead of reading a gathered copy.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Gather {
    None,
    /// The gate/up (suffix `-gathering-forward`).
    Forward,
    /// The gate/up and the gate and up weight gradients (suffix `-gathering`).
    Both,
}

impl Backend {
    fn parse(text: &str) -> Result<Self> {
        // A `-gathering[-forward]` suffix: which producers gather their rows.
        let (base, gathering) = match (text.strip_suffix("-gathering"), text.strip_suffix("-gathering-forward")) {
            (Some(base), _) => (base, Gather::Both),
            (_, Some(base)) => (base, Gather::Forward),
            _ => (text, Gather::None),
        };
        Ok(match base {
            "mma" if gathering == Gather::None => Backend::Mma,
            "engine" => Backend::Engine(gathering),
            "megakernel" => Backend::Megakernel(None, gathering),
            "megakernels" => Backend::Megakernels(None, gathering),
            other => match (other.strip_prefix("megakernel:"), other.strip_prefix("megakernels:")) {
                (Some(n), _) => {
                    Backend::Megakernel(Some(n.parse().context("megakernel:N takes a comm block count")?), gathering)
                }
                (_, Some(counts)) => Backend::Megakernels(Some(PassCommBlocks::parse(counts)?), gathering),
                _ => bail!(
                    "--gemm takes mma, engine, megakernel[:N] or megakernels[:N or :F/B], the last three also with \
                     -gathering or -gathering-forward, not {text}"
                ),
            },
        })
    }

    fn name(self) -> String {
        match self {
            Backend::Mma => "mma".into(),
            Backend::Engine(gathering) => format!("engine{}", gathering.suffix()),
            Backend::Megakernel(comm_blocks, gathering) => mega_name("megakernel", comm_blocks, gathering),
            Backend::Megakernels(counts, gathering) => {
                format!("megakernels{}{}", counts.map_or(String::new(), PassCommBlocks::suffix), gathering.suffix())
            }
        }
    }

    /// Sets `layer` up for this backend, the backward megakernel with `choices`.
    fn apply(self, gpu: &Gpu, layer: &mut UnfusedLayer, choices: BackwardChoices) -> Result<()> {
        layer.set_gemm_engine(gpu, self != Backend::Mma)?;
        let gathering = self.gathering();
        match self {
            Backend::Megakernel(comm_blocks, _) => {
                layer.set_forward_megakernel(gpu, Some(MegakernelOptions { comm_blocks, ..Default::default() }))?
            }
            Backend::Megakernels(counts, _) => {
                let options = |comm_blocks| Some(MegakernelOptions { comm_blocks, ..Default::default() });
                layer.set_forward_megakernel(gpu, options(counts.map(|c| c.forward)))?;
                let backward = options(counts.map(|c| c.backward)).map(|o| choices.apply(o));
                layer.set_backward_megakernel(gpu, backward)?;
            }
            Backend::Mma | Backend::Engine(_) => {}
        }
        layer.set_gather_in_producers(gpu, gathering != Gather::None, gathering == Gather::Both)?;
        Ok(())
    }

    /// Which producers gather their rows.
    fn gathering(self) -> Gather {
        match self {
            Backend::Mma => Gather::None,
            Backend::Engine(gathering) | Backend::Megakernel(_, gathering) | Backend::Megakernels(_, gathering) => {
                gathering
            }
        }
    }

    /// Whether any producer gathers its rows.
    fn gathers(self) -> bool {
        self.gathering() != Gather::None
    }
}

impl Gather {
    /// The backend name's suffix.
    fn suffix(self) -> &'static str {
        match self {
            Gather::None => "",
            Gather::Forward => "-gathering-forward",
            Gather::Both => "-gathering",
        }
    }
}

/// The comm blocks of the two megakernel passes (a backend without them: each pass's default).
#[derive(Clone, Copy, Debug, PartialEq)]
struct PassCommBlocks {
    forward: u32,
    backward: u32,
}

impl PassCommBlocks {
    /// `N` (both passes) or `F/B`.
    fn parse(text: &str) -> Result<Self> {
        let count = |n: &str| -> Result<u32> {
            n.parse().with_context(|| format!("megakernels:{text}: {n} is not a comm block count"))
        };
        let (forward, backward) = text.split_once('/').unwrap_or((text, text));
        Ok(Self { forward: count(forward)?, backward: count(backward)? })
    }

    /// The backend name's `:N` or `:F/B`.
    fn suffix(self) -> String {
        if self.forward == self.backward {
            format!(":{}", self.forward)
        } else {
            format!(":{}/{}", self.forward, self.backward)
        }
    }
}

/// `base[:N][-gathering[-forward]]`.
fn mega_name(base: &str, comm_blocks: Option<u32>, gathering: Gather) -> String {
    let blocks = comm_blocks.map_or(String::new(), |n| format!(":{n}"));
    format!("{base}{blocks}{}", gathering.suffix())
}

/// An `on|off` flag's value.
fn on_or_off(flag: &str, value: &str) -> Result<bool> {
    match value {
        "on" => Ok(true),
        "off" => Ok(false),
        other => bail!("{flag} {other}: on or off"),
    }
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        cases: Vec::new(),
        reps: 10,
        baseline: HashMap::new(),
        matmul_tflops: 783.0,
        copy_tbps: 4.23,
        backends: vec![Backend::Mma],
        ranks: 1,
        ring_factor: None,
        own_rank_tiles: false,
        backward_choices: BackwardChoices::default(),
        ranks_path: false,
        swap_weights: false,
    };
    let mut cases = "kimi:8192,glm:8192,qwen:8192,deepseek:8192".to_string();
    let mut it = std::env::args().skip(1).filter(|a| a != "--bench");
    while let Some(arg) = it.next() {
        let mut value = || it.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--cases" => cases = value()?,
            "--reps" => {
                args.reps = value()?.parse()?;
                if args.reps == 0 {
                    bail!("--reps 0: at least one repetition is timed");
                }
            }
            "--matmul-tflops" => args.matmul_tflops = value()?.parse()?,
            "--copy-tbps" => args.copy_tbps = value()?.parse()?,
            "--ranks" => {
                args.ranks = value()?.parse()?;
                if args.ranks == 0 {
                    bail!("--ranks 0: a layer has at least one rank");
                }
            }
            "--ring-factor" => {
                let factor: f64 = value()?.parse()?;
                if !(factor >= 1.0 && factor.is_finite()) {
                    bail!("--ring-factor {factor}: a ring must hold at least an even split (1 or more)");
                }
                args.ring_factor = Some(factor);
            }
            "--own-rank-tiles" => args.own_rank_tiles = true,
            "--early-slot-weight-gradients" => {
                args.backward_choices.early_slot_weight_gradients = Some(on_or_off(&arg, &value()?)?)
            }
            "--row-totals" => args.backward_choices.row_totals = Some(on_or_off(&arg, &value()?)?),
            "--ranks-path" => args.ranks_path = true,
            "--swap-weights" => args.swap_weights = true,
            "--gemm" => args.backends = value()?.split(',').map(Backend::parse).collect::<Result<_>>()?,
            "--baseline" => {
                let path = value()?;
                let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
                for line in text.lines().filter(|l| l.starts_with("BASELINE")) {
                    let f: Vec<&str> = line.split_whitespace().collect();
                    let [_, shape, tokens, forward, step] = f[..] else {
                        bail!("{path}: {line:?} is not `BASELINE shape tokens forward_ms step_ms`");
                    };
                    args.baseline.insert((shape.to_string(), tokens.parse()?), (forward.parse()?, step.parse()?));
                }
            }
            other => bail!("unknown argument {other}"),
        }
    }
    for case in cases.split(',') {
        let (name, tokens) = case.split_once(':').with_context(|| format!("case {case} is not shape:tokens"))?;
        args.cases
            .push((FrontierShape::by_name(name).with_context(|| format!("unknown shape {name}"))?, tokens.parse()?));
    }
    if args.swap_weights && args.over_ranks() {
        bail!("--swap-weights times the one-GPU layer; it does not combine with --ranks P > 1 or --ranks-path");
    }
    Ok(args)
}

fn random_tokens(config: &mok::MoeConfig, seed: u64) -> RoutedTokens {
    let (t, h, k, e) = (config.tokens_per_rank, config.hidden, config.top_k, config.num_experts);
    let (topk_ids, topk_weights) = mok::random::topk_routing(t, k, e, seed);
    RoutedTokens { x: mok::random::bf16_values(t * h, seed ^ 5, 1.0), topk_ids, topk_weights }
}

fn median(mut v: Vec<f32>) -> f64 {
    v.sort_by(f32::total_cmp);
    v[v.len() / 2] as f64
}

/// What one case on one backend measured.
struct Measured {
    fwd: f64,
    step: f64,
    /// Kernels launched per forward (memsets not counted).
    launches: u64,
    /// ... and per backward (after a forward).
    bwd_launches: u64,
    /// Megakernel backends: the launch's sides timed alone ([`Sides`]).
    sides: Option<Sides>,
    /// With the backward megakernel: its own timings.
    backward: Option<BackwardTimes>,
}

/// The backward megakernel timed on its own, ms.
struct BackwardTimes {
    /// Its sides, as [`Measured::sides`] (`whole`: the backward alone).
    sides: Sides,
    /// Without its weight-gradient tiles.
    without_weight_grads: f64,
    /// Its weight-gradient tiles alone.
    weight_grads: f64,
}

/// A megakernel pass and its sides, each timed the same way (`reps` passes of that work back to
/// back, the median; ms), so that the overlap efficiency compares like with like: every term
/// ran after passes of its own kind, not the whole pass after a backward (under the power limit
/// what ran before changes a pass's time, docs/PERF.md).
#[derive(Clone, Copy)]
struct Sides {
    /// Only the row moving.
    comm: f64,
    /// Only the GEMMs (rows left in place by the pass before).
    compute: f64,
    /// Nothing: the schedule and an empty launch.
    none: f64,
    /// All the work: the pass itself.
    whole: f64,
}

impl Sides {
    /// How much of the shorter side the whole pass hides: (comm + compute − whole) / min.
    fn overlap(&self) -> f64 {
        (self.comm + self.compute - self.whole) / self.comm.min(self.compute)
    }
}

/// The megakernel's pass and sides timed alone ([`Sides`]). `layer(Some(work))` sets the work of
/// the following passes, `layer(None)` runs a pass. Leaves the work at [`MegakernelWork::ALL`],
/// with one real pass after.
fn time_sides(
    timer: &mok::driver::GpuTimer,
    reps: usize,
    mut layer: impl FnMut(Option<MegakernelWork>) -> Result<()>,
) -> Result<Sides> {
    let mut time = |work: MegakernelWork| -> Result<f64> {
        layer(Some(work))?;
        let mut times = Vec::new();
        for _ in 0..reps {
            timer.start()?;
            layer(None)?;
            times.push(timer.stop_ms()?);
        }
        Ok(median(times))
    };
    let sides = Sides {
        comm: time(MegakernelWork::COMM_ONLY)?,
        compute: time(MegakernelWork::COMPUTE_ONLY)?,
        none: time(MegakernelWork::NONE)?,
        whole: time(MegakernelWork::ALL)?,
    };
    layer(None)?;
    Ok(sides)
}

/// The layer bench across processes ([`bench_case_processes`]): rank 0 prints the `RESULT`
/// lines (the other ranks measure in step with it and print nothing).
fn main_processes(args: &Args, env: &mok::symmetric::LaunchEnv) -> Result<()> {
    // One visible GPU (the launcher bound one per task, or every process shares it): that one;
    // else the local rank's.
    let one_visible = std::env::var("CUDA_VISIBLE_DEVICES").is_ok_and(|v| !v.is_empty() && !v.contains(','));
    let ordinal = if one_visible { 0 } else { env.local_rank };
    // Every case must split over the processes: refused before any rank joins or measures.
    for &(shape, tokens) in &args.cases {
        check_split(shape, tokens, env.world)?;
    }
    let gpu = mok::open_gpu(ordinal)?;
    let mut gather = process_gather(&gpu, env)?;
    for &(shape, tokens) in &args.cases {
        for &backend in &args.backends {
            let m =
                bench_case_processes((&gpu, ordinal as i32), env, &mut *gather, (shape, tokens), args.reps, backend)?;
            if env.rank == 0 {
                let config = shape.config(tokens);
                let flops = forward_flops(&config);
                // Backend `procsP:NAME`: P processes, one rank each.
                println!(
                    "RESULT {} {tokens} procs{}:{} fwd_ms {:.3} step_ms {:.3} fwd_tflops {:.1} step_tflops {:.1} \
                     torch_fwd_ms NaN torch_step_ms NaN flops {flops:.0} launches {}",
                    shape.name,
                    env.world,
                    backend.name(),
                    m.fwd,
                    m.step,
                    flops / m.fwd / 1e9,
                    3.0 * flops / m.step / 1e9,
                    m.launches
                );
            }
        }
    }
    Ok(())
}

/// Refuses a case whose tokens or experts do not split evenly over `ranks` ranks.
fn check_split(shape: FrontierShape, tokens: usize, ranks: usize) -> Result<()> {
    if !tokens.is_multiple_of(ranks) || !shape.experts.is_multiple_of(ranks) {
        bail!("{} at T = {tokens}: T and E = {} must split evenly over {ranks} ranks", shape.name, shape.experts);
    }
    Ok(())
}

/// A wait's deadline: `MOK_BENCH_WAIT_S` seconds where set, else `default`.
fn bench_wait(default: std::time::Duration) -> Result<std::time::Duration> {
    match std::env::var("MOK_BENCH_WAIT_S") {
        Ok(seconds) => Ok(std::time::Duration::from_secs(seconds.parse().context("MOK_BENCH_WAIT_S takes seconds")?)),
        Err(_) => Ok(default),
    }
}

/// How a process all-gathers with the others: an all-gather of equal-length byte strings.
type ProcessGather<'g> = Box<dyn FnMut(&[u8]) -> mok::Result<Vec<u8>> + 'g>;

/// Through files in the directory `MOK_RENDEZVOUS_DIR` names, when it is set (any build; the
/// processes may share a GPU, which NCCL refuses), else through NCCL (feature `nccl`, as the GPU
/// bundle is built).
fn process_gather<'g>(gpu: &'g Gpu, env: &mok::symmetric::LaunchEnv) -> Result<ProcessGather<'g>> {
    // Ranks that start far apart, or share one GPU, may need longer.
    let timeout = bench_wait(std::time::Duration::from_secs(120))?;
    if let Some(dir) = std::env::var_os("MOK_RENDEZVOUS_DIR") {
        let mut rendezvous = mok::symmetric::rendezvous::FileRendezvous::new(dir, env, timeout)?;
        return Ok(Box::new(move |mine| rendezvous.all_gather(mine)));
    }
    #[cfg(feature = "nccl")]
    {
        let boot = mok::symmetric::bootstrap::NcclBootstrap::new(gpu, env, timeout)?;
        Ok(Box::new(move |mine| boot.all_gather_bytes(gpu, mine)))
    }
    #[cfg(not(feature = "nccl"))]
    {
        let _ = gpu;
        bail!(
            "launched as rank {} of {}: the layer across processes all-gathers through NCCL (build with the `nccl` \
             feature, as cargo xtask gpu-bundle does) or through files (set MOK_RENDEZVOUS_DIR)",
            env.rank,
            env.world
        )
    }
}

/// The expert-parallel layer over `ranks` virtual ranks, `tokens` split evenly over them, on
/// `backend`: `mma` (the exchange's separate launches, `mma.sync` expert compute), the forward
/// megakernel hosting every rank in one launch (`megakernel`, the backward on the separate path)
/// or both megakernels (`megakernels`: then also the backward's sides and its weight-gradient
/// share).
fn bench_case_ep(
    gpu: &Gpu,
    shape: FrontierShape,
    tokens: usize,
    reps: usize,
    (ranks, ring_factor, own_rank_tiles, choices): (usize, Option<f64>, bool, BackwardChoices),
    backend: Backend,
) -> Result<Measured> {
    check_split(shape, tokens, ranks)?;
    let config = mok::MoeConfig { ep_ranks: ranks, ..shape.config(tokens / ranks) };
    let h = config.hidden;
    // A ring sized from the even split (random routing lands close to it); a pass that needs
    // more reports the rows it needs (MokError) instead of overrunning.
    let capacity_rows = ring_factor.map(|f| (f * (config.tokens_per_rank * config.top_k) as f64).ceil() as usize);
    let exchange = ExchangeOptions { capacity_rows, ..ExchangeOptions::default() };
    let mut layer = EpLayer::new_virtual(gpu, config.clone(), exchange)?;
    let share_rank_tiles = !own_rank_tiles;
    match backend {
        Backend::Mma => {}
        _ if backend.gathers() => {
            bail!("the expert-parallel layer (P = {ranks}): the rows are pulled across ranks, not gathered")
        }
        Backend::Megakernel(comm_blocks, _) => layer.set_forward_megakernel(
            gpu,
            Some(choices.apply(MegakernelOptions { comm_blocks, share_rank_tiles, ..Default::default() })),
        )?,
        Backend::Megakernels(counts, _) => {
            let options = |comm_blocks| {
                Some(choices.apply(MegakernelOptions { comm_blocks, share_rank_tiles, ..Default::default() }))
            };
            layer.set_forward_megakernel(gpu, options(counts.map(|c| c.forward)))?;
            layer.set_backward_megakernel(gpu, options(counts.map(|c| c.backward)))?;
        }
        Backend::Engine(_) => {
            bail!(
                "the expert-parallel layer (P = {ranks}) runs mma (separate launches), megakernel[:N] or megakernels[:N], not the engine"
            )
        }
    }
    let experts: Vec<DeviceExperts> = (0..ranks)
        .map(|rank| DeviceExperts::random(gpu, &config, 1 + 3 * rank as u64, 3.0 / (h as f32).sqrt()))
        .collect::<mok::Result<_>>()?;
    for rank in 0..ranks {
        layer.upload_tokens(gpu, rank, &random_tokens(&config, 7 + rank as u64))?;
        layer.upload_dy(gpu, rank, &mok::random::bf16_values(config.tokens_per_rank * h, 4 + rank as u64, 1.0))?;
    }
    layer.forward(gpu, &experts, None)?;
    layer.backward(gpu, &experts, None)?;
    layer.check_errors(gpu)?;
    let timer = gpu.timer()?;
    let (mut fwd, mut step) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        timer.start()?;
        layer.forward(gpu, &experts, None)?;
        fwd.push(timer.stop_ms()?);
        timer.start()?;
        layer.forward(gpu, &experts, None)?;
        layer.backward(gpu, &experts, None)?;
        step.push(timer.stop_ms()?);
    }
    layer.check_errors(gpu)?;
    let before = gpu.kernel_launches();
    layer.forward(gpu, &experts, None)?;
    let launches = gpu.kernel_launches() - before;
    let before = gpu.kernel_launches();
    layer.backward(gpu, &experts, None)?;
    let bwd_launches = gpu.kernel_launches() - before;
    let mut sides = None;
    if matches!(backend, Backend::Megakernel(..)) {
        sides = Some(time_sides(&timer, reps, |work| {
            match work {
                Some(work) => layer.set_forward_megakernel_work(work)?,
                None => layer.forward(gpu, &experts, None)?,
            }
            Ok(())
        })?);
        layer.check_errors(gpu)?;
    }
    let mut backward = None;
    if matches!(backend, Backend::Megakernels(..)) {
        // The backward alone, its two sides, and without its weight-gradient tiles (as on one
        // GPU, `bench_case`).
        let time_backward = |layer: &mut EpLayer| -> Result<f64> {
            let mut times = Vec::new();
            for _ in 0..reps {
                timer.start()?;
                layer.backward(gpu, &experts, None)?;
                times.push(timer.stop_ms()?);
            }
            Ok(median(times))
        };
        let sides = time_sides(&timer, reps, |work| {
            match work {
                Some(work) => layer.set_backward_megakernel_work(work)?,
                None => layer.backward(gpu, &experts, None)?,
            }
            Ok(())
        })?;
        layer.set_backward_megakernel_work(MegakernelWork::WITHOUT_WEIGHT_GRADS)?;
        let without = time_backward(&mut layer)?;
        layer.set_backward_megakernel_work(MegakernelWork::WEIGHT_GRADS_ONLY)?;
        let weight_grads = time_backward(&mut layer)?;
        layer.set_backward_megakernel_work(MegakernelWork::ALL)?;
        layer.backward(gpu, &experts, None)?;
        layer.check_errors(gpu)?;
        backward = Some(BackwardTimes { sides, without_weight_grads: without, weight_grads });
    }
    Ok(Measured { fwd: median(fwd), step: median(step), launches, bwd_launches, sides, backward })
}

fn bench_case(
    gpu: &Gpu,
    shape: FrontierShape,
    tokens: usize,
    (reps, swap_weights, choices): (usize, bool, BackwardChoices),
    backend: Backend,
) -> Result<Measured> {
    let config = shape.config(tokens);
    let (h, i, e) = (config.hidden, config.intermediate, config.num_experts);
    let host_tokens = random_tokens(&config, 7);
    let device_tokens = DeviceTokens::upload(gpu, &config, &host_tokens)?;
    let scale_in = 3.0 / (h as f32).sqrt();
    let make_experts = || -> Result<DeviceExperts> {
        Ok(DeviceExperts {
            w_gate: random_bf16(gpu, e * i * h, 1, scale_in)?,
            w_up: random_bf16(gpu, e * i * h, 2, scale_in)?,
            w_down: random_bf16(gpu, e * h * i, 3, 3.0 / (i as f32).sqrt())?,
        })
    };
    let experts = make_experts()?;
    let dy = random_bf16(gpu, tokens * h, 4, 1.0)?;
    let mut layer = UnfusedLayer::new(gpu, config)?;
    backend.apply(gpu, &mut layer, choices)?;
    layer.forward(gpu, &device_tokens, &experts, None)?;
    layer.backward(gpu, &device_tokens, &experts, None, &dy)?;
    layer.check_device_errors()?;
    let timer = gpu.timer()?;
    let (mut fwd, mut step) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        timer.start()?;
        layer.forward(gpu, &device_tokens, &experts, None)?;
        fwd.push(timer.stop_ms()?);
        timer.start()?;
        layer.forward(gpu, &device_tokens, &experts, None)?;
        layer.backward(gpu, &device_tokens, &experts, None, &dy)?;
        step.push(timer.stop_ms()?);
    }
    layer.check_device_errors()?;
    if swap_weights {
        // The same values in other buffers: every step's forward sees new weight addresses. A GPU
        // without room for a second copy (deepseek's 50.7 GB of weights twice, with the
        // gradients) skips this comparison and says so; the case's other timings stand.
        match make_experts() {
            Err(e) => println!(
                "MOKSWAP {} {tokens} {}: not measured, no room for a second weight copy: {e}",
                shape.name,
                backend.name()
            ),
            Ok(other) => {
                let mut swapped = Vec::new();
                for rep in 0..reps {
                    let weights = if rep % 2 == 0 { &other } else { &experts };
                    timer.start()?;
                    layer.forward(gpu, &device_tokens, weights, None)?;
                    layer.backward(gpu, &device_tokens, weights, None, &dy)?;
                    swapped.push(timer.stop_ms()?);
                }
                layer.check_device_errors()?;
                println!(
                    "MOKSWAP {} {tokens} {}: forward + backward {:.2} ms with the same weight buffers every step, {:.2} ms with the weights alternating between two copies",
                    shape.name,
                    backend.name(),
                    median(step.clone()),
                    median(swapped)
                );
            }
        }
    }
    let before = gpu.kernel_launches();
    layer.forward(gpu, &device_tokens, &experts, None)?;
    let launches = gpu.kernel_launches() - before;
    let before = gpu.kernel_launches();
    layer.backward(gpu, &device_tokens, &experts, None, &dy)?;
    let bwd_launches = gpu.kernel_launches() - before;
    let mut sides = None;
    if matches!(backend, Backend::Megakernel(..)) {
        sides = Some(time_sides(&timer, reps, |work| {
            match work {
                Some(work) => layer.set_forward_megakernel_work(work)?,
                None => layer.forward(gpu, &device_tokens, &experts, None)?,
            }
            Ok(())
        })?);
        layer.check_device_errors()?;
    }
    let mut backward = None;
    if matches!(backend, Backend::Megakernels(..)) {
        let sides = time_sides(&timer, reps, |work| {
            match work {
                Some(work) => layer.set_backward_megakernel_work(work)?,
                None => layer.backward(gpu, &device_tokens, &experts, None, &dy)?,
            }
            Ok(())
        })?;
        let mut time_backward = |work: MegakernelWork| -> Result<f64> {
            layer.set_backward_megakernel_work(work)?;
            let mut times = Vec::new();
            for _ in 0..reps {
                timer.start()?;
                layer.backward(gpu, &device_tokens, &experts, None, &dy)?;
                times.push(timer.stop_ms()?);
            }
            Ok(median(times))
        };
        let without = time_backward(MegakernelWork::WITHOUT_WEIGHT_GRADS)?;
        let weight_grads = time_backward(MegakernelWork::WEIGHT_GRADS_ONLY)?;
        layer.set_backward_megakernel_work(MegakernelWork::ALL)?;
        layer.backward(gpu, &device_tokens, &experts, None, &dy)?;
        layer.check_device_errors()?;
        backward = Some(BackwardTimes { sides, without_weight_grads: without, weight_grads });
    }
    Ok(Measured { fwd: median(fwd), step: median(step), launches, bwd_launches, sides, backward })
}

/// The layer across processes, one rank per GPU (launched by torchrun or srun: `env`): this
/// process's rank of `tokens` global tokens split over the world, its E/P experts, through
/// `MoeLayer::with_heap` over a multi-process symmetric heap (handles exchanged through
/// `gather`; `MOK_HEAP_HANDLE=fabric` across the nodes of an NVLink domain, POSIX fds within a
/// node by default). Every rank runs the same cases in the same order; the exchange keeps them in
/// step.
fn bench_case_processes(
    (gpu, ordinal): (&Gpu, i32),
    env: &mok::symmetric::LaunchEnv,
    gather: &mut dyn FnMut(&[u8]) -> mok::Result<Vec<u8>>,
    (shape, tokens): (FrontierShape, usize),
    reps: usize,
    backend: Backend,
) -> Result<Measured> {
    use mok::driver::DeviceBuffer;
    use mok::driver::vmm::ShareableKind;
    use mok::exchange::Exchange;
    use mok::moe::{Backend as LayerBackend, LayerOptions, MoeGradients, MoeInputs};
    use mok::symmetric::SymmetricHeap;
    use mok::unfused::{TokensView, WeightGradTarget};

    // The case's split over the processes was checked before any rank joined.
    let world = env.world;
    let config = mok::MoeConfig { ep_ranks: world, ..shape.config(tokens / world) };
    let (t, h, k) = (config.tokens_per_rank, config.hidden, config.top_k);
    let kind = match std::env::var("MOK_HEAP_HANDLE").as_deref() {
        Ok("fabric") => ShareableKind::Fabric,
        Ok("fd") | Err(_) => ShareableKind::PosixFd,
        Ok(other) => bail!("MOK_HEAP_HANDLE={other:?}: fd (processes of one node, the default) or fabric"),
    };
    // The layer's waits (processes sharing one GPU take turns on it, and a peer's publish can
    // take seconds).
    let timeout = bench_wait(MegakernelOptions::default().timeout)?;
    let megakernels = |comm_blocks| LayerOptions {
        backend: Some(LayerBackend::Megakernel),
        megakernel: MegakernelOptions { comm_blocks, timeout, ..Default::default() },
        ..Default::default()
    };
    let options = match backend {
        Backend::Mma => LayerOptions {
            backend: Some(LayerBackend::MmaSync),
            megakernel: MegakernelOptions { timeout, ..Default::default() },
            ..Default::default()
        },
        // `MoeLayer::with_heap` runs both passes as megakernels hosting the process's rank.
        _ if backend.gathers() => bail!("across ranks the rows are pulled, not gathered"),
        Backend::Megakernels(Some(counts), _) if counts.forward != counts.backward => {
            bail!(
                "across processes both passes take one comm block count (`MoeLayer`'s options), not {}",
                backend.name()
            )
        }
        Backend::Megakernel(comm_blocks, _) => megakernels(comm_blocks),
        Backend::Megakernels(counts, _) => megakernels(counts.map(|c| c.forward)),
        Backend::Engine(_) => {
            bail!("across ranks the layer runs mma or the megakernels, not the engine")
        }
    };
    let request = Exchange::heap_request(&config, &ExchangeOptions::default())?;
    let heap = SymmetricHeap::multi_process(gpu, env, ordinal, request, kind, &mut |mine| gather(mine))?;
    let mut layer = mok::MoeLayer::with_heap(gpu, config.clone(), options, heap)?;
    let host = random_tokens(&config, 7 + env.rank as u64);
    let x = DeviceBuffer::from_slice(gpu, &host.x)?;
    let ids = DeviceBuffer::from_slice(gpu, &host.topk_ids)?;
    let weights = DeviceBuffer::from_slice(gpu, &host.topk_weights)?;
    let experts = DeviceExperts::random(gpu, &config, 1 + 3 * env.rank as u64, 3.0 / (h as f32).sqrt())?;
    let dy = DeviceBuffer::from_slice(gpu, &mok::random::bf16_values(t * h, 4 + env.rank as u64, 1.0))?;
    let mut y = DeviceBuffer::alloc(gpu, t * h)?;
    let mut dx = DeviceBuffer::alloc(gpu, t * h)?;
    let mut d_topk = DeviceBuffer::alloc(gpu, t * k)?;
    let inputs = MoeInputs {
        tokens: TokensView { x: (&x).into(), topk_ids: (&ids).into(), topk_weights: (&weights).into() },
        experts: (&experts).into(),
        shared: None,
    };
    let mut step = |with_backward: bool| -> Result<()> {
        let token = layer.forward_token(gpu, &inputs, (&mut y).into())?;
        if with_backward {
            let grads = MoeGradients {
                dx: (&mut dx).into(),
                d_topk_weights: (&mut d_topk).into(),
                weights: WeightGradTarget::Layer,
            };
            layer.backward(gpu, token, &inputs, (&dy).into(), grads)?;
        }
        Ok(())
    };
    step(true)?;
    let timer = gpu.timer()?;
    let (mut fwd, mut steps) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        timer.start()?;
        step(false)?;
        fwd.push(timer.stop_ms()?);
        timer.start()?;
        step(true)?;
        steps.push(timer.stop_ms()?);
    }
    let before = gpu.kernel_launches();
    step(false)?;
    let launches = gpu.kernel_launches() - before;
    let before = gpu.kernel_launches();
    step(true)?;
    let bwd_launches = gpu.kernel_launches() - before - launches;
    layer.check()?;
    // Every rank is done with every slice before any rank frees its own.
    gather(&[1])?;
    drop(layer);
    Ok(Measured { fwd: median(fwd), step: median(steps), launches, bwd_launches, sides: None, backward: None })
}

fn main() -> Result<()> {
    let args = parse_args()?;
    // Under torchrun or srun with more than one process: one rank per GPU, across processes.
    let env = mok::symmetric::LaunchEnv::from_env()?;
    if env.world > 1 {
        if args.over_ranks() || args.swap_weights {
            bail!("across processes each process runs one rank: --ranks, --ranks-path and --swap-weights do not apply");
        }
        return main_processes(&args, &env);
    }
    let gpu = match mok::open_gpu(0) {
        Ok(gpu) => gpu,
        // No driver, no device, or a GPU mok has no kernels for: said, and nothing to measure
        // (a benchmark is not a test).
        Err(e)
            if matches!(&e, mok::MokError::NoDriver(_) | mok::MokError::UnsupportedGpu { .. })
                || matches!(&e, mok::MokError::Cuda { call, .. } if call == "cuInit") =>
        {
            println!("layer benchmark: no usable GPU ({e}); nothing measured.");
            return Ok(());
        }
        // A GPU that is there but would not open (out of memory, a module the driver refused):
        // a failure.
        Err(e) => return Err(e).context("opening GPU 0"),
    };
    let name = |backend: Backend| {
        let own = if args.own_rank_tiles { "/own-tiles" } else { "" };
        let dots = match args.backward_choices.early_slot_weight_gradients {
            Some(true) => "/slot-weight-gradients-early",
            Some(false) => "/slot-weight-gradients-late",
            None => "",
        };
        let totals = match args.backward_choices.row_totals {
            Some(true) => "/row-totals-on",
            Some(false) => "/row-totals-off",
            None => "",
        };
        if args.over_ranks() {
            format!("ep{}:{}{own}{dots}{totals}", args.ranks, backend.name())
        } else {
            format!("{}{dots}{totals}", backend.name())
        }
    };
    let backends: Vec<String> = args.backends.iter().map(|&b| name(b)).collect();
    println!(
        "layer benchmark on {}; backends {}; floors at {} TFLOP/s and {} TB/s",
        gpu.name(),
        backends.join(", "),
        args.matmul_tflops,
        args.copy_tbps
    );
    let mut rows = Vec::new();
    let mut details = Vec::new();
    let runs: Vec<(FrontierShape, usize, Backend)> =
        args.cases.iter().flat_map(|&(shape, tokens)| args.backends.iter().map(move |&b| (shape, tokens, b))).collect();
    for (shape, tokens, backend) in runs {
        let measured = if args.over_ranks() {
            bench_case_ep(
                &gpu,
                shape,
                tokens,
                args.reps,
                (args.ranks, args.ring_factor, args.own_rank_tiles, args.backward_choices),
                backend,
            )?
        } else {
            bench_case(&gpu, shape, tokens, (args.reps, args.swap_weights, args.backward_choices), backend)?
        };
        let backend_name = name(backend);
        let (fwd, step) = (measured.fwd, measured.step);
        if let Some(sides) = measured.sides {
            let Sides { comm, compute, none, whole } = sides;
            let overlap = sides.overlap();
            details.push(format!(
                "| {} | {tokens} | {} | {} | {} | {none:.2} ({:.1} %) | {comm:.2} | {compute:.2} | {whole:.2} | {:.0} % |",
                shape.name,
                backend_name.clone(),
                measured.launches,
                measured.bwd_launches,
                100.0 * none / whole,
                100.0 * overlap
            ));
        } else {
            details.push(format!(
                "| {} | {tokens} | {} | {} | {} | - | - | - | {fwd:.2} | - |",
                shape.name,
                backend_name.clone(),
                measured.launches,
                measured.bwd_launches
            ));
        }
        if let Some(times) = &measured.backward {
            let Sides { comm, compute, none, whole: bwd } = times.sides;
            let (without_wgrad, wgrad_alone) = (times.without_weight_grads, times.weight_grads);
            let overlap = times.sides.overlap();
            println!(
                "{} {tokens} {}: backward {bwd:.2} ms, without its weight-gradient tiles {without_wgrad:.2} ms (weight gradients {:.1} % of the backward), the weight-gradient tiles alone {wgrad_alone:.2} ms",
                shape.name,
                backend_name,
                100.0 * (bwd - without_wgrad) / bwd
            );
            details.push(format!(
                "| {} | {tokens} | {} (backward) | - | {} | {none:.2} ({:.1} %) | {comm:.2} | {compute:.2} | {bwd:.2} | {:.0} % |",
                shape.name,
                backend_name.clone(),
                measured.bwd_launches,
                100.0 * none / bwd,
                100.0 * overlap
            ));
        }
        let config = shape.config(tokens);
        let flops = forward_flops(&config);
        let floor = |flop: f64, bytes: f64| (flop / (args.matmul_tflops * 1e9), bytes / (args.copy_tbps * 1e9));
        let (fwd_flop_floor, fwd_byte_floor) = floor(flops, forward_min_bytes(&config));
        let (bwd_flop_floor, bwd_byte_floor) = floor(2.0 * flops, backward_min_bytes(&config));
        let step_floor = (fwd_flop_floor + bwd_flop_floor).max(fwd_byte_floor + bwd_byte_floor);
        let baseline = args.baseline.get(&(shape.name.to_string(), tokens)).copied();
        // One machine-readable line per run (`cargo xtask bench` reads them): name value pairs, NaN
        // where there is no PyTorch baseline.
        let (torch_fwd, torch_step) = baseline.unwrap_or((f64::NAN, f64::NAN));
        println!(
            "RESULT {} {tokens} {backend_name} fwd_ms {fwd:.3} step_ms {step:.3} fwd_tflops {:.1} step_tflops {:.1} \
             fwd_flop_floor_ms {fwd_flop_floor:.3} fwd_byte_floor_ms {fwd_byte_floor:.3} step_floor_ms {step_floor:.3} \
             torch_fwd_ms {torch_fwd:.3} torch_step_ms {torch_step:.3} flops {flops:.0} launches {} bwd_launches {}",
            shape.name,
            flops / fwd / 1e9,
            3.0 * flops / step / 1e9,
            measured.launches,
            measured.bwd_launches
        );
        rows.push((
            backend_name.clone(),
            shape.name,
            tokens,
            fwd,
            step,
            fwd_flop_floor.max(fwd_byte_floor),
            step_floor,
            fwd_flop_floor,
            fwd_byte_floor,
            baseline,
        ));
    }
    println!();
    println!(
        "| shape | T | backend | mok fwd ms | torch fwd ms | speedup | mok fwd+bwd ms | torch fwd+bwd ms | speedup | fwd floor ms (flop / bytes) | fwd+bwd floor ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (backend, name, tokens, fwd, step, _, step_floor, ff, fb, baseline) in rows {
        let (tf, ts) =
            baseline.map(|(a, b)| (format!("{a:.2}"), format!("{b:.2}"))).unwrap_or(("-".into(), "-".into()));
        let (rf, rs) = baseline
            .map(|(a, b)| (format!("{:.2}x", a / fwd), format!("{:.2}x", b / step)))
            .unwrap_or(("-".into(), "-".into()));
        println!(
            "| {name} | {tokens} | {backend} | {fwd:.2} | {tf} | {rf} | {step:.2} | {ts} | {rs} | {:.2} ({ff:.2} / {fb:.2}) | {step_floor:.2} |",
            ff.max(fb)
        );
    }
    println!();
    println!(
        "| shape | T | backend | kernels per forward | kernels per backward | schedule + empty launch ms (share) | comm side alone ms | compute side alone ms | pass alone ms | overlap efficiency |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for line in details {
        println!("{line}");
    }
    Ok(())
}
