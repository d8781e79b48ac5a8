//! Builds the kernels (`kernels/`) to PTX for sm_90a and sm_100a with the pinned nightly, and
//! hands the files to `src/lib.rs` through `OUT_DIR`. The rest of the workspace builds on
//! stable: only this step drives the nightly. The same executable also serves as rustc's
//! NVPTX linker (see `kernels/ptx_builder.rs`).

#[path = "kernels/ptx_builder.rs"]
mod ptx_builder;

use std::env;
use std::path::PathBuf;

fn main() {
    ptx_builder::run_as_linker_if_requested();

    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let kernels_dir = manifest_dir.join("kernels");
    println!("cargo:rerun-if-changed=kernels/src");
    println!("cargo:rerun-if-changed=kernels/Cargo.toml");
    println!("cargo:rerun-if-changed=kernels/ptx_builder.rs");

    let linker = env::current_exe().expect("build script knows its own path");
    for arch in ptx_builder::ALL_ARCHS {
        if let Err(message) =
            ptx_builder::build_ptx(&kernels_dir, &out_dir.join("kernels-target"), &out_dir, arch, &linker, false)
        {
            // One line that names the fix; cargo prints the script's stderr under the failure.
            eprintln!("mok: {message}");
            std::process::exit(1);
        }
    }
}
