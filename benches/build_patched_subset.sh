#!/usr/bin/env bash
# Builds a bundle subset of the tree with PATCH applied (a probe of benches/probes/), into DIR:
# applies the patch, ships its PTX, runs `cargo xtask gpu-bundle` and
# `cargo xtask gpu-subset --out DIR --tests TESTS --benches layer`, then restores kernels/,
# host/, benches/, docs/ and src/ptx/ (bundle/ is left with the patched build). ~8 minutes. Run from
# the repository root on a clean tree:
#   benches/build_patched_subset.sh benches/probes/NAME.patch target/NAME [gpu_unfused,gpu_api]
# then carry ["target/NAME"] and run its run.sh and benches/layer beside a subset of the tree
# built the same way without a patch (`cargo xtask gpu-bundle` + `gpu-subset`).
set -euo pipefail
patch="$1"
dir="$(realpath -m "$2")"
tests="${3:-gpu_unfused,gpu_api}"
git diff --quiet -- kernels host src benches docs || { echo "kernels/, host/, src/, benches/ or docs/ has uncommitted changes" >&2; exit 1; }
rm -rf "$dir"
mkdir -p "$(dirname "$dir")"
trap 'git checkout -q -- kernels host src benches docs; cargo xtask ptx > /dev/null 2>&1 || true' EXIT
git apply "$patch"
cargo xtask ptx --ship > /dev/null
grep -E "mok_sm90_(forward|backward)" target/ptx/ptxas-report.txt
cargo xtask gpu-bundle > "$dir.bundle.log" 2>&1 || { tail -20 "$dir.bundle.log" >&2; exit 1; }
cargo xtask gpu-subset --out "$dir" --tests "$tests" --benches layer
du -sh "$dir"
