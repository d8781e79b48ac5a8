#!/usr/bin/env bash
# Builds the probe of docs/PERF.md v22d into DIR (default target/store-hint-probe): hint.ptx is
# the shipped PTX (src/ptx/mok_sm90a.ptx, base.ptx) with every 3-D TMA store — the weight
# gradients' output tiles — given an L2 evict_first policy (`createpolicy` and
# `.L2::cache_hint`), a text edit of the PTX, checked by ptxas when XTASK_PTXAS (or ptxas on the
# PATH) is there. Results are unchanged; only the time means something. Time them with
#   CASES=kimi:8192,deepseek:8192 benches/compare_ptx.sh base.ptx hint.ptx base2.ptx hint2.ptx
# (compare_ptx.sh names each run by its file: give the repeats their own copies).
set -euo pipefail
dir="$(realpath -m "${1:-target/store-hint-probe}")"
mkdir -p "$dir"
cp src/ptx/mok_sm90a.ptx "$dir/base.ptx"
cp src/ptx/mok_sm90a.ptx "$dir/base2.ptx"
python3 - "$dir/base.ptx" "$dir/hint.ptx" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
store = r"(cp\.async\.bulk\.tensor\.3d\.global\.shared::cta\.tile\.bulk_group) (\[[^\]]*\], \[[^\]]*\]);"
hinted, count = re.subn(store, lambda m: "{ .reg .b64 %pol_ef; createpolicy.fractional.L2::evict_first.b64 %pol_ef, 1.0; "
                        + m.group(1) + ".L2::cache_hint " + m.group(2) + ", %pol_ef; }", text)
if count == 0:
    sys.exit("no 3-D TMA store found: the probe no longer applies")
open(sys.argv[2], "w").write(hinted)
print(f"hint.ptx: {count} stores with an evict_first policy")
PY
cp "$dir/hint.ptx" "$dir/hint2.ptx"
ptxas="${XTASK_PTXAS:-$(command -v ptxas || true)}"
if [ -n "$ptxas" ]; then "$ptxas" -arch=sm_90a "$dir/hint.ptx" -o /dev/null && echo "hint.ptx: ptxas ok"; fi
