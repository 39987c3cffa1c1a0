"""The Triton flash kernels' program order: head by head against the last waves tile-major (``_tail_order``).

    PYTHONPATH=. python3 bench/triton_order.py [--seqs 1024,4096,16384] [--head-dims 64,128] [--waves 0,2,4]
        [--dtypes bf16,fp32]

The Triton kernels are what runs where the Gluon ones do not (other GPUs, fp32, T below the Gluon minimums,
the deterministic hd64 backward); here the Gluon routes are switched off so that they run on the H200 too.
Causal, B·T = 16k, H·D = 2048 (the bench shapes), GPU time (``bench/_gpu.py``, median) of the forward and of
the backward alone for each value of ``flash_attention.TRITON_TAIL_WAVES`` (a launch argument: nothing
recompiles), values alternated twice so that clock drift does not favour one. Every order's outputs are
compared bit for bit with the first's.
"""

from __future__ import annotations

import argparse

import torch


def measure(D: int, T: int, dtype: torch.dtype, waves: list) -> list:
    """[(waves, fwd ms, bwd ms)] for each value, twice over, after checking they give the same bits."""
    from bench import isolated
    from bench._gpu import gpu_time
    from xtrain.kernels import flash_attention as FA

    q, k, v, do = isolated.bench_inputs(D, T, dtype)
    first = None
    for w in waves:
        FA.TRITON_TAIL_WAVES = w
        o, lse = FA.flash_attention_fwd_triton(q, k, v, causal=True)
        got = (o, lse, *FA.flash_attention_bwd_triton(do, q, k, v, o, lse, True))
        if first is None:
            first = got
        elif not all(torch.equal(a, b) for a, b in zip(got, first)):
            raise SystemExit(f"D={D} T={T} {dtype}: waves {w} changed the bits")
    o, lse = first[:2]
    rows = []
    for w in waves + waves:
        FA.TRITON_TAIL_WAVES = w
        tf = gpu_time(lambda: FA.flash_attention_fwd_triton(q, k, v, causal=True))["ms"]
        tb = gpu_time(lambda: FA.flash_attention_bwd_triton(do, q, k, v, o, lse, True))["ms"]
        rows.append((w, tf, tb))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--waves", default="0,2,4")
    ap.add_argument("--dtypes", default="bf16")
    a = ap.parse_args()
    from bench._gpu import warm_up
    from xtrain.kernels import flash_attention as FA

    FA.FWD_GLUON = FA.BWD_GLUON = False  # the Triton kernels everywhere
    warm_up()
    waves = [int(w) for w in a.waves.split(",")]
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    print(
        f"{'dtype':>5} {'D':>4} {'T':>6} | "
        + " | ".join(f"w{w} fwd / bwd ms" for w in waves)
        + " | best fwd / bwd vs w0"
    )
    for name in a.dtypes.split(","):
        for D in (int(d) for d in a.head_dims.split(",")):
            for T in (int(t) for t in a.seqs.split(",")):
                rows = measure(D, T, dtypes[name], waves)
                best = {w: (min(r[1] for r in rows if r[0] == w), min(r[2] for r in rows if r[0] == w)) for w in waves}
                f0, b0 = best[waves[0]]
                cells = " | ".join(f"{best[w][0]:.3f} / {best[w][1]:.3f}" for w in waves)
                gain = min(best[w][0] for w in waves[1:]) / f0, min(best[w][1] for w in waves[1:]) / b0
                print(f"{name:>5} {D:>4} {T:>6} | {cells} | {gain[0]:.3f} / {gain[1]:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
