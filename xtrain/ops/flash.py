"""Fused attention on the tape: the same function as the composed ``xtrain.ops.attention``, without the
[B, H, T, T] scores or probabilities.

    flash_attention(q [B, H, T, D], k [B, Hkv, T, D], v [B, Hkv, T, D], mask=True, scale=None) -> [B, H, T, D]

The forward kernel returns o and the row logsumexp (lse, [B, H, T] fp32); the backward closure saves only
q, k, v, o and lse (O(T) beyond the inputs and output) and recomputes the probabilities tile by tile.
dk and dv come back summed over each group of query heads (grouped-query attention), shaped like k and v.
"""

from __future__ import annotations

from xtrain.autograd import Var
from xtrain.kernels import attention as K
from xtrain.mask import Mask


def flash_attention(q: Var, k: Var, v: Var, mask: Mask | bool = True, scale: float | None = None) -> Var:
    """softmax(q kᵀ · scale [+ the mask]) v; scale defaults to 1/sqrt(D). ``mask`` (``xtrain.mask``): causal,
    full, or packed ``Documents`` (query t sees keys starts[b, t] .. t), whose starts the kernels take (on CUDA
    the Triton kernels: the Gluon kernels take no mask, so their routes fall back to Triton)."""
    from xtrain.ops.attention import _mask

    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Var):
            raise ValueError(f"flash_attention: {name} must be a Var, got {type(x).__name__}")
    m = _mask("flash_attention", mask, q)
    # the kernels validate shapes and dtypes; doc_starts None is the plain (causal or full) kernel
    o, lse = K.flash_attention_fwd(q.data, k.data, v.data, m.causal, scale, m.doc_starts)

    def backward(do):
        return K.flash_attention_bwd(do, q.data, k.data, v.data, o, lse, m.causal, scale, m.doc_starts)

    return Var.from_op(o, (q, k, v), backward, "flash_attention")
