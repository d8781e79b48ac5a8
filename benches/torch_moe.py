"""PyTorch baseline of the MoE layer (the torchtitan path), timed on the same GPU in the same
device call as mok's benchmark: gather rows by a stable sort of the routing, torch._grouped_mm
for gate, up and down, F.silu(g) * u, weighted index_add_ combine; backward by autograd.

Prints one line per case, `BASELINE <shape> <tokens> <fwd_ms> <fwd_bwd_ms>`, and writes the same
lines to the file given by --out. Inputs are random (never zeros); routing is random top-k. A case
that does not fit in GPU memory prints `BASELINE-SKIPPED` on stderr and has no line.
"""
import argparse
import gc
import sys

import torch
import torch.nn.functional as F

from torch_timing import median_ms

SHAPES = {
    "kimi": (384, 7168, 2048, 8),
    "glm": (256, 6144, 2048, 8),
    "qwen": (512, 4096, 1024, 10),
    "deepseek": (384, 7168, 3072, 6),
}


def moe_forward(x, ids, weights, w_gate, w_up, w_down):
    tokens, k = ids.shape
    num_experts = w_gate.shape[0]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    token_of_row = order // k
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = x[token_of_row]
    gate = torch._grouped_mm(rows, w_gate.transpose(-2, -1), offs=offsets)
    up = torch._grouped_mm(rows, w_up.transpose(-2, -1), offs=offsets)
    hidden = F.silu(gate) * up
    out = torch._grouped_mm(hidden, w_down.transpose(-2, -1), offs=offsets)
    out = out * weights.flatten()[order].unsqueeze(1).to(out.dtype)
    y = torch.zeros_like(x).index_add_(0, token_of_row, out)
    return y


def bench(shape, tokens, reps):
    num_experts, hidden, inter, k = SHAPES[shape]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1234)
    x = (torch.rand(tokens, hidden, device=dev, generator=gen) * 2 - 1).to(torch.bfloat16).requires_grad_()
    scores = torch.rand(tokens, num_experts, device=dev, generator=gen)
    weights, ids = torch.topk(scores, k, dim=1)
    weights = weights.float().requires_grad_()
    ids = ids.to(torch.int64)

    def weight(out_dim, in_dim):
        w = (torch.rand(num_experts, out_dim, in_dim, device=dev, generator=gen) * 2 - 1) * (3.0 / in_dim ** 0.5)
        return w.to(torch.bfloat16).requires_grad_()

    w_gate, w_up, w_down = weight(inter, hidden), weight(inter, hidden), weight(hidden, inter)
    dy = (torch.rand(tokens, hidden, device=dev, generator=gen) * 2 - 1).to(torch.bfloat16)

    def forward():
        with torch.no_grad():
            moe_forward(x, ids, weights, w_gate, w_up, w_down)

    def step():
        for t in (x, weights, w_gate, w_up, w_down):
            t.grad = None
        y = moe_forward(x, ids, weights, w_gate, w_up, w_down)
        y.backward(dy)

    fwd = median_ms(forward, reps)
    fwd_bwd = median_ms(step, reps)
    del x, w_gate, w_up, w_down, dy, weights
    torch.cuda.empty_cache()
    return fwd, fwd_bwd


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="kimi:8192,glm:8192,qwen:8192,deepseek:8192")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = []
    for case in args.cases.split(","):
        shape, tokens = case.split(":")
        try:
            fwd, fwd_bwd = bench(shape, int(tokens), args.reps)
        except torch.cuda.OutOfMemoryError:
            # A case this GPU cannot hold has no baseline; mok's rows for it print "-" there,
            # and the other cases keep theirs.
            print(f"BASELINE-SKIPPED {shape} {tokens}: out of GPU memory", file=sys.stderr, flush=True)
            fwd = None
        if fwd is None:
            # The failed case's tensors are free once the exception is gone.
            gc.collect()
            torch.cuda.empty_cache()
            continue
        line = f"BASELINE {shape} {tokens} {fwd:.4f} {fwd_bwd:.4f}"
        print(line, flush=True)
        lines.append(line)
    if args.out:
        # Written even when no case fit, so the benchmarks that read it still run.
        with open(args.out, "w") as f:
            f.write("".join(line + "\n" for line in lines))


if __name__ == "__main__":
    main()
