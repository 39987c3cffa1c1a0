"""Attention kernels: the references, the portable Triton flash kernels, the Hopper Gluon kernels, and the one
place that chooses between them.

    flash_attention_fwd(q [B,H,T,D], k [B,Hkv,T,D], v, causal=True, scale=None, doc_starts=None) -> (o, lse [B,H,T])
    flash_attention_bwd(do, q, k, v, o, lse, causal=True, scale=None, doc_starts=None) -> (dq, dk, dv)
    attention_fwd / attention_bwd: the composed ("math") attention of ``ops.math_attention`` (reference.py)

``doc_starts`` (int64 [B, T], packed documents: query t sees key s iff doc_starts[b, t] <= s <= t) runs the
Triton kernels on CUDA (their config from ``choose``; they skip key blocks outside each query block's documents,
triton.py "Document masks") and the tiled reference elsewhere. The Hopper Gluon kernels take no document mask:
a masked call whose unmasked twin would run a Gluon kernel runs the Triton kernel instead, the one documented
fallback. ``doc_mask_fallbacks()`` counts those calls, forward and backward apart (under a captured CUDA graph,
Python runs once per capture, so replays do not count).

Modules, imported one way: reference (the oracles) <- triton <- gluon_common <- gluon_fwd, gluon_bwd,
gluon_onepass <- this file. Off CUDA (or with the reference backend, or fp64) the entry points run the tiled
references. On CUDA, ``choose(capability, dtype, T, D, causal, deterministic)`` returns the kernels to try in
order, each with its frozen config; the first whose input predicate holds (layout, alignment, GPU) runs, and
the Triton kernel, last in every list, takes anything:
  forward   causal 16-bit on sm_90, D in (64, 128), T >= 1024: the Gluon forward (hd128: ping-pong, one Q
            buffer up to T = 1024 and two above; hd64: two Q buffers up to 2048, three warpgroups above)
  backward  causal 16-bit on sm_90: hd64 from T = 1024 the one-pass Gluon kernel (not bit-identical run to
            run, so never under torch.use_deterministic_algorithms(True)); hd128 from T = 1024, and hd64 from
            4096 in deterministic mode, the two-kernel Gluon backward (lse through the tensor cores for bf16)
  otherwise the Triton kernels, tiles by (D, fp32 or 16-bit) and, for the hd128 16-bit forward, T <= 4096.
Calls that take a Gluon path with default buffers keep a launch plan keyed by everything that picks the kernel:
the calling thread's kernel backend, the input signature (shapes, strides, dtypes, device: the capability and
the shape inputs of ``choose``), the scale, causality and the deterministic mode. Later calls allocate the
outputs and launch the compiled kernels directly, which halves the host time per call; a call under the
reference backend never looks a plan up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xtrain.kernels._dispatch import PlanCache, capability, get_backend, use_triton
from xtrain.kernels.attention import gluon_bwd, gluon_fwd, gluon_onepass
from xtrain.kernels.attention.gluon_bwd import GluonBwdConfig
from xtrain.kernels.attention.gluon_common import HAVE_GLUON, supported_bwd
from xtrain.kernels.attention.gluon_fwd import GluonFwdConfig
from xtrain.kernels.attention.gluon_onepass import OnepassConfig
from xtrain.kernels.attention.reference import (
    _check_bwd,
    _check_qkv,
    _scale,
    attention_bwd,
    attention_fwd,
    check_doc_starts,
    flash_attention_bwd_ref,
    flash_attention_fwd_ref,
)
from xtrain.kernels.attention.triton import (
    Tiles,
    TritonBwdConfig,
    TritonFwdConfig,
    _check_triton,
    _rows,
    flash_attention_bwd_triton,
    flash_attention_fwd_triton,
)

__all__ = [
    "Choice",
    "GluonBwdConfig",
    "GluonFwdConfig",
    "OnepassConfig",
    "Tiles",
    "TritonBwdConfig",
    "TritonFwdConfig",
    "attention_bwd",
    "attention_fwd",
    "bwd_route",
    "check_doc_starts",
    "doc_configs",
    "doc_mask_fallbacks",
    "choose",
    "flash_attention_bwd",
    "flash_attention_bwd_ref",
    "flash_attention_fwd",
    "flash_attention_fwd_ref",
    "shipped_configs",
]

# Triton tiles by (D, "fp32" | "16bit"), from a sweep on an H200 (xtrain bench attention --sweep).
# fwd: one Tiles; bwd: (dK/dV kernel, dQ kernel).
_TRITON_FWD = {
    (32, "16bit"): Tiles(128, 64, 4, 3),
    (64, "16bit"): Tiles(128, 64, 4, 3),
    (128, "16bit"): Tiles(128, 128, 8, 3),
    (32, "fp32"): Tiles(64, 32, 4, 2),
    (64, "fp32"): Tiles(64, 32, 4, 2),
    (128, "fp32"): Tiles(32, 32, 4, 2),
}
# hd128 16-bit at T <= 4096: half-height query tiles (twice the programs) and TMA loads
_TRITON_FWD_SHORT = {(128, "16bit"): (4096, Tiles(64, 64, 4, 3, True))}
_TRITON_BWD = {
    (32, "16bit"): (Tiles(64, 64, 4, 3), Tiles(128, 64, 8, 3, True)),
    (64, "16bit"): (Tiles(64, 64, 4, 3), Tiles(128, 64, 8, 3, True)),
    (128, "16bit"): (Tiles(64, 64, 4, 2, True), Tiles(64, 64, 4, 2, True)),
    (32, "fp32"): (Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2)),
    (64, "fp32"): (Tiles(32, 64, 4, 2), Tiles(64, 32, 4, 2)),
    (128, "fp32"): (Tiles(16, 32, 4, 2), Tiles(32, 16, 4, 2)),
}
# document-masked 16-bit calls: fewer rows per query tile (the masked bands shrink with the documents), from
# dev/doc_tiles.py on an H100 at T = 8192, mean documents 256 and 1024 (forward 0.20 vs 0.27 ms hd64, 0.16 vs
# 0.24 ms hd128; hd64 backward 0.57 vs 0.63 ms; the hd128 backward kept: nothing tried beat it)
_TRITON_DOC_FWD = {64: Tiles(64, 64, 4, 3), 128: Tiles(64, 64, 4, 3, True)}
_TRITON_DOC_BWD = {64: (Tiles(32, 64, 4, 3), Tiles(64, 64, 4, 3))}
GLUON_FWD_MIN_T = 1024  # the Gluon forward from this T (both head dims); below it was not measured faster
ONEPASS_MIN_T = 1024  # hd64 backward, not deterministic
GLUON_BWD_MIN_T = {64: 4096, 128: 1024}  # the split backward (hd64: deterministic mode only)


@dataclass(frozen=True)
class Choice:
    """The kernels to try, in order, each with its config: the first whose input predicate holds runs."""

    fwd: tuple
    bwd: tuple


def choose(cap: tuple | None, dtype: torch.dtype, T: int, D: int, causal: bool, deterministic: bool) -> Choice:
    """The one function that picks the attention kernels and their configs, from the device's compute capability
    (None off CUDA), the dtype, the shape (T, D), causality and ``torch.use_deterministic_algorithms`` mode."""
    key = (D, "fp32" if dtype == torch.float32 else "16bit")
    if key not in _TRITON_FWD or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return Choice((), ())  # the tiled reference only
    short = _TRITON_FWD_SHORT.get(key)
    fwd: list = [TritonFwdConfig(short[1] if short is not None and T <= short[0] else _TRITON_FWD[key])]
    bwd: list = [TritonBwdConfig(*_TRITON_BWD[key])]
    if not (HAVE_GLUON and cap == (9, 0) and causal and dtype in (torch.bfloat16, torch.float16)):
        return Choice(tuple(fwd), tuple(bwd))
    if T >= GLUON_FWD_MIN_T and D == 128:
        short_t = T <= 1024
        fwd.insert(0, GluonFwdConfig(1 if short_t else 2, True, 2, 2, short_t))
    elif T >= GLUON_FWD_MIN_T and D == 64:
        short_t = T <= 2048
        fwd.insert(0, GluonFwdConfig(2, False, 2 if short_t else 3, 3, short_t))
    if T >= GLUON_BWD_MIN_T.get(D, T + 1):
        bwd.insert(0, GluonBwdConfig(lse_mma=D == 128 and dtype == torch.bfloat16, doreg=D == 128))
    if D == 64 and T >= ONEPASS_MIN_T and not deterministic:
        bwd.insert(0, OnepassConfig())
    return Choice(tuple(fwd), tuple(bwd))


def doc_configs(dtype: torch.dtype, T: int, D: int) -> tuple:
    """(TritonFwdConfig, TritonBwdConfig) for a document-masked call: the tiles measured with the mask for 16-bit
    D = 64/128, else the Triton configs ``choose`` gives. Needs a (D, dtype) the Triton kernels take."""
    c = choose(None, dtype, T, D, True, False)
    fwd, bwd = c.fwd[-1], c.bwd[-1]
    if dtype in (torch.bfloat16, torch.float16):
        if D in _TRITON_DOC_FWD:
            fwd = TritonFwdConfig(_TRITON_DOC_FWD[D])
        if D in _TRITON_DOC_BWD:
            bwd = TritonBwdConfig(*_TRITON_DOC_BWD[D])
    return fwd, bwd


def shipped_configs() -> dict:
    """Every distinct Gluon config ``choose`` can return on sm_90, by kernel family (the offline compile check
    and the tests run these): {"fwd": {(D, config), ...}, "bwd": ..., "onepass": ...}."""
    out: dict = {"fwd": set(), "bwd": set(), "onepass": set()}
    for D in (64, 128):
        for dtype in (torch.bfloat16, torch.float16):
            for T in (1024, 2048, 4096, 16384):
                for det in (False, True):
                    c = choose((9, 0), dtype, T, D, True, det)
                    for cfg in c.fwd + c.bwd:
                        name = {GluonFwdConfig: "fwd", GluonBwdConfig: "bwd", OnepassConfig: "onepass"}.get(type(cfg))
                        if name:
                            out[name].add((D, cfg))
    return {k: sorted(v, key=repr) for k, v in out.items()}


def _choice(q: torch.Tensor, causal: bool) -> Choice:
    cap = capability(q.device) if q.is_cuda else None
    return choose(cap, q.dtype, q.shape[2], q.shape[3], bool(causal), torch.are_deterministic_algorithms_enabled())


# ---------------------------------------------------------------------------------------------------------
# launch plans of the Gluon paths, by input signature
# ---------------------------------------------------------------------------------------------------------
_FWD_PLANS = PlanCache()
_BWD_PLANS = PlanCache()


def plan_signature(kind: str, ts, scale, causal: bool) -> tuple:
    """Everything that picks the kernel a call runs, and so a cached plan's validity: the calling thread's kernel
    backend, each tensor's shape, strides, dtype and device (the device gives the capability), the scale,
    causality and the deterministic mode (the inputs of ``choose``)."""
    det = torch.are_deterministic_algorithms_enabled()
    sig = tuple((t.shape, t.stride(), t.dtype, t.device) for t in ts)
    return (kind, get_backend(), scale, bool(causal), det) + sig


def _plan_key(kind: str, ts, scale, causal: bool) -> tuple | None:
    """``plan_signature``, or None (no plan is looked up or kept) unless the call could take a Gluon path: Triton
    kernels for these tensors (not the reference backend), an sm_90 device, every base address 16-byte aligned
    (TMA needs it)."""
    if not (HAVE_GLUON and use_triton(*ts) and capability(ts[0].device) == (9, 0)):
        return None
    if not all(t.data_ptr() % 16 == 0 for t in ts):
        return None
    return plan_signature(kind, ts, scale, causal)


# ---------------------------------------------------------------------------------------------------------
# the document-mask fallback and its count
# ---------------------------------------------------------------------------------------------------------
_DOC_MASK_FALLBACKS = {"fwd": 0, "bwd": 0}  # process-wide: read by doc_mask_fallbacks(), never a setting


def doc_mask_fallbacks() -> dict:
    """{"fwd": n, "bwd": n}: document-masked flash calls that ran the Triton kernel where, without the mask, a
    Gluon kernel would have run."""
    return dict(_DOC_MASK_FALLBACKS)


def _doc_fwd(q, k, v, causal, scale, doc_starts):
    """The masked forward: the Triton kernel where a kernel runs (counted when the unmasked call's route is a
    Gluon kernel), else the tiled reference."""
    op = "flash_attention_fwd"
    _check_qkv(op, q, k, v)
    check_doc_starts(op, doc_starts, q, causal)
    fwd = _choice(q, causal).fwd if use_triton(q, k, v) and q.dtype != torch.float64 else ()
    if not fwd:
        return flash_attention_fwd_ref(q, k, v, causal, scale, doc_starts=doc_starts)
    _check_triton(op, q, k, v)
    s = _scale(op, scale, q.shape[-1])
    q, k, v = _rows(q), _rows(k), _rows(v)
    if isinstance(fwd[0], GluonFwdConfig) and gluon_fwd.supported(q, k, v):
        _DOC_MASK_FALLBACKS["fwd"] += 1
    cfg = doc_configs(q.dtype, q.shape[2], q.shape[3])[0]
    return flash_attention_fwd_triton(q, k, v, causal, s, config=cfg, doc_starts=doc_starts)


def _doc_bwd(do, q, k, v, o, lse, causal, scale, doc_starts):
    """The masked backward, routed as ``_doc_fwd``."""
    op = "flash_attention_bwd"
    _check_bwd(op, do, q, k, v, o, lse)
    check_doc_starts(op, doc_starts, q, causal)
    bwd = _choice(q, causal).bwd if use_triton(do, q, k, v, o, lse) and q.dtype != torch.float64 else ()
    if not bwd:
        return flash_attention_bwd_ref(do, q, k, v, o, lse, causal, scale, doc_starts=doc_starts)
    _check_triton(op, q, k, v)
    s = _scale(op, scale, q.shape[-1])
    do = do.to(q.dtype)
    name, _ = bwd_route(do, q, k, v, o, lse, causal)
    if name != "triton":
        _DOC_MASK_FALLBACKS["bwd"] += 1
    cfg = doc_configs(q.dtype, q.shape[2], q.shape[3])[1]
    return flash_attention_bwd_triton(do, q, k, v, o, lse, causal, s, config=cfg, doc_starts=doc_starts)


# ---------------------------------------------------------------------------------------------------------
# public entry points
# ---------------------------------------------------------------------------------------------------------
def flash_attention_fwd(q, k, v, causal: bool = True, scale: float | None = None, doc_starts=None):
    """Flash attention forward: the kernel ``choose`` gives on CUDA (fp32/bf16/fp16, D in 32/64/128), else the
    tiled reference; with ``doc_starts`` the Triton kernel on CUDA (module docstring). Returns (o in q.dtype, lse
    [B, H, T] fp32, natural log)."""
    op = "flash_attention_fwd"
    if doc_starts is not None:
        return _doc_fwd(q, k, v, causal, scale, doc_starts)
    key = _plan_key("fwd", (q, k, v), scale, causal) if isinstance(q, torch.Tensor) and q.is_cuda else None
    plan = _FWD_PLANS.lookup(key)
    if plan is not None:  # this signature took the Gluon forward before
        return plan(q, k, v)
    _check_qkv(op, q, k, v)
    if not use_triton(q, k, v) or q.dtype == torch.float64:
        return flash_attention_fwd_ref(q, k, v, causal, scale)
    _check_triton(op, q, k, v)
    s = _scale(op, scale, q.shape[-1])
    q, k, v = _rows(q), _rows(k), _rows(v)
    for cfg in _choice(q, causal).fwd:
        if isinstance(cfg, GluonFwdConfig):
            if gluon_fwd.supported(q, k, v):
                if key is None:
                    return gluon_fwd.flash_attention_fwd_gluon(q, k, v, causal, s, config=cfg, checked=True)
                o, lse, plan = gluon_fwd.flash_attention_fwd_gluon(
                    q, k, v, causal, s, config=cfg, checked=True, plan=True
                )
                _FWD_PLANS.put(key, plan)
                return o, lse
        else:
            return flash_attention_fwd_triton(q, k, v, causal, s, config=cfg)
    raise AssertionError("unreachable: the Triton config is last in every choice")


def bwd_route(do, q, k, v, o, lse, causal: bool = True) -> tuple:
    """(name, config) of the backward ``flash_attention_bwd`` runs for these CUDA inputs: "onepass", "gluon" or
    "triton" (the first of ``choose``'s list whose predicate holds)."""
    for cfg in _choice(q, causal).bwd:
        if isinstance(cfg, OnepassConfig):
            if gluon_onepass.supported_bwd(do, q, k, v, o, lse):
                return "onepass", cfg
        elif isinstance(cfg, GluonBwdConfig):
            if supported_bwd(do, q, k, v, o, lse):
                return "gluon", cfg
        else:
            return "triton", cfg
    raise AssertionError("unreachable: the Triton config is last in every choice")


def flash_attention_bwd(do, q, k, v, o, lse, causal: bool = True, scale: float | None = None, doc_starts=None):
    """Flash attention backward: the kernel ``choose`` gives on CUDA (fp32/bf16/fp16, D in 32/64/128), else the
    tiled reference; with ``doc_starts`` the Triton kernels on CUDA, as the forward. Returns (dq, dk, dv), dk and
    dv summed over each group of query heads."""
    op = "flash_attention_bwd"
    if doc_starts is not None:
        return _doc_bwd(do, q, k, v, o, lse, causal, scale, doc_starts)
    ts = (do, q, k, v, o, lse)
    cuda = all(isinstance(t, torch.Tensor) and t.is_cuda for t in ts)
    key = _plan_key("bwd", ts, scale, causal) if cuda else None
    plan = _BWD_PLANS.lookup(key)
    if plan is not None:  # this signature took a Gluon backward before
        return plan(*ts)
    _check_bwd(op, do, q, k, v, o, lse)
    if not use_triton(*ts) or q.dtype == torch.float64:
        return flash_attention_bwd_ref(do, q, k, v, o, lse, causal, scale)
    _check_triton(op, q, k, v)
    s = _scale(op, scale, q.shape[-1])
    do = do.to(q.dtype)
    name, cfg = bwd_route(do, q, k, v, o, lse, causal)
    if name == "triton":
        return flash_attention_bwd_triton(do, q, k, v, o, lse, causal, s, config=cfg)
    fn = gluon_onepass.flash_attention_bwd_gluon_onepass if name == "onepass" else gluon_bwd.flash_attention_bwd_gluon
    # a plan repeats the launches only: inputs that the full path converts first (do to q's dtype, lse to
    # contiguous fp32) take the full path every time
    if key is None or ts[0].dtype != q.dtype or lse.dtype != torch.float32 or not lse.is_contiguous():
        return fn(do, q, k, v, o, lse, causal, s, config=cfg, checked=True)
    dq, dk, dv, plan = fn(do, q, k, v, o, lse, causal, s, config=cfg, checked=True, plan=True)
    _BWD_PLANS.put(key, plan)
    return dq, dk, dv
