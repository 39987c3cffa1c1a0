"""Session 19: does the L2 flush before each timed call charge the call for bytes that are not its own?

    PYTHONPATH=. python3 bench/flush_probe.py [--rounds 3]

``bench._gpu.gpu_time`` empties the L2 before every timed call by writing zeros over a 256 MiB buffer. The last
~50 MB of those zeros (the H200's L2) are still dirty in the cache when the call starts, so the call's own traffic
evicts them: up to ~50 MB of DRAM writes that belong to the flush. That is ~2 % of a 1 GiB copy's time but ~10 %
of a 0.1 ms kernel's. This probe times a few calls of different sizes with the flush writing (as until now),
reading the buffer (an amax: the L2 is left holding clean lines), and with no flush, in alternating rounds, and
prints each call's ms and its bandwidth against the 1 GiB copy measured the same way.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from bench._gpu import gpu_time, warm_up
    from bench.kernels import zipf_ids
    from xtrain.kernels import embedding as K
    from xtrain.kernels import rms_norm as R

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    big = torch.randn(1 << 28, device="cuda")
    big_out = torch.empty_like(big)
    mid = torch.randn(1 << 25, device="cuda")  # 128 MiB
    mid_out = torch.empty_like(mid)
    N, V, C = 16384, 32000, 2048
    ids = zipf_ids(N, V)
    d = torch.randn(N, C, device="cuda")
    table = torch.empty(V, C, device="cuda")
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    _, rstd = R.rms_norm_fwd(x, w, 1e-6)
    calls = [
        ("copy 1 GiB", lambda: big_out.copy_(big), 2 * big.numel() * 4),
        ("copy 128 MiB", lambda: mid_out.copy_(mid), 2 * mid.numel() * 4),
        ("zero 262 MB table", table.zero_, V * C * 4),
        ("embedding bwd fp32 (library)", lambda: K.embedding_bwd(d, ids, V), (N * C + V * C) * 4 + 8 * N),
        (
            "rms_norm bwd 16384x4096 bf16",
            lambda: R.rms_norm_bwd(dy, x, w, rstd),
            3 * x.numel() * 2 + 4096 * 2 + 4 * 16384,
        ),
    ]
    warm_up()
    modes = ("write", "read", "none")
    res = {(m, n): [] for m in modes for n, _, _ in calls}
    for rnd in range(args.rounds):
        for m in modes if rnd % 2 == 0 else modes[::-1]:
            for name, fn, _ in calls:
                res[m, name].append(gpu_time(fn, flush=m)["ms"])
    med = {k: sorted(v)[len(v) // 2] for k, v in res.items()}
    print(f"{'call':34s}" + "".join(f"{m + ' flush':>24s}" for m in modes))
    for name, _, nbytes in calls:
        cells = []
        for m in modes:
            copy_bw = 2 * big.numel() * 4 / med[m, "copy 1 GiB"]
            cells.append(f"{med[m, name] * 1e3:9.1f} us {nbytes / med[m, name] / copy_bw:6.1%}")
        print(f"{name:34s}" + "".join(f"{c:>24s}" for c in cells))
    print(
        f"(% = bytes that must move / time, against the 1 GiB copy timed with the same flush; median of "
        f"{args.rounds} rounds)"
    )
    for (m, n), v in res.items():
        print(f"  {m} flush, {n}: " + " ".join(f"{t * 1e3:.1f}" for t in v) + " us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
