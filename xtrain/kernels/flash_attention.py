"""Flash attention: softmax(q kᵀ · scale [+ causal mask]) v without ever holding the T×T scores.

Shapes (legend): B batch, H query heads, Hkv key/value heads (Hkv divides H; query head h reads K/V head
h // (H // Hkv), grouped-query attention), T sequence, D head dim.

Contract (shared by the plain-torch reference and the Triton kernels):
    flash_attention_fwd(q[B,H,T,D], k[B,Hkv,T,D], v[B,Hkv,T,D], causal=True, scale=None)
        -> (o[B,H,T,D] in q.dtype, lse[B,H,T])
    flash_attention_bwd(do, q, k, v, o, lse, causal=True, scale=None)
        -> (dq like q, dk like k, dv like v)      dk, dv summed over each group of query heads
``scale`` defaults to 1/sqrt(D) and must be > 0. ``lse`` is the row logsumexp of the scaled, masked
scores in the NATURAL log (lse_i = log sum_j exp(s_ij)); it is fp32 (fp64 for fp64 inputs). It is all the
forward saves for the backward besides q, k, v, o: O(T) per head instead of the O(T²) probabilities.

Forward (online softmax; Milakov & Gimelshein 2018, FlashAttention, Dao et al. 2022). For one block of
query rows, walk the K/V tiles j keeping a running max m, running sum l and an unnormalised accumulator:
    s     = q k_jᵀ · scale                    (masked entries -inf)
    m_new = max(m, rowmax(s))
    p     = exp(s - m_new)
    l     = l · exp(m - m_new) + rowsum(p)     old sum rescaled to the new max, then this tile added
    acc   = acc · exp(m - m_new) + p v_j
    m     = m_new
and at the end o = acc / l, lse = m + log l.

Backward by recomputation (FlashAttention-2, Dao 2023). With D_i = rowsum(dO_i ∘ O_i) (a preprocess pass;
it equals sum_j P_ij dP_ij, which removes the softmax Jacobian):
    P_ij  = exp(s_ij - lse_i)          dP_ij = dO_i · v_j        dS_ij = P_ij (dP_ij - D_i)
    dV_j  = sum_i P_ij dO_i            dK_j  = scale · sum_i dS_ij q_i        dQ_i = scale · sum_j dS_ij k_j
The Triton backward computes dK/dV in one kernel whose program keeps a K/V tile resident and walks the
query tiles of every head of its group (so GQA sums need no atomics), and dQ in a second kernel whose
program keeps a Q tile resident and walks the K/V tiles: no atomics, no T×T, deterministic.

Ideas used in the Triton kernels, with their record on Hopper:
  * FlashAttention-2 work partitioning (Dao 2023): one program per (query tile, head) in the forward, the
    softmax normalisation deferred to the end, and the separate dK/dV and dQ passes above.
  * exp2 with log2(e) folded into the scale (as in the Triton fused-attention tutorial): the kernels work in
    the base-2 domain, m and the exponents are scaled by log2(e) once, and exp2 maps to one MUFU.EX2.
  * Causal split: the K/V tiles strictly below the diagonal run a loop with no mask arithmetic at all; only
    the diagonal tiles (one BLOCK_M-wide band) pay for the mask. Query tiles run heaviest-first so the short
    diagonal programs fill the tail of the grid.
  * Per-head-dim fixed configs (BLOCK_M/BLOCK_N/num_warps/num_stages) chosen by a sweep on an H200 rather
    than autotuning at run time (compile time is not free): see ``_FWD_CONFIGS``/``_BWD_CONFIGS`` and
    bench/RESULTS.md.
  * Tensor descriptors (Hopper TMA bulk copies, as in recent versions of the Triton tutorial) for the
    streamed tiles, per config: on the H200 they won for the dQ kernel and the short-T hd128 forward and lost
    elsewhere, so both load paths stay.
  * Tried and measured slower on the H200 (bench/RESULTS.md): Triton 3.6's automatic warp specialisation
    (``tl.range(..., warp_specialize=True)``: fails to compile at 4 warps, 4-27 % slower at 8); launching
    the programs tile-major so every head's heaviest causal tile starts first (loses L2 reuse of K/V:
    up to 35 % slower); software-pipelining the loops by hand (issuing the next tile's scores before the
    current softmax, the FlashAttention-3 overlap written in plain Triton: 3-64 % slower, it fights the
    compiler's own pipelining and register allocation); and the one-pass FlashAttention-2 backward with dQ
    added by fp32 atomics or TMA reduce-adds (5 matrix products per tile pair instead of 7, yet 4-18 %
    slower at its best config: the resident dK, dV and dQ tiles starve the registers; its code is in git
    history, commit cb76fc6).
  * The backward's dK/dV and dQ kernels run concurrently on two CUDA streams (+2-5 % on the H200).
  * Program order (``_tail_order``, session 10, after the Gluon backward's of session 9): 1-D grids, head by
    head (a head's tiles heaviest first, so the programs running together share its streamed tiles in L2)
    except the last ``TRITON_TAIL_WAVES`` waves' worth of heads, whose tiles start tile-major so the grid
    ends on light programs. H200, bench shapes (bench/triton_order.py): forward 3-5 % faster, backward 1-5 %
    (hd128 T = 16k forward unchanged). Unlike the all-tile-major order above it keeps the L2 reuse.
  * On Hopper the causal 16-bit forward at the lengths of ``GLUON_FWD_MIN_T`` runs a Gluon kernel instead
    (flash_attention_gluon.py: FlashAttention-3's warp specialisation, a TMA producer warp and two
    consumer warpgroups overlapping softmax with async wgmma, persistent over (query tile, head) items),
    which plain Triton 3.6 could not express; so does the backward at ``GLUON_BWD_MIN_T``
    (flash_attention_gluon_bwd.py: the same two-kernel split as here, warp-specialised; hd128, and hd64 at
    T >= 4k under ``torch.use_deterministic_algorithms(True)``), and the hd64 backward at ``GLUON_ONEPASS_MIN_T``
    otherwise (flash_attention_gluon_onepass.py: FlashAttention-3's one-pass form with a third warpgroup
    doing every dQ product; dQ summed by fp32 reduce-adds, so not bit-identical run to run).
    ``bwd_route`` says which runs.
  * Host time: those Gluon paths keep a launch plan per input signature (``_plan_key``): the first call
    checks, dispatches, builds descriptors and launches through the JIT, and leaves the compiled kernels and
    argument lists behind (``_dispatch.CachedLaunch``); later calls allocate the outputs and launch them
    directly (H200 machine, session 6: host time per call 0.12-0.33 -> 0.05-0.11 ms forward, 0.39-0.97 ->
    0.21-0.48 ms backward, where the kernels take 0.16-0.6 ms at T = 1k).
fp32 inputs use exact fp32 dots (``input_precision="ieee"``, matching torch's default of no TF32); bf16/fp16
inputs feed the tensor cores with 16-bit operands and accumulate in fp32 (P and dS are rounded to the
input dtype before their matrix products, as in FlashAttention).

The reference (``*_ref``) runs the same tiled algorithm in plain torch, on any device and in fp64: memory
O(T · tile) per head, never O(T²).
"""

from __future__ import annotations

import math

import torch

from xtrain.kernels._dispatch import HAVE_TRITON, PlanCache, capability, run_side_by_side, sm_count, use_triton

LOG2E = 1.4426950408889634  # 1 / ln 2: exp(x) = exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln 2: natural log = log2 * LN2
SUPPORTED_HEAD_DIMS = (32, 64, 128)  # Triton kernels; the reference takes any D
REF_TILE = 128  # K/V tile of the reference
_HAVE_DESC = False  # set below when Triton's host-side tensor descriptors import


# ---------------------------------------------------------------------------------------------------------
# input checks
# ---------------------------------------------------------------------------------------------------------
def _shapes(*ts) -> str:
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} {t.device}" for t in ts)


def _check_qkv(op: str, q, k, v) -> None:
    ts = (q, k, v)
    if not all(isinstance(t, torch.Tensor) for t in ts):
        raise ValueError(f"{op}: q, k, v must be torch tensors")
    if not (q.ndim == 4 and k.ndim == 4 and v.ndim == 4):
        raise ValueError(f"{op}: q, k, v must be [B, H, T, D] / [B, Hkv, T, D], got {_shapes(*ts)}")
    B, H, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != T or k.shape[3] != D:
        raise ValueError(f"{op}: k and v must be [B, Hkv, T, D] with q's B, T, D, got {_shapes(*ts)}")
    Hkv = k.shape[1]
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"{op}: Hkv={Hkv} must divide H={H}, got {_shapes(*ts)}")
    if T == 0 or D == 0 or B == 0:
        raise ValueError(f"{op}: empty input, got {_shapes(*ts)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"{op}: q, k, v must share one floating dtype, got {_shapes(*ts)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{op}: q, k, v must be on one device, got {_shapes(*ts)}")


def _check_bwd(op: str, do, q, k, v, o, lse) -> None:
    _check_qkv(op, q, k, v)
    B, H, T, D = q.shape
    if do.shape != q.shape or o.shape != q.shape or lse.shape != (B, H, T):
        raise ValueError(
            f"{op}: need do, o [B, H, T, D] and lse [B, H, T] matching q, got do/o/lse/q {_shapes(do, o, lse, q)}"
        )
    if do.device != q.device or o.device != q.device or lse.device != q.device:
        raise ValueError(f"{op}: all inputs must be on one device, got {_shapes(do, o, lse, q)}")
    if not (do.is_floating_point() and o.is_floating_point() and lse.is_floating_point()):
        raise ValueError(f"{op}: do, o, lse must be floating, got {_shapes(do, o, lse)}")


def _scale(op: str, scale, D: int) -> float:
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    # the kernels take the row max of the unscaled scores and multiply after: that is only the max of the
    # scaled scores when scale > 0
    if not (s > 0.0 and math.isfinite(s)):
        raise ValueError(f"{op}: scale must be a finite number > 0, got {scale!r}")
    return s


# ---------------------------------------------------------------------------------------------------------
# plain-torch tiled reference (the oracle): same recurrences as the kernels, O(T · tile) memory
# ---------------------------------------------------------------------------------------------------------
def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, Hkv*groups, T, D] view-then-copy: head h reads K/V head h // groups."""
    if groups == 1:
        return x
    B, Hkv, T, D = x.shape
    return x[:, :, None].expand(B, Hkv, groups, T, D).reshape(B, Hkv * groups, T, D)


def flash_attention_fwd_ref(q, k, v, causal: bool = True, scale: float | None = None, tile: int = REF_TILE):
    """Online-softmax forward over K/V tiles of width ``tile``. Returns (o in q.dtype, lse natural log)."""
    op = "flash_attention_fwd_ref"
    _check_qkv(op, q, k, v)
    B, H, T, D = q.shape
    s = _scale(op, scale, D)
    acc_t = _acc_dtype(q.dtype)
    groups = H // k.shape[1]
    qf = q.to(acc_t)
    kf, vf = _expand_kv(k.to(acc_t), groups), _expand_kv(v.to(acc_t), groups)  # [B, H, T, D]
    rows = torch.arange(T, device=q.device)
    m = torch.full((B, H, T), float("-inf"), dtype=acc_t, device=q.device)  # running max
    l = torch.zeros((B, H, T), dtype=acc_t, device=q.device)  # running sum
    acc = torch.zeros((B, H, T, D), dtype=acc_t, device=q.device)  # unnormalised output
    for j0 in range(0, T, tile):
        j1 = min(j0 + tile, T)
        sc = (qf @ kf[:, :, j0:j1].transpose(-1, -2)) * s  # [B, H, T, tile]
        if causal:
            cols = torch.arange(j0, j1, device=q.device)
            sc = sc.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        m_new = torch.maximum(m, sc.amax(dim=-1))
        # a row with every score so far masked keeps m = -inf; subtract 0 there instead so exp gives 0, not NaN
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(sc - m_safe[..., None])  # [B, H, T, tile]
        alpha = torch.exp(m - m_safe)  # rescales what was accumulated under the old max
        l = l * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + p @ vf[:, :, j0:j1]
        m = m_new
    o = acc / l[..., None]
    lse = m + torch.log(l)
    return o.to(q.dtype), lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def flash_attention_bwd_ref(do, q, k, v, o, lse, causal: bool = True, scale: float | None = None, tile: int = REF_TILE):
    """Backward by recomputing P one K/V tile at a time from lse. Returns (dq, dk, dv)."""
    op = "flash_attention_bwd_ref"
    _check_bwd(op, do, q, k, v, o, lse)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    groups = H // Hkv
    s = _scale(op, scale, D)
    acc_t = _acc_dtype(q.dtype)
    qf, dof, lsef = q.to(acc_t), do.to(acc_t), lse.to(acc_t)
    kf, vf = _expand_kv(k.to(acc_t), groups), _expand_kv(v.to(acc_t), groups)  # [B, H, T, D]
    delta = (dof * o.to(acc_t)).sum(dim=-1)  # D_i = rowsum(dO ∘ O), [B, H, T]
    rows = torch.arange(T, device=q.device)
    dq = torch.zeros_like(qf)
    dk = torch.empty_like(kf)  # per query head; summed over groups at the end
    dv = torch.empty_like(vf)
    for j0 in range(0, T, tile):
        j1 = min(j0 + tile, T)
        kj, vj = kf[:, :, j0:j1], vf[:, :, j0:j1]  # [B, H, tile, D]
        p = torch.exp((qf @ kj.transpose(-1, -2)) * s - lsef[..., None])  # [B, H, T, tile]
        if causal:
            cols = torch.arange(j0, j1, device=q.device)
            p = p.masked_fill(cols[None, :] > rows[:, None], 0.0)
        dv[:, :, j0:j1] = p.transpose(-1, -2) @ dof
        dp = dof @ vj.transpose(-1, -2)  # [B, H, T, tile]
        ds = p * (dp - delta[..., None])
        dq += (ds @ kj) * s
        dk[:, :, j0:j1] = (ds.transpose(-1, -2) @ qf) * s
    dk = dk.reshape(B, Hkv, groups, T, D).sum(dim=2)  # GQA: a K/V head's gradient sums over its group
    dv = dv.reshape(B, Hkv, groups, T, D).sum(dim=2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------------------------------------------
# public entry points: one dispatch rule
# ---------------------------------------------------------------------------------------------------------
def flash_attention_fwd(q, k, v, causal: bool = True, scale: float | None = None):
    """Triton on CUDA (fp32/bf16/fp16, D in 32/64/128), else the tiled reference. See the module doc."""
    _check_qkv("flash_attention_fwd", q, k, v)
    if use_triton(q, k, v) and q.dtype != torch.float64:
        return flash_attention_fwd_triton(q, k, v, causal, scale)
    return flash_attention_fwd_ref(q, k, v, causal, scale)


def flash_attention_bwd(do, q, k, v, o, lse, causal: bool = True, scale: float | None = None):
    """Triton on CUDA (fp32/bf16/fp16, D in 32/64/128), else the tiled reference. See the module doc."""
    _check_bwd("flash_attention_bwd", do, q, k, v, o, lse)
    if use_triton(do, q, k, v, o, lse) and q.dtype != torch.float64:
        return flash_attention_bwd_triton(do, q, k, v, o, lse, causal, scale)
    return flash_attention_bwd_ref(do, q, k, v, o, lse, causal, scale)


# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------
# Fixed configs per head dim, chosen by the sweep in xtrain/bench/attention.py on an H200 (bench/RESULTS.md).
# fwd:  (BLOCK_M, BLOCK_N, num_warps, num_stages, TMA); BLOCK_M must be a multiple of BLOCK_N (causal split).
# bwd:  ((BLOCK_M1, BLOCK_N1, num_warps, num_stages, TMA),  the dK/dV kernel: BLOCK_N1 resident keys,
#                                                            BLOCK_M1 query rows a step; BLOCK_N1 % BLOCK_M1 == 0
#        (BLOCK_M2, BLOCK_N2, num_warps, num_stages, TMA))  the dQ kernel: BLOCK_M2 resident query rows,
#                                                            BLOCK_N2 keys a step; BLOCK_M2 % BLOCK_N2 == 0
# TMA=True loads the streamed tiles through tensor descriptors (Hopper's bulk copy engine) when T is a
# multiple of every tile and the tensors are contiguous; otherwise the kernels use masked pointer loads.
_FWD_CONFIGS = {
    (32, "16bit"): (128, 64, 4, 3, False),
    (64, "16bit"): (128, 64, 4, 3, False),
    (128, "16bit"): (128, 128, 8, 3, False),  # T > 4096; shorter T: _FWD_SHORT_T below
    (32, "fp32"): (64, 32, 4, 2, False),
    (64, "fp32"): (64, 32, 4, 2, False),
    (128, "fp32"): (32, 32, 4, 2, False),
}
# hd128 at T <= 4096: smaller query tiles give twice the programs (better filling of 132 SMs when B·H·T/128
# is small) and TMA loads; measured 346 vs 298 TFLOP/s at T = 1k, but 480 vs 516 at T = 16k.
_FWD_SHORT_T = {(128, "16bit"): (4096, (64, 64, 4, 3, True))}
_BWD_CONFIGS = {
    (32, "16bit"): ((64, 64, 4, 3, False), (128, 64, 8, 3, True)),
    (64, "16bit"): ((64, 64, 4, 3, False), (128, 64, 8, 3, True)),
    (128, "16bit"): ((64, 64, 4, 2, True), (64, 64, 4, 2, True)),
    (32, "fp32"): ((32, 64, 4, 2, False), (64, 32, 4, 2, False)),
    (64, "fp32"): ((32, 64, 4, 2, False), (64, 32, 4, 2, False)),
    (128, "fp32"): ((16, 32, 4, 2, False), (32, 16, 4, 2, False)),
}


def _dtype_class(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "16bit"


def _fwd_config(D: int, dtype: torch.dtype, T: int):
    key = (D, _dtype_class(dtype))
    short = _FWD_SHORT_T.get(key)
    return short[1] if short is not None and T <= short[0] else _FWD_CONFIGS[key]


if HAVE_TRITON:
    import triton
    import triton.language as tl

    try:  # host-side tensor descriptors (Triton >= 3.4); without them the kernels use pointer loads
        from triton.tools.tensor_descriptor import TensorDescriptor

        _HAVE_DESC = True
    except ImportError:  # pragma: no cover
        _HAVE_DESC = False
    _LOG2E_C = tl.constexpr(LOG2E)

    @triton.jit
    def _tail_order(pid, nb, n_heads, TAIL):
        """(tile, head) of linear program id ``pid`` of a 1-D grid of nb tiles x n_heads: head by head (so the
        programs running together share one head's streamed tiles in L2), except the last TAIL heads, whose
        tiles go tile-major (tile 0 of each, then tile 1, ...). The hardware starts programs in id order and the
        callers make tile 0 the heaviest causal tile, so the grid ends on light programs, not on the last head's
        heaviest one (the Gluon backward's order, flash_attention_gluon_bwd._tail_order)."""
        first = (n_heads - TAIL) * nb
        tile = pid % nb
        head = pid // nb
        if pid >= first:
            tile = (pid - first) // TAIL
            head = n_heads - TAIL + (pid - first) % TAIL
        return tile, head

    @triton.jit
    def _fwd_tiles(
        acc,
        l_i,
        m_i,
        q,
        k_base,
        v_base,
        stride_kt,
        stride_vt,
        desc_k,
        desc_v,
        kv_row0,
        offs_m,
        T,
        qk_scale,
        lo,
        hi,
        MASK: tl.constexpr,
        CAUSAL: tl.constexpr,
        EVEN_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        """Online-softmax update of (acc, l_i, m_i) over the K/V tiles starting at lo, lo+BLOCK_N, .. < hi.
        m_i is kept in the log2 domain (scores times qk_scale = scale·log2 e). MASK=False is the hot loop:
        no mask arithmetic, every key valid."""
        offs_d = tl.arange(0, HEAD_DIM)
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k_ptrs = k_base + offs_n[:, None] * stride_kt + offs_d[None, :]
            v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]
            if USE_TMA:  # bulk tensor copy (Hopper TMA); only used when T is a multiple of the tiles
                k = desc_k.load([kv_row0 + start_n, 0])
            elif MASK and not EVEN_T:
                k = tl.load(k_ptrs, mask=offs_n[:, None] < T, other=0.0)
            else:
                k = tl.load(k_ptrs)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32, unscaled
            if MASK:
                if CAUSAL:
                    keep = offs_m[:, None] >= offs_n[None, :]  # also drops keys >= T: every query row < T
                else:
                    keep = (offs_n < T)[None, :]
                s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
            l_i = l_i * alpha + tl.sum(p, 1)
            if USE_TMA:
                v = desc_v.load([kv_row0 + start_n, 0])
            elif MASK and not EVEN_T:
                v = tl.load(v_ptrs, mask=offs_n[:, None] < T, other=0.0)
            else:
                v = tl.load(v_ptrs)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _flash_fwd_kernel(
        Q,
        K,
        V,
        O,
        LSE,
        desc_k,
        desc_v,
        stride_qb,
        stride_qh,
        stride_qt,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_vb,
        stride_vh,
        stride_vt,
        stride_ob,
        stride_oh,
        stride_ot,
        H,
        T,
        GROUP,
        qk_scale,
        TAIL,
        CAUSAL: tl.constexpr,
        EVEN_T: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        """One program: BLOCK_M query rows of one (batch, head); a 1-D grid of cdiv(T, BLOCK_M)·B·H programs
        in ``_tail_order``. With USE_TMA, K/V tiles come through host-built tensor descriptors over the
        [B*Hkv*T, D] rows."""
        nb = tl.cdiv(T, BLOCK_M)
        pid_m, off_bh = _tail_order(tl.program_id(0), nb, tl.num_programs(0) // nb, TAIL)
        if CAUSAL:  # heaviest query tiles first: the short ones fill the tail of the grid
            pid_m = nb - 1 - pid_m
        off_b = off_bh // H
        off_h = off_bh % H
        off_kvh = off_h // GROUP
        start_m = pid_m * BLOCK_M
        kv_row0 = (off_b * (H // GROUP) + off_kvh) * T  # first row of this K/V head in [B*Hkv*T, D]
        q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        k_base = K + off_b.to(tl.int64) * stride_kb + off_kvh.to(tl.int64) * stride_kh
        v_base = V + off_b.to(tl.int64) * stride_vb + off_kvh.to(tl.int64) * stride_vh
        o_base = O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        q_ptrs = q_base + offs_m[:, None] * stride_qt + offs_d[None, :]
        if EVEN_T:
            q = tl.load(q_ptrs)
        else:
            q = tl.load(q_ptrs, mask=offs_m[:, None] < T, other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if CAUSAL:
            # keys strictly left of this query tile: never masked
            acc, l_i, m_i = _fwd_tiles(
                acc,
                l_i,
                m_i,
                q,
                k_base,
                v_base,
                stride_kt,
                stride_vt,
                desc_k,
                desc_v,
                kv_row0,
                offs_m,
                T,
                qk_scale,
                0,
                start_m,
                False,
                CAUSAL,
                EVEN_T,
                BLOCK_N,
                HEAD_DIM,
                DOT_PRECISION,
                USE_TMA,
            )
            # the diagonal band: causal mask
            acc, l_i, m_i = _fwd_tiles(
                acc,
                l_i,
                m_i,
                q,
                k_base,
                v_base,
                stride_kt,
                stride_vt,
                desc_k,
                desc_v,
                kv_row0,
                offs_m,
                T,
                qk_scale,
                start_m,
                tl.minimum(start_m + BLOCK_M, T),
                True,
                CAUSAL,
                EVEN_T,
                BLOCK_N,
                HEAD_DIM,
                DOT_PRECISION,
                USE_TMA,
            )
        else:
            t_full = (T // BLOCK_N) * BLOCK_N
            acc, l_i, m_i = _fwd_tiles(
                acc,
                l_i,
                m_i,
                q,
                k_base,
                v_base,
                stride_kt,
                stride_vt,
                desc_k,
                desc_v,
                kv_row0,
                offs_m,
                T,
                qk_scale,
                0,
                t_full,
                False,
                CAUSAL,
                EVEN_T,
                BLOCK_N,
                HEAD_DIM,
                DOT_PRECISION,
                USE_TMA,
            )
            if not EVEN_T:  # the ragged last K/V tile: keys >= T masked
                acc, l_i, m_i = _fwd_tiles(
                    acc,
                    l_i,
                    m_i,
                    q,
                    k_base,
                    v_base,
                    stride_kt,
                    stride_vt,
                    desc_k,
                    desc_v,
                    kv_row0,
                    offs_m,
                    T,
                    qk_scale,
                    t_full,
                    T,
                    True,
                    CAUSAL,
                    EVEN_T,
                    BLOCK_N,
                    HEAD_DIM,
                    DOT_PRECISION,
                    USE_TMA,
                )
        acc = acc / l_i[:, None]
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # log2 domain -> natural log (x ln 2)
        o_ptrs = o_base + offs_m[:, None] * stride_ot + offs_d[None, :]
        lse_ptrs = LSE + off_bh.to(tl.int64) * T + offs_m
        if EVEN_T:
            tl.store(o_ptrs, acc.to(O.dtype.element_ty))
            tl.store(lse_ptrs, lse)
        else:
            tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=offs_m[:, None] < T)
            tl.store(lse_ptrs, lse, mask=offs_m < T)

    @triton.jit
    def _flash_bwd_preprocess_kernel(
        O,
        DO,
        DELTA,
        LSE,
        LSE2,
        LSEC,
        DELTAC,
        INV_SCALE,
        stride_ob,
        stride_oh,
        stride_ot,
        stride_dob,
        stride_doh,
        stride_dot,
        H,
        T,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        SCALE_LSE: tl.constexpr = False,
        COLS: tl.constexpr = 0,
    ):
        """DELTA[b, h, i] = sum_d dO[b, h, i, d] · O[b, h, i, d] in fp32; SCALE_LSE: also LSE2 = LSE · log2(e)
        (the Gluon split backward's base-2 row statistic; LSE, LSE2 contiguous fp32 [B, H, T]). COLS (> 0, with
        SCALE_LSE): also LSEC and DELTAC, contiguous [B, H, T, COLS] in O's dtype, row i holding -LSE[i] · INV_SCALE
        (INV_SCALE = 1 / softmax scale) and -DELTA[i] each as three parts in that dtype (columns 0-2, the parts
        summing to the fp32 value to ~24 bits; zeros after): the Gluon split's OPT_LSEMMA columns."""
        pid_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = off_bh // H
        off_h = off_bh % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m[:, None] < T
        o = tl.load(
            O
            + off_b.to(tl.int64) * stride_ob
            + off_h.to(tl.int64) * stride_oh
            + offs_m[:, None] * stride_ot
            + offs_d[None, :],
            mask=row_ok,
            other=0.0,
        )
        do = tl.load(
            DO
            + off_b.to(tl.int64) * stride_dob
            + off_h.to(tl.int64) * stride_doh
            + offs_m[:, None] * stride_dot
            + offs_d[None, :],
            mask=row_ok,
            other=0.0,
        )
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
        tl.store(DELTA + off_bh.to(tl.int64) * T + offs_m, delta, mask=offs_m < T)
        if SCALE_LSE:
            lse = tl.load(LSE + off_bh.to(tl.int64) * T + offs_m, mask=offs_m < T)
            tl.store(LSE2 + off_bh.to(tl.int64) * T + offs_m, lse * _LOG2E_C, mask=offs_m < T)
            if COLS > 0:
                cols = tl.arange(0, COLS)
                at = (off_bh.to(tl.int64) * T + offs_m)[:, None] * COLS + cols[None, :]
                tl.store(LSEC + at, _three_parts(-lse * INV_SCALE, cols, LSEC.dtype.element_ty), mask=row_ok)
                tl.store(DELTAC + at, _three_parts(-delta, cols, DELTAC.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _three_parts(x, cols, dtype: tl.constexpr):
        """[BLOCK_M, COLS] in dtype: row i = (hi, mid, lo, 0, ...) with hi + mid + lo = x[i] to ~24 bits (each part
        the dtype rounding of what the ones before it leave)."""
        hi = x.to(dtype)
        r = x - hi.to(tl.float32)
        mid = r.to(dtype)
        lo = (r - mid.to(tl.float32)).to(dtype)
        c = cols[None, :]
        zero = tl.zeros_like(hi)[:, None]
        return tl.where(c == 0, hi[:, None], tl.where(c == 1, mid[:, None], tl.where(c == 2, lo[:, None], zero)))

    @triton.jit
    def _bwd_dkdv_tiles(
        dk,
        dv,
        k,
        v,
        q_base,
        do_base,
        lse_base,
        delta_base,
        stride_qt,
        stride_dot,
        desc_q,
        desc_do,
        q_row0,
        offs_n,
        T,
        qk_scale,
        lo,
        hi,
        MASK: tl.constexpr,
        EVEN_T: tl.constexpr,
        BLOCK_M: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        """Accumulate dK, dV of one resident K/V tile over the query tiles lo, lo+BLOCK_M, .. < hi, working
        transposed ([keys, queries]) so the products with q and dO need no transposes of the results.
        Query rows >= T load as zeros (q, dO, lse, delta) and so contribute exactly zero."""
        offs_d = tl.arange(0, HEAD_DIM)
        for start_m in range(lo, hi, BLOCK_M):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_ptrs = q_base + offs_m[:, None] * stride_qt + offs_d[None, :]
            do_ptrs = do_base + offs_m[:, None] * stride_dot + offs_d[None, :]
            if USE_TMA:
                q = desc_q.load([q_row0 + start_m, 0])
                lse = tl.load(lse_base + offs_m)
            elif EVEN_T:
                q = tl.load(q_ptrs)
                lse = tl.load(lse_base + offs_m)
            else:
                q = tl.load(q_ptrs, mask=offs_m[:, None] < T, other=0.0)
                lse = tl.load(lse_base + offs_m, mask=offs_m < T, other=0.0)
            s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
            p_t = tl.exp2(s_t * qk_scale - (lse * 1.4426950408889634)[None, :])  # lse to log2 domain
            if MASK:
                p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
            if USE_TMA:
                do = desc_do.load([q_row0 + start_m, 0])
                delta = tl.load(delta_base + offs_m)
            elif EVEN_T:
                do = tl.load(do_ptrs)
                delta = tl.load(delta_base + offs_m)
            else:
                do = tl.load(do_ptrs, mask=offs_m[:, None] < T, other=0.0)
                delta = tl.load(delta_base + offs_m, mask=offs_m < T, other=0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        return dk, dv

    @triton.jit
    def _flash_bwd_dkdv_kernel(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DK,
        DV,
        desc_q,
        desc_do,
        stride_qb,
        stride_qh,
        stride_qt,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_vb,
        stride_vh,
        stride_vt,
        stride_dob,
        stride_doh,
        stride_dot,
        stride_dkb,
        stride_dkh,
        stride_dkt,
        stride_dvb,
        stride_dvh,
        stride_dvt,
        H,
        Hkv,
        T,
        GROUP,
        qk_scale,
        sm_scale,
        TAIL,
        CAUSAL: tl.constexpr,
        EVEN_T: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        """One program: BLOCK_N keys of one (batch, K/V head), over all query heads of its group; a 1-D grid
        of cdiv(T, BLOCK_N)·B·Hkv programs in ``_tail_order``. Causal programs at small pid_n have the most
        work and start first."""
        nb = tl.cdiv(T, BLOCK_N)
        pid_n, off_bkv = _tail_order(tl.program_id(0), nb, tl.num_programs(0) // nb, TAIL)
        off_b = off_bkv // Hkv
        off_kvh = off_bkv % Hkv
        start_n = pid_n * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        k_ptrs = (
            K
            + off_b.to(tl.int64) * stride_kb
            + off_kvh.to(tl.int64) * stride_kh
            + offs_n[:, None] * stride_kt
            + offs_d[None, :]
        )
        v_ptrs = (
            V
            + off_b.to(tl.int64) * stride_vb
            + off_kvh.to(tl.int64) * stride_vh
            + offs_n[:, None] * stride_vt
            + offs_d[None, :]
        )
        if EVEN_T:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=offs_n[:, None] < T, other=0.0)
            v = tl.load(v_ptrs, mask=offs_n[:, None] < T, other=0.0)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        for g in range(GROUP):
            off_h = off_kvh * GROUP + g
            q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
            do_base = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
            lse_base = LSE + (off_b * H + off_h).to(tl.int64) * T
            delta_base = DELTA + (off_b * H + off_h).to(tl.int64) * T
            q_row0 = (off_b * H + off_h) * T  # first row of this head in [B*H*T, D] (TMA coordinates)
            if CAUSAL:
                # query rows in this key tile's diagonal band see only part of it: masked
                dk, dv = _bwd_dkdv_tiles(
                    dk,
                    dv,
                    k,
                    v,
                    q_base,
                    do_base,
                    lse_base,
                    delta_base,
                    stride_qt,
                    stride_dot,
                    desc_q,
                    desc_do,
                    q_row0,
                    offs_n,
                    T,
                    qk_scale,
                    start_n,
                    tl.minimum(start_n + BLOCK_N, T),
                    True,
                    EVEN_T,
                    BLOCK_M,
                    HEAD_DIM,
                    DOT_PRECISION,
                    USE_TMA,
                )
                # query rows below the band see all of it
                dk, dv = _bwd_dkdv_tiles(
                    dk,
                    dv,
                    k,
                    v,
                    q_base,
                    do_base,
                    lse_base,
                    delta_base,
                    stride_qt,
                    stride_dot,
                    desc_q,
                    desc_do,
                    q_row0,
                    offs_n,
                    T,
                    qk_scale,
                    start_n + BLOCK_N,
                    T,
                    False,
                    EVEN_T,
                    BLOCK_M,
                    HEAD_DIM,
                    DOT_PRECISION,
                    USE_TMA,
                )
            else:
                dk, dv = _bwd_dkdv_tiles(
                    dk,
                    dv,
                    k,
                    v,
                    q_base,
                    do_base,
                    lse_base,
                    delta_base,
                    stride_qt,
                    stride_dot,
                    desc_q,
                    desc_do,
                    q_row0,
                    offs_n,
                    T,
                    qk_scale,
                    0,
                    T,
                    False,
                    EVEN_T,
                    BLOCK_M,
                    HEAD_DIM,
                    DOT_PRECISION,
                    USE_TMA,
                )
        dk = dk * sm_scale
        dk_ptrs = (
            DK
            + off_b.to(tl.int64) * stride_dkb
            + off_kvh.to(tl.int64) * stride_dkh
            + offs_n[:, None] * stride_dkt
            + offs_d[None, :]
        )
        dv_ptrs = (
            DV
            + off_b.to(tl.int64) * stride_dvb
            + off_kvh.to(tl.int64) * stride_dvh
            + offs_n[:, None] * stride_dvt
            + offs_d[None, :]
        )
        if EVEN_T:
            tl.store(dk_ptrs, dk.to(DK.dtype.element_ty))
            tl.store(dv_ptrs, dv.to(DV.dtype.element_ty))
        else:
            tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=offs_n[:, None] < T)
            tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < T)

    @triton.jit
    def _bwd_dq_tiles(
        dq,
        q,
        do,
        lse2,
        delta,
        k_base,
        v_base,
        stride_kt,
        stride_vt,
        desc_k,
        desc_v,
        kv_row0,
        offs_m,
        T,
        qk_scale,
        lo,
        hi,
        MASK: tl.constexpr,
        EVEN_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        """Accumulate dQ of one resident query tile over the K/V tiles lo, lo+BLOCK_N, .. < hi.
        Keys >= T load as zero rows of K, so their dS (whatever it is) times k adds exactly zero."""
        offs_d = tl.arange(0, HEAD_DIM)
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k_ptrs = k_base + offs_n[:, None] * stride_kt + offs_d[None, :]
            v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]
            if USE_TMA:
                k = desc_k.load([kv_row0 + start_n, 0])
                v = desc_v.load([kv_row0 + start_n, 0])
            elif EVEN_T:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
            else:
                k = tl.load(k_ptrs, mask=offs_n[:, None] < T, other=0.0)
                v = tl.load(v_ptrs, mask=offs_n[:, None] < T, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
            p = tl.exp2(s * qk_scale - lse2[:, None])
            if MASK:
                p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        return dq

    @triton.jit
    def _flash_bwd_dq_kernel(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DQ,
        desc_k,
        desc_v,
        stride_qb,
        stride_qh,
        stride_qt,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_vb,
        stride_vh,
        stride_vt,
        stride_dob,
        stride_doh,
        stride_dot,
        stride_dqb,
        stride_dqh,
        stride_dqt,
        H,
        T,
        GROUP,
        qk_scale,
        sm_scale,
        TAIL,
        CAUSAL: tl.constexpr,
        EVEN_T: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        """One program: BLOCK_M query rows of one (batch, head); a 1-D grid of cdiv(T, BLOCK_M)·B·H programs in
        ``_tail_order``, heaviest causal tiles first."""
        nb = tl.cdiv(T, BLOCK_M)
        pid_m, off_bh = _tail_order(tl.program_id(0), nb, tl.num_programs(0) // nb, TAIL)
        if CAUSAL:
            pid_m = nb - 1 - pid_m
        off_b = off_bh // H
        off_h = off_bh % H
        off_kvh = off_h // GROUP
        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        q_ptrs = (
            Q
            + off_b.to(tl.int64) * stride_qb
            + off_h.to(tl.int64) * stride_qh
            + offs_m[:, None] * stride_qt
            + offs_d[None, :]
        )
        do_ptrs = (
            DO
            + off_b.to(tl.int64) * stride_dob
            + off_h.to(tl.int64) * stride_doh
            + offs_m[:, None] * stride_dot
            + offs_d[None, :]
        )
        row = off_bh.to(tl.int64) * T + offs_m
        if EVEN_T:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(LSE + row)
            delta = tl.load(DELTA + row)
        else:
            q = tl.load(q_ptrs, mask=offs_m[:, None] < T, other=0.0)
            do = tl.load(do_ptrs, mask=offs_m[:, None] < T, other=0.0)
            lse = tl.load(LSE + row, mask=offs_m < T, other=0.0)
            delta = tl.load(DELTA + row, mask=offs_m < T, other=0.0)
        lse2 = lse * 1.4426950408889634  # natural log -> log2 domain (x 1/ln 2)
        k_base = K + off_b.to(tl.int64) * stride_kb + off_kvh.to(tl.int64) * stride_kh
        v_base = V + off_b.to(tl.int64) * stride_vb + off_kvh.to(tl.int64) * stride_vh
        kv_row0 = (off_b * (H // GROUP) + off_kvh) * T
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if CAUSAL:
            dq = _bwd_dq_tiles(
                dq,
                q,
                do,
                lse2,
                delta,
                k_base,
                v_base,
                stride_kt,
                stride_vt,
                desc_k,
                desc_v,
                kv_row0,
                offs_m,
                T,
                qk_scale,
                0,
                start_m,
                False,
                EVEN_T,
                BLOCK_N,
                HEAD_DIM,
                DOT_PRECISION,
                USE_TMA,
            )
            dq = _bwd_dq_tiles(
                dq,
                q,
                do,
                lse2,
                delta,
                k_base,
                v_base,
                stride_kt,
                stride_vt,
                desc_k,
                desc_v,
                kv_row0,
                offs_m,
                T,
                qk_scale,
                start_m,
                tl.minimum(start_m + BLOCK_M, T),
                True,
                EVEN_T,
                BLOCK_N,
                HEAD_DIM,
                DOT_PRECISION,
                USE_TMA,
            )
        else:
            dq = _bwd_dq_tiles(
                dq,
                q,
                do,
                lse2,
                delta,
                k_base,
                v_base,
                stride_kt,
                stride_vt,
                desc_k,
                desc_v,
                kv_row0,
                offs_m,
                T,
                qk_scale,
                0,
                T,
                False,
                EVEN_T,
                BLOCK_N,
                HEAD_DIM,
                DOT_PRECISION,
                USE_TMA,
            )
        dq = dq * sm_scale
        dq_ptrs = (
            DQ
            + off_b.to(tl.int64) * stride_dqb
            + off_h.to(tl.int64) * stride_dqh
            + offs_m[:, None] * stride_dqt
            + offs_d[None, :]
        )
        if EVEN_T:
            tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty))
        else:
            tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=offs_m[:, None] < T)


def _check_triton(op: str, *ts) -> None:
    if not HAVE_TRITON:
        raise RuntimeError(f"{op}: triton is not importable")
    q = ts[0]
    D = q.shape[-1]
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"{op}: head dim D={D} not supported by the Triton kernels (only "
            f"{SUPPORTED_HEAD_DIMS}), got q {tuple(q.shape)}"
        )
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{op}: dtype must be float32, bfloat16 or float16, got {_shapes(*ts)}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """The kernels index [B, H, T] by strides but need unit stride along D (16-byte vector loads)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _out(buf, shape, dtype, device, name, op):
    """A caller-given output buffer (tests pass NaN-poisoned ones) or a fresh one."""
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(buf.shape) != tuple(shape) or buf.dtype != dtype or buf.device != device or buf.stride(-1) != 1:
        raise ValueError(
            f"{op}: {name} buffer must be {tuple(shape)} {dtype} on {device} with unit last stride, got {_shapes(buf)}"
        )
    return buf


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # "tf32" is ignored for 16-bit operands


# Launch plans of the Gluon paths by input signature (``_plan_key``): the first call of a signature takes the
# full path (checks, dispatch, descriptors, the JIT launch) and leaves a plan; later calls allocate the outputs
# and launch the compiled kernels directly. Host time per call on the H200 machine of session 6 (bench/RESULTS.md):
# the forward 0.12-0.33 ms and the backward 0.39-0.97 ms before, as long as the kernels at T = 1k.
_FWD_PLANS = PlanCache()
_BWD_PLANS = PlanCache()


def _plannable(*ts) -> bool:
    """Whether a call with these arguments could take a Gluon path, so a plan key is worth computing: CUDA
    tensors on an sm_90 device, with Triton and Gluon installed."""
    if not (HAVE_TRITON and all(isinstance(t, torch.Tensor) and t.is_cuda for t in ts)):
        return False
    from xtrain.kernels import flash_attention_gluon as G

    return G.HAVE_GLUON and capability(ts[0].device) == (9, 0)


def _plan_key(kind: str, ts, scale) -> tuple | None:
    """Everything a cached plan's validity depends on: each tensor's shape, strides, dtype and device, the
    scale, and the module settings that steer the dispatch (read on every call, so a bench or test that
    changes one gets a new key); None (no plan) unless every base address is 16-byte aligned."""
    from xtrain.kernels import flash_attention_gluon as G

    if not all(t.data_ptr() % 16 == 0 for t in ts):  # TMA needs it; such calls take the full path every time
        return None
    D = ts[0].shape[-1]
    if kind == "fwd":
        salt = (FWD_GLUON, tuple(GLUON_FWD_MIN_T.items()), G.plan_salt(D))
    else:
        from xtrain.kernels import flash_attention_gluon_bwd as GB
        from xtrain.kernels import flash_attention_gluon_onepass as OP

        salt = (
            BWD_GLUON,
            BWD_ONEPASS,
            BWD_TWO_STREAMS,
            tuple(GLUON_ONEPASS_MIN_T.items()),
            tuple(GLUON_BWD_MIN_T.items()),
            torch.are_deterministic_algorithms_enabled(),
            GB.DEFAULT,
            OP.DEFAULT,
            GB.TAIL_WAVES,
        )
    return (kind, scale, salt) + tuple((t.shape, t.stride(), t.dtype, t.device) for t in ts)


def _descriptor(x: torch.Tensor, block_rows: int):
    """Tensor descriptor over x [B, h, T, D] seen as its [B*h*T, D] rows, one tile = block_rows rows."""
    D = x.shape[-1]
    return TensorDescriptor(x.view(-1, D), [x.numel() // D, D], [D, 1], [block_rows, D])


def _tma_ok(tma: bool, even: bool, *ts) -> bool:
    return bool(tma) and _HAVE_DESC and even and all(t.is_contiguous() for t in ts)


def flash_attention_fwd_triton(
    q, k, v, causal: bool = True, scale: float | None = None, *, o=None, lse=None, config=None
):
    """Launch the forward kernel. ``o``/``lse``: optional output buffers; ``config``: (BLOCK_M, BLOCK_N,
    num_warps, num_stages, TMA) overriding the per-head-dim default (the bench sweeps it)."""
    op = "flash_attention_fwd"
    plan_key = None
    if config is None and o is None and lse is None and causal and FWD_GLUON and _plannable(q, k, v):
        plan_key = _plan_key("fwd", (q, k, v), scale)
        plan = _FWD_PLANS.get(plan_key) if plan_key is not None else None
        if plan is not None:  # these shapes, strides, dtypes and settings took the Gluon forward before
            return plan(q, k, v)
    _check_qkv(op, q, k, v)
    _check_triton(op, q, k, v)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    s = _scale(op, scale, D)
    q, k, v = _rows(q), _rows(k), _rows(v)
    if config is None and causal and FWD_GLUON and T >= GLUON_FWD_MIN_T.get(D, T + 1):
        from xtrain.kernels import flash_attention_gluon as G  # not at import: it imports this module

        if G.supported(q, k, v) and (o is None or o.stride() == q.stride()):
            if plan_key is not None:
                o, lse, plan = G.flash_attention_fwd_gluon(q, k, v, True, s, checked=True, plan=True)
                _FWD_PLANS.put(plan_key, plan)
                return o, lse
            return G.flash_attention_fwd_gluon(q, k, v, True, s, o=o, lse=lse, checked=True)
    BLOCK_M, BLOCK_N, num_warps, num_stages, tma = config or _fwd_config(D, q.dtype, T)
    if BLOCK_M % BLOCK_N:
        raise ValueError(f"{op}: BLOCK_M={BLOCK_M} must be a multiple of BLOCK_N={BLOCK_N}")
    o = _out(o, (B, H, T, D), q.dtype, q.device, "o", op)
    lse = _out(lse, (B, H, T), torch.float32, q.device, "lse", op)
    if not lse.is_contiguous():
        raise ValueError(f"{op}: lse buffer must be contiguous")
    even = T % BLOCK_M == 0 and T % BLOCK_N == 0
    use_tma = _tma_ok(tma, even, k, v)
    desc_k, desc_v = (_descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N)) if use_tma else (None, None)
    nb = triton.cdiv(T, BLOCK_M)
    _flash_fwd_kernel[(nb * B * H,)](
        q,
        k,
        v,
        o,
        lse,
        desc_k,
        desc_v,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        o.stride(0),
        o.stride(1),
        o.stride(2),
        H,
        T,
        H // Hkv,
        s * LOG2E,
        tail_heads(nb, B * H, grid_sms(q.device), TRITON_TAIL_WAVES),
        CAUSAL=bool(causal),
        EVEN_T=even,
        HEAD_DIM=D,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        DOT_PRECISION=_precision(q.dtype),
        USE_TMA=use_tma,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return o, lse


def bwd_route(do, q, k, v, o, lse, causal: bool = True, *, config=None, dq=None, dk=None, dv=None) -> str:
    """Which backward ``flash_attention_bwd_triton`` runs for these inputs: "onepass" (the Gluon one-pass
    kernel, causal 16-bit hd64 from ``GLUON_ONEPASS_MIN_T``; its dQ is summed by fp32 reduce-adds, so never
    under ``torch.use_deterministic_algorithms(True)``), "gluon" (the Gluon two-kernel backward, causal 16-bit
    from ``GLUON_BWD_MIN_T``: hd128, and hd64 at long T where the one-pass kernel does not run, as in
    deterministic mode) or "triton" (the rest).
    Only without an explicit Triton ``config``; a route whose kernel cannot take the inputs (layout, GPU)
    falls through to the next."""
    if config is not None or not causal or not BWD_GLUON or not q.is_cuda:
        return "triton"
    T, D = q.shape[-2], q.shape[-1]
    deterministic = torch.are_deterministic_algorithms_enabled()
    if T >= GLUON_ONEPASS_MIN_T.get(D, T + 1):
        from xtrain.kernels import flash_attention_gluon_onepass as OP  # not at import: it imports this module

        if not deterministic and BWD_ONEPASS and OP.supported_bwd(do, q, k, v, o, lse, dq=dq, dk=dk, dv=dv):
            return "onepass"
    if T >= GLUON_BWD_MIN_T.get(D, T + 1):
        from xtrain.kernels import flash_attention_gluon_bwd as GB

        if GB.supported_bwd(do, q, k, v, o, lse, dq=dq, dk=dk, dv=dv):
            return "gluon"
    return "triton"


def flash_attention_bwd_triton(
    do, q, k, v, o, lse, causal: bool = True, scale: float | None = None, *, dq=None, dk=None, dv=None, config=None
):
    """Launch preprocess (delta), dK/dV and dQ kernels, or hand the call to a Gluon backward (``bwd_route``).
    The Triton and Gluon two-kernel paths use no atomics and are bit-identical run to run; the one-pass path
    (causal 16-bit hd64, T >= GLUON_ONEPASS_MIN_T) sums dQ with fp32 reduce-adds, so its dq may differ in the
    last bits between runs: ``torch.use_deterministic_algorithms(True)`` routes around it. ``dq``/``dk``/
    ``dv``: optional output buffers; ``config``: ((BLOCK_M1, BLOCK_N1, num_warps, num_stages, TMA),
    (BLOCK_M2, BLOCK_N2, num_warps, num_stages, TMA)) for the dK/dV and dQ kernels (always Triton)."""
    op = "flash_attention_bwd"
    plan_key = None
    if (
        config is None
        and dq is None
        and dk is None
        and dv is None
        and causal
        and BWD_GLUON
        and _plannable(do, q, k, v, o, lse)
    ):
        plan_key = _plan_key("bwd", (do, q, k, v, o, lse), scale)
        plan = _BWD_PLANS.get(plan_key) if plan_key is not None else None
        if plan is not None:  # these inputs and settings took a Gluon backward before
            return plan(do, q, k, v, o, lse)
    _check_bwd(op, do, q, k, v, o, lse)
    _check_triton(op, q, k, v)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    s = _scale(op, scale, D)
    # a plan repeats the launches only: inputs that the full path converts first (do to q's dtype, lse to
    # contiguous fp32) take the full path every time
    plannable = plan_key is not None and do.dtype == q.dtype and lse.dtype == torch.float32 and lse.is_contiguous()
    do = do.to(q.dtype)
    route = bwd_route(do, q, k, v, o, lse, causal, config=config, dq=dq, dk=dk, dv=dv)
    if route in ("onepass", "gluon"):
        from xtrain.kernels import flash_attention_gluon_bwd as GB  # not at import: they import this module
        from xtrain.kernels import flash_attention_gluon_onepass as OP

        fn = OP.flash_attention_bwd_gluon_onepass if route == "onepass" else GB.flash_attention_bwd_gluon
        if plannable:
            dq, dk, dv, plan = fn(do, q, k, v, o, lse, True, s, checked=True, plan=True)
            _BWD_PLANS.put(plan_key, plan)
            return dq, dk, dv
        return fn(do, q, k, v, o, lse, True, s, dq=dq, dk=dk, dv=dv, checked=True)
    do, q, k, v, o = _rows(do), _rows(q), _rows(k), _rows(v), _rows(o)
    lse = lse.to(torch.float32).contiguous()
    config = config or _BWD_CONFIGS[(D, _dtype_class(q.dtype))]
    (BM1, BN1, W1, S1, tma1), (BM2, BN2, W2, S2, tma2) = config
    if BN1 % BM1 or BM2 % BN2:
        raise ValueError(f"{op}: need BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0, got {config}")
    dq = _out(dq, (B, H, T, D), q.dtype, q.device, "dq", op)
    dk = _out(dk, (B, Hkv, T, D), k.dtype, q.device, "dk", op)
    dv = _out(dv, (B, Hkv, T, D), v.dtype, q.device, "dv", op)
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    PRE_M = 64
    _flash_bwd_preprocess_kernel[(triton.cdiv(T, PRE_M), B * H)](
        o,
        do,
        delta,
        delta,
        delta,
        delta,
        delta,
        1.0,
        o.stride(0),
        o.stride(1),
        o.stride(2),
        do.stride(0),
        do.stride(1),
        do.stride(2),
        H,
        T,
        HEAD_DIM=D,
        BLOCK_M=PRE_M,
    )
    prec = _precision(q.dtype)
    even1 = T % BM1 == 0 and T % BN1 == 0
    use_tma1 = _tma_ok(tma1, even1, q, do)
    desc_q, desc_do = (_descriptor(q, BM1), _descriptor(do, BM1)) if use_tma1 else (None, None)

    def launch_dkdv():
        nb = triton.cdiv(T, BN1)
        _flash_bwd_dkdv_kernel[(nb * B * Hkv,)](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dk,
            dv,
            desc_q,
            desc_do,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            v.stride(0),
            v.stride(1),
            v.stride(2),
            do.stride(0),
            do.stride(1),
            do.stride(2),
            dk.stride(0),
            dk.stride(1),
            dk.stride(2),
            dv.stride(0),
            dv.stride(1),
            dv.stride(2),
            H,
            Hkv,
            T,
            H // Hkv,
            s * LOG2E,
            s,
            tail_heads(nb, B * Hkv, grid_sms(q.device), TRITON_TAIL_WAVES),
            CAUSAL=bool(causal),
            EVEN_T=even1,
            HEAD_DIM=D,
            BLOCK_M=BM1,
            BLOCK_N=BN1,
            DOT_PRECISION=prec,
            USE_TMA=use_tma1,
            num_warps=W1,
            num_stages=S1,
        )

    even2 = T % BM2 == 0 and T % BN2 == 0
    use_tma2 = _tma_ok(tma2, even2, k, v)
    desc_k, desc_v = (_descriptor(k, BN2), _descriptor(v, BN2)) if use_tma2 else (None, None)

    def launch_dq():
        nb = triton.cdiv(T, BM2)
        _flash_bwd_dq_kernel[(nb * B * H,)](
            q,
            k,
            v,
            do,
            lse,
            delta,
            dq,
            desc_k,
            desc_v,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            v.stride(0),
            v.stride(1),
            v.stride(2),
            do.stride(0),
            do.stride(1),
            do.stride(2),
            dq.stride(0),
            dq.stride(1),
            dq.stride(2),
            H,
            T,
            H // Hkv,
            s * LOG2E,
            s,
            tail_heads(nb, B * H, grid_sms(q.device), TRITON_TAIL_WAVES),
            CAUSAL=bool(causal),
            EVEN_T=even2,
            HEAD_DIM=D,
            BLOCK_M=BM2,
            BLOCK_N=BN2,
            DOT_PRECISION=prec,
            USE_TMA=use_tma2,
            num_warps=W2,
            num_stages=S2,
        )

    if BWD_TWO_STREAMS and q.is_cuda:
        # the dK/dV and dQ kernels are independent once delta exists: the dQ kernel runs on a side stream so
        # the two overlap (each one's tail of short causal programs fills with the other's work)
        run_side_by_side(q.device, launch_dkdv, launch_dq)
    else:
        launch_dkdv()
        launch_dq()
    return dq, dk, dv


# Run the backward's dQ kernel on a second CUDA stream, concurrently with the dK/dV kernel.
BWD_TWO_STREAMS = True
# The Triton kernels' program order (``_tail_order``): the last TRITON_TAIL_WAVES x SM-count programs' heads
# start tile-major; 0 = head by head throughout (the order before session 10).
TRITON_TAIL_WAVES = 2


def grid_sms(device) -> int:
    """The SM count the program orders plan for: that of a CUDA ``device``, else an H200's 132 (the
    interpreter, and the CPU stand-ins of the offline compiles: only a launch argument, the code does not
    depend on it)."""
    return sm_count(device) if device.type == "cuda" else 132


def tail_heads(nb: int, heads: int, n_sm: int, waves: int) -> int:
    """How many of the last heads of a grid of nb tiles x heads start tile-major (``_tail_order``): enough for
    ``waves`` waves of one program per SM (``n_sm`` SMs, ``grid_sms``), at most all of them."""
    return min(heads, -(-waves * n_sm // nb))


# The causal 16-bit forward goes to the Gluon kernels (flash_attention_gluon.py: warp-specialised,
# persistent, Hopper only) from these sequence lengths on, by head dim, where they measured faster than the
# Triton kernel on the H200 (bench/RESULTS.md, T = 1k-16k, session 5: hd128 1.02-1.17x cuDNN against
# 0.82-0.93x; hd64 0.91-1.08x against 0.86-0.95x). Shorter T was not measured and stays on Triton.
# FWD_GLUON = False keeps every call on the Triton kernel (the bench compares the two).
FWD_GLUON = True
GLUON_FWD_MIN_T = {64: 1024, 128: 1024}
# The causal 16-bit backward goes to the Gluon two-kernel backward (flash_attention_gluon_bwd.py) for hd128
# from T = 1024 (H200: 0.90-1.06x cuDNN against the Triton kernel's 0.76-0.92x), and for hd64 where the one-pass
# kernel does not run (deterministic mode, BWD_ONEPASS off) from T = 4096: since session 13's dK/dV changes
# (lse/delta through shared memory) the split beats the Triton kernels there (H200, bench shapes,
# bench/deterministic_bwd.py, the same bits: 1.768-1.778 / 3.375 / 6.783 ms against 1.814-1.869 / 3.681 / 7.047 at
# T = 4k / 8k / 16k) but not below (1k / 2k: 0.661 / 1.028 against 0.634 / 1.022). Session 10 had set 16384 (the
# split then: 1.839 / 3.537 / 6.894 ms). BWD_GLUON = False keeps every call on Triton.
BWD_GLUON = True
GLUON_BWD_MIN_T = {64: 4096, 128: 1024}
# The causal 16-bit hd64 backward goes to the Gluon one-pass kernel (flash_attention_gluon_onepass.py: a third
# warpgroup does the dQ products, fp32 reduce-adds) from these T on (H200: 1.06-1.09x cuDNN at T = 2k-16k
# against the Triton kernel's 0.90-1.02x); not in deterministic mode (``bwd_route``). BWD_ONEPASS = False
# keeps hd64 on Triton.
BWD_ONEPASS = True
GLUON_ONEPASS_MIN_T = {64: 1024}
