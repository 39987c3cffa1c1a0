"""The fp32 embedding backward with a register cap on its rows kernel (session 13).

    PYTHONPATH=. python3 bench/embedding_maxnreg.py [--caps 0,32,40] [--rounds 3]

Nsight Compute (bench/ncu_probe.py --parts embedding) read the rows kernel at 36 registers per thread, which
leaves room for 6 blocks of 256 threads per SM (75 % occupancy; 64 % achieved) where 32 registers would allow 8.
The kernel waits on its loads (77 % of its stalls on the long scoreboard), so more warps in flight might move
more bytes. This times the whole op (bench shapes: N = 16k Zipf-like ids, V = 32k, C = 2048, fp32; GPU time,
``bench/_gpu.py``) under each cap (0 = none, the default), alternating, and checks the bits are the default's.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._gpu import gpu_time, warm_up  # noqa: E402
from xtrain.kernels import embedding as K  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--caps", default="0,32,40")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    N, V, C = 16384, 32000, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = (torch.rand(N, device="cuda", generator=g) ** 3 * V).long().clamp_max(V - 1)
    d = torch.randn(N, C, device="cuda", generator=g)
    copy_src = torch.empty(1 << 28, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    warm_up()
    copy_bw = 2 * copy_src.numel() * 4 / (gpu_time(lambda: copy_dst.copy_(copy_src))["ms"] * 1e-3)
    need = (N * C + V * C) * 4 + 8 * N
    K.ROWS_MAXNREG = None
    want = K.embedding_bwd_triton(d, ids, V)
    caps = [int(c) for c in a.caps.split(",")]
    times = {c: [] for c in caps}
    for _ in range(a.rounds):
        for c in caps:
            K.ROWS_MAXNREG = c or None
            got = K.embedding_bwd_triton(d, ids, V)
            assert torch.equal(got, want), f"cap {c}: bits differ from the default's"
            times[c].append(gpu_time(lambda: K.embedding_bwd_triton(d, ids, V))["ms"])
    K.ROWS_MAXNREG = None
    print(f"copy {copy_bw / 1e12:.2f} TB/s; fp32 embedding backward, ms (fraction of copy):")
    for c in caps:
        ts = sorted(times[c])
        print(f"  maxnreg {c or 'none':>4}: {ts[0]:.4f}-{ts[-1]:.4f} ({need / (ts[-1] * 1e-3) / copy_bw:.0%}-"
              f"{need / (ts[0] * 1e-3) / copy_bw:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
