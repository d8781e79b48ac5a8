"""PyTorch baselines for the GEMM engine benchmark (benches/gemm.rs), run in the same device call:
torch.matmul for the dense case, torch._grouped_mm (+ F.silu(g) * u where PyTorch needs it)
for the grouped ones, uniform random top-k routing, random data. Prints
`TORCHGEMM <case> <ms> <tflops>` lines and writes them to --out."""
import argparse
import torch
import torch.nn.functional as F

from torch_timing import median_ms

SHAPES = {"kimi": (384, 7168, 2048, 8), "glm": (256, 6144, 2048, 8), "qwen": (512, 4096, 1024, 10), "deepseek": (384, 7168, 3072, 6)}


def rnd(*shape, scale=1.0):
    # Generated in bf16 directly: an f32 temporary of a frontier weight tensor would not fit.
    return torch.empty(*shape, device="cuda", dtype=torch.bfloat16).uniform_(-scale, scale)


def offsets_for(tokens, experts, k):
    scores = torch.rand(tokens, experts, device="cuda")
    ids = torch.topk(scores, k, dim=1).indices.flatten()
    counts = torch.bincount(ids, minlength=experts)
    return torch.cumsum(counts, 0, dtype=torch.int32), ids.numel()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="kimi:8192,glm:8192,qwen:8192,deepseek:8192")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = []

    def emit(name, ms, flop):
        line = f"TORCHGEMM {name} {ms:.4f} {flop / ms / 1e9:.1f}"
        print(line, flush=True)
        lines.append(line)

    # Dense: 8 groups of [8192 x 7168] x [7168 x 4096]: torch.matmul per group, and _grouped_mm.
    a = rnd(8 * 8192, 7168)
    b = rnd(8, 7168, 4096, scale=0.02)
    offs = torch.arange(1, 9, device="cuda", dtype=torch.int32) * 8192
    flop = 2 * 8 * 8192 * 7168 * 4096
    emit("dense8-matmul", median_ms(lambda: [torch.matmul(a[g * 8192:(g + 1) * 8192], b[g]) for g in range(8)]), flop)
    emit("dense8-grouped_mm", median_ms(lambda: torch._grouped_mm(a, b, offs=offs)), flop)
    del a, b
    for case in args.cases.split(","):
        shape, tokens = case.split(":")
        experts, h, i, k = SHAPES[shape]
        tokens = int(tokens)
        offs, rows = offsets_for(tokens, experts, k)
        x = rnd(rows, h)
        w13 = rnd(experts, h, 2 * i, scale=0.02)   # [E, K=H, N=2I] as _grouped_mm wants
        w2 = rnd(experts, i, h, scale=0.02)        # [E, K=I, N=H]
        def gate_up():
            gu = torch._grouped_mm(x, w13, offs=offs)
            g, u = gu[:, :i], gu[:, i:]
            return F.silu(g) * u
        emit(f"{shape}:{tokens}:gate_up", median_ms(gate_up), 2 * rows * h * 2 * i)
        hid = rnd(rows, i)
        emit(f"{shape}:{tokens}:down", median_ms(lambda: torch._grouped_mm(hid, w2, offs=offs)), 2 * rows * i * h)
        dy = rnd(rows, h)
        w2t = w2.transpose(-2, -1)                 # dgrad of down: dy [R,H] x W_down[e] [H,I]
        emit(f"{shape}:{tokens}:dgrad_down", median_ms(lambda: torch._grouped_mm(dy, w2t, offs=offs)), 2 * rows * h * i)
        dgu = rnd(rows, 2 * i)
        w13t = w13.transpose(-2, -1)               # dgrad of gate/up: dgu [R,2I] x [2I,H]
        emit(f"{shape}:{tokens}:dgrad_gate_up", median_ms(lambda: torch._grouped_mm(dgu, w13t, offs=offs)), 2 * rows * 2 * i * h)
        try:
            dyt = dy.t()
            emit(f"{shape}:{tokens}:wgrad_down", median_ms(lambda: torch._grouped_mm(dyt, hid, offs=offs)), 2 * rows * h * i)
            dgut = dgu.t()
            emit(f"{shape}:{tokens}:wgrad_gate_up", median_ms(lambda: torch._grouped_mm(dgut, x, offs=offs)), 2 * rows * 2 * i * h)
        except Exception as e:  # report, do not invent a number
            print(f"TORCHGEMM-SKIP {shape}:{tokens}:wgrad {e}", flush=True)
        del x, w13, w2, w2t, w13t, hid, dy, dgu
        torch.cuda.empty_cache()
    if args.out:
        open(args.out, "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
