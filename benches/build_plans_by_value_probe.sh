#!/usr/bin/env bash
# Builds the plans-by-value probe of docs/PERF.md ("The tile lookups after every L1
# invalidation", its last paragraph) into DIR (default target/plans-by-value-probe):
# benches/probes/plans-by-value.patch passes the one-GPU forward megakernel's four plans by
# value as a kernel argument (`ForwardPlans`, read from the constant bank) instead of reading
# them from global memory, whose L1 lines the megakernel's fences invalidate at every tile. The
# entry point's parameters change, so the probe needs its own host: DIR/base holds the tree's
# bundle subset and DIR/probe the patched one (each its own `layer` bench and tests, each with
# its own embedded PTX). Restores kernels/, host/ and src/ptx/ afterwards; bundle/ is left with
# the patched build (rebuild it for anything else). Takes two bundle builds (~15 minutes). Run
# from the repository root on a clean tree; then, with carry ["DIR relative to the repository"]:
#   cd DIR && (cd probe && ./run.sh forward_megakernel moe_layer megakernel_is_bitwise) &&
#   for i in 1 2; do for b in probe base; do $b/benches/layer --cases kimi:8192,qwen:8192 \
#       --gemm engine,megakernel | grep "| megakernel\|| engine" | sed "s/^/$b /"; done; done
# and the probe's sanitizers: (cd probe && ./run.sh --sanitize forward_megakernel_is_bitwise).
set -euo pipefail
dir="$(realpath -m "${1:-target/plans-by-value-probe}")"
git diff --quiet -- kernels host src || { echo "kernels/, host/ or src/ has uncommitted changes" >&2; exit 1; }
rm -rf "$dir/base" "$dir/probe"
mkdir -p "$dir"
subset() {
    cargo xtask gpu-bundle > "$dir/$1-bundle.log" 2>&1 || { tail -20 "$dir/$1-bundle.log" >&2; exit 1; }
    cargo xtask gpu-subset --out "$dir/$1" --tests gpu_unfused,gpu_api --benches layer
}
subset base
trap 'git checkout -q -- kernels host src; cargo xtask ptx > /dev/null 2>&1 || true' EXIT
git apply benches/probes/plans-by-value.patch
cargo xtask ptx --ship > /dev/null
grep -E "mok_sm90_forward " target/ptx/ptxas-report.txt
subset probe
du -sh "$dir"
