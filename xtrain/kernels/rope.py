"""Rotary position embedding, Hugging Face "rotate_half" convention.

    inv_freq[i] = theta^(-2i/D), i < D/2;  angle[t, i] = pos[t] * inv_freq[i]
    cos/sin [.., T, D] repeat the D/2 angles over both halves
    rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
    y = x * cos + rotate_half(x) * sin

Each (x_i, x_{i+D/2}) pair is rotated by +angle; the rotation is orthogonal, so the backward is the
inverse rotation (by -angle): dx = dy * cos - rotate_half(dy) * sin.

Contract: rope_fwd(x[..., T, D], positions[T] or [B, T], theta) -> y (x.dtype);
          rope_bwd(dy, positions, theta) -> dx. Angles are computed in fp32 (fp64 for fp64 inputs).
With positions [B, T], x must be [B, ..., T, D] (e.g. [B, H, T, D]).
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, D: int, theta: float, dtype=torch.float32):
    """cos, sin of shape positions.shape + [D] (the D/2 angles repeated over both halves)."""
    inv_freq = theta ** (-torch.arange(0, D, 2, device=positions.device, dtype=torch.float64) / D)
    ang = positions.to(torch.float64)[..., None] * inv_freq  # [..., T, D/2]
    ang = ang.to(dtype)
    ang = torch.cat([ang, ang], dim=-1)  # [..., T, D]
    return ang.cos(), ang.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def _broadcast_cs(cs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # positions [T] -> cos [T, D] broadcasts over leading dims; [B, T] -> [B, 1.., T, D]
    if cs.dim() == 3:
        cs = cs.reshape(cs.shape[0], *([1] * (x.dim() - 3)), *cs.shape[1:])
    return cs


def rope_fwd_ref(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta, acc)
    cos, sin = _broadcast_cs(cos, x), _broadcast_cs(sin, x)
    xf = x.to(acc)
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


def rope_bwd_ref(dy: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    acc = torch.float64 if dy.dtype == torch.float64 else torch.float32
    cos, sin = rope_cos_sin(positions, dy.shape[-1], theta, acc)
    cos, sin = _broadcast_cs(cos, dy), _broadcast_cs(sin, dy)
    df = dy.to(acc)
    return (df * cos - _rotate_half(df) * sin).to(dy.dtype)


def rope_fwd(x, positions, theta=10000.0):
    return rope_fwd_ref(x, positions, theta)


def rope_bwd(dy, positions, theta=10000.0):
    return rope_bwd_ref(dy, positions, theta)
