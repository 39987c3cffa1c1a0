"""Composed attention: matmul -> scale -> causal mask -> softmax -> matmul.

Every step is an op on the tape, so the backward (dQ, dK, dV) comes from the parts. This path
materialises the [B, H, T, T] scores and probabilities; ``xtrain.ops.flash_attention`` computes the same
function without them.

Shapes: q [B, H, T, D]; k, v [B, Hkv, T, D] with Hkv dividing H (grouped-query attention: query head h
reads key/value head h // (H // Hkv)).

Every form takes a ``mask`` (``xtrain.mask``: a Mask value, or True / False for CAUSAL / FULL) and picks its
computation by the mask's kind: causal and full as ever, ``Documents`` (packed documents: query t sees keys
starts[b, t] .. t) through the same kernels given the starts, and ``Cached`` (new tokens over a KV cache's
rows, inference only) in ``cached_attention``, which reads the keys and values from the cache.
"""

from __future__ import annotations

import math

import torch

from xtrain.autograd import Var, is_grad_enabled
from xtrain.kernels import attention as K_attn
from xtrain.kernels._dispatch import prefer_fused, use_triton
from xtrain.kernels.attention import decode as K_dec
from xtrain.mask import Mask, as_mask
from xtrain.ops.basic import _FLOAT, _check_same, check, matmul, transpose
from xtrain.ops.basic import scale as scale_op
from xtrain.ops.nn import softmax


def check_attention_inputs(op: str, q: Var, k: Var, v: Var) -> None:
    _check_same(op, q, k)
    _check_same(op, q, v)
    check(q.ndim == 4 and k.ndim == 4 and v.ndim == 4, op, "q, k, v must be [B, H, T, D]", q, k, v)
    B, H, T, D = q.shape
    check(k.shape == v.shape, op, "k and v must have the same shape", q, k, v)
    check(
        k.shape[0] == B and k.shape[2] == T and k.shape[3] == D,
        op,
        "k/v must be [B, Hkv, T, D] with q's B, T and D",
        q,
        k,
        v,
    )
    Hkv = k.shape[1]
    check(Hkv > 0 and H % Hkv == 0, op, f"Hkv={Hkv} must divide H={H}", q, k, v)


def repeat_kv(x: Var, groups: int) -> Var:
    """[B, Hkv, T, D] -> [B, Hkv*groups, T, D], each K/V head repeated for its group of query heads.
    Backward sums the gradient over the group."""
    if groups == 1:
        return x
    B, Hkv, T, D = x.shape
    y = x.data[:, :, None].expand(B, Hkv, groups, T, D).reshape(B, Hkv * groups, T, D)

    def backward(d):
        return (d.reshape(B, Hkv, groups, T, D).sum(dim=2),)

    return Var.from_op(y, (x,), backward, "repeat_kv")


def _mask(op: str, mask, q: Var, cached: bool = False) -> Mask:
    """The mask as a Mask that fits q [B, H, T, D] (its kind's shape check); a Cached mask only where ``cached``."""
    m = as_mask(mask)
    check(cached or m.kind != "cached", op, "a Cached mask runs in cached_attention (keys from the cache)", q)
    if q.ndim == 4:  # else the form's own shape check names the problem
        m.check(op, q.shape[0], q.shape[2], q.device)
    return m


def causal_mask(scores: Var) -> Var:
    """Set scores[..., i, j] = -inf for j > i; those positions get zero gradient."""
    T, S = scores.shape[-2], scores.shape[-1]
    masked = torch.ones(T, S, dtype=torch.bool, device=scores.device).triu(1)  # [T, S], True above diag
    y = scores.data.masked_fill(masked, float("-inf"))
    return Var.from_op(y, (scores,), lambda d: (d.masked_fill(masked, 0.0),), "causal_mask")


def doc_mask(scores: Var, doc_starts: torch.Tensor) -> Var:
    """scores [B, H, T, T]: set scores[b, :, t, s] = -inf unless doc_starts[b, t] <= s <= t; those positions get
    zero gradient."""
    masked = K_attn.reference.doc_mask(doc_starts)[:, None]  # [B, 1, T, T]
    y = scores.data.masked_fill(masked, float("-inf"))
    return Var.from_op(y, (scores,), lambda d: (d.masked_fill(masked, 0.0),), "doc_mask")


def attention(q: Var, k: Var, v: Var, mask: Mask | bool = True, scale: float | None = None) -> Var:
    """softmax(q kᵀ · scale [+ the mask's -inf]) v, composed from tape ops. Returns [B, H, T, D]."""
    check_attention_inputs("attention", q, k, v)
    m = _mask("attention", mask, q)
    B, H, T, D = q.shape
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    groups = H // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    scores = scale_op(matmul(q, transpose(k, -1, -2)), s)  # [B, H, T, T]
    if m.kind == "documents":
        scores = doc_mask(scores, m.doc_starts)
    elif m.causal:
        scores = causal_mask(scores)
    probs = softmax(scores, dim=-1)  # [B, H, T, T]
    return matmul(probs, v)  # [B, H, T, D]


def math_attention(q: Var, k: Var, v: Var, mask: Mask | bool = True, scale: float | None = None) -> Var:
    """The same function as ``attention`` as one tape node with a hand-written backward
    (``xtrain.kernels.attention``): no K/V copies for GQA, two matmuls forward and four backward. It keeps
    the [B, H, T, T] probabilities, like the composed path; the model's CPU default."""
    check_attention_inputs("math_attention", q, k, v)
    m = _mask("math_attention", mask, q)
    D = q.shape[-1]
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    qd, kd, vd = q.data, k.data, v.data
    o, p = K_attn.attention_fwd(qd, kd, vd, m.causal, s, m.doc_starts)  # p is 0 wherever the mask is

    def backward(do):
        return K_attn.attention_bwd(do, qd, kd, vd, p, m.causal, s)

    return Var.from_op(o, (q, k, v), backward, "math_attention")


# On the CPU math attention is the fastest form (tiny preset, B=8, H=4, Hkv=2, T=256, D=64, 2 cores: fwd+bwd of
# one layer 32 ms, vs 125 ms composed and 159 ms for flash's tiled reference); its [T, T] probabilities grow as
# T², so from CPU_FLASH_MIN_T on the tiled flash reference (O(T) extra memory) takes over.
CPU_FLASH_MIN_T = 2048


def auto_attention(q: Var, k: Var, v: Var, mask: Mask | bool = True, scale: float | None = None) -> Var:
    """The attention form the device rule picks (``kernels._dispatch.prefer_fused``): flash attention on CUDA
    and on long CPU sequences (T > CPU_FLASH_MIN_T), math attention otherwise. Same function, same contract."""
    if prefer_fused(q.data) or q.shape[-2] > CPU_FLASH_MIN_T:
        from xtrain.ops.flash import flash_attention

        return flash_attention(q, k, v, mask, scale)
    return math_attention(q, k, v, mask, scale)


def cached_attention(q: Var, ck: torch.Tensor, cv: torch.Tensor, mask, scale: float | None = None) -> Var:
    """Attention of Tn new queries over their KV-cache rows (inference: no backward): q [B, H, Tn, D]; ck and cv
    one layer's whole cache [R, Hkv, Tmax, D], the new keys and values already in it (``SlotCache.store``);
    ``mask`` a ``Cached`` (the rows ``mask.slots``, their positions, the ``mask.keys`` positions read) -> rows
    [B*Tn, H*D]. A decode step (Tn = 1) on CUDA runs the decode kernel (``kernels.attention.decode``: each row's
    keys read in place, no gather). Otherwise the rows' first ``mask.keys`` positions (slices for a lone row known
    on the host, else a gather) go through math attention's computation (GQA folded into the matmul shapes,
    scores and softmax in fp32) with the mask's ``hidden`` keys at -inf; every query sees at least its own key."""
    op = "cached_attention"
    qd = q.data
    B, H, Tn, D = qd.shape if qd.dim() == 4 else (0, 0, 0, 0)
    Hkv, Tmax = (ck.shape[1], ck.shape[2]) if ck.dim() == 4 else (1, 0)
    S = getattr(mask, "keys", 0)
    if not (  # one expression for the common case; the checks below name what is wrong
        qd.dtype is ck.dtype is cv.dtype and qd.dtype in _FLOAT and qd.device == ck.device == cv.device
        and qd.dim() == 4 and ck.shape == cv.shape and ck.dim() == 4 and ck.shape[3] == D and Hkv > 0
        and H % Hkv == 0 and getattr(mask, "kind", None) == "cached" and S <= Tmax
    ):  # fmt: skip
        check(isinstance(ck, torch.Tensor) and isinstance(cv, torch.Tensor) and ck.dtype == cv.dtype == qd.dtype
              and ck.device == cv.device == qd.device, op, "ck and cv must be tensors of q's dtype and device",
              q, ck, cv)  # fmt: skip
        check(q.ndim == 4 and ck.ndim == 4 and ck.shape == cv.shape, op,
              "q must be [B, H, Tn, D], ck and cv [R, Hkv, Tmax, D]", q, ck, cv)  # fmt: skip
        check(ck.shape[3] == D and Hkv > 0 and H % Hkv == 0, op, "the caches must be [R, Hkv, Tmax, D], Hkv dividing H",
              q, ck, cv)  # fmt: skip
        check(False, op, f"mask must be a Cached mask of at most {Tmax} keys", q, ck)
    mask.check(op, B, Tn, qd.device)
    check(not (is_grad_enabled() and q.requires_grad), op, "inference only: run it under no_grad()", q)
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if Tn == 1 and use_triton(qd, ck):
        return Var(K_dec.decode_attention_triton(qd.view(B, H, D), ck, cv, mask.slots, mask.ends, s))
    if mask.row is not None:
        r = mask.row[0]
        kd, vd = ck[r : r + 1, :, :S], cv[r : r + 1, :, :S]  # views
    else:
        kd, vd = ck[mask.slots, :, :S], cv[mask.slots, :, :S]  # [B, Hkv, S, D]
    G = H // Hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    # batched matmuls over the B*Hkv (row, K/V head) pairs, the G query heads of a K/V head stacked as rows
    scores = torch.bmm(qd.reshape(B * Hkv, G * Tn, D), kd.reshape(B * Hkv, S, D).transpose(1, 2))  # [B*Hkv, G*Tn, S]
    scores = scores.mul_(s) if scores.dtype == acc else scores.to(acc).mul_(s)
    if mask.hidden is not None:
        scores.view(B, Hkv, G, Tn, S).masked_fill_(mask.hidden, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    o = torch.bmm(p if p.dtype == vd.dtype else p.to(vd.dtype), vd.reshape(B * Hkv, S, D))  # [B*Hkv, G*Tn, D]
    if Tn == 1:  # a decode step: the rows are o's memory as it is
        return Var(o.view(B, H * D))
    return Var(o.view(B, H, Tn, D).transpose(1, 2).reshape(B * Tn, H * D))


def attention_rows(q: Var, k: Var, v: Var, mask: Mask | bool = True, scale: float | None = None,
                   impl: str = "auto") -> Var:  # fmt: skip
    """Attention between the model's row layout and the head layout, as one node where the form allows:
    q [B, H, T, D], k [B, Hkv, T, D] (from ``qk_norm_rope``), v [B*T, Hkv*D] (the v projection's rows)
    -> [B*T, H*D] (the o projection's input rows). Where the math form runs (``impl`` "math", or "auto" on
    the CPU below CPU_FLASH_MIN_T), the head transposes of v, of the output and the output's contiguous copy
    happen inside one node (``xtrain.kernels.attention``), the same values as the unfused
    reshape/transpose/attention/transpose/contiguous/reshape chain bit for bit; other forms ("composed",
    "flash", "auto" on CUDA) run that chain of nodes. A ``Cached`` mask goes to ``cached_attention``."""
    check_attention_inputs("attention_rows", q, k, k)
    m = _mask("attention_rows", mask, q)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    check(v.ndim == 2 and tuple(v.shape) == (B * T, Hkv * D), "attention_rows", "v must be [B*T, Hkv*D]", q, k, v)
    _check_same("attention_rows", q, v)
    use_math = impl == "math" or (impl == "auto" and not prefer_fused(q.data) and T <= CPU_FLASH_MIN_T)
    if not use_math:
        from xtrain.ops.basic import contiguous, reshape

        fn = {"composed": attention, "auto": auto_attention}.get(impl)
        if fn is None:
            from xtrain.ops.flash import flash_attention as fn
        v4 = transpose(reshape(v, (B, T, Hkv, D)), 1, 2)  # [B, Hkv, T, D]
        return reshape(contiguous(transpose(fn(q, k, v4, m, scale), 1, 2)), (B * T, H * D))
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    qd, kd = q.data, k.data
    vd = v.data.view(B, T, Hkv, D).transpose(1, 2)  # [B, Hkv, T, D]
    o, p = K_attn.attention_fwd(qd, kd, vd, m.causal, s, m.doc_starts)  # [B, H, T, D]
    out = o.transpose(1, 2).contiguous().view(B * T, H * D)  # [B*T, H*D]

    def backward(dout):
        do = dout.view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        dq, dk, dv = K_attn.attention_bwd(do, qd, kd, vd, p, m.causal, s)
        return dq, dk, dv.transpose(1, 2).reshape(B * T, Hkv * D)

    return Var.from_op(out, (q, k, v), backward, "attention_rows")
