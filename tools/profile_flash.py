"""Run S²ANTA-flash a few times at one shape so that Nsight Compute can profile its kernel.

Usage on the GPU machine (fp16, Hq 32, Hkv 8, D 128; arguments B N S tile kernel):
    STOCHATTN_LINEINFO=1 ncu --clock-control none -k regex:santa_flash --launch-skip 4 \\
        --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section InstructionStats --section SourceCounters --import-source yes -o flash_tc \\
        python3 tools/profile_flash.py 8 32768 2048 64 tc
    ncu -i flash_tc.ncu-rep --page source --csv --print-source cuda > flash_tc_source.csv

Without ncu it prints the median CUDA-event time of one call (a quick check of the shape).
"""

from __future__ import annotations

import sys


def main(B=8, N=32768, S=2048, tile=64, kernel="tc"):
    import torch

    from stochattn.cuda.flash import santa_flash

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, 32, 128, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(B, 8, N, 128, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(B, 8, N, 128, device="cuda", dtype=torch.float16, generator=g)
    times = []
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        santa_flash(q, k, v, budget=S, tile_size=tile, seed=1, kernel=kernel)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    print(f"santa_flash kernel={kernel} B={B} N={N} S={S} tile={tile}: "
          f"median {times[len(times) // 2]:.1f} us of 6 calls")


if __name__ == "__main__":
    argv = sys.argv[1:6]
    main(*(int(a) for a in argv[:4]), *argv[4:5])
