//! Hands the kernels' PTX for sm_90a and sm_100a, and ptxas's cubin of each, to `src/lib.rs`
//! through `OUT_DIR`.
//!
//! By default it copies the PTX and cubins shipped in `src/ptx/` (committed, byte-identical to
//! a fresh build: `cargo xtask test` checks it), so a downstream build needs only stable Rust
//! and no kernel toolchain; docs.rs (`DOCS_RS`) always takes this path. With
//! `MOK_BUILD_KERNELS=1` it builds the kernels (`kernels/`) with the pinned nightly instead; the
//! same executable then also serves as rustc's NVPTX linker (see `kernels/ptx_builder.rs`). The
//! cubins of that build come from the ptxas that `MOK_PTXAS` names; without it they are left
//! empty, and the driver JIT-compiles the PTX at load (a stale shipped cubin must never run
//! beside fresh PTX). `cargo xtask gpu-bundle` builds that way with the pinned ptxas, and
//! `cargo xtask ptx --ship` refreshes the shipped files after a kernel change.

#[path = "kernels/ptx_builder.rs"]
mod ptx_builder;

use std::env;
use std::path::PathBuf;

fn main() {
    ptx_builder::run_as_linker_if_requested();

    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-env-changed=MOK_BUILD_KERNELS");
    println!("cargo:rerun-if-env-changed=DOCS_RS");
    let build_kernels = env::var_os("MOK_BUILD_KERNELS").is_some_and(|v| v == "1") && env::var_os("DOCS_RS").is_none();

    if !build_kernels {
        for name in ptx_builder::ALL_ARCHS.iter().flat_map(|arch| [arch.file_name, arch.cubin_name]) {
            let shipped = manifest_dir.join("src").join("ptx").join(name);
            println!("cargo:rerun-if-changed=src/ptx/{name}");
            if let Err(error) = std::fs::copy(&shipped, out_dir.join(name)) {
                eprintln!(
                    "mok: cannot copy the shipped kernels {} ({error}); build them with MOK_BUILD_KERNELS=1",
                    shipped.display()
                );
                std::process::exit(1);
            }
        }
        return;
    }

    let kernels_dir = manifest_dir.join("kernels");
    println!("cargo:rerun-if-changed=kernels/src");
    println!("cargo:rerun-if-changed=kernels/Cargo.toml");
    println!("cargo:rerun-if-changed=kernels/ptx_builder.rs");
    println!("cargo:rerun-if-env-changed={}", ptx_builder::PTXAS_ENV);
    let ptxas = env::var_os(ptx_builder::PTXAS_ENV).filter(|v| !v.is_empty()).map(PathBuf::from);
    let linker = env::current_exe().expect("build script knows its own path");
    for arch in ptx_builder::ALL_ARCHS {
        let cubin = out_dir.join(arch.cubin_name);
        let built =
            ptx_builder::build_ptx(&kernels_dir, &out_dir.join("kernels-target"), &out_dir, arch, &linker, false)
                .and_then(|ptx| match &ptxas {
                    Some(ptxas) => ptx_builder::assemble_cubin(ptxas, arch, &ptx, &cubin).map(drop),
                    // No cubin: the driver JIT-compiles the fresh PTX.
                    None => std::fs::write(&cubin, b"").map_err(|e| format!("cannot write {}: {e}", cubin.display())),
                });
        if let Err(message) = built {
            // One line that names the fix; cargo prints the script's stderr under the failure.
            eprintln!("mok: {message}");
            std::process::exit(1);
        }
    }
}
