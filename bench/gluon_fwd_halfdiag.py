"""The persistent Gluon forward with and without its half-width diagonal step, side by side.

    PYTHONPATH=. python3 bench/gluon_fwd_halfdiag.py [--seqs 1024,2048] [--head-dims 64] [--passes 3]

Session 17 (``flash_attention_gluon.HALF_DIAG_MAX_T``). In the two-warpgroup variants (q2, pp, q2pp) an item
is 128 query rows, and the first warpgroup's 64 rows see only the first 64 keys of the item's diagonal tile: the
other 64 are masked for all of them. With the half-width step, that step's S = Q Kᵀ and P·V take those 64 keys
only, so the warpgroup skips a quarter of the diagonal tile's products and exponentials of the item (causal; a
head of n_m items has n_m diagonal tiles among n_m (n_m + 1) / 2). Per (head dim, T) at the bench's shapes
(B·T = 16k, H·D = 2048, causal bf16), with the variant the library picks there: the two forms' outputs compared
(bits, and each against the fp32 tiled reference), then GPU time (``bench/_gpu.py``) of cuDNN, off and on,
interleaved over ``--passes`` passes.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench._gpu import gpu_time, warm_up
from xtrain.kernels import flash_attention_gluon as G


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--variant", help="force this variant (default: the library's pick)")
    args = ap.parse_args(argv)
    warm_up()
    default = dict(G.HALF_DIAG_MAX_T)
    table = []
    for D, T in ((D, T) for D in map(int, args.head_dims.split(",")) for T in map(int, args.seqs.split(","))):
        variant = args.variant or G.pick_variant(D, T)
        if (G.VARIANTS[variant] + (2,))[2] != 2:
            print(f"D={D} T={T}: {variant} has three warpgroups, HALF_DIAG does not apply", flush=True)
            continue
        B, H = 16384 // T, 2048 // D
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * B * H * T * T * D / 2
        outs = {}
        for hd in (False, True):
            G.HALF_DIAG_MAX_T = {D: T if hd else 0}
            o = torch.full_like(q, float("nan"))
            lse = torch.full((B, H, T), float("nan"), device="cuda")
            G.flash_attention_fwd_gluon(q, k, v, True, variant=variant, o=o, lse=lse)
            outs[hd] = (o, lse)
        nb = min(B, max(1, 2048 // T))  # the reference on a few sequences (its memory is O(T · tile))
        ref_o, ref_lse = G.reference(q[:nb].float(), k[:nb].float(), v[:nb].float(), True)
        same = torch.equal(outs[False][0], outs[True][0]) and torch.equal(outs[False][1], outs[True][1])
        errs = {hd: (rel(outs[hd][0][:nb], ref_o), rel(outs[hd][1][:nb], ref_lse)) for hd in outs}
        ms = {"cudnn": [], False: [], True: []}
        for _ in range(args.passes):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ms["cudnn"].append(
                    gpu_time(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True))["ms"]
                )
            for hd in (False, True):
                G.HALF_DIAG_MAX_T = {D: T if hd else 0}
                ms[hd].append(
                    gpu_time(
                        lambda q=q, k=k, v=v, var=variant: G.flash_attention_fwd_gluon(q, k, v, True, variant=var)
                    )["ms"]
                )
        G.HALF_DIAG_MAX_T = dict(default)
        cud = min(ms["cudnn"])
        row = (
            D,
            T,
            variant,
            same,
            errs[False],
            errs[True],
            flops / cud / 1e9,
            flops / min(ms[False]) / 1e9,
            flops / min(ms[True]) / 1e9,
            cud / min(ms[False]),
            cud / min(ms[True]),
            ms,
        )
        table.append(row)
        print(row, flush=True)
    print("\n| D | T | variant | same bits | rel err o, lse off / on | cuDNN | off | on | ratio off | ratio on |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for D, T, var, same, eo, en, ct, xo, xn, ro, rn, _ in table:
        print(
            f"| {D} | {T} | {var} | {same} | {eo[0]:.2e}, {eo[1]:.2e} / {en[0]:.2e}, {en[1]:.2e} | {ct:.0f} | "
            f"{xo:.0f} | {xn:.0f} | {ro:.3f} | {rn:.3f} |"
        )
    print("\nms per pass (cuDNN / off / on):")
    for D, T, _var, *_, ms in table:
        print(f"  D={D} T={T}: " + "  ".join(f"{k}: {' '.join(f'{m:.4f}' for m in v)}" for k, v in ms.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
