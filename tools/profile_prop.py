"""Run S²ANTA-prop a few times at one shape so that Nsight Compute can profile its kernels.

Usage on the GPU machine (fp16, Hq 32, Hkv 8, D 128):
    ncu --clock-control none -k regex:santa_prop --launch-skip 6 --launch-count 3 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python3 tools/profile_prop.py 8 32768 256
"""

from __future__ import annotations

import sys


def main(B=8, N=32768, S=256):
    import torch

    from stochattn.cuda.santa import santa_prop

    q = torch.randn(B, 32, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(B, 8, N, 128, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    for _ in range(4):
        santa_prop(q, k, v, budget=S, seed=1)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
