#!/usr/bin/env bash
# The GEMM phases of the forward megakernel against the engine path's standalone GEMMs, under
# Nsight Compute: for one case, the engine path's gate/up and down launches and every forward
# megakernel launch (its passes, then its sides alone: comm, compute, empty), each with its time,
# SM clock, DRAM bytes, L2 hit rate and SM throughput. The megakernel's compute side (GEMM tiles
# on rows left in place) against the sum of the two standalone GEMMs says whether its GEMM phases
# read more from DRAM (the tile walk, the L2) or ran at a lower clock (power) or neither.
#   ./gemm_phase_metrics.sh CASE [NAME]     e.g. ./gemm_phase_metrics.sh qwen:32768 q32
# Run from the bundle's benches/ folder; writes $OUT/NAME-{engine,megakernel}.csv and prints one
# line per launch. MOK_PTX, if set, is passed through.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 CASE [NAME]" >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
case_="$1" name="${2:-phases}"
metrics=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,sm__throughput.avg.pct_of_peak_sustained_elapsed
profile() { # BACKEND KERNEL-REGEX
    ncu --clock-control none --cache-control none --metrics "$metrics" --csv --page raw -k "regex:$2" \
        --log-file "$out/$name-$1.csv" "${LAYER_BIN:-$here/layer}" --cases "$case_" --gemm "$1" --reps 1 \
        > "$out/$name-$1.run.log" 2>&1
}
profile engine 'mok_sm90_gemm_(gate_up|rows_nt)$'
profile megakernel '^mok_sm90_forward$'
python3 - "$name" "$out/$name-engine.csv" "$out/$name-megakernel.csv" <<'PY'
import csv, sys
short = {"gpu__time_duration.sum": "time", "sm__cycles_elapsed.avg.per_second": "SM clock",
         "dram__bytes_read.sum": "DRAM read", "dram__bytes_write.sum": "DRAM write",
         "lts__t_sector_hit_rate.pct": "L2 hit", "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM"}
for path in sys.argv[2:]:
    rows = [r for r in csv.reader(open(path)) if r]
    h = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    names, units = rows[h], rows[h + 1]
    k = names.index("Kernel Name")
    for i, r in enumerate(rows[h + 2:]):
        parts = [f"{label} {r[names.index(m)]} {units[names.index(m)]}" for m, label in short.items() if m in names]
        print(f"{sys.argv[1]} {i} {r[k].split('(')[0]}: " + ", ".join(parts))
PY
