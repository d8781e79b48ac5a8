#!/usr/bin/env bash
# One device call: measure the two ceilings, the PyTorch baseline and mok's layer benchmark
# side by side. Run from the bundle folder (cargo xtask gpu-bundle) or the repository root with
# the bench binary at $LAYER_BIN. Logs go to $OUT (or ./bench-logs). GEMM=engine runs the routed
# experts' GEMMs on the tensor-core engine (unset: the bench's default, `mma`, the mma.sync kernels).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
cases="${CASES:-kimi:8192,glm:8192,qwen:8192,deepseek:8192}"
layer_bin="${LAYER_BIN:-$here/layer}"
python3 "$here/ceilings.py" 2>&1 | tee "$out/ceilings.log"
read -r _ _ matmul _ copy < <(grep CEILING "$out/ceilings.log")
PYTHONUNBUFFERED=1 python3 "$here/torch_moe.py" --cases "$cases" --out "$out/baseline.txt" 2>&1 | tee "$out/torch.log"
"$layer_bin" --cases "$cases" ${GEMM:+--gemm "$GEMM"} --baseline "$out/baseline.txt" --matmul-tflops "$matmul" --copy-tbps "$copy" 2>&1 | tee "$out/layer.log"
