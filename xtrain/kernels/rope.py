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

Triton kernel ``_rope_kernel``: x is viewed as [B', G, T, D] (B' = B for positions [B, T], else 1; G the
remaining leading dims, e.g. heads). A program takes BLOCK_T positions of one b, computes their cos/sin
once (the angle as the fp64 product pos * inv_freq rounded to fp32, exactly the reference's angle, then fp32
cos/sin) and applies them to an even share of the groups (heads), reading the two halves x1 = x[..., :D/2],
x2 = x[..., D/2:] once and writing
    y1 = x1 * cos - x2 * sin,   y2 = x2 * cos + x1 * sin       (backward: the same with sin -> -sin)
The next group's x is loaded before the current one is stored. Tiling: ``RopeConfig`` (``rope_config``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xtrain.kernels._dispatch import jit as _jit
from xtrain.kernels._dispatch import sm_count, tl, triton, use_triton


@dataclass(frozen=True)
class RopeConfig:
    """tile: elements per program step (BLOCK_T positions x D/2 pairs); num_warps; per_sm: the programs per SM the
    groups are shared out to."""

    tile: int = 512
    num_warps: int = 4
    per_sm: int = 32


def rope_config() -> RopeConfig:
    """The shipped tiling, for every shape, dtype and GPU: 512-element tiles, 4 warps, 32 programs per SM (H200: 86-87 %
    of copy bandwidth in bf16, 91-93 % in fp32)."""
    return RopeConfig()


_INV_FREQ_CACHE: dict = {}


def _inv_freq(D: int, theta: float, device) -> torch.Tensor:
    """theta^(-2i/D), i < D/2, fp64 [D/2]; cached per (D, theta, device): on a GPU, recomputing it costs
    three kernel launches per call, and the model calls rope twice per layer each way."""
    key = (D, float(theta), str(device))
    t = _INV_FREQ_CACHE.get(key)
    if t is None:
        t = theta ** (-torch.arange(0, D, 2, device=device, dtype=torch.float64) / D)
        _INV_FREQ_CACHE[key] = t
    return t


def rope_cos_sin(positions: torch.Tensor, D: int, theta: float, dtype=torch.float32):
    """cos, sin of shape positions.shape + [D] (the D/2 angles repeated over both halves)."""
    inv_freq = _inv_freq(D, theta, positions.device)
    ang = positions.to(torch.float64)[..., None] * inv_freq  # [..., T, D/2]
    ang = ang.to(dtype)
    ang = torch.cat([ang, ang], dim=-1)  # [..., T, D]
    return ang.cos(), ang.sin()


def _broadcast_cs(cs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # positions [T] -> cos [T, D] broadcasts over leading dims; [B, T] -> [B, 1.., T, D]
    if cs.dim() == 3:
        cs = cs.reshape(cs.shape[0], *([1] * (x.dim() - 3)), *cs.shape[1:])
    return cs


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float, sign: float) -> torch.Tensor:
    """Rotate each pair (x_i, x_{i+D/2}) by sign * angle: with c, s the half-width cos/sin,
        y1 = x1 c - sign x2 s,   y2 = x2 c + sign x1 s
    which is x * cos + sign * rotate_half(x) * sin written per half, without building rotate_half."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.shape[-1] // 2
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta, acc)
    c, s = _broadcast_cs(cos[..., :h], x), _broadcast_cs(sin[..., :h], x)  # [.., T, D/2]
    xf = x.to(acc)
    x1, x2 = xf[..., :h], xf[..., h:]
    y = torch.empty(xf.shape, dtype=acc, device=x.device)
    torch.mul(x1, c, out=y[..., :h])
    y[..., :h].addcmul_(x2, s, value=-sign)
    torch.mul(x2, c, out=y[..., h:])
    y[..., h:].addcmul_(x1, s, value=sign)
    return y.to(x.dtype)


def rope_fwd_ref(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    return _rotate(x, positions, theta, 1.0)


def rope_bwd_ref(dy: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    # the inverse rotation: dx = dy * cos - rotate_half(dy) * sin
    return _rotate(dy, positions, theta, -1.0)


# ------------------------------------------------------------------------------------------------ Triton


@_jit
def _rope_kernel(
    X, Y, POS, INV_FREQ, T, G, groups_per_program, HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    INVERSE: tl.constexpr,
):  # fmt: skip
    # x is [B', G, T, D]: B' = B for positions [B, T] (else 1), G = every other leading dim (e.g. heads)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    b = tl.program_id(1).to(tl.int64)
    h = tl.arange(0, BLOCK_H)  # [BLOCK_H] index of the pair (h, h + HALF)
    tmask = t < T
    hmask = h < HALF
    mask = tmask[:, None] & hmask[None, :]
    pidx = b * T + t  # into the flattened positions
    # cos/sin once per program, reused for all of its groups (heads): the trig is amortised over G
    pos = tl.load(POS + pidx, mask=tmask, other=0).to(tl.float64)
    inv_freq = tl.load(INV_FREQ + h, mask=hmask, other=0.0)  # fp64
    # the fp64 product rounded once to fp32 is exactly the reference's fp32 angle
    ang = (pos[:, None] * inv_freq[None, :]).to(tl.float32)
    c = tl.cos(ang)
    s = tl.sin(ang)
    if INVERSE:
        s = -s
    g0 = tl.program_id(2) * groups_per_program
    g1 = tl.minimum(g0 + groups_per_program, G)
    offs = ((b * G + g0) * T + t)[:, None] * (2 * HALF) + h[None, :]  # int64
    step = T * (2 * HALF)  # one group further
    x1n = tl.load(X + offs, mask=mask, other=0.0)
    x2n = tl.load(X + offs + HALF, mask=mask, other=0.0)
    for g in range(g0, g1):
        x1 = x1n.to(tl.float32)
        x2 = x2n.to(tl.float32)
        # the next group's loads go out before this group's stores (a tensor mask: the interpreter needs one)
        nmask = mask & (t * 0 + g + 1 < g1)[:, None]
        x1n = tl.load(X + offs + step, mask=nmask, other=0.0)
        x2n = tl.load(X + offs + step + HALF, mask=nmask, other=0.0)
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
        tl.store(Y + offs, y1.to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + offs + HALF, y2.to(Y.dtype.element_ty), mask=mask)
        offs += step


def _check(x: torch.Tensor, positions: torch.Tensor, name: str):
    if x.dim() < 2 or x.shape[-1] % 2 != 0:
        raise ValueError(f"{name}: x must be [..., T, D] with even D, got {tuple(x.shape)}")
    T = x.shape[-2]
    if (
        positions.dim() not in (1, 2)
        or positions.shape[-1] != T
        or (positions.dim() == 2 and (x.dim() < 3 or x.shape[0] != positions.shape[0]))
    ):
        raise ValueError(f"{name}: positions {tuple(positions.shape)} must be [T] or [B, T] for x {tuple(x.shape)}")


def _rope_triton(
    x: torch.Tensor, positions: torch.Tensor, theta: float, inverse: bool, config: RopeConfig | None
) -> torch.Tensor:
    _check(x, positions, "rope_bwd" if inverse else "rope_fwd")
    D = x.shape[-1]
    T = x.shape[-2]
    HALF = D // 2
    x2 = x.contiguous()
    y = torch.empty_like(x2)
    R = x2.numel() // D  # rows of D
    if R == 0:
        return y
    B = positions.shape[0] if positions.dim() == 2 else 1
    G = R // (B * T)  # groups (heads, ...) per batch row of positions
    pos = positions.reshape(-1).contiguous()  # [(B or 1) * T]
    inv_freq = _inv_freq(D, theta, x.device)
    cfg = config or rope_config()
    BLOCK_H = triton.next_power_of_2(HALF)
    BLOCK_T = max(1, min(triton.next_power_of_2(T), cfg.tile // BLOCK_H))
    n_t = triton.cdiv(T, BLOCK_T)
    target = cfg.per_sm * sm_count(x.device) if x.is_cuda else 4
    groups_per_program = max(1, (n_t * B * G) // max(1, target))  # a few groups each, still >= target programs
    # the same number of groups in every program (16 groups at 15 per program used to leave half of the
    # programs one group, each still paying for its cos/sin)
    groups_per_program = triton.cdiv(G, triton.cdiv(G, groups_per_program))
    grid = (n_t, B, triton.cdiv(G, groups_per_program))
    _rope_kernel[grid](
        x2, y, pos, inv_freq, T, G, groups_per_program, HALF=HALF, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, INVERSE=inverse,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return y


def rope_fwd_triton(
    x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0, config: RopeConfig | None = None
) -> torch.Tensor:
    return _rope_triton(x, positions, theta, False, config)


def rope_bwd_triton(
    dy: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0, config: RopeConfig | None = None
) -> torch.Tensor:
    return _rope_triton(dy, positions, theta, True, config)


def rope_fwd(x, positions, theta=10000.0):
    if x.dtype != torch.float64 and use_triton(x, positions):
        return rope_fwd_triton(x, positions, theta)
    return rope_fwd_ref(x, positions, theta)


def rope_bwd(dy, positions, theta=10000.0):
    if dy.dtype != torch.float64 and use_triton(dy, positions):
        return rope_bwd_triton(dy, positions, theta)
    return rope_bwd_ref(dy, positions, theta)
