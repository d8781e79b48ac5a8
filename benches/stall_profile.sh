#!/usr/bin/env bash
# Where the warps of one engine launch wait: Nsight Compute's warp-state sampling per SASS
# instruction (SourceCounters), clocks left alone as the benchmark runs them.
#   ./stall_profile.sh KERNEL_REGEX CASES NAME [SKIP]
# e.g. ./stall_profile.sh mok_sm90_gemm_rows_nt '' dense 4   (CASES '' = the dense case only)
# Writes $OUT/NAME.stalls.txt: the launch's time, tensor-pipe use and SM clock, then the
# instructions holding the most samples with their stall reasons (the top of the list names the
# waits that bound the launch), and $OUT/NAME.source.csv.gz (every instruction's samples). MOK_PTX and GEMM_BIN pass through; BENCH_ARGS is added to the
# benchmark's arguments (e.g. GEMM_BIN=./layer BENCH_ARGS='--gemm megakernels --reps 2');
# SAMPLING_INTERVAL=N samples every 2^(5 + N) cycles (ncu's `--warp-sampling-interval`; default
# ncu's choice), so that launches profiled with the same N have comparable sample counts.
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 KERNEL_REGEX CASES NAME [SKIP]" >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
rep="$out/$3.ncu-rep"
ncu --clock-control none --section SourceCounters --section WarpStateStats --section SpeedOfLight --section LaunchStats \
    --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second \
    ${SAMPLING_INTERVAL:+--warp-sampling-interval "$SAMPLING_INTERVAL"} \
    -k "regex:$1" --launch-skip "${4:-0}" --launch-count 1 -o "$rep" -f \
    "${GEMM_BIN:-$here/gemm}" --cases "$2" ${BENCH_ARGS:-} > "$out/$3.run.log" 2>&1
{
    ncu --import "$rep" --page raw --csv 2>/dev/null | python3 -c '
import csv, sys
rows = list(csv.reader(sys.stdin))
for n, u, v in zip(rows[0], rows[1], rows[2]):
    if any(k in n for k in ("gpu__time_duration.sum", "hmma_cycles_active", "sm__cycles_elapsed.avg.per_second", "launch__grid_size", "launch__cluster", "dram__throughput.avg.pct", "sm__throughput.avg.pct")):
        print(f"{n} {u} {v}")'
    ncu --import "$rep" --page details --section WarpStateStats 2>/dev/null | grep -E "Stall|Warp Cycles" || true
    ncu --import "$rep" --page source --csv --print-source sass 2>/dev/null | tee "$out/$3.source.csv" | python3 "$here/stall_top.py" || true
} > "$out/$3.stalls.txt" 2>&1
gzip -f "$out/$3.source.csv"
cat "$out/$3.stalls.txt"
rm -f "$rep"
