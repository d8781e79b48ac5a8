"""The two ceilings every benchmark reports against, measured in the same device call:
dense bf16 matmul 8192^3 (random data) and a 4 GiB device copy (bytes read + written).
Prints `CEILING matmul_tflops R copy_tbps B`."""
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
