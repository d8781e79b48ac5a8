#!/usr/bin/env bash
# Builds the work-slot probe of docs/PERF.md ("The tile lookups after every L1 invalidation")
# into DIR (default target/work-slot-probe), ready to carry to one device call:
# - base.ptx, the shipped kernels; work.ptx, benches/probes/work-in-slot.patch applied (every
#   engine variant but the standalone weight gradient takes each tile's lookup from a
#   shared-memory slot its producer fills, instead of looking it up in global memory); and
#   gallop.ptx, benches/probes/gallop-search.patch on top (each producer searches its tile's
#   group from its previous tile's: the patch's `gemm_layout::pair_group_from`, whose unit test
#   runs here);
# - the bundle's test binaries and the layer bench, built with the patch applied: the patch
#   grows the engine's dynamic shared memory by the slots (192 bytes), which the host sets at
#   launch, so the probe's tests need a host built with it (the shipped kernels run under it too:
#   they leave the slots' bytes unused).
# Restores kernels/ afterwards; bundle/ keeps the patched host (rebuild it for anything else).
# Takes ~10 minutes (the bundle). Run from the repository root on a clean kernels/ tree; then
#   run: cd DIR && TESTS="megakernel moe_layer ep_ engine_path gemm" SANITIZE=megakernel_is_bitwise \
#        CASES=kimi:8192,qwen:8192 GEMM=engine,megakernels benches/run_ptx_trial.sh \
#        gallop.ptx work.ptx base.ptx gallop.ptx work.ptx base.ptx
# with carry ["DIR relative to the repository"] (the tests run on the first PTX named; run them
# on work.ptx too, `MOK_PTX=work.ptx ./run.sh ...`, before shipping it alone).
set -euo pipefail
dir="$(realpath -m "${1:-target/work-slot-probe}")"
git diff --quiet -- kernels || { echo "kernels/ has uncommitted changes" >&2; exit 1; }
mkdir -p "$dir"
stage="$(mktemp -d)"  # gpu-subset copies the PTX files into DIR
cp src/ptx/mok_sm90a.ptx "$stage/base.ptx"
trap 'git checkout -q -- kernels; cargo xtask ptx > /dev/null 2>&1 || true' EXIT
git apply benches/probes/work-in-slot.patch
cargo xtask ptx > /dev/null
cp target/ptx/mok_sm90a.ptx "$stage/work.ptx"
grep -E "mok_sm90_(gemm|forward|backward)" target/ptx/ptxas-report.txt
cmp -s "$stage/base.ptx" "$stage/work.ptx" && { echo "the patch changed nothing" >&2; exit 1; }
# On top: each producer searches its tile's group from its previous tile's.
git apply benches/probes/gallop-search.patch
# Its search checked against the full one (`pair_list_computes_every_tile_once_...`).
cargo test -q -p mok-kernels --lib pair_list
cargo xtask ptx > /dev/null
cp target/ptx/mok_sm90a.ptx "$stage/gallop.ptx"
grep -E "mok_sm90_(gemm|forward|backward)" target/ptx/ptxas-report.txt
cargo xtask gpu-bundle > "$dir/bundle.log" 2>&1 || { tail -20 "$dir/bundle.log" >&2; exit 1; }
cargo xtask gpu-subset --out "$dir" --tests gpu_unfused,gpu_api,gpu_exchange,gpu_gemm --benches layer \
    --files "$stage/base.ptx,$stage/work.ptx,$stage/gallop.ptx"
