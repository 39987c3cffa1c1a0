"""Does the order of timing change the ratio under the power cap? xtrain's and cuDNN's attention backward timed in
alternation, several rounds, at one size (default hd128, T = 16k, causal bf16, the bench shapes).

    PYTHONPATH=. python3 bench/order_probe.py [--D 128] [--T 16384] [--rounds 4] [--reps 30]

Each round times xtrain then cuDNN (``bench/_gpu.py``: CUDA events, warm-up, median, L2 flushed, host kept
ahead) and the next round cuDNN then xtrain, so each contender is measured as often first as second. Prints
every measurement in order and the ratio of the medians (cuDNN ms / xtrain ms: above 1, xtrain is faster).
"""

from __future__ import annotations

import argparse
import statistics


def main() -> int:
    from bench import isolated
    from bench._gpu import gpu_time, warm_up
    from xtrain.kernels import flash_attention as FA

    ap = argparse.ArgumentParser()
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    warm_up()
    q, k, v, do = isolated.bench_inputs(a.D, a.T)
    o, lse = FA.flash_attention_fwd_triton(q, k, v, causal=True)
    calls = {"xtrain": lambda: FA.flash_attention_bwd_triton(do, q, k, v, o, lse, causal=True),
             "cudnn": isolated.cudnn_bwd(q, k, v, do)}
    got = {n: [] for n in calls}
    for r in range(a.rounds):
        order = ("xtrain", "cudnn") if r % 2 == 0 else ("cudnn", "xtrain")
        for n in order:
            ms = gpu_time(calls[n], reps=a.reps)["ms"]
            got[n].append(ms)
            print(f"round {r} {n:>6}: {ms:.3f} ms", flush=True)
    med = {n: statistics.median(v) for n, v in got.items()}
    print(f"D={a.D} T={a.T}: median xtrain {med['xtrain']:.3f} ms, cuDNN {med['cudnn']:.3f} ms, "
          f"ratio {med['cudnn'] / med['xtrain']:.3f}; xtrain first {got['xtrain'][0::2]}, second {got['xtrain'][1::2]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
