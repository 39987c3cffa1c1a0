"""Attention references: the composed ("math") attention and the tiled flash references, the oracles.

Shapes: B batch, H query heads, Hkv key/value heads (Hkv divides H; query head h reads K/V head
h // (H // Hkv), grouped-query attention), T sequence, D head dim.

Math attention, the CPU hot path of ``ops.math_attention``: two batched matmuls forward and four backward,
grouped-query attention folded into the matmul shapes (q [B, H, T, D] viewed as [B, Hkv, G*T, D]) instead
of copying K/V; P = softmax(scale q kᵀ [+ causal -inf]) is kept for the backward.
    attention_fwd(q, k, v, causal, scale) -> (o [B, H, T, D] in q.dtype, p [B, Hkv, G*T, T])
    attention_bwd(do, q, k, v, p, causal, scale) -> (dq, dk, dv)
    dV = Pᵀ dO,  dP = dO vᵀ,  dS = P (dP - rowsum(dP P)),  dQ = scale dS k,  dK = scale dSᵀ q

Flash references, the oracles of every flash kernel (Triton and Gluon) and the CPU path of
``ops.flash_attention``; the same tiled online-softmax recurrences as the kernels, O(T · tile) memory:
    flash_attention_fwd_ref(q, k, v, causal=True, scale=None) -> (o in q.dtype, lse [B, H, T])
    flash_attention_bwd_ref(do, q, k, v, o, lse, causal=True, scale=None) -> (dq, dk, dv)
``scale`` defaults to 1/sqrt(D) and must be > 0. ``lse`` is the natural-log row logsumexp of the scaled,
masked scores, fp32 (fp64 for fp64 inputs): all the forward saves besides q, k, v, o. Forward (online
softmax, Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022): per K/V tile j,
    m_new = max(m, rowmax(s_j)),  l = l·exp(m - m_new) + rowsum(exp(s_j - m_new)),
    acc = acc·exp(m - m_new) + exp(s_j - m_new) v_j;   o = acc / l,  lse = m + log l.
Backward by recomputation (FlashAttention-2, Dao 2023), delta_i = rowsum(dO_i ∘ O_i):
    P = exp(s - lse),  dV = Pᵀ dO,  dS = P (dO vᵀ - delta),  dQ = scale dS k,  dK = scale dSᵀ q
dk and dv are summed over each group of query heads. Precision: fp32 (fp64 for fp64 inputs) throughout.
"""

from __future__ import annotations

import functools
import math

import torch

from xtrain.kernels._dispatch import acc_dtype as _acc

REF_TILE = 128  # K/V tile of the flash references


# ---------------------------------------------------------------------------------------------------------
# math attention
# ---------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=32)
def _causal_mask(T: int, device) -> torch.Tensor:
    # True above the diagonal; cached per (T, device): read-only, and every block of every step asks for it
    return torch.ones(T, T, dtype=torch.bool, device=device).triu(1)


def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * T, D)  # [B, Hkv, G*T, D]
    s = torch.matmul(qg, k.transpose(-1, -2)).to(_acc(q))  # [B, Hkv, G*T, T]
    s.mul_(scale)
    if causal:
        s.view(B, Hkv, G, T, T).masked_fill_(_causal_mask(T, q.device), float("-inf"))
    p = torch.softmax(s, dim=-1)  # fp32; every row has its diagonal, so no row is all -inf
    o = torch.matmul(p.to(v.dtype), v)  # [B, Hkv, G*T, D]
    return o.reshape(B, H, T, D), p


def attention_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, causal: bool, scale: float
):
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    dog = do.reshape(B, Hkv, G * T, D)  # [B, Hkv, G*T, D]
    qg = q.reshape(B, Hkv, G * T, D)
    dv = torch.matmul(p.to(do.dtype).transpose(-1, -2), dog)  # [B, Hkv, T, D]
    dp = torch.matmul(dog, v.transpose(-1, -2)).to(p.dtype)  # [B, Hkv, G*T, T]
    rowsum = (dp * p).sum(dim=-1, keepdim=True)  # [B, Hkv, G*T, 1]
    ds = dp.sub_(rowsum).mul_(p).mul_(scale).to(q.dtype)  # dS * scale, in place over dP
    dq = torch.matmul(ds, k).reshape(B, H, T, D)
    dk = torch.matmul(ds.transpose(-1, -2), qg)  # [B, Hkv, T, D]
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------------
# input checks shared by every flash entry point
# ---------------------------------------------------------------------------------------------------------
def _shapes(*ts) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} {t.device}" for t in ts)


def _check_qkv(op: str, q, k, v) -> None:
    ts = (q, k, v)
    if not all(isinstance(t, torch.Tensor) for t in ts):
        raise ValueError(f"{op}: q, k, v must be torch tensors")
    if not (q.ndim == 4 and k.ndim == 4 and v.ndim == 4):
        raise ValueError(f"{op}: q, k, v must be [B, H, T, D] / [B, Hkv, T, D], got {_shapes(*ts)}")
    B, H, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != T or k.shape[3] != D:
        raise ValueError(f"{op}: k and v must be [B, Hkv, T, D] with q's B, T, D, got {_shapes(*ts)}")
    Hkv = k.shape[1]
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"{op}: Hkv={Hkv} must divide H={H}, got {_shapes(*ts)}")
    if T == 0 or D == 0 or B == 0:
        raise ValueError(f"{op}: empty input, got {_shapes(*ts)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"{op}: q, k, v must share one floating dtype, got {_shapes(*ts)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{op}: q, k, v must be on one device, got {_shapes(*ts)}")


def _check_bwd(op: str, do, q, k, v, o, lse) -> None:
    _check_qkv(op, q, k, v)
    B, H, T, D = q.shape
    if do.shape != q.shape or o.shape != q.shape or lse.shape != (B, H, T):
        raise ValueError(
            f"{op}: need do, o [B, H, T, D] and lse [B, H, T] matching q, got do/o/lse/q {_shapes(do, o, lse, q)}"
        )
    if do.device != q.device or o.device != q.device or lse.device != q.device:
        raise ValueError(f"{op}: all inputs must be on one device, got {_shapes(do, o, lse, q)}")
    if not (do.is_floating_point() and o.is_floating_point() and lse.is_floating_point()):
        raise ValueError(f"{op}: do, o, lse must be floating, got {_shapes(do, o, lse)}")


def _scale(op: str, scale, D: int) -> float:
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    # the kernels take the row max of the unscaled scores and multiply after: that is only the max of the
    # scaled scores when scale > 0
    if not (s > 0.0 and math.isfinite(s)):
        raise ValueError(f"{op}: scale must be a finite number > 0, got {scale!r}")
    return s


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, Hkv*groups, T, D] view-then-copy: head h reads K/V head h // groups."""
    if groups == 1:
        return x
    B, Hkv, T, D = x.shape
    return x[:, :, None].expand(B, Hkv, groups, T, D).reshape(B, Hkv * groups, T, D)


def flash_attention_fwd_ref(q, k, v, causal: bool = True, scale: float | None = None, tile: int = REF_TILE):
    """Online-softmax forward over K/V tiles of width ``tile``. Returns (o in q.dtype, lse natural log)."""
    op = "flash_attention_fwd_ref"
    _check_qkv(op, q, k, v)
    B, H, T, D = q.shape
    s = _scale(op, scale, D)
    acc_t = _acc_dtype(q.dtype)
    groups = H // k.shape[1]
    qf = q.to(acc_t)
    kf, vf = _expand_kv(k.to(acc_t), groups), _expand_kv(v.to(acc_t), groups)  # [B, H, T, D]
    rows = torch.arange(T, device=q.device)
    m = torch.full((B, H, T), float("-inf"), dtype=acc_t, device=q.device)  # running max
    l = torch.zeros((B, H, T), dtype=acc_t, device=q.device)  # running sum
    acc = torch.zeros((B, H, T, D), dtype=acc_t, device=q.device)  # unnormalised output
    for j0 in range(0, T, tile):
        j1 = min(j0 + tile, T)
        sc = (qf @ kf[:, :, j0:j1].transpose(-1, -2)) * s  # [B, H, T, tile]
        if causal:
            cols = torch.arange(j0, j1, device=q.device)
            sc = sc.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        m_new = torch.maximum(m, sc.amax(dim=-1))
        # a row with every score so far masked keeps m = -inf; subtract 0 there instead so exp gives 0, not NaN
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(sc - m_safe[..., None])  # [B, H, T, tile]
        alpha = torch.exp(m - m_safe)  # rescales what was accumulated under the old max
        l = l * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + p @ vf[:, :, j0:j1]
        m = m_new
    o = acc / l[..., None]
    lse = m + torch.log(l)
    return o.to(q.dtype), lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def flash_attention_bwd_ref(do, q, k, v, o, lse, causal: bool = True, scale: float | None = None, tile: int = REF_TILE):
    """Backward by recomputing P one K/V tile at a time from lse. Returns (dq, dk, dv)."""
    op = "flash_attention_bwd_ref"
    _check_bwd(op, do, q, k, v, o, lse)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    groups = H // Hkv
    s = _scale(op, scale, D)
    acc_t = _acc_dtype(q.dtype)
    qf, dof, lsef = q.to(acc_t), do.to(acc_t), lse.to(acc_t)
    kf, vf = _expand_kv(k.to(acc_t), groups), _expand_kv(v.to(acc_t), groups)  # [B, H, T, D]
    delta = (dof * o.to(acc_t)).sum(dim=-1)  # D_i = rowsum(dO ∘ O), [B, H, T]
    rows = torch.arange(T, device=q.device)
    dq = torch.zeros_like(qf)
    dk = torch.empty_like(kf)  # per query head; summed over groups at the end
    dv = torch.empty_like(vf)
    for j0 in range(0, T, tile):
        j1 = min(j0 + tile, T)
        kj, vj = kf[:, :, j0:j1], vf[:, :, j0:j1]  # [B, H, tile, D]
        p = torch.exp((qf @ kj.transpose(-1, -2)) * s - lsef[..., None])  # [B, H, T, tile]
        if causal:
            cols = torch.arange(j0, j1, device=q.device)
            p = p.masked_fill(cols[None, :] > rows[:, None], 0.0)
        dv[:, :, j0:j1] = p.transpose(-1, -2) @ dof
        dp = dof @ vj.transpose(-1, -2)  # [B, H, T, tile]
        ds = p * (dp - delta[..., None])
        dq += (ds @ kj) * s
        dk[:, :, j0:j1] = (ds.transpose(-1, -2) @ qf) * s
    dk = dk.reshape(B, Hkv, groups, T, D).sum(dim=2)  # GQA: a K/V head's gradient sums over its group
    dv = dv.reshape(B, Hkv, groups, T, D).sum(dim=2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
