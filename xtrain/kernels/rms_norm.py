"""RMSNorm over the last dim: y = x * inv_rms * w, inv_rms = 1 / sqrt(mean(x^2) + eps).

Contract (shared by the reference and the Triton kernels):
    rms_norm_fwd(x[..., C], w[C], eps, out_dtype=None) -> (y[..., C] in out_dtype (None: x.dtype), inv_rms[N] fp32),
        N = x.numel() // C; y is rounded once, from fp32, to out_dtype (the model's fp32 residual stream normed
        straight into bf16 for the next matmul: no cast pass)
    add_rms_norm_fwd(x[..., C], res[..., C], w, eps, out_dtype=None) -> (s = x + res in x.dtype, y, inv_rms)
        the residual add before the norm in the same pass (res promoted to x's dtype inside the add, one rounding:
        ``torch.add(x, res)`` bit for bit), y the norm of s: no second read of s
    rms_norm_bwd(dy[..., C] in any float dtype, x, w, inv_rms, dres=None, low=None) -> (dx in x.dtype, dw[C] in
        w.dtype) or, with a dtype ``low``, (dx, dw, dx.to(low))
        dres (x's shape and dtype): a gradient x already holds from another reader (the residual stream's next
        add); dx is then dres + the norm's gradient, added in fp32 and rounded once (no add pass). low: dx also
        written in that dtype from the same registers (the bf16 gradient of the branch the residual add took in:
        no cast pass)
Statistics are computed in fp32 whatever the input dtype; inv_rms is saved so backward skips the
reduction. With g = dy * w and n = C:
    dx = inv_rms * g - x * inv_rms^3 / n * sum_c(g * x)
    dw = sum_rows(dy * x * inv_rms)

Triton kernels (CUDA; CPU through the interpreter for tests), tiled by ``RmsNormConfig`` (``rms_norm_config``):
    _rms_norm_fwd_kernel   BLOCK_R rows x the whole row (BLOCK_C >= C) per program: one read of x, one
                           write of y, inv_rms saved in fp32.
    _rms_norm_bwd_kernel   a persistent grid of P programs; program p takes the [BLOCK_R, C] tiles p, p + P, ...
                           (all programs sweep the same region of memory at once), the tile loads pipelined by
                           Triton (num_stages: cp.async into shared memory, so bytes in flight cost no registers),
                           computing dx and accumulating its share of dw in an fp32 [BLOCK_R, C] register tile that
                           is reduced over rows once, at the end, into partial[p, :]. No atomics: dw is
                           deterministic run to run.
    _rms_norm_dw_kernel    the partial rows summed in a fixed order and cast to w.dtype in one launch; on sm_90+ a
                           programmatic dependent launch, started while the row kernel runs and waiting for its
                           writes, so only its work follows the row kernel, not its launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xtrain.kernels._dispatch import gdc_wait, pdl_ok, sm_count, tl, triton, use_triton
from xtrain.kernels._dispatch import jit as _jit


def rms_norm_fwd_ref(x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None):
    # no call that changes nothing (a same-dtype cast, a reshape of [N, C] rows): a batch-1 decode step on the CPU
    # runs nine of these norms on 256 values each, where every torch call costs more than its arithmetic
    xf = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [N, C]
    if xf.dtype is not torch.float64:
        xf = xf.float()
    inv_rms = (xf * xf).mean(dim=-1).add_(eps).rsqrt_()  # [N]
    y = torch.mul(xf, inv_rms.unsqueeze(1)).mul_(w if w.dtype is xf.dtype else w.to(xf.dtype))
    out = out_dtype or x.dtype
    if y.dtype is not out:
        y = y.to(out)
    return (y if x.dim() == 2 else y.reshape(x.shape)), inv_rms


def add_rms_norm_fwd_ref(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float, out_dtype=None):
    s = torch.add(x, res)
    return (s, *rms_norm_fwd_ref(s, w, eps, out_dtype))


def rms_norm_bwd_ref(dy, x, w, inv_rms, dres=None, low=None):
    # With xhat = x * r (r = inv_rms) the docstring's dx = r g - x r^3 / C sum(g x) reads
    # dx = r (g - xhat * mean_c(g * xhat)); written with in-place steps on fresh temporaries.
    C = x.shape[-1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.reshape(-1, C).to(acc)
    dyf = dy.reshape(-1, C).to(acc)
    r = inv_rms.to(acc)[:, None]  # [N, 1]
    xhat = xf * r  # [N, C]
    dw = (dyf * xhat).sum(dim=0)  # [C]
    g = dyf * w.to(acc)  # [N, C]
    dot = (g * xhat).mean(dim=-1, keepdim=True)  # [N, 1]
    dx = g.sub_(xhat.mul_(dot)).mul_(r)
    if dres is not None:
        dx.add_(dres.reshape(-1, C).to(acc))
    dx = dx.to(x.dtype).reshape(x.shape)
    return (dx, dw.to(w.dtype)) if low is None else (dx, dw.to(w.dtype), dx.to(low))


# ------------------------------------------------------------------------------------------------ Triton


@_jit
def _rms_norm_fwd_kernel(
    X, RES, S, W, Y, INV_RMS, N, C, eps, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_RES: tl.constexpr
):
    """HAS_RES: the row is X + RES (summed in X's dtype, one rounding, stored to S), then normed."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    cols = tl.arange(0, BLOCK_C)  # [BLOCK_C]
    rmask = rows < N
    cmask = cols < C
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]  # int64: N * C may pass 2^31
    x = tl.load(X + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(RES + offs, mask=mask, other=0.0).to(x.dtype)
        tl.store(S + offs, x, mask=mask)
    x = x.to(tl.float32)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / C + eps)  # [BLOCK_R]
    y = (x * inv_rms[:, None]) * w[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(INV_RMS + rows, inv_rms, mask=rmask)


@_jit(do_not_specialize=["LOW"])
def _rms_norm_bwd_kernel(
    DY, X, W, INV_RMS, DRES, DX, DX_LOW, DW_PARTIAL, N, C, LOW, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    STAGES: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """Program pid: tiles pid, pid + P, pid + 2P, ... of BLOCK_R rows, loads pipelined STAGES - 1 tiles ahead; dw
    partial row pid, so the sum is deterministic. HAS_RES: dx also adds DRES (the gradient x holds already).
    LOW (0 or 1, a run-time value, never specialized): dx also stored to DX_LOW in its dtype (rounded from DX's
    value). A run-time switch, not a constexpr: with and without the copy it is one compiled kernel, so the
    register layouts, and with them the order of the row sums, are the same (a constexpr gave two kernels whose
    dx differed in the last bit on the H100)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)  # reduced over rows once, at the end
    for t in tl.range(pid, tl.cdiv(N, BLOCK_R), tl.num_programs(0), num_stages=STAGES):
        rows_s = (t * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # int64 so row * C cannot overflow
        rm = rows_s < N
        m_s = rm[:, None] & cmask[None, :]
        o_s = rows_s[:, None] * C + cols[None, :]
        xs = tl.load(X + o_s, mask=m_s, other=0.0).to(tl.float32)
        dys = tl.load(DY + o_s, mask=m_s, other=0.0).to(tl.float32)
        rs = tl.load(INV_RMS + rows_s, mask=rm, other=0.0)
        gs = dys * w[None, :]
        dots = tl.sum(gs * xs, axis=1)
        dxs = rs[:, None] * gs - xs * ((rs * rs * rs / C) * dots)[:, None]  # r g - x r^3 / C sum(g x)
        if HAS_RES:
            dxs += tl.load(DRES + o_s, mask=m_s, other=0.0).to(tl.float32)
        dxs = dxs.to(DX.dtype.element_ty)
        tl.store(DX + o_s, dxs, mask=m_s)
        tl.store(DX_LOW + o_s, dxs.to(DX_LOW.dtype.element_ty), mask=m_s & (rows_s < N * LOW)[:, None])
        dw_acc += dys * xs * rs[:, None]
    tl.store(DW_PARTIAL + pid.to(tl.int64) * C + cols, tl.sum(dw_acc, axis=0), mask=cmask)


@_jit
def _rms_norm_dw_kernel(DW_PARTIAL, DW, P, C, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    """The dw second pass in one launch: program j sums columns [j * BLOCK_C, ...) of the P partial rows
    in a fixed order (deterministic) and writes dw already cast to w.dtype (the torch form was two
    launches: partial.sum(0), then .to(w.dtype)). PDL: launched as a programmatic dependent launch (sm_90):
    its programs may start while the backward kernel finishes, and wait (griddepcontrol.wait) until that
    kernel's writes are visible before reading the partial rows; the launch latency overlaps the tail."""
    if PDL:
        gdc_wait()
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    ps = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        m = ((p0 + ps) < P)[:, None] & cmask[None, :]
        acc += tl.load(DW_PARTIAL + (p0 + ps).to(tl.int64)[:, None] * C + cols[None, :], mask=m, other=0.0)
    tl.store(DW + cols, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=cmask)


@dataclass(frozen=True)
class RmsNormConfig:
    """Forward: fwd_rows rows of block_c (>= C) columns per program on fwd_warps. Backward: bwd_rows rows per tile on
    bwd_warps, per_sm programs per SM, stages of pipelined tile loads. dw pass: up to dw_rows partial rows per step,
    dw_block_c columns per program, dw_warps."""

    block_c: int
    fwd_rows: int
    fwd_warps: int
    bwd_rows: int
    bwd_warps: int
    per_sm: int
    stages: int
    dw_rows: int = 512
    dw_block_c: int = 16
    dw_warps: int = 4


def rms_norm_config(C: int) -> RmsNormConfig:
    """The shipped tiling for rows of C (the same for every dtype and GPU). Forward: ~4k elements per program for
    short rows. Backward, measured best on the H200: long rows (>= 2048) 8k-element tiles, 16 warps, one program per
    SM, 3 stages; short rows 2k-element tiles, 4 warps, 4 per SM, 4 stages (86 % of copy at 65536 x 768 bf16)."""
    block_c = triton.next_power_of_2(C)
    fwd_rows = max(1, min(16, 4096 // block_c))
    fwd_warps = 4 if block_c * fwd_rows <= 4096 else (8 if block_c <= 8192 else 16)
    tile, warps, per_sm, stages = (8192, 16, 1, 3) if block_c >= 2048 else (2048, 4, 4, 4)
    return RmsNormConfig(block_c, fwd_rows, fwd_warps, max(1, tile // block_c), warps, per_sm, stages)


def _num_programs(x: torch.Tensor, N: int, per_sm: int) -> int:
    if x.is_cuda:
        return max(1, min(N, per_sm * sm_count(x.device)))
    return max(1, min(N, 4))  # the interpreter: few programs, each several rows


def rms_norm_fwd_triton(x, w, eps: float, out_dtype=None, config: RmsNormConfig | None = None, res=None):
    """(y, inv_rms); with ``res``: (x + res, y, inv_rms), y the norm of the sum (``add_rms_norm_fwd``)."""
    C = x.shape[-1]
    x2 = x.reshape(-1, C).contiguous()  # [N, C]
    N = x2.shape[0]
    y = torch.empty_like(x2, dtype=out_dtype or x.dtype)
    inv_rms = torch.empty(N, dtype=torch.float32, device=x.device)
    r2 = res.reshape(-1, C).contiguous() if res is not None else x2  # x2: a placeholder, never read
    s = torch.empty_like(x2) if res is not None else x2
    if N > 0:
        cfg = config or rms_norm_config(C)
        _rms_norm_fwd_kernel[(triton.cdiv(N, cfg.fwd_rows),)](
            x2, r2, s, w.contiguous(), y, inv_rms, N, C, eps, BLOCK_R=cfg.fwd_rows, BLOCK_C=cfg.block_c,
            HAS_RES=res is not None, num_warps=cfg.fwd_warps,
        )  # fmt: skip
    y = y.reshape(x.shape)
    return (y, inv_rms) if res is None else (s.reshape(x.shape), y, inv_rms)


def rms_norm_bwd_triton(
    dy: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    inv_rms: torch.Tensor,
    dres: torch.Tensor | None = None,
    config: RmsNormConfig | None = None,
    low: torch.dtype | None = None,
):
    C = x.shape[-1]
    x2 = x.reshape(-1, C).contiguous()  # [N, C]
    dy2 = dy.reshape(-1, C).contiguous()
    N = x2.shape[0]
    dx = torch.empty_like(x2)
    res = dres.reshape(-1, C).contiguous() if dres is not None else dx  # dx: a placeholder, never read
    # without ``low`` a bf16 view of dx stands in (never written): the kernel keeps the DX_LOW dtype of the bf16 path
    dx_low = torch.empty_like(x2, dtype=low) if low is not None else dx.view(torch.bfloat16)
    tail = () if low is None else (dx_low.reshape(x.shape),)
    if N == 0:
        return dx.reshape(x.shape), torch.zeros_like(w), *tail
    cfg = config or rms_norm_config(C)
    P = _num_programs(x2, N, cfg.per_sm)
    P = triton.cdiv(N, triton.cdiv(N, P))  # no program without rows
    dw_partial = torch.empty(P, C, dtype=torch.float32, device=x.device)  # [P, C]
    _rms_norm_bwd_kernel[(P,)](
        dy2, x2, w.contiguous(), inv_rms.contiguous(), res, dx, dx_low, dw_partial, N, C, int(low is not None),
        BLOCK_R=cfg.bwd_rows, BLOCK_C=cfg.block_c, STAGES=cfg.stages, HAS_RES=dres is not None,
        num_warps=cfg.bwd_warps,
    )  # fmt: skip
    dw = torch.empty(C, dtype=w.dtype, device=x.device)
    pdl = pdl_ok(x)
    _rms_norm_dw_kernel[(triton.cdiv(C, cfg.dw_block_c),)](
        dw_partial, dw, P, C, BLOCK_P=min(cfg.dw_rows, triton.next_power_of_2(P)), BLOCK_C=cfg.dw_block_c,
        num_warps=cfg.dw_warps, **(dict(PDL=True, launch_pdl=True) if pdl else {}),
    )  # fmt: skip
    return dx.reshape(x.shape), dw, *tail


def rms_norm_fwd(x: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None):
    if x.dtype != torch.float64 and use_triton(x, w):
        return rms_norm_fwd_triton(x, w, eps, out_dtype)
    return rms_norm_fwd_ref(x, w, eps, out_dtype)


def add_rms_norm_fwd(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float, out_dtype=None):
    if x.dtype != torch.float64 and use_triton(x, res, w):
        return rms_norm_fwd_triton(x, w, eps, out_dtype, res=res)
    return add_rms_norm_fwd_ref(x, res, w, eps, out_dtype)


def rms_norm_bwd(dy, x, w, inv_rms, dres=None, low=None):
    if x.dtype != torch.float64 and use_triton(dy, x, w, inv_rms):
        return rms_norm_bwd_triton(dy, x, w, inv_rms, dres, low=low)
    return rms_norm_bwd_ref(dy, x, w, inv_rms, dres, low)
