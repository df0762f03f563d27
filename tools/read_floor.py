"""The practical floor of one decode launch: how long a kernel that only reads the bytes of
K and V (and does nothing else) takes at each decode shape, one launch per call.

The bandwidth floors of benchmarks/ and tools/ divide bytes by a sustained copy bandwidth
(4.25 TB/s on the H200), which leaves out what every launch pays at small sizes: the launch
itself, the ramp until every SM has loads in flight, and the tail. At batch 1 / 32k (134 MB,
a 31.6 us floor) these are several microseconds, so this measures what "90% of the floor"
can mean there. The kernel: 16-byte loads, 8 in flight per thread, grid-stride over the
buffer with ``blocks_per_sm`` CTAs of 256 threads per SM, an XOR of everything read stored
once per CTA (so nothing is optimised away). Timed like tools/tune_exact_tc.py: median of
batches of back-to-back launches between CUDA events, and once more with the launches
captured in a CUDA graph (GPU time without the host's launch cost); CuPy only.

    PYTHONPATH=. python3 tools/read_floor.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

HKV, D = 8, 128
BANDWIDTH = 4.25e12  # B/s, as tools/tune_exact_tc.py
CASES = ((1, 32768), (1, 131072), (8, 32768), (32, 32768), (8, 131072), (32, 131072))

_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(256)
read_only(const uint4* __restrict__ src, unsigned long long n16, unsigned* __restrict__ sink) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned acc = 0;
  for (; i + 7 * stride < n16; i += 8 * stride) {
    uint4 r[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) r[u] = __ldcs(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= r[u].x ^ r[u].y ^ r[u].z ^ r[u].w;
  }
  for (; i < n16; i += stride) {
    const uint4 r = __ldcs(src + i);
    acc ^= r.x ^ r.y ^ r.z ^ r.w;
  }
  acc = __reduce_xor_sync(0xffffffffu, acc);
  if ((threadIdx.x & 31) == 0) atomicXor(sink + blockIdx.x, acc);
}
"""


def time_cupy(fn, batches=5, calls=20, warmup=3):
    """Median over ``batches`` of the per-call time (us) of ``calls`` back-to-back calls
    between CUDA events on CuPy's current stream."""
    import cupy

    for _ in range(warmup):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    per = []
    for _ in range(batches):
        s, e = cupy.cuda.Event(), cupy.cuda.Event()
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        e.synchronize()
        per.append(cupy.cuda.get_elapsed_time(s, e) * 1e3 / calls)
    return float(np.median(per))


def time_graph_cupy(fn, calls=20):
    """The same with the ``calls`` calls captured in one CUDA graph and replayed."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        for _ in range(calls):
            fn()
        graph = stream.end_capture()
        return time_cupy(lambda: graph.launch(stream), calls=1, warmup=2) / calls


def case_bytes(batch: int, context: int, itemsize: int = 2) -> int:
    """Bytes of K and V at the Llama-3.1-8B decode shape (Hkv 8, D 128)."""
    return 2 * batch * HKV * context * D * itemsize


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the measurements here")
    ap.add_argument("--blocks-per-sm", default="2,4,8", help="comma list to try")
    args = ap.parse_args(argv)
    import cupy

    kernel = cupy.RawKernel(_SOURCE, "read_only")
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    a = cupy.empty(1 << 30, dtype=cupy.uint8)  # clocks up before the first shape
    b_ = cupy.empty_like(a)

    def copy():  # cudaMemcpyAsync device to device on the current stream
        b_.data.copy_from_device_async(a.data, a.nbytes)

    t0 = time.time()
    while time.time() - t0 < 1.0:
        copy()
        cupy.cuda.get_current_stream().synchronize()

    # This machine's copy bandwidth (bytes read + written), the basis of its own floor: the
    # device tool may hand out an H100 (HBM3) as well as the H200 the 4.25 TB/s is from.
    copy_Bps = 2 * a.nbytes / (time_cupy(copy, batches=3, calls=10) * 1e-6)
    del a, b_
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}: copy bandwidth "
          f"{copy_Bps / 1e12:.2f} TB/s", flush=True)
    rows = []
    for b, n in CASES:
        nbytes = case_bytes(b, n)
        buf = cupy.random.randint(0, 2**31, size=nbytes // 4, dtype=cupy.uint32)
        floor_us = nbytes / BANDWIDTH * 1e6
        here_us = nbytes / copy_Bps * 1e6  # the floor at this machine's copy bandwidth
        row = {"batch": b, "context": n, "bytes": nbytes, "floor_us": floor_us,
               "floor_here_us": here_us, "variants": {}}
        for bps in (int(x) for x in args.blocks_per_sm.split(",")):
            grid = sms * bps
            sink = cupy.zeros(grid, dtype=cupy.uint32)

            def launch():
                kernel((grid,), (256,), (buf, np.uint64(nbytes // 16), sink))

            eager = time_cupy(launch)
            graph = time_graph_cupy(launch)
            row["variants"][bps] = {"eager_us": eager, "graph_us": graph}
            print(f"B={b:2d} N={n:6d} {nbytes / 1e6:8.1f} MB floor {floor_us:7.1f} us "
                  f"(here {here_us:7.1f}) | {bps} CTAs/SM: eager {eager:7.1f} us "
                  f"({100 * floor_us / eager:5.1f}% / {100 * here_us / eager:5.1f}% here), "
                  f"graph {graph:7.1f} us ({100 * floor_us / graph:5.1f}% / "
                  f"{100 * here_us / graph:5.1f}%), {nbytes / graph / 1e6:5.2f} TB/s", flush=True)
        rows.append(row)
        del buf
        cupy.get_default_memory_pool().free_all_blocks()
    if args.json:
        meta = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "bandwidth_Bps": BANDWIDTH, "copy_Bps_here": copy_Bps,
                "timing": "median of 5 batches of 20 calls"}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
