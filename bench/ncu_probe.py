"""Hardware counters for the kernels still short of their goals (session 13): run under Nsight Compute.

    ncu --profile-from-start off --clock-control none --set full -o $OUT/probe \
        python3 bench/ncu_probe.py [--parts attn128,attn64,embedding,copy] [--T 8192]
    ncu -i $OUT/probe.ncu-rep --page details > $OUT/details.txt
    ncu -i $OUT/probe.ncu-rep --page raw --csv > $OUT/raw.csv      # every metric, one row per kernel
Stall samples per SASS instruction (where a kernel's warps wait): profile with ``--section SourceCounters
--section WarpStateStats -k regex:NAME`` instead of the full set, then ``ncu -i REPORT --page source
--print-source sass --csv``. ``--config`` picks the Gluon backward's config for attn128 (default: the library's).

Everything is built and run once outside the profiled range (compilation, autotuning, cuDNN's plan), then
each part launches its kernels once between cudaProfilerStart and cudaProfilerStop, so ncu profiles exactly
those launches, each alone (ncu serialises kernels and, by default, flushes the caches before each pass):
  attn128    the hd128 causal bf16 Gluon split backward's two kernels, each alone (dK/dV, then dQ), then
             cuDNN's backward (``torch.autograd.grad`` through SDPA), at the bench shapes (B·T = 16k, H·D = 2048)
  attn64     the hd64 one-pass backward (the form that beats cuDNN), for comparison, then cuDNN's hd64 backward
  embedding  the fp32 embedding backward (N = 16k, V = 32k, C = 2048, the bench's Zipf-like ids): every
             kernel of the op, the rows kernel among them
  copy       1 GiB read and written by an elementwise kernel (``torch.mul(src, 1, out=dst)``; ``copy_`` itself
             is a cudaMemcpy, which ncu does not profile): the bandwidth ceiling's counters
Nothing is timed here: read the counters (tensor pipe, shared-memory and DRAM throughput, warp stall reasons).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


CONFIG = None  # the Gluon backward's config for attn128 (--config)


def attn128(T: int):
    from bench import isolated
    from bench.gluon_bwd_alone import split_kernels
    from xtrain.kernels import flash_attention as FA

    q, k, v, do = isolated.bench_inputs(128, T)
    o, lse = FA.flash_attention_fwd_triton(q, k, v, causal=True)
    dkdv, dq = split_kernels(q, k, v, do, o, lse, True, CONFIG)
    cud = isolated.cudnn_bwd(q, k, v, do, True)
    return [("gluon dK/dV hd128", dkdv), ("gluon dQ hd128", dq), ("cudnn bwd hd128", cud)]


def attn64(T: int):
    from bench import isolated
    from xtrain.kernels import flash_attention as FA
    from xtrain.kernels import flash_attention_gluon_onepass as OP

    q, k, v, do = isolated.bench_inputs(64, T)
    o, lse = FA.flash_attention_fwd_triton(q, k, v, causal=True)
    one = lambda: OP.flash_attention_bwd_gluon_onepass(do, q, k, v, o, lse, causal=True)  # noqa: E731
    cud = isolated.cudnn_bwd(q, k, v, do, True)
    return [("gluon one-pass bwd hd64", one), ("cudnn bwd hd64", cud)]


def embedding(T: int):
    from bench.kernels import zipf_ids
    from xtrain.kernels import embedding as K

    N, V, C = 16384, 32000, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = zipf_ids(N, V, generator=g)
    d = torch.randn(N, C, device="cuda", generator=g)
    return [("embedding bwd fp32", lambda: K.embedding_bwd_triton(d, ids, V))]


def copy(T: int):
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    return [("copy 1 GiB", lambda: torch.mul(src, 1.0, out=dst))]


PARTS = {"attn128": attn128, "attn64": attn64, "embedding": embedding, "copy": copy}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="attn128,attn64,embedding,copy")
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument(
        "--config",
        default=None,
        help="flash_attention_gluon_bwd config for attn128 (default: its own): "
        "a name in its CONFIGS or a tuple written with colons, 64:3:64:4:62 = (BLOCK_M1, STAGES1, "
        "BLOCK_N2, STAGES2, OPTS)",
    )
    a = ap.parse_args()
    global CONFIG
    from bench.gluon_bwd_alone import config_arg

    CONFIG = config_arg(a.config)
    calls = []
    for p in a.parts.split(","):
        calls += PARTS[p](a.T)
    for _, fn in calls:  # compile, autotune, plan: all outside the profiled range
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    for name, fn in calls:
        print(f"# profiled: {name}", flush=True)
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
