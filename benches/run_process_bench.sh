#!/usr/bin/env bash
# The layer bench across PROCESSES processes (default 2), one rank each, as torchrun would start
# them (RANK, WORLD_SIZE, LOCAL_RANK), all-gathering their heap records through files in a fresh
# MOK_RENDEZVOUS_DIR (no NCCL needed). With SHARE_GPU=1 (the default) every process runs on
# GPU 0 (CUDA_VISIBLE_DEVICES=0): a check that the path runs end to end on a one-GPU machine;
# the processes take turns on the GPU, so the times mean nothing, and the waits' deadline is a
# minute (MOK_BENCH_WAIT_S=60). With SHARE_GPU=0 each
# process takes the GPU of its local rank (a machine with that many GPUs: the real numbers).
# Rank 0 prints the RESULT lines; every rank's log goes to $OUT (or ./bench-logs). Run from the
# bundle's benches/ folder:
#   PROCESSES=2 CASES=qwen:2048 GEMM=megakernels ./run_process_bench.sh
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
processes="${PROCESSES:-2}"
layer_bin="${LAYER_BIN:-$here/layer}"
rendezvous=$(mktemp -d)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
pids=()
for ((rank = 0; rank < processes; rank++)); do
    # Processes sharing one GPU take turns on it: waits of a minute, as the process tests use.
    if [ "${SHARE_GPU:-1}" = 1 ]; then visible=0; wait_s=60; else visible=$rank; wait_s=""; fi
    env ${wait_s:+MOK_BENCH_WAIT_S=$wait_s} \
        CUDA_VISIBLE_DEVICES=$visible MOK_RENDEZVOUS_DIR="$rendezvous" RANK=$rank WORLD_SIZE=$processes \
        LOCAL_RANK=$rank LOCAL_WORLD_SIZE=$processes timeout "${TIMEOUT:-600}" "$layer_bin" \
        --cases "${CASES:-qwen:2048}" --gemm "${GEMM:-megakernels}" --reps "${REPS:-3}" \
        > "$out/process-bench-rank$rank.log" 2>&1 &
    pids+=($!)
done
failed=0
for ((rank = 0; rank < processes; rank++)); do
    wait "${pids[$rank]}" || { echo "rank $rank failed (exit $?): see process-bench-rank$rank.log"; failed=1; }
done
rm -rf "$rendezvous"
grep -h '^RESULT' "$out/process-bench-rank0.log"
exit $failed
