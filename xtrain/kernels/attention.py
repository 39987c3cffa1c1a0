"""Attention as one kernel pair with a hand-written backward ("math" attention): the CPU hot path.

The composed ``ops.attention`` records five tape nodes (repeat_kv, matmul, scale, mask, softmax, matmul),
copies K and V once per query head of a group, and makes a pass over the [T, T] scores for each step.
This pair computes the same function with two batched matmuls forward and four backward, and folds
grouped-query attention into the matmul shapes instead of copying K/V:

    q [B, H, T, D] viewed as [B, Hkv, G*T, D]   (G = H / Hkv: the G query heads that share one K/V head
                                                 are contiguous, so this is a view, not a copy)
    S = scale * q kᵀ            [B, Hkv, G*T, T]   (+ -inf above the diagonal when causal)
    P = softmax(S)              saved for backward (the O(T²) cost the flash kernels avoid)
    O = P v                     [B, Hkv, G*T, D] -> [B, H, T, D]
Backward, with dO viewed the same way:
    dV = Pᵀ dO                  (the sum over the group falls out of the matmul)
    dP = dO vᵀ
    dS = P * (dP - rowsum(dP * P))      (softmax Jacobian; masked entries have P = 0, so dS = 0)
    dQ = scale * dS k,  dK = scale * dSᵀ q

Contract: attention_fwd(q, k, v, causal, scale) -> (o [B, H, T, D] in q.dtype, p [B, Hkv, G*T, T]);
          attention_bwd(do, q, k, v, p, causal, scale) -> (dq, dk, dv).
Precision: scores, softmax and P are fp32 (fp64 for fp64); the matmuls run in the input dtype.
There is no Triton version: on CUDA the model uses the flash kernels, which never build P.
"""

from __future__ import annotations

import torch

from xtrain.kernels._dispatch import acc_dtype as _acc


def _causal_mask(T: int, device) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).triu(1)  # True above the diagonal


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
