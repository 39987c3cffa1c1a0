"""Attention references: the composed ("math") attention and the tiled flash references, the oracles.

Shapes: B batch, H query heads, Hkv key/value heads (Hkv divides H; query head h reads K/V head
h // (H // Hkv), grouped-query attention), T sequence, D head dim.

Math attention, the CPU hot path of ``ops.math_attention``: two batched matmuls forward and four backward,
grouped-query attention folded into the matmul shapes (q [B, H, T, D] viewed as [B, Hkv, G*T, D]) instead
of copying K/V; P = softmax(scale q kᵀ [+ causal -inf]) is kept for the backward.
    attention_fwd(q, k, v, causal, scale, doc_starts=None) -> (o [B, H, T, D] in q.dtype, p [B, Hkv, G*T, T])
    attention_bwd(do, q, k, v, p, causal, scale) -> (dq, dk, dv)   (the mask is in p's zeros)
    dV = Pᵀ dO,  dP = dO vᵀ,  dS = P (dP - rowsum(dP P)),  dQ = scale dS k,  dK = scale dSᵀ q

Flash references, the oracles of every flash kernel (Triton and Gluon) and the CPU path of
``ops.flash_attention``; the same tiled online-softmax recurrences as the kernels, O(T · tile) memory:
    flash_attention_fwd_ref(q, k, v, causal=True, scale=None, tile=REF_TILE, doc_starts=None) -> (o, lse [B, H, T])
    flash_attention_bwd_ref(do, q, k, v, o, lse, causal=True, scale=None, tile=REF_TILE, doc_starts=None)
        -> (dq, dk, dv)
``scale`` defaults to 1/sqrt(D) and must be > 0.

Document masks (packed documents): every entry point takes an optional ``doc_starts`` int64 [B, T], the
first position of each query's document; query t then sees key s iff doc_starts[b, t] <= s <= t (causal
within the document; needs causal=True). None is plain causal attention, computed exactly as before. The
flash references with a mask tile the queries too (tiles of ``tile`` rows) and skip key tiles that lie
wholly before the query tile's earliest document start (the minimum over its rows and the batch: one host
read per call, left out while a CUDA graph is being captured, where every causal tile is computed: a
skipped tile contributes exact zeros, so both give the same bits). The values are trusted, not read on the
host: doc_starts[b, t] > t leaves row t without keys (NaN). ``lse`` is the natural-log row logsumexp of the scaled,
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


def doc_mask(doc_starts: torch.Tensor) -> torch.Tensor:
    """doc_starts [B, T] -> bool [B, T, T], True where query t may not see key s: s > t or s < doc_starts[b, t]."""
    T = doc_starts.shape[-1]
    cols = torch.arange(T, device=doc_starts.device)
    return (cols[None, None, :] < doc_starts[:, :, None]) | _causal_mask(T, doc_starts.device)


def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, doc_starts=None):
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * T, D)  # [B, Hkv, G*T, D]
    s = torch.matmul(qg, k.transpose(-1, -2)).to(_acc(q))  # [B, Hkv, G*T, T]
    s.mul_(scale)
    if doc_starts is not None:  # [B, 1, 1, T, T] over the (Hkv, G) heads
        s.view(B, Hkv, G, T, T).masked_fill_(doc_mask(doc_starts)[:, None, None], float("-inf"))
    elif causal:
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


def check_doc_starts(op: str, doc_starts, q, causal: bool = True) -> None:
    """doc_starts must be None or an int64 [B, T] tensor on q's device with q's B and T (q [B, H, T, D]);
    a document mask is causal, so it needs causal=True. Values are not read (no host sync)."""
    if doc_starts is None:
        return
    if not isinstance(doc_starts, torch.Tensor):
        raise ValueError(f"{op}: doc_starts must be an int64 tensor [B, T], got {type(doc_starts).__name__}")
    B, T = q.shape[0], q.shape[-2]
    if doc_starts.dtype != torch.int64 or tuple(doc_starts.shape) != (B, T) or doc_starts.device != q.device:
        raise ValueError(f"{op}: doc_starts must be int64 [B, T] = [{B}, {T}] on q's device, got doc_starts/q "
                         f"{_shapes(doc_starts, q)}")  # fmt: skip
    if not causal:
        raise ValueError(f"{op}: a document mask is causal within each document; got causal=False, doc_starts "
                         f"{_shapes(doc_starts)}")  # fmt: skip


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


def _first_tiles(doc_starts: torch.Tensor, tile: int) -> list[int]:
    """Per query tile i (rows i*tile ..), the first key tile any of its rows sees: the tile holding the earliest
    document start of those rows over the batch. All zeros while a CUDA graph is captured (no host read)."""
    T = doc_starts.shape[-1]
    n = -(-T // tile)
    if doc_starts.is_cuda and torch.cuda.is_current_stream_capturing():
        return [0] * n
    pad = n * tile - T  # pad with T (no row's start) so the last tile's min is over its real rows
    lo = torch.nn.functional.pad(doc_starts, (0, pad), value=T).view(-1, n, tile).amin(dim=(0, 2))  # [n]
    return [int(x) // tile for x in lo.tolist()]


def _doc_fwd(q, k, v, s: float, doc_starts, tile: int):
    """The document-masked forward, tiled over queries and keys: query tile [i0, i1) visits the key tiles from
    its first (``_first_tiles``) to the one holding its last row."""
    B, H, T, D = q.shape
    acc_t = _acc_dtype(q.dtype)
    groups = H // k.shape[1]
    qf = q.to(acc_t)
    kf, vf = _expand_kv(k.to(acc_t), groups), _expand_kv(v.to(acc_t), groups)  # [B, H, T, D]
    o = torch.empty((B, H, T, D), dtype=acc_t, device=q.device)
    lse = torch.empty((B, H, T), dtype=acc_t, device=q.device)
    for qi, jt in enumerate(_first_tiles(doc_starts, tile)):
        i0, i1 = qi * tile, min(qi * tile + tile, T)
        rows = torch.arange(i0, i1, device=q.device)
        start = doc_starts[:, i0:i1, None]  # [B, tile, 1]
        m = torch.full((B, H, i1 - i0), float("-inf"), dtype=acc_t, device=q.device)
        l = torch.zeros((B, H, i1 - i0), dtype=acc_t, device=q.device)
        acc = torch.zeros((B, H, i1 - i0, D), dtype=acc_t, device=q.device)
        for j0 in range(jt * tile, i1, tile):
            j1 = min(j0 + tile, T)
            cols = torch.arange(j0, j1, device=q.device)
            masked = (cols[None, None, :] > rows[None, :, None]) | (cols[None, None, :] < start)  # [B, tile, tile]
            sc = (qf[:, :, i0:i1] @ kf[:, :, j0:j1].transpose(-1, -2)) * s  # [B, H, tile, tile]
            sc = sc.masked_fill(masked[:, None], float("-inf"))
            m_new = torch.maximum(m, sc.amax(dim=-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # as in the causal loop
            p = torch.exp(sc - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ vf[:, :, j0:j1]
            m = m_new
        o[:, :, i0:i1] = acc / l[..., None]
        lse[:, :, i0:i1] = m + torch.log(l)
    return o.to(q.dtype), lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def _doc_bwd(do, q, k, v, o, lse, s: float, doc_starts, tile: int):
    """The document-masked backward, over the same (query tile, key tile) pairs as ``_doc_fwd``."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    groups = H // Hkv
    acc_t = _acc_dtype(q.dtype)
    qf, dof, lsef = q.to(acc_t), do.to(acc_t), lse.to(acc_t)
    kf, vf = _expand_kv(k.to(acc_t), groups), _expand_kv(v.to(acc_t), groups)  # [B, H, T, D]
    delta = (dof * o.to(acc_t)).sum(dim=-1)  # D_i = rowsum(dO ∘ O), [B, H, T]
    dq = torch.zeros_like(qf)
    dk = torch.zeros_like(kf)  # per query head; summed over groups at the end
    dv = torch.zeros_like(vf)
    for qi, jt in enumerate(_first_tiles(doc_starts, tile)):
        i0, i1 = qi * tile, min(qi * tile + tile, T)
        rows = torch.arange(i0, i1, device=q.device)
        start = doc_starts[:, i0:i1, None]  # [B, tile, 1]
        qi_, doi = qf[:, :, i0:i1], dof[:, :, i0:i1]  # [B, H, tile, D]
        for j0 in range(jt * tile, i1, tile):
            j1 = min(j0 + tile, T)
            cols = torch.arange(j0, j1, device=q.device)
            masked = (cols[None, None, :] > rows[None, :, None]) | (cols[None, None, :] < start)  # [B, tile, tile]
            kj, vj = kf[:, :, j0:j1], vf[:, :, j0:j1]
            p = torch.exp((qi_ @ kj.transpose(-1, -2)) * s - lsef[:, :, i0:i1, None])  # [B, H, tile, tile]
            p = p.masked_fill(masked[:, None], 0.0)
            dv[:, :, j0:j1] += p.transpose(-1, -2) @ doi
            ds = p * (doi @ vj.transpose(-1, -2) - delta[:, :, i0:i1, None])
            dq[:, :, i0:i1] += (ds @ kj) * s
            dk[:, :, j0:j1] += (ds.transpose(-1, -2) @ qi_) * s
    dk = dk.reshape(B, Hkv, groups, T, D).sum(dim=2)  # GQA: a K/V head's gradient sums over its group
    dv = dv.reshape(B, Hkv, groups, T, D).sum(dim=2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def flash_attention_fwd_ref(
    q, k, v, causal: bool = True, scale: float | None = None, tile: int = REF_TILE, doc_starts=None
):
    """Online-softmax forward over K/V tiles of width ``tile`` (and query tiles with ``doc_starts``). Returns
    (o in q.dtype, lse natural log)."""
    op = "flash_attention_fwd_ref"
    _check_qkv(op, q, k, v)
    check_doc_starts(op, doc_starts, q, causal)
    B, H, T, D = q.shape
    s = _scale(op, scale, D)
    if doc_starts is not None:
        return _doc_fwd(q, k, v, s, doc_starts, tile)
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


def flash_attention_bwd_ref(
    do, q, k, v, o, lse, causal: bool = True, scale: float | None = None, tile: int = REF_TILE, doc_starts=None
):
    """Backward by recomputing P one K/V tile at a time from lse. Returns (dq, dk, dv)."""
    op = "flash_attention_bwd_ref"
    _check_bwd(op, do, q, k, v, o, lse)
    check_doc_starts(op, doc_starts, q, causal)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    groups = H // Hkv
    s = _scale(op, scale, D)
    if doc_starts is not None:
        return _doc_bwd(do, q, k, v, o, lse, s, doc_starts, tile)
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
