#!/usr/bin/env bash
# One device call: ceilings, PyTorch GEMM baselines and mok's engine benchmark side by side.
# Run from the bundle's benches/ folder (or set GEMM_BIN). Logs go to $OUT (or ./bench-logs).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
cases="${CASES:-kimi:8192,glm:8192,qwen:8192,deepseek:8192,kimi:32768,qwen:32768}"
gemm_bin="${GEMM_BIN:-$here/gemm}"
[ -f "$out/ceilings.log" ] || python3 "$here/ceilings.py" 2>&1 | tee "$out/ceilings.log"
read -r _ _ matmul _ copy < <(grep CEILING "$out/ceilings.log")
PYTHONUNBUFFERED=1 python3 "$here/torch_gemm.py" --cases "$cases" --out "$out/torch_gemm.txt" 2>&1 | tee "$out/torch_gemm.log"
"$gemm_bin" --cases "$cases" --baseline "$out/torch_gemm.txt" --matmul-tflops "$matmul" --copy-tbps "$copy" 2>&1 | tee "$out/gemm.log"
