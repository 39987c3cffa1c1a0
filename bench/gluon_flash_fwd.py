"""Prototype causal flash-attention FORWARD for Hopper (sm_90) written in Gluon, timed against cuDNN and
xtrain's Triton forward.

    PYTHONPATH=. python3 bench/gluon_flash_fwd.py [--seqs 1024,4096] [--head-dims 64,128] [--variants pipe,ws]
    python3 bench/gluon_flash_fwd.py --compile-only        # no GPU needed: compiles every variant for sm_90

Contract: ``gluon_flash_fwd(q, k, v, causal=True, scale=None, variant=...) -> (o, lse)`` is the contract of
``xtrain.kernels.flash_attention.flash_attention_fwd_triton``: q [B,H,T,D], k/v [B,Hkv,T,D] (query head h
reads K/V head h // (H // Hkv)), o in q.dtype, lse the natural-log row logsumexp in fp32 [B,H,T]. Only
bf16/fp16, D in (64, 128) and T a multiple of the query tile (BLOCK_M = 128) are accepted (ValueError
otherwise): the K/V/Q/O tiles move by TMA over the [B*heads*T, D] row view of the tensors, so a tile must
never straddle two heads.

Design (after FlashAttention-3, Shah, Bikshandi, Zhang, Thakkar, Ramani & Dao, 2024; the Gluon idioms
follow the Gluon tutorials of the Triton repository: 04-tma, 05-wgmma, 08-warp-specialization and the
Blackwell 01-attention-forward for the overall structure). One program = BLOCK_M = 128 query rows of one
(batch, head), num_warps = 8 = two consumer warpgroups of 64 rows each (the wgmma accumulator layout
[8, 1] warps gives each warpgroup its own 64 rows):
  * Q lands once in shared memory by TMA (NVMMA-swizzled) and stays there; it is the shared-memory
    A operand of every S = Q Kᵀ wgmma (Kᵀ is a permuted view of the K tile, no data movement).
  * K and V tiles stream through a STAGES-deep ring of shared-memory slots, one mbarrier per slot for K
    and one for V (so S = Q Kᵀ can start before V has landed), each armed with expect-tx bytes.
  * Online softmax in registers in the base-2 domain: log2(e) is folded into qk_scale, exp2 everywhere,
    the row max/sum live in the rows' slice of the wgmma accumulator layout; the output normalisation is
    deferred to the end (lse = (m + log2 l) · ln 2).
  * P is rounded to bf16 in registers and converted to the wgmma register-A operand layout (for a 16-bit
    P this is a register-only relabelling of the S accumulator), so P never touches shared memory.
  * Causal: the K/V tiles left of the diagonal band run unmasked; only tiles that meet the diagonal pay
    for the mask (a uniform branch); query tiles are launched heaviest first.
  * The output tile is normalised in registers, written into Q's (now dead) shared-memory slot and stored
    by TMA; lse by plain stores.

Variants (``VARIANTS``; all with BLOCK_M = 128, 8 warps; BLOCK_N and STAGES per head dim):
  tma   the simplest correct version: TMA ring + async wgmma, but every wgmma is waited at once (no
        overlap of MMA with softmax beyond what the two warpgroups give each other).
  pipe  FlashAttention-3 intra-warpgroup pipelining: in iteration j the wgmma S_j = Q K_jᵀ and the
        wgmma O += P_{j-1} V_{j-1} are both in flight while ... the wait(1) returns S_j first; the
        softmax of S_j then runs while O += P_{j-1} V_{j-1} is still on the tensor cores.
  ws    ``pipe`` plus warp specialisation (gl.warp_specialize): a 1-warp producer partition with few
        registers issues all TMA loads (Q, then K/V into the ring, waiting on per-slot "empty" mbarriers
        that the consumers arrive on once the wgmma that read a slot has retired); the 8 consumer warps
        (default partition) only wait, compute and release.
  pipe3 / ws3: as pipe / ws with a third ring stage (more TMA lead; 224 KB of shared memory at hd128).
Not done (FlashAttention-3 has them): inter-warpgroup ping-pong scheduling with named barriers, a
persistent tile scheduler, FP8, ragged T.

Triton-version notes. The GPU box runs triton 3.6.0; newer Gluon (3.9 here) renamed some builtins, so the
kernels go through small aliases: ``tma.async_copy_global_to_shared`` (3.6) / ``tma.async_load`` (newer),
``tma.async_copy_shared_to_global`` / ``tma.async_store``; ``mbarrier.expect``'s byte count is passed
positionally (its keyword is ``bytes`` in 3.6, ``bytes_per_cta`` later); ``gl.thread_barrier`` (3.6) became ``gl.barrier``; ``gl.warp_specialize`` always gets
an explicit ``worker_num_regs`` (required in 3.6, optional later). Offline compilation uses
``triton.experimental.gluon._runtime.GluonASTSource`` (present in both; only exported later).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback

import torch

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# ---------------------------------------------------------------------------------------------------------
# Triton 3.6 / newer compatibility (module-level aliases are resolved as globals inside @gluon.jit)
# ---------------------------------------------------------------------------------------------------------
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # 3.6: thread_barrier; later: barrier

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
BLOCK_M = 128
NUM_WARPS = 8  # two consumer warpgroups of 64 query rows each


# ---------------------------------------------------------------------------------------------------------
# device helpers
# ---------------------------------------------------------------------------------------------------------
@gluon.jit
def _softmax_tile(s, m_i, l_i, qk_scale, start_m, start_n, s_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """One online-softmax step on the fp32 scores tile s = Q K_jᵀ (unscaled). Returns (p fp32, m, l,
    alpha) with m in the log2 domain (scores times qk_scale), alpha = exp2(m_old - m_new) the factor that
    rescales what was accumulated under the old max."""
    if CAUSAL:
        if start_n + BLOCK_N > start_m:  # the tile meets the diagonal band: mask keys right of the query
            offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            keep = gl.expand_dims(offs_m, 1) >= gl.expand_dims(offs_n, 0)
            s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _prologue(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, q_row, kv_row0, n_tiles,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Single-partition variants: Q, then the first STAGES K/V tiles (predicated off past n_tiles)."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [q_row, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        ok = i < n_tiles
        mbarrier.expect(k_bars.index(i), k_desc.block_type.nbytes, ok)
        _tma_load(k_desc, [kv_row0 + i * BLOCK_N, 0], k_bars.index(i), k_smem.index(i), ok)
        mbarrier.expect(v_bars.index(i), v_desc.block_type.nbytes, ok)
        _tma_load(v_desc, [kv_row0 + i * BLOCK_N, 0], v_bars.index(i), v_smem.index(i), ok)


@gluon.jit
def _refill(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, kv_row0, t, n_tiles, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr):
    """Single-partition variants: load K/V tile t into slot t % STAGES once every warp has retired the
    wgmmas that read the slot's previous tile (the thread barrier: wgmma waits are per warpgroup, the
    TMA is issued by one thread)."""
    _cta_barrier()
    ok = t < n_tiles
    slot = t % STAGES
    mbarrier.expect(k_bars.index(slot), k_desc.block_type.nbytes, ok)
    _tma_load(k_desc, [kv_row0 + t * BLOCK_N, 0], k_bars.index(slot), k_smem.index(slot), ok)
    mbarrier.expect(v_bars.index(slot), v_desc.block_type.nbytes, ok)
    _tma_load(v_desc, [kv_row0 + t * BLOCK_N, 0], v_bars.index(slot), v_smem.index(slot), ok)


@gluon.jit
def _epilogue(acc, m_i, l_i, o_desc, q_smem, lse_ptr, q_row, lse_row, s_layout: gl.constexpr,
              o_layout: gl.constexpr, BLOCK_M: gl.constexpr):
    """o = acc / l through Q's shared-memory slot and a TMA store; lse = (m + log2 l) · ln 2."""
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    o = acc / gl.expand_dims(l_o, 1)
    q_smem.store(o.to(o_desc.dtype))
    fence_async_shared()
    _cta_barrier()
    _tma_store(o_desc, [q_row, 0], q_smem)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    offs = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    gl.store(lse_ptr + lse_row + offs, lse)
    tma.store_wait(0)


@gluon.jit
def _tile_coords(H, GROUP, T, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(start_m, q_row, kv_row0, lse_row, n_tiles) of this program. Rows index the [B*heads*T, D] views."""
    pid_m = gl.program_id(0)
    off_bh = gl.program_id(1)
    if CAUSAL:  # heaviest query tiles first: the short diagonal programs fill the tail of the grid
        pid_m = gl.num_programs(0) - 1 - pid_m
    off_b = off_bh // H
    off_h = off_bh % H
    start_m = pid_m * BLOCK_M
    q_row = off_bh * T + start_m
    kv_row0 = (off_b * (H // GROUP) + off_h // GROUP) * T
    lse_row = off_bh.to(gl.int64) * T + start_m
    if CAUSAL:
        n_tiles = (start_m + BLOCK_M) // BLOCK_N
    else:
        n_tiles = T // BLOCK_N
    return start_m, q_row, kv_row0, lse_row, n_tiles


@gluon.constexpr_function
def _mma_layouts(BLOCK_N, HEAD_DIM, NUM_WARPS):
    s_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, HEAD_DIM, 16])
    return s_layout, o_layout


# ---------------------------------------------------------------------------------------------------------
# variant "tma": TMA ring + async wgmma, each wgmma waited at once
# ---------------------------------------------------------------------------------------------------------
@gluon.jit
def _attn_fwd_tma(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, H, GROUP, T,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, NUM_WARPS: gl.constexpr):
    layouts: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM, NUM_WARPS)
    s_layout: gl.constexpr = layouts[0]
    o_layout: gl.constexpr = layouts[1]
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_desc.dtype

    start_m, q_row, kv_row0, lse_row, n_tiles = _tile_coords(H, GROUP, T, CAUSAL, BLOCK_M, BLOCK_N)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
    fence_async_shared()

    _prologue(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, q_row, kv_row0, n_tiles,
              BLOCK_N, STAGES)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)
    for j in range(n_tiles):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_bars.index(slot), phase)
        s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, start_m, j * BLOCK_N, s_layout, BLOCK_M,
                                           BLOCK_N, CAUSAL)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        mbarrier.wait(v_bars.index(slot), phase)
        acc = warpgroup_mma(p16, v_smem.index(slot), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        _refill(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, kv_row0, j + STAGES, n_tiles, BLOCK_N, STAGES)

    _epilogue(acc, m_i, l_i, o_desc, q_smem, lse_ptr, q_row, lse_row, s_layout, o_layout, BLOCK_M)
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))


# ---------------------------------------------------------------------------------------------------------
# variant "pipe": FlashAttention-3 intra-warpgroup overlap of softmax(S_j) with the wgmmas
# ---------------------------------------------------------------------------------------------------------
@gluon.jit
def _pipe_loop(q_smem, k_smem, v_smem, k_bars, v_bars, k_empty, v_empty, k_desc, v_desc, kv_row0, n_tiles,
               qk_scale, start_m, s_layout: gl.constexpr, o_layout: gl.constexpr, dtype: gl.constexpr,
               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
               CAUSAL: gl.constexpr, WS: gl.constexpr):
    """The consumer main loop shared by "pipe" (WS=False: it also refills the ring itself) and "ws"
    (WS=True: it arrives on the slots' empty barriers and a producer partition refills them).

    Iteration j: issue S_j = Q K_jᵀ, issue O += P_{j-1} V_{j-1}; wait(1) retires S_j only (wgmma groups
    retire in order), so the softmax of S_j overlaps the P·V wgmma; wait(0) retires P·V, then O is rescaled
    to the new max."""
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

    # tile 0: scores and softmax only
    mbarrier.wait(k_bars.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    if WS:
        mbarrier.arrive(k_empty.index(0), count=1)
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, start_m, 0, s_layout, BLOCK_M, BLOCK_N, CAUSAL)
    p16 = gl.convert_layout(p.to(dtype), p_layout)

    for j in range(1, n_tiles):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_bars.index(slot), (j // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_bars.index(prev), ((j - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        if WS:
            mbarrier.arrive(k_empty.index(slot), count=1)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, start_m, j * BLOCK_N, s_layout, BLOCK_M,
                                           BLOCK_N, CAUSAL)
        p16_next = gl.convert_layout(p.to(dtype), p_layout)
        # P_{j-1} is the register A operand of the in-flight wgmma: keep it alive through the wait
        acc, p16 = warpgroup_mma_wait(0, deps=(o_tok, p16))
        if WS:
            mbarrier.arrive(v_empty.index(prev), count=1)
        else:
            _refill(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, kv_row0, j - 1 + STAGES, n_tiles, BLOCK_N,
                    STAGES)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p16 = p16_next

    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_bars.index(last), ((n_tiles - 1) // STAGES) & 1)
    o_tok = warpgroup_mma(p16, v_smem.index(last), acc, is_async=True)
    acc, p16 = warpgroup_mma_wait(0, deps=(o_tok, p16))
    if WS:
        mbarrier.arrive(v_empty.index(last), count=1)
    return acc, m_i, l_i


@gluon.jit
def _attn_fwd_pipe(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, H, GROUP, T,
                   HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, NUM_WARPS: gl.constexpr):
    layouts: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM, NUM_WARPS)
    s_layout: gl.constexpr = layouts[0]
    o_layout: gl.constexpr = layouts[1]
    dtype: gl.constexpr = q_desc.dtype

    start_m, q_row, kv_row0, lse_row, n_tiles = _tile_coords(H, GROUP, T, CAUSAL, BLOCK_M, BLOCK_N)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
    fence_async_shared()

    _prologue(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, q_row, kv_row0, n_tiles,
              BLOCK_N, STAGES)
    mbarrier.wait(q_bar, 0)
    acc, m_i, l_i = _pipe_loop(q_smem, k_smem, v_smem, k_bars, v_bars, k_bars, v_bars, k_desc, v_desc, kv_row0,
                               n_tiles, qk_scale, start_m, s_layout, o_layout, dtype, HEAD_DIM, BLOCK_M, BLOCK_N,
                               STAGES, CAUSAL, False)
    _epilogue(acc, m_i, l_i, o_desc, q_smem, lse_ptr, q_row, lse_row, s_layout, o_layout, BLOCK_M)
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))


# ---------------------------------------------------------------------------------------------------------
# variant "ws": 1-warp TMA producer partition + the "pipe" consumers in the default partition
# ---------------------------------------------------------------------------------------------------------
@gluon.jit
def _ws_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, k_empty, v_empty,
                 q_row, kv_row0, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [q_row, 0], q_bar, q_smem)
    for t in range(n_tiles):
        slot = t % STAGES
        # a fresh barrier counts as having completed the phase before phase 0: the first lap passes
        phase = ((t // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), phase)
        mbarrier.expect(k_bars.index(slot), k_desc.block_type.nbytes)
        _tma_load(k_desc, [kv_row0 + t * BLOCK_N, 0], k_bars.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase)
        mbarrier.expect(v_bars.index(slot), v_desc.block_type.nbytes)
        _tma_load(v_desc, [kv_row0 + t * BLOCK_N, 0], v_bars.index(slot), v_smem.index(slot))


@gluon.jit
def _ws_consumer(q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, k_empty, v_empty, k_desc, v_desc, o_desc,
                 lse_ptr, q_row, kv_row0, lse_row, n_tiles, qk_scale, start_m,
                 s_layout: gl.constexpr, o_layout: gl.constexpr, dtype: gl.constexpr,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr):
    mbarrier.wait(q_bar, 0)
    acc, m_i, l_i = _pipe_loop(q_smem, k_smem, v_smem, k_bars, v_bars, k_empty, v_empty, k_desc, v_desc, kv_row0,
                               n_tiles, qk_scale, start_m, s_layout, o_layout, dtype, HEAD_DIM, BLOCK_M, BLOCK_N,
                               STAGES, CAUSAL, True)
    _epilogue(acc, m_i, l_i, o_desc, q_smem, lse_ptr, q_row, lse_row, s_layout, o_layout, BLOCK_M)


@gluon.jit
def _attn_fwd_ws(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, H, GROUP, T,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, NUM_WARPS: gl.constexpr):
    layouts: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM, NUM_WARPS)
    s_layout: gl.constexpr = layouts[0]
    o_layout: gl.constexpr = layouts[1]
    dtype: gl.constexpr = q_desc.dtype

    start_m, q_row, kv_row0, lse_row, n_tiles = _tile_coords(H, GROUP, T, CAUSAL, BLOCK_M, BLOCK_N)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
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
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_ws_consumer, (q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, k_empty, v_empty, k_desc, v_desc, o_desc,
                        lse_ptr, q_row, kv_row0, lse_row, n_tiles, qk_scale, start_m, s_layout, o_layout, dtype,
                        HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL)),
        (_ws_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, k_empty, v_empty,
                        q_row, kv_row0, n_tiles, BLOCK_N, STAGES)),
    ], [1], [24])


# ---------------------------------------------------------------------------------------------------------
# variants and host side
# ---------------------------------------------------------------------------------------------------------
# name -> (kernel, {head_dim: (BLOCK_N, STAGES)})
VARIANTS = {
    "tma": (_attn_fwd_tma, {64: (128, 2), 128: (128, 2)}),
    "pipe": (_attn_fwd_pipe, {64: (128, 2), 128: (128, 2)}),
    "pipe3": (_attn_fwd_pipe, {64: (128, 3), 128: (128, 3)}),
    "ws": (_attn_fwd_ws, {64: (128, 2), 128: (128, 2)}),
    "ws3": (_attn_fwd_ws, {64: (128, 3), 128: (128, 3)}),
}
DEFAULT_VARIANT = "ws"
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def _descs(q, k, v, o, BLOCK_N):
    """Host TMA descriptors over the [B*heads*T, D] row views (tensors must be contiguous)."""
    D = q.shape[-1]
    gdt = _GL_DTYPES[q.dtype]
    lay_m = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gdt)
    lay_n = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gdt)

    def desc(x, rows, lay):
        x2 = x.view(-1, D)
        return TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [rows, D], lay)

    return desc(q, BLOCK_M, lay_m), desc(k, BLOCK_N, lay_n), desc(v, BLOCK_N, lay_n), desc(o, BLOCK_M, lay_m)


def _check(q, k, v, variant):
    if variant not in VARIANTS:
        raise ValueError(f"gluon_flash_fwd: unknown variant {variant!r}, have {sorted(VARIANTS)}")
    if not (q.ndim == k.ndim == v.ndim == 4):
        raise ValueError("gluon_flash_fwd: q, k, v must be [B, H, T, D] / [B, Hkv, T, D]")
    B, H, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2] != T or k.shape[3] != D:
        raise ValueError(f"gluon_flash_fwd: k, v must be [B, Hkv, T, D] matching q, got {tuple(k.shape)}")
    Hkv = k.shape[1]
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"gluon_flash_fwd: Hkv={Hkv} must divide H={H}")
    if q.dtype not in _GL_DTYPES or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"gluon_flash_fwd: q, k, v must all be bf16 or all fp16, got {q.dtype}")
    if D not in VARIANTS[variant][1]:
        raise ValueError(f"gluon_flash_fwd: head dim {D} not supported (only {sorted(VARIANTS[variant][1])})")
    if T == 0 or T % BLOCK_M:
        raise ValueError(f"gluon_flash_fwd: T={T} must be a positive multiple of {BLOCK_M}")


def gluon_flash_fwd(q, k, v, causal=True, scale=None, variant=DEFAULT_VARIANT, *, o=None, lse=None):
    """Forward attention with the Gluon kernel ``variant``. Returns (o [B,H,T,D] q.dtype, lse [B,H,T] fp32,
    natural log). ``o``/``lse``: optional output buffers (contiguous)."""
    _check(q, k, v, variant)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not (s > 0.0 and math.isfinite(s)):
        raise ValueError(f"gluon_flash_fwd: scale must be a finite number > 0, got {scale!r}")
    kernel, cfg = VARIANTS[variant]
    BLOCK_N, STAGES = cfg[D]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if o is None:
        o = torch.empty_like(q)
    if lse is None:
        lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    if not (o.is_contiguous() and o.shape == q.shape and o.dtype == q.dtype and lse.is_contiguous()
            and lse.shape == (B, H, T) and lse.dtype == torch.float32):
        raise ValueError("gluon_flash_fwd: o must be contiguous like q, lse contiguous fp32 [B, H, T]")
    q_desc, k_desc, v_desc, o_desc = _descs(q, k, v, o, BLOCK_N)
    grid = (T // BLOCK_M, B * H)
    kernel[grid](q_desc, k_desc, v_desc, o_desc, lse, s * LOG2E, H, H // Hkv, T,
                 HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES, CAUSAL=bool(causal),
                 NUM_WARPS=NUM_WARPS, num_warps=NUM_WARPS)
    return o, lse


# ---------------------------------------------------------------------------------------------------------
# offline compilation (no GPU): --compile-only
# ---------------------------------------------------------------------------------------------------------
def compile_variant(name, D, causal=True, T=1024):
    """Compile variant ``name`` at head dim D for sm_90 without a GPU. Returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    kernel, cfg = VARIANTS[name]
    BLOCK_N, STAGES = cfg[D]
    B, H, Hkv = 1, 4, 2
    q = torch.empty(B, H, T, D, dtype=torch.bfloat16)  # CPU tensors: only shapes, strides, dtype matter
    kv = torch.empty(B, Hkv, T, D, dtype=torch.bfloat16)
    lse = torch.empty(B, H, T, dtype=torch.float32)
    args = dict(zip(["q_desc", "k_desc", "v_desc", "o_desc"], _descs(q, kv, kv, q, BLOCK_N)))
    args.update(lse_ptr=lse, qk_scale=0.125 * LOG2E, H=H, GROUP=H // Hkv, T=T)
    consts = dict(HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES, CAUSAL=causal,
                  NUM_WARPS=NUM_WARPS)
    sig = {}
    for a in kernel.arg_names:
        sig[a] = "constexpr" if a in consts else mangle_type(args[a])
    src = GluonASTSource(kernel, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})


def _ptx_summary(ck):
    ptx = ck.asm.get("ptx", "")
    keys = ["wgmma.mma_async", "wgmma.wait_group", "cp.async.bulk.tensor", "mbarrier.try_wait",
            "mbarrier.arrive", "setmaxnreg", "ex2.approx", "bar.sync", "bar.arrive"]
    meta = ck.metadata
    regs = getattr(ck, "n_regs", None)
    out = {key: ptx.count(key) for key in keys}
    out["shared"] = getattr(meta, "shared", None)
    out["regs"] = regs
    return out


def compile_only(variants, head_dims, dump=None):
    print(f"triton {triton.__version__}: compiling Gluon variants for sm_90 (no GPU)")
    ok = True
    for name in variants:
        for D in head_dims:
            t0 = time.time()
            try:
                ck = compile_variant(name, D)
                print(f"  {name:6s} D={D:3d}: OK   {time.time() - t0:5.1f}s  {_ptx_summary(ck)}")
                if dump:
                    import os
                    os.makedirs(dump, exist_ok=True)
                    for ext in ("ttgir", "ptx"):
                        with open(f"{dump}/{name}_d{D}.{ext}", "w") as f:
                            f.write(ck.asm.get(ext, ""))
            except Exception as e:  # noqa: BLE001
                ok = False
                print(f"  {name:6s} D={D:3d}: FAIL {type(e).__name__}: {str(e)[:2000]}")
    return ok


# ---------------------------------------------------------------------------------------------------------
# GPU check + benchmark
# ---------------------------------------------------------------------------------------------------------
def _rel_err(x, ref):
    x = x.double()
    ref = ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def check_variant(name, head_dims):
    from xtrain.kernels.flash_attention import flash_attention_fwd_ref

    worst = 0.0
    for D in head_dims:
        for T in (1024, 2048):
            B, H, Hkv = 1, 4, 2
            g = torch.Generator(device="cuda").manual_seed(T + D)
            q, k, v = (torch.randn(B, h, T, D, generator=g, device="cuda", dtype=torch.bfloat16)
                       for h in (H, Hkv, Hkv))
            o = torch.full_like(q, float("nan"))
            lse = torch.full((B, H, T), float("nan"), device="cuda", dtype=torch.float32)
            gluon_flash_fwd(q, k, v, True, None, name, o=o, lse=lse)
            torch.cuda.synchronize()
            o_ref, lse_ref = flash_attention_fwd_ref(q.double(), k.double(), v.double(), True)
            eo, el = _rel_err(o, o_ref), _rel_err(lse, lse_ref)
            print(f"    check {name} D={D} T={T}: max rel err o {eo:.2e} lse {el:.2e}")
            worst = max(worst, eo, el)
    return worst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--compile-only", action="store_true", help="compile every variant for sm_90 (no GPU)")
    ap.add_argument("--dump", default=None, help="with --compile-only: write ttgir/ptx into this folder")
    args = ap.parse_args(argv)
    seqs = [int(x) for x in args.seqs.split(",") if x]
    head_dims = [int(x) for x in args.head_dims.split(",") if x]
    variants = [x for x in args.variants.split(",") if x]
    for name in variants:
        if name not in VARIANTS:
            ap.error(f"unknown variant {name!r}; have {','.join(VARIANTS)}")
    if args.compile_only:
        return 0 if compile_only(variants, head_dims, args.dump) else 1

    import triton.testing
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from xtrain.kernels.flash_attention import flash_attention_fwd_triton

    t_start = time.time()
    print(f"torch {torch.__version__}  triton {triton.__version__}  device {torch.cuda.get_device_name()}")
    passing = []
    for name in variants:
        print(f"[{name}] checking vs fp64 reference (B=1, H=4, Hkv=2, causal, NaN-filled outputs)")
        t0 = time.time()
        try:
            err = check_variant(name, head_dims)
            verdict = "PASS" if err < 1e-2 else "FAIL"
            print(f"[{name}] {verdict}: worst max rel err {err:.2e}  ({time.time() - t0:.1f}s incl. compile)")
            if err < 1e-2:
                passing.append(name)
        except Exception as e:  # noqa: BLE001
            print(f"[{name}] ERROR {type(e).__name__}: {str(e)[:500]}")
            traceback.print_exc(limit=3)
        sys.stdout.flush()

    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    rows = []
    for D in head_dims:
        for T in seqs:
            B, H = 16384 // T, 2048 // D
            g = torch.Generator(device="cuda").manual_seed(T * 7 + D)
            q, k, v = (torch.randn(B, H, T, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4.0 * B * H * T * T * D / 2
            tf = lambda ms: flops / ms * 1e-9  # noqa: E731
            row = {"D": D, "T": T}
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    row["cudnn"] = tf(bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
            except Exception as e:  # noqa: BLE001
                print(f"  cudnn D={D} T={T}: {type(e).__name__}: {str(e)[:200]}")
            try:
                row["triton"] = tf(bench(lambda: flash_attention_fwd_triton(q, k, v, True)))
            except Exception as e:  # noqa: BLE001
                print(f"  triton D={D} T={T}: {type(e).__name__}: {str(e)[:200]}")
            for name in passing:
                try:
                    o = torch.empty_like(q)
                    lse = torch.empty((B, H, T), device="cuda", dtype=torch.float32)
                    row[name] = tf(bench(lambda: gluon_flash_fwd(q, k, v, True, None, name, o=o, lse=lse)))
                except Exception as e:  # noqa: BLE001
                    print(f"  {name} D={D} T={T}: {type(e).__name__}: {str(e)[:300]}")
            rows.append(row)
            print("  " + "  ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
            sys.stdout.flush()
            del q, k, v

    cols = ["cudnn", "triton"] + passing
    print("\ncausal bf16 forward, TFLOP/s (x cuDNN); B = 16384 / T, H = 2048 / D")
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
