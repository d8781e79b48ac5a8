#!/usr/bin/env bash
# Builds one PTX variant of the kernels for a timing comparison (benches/compare_ptx.sh):
#   benches/ptx_variant.sh OUT.ptx FILE 'SED_EXPR' [FILE 'SED_EXPR']...
# applies each sed expression to its source file, builds the sm_90a PTX (cargo xtask ptx),
# copies it to OUT.ptx, prints the engine kernels' ptxas line, restores the files and rebuilds, so
# target/ptx matches the tree again. An edit must change something (checked), so a stale
# expression cannot silently time the unchanged kernel. Paths are relative to the caller's folder.
set -euo pipefail
[ $# -ge 3 ] && [ $(( ($# - 1) % 2 )) -eq 0 ] || { echo "usage: $0 OUT.ptx FILE 'SED_EXPR'..." >&2; exit 2; }
out="$(realpath -m "$1")"; shift
repo="$(cd "$(dirname "$0")/.." && pwd)"
backup="$(mktemp -d)"
files=()
restore() {
    local i
    for i in "${!files[@]}"; do cp "$backup/$i" "${files[$i]}"; done
    rm -rf "$backup"
    if [ "${#files[@]}" -gt 0 ]; then (cd "$repo" && cargo xtask ptx > /dev/null 2>&1) || true; fi
}
trap restore EXIT
while [ $# -gt 0 ]; do
    file="$(realpath "$1")"; expr="$2"; shift 2
    known=""
    for f in ${files[@]+"${files[@]}"}; do [ "$f" = "$file" ] && known=1; done
    if [ -z "$known" ]; then
        cp "$file" "$backup/${#files[@]}"
        files+=("$file")
    fi
    before=$(md5sum < "$file")
    sed -i -e "$expr" "$file"
    [ "$before" != "$(md5sum < "$file")" ] || { echo "sed '$expr' changed nothing in $file" >&2; exit 1; }
done
cd "$repo"
cargo xtask ptx > /dev/null
cp target/ptx/mok_sm90a.ptx "$out"
grep "mok_sm90_gemm" target/ptx/ptxas-report.txt
