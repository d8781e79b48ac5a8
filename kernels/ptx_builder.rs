//! Builds `mok-kernels` into PTX with rustc's NVPTX backend and a bitcode link step of our own.
//!
//! Shared by the `mok` facade's `build.rs` and by `xtask` (both `#[path]`-include this file), so
//! the PTX that ships and the PTX that `cargo xtask ptx` checks are made by the same code.
//!
//! Why a link step of our own: the `nvptx64-nvidia-cuda` target's default linker,
//! `llvm-bitcode-linker`, is a rustup component that cannot be installed on our machines. Its job
//! is small: `llvm-link` the bitcode objects rustc hands over, `opt` (internalize everything but
//! the exported kernels, then O3), `llc` to PTX. The executable that runs this file (the build
//! script or xtask) re-invokes itself as rustc's linker with `MOK_PTX_LINK=1` set; see
//! [`run_as_linker_if_requested`].

#![allow(dead_code)]

use std::env;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The pinned nightly that compiles the kernels (BRIEF §5).
pub const KERNEL_TOOLCHAIN: &str = "nightly-2026-05-20";

/// The command that installs the toolchain, printed when it is missing.
pub const INSTALL_HINT: &str =
    "cargo xtask setup  (or: rustup toolchain install nightly-2026-05-20 --profile minimal -c rust-src -c llvm-tools)";

/// One GPU architecture the kernels are built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PtxArch {
    /// `-C target-cpu` / `llc -mcpu` name.
    pub sm: &'static str,
    /// The PTX ISA version feature: the lowest that has the instructions we use on that chip
    /// (wgmma and setmaxnreg need PTX 8.0 on sm_90a, device-side tensor-map edits 8.3;
    /// sm_100a needs 8.6).
    pub ptx_feature: &'static str,
    /// File name of the PTX in the output folder.
    pub file_name: &'static str,
    /// File name of ptxas's cubin of that PTX, beside it ([`assemble_cubin`]).
    pub cubin_name: &'static str,
}

/// Hopper (H100, H200), with the `a` features (wgmma, setmaxnreg).
pub const SM90A: PtxArch =
    PtxArch { sm: "sm_90a", ptx_feature: "+ptx83", file_name: "mok_sm90a.ptx", cubin_name: "mok_sm90a.cubin" };
/// Blackwell (B200, GB200, GB300).
pub const SM100A: PtxArch =
    PtxArch { sm: "sm_100a", ptx_feature: "+ptx86", file_name: "mok_sm100a.ptx", cubin_name: "mok_sm100a.cubin" };
/// Every architecture mok ships.
pub const ALL_ARCHS: [PtxArch; 2] = [SM90A, SM100A];

const LINK_MODE_ENV: &str = "MOK_PTX_LINK";
const LLVM_BIN_ENV: &str = "MOK_PTX_LLVM_BIN";
const PTX_FEATURE_ENV: &str = "MOK_PTX_FEATURE";

/// If this process was started by rustc as the NVPTX linker, does the link and exits.
/// Call it first thing in `main`.
pub fn run_as_linker_if_requested() {
    if env::var_os(LINK_MODE_ENV).is_none() {
        return;
    }
    match link(env::args_os().skip(1).collect()) {
        Ok(()) => std::process::exit(0),
        Err(message) => {
            eprintln!("mok ptx link: {message}");
            std::process::exit(1);
        }
    }
}

fn link(args: Vec<OsString>) -> Result<(), String> {
    let mut inputs = Vec::new();
    let mut exports = Vec::new();
    let mut output = None;
    let mut target_cpu = None;
    let mut iter = args.into_iter();
    while let Some(arg) = iter.next() {
        let text = arg.to_string_lossy().into_owned();
        match text.as_str() {
            "-o" => output = iter.next().map(PathBuf::from),
            "--export-symbol" => exports.extend(iter.next().map(|s| s.to_string_lossy().into_owned())),
            "--target-cpu" => target_cpu = iter.next().map(|s| s.to_string_lossy().into_owned()),
            // rustc also passes e.g. `--target`, `--fallback-arch`, `--bitcode-linker`-style
            // options that carry a value; unknown flags are ignored with their value only when
            // they are not input files.
            "--target" | "--fallback-arch" | "-L" => {
                iter.next();
            }
            _ if text.starts_with('-') => {}
            _ => inputs.push(PathBuf::from(arg)),
        }
    }
    let output = output.ok_or("rustc passed no `-o`")?;
    let target_cpu = target_cpu.ok_or("rustc passed no `--target-cpu`")?;
    if exports.is_empty() {
        return Err("no `--export-symbol`: the kernel crate exports no `extern \"ptx-kernel\"` fn".into());
    }
    let llvm_bin = PathBuf::from(env::var_os(LLVM_BIN_ENV).ok_or("MOK_PTX_LLVM_BIN unset")?);
    let ptx_feature = env::var(PTX_FEATURE_ENV).map_err(|_| "MOK_PTX_FEATURE unset")?;

    // rustc hands over the crate's bitcode objects and the rlibs of `core` and
    // `compiler_builtins`, whose members are bitcode too (plus a `lib.rmeta` to skip); it also
    // names library folders, which carry nothing for us.
    let unpack_dir = output.with_extension("rlib-members");
    let mut objects = Vec::new();
    for input in inputs.iter().filter(|path| path.is_file()) {
        if input.extension().is_some_and(|ext| ext == "rlib") {
            let member_dir = unpack_dir.join(input.file_stem().unwrap_or_default());
            let _ = fs::remove_dir_all(&member_dir);
            fs::create_dir_all(&member_dir).map_err(|e| format!("cannot create {}: {e}", member_dir.display()))?;
            run(Command::new(llvm_bin.join("llvm-ar")).arg("x").arg(input).arg("--output").arg(&member_dir))?;
            let mut members: Vec<PathBuf> = fs::read_dir(&member_dir)
                .map_err(|e| format!("cannot list {}: {e}", member_dir.display()))?
                .filter_map(|entry| entry.ok().map(|entry| entry.path()))
                .filter(|path| path.extension().is_some_and(|ext| ext == "o"))
                .collect();
            // Directory order is arbitrary; sorted names keep the link, and the PTX, reproducible.
            members.sort();
            objects.extend(members);
        } else {
            objects.push(input.clone());
        }
    }
    let merged = output.with_extension("linked.bc");
    let optimized = output.with_extension("opt.bc");
    run(Command::new(llvm_bin.join("llvm-link"))
        .arg(&objects[0])
        .arg("--only-needed")
        .args(&objects[1..])
        .arg("-o")
        .arg(&merged))?;
    exports.sort();
    run(Command::new(llvm_bin.join("opt"))
        .arg(format!("--internalize-public-api-list={}", exports.join(",")))
        .arg("--passes=internalize,globaldce,default<O3>")
        .arg(&merged)
        .arg("-o")
        .arg(&optimized))?;
    run(Command::new(llvm_bin.join("llc"))
        .arg(format!("-mcpu={target_cpu}"))
        .arg(format!("-mattr={ptx_feature}"))
        .arg("-O3")
        .arg(&optimized)
        .arg("-o")
        .arg(&output))
}

fn run(command: &mut Command) -> Result<(), String> {
    let status = command.status().map_err(|e| format!("cannot start {command:?}: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("{command:?} failed: {status}")) }
}

/// The LLVM tools folder of the kernel toolchain, or an error naming the install command.
pub fn llvm_tools_dir() -> Result<PathBuf, String> {
    let output = Command::new("rustc")
        .arg(format!("+{KERNEL_TOOLCHAIN}"))
        .args(["--print", "sysroot"])
        .env_remove("RUSTC")
        .env_remove("RUSTUP_TOOLCHAIN")
        .output()
        .map_err(|e| format!("cannot run rustc: {e}; install the kernel toolchain with: {INSTALL_HINT}"))?;
    if !output.status.success() {
        return Err(format!("toolchain {KERNEL_TOOLCHAIN} is missing; install it with: {INSTALL_HINT}"));
    }
    let sysroot = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    let bin = sysroot.join("lib/rustlib/x86_64-unknown-linux-gnu/bin");
    let src = sysroot.join("lib/rustlib/src/rust/library/core");
    for tool in ["llvm-link", "opt", "llc"] {
        if !bin.join(tool).exists() {
            return Err(format!("{KERNEL_TOOLCHAIN} lacks llvm-tools ({tool}); install it with: {INSTALL_HINT}"));
        }
    }
    if !src.exists() {
        return Err(format!("{KERNEL_TOOLCHAIN} lacks rust-src; install it with: {INSTALL_HINT}"));
    }
    Ok(bin)
}

/// Builds the kernels for `arch` and copies the PTX to `out_dir/arch.file_name`.
///
/// `kernels_dir` is the `kernels/` crate, `target_dir` a cargo target folder of its own (a
/// nested cargo must not share the outer build's), `linker` the executable that calls
/// [`run_as_linker_if_requested`]. `deny_warnings` turns kernel-crate warnings into errors (the
/// xtask checks use it; a user's build of `mok` does not, so a lint never breaks a dependent).
pub fn build_ptx(
    kernels_dir: &Path,
    target_dir: &Path,
    out_dir: &Path,
    arch: PtxArch,
    linker: &Path,
    deny_warnings: bool,
) -> Result<PathBuf, String> {
    let llvm_bin = llvm_tools_dir()?;
    let mut rustflags = vec![
        format!("-Ctarget-cpu={}", arch.sm),
        // What the final `llc` gets (`-mattr`), named here too so a change of it changes cargo's
        // fingerprint and rebuilds the kernels (the linker's environment is not fingerprinted).
        format!("--cfg=mok_ptx_isa=\"{}\"", arch.ptx_feature),
        format!("-Clinker={}", linker.display()),
        "-Cpanic=abort".to_string(),
        // Architecture-specific code (wgmma on sm_90a, tcgen05 on sm_100a) is gated on this cfg;
        // "a" instructions do not assemble for the other architecture.
        format!("--cfg=mok_arch=\"{}\"", arch.sm),
        // Paths in panic locations and debug info must not depend on where the tree lives, so
        // the same source gives the same PTX bytes.
        format!("--remap-path-prefix={}=mok", kernels_dir.parent().unwrap_or(kernels_dir).display()),
    ];
    if deny_warnings {
        rustflags.push("-Dwarnings".to_string());
    }
    let mut command = Command::new("cargo");
    // The outer cargo's variables point at the stable toolchain and its target folder: drop them.
    for (key, _) in env::vars_os() {
        let key_text = key.to_string_lossy();
        if key_text.starts_with("CARGO_")
            || key_text.starts_with("RUSTC")
            || key_text == "RUSTUP_TOOLCHAIN"
            || key_text == "RUSTFLAGS"
            || key_text == "RUSTDOCFLAGS"
        {
            command.env_remove(&key);
        }
    }
    command
        .arg(format!("+{KERNEL_TOOLCHAIN}"))
        .args([
            "rustc",
            "--release",
            "--lib",
            "--crate-type",
            "cdylib",
            "--target",
            "nvptx64-nvidia-cuda",
            "-Zbuild-std=core",
        ])
        .arg("--manifest-path")
        .arg(kernels_dir.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(target_dir.join(arch.sm))
        .env("CARGO_ENCODED_RUSTFLAGS", rustflags.join("\u{1f}"))
        .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "1")
        .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
        .env("CARGO_PROFILE_RELEASE_INCREMENTAL", "false")
        .env(LINK_MODE_ENV, "1")
        .env(LLVM_BIN_ENV, &llvm_bin)
        .env(PTX_FEATURE_ENV, arch.ptx_feature);
    let status = command
        .status()
        .map_err(|e| format!("cannot run cargo +{KERNEL_TOOLCHAIN}: {e}; install with: {INSTALL_HINT}"))?;
    if !status.success() {
        return Err(format!("kernel build for {} failed ({status})", arch.sm));
    }
    let built = target_dir.join(arch.sm).join("nvptx64-nvidia-cuda/release/mok_kernels.ptx");
    let dest = out_dir.join(arch.file_name);
    fs::create_dir_all(out_dir).map_err(|e| format!("cannot create {}: {e}", out_dir.display()))?;
    let ptx = fs::read_to_string(&built).map_err(|e| format!("cannot read {}: {e}", built.display()))?;
    let ptx = apply_entry_markers(&ptx)?;
    fs::write(&dest, ptx).map_err(|e| format!("cannot write {}: {e}", dest.display()))?;
    Ok(dest)
}

/// The environment variable naming a ptxas: `cargo xtask` uses it instead of the one `setup`
/// installs, and `build.rs`, when it builds the kernels (`MOK_BUILD_KERNELS=1`), assembles the
/// cubins with it (`cargo xtask gpu-bundle` sets it to the pinned ptxas).
pub const PTXAS_ENV: &str = "MOK_PTXAS";

/// Assembles `ptx` (built for `arch`) into the cubin `cubin` with `ptxas`; returns ptxas's
/// report (`-v`: registers, spills, stack per kernel), stdout then stderr.
///
/// The options are fixed here because ptxas records them in the cubin: the same ptxas and the
/// same PTX give the same bytes only with the same options, and the cubin that ships must equal
/// what `cargo xtask ptx` checks.
pub fn assemble_cubin(ptxas: &Path, arch: PtxArch, ptx: &Path, cubin: &Path) -> Result<String, String> {
    let mut command = Command::new(ptxas);
    command.arg(format!("-arch={}", arch.sm)).arg("-v").arg(ptx).arg("-o").arg(cubin);
    let output = command.output().map_err(|e| format!("cannot run {}: {e}", ptxas.display()))?;
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    if !output.status.success() {
        return Err(format!(
            "`{} -arch={} -v {} -o {}` failed ({}):\n{}",
            ptxas.display(),
            arch.sm,
            ptx.display(),
            cubin.display(),
            output.status,
            text.trim_end()
        ));
    }
    Ok(text)
}

/// Markers the kernels leave in their bodies (`ptx::declare_block_threads::<N>()`,
/// `ptx::declare_cluster_blocks::<N>()`) and the entry directive each becomes.
const ENTRY_MARKERS: [(&str, &str); 2] =
    [("// mok:maxntid ", ".maxntid"), ("// mok:reqnctapercluster ", ".reqnctapercluster")];

/// Gives every `.entry` whose body holds a marker `// mok:maxntid N` (or
/// `// mok:reqnctapercluster N`) the directive `.maxntid N, 1, 1` (`.reqnctapercluster N, 1, 1`),
/// between its parameter list and its body, where PTX wants them. Two different values of one
/// marker in a kernel are an error.
pub fn apply_entry_markers(ptx: &str) -> Result<String, String> {
    let lines: Vec<&str> = ptx.lines().collect();
    let starts_function = |line: &str| {
        line.starts_with(".visible .entry ")
            || line.starts_with(".entry ")
            || line.starts_with(".func ")
            || line.starts_with(".visible .func ")
    };
    let mut out = String::with_capacity(ptx.len() + 256);
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let is_entry = line.starts_with(".visible .entry ") || line.starts_with(".entry ");
        if !is_entry {
            out.push_str(line);
            out.push('\n');
            i += 1;
            continue;
        }
        // The parameter list ends at the first line starting with ')'; the body runs to the next
        // entry or function.
        let params_end = (i..lines.len())
            .find(|&j| lines[j].starts_with(')'))
            .ok_or_else(|| format!("unterminated entry: {line}"))?;
        let body_end = (params_end + 1..lines.len()).find(|&j| starts_function(lines[j])).unwrap_or(lines.len());
        for entry_line in &lines[i..=params_end] {
            out.push_str(entry_line);
            out.push('\n');
        }
        for (marker, directive) in ENTRY_MARKERS {
            let mut value: Option<u32> = None;
            for body_line in &lines[params_end + 1..body_end] {
                if let Some(at) = body_line.find(marker) {
                    let text = body_line[at + marker.len()..].trim();
                    let n: u32 = text.parse().map_err(|_| format!("bad marker `{body_line}` in {line}"))?;
                    match value {
                        Some(previous) if previous != n => {
                            return Err(format!("kernel {line} declares {directive} {previous} and {n}"));
                        }
                        _ => value = Some(n),
                    }
                }
            }
            if let Some(n) = value {
                out.push_str(&format!("{directive} {n}, 1, 1\n"));
            }
        }
        i = params_end + 1;
    }
    Ok(out)
}
