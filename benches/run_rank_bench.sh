#!/usr/bin/env bash
# One device call: the ceilings and the PyTorch layer once, then mok's layer benchmark over P
# virtual ranks (default 8) on both megakernels, every case in its own process (a case that
# does not fit in memory fails alone), with each rank's ring sized RING_FACTOR times an even
# split (default 1.25; the worst-case default does not fit the largest cases at P = 8), and
# with ONE_GPU=1 the same cases on one GPU first (GEMM_ONE_GPU, default megakernels) in the same
# call, for the P = 8 against P = 1 comparison (docs/PERF.md's "Current numbers": ONE_GPU=1
# GEMM=megakernels GEMM_ONE_GPU=engine,megakernels; with RANKS=0 the one-GPU cases alone), and with VARIANT_PTX=name=file.ptx the rank
# cases once more on that PTX (MOK_PTX; e.g. an earlier commit's kernels against the current ones, same
# call: the PTX must have every kernel this host launches and the same heap layout), and with
# VARIANT_ARGS=name="--flag ..." the rank cases once more with those benchmark flags (e.g.
# own="--own-rank-tiles": each rank's GEMM tiles on its own blocks; ep1="--ranks 1 --ranks-path":
# one rank through the ranks kernels, which sets the ranks kernels' own cost apart from what
# hosting P ranks on one GPU costs; RANKS=1 runs only that). Run from
# the bundle's benches/ folder; logs and tables go to $OUT (or ./bench-logs):
#   CASES=kimi:8192,deepseek:8192 GEMM=megakernel:0,megakernel:4,megakernels ./run_rank_bench.sh
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
cases="${CASES:-kimi:8192,glm:8192,qwen:8192,deepseek:8192,kimi:32768,qwen:32768}"
backends="${GEMM:-megakernel,megakernels}"
ranks="${RANKS:-8}"
ranks_path=""
[ "$ranks" = 1 ] && ranks_path="--ranks-path"
layer_bin="${LAYER_BIN:-$here/layer}"
python3 "$here/ceilings.py" > "$out/ceilings.log" 2>&1
read -r _ _ matmul _ copy < <(grep CEILING "$out/ceilings.log")
PYTHONUNBUFFERED=1 python3 "$here/torch_moe.py" --cases "$cases" --out "$out/baseline.txt" > "$out/torch.log" 2>&1
# rank_cases LOG_PREFIX EXTRA_FLAGS [ENV=VALUE...]: every case over the ranks, each in its own
# process.
rank_cases() {
    local prefix=$1 flags=$2 case log
    shift 2
    for case in ${cases//,/ }; do
        log="$prefix${case/:/-}.log"
        # RANKS=1: one rank through the ranks kernels, not the one-GPU layer.
        # shellcheck disable=SC2086 # the extra flags split into words
        env "$@" "$layer_bin" --ranks "$ranks" ${ranks_path} --ring-factor "${RING_FACTOR:-1.25}" --cases "$case" \
            --gemm "$backends" --baseline "$out/baseline.txt" --matmul-tflops "$matmul" --copy-tbps "$copy" \
            $flags > "$out/$log" 2>&1 || echo "$case: failed (see $log)"
    done
}
# The one-GPU cases first, so a call cut short still returns them.
if [ "${ONE_GPU:-0}" = 1 ]; then
    for case in ${cases//,/ }; do
        "$layer_bin" --cases "$case" --gemm "${GEMM_ONE_GPU:-megakernels}" --baseline "$out/baseline.txt" \
            --matmul-tflops "$matmul" --copy-tbps "$copy" > "$out/one-gpu-${case/:/-}.log" 2>&1 \
            || echo "$case on one GPU: failed (see one-gpu-${case/:/-}.log)"
    done
fi
if [ "$ranks" != 0 ]; then
    rank_cases ranks- ""
    if [ -n "${VARIANT_PTX:-}" ]; then
        rank_cases "ranks-${VARIANT_PTX%%=*}-" "" MOK_PTX="${VARIANT_PTX#*=}"
    fi
    if [ -n "${VARIANT_ARGS:-}" ]; then
        rank_cases "ranks-${VARIANT_ARGS%%=*}-" "${VARIANT_ARGS#*=}"
    fi
fi
for log in "$out"/ranks-*.log "$out"/one-gpu-*.log; do
    [ -f "$log" ] || continue
    echo "${log##*/}:"
    grep -h -E '^\| [a-z]+ \| [0-9]' "$log"
    grep -h 'backward .* ms, without' "$log"
done
# Every log in one file too, named to sort first: a device call that returns only some of the
# files under $OUT still returns this one.
for log in "$out"/*.log; do
    [ "${log##*/}" = 00-all.log ] || { echo "===== ${log##*/}"; cat "$log"; }
done > "$out/00-all.log.tmp" && mv "$out/00-all.log.tmp" "$out/00-all.log"
