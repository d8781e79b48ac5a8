#!/usr/bin/env bash
# Builds the kernels of docs/PERF.md's v22a–c probes (none shipped) into DIR (default
# target/v22-probes): base.ptx is the tree's own; each benches/probes/NAME.patch, applied to a
# clean kernels/ tree, gives NAME.ptx (results unchanged: they ran the GPU tests before they were
# timed). Restores kernels/ and target/ptx afterwards. Time them with benches/compare_ptx.sh
# (v22a, v22b: the engine kernels) or benches/compare_layer_ptx.sh with GEMM=megakernels (v22c),
# each PTX twice under its own file name. Run from the repository root on a clean kernels/ tree.
set -euo pipefail
dir="$(realpath -m "${1:-target/v22-probes}")"
git diff --quiet -- kernels || { echo "kernels/ has uncommitted changes" >&2; exit 1; }
mkdir -p "$dir"
trap 'git checkout -q -- kernels; cargo xtask ptx > /dev/null 2>&1 || true' EXIT
cargo xtask ptx > /dev/null
cp target/ptx/mok_sm90a.ptx "$dir/base.ptx"
for patch in benches/probes/v22*.patch; do
    name="$(basename "$patch" .patch)"
    git apply "$patch"
    cargo xtask ptx > /dev/null
    cp target/ptx/mok_sm90a.ptx "$dir/$name.ptx"
    git checkout -q -- kernels
    echo "$dir/$name.ptx"
done
