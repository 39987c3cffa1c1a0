"""AdamW (Loshchilov & Hutter, decoupled weight decay) over lists of tensors, updating in place.

Per parameter p with gradient g (all fp32 master tensors), at step t >= 1:
    p   <- p * (1 - lr * wd)                      decoupled weight decay
    m   <- m + (1 - b1) * (g - m)                 (torch's lerp)
    v   <- v * b2 + (1 - b2) * g * g
    p   <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
The reference performs exactly torch.optim.AdamW's single-tensor (foreach=False) operations in the same
order, so on CPU in fp32 it matches torch bit for bit (a test checks this).

Contract: adamw_step(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decays,
          copies=None) -> None. ``weight_decays`` is one float per parameter. ``copies`` (optional) is a list
          of low-precision compute copies (e.g. bf16) to refresh from the updated masters in the same pass.

Triton: ``_adamw_kernel`` updates every parameter in ONE launch. The work is cut into blocks of BLOCK elements; a block
table (int64 [n_blocks, 8]: element offsets of the block in p, m, v and the copy, its start inside its tensor, its
length, the length to copy (0: no copy), its tensor index) says where each block lives. Offsets are taken relative to
one base tensor per state (the first parameter, the first moment, ...), so a block's address is ``base + offset`` in the
one flat device address space: no copying into a flat buffer and back. The table depends only on the addresses and sizes
of the tensors that live across steps (params, moments, copies) and is built once and cached. The gradients are new
tensors each step, so where each one starts (relative to the first) is a second, per-tensor table of n int64
(``_grad_offsets``), cached by the gradients' addresses: eager steps that reuse the allocator's blocks hit it; a CUDA
graph capture, whose gradients come from the graph's own pool, builds it once into pinned host memory that the cache
keeps alive, and the graph records its copy to the device as one 8n-byte copy node (no pageable host memory, which a
capture refuses). Each element moves once: read p, g, m, v (16 B), write p, m, v and the bf16 copy (14 B).

Full blocks (all but each tensor's last) take an unmasked path: with the length read from the table, a mask ``i < n``
has unknown divisibility and Triton emitted one 4-byte access per element (seen in the sm_90 PTX); unmasked, the
accesses are 16 bytes wide. H200: 2.50 ms for 341M parameters in 217 tensors (96% of copy bandwidth; 4.89 ms masked).

Device scalars (``adamw_step_triton_device``, the captured training step): the same kernel reads the step size, the bias
correction, a gradient scale (the clip coefficient, applied as each gradient is read) and a go-ahead flag from a
4-element device tensor that a few 0-dim torch ops compute in float64 from the lr, step and clip tensors
(``device_scalars``), in the order the host computes them, so nothing is read back to the host and the result is the
host path's bit for bit; with the flag off (a non-finite step) nothing is written.

Bit-exactness: the kernel repeats the rounding steps of the CUDA reference (torch's own kernels), with
Triton's fp contraction switched off and every fused multiply-add written out where torch has one:
    p = p * fl(1 - lr*wd)                               mul_
    m = fma(1 - b1, g - m, m)                           lerp_ (weight < 0.5; nvcc contracts)
    v = fma(1 - b2, g * g, v * b2)                      mul_, then addcmul_ = fma(value, t1 * t2, self)
    d = sqrt_rn(v) * fl(1 / fl(sqrt(bc2))) + eps        CUDA divides by a CPU scalar as * its reciprocal
    p = fma(-lr / bc1, div_rn(m, d), p)                 addcdiv_ = fma(value, t1 / t2, self)
On CUDA this matches the reference bit for bit (checked by the GPU test). On CPU, torch's own kernels
round differently (true division by the scalar, no fma in addcmul/addcdiv), so the interpreter run
agrees with the CPU reference to a few ulp, not bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from xtrain.kernels._dispatch import jit as _jit
from xtrain.kernels._dispatch import tl, use_triton


def adamw_step_ref(
    params, grads, exp_avgs, exp_avg_sqs, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
    weight_decays, copies=None,
) -> None:  # fmt: skip
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        wd = weight_decays[i]
        if wd != 0:
            p.mul_(1 - lr * wd)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)
        if copies is not None and copies[i] is not None:
            copies[i].copy_(p)


# ------------------------------------------------------------------------------------------------ Triton

BLOCK = 4096
NUM_WARPS = 8


@_jit
def _adamw_update(
    p, g, m, v, decay, lerp_w, beta2, one_minus_beta2, neg_step_size, inv_bc2_sqrt, eps, LERP_SMALL: tl.constexpr,
    RECIP_DIV: tl.constexpr,
):  # fmt: skip
    p = p * decay  # decay = 1 exactly when wd = 0, where the reference skips the multiply
    if LERP_SMALL:
        m = tl.fma(lerp_w, g - m, m)
    else:
        m = tl.fma(-(g - m), 1.0 - lerp_w, g)
    v = tl.fma(one_minus_beta2, g * g, v * beta2)
    if RECIP_DIV:
        denom = tl.sqrt_rn(v) * inv_bc2_sqrt + eps
    else:
        denom = tl.div_rn(tl.sqrt_rn(v), 1.0 / inv_bc2_sqrt) + eps
    p = tl.fma(neg_step_size, tl.div_rn(m, denom), p)
    return p, m, v


@_jit
def _adamw_kernel(
    P, G, M, VS, COPY, TABLE, GOFF, DECAY, SCAL, lerp_w, beta2, one_minus_beta2, neg_step_size, inv_bc2_sqrt, eps,
    HAS_COPY: tl.constexpr, ALIGNED: tl.constexpr, LERP_SMALL: tl.constexpr, RECIP_DIV: tl.constexpr,
    DEVICE_SCALARS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # DEVICE_SCALARS: SCAL holds [neg_step_size, inv_bc2_sqrt, grad_scale, go] (fp32, on the device); the
    # scalar arguments of the same names are ignored, and with go == 0 the program writes nothing
    go = 1.0
    grad_scale = 1.0
    if DEVICE_SCALARS:
        neg_step_size = tl.load(SCAL + 0)
        inv_bc2_sqrt = tl.load(SCAL + 1)
        grad_scale = tl.load(SCAL + 2)
        go = tl.load(SCAL + 3)
    if go != 0.0:
        row = TABLE + tl.program_id(0).to(tl.int64) * 8
        p_off = tl.load(row + 0)
        start = tl.load(row + 1)  # the block's first element inside its tensor
        m_off = tl.load(row + 2)
        v_off = tl.load(row + 3)
        c_off = tl.load(row + 4)
        n = tl.load(row + 5)
        n_copy = tl.load(row + 6)  # n, or 0 when this parameter has no copy of this dtype
        tid = tl.load(row + 7)
        g_off = tl.load(GOFF + tid) + start
        decay = tl.load(DECAY + tid)
        if ALIGNED:  # every block starts on 16 elements: lets the compiler use 16-byte accesses
            p_off = tl.multiple_of(p_off, 16)
            g_off = tl.multiple_of(g_off, 16)
            m_off = tl.multiple_of(m_off, 16)
            v_off = tl.multiple_of(v_off, 16)
            c_off = tl.multiple_of(c_off, 16)
        i = tl.arange(0, BLOCK)
        if n == BLOCK:  # a full block, unmasked: 16-byte accesses (module docstring)
            p = tl.load(P + p_off + i)
            g = tl.load(G + g_off + i)
            m = tl.load(M + m_off + i)
            v = tl.load(VS + v_off + i)
            if DEVICE_SCALARS:
                g = g * grad_scale  # the clip, as clip_grads_ multiplies (one rounding)
            p, m, v = _adamw_update(
                p, g, m, v, decay, lerp_w, beta2, one_minus_beta2, neg_step_size, inv_bc2_sqrt, eps, LERP_SMALL,
                RECIP_DIV,
            )  # fmt: skip
            tl.store(P + p_off + i, p)
            tl.store(M + m_off + i, m)
            tl.store(VS + v_off + i, v)
            if HAS_COPY:
                if n_copy > 0:
                    tl.store(COPY + c_off + i, p.to(COPY.dtype.element_ty))
        else:
            mask = i < n
            p = tl.load(P + p_off + i, mask=mask, other=0.0)
            g = tl.load(G + g_off + i, mask=mask, other=0.0)
            m = tl.load(M + m_off + i, mask=mask, other=0.0)
            v = tl.load(VS + v_off + i, mask=mask, other=0.0)
            if DEVICE_SCALARS:
                g = g * grad_scale
            p, m, v = _adamw_update(
                p, g, m, v, decay, lerp_w, beta2, one_minus_beta2, neg_step_size, inv_bc2_sqrt, eps, LERP_SMALL,
                RECIP_DIV,
            )  # fmt: skip
            tl.store(P + p_off + i, p, mask=mask)
            tl.store(M + m_off + i, m, mask=mask)
            tl.store(VS + v_off + i, v, mask=mask)
            if HAS_COPY:
                tl.store(COPY + c_off + i, p.to(COPY.dtype.element_ty), mask=i < n_copy)


_plan_cache: dict = {}


def _offsets(ts, base: torch.Tensor) -> np.ndarray:
    es = base.element_size()
    d = np.array([t.data_ptr() - base.data_ptr() for t in ts], dtype=np.int64)
    if np.any(d % es):
        raise ValueError("adamw_step: tensors are not aligned to their element size")
    return d // es


def _validate(params, grads, exp_avgs, exp_avg_sqs, weight_decays, copies, grads_only: bool = False) -> bool:
    """Raise on inconsistent lists or shapes; return False where only the reference can run (not all
    contiguous fp32 on one device). ``grads_only``: the rest was validated when the plan was built (same
    addresses and sizes): check only the gradients, which are new tensors each step."""
    if grads_only:
        if len(grads) != len(params):
            raise ValueError(f"adamw_step: lists differ in length: params {len(params)}, grads {len(grads)}")
        device = params[0].device
        for i, (p, g) in enumerate(zip(params, grads)):
            if g.shape != p.shape:
                raise ValueError(f"adamw_step: tensor {i} shapes differ: param {tuple(p.shape)}, grad {tuple(g.shape)}")
            if g.device != device or g.dtype != torch.float32 or not g.is_contiguous():
                return False
        return True
    n_lists = {len(params), len(grads), len(exp_avgs), len(exp_avg_sqs), len(weight_decays)}
    if copies is not None:
        n_lists.add(len(copies))
    if len(n_lists) != 1:
        raise ValueError(
            f"adamw_step: lists differ in length: params {len(params)}, grads {len(grads)}, "
            f"exp_avgs {len(exp_avgs)}, exp_avg_sqs {len(exp_avg_sqs)}, weight_decays "
            f"{len(weight_decays)}" + ("" if copies is None else f", copies {len(copies)}")
        )
    ok = True
    device = params[0].device
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if not (p.shape == g.shape == m.shape == v.shape):
            raise ValueError(
                f"adamw_step: tensor {i} shapes differ: param {tuple(p.shape)}, grad "
                f"{tuple(g.shape)}, exp_avg {tuple(m.shape)}, exp_avg_sq {tuple(v.shape)}"
            )
        c = None if copies is None else copies[i]
        if c is not None and c.shape != p.shape:
            raise ValueError(f"adamw_step: copy {i} has shape {tuple(c.shape)}, param {tuple(p.shape)}")
        for t in (p, g, m, v) + (() if c is None else (c,)):
            if t.device != device or not t.is_contiguous():
                ok = False
        if any(t.dtype != torch.float32 for t in (p, g, m, v)):
            ok = False
    return ok


def _plan(params, grads, exp_avgs, exp_avg_sqs, weight_decays, copies):
    """Everything about a step that depends only on the identities of the tensors that live across steps
    (addresses, sizes, dtypes of params, moments, copies): validation, the block table, the copy base. Cached, so
    a training step pays only a dictionary lookup on a key of addresses (the host time matters: it sits between
    the launches). The gradients' addresses are not in the key (``_grad_offsets`` has them)."""
    key = (
        tuple(t.data_ptr() for t in params),
        tuple(t.data_ptr() for t in exp_avgs),
        tuple(t.data_ptr() for t in exp_avg_sqs),
        None if copies is None else tuple((0, None) if c is None else (c.data_ptr(), c.dtype) for c in copies),
        tuple(t.numel() for t in params),
        len(weight_decays),
        params[0].device,
        BLOCK,
    )
    plan = _plan_cache.get(key)
    if plan is not None:
        if not _validate(params, grads, exp_avgs, exp_avg_sqs, weight_decays, copies, grads_only=True):
            return None
        return plan
    if not _validate(params, grads, exp_avgs, exp_avg_sqs, weight_decays, copies):
        plan = None
    else:
        # one launch writes copies of one dtype; copies of any other dtype are refreshed after it
        live = [c for c in copies if c is not None] if copies is not None else []
        copy_base = live[0] if live else None
        kernel_copies = None
        if copy_base is not None:
            kernel_copies = [c if c is not None and c.dtype == copy_base.dtype else None for c in copies]
        table, aligned = _block_table(params, exp_avgs, exp_avg_sqs, kernel_copies, copy_base, params[0].device)
        leftover = (
            [] if copies is None else [i for i, c in enumerate(copies) if c is not None and kernel_copies[i] is None]
        )
        plan = (table, aligned, copy_base, leftover)
    if len(_plan_cache) > 8:
        _plan_cache.clear()
    _plan_cache[key] = plan
    return plan


def _block_table(params, exp_avgs, exp_avg_sqs, copies, copy_base, device):
    n = np.array([t.numel() for t in params], dtype=np.int64)
    nb = (n + BLOCK - 1) // BLOCK  # blocks per tensor
    tid = np.repeat(np.arange(len(params), dtype=np.int64), nb)
    start = (np.arange(int(nb.sum()), dtype=np.int64) - np.repeat(np.cumsum(nb) - nb, nb)) * BLOCK
    p_col, m_col, v_col = (_offsets(ts, ts[0])[tid] + start for ts in (params, exp_avgs, exp_avg_sqs))
    have = np.zeros(len(params), dtype=bool)
    c = np.zeros(len(params), dtype=np.int64)  # offsets may be negative: tensors lie either side of the base
    if copy_base is not None:
        have = np.array([x is not None for x in copies])
        c[have] = _offsets([x for x in copies if x is not None], copy_base)
    length = np.minimum(BLOCK, n[tid] - start)
    table_np = np.stack([p_col, start, m_col, v_col, c[tid] + start, length, np.where(have[tid], length, 0), tid], 1)
    aligned = bool(np.all(table_np[:, :5] % 16 == 0))  # start is a multiple of BLOCK
    table = torch.from_numpy(np.ascontiguousarray(table_np)).to(device)
    return table, aligned


_grad_cache: dict = {}
_captured_grad_tables: list = []  # (pinned host, device) pairs a CUDA graph's copy node reads: kept for good


def _grad_offsets(grads) -> tuple[torch.Tensor, bool]:
    """Where each gradient starts, in elements from the first one (int64 [n] on the grads' device), and whether
    every offset is a multiple of 16 elements. Cached by the gradients' addresses. Under CUDA graph capture the
    table is staged in pinned host memory that is never freed, so the graph's copy node reads valid bytes at
    every replay (its addresses are the graph pool's, the same at every replay)."""
    key = (tuple(t.data_ptr() for t in grads), grads[0].device)
    hit = _grad_cache.get(key)
    if hit is not None:
        return hit
    offs = _offsets(grads, grads[0])
    aligned = bool(np.all(offs % 16 == 0))
    dev = grads[0].device
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        host = torch.from_numpy(offs).pin_memory()
        table = torch.empty(len(grads), dtype=torch.int64, device=dev)
        table.copy_(host, non_blocking=True)
        _captured_grad_tables.append((host, table))
    else:
        table = torch.from_numpy(offs).to(dev)
    if len(_grad_cache) > 8:
        _grad_cache.clear()
    _grad_cache[key] = hit = (table, aligned)
    return hit


def _f32(x: float) -> float:
    return float(np.float32(x))


def adamw_step_triton(
    params, grads, exp_avgs, exp_avg_sqs, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
    weight_decays, copies=None, recip_div: bool | None = None,
) -> None:  # fmt: skip
    """The one-launch Triton step. ``recip_div``: divide by the bias-correction scalar as a multiply by its reciprocal,
    as torch does on CUDA (None: so on CUDA tensors, a true division elsewhere; ``compile_check`` passes True to build
    the CUDA form on a CPU)."""
    if not params:
        return
    plan = _plan(params, grads, exp_avgs, exp_avg_sqs, weight_decays, copies)
    if plan is None:
        raise ValueError(
            "adamw_step: the Triton path needs contiguous fp32 params, grads and moments on one "
            "device (adamw_step falls back to the reference for anything else)"
        )
    table, aligned, copy_base, leftover = plan
    goff, g_aligned = _grad_offsets(grads)
    decay = torch.tensor([_f32(1 - lr * wd) if wd != 0 else 1.0 for wd in weight_decays], dtype=torch.float32).to(
        params[0].device, non_blocking=True
    )
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    inv_bc2 = float(np.float32(1.0) / np.float32(bias_correction2_sqrt))
    lerp_w = 1 - beta1
    _adamw_kernel[(table.shape[0],)](
        params[0], grads[0], exp_avgs[0], exp_avg_sqs[0], params[0] if copy_base is None else copy_base, table, goff,
        decay, decay, _f32(lerp_w), _f32(beta2), _f32(1 - beta2), _f32(-(lr / bias_correction1)), inv_bc2, _f32(eps),
        HAS_COPY=copy_base is not None, ALIGNED=aligned and g_aligned, LERP_SMALL=abs(lerp_w) < 0.5,
        RECIP_DIV=params[0].is_cuda if recip_div is None else recip_div, DEVICE_SCALARS=False, BLOCK=BLOCK,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )  # fmt: skip
    for i in leftover:
        copies[i].copy_(params[i])


_wd_cache: dict = {}


def device_scalars(step, lr, ok, grad_scale, *, beta1: float, beta2: float, weight_decays):
    """The step's scalars computed on the device from 0-dim tensors, with no host read, in the same order and
    precision as ``adamw_step_triton`` computes them on the host (float64, rounded to fp32 where it passes
    them): ``step`` (the count of updates done, incremented here where ``ok``), ``lr`` (float64), ``ok``
    (bool), ``grad_scale`` (the clip coefficient; None: 1). Returns (scal [4] fp32, decay [n] fp32)."""
    dev = step.device
    okf = ok.to(step.dtype)
    step.add_(okf)
    t = torch.clamp(step.double(), min=1.0)  # a skipped first step keeps 0; its scalars are then unused
    lr = lr.double()
    neg_step_size = -(lr / (1 - torch.pow(beta1, t)))
    inv_bc2 = 1.0 / torch.sqrt(1 - torch.pow(beta2, t)).float()  # fp32 / fp32, as the host path divides
    gs = torch.ones((), device=dev) if grad_scale is None else grad_scale.float()
    scal = torch.stack([neg_step_size.float(), inv_bc2, gs, ok.float()])
    key = (tuple(weight_decays), dev)
    wd = _wd_cache.get(key)
    if wd is None:
        wd = _wd_cache.setdefault(key, torch.tensor(weight_decays, dtype=torch.float64, device=dev))
    decay = (1 - lr * wd).float()  # exactly 1 where wd == 0
    return scal, decay


def adamw_step_triton_device(
    params, grads, exp_avgs, exp_avg_sqs, *, step: torch.Tensor, lr: torch.Tensor, ok: torch.Tensor,
    grad_scale: torch.Tensor | None = None, beta1: float, beta2: float, eps: float, weight_decays, copies=None,
    recip_div: bool | None = None,
) -> None:  # fmt: skip
    """The one-launch step with its scalars as device tensors (``device_scalars``): nothing is read back to the
    host, so it can be captured in a CUDA graph. ``grad_scale`` multiplies each gradient as it is read (the clip,
    fused: the grads themselves are not written); where ``ok`` is false nothing is written at all. With the same
    scalars it computes bit for bit what ``adamw_step_triton`` computes on gradients clipped beforehand."""
    if not params:
        return
    plan = _plan(params, grads, exp_avgs, exp_avg_sqs, weight_decays, copies)
    if plan is None:
        raise ValueError("adamw_step_triton_device: needs contiguous fp32 params, grads and moments on one device")
    table, aligned, copy_base, leftover = plan
    goff, g_aligned = _grad_offsets(grads)
    scal, decay = device_scalars(step, lr, ok, grad_scale, beta1=beta1, beta2=beta2, weight_decays=weight_decays)
    lerp_w = 1 - beta1
    _adamw_kernel[(table.shape[0],)](
        params[0], grads[0], exp_avgs[0], exp_avg_sqs[0], params[0] if copy_base is None else copy_base, table, goff,
        decay, scal, _f32(lerp_w), _f32(beta2), _f32(1 - beta2), 0.0, 0.0, _f32(eps),
        HAS_COPY=copy_base is not None, ALIGNED=aligned and g_aligned, LERP_SMALL=abs(lerp_w) < 0.5,
        RECIP_DIV=params[0].is_cuda if recip_div is None else recip_div, DEVICE_SCALARS=True, BLOCK=BLOCK,
        num_warps=NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    for i in leftover:  # a copy of a second dtype (rare): it mirrors the master, updated or not
        copies[i].copy_(params[i])


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, **kw) -> None:
    # the first tensor decides the device; _plan checks (once per set of tensors) that all of them qualify
    if (
        params
        and use_triton(params[0])
        and _plan(params, grads, exp_avgs, exp_avg_sqs, kw["weight_decays"], kw.get("copies")) is not None
    ):
        adamw_step_triton(params, grads, exp_avgs, exp_avg_sqs, **kw)
    else:
        adamw_step_ref(params, grads, exp_avgs, exp_avg_sqs, **kw)
