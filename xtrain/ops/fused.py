"""Fused ops: several ops' work in one node, to save memory or passes.

linear_cross_entropy(x, w, targets) = cross_entropy(x @ w^T, targets) without ever holding the [N, V]
logits: the kernel (``xtrain.kernels.linear_cross_entropy``, after Liger-Kernel's fused linear
cross-entropy) walks the tokens in chunks and computes dx and dw during the forward, while each chunk's
logits exist. The loss is a scalar, so backward only scales the saved gradients by dloss.
"""

from __future__ import annotations

import torch

from xtrain.autograd import Var, is_grad_enabled
from xtrain.kernels import linear_cross_entropy as K
from xtrain.ops.basic import _check_same, check, check_values

_INT = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def linear_cross_entropy(
    x: Var,
    w: Var,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> Var:
    """Scalar cross-entropy of logits = x @ w^T: x [N, C] (e.g. the final hidden states), w [V, C] (the
    lm-head weight, Hugging Face layout), targets [N] integer; rows whose target is ``ignore_index``
    count for nothing and "mean" divides by the number of counted rows.

    Memory: dx [N, C] and dw [V, C] are kept from forward to backward instead of the logits."""
    op = "linear_cross_entropy"
    _check_same(op, x, w)
    check(x.ndim == 2 and w.ndim == 2 and x.shape[1] == w.shape[1], op, "expected x [N, C] and w [V, C]", x, w)
    check(
        isinstance(targets, torch.Tensor) and targets.dtype in _INT,
        op,
        "targets must be an integer torch tensor",
        x,
        w,
        targets,
    )
    check(targets.shape == (x.shape[0],), op, "targets must be [N]", x, w, targets)
    check(targets.device == x.device, op, f"targets on {targets.device}, x on {x.device}", x, targets)
    check(reduction in ("mean", "sum"), op, f"reduction must be mean or sum, got {reduction!r}", x)
    V = w.shape[0]
    valid = targets[targets != ignore_index] if check_values(targets) else targets[:0]
    if valid.numel():
        lo, hi = int(valid.min()), int(valid.max())
        check(
            lo >= 0 and hi < V,
            op,
            f"targets must lie in [0, {V}) or equal ignore_index {ignore_index}, got range [{lo}, {hi}]",
            x,
            w,
            targets,
        )

    need_dx = is_grad_enabled() and x.requires_grad
    need_dw = is_grad_enabled() and w.requires_grad
    loss, dx, dw = K.linear_cross_entropy_fwd(
        x.data, w.data, targets, ignore_index, reduction, need_dx=need_dx, need_dw=need_dw, chunk_size=chunk_size
    )

    def backward(dloss):
        return K.linear_cross_entropy_bwd(dloss, dx, dw)

    return Var.from_op(loss, (x, w), backward, op)
