"""Reads `ncu --page source --csv --print-source sass` on stdin and prints the SASS instructions
holding the most warp-state samples, each with its largest stall reasons (stall_profile.sh).
Its reading of the export (`source_table`, `col`, `num`) is shared with stall_regions.py."""
import csv
import sys


def source_table(rows, name="stall_top"):
    """(header, data rows) of a source-page export: it starts with a "Kernel Name" line; the
    header is the first row naming the source."""
    starts = [i for i, r in enumerate(rows) if any(c.strip().lower() == "source" for c in r)]
    if not starts:
        sys.exit(f"{name}: no source page header (ncu could not export it)")
    head = rows[starts[0]]
    return head, [r for r in rows[starts[0] + 1:] if len(r) == len(head)]


def col(head, *keys, avoid=()):
    """The index of the first column whose name holds every key and none of `avoid`."""
    for i, name in enumerate(head):
        low = name.lower()
        if all(k in low for k in keys) and not any(a in low for a in avoid):
            return i
    return None


def num(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def stall_reasons(head, total):
    """The per-reason sample columns (every stall column but the totals)."""
    return [i for i, name in enumerate(head) if "stall" in name.lower() and i != total and "not-issued" not in name.lower()]


def main():
    head, data = source_table(list(csv.reader(sys.stdin)))
    print("columns:", "; ".join(head))
    total, source, address = col(head, "warp stall sampling (all"), col(head, "source"), col(head, "address")
    if total is None or source is None:
        sys.exit("stall_top: no sample or source column")
    reasons = stall_reasons(head, total)
    all_samples = sum(num(r[total]) for r in data) or 1.0
    print(f"samples: {all_samples:.0f}")
    for r in sorted(data, key=lambda r: -num(r[total]))[:30]:
        top = sorted(((num(r[i]), head[i]) for i in reasons), reverse=True)[:3]
        why = ", ".join(f"{name} {v:.0f}" for v, name in top if v > 0)
        where = r[address] if address is not None else ""
        print(f"{100 * num(r[total]) / all_samples:5.1f}% {where} {r[source].strip()[:70]} | {why}")


if __name__ == "__main__":
    main()
