//! `cargo xtask gpu-bundle`: the release GPU test binaries, the bench binaries and the demo, in
//! one folder with a `run.sh`, to copy to the GPU machine and run there.
//!
//! Layout: `tests/` (one libtest binary per test target, hash suffix dropped; the burn
//! integration's as `burn_gpu.gz`, which run.sh unpacks), `benches/` (bench
//! binaries, `benches/*.py` and `benches/*.sh`), `bin/` (`mok-demo`, `xtask` for `xtask bench` there,
//! and the burn example as `burn-train.gz`), `run.sh`.

use std::env;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::json::{self, Json};
use crate::{cargo, describe};

const RUN_SH: &str = include_str!("run.sh");

/// Every build of the bundle: release, GPU tests on, the facade package only. One feature set and
/// one profile for all three builds, so they share the library.
/// `nccl` lets the layer bench run one rank per GPU under torchrun or srun (libnccl is only
/// loaded when that path runs).
const BUILD_ARGS: [&str; 5] = ["--release", "--features", "gpu-tests nccl", "-p", "mok"];

/// One `compiler-artifact` message of cargo's JSON output that has an executable.
#[derive(Debug)]
struct Artifact {
    manifest_path: PathBuf,
    target_name: String,
    kinds: Vec<String>,
    /// Built as a libtest harness (`profile.test`).
    test: bool,
    executable: PathBuf,
}

fn artifact_of(message: &Json) -> Option<Artifact> {
    if message.get("reason")?.as_str()? != "compiler-artifact" {
        return None;
    }
    let target = message.get("target")?;
    Some(Artifact {
        manifest_path: PathBuf::from(message.get("manifest_path")?.as_str()?),
        target_name: target.get("name")?.as_str()?.to_string(),
        kinds: target.get("kind")?.as_array()?.iter().filter_map(|kind| kind.as_str().map(str::to_string)).collect(),
        test: message.get("profile").and_then(|profile| profile.get("test")).and_then(Json::as_bool).unwrap_or(false),
        executable: PathBuf::from(message.get("executable")?.as_str()?),
    })
}

/// Runs a cargo build `command` with JSON messages (diagnostics still rendered on stderr) and
/// returns the executables it made for the workspace root's package (`mok`).
fn build_executables(root: &Path, command: &mut Command) -> Result<Vec<Artifact>> {
    build_executables_of(&root.join("Cargo.toml"), command)
}

/// As [`build_executables`], for the package whose manifest is `manifest`.
fn build_executables_of(manifest: &Path, command: &mut Command) -> Result<Vec<Artifact>> {
    command.arg("--message-format=json-render-diagnostics").stdout(Stdio::piped());
    // The bundle tests the kernels of this tree, not the shipped PTX (the two are equal once
    // `cargo xtask ptx --ship` ran; `cargo xtask test` checks that).
    command.env("MOK_BUILD_KERNELS", "1");
    // ... and with the cubins the pinned ptxas makes of them (as shipped), so the GPU runs load
    // the cubin as a user's build does (`build.rs`; without ptxas it would embed none).
    command.env(crate::ptx_builder::PTXAS_ENV, crate::setup::ptxas_path()?);
    // The driver bindings that every GPU run so far used, unless the caller picks others.
    if env::var_os("CUDARC_CUDA_VERSION").is_none() {
        command.env("CUDARC_CUDA_VERSION", "12080");
    }
    let described = describe(command);
    println!("gpu-bundle: {described}");
    let mut child = command.spawn().with_context(|| format!("cannot start `{described}`"))?;
    let stdout = child.stdout.take().context("no stdout pipe")?;
    let manifest = canonical(manifest);
    let mut artifacts = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.with_context(|| format!("reading the output of `{described}`"))?;
        if !line.starts_with('{') {
            continue;
        }
        let message =
            json::parse(&line).map_err(|why| anyhow::anyhow!("`{described}` printed bad JSON ({why}): {line}"))?;
        if let Some(artifact) = artifact_of(&message)
            && canonical(&artifact.manifest_path) == manifest
        {
            artifacts.push(artifact);
        }
    }
    let status = child.wait().with_context(|| format!("waiting for `{described}`"))?;
    if !status.success() {
        bail!("`{described}` failed ({status})");
    }
    Ok(artifacts)
}

/// Builds the bench binary `name` of the facade (release, GPU tests' features, as the bundle
/// builds it) and returns its path.
pub fn build_bench(root: &Path, name: &str) -> Result<PathBuf> {
    let artifacts = build_executables(root, cargo(root).args(["build", "--bench", name]).args(BUILD_ARGS))?;
    artifacts
        .into_iter()
        .find(|a| a.target_name == name && a.kinds.iter().any(|k| k == "bench"))
        .map(|a| a.executable)
        .with_context(|| format!("cargo built no bench named {name}"))
}

fn canonical(path: &Path) -> PathBuf {
    fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// Copies `from` to `to` and strips its debug info when `strip` is available.
fn install(from: &Path, to: &Path, strip: bool) -> Result<()> {
    fs::copy(from, to).with_context(|| format!("cannot copy {} to {}", from.display(), to.display()))?;
    if strip {
        crate::run(Command::new("strip").arg("--strip-debug").arg(to))?;
    }
    Ok(())
}

/// Installs `from` as `to.gz`, compressed and not executable (run.sh unpacks it to `to` before
/// running anything), for binaries too large to carry as they are.
fn pack(from: &Path, to: &Path, strip: bool) -> Result<()> {
    install(from, to, strip)?;
    crate::run(Command::new("gzip").args(["-9", "-f"]).arg(to))?;
    let mut packed = to.as_os_str().to_owned();
    packed.push(".gz");
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&packed, fs::Permissions::from_mode(0o644))
        .with_context(|| format!("cannot chmod {}", Path::new(&packed).display()))
}

fn dir_size(path: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in fs::read_dir(path).with_context(|| format!("cannot list {}", path.display()))? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            total += dir_size(&entry.path())?;
        } else if kind.is_file() {
            total += entry.metadata()?.len();
        }
    }
    Ok(total)
}

pub fn gpu_bundle(root: &Path, out: PathBuf) -> Result<()> {
    let out = if out.is_absolute() { out } else { env::current_dir().context("no current folder")?.join(out) };
    let tests_dir = out.join("tests");
    let benches_dir = out.join("benches");
    let bin_dir = out.join("bin");
    // Replace what an earlier bundle left; leave anything else in the folder alone.
    for dir in [&tests_dir, &benches_dir, &bin_dir] {
        if dir.exists() {
            fs::remove_dir_all(dir).with_context(|| format!("cannot remove {}", dir.display()))?;
        }
        fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let strip = Command::new("strip")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !strip {
        println!("gpu-bundle: `strip` not found: the binaries keep their line tables");
    }

    // 1. Test binaries: every libtest harness of `mok` (integration tests and unit tests).
    let tests = build_executables(root, cargo(root).args(["test", "--no-run"]).args(BUILD_ARGS))?;
    let mut names = Vec::new();
    for artifact in tests.iter().filter(|artifact| artifact.test) {
        let kind = artifact.kinds.first().map_or("unknown", String::as_str);
        // Integration tests keep their name; a lib's or bin's unit tests get the kind appended.
        let name =
            if kind == "test" { artifact.target_name.clone() } else { format!("{}-{kind}", artifact.target_name) };
        if names.contains(&name) {
            bail!("two test binaries are both named `{name}`");
        }
        install(&artifact.executable, &tests_dir.join(&name), strip)?;
        names.push(name);
    }

    // 1b. The burn integration's GPU test (its own workspace), as `tests/burn_gpu`.
    let burn = root.join("integrations").join("burn").join("Cargo.toml");
    let burn_target = root.join("target").join("burn");
    let mut command = cargo(root);
    command.args(["test", "--no-run", "--release", "--features", "gpu-tests", "--manifest-path"]).arg(&burn);
    command.arg("--target-dir").arg(&burn_target);
    let burn_tests = build_executables_of(&burn, &mut command)?;
    for artifact in burn_tests.iter().filter(|a| a.test && a.target_name == "gpu") {
        // ~36 MB: it travels compressed (run.sh unpacks it), so the bundle stays within what a
        // device call carries.
        pack(&artifact.executable, &tests_dir.join("burn_gpu"), strip)?;
        names.push("burn_gpu (gzip)".into());
    }
    // The burn example, as `bin/burn-train` (compressed the same way).
    let mut command = cargo(root);
    command.args(["build", "--release", "--example", "train", "--manifest-path"]).arg(&burn);
    command.arg("--target-dir").arg(&burn_target);
    let burn_examples = build_executables_of(&burn, &mut command)?;
    for artifact in burn_examples.iter().filter(|a| a.target_name == "train" && a.kinds.iter().any(|k| k == "example"))
    {
        pack(&artifact.executable, &bin_dir.join("burn-train"), strip)?;
    }

    // 2. Bench binaries (`[[bench]]` targets) and the scripts next to their sources.
    // `cargo build --benches` rather than `cargo bench --no-run`: the release profile and the
    // same features as the tests, so the library and its PTX are built once, not once per profile.
    let benches = build_executables(root, cargo(root).args(["build", "--benches"]).args(BUILD_ARGS))?;
    let mut bench_names = Vec::new();
    for artifact in benches.iter().filter(|artifact| artifact.kinds.iter().any(|kind| kind == "bench")) {
        install(&artifact.executable, &benches_dir.join(&artifact.target_name), strip)?;
        bench_names.push(artifact.target_name.clone());
    }
    let bench_sources = root.join("benches");
    if bench_sources.is_dir() {
        for entry in fs::read_dir(&bench_sources).with_context(|| format!("cannot list {}", bench_sources.display()))? {
            let path = entry?.path();
            // Scripts that drive or compare the benches (`*.py`, `*.sh`); they keep their mode.
            if path.is_file() && path.extension().is_some_and(|ext| ext == "py" || ext == "sh") {
                let name = path.file_name().unwrap_or_default();
                fs::copy(&path, benches_dir.join(name)).with_context(|| format!("cannot copy {}", path.display()))?;
                bench_names.push(name.to_string_lossy().into_owned());
            }
        }
    }

    // 3. The demo (and any other binary of `mok`).
    let bins = build_executables(root, cargo(root).args(["build", "--bins"]).args(BUILD_ARGS))?;
    let mut bin_names = Vec::new();
    for artifact in bins.iter().filter(|artifact| artifact.kinds.iter().any(|kind| kind == "bin")) {
        install(&artifact.executable, &bin_dir.join(&artifact.target_name), strip)?;
        bin_names.push(artifact.target_name.clone());
    }

    // xtask itself, so `bin/xtask bench --layer-bin benches/layer` runs the benchmark command on a
    // GPU machine without Rust (the binary is this host's: the same x86-64 Linux).
    let xtask = env::current_exe().context("cannot find the running xtask binary")?;
    install(&xtask, &bin_dir.join("xtask"), strip)?;
    bin_names.push("xtask".into());

    // 4. The runner.
    let run_sh = out.join("run.sh");
    fs::write(&run_sh, RUN_SH).with_context(|| format!("cannot write {}", run_sh.display()))?;
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&run_sh, fs::Permissions::from_mode(0o755))
            .with_context(|| format!("cannot chmod {}", run_sh.display()))?;
    }

    let size = dir_size(&out)?;
    println!("gpu-bundle: {}", out.display());
    println!("  tests/   ({}): {}", names.len(), names.join(" "));
    println!("  benches/ ({}): {}", bench_names.len(), bench_names.join(" "));
    println!("  bin/     ({}): {}", bin_names.len(), bin_names.join(" "));
    println!("  run.sh   (usage: run.sh [--bench] [TEST-ARGS...])");
    println!("gpu-bundle: size {:.1} MiB ({size} bytes)", size as f64 / (1024.0 * 1024.0));
    Ok(())
}

/// The most a device call carries with the working tree (the device tool's limit).
pub const CARRY_LIMIT_BYTES: u64 = 64 * 1024 * 1024;

/// What [`gpu_subset`] copies out of a bundle.
#[derive(Clone, Debug, Default)]
pub struct SubsetArgs {
    /// The bundle (`cargo xtask gpu-bundle`'s output).
    pub from: PathBuf,
    /// The folder to fill (its `tests/` and `benches/` are replaced).
    pub out: PathBuf,
    /// Test binaries by name (`gpu_unfused`, `burn_gpu`, ...), packed with gzip.
    pub tests: Vec<String>,
    /// Bench binaries by name (`layer`, ...); the bundle's bench scripts always come along.
    pub benches: Vec<String>,
    /// Extra files (PTX variants for `MOK_PTX`, ...), copied into the folder's top level.
    pub files: Vec<PathBuf>,
}

/// `cargo xtask gpu-subset`: the part of a bundle one device call needs — `run.sh`, the named
/// test binaries (gzipped; run.sh unpacks them), the named bench binaries with every bench
/// script, and extra files — in a folder, refused if it exceeds what a call carries. Prints the
/// size and the `carry` entry to name (the folder relative to `root`, which must be one git
/// ignores: a carried path is an ignored one).
pub fn gpu_subset(root: &Path, args: &SubsetArgs) -> Result<u64> {
    let (tests_dir, benches_dir) = (args.out.join("tests"), args.out.join("benches"));
    for dir in [&tests_dir, &benches_dir] {
        if dir.exists() {
            fs::remove_dir_all(dir).with_context(|| format!("cannot remove {}", dir.display()))?;
        }
        fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let run_sh = args.from.join("run.sh");
    fs::copy(&run_sh, args.out.join("run.sh"))
        .with_context(|| format!("no {} (build the bundle first)", run_sh.display()))?;
    for name in &args.tests {
        let (plain, packed) = (args.from.join("tests").join(name), args.from.join("tests").join(format!("{name}.gz")));
        if packed.is_file() {
            fs::copy(&packed, tests_dir.join(format!("{name}.gz")))?;
        } else if plain.is_file() {
            // The bundle's binaries are stripped already.
            pack(&plain, &tests_dir.join(name), false)?;
        } else {
            bail!("the bundle has no test binary {name:?} (in {})", args.from.join("tests").display());
        }
    }
    let bench_sources = args.from.join("benches");
    for entry in fs::read_dir(&bench_sources).with_context(|| format!("cannot list {}", bench_sources.display()))? {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let script = path.extension().is_some_and(|ext| ext == "py" || ext == "sh");
        if path.is_file() && (script || args.benches.contains(&name)) {
            fs::copy(&path, benches_dir.join(&name)).with_context(|| format!("cannot copy {}", path.display()))?;
        }
    }
    for name in &args.benches {
        if !benches_dir.join(name).is_file() {
            bail!("the bundle has no bench binary {name:?} (in {})", bench_sources.display());
        }
    }
    for file in &args.files {
        let name = file.file_name().with_context(|| format!("{} names no file", file.display()))?;
        fs::copy(file, args.out.join(name)).with_context(|| format!("cannot copy {}", file.display()))?;
    }
    let size = dir_size(&args.out)?;
    if size > CARRY_LIMIT_BYTES {
        bail!(
            "{} holds {:.1} MiB, more than the {} MiB a device call carries: name fewer binaries",
            args.out.display(),
            size as f64 / (1024.0 * 1024.0),
            CARRY_LIMIT_BYTES / (1024 * 1024)
        );
    }
    let relative = canonical(&args.out).strip_prefix(canonical(root)).map(Path::to_path_buf).ok();
    let ignored = relative.as_ref().is_some_and(|r| {
        Command::new("git").arg("-C").arg(root).args(["check-ignore", "-q"]).arg(r).status().is_ok_and(|s| s.success())
    });
    println!("gpu-subset: {} ({:.1} MiB)", args.out.display(), size as f64 / (1024.0 * 1024.0));
    match relative {
        Some(r) if ignored => println!("gpu-subset: carry [\"{}\"], then run from there (cd {0})", r.display()),
        _ => println!("gpu-subset: not an ignored folder of the repository: a device call cannot carry it"),
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subset_takes_the_named_binaries_and_every_script_and_refuses_unknown_ones() {
        let scratch = env::temp_dir().join(format!("mok-subset-{}", std::process::id()));
        let (from, out) = (scratch.join("bundle"), scratch.join("out"));
        for dir in ["tests", "benches", "bin"] {
            fs::create_dir_all(from.join(dir)).unwrap();
        }
        fs::write(from.join("run.sh"), "#!/bin/sh\n").unwrap();
        fs::write(from.join("tests/gpu_unfused"), vec![7u8; 4096]).unwrap();
        fs::write(from.join("tests/gpu_api"), b"api").unwrap();
        fs::write(from.join("tests/burn_gpu.gz"), b"packed").unwrap();
        fs::write(from.join("benches/layer"), b"bench").unwrap();
        fs::write(from.join("benches/gemm"), b"other bench").unwrap();
        fs::write(from.join("benches/torch_moe.py"), b"print()").unwrap();
        fs::write(scratch.join("variant.ptx"), b".version 8.8").unwrap();
        let args = SubsetArgs {
            from: from.clone(),
            out: out.clone(),
            tests: vec!["gpu_unfused".into(), "burn_gpu".into()],
            benches: vec!["layer".into()],
            files: vec![scratch.join("variant.ptx")],
        };
        let size = gpu_subset(&scratch, &args).unwrap();
        assert!(size > 0 && size < CARRY_LIMIT_BYTES);
        assert!(out.join("run.sh").is_file() && out.join("variant.ptx").is_file());
        assert!(out.join("tests/gpu_unfused.gz").is_file() && out.join("tests/burn_gpu.gz").is_file());
        assert!(!out.join("tests/gpu_api.gz").exists() && !out.join("tests/gpu_unfused").exists());
        assert!(out.join("benches/layer").is_file() && out.join("benches/torch_moe.py").is_file());
        assert!(!out.join("benches/gemm").exists());
        let missing = SubsetArgs { tests: vec!["gpu_nothing".into()], ..args.clone() };
        assert!(gpu_subset(&scratch, &missing).unwrap_err().to_string().contains("no test binary \"gpu_nothing\""));
        let missing = SubsetArgs { benches: vec!["nothing".into()], ..args };
        assert!(gpu_subset(&scratch, &missing).unwrap_err().to_string().contains("no bench binary \"nothing\""));
        fs::remove_dir_all(&scratch).unwrap();
    }
}
