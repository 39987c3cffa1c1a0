"""Experiments on the Gluon causal flash-attention FORWARD for Hopper (sm_90): a persistent kernel aimed at
short sequences, timed against cuDNN, xtrain's Triton forward and the library's Gluon kernel.

    PYTHONPATH=. python3 bench/gluon_flash_fwd.py                     # checks, then the timing table (H200)
    PYTHONPATH=. python3 bench/gluon_flash_fwd.py --seqs 1024,2048 --variants lib,pers,pers_pp
    PYTHONPATH=. python3 bench/gluon_flash_fwd.py --compile-only      # no GPU: compile every variant, sm_90
    PYTHONPATH=. python3 bench/gluon_flash_fwd.py --replay            # no GPU: CPU replay of the scheduling

Contract of every variant: that of ``xtrain.kernels.flash_attention_gluon.flash_attention_fwd_gluon`` (q
[B,H,T,D], k/v [B,Hkv,T,D], query head h reads K/V head h // (H // Hkv); returns o in q.dtype and lse [B,H,T]
the natural-log row logsumexp in fp32; bf16/fp16, D in (64, 128), T a multiple of 128, contiguous or
[B,T,H,D]-transposed layouts). The library kernel supplies the device pieces that carry over unchanged
(``_softmax_tile``, ``_mma_layouts``, the TMA/barrier aliases) and the host pieces (``supported``,
``_row_view``, ``_desc``); this file adds only what differs.

Why: the library kernel (one program per (128-row query tile, batch·head), grid (T/128, B·H)) reaches
cuDNN at T >= 8k but not at short T (H200 hd128 0.88x at T=1k, hd64 0.75x): at T=1k each program walks only
1..8 K/V tiles, and every program pays its prologue (barrier init, partition start, Q load, the first K/V
tiles) and epilogue (O store, lse) with nothing to overlap them.

Variants (``VARIANTS``; every new one is the persistent kernel ``_pers_kernel`` with different constants):
  lib        the library kernel (``flash_attention_fwd_gluon``), the baseline.
  pers       PERSISTENT: grid = number of SMs (``--grid`` overrides); each program walks a static list of
             work items (one item = one 128-row query tile of one batch·head). The warp roles are the
             library's (default partition = consumer warpgroup 0, a 4-warp worker = consumer warpgroup 1,
             a 1-warp TMA producer), but the partitions loop over items and the mbarrier phases run on:
               * the K/V ring uses one running tile counter t over all items (slot t % STAGES, phase
                 (t // STAGES) & 1), in the producer and in both consumers alike;
               * Q has its own full/empty barrier pair; the consumers release Q as soon as the last
                 S = Q Kᵀ wgmma of the item has retired (before the last P·V and the epilogue), so the
                 producer loads the next item's Q, then its K/V tiles, while the consumers finish;
               * O leaves through a dedicated shared-memory buffer (not the Q slot) by a TMA store that
                 is only waited for just before that buffer is written again (one item later), so the
                 store overlaps the next item's main loop.
             Schedule: with n_m = T / 128 query tiles, the items of one head are ordered heaviest/lightest
             alternately (tiles n_m-1, 0, n_m-2, 1, ...), heads one after another; the list is cut into
             PAIRS of consecutive items (causal: each pair costs n_m + 1 K/V tiles, whatever the pair) and
             pair k goes to program k mod G. Pairs of equal cost make the static round-robin balanced
             (FA3's answer to the same problem is a dynamic scheduler with an atomic counter), and
             head-major order keeps the G programs that run at any moment on about G / (n_m / 2)
             consecutive heads, so K/V of a head is read from DRAM about once and from L2 by its other
             query tiles (the library kernel gets the same reuse from its grid order, pid_m fastest). A
             pid_m-major order (all heads' tile n_m-1 first) would be simplest but sweeps every head's
             K/V between two reads of one head: 128 MB of K/V at these shapes vs 50 MB of L2.
  pers_q2    pers with two Q buffers: the next item's Q lands while the current item still runs (hd128:
             224 KB of shared memory, just under the 227 KB limit).
  pers_pp    pers with FA3's enforced ping-pong of the two consumer warpgroups. Gluon 3.6 exposes no named
             barrier (bar.sync id) to kernels, so the hand-off is two mbarriers (count 1): a warpgroup
             waits on its own barrier before issuing the wgmmas of a step and arrives on the other's once
             they are issued; warpgroup 0 starts on the free "previous phase" of a fresh barrier. Steps per
             item: S_0 | S_j + P_{j-1}V_{j-1} (j = 1..n-1) | P_{n-1}V_{n-1}, the same count in both
             warpgroups, so the alternation holds across items.
  pers_q2pp  both.
  pers_n64   pers with 64-wide K/V tiles and a 4-slot ring (less register pressure, finer diagonal).
  Not done: BLOCK_N = 192 / 176 (FA3's kBlockN at hd128). Gluon wants power-of-two shapes: the host
             TensorDescriptor rejects a 192-row block (Gluon 3.6 and 3.9) and a [64, 192] register tensor
             (the S accumulator) cannot be declared; it would take S as two wgmmas (128 + 64 columns) over
             three 64-row TMA copies per tile. The kernel keeps ``KV_TAIL`` (mask keys >= T when BLOCK_N does
             not divide T, non-causal) for such tiles; no variant uses it now.

Credits: the design follows FlashAttention-3 (Shah, Bikshandi, Zhang, Thakkar, Ramani & Dao, 2024; its
Hopper sources: producer/consumer warpgroups, intra-warpgroup overlap, ping-pong scheduling barriers, the
persistent tile scheduler) and the Gluon tutorials of the Triton repository (TMA, wgmma, warp
specialisation, persistent kernels). The code and words here are this project's own.

Triton-version notes (the GPU machine runs triton 3.6; newer Gluon renamed a few builtins): the kernels use
the library's aliases ``_tma_load``/``_tma_store``/``_cta_barrier``; ``mbarrier.expect``'s byte count is
positional (``bytes`` in 3.6, ``bytes_per_cta`` later); ``gl.warp_specialize`` gets an explicit
``worker_num_regs`` (required in 3.6); offline compilation goes through
``triton.experimental.gluon._runtime.GluonASTSource`` + ``triton.compile(target=GPUTarget("cuda", 90, 32))``.

main(): correctness first, in a child process (a deadlocked mbarrier wait hangs the GPU context; a CUDA
fault poisons it): per variant a timeout, NaN-poisoned outputs, fp64 reference; a variant that fails is
left out of the timing. Then triton.testing.do_bench (median) of cuDNN, the Triton kernel (the library's
Gluon dispatch switched off), lib and the new variants; the table gives TFLOP/s and the ratio to cuDNN.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

import torch
import triton

from xtrain.kernels import flash_attention_gluon as LIB
from xtrain.kernels.flash_attention_gluon import HAVE_GLUON, LOG2E

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from xtrain.kernels.flash_attention_gluon import (  # noqa: F401  (resolved as globals in @gluon.jit)
        _CONSUMER_REGS,
        _PRODUCER_REGS,
        HALF_ROWS,
        _cta_barrier,
        _mma_layouts,
        _softmax_tile,
        _tma_load,
        _tma_store,
    )

BLOCK_M = 128  # query rows per work item (two consumer warpgroups of 64)

# =========================================================================================================
# device code: the persistent kernel
# =========================================================================================================
if HAVE_GLUON:

    @gluon.jit
    def _n_local(pid, n_prog, U):
        """Items of program pid: it owns pairs k = pid, pid + n_prog, ... of the U items (pair k = items 2k,
        2k + 1); the last pair is a single item when U is odd. The host launches n_prog <= pairs."""
        n_pairs = (U + 1) // 2
        m_count = (n_pairs - pid + n_prog - 1) // n_prog
        last = pid + (m_count - 1) * n_prog
        return 2 * m_count - (U % 2) * (last == n_pairs - 1).to(gl.int32)

    @gluon.jit
    def _item(idx, pid, n_prog, n_m, H, GROUP, T, q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch,
              BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """Coordinates of the program's idx-th item: global item u = 2·(pid + (idx // 2)·n_prog) + idx % 2,
        head bh = u // n_m, and within the head the r-th of the order n_m-1, 0, n_m-2, 1, ... (r = u % n_m).
        Returns (start_m, q_row, q_col, kv_row0, kv_col, lse_row, n_tiles)."""
        u = 2 * (pid + (idx // 2) * n_prog) + idx % 2
        bh = u // n_m
        r = u % n_m
        odd = r % 2
        pid_m = odd * (r // 2) + (1 - odd) * (n_m - 1 - r // 2)
        off_b = bh // H
        off_h = bh % H
        off_hk = off_h // GROUP
        start_m = pid_m * (2 * HALF_ROWS)
        q_row = off_b * q_rb + off_h * q_rh + start_m
        q_col = off_h * q_ch
        kv_row0 = off_b * kv_rb + off_hk * kv_rh
        kv_col = off_hk * kv_ch
        lse_row = bh.to(gl.int64) * T + start_m
        if CAUSAL:
            n_tiles = (start_m + 2 * HALF_ROWS + BLOCK_N - 1) // BLOCK_N
        else:
            n_tiles = (T + BLOCK_N - 1) // BLOCK_N
        return start_m, q_row, q_col, kv_row0, kv_col, lse_row, n_tiles

    @gluon.jit
    def _scores(s, m_i, l_i, qk_scale, start_m, start_n, T, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                CAUSAL: gl.constexpr, KV_TAIL: gl.constexpr):
        """The library's online-softmax step, after masking keys >= T when BLOCK_N does not divide T
        (non-causal only; causal masking already hides them)."""
        if KV_TAIL:
            if start_n + BLOCK_N > T:
                offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                s = gl.where(gl.expand_dims(offs_n, 0) < T, s, float("-inf"))
        return _softmax_tile(s, m_i, l_i, qk_scale, start_m, start_n, s_layout, HALF_ROWS, BLOCK_N, CAUSAL)

    @gluon.jit
    def _pp_enter(sched, step, HALF: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: wait for this warpgroup's turn to issue wgmmas. Warpgroup 0 waits on parity
        (step & 1) ^ 1 (its first wait passes on the fresh barrier), warpgroup 1 on step & 1."""
        if PINGPONG:
            mbarrier.wait(sched.index(HALF), (step & 1) ^ (1 - HALF))

    @gluon.jit
    def _pp_leave(sched, HALF: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(sched.index(1 - HALF), count=1)  # the other warpgroup's turn

    @gluon.jit
    def _pers_consumer(q_smem, o_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty, sched,
                       o_desc, lse_ptr, qk_scale, pid, n_prog, U, n_m, H, GROUP, T, q_rb, q_rh, q_ch, kv_rb, kv_rh,
                       kv_ch, dtype: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, CAUSAL: gl.constexpr, KV_TAIL: gl.constexpr, NUM_Q: gl.constexpr,
                       PINGPONG: gl.constexpr, HALF: gl.constexpr):
        """Consumer warpgroup HALF (query rows 64·HALF .. +64 of every item)."""
        layouts: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM)
        s_layout: gl.constexpr = layouts[0]
        o_layout: gl.constexpr = layouts[1]
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        o_half = o_smem.index(HALF)
        n_local = _n_local(pid, n_prog, U)
        t = pid * 0  # running K/V tile counter (ring slot and phase), continued across items
        sc = pid * 0  # running ping-pong step counter
        for idx in range(n_local):
            start_m, q_row, q_col, kv_row0, kv_col, lse_row, n_tiles = _item(
                idx, pid, n_prog, n_m, H, GROUP, T, q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch, BLOCK_N, CAUSAL)
            row0 = start_m + HALF * HALF_ROWS
            qs = idx % NUM_Q
            q_half = q_smem.index(2 * qs + HALF)
            mbarrier.wait(q_full.index(qs), (idx // NUM_Q) & 1)

            m_i = gl.full([HALF_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
            l_i = gl.full([HALF_ROWS], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
            acc = gl.zeros([HALF_ROWS, HEAD_DIM], gl.float32, o_layout)
            s_zero = gl.zeros([HALF_ROWS, BLOCK_N], gl.float32, s_layout)

            # step 0: S_0 alone
            slot = t % STAGES
            _pp_enter(sched, sc, HALF, PINGPONG)
            mbarrier.wait(k_full.index(slot), (t // STAGES) & 1)
            s_tok = warpgroup_mma(q_half, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            _pp_leave(sched, HALF, PINGPONG)
            s = warpgroup_mma_wait(0, deps=(s_tok, ))
            mbarrier.arrive(k_empty.index(slot), count=1)
            p, m_i, l_i, alpha = _scores(s, m_i, l_i, qk_scale, row0, 0, T, s_layout, BLOCK_N, CAUSAL, KV_TAIL)
            p16 = gl.convert_layout(p.to(dtype), p_layout)
            # steps 1 .. n-1: S_j and P_{j-1} V_{j-1}
            for j in range(1, n_tiles):
                tj = t + j
                slot = tj % STAGES
                prev = (tj - 1) % STAGES
                _pp_enter(sched, sc + j, HALF, PINGPONG)
                mbarrier.wait(k_full.index(slot), (tj // STAGES) & 1)
                s_tok = warpgroup_mma(q_half, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                mbarrier.wait(v_full.index(prev), ((tj - 1) // STAGES) & 1)
                o_tok = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
                _pp_leave(sched, HALF, PINGPONG)
                s = warpgroup_mma_wait(1, deps=(s_tok, ))
                mbarrier.arrive(k_empty.index(slot), count=1)
                p, m_i, l_i, alpha = _scores(s, m_i, l_i, qk_scale, row0, j * BLOCK_N, T, s_layout, BLOCK_N,
                                             CAUSAL, KV_TAIL)
                p16_next = gl.convert_layout(p.to(dtype), p_layout)
                acc, p16 = warpgroup_mma_wait(0, deps=(o_tok, p16))
                mbarrier.arrive(v_empty.index(prev), count=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
                p16 = p16_next
            # every Q Kᵀ wgmma of this item has retired: Q's slot may take the next item's Q
            mbarrier.arrive(q_empty.index(qs), count=1)
            # step n: the last P V
            tl_ = t + n_tiles - 1
            last = tl_ % STAGES
            _pp_enter(sched, sc + n_tiles, HALF, PINGPONG)
            mbarrier.wait(v_full.index(last), (tl_ // STAGES) & 1)
            o_tok = warpgroup_mma(p16, v_smem.index(last), acc, is_async=True)
            _pp_leave(sched, HALF, PINGPONG)
            acc, p16 = warpgroup_mma_wait(0, deps=(o_tok, p16))
            mbarrier.arrive(v_empty.index(last), count=1)
            t += n_tiles
            sc += n_tiles + 1

            # epilogue: o = acc / l through this warpgroup's O buffer (the previous item's store must have
            # finished reading it), TMA store left in flight; lse by plain stores
            o = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
            tma.store_wait(0)
            _cta_barrier()
            o_half.store(o.to(dtype))
            fence_async_shared()
            _cta_barrier()
            _tma_store(o_desc, [q_row + HALF * HALF_ROWS, q_col], o_half)
            lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
            offs = gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, s_layout))
            gl.store(lse_ptr + lse_row + HALF * HALF_ROWS + offs, lse)
        tma.store_wait(0)

    @gluon.jit
    def _pers_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty,
                       v_empty, pid, n_prog, U, n_m, H, GROUP, T, q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, NUM_Q: gl.constexpr):
        """The TMA warp: per item, both Q halves into Q slot idx % NUM_Q once both consumers released it,
        then the item's K/V tiles into the ring (running counter t, continued across items)."""
        n_local = _n_local(pid, n_prog, U)
        t = pid * 0
        for idx in range(n_local):
            start_m, q_row, q_col, kv_row0, kv_col, lse_row, n_tiles = _item(
                idx, pid, n_prog, n_m, H, GROUP, T, q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch, BLOCK_N, CAUSAL)
            qs = idx % NUM_Q
            mbarrier.wait(q_empty.index(qs), ((idx // NUM_Q) & 1) ^ 1)  # first use passes on a fresh barrier
            mbarrier.expect(q_full.index(qs), 2 * q_desc.block_type.nbytes)
            _tma_load(q_desc, [q_row, q_col], q_full.index(qs), q_smem.index(2 * qs))
            _tma_load(q_desc, [q_row + HALF_ROWS, q_col], q_full.index(qs), q_smem.index(2 * qs + 1))
            for j in range(n_tiles):
                slot = t % STAGES
                phase = ((t // STAGES) & 1) ^ 1
                mbarrier.wait(k_empty.index(slot), phase)
                mbarrier.expect(k_full.index(slot), k_desc.block_type.nbytes)
                _tma_load(k_desc, [kv_row0 + j * BLOCK_N, kv_col], k_full.index(slot), k_smem.index(slot))
                mbarrier.wait(v_empty.index(slot), phase)
                mbarrier.expect(v_full.index(slot), v_desc.block_type.nbytes)
                _tma_load(v_desc, [kv_row0 + j * BLOCK_N, kv_col], v_full.index(slot), v_smem.index(slot))
                t += 1

    @gluon.jit
    def _pers_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, H, GROUP, T, U, n_m,
                     q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch,
                     HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                     KV_TAIL: gl.constexpr, NUM_Q: gl.constexpr, PINGPONG: gl.constexpr):
        """Persistent program: U = B·H·n_m items (n_m = T / 128), grid <= ceil(U / 2) programs. num_warps =
        4 (default partition = consumer 0; workers: consumer 1 (4 warps), producer (1 warp))."""
        dtype: gl.constexpr = q_desc.dtype
        pid = gl.program_id(0)
        n_prog = gl.num_programs(0)
        q_smem = gl.allocate_shared_memory(dtype, [2 * NUM_Q, HALF_ROWS, HEAD_DIM], q_desc.layout)
        o_smem = gl.allocate_shared_memory(dtype, [2, HALF_ROWS, HEAD_DIM], o_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_full = gl.allocate_shared_memory(gl.int64, [NUM_Q, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [NUM_Q, 1], mbarrier.MBarrierLayout())
        k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        sched = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_Q):
            mbarrier.init(q_full.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # one arrival per consumer warpgroup
        for i in gl.static_range(STAGES):
            mbarrier.init(k_full.index(i), count=1)
            mbarrier.init(v_full.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(sched.index(i), count=1)
        fence_async_shared()

        gl.warp_specialize([
            (_pers_consumer, (q_smem, o_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty,
                              sched, o_desc, lse_ptr, qk_scale, pid, n_prog, U, n_m, H, GROUP, T, q_rb, q_rh, q_ch,
                              kv_rb, kv_rh, kv_ch, dtype, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, KV_TAIL, NUM_Q,
                              PINGPONG, 0)),
            (_pers_consumer, (q_smem, o_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty,
                              sched, o_desc, lse_ptr, qk_scale, pid, n_prog, U, n_m, H, GROUP, T, q_rb, q_rh, q_ch,
                              kv_rb, kv_rh, kv_ch, dtype, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, KV_TAIL, NUM_Q,
                              PINGPONG, 1)),
            (_pers_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full,
                              k_empty, v_empty, pid, n_prog, U, n_m, H, GROUP, T, q_rb, q_rh, q_ch, kv_rb, kv_rh,
                              kv_ch, BLOCK_N, STAGES, CAUSAL, NUM_Q)),
        ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


# =========================================================================================================
# variants and host side
# =========================================================================================================
# name -> {head_dim: (BLOCK_N, STAGES, NUM_Q, PINGPONG)}; "lib" is the library kernel
_S = LIB.STAGES  # the library's ring depth by head dim (hd64: 3, hd128: 2)
VARIANTS = {
    "lib": None,
    "pers": {64: (128, _S[64], 1, False), 128: (128, _S[128], 1, False)},
    "pers_q2": {64: (128, _S[64], 2, False), 128: (128, _S[128], 2, False)},
    "pers_pp": {64: (128, _S[64], 1, True), 128: (128, _S[128], 1, True)},
    "pers_q2pp": {64: (128, _S[64], 2, True), 128: (128, _S[128], 2, True)},
    "pers_n64": {64: (64, 4, 1, False), 128: (64, 4, 1, False)},
}
GRID = None  # --grid: number of persistent programs (default: the GPU's SM count)
_NUM_SMS: dict = {}


def _num_sms(device) -> int:
    idx = torch.device(device).index or 0
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def has_head_dim(variant: str, D: int) -> bool:
    return VARIANTS[variant] is None or D in VARIANTS[variant]


def _pers_launch_args(q, k, v, o, lse, causal, scale, cfg, n_prog):
    """(grid, positional args, constexpr kwargs) of _pers_kernel; q/k/v/o CPU or GPU tensors."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    BLOCK_N, STAGES, NUM_Q, PINGPONG = cfg
    q2, q_rb, q_rh, q_ch = LIB._row_view(q)
    k2, kv_rb, kv_rh, kv_ch = LIB._row_view(k)
    v2 = LIB._row_view(v)[0]
    o2 = LIB._row_view(o)[0]
    n_m = T // BLOCK_M
    U = B * H * n_m
    G = max(1, min(n_prog, (U + 1) // 2))
    args = (LIB._desc(q2, LIB.HALF_M, D), LIB._desc(k2, BLOCK_N, D), LIB._desc(v2, BLOCK_N, D),
            LIB._desc(o2, LIB.HALF_M, D), lse, scale * LOG2E, H, H // Hkv, T, U, n_m,
            q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch)
    consts = dict(HEAD_DIM=D, BLOCK_N=BLOCK_N, STAGES=STAGES, CAUSAL=bool(causal),
                  KV_TAIL=bool(not causal and T % BLOCK_N != 0), NUM_Q=NUM_Q, PINGPONG=bool(PINGPONG))
    return (G, ), args, consts


def gluon_flash_fwd(q, k, v, causal=True, scale=None, variant="pers", *, o=None, lse=None):
    """Forward attention by ``variant`` (see the module docstring). Returns (o, lse)."""
    if variant == "lib":
        return LIB.flash_attention_fwd_gluon(q, k, v, causal, scale, o=o, lse=lse)
    cfg = VARIANTS[variant]
    B, H, T, D = q.shape
    if not LIB.supported(q, k, v) or D not in cfg:
        raise ValueError(f"{variant}: inputs not supported (q {tuple(q.shape)} {q.dtype} strides {q.stride()}, "
                         f"k strides {k.stride()}; head dims {sorted(cfg)})")
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if o is None:
        o = torch.empty_like(q) if q.is_contiguous() else torch.empty(
            B, T, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    if lse is None:
        lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    assert o.stride() == q.stride() and lse.is_contiguous()
    grid, args, consts = _pers_launch_args(q, k, v, o, lse, causal, s, cfg[D], GRID or _num_sms(q.device))
    _pers_kernel[grid](*args, **consts, num_warps=4)
    return o, lse


# =========================================================================================================
# offline compilation (no GPU): --compile-only
# =========================================================================================================
def compile_variant(name, D, causal=True, T=1024):
    """Compile variant ``name`` at head dim D for sm_90 without a GPU. Returns the CompiledKernel."""
    if name == "lib":
        return LIB.compile_sm90(D, causal)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    B, H, Hkv = 1, 4, 2
    q = torch.empty(B, H, T, D, dtype=torch.bfloat16)  # CPU tensors: only shapes, strides, dtype matter
    kv = torch.empty(B, Hkv, T, D, dtype=torch.bfloat16)
    lse = torch.empty(B, H, T, dtype=torch.float32)
    _, args, consts = _pers_launch_args(q, kv, kv, q, lse, causal, 1.0 / math.sqrt(D), VARIANTS[name][D], 132)
    names = [a for a in _pers_kernel.arg_names if a not in consts]
    vals = dict(zip(names, args))
    sig = {a: "constexpr" if a in consts else mangle_type(vals[a]) for a in _pers_kernel.arg_names}
    src = GluonASTSource(_pers_kernel, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def _res_usage(cubin):
    """Registers and local memory (spill) bytes per thread from cuobjdump -res-usage (ships with triton).
    Warp-specialised kernels: the cubin's count is the launch budget; setmaxnreg moves it per partition."""
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


def _summary(ck):
    ptx = ck.asm.get("ptx", "")
    keys = ["wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait", "setmaxnreg"]
    counts = ", ".join(f"{key} x{ptx.count(key)}" for key in keys)
    return f"smem {getattr(ck.metadata, 'shared', '?')} B; {_res_usage(ck.asm.get('cubin', b''))}; PTX {counts}"


def compile_only(variants, head_dims, dump=None):
    print(f"triton {triton.__version__}: compiling Gluon variants for sm_90 (no GPU)")
    ok = True
    for name in variants:
        for D in head_dims:
            if not has_head_dim(name, D):
                continue
            for causal in (True, False):
                t0 = time.time()
                tag = f"{name:10s} D={D:3d} {'causal' if causal else 'full  '}"
                try:
                    ck = compile_variant(name, D, causal)
                    print(f"  {tag}: OK   {time.time() - t0:5.1f}s  {_summary(ck)}")
                    if dump:
                        os.makedirs(dump, exist_ok=True)
                        for ext in ("ttgir", "ptx"):
                            with open(f"{dump}/{name}_d{D}_{int(causal)}.{ext}", "w") as f:
                                f.write(ck.asm.get(ext, ""))
                except Exception as e:  # noqa: BLE001
                    ok = False
                    print(f"  {tag}: FAIL {type(e).__name__}: {str(e)[:2000]}")
                sys.stdout.flush()
    return ok


# =========================================================================================================
# CPU replay of the persistent kernel's scheduling and barrier protocol: --replay
# =========================================================================================================
def py_n_local(pid, n_prog, U):
    n_pairs = (U + 1) // 2
    m_count = (n_pairs - pid + n_prog - 1) // n_prog
    last = pid + (m_count - 1) * n_prog
    return 2 * m_count - (U % 2) * int(last == n_pairs - 1)


def py_item(idx, pid, n_prog, n_m):
    """(pid_m, bh) of the program's idx-th item: a line-for-line copy of ``_item``."""
    u = 2 * (pid + (idx // 2) * n_prog) + idx % 2
    bh, r = u // n_m, u % n_m
    odd = r % 2
    return odd * (r // 2) + (1 - odd) * (n_m - 1 - r // 2), bh


def py_n_tiles(pid_m, T, block_n, causal):
    return -(-(pid_m * BLOCK_M + BLOCK_M) // block_n) if causal else -(-T // block_n)


def replay_schedule(BH, T, n_prog, block_n=128, causal=True):
    """Every (pid_m, bh) exactly once; returns per-program K/V tile counts and the schedule."""
    n_m = T // BLOCK_M
    U = BH * n_m
    G = max(1, min(n_prog, (U + 1) // 2))
    seen, loads, sched = {}, [], []
    for pid in range(G):
        items = [py_item(i, pid, G, n_m) for i in range(py_n_local(pid, G, U))]
        sched.append(items)
        loads.append(sum(py_n_tiles(m, T, block_n, causal) for m, _ in items))
        for it in items:
            assert it not in seen, f"item {it} twice (programs {seen[it]} and {pid})"
            seen[it] = pid
    want = {(m, bh) for m in range(n_m) for bh in range(BH)}
    assert set(seen) == want, f"missing {sorted(want - set(seen))[:5]} extra {sorted(set(seen) - want)[:5]}"
    return loads, sched, G


class _Bar:
    """An mbarrier: arrivals complete a phase at `count`; wait(parity) passes iff the phase of that parity
    has completed, i.e. the current phase's parity differs (a fresh barrier passes parity 1)."""

    def __init__(self, count, name):
        self.count, self.pending, self.phases, self.name = count, 0, 0, name

    def arrive(self):
        self.pending += 1
        if self.pending == self.count:
            self.pending, self.phases = 0, self.phases + 1

    def passes(self, parity):
        return (self.phases & 1) != parity


def replay_program(pid, G, BH, T, block_n, stages, num_q, pingpong, causal, rng, bug=None):
    """Run one program's three partitions as Python generators that mirror _pers_producer/_pers_consumer
    line by line, interleaved at random, with TMA copies and stores completing after random delays.
    Asserts: every consumer wait hands over exactly the tile/Q the consumer expects, no TMA copy lands in a
    slot a consumer may still read, the O buffer is not rewritten under an in-flight store, ping-pong steps
    alternate strictly, and nothing deadlocks. Returns the number of scheduler steps."""
    n_m = T // BLOCK_M
    U = BH * n_m
    n_local = py_n_local(pid, G, U)
    bar = {}
    for i in range(num_q):
        bar["q_full", i], bar["q_empty", i] = _Bar(1, f"q_full{i}"), _Bar(2, f"q_empty{i}")
    for i in range(stages):
        for nm, c in (("k_full", 1), ("v_full", 1), ("k_empty", 2), ("v_empty", 2)):
            bar[nm, i] = _Bar(c, f"{nm}{i}")
    bar["sched", 0], bar["sched", 1] = _Bar(1, "sched0"), _Bar(1, "sched1")
    content = {}  # (buffer, slot) -> what the last completed TMA copy put there
    readers = {}  # (buffer, slot) -> set of consumers that may read it (from full-wait to empty-arrive)
    inflight = []  # pending async events: [delay, fn]
    o_store = [False, False]  # an O store of warpgroup HALF still reads o_smem[HALF]
    pp_log = []

    def tma(buf, slot, tag, b):
        assert not readers.get((buf, slot)), f"TMA into {buf}[{slot}] while {readers[(buf, slot)]} read it"

        def land():
            content[buf, slot] = tag
            b.arrive()
        inflight.append([rng.randint(1, 6), land])

    def producer():
        t = 0
        for idx in range(n_local):
            pid_m, bh = py_item(idx, pid, G, n_m)
            n_tiles = py_n_tiles(pid_m, T, block_n, causal)
            qs = idx % num_q
            yield bar["q_empty", qs], ((idx // num_q) & 1) ^ 1
            tma("q", qs, ("q", idx), bar["q_full", qs])
            for j in range(n_tiles):
                slot, phase = t % stages, ((t // stages) & 1) ^ 1
                yield bar["k_empty", slot], phase
                tma("k", slot, ("kv", idx, j), bar["k_full", slot])
                yield bar["v_empty", slot], phase
                tma("v", slot, ("kv", idx, j), bar["v_full", slot])
                t += 1

    def use(buf, slot, tag, who):
        assert content.get((buf, slot)) == tag, f"{who} read {buf}[{slot}] = {content.get((buf, slot))}, want {tag}"
        readers.setdefault((buf, slot), set()).add(who)

    def release(buf, slot, who, b):
        readers[buf, slot].discard(who)
        b.arrive()

    def consumer(half):
        who = f"wg{half}"

        def pp_enter(step):
            if pingpong:
                yield bar["sched", half], (step & 1) ^ (1 - half) ^ (bug == "pp_parity" and half == 1)
                pp_log.append(half)

        def pp_leave():
            if pingpong:
                bar["sched", 1 - half].arrive()

        t = sc = 0
        for idx in range(n_local):
            pid_m, bh = py_item(idx, pid, G, n_m)
            n_tiles = py_n_tiles(pid_m, T, block_n, causal)
            qs = idx % num_q
            yield bar["q_full", qs], (idx // num_q) & 1
            use("q", qs, ("q", idx), who)
            slot = t % stages
            yield from pp_enter(sc)
            yield bar["k_full", slot], (t // stages) & 1
            use("k", slot, ("kv", idx, 0), who)
            pp_leave()
            release("k", slot, who, bar["k_empty", slot])  # wait(0) on S_0, then arrive
            for j in range(1, n_tiles):
                tj = t + j
                slot, prev = tj % stages, (tj - 1) % stages
                yield from pp_enter(sc + j)
                yield bar["k_full", slot], (tj // stages) & 1
                use("k", slot, ("kv", idx, j), who)
                yield bar["v_full", prev], ((tj - 1) // stages) & 1
                use("v", prev, ("kv", idx, j - 1), who)
                pp_leave()
                release("k", slot, who, bar["k_empty", slot])
                release("v", prev, who, bar["v_empty", prev])
            if not (bug == "q_release_late_count" and half == 1):
                release("q", qs, who, bar["q_empty", qs])
            tl_ = t + n_tiles - 1
            last = tl_ % stages
            yield from pp_enter(sc + n_tiles)
            yield bar["v_full", last], (tl_ // stages) & 1
            use("v", last, ("kv", idx, n_tiles - 1), who)
            pp_leave()
            release("v", last, who, bar["v_empty", last])
            t = 0 if bug == "ring_per_item" else t + n_tiles
            sc += n_tiles + 1
            yield "ostore", half  # tma.store_wait(0) before o_smem is written again
            o_store[half] = True  # o_smem write, fence, TMA store issued (left in flight)

            def done(h=half):
                o_store[h] = False
            inflight.append([rng.randint(1, 12), done])
        yield "ostore", half

    agents = {"prod": producer(), "wg0": consumer(0), "wg1": consumer(1)}
    waiting = {name: (None, None) for name in agents}  # what each agent waits on (None: nothing yet)

    def ready(b, p):
        if b is None:
            return True
        if b == "ostore":
            return not o_store[p]
        return b.passes(p)

    steps = 0
    while agents:
        steps += 1
        runnable = [n for n, (b, p) in waiting.items() if ready(b, p)]
        if inflight and (not runnable or rng.random() < 0.3):
            ev = rng.randrange(len(inflight))
            inflight[ev][0] -= 1
            if inflight[ev][0] <= 0:
                inflight.pop(ev)[1]()
            continue
        if not runnable:
            raise AssertionError(f"DEADLOCK pid {pid}: " + ", ".join(
                f"{n} on {b if isinstance(b, str) else b.name} parity {p}" for n, (b, p) in waiting.items()))
        name = rng.choice(runnable)
        try:
            waiting[name] = next(agents[name])
        except StopIteration:
            del agents[name], waiting[name]
    assert not any(readers.values()), f"readers left: {readers}"
    if pingpong:
        assert pp_log == [0, 1] * (len(pp_log) // 2), f"ping-pong order broken: {pp_log[:40]}"
    return steps


def replay(seed=0):
    """CPU checks of the persistent schedule (coverage, balance, L2 locality) and of the barrier protocol."""
    rng = random.Random(seed)
    print("schedule (H200: 132 programs): every (query tile, head) once; K/V tiles per program max/mean")
    for D in (64, 128):
        for T in (1024, 2048, 4096, 8192, 16384):
            BH = (16384 // T) * (2048 // D)
            loads, sched, G = replay_schedule(BH, T, 132)
            # heads in flight: the heads of the items the G programs hold at their k-th item, over k
            n_conc = [len({sched[p][k][1] for p in range(G) if k < len(sched[p])}) for k in range(len(sched[0]))]
            print(f"  D={D:3d} T={T:5d} B·H={BH:4d}: {len(loads)} programs, max {max(loads)} mean "
                  f"{sum(loads) / len(loads):.1f} -> balance {sum(loads) / len(loads) / max(loads):.3f}; "
                  f"heads in flight per lap {min(n_conc)}..{max(n_conc)} of {BH}")
    for BH, T, G, bn in ((4, 384, 5, 128), (3, 384, 4, 128), (4, 256, 3, 256), (1, 640, 2, 64), (7, 1024, 9, 128)):
        replay_schedule(BH, T, G, bn, True)
        replay_schedule(BH, T, G, bn, False)
    print("  odd n_m / odd item counts / small grids / BLOCK_N 64, 256: coverage OK")

    print("barrier protocol (random interleavings, random TMA/store latencies):")
    cases = []
    for name, cfg in VARIANTS.items():
        if cfg is None:
            continue
        for D, (bn, st, nq, pp) in cfg.items():
            for BH, T, G in ((4, 256, 3), (2, 384, 2), (3, 1024, 5), (1, 640, 1)):
                for causal in (True, False):
                    cases.append((name, D, BH, T, G, bn, st, nq, pp, causal))
    n = 0
    for name, D, BH, T, G, bn, st, nq, pp, causal in cases:
        for pid in range(min(G, 2)):
            for _ in range(3):
                replay_program(pid, G, BH, T, bn, st, nq, pp, causal, rng)
                n += 1
    print(f"  {n} program replays over {len(cases)} cases: no deadlock, no hazard, ping-pong alternates")

    # negative controls: the replay must catch a broken protocol
    for bug in ("ring_per_item", "pp_parity", "q_release_late_count"):
        try:
            for pid in range(3):
                for _ in range(5):
                    replay_program(pid, 3, 3, 1024, 128, 2, 1, bug == "pp_parity", True, rng, bug=bug)
            print(f"  negative control {bug}: NOT caught")
            return False
        except AssertionError as e:
            print(f"  negative control {bug}: caught ({str(e)[:90]})")
    return True


# =========================================================================================================
# GPU check + benchmark
# =========================================================================================================
# (B, T, causal, transposed k/v) of the correctness cases; H = 4, Hkv = 2 always
CHECK_CASES = ((1, 1024, True, False), (2, 2048, True, False), (2, 256, True, False), (1, 384, True, False),
               (2, 1024, False, False), (1, 2048, False, False), (2, 1024, True, True))


def _rel_err(x, ref):
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def check_variant(name, head_dims):
    """True iff every case passes: max relative error < 1e-2 on o and < 1e-5 on lse against the fp64
    reference; outputs pre-filled with NaN so an unwritten tile fails."""
    from xtrain.kernels.flash_attention import flash_attention_fwd_ref

    ok = True
    for D in head_dims:
        if not has_head_dim(name, D):
            continue
        for B, T, causal, transposed in CHECK_CASES:
            H, Hkv = 4, 2
            g = torch.Generator(device="cuda").manual_seed(T + D + B)

            def mk(h):
                if transposed:
                    return torch.randn(B, T, h, D, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                return torch.randn(B, h, T, D, generator=g, device="cuda", dtype=torch.bfloat16)
            q, k, v = mk(H), mk(Hkv), mk(Hkv)
            o = torch.full_like(q, float("nan"))
            lse = torch.full((B, H, T), float("nan"), device="cuda", dtype=torch.float32)
            gluon_flash_fwd(q, k, v, causal, None, name, o=o, lse=lse)
            torch.cuda.synchronize()
            o_ref, lse_ref = flash_attention_fwd_ref(q.double(), k.double(), v.double(), causal)
            eo, el = _rel_err(o, o_ref), _rel_err(lse, lse_ref)
            good = eo < 1e-2 and el < 1e-5
            ok &= good
            print(f"    {name} D={D} B={B} T={T} {'causal' if causal else 'full'}{' kvT' if transposed else ''}: "
                  f"o {eo:.2e} lse {el:.2e} {'ok' if good else 'FAIL'}")
            sys.stdout.flush()
    return ok


def _check_one(name, head_dims):
    """Check one variant in this process; prints the @@ markers run_checks parses."""
    print(f"@@START {name}")
    sys.stdout.flush()
    t0 = time.time()
    try:
        verdict = "PASS" if check_variant(name, head_dims) else "FAIL"
        print(f"[{name}] {verdict} ({time.time() - t0:.1f}s incl. compile)")
    except Exception as e:  # noqa: BLE001
        verdict = "ERROR"
        print(f"[{name}] ERROR {type(e).__name__}: {str(e)[:800]}")
        root = e
        while root.__cause__ is not None:
            root = root.__cause__
        if root is not e:
            print(f"[{name}]   caused by {type(root).__name__}: {str(root)[:800]}")
    print(f"@@RESULT {name} {verdict}")
    sys.stdout.flush()
    return verdict


def run_checks(variants, head_dims, startup_s=120.0, per_variant_s=90.0):
    """Correctness checks in child processes, output echoed. A child stops at the first exception (a CUDA
    fault poisons its context) and a new child takes the rest; a variant with no result within
    per_variant_s (a deadlocked mbarrier wait never returns) is killed (the child this function started,
    by its handle) and reported as HANG. Returns the passing variants."""
    import queue
    import subprocess
    import threading

    passing, todo = [], list(variants)
    while todo:
        cmd = [sys.executable, os.path.abspath(__file__), "--check-only", "--variants", ",".join(todo),
               "--head-dims", ",".join(map(str, head_dims))]
        if GRID:
            cmd += ["--grid", str(GRID)]
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
                child.kill()
                child.wait()
                victim = current or todo[0]
                print(f"[{victim}] HANG: no result within {per_variant_s if current else startup_s:.0f}s, child killed")
                todo.remove(victim)
                break
            if ln is None:
                child.wait()
                if current is not None:
                    print(f"[{current}] ERROR: the check process died (exit code {child.returncode})")
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


def bench_row(D, T, variants):
    """TFLOP/s of cuDNN, the Triton kernel, and each variant: causal bf16, B = 16k / T, H = 2048 / D."""
    import torch.nn.functional as F
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import xtrain.kernels.flash_attention as FA

    B, H = 16384 // T, 2048 // D
    g = torch.Generator(device="cuda").manual_seed(T * 7 + D)
    q, k, v = (torch.randn(B, H, T, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4.0 * B * H * T * T * D / 2
    row = {"D": D, "T": T}

    def timed(col, fn):
        try:
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            row[col] = flops / ms * 1e-9
        except Exception as e:  # noqa: BLE001
            print(f"  {col} D={D} T={T}: {type(e).__name__}: {str(e)[:300]}")

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        timed("cudnn", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    saved = FA.FWD_GLUON
    FA.FWD_GLUON = False  # the Triton kernel itself, not the library's Gluon dispatch
    try:
        timed("triton", lambda: FA.flash_attention_fwd_triton(q, k, v, True))
    finally:
        FA.FWD_GLUON = saved
    o = torch.empty_like(q)
    lse = torch.empty((B, H, T), device="cuda", dtype=torch.float32)
    for name in variants:
        if has_head_dim(name, D):
            timed(name, lambda name=name: gluon_flash_fwd(q, k, v, True, None, name, o=o, lse=lse))
    return row


def main(argv=None):
    global GRID
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--grid", type=int, default=None, help="persistent programs (default: the SM count)")
    ap.add_argument("--compile-only", action="store_true", help="compile every variant for sm_90 (no GPU)")
    ap.add_argument("--replay", action="store_true", help="CPU replay of the persistent schedule/barriers")
    ap.add_argument("--dump", default=None, help="with --compile-only: write ttgir/ptx into this folder")
    ap.add_argument("--no-isolate", action="store_true", help="check in this process (no child, no timeouts)")
    ap.add_argument("--check-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    GRID = args.grid
    seqs = [int(x) for x in args.seqs.split(",") if x]
    head_dims = [int(x) for x in args.head_dims.split(",") if x]
    variants = [x for x in args.variants.split(",") if x]
    for name in variants:
        if name not in VARIANTS:
            ap.error(f"unknown variant {name!r}; have {','.join(VARIANTS)}")
    if args.replay:
        return 0 if replay() else 1
    if args.compile_only:
        return 0 if compile_only(variants, head_dims, args.dump) else 1

    t_start = time.time()
    print(f"torch {torch.__version__}  triton {triton.__version__}  device {torch.cuda.get_device_name()}  "
          f"SMs {_num_sms(0)}  grid {GRID or 'SMs'}")
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
