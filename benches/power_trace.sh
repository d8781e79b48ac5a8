#!/usr/bin/env bash
# Board power and SM clock while torch and then mok run the same GEMM cases (one device call),
# to tell whether a case runs at the power limit in steady state:
#   REPEAT=4 ./power_trace.sh kimi:8192
# Each side runs REPEAT times back to back (the bench always runs the dense case first). Run from
# the bundle's benches/ folder; GPU picks the device (default 0). `nvidia-smi dmon` samples once a
# second; the summary (also in $OUT/power_summary.txt) keeps the samples at >= 600 W (the
# GEMMs; ramps and start-up between runs stay below); dmon.log keeps them all. Times are
# compared as HH:MM:SS, so a trace must not span midnight.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 CASES" >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
: > "$out/phases.log"; : > "$out/power_torch.log"; : > "$out/power_mok.log"
nvidia-smi dmon -i "${GPU:-0}" -s pc -d 1 -o T > "$out/dmon.log" 2>&1 &
dmon=$!
trap 'kill $dmon 2>/dev/null || true' EXIT
sleep 2
mark() { echo "$1 $(date +%H:%M:%S)" >> "$out/phases.log"; }
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
python3 - "$out/dmon.log" "$out/phases.log" <<'PY' | tee "$out/power_summary.txt"
import sys
samples, names = [], None
for line in open(sys.argv[1]):
    if line.startswith("#"):
        if names is None:  # the first header line names the columns: Time gpu pwr ... pclk
            names = line.lstrip("#").split()
        continue
    f = line.split()
    if not names or len(f) != len(names):
        continue
    power, clock = f[names.index("pwr")], f[names.index("pclk")]
    if power.replace(".", "").isdigit() and clock.isdigit():
        samples.append((f[0], float(power), float(clock)))
phases = dict(l.split() for l in open(sys.argv[2]))
for who in ("torch", "mok"):
    start, end = phases[f"{who}-start"], phases[f"{who}-end"]
    # The GEMMs themselves: at 1 Hz a burst of a few seconds has only ramps around it, which
    # stay below 600 W (the limit is 700 W), while process start-up between runs sits near idle.
    inside = [s for s in samples if start <= s[0] <= end and s[1] >= 600]
    if not inside:
        print(f"POWER {who}: no sample at >= 600 W"); continue
    power = sorted(s[1] for s in inside); clock = sorted(s[2] for s in inside)
    mid = len(inside) // 2
    print(f"POWER {who}: {len(inside)} samples at >= 600 W: power {power[0]:.0f}-{power[-1]:.0f} W "
          f"(median {power[mid]:.0f}), SM clock {clock[0]:.0f}-{clock[-1]:.0f} MHz (median {clock[mid]:.0f})")
PY
