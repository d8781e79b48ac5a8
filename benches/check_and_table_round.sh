#!/usr/bin/env bash
# One device call that checks a build and times it against PyTorch: the subset's GPU tests
# matching TESTS (default `megakernel`), then the same-call table (run_rank_bench.sh: the ceilings,
# the PyTorch layer, every case on one GPU with the engine path and both megakernels, then over
# 8 virtual ranks; CASES as there, default every frontier case, kimi 32768 at P = 8 needing more
# than 80 GB), then memcheck, racecheck and synccheck over SANITIZE_FILTER (default
# `megakernel_is_bitwise`) in the time left of BUDGET seconds (default 560). Run from the
# repository root with the subset carried (`cargo xtask gpu-subset --out target/X --tests
# gpu_unfused,gpu_api,gpu_exchange --benches layer`):
#   OUT=$OUT benches/check_and_table_round.sh target/X
# Logs and r.tgz go to $OUT (or ./bench-logs); the last lines are the tests', the table's rows and
# the sanitizers' summary.
set -uo pipefail
subset="$(cd "$1" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
budget="${BUDGET:-560}"
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
tests="$(cd "$subset" && OUT="$out/tests" MOK_TEST_TIMEOUT=170 ./run.sh "${TESTS:-megakernel}" 2>&1 | tail -1)"
echo "tests ($(elapsed) s): $tests"
# The table gets what the sanitizers' minimum (150 s) leaves.
(cd "$subset/benches" && OUT="$out/table" ONE_GPU=1 GEMM_ONE_GPU=engine,megakernels GEMM=megakernels \
    timeout $(( budget - 150 - $(elapsed) )) ./run_rank_bench.sh) > "$out/table.txt" 2>&1
echo "table ($(elapsed) s)"
left=$(( budget - $(elapsed) ))
sanitize="$(cd "$subset" && OUT="$out/sanitize" MOK_SANITIZE_TOOLS="memcheck racecheck synccheck" \
    MOK_TEST_TIMEOUT=$(( left - 15 )) timeout "$left" ./run.sh --sanitize "${SANITIZE_FILTER:-megakernel_is_bitwise}" 2>&1 \
    | tail -2 | tr '\n' ' ')"
(cd "$out" && tar czf r.tgz tests table sanitize 2>/dev/null)
grep -h "^test .* FAILED$\|panicked" "$out"/tests/logs/*.log 2>/dev/null | head -5
grep -h -E '^\| [a-z]+ \| [0-9]' "$out/table.txt"
echo "tests: $tests"
echo "sanitize ($(elapsed) s): $sanitize"
