#!/usr/bin/env bash
# The gathering producers (`UnfusedLayer::set_gather_in_producer`), one step per device call
# (each fits the 10-minute limit of a call): `tests` runs their bitwise tests (the engine path's
# and the forward megakernel's in gpu_unfused, and gpu_gemm's engine_matches_unfused_* with the
# gathering plans, then the backward megakernel's and gpu_api's MoeLayer tests), `sanitize` the layer's and gpu_gemm's two smallest gathering checks (the standalone
# gathering kernels, where racecheck finishes quickly) under memcheck, racecheck and synccheck, `bench` the
# GEMM benchmark with the gathering plans each timed right after its plain one (`gemm
# --gathering`) and the layer benchmark with the engine path with and without the gathering
# producers alternating (engine, engine-gathering, engine, engine-gathering) beside the ceilings
# and PyTorch, `bench-megakernel` the same with the plain engine path, the forward megakernel gathering (its backward the engine path's, gathering)
# and both megakernels gathering (engine, megakernel-gathering, megakernels-gathering, twice): the
# one-GPU default forward is whichever is fastest. Run from a bundle folder that holds run.sh,
# tests/gpu_unfused(.gz), tests/gpu_gemm(.gz), tests/gpu_api(.gz), benches/layer and
# benches/gemm with the scripts (cargo xtask gpu-subset --tests gpu_unfused,gpu_gemm,gpu_api
# --benches layer,gemm). Logs under $OUT (or
# ./bench-logs); a short table last; exits non-zero when the step failed.
#   ./benches/gather_trial.sh tests      (then: sanitize, bench, bench-megakernel; CASES=deepseek:8192,kimi:8192)
#   ./benches/gather_trial.sh all        (tests, bench, bench-megakernel, then sanitize with its
#                                         tools cut at MOK_TEST_TIMEOUT, default 240 s: one call
#                                         of at most ~9.5 minutes;
#                                         $OUT keeps the tables and gather-all-logs.tar.gz)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bundle="$(cd "$here/.." && pwd)"
mkdir -p "${OUT:-./bench-logs}"
out="$(cd "${OUT:-./bench-logs}" && pwd)"
# Both layer tests (the engine path's and the forward megakernel's): a libtest substring.
test_name=gathering_its_rows_in_the_producer_is_bitwise_the_engine_path
case "${1:-}" in
    tests)
        (cd "$bundle" && OUT="$out" ./run.sh "$test_name") > "$out/gather-test.txt" 2>&1
        rc=$?
        (cd "$bundle" && OUT="$out" ./run.sh engine_matches_unfused) > "$out/gather-plans.txt" 2>&1
        plans=$?
        [ "$rc" = 0 ] && rc=$plans
        # The backward megakernel's own tests (its spare warps' join, its faults), and gpu_api's
        # backends through `MoeLayer` (the gathering and the forward-megakernel backends).
        (cd "$bundle" && OUT="$out" ./run.sh backward_megakernel moe_layer workspace_bytes) \
            > "$out/gather-layers.txt" 2>&1
        layers=$?
        [ "$rc" = 0 ] && rc=$layers
        echo "== layer test"; tail -2 "$out/gather-test.txt"
        echo "== plans";      tail -2 "$out/gather-plans.txt"
        echo "== backward megakernel, MoeLayer"; tail -2 "$out/gather-layers.txt"
        ;;
    sanitize)
        (cd "$bundle" && OUT="$out" MOK_TEST_TIMEOUT="${MOK_TEST_TIMEOUT:-560}" MOK_SANITIZE_TOOLS="memcheck racecheck synccheck" \
            ./run.sh --sanitize "$test_name" engine_matches_unfused_on_tiny engine_matches_unfused_on_odd) \
            > "$out/gather-sanitize.txt" 2>&1
        rc=$?
        grep -h "^sanitize:\|passed" "$out/gather-sanitize.txt" | tail -2
        ;;
    bench)
        cases="${CASES:-deepseek:8192,kimi:8192}"
        "$here/gemm" --cases "$cases" --gathering > "$out/gather-gemm.txt" 2>&1
        rc=$?
        OUT="$out" CASES="$cases" GEMM=engine,engine-gathering,engine,engine-gathering \
            "$here/run_layer_bench.sh" > "$out/gather-bench.txt" 2>&1
        layer=$?
        [ "$rc" = 0 ] && rc=$layer
        echo "== gemm";  grep -h "gate_up" "$out/gather-gemm.txt" | grep "^|"
        echo "== layer"; grep -h "^|" "$out/layer.log" | tail -10
        ;;
    bench-megakernel)
        cases="${CASES:-deepseek:8192,kimi:8192}"
        OUT="$out" CASES="$cases" GEMM=engine,megakernel-gathering,megakernels-gathering,engine,megakernel-gathering,megakernels-gathering \
            "$here/run_layer_bench.sh" > "$out/gather-megakernel-bench.txt" 2>&1
        rc=$?
        echo "== layer"; grep -h "^|" "$out/layer.log" | tail -10
        ;;
    all)
        rc=0
        for step in tests bench bench-megakernel; do
            echo "==== $step"
            "$0" "$step" || rc=1
            # Each layer bench writes layer.log; keep the step's own.
            [ -f "$out/layer.log" ] && mv "$out/layer.log" "$out/layer-$step.log"
        done
        echo "==== sanitize"
        MOK_TEST_TIMEOUT="${MOK_TEST_TIMEOUT:-240}" "$0" sanitize || rc=1
        # A device call returns a few files only: every log in one archive, beside the tables.
        keep="gather-gemm.txt layer-bench.log layer-bench-megakernel.log gather-sanitize.txt"
        (cd "$out" && tar czf ../gather-all-logs.tar.gz . && mv ../gather-all-logs.tar.gz . &&
            find . -mindepth 1 -maxdepth 1 ! -name gather-all-logs.tar.gz \
                $(for f in $keep; do printf -- "! -name %s " "$f"; done) -exec rm -rf {} +)
        ;;
    *)
        echo "usage: gather_trial.sh tests|sanitize|bench|bench-megakernel|all (one device call each)" >&2
        exit 2
        ;;
esac
exit $rc
