"""Fused linear + cross-entropy: loss = CE(x @ w^T, targets) without the [N, V] logits in fp32.

The lm-head matmul and the loss are the largest activation of a language model: N tokens x V vocab
logits (8k x 128k in bf16 is 2 GiB, and an fp32 softmax of it 4 GiB more). Following Liger-Kernel's
FusedLinearCrossEntropy (credit: linkedin/Liger-Kernel, ``fused_linear_cross_entropy.py``), we walk the
tokens in chunks and compute the gradients during the forward, while the chunk's logits are at hand:

    for each chunk c of tokens:
        logits_c  = x_c @ w^T                          [n_c, V], in the compute dtype
        nll_c, dlogits_c = CE fwd + bwd in place       (Triton: cross_entropy_fwd_bwd), scale = 1/denom
        dx_c      = dlogits_c @ w                      [n_c, C]
        dw       += dlogits_c^T @ x_c                  [V, C]   (cuBLAS accumulates each chunk in fp32)
    loss = sum(nll) / denom

Only one chunk of logits ever exists. The loss is a scalar, so the upstream gradient dloss only scales
the saved dx and dw: backward is two multiplications. dw is accumulated in w.dtype with addmm_ (as
Liger does): with bf16 weights that is one bf16 rounding per chunk instead of one in all (a few per
mille relative error at 4 to 8 chunks), which keeps the extra memory at one [V, C] in w.dtype.

Contract:
    linear_cross_entropy_fwd(x[N, C], w[V, C], targets[N], ignore_index=-100, reduction="mean",
                             need_dx=True, need_dw=True, chunk_size=None)
        -> (loss 0-dim fp32, dx[N, C] in x.dtype or None, dw[V, C] in w.dtype or None)
        dx, dw are dloss = 1 gradients.
    linear_cross_entropy_bwd(dloss, dx, dw) -> (dx * dloss, dw * dloss)
The reference path (any device) is the same chunk loop with the plain-torch cross-entropy in fp32; the
Triton path uses the fused cross-entropy kernel on CUDA. The chunk logits matmuls are torch (cuBLAS).
"""

from __future__ import annotations

import functools

import torch

from xtrain.kernels import cross_entropy as K_ce
from xtrain.kernels._dispatch import use_triton

CHUNK_ELEMENTS = 1 << 28  # at most 2^28 logits per chunk (512 MiB in bf16)
MAX_CHUNK_ROWS = 2048  # bigger chunks would save little: each chunk costs one read + write of dw


def default_chunk_size(N: int, V: int) -> int:
    """Rows per chunk: large enough that re-reading dw per chunk is a few percent of the matmuls
    (dw traffic / matmul time ~ 120 / chunk rows on an H200), small enough to bound the logits."""
    rows = max(1, min(MAX_CHUNK_ROWS, CHUNK_ELEMENTS // max(V, 1)))
    return max(1, min(N, rows))


def _check(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, reduction: str):
    name = "linear_cross_entropy"
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{name}: expected x [N, C] and w [V, C], got x {tuple(x.shape)} and w {tuple(w.shape)}")
    if targets.dim() != 1 or targets.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: expected targets [N] = [{x.shape[0]}], got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"{name}: targets must be integer class ids, got {targets.dtype}")
    if x.dtype != w.dtype:
        raise ValueError(f"{name}: x and w must share a dtype, got {x.dtype} and {w.dtype}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{name}: reduction must be 'mean' or 'sum', got {reduction!r}")


def _linear_cross_entropy(
    x, w, targets, ignore_index=-100, reduction="mean", need_dx=True, need_dw=True, chunk_size=None, *, fused_ce
):
    """The chunk loop (module docstring); ``fused_ce``: the Triton cross-entropy kernels, else the plain-torch one."""
    _check(x, w, targets, reduction)
    N, C = x.shape
    V = w.shape[0]
    targets = targets.contiguous()
    chunk = chunk_size or default_chunk_size(N, V)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    # the denominator stays on the device (no host read, no synchronisation): the kernels load 1/denom
    if reduction == "mean":
        denom = (targets != ignore_index).sum().clamp_min(1).to(acc)
    else:
        denom = torch.ones((), dtype=acc, device=x.device)
    inv_denom = 1.0 / denom
    loss_sum = torch.zeros((), dtype=acc, device=x.device)
    dx = torch.empty_like(x) if need_dx else None
    dw = torch.zeros_like(w) if need_dw else None
    ce_fwd = K_ce.cross_entropy_fwd_triton if fused_ce else K_ce.cross_entropy_fwd_ref
    ce_fwd_bwd = K_ce.cross_entropy_fwd_bwd_triton if fused_ce else K_ce.cross_entropy_fwd_bwd_ref
    for n0 in range(0, N, chunk):
        n1 = min(N, n0 + chunk)
        xc = x[n0:n1]  # [n, C]
        tc = targets[n0:n1]
        logits = xc @ w.t()  # [n, V] in the compute dtype: the only logits alive
        if not (need_dx or need_dw):  # evaluation: the loss alone
            loss_sum += ce_fwd(logits, tc, ignore_index, "sum")[0]
            continue
        nll_c, _ = ce_fwd_bwd(logits, tc, ignore_index, inv_denom)
        loss_sum += nll_c.sum()
        # logits now holds dlogits = (softmax - onehot) / denom, in the compute dtype
        if need_dx:
            torch.mm(logits, w, out=dx[n0:n1])  # [n, V] @ [V, C]
        if need_dw:
            dw.addmm_(logits.t(), xc)  # [V, n] @ [n, C], accumulated in w.dtype
        del logits
    loss = loss_sum / denom
    return loss, dx, dw


linear_cross_entropy_fwd_ref = functools.partial(_linear_cross_entropy, fused_ce=False)  # any device
linear_cross_entropy_fwd_triton = functools.partial(_linear_cross_entropy, fused_ce=True)  # CUDA


def linear_cross_entropy_fwd(
    x, w, targets, ignore_index=-100, reduction="mean", need_dx=True, need_dw=True, chunk_size=None
):
    fused = x.dtype != torch.float64 and use_triton(x, w, targets)
    return _linear_cross_entropy(x, w, targets, ignore_index, reduction, need_dx, need_dw, chunk_size, fused_ce=fused)


def linear_cross_entropy_bwd(dloss: torch.Tensor, dx: torch.Tensor | None, dw: torch.Tensor | None):
    """The saved dloss = 1 gradients, scaled by the upstream gradient of the scalar loss."""
    dx = None if dx is None else dx * dloss.to(dx.dtype)
    dw = None if dw is None else dw * dloss.to(dw.dtype)
    return dx, dw
