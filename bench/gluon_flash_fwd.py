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

Variants (``VARIANTS``: kernel + per-head-dim BLOCK_N, STAGES, optional maxnreg; BLOCK_M = 128 always):
  tma       the simplest correct version, 8 warps: TMA ring + async wgmma, but every wgmma is waited at
            once (no overlap of MMA with softmax beyond what the two warpgroups give each other); the CTA
            refills a slot itself after a CTA barrier (wgmma waits are per warpgroup).
  pipe      FlashAttention-3 intra-warpgroup pipelining, 8 warps: iteration j issues S_j = Q K_jᵀ and then
            O += P_{j-1} V_{j-1}; wait(1) retires S_j only (wgmma groups retire in order), so the softmax of
            S_j runs while the P·V wgmma is still on the tensor cores; wait(0), then O is rescaled.
  ws        ``pipe`` + warp specialisation (gl.warp_specialize): a 1-warp producer partition (24 registers)
            issues every TMA load (Q, then K/V into the ring, waiting on per-slot "empty" mbarriers); the
            8 consumer warps (default partition) wait, compute, and arrive on a slot's empty barrier once
            the wgmma that read it has retired.
  ws2       as ``ws`` but each consumer warpgroup is its own partition (default = warpgroup 0, a 4-warp
            worker = warpgroup 1, each with its 64 query rows and its own half of the Q/O tile; empty
            barriers count one arrival per warpgroup), so the partition-wide syncs behind every arrive
            span one warpgroup, and the two warpgroups drift apart freely (the softmax of one overlaps
            the wgmmas of the other; FA3 enforces that order with named barriers, this does not).
  *3 / *_n64  the same kernels with a third ring stage (more TMA lead; 224 KB of shared memory at hd128),
            or BLOCK_N = 64 (fewer registers; at hd64 with maxnreg 128 two CTAs fit on an SM).
Not done (FlashAttention-3 has them): enforced inter-warpgroup ping-pong, a persistent tile scheduler with
an overlapped epilogue, FP8, ragged T.

Triton-version notes. The GPU box runs triton 3.6.0; newer Gluon (3.9 here) renamed some builtins, so the
kernels go through module-level aliases: ``tma.async_copy_global_to_shared`` (3.6) / ``tma.async_load``
(newer), ``tma.async_copy_shared_to_global`` / ``tma.async_store``, ``gl.thread_barrier`` / ``gl.barrier``;
``mbarrier.expect``'s byte count is passed positionally (keyword ``bytes`` in 3.6, ``bytes_per_cta`` later);
``gl.warp_specialize`` always gets an explicit ``worker_num_regs`` (required in 3.6, optional later).
Offline compilation uses ``triton.experimental.gluon._runtime.GluonASTSource`` (present in both, exported
only later) with ``triton.compile(..., target=GPUTarget("cuda", 90, 32))``.

main() first checks every variant in a child process (a deadlocked mbarrier wait would otherwise hang the
whole run; a CUDA fault would poison the context for the variants after it): a variant with no result
within 90 s is killed and reported as HANG. ``--no-isolate`` checks in-process instead.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
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
WS2_CONSUMER_REGS = gl.constexpr(232)  # registers/thread of ws2's second consumer partition (setmaxnreg)


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
# variant "ws2": each consumer warpgroup is its own partition (64 query rows each) + a 1-warp producer
# ---------------------------------------------------------------------------------------------------------
@gluon.jit
def _ws2_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, k_empty, v_empty,
                  q_row, kv_row0, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    HALF_M: gl.constexpr = q_desc.block_type.shape[0]
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    _tma_load(q_desc, [q_row, 0], q_bar, q_smem.index(0))
    _tma_load(q_desc, [q_row + HALF_M, 0], q_bar, q_smem.index(1))
    for t in range(n_tiles):
        slot = t % STAGES
        phase = ((t // STAGES) & 1) ^ 1  # first lap passes on the fresh barriers
        mbarrier.wait(k_empty.index(slot), phase)
        mbarrier.expect(k_bars.index(slot), k_desc.block_type.nbytes)
        _tma_load(k_desc, [kv_row0 + t * BLOCK_N, 0], k_bars.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase)
        mbarrier.expect(v_bars.index(slot), v_desc.block_type.nbytes)
        _tma_load(v_desc, [kv_row0 + t * BLOCK_N, 0], v_bars.index(slot), v_smem.index(slot))


@gluon.jit
def _ws2_consumer(q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, k_empty, v_empty, k_desc, v_desc, o_desc,
                  lse_ptr, q_row, kv_row0, lse_row, n_tiles, qk_scale, start_m, dtype: gl.constexpr,
                  HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                  HALF: gl.constexpr):
    """One warpgroup, rows [start_m + HALF*64, +64) of the CTA's 128. Both consumers walk all n_tiles K/V
    tiles (each slot's empty barriers expect one arrival from each); with BLOCK_N < 128 the upper half's
    last diagonal tile is fully masked for it (exact, just wasted)."""
    HALF_M: gl.constexpr = o_desc.block_type.shape[0]
    layouts: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM, 4)
    s_layout: gl.constexpr = layouts[0]
    o_layout: gl.constexpr = layouts[1]
    q_half = q_smem.index(HALF)
    mbarrier.wait(q_bar, 0)
    acc, m_i, l_i = _pipe_loop(q_half, k_smem, v_smem, k_bars, v_bars, k_empty, v_empty, k_desc, v_desc, kv_row0,
                               n_tiles, qk_scale, start_m + HALF * HALF_M, s_layout, o_layout, dtype, HEAD_DIM,
                               HALF_M, BLOCK_N, STAGES, CAUSAL, True)
    _epilogue(acc, m_i, l_i, o_desc, q_half, lse_ptr, q_row + HALF * HALF_M, lse_row + HALF * HALF_M, s_layout,
              o_layout, HALF_M)


@gluon.jit
def _attn_fwd_ws2(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, H, GROUP, T,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, NUM_WARPS: gl.constexpr):
    """num_warps = 4 (the default partition = consumer warpgroup 0); q_desc/o_desc tiles are BLOCK_M/2 rows."""
    dtype: gl.constexpr = q_desc.dtype
    HALF_M: gl.constexpr = q_desc.block_type.shape[0]
    gl.static_assert(2 * HALF_M == BLOCK_M)
    start_m, q_row, kv_row0, lse_row, n_tiles = _tile_coords(H, GROUP, T, CAUSAL, BLOCK_M, BLOCK_N)

    q_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_DIM], q_desc.layout)
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
        (_ws2_consumer, (q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, k_empty, v_empty, k_desc, v_desc, o_desc,
                         lse_ptr, q_row, kv_row0, lse_row, n_tiles, qk_scale, start_m, dtype, HEAD_DIM, BLOCK_N,
                         STAGES, CAUSAL, 0)),
        (_ws2_consumer, (q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, k_empty, v_empty, k_desc, v_desc, o_desc,
                         lse_ptr, q_row, kv_row0, lse_row, n_tiles, qk_scale, start_m, dtype, HEAD_DIM, BLOCK_N,
                         STAGES, CAUSAL, 1)),
        (_ws2_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, k_empty, v_empty,
                         q_row, kv_row0, n_tiles, BLOCK_N, STAGES)),
    ], [4, 1], [WS2_CONSUMER_REGS, 24])


# ---------------------------------------------------------------------------------------------------------
# variants and host side
# ---------------------------------------------------------------------------------------------------------
# name -> (kernel, {head_dim: (BLOCK_N, STAGES, maxnreg or None)}). maxnreg caps the registers per thread so
# that two 8-warp CTAs fit on one SM (65536 registers: 2 x 256 threads x 128).
VARIANTS = {
    "tma": (_attn_fwd_tma, {64: (128, 2, None), 128: (128, 2, None)}),
    "tma_n64": (_attn_fwd_tma, {64: (64, 3, 128), 128: (64, 3, None)}),
    "pipe": (_attn_fwd_pipe, {64: (128, 2, None), 128: (128, 2, None)}),
    "pipe3": (_attn_fwd_pipe, {64: (128, 3, None), 128: (128, 3, None)}),
    "pipe_n64": (_attn_fwd_pipe, {64: (64, 3, 128), 128: (64, 3, None)}),
    "ws": (_attn_fwd_ws, {64: (128, 2, None), 128: (128, 2, None)}),
    "ws3": (_attn_fwd_ws, {64: (128, 3, None), 128: (128, 3, None)}),
    "ws_n64": (_attn_fwd_ws, {64: (64, 4, None), 128: (64, 4, None)}),
    "ws2": (_attn_fwd_ws2, {64: (128, 2, None), 128: (128, 2, None)}),
    "ws2_3": (_attn_fwd_ws2, {64: (128, 3, None), 128: (128, 3, None)}),
}
# the kernel's num_warps and the rows of the Q/O TMA tiles; ws2's default partition is one warpgroup and
# each of its two consumers loads/stores a 64-row half of the 128-row query tile
_WARPS_QROWS = {_attn_fwd_ws2: (4, BLOCK_M // 2)}
DEFAULT_VARIANT = "pipe"
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def _descs(q, k, v, o, BLOCK_N, q_rows=BLOCK_M):
    """Host TMA descriptors over the [B*heads*T, D] row views (tensors must be contiguous)."""
    D = q.shape[-1]
    gdt = _GL_DTYPES[q.dtype]
    lay_m = gl.NVMMASharedLayout.get_default_for([q_rows, D], gdt)
    lay_n = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gdt)

    def desc(x, rows, lay):
        x2 = x.view(-1, D)
        return TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [rows, D], lay)

    return desc(q, q_rows, lay_m), desc(k, BLOCK_N, lay_n), desc(v, BLOCK_N, lay_n), desc(o, q_rows, lay_m)


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
    BLOCK_N, STAGES, maxnreg = cfg[D]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if o is None:
        o = torch.empty_like(q)
    if lse is None:
        lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    if not (o.is_contiguous() and o.shape == q.shape and o.dtype == q.dtype and lse.is_contiguous()
            and lse.shape == (B, H, T) and lse.dtype == torch.float32):
        raise ValueError("gluon_flash_fwd: o must be contiguous like q, lse contiguous fp32 [B, H, T]")
    num_warps, q_rows = _WARPS_QROWS.get(kernel, (NUM_WARPS, BLOCK_M))
    q_desc, k_desc, v_desc, o_desc = _descs(q, k, v, o, BLOCK_N, q_rows)
    grid = (T // BLOCK_M, B * H)
    kernel[grid](q_desc, k_desc, v_desc, o_desc, lse, s * LOG2E, H, H // Hkv, T,
                 HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES, CAUSAL=bool(causal),
                 NUM_WARPS=num_warps, num_warps=num_warps, **_launch_opts(maxnreg))
    return o, lse


def _launch_opts(maxnreg):
    return {} if maxnreg is None else {"maxnreg": maxnreg}


# ---------------------------------------------------------------------------------------------------------
# offline compilation (no GPU): --compile-only
# ---------------------------------------------------------------------------------------------------------
def compile_variant(name, D, causal=True, T=1024):
    """Compile variant ``name`` at head dim D for sm_90 without a GPU. Returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    kernel, cfg = VARIANTS[name]
    BLOCK_N, STAGES, maxnreg = cfg[D]
    B, H, Hkv = 1, 4, 2
    q = torch.empty(B, H, T, D, dtype=torch.bfloat16)  # CPU tensors: only shapes, strides, dtype matter
    kv = torch.empty(B, Hkv, T, D, dtype=torch.bfloat16)
    lse = torch.empty(B, H, T, dtype=torch.float32)
    num_warps, q_rows = _WARPS_QROWS.get(kernel, (NUM_WARPS, BLOCK_M))
    args = dict(zip(["q_desc", "k_desc", "v_desc", "o_desc"], _descs(q, kv, kv, q, BLOCK_N, q_rows)))
    args.update(lse_ptr=lse, qk_scale=0.125 * LOG2E, H=H, GROUP=H // Hkv, T=T)
    consts = dict(HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES, CAUSAL=causal,
                  NUM_WARPS=num_warps)
    sig = {}
    for a in kernel.arg_names:
        sig[a] = "constexpr" if a in consts else mangle_type(args[a])
    src = GluonASTSource(kernel, sig, consts)
    options = {"num_warps": num_warps, **_launch_opts(maxnreg)}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


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
        return f"{m.group(1)} regs, {m.group(2)} B local (spills)" if m else "res-usage n/a"
    except Exception as e:  # noqa: BLE001
        return f"res-usage n/a ({type(e).__name__})"


def _ptx_summary(ck):
    ptx = ck.asm.get("ptx", "")
    keys = ["wgmma.mma_async", "wgmma.wait_group", "cp.async.bulk.tensor", "mbarrier.try_wait", "setmaxnreg"]
    counts = ", ".join(f"{key} x{ptx.count(key)}" for key in keys)
    return f"smem {getattr(ck.metadata, 'shared', '?')} B; {_res_usage(ck.asm.get('cubin', b''))}; PTX: {counts}"


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
    """Max relative error of o and lse against the fp64 reference: causal at T = 1024 and 2048 (the gate),
    plus one non-causal size that is only reported. Outputs are pre-filled with NaN."""
    from xtrain.kernels.flash_attention import flash_attention_fwd_ref

    worst = 0.0
    for D in head_dims:
        for T, causal in ((1024, True), (2048, True), (1024, False)):
            B, H, Hkv = 1, 4, 2
            g = torch.Generator(device="cuda").manual_seed(T + D)
            q, k, v = (torch.randn(B, h, T, D, generator=g, device="cuda", dtype=torch.bfloat16)
                       for h in (H, Hkv, Hkv))
            o = torch.full_like(q, float("nan"))
            lse = torch.full((B, H, T), float("nan"), device="cuda", dtype=torch.float32)
            gluon_flash_fwd(q, k, v, causal, None, name, o=o, lse=lse)
            torch.cuda.synchronize()
            o_ref, lse_ref = flash_attention_fwd_ref(q.double(), k.double(), v.double(), causal)
            eo, el = _rel_err(o, o_ref), _rel_err(lse, lse_ref)
            tag = "causal" if causal else "non-causal (info only)"
            print(f"    {name} D={D} T={T} {tag}: max rel err o {eo:.2e} lse {el:.2e}")
            if causal:
                worst = max(worst, eo, el)
    return worst


def _check_one(name, head_dims):
    """Check one variant in this process; prints the @@ markers that run_checks parses. Returns "PASS",
    "FAIL" (wrong numbers) or "ERROR" (an exception)."""
    print(f"@@START {name}")
    print(f"[{name}] checking vs fp64 reference (B=1, H=4, Hkv=2, T=1024/2048, causal, NaN-filled outputs)")
    sys.stdout.flush()
    t0 = time.time()
    try:
        err = check_variant(name, head_dims)
        verdict = "PASS" if err < 1e-2 else "FAIL"
        print(f"[{name}] {verdict}: worst max rel err {err:.2e} ({time.time() - t0:.1f}s incl. compile)")
    except Exception as e:  # noqa: BLE001
        verdict = "ERROR"
        print(f"[{name}] ERROR {type(e).__name__}: {str(e)[:500]}")
        root = e
        while root.__cause__ is not None:  # compilation errors wrap the real cause
            root = root.__cause__
        if root is not e:
            print(f"[{name}]   caused by {type(root).__name__}: {str(root)[:500]}")
    print(f"@@RESULT {name} {verdict}")
    sys.stdout.flush()
    return verdict


def run_checks(variants, head_dims, startup_s=180.0, per_variant_s=90.0):
    """Run the correctness checks in child processes, echoing their output. The child stops at the first
    exception (a CUDA fault poisons its context for every later variant) and a new child takes the
    remaining variants; a variant that does not finish within per_variant_s (a deadlock on an mbarrier
    hangs the GPU context for good) is killed and reported as HANG. Returns the passing variants."""
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
            if ln is None:  # the child exited
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
    """TFLOP/s of cuDNN, xtrain's Triton forward and each variant at causal bf16, B = 16k / T, H = 2048 / D."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from xtrain.kernels.flash_attention import flash_attention_fwd_triton

    B, H = 16384 // T, 2048 // D
    g = torch.Generator(device="cuda").manual_seed(T * 7 + D)
    q, k, v = (torch.randn(B, H, T, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4.0 * B * H * T * T * D / 2
    row = {"D": D, "T": T}

    def timed(col, fn):
        try:
            row[col] = flops / _bench_ms(fn) * 1e-9
        except Exception as e:  # noqa: BLE001
            print(f"  {col} D={D} T={T}: {type(e).__name__}: {str(e)[:300]}")

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        timed("cudnn", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    timed("triton", lambda: flash_attention_fwd_triton(q, k, v, True))
    o = torch.empty_like(q)
    lse = torch.empty((B, H, T), device="cuda", dtype=torch.float32)
    for name in variants:
        timed(name, lambda name=name: gluon_flash_fwd(q, k, v, True, None, name, o=o, lse=lse))
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--compile-only", action="store_true", help="compile every variant for sm_90 (no GPU)")
    ap.add_argument("--dump", default=None, help="with --compile-only: write ttgir/ptx into this folder")
    ap.add_argument("--no-isolate", action="store_true",
                    help="run the correctness checks in this process (default: a child process, so that a "
                         "deadlocked kernel costs a timeout instead of the whole run)")
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

    t_start = time.time()
    print(f"torch {torch.__version__}  triton {triton.__version__}  device {torch.cuda.get_device_name()}")
    sys.stdout.flush()
    if args.check_only:  # the child process of run_checks: stop at the first exception
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
