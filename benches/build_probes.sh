#!/usr/bin/env bash
# Builds the timing probes of docs/PERF.md ("Probes: what the operand streams cost",
# 2026-11-29) into DIR (default bundle/benches): each a one-line toggle of the engine's producer or
# consumer whose results are WRONG — only their times mean something — as NAME.ptx plus a
# wrapper probe_NAME.sh that runs the bundle's `gemm` with MOK_PTX set to it, for
#   ./compare_bins.sh base=./gemm noW=./probe_noW.sh ...
#   noA     a tile's rows loaded only for its first K block (M-pairs)
#   noW     the weight tile loaded only for its first K block (M-pairs)
#   noAW    neither
#   skip48  a consumer warpgroup with <= 48 rows of a tile skips its MMAs and epilogue
#   noWn    the weight tile loaded only for its first K block (N-pairs: the downs below K 4096)
#   noStore row-grouped epilogues stage their tiles but issue no TMA store
# Run from the repository root after `cargo xtask gpu-bundle` (which recreates bundle/).
set -euo pipefail
dir="$(realpath -m "${1:-bundle/benches}")"
engine=kernels/src/gemm/engine.rs
expect='                mbarrier::arrive_expect_tx(full, stage_bytes);'
expect_fewer() {  # the bytes a stage after the first no longer brings
    echo "s/$expect/                mbarrier::arrive_expect_tx(full, if kb > 0 \&\& w.shares_weights { stage_bytes - $1 } else { stage_bytes });/"
}
no_rows='s/                        for half in 0..a_halves {/                        for half in 0..(if kb == 0 { a_halves } else { 0 }) {/'
no_weights='s/                        load_weights::<V>(b_tile, (map_b, p.map_b2), k0, w.n0, g, full, Some(rank));/                        if kb == 0 { load_weights::<V>(b_tile, (map_b, p.map_b2), k0, w.n0, g, full, Some(rank)); }/'
no_weights_n='s/                            load_weights::<V>(b_tile, (map_b, p.map_b2), k0, w.n0, g, full, None);/                            if kb == 0 { load_weights::<V>(b_tile, (map_b, p.map_b2), k0, w.n0, g, full, None); }/'
expect_n="s/$expect/                mbarrier::arrive_expect_tx(full, if V != Variant::WGRAD \&\& kb > 0 \&\& !w.shares_weights \&\& w.has_columns { stage_bytes - B_TILE_BYTES } else { stage_bytes });/"
no_store='s/                    (None, _) => tma::store_2d(out.map, col, out.row0 as i32, src),/                    (None, _) => {}/'
skip48='s/        if V != Variant::WGRAD \&\& (wg \* 64 >= w.rows || !w.has_columns) {/        if V != Variant::WGRAD \&\& (wg * 64 + 48 >= w.rows || !w.has_columns) {/'
mkdir -p "$dir"
benches/ptx_variant.sh "$dir/noA.ptx" $engine "$(expect_fewer 'a_halves * (A_TILE_BYTES \/ 2)')" $engine "$no_rows"
benches/ptx_variant.sh "$dir/noW.ptx" $engine "$(expect_fewer B_TILE_BYTES)" $engine "$no_weights"
benches/ptx_variant.sh "$dir/noAW.ptx" $engine "$(expect_fewer 'B_TILE_BYTES - a_halves * (A_TILE_BYTES \/ 2)')" \
    $engine "$no_weights" $engine "$no_rows"
benches/ptx_variant.sh "$dir/skip48.ptx" $engine "$skip48"
benches/ptx_variant.sh "$dir/noWn.ptx" $engine "$expect_n" $engine "$no_weights_n"
benches/ptx_variant.sh "$dir/noStore.ptx" $engine "$no_store"
for name in noA noW noAW skip48 noWn noStore; do
    cat > "$dir/probe_$name.sh" <<EOF
#!/usr/bin/env bash
# Timing probe $name (wrong results): the bundle's gemm with $name.ptx.
MOK_PTX="\$(dirname "\$0")/$name.ptx" exec "\$(dirname "\$0")/gemm" "\$@"
EOF
    chmod +x "$dir/probe_$name.sh"
done
echo "probes in $dir: noA noW noAW skip48 noWn noStore"
