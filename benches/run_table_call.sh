#!/usr/bin/env bash
# The "Current numbers" table of docs/PERF.md in one device call, one-GPU cases first (so a call
# cut short still returns them): the ceilings and the PyTorch layer once, then every case on one
# GPU (GEMM_ONE_GPU, default engine,megakernels), then every case over P = RANKS virtual ranks
# (default 8; both megakernels; each rank's ring RING_FACTOR, default 1.25, times an even split),
# each case in its own process. Run from the bundle's benches/ folder; logs go to $OUT (or
# ./bench-logs), the last lines are the table rows.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
cases="${CASES:-kimi:8192,glm:8192,qwen:8192,deepseek:8192,kimi:32768,qwen:32768}"
layer_bin="${LAYER_BIN:-$here/layer}"
python3 "$here/ceilings.py" > "$out/ceilings.log" 2>&1
read -r _ _ matmul _ copy < <(grep CEILING "$out/ceilings.log")
PYTHONUNBUFFERED=1 python3 "$here/torch_moe.py" --cases "$cases" --out "$out/baseline.txt" > "$out/torch.log" 2>&1
common=(--baseline "$out/baseline.txt" --matmul-tflops "$matmul" --copy-tbps "$copy")
for case in ${cases//,/ }; do
    "$layer_bin" --cases "$case" --gemm "${GEMM_ONE_GPU:-engine,megakernels}" "${common[@]}" \
        > "$out/one-gpu-${case/:/-}.log" 2>&1 || echo "$case on one GPU: failed (see one-gpu-${case/:/-}.log)"
done
for case in ${cases//,/ }; do
    "$layer_bin" --ranks "${RANKS:-8}" --ring-factor "${RING_FACTOR:-1.25}" --cases "$case" --gemm megakernels \
        "${common[@]}" > "$out/ranks-${case/:/-}.log" 2>&1 || echo "$case over ranks: failed (see ranks-${case/:/-}.log)"
done
grep CEILING "$out/ceilings.log"
for log in "$out"/one-gpu-*.log "$out"/ranks-*.log; do
    [ -f "$log" ] || continue
    echo "${log##*/}:"
    grep -h -E '^\| [a-z]+ \| [0-9]' "$log"
done
