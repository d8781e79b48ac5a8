#!/usr/bin/env bash
# The layer across processes' pending checks, one step per device call (each fits the 10-minute
# limit of a call): `processes` runs `gpu_processes` (2-4 processes sharing the GPU, the
# stalled-peer faults, each rank's case, alternate and case again), `api` the other test
# binaries of the folder (`gpu_api`, `gpu_exchange`), `sanitize` runs gpu_processes under one
# tool (TOOL=memcheck, the default; racecheck and synccheck in calls of their own; the children
# followed; reduced cases under the tool), `bench` the layer bench over two processes sharing GPU 0
# through files (run_process_bench.sh: a check that it runs, not a timing). Run from a bundle
# folder that holds run.sh, tests/gpu_processes(.gz), tests/gpu_api(.gz), tests/gpu_exchange(.gz)
# and benches/layer with the scripts (cargo xtask gpu-subset --tests
# gpu_processes,gpu_api,gpu_exchange --benches layer). Logs under $OUT (or ./bench-logs); a
# short summary last; exits non-zero when the step failed.
#   ./benches/process_checks.sh processes      (then: api, sanitize, bench; TOOL=racecheck and
#                                              TOOL=synccheck sanitize: a call each)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bundle="$(cd "$here/.." && pwd)"
mkdir -p "${OUT:-./bench-logs}"
out="$(cd "${OUT:-./bench-logs}" && pwd)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
case "${1:-}" in
    processes)
        (cd "$bundle" && OUT="$out" MOK_TEST_TIMEOUT=560 ./run.sh process) > "$out/process-tests.txt" 2>&1
        rc=$?
        grep -h "passed\|failed" "$out/process-tests.txt" | tail -4
        ;;
    api)
        (cd "$bundle" && OUT="$out" MOK_TEST_TIMEOUT=280 ./run.sh --skip process) > "$out/api-tests.txt" 2>&1
        rc=$?
        grep -h "passed\|failed" "$out/api-tests.txt" | tail -4
        ;;
    sanitize)
        tool="${TOOL:-memcheck}"
        (cd "$bundle" && OUT="$out" MOK_TEST_TIMEOUT=560 MOK_SANITIZE_TOOLS="$tool" \
            ./run.sh --sanitize process) > "$out/process-sanitize-$tool.txt" 2>&1
        rc=$?
        grep -h "^sanitize:\|passed" "$out/process-sanitize-$tool.txt" | tail -2
        ;;
    bench)
        OUT="$out" PROCESSES=2 CASES=qwen:2048 GEMM=megakernels TIMEOUT=500 "$here/run_process_bench.sh" \
            > "$out/process-bench.txt" 2>&1
        rc=$?
        tail -3 "$out/process-bench.txt"
        ;;
    *)
        echo "usage: process_checks.sh processes|api|sanitize|bench (one device call each)" >&2
        exit 2
        ;;
esac
exit $rc
