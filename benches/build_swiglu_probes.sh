#!/usr/bin/env bash
# Builds the timing probe of docs/PERF.md ("v3 — the SwiGLU backward out of the down dgrad's
# epilogue") into DIR (default target/swiglu-probes), plus base.ptx (the tree's own):
#   noChunkWork    each SwiGLU-backward chunk of the backward megakernel waits for its M tile and
#                  counts as usual but moves no data (d_gate, d_up are NOT written: the results
#                  are WRONG, only the time means something): base minus this is what the
#                  chunks' memory work costs the pass
#   consumersOnly  the chunks run on the consumer warps alone, after their down-dgrad tiles
#                  (the producer warpgroup's spare warps run none); correct results
#   spareOnly      the chunks run on the producer warpgroup's spare warps alone (the consumers
#                  go straight to the gate/up dgrad); correct results
# Time it with the layer bench's backward lines (the data gradients alone: "without its
# weight-gradient tiles"):
#   for v in base noChunkWork consumersOnly spareOnly; do
#     MOK_PTX=DIR/$v.ptx ./layer --cases kimi:8192,qwen:8192 --gemm megakernels; done
# Run from the repository root.
set -euo pipefail
dir="$(realpath -m "${1:-target/swiglu-probes}")"
backward=kernels/src/megakernel/backward.rs
mkdir -p "$dir"
cargo xtask ptx > /dev/null
cp target/ptx/mok_sm90a.ptx "$dir/base.ptx"
benches/ptx_variant.sh "$dir/noChunkWork.ptx" $backward \
    's/let elements = (chunk_first as usize \* width, chunk_end as usize \* width);/let elements = (0, if width == usize::MAX { chunk_end as usize } else { 0 });/'
benches/ptx_variant.sh "$dir/consumersOnly.ptx" kernels/src/gemm/engine.rs \
    's/^            between_dgrads(true);$/            if thread == u32::MAX { between_dgrads(true); }/'
benches/ptx_variant.sh "$dir/spareOnly.ptx" kernels/src/gemm/engine.rs \
    's/^                    between_dgrads(false);$/                    if thread == u32::MAX { between_dgrads(false); }/'
cmp -s target/ptx/mok_sm90a.ptx "$dir/base.ptx" || { echo "target/ptx no longer matches the tree" >&2; exit 1; }
echo "probes in $dir: base noChunkWork consumersOnly spareOnly"
