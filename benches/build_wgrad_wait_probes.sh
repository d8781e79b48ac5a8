#!/usr/bin/env bash
# Builds the timing probes of docs/PERF.md ("The weight gradients' waits across ranks, probed")
# into DIR (default target/wprobe): variants of the backward megakernels' weight-gradient waits
# (`wait_for_group` and its caller in kernels/src/gemm/hooks.rs), each as NAME.ptx for MOK_PTX.
# Results may be WRONG where a wait is dropped; only the times mean something.
#   first   every wait reads the group's first M tile only
#   gateup  across ranks only the gate and up weight gradients wait (on the SwiGLU counts)
#   down    across ranks only the down weight gradient waits (on the gathered counts)
#   none    no weight-gradient tile waits, in either kernel
#   spin    the waits as a bare acquire spin, no deadline or abort reads
# (`benches/probes/backward-ranks-wgrad-no-waits.patch` is the sixth: none across ranks.) Time
# them from a subset's benches/ folder, e.g.
#   LAYER_ARGS="--ranks 1 --ranks-path" CASES=qwen:32768 GEMM=megakernels \
#     ./compare_layer_ptx.sh base.ptx none.ptx down.ptx down.ptx none.ptx base.ptx
# Run from the repository root.
set -euo pipefail
dir="$(realpath -m "${1:-target/wprobe}")"
mkdir -p "$dir"
hooks=kernels/src/gemm/hooks.rs
caller='                    if gathered || b.work \& WORK_GEMMS != 0 {'
guarded() { echo "s/^$caller/                    if $1 \&\& (gathered || b.work \& WORK_GEMMS != 0) {/"; }
benches/ptx_variant.sh "$dir/first.ptx" $hooks \
    's/        for tile in first_tile\.\.end_tile {/        for tile in first_tile..(first_tile + 1).min(end_tile) {/'
benches/ptx_variant.sh "$dir/gateup.ptx" $hooks "$(guarded '!(RANKS \&\& gathered)')"
benches/ptx_variant.sh "$dir/down.ptx" $hooks "$(guarded '!(RANKS \&\& !gathered)')"
benches/ptx_variant.sh "$dir/none.ptx" $hooks "$(guarded 'false')"
benches/ptx_variant.sh "$dir/spin.ptx" $hooks \
    's/            if let Err(seen) = wait_until(counter, false, timeout_ns, error, |v| v >= expected) {/            let _ = timeout_ns; if let Err(seen) = { while crate::comm::wait::load_acquire(counter, false) < expected {} Ok::<u32, u32>(0) } {/'
