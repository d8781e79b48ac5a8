"""Splits the warp-state samples of Nsight Compute source exports (`stall_profile.sh`'s
NAME.source.csv[.gz]) between the GEMM main loops and everything else, so that two launches
doing the same GEMM work — the forward megakernel's compute side against the standalone gate/up
and down kernels — show whether their difference lies inside the K loops or at the tiles'
boundaries (tile hand-out and lookup, hooks, epilogues, the warpgroups' waits on each other).

    python3 benches/stall_regions.py mk=mk.source.csv.gz engine=gu.source.csv.gz,dn.source.csv.gz

Each argument is LABEL=CSV[,CSV...] (the CSVs of one label are summed). A main loop is the
code from a K block's stage wait through its `HGMMA`s to the loop's branch: the
consumers' K loop, one per GEMM variant the kernel holds. Samples count warp cycles only when
the launches were sampled at the same interval (`SAMPLING_INTERVAL` of stall_profile.sh);
otherwise compare the shares. Prints per label: samples in main loops and elsewhere, the stall
reasons of each, and the instructions outside the main loops holding the most samples.
"""
import csv
import gzip
import re
import sys

from stall_top import col, num, source_table, stall_reasons  # the script's own folder is on sys.path


def read_rows(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        return source_table(list(csv.reader(f)), f"stall_regions: {path}")


def main_loops(texts):
    """Index ranges (first, last) of the consumers' K loops in one kernel's instructions, in
    address order: each group of `HGMMA`s (a K block's), from the last barrier wait
    (`SYNCS.PHASECHK`) before its first `HGMMA` — where every engine variant's K-loop body
    starts, waiting for its stage — through the first branch after its last `HGMMA` (the loop's
    backward branch)."""
    hgmma = [i for i, text in enumerate(texts) if "HGMMA" in text]
    if not hgmma:
        return []
    groups, current = [], [hgmma[0]]
    for i in hgmma[1:]:
        # A K block's HGMMAs lie a few instructions apart; the next group is another loop.
        if i - current[-1] > 64:
            groups.append(current)
            current = [i]
        else:
            current.append(i)
    groups.append(current)
    loops = []
    for group in groups:
        first = group[0]
        while first > 0 and "SYNCS.PHASECHK" not in texts[first]:
            first -= 1
        last = group[-1]
        while last + 1 < len(texts) and not re.search(r"\bBRA\b", texts[last]):
            last += 1
        loops.append((first, last))
    return loops


def summarise(label, paths):
    regions = {"main loops": {}, "elsewhere": {}}
    totals = {"main loops": 0.0, "elsewhere": 0.0}
    hot = []
    for path in paths:
        head, rows = read_rows(path)
        total = col(head, "warp stall sampling (all")
        source, address = col(head, "source"), col(head, "address")
        if total is None or source is None:
            sys.exit(f"stall_regions: {path}: no sample or source column")
        reasons = stall_reasons(head, total)
        data = [r for r in rows if r[source].strip()]
        texts = [r[source].strip() for r in data]
        loops = main_loops(texts)
        for index, (r, text) in enumerate(zip(data, texts)):
            pc = r[address].strip() if address is not None else f"#{index}"
            region = "main loops" if any(a <= index <= b for a, b in loops) else "elsewhere"
            samples = num(r[total])
            totals[region] += samples
            for i in reasons:
                regions[region][head[i]] = regions[region].get(head[i], 0.0) + num(r[i])
            if region == "elsewhere" and samples > 0:
                hot.append((samples, path.split("/")[-1], pc, text[:60]))
    everything = sum(totals.values()) or 1.0
    print(f"{label}: {everything:.0f} samples")
    for region in ("main loops", "elsewhere"):
        top = sorted(((v, k) for k, v in regions[region].items() if v > 0), reverse=True)[:5]
        why = ", ".join(f"{k.replace('Warp Stall Sampling', '').strip()} {v:.0f}" for v, k in top)
        print(f"  {region}: {totals[region]:.0f} ({100 * totals[region] / everything:.1f} %) | {why}")
    print("  outside the main loops, the instructions holding the most samples:")
    for samples, name, pc, text in sorted(hot, reverse=True)[:15]:
        print(f"    {100 * samples / everything:5.2f}% {name} {pc} {text}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for argument in sys.argv[1:]:
        label, _, files = argument.partition("=")
        if not files:
            sys.exit(f"stall_regions: {argument}: expected LABEL=CSV[,CSV...]")
        summarise(label, files.split(","))
