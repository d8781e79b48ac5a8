#!/usr/bin/env bash
# One device call timing the weight-gradient wait probes (benches/build_wgrad_wait_probes.sh;
# docs/PERF.md, "The weight gradients' waits across ranks, probed") against the subset's own
# kernels at one case (CASE, default qwen:32768), alternating, each PTX through MOK_PTX (its
# first process JIT-compiles it, ~15–25 s): for every PTX named in VARIANTS (default "none down"),
# and each of the run settings in SETTINGS (default: one rank through the ranks kernels, with
# the slot-weight gradients early and apart from the combine's tail, then on one GPU), two runs.
# Prints the backward, its parts and the step per run; logs go to $OUT/r.tgz. Run from the
# repository root with the subset and the probes carried:
#   OUT=$OUT benches/wgrad_waits_round.sh target/X target/wprobe
set -uo pipefail
subset="$1"; probes="$2"
out="${OUT:-./bench-logs}"; mkdir -p "$out/p"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
start=$(date +%s); budget="${BUDGET:-400}"
elapsed() { echo $(( $(date +%s) - start )); }
case_="${CASE:-qwen:32768}"
IFS=';' read -r -a settings <<< "${SETTINGS:---ranks 1 --ranks-path --early-slot-weight-gradients on;--ranks 1 --ranks-path --early-slot-weight-gradients off;--early-slot-weight-gradients on}"
run() { # NAME PTX-or-base SETTING
    local name=$1 ptx=$2 setting=$3 log="$out/p/$1.log"
    [ $(( budget - $(elapsed) )) -ge 30 ] || { echo "skip $name"; return; }
    # shellcheck disable=SC2086 # the setting splits into flags
    if [ "$ptx" = base ]; then "$subset/benches/layer" --cases "$case_" --gemm megakernels $setting > "$log" 2>&1
    else MOK_PTX="$probes/$ptx.ptx" "$subset/benches/layer" --cases "$case_" --gemm megakernels $setting > "$log" 2>&1; fi
    echo "$name ($(elapsed) s): $(grep -h 'ms, without' "$log" | sed 's/.*backward \([0-9.]*\) ms, without its weight-gradient tiles \([0-9.]*\) ms.*alone \([0-9.]*\) ms.*/backward \1, without weight gradients \2, weight gradients alone \3/') $(grep -h '^RESULT' "$log" | awk '{print $6, $7, $8}')"
}
for s in "${!settings[@]}"; do
    setting="${settings[$s]}"
    echo "setting $s: $setting"
    for round in 1 2; do
        run "s$s-base-$round" base "$setting"
        for v in ${VARIANTS:-none down}; do run "s$s-$v-$round" "$v" "$setting"; done
    done
done
(cd "$out" && tar czf r.tgz p && rm -rf p)
