"""Fused attention on the tape: the same function as the composed ``xtrain.ops.attention``, without the
[B, H, T, T] scores or probabilities.

    flash_attention(q [B, H, T, D], k [B, Hkv, T, D], v [B, Hkv, T, D], causal=True, scale=None, doc_starts=None)
        -> [B, H, T, D]

The forward kernel returns o and the row logsumexp (lse, [B, H, T] fp32); the backward closure saves only
q, k, v, o and lse (O(T) beyond the inputs and output) and recomputes the probabilities tile by tile.
dk and dv come back summed over each group of query heads (grouped-query attention), shaped like k and v.
"""

from __future__ import annotations

import torch

from xtrain.autograd import Var
from xtrain.kernels import attention as K


def flash_attention(
    q: Var, k: Var, v: Var, causal: bool = True, scale: float | None = None, doc_starts: torch.Tensor | None = None
) -> Var:
    """softmax(q kᵀ · scale [+ causal mask]) v; scale defaults to 1/sqrt(D). ``doc_starts`` (int64 [B, T],
    packed documents): query t sees key s iff doc_starts[b, t] <= s <= t; on CUDA the Triton kernels take it
    (``xtrain.kernels.attention``: the Gluon kernels do not, so their routes fall back to Triton)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Var):
            raise ValueError(f"flash_attention: {name} must be a Var, got {type(x).__name__}")
    if doc_starts is not None:
        K._check_qkv("flash_attention", q.data, k.data, v.data)
        K.check_doc_starts("flash_attention", doc_starts, q.data, causal)
    if doc_starts is None:
        o, lse = K.flash_attention_fwd(q.data, k.data, v.data, causal, scale)  # validates shapes and dtypes
    else:
        o, lse = K.flash_attention_fwd(q.data, k.data, v.data, causal, scale, doc_starts)

    def backward(do):
        if doc_starts is None:
            return K.flash_attention_bwd(do, q.data, k.data, v.data, o, lse, causal, scale)
        return K.flash_attention_bwd(do, q.data, k.data, v.data, o, lse, causal, scale, doc_starts)

    return Var.from_op(o, (q, k, v), backward, "flash_attention")
