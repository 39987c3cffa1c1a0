"""``xtrain bench kernels``: every fused Triton kernel vs its plain-torch reference, against the copy ceiling.

For each kernel and size: the Triton time, the reference time (the same function's plain-torch path on
the GPU), the speed-up, and the achieved bandwidth = the bytes the op must move (each input read once,
each output written once; formulas in ``CASES`` below) / time, also as a fraction of the device-to-device
copy bandwidth measured first in the same run (bytes read + written by ``dst.copy_(src)`` on 1 GiB).
Then fused linear + cross-entropy: peak memory and time of one forward + backward against the unfused
path (logits matmul, Triton cross-entropy forward and backward, two gradient matmuls) and against the
plain-torch unfused path.
Timing: ``bench._gpu.gpu_time`` (CUDA events, warm-up, median, the L2 flushed before each call, the host
queueing every call while the GPU sleeps first), so a time is the kernels' GPU time and not the host's
launch overhead, which is printed beside it ("host us": one call's launch cost on the CPU, measured with the
GPU busy) together with ``triton.testing.do_bench``'s figure, which holds the host's time wherever the host
launches slower than the GPU runs. Random normal data, never zeros.

``--variants`` sweeps each kernel's candidate tilings instead (module-level knobs): every variant is first
run with its outputs poisoned (NaN) and checked against the float64 oracle, then timed next to the
reference; a short table (default vs fastest checked variant per kernel and size) comes last.
``--only a,b`` builds and runs only those groups (e.g. cross_entropy,rms_norm_bwd,embedding_bwd);
``--prewarm W`` first compiles every variant in W parallel processes (they share Triton's on-disk cache,
so the timing process compiles nothing); ``--smoke`` runs the variant code paths on the CPU through the
Triton interpreter at tiny fp32 sizes (a check that they run, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback

import torch

from xtrain.fileio import atomic_write_text
from xtrain.testing import poisoned


def zipf_ids(N: int, V: int, device="cuda", generator=None) -> torch.Tensor:
    """The embedding bench's ids: N draws in [0, V) with Zipf-like repeats (u³·V, u uniform: id 0 about N / V^(1/3)
    times), int64."""
    return (torch.rand(N, device=device, generator=generator) ** 3 * V).long().clamp_max(V - 1)


def _bench(fn, rep: int = 100) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")  # ms


def _gpu(fn) -> dict:
    """``bench._gpu.gpu_time``: {"ms": GPU ms per call, "host_ms": the host's ms per call, "queue_full"}."""
    from bench._gpu import gpu_time

    g = gpu_time(fn)
    if not g["queue_full"]:
        print("# warning: the host did not stay ahead of the GPU; this time may include launch overhead", flush=True)
    return g


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting read + write."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = _gpu(lambda: dst.copy_(src))["ms"]
    return 2 * src.numel() * 4 / (ms * 1e-3)


_DEV = "cuda"  # the variant sweep's smoke test runs it on the CPU (Triton interpreter) at small sizes


def _rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return (scale * torch.randn(*shape, device=_DEV)).to(dtype)


def _esize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32")


# Each case builder returns (label, bytes that must move, triton fn, reference fn).


def rms_cases():
    for N, C, dt in [
        (16384, 4096, torch.bfloat16),
        (65536, 768, torch.bfloat16),
        (8192, 8192, torch.bfloat16),
        (16384, 4096, torch.float32),
    ]:
        yield from _rms(N, C, dt)


def _rms(N, C, dt):
    from xtrain.kernels import rms_norm as K

    e = _esize(dt)
    x, dy, w = _rand(N, C, dtype=dt), _rand(N, C, dtype=dt), _rand(C, dtype=dt)
    _, r = K.rms_norm_fwd_triton(x, w, 1e-6)
    yield (
        f"rms_norm fwd {N}x{C} {_name(dt)}",
        2 * N * C * e + C * e + 4 * N,
        lambda: K.rms_norm_fwd_triton(x, w, 1e-6),
        lambda: K.rms_norm_fwd_ref(x, w, 1e-6),
    )
    yield (
        f"rms_norm bwd {N}x{C} {_name(dt)}",
        3 * N * C * e + C * e + 4 * N,
        lambda: K.rms_norm_bwd_triton(dy, x, w, r),
        lambda: K.rms_norm_bwd_ref(dy, x, w, r),
    )


def rope_cases():
    for shape, batched, dt in [
        ((4, 32, 4096, 128), False, torch.bfloat16),
        ((4, 32, 4096, 128), False, torch.float32),
        ((2, 16, 16384, 128), True, torch.bfloat16),
    ]:
        yield from _rope(shape, batched, dt)


def _rope(shape, batched, dt):
    from xtrain.kernels import rope as K

    x = _rand(*shape, dtype=dt)
    T = shape[-2]
    pos = torch.randint(0, 16384, (shape[0], T), device="cuda") if batched else torch.arange(T, device="cuda")
    nbytes = 2 * x.numel() * _esize(dt)
    lbl = f"{'x'.join(map(str, shape))} {'pos[B,T]' if batched else 'pos[T]'} {_name(dt)}"
    for table in (True, False):
        tag = "table" if table else "in-kernel"
        yield (
            f"rope fwd ({tag}) {lbl}",
            nbytes,
            lambda table=table: K.rope_fwd_triton(x, pos, 1e6, table=table),
            lambda: K.rope_fwd_ref(x, pos, 1e6),
        )
    yield (
        f"rope bwd (in-kernel) {lbl}",
        nbytes,
        lambda: K.rope_bwd_triton(x, pos, 1e6, table=False),
        lambda: K.rope_bwd_ref(x, pos, 1e6),
    )


def swiglu_cases():
    for shape, dt in [((8192, 14336), torch.bfloat16), ((4096, 14336), torch.float32)]:
        yield from _swiglu(shape, dt)


def _swiglu(shape, dt):
    from xtrain.kernels import swiglu as K

    n, e = shape[0] * shape[1], _esize(dt)
    g, u, dy = _rand(*shape, dtype=dt), _rand(*shape, dtype=dt), _rand(*shape, dtype=dt)
    lbl = f"{shape[0]}x{shape[1]} {_name(dt)}"
    yield (f"silu fwd {lbl}", 2 * n * e, lambda: K.silu_fwd_triton(g), lambda: K.silu_fwd_ref(g))
    yield (f"silu bwd {lbl}", 3 * n * e, lambda: K.silu_bwd_triton(dy, g), lambda: K.silu_bwd_ref(dy, g))
    yield (f"swiglu fwd {lbl}", 3 * n * e, lambda: K.swiglu_fwd_triton(g, u), lambda: K.swiglu_fwd_ref(g, u))
    yield (f"swiglu bwd {lbl}", 5 * n * e, lambda: K.swiglu_bwd_triton(dy, g, u), lambda: K.swiglu_bwd_ref(dy, g, u))


def dropout_cases():
    for shape, dt in [((8192, 14336), torch.bfloat16), ((4096, 14336), torch.float32)]:
        yield from _dropout(shape, dt)


def _dropout(shape, dt):
    from xtrain.kernels import dropout as K

    x = _rand(*shape, dtype=dt)
    yield (
        f"dropout fwd {shape[0]}x{shape[1]} {_name(dt)}",
        2 * x.numel() * _esize(dt),
        lambda: K.dropout_fwd_triton(x, 0.1, 1234),
        lambda: K.dropout_fwd_ref(x, 0.1, 1234),
    )


def ce_cases():
    for N, V, dt in [(8192, 32768, torch.bfloat16), (8192, 131072, torch.bfloat16), (4096, 131072, torch.float32)]:
        yield from _ce(N, V, dt)


def _ce(N, V, dt):
    from xtrain.kernels import cross_entropy as K

    e = _esize(dt)
    logits = _rand(N, V, dtype=dt, scale=3.0)
    t = torch.randint(0, V, (N,), device="cuda")
    _, lse, denom = K.cross_entropy_fwd_triton(logits, t)
    dl = torch.tensor(1.0, device="cuda")
    lbl = f"{N}x{V} {_name(dt)}"
    yield (
        f"cross_entropy fwd {lbl}",
        N * V * e + 16 * N,
        lambda: K.cross_entropy_fwd_triton(logits, t),
        lambda: K.cross_entropy_fwd_ref(logits, t),
    )
    yield (
        f"cross_entropy bwd {lbl}",
        2 * N * V * e + 12 * N,
        lambda: K.cross_entropy_bwd_triton(dl, logits, t, lse, -100, denom),
        lambda: K.cross_entropy_bwd_ref(dl, logits, t, lse, -100, denom),
    )


def adamw_cases():
    from xtrain.kernels import adamw as K

    # a 24-layer, width-1024 model: ~340M parameters in 217 tensors
    shapes = [(32000, 1024)] + 24 * ([(1024, 1024)] * 4 + [(2816, 1024)] * 3 + [(1024,)] * 2)
    n = sum(torch.Size(s).numel() for s in shapes)

    def state():
        ps = [_rand(*s, dtype=torch.float32) for s in shapes]
        gs = [_rand(*s, dtype=torch.float32) for s in shapes]
        ms = [_rand(*s, dtype=torch.float32, scale=0.1) for s in shapes]
        vs = [torch.rand(*s, device="cuda") * 0.01 for s in shapes]
        cs = [torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
        return ps, gs, ms, vs, cs

    st = state()
    kw = dict(step=10, lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decays=[0.1] * len(shapes))
    yield (
        f"adamw {n / 1e6:.0f}M params / {len(shapes)} tensors, +bf16 copies",
        30 * n,
        lambda: K.adamw_step_triton(*st[:4], copies=st[4], **kw),
        lambda: K.adamw_step_ref(*st[:4], copies=st[4], **kw),
    )


def embedding_cases():
    # fp32 at the bf16 row's shape too (session 16): a table 8x the tokens' rows, where the zero rows dominate
    for N, V, C, dt in [
        (16384, 131072, 4096, torch.bfloat16),
        (16384, 32000, 2048, torch.float32),
        (16384, 131072, 4096, torch.float32),
    ]:
        yield from _embedding(N, V, C, dt)


def _embedding(N, V, C, dt):
    from xtrain.kernels import embedding as K

    e = _esize(dt)
    ids = zipf_ids(N, V)
    d = _rand(N, C, dtype=dt)
    yield (
        f"embedding bwd N={N} V={V} C={C} {_name(dt)}",
        N * C * e + V * C * e + 8 * N,
        lambda: K.embedding_bwd_triton(d, ids, V),
        lambda: K.embedding_bwd_ref(d, ids, V),
    )
    plan = K.embedding_bwd_plan(ids, V, C, dt)
    if plan is None:  # the backward's form here takes no plan (bf16)
        return
    # session 22: what ops.embedding runs in training: the forward launches the backward's ids-only part (the slots
    # pass and lists) on a side stream beside its gather, and the backward starts at its rows grid. First the backward
    # given a plan made before; then forward + backward, the plan made in the forward, against both without a plan
    yield (
        f"embedding bwd N={N} V={V} C={C} {_name(dt)}, plan made before",
        N * C * e + V * C * e + 8 * N,
        lambda: K.embedding_bwd_triton(d, ids, V, plan),
        lambda: K.embedding_bwd_ref(d, ids, V),
    )
    table = _rand(V, C, dtype=dt)

    def planned():
        out, p = K.embedding_fwd_planned(ids, table)
        return out, K.embedding_bwd_triton(d, ids, V, p)

    yield (
        f"embedding fwd + bwd N={N} V={V} C={C} {_name(dt)}, plan made in the fwd (ref: Triton, no plan)",
        3 * N * C * e + V * C * e + 16 * N,
        planned,
        lambda: (K.embedding_fwd(ids, table), K.embedding_bwd_triton(d, ids, V)),
    )


GROUPS = {
    "rms_norm": rms_cases,
    "rope": rope_cases,
    "swiglu": swiglu_cases,
    "dropout": dropout_cases,
    "cross_entropy": ce_cases,
    "adamw": adamw_cases,
    "embedding": embedding_cases,
}


def linear_ce_rows(sizes):
    """Peak memory (beyond inputs) and time of one forward + backward: fused vs unfused."""
    rows = []
    for N, C, V in sizes:
        rows.append(_linear_ce_row(N, C, V))
        torch.cuda.empty_cache()
    return rows


def _linear_ce_row(N, C, V):
    from xtrain.kernels import cross_entropy as K_ce
    from xtrain.kernels import linear_cross_entropy as K

    x = _rand(N, C)
    w = _rand(V, C, scale=C**-0.5)
    t = torch.randint(0, V, (N,), device="cuda")
    one = torch.tensor(1.0, device="cuda")

    def fused():
        loss, dx, dw = K.linear_cross_entropy_fwd_triton(x, w, t)
        return K.linear_cross_entropy_bwd(one, dx, dw)

    def unfused(ce_fwd=K_ce.cross_entropy_fwd_triton, ce_bwd=K_ce.cross_entropy_bwd_triton):
        logits = x @ w.t()  # [N, V] bf16
        loss, lse, denom = ce_fwd(logits, t)
        dlog = ce_bwd(one, logits, t, lse, -100, denom)  # as ops.cross_entropy: not in place
        return dlog @ w, dlog.t() @ x

    def unfused_ref():
        return unfused(K_ce.cross_entropy_fwd_ref, K_ce.cross_entropy_bwd_ref)

    res = {}
    for name, fn in (("fused", fused), ("unfused", unfused), ("unfused_ref", unfused_ref)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        ms = _bench(fn, rep=400)
        res[name] = (peak, ms)
    return dict(
        N=N,
        C=C,
        V=V,
        **{f"{k}_peak_gib": v[0] / 2**30 for k, v in res.items()},
        **{f"{k}_ms": v[1] for k, v in res.items()},
        time_ratio=res["fused"][1] / res["unfused"][1],
        mem_saved_gib=(res["unfused"][0] - res["fused"][0]) / 2**30,
    )


# ------------------------------------------------------------------------------ variant sweep (--variants)
# Each kernel's tiling knobs (module-level overrides) swept at the bench's sizes: every variant is first
# checked against the float64 oracle with its outputs poisoned (NaN), then timed next to the reference.


@contextlib.contextmanager
def _knob(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


@contextlib.contextmanager
def _knobs(module, knobs: dict):
    """``_knob`` for each (name, value) of knobs."""
    with contextlib.ExitStack() as stack:
        for name, value in knobs.items():
            stack.enter_context(_knob(module, name, value))
        yield


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _tol(dt):
    return 1e-5 if dt == torch.float32 else 1e-2


def _wanted(group: str, only) -> bool:
    """--only entries match a group by substring, spaces and underscores alike ("rms_norm_bwd", "rms_norm")."""
    return not only or any(o.replace(" ", "_") in group.replace(" ", "_") for o in only)


def variant_cases(only=None, smoke=False):
    """Yields (group, label, variant, nbytes, fn, check, ref_fn); check() -> (ok, detail), run poisoned.
    Only the groups ``only`` names build their data. smoke: tiny fp32 sizes (the CPU interpreter run)."""
    f32, bf16 = torch.float32, torch.bfloat16
    if _wanted("rms_norm bwd", only):
        sizes = (
            [(37, 768, f32), (5, 4096, f32), (3, 8192, f32)]
            if smoke
            else [(16384, 4096, bf16), (65536, 768, bf16), (8192, 8192, bf16), (16384, 4096, f32)]
        )
        for N, C, dt in sizes:
            yield from _v_rms(N, C, dt)
    if _wanted("rope fwd", only) and not smoke:
        for shape, batched, dt in [
            ((4, 32, 4096, 128), False, torch.bfloat16),
            ((4, 32, 4096, 128), False, torch.float32),
            ((2, 16, 16384, 128), True, torch.bfloat16),
        ]:
            yield from _v_rope(shape, batched, dt)
    if _wanted("dropout fwd", only) and not smoke:
        for shape, dt in [((8192, 14336), torch.bfloat16), ((4096, 14336), torch.float32)]:
            yield from _v_dropout(shape, dt)
    if _wanted("cross_entropy fwd", only):
        sizes = (
            [(9, 4096, f32), (5, 1000, f32)]
            if smoke
            else [(8192, 32768, bf16), (8192, 131072, bf16), (4096, 131072, f32)]
        )
        for N, V, dt in sizes:
            yield from _v_ce(N, V, dt, smoke)
    if _wanted("adamw", only) and not smoke:
        yield from _v_adamw()
    if _wanted("embedding bwd", only):
        sizes = (
            [(100, 50, 2048, f32), (64, 1000, 300, f32)]
            if smoke
            else [(16384, 131072, 4096, bf16), (16384, 32000, 2048, f32)]
        )
        for N, V, C, dt in sizes:
            yield from _v_embedding(N, V, C, dt, smoke)


class _Lazy:
    """A float64 oracle computed on first use (compile-only workers never pay for it)."""

    def __init__(self, fn):
        self.fn, self.val = fn, None

    def __call__(self):
        if self.val is None:
            self.val = self.fn()
        return self.val


def _v_rms(N, C, dt):
    from xtrain.kernels import rms_norm as K

    e = _esize(dt)
    x, dy = _rand(N, C, dtype=dt), _rand(N, C, dtype=dt)
    w = (1 + 0.1 * torch.randn(C, device=_DEV)).to(dt)
    _, r = K.rms_norm_fwd_triton(x, w, 1e-6)

    def oracle():
        _, r64 = K.rms_norm_fwd_ref(x.double(), w.double(), 1e-6)
        return K.rms_norm_bwd_ref(dy.double(), x.double(), w.double(), r64)

    oracle = _Lazy(oracle)
    # (elements per tile, num_warps, programs per SM, prefetch: True = by hand, int = Triton num_stages), dw pass
    if C >= 2048:
        cfgs = [
            (None, "torch"),
            (None, "triton"),
            ((8192, 16, 1, 3), "triton"),
            ((8192, 16, 1, 4), "triton"),
            ((4096, 8, 2, 3), "triton"),
            ((4096, 8, 2, 4), "triton"),
        ]
        if dt == torch.float32:
            cfgs = cfgs[:3] + cfgs[4:5]
        elif C >= 8192:  # a [1, 8192] tile on 8 warps needs ~208 registers a thread (sm_90 compile): dropped
            cfgs = cfgs[:4]
    else:
        cfgs = [
            (None, "torch"),
            (None, "triton"),
            ((4096, 8, 2, 3), "triton"),
            ((4096, 8, 2, 4), "triton"),
            ((2048, 4, 4, 3), "triton"),
            ((2048, 4, 4, 4), "triton"),
            ((1024, 1, 8, 4), "triton"),
        ]
    # the dw pass's (partial rows per step, columns per program, warps); (512, 16, 4) is the default now
    cfgs += [(None, "triton", dwc) for dwc in ((32, 128, 4), (256, 32, 4))]
    # 5th field: INTERLEAVE (tiles pid, pid + P, ...; the defaults have it on)
    if C < 2048:
        cfgs += [
            ((4096, 8, 2, 4, False), "triton"),
            ((4096, 8, 2, 5), "triton"),
            ((4096, 8, 3, 4), "triton"),
            ((2048, 4, 4, 4, True), "triton"),
            ((2048, 4, 6, 4), "triton"),
            ((2048, 4, 8, 3), "triton"),
            ((2048, 2, 8, 4), "triton"),
            ((1024, 2, 12, 4), "triton"),
            ((1024, 1, 16, 4), "triton"),
            ((8192, 16, 1, 4, True), "triton"),
            ((4096, 4, 4, 4, True), "triton"),
        ]
    else:
        cfgs += [((8192, 16, 1, 3, False), "triton")]
    for cfg, dw_reduce, *extra in cfgs:

        def fn(cfg=cfg, dw_reduce=dw_reduce, dwc=(extra or [K.DW_CONFIG])[0]):
            with _knob(K, "BWD_CONFIG", cfg), _knob(K, "DW_REDUCE", dw_reduce), _knob(K, "DW_CONFIG", dwc):
                return K.rms_norm_bwd_triton(dy, x, w, r)

        def check(fn=fn):
            dx, dw = fn()
            dx64, dw64 = oracle()
            ex, ew = _rel(dx, dx64), _rel(dw, dw64)
            return ex < _tol(dt) and ew < _tol(dt) and dw.dtype == w.dtype, f"dx {ex:.1e} dw {ew:.1e}"

        if cfg is None and not extra and dw_reduce == K.DW_REDUCE:
            name = "default"  # the library's path (the summary's "default" column)
        else:
            name = (
                ("default tiling" if cfg is None else str(cfg))
                + f", dw {dw_reduce}"
                + (f" {extra[0]}" if extra else "")
            )
        yield (
            "rms_norm bwd",
            f"{N}x{C} {_name(dt)}",
            name,
            3 * N * C * e + C * e + 4 * N,
            fn,
            check,
            lambda: K.rms_norm_bwd_ref(dy, x, w, r),
        )


def _v_rope(shape, batched, dt):
    from xtrain.kernels import rope as K

    x = _rand(*shape, dtype=dt)
    T = shape[-2]
    pos = torch.randint(0, 16384, (shape[0], T), device=_DEV) if batched else torch.arange(T, device=_DEV)
    y32 = K.rope_fwd_ref(x.float(), pos, 1e6)
    lbl = f"{'x'.join(map(str, shape))} {'pos[B,T]' if batched else 'pos[T]'} {_name(dt)}"
    # session 16: smaller tiles, fewer warps and more programs per SM (the default sits at 85-88 %)
    more = [
        ((512, 4, 16, True), False),
        ((512, 2, 32, True), False),
        ((1024, 4, 24, True), False),
        ((1024, 4, 32, True), False),
        ((1024, 8, 8, True), False),
        ((2048, 8, 8, True), False),
        ((1024, 2, 32, True), False),
        ((512, 4, 32, True), False),
    ]
    for cfg, table in [
        (None, False),
        (None, True),
        ((2048, 4, 8, False), False),
        ((4096, 8, 4, True), False),
        ((1024, 4, 16, True), False),
        ((4096, 4, 8, True), False),
    ] + more:

        def fn(cfg=cfg, table=table):
            with _knob(K, "CONFIG", cfg):
                return K.rope_fwd_triton(x, pos, 1e6, table=table)

        def check(fn=fn):
            err = _rel(fn(), y32)
            return err < _tol(dt), f"{err:.1e}"

        yield (
            "rope fwd",
            lbl,
            f"{cfg}{' table' if table else ''}",
            2 * x.numel() * _esize(dt),
            fn,
            check,
            lambda: K.rope_fwd_ref(x, pos, 1e6),
        )


def _v_dropout(shape, dt):
    from xtrain.kernels import dropout as K

    x = _rand(*shape, dtype=dt)
    y0 = K.dropout_fwd_ref(x, 0.1, 1234)
    for block, warps in [(1024, 8), (512, 4), (2048, 8), (1024, 4)]:

        def fn(block=block, warps=warps):
            with _knob(K, "BLOCK", block), _knob(K, "NUM_WARPS", warps):
                return K.dropout_fwd_triton(x, 0.1, 1234)

        def check(fn=fn):
            same = torch.equal(fn(), y0)
            return same, f"equal {same}"

        yield (
            "dropout fwd",
            f"{shape[0]}x{shape[1]} {_name(dt)}",
            f"pairs {block} w{warps}",
            2 * x.numel() * _esize(dt),
            fn,
            check,
            lambda: K.dropout_fwd_ref(x, 0.1, 1234),
        )


def _v_ce(N, V, dt, smoke=False):
    from xtrain.kernels import cross_entropy as K

    e = _esize(dt)
    logits = _rand(N, V, dtype=dt, scale=3.0)
    t = torch.randint(0, V, (N,), device=_DEV)
    t[::7] = -100
    oracle = _Lazy(lambda: K.cross_entropy_fwd_ref(logits.double(), t))
    lbl = f"{N}x{V} {_name(dt)}"
    # (label, FWD_CONFIG = (BLOCK_V, num_warps, blocks per program, rows per program, stages), EPILOGUE, host read)
    vs = [
        ("default (split kernel, kernel epilogue)", None, "kernel", False),
        ("previous: torch epilogue + host read of denom", None, "torch", True),
        ("torch epilogue, no host read", None, "torch", False),
    ]
    # group g: _ce_fwd_group_kernel, per-group online log-sum-exp (no block reduction in the loop);
    # loss (BLOCK, warps): the epilogue kernel's step
    if smoke:
        vs += [
            ("group 16, whole row 256 w4", (256, 4, 0, 1, 0, 16), "kernel", False),
            ("group 16, split 2x128 w4 + combine", (128, 4, 2, 1, 0, 16), "kernel", False),
        ]
    elif dt == torch.float32:
        vs += [
            ("split 4x4096 w8 + combine, stages 3", (4096, 8, 4, 1, 3), "kernel", False),
            ("group 16, split 4x4096 w8 + combine", (4096, 8, 4, 1, 0, 16), "kernel", False),
            ("group 8, split 4x4096 w8 + combine", (4096, 8, 4, 1, 0, 8), "kernel", False),
            ("group 16, whole row 4096 w8", (4096, 8, 0, 1, 0, 16), "kernel", False),
            ("default, loss step 8192 w16", None, "kernel", False, (8192, 16)),
        ]
    else:
        vs += [
            ("split whole row 4096 w8, stages 3", (4096, 8, 0, 1, 3), "kernel", False),
            ("group 8, whole row 4096 w8", (4096, 8, 0, 1, 0, 8), "kernel", False),
            ("group 16, whole row 4096 w8", (4096, 8, 0, 1, 0, 16), "kernel", False),
            ("group 32, whole row 4096 w8", (4096, 8, 0, 1, 0, 32), "kernel", False),
            ("group 16, whole row 4096 w4", (4096, 4, 0, 1, 0, 16), "kernel", False),
            ("group 16, whole row 8192 w16", (8192, 16, 0, 1, 0, 16), "kernel", False),
            ("group 16, whole row 2048 w4", (2048, 4, 0, 1, 0, 16), "kernel", False),
            ("group 16, split 4x4096 w8 + combine", (4096, 8, 4, 1, 0, 16), "kernel", False),
            ("group 16 w8, loss step 4096 w8", (4096, 8, 0, 1, 0, 16), "kernel", False, (4096, 8)),
            ("group 16 w8, loss step 8192 w16", (4096, 8, 0, 1, 0, 16), "kernel", False, (8192, 16)),
            ("default, loss step 8192 w16", None, "kernel", False, (8192, 16)),
        ]
    for name, cfg, epi, sync, *loss_cfg in vs:

        def fn(cfg=cfg, epi=epi, sync=sync, loss_cfg=(loss_cfg or [K.LOSS_CONFIG])[0]):
            with _knob(K, "FWD_CONFIG", cfg), _knob(K, "EPILOGUE", epi), _knob(K, "LOSS_CONFIG", loss_cfg):
                out = K.cross_entropy_fwd_triton(logits, t)
            if sync:
                out[2].item()
            return out

        def check(fn=fn):
            loss, lse, denom = fn()
            loss64, lse64, denom64 = oracle()
            el, es = abs(loss.item() - loss64.item()) / loss64.item(), _rel(lse, lse64)
            dn = denom.item() == denom64.item()
            return el < 1e-5 and es < 1e-6 and dn, f"loss {el:.1e} lse {es:.1e} denom {dn}"

        yield (
            "cross_entropy fwd",
            lbl,
            name,
            N * V * e + 16 * N,
            fn,
            check,
            lambda: K.cross_entropy_fwd_ref(logits, t),
        )

    def kern_only():
        return K.cross_entropy_fwd_lse_triton(logits, t)

    def check_k():
        es = _rel(kern_only()[0], oracle()[1])
        return es < 1e-6, f"lse {es:.1e}"

    yield (
        "cross_entropy fwd",
        lbl,
        "default, kernels only (no epilogue)",
        N * V * e + 16 * N,
        kern_only,
        check_k,
        None,
    )


def _v_adamw():
    from xtrain.kernels import adamw as K

    shapes = [(32000, 1024)] + 24 * ([(1024, 1024)] * 4 + [(2816, 1024)] * 3 + [(1024,)] * 2)
    n = sum(torch.Size(sh).numel() for sh in shapes)
    st = (
        [_rand(*sh, dtype=torch.float32) for sh in shapes],
        [_rand(*sh, dtype=torch.float32) for sh in shapes],
        [_rand(*sh, dtype=torch.float32, scale=0.1) for sh in shapes],
        [torch.rand(*sh, device=_DEV) * 0.01 for sh in shapes],
        [torch.empty(sh, device=_DEV, dtype=torch.bfloat16) for sh in shapes],
    )
    kw = dict(step=10, lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decays=[0.1] * len(shapes))
    for block, warps in [(4096, 8), (8192, 8), (2048, 4), (8192, 16)]:

        def fn(block=block, warps=warps):
            with _knob(K, "BLOCK", block), _knob(K, "NUM_WARPS", warps):
                K.adamw_step_triton(*st[:4], copies=st[4], **kw)

        def check(block=block, warps=warps):
            a = [[t.clone() for t in lst] for lst in st]
            b = [[t.clone() for t in lst] for lst in st]
            with _knob(K, "BLOCK", block), _knob(K, "NUM_WARPS", warps):
                K.adamw_step_triton(*a[:4], copies=a[4], **kw)
            K.adamw_step_ref(*b[:4], copies=b[4], **kw)
            bad = sum(int(not torch.equal(p, q)) for la, lb in zip(a, b) for p, q in zip(la, lb))
            return bad == 0, f"{bad} tensors differ"

        yield (
            "adamw",
            f"{n / 1e6:.0f}M params / {len(shapes)} tensors +bf16",
            f"BLOCK {block} w{warps}",
            30 * n,
            fn,
            check,
            lambda: K.adamw_step_ref(*st[:4], copies=st[4], **kw),
        )


def _v_embedding(N, V, C, dt, smoke=False):
    from xtrain.kernels import embedding as K

    e = _esize(dt)
    ids = zipf_ids(N, V, _DEV)
    d = _rand(N, C, dtype=dt)
    oracle = _Lazy(lambda: K.embedding_bwd_ref(d.double(), ids, V))
    lbl = f"N={N} V={V} C={C} {_name(dt)}"
    bc = 1024 if e <= 2 else 512
    # CONFIG = (CHUNK, BLOCK_C, num_warps, zero fill, sort keys, index a step ahead[, chunk body])
    vs = [("default", None), ("fused zero + int32 sort + index ahead", (16, bc, 4, "fused", True, True))]
    if e > 2:
        vs.append(("absent zero + int32 sort + index ahead", (16, bc, 4, "absent", True, True)))
    # the tile chunk body: a chunk's rows gathered at once, runs summed by an in-register scan. Its column
    # block must be 16 bytes x 32 lanes x warps (in-thread scan): 1024 bf16 / 512 fp32 on 4 warps.
    # Sort keys 16: int16 where V <= 65536 (fp32 case), else int32.
    tb, tb8 = (1024, 2048) if e <= 2 else (512, 1024)
    vs += [
        (f"tile, {z}, chunk {ch}, {b} cols w{w}, keys 16", (ch, b, w, z, 16, False, "tile"))
        for z in ("fused", "absent")
        for ch, b, w in ((16, tb, 4), (8, tb, 4), (16, tb8, 8), (8, tb8, 8))
    ]
    # session 6: the sort, walks and merge on a high-priority side stream while the absent rows are zeroed
    vs += [
        ("side, walk, keys 16", (16, bc, 4, "side", 16, True)),
        ("side, tile, keys 16", (16, tb, 4, "side", 16, False, "tile")),
        ("side, tile, chunk 8, keys 16", (8, tb, 4, "side", 16, False, "tile")),
        ("side, tile, chunk 32, keys 16", (32, tb, 4, "side", 16, False, "tile")),
    ]
    if e > 2:
        vs += [
            ("tile, fused, chunk 32, 512 cols w4, keys 16", (32, 512, 4, "fused", 16, False, "tile")),
            ("walk, fused, chunk 32, keys 16", (32, bc, 4, "fused", 16, True)),
        ]
    # the same with the side stream at the default priority (does the priority matter?), and the merge pass
    # taking 4 or 16 chunks per step (a frequent id spans dozens of chunks). A third element: module knobs of
    # the embedding module set for the variant (the rest keep their defaults).
    walk = (16, bc, 4, "side", 16, True)
    vs += [
        ("side, walk, keys 16, equal priority", walk, {"SIDE_HIGH_PRIORITY": False}),
        ("side, walk, keys 16, merge 4", walk, {"MERGE_BLOCK": 4}),
        ("side, walk, keys 16, merge 16", walk, {"MERGE_BLOCK": 16}),
    ]
    # session 7: the rows kernel (every row seen at most K times, zeros included) beside the chain for the
    # frequent ids; ROWS = (K, BLOCK_R, BLOCK_C, num_warps[, programs per SM]) of the rows kernel
    rb = (2048, 1024) if e <= 2 else (1024, 512)
    rows = (16, bc, 4, "rows", 16, True)
    vs += [
        (f"rows K{k} {br}x{bcol} w{w}, walk chain", rows, {"ROWS": (k, br, bcol, w)})
        for k in (2, 4)
        for br, bcol, w in ((2, rb[0], 8), (4, rb[1], 4), (8, rb[1], 8))
    ]
    # the slots pass with fewer tokens per program (more programs to spread the atomics); the rows kernel
    # persistent (2-6 programs per SM) measured 0.155-0.239 ms fp32 in session 7 and is not swept again
    vs += [
        (f"rows K4 8x{rb[1]} w8, slots block {sb}", rows, {"ROWS": (4, 8, rb[1], 8), "SLOTS_BLOCK": sb})
        for sb in (128, 256)
    ]
    vs += [("rows K4 4x512 w4 persistent 3/SM", rows, {"ROWS": (4, 4, rb[1], 4, 3)})]
    # session 12: whole-row tiles (bench/embedding_rows_probe.py: the rows kernel alone, fp32 K = 4, 1x2048 w4
    # 0.099 ms and 2x2048 w8 0.099 against 8x512 w8 0.109)
    vs += [
        (f"rows K{k} whole rows {br}x{C} w{w}", rows, {"ROWS": (k, br, C, w)})
        for k in (2, 4)
        for br, w in ((1, 4), (2, 8), (1, 8), (2, 4), (4, 8), (1, 16), (2, 16), (4, 16), (8, 16))
    ]
    # session 12: with whole-row tiles the chain is the longer branch, its merge a serial walk over a frequent id's
    # chunks: the merge MERGE_BLOCK chunks per step, and the walks' tile body, with the default rows tiling
    for mb in (1, 4, 16):
        vs += [
            (
                f"rows (default ROWS), merge {mb}, chain {ch} {body}",
                (ch, tb if body == "tile" else bc, 4, "rows", 16, body == "walk", body),
                {"MERGE_BLOCK": mb},
            )
            for ch, body in ((16, "walk"), (16, "tile"), (32, "tile"), (8, "tile"))
        ]
    # the rows kernel: zero-only tiles skip the slots and gathers; the gathers with an evict-first L2 policy
    vs += [
        (
            f"rows K4 {br}x{bcol} w{w}, {'zero fast path' if z else ''}{' evict_first' if ev else ''}",
            rows,
            {"ROWS": (4, br, bcol, w), "ROWS_ZERO_FAST": z, "ROWS_EVICT": ev},
        )
        for br, bcol, w in ((1, rb[0], 4), (1, rb[1], 4), (2, rb[1], 4), (8, rb[1], 8))
        for z, ev in ((True, ""), (False, "evict_first"), (True, "evict_first"))
    ]
    # session 8: the rows form's chain with other chunk sizes and the tile body (fewer, longer chain programs)
    vs += [
        (
            f"rows K4 {rb[1]} cols, chain chunk {ch}{' tile' if t else ' walk'}",
            (ch, tb if t else bc, 4, "rows", 16, not t) + (("tile",) if t else ()),
            {"ROWS": (4, 8, rb[1], 8)},
        )
        for ch in (8, 32, 64)
        for t in (False, True)
    ]
    # the merge kernel launched as the walks' programmatic dependent (PDL, the default) or not
    vs += [
        ("side, walk, keys 16, no PDL", walk, {"PDL": False}),
        ("rows (default ROWS), walk, keys 16, no PDL", rows, {"PDL": False}),
    ]
    # session 16: the rows grid's launch as the slots pass's programmatic dependent, and issued before the chain
    # (both the default since)
    vs += [
        (f"rows (default ROWS), launch {lbl_}", rows, knobs_)
        for lbl_, knobs_ in (
            ("as before", {"ROWS_PDL": False, "ROWS_MAIN_FIRST": False}),
            ("pdl", {"ROWS_PDL": True, "ROWS_MAIN_FIRST": False}),
            ("main first", {"ROWS_PDL": False, "ROWS_MAIN_FIRST": True}),
            ("pdl + main first", {"ROWS_PDL": True, "ROWS_MAIN_FIRST": True}),
        )
    ]
    # session 18: the "tiers" form (TIERS = (K2, MT, BLOCK_C, warps, per SM of tier A, HT, BLOCK_C, warps, per SM of
    # tier B, SCAN); the default first)
    tiers = (16, bc, 4, "tiers", 16, True)
    vs += [
        (f"tiers {t}", tiers, {"TIERS": t})
        for t in (
            None,
            (64, 16, 1024, 8, 1, 128, 32, 4, 1, 4096),
            (32, 8, 2048, 4, 1, 256, 64, 4, 1, 4096),
            (128, 8, 2048, 4, 1, 256, 64, 4, 1, 4096),
            (64, 8, 2048, 4, 2, 256, 64, 4, 1, 4096),
            (64, 8, 2048, 4, 1, 128, 32, 4, 2, 4096),
        )
    ]
    for name, cfg, *extra in vs:

        def fn(knobs=tuple({"CONFIG": cfg, **(extra[0] if extra else {})}.items())):
            with _knobs(K, dict(knobs)):
                return K.embedding_bwd_triton(d, ids, V)

        def check(fn=fn):
            a = fn()
            err, det = _rel(a, oracle()), torch.equal(a, fn())
            return err < _tol(dt) and det, f"{err:.1e} deterministic {det}"

        yield (
            "embedding bwd",
            lbl,
            f"{name} {cfg}" if cfg else name,
            N * C * e + V * C * e + 8 * N,
            fn,
            check,
            lambda: K.embedding_bwd_ref(d, ids, V),
        )
    # the stages on their own (not the op: no check, not ranked)
    flat = ids.reshape(-1)
    ids32 = flat.to(torch.int32)
    ok = lambda: (True, "-")  # noqa: E731
    yield (
        "embedding bwd",
        lbl,
        "stage alone: torch.zeros(V, C)",
        V * C * e,
        lambda: torch.zeros(V, C, dtype=dt, device=_DEV),
        ok,
        None,
    )
    # write-only bandwidth: what bounds a kernel that must write the whole [V, C] gradient
    buf = torch.empty(V, C, dtype=dt, device=_DEV)
    yield ("embedding bwd", lbl, "stage alone: buf.zero_() (no allocation)", V * C * e, buf.zero_, ok, None)
    for blk, warps in ((4096, 4), (8192, 8), (16384, 8), (32768, 16)):
        yield (
            "embedding bwd",
            lbl,
            f"stage alone: Triton zero store {blk} w{warps}",
            V * C * e,
            lambda blk=blk, warps=warps: _zero_store(buf, blk, warps),
            ok,
            None,
        )
    ms = _memset_fn(buf) if buf.is_cuda else None
    if ms is not None:
        yield ("embedding bwd", lbl, "stage alone: cudaMemsetAsync", V * C * e, ms, ok, None)
    srt, order = torch.sort(ids32, stable=True)
    n_chunks = (N + 15) // 16
    part = torch.empty(n_chunks, 2, C, dtype=torch.float32, device=_DEV)

    def chunk_merge():
        bcc = min(bc, 1 << (C - 1).bit_length())
        grid = (n_chunks, (C + bcc - 1) // bcc)
        K._embedding_bwd_chunk_kernel[grid](
            d, order, srt, buf, part, N, V, C, CHUNK=16, BLOCK_C=bcc, IDX_AHEAD=e > 2, num_warps=4
        )
        K._embedding_bwd_merge_kernel[grid](srt, part, buf, N, V, C, n_chunks, CHUNK=16, BLOCK_C=bcc, num_warps=4)

    yield ("embedding bwd", lbl, "stage alone: chunk + merge kernels (ids sorted)", N * C * e, chunk_merge, ok, None)

    def tile_merge(ch=16):
        grid = (n_tc, (C + tb - 1) // tb)
        K._embedding_bwd_chunk_kernel[grid](
            d, order, srt, buf, part, N, V, C, CHUNK=ch, BLOCK_C=tb, TILE=True, num_warps=4
        )
        K._embedding_bwd_merge_kernel[grid](srt, part, buf, N, V, C, n_tc, CHUNK=ch, BLOCK_C=tb, num_warps=4)

    n_tc = (N + 15) // 16
    yield (
        "embedding bwd",
        lbl,
        f"stage alone: tile chunk + merge kernels (ids sorted), {tb} cols w4",
        N * C * e,
        tile_merge,
        ok,
        None,
    )
    if V <= 2**16:
        keys16 = (flat - 2**15).to(torch.int16)
        yield (
            "embedding bwd",
            lbl,
            "stage alone: torch.sort int16 keys (no cast)",
            10 * N,
            lambda: torch.sort(keys16, stable=True),
            ok,
            None,
        )
    yield (
        "embedding bwd",
        lbl,
        "stage alone: torch.sort int64 ids",
        16 * N,
        lambda: torch.sort(flat, stable=True),
        ok,
        None,
    )
    yield (
        "embedding bwd",
        lbl,
        "stage alone: torch.sort int32 ids (+ the cast)",
        12 * N,
        lambda: torch.sort(flat.to(torch.int32), stable=True),
        ok,
        None,
    )

    # the rows form's parts: the slots pass (counts zeroed + atomics), the rows kernel alone on its result
    def slots_pass(k=4):
        counts = torch.zeros(V, dtype=torch.int32, device=_DEV)
        slots = torch.empty(k, V, dtype=torch.int32, device=_DEV)
        K._embedding_slots_kernel[((N + 1023) // 1024,)](flat, counts, slots, N, V, K=k, BLOCK=1024, num_warps=4)
        return counts, slots

    yield ("embedding bwd", lbl, "stage alone: rows form's slots pass (K4)", 8 * N + 4 * V, slots_pass, ok, None)
    for k in (2, 4):
        cs = slots_pass(k)
        for br, bcol, w in ((4, rb[0], 8), (4, rb[1], 4)):

            def rows_alone(cs=cs, k=k, br=br, bcol=bcol, w=w):
                n_rb, n_cb = (V + br - 1) // br, (C + bcol - 1) // bcol
                K._embedding_bwd_rows_kernel[(n_rb, n_cb)](
                    d, cs[0], cs[1], buf, V, C, n_cb, n_rb * n_cb, K=k, BLOCK_R=br, BLOCK_C=bcol, num_warps=w
                )

            light = int(cs[0][(cs[0] <= k)].sum())
            yield (
                "embedding bwd",
                lbl,
                f"stage alone: rows kernel K{k} {br}x{bcol} w{w} (its bytes)",
                V * C * e + light * C * e,
                rows_alone,
                ok,
                None,
            )

    def present():
        p = torch.zeros(V, dtype=torch.int8, device=_DEV)
        p[ids32] = 1
        return p

    yield ("embedding bwd", lbl, "stage alone: present marks (zeros + index_put)", V + N * 4, present, ok, None)


def _zero_store(buf, block, warps):
    """A plain store-only Triton kernel over buf (the write-bandwidth probe; reference: buf.zero_())."""
    from xtrain.kernels._dispatch import tl, triton

    global _ZERO_KERNEL
    if _ZERO_KERNEL is None:

        @triton.jit
        def _zero_kernel(P, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            tl.store(P + offs, tl.zeros([BLOCK], dtype=P.dtype.element_ty), mask=offs < n)

        _ZERO_KERNEL = _zero_kernel
    n = buf.numel()
    _ZERO_KERNEL[(triton.cdiv(n, block),)](buf, n, BLOCK=block, num_warps=warps)
    return buf


_ZERO_KERNEL = None


def _memset_fn(buf):
    """cudaMemsetAsync on the current stream through ctypes, or None where libcudart cannot be found."""
    import ctypes
    import glob

    cands = ["libcudart.so"] + sorted(
        glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcudart.so*"))
    )
    for name in cands:
        try:
            lib = ctypes.CDLL(name)
            fn = lib.cudaMemsetAsync
        except OSError:
            continue
        except AttributeError:
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]
        nbytes = buf.numel() * buf.element_size()
        return lambda: fn(buf.data_ptr(), 0, nbytes, torch.cuda.current_stream().cuda_stream)
    return None


def _time(fn, smoke: bool) -> float:
    if not smoke:
        return _gpu(fn)["ms"]
    t0 = time.perf_counter()  # the CPU smoke run: one call through the interpreter, not a measurement
    fn()
    return (time.perf_counter() - t0) * 1e3


def _matches(variant: str, match) -> bool:
    """--match: the variant's name holds one of these substrings (None: every variant)."""
    return match is None or any(m in variant for m in match)


def run_variants(bw: float, only=None, log=None, smoke: bool = False, match=None) -> list:
    rows = []
    ref_ms_cache = {}
    gen = variant_cases(only, smoke)
    while True:
        try:
            group, label, variant, nbytes, fn, check, ref_fn = next(gen)
        except StopIteration:
            break
        except Exception:
            traceback.print_exc()
            break
        if not _wanted(group, only) or not _matches(variant, match):
            continue
        row = dict(group=group, size=label, variant=variant)
        try:
            with poisoned():
                ok, detail = check()
            t_ms = _time(fn, smoke)
            if ref_fn is None:
                r_ms = float("nan")
            elif (group, label) in ref_ms_cache:
                r_ms = ref_ms_cache[(group, label)]
            else:
                r_ms = ref_ms_cache[(group, label)] = _time(ref_fn, smoke)
            row.update(
                ok=bool(ok),
                detail=detail,
                ms=t_ms,
                ref_ms=r_ms,
                of_copy=nbytes / (t_ms * 1e-3) / bw,
                speedup=r_ms / t_ms,
            )
        except Exception as exc:
            row.update(
                ok=False,
                detail=f"{type(exc).__name__}: {exc}"[:300],
                ms=float("nan"),
                ref_ms=float("nan"),
                of_copy=float("nan"),
                speedup=float("nan"),
            )
        rows.append(row)
        line = (
            f"{group:18s} {label:34s} {variant:44s} {'ok ' if row['ok'] else 'BAD'} {row['ms']:8.3f} ms "
            f"{row['of_copy']:5.0%}  x{row['speedup']:5.1f}  {row['detail']}"
        )
        print(line, flush=True)
        if log is not None:
            log.write(line + "\n")
            log.flush()
        if not smoke:
            torch.cuda.empty_cache()
    return rows


def compile_worker(only, rank: int, world: int, smoke: bool = False, match=None) -> int:
    """--prewarm's worker: run variant k (k % world == rank) once, unchecked and untimed, so Triton compiles
    it into the shared on-disk cache; the timing process then finds every kernel already compiled."""
    n = failed = 0
    for k, (group, _label, variant, _nbytes, fn, _check, _ref) in enumerate(variant_cases(only, smoke)):
        if k % world != rank or not _wanted(group, only) or not _matches(variant, match):
            continue
        try:
            fn()
            n += 1
        except Exception:  # the timing process reports it, with its check
            failed += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(f"# compile worker {rank}/{world}: {n} variants run, {failed} raised", flush=True)
    return 0


def prewarm(argv_only, world: int, argv_match=None) -> None:
    t0 = time.perf_counter()
    cmd = [sys.executable, __file__, "--variants"] + (["--only", *argv_only] if argv_only else [])
    cmd += ["--match", *argv_match] if argv_match else []
    procs = [subprocess.Popen(cmd + ["--compile-worker", f"{r}/{world}"]) for r in range(world)]
    codes = [p.wait() for p in procs]
    print(f"# prewarm: {world} compile workers, {time.perf_counter() - t0:.1f} s, exit codes {codes}", flush=True)


def _summary(vrows) -> None:
    """The short table: per kernel and size, the current default and the fastest checked variant."""

    def is_default(v):
        return v in ("None", "pairs 1024 w8", "BLOCK 4096 w8") or (
            v.startswith("default") and "only" not in v and not v.startswith("default tiling")
        )

    def ranked(v):
        return "alone" not in v and "kernels only" not in v and not v.startswith("previous")

    keys = list(dict.fromkeys((r["group"], r["size"]) for r in vrows))
    print("\n| kernel, size | default ms | default of copy | best variant | best ms | best of copy | best vs ref |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for k in keys:
        rs = [r for r in vrows if (r["group"], r["size"]) == k]
        d = next((r for r in rs if is_default(r["variant"])), None)
        ok = [r for r in rs if r["ok"] and r["ms"] == r["ms"] and ranked(r["variant"])]
        b = min(ok, key=lambda r: r["ms"]) if ok else None
        dm = f"{d['ms']:.3f} | {d['of_copy']:.0%}" if d else "- | -"
        bm = f"{b['variant']} | {b['ms']:.3f} | {b['of_copy']:.0%} | {b['speedup']:.1f}x" if b else "- | - | - | -"
        print(f"| {k[0]} {k[1]} | {dm} | {bm} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="xtrain bench kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help=f"run these groups only ({', '.join(sorted(GROUPS))}, linear_ce)")
    ap.add_argument("--json", help="write every row to this JSON file")
    ap.add_argument(
        "--variants",
        action="store_true",
        help="sweep each kernel's tiling variants instead (checked, then timed; --only filters groups)",
    )
    ap.add_argument("--log", help="with --variants: also write the lines to this file")
    ap.add_argument(
        "--match",
        nargs="*",
        help="with --variants: only the variants whose name holds one of these "
        "substrings (comma-separated or repeated)",
    )
    ap.add_argument(
        "--prewarm",
        type=int,
        default=0,
        metavar="W",
        help="with --variants: first compile every variant in W parallel processes (shared Triton cache)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="with --variants: tiny fp32 sizes on the CPU through the Triton interpreter (checks only; "
        "the times are not measurements)",
    )
    ap.add_argument("--compile-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    only = [x for o in (args.only or []) for x in o.split(",") if x] or None
    match = [x for o in (args.match or []) for x in o.split(",") if x] or None
    if args.smoke:
        global _DEV
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("xtrain bench kernels --smoke: set TRITON_INTERPRET=1 before triton is imported", file=sys.stderr)
            return 1
        os.environ["TRITON_INTERPRET"] = "1"
        _DEV = "cpu"
        vrows = run_variants(float("nan"), only, smoke=True, match=match)
        _summary(vrows)
        bad = [r for r in vrows if not r["ok"]]
        print(
            f"# smoke: {len(vrows)} variants, {len(bad)} failed their check, {time.perf_counter() - t_start:.0f} s"
            + "".join(f"\n#  BAD {r['group']} {r['size']} {r['variant']}: {r['detail']}" for r in bad)
        )
        return 1 if bad else 0
    if not torch.cuda.is_available():
        print("xtrain bench kernels: needs a CUDA GPU", file=sys.stderr)
        return 1
    if args.compile_worker:
        rank, world = map(int, args.compile_worker.split("/"))
        return compile_worker(only, rank, world, match=match)
    import triton

    dev = torch.cuda.get_device_name()
    print(f"# {dev}, torch {torch.__version__}, triton {triton.__version__}")
    if args.variants and args.prewarm > 0:
        prewarm(args.only, args.prewarm, args.match)
    from bench._gpu import warm_up

    warm_up()  # cold clocks read the first rows slow (bench/_gpu.py)
    bw = copy_bandwidth()
    print(f"# copy bandwidth (read + write): {bw / 1e12:.2f} TB/s")
    if args.variants:
        with open(args.log, "w") if args.log else contextlib.nullcontext() as log:
            vrows = run_variants(bw, only, log, match=match)
        if args.json:
            atomic_write_text(
                args.json,
                json.dumps(
                    dict(
                        device=dev,
                        torch=torch.__version__,
                        triton=triton.__version__,
                        copy_tbps=bw / 1e12,
                        variants=vrows,
                    ),
                    indent=1,
                ),
            )
        _summary(vrows)
        bad = [r for r in vrows if not r["ok"]]
        print(
            f"# {len(vrows)} variants, {len(bad)} failed their check, {time.perf_counter() - t_start:.0f} s"
            + "".join(f"\n#  BAD {r['group']} {r['size']} {r['variant']}: {r['detail']}" for r in bad)
        )
        return 0
    rows = []
    for gname, builder in GROUPS.items():
        if only and gname not in only:
            continue
        try:
            for label, nbytes, f_tri, f_ref in builder():
                g = _gpu(f_tri)
                t_ms, db_ms = g["ms"], _bench(f_tri)
                r_ms = _gpu(f_ref)["ms"]
                rows.append(
                    dict(
                        kernel=label,
                        triton_ms=t_ms,
                        ref_ms=r_ms,
                        speedup=r_ms / t_ms,
                        tbps=nbytes / (t_ms * 1e-3) / 1e12,
                        of_copy=nbytes / (t_ms * 1e-3) / bw,
                        host_us=g["host_ms"] * 1e3,
                        do_bench_ms=db_ms,
                        do_bench_of_copy=nbytes / (db_ms * 1e-3) / bw,
                    )
                )
                r = rows[-1]
                print(
                    f"{label:58s} {t_ms:8.3f} ms  {r['tbps']:5.2f} TB/s  {r['of_copy']:5.0%}  "
                    f"host {r['host_us']:6.1f} us  do_bench {db_ms:8.3f} ms {r['do_bench_of_copy']:5.0%}  "
                    f"ref {r_ms:8.3f} ms  x{r['speedup']:.1f}",
                    flush=True,
                )
        except Exception:  # keep the table going; the traceback says what broke
            traceback.print_exc()
        torch.cuda.empty_cache()
    lce = []
    if not only or "linear_ce" in only:
        try:
            lce = linear_ce_rows([(8192, 4096, 32768), (8192, 4096, 131072)])
        except Exception:
            traceback.print_exc()
    if args.json:
        atomic_write_text(
            args.json,
            json.dumps(
                dict(
                    device=dev,
                    torch=torch.__version__,
                    triton=triton.__version__,
                    copy_tbps=bw / 1e12,
                    kernels=rows,
                    linear_cross_entropy=lce,
                ),
                indent=1,
            ),
        )
    print(
        f"\n## Fused kernels: {dev}, torch {torch.__version__}, triton {triton.__version__}, "
        f"copy {bw / 1e12:.2f} TB/s\n"
    )
    print("| kernel | Triton ms | TB/s | of copy | host us/call | do_bench ms (of copy) | reference ms | speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['kernel']} | {r['triton_ms']:.3f} | {r['tbps']:.2f} | {r['of_copy']:.0%} | {r['host_us']:.0f} "
            f"| {r['do_bench_ms']:.3f} ({r['do_bench_of_copy']:.0%}) | {r['ref_ms']:.3f} | {r['speedup']:.1f}x |"
        )
    if lce:
        print(
            "\n| linear+CE (bf16) N x C x V | fused peak GiB | unfused peak GiB | torch-ref peak GiB | fused ms "
            "| unfused ms | torch-ref ms | fused/unfused time |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in lce:
            print(
                f"| {r['N']}x{r['C']}x{r['V']} | {r['fused_peak_gib']:.2f} | {r['unfused_peak_gib']:.2f} | "
                f"{r['unfused_ref_peak_gib']:.2f} | {r['fused_ms']:.2f} | {r['unfused_ms']:.2f} | "
                f"{r['unfused_ref_ms']:.2f} | {r['time_ratio']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
