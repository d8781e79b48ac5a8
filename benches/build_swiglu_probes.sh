#!/usr/bin/env bash
# Builds the timing probe of docs/PERF.md ("v3 — the SwiGLU backward out of the down dgrad's
# epilogue") into DIR (default target/swiglu-probes), plus base.ptx (the tree's own):
#   noChunkWork  each SwiGLU-backward chunk of the backward megakernel waits for its M tile and
#                counts as usual but moves no data (d_gate, d_up are NOT written: the results
#                are WRONG, only the time means something): base minus this is what the
#                chunks' memory work costs the pass
# Time it with the layer bench's backward lines (the data gradients alone: "without its
# weight-gradient tiles"):
#   for v in base noChunkWork; do
#     MOK_PTX=DIR/$v.ptx ./layer --cases kimi:8192,qwen:8192 --gemm megakernels; done
# Run from the repository root.
set -euo pipefail
dir="$(realpath -m "${1:-target/swiglu-probes}")"
backward=kernels/src/megakernel/backward.rs
mkdir -p "$dir"
cargo xtask ptx > /dev/null
cp target/ptx/mok_sm90a.ptx "$dir/base.ptx"
benches/ptx_variant.sh "$dir/noChunkWork.ptx" $backward \
    's/^                swiglu_backward_octets(rows, /                if width == usize::MAX { swiglu_backward_octets(rows, /; s/chunk_end as usize \* width), lane);$/chunk_end as usize * width), lane); }/'
cmp -s target/ptx/mok_sm90a.ptx "$dir/base.ptx" || { echo "target/ptx no longer matches the tree" >&2; exit 1; }
echo "probes in $dir: base noChunkWork"
