"""Board power, SM clock and achieved rate while the GPU does one thing at a time for several
seconds: nothing, a device copy (DRAM bound), a dense bf16 matmul (tensor bound), and both at
once on two streams. It measures what the power limit leaves for a GEMM that must also stream
its weights from DRAM (docs/PERF.md: the small-group cases are bound by energy per run).

    python3 power_budget.py [--seconds 8]

nvidia-smi is polled in a thread (power.draw.instant where the driver has it); each phase
reports the median of the samples after its first second, when the clock has settled."""
import argparse
import statistics
import subprocess
import threading
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--seconds", type=float, default=8.0)
args = parser.parse_args()

samples = []  # (time, watts, MHz)
stop = threading.Event()


def poll():
    fields = "power.draw.instant,clocks.sm"
    probe = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True)
    if probe.returncode != 0 or "N/A" in probe.stdout or "not" in probe.stdout.lower():
        fields = "power.draw,clocks.sm"
    while not stop.is_set():
        out = subprocess.run(["nvidia-smi", "-i", "0", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout.split(",")
        try:
            samples.append((time.time(), float(out[0]), float(out[1])))
        except (ValueError, IndexError):
            pass
        time.sleep(0.05)


threading.Thread(target=poll, daemon=True).start()

n = 8192
a = torch.rand(n, n, device="cuda").to(torch.bfloat16) * 2 - 1
b = torch.rand(n, n, device="cuda").to(torch.bfloat16) * 2 - 1
c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
x = torch.rand(2**30, device="cuda")
y = torch.empty_like(x)
copy_stream, mm_stream = torch.cuda.Stream(), torch.cuda.Stream()
torch.cuda.synchronize()


def stream_loop(kind, stream, deadline, counted_from, result):
    """Keeps `stream` busy until `deadline`; records (operations, seconds) completed after
    `counted_from`. One thread per stream, so neither waits for the other."""
    ops, first, batch = 0, None, 4 if kind == "copy" else 8
    with torch.cuda.stream(stream):
        while time.time() < deadline:
            for _ in range(batch):
                if kind == "copy":
                    y.copy_(x)
                else:
                    torch.matmul(a, b, out=c)
            done = torch.cuda.Event()
            done.record(stream)
            done.synchronize()
            now = time.time()
            if now >= counted_from:
                if first is None:
                    first = now  # count from the first completion after the settling second
                else:
                    ops += batch
    result[kind] = (ops, (now - first) if first else 0.0)


def run(name, kinds):
    start = time.time()
    counted_from, deadline = start + 1.0, start + args.seconds
    result, threads = {}, []
    for kind in kinds:
        stream = copy_stream if kind == "copy" else mm_stream
        threads.append(threading.Thread(target=stream_loop, args=(kind, stream, deadline, counted_from, result)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not kinds:
        time.sleep(args.seconds)
    torch.cuda.synchronize()
    window = [s for s in samples if counted_from <= s[0] <= deadline]
    watts = statistics.median(s[1] for s in window) if window else float("nan")
    mhz = statistics.median(s[2] for s in window) if window else float("nan")
    ops, secs = result.get("copy", (0, 0.0))
    tbps = ops * 2 * x.numel() * 4 / secs / 1e12 if secs else 0.0
    ops, secs = result.get("mm", (0, 0.0))
    tflops = ops * 2 * n**3 / secs / 1e12 if secs else 0.0
    print(f"POWER {name:8s} {watts:6.0f} W {mhz:6.0f} MHz copy {tbps:5.2f} TB/s matmul {tflops:5.0f} TFLOP/s"
          f" ({len(window)} samples)", flush=True)


time.sleep(args.seconds / 2)
run("idle", [])
run("copy", ["copy"])
time.sleep(2)
run("matmul", ["mm"])
time.sleep(2)
run("both", ["copy", "mm"])
stop.set()
