"""Probe: Triton tiles for the document-masked flash kernels (GPU). Times the forward and the backward with a few
tile configs against the shipped ones, at T = 8192, hd 64 and 128, mean documents 256 and 1024, bf16.

    PYTHONPATH=. python3 dev/doc_tiles.py
"""

from __future__ import annotations

import torch

from bench._docs import random_doc_starts
from bench._gpu import gpu_time
from xtrain.kernels import attention as FA
from xtrain.kernels.attention import Tiles, TritonBwdConfig, TritonFwdConfig
from xtrain.kernels.attention import triton as TR

T, TOKENS, WIDTH = 8192, 16384, 2048
FWD = {
    64: [
        Tiles(128, 64, 4, 3),
        Tiles(64, 64, 4, 3),
        Tiles(128, 32, 4, 3),
        Tiles(64, 32, 4, 3),
        Tiles(128, 64, 4, 3, True),
    ],
    128: [Tiles(128, 128, 8, 3), Tiles(64, 64, 4, 3, True), Tiles(128, 64, 8, 3), Tiles(64, 32, 4, 3)],
}
BWD = {  # (dK/dV, dQ)
    64: [(Tiles(64, 64, 4, 3), Tiles(128, 64, 8, 3, True)), (Tiles(32, 64, 4, 3), Tiles(64, 64, 4, 3)),
         (Tiles(64, 128, 8, 3), Tiles(64, 32, 4, 3)), (Tiles(32, 64, 4, 3), Tiles(128, 64, 8, 3, True))],
    128: [(Tiles(64, 64, 4, 2, True), Tiles(64, 64, 4, 2, True)), (Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2)),
          (Tiles(64, 128, 8, 2), Tiles(64, 64, 4, 2, True))],
}  # fmt: skip


def fwd_call(q, k, v, c, ds):
    return lambda: TR.flash_attention_fwd_triton(q, k, v, True, config=c, doc_starts=ds)


def bwd_call(do, q, k, v, o, lse, c, ds):
    return lambda: TR.flash_attention_bwd_triton(do, q, k, v, o, lse, True, config=c, doc_starts=ds)


def main():
    print(torch.cuda.get_device_name(), "T", T)
    for D in (64, 128):
        B, H = TOKENS // T, WIDTH // D
        g = torch.Generator(device="cuda").manual_seed(D)
        q, k, v, do = (torch.randn(B, H, T, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        for mean in (256, 1024):
            ds = random_doc_starts(B, T, mean, seed=T + mean, device="cuda")
            o, lse = FA.flash_attention_fwd(q, k, v, True, doc_starts=ds)
            for t in FWD[D]:
                c = TritonFwdConfig(t)
                try:
                    f = fwd_call(q, k, v, c, ds)
                    ms = gpu_time(f)["ms"]
                    o2, _ = f()
                    e = float((o2.float() - o.float()).norm() / o.float().norm())
                    print(f"D={D} doc={mean} fwd {t}: {ms:.3f} ms err {e:.1e}", flush=True)
                except Exception as ex:
                    print(f"D={D} doc={mean} fwd {t}: failed {type(ex).__name__}: {str(ex)[:120]}", flush=True)
            for a, b in BWD[D]:
                c = TritonBwdConfig(a, b)
                try:
                    ms = gpu_time(bwd_call(do, q, k, v, o, lse, c, ds))["ms"]
                    print(f"D={D} doc={mean} bwd {a} {b}: {ms:.3f} ms", flush=True)
                except Exception as ex:
                    print(f"D={D} doc={mean} bwd {a} {b}: failed {type(ex).__name__}: {str(ex)[:120]}", flush=True)


if __name__ == "__main__":
    main()
