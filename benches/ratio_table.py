"""The GEMM table of one device call that ran torch and mok more than once, alternating
(run_gemm_bench.sh runs torch, mok, mok, torch): each case's time is the mean over its runs, so
a chip that heats up during the call favours neither side. Prints the per-run times too, and the
drift between a side's first and last run (the position effect the alternation cancels).

    ratio_table.py --torch t1.txt t2.txt --mok m1.log m2.log --matmul-tflops R --copy-tbps B

torch files hold `TORCHGEMM <case> <ms> <tflops>` lines (torch_gemm.py --out), mok files
`MOKGEMM <case> <ms> <flop> <bytes>` lines (the gemm bench's output)."""
import argparse
import math
import sys


def read(path, tag):
    """{case: fields after the case name} of the `tag` lines of one run's file."""
    rows = {}
    for line in open(path):
        f = line.split()
        if f and f[0] == tag:
            rows[f[1]] = [float(x) for x in f[2:]]
    if not rows:
        sys.exit(f"ratio_table: no {tag} line in {path}: that run failed (see its log)")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--torch", nargs="+", required=True)
    ap.add_argument("--mok", nargs="+", required=True)
    ap.add_argument("--matmul-tflops", type=float, required=True)
    ap.add_argument("--copy-tbps", type=float, required=True)
    args = ap.parse_args()
    torch_runs = [read(p, "TORCHGEMM") for p in args.torch]
    mok_runs = [read(p, "MOKGEMM") for p in args.mok]

    def runs_ms(runs, case):
        ms = [run[case][0] for run in runs if case in run]
        if len(ms) != len(runs):  # a case missing from one run would bias the mean: say so
            print(f"ratio_table: {case} is in {len(ms)} of {len(runs)} runs; mean over those")
        return ms

    def fmt(ms):
        return "/".join(f"{m:.3f}" for m in ms)

    print("| case | mok ms (runs) | mok TFLOP/s | torch ms (runs) | torch TFLOP/s | mok / torch | floor ms (FLOP / bytes) |")
    print("|---|---|---|---|---|---|---|")
    for case in mok_runs[0]:
        mok_ms = runs_ms(mok_runs, case)
        _, flop, nbytes = mok_runs[0][case]
        mok_mean = sum(mok_ms) / len(mok_ms)
        dense = case.startswith("dense8")
        keys = ["dense8-matmul", "dense8-grouped_mm"] if dense else [case]
        floor_flop, floor_bytes = flop / (args.matmul_tflops * 1e9), nbytes / (args.copy_tbps * 1e9)
        for n, key in enumerate(keys):
            if key in torch_runs[0]:
                torch_ms = runs_ms(torch_runs, key)
                torch_mean = sum(torch_ms) / len(torch_ms)
                torch_cols = f"{fmt(torch_ms)} | {flop / torch_mean / 1e9:.0f} | {torch_mean / mok_mean:.3f}x"
            else:
                torch_cols = "- | - | -"
            name = case if n == 0 else f"{case} vs _grouped_mm"
            mok_cols = f"{fmt(mok_ms)} | {flop / mok_mean / 1e9:.0f}" if n == 0 else " | "
            floor = f"{max(floor_flop, floor_bytes):.3f} ({floor_flop:.3f} / {floor_bytes:.3f})" if n == 0 else ""
            print(f"| {name} | {mok_cols} | {torch_cols} | {floor} |")

    # Drift: geometric mean over the cases of (last run's time / first run's time), per side.
    for side, runs in (("torch", torch_runs), ("mok", mok_runs)):
        if len(runs) < 2:
            continue
        shared = [c for c in runs[0] if c in runs[-1]]
        logs = [math.log(runs[-1][c][0] / runs[0][c][0]) for c in shared]
        print(f"DRIFT {side}: last run / first run time, geometric mean over {len(shared)} cases: "
              f"{math.exp(sum(logs) / len(logs)):.3f}")


if __name__ == "__main__":
    main()
