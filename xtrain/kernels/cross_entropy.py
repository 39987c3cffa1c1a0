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
    cross_entropy_fwd_bwd(logits, targets, ignore_index, scale) -> (nll[N] fp32, lse[N] fp32), and
        (scale: a Python number or a 0-dim device tensor)
        logits overwritten in place by scale * (softmax - onehot) (0 on ignored rows): forward and
        backward in one call for a caller that knows dloss up front (fused linear + cross-entropy).
A batch where every target is ignored has loss 0 and zero gradient under "mean" (not nan), so an
all-padding micro-batch cannot poison an accumulated step.

Triton kernels walk the vocabulary in BLOCK_V blocks with an online log-sum-exp in fp32 (never
materialising an fp32 copy of the logits):
    m_new = max(m, max_b x);   s = s * exp(m - m_new) + sum_b exp(x - m_new);   lse = m + log(s)
    _ce_fwd_group_kernel           the forward (default): like the split kernel, but each step's block is a
                                   [BLOCK_V / 16, 16] tile with an online log-sum-exp per 16-column group,
                                   so the loop has no block-wide reduction (no shared memory, no barrier),
                                   merged once per row at the end; exp2 with log2(e) folded into one FMA.
                                   H200, 2026-11-29: 73% -> 90% of copy at 8192 x 32768 bf16 (with the
                                   one-step loss epilogue), 85% -> 99% at 131072, fp32 103%.
    _ce_fwd_split_kernel           the previous forward: program (row, k) reduces a column range of one row to
                                   (m, s), keeping s per lane (one block reduction per step, not two) and
                                   loading the next block before reducing the current one; with one range
                                   per row it writes lse, nll itself, else ``_ce_fwd_combine_kernel``
                                   merges the partials. H200, 2026-11-29 (bench/RESULTS.md): 41% -> 58% of
                                   copy at 8192 x 32768 bf16, 61% -> 68% at 131072, 73% -> 91% fp32 (the
                                   first version: one program per row, two block reductions per step).
    _ce_fwd_rows_kernel            alternative forward (FWD_CONFIG with rows > 1): ROWS rows per program in
                                   [ROWS, BLOCK_V] tiles, one warp per tile row, so the per-step max is a
                                   warp shuffle, not a block-wide reduction (H200: slower than the split
                                   kernel at every size, e.g. 0.181-0.211 vs 0.174 ms at 8192 x 32768 bf16,
                                   0.54-0.82 vs 0.49 ms at 4096 x 131072 fp32; not the default)
    _ce_loss_kernel                the epilogue in one program: loss = sum(nll) / denom and denom as device
                                   scalars (replaced count/sum/clamp/divide torch launches and the host read)
    _cross_entropy_bwd_kernel      one read + one write: (exp(x - lse) - [v == t]) * dloss / denom
    _cross_entropy_fwd_bwd_kernel  both: two reads + one write, gradient in place
"""

from __future__ import annotations

import torch

from xtrain.kernels._dispatch import acc_dtype as _acc
from xtrain.kernels._dispatch import jit as _jit
from xtrain.kernels._dispatch import tl, triton, use_triton


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


@_jit
def _row_lse(ROW, V, BLOCK_V: tl.constexpr):
    """Online log-sum-exp of one row of V logits, in fp32 (one exp per logit).

    Measured alternative (H200, 2026-11-29): per-lane running max/sum with no reduction in the loop,
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
def _finish_range(ROW, TARGETS, M_PART, S_PART, LSE, NLL, row, k, n_split, ignore_index, m, s, FINAL: tl.constexpr):
    """A program's column range reduced to (max m, sum s of exp(x - m)): with one range per row (FINAL),
    lse = m + log s and the row's nll; else the partial (m, s) for ``_ce_fwd_combine_kernel``."""
    if FINAL:
        lse = m + tl.log(s)
        t = tl.load(TARGETS + row)
        valid = t != ignore_index
        picked = tl.load(ROW + tl.where(valid, t, 0)).to(tl.float32)
        tl.store(LSE + row, lse)
        tl.store(NLL + row, tl.where(valid, lse - picked, 0.0))
    else:
        tl.store(M_PART + row * n_split + k, m)
        tl.store(S_PART + row * n_split + k, s)


@_jit
def _ce_fwd_split_kernel(
    LOGITS,
    TARGETS,
    M_PART,
    S_PART,
    LSE,
    NLL,
    V,
    stride,
    cols_per_split,
    n_split,
    ignore_index,
    BLOCK_V: tl.constexpr,
    FINAL: tl.constexpr,
    STAGES: tl.constexpr = 0,
):
    """Program (row, k) reduces columns [k * cols_per_split, ...) of one row to a partial (max m, sum s),
    s = sum exp(x - m). One block reduction (the max) per BLOCK_V step: the sum is kept per lane,
    rescaled by one scalar exp per step, and reduced once at the end (~1 exp per logit). The next
    block's load is issued before the current block is reduced, so a load is in flight while the
    program waits on its reduction. FINAL (one split per row): lse and nll written directly."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    ROW = LOGITS + row * stride
    c0 = k * cols_per_split
    c1 = tl.minimum(c0 + cols_per_split, V)
    cols = tl.arange(0, BLOCK_V)
    x = tl.load(ROW + c0 + cols, mask=c0 + cols < c1, other=-float("inf")).to(tl.float32)
    if STAGES <= 1:  # the hand prefetch: the second block's load goes out before the first is reduced
        nxt = tl.load(ROW + c0 + BLOCK_V + cols, mask=c0 + BLOCK_V + cols < c1, other=-float("inf"))
    m = tl.max(x, axis=0)  # the first block holds at least one column: m is finite for finite logits
    acc = tl.exp(x - m)
    if STAGES > 1:  # Triton pipelines the loads itself (cp.async into shared memory), STAGES - 1 ahead
        for start in tl.range(c0 + BLOCK_V, c1, BLOCK_V, num_stages=STAGES):
            x = tl.load(ROW + start + cols, mask=start + cols < c1, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            acc = acc * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
    else:
        for start in range(c0 + BLOCK_V, c1, BLOCK_V):
            x = nxt.to(tl.float32)
            nxt = tl.load(ROW + start + BLOCK_V + cols, mask=start + BLOCK_V + cols < c1, other=-float("inf"))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            acc = acc * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
    _finish_range(ROW, TARGETS, M_PART, S_PART, LSE, NLL, row, k, n_split, ignore_index, m, tl.sum(acc, axis=0), FINAL)


@_jit
def _ce_fwd_group_kernel(
    LOGITS,
    TARGETS,
    M_PART,
    S_PART,
    LSE,
    NLL,
    V,
    stride,
    cols_per_split,
    n_split,
    ignore_index,
    BLOCK_V: tl.constexpr,
    GROUP: tl.constexpr,
    FINAL: tl.constexpr,
):
    """The split kernel's job with no block-wide reduction inside the loop. Each BLOCK_V step is loaded
    as a [BLOCK_V // GROUP, GROUP] tile of GROUP consecutive columns per tile row, and every tile row
    keeps its own running max and sum (an online log-sum-exp per group of columns): the per-step max is
    over GROUP columns that Triton lays out within one thread or two (16-byte vectors), so it needs no
    shared memory and no barrier. The groups are merged once, at the end (M = max m_g,
    S = sum s_g 2^(m_g - M)). Costs one extra exp per GROUP columns (the rescale of each group's sum).
    Exponentials in base 2 with log2(e) folded in: 2^(x·log2e − m·log2e), one FMA and one MUFU.EX2 per
    logit."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    ROW = LOGITS + row * stride
    c0 = k * cols_per_split
    c1 = tl.minimum(c0 + cols_per_split, V)
    NG: tl.constexpr = BLOCK_V // GROUP
    LOG2E: tl.constexpr = 1.4426950408889634  # exp(x) = exp2(x * LOG2E)
    offs = tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [NG, GROUP] columns
    x = tl.load(ROW + c0 + offs, mask=c0 + offs < c1, other=-float("inf")).to(tl.float32)
    nxt = tl.load(ROW + c0 + BLOCK_V + offs, mask=c0 + BLOCK_V + offs < c1, other=-float("inf"))
    m = tl.max(x, axis=1)  # [NG]; -inf for a group with no column yet
    ml = tl.where(m == -float("inf"), 0.0, m * LOG2E)  # a safe shift: exp2(-inf - 0) = 0, never nan
    s = tl.sum(tl.exp2(x * LOG2E - ml[:, None]), axis=1)
    for start in range(c0 + BLOCK_V, c1, BLOCK_V):
        x = nxt.to(tl.float32)
        nxt = tl.load(ROW + start + BLOCK_V + offs, mask=start + BLOCK_V + offs < c1, other=-float("inf"))
        m_new = tl.maximum(m, tl.max(x, axis=1))
        ml_new = tl.where(m_new == -float("inf"), 0.0, m_new * LOG2E)
        s = s * tl.exp2(ml - ml_new) + tl.sum(tl.exp2(x * LOG2E - ml_new[:, None]), axis=1)
        m = m_new
        ml = ml_new
    mx = tl.max(m, axis=0)  # finite: the first step holds at least one column of the range
    tot = tl.sum(s * tl.exp2((m - mx) * LOG2E), axis=0)  # a group still at m = -inf adds 0 (not 0 * inf)
    _finish_range(ROW, TARGETS, M_PART, S_PART, LSE, NLL, row, k, n_split, ignore_index, mx, tot, FINAL)


@_jit
def _ce_fwd_combine_kernel(
    LOGITS,
    TARGETS,
    M_PART,
    S_PART,
    LSE,
    NLL,
    N,
    stride,
    n_split,
    ignore_index,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """lse[n] = M + log(sum_k s_k exp(m_k - M)), M = max_k m_k, over the n_split partials of each row."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_S)
    rmask = rows < N
    mask = rmask[:, None] & (ks[None, :] < n_split)
    offs = rows.to(tl.int64)[:, None] * n_split + ks[None, :]
    m = tl.load(M_PART + offs, mask=mask, other=-float("inf"))
    s = tl.load(S_PART + offs, mask=mask, other=0.0)
    mx = tl.max(m, axis=1)
    mx_safe = tl.where(rmask, mx, 0.0)
    total = tl.sum(tl.where(mask, s * tl.exp(m - mx_safe[:, None]), 0.0), axis=1)
    lse = mx_safe + tl.log(tl.where(rmask, total, 1.0))  # rows past N: no log(0)
    t = tl.load(TARGETS + rows, mask=rmask, other=ignore_index)
    valid = t != ignore_index
    picked = tl.load(LOGITS + rows.to(tl.int64) * stride + tl.where(valid, t, 0), mask=rmask & valid, other=0.0).to(
        tl.float32
    )
    tl.store(LSE + rows, lse, mask=rmask)
    tl.store(NLL + rows, tl.where(valid, lse - picked, 0.0), mask=rmask)


@_jit
def _ce_fwd_rows_kernel(
    LOGITS,
    TARGETS,
    LSE,
    NLL,
    N,
    V,
    stride,
    ignore_index,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    STAGES: tl.constexpr = 0,
):
    """ROWS rows per program, walked together in [ROWS, BLOCK_V] tiles. With BLOCK_V = 32 lanes x one
    16-byte vector (256 bf16, 128 fp32 columns) Triton lays each tile row on a single warp (checked in
    sm_90 TTGIR: warpsPerCTA = [num_warps, 1]), so the per-step row max is a warp shuffle reduction with
    no shared memory and no barrier, where the one-row kernel's 4096-column step needs a block-wide
    reduction (shared memory + bar.sync) every step. Same online log-sum-exp as the split kernel: the
    sum kept per lane, the next tile loaded before the current one is reduced."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < N
    rows64 = tl.where(rmask, rows, 0).to(tl.int64)
    base = LOGITS + rows64[:, None] * stride  # [ROWS, 1]
    cols = tl.arange(0, BLOCK_V)[None, :]
    x = tl.load(base + cols, mask=rmask[:, None] & (cols < V), other=-float("inf")).to(tl.float32)
    if STAGES <= 1:  # the hand prefetch: the second tile's load goes out before the first is reduced
        nxt = tl.load(base + BLOCK_V + cols, mask=rmask[:, None] & (BLOCK_V + cols < V), other=-float("inf"))
    m = tl.where(rmask, tl.max(x, axis=1), 0.0)  # rows past N: 0, not -inf (no inf - inf below)
    acc = tl.exp(x - m[:, None])
    if STAGES > 1:  # Triton pipelines the loads itself (cp.async into shared memory), STAGES - 1 ahead
        for start in tl.range(BLOCK_V, V, BLOCK_V, num_stages=STAGES):
            x = tl.load(base + start + cols, mask=rmask[:, None] & (start + cols < V), other=-float("inf")).to(
                tl.float32
            )
            m_new = tl.maximum(m, tl.max(x, axis=1))
            acc = acc * tl.exp(m - m_new)[:, None] + tl.exp(x - m_new[:, None])
            m = m_new
    else:
        for start in range(BLOCK_V, V, BLOCK_V):
            x = nxt.to(tl.float32)
            nxt = tl.load(
                base + start + BLOCK_V + cols, mask=rmask[:, None] & (start + BLOCK_V + cols < V), other=-float("inf")
            )
            m_new = tl.maximum(m, tl.max(x, axis=1))
            acc = acc * tl.exp(m - m_new)[:, None] + tl.exp(x - m_new[:, None])
            m = m_new
    lse = m + tl.log(tl.where(rmask, tl.sum(acc, axis=1), 1.0))
    t = tl.load(TARGETS + rows, mask=rmask, other=ignore_index)
    valid = t != ignore_index
    picked = tl.load(LOGITS + rows64 * stride + tl.where(valid, t, 0), mask=rmask & valid, other=0.0).to(tl.float32)
    tl.store(LSE + rows, lse, mask=rmask)
    tl.store(NLL + rows, tl.where(valid, lse - picked, 0.0), mask=rmask)


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


def _config(V: int):
    BLOCK_V = min(8192, triton.next_power_of_2(V))
    num_warps = 16 if BLOCK_V >= 8192 else (8 if BLOCK_V >= 2048 else 4)
    return BLOCK_V, num_warps


def _rows(logits: torch.Tensor) -> torch.Tensor:
    # rows may be a slice of a wider buffer, but each row must be contiguous
    return logits if logits.stride(1) == 1 else logits.contiguous()


FWD_CONFIG = None  # (BLOCK_V, num_warps, blocks per program[, rows per program[, stages[, group]]]) override, for
# the bench's sweep; stages >= 2: Triton's own pipelining of the block loads (num_stages) instead of the hand
# prefetch; group > 0: _ce_fwd_group_kernel, an online log-sum-exp per group of that many columns
# the defaults by logits element size, (BLOCK_V, num_warps, blocks per program, rows, stages, group); measured on
# the H200 (bench/RESULTS.md, 2026-11-29 session 3): the group kernel, whole row per program, 4096-column steps,
# 8 warps, 16-column groups, for 16- and 32-bit logits: 8192 x 32768 bf16 0.173 -> 0.141 ms (73% -> 90% of copy,
# with the loss step below), 8192 x 131072 bf16 0.592 -> 0.512 ms (85% -> 99%), 4096 x 131072 fp32 0.496 ->
# 0.493 ms (102% -> 103%; was 4 steps per program + the combine pass).
FWD_DEFAULTS = {2: (4096, 8, 0, 1, 0, 16), 4: (4096, 8, 0, 1, 0, 16)}
LOSS_CONFIG = (8192, 16)  # _ce_loss_kernel's (BLOCK, num_warps): one program, BLOCK rows a step (H200: 8192 x
# 32768 bf16, 0.148 -> 0.141 ms against (1024, 4), whose 8 serial steps were latency-bound)
EPILOGUE = "kernel"  # "kernel": _ce_loss_kernel; "torch": the same sums as torch ops (bench comparison)


def _fwd_config(V: int, esize: int = 2):
    """The forward's tiling: BLOCK_V columns per step, num_warps, the columns each program reduces
    (cols_per_split, a multiple of BLOCK_V; splits = cdiv(V, cols_per_split) programs per row) and the
    rows per program (ROWS > 1: ``_ce_fwd_rows_kernel``, the whole row, no combine pass)."""
    cfg = FWD_CONFIG if FWD_CONFIG is not None else FWD_DEFAULTS[2 if esize <= 2 else 4]
    BLOCK_V, num_warps, bpp = cfg[:3]
    rows = cfg[3] if len(cfg) > 3 else 1
    stages = cfg[4] if len(cfg) > 4 else 0
    group = cfg[5] if len(cfg) > 5 else 0
    BLOCK_V = min(BLOCK_V, triton.next_power_of_2(V))
    if FWD_CONFIG is None and BLOCK_V < 4096 and rows == 1:
        num_warps = 4  # short rows (tests, small vocabularies): fewer warps than a 4096-column step needs
    if rows > 1:
        bpp = 0
    group = min(group, BLOCK_V)
    return (
        BLOCK_V,
        num_warps,
        BLOCK_V * (bpp if bpp > 0 else triton.cdiv(V, BLOCK_V)),
        rows,
        stages,
        group if rows == 1 else 0,
    )


def cross_entropy_fwd_lse_triton(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100):
    """The forward's kernels only: (lse[N], nll[N]) fp32, no reduction and no host synchronisation."""
    N, V = logits.shape
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    nll = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return lse, nll
    BLOCK_V, num_warps, cps, rows, stages, group = _fwd_config(V, logits.element_size())
    if rows > 1:
        _ce_fwd_rows_kernel[(triton.cdiv(N, rows),)](
            logits,
            targets,
            lse,
            nll,
            N,
            V,
            logits.stride(0),
            ignore_index,
            ROWS=rows,
            BLOCK_V=BLOCK_V,
            STAGES=stages,
            num_warps=num_warps,
        )
        return lse, nll
    n_split = triton.cdiv(V, cps)

    def split(grid, m_part, s_part, final):
        if group > 0:
            _ce_fwd_group_kernel[grid](
                logits,
                targets,
                m_part,
                s_part,
                lse,
                nll,
                V,
                logits.stride(0),
                cps,
                n_split,
                ignore_index,
                BLOCK_V=BLOCK_V,
                GROUP=group,
                FINAL=final,
                num_warps=num_warps,
            )
        else:
            _ce_fwd_split_kernel[grid](
                logits,
                targets,
                m_part,
                s_part,
                lse,
                nll,
                V,
                logits.stride(0),
                cps,
                n_split,
                ignore_index,
                BLOCK_V=BLOCK_V,
                FINAL=final,
                STAGES=stages,
                num_warps=num_warps,
            )

    if n_split == 1:
        split((N, 1), lse, lse, True)
        return lse, nll
    m_part = torch.empty(N, n_split, dtype=torch.float32, device=logits.device)
    s_part = torch.empty(N, n_split, dtype=torch.float32, device=logits.device)
    split((N, n_split), m_part, s_part, False)
    BLOCK_S = triton.next_power_of_2(n_split)
    BLOCK_N = max(1, min(128, 2048 // BLOCK_S))
    _ce_fwd_combine_kernel[(triton.cdiv(N, BLOCK_N),)](
        logits,
        targets,
        m_part,
        s_part,
        lse,
        nll,
        N,
        logits.stride(0),
        n_split,
        ignore_index,
        BLOCK_N=BLOCK_N,
        BLOCK_S=BLOCK_S,
        num_warps=4,
    )
    return lse, nll


def cross_entropy_fwd_triton(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
):
    _check("cross_entropy_fwd", logits, targets, reduction)
    logits = _rows(logits)
    targets = targets.contiguous()
    lse, nll = cross_entropy_fwd_lse_triton(logits, targets, ignore_index)
    # loss and denom stay on the device: no host synchronisation anywhere in the forward
    if EPILOGUE == "torch":
        if reduction == "mean":
            denom = (targets != ignore_index).sum().clamp_min(1).to(torch.float32)
        else:
            denom = torch.ones((), dtype=torch.float32, device=logits.device)
        return nll.sum() / denom, lse, denom
    loss = torch.empty((), dtype=torch.float32, device=logits.device)
    denom = torch.empty((), dtype=torch.float32, device=logits.device)
    block, warps = LOSS_CONFIG
    _ce_loss_kernel[(1,)](
        nll,
        targets,
        loss,
        denom,
        targets.shape[0],
        ignore_index,
        MEAN=reduction == "mean",
        BLOCK=min(block, max(16, triton.next_power_of_2(targets.shape[0]))),
        num_warps=warps,
    )
    return loss, lse, denom


def cross_entropy_bwd_triton(
    dloss: torch.Tensor,
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int = -100,
    denom=1.0,
    inplace: bool = False,
) -> torch.Tensor:
    _check("cross_entropy_bwd", logits, targets)
    if inplace and logits.stride(1) != 1:
        raise ValueError(f"cross_entropy_bwd: inplace needs rows of contiguous logits, got strides {logits.stride()}")
    src = _rows(logits)
    N, V = src.shape
    out = src if inplace else torch.empty_like(src)
    dloss = torch.as_tensor(dloss, dtype=torch.float32, device=logits.device).reshape(())
    if N > 0:
        BLOCK_V, num_warps = _config(V)
        if not isinstance(denom, torch.Tensor):  # a Python number: a device fill, no host round trip
            denom = torch.full((), float(denom), dtype=torch.float32, device=logits.device)
        _cross_entropy_bwd_kernel[(N,)](
            dloss,
            src,
            targets.contiguous(),
            lse.contiguous(),
            out,
            denom,
            V,
            src.stride(0),
            out.stride(0),
            ignore_index,
            BLOCK_V=BLOCK_V,
            num_warps=num_warps,
        )
    return out


def cross_entropy_fwd_bwd_triton(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, scale: float = 1.0
):
    _check("cross_entropy_fwd_bwd", logits, targets)
    if logits.stride(1) != 1:
        raise ValueError(f"cross_entropy_fwd_bwd: needs rows of contiguous logits, got strides {logits.stride()}")
    N, V = logits.shape
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    nll = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N > 0:
        BLOCK_V, num_warps = _config(V)
        if not isinstance(scale, torch.Tensor):  # a Python number: a device fill, no host round trip
            scale = torch.full((), float(scale), dtype=torch.float32, device=logits.device)
        _cross_entropy_fwd_bwd_kernel[(N,)](
            logits,
            targets.contiguous(),
            lse,
            nll,
            V,
            logits.stride(0),
            ignore_index,
            scale.reshape(()),
            BLOCK_V=BLOCK_V,
            num_warps=num_warps,
        )
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


def cross_entropy_fwd_bwd(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, scale: float = 1.0):
    if _fast(logits, targets):
        return cross_entropy_fwd_bwd_triton(logits, targets, ignore_index, scale)
    return cross_entropy_fwd_bwd_ref(logits, targets, ignore_index, scale)
