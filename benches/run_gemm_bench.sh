#!/usr/bin/env bash
# One device call: ceilings, PyTorch GEMM baselines and mok's engine benchmark side by side.
# The two sides alternate, torch, mok, mok, torch (ORDER overrides it), and each case is the mean
# over its side's runs: the chip heats up over a call, so whichever side ran second would be timed
# on a hotter chip (lower clock at the same power). Board power, temperature and SM clock are
# sampled once a second into dmon.log. Run from the bundle's benches/ folder (or set GEMM_BIN).
# Logs go to $OUT (or ./bench-logs); the table printed last is the call's result.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-./bench-logs}"
mkdir -p "$out"
cases="${CASES:-kimi:8192,glm:8192,qwen:8192,deepseek:8192,kimi:32768,qwen:32768}"
order="${ORDER:-torch mok mok torch}"
gemm_bin="${GEMM_BIN:-$here/gemm}"
nvidia-smi dmon -s pct -d 1 -o T > "$out/dmon.log" 2>&1 &
dmon=$!
trap 'kill $dmon 2>/dev/null || true' EXIT
[ -f "$out/ceilings.log" ] || python3 "$here/ceilings.py" 2>&1 | tee "$out/ceilings.log"
read -r _ _ matmul _ copy < <(grep CEILING "$out/ceilings.log")
torch_files=() mok_files=()
for side in $order; do
    case "$side" in
    torch)
        n=$((${#torch_files[@]} + 1))
        echo "== torch run $n $(date +%H:%M:%S)" | tee -a "$out/phases.log"
        PYTHONUNBUFFERED=1 python3 "$here/torch_gemm.py" --cases "$cases" --out "$out/torch_gemm-$n.txt" \
            2>&1 | tee "$out/torch_gemm-$n.log"
        torch_files+=("$out/torch_gemm-$n.txt")
        ;;
    mok)
        n=$((${#mok_files[@]} + 1))
        echo "== mok run $n $(date +%H:%M:%S)" | tee -a "$out/phases.log"
        # Its own table uses the first torch run; the combined table below uses all of them.
        "$gemm_bin" --cases "$cases" --baseline "${torch_files[0]:-/dev/null}" --matmul-tflops "$matmul" \
            --copy-tbps "$copy" 2>&1 | tee "$out/gemm-$n.log"
        mok_files+=("$out/gemm-$n.log")
        ;;
    *) echo "ORDER holds '$side'; each word must be torch or mok" >&2; exit 2 ;;
    esac
done
echo "== end $(date +%H:%M:%S)" | tee -a "$out/phases.log"
python3 "$here/ratio_table.py" --torch "${torch_files[@]}" --mok "${mok_files[@]}" \
    --matmul-tflops "$matmul" --copy-tbps "$copy" | tee "$out/table.txt"
