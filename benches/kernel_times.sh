#!/usr/bin/env bash
# Every kernel's duration inside the layer benchmark, under Nsight Compute (each kernel alone,
# clocks and caches as the benchmark leaves them), for one case and one backend:
#   ./kernel_times.sh CASE BACKEND NAME [LAYER ARGS...]
# e.g. ./kernel_times.sh kimi:8192 megakernel kimi-mk
# writes $OUT/NAME.csv (ncu's raw page) and prints, per kernel name, its launches and the median,
# min and max of its durations in µs. The benchmark runs one timed repetition (`--reps 1`) after
# its warm-up, so the counts include the warm-up's launches and the per-side timings'. With
# SEQUENCE=NAME, also every launch of kernel NAME in order, in ms (e.g. the megakernel's passes:
# warm-up, timed, then its sides alone). MOK_PTX, if set, is passed through.
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 CASE BACKEND NAME [LAYER ARGS...]" >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
case_="$1" backend="$2" name="$3"
shift 3
ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --page raw \
    --log-file "$out/$name.csv" "${LAYER_BIN:-$here/layer}" --cases "$case_" --gemm "$backend" --reps 1 "$@" \
    > "$out/$name.run.log" 2>&1
python3 - "$out/$name.csv" "$name" "${SEQUENCE:-}" <<'PY'
import csv, statistics, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
header = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
names = rows[header]
k, d = names.index("Kernel Name"), names.index("gpu__time_duration.sum")
unit = rows[header + 1][d]
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(unit, 1.0)
times = {}
for r in rows[header + 2:]:
    times.setdefault(r[k].split("(")[0], []).append(float(r[d].replace(",", "")) * scale)
if sys.argv[3]:
    print(f"{sys.argv[2]} {sys.argv[3]} in order (ms):", " ".join(f"{t / 1e3:.3f}" for t in times.get(sys.argv[3], [])))
for kernel, ts in sorted(times.items(), key=lambda kv: -statistics.median(kv[1])):
    print(f"{sys.argv[2]} {kernel} n={len(ts)} median={statistics.median(ts):.1f}us min={min(ts):.1f} max={max(ts):.1f}")
PY
