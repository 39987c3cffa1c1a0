"""Neural-network ops: each forward calls a kernel, each backward closure calls its kernel pair.

The pattern (see DESIGN.md, "One op, end to end"): validate, run ``K.<op>_fwd``, keep what the contract
says backward needs, and record a node whose closure runs ``K.<op>_bwd``.
"""

from __future__ import annotations

import torch

from xtrain.autograd import Var, adds_into, is_grad_enabled
from xtrain.kernels import cross_entropy as K_ce
from xtrain.kernels import dropout as K_dropout
from xtrain.kernels import embedding as K_emb
from xtrain.kernels import rms_norm as K_rms
from xtrain.kernels import rope as K_rope
from xtrain.kernels import softmax as K_softmax
from xtrain.kernels import swiglu as K_swiglu
from xtrain.ops.basic import _FLOAT, _check_float, _check_same, check, check_values

_INT = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def embedding(ids: torch.Tensor, table: Var, *, tied: bool = False) -> Var:
    """out[..., C] = table[ids]; ids is an integer tensor (not a Var), table [V, C]. Backward: the [V, C] gradient,
    or, where the table is a leaf that holds a gradient already and N < V, the rows added into that gradient in
    place (``_add_rows_into``; DESIGN.md, "One op, end to end"). ``tied``: the table is also read by an op whose
    backward runs first (a tied LM head), so it will hold a gradient: the full backward's plan is not made ahead."""
    check(
        isinstance(ids, torch.Tensor) and ids.dtype in _INT,
        "embedding",
        "ids must be an integer torch tensor",
        ids,
        table,
    )
    check(table.ndim == 2, "embedding", "table must be 2-D [V, C]", ids, table)
    check(ids.device == table.device, "embedding", f"ids on {ids.device}, table on {table.device}", ids, table)
    V = table.shape[0]
    if ids.numel() and check_values(ids):
        lo, hi = (int(t) for t in torch.aminmax(ids))
        check(lo >= 0 and hi < V, "embedding", f"ids must lie in [0, {V}), got range [{lo}, {hi}]", ids, table)

    fits = ids.numel() < V and table._backward is None  # a leaf with fewer tokens than rows: _add_rows_into can serve
    if is_grad_enabled() and table.requires_grad and not (fits and (tied or table.grad is not None)):
        # the backward's ids-only part (its slots pass and lists), made beside the gather where the backward uses it
        out, plan = K_emb.embedding_fwd_planned(ids, table.data)
    else:
        out, plan = K_emb.embedding_fwd(ids, table.data), None

    def backward(d):
        grad = table.grad
        if fits and grad is not None:
            # a leaf that holds a gradient already (a tied LM head's, an earlier micro-batch's): its rows summed
            # into it in place, as the engine adds into a leaf, without a [V, C] table of mostly zeros
            _add_rows_into(grad, d, ids, plan)
            return (None,)
        return (K_emb.embedding_bwd(d, ids, V, plan).to(table.dtype),)

    return Var.from_op(out, (table,), backward, "embedding")


def _add_rows_into(grad: torch.Tensor, d: torch.Tensor, ids: torch.Tensor, plan) -> None:
    """grad += embedding_bwd(d, ids, V), bit for bit, with [N, C] of temporaries instead of [V, C]. Each distinct
    id is named by its rank among the distinct ids; the kernel sums d's rows per rank (a row's sum runs over its
    tokens in token order, as with the ids themselves), and ``index_add_`` adds each summed row into its table row,
    one add per element (a rank j past the last distinct id holds zeros and adds them to row j: exact, and no row
    takes more than two adds). Nothing here reads a value back to the host, so a CUDA graph captures it."""
    flat = ids.reshape(-1).long()
    s, order = torch.sort(flat)
    first = torch.ones_like(s, dtype=torch.bool)
    first[1:] = s[1:] != s[:-1]
    rank = first.cumsum(0) - 1  # [N]: each sorted token's rank
    cid = torch.empty_like(flat).scatter_(0, order, rank)  # each token's rank, in token order
    # rank -> table row (a rank's tokens all write the same id); rank j past the last distinct id keeps row j
    rows = torch.arange(flat.numel(), device=flat.device).scatter_(0, rank, s)
    if plan is not None and plan.ready is not None:  # the forward's plan (made for the ids) is unused: join its stream
        torch.cuda.current_stream(d.device).wait_event(plan.ready)
    grad.index_add_(0, rows, K_emb.embedding_bwd(d, cid.view(ids.shape), flat.numel()).to(grad.dtype))


def rms_norm(x: Var, weight: Var, eps: float = 1e-6, dtype: torch.dtype | None = None) -> Var:
    """RMSNorm over the last dim, statistics in fp32, inverse RMS saved for backward. ``dtype``: the output's
    dtype (None: x's), rounded once from fp32: ``cast(rms_norm(x), dtype)`` in one kernel each way (the fp32
    residual stream normed straight into the bf16 matmul input; the gradient returns in x's dtype)."""
    xd, wd = x.data, weight.data
    if not (  # the common case in one expression; else the checks below name what is wrong
        xd.dtype is wd.dtype and xd.dtype in _FLOAT and xd.device == wd.device and wd.dim() == 1 and xd.dim() >= 1
        and xd.shape[-1] == wd.shape[0] and eps > 0 and (dtype is None or dtype.is_floating_point)
    ):  # fmt: skip
        _check_same("rms_norm", x, weight)
        check(
            weight.ndim == 1 and x.ndim >= 1 and x.shape[-1] == weight.shape[0],
            "rms_norm",
            "weight must be 1-D and match x's last dim",
            x,
            weight,
        )
        check(eps > 0, "rms_norm", f"eps must be > 0, got {eps}", x)
        check(dtype is None or dtype.is_floating_point, "rms_norm", f"dtype must be floating point, got {dtype}", x)
    y, inv_rms = K_rms.rms_norm_fwd(xd, wd, eps, dtype if dtype is not None and dtype != xd.dtype else None)

    @adds_into
    def backward(d, acc=(None, None)):  # acc[0]: x's gradient so far (the residual's), added in the kernel
        return K_rms.rms_norm_bwd(d, xd, wd, inv_rms, acc[0])

    return Var.from_op(y, (x, weight), backward, "rms_norm")


def silu(x: Var) -> Var:
    _check_float("silu", x)
    xd = x.data
    return Var.from_op(K_swiglu.silu_fwd(xd), (x,), lambda d: (K_swiglu.silu_bwd(d, xd),), "silu")


def swiglu(gate: Var, up: Var) -> Var:
    """silu(gate) * up, one kernel each way (the sigmoid is recomputed in backward, not stored)."""
    _check_same("swiglu", gate, up)
    check(gate.shape == up.shape, "swiglu", "gate and up must have the same shape", gate, up)
    gd, ud = gate.data, up.data
    return Var.from_op(K_swiglu.swiglu_fwd(gd, ud), (gate, up), lambda d: K_swiglu.swiglu_bwd(d, gd, ud), "swiglu")


def softmax(x: Var, dim: int = -1) -> Var:
    _check_float("softmax", x)
    check(x.ndim >= 1 and -x.ndim <= dim < x.ndim, "softmax", f"dim {dim} out of range", x)
    y = K_softmax.softmax_fwd(x.data, dim)
    return Var.from_op(y, (x,), lambda d: (K_softmax.softmax_bwd(d, y, dim),), "softmax")


def cross_entropy(logits: Var, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean") -> Var:
    """Mean (or sum) negative log-likelihood of ``targets`` under softmax(logits), in fp32.

    logits [N, V], targets [N] integer; rows whose target is ``ignore_index`` count for nothing, and the
    mean divides by the number of counted rows. Backward: (softmax - onehot) / count.
    """
    _check_float("cross_entropy", logits)
    check(logits.ndim == 2, "cross_entropy", "logits must be [N, V]", logits, targets)
    check(
        isinstance(targets, torch.Tensor) and targets.dtype in _INT,
        "cross_entropy",
        "targets must be an integer torch tensor",
        logits,
        targets,
    )
    check(targets.shape == (logits.shape[0],), "cross_entropy", "targets must be [N]", logits, targets)
    check(reduction in ("mean", "sum"), "cross_entropy", f"reduction must be mean or sum, got {reduction!r}", logits)
    V = logits.shape[1]
    valid = targets[targets != ignore_index] if check_values(targets) else targets[:0]
    if valid.numel():
        lo, hi = int(valid.min()), int(valid.max())
        check(
            lo >= 0 and hi < V,
            "cross_entropy",
            f"targets must lie in [0, {V}) or equal ignore_index {ignore_index}, got range [{lo}, {hi}]",
            logits,
            targets,
        )
    ld = logits.data
    loss, lse, denom = K_ce.cross_entropy_fwd(ld, targets, ignore_index, reduction)

    def backward(d):
        return (K_ce.cross_entropy_bwd(d, ld, targets, lse, ignore_index, denom),)

    return Var.from_op(loss, (logits,), backward, "cross_entropy")


def rope(x: Var, positions: torch.Tensor, theta: float = 10000.0) -> Var:
    """Rotary embedding on x[..., T, D] (D even), positions [T] or [B, T] (then x is [B, ..., T, D])."""
    _check_float("rope", x)
    check(x.ndim >= 2 and x.shape[-1] % 2 == 0, "rope", "x must be [..., T, D] with D even", x, positions)
    check(
        isinstance(positions, torch.Tensor) and positions.dtype in _INT,
        "rope",
        "positions must be an integer torch tensor",
        x,
        positions,
    )
    T = x.shape[-2]
    if positions.ndim == 1:
        check(positions.shape[0] == T, "rope", "positions [T] must match x's T", x, positions)
    else:
        check(
            positions.ndim == 2 and x.ndim >= 3 and positions.shape == (x.shape[0], T),
            "rope",
            "positions [B, T] needs x [B, ..., T, D]",
            x,
            positions,
        )
    check(positions.device == x.device, "rope", "positions and x are on different devices", x, positions)
    check(theta > 0, "rope", f"theta must be > 0, got {theta}", x)
    y = K_rope.rope_fwd(x.data, positions, theta)
    return Var.from_op(y, (x,), lambda d: (K_rope.rope_bwd(d, positions, theta),), "rope")


def dropout(x: Var, p: float, seed, training: bool = True, row_start: int = 0, row_stride: int = 1) -> Var:
    """Inverted dropout; the keep mask is a pure function of (seed, global element index) — see
    ``xtrain.kernels.dropout``: row b of x (the first dim) is row ``row_start + b * row_stride`` of the
    global batch. ``seed``: an int, or a one-element int64 tensor on x's device that the kernels read on the
    device (what a captured step needs: the model passes an entry of its seed buffer). The backward reads the
    same tensor, so it must not change between forward and backward (checked by its version counter, on the
    host). ``p == 0`` or ``training=False`` returns x itself (no node)."""
    check(0.0 <= p < 1.0, "dropout", f"p must lie in [0, 1), got {p}", x)
    check(row_start >= 0 and row_stride >= 1, "dropout", f"need row_start >= 0, row_stride >= 1, got "
          f"{row_start}, {row_stride}", x)  # fmt: skip
    if isinstance(seed, torch.Tensor):
        check(
            seed.dtype == torch.int64 and seed.numel() == 1 and seed.device == x.device,
            "dropout",
            f"seed must be an int or a one-element int64 tensor on {x.device}, got {seed.dtype} on {seed.device}",
            x,
            seed,
        )
    if p == 0.0 or not training:
        return x
    _check_float("dropout", x)
    check(x.data.is_contiguous(), "dropout", "x must be contiguous (the mask indexes flat elements)", x)
    seed = K_dropout.seed_tensor(seed, x.device)
    version = seed._version
    rows = (int(row_start), int(row_stride))
    y = K_dropout.dropout_fwd(x.data, p, seed, *rows)

    def backward(d):
        if seed._version != version:
            raise RuntimeError("dropout: the seed tensor was written between forward and backward")
        return (K_dropout.dropout_bwd(d.contiguous(), p, seed, *rows),)

    return Var.from_op(y, (x,), backward, "dropout")
