"""Timing shared by the PyTorch baseline scripts: CUDA events around each call, a warm-up of
at least 200 ms, the median of `reps`."""
import torch


def median_ms(fn, reps=20, warmup_ms=200.0):
    """Median of `reps` timed calls, after at least `warmup_ms` of warm-up calls (and 3), so
    clocks and caches are in the steady state the repetitions measure. Same method as mok's
    benches/gemm.rs."""
    warm, calls = 0.0, 0
    while warm < warmup_ms or calls < 3:
        warm += _timed(fn)
        calls += 1
    times = sorted(_timed(fn) for _ in range(reps))
    return times[len(times) // 2]


def _timed(fn):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop)
