#!/usr/bin/env bash
# Builds one PTX variant of the kernels for a timing comparison (benches/compare_ptx.sh):
#   benches/ptx_variant.sh OUT.ptx FILE 'SED_EXPR' [FILE 'SED_EXPR']...
# applies each sed expression to its source file, builds the sm_90a PTX (cargo xtask ptx),
# copies it to OUT.ptx and restores the files. The edit must change something (checked), so a
# stale expression cannot silently time the unchanged kernel.
set -euo pipefail
[ $# -ge 3 ] && [ $(( ($# - 1) % 2 )) -eq 0 ] || { echo "usage: $0 OUT.ptx FILE 'SED_EXPR'..." >&2; exit 2; }
cd "$(dirname "$0")/.."
out="$1"; shift
files=()
restore() { for f in "${files[@]}"; do cp "/tmp/ptx-variant-$(basename "$f").orig" "$f"; done; }
trap restore EXIT
while [ $# -gt 0 ]; do
    file="$1"; expr="$2"; shift 2
    if [[ ! " ${files[*]-} " =~ " $file " ]]; then
        cp "$file" "/tmp/ptx-variant-$(basename "$file").orig"
        files+=("$file")
    fi
    before=$(md5sum < "$file")
    sed -i -e "$expr" "$file"
    [ "$before" != "$(md5sum < "$file")" ] || { echo "sed '$expr' changed nothing in $file" >&2; exit 1; }
done
cargo xtask ptx > /dev/null
cp target/ptx/mok_sm90a.ptx "$out"
grep "mok_sm90_gemm" target/ptx/ptxas-report.txt
