"""Reads `ncu --page source --csv --print-source sass` on stdin and prints the SASS instructions
holding the most warp-state samples, each with its largest stall reasons (stall_profile.sh)."""
import csv
import sys

rows = list(csv.reader(sys.stdin))
# The export starts with a "Kernel Name" line; the header is the first row naming the source.
starts = [i for i, r in enumerate(rows) if any(c.strip().lower() == "source" for c in r)]
if not starts:
    sys.exit("stall_top: no source page header (ncu could not export it)")
head, rows = rows[starts[0]], rows[starts[0]:]
print("columns:", "; ".join(head))


def col(*keys, avoid=()):
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


total = col("warp stall sampling (all")
source = col("source")
address = col("address")
if total is None or source is None:
    sys.exit("stall_top: no sample or source column")
reasons = [i for i, name in enumerate(head) if "stall" in name.lower() and i != total and "not-issued" not in name.lower()]
data = [r for r in rows[1:] if len(r) == len(head)]
all_samples = sum(num(r[total]) for r in data) or 1.0
print(f"samples: {all_samples:.0f}")
for r in sorted(data, key=lambda r: -num(r[total]))[:30]:
    top = sorted(((num(r[i]), head[i]) for i in reasons), reverse=True)[:3]
    why = ", ".join(f"{name} {v:.0f}" for v, name in top if v > 0)
    where = r[address] if address is not None else ""
    print(f"{100 * num(r[total]) / all_samples:5.1f}% {where} {r[source].strip()[:70]} | {why}")
