"""Session 21: the fp32 embedding backward ("tiers" form) on other id distributions, and what its slots pass costs.

    PYTHONPATH=. python3 bench/slots_probe.py [--N 16384 --V 32000 --C 2048] [--knobs ...] [--plan] [--timeline]

The op's default bench draws Zipf-like ids. Here the same shapes run on five draws: the bench's Zipf-like ids; ids
uniform over the table; N distinct ids (no id twice); half the tokens one id and the rest Zipf-like, shuffled (a
batch with padding, session 22); every token the same id (the worst case for one row's chain). For each: the op's
GPU time (``bench/_gpu.py``, write flush) against the copy rate, its fp64 error, whether two calls give the same
bits, and from five torch.profiler timelines (the last of three calls each) the median duration of the counts' fill,
the slots pass and the rows grid, and the median span of one call (first kernel start to last kernel end). The slots
pass is the op's latency-bound head: its integer atomics meet at one address per repeated id, so a Zipf-like draw
(one id 521 times) may serialise where distinct ids do not. ``--knobs "NAME=VALUE,..."`` sets module knobs of
``xtrain.kernels.embedding`` first; ``--plan`` times the backward given its ids-only part made before
(``embedding_bwd_plan``, session 22); ``--timeline`` prints each draw's last timeline.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from bench._gpu import gpu_time, warm_up
    from bench.embedding_tiers_probe import parse_knobs
    from bench.embedding_timeline import print_timeline, timeline
    from bench.kernels import copy_bandwidth, zipf_ids
    from xtrain.kernels import embedding as K

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--N", type=int, default=16384)
    ap.add_argument("--V", type=int, default=32000)
    ap.add_argument("--C", type=int, default=2048)
    ap.add_argument("--knobs", default="", help="NAME=VALUE,... set in xtrain.kernels.embedding first")
    ap.add_argument("--plan", action="store_true", help="the backward given the plan made before")
    ap.add_argument("--timeline", action="store_true", help="print each draw's last timeline")
    args = ap.parse_args(argv)
    for k, v in (parse_knobs(args.knobs) if args.knobs else {}).items():
        if not hasattr(K, k):
            raise SystemExit(f"slots_probe: xtrain.kernels.embedding has no knob {k}")
        setattr(K, k, v)
    N, V, C = args.N, args.V, args.C
    if N > V:
        raise SystemExit("slots_probe: the distinct draw needs N <= V")
    torch.manual_seed(0)
    d = torch.randn(N, C, device="cuda")
    draws = {
        "zipf-like (the bench's)": zipf_ids(N, V),
        "uniform": torch.randint(0, V, (N,), device="cuda"),
        "distinct": torch.randperm(V, device="cuda")[:N],
        "half one id (padding)": torch.cat([zipf_ids(N - N // 2, V), torch.full((N // 2,), 7, device="cuda")])[
            torch.randperm(N, device="cuda")
        ],
        "one id": torch.full((N,), 7, device="cuda"),
    }
    warm_up()
    copy_tbs = copy_bandwidth() / 1e12
    must = (N * C + V * C) * 4 + 8 * N
    print(
        f"N = {N}, V = {V}, C = {C}, fp32; copy {copy_tbs:.2f} TB/s; knobs: {args.knobs or 'defaults'}"
        f"{'; plan made before' if args.plan else ''}"
    )
    print(
        f"{'ids':26s} {'named':>6s} {'>4':>5s} {'>64':>4s} {'op ms':>7s} {'of copy':>7s} {'err':>8s} {'bits':>5s} "
        f"{'fill us':>7s} {'slots us':>8s} {'grid us':>7s} {'span us':>7s}"
    )
    for name, ids in draws.items():
        cnt = torch.bincount(ids, minlength=V)
        plan = K.embedding_bwd_plan(ids, V, C, d.dtype) if args.plan else None
        fn = lambda ids=ids, plan=plan: K.embedding_bwd_triton(d, ids, V, plan)  # noqa: E731
        a = fn()
        same = torch.equal(a, fn())
        err = float((a.double() - K.embedding_bwd_ref(d.double(), ids, V)).abs().max())
        ms = gpu_time(fn)["ms"]
        per_call = [timeline(fn) for _ in range(5)]  # each: the last of three profiled calls

        def dur(key, per_call=per_call):  # nan where the call has no such kernel (--plan: no fill, no slots pass)
            found = [e["dur"] for c in per_call for e in c if key in e["name"]]
            return statistics.median(found) if found else float("nan")

        span = statistics.median(max(e["ts"] + e["dur"] for e in c) - c[0]["ts"] for c in per_call)
        print(
            f"{name:26s} {int((cnt > 0).sum()):6d} {int((cnt > 4).sum()):5d} {int((cnt > 64).sum()):4d} {ms:7.4f} "
            f"{must / (ms * 1e-3) / 1e12 / copy_tbs * 100:6.1f}% {err:8.1e} {'same' if same else 'DIFF':>5s} "
            f"{dur('_zero_i32'):7.1f} {dur('tier_slots'):8.1f} {dur('bwd_rows'):7.1f} {span:7.1f}"
        )
        if args.timeline:
            print_timeline(name, per_call[-1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
