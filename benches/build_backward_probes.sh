#!/usr/bin/env bash
# Builds the timing probes of docs/PERF.md ("The fused SwiGLU-backward epilogue, probed") into DIR
# (default target/backward-probes): each a one-line toggle of the down dgrad's fused epilogue
# (`swiglu_backward_rows`, used by `mok_sm90_backward`, `mok_sm90_backward_ranks` and the
# standalone `mok_sm90_gemm_rows_nn_swiglu_bwd`) whose results are WRONG — only their times mean
# something — as NAME.ptx, plus base.ptx (the tree's own). Time them with the layer bench:
#   for v in base noEpi noLoad noMath noStore; do
#     MOK_PTX=DIR/$v.ptx ./layer --cases kimi:8192,qwen:8192 --gemm megakernels; done
# and compare the "without its weight-gradient tiles" lines (the data gradients alone).
#   noEpi    no pair is written or read (the epilogue does nothing but meet)
#   noLoad   the pre-activations are constants made from the pair's offset, not loads
#   noMath   d_gate, d_up are plain products, not the SwiGLU backward
#   noStore  the stores run only for a never-seen bit pattern (the math stays live)
# Run from the repository root.
set -euo pipefail
dir="$(realpath -m "${1:-target/backward-probes}")"
epilogue=kernels/src/gemm/epilogue.rs
mkdir -p "$dir"
cargo xtask ptx > /dev/null
cp target/ptx/mok_sm90a.ptx "$dir/base.ptx"
benches/ptx_variant.sh "$dir/noEpi.ptx" $epilogue \
    's/        if r >= w.rows || w.n0 + col >= p.n {/        if r >= w.rows || w.n0 + col >= p.n || p.n != 0 {/'
benches/ptx_variant.sh "$dir/noLoad.ptx" $epilogue \
    's/let (g0, g1, u0, u1) = (\*gate.add(at), \*gate.add(at + 1), \*up.add(at), \*up.add(at + 1));/let _ = (gate, up); let (g0, g1, u0, u1) = (at as f32, 0.5, 0.25, at as f32 * 0.5);/'
benches/ptx_variant.sh "$dir/noMath.ptx" $epilogue \
    's/math::swiglu_backward(g0, u0, acc\[index\], limit)/(g0 * acc[index] + limit, u0 * acc[index])/' \
    $epilogue 's/math::swiglu_backward(g1, u1, acc\[index + 1\], limit)/(g1 * acc[index + 1], u1 * acc[index + 1])/'
benches/ptx_variant.sh "$dir/noStore.ptx" $epilogue \
    's/\*d_gate.add(at \/ 2) = f32x2_to_bf16x2(dg0, dg1);/if dg0.to_bits() == 0x7fc0_0001 { *d_gate.add(at \/ 2) = f32x2_to_bf16x2(dg0, dg1); }/' \
    $epilogue 's/\*d_up.add(at \/ 2) = f32x2_to_bf16x2(du0, du1);/if du0.to_bits() == 0x7fc0_0001 { *d_up.add(at \/ 2) = f32x2_to_bf16x2(du0, du1); }/'
cmp -s target/ptx/mok_sm90a.ptx "$dir/base.ptx" || { echo "target/ptx no longer matches the tree" >&2; exit 1; }
echo "probes in $dir: base noEpi noLoad noMath noStore"
