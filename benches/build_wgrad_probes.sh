#!/usr/bin/env bash
# Builds the weight-gradient timing probes of docs/PERF.md ("The backward's weight gradients,
# probed") into DIR (default target/wgrad-probes), each a one-line toggle of the backward
# megakernel's weight-gradient producer, plus base.ptx (the tree's own):
#   everyTile  the producer waits for a tile's rows at every tile, not once per group
#   noWait     no wait at all before a weight-gradient tile (results may be WRONG: timing only)
#   regs224    every paired variant at the weight gradient's own 56 / 224 register split
#   noEpiW     a weight-gradient tile stores nothing (no epilogue; standalone and megakernel)
#   loadsW     a weight-gradient tile's stages are loaded and released, nothing else (no MMA
#              issued, none stored: what the loads alone take)
# (noEpiW and loadsW change the standalone weight gradient too: time both, `gemm --cases kimi:8192`
# next to the layer bench's "weight-gradient tiles alone", to see which side of a tile the
# megakernel's extra time is on.)
# Time them with the layer bench's backward lines:
#   for v in base everyTile noWait; do
#     MOK_PTX=DIR/$v.ptx ./layer --cases kimi:8192,qwen:8192 --gemm megakernels; done
# Run from the repository root.
set -euo pipefail
dir="$(realpath -m "${1:-target/wgrad-probes}")"
producer=kernels/src/gemm/producer.rs
hooks=kernels/src/gemm/hooks.rs
mkdir -p "$dir"
cargo xtask ptx > /dev/null
cp target/ptx/mok_sm90a.ptx "$dir/base.ptx"
benches/ptx_variant.sh "$dir/everyTile.ptx" $producer \
    's/if hooked(V) \&\& !(V == Variant::WGRAD_IN_PAIR \&\& w.group == ready_group) {/if hooked(V) \&\& ready_group != u32::MAX - 1 {/'
benches/ptx_variant.sh "$dir/noWait.ptx" $hooks \
    's/                    wait_for_group(b, \&c, work.group, gathered);/                    if work.group == u32::MAX { wait_for_group(b, \&c, work.group, gathered); }/'
benches/ptx_variant.sh "$dir/regs224.ptx" kernels/src/gemm_layout.rs \
    's/^pub const PAIRED_PRODUCER_REGISTERS: u32 = 64;/pub const PAIRED_PRODUCER_REGISTERS: u32 = 56;/' \
    kernels/src/gemm_layout.rs 's/^pub const PAIRED_CONSUMER_REGISTERS: u32 = 216;/pub const PAIRED_CONSUMER_REGISTERS: u32 = 224;/'
benches/ptx_variant.sh "$dir/noEpiW.ptx" kernels/src/gemm/epilogue.rs \
    's/^    let out = if is_wgrad(V) {/    if is_wgrad(V) \&\& p.n != 0x7fff_fff1 { return; }\n    let out = if is_wgrad(V) {/'
benches/ptx_variant.sh "$dir/loadsW.ptx" kernels/src/gemm/engine.rs \
    's/if !is_wgrad(V) \&\& (wg \* 64 >= w.rows || !w.has_columns) {/if (is_wgrad(V) \&\& p.n != 0x7fff_fff1) || (!is_wgrad(V) \&\& (wg * 64 >= w.rows || !w.has_columns)) {/'
cmp -s target/ptx/mok_sm90a.ptx "$dir/base.ptx" || { echo "target/ptx no longer matches the tree" >&2; exit 1; }
echo "probes in $dir: base everyTile noWait regs224 noEpiW loadsW"
