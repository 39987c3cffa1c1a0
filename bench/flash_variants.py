"""Side-by-side timing of flash-attention kernel variants against SDPA's cuDNN backend, in one process.

    PYTHONPATH=. python3 bench/flash_variants.py [--json FILE]

For causal bf16 attention at B·T = 16k, H·D = 2048, head dims 64 and 128 and a few T, times:
  * cuDNN (torch SDPA) forward and backward — the bar;
  * each forward config in FWD and backward config in BWD (None = the default), and the default backward
    with its two kernels on one stream instead of two (``FA.BWD_TWO_STREAMS``);
the variants of this session's rounds (warp specialisation, the one-pass backward, launch order, hand
pipelining) were measured with earlier versions of this script: see bench/RESULTS.md and git history;
and first checks every variant against the fp64 reference (GQA 4/2, T = 1000 ragged and 2048,
NaN-poisoned outputs). Prints one table per head dim: TFLOP/s and the ratio to cuDNN.
FLOPs as in bench/attention.py (forward 4·B·H·T²·D/2 causal, backward 2.5×).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch

sys.path.insert(0, ".")
from bench.attention import _bench, _inputs, attn_flops, sdpa_backends, time_sdpa, verify  # noqa: E402
from xtrain.fileio import atomic_write_text  # noqa: E402
from xtrain.kernels import flash_attention as FA  # noqa: E402

F, TM = False, True
# forward: (BLOCK_M, BLOCK_N, num_warps, num_stages, TMA)
# None: the default dispatch (the Gluon kernel where flash_attention.GLUON_FWD_MIN_T says, else Triton)
FWD = {64: [None, (128, 64, 4, 3, F)], 128: [None, (64, 64, 4, 3, TM), (128, 128, 8, 3, F)]}
# backward: None = the default; else ((dK/dV: BLOCK_M1, BLOCK_N1, warps, stages, TMA), (dQ: BLOCK_M2, ...))
# (hd64: the default is the Gluon one-pass kernel from flash_attention.GLUON_ONEPASS_MIN_T; its Triton config
# is listed to time the two side by side)
BWD = {64: [None, FA._BWD_CONFIGS[(64, "16bit")]], 128: [None]}
SEQS = (1024, 2048, 4096, 8192, 16384)


def check(D, fcfg, bcfg, T):
    """Max rel error of o, dq, dk, dv vs the fp64 reference (GQA 4/2, NaN-poisoned outputs)."""
    return verify(D, fcfg, bcfg, True, T=T)


def one_size(D, T, ok_f, ok_b, cudnn):
    B, H = 16384 // T, 2048 // D
    q, k, v, do = _inputs(B, H, T, D, torch.bfloat16, seed=T + D)
    fl = attn_flops(B, H, T, D, True)
    ref = time_sdpa(cudnn, q, k, v, do, True)
    ref_tf = (fl / ref[0] * 1e-9, 2.5 * fl / ref[1] * 1e-9)
    row = {"D": D, "T": T, "cudnn": ref_tf, "fwd": {}, "bwd": {}}
    o, lse = FA.flash_attention_fwd_triton(q, k, v, True)
    for c in ok_f:
        row["fwd"][str(c)] = fl / _bench(lambda c=c: FA.flash_attention_fwd_triton(q, k, v, True, config=c)) * 1e-9
    for c in ok_b:
        row["bwd"][str(c or "default")] = (
            2.5 * fl / _bench(lambda c=c: FA.flash_attention_bwd_triton(do, q, k, v, o, lse, True, config=c)) * 1e-9
        )
    FA.BWD_TWO_STREAMS = False
    row["bwd"]["default, one stream"] = (
        2.5 * fl / _bench(lambda: FA.flash_attention_bwd_triton(do, q, k, v, o, lse, True)) * 1e-9
    )
    FA.BWD_TWO_STREAMS = True
    print(
        f"D={D} T={T} cudnn {ref_tf[0]:.0f}/{ref_tf[1]:.0f}  "
        f"best fwd {max(row['fwd'].values()):.0f}  best bwd {max(row['bwd'].values()):.0f}",
        flush=True,
    )
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqs", type=int, nargs="+", default=list(SEQS))
    args = ap.parse_args(argv)
    import triton

    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}", flush=True)
    log, tables = [], {}
    cudnn = sdpa_backends()["cudnn"]
    for D in args.head_dims:
        ok_f, ok_b = [], []
        for cands, ok, part in ((FWD[D], ok_f, "fwd"), (BWD[D], ok_b, "bwd")):
            for c in cands:
                try:
                    err = max(
                        check(D, c if part == "fwd" else None, c if part == "bwd" else None, T) for T in (1000, 2048)
                    )
                    print(f"check D={D} {part} {c}: max rel err {err:.2e}", flush=True)
                    if err < 1e-2:
                        ok.append(c)
                except Exception as e:
                    print(f"check D={D} {part} {c}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        rows = []
        for T in args.seqs:
            row = one_size(D, T, ok_f, ok_b, cudnn)
            rows.append(row)
            log.append(row)
            torch.cuda.empty_cache()
        tables[D] = rows
    for D, rows in tables.items():
        for part, i in (("fwd", 0), ("bwd", 1)):
            names = list(rows[0][part])
            print(f"\nD={D} {part}: TFLOP/s (ratio to cuDNN) at T = " + ", ".join(str(r["T"]) for r in rows))
            print(f"  {'cudnn':<52} " + " ".join(f"{r['cudnn'][i]:>13.0f}" for r in rows))
            for n in names:
                print(
                    f"  {n:<52} "
                    + " ".join(
                        f"{r[part].get(n, float('nan')):>6.0f} ({r[part].get(n, float('nan')) / r['cudnn'][i]:.2f})"
                        for r in rows
                    )
                )
    if args.json:
        atomic_write_text(args.json, json.dumps(log, indent=1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
