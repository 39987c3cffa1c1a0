"""SiLU and SwiGLU: silu(x) = x * sigmoid(x); swiglu(g, u) = silu(g) * u.

Contract:
    silu_fwd(x) -> y;              silu_bwd(dy, x) -> dx = dy * s * (1 + x * (1 - s)), s = sigmoid(x)
    swiglu_fwd(g, u) -> y;         swiglu_bwd(dy, g, u) -> (dg, du)
        dg = dy * u * s * (1 + g * (1 - s)),  du = dy * silu(g)
Backward recomputes the sigmoid from the saved input instead of storing it (one tensor less per layer).
Maths in fp32 (fp64 for fp64 inputs); outputs in the input dtype.

Triton kernels (swiglu only: silu alone is on no default path, so it runs its reference): elementwise passes of
BLOCK elements per program, one read of every input and one write of every output (swiglu_bwd: read dy, g, u; write
dg, du), the sigmoid recomputed in registers. They walk rows of F elements, so g and u may be the two column halves
of one [N, 2F] product (``ops.swiglu_linear``'s stacked gate/up) and ``swiglu_bwd``'s ``out`` the halves of one
[N, 2F] gradient: any row stride, unit column stride.
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


@_jit
def _swiglu_fwd_kernel(G, U, Y, F, rs, nb, BLOCK: tl.constexpr):  # y [R, F] contiguous; g, u rows rs apart
    row, cols = tl.program_id(0) // nb, (tl.program_id(0) % nb).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask, at = cols < F, row.to(tl.int64) * rs + cols
    g = tl.load(G + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row.to(tl.int64) * F + cols, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)


@_jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, F, rs, rs_out, nb, BLOCK: tl.constexpr):  # dy [R, F] contiguous
    row, cols = tl.program_id(0) // nb, (tl.program_id(0) % nb).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask, at, out = cols < F, row.to(tl.int64) * rs + cols, row.to(tl.int64) * rs_out + cols
    g = tl.load(G + at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + at, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row.to(tl.int64) * F + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(DG + out, (dy * u * s * (1 + g * (1 - s))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + out, (dy * g * s).to(DU.dtype.element_ty), mask=mask)


def _same_shape(name: str, *ts: torch.Tensor):
    if any(t.shape != ts[0].shape for t in ts):
        raise ValueError(f"{name}: shapes must match, got {[tuple(t.shape) for t in ts]}")


def _as_rows(*ts: torch.Tensor) -> list[torch.Tensor] | None:
    """ts as [R, F] rows for the swiglu kernels: all contiguous -> one flat row each (the widest programs);
    else 2-D with a unit column stride and one row stride (walked in place); else None."""
    if all(t.is_contiguous() for t in ts):
        return [t.view(1, -1) for t in ts]
    ok = all(t.dim() == 2 and t.stride(1) == 1 and t.stride(0) == ts[0].stride(0) for t in ts)
    return list(ts) if ok else None


BLOCK = 1024  # a row of F in programs of this many elements (8 a thread at 4 warps)


def swiglu_fwd_triton(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    _same_shape("swiglu_fwd", g, u)
    y = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    g2, u2 = _as_rows(g, u) or _as_rows(g.contiguous(), u.contiguous())
    (R, F), nb = g2.shape, triton.cdiv(g2.shape[1], BLOCK)
    _swiglu_fwd_kernel[(max(1, R * nb),)](g2, u2, y, F, g2.stride(0), nb, BLOCK=BLOCK, num_warps=4)
    return y


def swiglu_bwd_triton(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor, out=None):
    """-> (dg, du); ``out``: (dg, du) to write, each of g's shape; g, u and out are walked in place when they
    are rows sharing a row stride (``_as_rows``: the halves of one [R, 2F] product and of one [R, 2F] gradient)."""
    _same_shape("swiglu_bwd", dy, g, u, *(out or ()))
    out = out or (
        torch.empty_like(g, memory_format=torch.contiguous_format),
        torch.empty_like(u, memory_format=torch.contiguous_format),
    )
    rows = _as_rows(g, u, *out) or _as_rows(g.contiguous(), u.contiguous(), *out)
    if rows is None:
        raise ValueError(
            f"swiglu_bwd: out must be contiguous or rows like g's, got strides {[o.stride() for o in out]}"
        )
    g2, u2, dg, du = rows
    (R, F), nb = g2.shape, triton.cdiv(g2.shape[1], BLOCK)
    args = (dy.contiguous(), g2, u2, dg, du, F, g2.stride(0), dg.stride(0), nb)
    _swiglu_bwd_kernel[(max(1, R * nb),)](*args, BLOCK=BLOCK, num_warps=4)
    return out


def _fast(*ts: torch.Tensor) -> bool:
    return ts[0].dtype != torch.float64 and all(t.dtype == ts[0].dtype for t in ts) and use_triton(*ts)


def silu_fwd(x):
    return silu_fwd_ref(x)


def silu_bwd(dy, x):
    return silu_bwd_ref(dy, x)


def swiglu_fwd(g, u):
    return swiglu_fwd_triton(g, u) if _fast(g, u) else swiglu_fwd_ref(g, u)


def swiglu_bwd(dy, g, u, out=None):
    """-> (dg, du), written into ``out`` = (dg, du) when given (``swiglu_bwd_triton``'s)."""
    if _fast(dy, g, u):
        return swiglu_bwd_triton(dy, g, u, out)
    dg, du = swiglu_bwd_ref(dy, g, u)
    return (dg, du) if out is None else (out[0].copy_(dg), out[1].copy_(du))
