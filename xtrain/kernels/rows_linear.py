"""A few rows times a weight, with what reads and writes those rows in the same pass: the decode step's projections
(one token a sequence: each matmul a matrix-vector product, bound by reading the weight).

Contract: rows_linear(x, w, pre, g, eps, res) -> y [M, N]; w [K, N] (any strides), x [M, K] ([M, 2K] for "glu":
gate half, up half); the product's input a, in w's dtype, is x (pre=None), rms_norm(x, g, eps) (pre="norm", x in the
master dtype, ``rms_norm_fwd_ref``'s maths) or swiglu(gate, up) (pre="glu", ``swiglu_fwd_ref``'s); y = a @ w in w's
dtype, or with res [M, N] (the residual stream, master dtype) res + (a @ w rounded to w's dtype): ``add_cast``'s.

The Triton kernel: program (column block, row) computes the row's prologue in registers ("norm": the row's sum of
squares first), walks K in BLOCK_K steps over [BLOCK_N, BLOCK_K] tiles of w accumulating in fp32, and writes y with
the residual added: the norm, the SwiGLU and the add cost no launch of their own. Column blocks narrow enough for
about two programs per SM; rows share w through L2, so it is for a few rows (``ROWS_MAX``), more go through cuBLAS.
"""

from __future__ import annotations

import torch

from xtrain.kernels import rms_norm as K_rms
from xtrain.kernels import swiglu as K_swiglu
from xtrain.kernels._dispatch import jit as _jit
from xtrain.kernels._dispatch import sm_count, tl, triton

ROWS_MAX = 16  # more rows than this: the composed form (cuBLAS reads w once for all of them)
_PRE = {None: 0, "norm": 1, "glu": 2}


def rows_linear_ref(x, w, pre=None, g=None, eps=0.0, res=None, fast: bool = False):
    """The composed form; ``fast``: the norm and SwiGLU through their dispatching kernels (many rows on CUDA)."""
    a = x
    if pre == "norm":
        a = (K_rms.rms_norm_fwd if fast else K_rms.rms_norm_fwd_ref)(x, g, eps, w.dtype)[0]
    elif pre == "glu":
        gate, up = x.chunk(2, dim=1)
        a = (K_swiglu.swiglu_fwd if fast else K_swiglu.swiglu_fwd_ref)(gate, up)
    if res is None:
        return a @ w
    if res.dtype is w.dtype:
        return torch.addmm(res, a, w)  # one call: a decode step on the CPU is bound by the number of calls
    return res + (a @ w).to(res.dtype)


@_jit
def _rows_linear_kernel(X, W, G, R, Y, K, N, x_sm, w_sk, w_sn, r_sm, y_sm, eps, PRE: tl.constexpr,
                        RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    m = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    k0 = tl.arange(0, BLOCK_K)
    xr = X + m * x_sm
    inv = 0.0
    if PRE == 1:  # the row's statistics first
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            xk = tl.load(xr + k + k0, mask=k + k0 < K, other=0.0).to(tl.float32)
            ss += xk * xk
        inv = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + k0
        km = kk < K
        a = tl.load(xr + kk, mask=km, other=0.0).to(tl.float32)
        if PRE == 1:
            a = (a * inv * tl.load(G + kk, mask=km, other=0.0).to(tl.float32)).to(W.dtype.element_ty)
        if PRE == 2:
            u = tl.load(xr + K + kk, mask=km, other=0.0).to(tl.float32)
            a = (tl.sigmoid(a) * a * u).to(W.dtype.element_ty)
        w = tl.load(W + kk[None, :] * w_sk + n[:, None] * w_sn, mask=km[None, :] & nm[:, None], other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if RES:
        y = y.to(W.dtype.element_ty).to(tl.float32) + tl.load(R + m * r_sm + n, mask=nm, other=0.0).to(tl.float32)
    tl.store(Y + m * y_sm + n, y.to(Y.dtype.element_ty), mask=nm)


def rows_linear_config(M: int, K: int, N: int, sms: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): columns narrow enough for about two programs per SM, a tile of at most 4096 values."""
    block_n = 1
    while block_n < 64 and M * triton.cdiv(N, 2 * block_n) >= 2 * sms:
        block_n *= 2
    return block_n, max(16, min(triton.next_power_of_2(K), 4096 // block_n))


def rows_linear_triton(x, w, pre=None, g=None, eps=0.0, res=None, config: tuple[int, int] | None = None):
    (K, N), M = w.shape, x.shape[0]
    out = torch.empty((M, N), dtype=w.dtype if res is None else res.dtype, device=x.device)
    bn, bk = config or rows_linear_config(M, K, N, sm_count(x.device) if x.is_cuda else 4)
    r = out if res is None else res
    _rows_linear_kernel[(triton.cdiv(N, bn), M)](
        x, w, x if g is None else g, r, out, K, N, x.stride(0), w.stride(0), w.stride(1), r.stride(0),
        out.stride(0), eps, PRE=_PRE[pre], RES=res is not None, BLOCK_N=bn, BLOCK_K=bk, num_warps=4,
    )  # fmt: skip
    return out
