"""Does the order of timing change the ratio under the power cap? xtrain's and cuDNN's attention backward timed in
alternation, several rounds, at one size (default hd128, T = 16k, causal bf16, the bench shapes).

    PYTHONPATH=. python3 bench/order_probe.py [--D 128] [--T 16384] [--rounds 4] [--reps 30] [--B 1]
    PYTHONPATH=. python3 bench/order_probe.py --streams ...   # xtrain's backward on two streams against one

Each round times xtrain then cuDNN (``bench/_gpu.py``: CUDA events, warm-up, median, L2 flushed, host kept
ahead) and the next round cuDNN then xtrain, so each contender is measured as often first as second. Prints
every measurement in order and the ratio of the medians (cuDNN ms / xtrain ms: above 1, xtrain is faster).
``--streams``: xtrain's backward as the library runs it (dQ kernel on a side stream, beside the dK/dV kernel)
against the same on one stream (``flash_attention.BWD_TWO_STREAMS`` off).
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
    ap.add_argument("--B", type=int, default=None, help="batch (default: the bench's 16k tokens / T)")
    ap.add_argument(
        "--streams",
        action="store_true",
        help="cuDNN's place taken by xtrain on one stream (flash_attention.BWD_TWO_STREAMS off)",
    )
    a = ap.parse_args()
    warm_up()
    q, k, v, do = isolated.bench_inputs(a.D, a.T, tokens=(a.B or 16384 // a.T) * a.T)
    o, lse = FA.flash_attention_fwd_triton(q, k, v, causal=True)
    xtrain = lambda: FA.flash_attention_bwd_triton(do, q, k, v, o, lse, causal=True)  # noqa: E731
    if a.streams:

        def one_stream():
            FA.BWD_TWO_STREAMS = False
            try:
                return FA.flash_attention_bwd_triton(do, q, k, v, o, lse, causal=True)
            finally:
                FA.BWD_TWO_STREAMS = True

        calls = {"xtrain, two streams": xtrain, "xtrain, one stream": one_stream}
    else:
        calls = {"xtrain": xtrain, "cuDNN": isolated.cudnn_bwd(q, k, v, do)}
    first, second = calls
    got = {n: [] for n in calls}
    for r in range(a.rounds):
        for n in (first, second) if r % 2 == 0 else (second, first):
            ms = gpu_time(calls[n], reps=a.reps)["ms"]
            got[n].append(ms)
            print(f"round {r} {n:>20}: {ms:.3f} ms", flush=True)
    med = {n: statistics.median(v) for n, v in got.items()}
    print(
        f"D={a.D} T={a.T} B={q.shape[0]}: median {first} {med[first]:.3f} ms, {second} {med[second]:.3f} ms, "
        f"ratio {med[second] / med[first]:.3f}; {first} when first {got[first][0::2]}, when second "
        f"{got[first][1::2]}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
