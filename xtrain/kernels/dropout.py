"""Inverted dropout whose keep mask is a pure function of (seed, element index).

No RNG state: one 32-bit hash serves a pair of elements. With k = i // 2 and h = hash32(k, seed), element i
draws the 16-bit uniform u = h & 0xFFFF (i even) or h >> 16 (i odd), and is kept when u is at least
threshold = round(p * 2^16). Kept elements are scaled by 1/(1-p). The drop probability is therefore p
rounded to a multiple of 2^-16 (p = 0.1 drops 6554/65536 = 0.100006); the scale is the exact 1/(1-p).
Because the decision is an integer comparison on a hash, the reference, the Triton kernel, fp32 and bf16
all keep exactly the same elements, and a recomputed forward (activation recompute) or a resumed run draws
the same mask.

hash32 (our own mix of the well-known xorshift-multiply finalizer): with M = 2^32 - 1,
    mix(h) = h ^ h>>16; h = h * 0x7FEB352D mod 2^32; h ^= h>>15; h = h * 0x2C1B3C6D mod 2^32; h ^= h>>16
    hash32(k, seed) = mix(mix((k mod 2^32) ^ seed_lo) ^ seed_hi),  seed_lo/hi = low/high 32 bits of seed
Both multipliers are below 2^31, so the int64 products in the reference never overflow.
Index i is the flat (row-major, contiguous) element index; tensors must have fewer than 2^32 elements.
Why pairs: the hash is ~20 integer operations, and at one hash per element the bf16 kernel was bound by
integer throughput, not memory (72% of copy bandwidth on the H200, 2026-11-29); one hash per two
elements took it to 95-97% (bench/RESULTS.md). (Before 2026-11-29 each element had its own hash and a
24-bit threshold, so masks drawn by older code differ: a run resumed across that change draws new masks
from then on.)

Contract: dropout_fwd(x, p, seed) -> y;  dropout_bwd(dy, p, seed) -> dx (the same mask, regenerated from
the seed rather than stored: one bit of state per element saved for free).

Triton kernel ``_dropout_kernel``: the same hash in uint32 registers, where multiplication wraps mod 2^32
exactly as the reference's ``& 0xFFFFFFFF`` and ``>>`` is a logical shift, so the mask is bit-for-bit
the reference's; the scale is the fp32-rounded 1/(1-p) the reference multiplies by. One read, one write.
"""

from __future__ import annotations

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


def dropout_mask_ref(numel: int, p: float, seed: int, device) -> torch.Tensor:
    """Boolean keep mask of ``numel`` elements (True = kept)."""
    if numel >= 1 << 32:
        raise ValueError(f"dropout: tensors must have fewer than 2^32 elements, got {numel}")
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    lo, hi = seed & _M32, seed >> 32
    k = torch.arange((numel + 1) // 2, device=device, dtype=torch.int64)  # pair index
    h = _mix32(_mix32(k ^ lo) ^ hi)
    u = torch.stack([h & 0xFFFF, h >> 16], dim=-1).reshape(-1)[:numel]  # element 2k: low half, 2k+1: high
    return u >= keep_threshold(p)


def dropout_fwd_ref(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    keep = dropout_mask_ref(x.numel(), p, seed, x.device).reshape(x.shape)
    scale = 1.0 / (1.0 - p)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.where(keep, x.to(acc) * scale, torch.zeros((), dtype=acc, device=x.device)).to(x.dtype)


def dropout_bwd_ref(dy: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    # dropout with a fixed mask is the elementwise linear map y_i = c_i x_i, so dx_i = c_i dy_i
    return dropout_fwd_ref(dy, p, seed)


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


@_jit(do_not_specialize=["seed_lo", "seed_hi", "threshold"])  # no recompile per seed value
def _dropout_kernel(X, Y, n, seed_lo, seed_hi, threshold, scale, BLOCK: tl.constexpr):
    # BLOCK pairs = 2 * BLOCK elements per program; one hash per pair
    pid = tl.program_id(0).to(tl.int64)
    k = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.uint32)  # pair index (n < 2^32)
    h = _mix32_tl(_mix32_tl(k ^ seed_lo.to(tl.uint32)) ^ seed_hi.to(tl.uint32))
    thr = threshold.to(tl.uint32)
    keep_even = ((h & 0xFFFF) >= thr).to(tl.int8)
    keep_odd = ((h >> 16) >= thr).to(tl.int8)
    # interleave -> element order 2k, 2k+1; no shared memory (sm_90 PTX: 16-byte loads/stores kept)
    keep = tl.interleave(keep_even, keep_odd) != 0
    offs = pid * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.where(keep, x * scale, 0.0)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def _dropout_triton(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    n = x.numel()
    if n >= 1 << 32:
        raise ValueError(f"dropout: tensors must have fewer than 2^32 elements, got {n}")
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    x = x.contiguous()
    y = torch.empty_like(x)
    # the reference multiplies fp32 by the Python float 1/(1-p), i.e. by its fp32 rounding: pass that
    scale = float(torch.tensor(1.0 / (1.0 - p), dtype=torch.float32))
    _dropout_kernel[(max(1, triton.cdiv(n, 2 * BLOCK)),)](
        x, y, n, seed & _M32, seed >> 32, keep_threshold(p), scale, BLOCK=BLOCK, num_warps=NUM_WARPS
    )
    return y


def dropout_fwd_triton(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    return _dropout_triton(x, p, seed)


def dropout_bwd_triton(dy: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    return _dropout_triton(dy, p, seed)


def dropout_fwd(x, p, seed):
    if x.dtype != torch.float64 and use_triton(x):
        return dropout_fwd_triton(x, p, seed)
    return dropout_fwd_ref(x, p, seed)


def dropout_bwd(dy, p, seed):
    if dy.dtype != torch.float64 and use_triton(dy):
        return dropout_bwd_triton(dy, p, seed)
    return dropout_bwd_ref(dy, p, seed)
