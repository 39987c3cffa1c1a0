"""The deterministic hd64 attention backward: which kernel should ``torch.use_deterministic_algorithms(True)`` get?

    PYTHONPATH=. python3 bench/deterministic_bwd.py [--seqs 1024,4096,16384] [--head-dim 64]

Causal bf16, bench shapes (B·T = 16k, H·D = 2048), GPU time (``bench/_gpu.py``, median), one process: the Triton
kernels (``flash_attention_bwd_triton`` with an explicit Triton config, which never routes to Gluon), the Gluon
two-kernel split (``flash_attention_bwd_gluon``: its default config and "split_s14", the default of sessions 13-14),
the library's default route (the one-pass kernel at hd64, not deterministic) and cuDNN's backward; each as ms and
x cuDNN. Also whether the split gives the same bits twice and against the Triton kernels.
"""

from __future__ import annotations

import argparse

import torch


def row(D: int, T: int) -> str:
    from bench import isolated
    from bench._gpu import gpu_time
    from xtrain.kernels import flash_attention as FA
    from xtrain.kernels import flash_attention_gluon_bwd as GB

    q, k, v, do = isolated.bench_inputs(D, T)
    o, lse = FA.flash_attention_fwd_triton(q, k, v, causal=True)
    tri_cfg = FA._BWD_CONFIGS[(D, FA._dtype_class(q.dtype))]
    fns = {
        "triton": lambda: FA.flash_attention_bwd_triton(do, q, k, v, o, lse, True, config=tri_cfg),
        "split": lambda: GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, True),
        "split_s14": lambda: GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, True, config="split_s14"),
        "default route": lambda: FA.flash_attention_bwd_triton(do, q, k, v, o, lse, True),
        "cuDNN": isolated.cudnn_bwd(q, k, v, do, True),
    }
    ms = {name: gpu_time(fn)["ms"] for name, fn in fns.items()}
    a, b, tri = fns["split"](), fns["split"](), fns["triton"]()
    same = all(torch.equal(x, y) for x, y in zip(a, b))
    as_triton = all(torch.equal(x, y) for x, y in zip(a, tri))
    cells = " | ".join(f"{ms[n]:.3f} ({ms['cuDNN'] / ms[n]:.2f})" for n in fns if n != "cuDNN")
    return f"{T:>6} | {cells} | {ms['cuDNN']:.3f} | {same} | {as_triton}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--head-dim", type=int, default=64)
    a = ap.parse_args()
    from bench._gpu import warm_up

    warm_up()
    print(f"D = {a.head_dim}: ms (x cuDNN)")
    print(
        "     T | Triton kernels | Gluon split | split_s14 | default route | cuDNN ms | split same bits twice | "
        "split == Triton"
    )
    for T in (int(t) for t in a.seqs.split(",")):
        print(row(a.head_dim, T), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
