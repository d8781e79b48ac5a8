#!/usr/bin/env bash
# Builds the timing probe of docs/PERF.md ("The deterministic weight-gradient reduction against
# a split over blocks") into DIR (default target/wgrad-split-probe): split2.ptx runs every
# weight-gradient tile as two tiles, each over half of the expert's rows (whole 64-row K blocks
# to the first), both storing into the same output tile — so its results are WRONG and only its
# time means something. It is a lower bound on a real split over blocks: that would also write
# f32 partials and reduce them in a fixed order. base.ptx is the tree's own. Time them with
#   benches/compare_layer_ptx.sh base.ptx split2.ptx   (GEMM=megakernels)
# and compare the backward lines. Run from the repository root.
set -euo pipefail
dir="$(realpath -m "${1:-target/wgrad-split-probe}")"
source=kernels/src/gemm/source.rs
mkdir -p "$dir"
cargo xtask ptx > /dev/null
cp target/ptx/mok_sm90a.ptx "$dir/base.ptx"
benches/ptx_variant.sh "$dir/split2.ptx" \
    $source 's/        weight_gradient_tiles(p.groups, p.m, p.n)$/        2 * weight_gradient_tiles(p.groups, p.m, p.n)/' \
    $source 's/        let group = tile \/ (m_tiles \* nt);/        let (half, tile) = (tile % 2, tile \/ 2); let group = tile \/ (m_tiles * nt);/' \
    $source 's/        let k_blocks = (row_end - row_begin).div_ceil(TILE_K);/        let split = (row_end - row_begin).div_ceil(TILE_K) \/ 2 * TILE_K; let (row_begin, row_end) = if half == 0 { (row_begin, row_begin + split) } else { (row_begin + split, row_end) }; let k_blocks = (row_end - row_begin).div_ceil(TILE_K);/'
cmp -s target/ptx/mok_sm90a.ptx "$dir/base.ptx" || { echo "target/ptx no longer matches the tree" >&2; exit 1; }
echo "probes in $dir: base split2"
