"""Session 18: the fp32 embedding backward's "tiers" form against the "rows" form, with its knobs.

    PYTHONPATH=. python3 bench/embedding_tiers_probe.py [--reps 30] [--timeline] [--V 32000 --C 2048]
        [--tiers "64,8,2048,4,1,256,64,4,1,4096;..."] [--knobs "FILL_PDL=False;SLOTS_BLOCK=128,...;..."]

The "rows" form (the fp32 default of sessions 7-17) writes every row seen at most K = 4 times from one grid and
leaves the rest to a chain of the sort keys, cub's radix sort (four or five kernels), the chunk walks and the merge
on a side stream. On the bench's Zipf-like ids (N = 16k, V = 32000, C = 2048) those are ~310 ids and ~3800 tokens;
the chain's kernels, latency-bound under the grid's traffic, end the op ~20 us after the grid. Only a handful of
those ids are seen more than 64 times. The "tiers" form (``xtrain.kernels.embedding``, module docstring) gives the
ids seen 5-64 times to one persistent kernel that orders each row's slots by rank (no sort) and the few heavier ids
to a scan-built token list and a persistent sum: no global sort, two short chains. Each row of the table prints the
op's GPU time and its fraction of the copy bandwidth, in alternating rounds; ``--timeline`` adds torch.profiler
timelines (kernel start, duration, stream). ``--tiers`` takes ``TIERS`` tuples (see ``TIERS_DEFAULTS``) to time
besides the default; ``--knobs`` runs the tiers form with other module knobs (session 19); the pseudo-knob PLAN=True
gives the backward the ids-only part made ahead (``embedding_bwd_plan``, session 22).
"""

from __future__ import annotations

import ast
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.embedding_tma_probe import Recorder, probe_parser  # noqa: E402
from bench.kernels import _knobs  # noqa: E402
from xtrain.kernels import embedding as K  # noqa: E402


def parse_knobs(kv: str) -> dict:
    """ "NAME=VALUE,NAME=VALUE" -> {name: value}: each value a Python literal (tuples may hold commas)."""
    return {k: ast.literal_eval(v) for k, v in (p.split("=", 1) for p in re.split(r",(?=[A-Z_][A-Z0-9_]*=)", kv))}


def _form(config, knobs):
    """The embedding module's CONFIG and the given knobs (name -> value) set for a block."""
    return _knobs(K, {"CONFIG": config, **knobs})


def main(argv=None) -> int:
    from bench._gpu import warm_up
    from bench.kernels import copy_bandwidth, zipf_ids

    ap = probe_parser(__doc__)
    ap.add_argument("--timeline", action="store_true")
    ap.add_argument("--tiers", default="", help="';'-separated TIERS tuples to time besides the default")
    ap.add_argument("--knobs", default="", help="';'-separated variants of the tiers form, each NAME=VALUE,...")
    args = ap.parse_args(argv)
    N, V, C = args.N, args.V, args.C
    torch.manual_seed(0)
    ids = zipf_ids(N, V)
    d = torch.randn(N, C, device="cuda")
    cnt = torch.bincount(ids, minlength=V)
    print(
        f"ids: {int((cnt > 4).sum())} seen more than 4 times ({int(cnt[cnt > 4].sum())} tokens), "
        f"{int((cnt > 64).sum())} more than 64 ({int(cnt[cnt > 64].sum())} tokens), the most {int(cnt.max())}"
    )
    rows = (16, 512, 4, "rows", 16, True)
    tiers = (16, 512, 4, "tiers", 16, True)
    forms = [("rows", rows, {}), ("tiers (default)", tiers, {})]
    forms += [(f"tiers {t}", tiers, {"TIERS": tuple(int(x) for x in t.split(","))}) for t in args.tiers.split(";") if t]
    forms += [(f"tiers {kv}", tiers, parse_knobs(kv)) for kv in args.knobs.split(";") if kv]
    ref = K.embedding_bwd_ref(d.double(), ids, V)
    # the pseudo-knob PLAN=True: the backward given the plan (embedding_bwd_plan) made once, ahead
    wants = {name: bool(t.pop("PLAN", False)) for name, cfg, t in forms}
    plans = {}
    for name, cfg, t in forms:
        with _form(cfg, t):
            plans[name] = K.embedding_bwd_plan(ids, V, C, d.dtype) if wants[name] else None
            a = K.embedding_bwd_triton(d, ids, V, plans[name])
            same = torch.equal(a, K.embedding_bwd_triton(d, ids, V, plans[name]))
        print(
            f"{name}: max abs error {float((a.double() - ref).abs().max()):.2e} against fp64, "
            f"{'the same bits twice' if same else 'NOT the same bits twice'}"
        )
    warm_up()
    copy_tbs = copy_bandwidth() / 1e12
    must = (N * C + V * C) * 4 + 8 * N
    row = Recorder(args.reps, copy_tbs, 60)
    for rnd in range(3):
        for name, cfg, t in forms if rnd % 2 == 0 else forms[::-1]:

            def call(cfg=cfg, t=t, plan=plans[name]):
                with _form(cfg, t):
                    return K.embedding_bwd_triton(d, ids, V, plan)

            row(f"{name}, round {rnd}", call, must)
    if args.timeline:
        from bench.embedding_timeline import print_timeline, timeline

        for name, cfg, t in forms:
            with _form(cfg, t):
                print_timeline(name, timeline(lambda plan=plans[name]: K.embedding_bwd_triton(d, ids, V, plan)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
