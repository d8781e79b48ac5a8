//! `cargo xtask setup`: the kernel toolchain and ptxas, each installed only when missing.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, anyhow, bail, ensure};

use crate::ptx_builder::{self, KERNEL_TOOLCHAIN, PTXAS_ENV};
use crate::{capture, describe, run};

/// The ptxas release: CUDA 13.0, which the GPU machine's driver supports.
pub const PTXAS_VERSION: &str = "13.0.88";
/// The PyPI wheel that ships it.
const PTXAS_WHEEL: &str = "nvidia-cuda-nvcc";
/// ptxas's path inside the wheel.
const PTXAS_IN_WHEEL: &str = "nvidia/cu13/bin/ptxas";
/// Overrides the cache folder (default `~/.cache/mok`).
const CACHE_ENV: &str = "MOK_CACHE_DIR";

/// Installs what is missing and prints where everything is.
pub fn setup() -> Result<()> {
    ensure_toolchain()?;
    ensure_ptxas()?;
    Ok(())
}

fn non_empty_var(name: &str) -> Option<PathBuf> {
    env::var_os(name).filter(|value| !value.is_empty()).map(PathBuf::from)
}

/// Where xtask keeps downloads: `$MOK_CACHE_DIR`, else `~/.cache/mok`.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(dir) = non_empty_var(CACHE_ENV) {
        return Ok(dir);
    }
    let home = non_empty_var("HOME").ok_or_else(|| anyhow!("neither {CACHE_ENV} nor HOME is set"))?;
    Ok(home.join(".cache").join("mok"))
}

fn ptxas_install_dir() -> Result<PathBuf> {
    Ok(cache_dir()?.join(format!("ptxas-{PTXAS_VERSION}")))
}

/// The ptxas to use: `$MOK_PTXAS`, else the one `setup` installs. Errors name the fix.
pub fn ptxas_path() -> Result<PathBuf> {
    if let Some(path) = non_empty_var(PTXAS_ENV) {
        return Ok(path);
    }
    let path = ptxas_install_dir()?.join(PTXAS_IN_WHEEL);
    ensure!(
        path.is_file(),
        "ptxas is not installed at {}: run `cargo xtask setup` (or set {PTXAS_ENV})",
        path.display()
    );
    Ok(path)
}

/// `ptxas --version`'s release line, e.g. `Cuda compilation tools, release 13.0, V13.0.88`.
pub fn ptxas_version(ptxas: &Path) -> Result<String> {
    let mut command = Command::new(ptxas);
    command.arg("--version");
    let output = capture(&mut command)?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "`{}` failed ({}): {}{}",
            describe(&command),
            output.status,
            stdout,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let mut lines = stdout.lines().map(str::trim).filter(|line| !line.is_empty());
    let line = lines.clone().find(|line| line.contains("release")).or_else(|| lines.next_back()).unwrap_or("");
    ensure!(!line.is_empty(), "`{}` printed nothing", describe(&command));
    Ok(line.to_string())
}

/// The kernel toolchain with rust-src and llvm-tools; returns the LLVM tools folder.
fn ensure_toolchain() -> Result<PathBuf> {
    match ptx_builder::llvm_tools_dir() {
        Ok(bin) => {
            println!("setup: toolchain {KERNEL_TOOLCHAIN} with rust-src and llvm-tools: present ({})", bin.display());
            return Ok(bin);
        }
        Err(why) => println!("setup: {why}\nsetup: installing {KERNEL_TOOLCHAIN}"),
    }
    run(Command::new("rustup")
        .args(["toolchain", "install", KERNEL_TOOLCHAIN, "--profile", "minimal", "-c", "rust-src", "-c", "llvm-tools"])
        .env_remove("RUSTUP_TOOLCHAIN"))?;
    if ptx_builder::llvm_tools_dir().is_err() {
        // An already-installed toolchain may not get the components from `toolchain install`.
        run(Command::new("rustup")
            .args(["component", "add", "--toolchain", KERNEL_TOOLCHAIN, "rust-src", "llvm-tools"])
            .env_remove("RUSTUP_TOOLCHAIN"))?;
    }
    let bin = ptx_builder::llvm_tools_dir().map_err(|why| anyhow!("after installing: {why}"))?;
    println!("setup: toolchain {KERNEL_TOOLCHAIN}: installed ({})", bin.display());
    Ok(bin)
}

/// ptxas: `$MOK_PTXAS` if set, else the cached copy, downloaded from PyPI when missing.
fn ensure_ptxas() -> Result<PathBuf> {
    if let Some(path) = non_empty_var(PTXAS_ENV) {
        let version = ptxas_version(&path).with_context(|| format!("{PTXAS_ENV}={} does not run", path.display()))?;
        println!("setup: ptxas from {PTXAS_ENV}: {} ({version})", path.display());
        return Ok(path);
    }
    let install_dir = ptxas_install_dir()?;
    let ptxas = install_dir.join(PTXAS_IN_WHEEL);
    if ptxas.is_file() {
        match ptxas_version(&ptxas) {
            Ok(version) => {
                println!("setup: ptxas {PTXAS_VERSION}: present ({}, {version})", ptxas.display());
                return Ok(ptxas);
            }
            Err(why) => {
                println!("setup: the cached ptxas does not run ({why:#}); installing it again")
            }
        }
    }

    // Download and unpack into a folder of our own, then move it into place: an interrupted run
    // never leaves a half-made install behind.
    let cache = cache_dir()?;
    let staging = cache.join(format!("ptxas-{PTXAS_VERSION}.partial-{}", std::process::id()));
    if staging.exists() {
        fs::remove_dir_all(&staging).with_context(|| format!("cannot remove {}", staging.display()))?;
    }
    let wheel_dir = staging.join("wheel");
    let unpack_dir = staging.join("unpacked");
    fs::create_dir_all(&wheel_dir).with_context(|| format!("cannot create {}", wheel_dir.display()))?;
    println!("setup: downloading {PTXAS_WHEEL}=={PTXAS_VERSION} from PyPI for ptxas");
    let result = (|| -> Result<()> {
        run(Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"])
            .args(["--platform", "manylinux2014_x86_64", "--python-version", "3.11"])
            .arg(format!("{PTXAS_WHEEL}=={PTXAS_VERSION}"))
            .arg("-d")
            .arg(&wheel_dir))?;
        let wheel = fs::read_dir(&wheel_dir)
            .with_context(|| format!("cannot list {}", wheel_dir.display()))?
            .filter_map(|entry| entry.ok().map(|entry| entry.path()))
            .find(|path| path.extension().is_some_and(|ext| ext == "whl"))
            .ok_or_else(|| anyhow!("pip downloaded no wheel into {}", wheel_dir.display()))?;
        run(Command::new("python3")
            .args(["-c", "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])"])
            .arg(&wheel)
            .arg(PTXAS_IN_WHEEL)
            .arg(&unpack_dir))?;
        let unpacked = unpack_dir.join(PTXAS_IN_WHEEL);
        make_executable(&unpacked)?;
        let version = ptxas_version(&unpacked)?;
        ensure!(
            version.contains(PTXAS_VERSION),
            "{} reports `{version}`, expected {PTXAS_VERSION}",
            unpacked.display()
        );
        if install_dir.exists() {
            fs::remove_dir_all(&install_dir).with_context(|| format!("cannot remove {}", install_dir.display()))?;
        }
        fs::rename(&unpack_dir, &install_dir)
            .with_context(|| format!("cannot move {} to {}", unpack_dir.display(), install_dir.display()))?;
        println!("setup: ptxas {PTXAS_VERSION}: installed ({}, {version})", ptxas.display());
        Ok(())
    })();
    let _ = fs::remove_dir_all(&staging);
    result.context("installing ptxas")?;
    Ok(ptxas)
}

fn make_executable(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))
        .with_context(|| format!("cannot chmod {}", path.display()))
}
