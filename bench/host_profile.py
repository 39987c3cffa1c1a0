"""Where an op's host time goes: cProfile over calls launched while the GPU is busy (session 19).

    PYTHONPATH=. python3 bench/host_profile.py [--calls 50] [--top 25]

``bench._gpu.gpu_time`` reports an op's host time per call beside its GPU time; a training step is host-bound where
its ops' host times add up to more than their kernels. This profiles the fp32 embedding backward at the bench's
shape (N = 16k, V = 32000, C = 2048, the "tiers" form): a long GPU sleep is queued first, so no launch waits on the
GPU, then ``--calls`` calls run under cProfile; it prints the mean host time per call and the functions with the most
cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from bench._gpu import _cycles_per_ms
    from bench.kernels import zipf_ids
    from xtrain.kernels import embedding as K

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    N, V, C = 16384, 32000, 2048
    ids = zipf_ids(N, V)
    d = torch.randn(N, C, device="cuda")
    for _ in range(3):
        K.embedding_bwd(d, ids, V)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(_cycles_per_ms() * (args.calls * 2 + 50)))
    t0 = time.perf_counter()
    for _ in range(5):
        K.embedding_bwd(d, ids, V)
    plain = (time.perf_counter() - t0) / 5 * 1e6
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        K.embedding_bwd(d, ids, V)
    prof.disable()
    torch.cuda.synchronize()
    print(f"host time per call, unprofiled: {plain:.1f} us")
    for rnd in range(3):
        for plans in (True, False):
            K.TIER_PLANS = plans
            torch.cuda.synchronize()
            torch.cuda._sleep(int(_cycles_per_ms() * 60))
            t0 = time.perf_counter()
            for _ in range(20):
                K.embedding_bwd(d, ids, V)
            print(f"round {rnd}: cached plans {plans}: {(time.perf_counter() - t0) / 20 * 1e6:.1f} us per call")
    K.TIER_PLANS = True
    pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
