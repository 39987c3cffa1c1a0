"""Cross-entropy over a vocabulary, from logits, in fp32 whatever the logits dtype.

    lse[n]  = log sum_v exp(logits[n, v])                      (safe: max subtracted first)
    loss    = sum_{n counted} (lse[n] - logits[n, t_n]) / denom  (denom = count for "mean", 1 for "sum")
    dlogits = dloss * (softmax(logits[n]) - onehot(t_n)) / denom for counted rows, 0 for ignored rows

Contract:
    cross_entropy_fwd(logits[N, V], targets[N], ignore_index, reduction) -> (loss 0-dim fp32, lse[N] fp32,
        denom 0-dim fp32 tensor on the logits' device: max(count, 1) for "mean", 1 for "sum"; the
        reference's are in fp64 for fp64 logits). lse is saved so the backward needs no second reduction;
        denom is a device tensor so the forward never waits on the host (it was a float read back with
        .item(), a synchronisation inside every forward).
    cross_entropy_bwd(dloss, logits, targets, lse, ignore_index, denom, inplace=False) -> dlogits
        (logits.dtype; written into ``logits`` itself when inplace=True and the caller no longer needs it;
        denom: that tensor, or a Python number).
    cross_entropy_fwd_bwd_{triton,ref}(logits, targets, ignore_index, scale) -> (nll[N] fp32, lse[N] fp32), and
        (scale: a Python number or a 0-dim device tensor)
        logits overwritten in place by scale * (softmax - onehot) (0 on ignored rows): forward and backward in
        one call for a caller that knows dloss up front (the fused linear + cross-entropy, which picks the form).
A batch where every target is ignored has loss 0 and zero gradient under "mean" (not nan), so an
all-padding micro-batch cannot poison an accumulated step.

Triton kernels (one program per row, the whole row; fp32 statistics, never an fp32 copy of the logits):
    _ce_fwd_group_kernel           the forward: an online log-sum-exp over BLOCK_V-column steps, each step a
                                   [BLOCK_V / GROUP, GROUP] tile with a running max and sum per GROUP-column group
                                   (the per-step max stays within a thread or two: no shared memory, no barrier),
                                   the groups merged once at the end; exp2 with log2(e) folded into one FMA:
                                       m_new = max(m, max_b x);  s = s * 2^((m - m_new) log2 e) + sum_b 2^(..);
                                       lse = m + log(s)
                                   The next step's block is loaded before the current one is reduced.
    _ce_loss_kernel                the epilogue in one program: loss = sum(nll) / denom and denom as device
                                   scalars (no host read)
    _cross_entropy_bwd_kernel      one read + one write: (exp(x - lse) - [v == t]) * dloss / denom
    _cross_entropy_fwd_bwd_kernel  both: two reads + one write, gradient in place
Tiling: ``CrossEntropyConfig``, chosen from V by ``cross_entropy_config`` (the same for every dtype and GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xtrain.kernels._consts import LOG2E
from xtrain.kernels._dispatch import HAVE_TRITON, tl, triton, use_triton
from xtrain.kernels._dispatch import acc_dtype as _acc
from xtrain.kernels._dispatch import jit as _jit


def _check(name: str, logits: torch.Tensor, targets: torch.Tensor, reduction: str | None = None):
    if logits.dim() != 2 or targets.dim() != 1 or targets.shape[0] != logits.shape[0]:
        raise ValueError(
            f"{name}: expected logits [N, V] and targets [N], got {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"{name}: targets must be integer class ids, got {targets.dtype}")
    if reduction is not None and reduction not in ("mean", "sum"):
        raise ValueError(f"{name}: reduction must be 'mean' or 'sum', got {reduction!r}")


def cross_entropy_fwd_ref(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
):
    lf = logits.to(_acc(logits))
    lse = torch.logsumexp(lf, dim=-1)  # [N]
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, torch.zeros_like(targets))
    picked = lf.gather(1, safe_t[:, None]).squeeze(1)  # [N]
    nll = torch.where(valid, lse - picked, torch.zeros_like(lse))
    if reduction == "mean":
        denom = valid.sum().clamp_min(1).to(lf.dtype)
    else:
        denom = torch.ones((), dtype=lf.dtype, device=logits.device)
    loss = nll.sum() / denom
    return loss, lse, denom


def cross_entropy_bwd_ref(
    dloss: torch.Tensor,
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int = -100,
    denom=1.0,
    inplace: bool = False,
) -> torch.Tensor:
    acc = _acc(logits)
    valid = targets != ignore_index
    scale = torch.as_tensor(dloss, device=logits.device).to(acc) / torch.as_tensor(denom, device=logits.device).to(acc)
    # softmax(logits) = exp(logits - lse); torch.softmax does it in one fused pass where the subtraction
    # and exp would make two (and a temporary), so the saved lse is not needed on this path
    probs = torch.softmax(logits.to(acc), dim=-1)  # [N, V]
    safe_t = torch.where(valid, targets, torch.zeros_like(targets))
    probs.scatter_add_(1, safe_t[:, None], -torch.ones_like(probs[:, :1]))
    probs.mul_((valid.to(acc) * scale)[:, None])
    if inplace:
        logits.copy_(probs)
        return logits
    return probs.to(logits.dtype)


def cross_entropy_fwd_bwd_ref(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, scale: float = 1.0
):
    acc = _acc(logits)
    lf = logits.to(acc)
    lse = torch.logsumexp(lf, dim=-1)  # [N]
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, torch.zeros_like(targets))
    nll = torch.where(valid, lse - lf.gather(1, safe_t[:, None]).squeeze(1), torch.zeros_like(lse))
    logits.copy_(
        cross_entropy_bwd_ref(
            torch.as_tensor(scale, device=logits.device).to(acc), logits, targets, lse, ignore_index, 1.0
        )
    )
    return nll, lse


# ------------------------------------------------------------------------------------------------ Triton


_LOG2E = tl.constexpr(LOG2E) if HAVE_TRITON else LOG2E  # (a global a kernel reads must be a constexpr)


@_jit
def _row_lse(ROW, V, BLOCK_V: tl.constexpr):
    """Online log-sum-exp of one row of V logits, in fp32 (one exp per logit).

    Measured alternative (H200): per-lane running max/sum with no reduction in the loop,
    merged once at the end, was slower (0.96 vs 0.83 ms at 8192 x 131072 bf16), so the two block
    reductions per iteration stay."""
    cols = tl.arange(0, BLOCK_V)
    # the first block outside the loop, so m and s are fp32 scalars from the start
    x = tl.load(ROW + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    s = tl.sum(tl.exp(x - m), axis=0)  # masked lanes: exp(-inf) = 0
    for start in range(BLOCK_V, V, BLOCK_V):
        x = tl.load(ROW + start + cols, mask=start + cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    return m + tl.log(s)


@_jit
def _ce_fwd_group_kernel(
    LOGITS, TARGETS, LSE, NLL, V, stride, ignore_index, BLOCK_V: tl.constexpr, GROUP: tl.constexpr
):  # fmt: skip
    """Row lse and nll with no block-wide reduction inside the loop. Each BLOCK_V step is loaded
    as a [BLOCK_V // GROUP, GROUP] tile of GROUP consecutive columns per tile row, and every tile row
    keeps its own running max and sum (an online log-sum-exp per group of columns): the per-step max is
    over GROUP columns that Triton lays out within one thread or two (16-byte vectors), so it needs no
    shared memory and no barrier. The groups are merged once, at the end (M = max m_g,
    S = sum s_g 2^(m_g - M)). Costs one extra exp per GROUP columns (the rescale of each group's sum).
    Exponentials in base 2 with log2(e) folded in: 2^(x·log2e − m·log2e), one FMA and one MUFU.EX2 per
    logit."""
    row = tl.program_id(0).to(tl.int64)
    ROW = LOGITS + row * stride
    c0 = 0
    c1 = V
    NG: tl.constexpr = BLOCK_V // GROUP
    offs = tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [NG, GROUP] columns
    x = tl.load(ROW + c0 + offs, mask=c0 + offs < c1, other=-float("inf")).to(tl.float32)
    nxt = tl.load(ROW + c0 + BLOCK_V + offs, mask=c0 + BLOCK_V + offs < c1, other=-float("inf"))
    m = tl.max(x, axis=1)  # [NG]; -inf for a group with no column yet
    ml = tl.where(m == -float("inf"), 0.0, m * _LOG2E)  # a safe shift: exp2(-inf - 0) = 0, never nan
    s = tl.sum(tl.exp2(x * _LOG2E - ml[:, None]), axis=1)
    for start in range(c0 + BLOCK_V, c1, BLOCK_V):
        x = nxt.to(tl.float32)
        nxt = tl.load(ROW + start + BLOCK_V + offs, mask=start + BLOCK_V + offs < c1, other=-float("inf"))
        m_new = tl.maximum(m, tl.max(x, axis=1))
        ml_new = tl.where(m_new == -float("inf"), 0.0, m_new * _LOG2E)
        s = s * tl.exp2(ml - ml_new) + tl.sum(tl.exp2(x * _LOG2E - ml_new[:, None]), axis=1)
        m = m_new
        ml = ml_new
    mx = tl.max(m, axis=0)  # finite: the first step holds at least one column of the range
    tot = tl.sum(s * tl.exp2((m - mx) * _LOG2E), axis=0)  # a group still at m = -inf adds 0 (not 0 * inf)
    lse = mx + tl.log(tot)
    t = tl.load(TARGETS + row)
    valid = t != ignore_index
    picked = tl.load(ROW + tl.where(valid, t, 0)).to(tl.float32)
    tl.store(LSE + row, lse)
    tl.store(NLL + row, tl.where(valid, lse - picked, 0.0))


@_jit
def _ce_loss_kernel(NLL, TARGETS, LOSS, DENOM, N, ignore_index, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """The epilogue in one program: loss = sum(nll) / denom, denom = max(count, 1) ("mean") or 1, both
    written as device scalars (no host read). Fixed summation order: deterministic."""
    offs = tl.arange(0, BLOCK)
    tot = tl.zeros([BLOCK], dtype=tl.float32)
    cnt = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, N, BLOCK):
        m = start + offs < N
        tot += tl.load(NLL + start + offs, mask=m, other=0.0)
        cnt += (tl.load(TARGETS + start + offs, mask=m, other=ignore_index) != ignore_index).to(tl.int32)
    total = tl.sum(tot, axis=0)
    count = tl.sum(cnt, axis=0)
    if MEAN:
        denom = tl.maximum(count, 1).to(tl.float32)
    else:
        denom = (count * 0 + 1).to(tl.float32)  # 1, as the same scalar type in both branches
    tl.store(LOSS, total / denom)
    tl.store(DENOM, denom)


@_jit
def _write_row_grad(ROW, OUT_ROW, V, t, lse, scale, BLOCK_V: tl.constexpr):
    """OUT_ROW[v] = (softmax(ROW)[v] - [v == t]) * scale, one pass over the row (OUT_ROW may be ROW)."""
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        mask = c < V
        x = tl.load(ROW + c, mask=mask, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(c == t, 1.0, 0.0)) * scale
        tl.store(OUT_ROW + c, g.to(OUT_ROW.dtype.element_ty), mask=mask)


@_jit
def _cross_entropy_bwd_kernel(
    DLOSS, LOGITS, TARGETS, LSE, OUT, DENOM, V, stride, out_stride, ignore_index, BLOCK_V: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    ROW = LOGITS + row * stride
    OUT_ROW = OUT + row * out_stride
    t = tl.load(TARGETS + row)
    valid = t != ignore_index
    scale = tl.where(valid, tl.load(DLOSS).to(tl.float32) / tl.load(DENOM).to(tl.float32), 0.0)
    lse = tl.load(LSE + row)
    _write_row_grad(ROW, OUT_ROW, V, t, lse, scale, BLOCK_V)


@_jit
def _cross_entropy_fwd_bwd_kernel(LOGITS, TARGETS, LSE, NLL, V, stride, ignore_index, SCALE, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(SCALE).to(tl.float32)  # a device scalar: the caller never reads its denominator back
    ROW = LOGITS + row * stride
    lse = _row_lse(ROW, V, BLOCK_V)
    t = tl.load(TARGETS + row)
    valid = t != ignore_index
    picked = tl.load(ROW + tl.where(valid, t, 0)).to(tl.float32)  # read before the row is overwritten
    tl.store(LSE + row, lse)
    tl.store(NLL + row, tl.where(valid, lse - picked, 0.0))
    _write_row_grad(ROW, ROW, V, t, lse, tl.where(valid, scale, 0.0), BLOCK_V)  # in place


@dataclass(frozen=True)
class CrossEntropyConfig:
    """block_v columns per step and num_warps of the forward (group: columns per online log-sum-exp group);
    bwd_block_v, bwd_warps of the backward and fwd+bwd kernels; loss_block rows per step and loss_warps of the one-
    program loss epilogue."""

    block_v: int
    num_warps: int
    group: int
    bwd_block_v: int
    bwd_warps: int
    loss_block: int = 8192
    loss_warps: int = 16


def cross_entropy_config(V: int, N: int = 1) -> CrossEntropyConfig:
    """The shipped tiling: forward steps of 4096 columns on 8 warps in groups of 16 (H200: 8192 x 32768 bf16 at 90 %
    of copy bandwidth with the epilogue, 8192 x 131072 bf16 99 %, fp32 103 %), narrower rows in one step on 4 warps;
    backward steps of up to 8192 columns on 16 warps. The loss epilogue takes up to 8192 rows a step (fewer, serial,
    steps were latency-bound)."""
    block_v = min(4096, triton.next_power_of_2(V))
    bwd_block_v = min(8192, triton.next_power_of_2(V))
    bwd_warps = 16 if bwd_block_v >= 8192 else (8 if bwd_block_v >= 2048 else 4)
    loss_block = min(8192, max(16, triton.next_power_of_2(N)))
    return CrossEntropyConfig(
        block_v, 8 if block_v >= 4096 else 4, min(16, block_v), bwd_block_v, bwd_warps, loss_block
    )


def _rows(logits: torch.Tensor) -> torch.Tensor:
    # rows may be a slice of a wider buffer, but each row must be contiguous
    return logits if logits.stride(1) == 1 else logits.contiguous()


def cross_entropy_fwd_lse_triton(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, config: CrossEntropyConfig | None = None
):
    """The forward's kernel only: (lse[N], nll[N]) fp32, no reduction and no host synchronisation."""
    N, V = logits.shape
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    nll = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return lse, nll
    cfg = config or cross_entropy_config(V, N)
    _ce_fwd_group_kernel[(N,)](
        logits, targets, lse, nll, V, logits.stride(0), ignore_index, BLOCK_V=cfg.block_v, GROUP=cfg.group,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return lse, nll


def cross_entropy_fwd_triton(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
    config: CrossEntropyConfig | None = None,
):  # fmt: skip
    _check("cross_entropy_fwd", logits, targets, reduction)
    logits = _rows(logits)
    targets = targets.contiguous()
    cfg = config or cross_entropy_config(logits.shape[1], targets.shape[0])
    lse, nll = cross_entropy_fwd_lse_triton(logits, targets, ignore_index, cfg)
    # loss and denom stay on the device: no host synchronisation anywhere in the forward
    loss = torch.empty((), dtype=torch.float32, device=logits.device)
    denom = torch.empty((), dtype=torch.float32, device=logits.device)
    _ce_loss_kernel[(1,)](
        nll, targets, loss, denom, targets.shape[0], ignore_index, MEAN=reduction == "mean", BLOCK=cfg.loss_block,
        num_warps=cfg.loss_warps,
    )  # fmt: skip
    return loss, lse, denom


def cross_entropy_bwd_triton(
    dloss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ignore_index: int = -100,
    denom=1.0, inplace: bool = False, config: CrossEntropyConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    _check("cross_entropy_bwd", logits, targets)
    if inplace and logits.stride(1) != 1:
        raise ValueError(f"cross_entropy_bwd: inplace needs rows of contiguous logits, got strides {logits.stride()}")
    src = _rows(logits)
    N, V = src.shape
    out = src if inplace else torch.empty_like(src)
    dloss = torch.as_tensor(dloss, dtype=torch.float32, device=logits.device).reshape(())
    if N > 0:
        cfg = config or cross_entropy_config(V, N)
        if not isinstance(denom, torch.Tensor):  # a Python number: a device fill, no host round trip
            denom = torch.full((), float(denom), dtype=torch.float32, device=logits.device)
        _cross_entropy_bwd_kernel[(N,)](
            dloss, src, targets.contiguous(), lse.contiguous(), out, denom, V, src.stride(0), out.stride(0),
            ignore_index, BLOCK_V=cfg.bwd_block_v, num_warps=cfg.bwd_warps,
        )  # fmt: skip
    return out


def cross_entropy_fwd_bwd_triton(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, scale: float = 1.0,
    config: CrossEntropyConfig | None = None,
):  # fmt: skip
    _check("cross_entropy_fwd_bwd", logits, targets)
    if logits.stride(1) != 1:
        raise ValueError(f"cross_entropy_fwd_bwd: needs rows of contiguous logits, got strides {logits.stride()}")
    N, V = logits.shape
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    nll = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N > 0:
        cfg = config or cross_entropy_config(V, N)
        if not isinstance(scale, torch.Tensor):  # a Python number: a device fill, no host round trip
            scale = torch.full((), float(scale), dtype=torch.float32, device=logits.device)
        _cross_entropy_fwd_bwd_kernel[(N,)](
            logits, targets.contiguous(), lse, nll, V, logits.stride(0), ignore_index, scale.reshape(()),
            BLOCK_V=cfg.bwd_block_v, num_warps=cfg.bwd_warps,
        )  # fmt: skip
    return nll, lse


def _fast(logits: torch.Tensor, *ts) -> bool:
    return logits.dtype != torch.float64 and use_triton(logits, *ts)


def cross_entropy_fwd(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"):
    if _fast(logits, targets):
        return cross_entropy_fwd_triton(logits, targets, ignore_index, reduction)
    _check("cross_entropy_fwd", logits, targets, reduction)
    return cross_entropy_fwd_ref(logits, targets, ignore_index, reduction)


def cross_entropy_bwd(
    dloss: torch.Tensor,
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int = -100,
    denom=1.0,
    inplace: bool = False,
) -> torch.Tensor:
    if _fast(logits, targets, lse):
        return cross_entropy_bwd_triton(dloss, logits, targets, lse, ignore_index, denom, inplace)
    return cross_entropy_bwd_ref(dloss, logits, targets, lse, ignore_index, denom, inplace)
