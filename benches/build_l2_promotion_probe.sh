#!/usr/bin/env bash
# Builds the probe of docs/PERF.md v23a into DIR (default target/l2-promotion-probe): `layer_l2`,
# the layer benchmark with benches/probes/v23a-l2-promotion-env.patch applied to host/, whose
# tensor maps take their L2 promotion from MOK_PROBE_L2_PROMOTION (none, 64, 128; anything else
# or unset: the shipped 256 bytes). Restores host/ afterwards. Carry DIR and time it from there:
#   for v in 256 none 256 none; do MOK_PROBE_L2_PROMOTION=$v ./layer_l2 --cases deepseek:8192 \
#       --gemm engine --baseline base.txt; done
# Run from the repository root on a clean host/ tree.
set -euo pipefail
dir="$(realpath -m "${1:-target/l2-promotion-probe}")"
git diff --quiet -- host || { echo "host/ has uncommitted changes" >&2; exit 1; }
mkdir -p "$dir"
trap 'git checkout -q -- host' EXIT
git apply benches/probes/v23a-l2-promotion-env.patch
executable=$(cargo build --bench layer --release --features "gpu-tests nccl" -p mok --message-format json 2>/dev/null |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "layer" and m.get("executable"):
        print(m["executable"])')
[ -n "$executable" ] || { echo "the layer benchmark did not build" >&2; exit 1; }
strip --strip-debug -o "$dir/layer_l2" "$executable"
echo "$dir/layer_l2"
