#!/usr/bin/env bash
# One device call, several builds of the kernels: PyTorch baselines once, then mok's engine
# benchmark once per PTX file given (loaded through MOK_PTX), so variants are compared on the
# same machine within minutes. Run from the bundle's benches/ folder: ./compare_ptx.sh a.ptx b.ptx
# Logs go to $OUT (or ./bench-logs); the last lines are one table row per case and PTX.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 PTX_FILE..." >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
cases="${CASES:-kimi:8192,glm:8192,qwen:8192,deepseek:8192,kimi:32768,qwen:32768}"
gemm_bin="${GEMM_BIN:-$here/gemm}"
[ -f "$out/ceilings.log" ] || python3 "$here/ceilings.py" > "$out/ceilings.log" 2>&1
read -r _ _ matmul _ copy < <(grep CEILING "$out/ceilings.log")
[ -f "$out/torch_gemm.txt" ] || PYTHONUNBUFFERED=1 python3 "$here/torch_gemm.py" --cases "$cases" \
    --out "$out/torch_gemm.txt" > "$out/torch_gemm.log" 2>&1
for ptx in "$@"; do
    name="$(basename "$ptx" .ptx)"
    MOK_PTX="$ptx" "$gemm_bin" --cases "$cases" --baseline "$out/torch_gemm.txt" --matmul-tflops "$matmul" \
        --copy-tbps "$copy" > "$out/gemm-$name.log" 2>&1 || echo "$name: FAILED (see gemm-$name.log)"
done
for ptx in "$@"; do
    name="$(basename "$ptx" .ptx)"
    grep "^|" "$out/gemm-$name.log" | sed "s/^/$name /" || true
done
