#!/usr/bin/env bash
# Builds a bundle subset of another branch or commit, into DIR: checks REV out, runs
# `cargo xtask gpu-bundle` and `cargo xtask gpu-subset --out DIR --tests TESTS --benches layer`,
# then checks the starting branch out again (bundle/ is left with REV's build). The kernels are
# REV's shipped PTX (src/ptx), as a user's build would take them. ~5 minutes with a warm
# target/. Run from the repository root on a clean tree:
#   benches/build_branch_subset.sh params-in-shared target/pis [gpu_unfused,gpu_api,gpu_exchange]
# then carry ["target/pis"] beside a subset of the current tree (`benches/device_round.sh`
# compares two such subsets in one device call).
set -euo pipefail
rev="$1"
dir="$(realpath -m "$2")"
tests="${3:-gpu_unfused,gpu_api,gpu_exchange}"
git diff --quiet && git diff --cached --quiet || { echo "the tree has uncommitted changes" >&2; exit 1; }
start="$(git symbolic-ref --short -q HEAD || git rev-parse HEAD)"
rm -rf "$dir"
mkdir -p "$(dirname "$dir")"
trap 'git checkout -q "$start"' EXIT
git checkout -q "$rev"
cargo xtask gpu-bundle > "$dir.bundle.log" 2>&1 || { tail -20 "$dir.bundle.log" >&2; exit 1; }
cargo xtask gpu-subset --out "$dir" --tests "$tests" --benches layer
du -sh "$dir"
