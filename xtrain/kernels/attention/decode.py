"""Decode attention: one new query per row over that row's KV-cache positions, read where they lie in the cache.

Contract:
    decode_attention(q [B, H, D], ck, cv [R, Hkv, Tmax, D], slots [B] int64, n [B] int64, scale) -> o [B, H*D]
    row b's query heads attend to keys and values 0 .. n[b] - 1 of cache row slots[b] (1 <= n[b] <= Tmax); GQA
    (H a multiple of Hkv) as in the model; scores and softmax in fp32 (fp64 for fp64); o in q's dtype, laid out
    as the o projection's input rows.

The reference gathers the rows (``ck[slots, :, :S]``) and runs the math attention of ``ops.cached_attention``. The
Triton kernel gathers nothing: program (b, kv head) reads its row's keys and values in place, in tiles of BLOCK_S
positions up to n[b] (a bound read on the device, so a CUDA graph replays it for any row lengths), with the
online softmax of flash attention (Dao et al., 2022) over its G query heads at once. It replaces the gathers,
two batched matmuls, the scale, the mask and the softmax of a decode step: one launch a layer instead of about
ten, which is what a batch-1 decode step's time is made of.
"""

from __future__ import annotations

import torch

from xtrain.kernels._dispatch import jit as _jit
from xtrain.kernels._dispatch import tl, triton


def decode_attention_ref(q, ck, cv, slots, n, scale: float):
    B, H, D = q.shape
    Hkv = ck.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    S = int(n.max())
    k, v = ck[slots, :, :S], cv[slots, :, :S]  # [B, Hkv, S, D]
    s = (q.view(B, Hkv, H // Hkv, D) @ k.transpose(-1, -2)).to(acc) * scale  # [B, Hkv, G, S]
    hidden = torch.arange(S, device=q.device)[None, :] >= n[:, None]  # [B, S]
    p = torch.softmax(s.masked_fill(hidden[:, None, None], float("-inf")), dim=-1)
    return (p.to(v.dtype) @ v).reshape(B, H * D)  # [B, Hkv, G, D] -> rows


@_jit
def _decode_attention_kernel(Q, CK, CV, SLOTS, N, O, scale, s_row, s_head, s_pos, H: tl.constexpr, G: tl.constexpr,
                             D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):  # fmt: skip
    b, hk = tl.program_id(0), tl.program_id(1)
    n = tl.load(N + b)
    g, d = tl.arange(0, BLOCK_G), tl.arange(0, D)
    heads = hk * G + g  # [BLOCK_G] the query heads of kv head hk
    q = tl.load(Q + (b * H + heads)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0).to(tl.float32)
    base = tl.load(SLOTS + b) * s_row + hk * s_head
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for s0 in range(0, n, BLOCK_S):
        pos = s0 + tl.arange(0, BLOCK_S)
        seen = pos < n
        at = base + pos.to(tl.int64)[:, None] * s_pos + d[None, :]  # [BLOCK_S, D]
        k = tl.load(CK + at, mask=seen[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_G, BLOCK_S]
        s = tl.where(seen[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        v = tl.load(CV + at, mask=seen[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    o = acc / den[:, None]
    tl.store(O + b * H * D + heads[:, None] * D + d[None, :], o.to(O.dtype.element_ty), mask=(g < G)[:, None])


def decode_attention_triton(q, ck, cv, slots, n, scale: float, block_s: int = 32, num_warps: int = 4):
    B, H, D = q.shape
    Hkv = ck.shape[1]
    if ck.stride(-1) != 1 or ck.stride() != cv.stride() or D & (D - 1):
        raise ValueError(f"decode_attention: needs row-major caches of one layout and D a power of 2: {ck.shape}")
    o = torch.empty(B, H * D, dtype=q.dtype, device=q.device)
    G = H // Hkv
    _decode_attention_kernel[(B, Hkv)](
        q.contiguous(), ck, cv, slots, n, o, float(scale), ck.stride(0), ck.stride(1), ck.stride(2), H=H, G=G, D=D,
        BLOCK_G=triton.next_power_of_2(G), BLOCK_S=block_s, num_warps=num_warps,
    )  # fmt: skip
    return o
