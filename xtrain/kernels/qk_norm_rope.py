"""Per-head RMSNorm followed by RoPE, one fused step each way (Qwen3's q_norm/k_norm + rotary embedding).

    x [B, T, G*D] or [B*T, G*D] (a q or k projection, G heads of D) -> view [B, T, G, D]
    n = rms_norm over D with weight w [D]             (statistics in fp32, inv_rms [B*T*G] saved)
    y = rope(n transposed to [B, G, T, D])            (HF rotate_half convention, see kernels/rope.py)

Contract: qk_norm_rope_fwd(x, w, G, eps, positions, theta, table) -> (y [B, G, T, D] in x.dtype, inv_rms);
          qk_norm_rope_bwd(dy, x, w, G, inv_rms, positions, theta, table) -> (dx [B, T, G*D], dw [D]).
``table`` is ``rope_table(positions, D, theta, acc)``: the half-width cos/sin [T, D/2] (or [B, 1, T, D/2]
for positions [B, T]), computed once per model call and shared by every layer's q and k, each way.

The reference performs exactly the operations of ``rms_norm_fwd_ref`` then ``rope_fwd_ref`` (and their
backwards in reverse), with the cos/sin taken from the table instead of recomputed per call, so the model
is bit-identical to the unfused composition in every dtype. On CUDA the public functions call the existing
Triton rms_norm and rope kernels in turn (a fused Triton kernel has not been measured to pay yet).
"""

from __future__ import annotations

import torch

from xtrain.kernels import rms_norm as K_rms
from xtrain.kernels import rope as K_rope
from xtrain.kernels._dispatch import use_triton


def rope_table(positions: torch.Tensor, D: int, theta: float, dtype: torch.dtype):
    """Half-width (cos, sin) [.., T, D/2] in ``dtype``, broadcastable over [B, G, T, D/2]: the values
    ``kernels.rope`` computes for these positions (same maths, bit for bit)."""
    cos, sin = K_rope.rope_cos_sin(positions, D, theta, dtype)
    h = D // 2
    c, s = cos[..., :h], sin[..., :h]
    if c.dim() == 3:  # positions [B, T] -> [B, 1, T, D/2]
        c, s = c[:, None], s[:, None]
    return c, s


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, sign: float, acc: torch.dtype, y=None) -> torch.Tensor:
    """kernels.rope._rotate with the table given: y1 = x1 c - sign x2 s, y2 = x2 c + sign x1 s. ``y``: where to
    write (shaped like x, in acc; any layout), e.g. a transposed view of the layout the next step reads."""
    h = x.shape[-1] // 2
    xf = x if x.dtype == acc else x.to(acc)
    x1, x2 = xf[..., :h], xf[..., h:]
    if y is None:
        y = torch.empty(xf.shape, dtype=acc, device=x.device)
    y1, y2 = y[..., :h], y[..., h:]
    torch.mul(x1, c, out=y1)
    y1.addcmul_(x2, s, value=-sign)
    torch.mul(x2, c, out=y2)
    y2.addcmul_(x1, s, value=sign)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _bt(x: torch.Tensor, positions: torch.Tensor) -> tuple[int, int, int]:
    """(B, T, F) of x [B, T, F] or [B*T, F]; T is the positions' last dim."""
    T, F = positions.shape[-1], x.shape[-1]
    return x.numel() // (T * F), T, F


def qk_norm_rope_fwd_ref(x, w, G: int, eps: float, positions, theta: float, table):
    B, T, F = _bt(x, positions)
    D = F // G
    acc = _acc(x)
    xf = x.reshape(-1, D)  # [B*T*G, D]
    if xf.dtype != acc:
        xf = xf.to(acc)
    inv_rms = torch.rsqrt((xf * xf).mean(dim=-1) + eps)  # [B*T*G]
    n = torch.mul(xf, inv_rms[:, None]).mul_(w if w.dtype == acc else w.to(acc))
    if n.dtype != x.dtype:
        n = n.to(x.dtype)  # the unfused path rounds the norm's output to x's dtype before rope
    n = n.view(B, T, G, D).transpose(1, 2)  # [B, G, T, D]
    return _rotate(n, table[0], table[1], 1.0, acc), inv_rms


def qk_norm_rope_bwd_ref(dy, x, w, G: int, inv_rms, positions, theta: float, table):
    B, T, F = _bt(x, positions)
    D = F // G
    acc = _acc(x)
    # written straight into [B, T, G, D] memory (through its [B, G, T, D] view), so the rows below need no copy
    buf = torch.empty((B, T, G, D), dtype=acc, device=dy.device)
    dn = _rotate(dy, table[0], table[1], -1.0, acc, y=buf.transpose(1, 2)).transpose(1, 2)  # [B, T, G, D]
    # rms_norm_bwd_ref's operations, in its order: dx = r (g - xhat * mean(g * xhat)), g = dn * w
    xf = x.reshape(-1, D)  # [B*T*G, D]
    dyf = dn.reshape(-1, D)  # a view
    if xf.dtype != acc:
        xf, dyf = xf.to(acc), dyf.to(acc)
    r = (inv_rms if inv_rms.dtype == acc else inv_rms.to(acc))[:, None]  # [B*T*G, 1]
    xhat = xf * r
    dw = (dyf * xhat).sum(dim=0)  # [D]
    g = dyf * (w if w.dtype == acc else w.to(acc))
    dot = (g * xhat).mean(dim=-1, keepdim=True)
    dx = g.sub_(xhat.mul_(dot)).mul_(r)
    if dx.dtype != x.dtype:
        dx = dx.to(x.dtype)
    return dx.reshape(x.shape), (dw if dw.dtype == w.dtype else dw.to(w.dtype))


def qk_norm_rope_fwd(x, w, G: int, eps: float, positions, theta: float, table):
    if x.dtype != torch.float64 and use_triton(x, w):
        B, T, F = _bt(x, positions)
        n, inv_rms = K_rms.rms_norm_fwd(x.view(B, T, G, F // G), w, eps)
        return K_rope.rope_fwd(n.transpose(1, 2), positions, theta), inv_rms
    return qk_norm_rope_fwd_ref(x, w, G, eps, positions, theta, table)


def qk_norm_rope_bwd(dy, x, w, G: int, inv_rms, positions, theta: float, table):
    if x.dtype != torch.float64 and use_triton(dy, x, w):
        B, T, F = _bt(x, positions)
        dn = K_rope.rope_bwd(dy, positions, theta).transpose(1, 2)
        dx, dw = K_rms.rms_norm_bwd(dn, x.view(B, T, G, F // G), w, inv_rms)
        return dx.reshape(x.shape), dw
    return qk_norm_rope_bwd_ref(dy, x, w, G, inv_rms, positions, theta, table)
