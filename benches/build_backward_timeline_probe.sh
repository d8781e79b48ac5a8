#!/usr/bin/env bash
# Builds the backward-timeline probe into DIR (default target/backward-timeline-probe):
# benches/probes/backward-timeline.patch makes every block of the one-GPU backward megakernel
# stamp `%globaltimer` at the end of each of its phases (gather, SwiGLU chunks, the data
# gradients, the weight gradients, the final cluster barrier, the dx combine) into a buffer the
# host allocates with MOK_BACKWARD_TRACE=1, and the `layer` bench print, after each backward
# timing, the last launch's stamps over the blocks (min / p10 / median / p90 / max µs from the
# launch's first start) and the per-block phase lengths. Timing only: the stamps add a store
# per phase end. Restores kernels/, host/, benches/layer.rs and src/ptx/ afterwards; bundle/ is
# left with the patched build. One bundle build (~8 minutes). Run from the repository root on a
# clean tree; then, with carry ["DIR relative to the repository"]:
#   MOK_BACKWARD_TRACE=1 DIR/benches/layer --cases kimi:8192,qwen:8192 --gemm megakernels \
#       | grep "MOKTRACE\|| megakernels"
set -euo pipefail
dir="$(realpath -m "${1:-target/backward-timeline-probe}")"
git diff --quiet -- kernels host src benches/layer.rs || { echo "kernels/, host/, src/ or benches/layer.rs has uncommitted changes" >&2; exit 1; }
rm -rf "$dir"
mkdir -p "$(dirname "$dir")"
trap 'git checkout -q -- kernels host src benches/layer.rs; cargo xtask ptx > /dev/null 2>&1 || true' EXIT
git apply benches/probes/backward-timeline.patch
cargo xtask ptx --ship > /dev/null
grep -E "mok_sm90_backward " target/ptx/ptxas-report.txt
cargo xtask gpu-bundle > "$dir.bundle.log" 2>&1 || { tail -20 "$dir.bundle.log" >&2; exit 1; }
cargo xtask gpu-subset --out "$dir" --tests gpu_unfused --benches layer
du -sh "$dir"
