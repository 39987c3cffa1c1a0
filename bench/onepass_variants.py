"""Check and time configs of the library's one-pass Gluon backward (xtrain/kernels/flash_attention_gluon_onepass.py)
against cuDNN and the library default, in one process per timing run (checks in child processes: a config that
deadlocks costs a timeout, not the run).

    PYTHONPATH=. python3 bench/onepass_variants.py [--head-dims 64,128] [--seqs 2048,8192,16384] [--variants a,b]
    PYTHONPATH=. python3 bench/onepass_variants.py --compile-only     # no GPU: sm_90 compile facts per variant

A variant is a name of ``VARIANTS``: {head dim: config}, where a config is a name of the library's ``CONFIGS`` or
its tuple (STAGES, SLOTS, NDS, PF, KV_REGS, DQ_REGS, DV_EARLY, NP, DP); the check is ``isolated.bwd_worst_error``
(B=1, H=4, Hkv=2, T = 1024 and 2048, causal, NaN-poisoned outputs, fp64 reference, pass below 1e-2), the timing
``isolated.bwd_bench_row`` (causal bf16, B·T = 16k, H·D = 2048, backward alone, do_bench median).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench import isolated  # noqa: E402
from xtrain.kernels import flash_attention_gluon_onepass as OP  # noqa: E402

VARIANTS = {
    "pf": {64: "pf"},  # the hd64 default
    "np64": {64: "np"},
    # hd128, producer-less (three warpgroups): NP = 1 loads by dK/dV warpgroup 0, NP = 2 by the dQ warpgroup;
    # dQ in 32-column pieces (the dQ warpgroup gets 56 registers; at 40 ptxas serialises every wgmma)
    "np128": {128: "np"},
    "np128_s3": {128: (3, 2, 2, False, 224, 56, False, 1, 32)},
    "np128_dql": {128: (3, 2, 2, False, 224, 56, False, 2, 32)},
    "np128_dve": {128: (2, 2, 2, False, 224, 56, True, 1, 32)},
}
DEFAULT_VARIANTS = ["np128", "np128_s3", "np128_dql", "np128_dve"]


def _run(cfg):
    return lambda do, q, k, v, o, lse, dq, dk, dv: OP.flash_attention_bwd_gluon_onepass(
        do, q, k, v, o, lse, True, dq=dq, dk=dk, dv=dv, config=cfg)


def check_fn(name, head_dims):
    dims = [D for D in head_dims if D in VARIANTS[name]]

    def check():
        worst = 0.0
        for D in dims:
            worst = max(worst, isolated.bwd_worst_error(name, [D], _run(VARIANTS[name][D])))
        return worst < 1e-2, f"worst rel-norm err {worst:.2e}"
    return isolated.check_one(name, check)


def checks_fn(variants, head_dims):
    return isolated.run_checks(os.path.abspath(__file__), variants, ["--head-dims", ",".join(map(str, head_dims))],
                               startup_s=120.0, per_variant_s=90.0)


def bench_row(D, T, variants):
    runs = [(name, _run(VARIANTS[name][D])) for name in variants if D in VARIANTS[name]]
    return isolated.bwd_bench_row(D, T, runs, warmup=10, rep=40)


def compile_only(variants, head_dims) -> bool:
    from bench.gluon_flash_bwd_onepass import ptxas_report

    ok = True
    for name in variants:
        for D in (D for D in head_dims if D in VARIANTS[name]):
            for causal in (True, False):
                try:
                    ck = OP.compile_sm90(causal=causal, config=VARIANTS[name][D], D=D)
                except Exception as e:  # noqa: BLE001
                    print(f"{name} D={D} causal={causal}: FAILED {type(e).__name__}: {str(e)[:500]}")
                    ok = False
                    continue
                regs = re.findall(r"setmaxnreg\S*\s+(\d+)", ck.asm["ptx"])
                print(f"{name} D={D} causal={causal}: {ptxas_report(ck)}, setmaxnreg {regs}, "
                      f"smem {ck.metadata.shared} B")
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="2048,8192,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"any of {','.join(VARIANTS)}")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--no-isolate", action="store_true")
    ap.add_argument("--check-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    seqs = [int(x) for x in args.seqs.split(",") if x]
    head_dims = [int(x) for x in args.head_dims.split(",") if x]
    variants = [x for x in args.variants.split(",") if x]
    for name in variants:
        if name not in VARIANTS:
            ap.error(f"unknown variant {name!r}; have {','.join(VARIANTS)}")
    if args.compile_only:
        return 0 if compile_only(variants, head_dims) else 1
    import triton

    print(f"torch {torch.__version__}  triton {triton.__version__}  device {torch.cuda.get_device_name()}")
    sys.stdout.flush()
    return isolated.check_then_time(
        variants, head_dims, seqs, check_only=args.check_only, no_isolate=args.no_isolate, check_fn=check_fn,
        checks_fn=checks_fn, bench_row=bench_row,
        title="causal bf16 BACKWARD, TFLOP/s (x cuDNN); B = 16384 / T, H = 2048 / D; backward alone; "
              "triton = library default")


if __name__ == "__main__":
    sys.exit(main())
