#!/usr/bin/env bash
# Builds the paired-stages probe of docs/PERF.md ("A row tile's K blocks issued two at a time")
# into DIR (default target/paired-stages-probe): base.ptx (the shipped kernels) and paired.ptx
# (benches/probes/paired-stages.patch applied to kernels/), plus a second copy of each so that
# compare_ptx.sh can alternate them. Restores kernels/ afterwards. Carry DIR with a bundle and,
# from the bundle's benches/ folder:
#   MOK_PTX=$DIR/paired.ptx ../tests/gpu_gemm --test-threads=1      # the variant's bits first
#   CASES=deepseek:8192,kimi:8192 ./compare_ptx.sh $DIR/base.ptx $DIR/paired.ptx $DIR/base2.ptx $DIR/paired2.ptx
# Run from the repository root on a clean kernels/ tree.
set -euo pipefail
dir="$(realpath -m "${1:-target/paired-stages-probe}")"
git diff --quiet -- kernels || { echo "kernels/ has uncommitted changes" >&2; exit 1; }
mkdir -p "$dir"
cargo xtask ptx > /dev/null
cp target/ptx/mok_sm90a.ptx "$dir/base.ptx"
trap 'git checkout -q -- kernels; cargo xtask ptx > /dev/null 2>&1 || true' EXIT
git apply benches/probes/paired-stages.patch
cargo xtask ptx > /dev/null
cp target/ptx/mok_sm90a.ptx "$dir/paired.ptx"
grep "mok_sm90_gemm" target/ptx/ptxas-report.txt
cmp -s "$dir/base.ptx" "$dir/paired.ptx" && { echo "the patch changed nothing" >&2; exit 1; }
cp "$dir/base.ptx" "$dir/base2.ptx"
cp "$dir/paired.ptx" "$dir/paired2.ptx"
ls -l "$dir"
