"""Finite-difference gradient check in float64.

For an op ``fn(*vars) -> Var`` and float64 inputs, draw a fixed random weight W shaped like the output and
take the scalar L = sum(W * out). Its analytic gradient comes from our backward (``out.backward(W)``); its
numerical gradient from central differences, element by element:

    dL/dx_i ~ (L(x + h e_i) - L(x - h e_i)) / (2h)

The error reported per input is normwise: max_i |analytic_i - numeric_i| / max(max_i |numeric_i|, 1e-12).
In float64 with h = 1e-6 the central difference is exact up to O(h^2 f''') ~ 1e-12 truncation plus
~1e-16 * |L| / h ~ 1e-10 rounding, so a correct backward of a smooth op lands near 1e-9 or below and a
wrong one (a missing term, a transposed index, a forgotten broadcast sum) lands near 1e-1. Tolerances:
``TOL_SMOOTH = 1e-6`` for smooth ops; ops that are piecewise linear in their input at a fixed random draw
(dropout with its fixed mask, the causal mask) are exactly linear there and use the same tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from xtrain.autograd import Var, no_grad

TOL_SMOOTH = 1e-6


def _loss(fn, tensors, others, W) -> float:
    with no_grad():
        out = fn(*[Var(t) for t in tensors], *others)
    return float((W * out.data.to(torch.float64)).sum())


def gradcheck(
    fn: Callable[..., Var],
    inputs: Sequence[torch.Tensor],
    others: Sequence = (),
    h: float = 1e-6,
    seed: int = 0,
    which: Sequence[bool] | None = None,
) -> list[float | None]:
    """Max normwise relative error of our gradient vs central differences, one entry per input.

    ``inputs`` are float64 tensors passed as Vars that require grad; ``others`` are passed as they are
    (ids, targets, seeds). Inputs with ``which[i] == False`` are not checked (entry None).
    """
    inputs = [t.detach().clone() for t in inputs]
    for t in inputs:
        if t.dtype != torch.float64:
            raise ValueError(f"gradcheck: inputs must be float64, got {t.dtype}")
    which = [True] * len(inputs) if which is None else list(which)
    vars_ = [Var(t.clone(), requires_grad=w) for t, w in zip(inputs, which)]
    out = fn(*vars_, *others)
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(W.to(out.dtype))
    errors: list[float | None] = []
    for i, t in enumerate(inputs):
        if not which[i]:
            errors.append(None)
            continue
        analytic = vars_[i].grad if vars_[i].grad is not None else torch.zeros_like(t)
        numeric = torch.zeros_like(t)
        flat = t.view(-1)
        nflat = numeric.view(-1)
        for j in range(flat.numel()):
            orig = flat[j].item()
            flat[j] = orig + h
            lp = _loss(fn, inputs, others, W)
            flat[j] = orig - h
            lm = _loss(fn, inputs, others, W)
            flat[j] = orig
            nflat[j] = (lp - lm) / (2 * h)
        scale = max(float(numeric.abs().max()), 1e-12)
        errors.append(float((analytic.to(torch.float64) - numeric).abs().max()) / scale)
    return errors
