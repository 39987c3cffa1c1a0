"""Prototype causal flash-attention BACKWARD for Hopper (sm_90) written in Gluon, timed against cuDNN and
xtrain's Triton backward.

    PYTHONPATH=. python3 bench/gluon_flash_bwd.py [--seqs 1024,4096] [--head-dims 64,128] [--variants split,fused]
    python3 bench/gluon_flash_bwd.py --compile-only        # no GPU needed: compiles every variant for sm_90
    python3 bench/gluon_flash_bwd.py --replay              # no GPU needed: CPU replay of the kernels' tile order

Contract: ``gluon_flash_bwd(do, q, k, v, o, lse, causal=True, scale=None, variant=...) -> (dq, dk, dv)`` is
the contract of ``xtrain.kernels.flash_attention.flash_attention_bwd_triton``: q/do/o [B,H,T,D], k/v
[B,Hkv,T,D] (query head h reads K/V head h // (H // Hkv); dk/dv are summed over each group), lse the
natural-log row logsumexp of the forward in fp32 [B,H,T]; dq/dk/dv come back in the input dtype. Only
bf16/fp16, D in (64, 128) and T a positive multiple of 128 are accepted (ValueError otherwise): every tile
moves by TMA over the [B*heads*T, D] row view of a tensor, so a tile must never straddle two heads.

Math (FlashAttention-2 backward by recomputation, Dao 2023; base-2 exponent as in the Triton tutorial):
    delta_i = rowsum(dO_i * O_i)                                  (a small preprocess kernel)
    P_ij    = exp2(s_ij * scale * log2e - lse_i * log2e)          s = q kᵀ unscaled, masked P = 0
    dP_ij   = dO_i . v_j        dS_ij = P_ij (dP_ij - delta_i)
    dV_j    = sum_i P_ij dO_i   dK_j = scale * sum_i dS_ij q_i    dQ_i = scale * sum_j dS_ij k_j

Design (after FlashAttention-3, Shah, Bikshandi, Zhang, Thakkar, Ramani & Dao, 2024, whose Hopper
backward keeps dK/dV of a key tile in registers and accumulates dQ with TMA reduce-adds into fp32; the
Gluon idioms follow the Gluon tutorials of the Triton repository (TMA, wgmma, warp specialisation) and the
structure of bench/gluon_flash_fwd.py's "ws2" forward). Every kernel here has the same skeleton: a 1-warp
producer partition (24 registers) issues all TMA loads into a STAGES-deep shared-memory ring guarded by
per-slot "ready" (expect-tx) and "empty" (two arrivals, one per consumer) mbarriers, and two consumer
warpgroups run as separate partitions (the default partition = warpgroup 0, a 4-warp worker = warpgroup 1
with 232 registers via setmaxnreg), each owning 64 rows of the CTA's resident tile. All products are
async wgmma with fp32 accumulators; 16-bit P and dS are rounded in registers and fed as the register A
operand where their layout allows it (no shared-memory round trip).

  dK/dV kernel (one CTA = BLOCK_N = 128 keys of one (batch, kv head); warpgroup w owns keys w*64..+64;
  its K and V halves stay in shared memory). It walks the query tiles (BLOCK_M rows) of every query head
  of its GQA group — causal: only tiles at or below the diagonal — working TRANSPOSED, [keys, queries]:
      Sᵀ  = K Qᵀ          (A = K half, smem; B = permuted view of the Q tile)
      dPᵀ = V dOᵀ         (A = V half, smem; B = permuted view of the dO tile)
      Pᵀ  = exp2(Sᵀ·c − lse2), masked on the diagonal;  dSᵀ = Pᵀ ∘ (dPᵀ − delta)
      dV += Pᵀ dO         (A = Pᵀ from registers, B = dO tile)
      dK += dSᵀ Q         (A = dSᵀ from registers, B = Q tile)
  so dK and dV accumulate in registers with no transposes; lse/delta of the tile are plain loads issued
  before the tile's barrier wait. At the end dK·scale and dV go out through the (dead) K/V shared tiles
  and TMA stores.
  dQ kernel (split variants; one CTA = 128 query rows of one (batch, head), warpgroup w owns rows
  w*64..+64 with its Q and dO halves resident): per K/V tile S = Q Kᵀ, dP = dO Vᵀ, P, dS as above and
  dQ += dS K (A = dS from registers, B = the K tile); dQ·scale leaves through Q's dead shared tile.
  split     the two kernels above run concurrently on two CUDA streams (as xtrain's Triton backward):
            7 matrix products per (query, key) tile pair, no atomics, deterministic.
  fused     FlashAttention-3's one-pass form: the dK/dV kernel also forms dQ's contribution of its key
            half: dSᵀ (bf16) is written to shared memory, dQ_part = dS K_half (A = the permuted dSᵀ tile,
            B = the K half) and dQ_part is added into an fp32 dQ buffer with a TMA reduce-add
            (cp.reduce.async.bulk.tensor ... .add; Gluon 3.9 ``tma.async_atomic_add``, in 3.6 the same
            builder op through a local builtin). 5 products per tile pair (+1 because each warpgroup
            reduces its own 64-key partial: 2 reduce-adds per tile pair instead of FA3's 1). The preprocess
            zeroes the fp32 buffer, a last kernel converts it (times scale) to the input dtype.
            Not deterministic (the order of the reduce-adds varies).
  fused_atom  as fused, but dQ_part goes straight from registers by fp32 atomics (red.global.add): no
            staging, many more memory transactions (a fallback if the TMA reduce misbehaves).
  split3    split with a third ring stage in both kernels.
  split_wide  split with wider steps: hd64 dK/dV takes 128-query tiles, the dQ kernel 128-key tiles.
  split_pipe  split with the dK/dV consumer software-pipelined across query tiles (FA3's intra-warpgroup
            overlap): tile i's dV/dK wgmmas stay in flight while tile i+1's Sᵀ/dPᵀ are issued, and tile
            i's ring slot is released by the wait that retires Sᵀ_{i+1}. (Elsewhere each tile's wgmmas are
            waited before the next tile; the two warpgroups interleave each other instead.)
Not done (FlashAttention-3 has them): splitting the dQ product across both warpgroups over one shared dSᵀ
tile (it would halve the fused variant's reduce-add traffic, ≈ 17 GB at hd128/T=16k as written), a
persistent scheduler, deterministic dQ, ragged T. A 3-stage fused ring does not fit at hd128 (246 KB of
shared memory > 227 KB).

Offline build facts (sm_90, triton 3.6.0 and 3.9.0 alike; ``--compile-only`` prints them): every kernel
is launched with 168 registers/thread (3 warpgroups' worth of warps) and re-partitions them with
setmaxnreg: consumer warpgroups 248 (default) / 232 (worker), producer warp 24; cuobjdump reports 0 bytes
of local memory (no spills) for every variant and head dim. Shared memory (hd64 / hd128): split dK/dV
66 / 131 KB, dQ 66 / 131 KB; split3 82 / 164 KB; split_wide dQ 99 / 197 KB; fused 115 / 213 KB;
fused_atom 82 / 148 KB.

Triton-version notes: as bench/gluon_flash_fwd.py (aliases for the renamed TMA/barrier builtins,
``mbarrier.expect`` bytes positional, explicit ``worker_num_regs``, ``GluonASTSource`` for offline
compiles). The GPU box runs triton 3.6.0: check compiles with ``PYTHONPATH=/tmp/t36:.``.

main() first checks every variant in a child process (a deadlocked mbarrier wait would hang the run; a
CUDA fault would poison the context): a variant with no result within 120 s is killed and reported HANG.
Gate: relative-norm error ||x − ref|| / ||ref|| < 1e-2 for each of dq, dk, dv against
``flash_attention_bwd_ref`` in fp64 (B=1, H=4, Hkv=2, T=1024 and 2048, D=64 and 128, causal, outputs
NaN-poisoned; o and lse from ``flash_attention_fwd_ref`` in fp64 then cast). Timing: do_bench median of
each backward alone; cuDNN's backward alone via ``torch.autograd.grad`` on a saved SDPA graph
(retain_graph), TFLOP/s = 2.5 × 4·B·H·T²·D/2.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# ---------------------------------------------------------------------------------------------------------
# Triton 3.6 / newer compatibility (module-level aliases are resolved as globals inside @gluon.jit)
# ---------------------------------------------------------------------------------------------------------
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # 3.6: thread_barrier; later: barrier
_tma_reduce_add = getattr(tma, "async_atomic_add", None)
if _tma_reduce_add is None:  # triton 3.6: the builder op exists (the tl descriptor atomic_add uses it) but
    # Gluon does not wrap it yet; wrap it the way newer Gluon does
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _builtin

    @_builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

LOG2E = 1.4426950408889634
HALF_ROWS = 64  # rows of the resident tile owned by one consumer warpgroup
CONSUMER_REGS = gl.constexpr(232)  # registers/thread of the second consumer partition (setmaxnreg)
PRODUCER_REGS = gl.constexpr(24)


@gluon.constexpr_function
def _acc_layout(N):
    """wgmma accumulator layout of one warpgroup for a [64*k, N] result."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])


# ---------------------------------------------------------------------------------------------------------
# dK/dV kernel (+ dQ partials when FUSED)
# ---------------------------------------------------------------------------------------------------------
@gluon.jit
def _dkdv_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_bars, do_bars,
                   q_empty, do_empty, kv_row, q_head0, mt0, n_m, n_iter, T,
                   BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    KH: gl.constexpr = k_desc.block_type.shape[0]
    mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
    _tma_load(k_desc, [kv_row, 0], kv_bar, k_smem.index(0))
    _tma_load(k_desc, [kv_row + KH, 0], kv_bar, k_smem.index(1))
    _tma_load(v_desc, [kv_row, 0], kv_bar, v_smem.index(0))
    _tma_load(v_desc, [kv_row + KH, 0], kv_bar, v_smem.index(1))
    for it in range(n_iter):
        g = it // n_m
        mt = mt0 + it % n_m
        q_row = (q_head0 + g) * T + mt * BLOCK_M
        slot = it % STAGES
        phase = ((it // STAGES) & 1) ^ 1  # fresh barriers: the first lap passes
        mbarrier.wait(q_empty.index(slot), phase)
        mbarrier.expect(q_bars.index(slot), q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row, 0], q_bars.index(slot), q_smem.index(slot))
        mbarrier.wait(do_empty.index(slot), phase)
        mbarrier.expect(do_bars.index(slot), do_desc.block_type.nbytes)
        _tma_load(do_desc, [q_row, 0], do_bars.index(slot), do_smem.index(slot))


@gluon.jit
def _dkdv_consumer(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar, q_bars, do_bars, q_empty, do_empty,
                   dk_desc, dv_desc, dq_desc, dq_ptr, lse_ptr, delta_ptr, kv_row, q_head0, mt0, n_m, n_iter, T,
                   start_n, qk_scale, sm_scale,
                   dtype: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, FUSED: gl.constexpr, HALF: gl.constexpr):
    """One warpgroup: keys [start_n + HALF*64, +64). Works on [keys, queries] tiles (see the docstring)."""
    KH: gl.constexpr = dk_desc.block_type.shape[0]
    s_layout: gl.constexpr = _acc_layout(BLOCK_M)  # [KH, BLOCK_M] Sᵀ, dPᵀ
    a_layout: gl.constexpr = _acc_layout(HEAD_DIM)  # [KH, HEAD_DIM] dK, dV (and [BLOCK_M, HEAD_DIM] dQ_part)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    k_half = k_smem.index(HALF)
    v_half = v_smem.index(HALF)
    k_lo = start_n + HALF * KH
    offs_k = k_lo + gl.arange(0, KH, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([KH, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([KH, HEAD_DIM], gl.float32, a_layout)
    dv = gl.zeros([KH, HEAD_DIM], gl.float32, a_layout)
    if FUSED > 0:
        dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, a_layout)
        ds_half = ds_smem.index(HALF)
        dq_half = dq_smem.index(HALF)
    mbarrier.wait(kv_bar, 0)
    for it in range(n_iter):
        g = it // n_m
        start_m = (mt0 + it % n_m) * BLOCK_M
        q_row = (q_head0 + g) * T + start_m  # row of [B*H*T] (lse, delta, dq)
        lse2 = gl.load(lse_ptr + q_row.to(gl.int64) + cols) * 1.4426950408889634
        delta = gl.load(delta_ptr + q_row.to(gl.int64) + cols)
        slot = it % STAGES
        phase = (it // STAGES) & 1
        q_t = q_smem.index(slot)
        do_t = do_smem.index(slot)
        mbarrier.wait(q_bars.index(slot), phase)
        st = warpgroup_mma(k_half, q_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_bars.index(slot), phase)
        dpt = warpgroup_mma(v_half, do_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=(st, ))
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
        if CAUSAL:
            if start_m < k_lo + KH:  # some query of the tile precedes some key of this half: mask
                keep = gl.expand_dims(start_m + cols, 0) >= gl.expand_dims(offs_k, 1)
                pt = gl.where(keep, pt, 0.0)
        p16 = pt.to(dtype)
        p_op = gl.convert_layout(p16, op_layout)
        dv_tok = warpgroup_mma(p_op, do_t, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=(dpt, ))  # retires dPᵀ; dV may still run
        dst = pt * (dpt - gl.expand_dims(delta, 0))
        ds16 = dst.to(dtype)
        ds_op = gl.convert_layout(ds16, op_layout)
        dk_tok = warpgroup_mma(ds_op, q_t, dk, is_async=True)
        if FUSED > 0:
            # dQ_part [BLOCK_M, D] = dS[:, half] K_half: dSᵀ through shared memory (A must be query-major)
            ds_half.store(ds16)
            fence_async_shared()
            _cta_barrier()
            dq_tok = warpgroup_mma(ds_half.permute((1, 0)), k_half, dq_zero, use_acc=False, is_async=True)
            dv, dk, dq_part, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok, p_op, ds_op))
        else:
            dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_op))
        mbarrier.arrive(q_empty.index(slot), count=1)
        mbarrier.arrive(do_empty.index(slot), count=1)
        if FUSED == 1:
            # the previous reduce-add must have finished reading the staging tile (only the issuing thread
            # tracks it: wait there, then a barrier) before it is overwritten
            tma.store_wait(0)
            _cta_barrier()
            dq_half.store(dq_part)
            fence_async_shared()
            _cta_barrier()
            _tma_reduce_add(dq_desc, [q_row, 0], dq_half)
        elif FUSED == 2:
            rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, a_layout))
            dcol = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, a_layout))
            ptrs = dq_ptr + (q_row.to(gl.int64) + gl.expand_dims(rows, 1)) * HEAD_DIM + gl.expand_dims(dcol, 0)
            gl.atomic_add(ptrs, dq_part, sem="relaxed")
    # epilogue: dK·scale, dV through the dead K/V halves and TMA stores
    k_half.store((dk * sm_scale).to(dtype))
    v_half.store(dv.to(dtype))
    fence_async_shared()
    _cta_barrier()
    _tma_store(dk_desc, [kv_row + HALF * KH, 0], k_half)
    _tma_store(dv_desc, [kv_row + HALF * KH, 0], v_half)
    tma.store_wait(0)


@gluon.jit
def _dkdv_consumer_pipe(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar, q_bars, do_bars, q_empty,
                        do_empty, dk_desc, dv_desc, dq_desc, dq_ptr, lse_ptr, delta_ptr, kv_row, q_head0, mt0, n_m,
                        n_iter, T, start_n, qk_scale, sm_scale,
                        dtype: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                        CAUSAL: gl.constexpr, FUSED: gl.constexpr, HALF: gl.constexpr):
    """As _dkdv_consumer (split only), software-pipelined across query tiles (FlashAttention-3's
    intra-warpgroup overlap): the dV/dK wgmmas of tile i stay in flight while Sᵀ/dPᵀ of tile i+1 are
    issued; the wait that retires Sᵀ_{i+1} also retires them (wgmma groups retire in order), and only then
    is tile i's ring slot released. Pᵀ_i/dSᵀ_i (register A operands) are kept alive through that wait."""
    KH: gl.constexpr = dk_desc.block_type.shape[0]
    s_layout: gl.constexpr = _acc_layout(BLOCK_M)
    a_layout: gl.constexpr = _acc_layout(HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    k_half = k_smem.index(HALF)
    v_half = v_smem.index(HALF)
    k_lo = start_n + HALF * KH
    offs_k = k_lo + gl.arange(0, KH, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([KH, BLOCK_M], gl.float32, s_layout)
    # dK/dV are loop-carried while a wgmma on them is in flight: carry them as wgmma accumulators
    dk = warpgroup_mma_init(gl.zeros([KH, HEAD_DIM], gl.float32, a_layout))
    dv = warpgroup_mma_init(gl.zeros([KH, HEAD_DIM], gl.float32, a_layout))
    p_op = gl.zeros([KH, BLOCK_M], dtype, op_layout)
    ds_op = gl.zeros([KH, BLOCK_M], dtype, op_layout)
    mbarrier.wait(kv_bar, 0)
    for it in range(n_iter):
        g = it // n_m
        start_m = (mt0 + it % n_m) * BLOCK_M
        q_row = (q_head0 + g) * T + start_m
        lse2 = gl.load(lse_ptr + q_row.to(gl.int64) + cols) * 1.4426950408889634
        delta = gl.load(delta_ptr + q_row.to(gl.int64) + cols)
        slot = it % STAGES
        phase = (it // STAGES) & 1
        q_t = q_smem.index(slot)
        do_t = do_smem.index(slot)
        mbarrier.wait(q_bars.index(slot), phase)
        st = warpgroup_mma(k_half, q_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_bars.index(slot), phase)
        dpt = warpgroup_mma(v_half, do_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # in flight: dV_{i-1}, dK_{i-1}, Sᵀ_i, dPᵀ_i -> wait(1) retires all but dPᵀ_i
        st, dv, dk, p_op, ds_op = warpgroup_mma_wait(1, deps=(st, dv, dk, p_op, ds_op))
        prev = (it + STAGES - 1) % STAGES
        mbarrier.arrive(q_empty.index(prev), count=1, pred=it > 0)
        mbarrier.arrive(do_empty.index(prev), count=1, pred=it > 0)
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
        if CAUSAL:
            if start_m < k_lo + KH:
                keep = gl.expand_dims(start_m + cols, 0) >= gl.expand_dims(offs_k, 1)
                pt = gl.where(keep, pt, 0.0)
        p_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv = warpgroup_mma(p_op, do_t, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=(dpt, ))  # in flight: dPᵀ_i, dV_i -> retires dPᵀ_i
        dst = pt * (dpt - gl.expand_dims(delta, 0))
        ds_op = gl.convert_layout(dst.to(dtype), op_layout)
        dk = warpgroup_mma(ds_op, q_t, dk, is_async=True)
    dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, p_op, ds_op))
    # (the last slot is not released: the producer has issued every load already)
    k_half.store((dk * sm_scale).to(dtype))
    v_half.store(dv.to(dtype))
    fence_async_shared()
    _cta_barrier()
    _tma_store(dk_desc, [kv_row + HALF * KH, 0], k_half)
    _tma_store(dv_desc, [kv_row + HALF * KH, 0], v_half)
    tma.store_wait(0)


@gluon.jit
def _bwd_dkdv_kernel(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, dq_desc, dq_ptr, lse_ptr, delta_ptr,
                     qk_scale, sm_scale, H, GROUP, T,
                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                     FUSED: gl.constexpr, PIPE: gl.constexpr):
    """grid = (T // 128, B*Hkv); num_warps = 4 (default partition = consumer warpgroup 0). The K/V/dK/dV
    descriptors have 64-row tiles (one warpgroup's half), Q/dO BLOCK_M-row tiles, dq_desc is over the fp32
    dQ buffer with BLOCK_M-row tiles (FUSED == 1)."""
    dtype: gl.constexpr = q_desc.dtype
    KH: gl.constexpr = k_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = 2 * KH
    gl.static_assert(BLOCK_N % BLOCK_M == 0)
    pid_n = gl.program_id(0)
    off_bkv = gl.program_id(1)
    Hkv = H // GROUP
    off_b = off_bkv // Hkv
    off_kvh = off_bkv % Hkv
    start_n = pid_n * BLOCK_N
    kv_row = off_bkv * T + start_n
    q_head0 = off_b * H + off_kvh * GROUP  # first query head of the group, as a [B*H] index
    if CAUSAL:
        mt0 = start_n // BLOCK_M  # query tiles above the key tile see none of it
    else:
        mt0 = 0
    n_m = T // BLOCK_M - mt0
    n_iter = GROUP * n_m

    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, KH, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, KH, HEAD_DIM], v_desc.layout)
    if FUSED > 0:
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KH, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [2, KH, BLOCK_M], ds_layout)
    else:
        ds_smem = k_smem  # unused
    if FUSED == 1:
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM], dq_desc.layout)
    else:
        dq_smem = k_smem  # unused
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(do_bars.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(do_empty.index(i), count=2)
    fence_async_shared()

    # (the partitions' argument lists are spelled out: Gluon 3.6 cannot build tuples holding constexprs)
    if PIPE:
        gl.static_assert(FUSED == 0)
        gl.warp_specialize([
            (_dkdv_consumer_pipe, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar, q_bars, do_bars, q_empty,
                          do_empty, dk_desc, dv_desc, dq_desc, dq_ptr, lse_ptr, delta_ptr, kv_row, q_head0, mt0,
                          n_m, n_iter, T, start_n, qk_scale, sm_scale, dtype, HEAD_DIM, BLOCK_M, STAGES, CAUSAL,
                          FUSED, 0)),
            (_dkdv_consumer_pipe, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar, q_bars, do_bars, q_empty,
                          do_empty, dk_desc, dv_desc, dq_desc, dq_ptr, lse_ptr, delta_ptr, kv_row, q_head0, mt0,
                          n_m, n_iter, T, start_n, qk_scale, sm_scale, dtype, HEAD_DIM, BLOCK_M, STAGES, CAUSAL,
                          FUSED, 1)),
            (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_bars,
                          do_bars, q_empty, do_empty, kv_row, q_head0, mt0, n_m, n_iter, T, BLOCK_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_dkdv_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar, q_bars, do_bars, q_empty,
                          do_empty, dk_desc, dv_desc, dq_desc, dq_ptr, lse_ptr, delta_ptr, kv_row, q_head0, mt0,
                          n_m, n_iter, T, start_n, qk_scale, sm_scale, dtype, HEAD_DIM, BLOCK_M, STAGES, CAUSAL,
                          FUSED, 0)),
            (_dkdv_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar, q_bars, do_bars, q_empty,
                          do_empty, dk_desc, dv_desc, dq_desc, dq_ptr, lse_ptr, delta_ptr, kv_row, q_head0, mt0,
                          n_m, n_iter, T, start_n, qk_scale, sm_scale, dtype, HEAD_DIM, BLOCK_M, STAGES, CAUSAL,
                          FUSED, 1)),
            (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_bars,
                          do_bars, q_empty, do_empty, kv_row, q_head0, mt0, n_m, n_iter, T, BLOCK_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---------------------------------------------------------------------------------------------------------
# dQ kernel (split variants)
# ---------------------------------------------------------------------------------------------------------
@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_bars, v_bars,
                 k_empty, v_empty, q_row, kv_row0, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    QH: gl.constexpr = q_desc.block_type.shape[0]
    mbarrier.expect(q_bar, 4 * q_desc.block_type.nbytes)
    _tma_load(q_desc, [q_row, 0], q_bar, q_smem.index(0))
    _tma_load(q_desc, [q_row + QH, 0], q_bar, q_smem.index(1))
    _tma_load(do_desc, [q_row, 0], q_bar, do_smem.index(0))
    _tma_load(do_desc, [q_row + QH, 0], q_bar, do_smem.index(1))
    for t in range(n_tiles):
        slot = t % STAGES
        phase = ((t // STAGES) & 1) ^ 1  # fresh barriers: the first lap passes
        mbarrier.wait(k_empty.index(slot), phase)
        mbarrier.expect(k_bars.index(slot), k_desc.block_type.nbytes)
        _tma_load(k_desc, [kv_row0 + t * BLOCK_N, 0], k_bars.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase)
        mbarrier.expect(v_bars.index(slot), v_desc.block_type.nbytes)
        _tma_load(v_desc, [kv_row0 + t * BLOCK_N, 0], v_bars.index(slot), v_smem.index(slot))


@gluon.jit
def _dq_consumer(q_smem, do_smem, k_smem, v_smem, q_bar, k_bars, v_bars, k_empty, v_empty, dq_desc, lse_ptr,
                 delta_ptr, q_row, start_m, n_tiles, qk_scale, sm_scale, dtype: gl.constexpr,
                 HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                 HALF: gl.constexpr):
    """One warpgroup: query rows [start_m + HALF*64, +64), resident Q/dO halves, walks the K/V ring."""
    QH: gl.constexpr = dq_desc.block_type.shape[0]
    s_layout: gl.constexpr = _acc_layout(BLOCK_N)  # [QH, BLOCK_N] S, dP
    a_layout: gl.constexpr = _acc_layout(HEAD_DIM)  # [QH, HEAD_DIM] dQ
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    q_half = q_smem.index(HALF)
    do_half = do_smem.index(HALF)
    q_lo = start_m + HALF * QH
    row0 = q_row + HALF * QH
    offs_q = gl.arange(0, QH, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    lse2 = gl.load(lse_ptr + row0.to(gl.int64) + offs_q) * 1.4426950408889634
    delta = gl.load(delta_ptr + row0.to(gl.int64) + offs_q)
    s_zero = gl.zeros([QH, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([QH, HEAD_DIM], gl.float32, a_layout)
    mbarrier.wait(q_bar, 0)
    for j in range(n_tiles):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        start_n = j * BLOCK_N
        k_t = k_smem.index(slot)
        mbarrier.wait(k_bars.index(slot), phase)
        s = warpgroup_mma(q_half, k_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_bars.index(slot), phase)
        dp = warpgroup_mma(do_half, v_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s, ))
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
        if CAUSAL:
            if start_n + BLOCK_N > q_lo + 1:  # some key of the tile follows some query of this half
                keep = gl.expand_dims(q_lo + offs_q, 1) >= gl.expand_dims(start_n + cols, 0)
                p = gl.where(keep, p, 0.0)
        dp = warpgroup_mma_wait(0, deps=(dp, ))
        mbarrier.arrive(v_empty.index(slot), count=1)
        ds = p * (dp - gl.expand_dims(delta, 1))
        ds_op = gl.convert_layout(ds.to(dtype), op_layout)
        dq_tok = warpgroup_mma(ds_op, k_t, dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
        mbarrier.arrive(k_empty.index(slot), count=1)
    q_half.store((dq * sm_scale).to(dtype))
    fence_async_shared()
    _cta_barrier()
    _tma_store(dq_desc, [row0, 0], q_half)
    tma.store_wait(0)


@gluon.jit
def _bwd_dq_kernel(q_desc, do_desc, k_desc, v_desc, dq_desc, lse_ptr, delta_ptr, qk_scale, sm_scale, H, GROUP, T,
                   HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """grid = (T // 128, B*H), heaviest causal tiles first; num_warps = 4. Q/dO/dQ descriptors have 64-row
    tiles (one warpgroup's half), K/V BLOCK_N-row tiles."""
    dtype: gl.constexpr = q_desc.dtype
    QH: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = 2 * QH
    gl.static_assert(BLOCK_M % BLOCK_N == 0)
    pid_m = gl.program_id(0)
    off_bh = gl.program_id(1)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m
    off_b = off_bh // H
    off_h = off_bh % H
    start_m = pid_m * BLOCK_M
    q_row = off_bh * T + start_m
    kv_row0 = (off_b * (H // GROUP) + off_h // GROUP) * T
    if CAUSAL:
        n_tiles = (start_m + BLOCK_M) // BLOCK_N
    else:
        n_tiles = T // BLOCK_N

    q_smem = gl.allocate_shared_memory(dtype, [2, QH, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, QH, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()

    gl.warp_specialize([
        (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, k_bars, v_bars, k_empty, v_empty, dq_desc, lse_ptr,
                        delta_ptr, q_row, start_m, n_tiles, qk_scale, sm_scale, dtype, HEAD_DIM, BLOCK_N, STAGES,
                        CAUSAL, 0)),
        (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, k_bars, v_bars, k_empty, v_empty, dq_desc, lse_ptr,
                        delta_ptr, q_row, start_m, n_tiles, qk_scale, sm_scale, dtype, HEAD_DIM, BLOCK_N, STAGES,
                        CAUSAL, 1)),
        (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_bars, v_bars,
                        k_empty, v_empty, q_row, kv_row0, n_tiles, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---------------------------------------------------------------------------------------------------------
# small elementwise kernels (plain Triton): delta (+ zeroed fp32 dQ buffer), fp32 dQ -> input dtype
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_pre_kernel(O, DO, DELTA, DQACC, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ZERO: tl.constexpr):
    """Rows of the [B*H*T, D] views: delta = rowsum(O * dO) in fp32; ZERO: DQACC rows = 0."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs = rows.to(tl.int64)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(O + offs).to(tl.float32)
    do = tl.load(DO + offs).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, axis=1))
    if ZERO:
        tl.store(DQACC + offs, tl.zeros([BLOCK, HEAD_DIM], tl.float32))


@triton.jit
def _dq_convert_kernel(DQACC, DQ, scale, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(DQACC + offs, mask=offs < N)
    tl.store(DQ + offs, (x * scale).to(DQ.dtype.element_ty), mask=offs < N)


# ---------------------------------------------------------------------------------------------------------
# variants and host side
# ---------------------------------------------------------------------------------------------------------
# name -> (kind, {head_dim: config}); kind "split": config = (BLOCK_M_kv, STAGES_kv, BLOCK_N_q, STAGES_q, PIPE)
# (the dK/dV kernel's query step and ring depth, the dQ kernel's key step and ring depth, 1 = the pipelined
# dK/dV consumer); kind "fused":
# config = (BLOCK_M_kv, STAGES_kv, FUSED mode: 1 TMA reduce-add, 2 atomics). Resident tiles are 128 rows
# (2 warpgroups x 64).
VARIANTS = {
    "split": ("split", {64: (64, 2, 64, 2, 0), 128: (64, 2, 64, 2, 0)}),
    "split3": ("split", {64: (64, 3, 64, 3, 0), 128: (64, 3, 64, 3, 0)}),
    "split_wide": ("split", {64: (128, 2, 128, 2, 0), 128: (64, 2, 128, 2, 0)}),
    "split_pipe": ("split", {64: (64, 2, 64, 2, 1), 128: (64, 2, 64, 2, 1)}),
    "fused": ("fused", {64: (64, 2, 1), 128: (64, 2, 1)}),
    "fused_atom": ("fused", {64: (64, 2, 2), 128: (64, 2, 2)}),
}
DEFAULT_VARIANT = "split"
RESIDENT = 128  # keys per dK/dV CTA, query rows per dQ CTA
TWO_STREAMS = True
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def _desc(x, rows, dtype=None):
    """Host TMA descriptor over x's [N, D] row view with [rows, D] tiles (x contiguous)."""
    D = x.shape[-1]
    gdt = dtype or _GL_DTYPES[x.dtype]
    x2 = x.view(-1, D)
    lay = gl.NVMMASharedLayout.get_default_for([rows, D], gdt)
    return TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [rows, D], lay)


def _check(do, q, k, v, o, lse, variant):
    if variant not in VARIANTS:
        raise ValueError(f"gluon_flash_bwd: unknown variant {variant!r}, have {sorted(VARIANTS)}")
    if not (q.ndim == k.ndim == v.ndim == 4):
        raise ValueError("gluon_flash_bwd: q, k, v must be [B, H, T, D] / [B, Hkv, T, D]")
    B, H, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != T or k.shape[3] != D:
        raise ValueError(f"gluon_flash_bwd: k, v must be [B, Hkv, T, D] matching q, got {tuple(k.shape)}")
    if do.shape != q.shape or o.shape != q.shape or tuple(lse.shape) != (B, H, T):
        raise ValueError("gluon_flash_bwd: need do, o [B, H, T, D] and lse [B, H, T] matching q")
    Hkv = k.shape[1]
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"gluon_flash_bwd: Hkv={Hkv} must divide H={H}")
    if q.dtype not in _GL_DTYPES or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"gluon_flash_bwd: q, k, v must all be bf16 or all fp16, got {q.dtype}")
    if D not in VARIANTS[variant][1]:
        raise ValueError(f"gluon_flash_bwd: head dim {D} not supported (only {sorted(VARIANTS[variant][1])})")
    if T == 0 or T % RESIDENT:
        raise ValueError(f"gluon_flash_bwd: T={T} must be a positive multiple of {RESIDENT}")


def _plan(variant, D):
    kind, cfg = VARIANTS[variant]
    return kind, cfg[D]


def gluon_flash_bwd(do, q, k, v, o, lse, causal=True, scale=None, variant=DEFAULT_VARIANT, *,
                    dq=None, dk=None, dv=None):
    """Backward attention with the Gluon kernels of ``variant``. Returns (dq, dk, dv) in q.dtype.
    ``dq``/``dk``/``dv``: optional contiguous output buffers (the check passes NaN-poisoned ones)."""
    _check(do, q, k, v, o, lse, variant)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not (s > 0.0 and math.isfinite(s)):
        raise ValueError(f"gluon_flash_bwd: scale must be a finite number > 0, got {scale!r}")
    do = do.to(q.dtype).contiguous()
    q, k, v, o = q.contiguous(), k.contiguous(), v.contiguous(), o.contiguous()
    lse = lse.to(torch.float32).contiguous()
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    for name, buf, ref in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if not (buf.is_contiguous() and buf.shape == ref.shape and buf.dtype == ref.dtype):
            raise ValueError(f"gluon_flash_bwd: {name} must be contiguous, shaped and typed like its input")
    kind, cfg = _plan(variant, D)
    fused = kind == "fused"
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    dq_acc = torch.empty((B, H, T, D), dtype=torch.float32, device=q.device) if fused else delta
    PRE = 64
    _bwd_pre_kernel[(B * H * T // PRE, )](o, do, delta, dq_acc, HEAD_DIM=D, BLOCK=PRE, ZERO=fused, num_warps=4)
    qk_scale = s * LOG2E

    BM1, ST1 = cfg[0], cfg[1]
    fmode = cfg[2] if fused else 0
    pipe = 0 if fused else cfg[4]
    q1, do1 = _desc(q, BM1), _desc(do, BM1)
    kvd = [_desc(x, HALF_ROWS) for x in (k, v, dk, dv)]
    dq1 = _desc(dq_acc, BM1, gl.float32) if fmode == 1 else q1  # unused unless the TMA reduce-add runs

    def launch_dkdv():
        _bwd_dkdv_kernel[(T // RESIDENT, B * Hkv)](
            q1, do1, *kvd, dq1, dq_acc, lse, delta, qk_scale, s, H, H // Hkv, T,
            HEAD_DIM=D, BLOCK_M=BM1, STAGES=ST1, CAUSAL=bool(causal), FUSED=fmode, PIPE=pipe, num_warps=4)

    if fused:
        launch_dkdv()
        N = dq.numel()
        CV = 4096
        _dq_convert_kernel[(triton.cdiv(N, CV), )](dq_acc, dq, s, N, BLOCK=CV, num_warps=8)
        return dq, dk, dv

    BN2, ST2 = cfg[2], cfg[3]
    qd2, dod2, dqd2 = _desc(q, HALF_ROWS), _desc(do, HALF_ROWS), _desc(dq, HALF_ROWS)
    kd2, vd2 = _desc(k, BN2), _desc(v, BN2)

    def launch_dq():
        _bwd_dq_kernel[(T // RESIDENT, B * H)](
            qd2, dod2, kd2, vd2, dqd2, lse, delta, qk_scale, s, H, H // Hkv, T,
            HEAD_DIM=D, BLOCK_N=BN2, STAGES=ST2, CAUSAL=bool(causal), num_warps=4)

    if TWO_STREAMS and q.is_cuda:
        from xtrain.kernels._dispatch import side_stream

        main_s = torch.cuda.current_stream(q.device)
        side = side_stream(q.device)
        side.wait_stream(main_s)
        with torch.cuda.stream(side):
            launch_dq()
        launch_dkdv()
        main_s.wait_stream(side)
    else:
        launch_dkdv()
        launch_dq()
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------------
# CPU replay of the kernels' tile schedule and math (no GPU): --replay
# ---------------------------------------------------------------------------------------------------------
def replay(variant, D=64, T=384, B=1, H=4, Hkv=2, causal=True, seed=0):
    """Replays, in torch fp64 on the CPU, exactly the loops the kernels run (which tiles, in which order,
    which are masked, which warpgroup half owns which rows, the transposed dK/dV formulation, the fused
    dQ partials per key half) and returns the max relative errors of dq, dk, dv against
    flash_attention_bwd_ref. Catches schedule/mask/indexing mistakes, not layout or barrier bugs."""
    from xtrain.kernels.flash_attention import flash_attention_bwd_ref, flash_attention_fwd_ref

    kind, cfg = _plan(variant, D)
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, h, T, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv, H))
    o, lse = flash_attention_fwd_ref(q, k, v, causal)
    s = 1.0 / math.sqrt(D)
    qk = s * LOG2E
    GROUP = H // Hkv
    qf, dof = q.reshape(B * H * T, D), do.reshape(B * H * T, D)
    kf, vf = k.reshape(B * Hkv * T, D), v.reshape(B * Hkv * T, D)
    lse_f = lse.reshape(-1)
    delta = (do * o).sum(-1).reshape(-1)
    dq = torch.zeros(B * H * T, D, dtype=torch.float64)
    dk = torch.zeros(B * Hkv * T, D, dtype=torch.float64)
    dv = torch.zeros_like(dk)
    BM1 = cfg[0]
    for pid_n in range(T // RESIDENT):  # dK/dV kernel grid
        for off_bkv in range(B * Hkv):
            off_b, off_kvh = off_bkv // Hkv, off_bkv % Hkv
            start_n = pid_n * RESIDENT
            kv_row = off_bkv * T + start_n
            q_head0 = off_b * H + off_kvh * GROUP
            mt0 = start_n // BM1 if causal else 0
            n_m = T // BM1 - mt0
            for half in range(2):
                k_lo = start_n + half * HALF_ROWS
                kh = kf[kv_row + half * HALF_ROWS: kv_row + (half + 1) * HALF_ROWS]
                vh = vf[kv_row + half * HALF_ROWS: kv_row + (half + 1) * HALF_ROWS]
                dkh = torch.zeros_like(kh)
                dvh = torch.zeros_like(vh)
                for it in range(GROUP * n_m):
                    gg, start_m = it // n_m, (mt0 + it % n_m) * BM1
                    q_row = (q_head0 + gg) * T + start_m
                    qt, dot = qf[q_row:q_row + BM1], dof[q_row:q_row + BM1]
                    st = kh @ qt.T
                    pt = torch.exp2(st * qk - (lse_f[q_row:q_row + BM1] * LOG2E)[None, :])
                    if causal and start_m < k_lo + HALF_ROWS:
                        keep = (start_m + torch.arange(BM1))[None, :] >= (k_lo + torch.arange(HALF_ROWS))[:, None]
                        pt = torch.where(keep, pt, 0.0)
                    dvh += pt @ dot
                    dst = pt * (vh @ dot.T - delta[q_row:q_row + BM1][None, :])
                    dkh += dst @ qt
                    if kind == "fused":
                        dq[q_row:q_row + BM1] += dst.T @ kh  # the per-half partial, reduce-added
                dk[kv_row + half * HALF_ROWS: kv_row + (half + 1) * HALF_ROWS] = dkh * s
                dv[kv_row + half * HALF_ROWS: kv_row + (half + 1) * HALF_ROWS] = dvh
    if kind == "fused":
        dq *= s
    else:
        BN2 = cfg[2]
        for pid in range(T // RESIDENT):  # dQ kernel grid (heaviest first)
            for off_bh in range(B * H):
                pid_m = T // RESIDENT - 1 - pid if causal else pid
                off_b, off_h = off_bh // H, off_bh % H
                start_m = pid_m * RESIDENT
                q_row = off_bh * T + start_m
                kv_row0 = (off_b * Hkv + off_h // GROUP) * T
                n_tiles = (start_m + RESIDENT) // BN2 if causal else T // BN2
                for half in range(2):
                    q_lo, row0 = start_m + half * HALF_ROWS, q_row + half * HALF_ROWS
                    qh, doh = qf[row0:row0 + HALF_ROWS], dof[row0:row0 + HALF_ROWS]
                    lse2 = lse_f[row0:row0 + HALF_ROWS] * LOG2E
                    dqh = torch.zeros_like(qh)
                    for j in range(n_tiles):
                        sn = j * BN2
                        kt, vt = kf[kv_row0 + sn: kv_row0 + sn + BN2], vf[kv_row0 + sn: kv_row0 + sn + BN2]
                        p = torch.exp2((qh @ kt.T) * qk - lse2[:, None])
                        if causal and sn + BN2 > q_lo + 1:
                            keep = (q_lo + torch.arange(HALF_ROWS))[:, None] >= (sn + torch.arange(BN2))[None, :]
                            p = torch.where(keep, p, 0.0)
                        ds = p * (doh @ vt.T - delta[row0:row0 + HALF_ROWS][:, None])
                        dqh += ds @ kt
                    dq[row0:row0 + HALF_ROWS] = dqh * s
    ref = flash_attention_bwd_ref(do, q, k, v, o, lse, causal)
    got = (dq.reshape(B, H, T, D), dk.reshape(B, Hkv, T, D), dv.reshape(B, Hkv, T, D))
    return [((x - r).norm() / r.norm()).item() for x, r in zip(got, ref)]


# ---------------------------------------------------------------------------------------------------------
# offline compilation (no GPU): --compile-only
# ---------------------------------------------------------------------------------------------------------
def _compile(kernel, args, consts, num_warps=4):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    sig = {a: ("constexpr" if a in consts else mangle_type(args[a])) for a in kernel.arg_names}
    src = GluonASTSource(kernel, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def compile_variant(name, D, causal=True, T=1024):
    """Compile the Gluon kernels of variant ``name`` at head dim D for sm_90 without a GPU. Returns
    {kernel name: CompiledKernel}."""
    kind, cfg = _plan(name, D)
    B, H, Hkv = 1, 4, 2
    q = torch.empty(B, H, T, D, dtype=torch.bfloat16)  # CPU tensors: only shapes, strides, dtype matter
    kv = torch.empty(B, Hkv, T, D, dtype=torch.bfloat16)
    lse = torch.empty(B, H, T, dtype=torch.float32)
    dq_acc = torch.empty(B, H, T, D, dtype=torch.float32)
    BM1, ST1 = cfg[0], cfg[1]
    fmode = cfg[2] if kind == "fused" else 0
    q1 = _desc(q, BM1)
    out = {}
    args = dict(q_desc=q1, do_desc=q1, k_desc=_desc(kv, HALF_ROWS), v_desc=_desc(kv, HALF_ROWS),
                dk_desc=_desc(kv, HALF_ROWS), dv_desc=_desc(kv, HALF_ROWS),
                dq_desc=_desc(dq_acc, BM1, gl.float32) if fmode == 1 else q1, dq_ptr=dq_acc, lse_ptr=lse,
                delta_ptr=lse, qk_scale=0.125 * LOG2E, sm_scale=0.125, H=H, GROUP=H // Hkv, T=T)
    consts = dict(HEAD_DIM=D, BLOCK_M=BM1, STAGES=ST1, CAUSAL=causal, FUSED=fmode,
                  PIPE=0 if kind == "fused" else cfg[4])
    out["dkdv"] = _compile(_bwd_dkdv_kernel, args, consts)
    if kind == "split":
        BN2, ST2 = cfg[2], cfg[3]
        qh = _desc(q, HALF_ROWS)
        args = dict(q_desc=qh, do_desc=qh, k_desc=_desc(kv, BN2), v_desc=_desc(kv, BN2), dq_desc=qh, lse_ptr=lse,
                    delta_ptr=lse, qk_scale=0.125 * LOG2E, sm_scale=0.125, H=H, GROUP=H // Hkv, T=T)
        consts = dict(HEAD_DIM=D, BLOCK_N=BN2, STAGES=ST2, CAUSAL=causal)
        out["dq"] = _compile(_bwd_dq_kernel, args, consts)
    return out


def _res_usage(cubin):
    """Registers / local memory (spills) per thread of a cubin, from the cuobjdump that ships with triton
    (best effort)."""
    import os
    import re
    import subprocess
    import tempfile

    try:
        import triton.backends.nvidia as nv

        tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            txt = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, timeout=60).stdout
        m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", txt)
        return f"{m.group(1)} regs, {m.group(2)} B local" if m else "res-usage n/a"
    except Exception as e:  # noqa: BLE001
        return f"res-usage n/a ({type(e).__name__})"


def _ptx_summary(ck):
    import re

    ptx = ck.asm.get("ptx", "")
    keys = ["wgmma.mma_async", "cp.async.bulk.tensor", "cp.reduce.async.bulk.tensor", "red.global",
            "atom.global", "mbarrier.try_wait", "setmaxnreg", "ld.local", "st.local"]
    counts = ", ".join(f"{key} x{ptx.count(key)}" for key in keys if ptx.count(key))
    regs = sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)))
    return (f"smem {getattr(ck.metadata, 'shared', '?')} B; {_res_usage(ck.asm.get('cubin', b''))}; "
            f"setmaxnreg {regs}; PTX: {counts}")


def compile_only(variants, head_dims, dump=None):
    print(f"triton {triton.__version__}: compiling Gluon backward variants for sm_90 (no GPU)")
    ok = True
    for name in variants:
        for D in head_dims:
            t0 = time.time()
            try:
                cks = compile_variant(name, D)
                for kname, ck in cks.items():
                    print(f"  {name:10s} D={D:3d} {kname:4s}: OK {time.time() - t0:5.1f}s  {_ptx_summary(ck)}")
                    if dump:
                        import os
                        os.makedirs(dump, exist_ok=True)
                        for ext in ("ttgir", "ptx"):
                            with open(f"{dump}/{name}_{kname}_d{D}.{ext}", "w") as f:
                                f.write(ck.asm.get(ext, ""))
            except Exception as e:  # noqa: BLE001
                ok = False
                print(f"  {name:10s} D={D:3d}: FAIL {type(e).__name__}: {str(e)[:3000]}")
    return ok


# ---------------------------------------------------------------------------------------------------------
# GPU check + benchmark
# ---------------------------------------------------------------------------------------------------------
def _rel_norm(x, ref):
    x = x.double()
    ref = ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_variant(name, head_dims):
    """Worst relative-norm error of dq, dk, dv against the fp64 reference (causal, T = 1024 and 2048)."""
    from xtrain.kernels.flash_attention import flash_attention_bwd_ref, flash_attention_fwd_ref

    worst = 0.0
    for D in head_dims:
        for T in (1024, 2048):
            B, H, Hkv = 1, 4, 2
            g = torch.Generator(device="cuda").manual_seed(T + D)
            q, k, v, do = (torch.randn(B, h, T, D, generator=g, device="cuda", dtype=torch.bfloat16)
                           for h in (H, Hkv, Hkv, H))
            o64, lse64 = flash_attention_fwd_ref(q.double(), k.double(), v.double(), True)
            o, lse = o64.to(torch.bfloat16), lse64.float()
            dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
            gluon_flash_bwd(do, q, k, v, o, lse, True, None, name, dq=dq, dk=dk, dv=dv)
            torch.cuda.synchronize()
            ref = flash_attention_bwd_ref(do.double(), q.double(), k.double(), v.double(), o.double(),
                                          lse.double(), True)
            errs = [_rel_norm(x, r) for x, r in zip((dq, dk, dv), ref)]
            print(f"    {name} D={D} T={T} causal: rel-norm err dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e}")
            worst = max(worst, *errs)
    return worst


def _check_one(name, head_dims):
    """Check one variant in this process; prints the @@ markers that run_checks parses."""
    print(f"@@START {name}")
    print(f"[{name}] checking vs fp64 reference (B=1, H=4, Hkv=2, T=1024/2048, causal, NaN-filled outputs)")
    sys.stdout.flush()
    t0 = time.time()
    try:
        err = check_variant(name, head_dims)
        verdict = "PASS" if err < 1e-2 else "FAIL"
        print(f"[{name}] {verdict}: worst rel-norm err {err:.2e} ({time.time() - t0:.1f}s incl. compile)")
    except Exception as e:  # noqa: BLE001
        verdict = "ERROR"
        print(f"[{name}] ERROR {type(e).__name__}: {str(e)[:500]}")
        root = e
        while root.__cause__ is not None:
            root = root.__cause__
        if root is not e:
            print(f"[{name}]   caused by {type(root).__name__}: {str(root)[:500]}")
    print(f"@@RESULT {name} {verdict}")
    sys.stdout.flush()
    return verdict


def run_checks(variants, head_dims, startup_s=180.0, per_variant_s=120.0):
    """Correctness checks in child processes (see bench/gluon_flash_fwd.py): a child stops at its first
    exception and a new child takes the remaining variants; a variant silent for per_variant_s is killed
    and reported HANG. Returns the passing variants."""
    import queue
    import subprocess
    import threading

    passing, todo = [], list(variants)
    while todo:
        cmd = [sys.executable, __file__, "--check-only", "--variants", ",".join(todo),
               "--head-dims", ",".join(map(str, head_dims))]
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        lines: queue.Queue = queue.Queue()

        def pump(stream=child.stdout, sink=lines):
            for ln in stream:
                sink.put(ln)
            sink.put(None)

        threading.Thread(target=pump, daemon=True).start()
        current, progressed, deadline = None, False, time.time() + startup_s
        while True:
            try:
                ln = lines.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                child.kill()  # the child this function started, by its handle
                child.wait()
                victim = current or todo[0]
                print(f"[{victim}] ERROR HANG: no result within {per_variant_s if current else startup_s:.0f}s, "
                      f"child killed")
                todo.remove(victim)
                break
            if ln is None:
                child.wait()
                if current is not None:
                    print(f"[{current}] ERROR the check process died (exit code {child.returncode})")
                    todo.remove(current)
                elif not progressed and todo:
                    print(f"check process exited with code {child.returncode} before checking {todo}")
                    todo = []
                break
            if ln.startswith("@@START "):
                current = ln.split()[1]
                deadline = time.time() + per_variant_s
            elif ln.startswith("@@RESULT "):
                _, name, verdict = ln.split()
                if verdict == "PASS":
                    passing.append(name)
                todo.remove(name)
                current, progressed, deadline = None, True, time.time() + per_variant_s
            else:
                print(ln, end="")
            sys.stdout.flush()
    return [v for v in variants if v in passing]


def _bench_ms(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_row(D, T, variants):
    """Backward TFLOP/s of cuDNN, xtrain's Triton backward and each variant at causal bf16, B = 16k / T,
    H = Hkv = 2048 / D. FLOPs = 2.5 x forward FLOPs (4·B·H·T²·D/2)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from xtrain.kernels.flash_attention import flash_attention_bwd_triton, flash_attention_fwd_triton

    B, H = 16384 // T, 2048 // D
    g = torch.Generator(device="cuda").manual_seed(T * 7 + D)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    flops = 2.5 * 4.0 * B * H * T * T * D / 2
    row = {"D": D, "T": T}

    def timed(col, fn):
        try:
            row[col] = flops / _bench_ms(fn) * 1e-9
        except Exception as e:  # noqa: BLE001
            print(f"  {col} D={D} T={T}: {type(e).__name__}: {str(e)[:300]}")

    try:  # cuDNN backward alone: autograd.grad on a saved graph
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        timed("cudnn", lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True))
        del out, qg, kg, vg
    except Exception as e:  # noqa: BLE001
        print(f"  cudnn D={D} T={T}: {type(e).__name__}: {str(e)[:300]}")
    o, lse = flash_attention_fwd_triton(q, k, v, True)
    timed("triton", lambda: flash_attention_bwd_triton(do, q, k, v, o, lse, True))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for name in variants:
        timed(name, lambda name=name: gluon_flash_bwd(do, q, k, v, o, lse, True, None, name, dq=dq, dk=dk, dv=dv))
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--compile-only", action="store_true", help="compile every variant for sm_90 (no GPU)")
    ap.add_argument("--replay", action="store_true", help="CPU replay of the tile schedule (no GPU)")
    ap.add_argument("--dump", default=None, help="with --compile-only: write ttgir/ptx into this folder")
    ap.add_argument("--no-isolate", action="store_true", help="run the correctness checks in this process")
    ap.add_argument("--check-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    seqs = [int(x) for x in args.seqs.split(",") if x]
    head_dims = [int(x) for x in args.head_dims.split(",") if x]
    variants = [x for x in args.variants.split(",") if x]
    for name in variants:
        if name not in VARIANTS:
            ap.error(f"unknown variant {name!r}; have {','.join(VARIANTS)}")
    if args.compile_only:
        return 0 if compile_only(variants, head_dims, args.dump) else 1
    if args.replay:
        ok = True
        for name in variants:
            for D in head_dims:
                for causal in (True, False):
                    errs = replay(name, D, causal=causal)
                    good = max(errs) < 1e-10
                    ok &= good
                    print(f"  replay {name:10s} D={D:3d} causal={causal!s:5s}: rel-norm err dq {errs[0]:.1e} "
                          f"dk {errs[1]:.1e} dv {errs[2]:.1e} {'OK' if good else 'MISMATCH'}")
        return 0 if ok else 1

    t_start = time.time()
    print(f"torch {torch.__version__}  triton {triton.__version__}  device {torch.cuda.get_device_name()}")
    sys.stdout.flush()
    if args.check_only:
        for name in variants:
            if _check_one(name, head_dims) == "ERROR":
                return 3
        return 0
    if args.no_isolate:
        passing = [name for name in variants if _check_one(name, head_dims) == "PASS"]
    else:
        passing = run_checks(variants, head_dims)
    print(f"passing variants: {passing}  ({time.time() - t_start:.0f}s)")
    sys.stdout.flush()

    rows = []
    for D in head_dims:
        for T in seqs:
            row = bench_row(D, T, passing)
            rows.append(row)
            print("  " + "  ".join(f"{c}={x:.0f}" if isinstance(x, float) else f"{c}={x}" for c, x in row.items()))
            sys.stdout.flush()

    cols = ["cudnn", "triton"] + passing
    print("\ncausal bf16 BACKWARD, TFLOP/s (x cuDNN); B = 16384 / T, H = 2048 / D; backward alone "
          "(cuDNN: autograd.grad on a saved SDPA graph)")
    print(f"{'D':>4} {'T':>6} " + " ".join(f"{c:>15}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            if c not in r:
                cells.append(f"{'-':>15}")
            elif c == "cudnn" or "cudnn" not in r:
                cells.append(f"{r[c]:>15.0f}")
            else:
                cells.append(f"{r[c]:>7.0f} ({r[c] / r['cudnn']:.2f}x)")
        print(f"{r['D']:>4} {r['T']:>6} " + " ".join(cells))
    print(f"\ntotal {time.time() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
