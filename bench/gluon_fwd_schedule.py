"""The persistent Gluon forward's order of work (``flash_attention_gluon.SCHEDULE``) measured side by side.

    PYTHONPATH=. python3 bench/gluon_fwd_schedule.py [--seqs 1024,2048] [--bh 512,528] [--head-dims 64]

Session 8 probe (H200): at T = 1k the bench's shape (B·H = 512, hd64) puts 2048 pairs of items on 132
programs, 15.5 pairs each, so 68 programs run a 16th pair while 64 idle; with B·H = 495 or 528 (the pairs
divide evenly) q2 ran 2-3 % more TFLOP/s, and w3 at T = 4k 7 %. This runs, per (T, variant, B·H), cuDNN and
each schedule ("pairs": the kernel's own rule; "tail", "lpt": tables from ``schedule``), checks that every
schedule gives the pairs' bits, and prints GPU time as TFLOP/s and the ratio to cuDNN, two passes interleaved.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench._gpu import gpu_time, warm_up
from xtrain.kernels import flash_attention_gluon as G

FORMS = [("pairs", 1, 1.0), ("tail", 1, 1.0), ("tail", 2, 1.0), ("tail", 2, 2.0), ("lpt", 1, 1.0)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument(
        "--bh",
        default="issue",
        help="B·H values, comma-separated, or 'issue': B·T = 16k and H·D = 2048 (xtrain bench attention)",
    )
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--forms", help="schedules to time, e.g. pairs:1:1,tail:2:1 (policy:tail rounds:item cost)")
    args = ap.parse_args(argv)
    global FORMS
    if args.forms:
        FORMS = [(f.split(":")[0], int(f.split(":")[1]), float(f.split(":")[2])) for f in args.forms.split(",")]
    warm_up()
    table = []
    for D, T in ((D, T) for D in map(int, args.head_dims.split(",")) for T in map(int, args.seqs.split(","))):
        variants = [G.pick_variant(D, T)] + (["q2"] if D == 64 and G.pick_variant(D, T) == "w3" and T <= 4096 else [])
        shapes = (
            [(16384 // T, 2048 // D)]
            if args.bh == "issue"
            else [(bh // h, h) for bh in map(int, args.bh.split(",")) for h in (32 if bh % 32 == 0 else 33,)]
        )
        for B, H in shapes:
            BH = B * H
            q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * B * H * T * T * D / 2
            for variant in variants:
                res = {}
                base = None
                for sched, tail, cost in FORMS:
                    G.SCHEDULE, G.SCHED_TAIL_ROUNDS, G.SCHED_ITEM_COST = sched, tail, cost
                    o, lse = G.flash_attention_fwd_gluon(q, k, v, True, variant=variant)
                    if base is None:
                        base = (o, lse)
                    same = torch.equal(o, base[0]) and torch.equal(lse, base[1])
                    res[(sched, tail, cost)] = [same]
                for _ in range(2):  # two interleaved passes
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        res.setdefault("cudnn", []).append(
                            gpu_time(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True))[
                                "ms"
                            ]
                        )
                    for sched, tail, cost in FORMS:
                        G.SCHEDULE, G.SCHED_TAIL_ROUNDS, G.SCHED_ITEM_COST = sched, tail, cost
                        res[(sched, tail, cost)].append(
                            gpu_time(
                                lambda q=q, k=k, v=v, var=variant: G.flash_attention_fwd_gluon(
                                    q, k, v, True, variant=var
                                )
                            )["ms"]
                        )
                G.SCHEDULE, G.SCHED_TAIL_ROUNDS, G.SCHED_ITEM_COST = "pairs", 1, 1.0
                cud = min(res["cudnn"])
                for form in FORMS:
                    same, *ms = res[form]
                    table.append(
                        (
                            T,
                            variant,
                            BH,
                            f"{form[0]} {form[1]} {form[2]}",
                            same,
                            flops / min(ms) / 1e9,
                            flops / cud / 1e9,
                            cud / min(ms),
                            ms,
                        )
                    )
                    print(table[-1], flush=True)
    print(
        "\n| T | variant | B·H | schedule (policy, tail rounds, item cost) | same bits | TFLOP/s | cuDNN | ratio "
        "| ms (two passes) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for T, var, BH, name, same, xt, ct, r, ms in table:
        print(
            f"| {T} | {var} | {BH} | {name} | {same} | {xt:.0f} | {ct:.0f} | {r:.3f} | "
            f"{' / '.join(f'{m:.4f}' for m in ms)} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
