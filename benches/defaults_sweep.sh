#!/usr/bin/env bash
# One device call that re-measures the one-GPU backward's chosen defaults on the GPU it runs on:
# the backward megakernel's comm blocks (`megakernels:0/B` for B in BLOCKS, default "0 4 8 0 4",
# the forward with none) on every case of COMM_CASES, then the row totals forced on and off
# (`--row-totals`, alternating, twice each) on every case of TOTALS_CASES (default kimi and qwen
# at T = 32768), at P = 1 and over TOTALS_RANKS (default 8) virtual ranks. No run starts after
# BUDGET seconds (default 500). Run from the repository root with a subset carried (`cargo xtask
# gpu-subset --out target/X --benches layer`):
#   OUT=$OUT benches/defaults_sweep.sh target/X
# Logs go to $OUT/sweep (or ./bench-logs/sweep); the last lines are one row per case: for each
# setting in the order run, the backward alone ms (forward + backward ms).
set -uo pipefail
subset="$(cd "$1" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out/sweep" && out="$(cd "$out" && pwd)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
layer="$subset/benches/layer"
start=$(date +%s)
in_budget() { [ $(( $(date +%s) - start )) -lt "${BUDGET:-500}" ]; }
blocks="${BLOCKS:-0 4 8 0 4}"
gemm="$(for b in $blocks; do printf 'megakernels:0/%s,' "$b"; done)"
gemm="${gemm%,}"
# "setting: backward ms (forward + backward ms)" for each RESULT and backward line of a log.
summary() {
    paste -d' ' <(grep -h '^RESULT' "$1" | awk '{print $4, $8}') \
        <(grep -h 'ms, without' "$1" | sed 's/.*backward \([0-9.]*\) ms, without.*/\1/') |
        awk '{printf "%s: %s (%s); ", $1, $3, $2}'
}
for c in ${COMM_CASES:-qwen:8192 qwen:32768 glm:8192 kimi:8192 deepseek:8192}; do
    in_budget || { echo "comm blocks $c: not run (budget)"; continue; }
    log="$out/sweep/comm-${c/:/-}.log"
    "$layer" --cases "$c" --gemm "$gemm" > "$log" 2>&1
    echo "comm blocks $c: $(summary "$log")"
done
for c in ${TOTALS_CASES:-kimi:32768 qwen:32768}; do
    for ranks in 1 ${TOTALS_RANKS:-8}; do
        row="totals $c P=$ranks:"
        for totals in on off on off; do
            in_budget || { row="$row $totals not run (budget);"; continue; }
            log="$out/sweep/totals-${c/:/-}-p$ranks-$totals.log"
            args=(--cases "$c" --gemm megakernels --row-totals "$totals")
            [ "$ranks" -gt 1 ] && args+=(--ranks "$ranks" --ring-factor 1.25)
            "$layer" "${args[@]}" > "$log" 2>&1
            row="$row $totals $(summary "$log" | sed 's/^[^:]*: //')"
        done
        echo "$row"
    done
done
