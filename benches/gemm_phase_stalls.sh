#!/usr/bin/env bash
# Where the forward megakernel's GEMM phases spend the cycles the standalone GEMMs do not: the
# warp-state samples of its compute side alone (its GEMM tiles on rows left in place) against
# those of the engine path's gate/up and down launches, all sampled at the same interval, split
# by stall_regions.py between the consumers' K loops and everything else (docs/PERF.md, "The
# forward megakernel's GEMM phases").
#   ./gemm_phase_stalls.sh CASE [NAME] [SKIP]     e.g. ./gemm_phase_stalls.sh qwen:32768 q32
# Run from the bundle's benches/ folder. SKIP (default 5) is the compute side's index among the
# megakernel's launches in `layer --gemm megakernel --reps 1`: four passes, then the comm side,
# the compute side, the empty launch (kernel_times.sh with SEQUENCE=mok_sm90_forward lists
# them). SAMPLING_INTERVAL (default 10: every 2^15 cycles) is passed to stall_profile.sh. Writes
# $OUT/NAME-{mk,gu,dn}.{stalls.txt,source.csv.gz} (the benchmark's run logs go to /tmp: a device
# call brings few files back) and prints the launches' times and the split.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 CASE [NAME] [SKIP]" >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
case_="$1" name="${2:-phases}" skip="${3:-5}"
export SAMPLING_INTERVAL="${SAMPLING_INTERVAL:-10}" GEMM_BIN="${LAYER_BIN:-$here/layer}"
BENCH_ARGS='--gemm megakernel --reps 1' "$here/stall_profile.sh" '^mok_sm90_forward$' "$case_" "$name-mk" "$skip"
BENCH_ARGS='--gemm engine --reps 1' "$here/stall_profile.sh" 'mok_sm90_gemm_gate_up$' "$case_" "$name-gu" 0
BENCH_ARGS='--gemm engine --reps 1' "$here/stall_profile.sh" 'mok_sm90_gemm_rows_nt$' "$case_" "$name-dn" 0
mkdir -p /tmp/ncu-logs
mv "$out/$name"-*.run.log /tmp/ncu-logs/ 2>/dev/null || true
for part in mk gu dn; do
    echo "$name-$part: $(grep -h 'gpu__time_duration.sum\|sm__cycles_elapsed.avg.per_second' "$out/$name-$part.stalls.txt" | tr '\n' ' ')"
done
python3 "$here/stall_regions.py" "megakernel=$out/$name-mk.source.csv.gz" \
    "engine=$out/$name-gu.source.csv.gz,$out/$name-dn.source.csv.gz"
