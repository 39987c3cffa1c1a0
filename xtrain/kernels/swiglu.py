"""SiLU and SwiGLU: silu(x) = x * sigmoid(x); swiglu(g, u) = silu(g) * u.

Contract:
    silu_fwd(x) -> y;              silu_bwd(dy, x) -> dx = dy * s * (1 + x * (1 - s)), s = sigmoid(x)
    swiglu_fwd(g, u) -> y;         swiglu_bwd(dy, g, u) -> (dg, du)
        dg = dy * u * s * (1 + g * (1 - s)),  du = dy * silu(g)
Backward recomputes the sigmoid from the saved input instead of storing it (one tensor less per layer).
Maths in fp32 (fp64 for fp64 inputs); outputs in the input dtype.
"""

from __future__ import annotations

import torch


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def silu_fwd_ref(x: torch.Tensor) -> torch.Tensor:
    xf = x.to(_acc(x))
    return (xf * torch.sigmoid(xf)).to(x.dtype)


def silu_bwd_ref(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    xf = x.to(_acc(x))
    s = torch.sigmoid(xf)
    return (dy.to(xf.dtype) * s * (1 + xf * (1 - s))).to(x.dtype)


def swiglu_fwd_ref(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    gf = g.to(_acc(g))
    return (gf * torch.sigmoid(gf) * u.to(gf.dtype)).to(g.dtype)


def swiglu_bwd_ref(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor):
    gf = g.to(_acc(g))
    uf = u.to(gf.dtype)
    dyf = dy.to(gf.dtype)
    s = torch.sigmoid(gf)
    dg = dyf * uf * s * (1 + gf * (1 - s))
    du = dyf * gf * s
    return dg.to(g.dtype), du.to(u.dtype)


def silu_fwd(x):
    return silu_fwd_ref(x)


def silu_bwd(dy, x):
    return silu_bwd_ref(dy, x)


def swiglu_fwd(g, u):
    return swiglu_fwd_ref(g, u)


def swiglu_bwd(dy, g, u):
    return swiglu_bwd_ref(dy, g, u)
