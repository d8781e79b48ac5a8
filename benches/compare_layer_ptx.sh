#!/usr/bin/env bash
# One device call, several builds of the kernels, the whole layer: the ceilings and the PyTorch
# layer once, then mok's layer benchmark once per PTX file given (loaded through MOK_PTX), each
# with the backends of $GEMM (default engine,megakernel), over $RANKS virtual ranks when set (the
# layer bench's --ranks: then GEMM names mma or megakernel backends), with $LAYER_ARGS added to
# every run (e.g. "--ranks 1 --ranks-path"). Run from the bundle's
# benches/ folder:
#   CASES=kimi:8192 GEMM=engine,megakernel:0 ./compare_layer_ptx.sh a.ptx b.ptx
#   RANKS=8 CASES=qwen:8192 GEMM=megakernels ./compare_layer_ptx.sh a.ptx b.ptx
# Logs go to $OUT (or ./bench-logs); the last lines are the tables, each row prefixed with its PTX
# (and its run number from the second run of the same PTX on).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 PTX_FILE..." >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
cases="${CASES:-kimi:8192,glm:8192,qwen:8192,deepseek:8192}"
backends="${GEMM:-engine,megakernel}"
layer_bin="${LAYER_BIN:-$here/layer}"
[ -f "$out/ceilings.log" ] || python3 "$here/ceilings.py" > "$out/ceilings.log" 2>&1
read -r _ _ matmul _ copy < <(grep CEILING "$out/ceilings.log")
[ -f "$out/baseline.txt" ] || PYTHONUNBUFFERED=1 python3 "$here/torch_moe.py" --cases "$cases" \
    --out "$out/baseline.txt" > "$out/torch.log" 2>&1
# A PTX given more than once (alternating runs: a.ptx b.ptx a.ptx b.ptx) gets one log per run:
# NAME, NAME.2, NAME.3, ...
names=()
for ptx in "$@"; do
    base="$(basename "$ptx" .ptx)"
    name="$base" n=1
    while printf '%s\n' ${names[@]+"${names[@]}"} | grep -qx -- "$name"; do
        n=$((n + 1))
        name="$base.$n"
    done
    names+=("$name")
done
i=0
for ptx in "$@"; do
    name="${names[$i]}"
    i=$((i + 1))
    # shellcheck disable=SC2086 # the extra flags split into words
    MOK_PTX="$ptx" "$layer_bin" --cases "$cases" --gemm "$backends" --baseline "$out/baseline.txt" \
        --matmul-tflops "$matmul" --copy-tbps "$copy" ${RANKS:+--ranks "$RANKS"} ${LAYER_ARGS:-} > "$out/layer-$name.log" 2>&1 ||
        echo "$name: FAILED (see layer-$name.log)"
done
for name in "${names[@]}"; do
    grep "^|" "$out/layer-$name.log" | grep -v "^|---\|^| shape" | sed "s/^/$name /" || true
done
