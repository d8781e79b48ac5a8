#!/usr/bin/env bash
# Prepares one device call that checks and times this branch's clustered engine against `main`
# (run here, on the experiment branch, with a clean tree):
#   benches/pair_experiment.sh
# then on the device (carry: bundle):
#   cd bundle && MOK_TEST_TIMEOUT=150 timeout 170 ./tests/gpu_gemm --test-threads=1 | tail -9;
#   cd benches && export CASES=kimi:8192,qwen:8192,kimi:32768 &&
#   GEMM_BIN=../main/gemm timeout 150 ./compare_ptx.sh ../main/main.ptx &&
#   timeout 150 ./compare_ptx.sh ../main/branch.ptx
# (the second compare reuses the first one's torch baselines, same call).
set -euo pipefail
cd "$(dirname "$0")/.."
branch=$(git rev-parse --abbrev-ref HEAD)
[ -z "$(git status --porcelain)" ] || { echo "commit or stash first" >&2; exit 2; }
git checkout -q main
cargo xtask gpu-bundle > /dev/null && cargo xtask ptx > /dev/null
mkdir -p /tmp/mok-main
cp bundle/benches/gemm /tmp/mok-main/gemm
cp target/ptx/mok_sm90a.ptx /tmp/mok-main/main.ptx
git checkout -q "$branch"
cargo xtask gpu-bundle > /dev/null && cargo xtask ptx > /dev/null
mkdir -p bundle/main
cp /tmp/mok-main/gemm /tmp/mok-main/main.ptx bundle/main/
cp target/ptx/mok_sm90a.ptx bundle/main/branch.ptx
md5sum bundle/main/*.ptx
