"""Safe softmax along one dim: y = exp(x - max) / sum(exp(x - max)).

Contract: softmax_fwd(x, dim) -> y (x.dtype, maths in fp32 or fp64);
          softmax_bwd(dy, y, dim) -> dx = y * (dy - sum(dy * y, dim))   (the softmax Jacobian-vector product)
The output y is what backward needs, so it is what the op saves.
"""

from __future__ import annotations

import torch

from xtrain.kernels._dispatch import acc_dtype as _acc


def softmax_fwd(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    xf = x.to(_acc(x))
    m = xf.amax(dim=dim, keepdim=True)
    # a row of all -inf (fully masked) would give nan from (-inf) - (-inf); pin its max to 0
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(xf - m)
    return (e / e.sum(dim=dim, keepdim=True)).to(x.dtype)


def softmax_bwd(dy: torch.Tensor, y: torch.Tensor, dim: int = -1) -> torch.Tensor:
    yf = y.to(_acc(y))
    dyf = dy.to(yf.dtype)
    return (yf * (dyf - (dyf * yf).sum(dim=dim, keepdim=True))).to(y.dtype)
