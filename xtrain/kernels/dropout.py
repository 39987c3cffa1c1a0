"""Inverted dropout whose keep mask is a pure function of (seed, global element index).

No RNG state. The tensor is read as rows ``x[b]`` (the first dim; a batch of sequences), and row b is row ``row_start +
b * row_stride`` of the global batch, so element (b, rest) has the global index g = (row_start + b * row_stride) * N +
rest, N = numel / rows. The defaults (0, 1) make g the flat index. The trainer passes where a micro-batch's rows sit in
the step's global batch (data-parallel rank and micro-batch index), so a token draws the same mask whether it is trained
in one process, in one of k micro-batches or on rank r of N, and two tokens never share a mask.

One 32-bit hash serves a pair of elements: with k = g // 2 and h = hash32(k, seed), element g draws the 16-bit uniform
u = h & 0xFFFF (g even) or h >> 16 (g odd), and is kept when u >= threshold = round(p * 2^16). Kept elements are scaled
by 1/(1-p). The drop probability is p rounded to a multiple of 2^-16 (p = 0.1 drops 6554/65536 = 0.100006); the scale is
the exact 1/(1-p). The decision is an integer comparison on a hash, so the reference, the Triton kernel, fp32, bf16 and
fp64 keep exactly the same elements, and a recomputed forward or a resumed run draws the same mask.

hash32 (our own mix of the well-known xorshift-multiply finalizer), all arithmetic mod 2^32:
    mix(h) = h ^ h>>16; h = h * 0x7FEB352D; h ^= h>>15; h = h * 0x2C1B3C6D; h ^= h>>16
    hash32(k, seed) = mix(mix(k_lo ^ seed_lo) ^ seed_hi ^ k_hi)   (lo/hi: low/high 32 bits)
Both multipliers are below 2^31, so the int64 products in the reference never overflow.
Why pairs: the hash is ~20 integer operations; at one hash per element the bf16 kernel is bound by integer
throughput (72% of copy bandwidth on an H200), at one per pair it reaches 95-97%. A row of odd length N
breaks the pairing inside a program, so that case (``EVEN=False``) hashes every element.

The seed is read from the device: a one-element int64 tensor on x's device (the 64 bits of the seed, as two's
complement), which the kernel loads and splits into lo/hi on the device, so a CUDA graph that captured a launch draws
the mask of whatever seed the tensor holds when it replays (the model keeps all its per-site seeds in one persistent
buffer and rewrites it each step). The reference splits it with tensor ops, never reading it back to the host. A Python
int is accepted too (``seed_tensor`` turns it into such a tensor: a host-to-device copy, for direct callers and tests,
not for a captured step).

Contract: dropout_fwd(x, p, seed, row_start=0, row_stride=1) -> y; dropout_bwd(dy, p, seed, ...) -> dx (the same mask,
regenerated from the seed rather than stored).

Triton kernel ``_dropout_kernel``: one program per (row, block of 2*BLOCK elements); each loads the seed (one int64),
then computes the same hash in uint32 registers, where multiplication wraps mod 2^32 as the reference's ``& 0xFFFFFFFF``
and ``>>`` is a logical shift, so the mask is bit-for-bit the reference's; the scale is the fp32-rounded 1/(1-p) the
reference multiplies by. One read, one write.
"""

from __future__ import annotations

import math

import torch

from xtrain.kernels._dispatch import jit as _jit
from xtrain.kernels._dispatch import tl, triton, use_triton

_M32 = 0xFFFFFFFF
MUL1 = 0x7FEB352D
MUL2 = 0x2C1B3C6D


def _mix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * MUL1) & _M32
    h = h ^ (h >> 15)
    h = (h * MUL2) & _M32
    h = h ^ (h >> 16)
    return h


def keep_threshold(p: float) -> int:
    return int(round(p * (1 << 16)))


def _global_index(shape, row_start: int, row_stride: int, device) -> torch.Tensor:
    """int64 global element index g of every element of a tensor of ``shape`` (rows = first dim)."""
    rows = shape[0] if len(shape) else 1
    n = math.prod(shape) // max(rows, 1)
    g_row = row_start + torch.arange(rows, device=device, dtype=torch.int64) * row_stride  # (rows,)
    return (g_row[:, None] * n + torch.arange(n, device=device, dtype=torch.int64)).reshape(shape)


def seed_tensor(seed, device) -> torch.Tensor:
    """The seed as the kernels read it: a one-element int64 tensor on ``device``. A tensor is checked and
    returned as it is (its memory is what a captured launch reads); an int is taken mod 2^64 and copied to the
    device as two's complement."""
    device = torch.device(device)
    if isinstance(seed, torch.Tensor):
        same = seed.device.type == device.type and device.index in (None, seed.device.index)
        if seed.dtype != torch.int64 or seed.numel() != 1 or not same:
            raise ValueError(
                f"dropout: the seed must be an int or a one-element int64 tensor on {device}, got "
                f"{seed.dtype} {tuple(seed.shape)} on {seed.device}"
            )
        return seed
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return torch.tensor(s - (1 << 64) if s >> 63 else s, dtype=torch.int64, device=device)


def dropout_mask_ref(shape, p: float, seed, device, row_start: int = 0, row_stride: int = 1) -> torch.Tensor:
    """Boolean keep mask (True = kept) of a tensor of ``shape`` (an int means a flat tensor). ``seed``: an int or
    a one-element int64 tensor (split into its 32-bit halves with tensor ops: no read back to the host)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    s = seed_tensor(seed, device).reshape(())
    lo, hi = s & _M32, (s >> 32) & _M32  # >> is arithmetic on int64: mask the sign extension off
    g = _global_index(shape, row_start, row_stride, device)
    k = g >> 1  # pair index
    h = _mix32(_mix32((k & _M32) ^ lo) ^ hi ^ (k >> 32))
    u = torch.where((g & 1) == 0, h & 0xFFFF, h >> 16)
    return u >= keep_threshold(p)


def dropout_fwd_ref(x: torch.Tensor, p: float, seed, row_start: int = 0, row_stride: int = 1) -> torch.Tensor:
    keep = dropout_mask_ref(x.shape, p, seed, x.device, row_start, row_stride)
    scale = 1.0 / (1.0 - p)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.where(keep, x.to(acc) * scale, torch.zeros((), dtype=acc, device=x.device)).to(x.dtype)


def dropout_bwd_ref(dy: torch.Tensor, p: float, seed, row_start: int = 0, row_stride: int = 1) -> torch.Tensor:
    # dropout with a fixed mask is the elementwise linear map y_i = c_i x_i, so dx_i = c_i dy_i
    return dropout_fwd_ref(dy, p, seed, row_start, row_stride)


# ------------------------------------------------------------------------------------------------ Triton

BLOCK = 512  # pairs per program (1024 elements); 512 x 4 warps measured best of 4 tilings (H200)
NUM_WARPS = 4


@_jit
def _mix32_tl(h):
    # h is uint32: '*' wraps mod 2^32 and '>>' is a logical shift, as in the reference
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x2C1B3C6D
    h = h ^ (h >> 16)
    return h


@_jit(do_not_specialize=["row_start", "row_stride", "threshold"])  # no recompile per value
def _dropout_kernel(X, Y, SEED, N, row_start, row_stride, threshold, scale, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    # program (row b, block j) covers elements [j*2*BLOCK, (j+1)*2*BLOCK) of row b, which is global row
    # row_start + b*row_stride; EVEN (N even): pairs never straddle a program, one hash per pair
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    g0 = (row_start + b * row_stride) * N + j * (2 * BLOCK)  # global index of the block's first element
    seed = tl.load(SEED)  # int64: its low and high 32 bits (the casts truncate)
    sl = seed.to(tl.uint32)
    sh = (seed >> 32).to(tl.uint32)
    thr = threshold.to(tl.uint32)
    if EVEN:
        k = (g0 >> 1) + tl.arange(0, BLOCK)  # pair index, int64
        h = _mix32_tl(_mix32_tl((k & 0xFFFFFFFF).to(tl.uint32) ^ sl) ^ sh ^ (k >> 32).to(tl.uint32))
        keep_even = ((h & 0xFFFF) >= thr).to(tl.int8)
        keep_odd = ((h >> 16) >= thr).to(tl.int8)
        # interleave -> element order 2k, 2k+1; no shared memory (sm_90 PTX: 16-byte loads/stores kept)
        keep = tl.interleave(keep_even, keep_odd) != 0
    else:
        g = g0 + tl.arange(0, 2 * BLOCK)
        k = g >> 1
        h = _mix32_tl(_mix32_tl((k & 0xFFFFFFFF).to(tl.uint32) ^ sl) ^ sh ^ (k >> 32).to(tl.uint32))
        keep = tl.where((g & 1) == 0, h & 0xFFFF, h >> 16) >= thr
    cols = j * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    mask = cols < N
    offs = b * N + cols
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.where(keep, x * scale, 0.0)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def _dropout_triton(x: torch.Tensor, p: float, seed, row_start: int = 0, row_stride: int = 1) -> torch.Tensor:
    seed = seed_tensor(seed, x.device)
    x = x.contiguous()
    y = torch.empty_like(x)
    rows = x.shape[0] if x.dim() else 1
    n = x.numel() // max(rows, 1)
    if rows == 0 or n == 0:
        return y
    # the reference multiplies fp32 by the Python float 1/(1-p), i.e. by its fp32 rounding: pass that
    scale = float(torch.tensor(1.0 / (1.0 - p), dtype=torch.float32))
    grid = (rows, triton.cdiv(n, 2 * BLOCK))
    _dropout_kernel[grid](
        x, y, seed, n, int(row_start), int(row_stride), keep_threshold(p), scale,
        BLOCK=BLOCK, EVEN=n % 2 == 0, num_warps=NUM_WARPS,
    )  # fmt: skip
    return y


def dropout_fwd_triton(x: torch.Tensor, p: float, seed, row_start: int = 0, row_stride: int = 1) -> torch.Tensor:
    return _dropout_triton(x, p, seed, row_start, row_stride)


def dropout_bwd_triton(dy: torch.Tensor, p: float, seed, row_start: int = 0, row_stride: int = 1) -> torch.Tensor:
    return _dropout_triton(dy, p, seed, row_start, row_stride)


def dropout_fwd(x, p, seed, row_start: int = 0, row_stride: int = 1):
    if x.dtype != torch.float64 and use_triton(x):
        return dropout_fwd_triton(x, p, seed, row_start, row_stride)
    return dropout_fwd_ref(x, p, seed, row_start, row_stride)


def dropout_bwd(dy, p, seed, row_start: int = 0, row_stride: int = 1):
    if dy.dtype != torch.float64 and use_triton(dy):
        return dropout_bwd_triton(dy, p, seed, row_start, row_stride)
    return dropout_bwd_ref(dy, p, seed, row_start, row_stride)
