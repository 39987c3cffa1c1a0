"""Compile every Triton kernel the library launches for a GPU target, with no GPU: ``xtrain check --kernels 90``, or
``python -m xtrain.kernels.compile_check [--arch 90] [--only NAME]``.

Why: the CPU tests run the kernels through the Triton interpreter, which executes Python, not compiled code, so a kernel
can pass them and still fail to compile on a GPU (e.g. a store into an argument that is ``None`` in one specialisation,
under a branch decided at run time: the interpreter never takes it, Triton 3.9 compiles it and Triton 3.6 refuses it).
This check catches that class of failure on a CPU machine, with whichever Triton is installed; to check against another
(the GPU image has 3.6), run it in a venv with that Triton.

How: Triton's launcher is asked to compile and not launch (``JITFunction.run`` with ``warmup=True``), and its driver is
replaced by a stand-in that names the target (``cuda``, ``--arch``, warp size 32). Then each op's Triton entry point
(``*_triton``) is called on small CPU tensors in fp32 and bf16, with the configs that choose other kernel
specialisations (every shipped form of the embedding backward). The wrappers run as they would on a GPU, up to the
launch: every specialisation they ask for is compiled down to a cubin with ptxas. Nothing they compute is used, and
their outputs are never written. Each case reports the kernels it compiled, or the first error.

Where a wrapper's choice of specialisation depends on the tensors being on CUDA, the CPU run answers as the target would
where it can: ``pdl_ok`` (whether a kernel is launched as a programmatic dependent, a compile-time flag) says yes for
sm_90 and later, and AdamW is built with both divisions (``recip_div``, the one of each device's reference). For sm_90
the run also compiles every Gluon attention config the routing ships (``xtrain.kernels.attention.shipped_configs``)
through the Gluon modules' own ``compile_sm90``. Streams are not compiled code: the forms that run two chains side by
side on CUDA launch the same kernels one after the other here. Run this in a process that has not set TRITON_INTERPRET
and, on a CPU-only torch, has set XTRAIN_KERNELS=triton (which loads Triton there; ``xtrain check --kernels`` and
``tests/_child.py`` run it so).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable
from unittest import mock

import torch


@contextlib.contextmanager
def compile_only(arch: int = 90):
    """Within: a Triton launch compiles for ``cuda`` sm_``arch`` and returns without running; yields the list
    that each compile (or cache hit) appends the kernel's name to. Restores Triton's driver and launcher after."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compile_check: TRITON_INTERPRET=1 is set; the kernels would be interpreted, not compiled")
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class _Target:  # the part of Triton's driver a compile-only launch asks for
        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    names: list = []
    run = JITFunction.run

    def compile_run(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        if not getattr(kernel, "asm", {}).get("cubin"):
            raise RuntimeError(f"compile_check: {self.__name__} gave no cubin")
        names.append(self.__name__)
        return kernel

    # the wrappers ask pdl_ok (a CUDA tensor on sm_90+) whether to launch a kernel as a programmatic dependent, which
    # is a compile-time flag of the kernel: answered as the target would, in every kernel module that imported it
    from xtrain.kernels import _dispatch

    real_pdl_ok = _dispatch.pdl_ok
    modules = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("xtrain.kernels") and getattr(m, "pdl_ok", None) is real_pdl_ok
    ]
    old = driver._active  # None until a driver was asked for (none is active on a machine without a GPU)
    driver.set_active(_Target())
    JITFunction.run = compile_run
    with contextlib.ExitStack() as stack:
        for m in modules:
            stack.enter_context(mock.patch.object(m, "pdl_ok", lambda t: _dispatch.gdc_wait is not None and arch >= 90))
        try:
            yield names
        finally:
            JITFunction.run = run
            driver._active = old


def cases() -> dict[str, Callable[[], None]]:
    """name -> a call of one op's Triton entry point on small CPU tensors (each a distinct specialisation set)."""
    from xtrain.kernels import (
        adamw,
        attention,
        cross_entropy,
        dropout,
        embedding,
        linear_cross_entropy,
        qk_norm_rope,
        rms_norm,
        rope,
        rows_linear,
        swiglu,
    )
    from xtrain.kernels.attention import decode

    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    out: dict[str, Callable[[], None]] = {}
    for dt, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):

        def norm(dt=dt):
            for C in (96, 2048):  # short rows' and long rows' tilings
                x, w = r(8, C, dtype=dt), r(C, dtype=dt)
                y, inv = rms_norm.rms_norm_fwd_triton(x, w, 1e-6)
                rms_norm.rms_norm_bwd_triton(r(8, C, dtype=dt), x, w, inv)
                rms_norm.rms_norm_bwd_triton(r(8, C, dtype=dt), x, w, inv, r(8, C, dtype=dt))  # + the residual's
                rms_norm.rms_norm_fwd_triton(x, w, 1e-6, torch.bfloat16, res=r(8, C, dtype=torch.bfloat16))  # + add
                rms_norm.rms_norm_bwd_triton(r(8, C, dtype=dt), x, w, inv, low=torch.bfloat16)  # + the bf16 dx

        def rope_(dt=dt):
            x, pos = r(2, 4, 16, 64, dtype=dt), torch.arange(16)
            rope.rope_fwd_triton(x, pos)
            rope.rope_bwd_triton(x, pos)

        def qk_(dt=dt):
            for pos in (torch.arange(16), torch.arange(32).view(2, 16)):  # positions [T] and [B, T]
                x, w = r(32, 4 * 64, dtype=dt), r(64, dtype=dt)
                table = qk_norm_rope.rope_table(pos, 64, 10000.0, torch.float32)
                y, inv = qk_norm_rope.qk_norm_rope_fwd_triton(x, w, 4, 1e-6, pos, table)
                qk_norm_rope.qk_norm_rope_bwd_triton(y, x, w, 4, inv, pos, table)  # dy in the forward's layout
                dy = r(2, 4, 16, 64, dtype=dt)
                qk_norm_rope.qk_norm_rope_bwd_triton(dy, x, w, 4, inv, pos, table)  # and contiguous
            for B, H, Hkv, D in ((1, 12, 4, 64), (2, 16, 8, 128)):  # a decode step: a lone row's table, then B rows'
                ck, c = r(3, Hkv, 40, D, dtype=dt), r(B, 1, 1, D // 2) if B > 1 else r(1, D // 2)
                qkv, w, rows = r(B, (H + 2 * Hkv) * D, dtype=dt), r(H + Hkv, D), torch.arange(B)
                qk_norm_rope.qkv_norm_rope_store_triton(qkv, w, H, Hkv, 1e-6, (c, c), ck, ck, rows, rows)

        def swiglu_(dt=dt):
            a, b, dy = r(8, 96, dtype=dt), r(8, 96, dtype=dt), r(8, 96, dtype=dt)
            swiglu.swiglu_fwd_triton(a, b)
            swiglu.swiglu_bwd_triton(dy, a, b)

        def dropout_(dt=dt):
            x = r(8, 96, dtype=dt)
            dropout.dropout_fwd_triton(x, 0.1, 7)
            dropout.dropout_bwd_triton(x, 0.1, 7)

        def xent(dt=dt):
            logits, t = r(8, 1000, dtype=dt), torch.randint(0, 1000, (8,), generator=g)
            cross_entropy.cross_entropy_fwd_lse_triton(logits, t)
            loss, lse = cross_entropy.cross_entropy_fwd_triton(logits, t)[:2]
            cross_entropy.cross_entropy_bwd_triton(torch.ones(()), logits, t, lse)
            cross_entropy.cross_entropy_fwd_bwd_triton(logits, t)

        def lin_xent(dt=dt):
            x, w, t = r(16, 64, dtype=dt), r(500, 64, dtype=dt), torch.randint(0, 500, (16,), generator=g)
            linear_cross_entropy.linear_cross_entropy_fwd_triton(x, w, t)

        def emb(dt=dt):  # every shipped form of the backward in this dtype
            ids, d = torch.randint(0, 100, (64,), generator=g), r(64, 32, dtype=dt)
            for config in embedding.SHIPPED:
                embedding.embedding_bwd_triton(d, ids, 100, config=config)

        def attn(D, dt=dt):  # T = 128 takes the short-sequence configs, 1024 the others; GQA, causal and not,
            for T in (128, 1024):  # and causal with a document mask
                q, k = r(1, 4, T, D, dtype=dt), r(1, 2, T, D, dtype=dt)
                starts = (torch.arange(T) // 100 * 100)[None]
                for causal, ds in ((True, None), (False, None), (True, starts)):
                    c = attention.choose(None, dt, T, D, causal, False)  # the Triton configs (the last of each)
                    f, b = (c.fwd[-1], c.bwd[-1]) if ds is None else attention.doc_configs(dt, T, D)
                    o, lse = attention.flash_attention_fwd_triton(q, k, k, causal, config=f, doc_starts=ds)
                    attention.flash_attention_bwd_triton(q, q, k, k, o, lse, causal, config=b, doc_starts=ds)

        def decode_attn(dt=dt):  # GQA with G = 3 (seed) and G = 2, D = 128 (Qwen3)
            for H, Hkv, D in ((12, 4, 64), (16, 8, 128)):
                ck = r(2, Hkv, 40, D, dtype=dt)
                decode.decode_attention_triton(
                    r(2, H, D, dtype=dt), ck, ck, torch.tensor([1, 0]), torch.tensor([3, 40]), 0.1
                )

        def rows(dt=dt):  # the decode projections: plain, normed (an fp32 residual stream in), SwiGLU + residual
            w = r(64, 48, dtype=dt).t()
            rows_linear.rows_linear_triton(r(2, 48, dtype=dt), w)
            rows_linear.rows_linear_triton(r(2, 48), w, "norm", r(48), 1e-6)
            rows_linear.rows_linear_triton(r(2, 96, dtype=dt), w, "glu", res=r(2, 64))

        for name, fn in (
            ("decode_attention", decode_attn),
            ("rows_linear", rows),
            ("rms_norm", norm),
            ("rope", rope_),
            ("qk_norm_rope", qk_),
            ("swiglu", swiglu_),
            ("dropout", dropout_),
            ("cross_entropy", xent),
            ("linear_cross_entropy", lin_xent),
            ("embedding bwd", emb),
        ):
            out[f"{name} {tag}"] = fn
        for D in (32, 64, 128):
            out[f"flash_attention hd{D} {tag}"] = lambda D=D, dt=dt: attn(D, dt)

    def emb_plan():
        ids, d = torch.randint(0, 100, (64,), generator=g), r(64, 32)
        plan = embedding.embedding_bwd_plan_triton(ids, 100, 32, torch.float32)
        embedding.embedding_bwd_triton(d, ids, 100, plan=plan)

    def adamw_(recip_div=None):
        ps = [r(300), r(17, 5)]
        copies = [torch.empty(p.shape, dtype=torch.bfloat16) for p in ps]
        for cp in (None, copies):
            adamw.adamw_step_triton(
                ps, [r(*p.shape) for p in ps], [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps],
                step=1, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decays=[0.1, 0.0], copies=cp,
                recip_div=recip_div,
            )  # fmt: skip

    out["embedding bwd fp32, plan made before"] = emb_plan

    out["adamw fp32 (and bf16 copies)"] = adamw_
    out["adamw fp32, CUDA's division"] = lambda: adamw_(recip_div=True)

    def adamw_device():
        ps = [r(300), r(17, 5)]
        copies = [torch.empty(p.shape, dtype=torch.bfloat16) for p in ps]
        adamw.adamw_step_triton_device(
            ps, [r(*p.shape) for p in ps], [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps],
            step=torch.zeros(()), lr=torch.tensor(1e-3, dtype=torch.float64), ok=torch.tensor(True),
            grad_scale=torch.tensor(0.5), beta1=0.9, beta2=0.95, eps=1e-8, weight_decays=[0.1, 0.0], copies=copies,
            recip_div=True,
        )  # fmt: skip

    out["adamw fp32, scalars on the device (the captured step)"] = adamw_device
    return out


def gluon_cases() -> dict[str, Callable[[], list]]:
    """name -> an offline sm_90 compile of one shipped Gluon attention config (causal; GQA), returning the kernel
    names it compiled. Empty when this Triton has no Gluon."""
    from xtrain.kernels import attention
    from xtrain.kernels.attention import gluon_bwd, gluon_common, gluon_fwd, gluon_onepass

    if not gluon_common.HAVE_GLUON:
        return {}
    out: dict[str, Callable[[], list]] = {}
    shipped = attention.shipped_configs()
    for D, cfg in shipped["fwd"]:
        out[f"gluon attention fwd hd{D} {cfg}"] = lambda D=D, cfg=cfg: [gluon_fwd.compile_sm90(D, cfg).name]
    for D, cfg in shipped["bwd"]:
        out[f"gluon attention bwd hd{D} {cfg}"] = lambda D=D, cfg=cfg: [
            ck.name for ck in gluon_bwd.compile_sm90(D, cfg).values()
        ]
    for D, cfg in shipped["onepass"]:
        out[f"gluon attention onepass hd{D} {cfg}"] = lambda cfg=cfg: [gluon_onepass.compile_sm90(cfg).name]
    return out


def run(arch: int = 90, only: str | None = None, progress: bool = False) -> list[dict]:
    """Compile every case (or those whose name contains ``only``); one dict per case: name, ok, kernels (the
    names compiled, in launch order), error (the last line of the exception, or None), seconds. For sm_90 the
    cases include the shipped Gluon attention configs (``gluon_cases``)."""
    rows = []
    all_cases = cases()
    if arch == 90:
        all_cases.update(gluon_cases())
    picked = [n for n in all_cases if only is None or only in n]
    if not picked:
        raise ValueError(f"compile_check: no case matches {only!r}; cases: {sorted(all_cases)}")
    for i, name in enumerate(picked):
        t0 = time.perf_counter()
        with compile_only(arch) as names:
            try:
                names.extend(all_cases[name]() or ())  # a Gluon case returns the names it compiled itself
                err = None
            except Exception as e:  # noqa: BLE001 - reported per case, the run goes on
                tb = traceback.format_exception_only(type(e), e)
                err = " ".join(line.strip() for line in tb)[-600:]
        rows.append(
            dict(name=name, ok=err is None, kernels=list(names), error=err, seconds=round(time.perf_counter() - t0, 1))
        )
        if progress:
            print(
                f"[{i + 1}/{len(picked)}] {name}: {'ok' if err is None else 'FAILED'} "
                f"({len(names)} launches, {rows[-1]['seconds']} s)",
                file=sys.stderr,
                flush=True,
            )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m xtrain.kernels.compile_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 to compile for (default 90)")
    ap.add_argument("--only", default=None, help="only the cases whose name contains this")
    a = ap.parse_args(argv)
    try:
        import triton
    except ImportError:
        print("compile_check: needs Triton (pip install triton)", file=sys.stderr)
        return 2
    from xtrain.kernels._dispatch import HAVE_TRITON

    if not HAVE_TRITON:  # the kernel modules were defined without Triton: nothing to compile
        print("compile_check: Triton is not loaded (a CPU-only torch loads it with XTRAIN_KERNELS=triton)",
              file=sys.stderr)  # fmt: skip
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print(
            "compile_check: unset TRITON_INTERPRET first (the interpreter runs kernels, it does not compile them)",
            file=sys.stderr,
        )
        return 2
    if a.arch <= 0:
        print(
            f"compile_check: --arch must be a CUDA compute capability x 10 (90 for sm_90), got {a.arch}",
            file=sys.stderr,
        )
        return 2
    rows = run(a.arch, a.only, progress=True)
    print(f"# Triton {triton.__version__}, target cuda sm_{a.arch}, torch {torch.__version__}")
    for row in rows:
        kernels = sorted(set(row["kernels"]))
        print(
            f"{'ok    ' if row['ok'] else 'FAILED'} {row['name']:<40} {row['seconds']:>5.1f} s  "
            f"{', '.join(kernels) if row['ok'] else row['error']}"
        )
    bad = [row["name"] for row in rows if not row["ok"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} cases compiled" + (f"; failed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
