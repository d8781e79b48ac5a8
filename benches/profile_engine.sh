#!/usr/bin/env bash
# Nsight Compute profile of one engine launch inside the GEMM benchmark, on a machine where ncu
# can read the GPU's hardware counters (its driver allowing profiling by the user). Clocks are left
# alone (--clock-control none), as the benchmark runs them.
#   ./profile_engine.sh KERNEL_REGEX CASES NAME [SKIP]
# e.g. ./profile_engine.sh mok_sm90_gemm_gate_up kimi:8192 kimi-gate-up
# profiles the first (after SKIP) launch of a kernel matching KERNEL_REGEX while `gemm --cases
# CASES` runs (the dense case always runs first), and writes $OUT/NAME.txt (details page) and
# $OUT/NAME.ncu-rep. MOK_PTX, if set, is passed through.
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 KERNEL_REGEX CASES NAME [SKIP]" >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
ncu --clock-control none --set full -k "regex:$1" --launch-skip "${4:-0}" --launch-count 1 \
    -o "$out/$3" -f "${GEMM_BIN:-$here/gemm}" --cases "$2" > "$out/$3.run.log" 2>&1
ncu --import "$out/$3.ncu-rep" --page details > "$out/$3.txt"
# The memory counters that tell where the bytes went, one line each.
ncu --import "$out/$3.ncu-rep" --page raw --csv 2>/dev/null | python3 -c '
import csv, sys
rows = list(csv.reader(sys.stdin))
names, units, values = rows[0], rows[1], rows[2]
for n, u, v in zip(names, units, values):
    if any(k in n for k in ("dram__bytes", "lts__t_sectors_srcunit_tex", "lts__t_sectors_srcunit_ltcfabric", "gpu__time_duration", "lts__t_sector_hit_rate", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct")):
        print(f"{n} {u} {v}")
' > "$out/$3.metrics.txt" || true
