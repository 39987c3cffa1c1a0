"""Cross-entropy over a vocabulary, from logits, in fp32 whatever the logits dtype.

    lse[n]  = log sum_v exp(logits[n, v])                      (safe: max subtracted first)
    loss    = sum_{n counted} (lse[n] - logits[n, t_n]) / denom  (denom = count for "mean", 1 for "sum")
    dlogits = dloss * (softmax(logits[n]) - onehot(t_n)) / denom for counted rows, 0 for ignored rows

Contract:
    cross_entropy_fwd(logits[N, V], targets[N], ignore_index, reduction) -> (loss 0-dim fp32, lse[N] fp32,
        denom: float). lse is saved so the backward needs no second reduction.
    cross_entropy_bwd(dloss, logits, targets, lse, ignore_index, denom, inplace=False) -> dlogits
        (logits.dtype; written into ``logits`` itself when inplace=True and the caller no longer needs it).
    cross_entropy_fwd_bwd(logits, targets, ignore_index, scale) -> (nll[N] fp32, lse[N] fp32), and
        logits overwritten in place by scale * (softmax - onehot) (0 on ignored rows): forward and
        backward in one call for a caller that knows dloss up front (fused linear + cross-entropy).
A batch where every target is ignored has loss 0 and zero gradient under "mean" (not nan), so an
all-padding micro-batch cannot poison an accumulated step.

Triton kernels walk the vocabulary in BLOCK_V blocks with an online log-sum-exp in fp32 (never
materialising an fp32 copy of the logits):
    m_new = max(m, max_b x);   s = s * exp(m - m_new) + sum_b exp(x - m_new);   lse = m + log(s)
    _ce_fwd_split_kernel           the forward: program (row, k) reduces a column range of one row to
                                   (m, s), keeping s per lane (one block reduction per step, not two) and
                                   loading the next block before reducing the current one; with one range
                                   per row it writes lse, nll itself, else ``_ce_fwd_combine_kernel``
                                   merges the partials. H200, 2026-11-29 (bench/RESULTS.md): 41% -> 58% of
                                   copy at 8192 x 32768 bf16, 61% -> 68% at 131072, 73% -> 91% fp32 (the
                                   first version: one program per row, two block reductions per step).
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
        raise ValueError(f"{name}: expected logits [N, V] and targets [N], got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"{name}: targets must be integer class ids, got {targets.dtype}")
    if reduction is not None and reduction not in ("mean", "sum"):
        raise ValueError(f"{name}: reduction must be 'mean' or 'sum', got {reduction!r}")


def cross_entropy_fwd_ref(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                          reduction: str = "mean"):
    lf = logits.to(_acc(logits))
    lse = torch.logsumexp(lf, dim=-1)  # [N]
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, torch.zeros_like(targets))
    picked = lf.gather(1, safe_t[:, None]).squeeze(1)  # [N]
    nll = torch.where(valid, lse - picked, torch.zeros_like(lse))
    count = int(valid.sum().item())
    denom = float(max(count, 1)) if reduction == "mean" else 1.0
    loss = nll.sum() / denom
    return loss, lse, denom


def cross_entropy_bwd_ref(dloss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor,
                          lse: torch.Tensor, ignore_index: int = -100, denom: float = 1.0,
                          inplace: bool = False) -> torch.Tensor:
    acc = _acc(logits)
    valid = targets != ignore_index
    scale = torch.as_tensor(dloss, device=logits.device).to(acc) / denom
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


def cross_entropy_fwd_bwd_ref(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                              scale: float = 1.0):
    acc = _acc(logits)
    lf = logits.to(acc)
    lse = torch.logsumexp(lf, dim=-1)  # [N]
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, torch.zeros_like(targets))
    nll = torch.where(valid, lse - lf.gather(1, safe_t[:, None]).squeeze(1), torch.zeros_like(lse))
    logits.copy_(cross_entropy_bwd_ref(torch.tensor(scale, dtype=acc, device=logits.device), logits, targets,
                                       lse, ignore_index, 1.0))
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
def _ce_fwd_split_kernel(LOGITS, TARGETS, M_PART, S_PART, LSE, NLL, V, stride, cols_per_split, n_split,
                         ignore_index, BLOCK_V: tl.constexpr, FINAL: tl.constexpr):
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
    nxt = tl.load(ROW + c0 + BLOCK_V + cols, mask=c0 + BLOCK_V + cols < c1, other=-float("inf"))
    m = tl.max(x, axis=0)  # the first block holds at least one column: m is finite for finite logits
    acc = tl.exp(x - m)
    for start in range(c0 + BLOCK_V, c1, BLOCK_V):
        x = nxt.to(tl.float32)
        nxt = tl.load(ROW + start + BLOCK_V + cols, mask=start + BLOCK_V + cols < c1, other=-float("inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        acc = acc * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    s = tl.sum(acc, axis=0)
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
def _ce_fwd_combine_kernel(LOGITS, TARGETS, M_PART, S_PART, LSE, NLL, N, stride, n_split, ignore_index,
                           BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
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
    picked = tl.load(LOGITS + rows.to(tl.int64) * stride + tl.where(valid, t, 0), mask=rmask & valid,
                     other=0.0).to(tl.float32)
    tl.store(LSE + rows, lse, mask=rmask)
    tl.store(NLL + rows, tl.where(valid, lse - picked, 0.0), mask=rmask)


@_jit
def _cross_entropy_bwd_kernel(DLOSS, LOGITS, TARGETS, LSE, OUT, V, stride, out_stride, ignore_index, denom,
                              BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ROW = LOGITS + row * stride
    OUT_ROW = OUT + row * out_stride
    t = tl.load(TARGETS + row)
    valid = t != ignore_index
    scale = tl.where(valid, tl.load(DLOSS).to(tl.float32) / denom, 0.0)
    lse = tl.load(LSE + row)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        mask = c < V
        x = tl.load(ROW + c, mask=mask, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(c == t, 1.0, 0.0)) * scale
        tl.store(OUT_ROW + c, g.to(OUT.dtype.element_ty), mask=mask)


@_jit
def _cross_entropy_fwd_bwd_kernel(LOGITS, TARGETS, LSE, NLL, V, stride, ignore_index, scale,
                                  BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ROW = LOGITS + row * stride
    lse = _row_lse(ROW, V, BLOCK_V)
    t = tl.load(TARGETS + row)
    valid = t != ignore_index
    picked = tl.load(ROW + tl.where(valid, t, 0)).to(tl.float32)  # read before the row is overwritten
    tl.store(LSE + row, lse)
    tl.store(NLL + row, tl.where(valid, lse - picked, 0.0))
    row_scale = tl.where(valid, scale, 0.0)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        mask = c < V
        x = tl.load(ROW + c, mask=mask, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(c == t, 1.0, 0.0)) * row_scale
        tl.store(ROW + c, g.to(LOGITS.dtype.element_ty), mask=mask)


def _config(V: int):
    BLOCK_V = min(8192, triton.next_power_of_2(V))
    num_warps = 16 if BLOCK_V >= 8192 else (8 if BLOCK_V >= 2048 else 4)
    return BLOCK_V, num_warps


def _rows(logits: torch.Tensor) -> torch.Tensor:
    # rows may be a slice of a wider buffer, but each row must be contiguous
    return logits if logits.stride(1) == 1 else logits.contiguous()


FWD_CONFIG = None  # (BLOCK_V, num_warps, blocks per program) override, for the bench's variant sweep


def _fwd_config(V: int, esize: int = 2):
    """The forward's tiling: BLOCK_V columns per step, num_warps, and the columns each program reduces
    (cols_per_split, a multiple of BLOCK_V; splits = cdiv(V, cols_per_split) programs per row)."""
    if FWD_CONFIG is not None:
        BLOCK_V, num_warps, bpp = FWD_CONFIG
        BLOCK_V = min(BLOCK_V, triton.next_power_of_2(V))
    else:
        # measured on the H200 (bench/RESULTS.md): 16-bit logits -> one program per row (no combine pass),
        # 4096-column steps, 8 warps; fp32 logits -> 4 steps (16k columns) per program + the combine pass
        BLOCK_V = min(4096, triton.next_power_of_2(V))
        num_warps = 8 if BLOCK_V >= 4096 else 4
        bpp = 0 if esize <= 2 else 4
    return BLOCK_V, num_warps, BLOCK_V * (bpp if bpp > 0 else triton.cdiv(V, BLOCK_V))


def cross_entropy_fwd_lse_triton(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100):
    """The forward's kernels only: (lse[N], nll[N]) fp32, no reduction and no host synchronisation."""
    N, V = logits.shape
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    nll = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return lse, nll
    BLOCK_V, num_warps, cps = _fwd_config(V, logits.element_size())
    n_split = triton.cdiv(V, cps)
    if n_split == 1:
        _ce_fwd_split_kernel[(N, 1)](logits, targets, lse, lse, lse, nll, V, logits.stride(0), cps, 1,
                                     ignore_index, BLOCK_V=BLOCK_V, FINAL=True, num_warps=num_warps)
        return lse, nll
    m_part = torch.empty(N, n_split, dtype=torch.float32, device=logits.device)
    s_part = torch.empty(N, n_split, dtype=torch.float32, device=logits.device)
    _ce_fwd_split_kernel[(N, n_split)](logits, targets, m_part, s_part, lse, nll, V, logits.stride(0), cps,
                                       n_split, ignore_index, BLOCK_V=BLOCK_V, FINAL=False,
                                       num_warps=num_warps)
    BLOCK_S = triton.next_power_of_2(n_split)
    BLOCK_N = max(1, min(128, 2048 // BLOCK_S))
    _ce_fwd_combine_kernel[(triton.cdiv(N, BLOCK_N),)](logits, targets, m_part, s_part, lse, nll, N,
                                                       logits.stride(0), n_split, ignore_index,
                                                       BLOCK_N=BLOCK_N, BLOCK_S=BLOCK_S, num_warps=4)
    return lse, nll


def cross_entropy_fwd_triton(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                             reduction: str = "mean"):
    _check("cross_entropy_fwd", logits, targets, reduction)
    logits = _rows(logits)
    targets = targets.contiguous()
    lse, nll = cross_entropy_fwd_lse_triton(logits, targets, ignore_index)
    # every device op is queued before the one host synchronisation (the count, which the contract
    # returns as a float), so the GPU never waits on the host inside this call
    count = (targets != ignore_index).sum()
    total = nll.sum()
    if reduction == "mean":
        loss = total / count.clamp_min(1).to(torch.float32)
    else:
        loss = total / 1.0
    denom = float(max(int(count.item()), 1)) if reduction == "mean" else 1.0
    return loss, lse, denom


def cross_entropy_bwd_triton(dloss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor,
                             lse: torch.Tensor, ignore_index: int = -100, denom: float = 1.0,
                             inplace: bool = False) -> torch.Tensor:
    _check("cross_entropy_bwd", logits, targets)
    if inplace and logits.stride(1) != 1:
        raise ValueError(f"cross_entropy_bwd: inplace needs rows of contiguous logits, got strides "
                         f"{logits.stride()}")
    src = _rows(logits)
    N, V = src.shape
    out = src if inplace else torch.empty_like(src)
    dloss = torch.as_tensor(dloss, dtype=torch.float32, device=logits.device).reshape(())
    if N > 0:
        BLOCK_V, num_warps = _config(V)
        _cross_entropy_bwd_kernel[(N,)](dloss, src, targets.contiguous(), lse.contiguous(), out, V,
                                        src.stride(0), out.stride(0), ignore_index, float(denom),
                                        BLOCK_V=BLOCK_V, num_warps=num_warps)
    return out


def cross_entropy_fwd_bwd_triton(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                                 scale: float = 1.0):
    _check("cross_entropy_fwd_bwd", logits, targets)
    if logits.stride(1) != 1:
        raise ValueError(f"cross_entropy_fwd_bwd: needs rows of contiguous logits, got strides "
                         f"{logits.stride()}")
    N, V = logits.shape
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    nll = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N > 0:
        BLOCK_V, num_warps = _config(V)
        _cross_entropy_fwd_bwd_kernel[(N,)](logits, targets.contiguous(), lse, nll, V, logits.stride(0),
                                            ignore_index, float(scale), BLOCK_V=BLOCK_V,
                                            num_warps=num_warps)
    return nll, lse


def _fast(logits: torch.Tensor, *ts) -> bool:
    return logits.dtype != torch.float64 and use_triton(logits, *ts)


def cross_entropy_fwd(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                      reduction: str = "mean"):
    if _fast(logits, targets):
        return cross_entropy_fwd_triton(logits, targets, ignore_index, reduction)
    _check("cross_entropy_fwd", logits, targets, reduction)
    return cross_entropy_fwd_ref(logits, targets, ignore_index, reduction)


def cross_entropy_bwd(dloss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                      ignore_index: int = -100, denom: float = 1.0, inplace: bool = False) -> torch.Tensor:
    if _fast(logits, targets, lse):
        return cross_entropy_bwd_triton(dloss, logits, targets, lse, ignore_index, denom, inplace)
    return cross_entropy_bwd_ref(dloss, logits, targets, lse, ignore_index, denom, inplace)


def cross_entropy_fwd_bwd(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                          scale: float = 1.0):
    if _fast(logits, targets):
        return cross_entropy_fwd_bwd_triton(logits, targets, ignore_index, scale)
    return cross_entropy_fwd_bwd_ref(logits, targets, ignore_index, scale)
