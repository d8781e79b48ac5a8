//! `cargo xtask`: the project's developer and CI tasks.
//!
//! - `setup`: installs the kernel toolchain and ptxas (idempotent).
//! - `ptx`: builds the kernels to PTX for every architecture, runs ptxas on them and reports
//!   registers, spills, stack and shared memory per kernel.
//! - `test`: setup, ptx (and the check that the shipped PTX equals it), fmt, clippy, builds
//!   without features and of a downstream crate, the workspace tests and the burn
//!   integration's checks; CI's entry point.
//! - `gpu-bundle`: the release GPU test, bench and demo binaries plus a `run.sh`, for the GPU machine.
//! - `gpu-subset`: what one device call carries, picked from the bundle.
//! - `bench`, `bench-chart`: the layer benchmark beside PyTorch, and its chart.
//! - `demo`: runs `mok-demo`.

// The PTX build logic, shared with the facade's build script. The xtask executable also serves
// as rustc's NVPTX linker, so `main` hands over to it first thing.
#[path = "../../kernels/ptx_builder.rs"]
mod ptx_builder;

mod bench;
mod bundle;
mod json;
mod ptx;
mod setup;

use std::env;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Output, Stdio};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask", about = "mok's developer and CI tasks")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install the kernel toolchain (nightly + rust-src + llvm-tools) and ptxas; a no-op when present.
    Setup,
    /// Build the PTX for every architecture into target/ptx/ and report ptxas's resource usage.
    Ptx {
        /// Also build a second time in another target folder and check the PTX is byte-identical.
        #[arg(long)]
        check_reproducible: bool,
        /// Copy the fresh PTX into src/ptx/, the files a downstream build uses (commit them).
        #[arg(long)]
        ship: bool,
    },
    /// Run everything CI runs: setup, ptx and the shipped-PTX check, cargo fmt --check, clippy
    /// -D warnings, the feature-less and downstream builds, cargo test, the burn integration's.
    Test,
    /// Build the release GPU tests, benches and demo into a folder with a run.sh for the GPU machine.
    GpuBundle {
        /// Output folder (default: bundle/ at the workspace root).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Copy what one device call needs out of a bundle into a folder small enough to carry:
    /// run.sh, the named test binaries (gzipped), the named bench binaries with every bench
    /// script, and extra files (PTX variants); prints the `carry` entry.
    GpuSubset {
        /// The folder to fill, e.g. target/call1 (inside the repository, git-ignored).
        #[arg(long)]
        out: PathBuf,
        /// The bundle (default: bundle/ at the workspace root).
        #[arg(long)]
        from: Option<PathBuf>,
        /// Test binaries, e.g. gpu_unfused,gpu_exchange.
        #[arg(long, value_delimiter = ',')]
        tests: Vec<String>,
        /// Bench binaries, e.g. layer.
        #[arg(long, value_delimiter = ',')]
        benches: Vec<String>,
        /// Extra files copied into the folder (PTX variants for MOK_PTX, ...).
        #[arg(long, value_delimiter = ',')]
        files: Vec<PathBuf>,
    },
    /// Run the layer benchmark across shapes, token counts and backends, next to the PyTorch
    /// layer when python3 has torch with CUDA; writes results.json and chart.svg.
    Bench {
        /// Frontier shapes (kimi, glm, qwen, deepseek).
        #[arg(long, value_delimiter = ',', default_value = "kimi,glm,qwen,deepseek")]
        shapes: Vec<String>,
        /// Token counts T per case (global over the ranks).
        #[arg(long, value_delimiter = ',', default_value = "8192")]
        tokens: Vec<usize>,
        /// Backends: mma, engine, megakernel, megakernel:N (N comm blocks), megakernels[:N] (the
        /// forward and the backward megakernels, on one GPU or over virtual ranks;
        /// megakernels:F/B: F comm blocks in the forward, B in the backward); engine,
        /// megakernel[:N] and megakernels[:N] also with a `-gathering` suffix (the token rows
        /// gathered in the gate/up's and the weight gradients' producers, one GPU) or
        /// `-gathering-forward` (in the gate/up's alone).
        #[arg(long, value_delimiter = ',', default_value = "engine,megakernel")]
        backends: Vec<String>,
        /// P > 1: the expert-parallel layer over P virtual ranks on one GPU instead.
        #[arg(long, default_value_t = 1)]
        ranks: usize,
        /// With --ranks: each rank's receive ring holds F times an even split's rows (default:
        /// the worst case, every slot on one rank, which does not fit the largest cases at P = 8).
        #[arg(long)]
        ring_factor: Option<f64>,
        /// Timed repetitions per case (the median is reported).
        #[arg(long, default_value_t = 10)]
        reps: usize,
        /// Output folder for results.json, chart.svg and the logs.
        #[arg(long, default_value = "bench-results")]
        out: PathBuf,
        /// Skip the PyTorch comparison even where torch is installed.
        #[arg(long)]
        no_torch: bool,
        /// Use this layer-bench binary instead of building one (the GPU bundle's
        /// `benches/layer`; its folder must hold ceilings.py and torch_moe.py).
        #[arg(long)]
        layer_bin: Option<PathBuf>,
    },
    /// Write results.json and chart.svg again from a saved layer-bench log (its RESULT lines).
    BenchChart {
        /// A `layer.log` of `cargo xtask bench` (or the bench's output).
        log: PathBuf,
        /// Output folder.
        #[arg(long, default_value = "bench-results")]
        out: PathBuf,
    },
    /// Run `mok-demo` (release build) with the given arguments (all forwarded, `--help` too).
    #[command(disable_help_flag = true)]
    Demo {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
}

fn main() -> ExitCode {
    ptx_builder::run_as_linker_if_requested();

    let cli = Cli::parse();
    let root = workspace_root();
    let result = match cli.command {
        Task::Setup => setup::setup(),
        Task::Ptx { check_reproducible, ship } => {
            ptx::ptx(&root, check_reproducible).and_then(|()| if ship { ptx::ship(&root) } else { Ok(()) })
        }
        Task::Test => test(&root),
        Task::GpuBundle { out } => bundle::gpu_bundle(&root, out.unwrap_or_else(|| root.join("bundle"))),
        Task::GpuSubset { out, from, tests, benches, files } => {
            let absolute =
                |p: PathBuf| if p.is_absolute() { p } else { env::current_dir().unwrap_or_default().join(p) };
            let args = bundle::SubsetArgs {
                from: absolute(from.unwrap_or_else(|| root.join("bundle"))),
                out: absolute(out),
                tests,
                benches,
                files: files.into_iter().map(absolute).collect(),
            };
            bundle::gpu_subset(&root, &args).map(|_| ())
        }
        Task::Bench { shapes, tokens, backends, ranks, ring_factor, reps, out, no_torch, layer_bin } => bench::bench(
            &root,
            &bench::BenchArgs { shapes, tokens, backends, ranks, ring_factor, reps, out, torch: !no_torch, layer_bin },
        ),
        Task::BenchChart { log, out } => bench::chart_from_log(&log, &out),
        Task::Demo { args } => return demo(&root, &args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root: the parent of xtask's own folder.
fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().unwrap_or(manifest_dir).to_path_buf()
}

/// `program arg arg ...` for messages.
pub fn describe(command: &Command) -> String {
    let mut text = command.get_program().to_string_lossy().into_owned();
    for arg in command.get_args() {
        text.push(' ');
        text.push_str(&arg.to_string_lossy());
    }
    text
}

/// Runs `command` with inherited output; an error names the command.
pub fn run(command: &mut Command) -> Result<()> {
    let described = describe(command);
    let status = command.status().with_context(|| format!("cannot start `{described}`"))?;
    if !status.success() {
        bail!("`{described}` failed ({status})");
    }
    Ok(())
}

/// Runs `command` and captures stdout and stderr (stdin closed), whether it succeeds or not.
pub fn capture(command: &mut Command) -> Result<Output> {
    let described = describe(command);
    command.stdin(Stdio::null()).output().with_context(|| format!("cannot start `{described}`"))
}

/// `cargo` with the workspace root as working folder.
pub fn cargo(root: &Path) -> Command {
    let mut command = Command::new("cargo");
    command.current_dir(root);
    command
}

fn test(root: &Path) -> Result<()> {
    let probe = root.join("tests").join("downstream-probe").join("Cargo.toml");
    let probe = probe.to_string_lossy().into_owned();
    let probe_target = root.join("target").join("downstream-probe");
    let probe_target = probe_target.to_string_lossy().into_owned();
    let burn = root.join("integrations").join("burn").join("Cargo.toml");
    let burn = burn.to_string_lossy().into_owned();
    let burn_target = root.join("target").join("burn");
    let burn_target = burn_target.to_string_lossy().into_owned();
    let cargo_steps: [&[&str]; 8] = [
        &["fmt", "--all", "--check"],
        // The GPU tests too: they compile without a GPU (the bundle builds them), and the NCCL
        // bootstrap (libnccl is loaded at run time).
        &["clippy", "--workspace", "--all-targets", "--features", "gpu-tests nccl", "--", "-D", "warnings"],
        // Without any feature, as a downstream build compiles it (test hooks off).
        &["check", "--workspace", "--all-targets"],
        // With the shipped PTX (no kernel toolchain), as a downstream build does; doctests too;
        // the test hooks on, so the tests of `MOK_PTX` and the probes' argument checks build;
        // NCCL's bootstrap for its config layout and deadline tests.
        &["test", "--workspace", "--features", "mok/testing mok/nccl"],
        // A crate that depends on mok beside cudarc configured as candle-core does.
        &["build", "--manifest-path", &probe, "--target-dir", &probe_target],
        // The burn integration (its own workspace: burn 0.21 on CubeCL's CUDA runtime): format,
        // lints with its GPU tests, and its CPU tests.
        &["fmt", "--manifest-path", &burn, "--check"],
        &[
            "clippy",
            "--manifest-path",
            &burn,
            "--target-dir",
            &burn_target,
            "--all-targets",
            "--features",
            "gpu-tests",
            "--",
            "-D",
            "warnings",
        ],
        &["test", "--manifest-path", &burn, "--target-dir", &burn_target],
    ];
    let total = 3 + cargo_steps.len();
    println!("==> xtask test 1/{total}: setup");
    setup::setup().context("xtask test: step 1 (setup) failed")?;
    println!("==> xtask test 2/{total}: ptx");
    ptx::ptx(root, false).context("xtask test: step 2 (ptx) failed")?;
    println!("==> xtask test 3/{total}: the shipped PTX equals the fresh build");
    ptx::check_shipped(root).context("xtask test: step 3 (shipped PTX) failed")?;
    for (index, args) in cargo_steps.iter().enumerate() {
        let step = index + 4;
        let mut command = cargo(root);
        command.args(*args);
        // The workspace's own steps use the shipped PTX, whatever the caller's environment says.
        command.env_remove("MOK_BUILD_KERNELS");
        let described = describe(&command);
        println!("==> xtask test {step}/{total}: {described}");
        let mut hint = "";
        if args[0] == "fmt" || args[0] == "clippy" {
            // A missing component shows as cargo's "no such command".
            if !capture(cargo(root).args([args[0], "--version"]))?.status.success() {
                hint = " (is the component installed? `rustup component add rustfmt clippy`)";
            }
        }
        run(&mut command).with_context(|| format!("xtask test: step {step} (`{described}`) failed{hint}"))?;
    }
    println!("xtask test: all steps passed");
    Ok(())
}

fn demo(root: &Path, args: &[OsString]) -> ExitCode {
    let mut command = cargo(root);
    command.args(["run", "--release", "-p", "mok", "--features", "testing", "--bin", "mok-demo", "--"]).args(args);
    match command.status() {
        Ok(status) if status.success() => ExitCode::SUCCESS,
        Ok(status) => {
            eprintln!("error: `{}` failed ({status})", describe(&command));
            ExitCode::from(
                status.code().and_then(|code| u8::try_from(code).ok()).filter(|&code| code != 0).unwrap_or(1),
            )
        }
        Err(error) => {
            eprintln!("error: cannot start `{}`: {error}", describe(&command));
            ExitCode::FAILURE
        }
    }
}
