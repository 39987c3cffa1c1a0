"""The hd64 one-pass Gluon backward's configs side by side, against cuDNN's backward, at the bench shapes.

    PYTHONPATH=. python3 bench/onepass_configs.py [--configs pf,nopf] [--seqs 1024,4096,8192,16384]

Causal bf16, B·T = 16k, H·D = 2048, D = 64. GPU time (``bench/_gpu.py``: CUDA events, warm-up, median, L2
flushed, the host kept ahead), each contender timed in turn at each sequence length; nominal TFLOP/s (2.5 x the
forward's 4·B·H·T²·D / 2) and the ratio to cuDNN. Each config's dK and dV are checked bit for bit against the
first config's (the one-pass form's dQ comes from fp32 reduce-adds in a scheduling order, so it is not).
"""

from __future__ import annotations

import argparse


def main() -> int:
    import torch

    from bench import isolated
    from bench._gpu import gpu_time, warm_up
    from xtrain.kernels import flash_attention as FA
    from xtrain.kernels import flash_attention_gluon_onepass as OP

    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="pf,nopf", help="names in flash_attention_gluon_onepass.CONFIGS")
    ap.add_argument("--seqs", default="1024,4096,8192,16384")
    a = ap.parse_args()
    configs = a.configs.split(",")
    warm_up()
    rows = []
    D = 64
    for T in (int(t) for t in a.seqs.split(",")):
        q, k, v, do = isolated.bench_inputs(D, T)
        B, H = q.shape[0], q.shape[1]
        o, lse = FA.flash_attention_fwd_triton(q, k, v, causal=True)
        xs = (do, q, k, v, o, lse)
        calls = {c: (lambda c=c, xs=xs: OP.flash_attention_bwd_gluon_onepass(*xs, True, config=c)) for c in configs}
        calls["cudnn"] = isolated.cudnn_bwd(q, k, v, do)
        first = calls[configs[0]]()
        for c in configs[1:]:
            got = calls[c]()
            same = torch.equal(got[1], first[1]) and torch.equal(got[2], first[2])
            print(f"T={T} {c}: dK, dV bit-identical to {configs[0]}: {same}", flush=True)
        ms = {name: gpu_time(fn)["ms"] for name, fn in calls.items()}
        nominal = 2.5 * 4.0 * B * H * T * T * D / 2
        rows.append((T, ms, nominal))
    print(f"{'T':>6} | " + " | ".join(f"{n:>16}" for n in calls))
    for T, ms, nominal in rows:
        cells = [f"{ms[n]:.3f} ms {nominal / ms[n] / 1e9:4.0f}" for n in calls]
        print(
            f"{T:>6} | "
            + " | ".join(f"{c:>16}" for c in cells)
            + " | x cuDNN "
            + " ".join(f"{ms['cudnn'] / ms[c]:.2f}" for c in configs)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
