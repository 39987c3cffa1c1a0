"""SiLU and SwiGLU: silu(x) = x * sigmoid(x); swiglu(g, u) = silu(g) * u.

Contract:
    silu_fwd(x) -> y;              silu_bwd(dy, x) -> dx = dy * s * (1 + x * (1 - s)), s = sigmoid(x)
    swiglu_fwd(g, u) -> y;         swiglu_bwd(dy, g, u) -> (dg, du)
        dg = dy * u * s * (1 + g * (1 - s)),  du = dy * silu(g)
Backward recomputes the sigmoid from the saved input instead of storing it (one tensor less per layer).
Maths in fp32 (fp64 for fp64 inputs); outputs in the input dtype.

Triton kernels: flat elementwise passes of BLOCK elements per program, one read of every input and one
write of every output (swiglu_bwd: read dy, g, u; write dg, du), the sigmoid recomputed in registers.
"""

from __future__ import annotations

import torch

from xtrain.kernels._dispatch import acc_dtype as _acc
from xtrain.kernels._dispatch import jit as _jit
from xtrain.kernels._dispatch import tl, triton, use_triton


def silu_fwd_ref(x: torch.Tensor) -> torch.Tensor:
    xf = x.to(_acc(x))
    return torch.sigmoid(xf).mul_(xf).to(x.dtype)


def _dsilu(xf: torch.Tensor, s: torch.Tensor, silu: torch.Tensor) -> torch.Tensor:
    """d silu / dx = s + silu (1 - s) = s (1 + x - silu), s = sigmoid(x): a fresh tensor, built in place."""
    return torch.add(xf, 1).sub_(silu).mul_(s)


def silu_bwd_ref(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    xf = x.to(_acc(x))
    s = torch.sigmoid(xf)
    return _dsilu(xf, s, xf * s).mul_(dy.to(xf.dtype)).to(x.dtype)


def swiglu_fwd_ref(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    acc = _acc(g)
    gf = g if g.dtype is acc else g.to(acc)  # no same-dtype casts: each is a call (a decode step is op-bound)
    y = torch.sigmoid(gf).mul_(gf).mul_(u if u.dtype is acc else u.to(acc))
    return y if y.dtype is g.dtype else y.to(g.dtype)


def swiglu_bwd_ref(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor):
    # In-place steps on fresh temporaries: each pass over the [N, F] activations costs as much as the maths.
    gf = g.to(_acc(g))
    uf = u.to(gf.dtype)
    dyf = dy.to(gf.dtype)
    s = torch.sigmoid(gf)
    silu = gf * s
    du = dyf * silu  # du = dy * silu(g)
    dg = _dsilu(gf, s, silu).mul_(uf).mul_(dyf)  # dg = dy * u * dsilu(g)
    return dg.to(g.dtype), du.to(u.dtype)


# ------------------------------------------------------------------------------------------------ Triton

BLOCK = 2048


@_jit
def _silu_fwd_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (x * tl.sigmoid(x)).to(Y.dtype.element_ty), mask=mask)


@_jit
def _silu_bwd_kernel(DY, X, DX, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(x)
    tl.store(DX + offs, (dy * s * (1 + x * (1 - s))).to(DX.dtype.element_ty), mask=mask)


@_jit
def _swiglu_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)


@_jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dy * u * s * (1 + g * (1 - s))
    du = dy * g * s
    tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, du.to(DU.dtype.element_ty), mask=mask)


def _same_shape(name: str, *ts: torch.Tensor):
    if any(t.shape != ts[0].shape for t in ts):
        raise ValueError(f"{name}: shapes must match, got {[tuple(t.shape) for t in ts]}")


def _grid(n: int):
    return (max(1, triton.cdiv(n, BLOCK)),)


def silu_fwd_triton(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    _silu_fwd_kernel[_grid(x.numel())](x, y, x.numel(), BLOCK=BLOCK, num_warps=8)
    return y


def silu_bwd_triton(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    _same_shape("silu_bwd", dy, x)
    x, dy = x.contiguous(), dy.contiguous()
    dx = torch.empty_like(x)
    _silu_bwd_kernel[_grid(x.numel())](dy, x, dx, x.numel(), BLOCK=BLOCK, num_warps=8)
    return dx


def swiglu_fwd_triton(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    _same_shape("swiglu_fwd", g, u)
    g, u = g.contiguous(), u.contiguous()
    y = torch.empty_like(g)
    _swiglu_fwd_kernel[_grid(g.numel())](g, u, y, g.numel(), BLOCK=BLOCK, num_warps=8)
    return y


def swiglu_bwd_triton(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor):
    _same_shape("swiglu_bwd", dy, g, u)
    dy, g, u = dy.contiguous(), g.contiguous(), u.contiguous()
    dg = torch.empty_like(g)
    du = torch.empty_like(u)
    _swiglu_bwd_kernel[_grid(g.numel())](dy, g, u, dg, du, g.numel(), BLOCK=BLOCK, num_warps=8)
    return dg, du


def _fast(*ts: torch.Tensor) -> bool:
    return ts[0].dtype != torch.float64 and all(t.dtype == ts[0].dtype for t in ts) and use_triton(*ts)


def silu_fwd(x):
    return silu_fwd_triton(x) if _fast(x) else silu_fwd_ref(x)


def silu_bwd(dy, x):
    return silu_bwd_triton(dy, x) if _fast(dy, x) else silu_bwd_ref(dy, x)


def swiglu_fwd(g, u):
    return swiglu_fwd_triton(g, u) if _fast(g, u) else swiglu_fwd_ref(g, u)


def swiglu_bwd(dy, g, u):
    return swiglu_bwd_triton(dy, g, u) if _fast(dy, g, u) else swiglu_bwd_ref(dy, g, u)
