#!/usr/bin/env python3
"""Times how long the CUDA driver takes to load mok's kernels: the PTX (JIT-compiled by the
driver; the first load in a fresh machine misses the driver's JIT cache) and, when a cubin is
given, the cubin (no JIT). Each load runs in a fresh process, so nothing but the driver's
on-disk cache carries over.

    module_load_time.py PTX [CUBIN] [--repeat N]
"""
import ctypes, os, subprocess, sys, time

def load_once(path):
    cuda = ctypes.CDLL("libcuda.so.1")
    check = lambda r, what: (_ for _ in ()).throw(RuntimeError(f"{what}: CUresult {r}")) if r else None
    check(cuda.cuInit(0), "cuInit")
    dev, ctx, module = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    data = open(path, "rb").read()
    if path.endswith(".ptx"):
        data += b"\0"
    buf = ctypes.create_string_buffer(data, len(data))
    start = time.perf_counter()
    check(cuda.cuModuleLoadData(ctypes.byref(module), buf), f"cuModuleLoadData({path})")
    return time.perf_counter() - start

def main():
    args = sys.argv[1:]
    if args and args[0] == "--child":
        print(f"{load_once(args[1]):.4f}")
        return
    repeat = 3
    if "--repeat" in args:
        i = args.index("--repeat")
        repeat = int(args[i + 1])
        del args[i:i + 2]
    for path in args:
        times = []
        for _ in range(repeat):
            out = subprocess.run([sys.executable, __file__, "--child", path], capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{path}: load failed: {out.stderr.strip()}")
                break
            times.append(float(out.stdout))
        print(f"LOADTIME {os.path.basename(path)} {os.path.getsize(path)} bytes: " + " ".join(f"{t:.3f}s" for t in times))

if __name__ == "__main__":
    main()
