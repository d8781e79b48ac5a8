#!/usr/bin/env bash
# One device call: measure the two ceilings, the PyTorch baseline and mok's layer benchmark
# side by side. Run from the bundle folder (cargo xtask gpu-bundle) or the repository root with
# the bench binary at $LAYER_BIN. Logs go to $OUT (or ./bench-logs).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
cases="${CASES:-kimi:8192,glm:8192,qwen:8192,deepseek:8192}"
layer_bin="${LAYER_BIN:-$here/layer}"
python3 - <<'PY' 2>&1 | tee "$out/ceilings.log"
import torch
a = torch.rand(8192, 8192, device="cuda").to(torch.bfloat16) * 2 - 1
b = torch.rand(8192, 8192, device="cuda").to(torch.bfloat16) * 2 - 1
for _ in range(3): a @ b
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(20): a @ b
e.record(); e.synchronize()
tflops = 2 * 8192**3 * 20 / (s.elapsed_time(e) * 1e-3) / 1e12
x = torch.rand(2**30, device="cuda")
y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s.record()
for _ in range(20): y.copy_(x)
e.record(); e.synchronize()
tbps = 2 * x.numel() * 4 * 20 / (s.elapsed_time(e) * 1e-3) / 1e12
print(f"CEILING matmul_tflops {tflops:.0f} copy_tbps {tbps:.2f}")
PY
read -r _ _ matmul _ copy < <(grep CEILING "$out/ceilings.log")
PYTHONUNBUFFERED=1 python3 "$here/torch_moe.py" --cases "$cases" --out "$out/baseline.txt" 2>&1 | tee "$out/torch.log"
"$layer_bin" --cases "$cases" --baseline "$out/baseline.txt" --matmul-tflops "$matmul" --copy-tbps "$copy" 2>&1 | tee "$out/layer.log"
