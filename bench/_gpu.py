"""What the GPU benchmarks share: a warm-up before the first timing.

An idle GPU's clocks (and the power state behind them) take a while to come up: in a fresh process the first
timings can read slow (bench/RESULTS.md: 10-30 % for 0.1 ms kernels). ``warm_up`` keeps the GPU busy with
large matmuls for a few seconds first. It is not enough on a machine that has just started: on the H200 in
session 5 the first ``xtrain bench kernels`` process on a fresh machine read some RMSNorm backward rows at
59-83 % of copy with this warm-up (62-66 % without it) where later processes read 83-90 %, every time. Trust
a number once a second process agrees.
"""

from __future__ import annotations

import time


def warm_up(seconds: float = 3.0) -> float:
    """Run bf16 matmuls on the current CUDA device for about ``seconds``; returns the seconds spent."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            a = (a @ a).clamp_(-1.0, 1.0)
        torch.cuda.synchronize()
    del a
    torch.cuda.empty_cache()
    return time.perf_counter() - t0
