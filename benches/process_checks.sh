#!/usr/bin/env bash
# One device call for the layer across processes: the process tests (`gpu_processes`: 2-4
# processes sharing the GPU, the stalled-peer faults, each rank's case, alternate and case
# again), the same under memcheck, racecheck and synccheck (their children followed), the public
# layer's and the exchange's tests (`gpu_api`, `gpu_exchange`), then the layer bench over two
# processes sharing GPU 0 through files (run_process_bench.sh: a check that it runs, not a
# timing). Run from a bundle folder that holds run.sh, tests/gpu_processes(.gz),
# tests/gpu_api(.gz), tests/gpu_exchange(.gz) and benches/layer with the scripts (cargo xtask
# gpu-subset --tests gpu_processes,gpu_api,gpu_exchange --benches layer). Logs under $OUT (or
# ./bench-logs); a short summary last.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bundle="$(cd "$here/.." && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
(cd "$bundle" && OUT="$out" ./run.sh) > "$out/process-tests.txt" 2>&1
(cd "$bundle" && OUT="$out" MOK_SANITIZE_TOOLS="memcheck racecheck synccheck" ./run.sh --sanitize process) \
    > "$out/process-sanitize.txt" 2>&1
OUT="$out" PROCESSES=2 CASES=qwen:2048 GEMM=megakernels "$here/run_process_bench.sh" > "$out/process-bench.txt" 2>&1
echo "== tests";    grep -h "passed\|failed" "$out/process-tests.txt" | tail -3
echo "== sanitize"; grep -h "^sanitize:\|passed" "$out/process-sanitize.txt" | tail -2
echo "== bench";    tail -3 "$out/process-bench.txt"
