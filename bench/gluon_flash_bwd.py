"""Gluon (Hopper, sm_90) flash-attention BACKWARD, timed against cuDNN and xtrain's Triton backward.

    PYTHONPATH=. python3 bench/gluon_flash_bwd.py [--seqs 1024,4096] [--head-dims 64,128] [--variants split,split3]
    PYTHONPATH=. python3 bench/gluon_flash_bwd.py --compile-only  # no GPU needed: compiles every variant for sm_90
    PYTHONPATH=. python3 bench/gluon_flash_bwd.py --replay        # no GPU needed: CPU replay of the tile order

The kernels are the library's (xtrain/kernels/flash_attention_gluon_bwd.py: design, credits, H200 numbers
and the variants that lost); this file is the harness. A variant is a named config of that module
(``CONFIGS``: split, split_s9, split3, split_wide), launched through ``flash_attention_bwd_gluon(..., config=name)``.
The default timing set is ``DEFAULT_BENCH`` (split, split_wide; cuDNN and the Triton kernel always).
The one-pass variants (fused: dQ by TMA reduce-add, fused_atom: by fp32 atomics) and split_pipe (the dK/dV
consumer software-pipelined across query tiles) measured slower on the H200 and are gone from here; their
code is this file at commit 921bd50. The persistent round (pers, pers_pp, pers_wide, pers_wide_pp, with a
CPU replay of their barrier protocol) lost too (numbers in the module docstring); code at commit 6586ece.

Offline build facts (``--compile-only`` prints them, triton 3.6 and 3.9; the GPU box runs 3.6, so check
compiles with ``PYTHONPATH=/tmp/t36:.``): registers per thread, local memory (spills), setmaxnreg values,
shared memory and the PTX instructions the kernels are built on.

main() first checks every variant in a child process (a deadlocked mbarrier wait would hang the run; a
CUDA fault would poison the context): a variant with no result within 120 s is killed and reported HANG.
Gate: relative-norm error ||x − ref|| / ||ref|| < 1e-2 for each of dq, dk, dv against
``flash_attention_bwd_ref`` in fp64 (B=1, H=4, Hkv=2, T=1024 and 2048, D=64 and 128, causal, outputs
NaN-poisoned; o and lse from ``flash_attention_fwd_ref`` in fp64 then cast). Timing: GPU time
(bench/_gpu.py, host kept ahead), median, of each backward alone; cuDNN's backward alone via
``torch.autograd.grad`` on a saved SDPA graph (retain_graph), TFLOP/s = 2.5 × 4·B·H·T²·D/2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from bench import isolated  # noqa: E402
from bench.isolated import check_one  # noqa: E402
from xtrain.fileio import atomic_write_text  # noqa: E402
from xtrain.kernels import flash_attention_gluon_bwd as GB  # noqa: E402

LOG2E = GB.LOG2E
HALF_ROWS = GB.HALF_M  # rows of the resident tile owned by one consumer warpgroup
RESIDENT = GB.RESIDENT  # keys per dK/dV program, query rows per dQ program
VARIANTS = GB.CONFIGS  # name -> {head_dim: (BLOCK_M1, STAGES1, BLOCK_N2, STAGES2)}
DEFAULT_VARIANT = GB.DEFAULT
# the default timing set (split3 lost everywhere; --variants names any config)
DEFAULT_BENCH = ["split", "split_wide"]


def gluon_flash_bwd(
    do, q, k, v, o, lse, causal=True, scale=None, variant=DEFAULT_VARIANT, *, dq=None, dk=None, dv=None
):
    """The library backward with the config named ``variant``. Returns (dq, dk, dv)."""
    return GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, causal, scale, dq=dq, dk=dk, dv=dv, config=variant)


# ---------------------------------------------------------------------------------------------------------
# CPU replay of the kernels' tile schedule and math (no GPU): --replay
# ---------------------------------------------------------------------------------------------------------
def replay(variant, D=64, T=384, B=2, H=4, Hkv=2, causal=True, transposed=False, seed=0):
    """Replays, in torch fp64 on the CPU, exactly the loops the kernels run (which tiles, in which order,
    which are masked, which warpgroup half owns which rows, the transposed dK/dV formulation) with the
    kernels' descriptor coordinates (row b·rb + h·rh + t, column h·ch of each tensor's 2-D row view;
    ``transposed``: q, k, v, do and the outputs as [B, T, Hx, D] seen through a transpose) and returns the
    relative errors of dq, dk, dv against flash_attention_bwd_ref. Catches schedule, mask and indexing
    mistakes, not barrier bugs."""
    from xtrain.kernels.flash_attention import flash_attention_bwd_ref, flash_attention_fwd_ref
    from xtrain.kernels.flash_attention_gluon import _row_view

    BM1, _, BN2 = VARIANTS[variant][D][:3]
    g = torch.Generator().manual_seed(seed)

    def mk(h, data=True):
        x = (
            torch.randn(B, T, h, D, generator=g, dtype=torch.float64)
            if data
            else torch.zeros(B, T, h, D, dtype=torch.float64)
        )
        return x.transpose(1, 2) if transposed else x.transpose(1, 2).contiguous()

    q, k, v, do = mk(H), mk(Hkv), mk(Hkv), mk(H)
    dq, dk, dv = mk(H, False), mk(Hkv, False), mk(Hkv, False)
    o, lse = flash_attention_fwd_ref(q, k, v, causal)
    s = 1.0 / math.sqrt(D)
    qk = s * LOG2E
    GROUP = H // Hkv
    lse_f = lse.reshape(-1)
    delta = (do * o).sum(-1).reshape(-1)
    (q2, *qc), (k2, *kc), (v2, *vc), (do2, *doc) = (_row_view(x) for x in (q, k, v, do))
    (dq2, *dqc), (dk2, *dkc), (dv2, *dvc) = (_row_view(x) for x in (dq, dk, dv))

    def tile(x2, c, b, h, t, n):  # rows [t, t + n) of head h of batch b, through the 2-D view
        row, col = b * c[0] + h * c[1] + t, h * c[2]
        return x2[row : row + n, col : col + D]

    for pid_n in range(T // RESIDENT):  # dK/dV kernel grid
        for off_bkv in range(B * Hkv):
            off_b, off_kvh = off_bkv // Hkv, off_bkv % Hkv
            start_n = pid_n * RESIDENT
            h0 = off_kvh * GROUP
            mt0 = start_n // BM1 if causal else 0
            n_m = T // BM1 - mt0
            for half in range(2):
                k_lo = start_n + half * HALF_ROWS
                kh, vh = tile(k2, kc, off_b, off_kvh, k_lo, HALF_ROWS), tile(v2, vc, off_b, off_kvh, k_lo, HALF_ROWS)
                dkh, dvh = torch.zeros_like(kh), torch.zeros_like(vh)
                for it in range(GROUP * n_m):
                    h, start_m = h0 + it // n_m, (mt0 + it % n_m) * BM1
                    row = (off_b * H + h) * T + start_m  # lse / delta
                    qt, dot = tile(q2, qc, off_b, h, start_m, BM1), tile(do2, doc, off_b, h, start_m, BM1)
                    pt = torch.exp2((kh @ qt.T) * qk - (lse_f[row : row + BM1] * LOG2E)[None, :])
                    if causal and start_m < k_lo + HALF_ROWS:
                        keep = (start_m + torch.arange(BM1))[None, :] >= (k_lo + torch.arange(HALF_ROWS))[:, None]
                        pt = torch.where(keep, pt, 0.0)
                    dvh += pt @ dot
                    dkh += (pt * (vh @ dot.T - delta[row : row + BM1][None, :])) @ qt
                tile(dk2, dkc, off_b, off_kvh, k_lo, HALF_ROWS)[:] = dkh * s
                tile(dv2, dvc, off_b, off_kvh, k_lo, HALF_ROWS)[:] = dvh
    for pid in range(T // RESIDENT):  # dQ kernel grid (heaviest first)
        for off_bh in range(B * H):
            pid_m = T // RESIDENT - 1 - pid if causal else pid
            off_b, off_h = off_bh // H, off_bh % H
            off_hk = off_h // GROUP
            start_m = pid_m * RESIDENT
            n_tiles = (start_m + RESIDENT) // BN2 if causal else T // BN2
            for half in range(2):
                q_lo = start_m + half * HALF_ROWS
                row0 = off_bh * T + q_lo
                qh, doh = tile(q2, qc, off_b, off_h, q_lo, HALF_ROWS), tile(do2, doc, off_b, off_h, q_lo, HALF_ROWS)
                lse2 = lse_f[row0 : row0 + HALF_ROWS] * LOG2E
                dqh = torch.zeros_like(qh)
                for j in range(n_tiles):
                    sn = j * BN2
                    kt, vt = tile(k2, kc, off_b, off_hk, sn, BN2), tile(v2, vc, off_b, off_hk, sn, BN2)
                    p = torch.exp2((qh @ kt.T) * qk - lse2[:, None])
                    if causal and sn + BN2 > q_lo + 1:
                        keep = (q_lo + torch.arange(HALF_ROWS))[:, None] >= (sn + torch.arange(BN2))[None, :]
                        p = torch.where(keep, p, 0.0)
                    dqh += (p * (doh @ vt.T - delta[row0 : row0 + HALF_ROWS][:, None])) @ kt
                tile(dq2, dqc, off_b, off_h, q_lo, HALF_ROWS)[:] = dqh * s
    ref = flash_attention_bwd_ref(do, q, k, v, o, lse, causal)
    return [((x - r).norm() / r.norm()).item() for x, r in zip((dq, dk, dv), ref)]


# ---------------------------------------------------------------------------------------------------------
# offline compilation (no GPU): --compile-only
# ---------------------------------------------------------------------------------------------------------
def compile_variant(name, D, causal=True):
    """{kernel name: CompiledKernel} of variant ``name`` at head dim D, compiled for sm_90 without a GPU."""
    return GB.compile_sm90(D, causal, name)


def _ptx_summary(ck):
    return isolated.ptx_summary(
        ck,
        [
            "wgmma.mma_async",
            "cp.async.bulk.tensor",
            "red.global",
            "atom.global",
            "mbarrier.try_wait",
            "setmaxnreg",
            "ld.local",
            "st.local",
        ],
    )


def compile_only(variants, head_dims, dump=None):
    print(f"triton {triton.__version__}: compiling Gluon backward variants for sm_90 (no GPU)")
    ok = True
    for name in variants:
        for D in head_dims:
            t0 = time.time()
            try:
                cks = compile_variant(name, D)
                for kname, ck in cks.items():
                    print(f"  {name:10s} D={D:3d} {kname:4s}: OK {time.time() - t0:5.1f}s  {_ptx_summary(ck)}")
                    if dump:
                        import os

                        os.makedirs(dump, exist_ok=True)
                        for ext in ("ttgir", "ptx"):
                            atomic_write_text(f"{dump}/{name}_{kname}_d{D}.{ext}", ck.asm.get(ext, ""))
            except Exception as e:  # noqa: BLE001
                ok = False
                print(f"  {name:10s} D={D:3d}: FAIL {type(e).__name__}: {str(e)[:3000]}")
    return ok


# ---------------------------------------------------------------------------------------------------------
# GPU check + benchmark
# ---------------------------------------------------------------------------------------------------------
def check_variant(name, head_dims):
    """Worst relative-norm error of dq, dk, dv against the fp64 reference (causal, T = 1024 and 2048)."""
    return isolated.bwd_worst_error(
        name,
        head_dims,
        lambda do, q, k, v, o, lse, dq, dk, dv: gluon_flash_bwd(
            do, q, k, v, o, lse, True, None, name, dq=dq, dk=dk, dv=dv
        ),
    )


def _check_one(name, head_dims):
    """Check one variant in this process (bench/isolated.py's markers around it)."""
    print(f"[{name}] checking vs fp64 reference (B=1, H=4, Hkv=2, T=1024/2048, causal, NaN-filled outputs)")

    def check():
        err = check_variant(name, head_dims)
        return err < 1e-2, f"worst rel-norm err {err:.2e}"

    return check_one(name, check)


def run_checks(variants, head_dims, startup_s=180.0, per_variant_s=120.0):
    """The checks in child processes (bench/isolated.py). Returns the passing variants."""
    return isolated.run_checks(
        os.path.abspath(__file__), variants, ["--head-dims", ",".join(map(str, head_dims))], startup_s, per_variant_s
    )


def bench_row(D, T, variants):
    """Backward TFLOP/s of cuDNN, xtrain's Triton backward and each variant (``isolated.bwd_bench_row``)."""

    def run(name):
        return lambda do, q, k, v, o, lse, dq, dk, dv: gluon_flash_bwd(
            do, q, k, v, o, lse, True, None, name, dq=dq, dk=dk, dv=dv
        )

    return isolated.bwd_bench_row(D, T, [(name, run(name)) for name in variants], warmup=5, rep=30)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    isolated.add_variant_args(
        ap,
        seqs="1024,2048,4096,8192,16384",
        head_dims="64,128",
        variants=None,
        variants_help=f"any of {','.join(VARIANTS)} (default: the timing set "
        f"{','.join(DEFAULT_BENCH)}; every config with --compile-only / "
        f"--replay)",
        replay_help="CPU replay of the tile schedule (no GPU)",
    )
    ap.add_argument("--dump", default=None, help="with --compile-only: write ttgir/ptx into this folder")
    args = ap.parse_args(argv)
    if args.variants is None:
        args.variants = ",".join(VARIANTS if (args.compile_only or args.replay) else DEFAULT_BENCH)
    seqs, head_dims, variants = isolated.variant_lists(ap, args, VARIANTS)
    if args.compile_only:
        return 0 if compile_only(variants, head_dims, args.dump) else 1
    if args.replay:
        ok = True
        for name in variants:
            for D in head_dims:
                for causal in (True, False):
                    for transposed in (False, True):
                        errs = replay(name, D, causal=causal, transposed=transposed)
                        good = max(errs) < 1e-10
                        ok &= good
                        print(
                            f"  replay {name:10s} D={D:3d} causal={causal!s:5s} "
                            f"{'bthd' if transposed else 'bhtd'}: rel-norm err dq {errs[0]:.1e} "
                            f"dk {errs[1]:.1e} dv {errs[2]:.1e} {'OK' if good else 'MISMATCH'}"
                        )
        return 0 if ok else 1

    print(f"torch {torch.__version__}  triton {triton.__version__}  device {torch.cuda.get_device_name()}")
    sys.stdout.flush()
    return isolated.check_then_time(
        variants,
        head_dims,
        seqs,
        check_only=args.check_only,
        no_isolate=args.no_isolate,
        check_fn=_check_one,
        checks_fn=run_checks,
        bench_row=bench_row,
        title="causal bf16 BACKWARD, TFLOP/s (x cuDNN); B = 16384 / T, H = 2048 / D; backward alone "
        "(cuDNN: autograd.grad on a saved SDPA graph)",
    )


if __name__ == "__main__":
    sys.exit(main())
