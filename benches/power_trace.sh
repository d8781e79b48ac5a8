#!/usr/bin/env bash
# Board power and SM clock while torch and then mok run the same GEMM cases (one device call),
# to tell whether a case runs at the power limit in steady state:
#   REPEAT=4 ./power_trace.sh kimi:8192
# Each side runs REPEAT times back to back (the bench always runs the dense case first; with a few
# seconds per run, a second's samples mostly fall in the grouped cases). Run from the bundle's
# benches/ folder. `nvidia-smi dmon` samples once a second; the table gives
# each phase's samples at ≥ 400 W (the GEMMs, not process start-up), and dmon.log keeps them all. Logs go to $OUT.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 CASES" >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
nvidia-smi dmon -s pc -d 1 -o T > "$out/dmon.log" 2>&1 &
dmon=$!
trap 'kill $dmon 2>/dev/null || true' EXIT
sleep 2
mark() { echo "$1 $(date +%H:%M:%S)" >> "$out/phases.log"; }
: > "$out/phases.log"
mark torch-start
for _ in $(seq "${REPEAT:-4}"); do
    python3 "$here/torch_gemm.py" --cases "$1" --out "$out/power_torch.txt" >> "$out/power_torch.log" 2>&1
done
mark torch-end
sleep 3
mark mok-start
for _ in $(seq "${REPEAT:-4}"); do
    "${GEMM_BIN:-$here/gemm}" --cases "$1" --baseline "$out/power_torch.txt" >> "$out/power_mok.log" 2>&1
done
mark mok-end
sleep 1
kill $dmon
python3 - "$out/dmon.log" "$out/phases.log" <<'PY'
import sys
samples, names = [], None
for line in open(sys.argv[1]):
    if line.startswith("#"):
        if names is None:  # the first header line names the columns: Time gpu pwr ... pclk
            names = line.lstrip("#").split()
        continue
    f = line.split()
    if names and len(f) == len(names) and f[names.index("pwr")] != "-":
        samples.append((f[0], float(f[names.index("pwr")]), float(f[names.index("pclk")])))
phases = dict(l.split() for l in open(sys.argv[2]))
for who in ("torch", "mok"):
    start, end = phases[f"{who}-start"], phases[f"{who}-end"]
    # Samples at >= 400 W: the GEMMs themselves, not process start-up between runs.
    inside = [s for s in samples if start <= s[0] <= end and s[1] >= 400]
    if not inside:
        print(f"{who}: no samples"); continue
    power = [s[1] for s in inside]; clock = [s[2] for s in inside]
    print(f"POWER {who}: {len(inside)} s, power {min(power):.0f}-{max(power):.0f} W (mean {sum(power)/len(power):.0f}), "
          f"SM clock {min(clock):.0f}-{max(clock):.0f} MHz (mean {sum(clock)/len(clock):.0f})")
PY
