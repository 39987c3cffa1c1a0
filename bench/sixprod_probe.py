"""A probe (session 26): the hd128 backward in SIX matrix products per tile pair, as two concurrent kernels.

    PYTHONPATH=. python3 bench/sixprod_probe.py --compile-only            # no GPU: ptxas facts (sm_90)
    PYTHONPATH=. python3 bench/sixprod_probe.py [--seqs 1024,...,16384]   # GPU: fp64 check, then time
    PYTHONPATH=. python3 bench/sixprod_probe.py --parts [--seqs ...]      # GPU: each pass alone, both, the split

Why. At T = 8k-16k the H200 runs this backward at its 700 W cap, so time follows energy, and energy follows the
count of matrix products (bench/RESULTS.md, session 14: the split's kernels spend ~1.0 pJ per executed FLOP, a plain
matmul's rate, but execute 7 products per (query, key) tile pair where cuDNN's count is 5). The 5-product one-pass
form does not fit the register file at hd128: two 64-key warpgroups each hold dK AND dV (128 registers) beside Sᵀ
and dPᵀ (64), which leaves no room for a dQ warpgroup (sessions 4, 5, 9, 14, 25). Take dV out of it and it fits:

  * pass A, "dV": one program per 128 keys of a (batch, kv head), K resident, two warpgroups of 64 keys walking the
    query tiles (BLOCK_MA rows): Sᵀ = K Qᵀ, Pᵀ = exp2(Sᵀ·scale·log2e − lse·log2e), dV += Pᵀ dO. 2 products.
  * pass B, "dK + dQ": the library's hd64 one-pass kernel (flash_attention_gluon_onepass.py) without its dV product:
    two dK warpgroups (Sᵀ, dPᵀ, dSᵀ into shared memory, dK += dSᵀ Q), a dQ warpgroup (dQ_step = dS K, staged in fp32,
    one TMA reduce-add per step into an fp32 accumulator) and a producer warp. 4 products. The dK warpgroups hold
    dK (64 registers), not dK and dV, so the dQ warpgroup's 64-register accumulator fits beside them.

So 6 products instead of 7, at the price of the dQ reduce-adds (32 KB per 64 x 128 step through L2) and a
convert kernel. The two passes are independent (both read Q, K, V, dO, lse, delta) and run on two streams, as the
split's two kernels do. dq is not bit-identical run to run (the reduce-add order), as the hd64 one-pass's.

Both kernels walk the split's way (``OPT_PEEL``): each group head's steps that meet the diagonal masked in a loop of
their own (the mask applied to S as -inf before the exponential: session 24's ptxas lesson), those wholly above a
warpgroup's keys skipped (pass B still hands the dQ warpgroup a zero dSᵀ half for them), the rest unmasked; lse and
delta come by TMA into shared memory beside Q and dO (``OPT_SMEM``). Pass A's ``PIPE``: the next step's Sᵀ issued
before this step's exponentials (FA3's intra-warpgroup overlap; only Sᵀ and dV are in flight, so it has registers).

Not in the library. Its oracle is the library's plain-torch reference ``flash_attention_bwd_ref``, against which
the GPU run checks it first (``isolated.bwd_worst_error``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from xtrain.kernels import flash_attention as FA  # noqa: E402
from xtrain.kernels import flash_attention_gluon_bwd as GB  # noqa: E402
from xtrain.kernels import flash_attention_gluon_onepass as OP  # noqa: E402
from xtrain.kernels._dispatch import run_side_by_side  # noqa: E402
from xtrain.kernels.flash_attention_gluon import HAVE_GLUON, LOG2E, _desc, _row_view  # noqa: E402

KH = 64  # keys per warpgroup (two per program)
BLOCK_M = 64  # pass B's query step
# name -> (BLOCK_MA, STAGES_A, PIPE_A, STAGES_B, NDS, SLOTS, KV_REGS, DQ_REGS[, DQH[, ABL]]) (``_b_dq``); pass B's
# dK warpgroup 0 gets 488 - KV_REGS - DQ_REGS registers (512 per thread-slot, 24 for the producer warp)
VARIANTS = {
    "six": (64, 2, False, 2, 2, 2, 192, 104),
    "six_a128": (128, 2, False, 2, 2, 2, 192, 104),
    "six_pipe": (64, 2, True, 2, 2, 2, 192, 104),
    "six_b3": (64, 2, False, 3, 2, 1, 192, 104),
    "six_dqh": (128, 2, False, 2, 2, 2, 192, 104, True),
    "six_dqh_ds3": (128, 2, False, 2, 3, 1, 192, 104, True),
    # timing-only ablations of pass B's dQ warpgroup (wrong dq): no reduce-add / no staging / no dQ product
    "abl_nored": (128, 2, False, 2, 2, 2, 192, 104, False, 1),
    "abl_nostage": (128, 2, False, 2, 2, 2, 192, 104, False, 2),
    "abl_nodq": (128, 2, False, 2, 2, 2, 192, 104, False, 3),
}
CORRECT = [n for n, c in VARIANTS.items() if len(c) < 10 or not c[9]]

if HAVE_GLUON:
    from xtrain.kernels.flash_attention_gluon import (
        _CONSUMER_REGS,
        _PRODUCER_REGS,
        _cta_barrier,
        _tma_load,
        _tma_store,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from xtrain.kernels.flash_attention_gluon_bwd import (
        _acc_layout,
        _dkdv_issue_sdp,
        _dkdv_producer,
        _dkdv_skip,
        _next_query_tile,
        _ring_init,
        _tail_order,
    )

    @gluon.jit
    def _place(H, GROUP, T, TAIL, KH: gl.constexpr, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
        """(off_b, off_kvh, start_n, h0, mt0, n_m, n_iter) of this program (the split's ``_tail_order``)."""
        pid_n, off_bkv = _tail_order(gl.program_id(0), T // (2 * KH), TAIL)
        Hkv = H // GROUP
        off_b = off_bkv // Hkv
        off_kvh = off_bkv % Hkv
        start_n = pid_n * (2 * KH)
        if CAUSAL:
            mt0 = start_n // BLOCK_M
        else:
            mt0 = 0
        n_m = T // BLOCK_M - mt0
        return off_b, off_kvh, start_n, off_kvh * GROUP, mt0, n_m, GROUP * n_m

    @gluon.jit
    def _store_half(half_smem, x, desc, row, col):
        """x (one warpgroup's [64, D] result, in the output dtype) out through a dead shared half by TMA."""
        half_smem.store(x)
        fence_async_shared()
        _cta_barrier()
        _tma_store(desc, [row, col], half_smem)
        tma.store_wait(0)

    # ------------------------------------------------------------------------------------------------------
    # pass A: dV
    # ------------------------------------------------------------------------------------------------------
    @gluon.jit
    def _a_producer(q_desc, do_desc, k_desc, lse_desc, q_smem, do_smem, k_smem, lse_smem, kv_bar, q_bars, do_bars,
                    q_empty, k_row, k_col, q_base, q_rh, q_ch, do_base, do_rh, do_ch, h0, mt0, n_iter, T, lt0,
                    BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
        """The TMA warp: both K halves once, then each step's Q tile with its lse row (one barrier) and dO tile."""
        KH: gl.constexpr = k_desc.block_type.shape[0]
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
        _tma_load(k_desc, [k_row, k_col], kv_bar, k_smem.index(0))
        _tma_load(k_desc, [k_row + KH, k_col], kv_bar, k_smem.index(1))
        h = h0
        start_m = mt0 * BLOCK_M
        lt = lt0
        for it in range(n_iter):
            slot = it % STAGES
            phase = ((it // STAGES) & 1) ^ 1  # fresh barriers: the first lap passes
            mbarrier.wait(q_empty.index(slot), phase)
            bar = q_bars.index(slot)
            mbarrier.expect(bar, q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
            _tma_load(lse_desc, [lt, 0], bar, lse_smem.index(slot))
            _tma_load(q_desc, [q_base + h * q_rh + start_m, h * q_ch], bar, q_smem.index(slot))
            dbar = do_bars.index(slot)
            mbarrier.expect(dbar, do_desc.block_type.nbytes)
            _tma_load(do_desc, [do_base + h * do_rh + start_m, h * do_ch], dbar, do_smem.index(slot))
            start_m, wrap = _next_query_tile(start_m, BLOCK_M, T, mt0 * BLOCK_M)
            lt += 1
            lt += wrap * mt0
            h += wrap

    @gluon.jit
    def _a_issue_s(k_half, q_smem, q_bars, s_zero, it, STAGES: gl.constexpr):
        slot = it % STAGES
        mbarrier.wait(q_bars.index(slot), (it // STAGES) & 1)
        return warpgroup_mma(k_half, q_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)

    @gluon.jit
    def _a_p(st, lse_smem, slot, start_m, offs_k, cols, qk_scale, dtype: gl.constexpr, s_layout: gl.constexpr,
             op_layout: gl.constexpr, MASK: gl.constexpr):
        """Pᵀ of a retired Sᵀ, as the dV wgmma's register A operand."""
        lse_b = lse_smem.index(slot).load(s_layout)
        if MASK:
            keep = gl.expand_dims(start_m + cols, 0) >= gl.expand_dims(offs_k, 1)
            st = gl.where(keep, st, float("-inf"))
        pt = gl.exp2(st * qk_scale - lse_b)
        return gl.convert_layout(pt.to(dtype), op_layout)

    @gluon.jit
    def _a_step(k_half, q_smem, do_smem, lse_smem, q_bars, do_bars, q_empty, dv, s_zero, it, start_m, offs_k, cols,
                qk_scale, dtype: gl.constexpr, s_layout: gl.constexpr, op_layout: gl.constexpr,
                STAGES: gl.constexpr, MASK: gl.constexpr):
        slot = it % STAGES
        st = _a_issue_s(k_half, q_smem, q_bars, s_zero, it, STAGES)
        st = warpgroup_mma_wait(0, deps=(st, ))
        p_op = _a_p(st, lse_smem, slot, start_m, offs_k, cols, qk_scale, dtype, s_layout, op_layout, MASK)
        mbarrier.wait(do_bars.index(slot), (it // STAGES) & 1)
        dv = warpgroup_mma(p_op, do_smem.index(slot), dv, is_async=True)
        dv, p_op = warpgroup_mma_wait(0, deps=(dv, p_op))
        mbarrier.arrive(q_empty.index(slot), count=1)
        return dv

    @gluon.jit
    def _a_step_pipe(k_half, q_smem, do_smem, lse_smem, q_bars, do_bars, q_empty, dv, st, s_zero, it, n_iter, start_m,
                     offs_k, cols, qk_scale, dtype: gl.constexpr, s_layout: gl.constexpr, op_layout: gl.constexpr,
                     STAGES: gl.constexpr, MASK: gl.constexpr):
        """PIPE: ``st`` is step it's retired Sᵀ; step it + 1's Sᵀ is issued before the exponentials and returned
        retired (the last step issues its own again: a harmless repeat read of a slot it still holds)."""
        slot = it % STAGES
        nxt = gl.minimum(it + 1, n_iter - 1)
        s_next = _a_issue_s(k_half, q_smem, q_bars, s_zero, nxt, STAGES)
        p_op = _a_p(st, lse_smem, slot, start_m, offs_k, cols, qk_scale, dtype, s_layout, op_layout, MASK)
        mbarrier.wait(do_bars.index(slot), (it // STAGES) & 1)
        dv = warpgroup_mma(p_op, do_smem.index(slot), dv, is_async=True)
        s_next, dv, p_op = warpgroup_mma_wait(0, deps=(s_next, dv, p_op))
        mbarrier.arrive(q_empty.index(slot), count=1)
        return dv, s_next

    @gluon.jit
    def _a_consumer(q_smem, do_smem, k_smem, lse_smem, kv_bar, q_bars, do_bars, q_empty, dv_desc, dv_row, dv_col, mt0,
                    n_m, n_iter, start_n, qk_scale, dtype: gl.constexpr, HEAD_DIM: gl.constexpr,
                    BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, HALF: gl.constexpr,
                    PIPE: gl.constexpr):
        """Warpgroup HALF of pass A: keys [start_n + HALF·64, +64), dV in registers, out through its dead K half."""
        KH: gl.constexpr = dv_desc.block_type.shape[0]
        s_layout: gl.constexpr = _acc_layout(BLOCK_M)
        a_layout: gl.constexpr = _acc_layout(HEAD_DIM)
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
        k_half = k_smem.index(HALF)
        offs_k = start_n + HALF * KH + gl.arange(0, KH, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([KH, BLOCK_M], gl.float32, s_layout)
        dv = gl.zeros([KH, HEAD_DIM], gl.float32, a_layout)
        start_m = mt0 * BLOCK_M
        if CAUSAL:  # the split's PEEL arithmetic: steps skipped, then steps masked, at each group head's start
            n_skip: gl.constexpr = (HALF * KH) // BLOCK_M
            n_diag: gl.constexpr = ((HALF + 1) * KH + BLOCK_M - 1) // BLOCK_M - n_skip
        else:
            n_skip: gl.constexpr = 0
            n_diag: gl.constexpr = 0
        mbarrier.wait(kv_bar, 0)
        it = 0
        if PIPE:
            # (the skipped steps run masked here: P = 0, so they add nothing)
            st = _a_issue_s(k_half, q_smem, q_bars, s_zero, 0, STAGES)
            st = warpgroup_mma_wait(0, deps=(st, ))
            for _g in range(n_iter // n_m):
                for i in gl.static_range(n_skip + n_diag):
                    dv, st = _a_step_pipe(k_half, q_smem, do_smem, lse_smem, q_bars, do_bars, q_empty, dv, st, s_zero,
                                          it, n_iter, start_m + i * BLOCK_M, offs_k, cols, qk_scale, dtype, s_layout,
                                          op_layout, STAGES, True)
                    it += 1
                for _i in range(n_m - n_skip - n_diag):
                    dv, st = _a_step_pipe(k_half, q_smem, do_smem, lse_smem, q_bars, do_bars, q_empty, dv, st, s_zero,
                                          it, n_iter, start_m, offs_k, cols, qk_scale, dtype, s_layout, op_layout,
                                          STAGES, False)
                    it += 1
        else:
            for _g in range(n_iter // n_m):
                for _i in gl.static_range(n_skip):
                    _dkdv_skip(q_bars, do_bars, q_empty, it, STAGES)
                    it += 1
                for i in gl.static_range(n_diag):
                    dv = _a_step(k_half, q_smem, do_smem, lse_smem, q_bars, do_bars, q_empty, dv, s_zero, it,
                                 start_m + (n_skip + i) * BLOCK_M, offs_k, cols, qk_scale, dtype, s_layout, op_layout,
                                 STAGES, True)
                    it += 1
                for _i in range(n_m - n_skip - n_diag):
                    dv = _a_step(k_half, q_smem, do_smem, lse_smem, q_bars, do_bars, q_empty, dv, s_zero, it, start_m,
                                 offs_k, cols, qk_scale, dtype, s_layout, op_layout, STAGES, False)
                    it += 1
        _store_half(k_half, dv.to(dtype), dv_desc, dv_row + HALF * KH, dv_col)

    @gluon.jit
    def _a_kernel(q_desc, do_desc, k_desc, dv_desc, lse_desc, qk_scale, H, GROUP, T, q_rb, q_rh, q_ch, do_rb, do_rh,
                  do_ch, k_rb, k_rh, k_ch, dv_rb, dv_rh, dv_ch, TAIL, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, PIPE: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        KH: gl.constexpr = k_desc.block_type.shape[0]
        off_b, off_kvh, start_n, h0, mt0, n_m, n_iter = _place(H, GROUP, T, TAIL, KH, BLOCK_M, CAUSAL)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2, KH, HEAD_DIM], k_desc.layout)
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], lse_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_bars.index(i), count=1)
            mbarrier.init(do_bars.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # one arrival per consumer warpgroup
        fence_async_shared()
        k_row = off_b * k_rb + off_kvh * k_rh + start_n
        dv_row = off_b * dv_rb + off_kvh * dv_rh + start_n
        gl.warp_specialize([
            (_a_consumer, (q_smem, do_smem, k_smem, lse_smem, kv_bar, q_bars, do_bars, q_empty, dv_desc, dv_row,
                           off_kvh * dv_ch, mt0, n_m, n_iter, start_n, qk_scale, dtype, HEAD_DIM, BLOCK_M, STAGES,
                           CAUSAL, 0, PIPE)),
            (_a_consumer, (q_smem, do_smem, k_smem, lse_smem, kv_bar, q_bars, do_bars, q_empty, dv_desc, dv_row,
                           off_kvh * dv_ch, mt0, n_m, n_iter, start_n, qk_scale, dtype, HEAD_DIM, BLOCK_M, STAGES,
                           CAUSAL, 1, PIPE)),
            (_a_producer, (q_desc, do_desc, k_desc, lse_desc, q_smem, do_smem, k_smem, lse_smem, kv_bar, q_bars,
                           do_bars, q_empty, k_row, off_kvh * k_ch, off_b * q_rb, q_rh, q_ch, off_b * do_rb, do_rh,
                           do_ch, h0, mt0, n_iter, T, (off_b * H + h0) * (T // BLOCK_M) + mt0, BLOCK_M, STAGES)),
        ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])

    # ------------------------------------------------------------------------------------------------------
    # pass B: dK and dQ
    # ------------------------------------------------------------------------------------------------------
    @gluon.jit
    def _b_handoff(ds16, ds_smem, ds_empty, ds_full, it, NDS: gl.constexpr, HALF: gl.constexpr):
        """This half's dSᵀ of step ``it`` into dS buffer it % NDS (once the dQ warpgroup is done with it)."""
        b = it % NDS
        mbarrier.wait(ds_empty.index(b), ((it // NDS) & 1) ^ 1)  # fresh barrier: the first lap passes
        ds_half = ds_smem.index(2 * b + HALF)
        ds_half.store(ds16)
        fence_async_shared()
        _cta_barrier()  # every thread's store is fenced before the wgmma and the one arrival
        return ds_half, b

    @gluon.jit
    def _b_step(k_half, v_half, q_smem, do_smem, lse_smem, delta_smem, ds_smem, q_bars, do_bars, q_empty, ds_empty,
                ds_full, dk, s_zero, it, start_m, offs_k, cols, qk_scale, dtype: gl.constexpr,
                s_layout: gl.constexpr, STAGES: gl.constexpr, NDS: gl.constexpr, HALF: gl.constexpr,
                MASK: gl.constexpr):
        slot, q_t, do_t, st, dpt = _dkdv_issue_sdp(k_half, v_half, q_smem, do_smem, q_bars, do_bars, s_zero, it, STAGES)
        lse_b = lse_smem.index(slot).load(s_layout)
        st = warpgroup_mma_wait(1, deps=(st, ))  # retires Sᵀ; dPᵀ may still run
        if MASK:
            keep = gl.expand_dims(start_m + cols, 0) >= gl.expand_dims(offs_k, 1)
            st = gl.where(keep, st, float("-inf"))
        pt = gl.exp2(st * qk_scale - lse_b)
        delta_b = delta_smem.index(slot).load(s_layout)
        dpt = warpgroup_mma_wait(0, deps=(dpt, ))
        ds16 = (pt * (dpt - delta_b)).to(dtype)
        ds_half, b = _b_handoff(ds16, ds_smem, ds_empty, ds_full, it, NDS, HALF)
        dk = warpgroup_mma(ds_half, q_t, dk, is_async=True)  # A from shared memory
        mbarrier.arrive(ds_full.index(b), count=1)
        dk = warpgroup_mma_wait(0, deps=(dk, ))
        mbarrier.arrive(q_empty.index(slot), count=1)
        return dk

    @gluon.jit
    def _b_skip(q_bars, do_bars, q_empty, ds_smem, ds_empty, ds_full, ds_zero, it, STAGES: gl.constexpr,
                NDS: gl.constexpr, HALF: gl.constexpr):
        """A step whose queries all precede this half's keys: nothing for dK, a zero dSᵀ half for the dQ warpgroup."""
        slot = it % STAGES
        phase = (it // STAGES) & 1
        mbarrier.wait(q_bars.index(slot), phase)
        mbarrier.wait(do_bars.index(slot), phase)
        _, b = _b_handoff(ds_zero, ds_smem, ds_empty, ds_full, it, NDS, HALF)
        mbarrier.arrive(ds_full.index(b), count=1)
        mbarrier.arrive(q_empty.index(slot), count=1)

    @gluon.jit
    def _b_consumer(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, kv_bar, q_bars, do_bars, q_empty,
                    ds_full, ds_empty, dk_desc, dk_row, dk_col, mt0, n_m, n_iter, start_n, qk_scale, sm_scale,
                    dtype: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                    CAUSAL: gl.constexpr, HALF: gl.constexpr, NDS: gl.constexpr):
        """dK warpgroup HALF of pass B: keys [start_n + HALF·64, +64)."""
        KH: gl.constexpr = dk_desc.block_type.shape[0]
        s_layout: gl.constexpr = _acc_layout(BLOCK_M)
        a_layout: gl.constexpr = _acc_layout(HEAD_DIM)
        k_half = k_smem.index(HALF)
        v_half = v_smem.index(HALF)
        offs_k = start_n + HALF * KH + gl.arange(0, KH, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([KH, BLOCK_M], gl.float32, s_layout)
        dk = gl.zeros([KH, HEAD_DIM], gl.float32, a_layout)
        start_m = mt0 * BLOCK_M
        if CAUSAL:  # the split's PEEL arithmetic: steps skipped, then steps masked, at each group head's start
            n_skip: gl.constexpr = (HALF * KH) // BLOCK_M
            n_diag: gl.constexpr = ((HALF + 1) * KH + BLOCK_M - 1) // BLOCK_M - n_skip
        else:
            n_skip: gl.constexpr = 0
            n_diag: gl.constexpr = 0
        mbarrier.wait(kv_bar, 0)
        it = 0
        for _g in range(n_iter // n_m):
            for _i in gl.static_range(n_skip):
                _b_skip(q_bars, do_bars, q_empty, ds_smem, ds_empty, ds_full, gl.zeros([KH, BLOCK_M], dtype, s_layout),
                        it, STAGES, NDS, HALF)
                it += 1
            for i in gl.static_range(n_diag):
                dk = _b_step(k_half, v_half, q_smem, do_smem, lse_smem, delta_smem, ds_smem, q_bars, do_bars, q_empty,
                             ds_empty, ds_full, dk, s_zero, it, start_m + (n_skip + i) * BLOCK_M, offs_k, cols,
                             qk_scale, dtype, s_layout, STAGES, NDS, HALF, True)
                it += 1
            for _i in range(n_m - n_skip - n_diag):
                dk = _b_step(k_half, v_half, q_smem, do_smem, lse_smem, delta_smem, ds_smem, q_bars, do_bars, q_empty,
                             ds_empty, ds_full, dk, s_zero, it, start_m, offs_k, cols, qk_scale, dtype, s_layout,
                             STAGES, NDS, HALF, False)
                it += 1
        # both K halves feed the dQ warpgroup: its last ds_empty arrival comes after its last dQ wgmmas retired
        last = n_iter - 1
        mbarrier.wait(ds_empty.index(last % NDS), (last // NDS) & 1)
        _store_half(k_half, (dk * sm_scale).to(dtype), dk_desc, dk_row + HALF * KH, dk_col)

    @gluon.jit
    def _b_dq(k_smem, ds_smem, dq_smem, kv_bar, ds_full, ds_empty, dq_desc, dq_row0, T, mt0, n_m, n_iter,
              BLOCK_M: gl.constexpr, NDS: gl.constexpr, SLOTS: gl.constexpr, DQH: gl.constexpr, ABL: gl.constexpr):
        """Pass B's dQ warpgroup. DQH: the step's dQ as two head-dim halves (dq_desc has [64, D/2] tiles, two staging
        tiles per slot): both halves' wgmmas issued at once, the first half staged while the second runs. ABL
        (timing-only ablations, wrong dq): 1 no reduce-add, 2 neither staging store nor reduce-add, 3 no dQ
        product either (the warpgroup only waits ds_full and arrives ds_empty)."""
        DC: gl.constexpr = dq_desc.block_type.shape[1]
        mbarrier.wait(kv_bar, 0)
        k0 = k_smem.index(0)
        k1 = k_smem.index(1)
        zero = gl.zeros([BLOCK_M, DC], gl.float32, _acc_layout(DC))
        keep = zero
        for it in range(n_iter):
            b = it % NDS
            mbarrier.wait(ds_full.index(b), (it // NDS) & 1)
            row = dq_row0 + (it // n_m) * T + (mt0 + it % n_m) * BLOCK_M
            s = it % SLOTS
            if ABL == 3:
                mbarrier.arrive(ds_empty.index(b), count=1)
            elif DQH:
                dsl = ds_smem.index(2 * b).permute((1, 0))
                dsh = ds_smem.index(2 * b + 1).permute((1, 0))
                a0 = warpgroup_mma(dsl, k0.slice(0, DC, dim=1), zero, use_acc=False, is_async=True)
                a0 = warpgroup_mma(dsh, k1.slice(0, DC, dim=1), a0, is_async=True)
                a1 = warpgroup_mma(dsl, k0.slice(DC, DC, dim=1), zero, use_acc=False, is_async=True)
                a1 = warpgroup_mma(dsh, k1.slice(DC, DC, dim=1), a1, is_async=True)
                a0 = warpgroup_mma_wait(2, deps=(a0, ))
                if ABL < 2:
                    tma.store_wait(2 * (SLOTS - 1))  # the reduce-adds of step it - SLOTS (same tiles) have read them
                    _cta_barrier()
                    dq_smem.index(2 * s).store(a0)
                a1 = warpgroup_mma_wait(0, deps=(a1, ))
                mbarrier.arrive(ds_empty.index(b), count=1)
                if ABL < 2:
                    dq_smem.index(2 * s + 1).store(a1)
                    fence_async_shared()
                    _cta_barrier()
                    if ABL == 0:
                        OP._tma_reduce_add(dq_desc, [row, 0], dq_smem.index(2 * s))
                        OP._tma_reduce_add(dq_desc, [row, DC], dq_smem.index(2 * s + 1))
            elif ABL == 2:  # the products kept live by accumulating across steps, stored once at the end
                keep = warpgroup_mma(ds_smem.index(2 * b).permute((1, 0)), k0, keep, is_async=True)
                keep = warpgroup_mma(ds_smem.index(2 * b + 1).permute((1, 0)), k1, keep, is_async=True)
                keep = warpgroup_mma_wait(0, deps=(keep, ))
                mbarrier.arrive(ds_empty.index(b), count=1)
            else:
                dq = warpgroup_mma(ds_smem.index(2 * b).permute((1, 0)), k0, zero, use_acc=False, is_async=True)
                dq = warpgroup_mma(ds_smem.index(2 * b + 1).permute((1, 0)), k1, dq, is_async=True)
                dq = warpgroup_mma_wait(0, deps=(dq, ))
                mbarrier.arrive(ds_empty.index(b), count=1)
                if ABL < 2:
                    tma.store_wait(SLOTS - 1)
                    _cta_barrier()
                    dq_smem.index(s).store(dq)
                    fence_async_shared()
                    _cta_barrier()
                    if ABL == 0:
                        OP._tma_reduce_add(dq_desc, [row, 0], dq_smem.index(s))
        if ABL == 2:
            dq_smem.index(0).store(keep)
        tma.store_wait(0)  # no CTA exit while a reduce-add still reads shared memory

    @gluon.jit
    def _b_kernel(q_desc, do_desc, k_desc, v_desc, dk_desc, dq_desc, lse_desc, delta_desc, qk_scale, sm_scale, H, GROUP,
                  T, q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, dk_rb, dk_rh, dk_ch,
                  TAIL, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, SLOTS: gl.constexpr,
                  NDS: gl.constexpr, CAUSAL: gl.constexpr, KV_REGS: gl.constexpr, DQ_REGS: gl.constexpr,
                  DQH: gl.constexpr, ABL: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        KH: gl.constexpr = k_desc.block_type.shape[0]
        gl.static_assert(BLOCK_M == 64)
        off_b, off_kvh, start_n, h0, mt0, n_m, n_iter = _place(H, GROUP, T, TAIL, KH, BLOCK_M, CAUSAL)
        dq_row0 = (off_b * H + h0) * T
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2, KH, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, KH, HEAD_DIM], v_desc.layout)
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], lse_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], delta_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KH, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [2 * NDS, KH, BLOCK_M], ds_layout)  # [buffer·2 + half]
        DC: gl.constexpr = dq_desc.block_type.shape[1]
        dq_smem = gl.allocate_shared_memory(gl.float32, [SLOTS * (HEAD_DIM // DC), BLOCK_M, DC], dq_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_full = gl.allocate_shared_memory(gl.int64, [NDS, 1], mbarrier.MBarrierLayout())
        ds_empty = gl.allocate_shared_memory(gl.int64, [NDS, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        _ring_init(q_bars, q_empty, STAGES)
        _ring_init(do_bars, do_empty, STAGES)
        for i in gl.static_range(NDS):
            mbarrier.init(ds_full.index(i), count=2)  # one arrival per dK warpgroup
            mbarrier.init(ds_empty.index(i), count=1)  # the dQ warpgroup, once its dQ wgmmas retired
        fence_async_shared()
        k_row = off_b * k_rb + off_kvh * k_rh + start_n
        v_row = off_b * v_rb + off_kvh * v_rh + start_n
        dk_row = off_b * dk_rb + off_kvh * dk_rh + start_n
        gl.warp_specialize([
            (_b_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, kv_bar, q_bars, do_bars,
                           q_empty, ds_full, ds_empty, dk_desc, dk_row, off_kvh * dk_ch, mt0, n_m, n_iter, start_n,
                           qk_scale, sm_scale, dtype, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, 0, NDS)),
            (_b_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, kv_bar, q_bars, do_bars,
                           q_empty, ds_full, ds_empty, dk_desc, dk_row, off_kvh * dk_ch, mt0, n_m, n_iter, start_n,
                           qk_scale, sm_scale, dtype, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, 1, NDS)),
            (_b_dq, (k_smem, ds_smem, dq_smem, kv_bar, ds_full, ds_empty, dq_desc, dq_row0, T, mt0, n_m, n_iter,
                     BLOCK_M, NDS, SLOTS, DQH, ABL)),
            (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
                              lse_smem, delta_smem, kv_bar, q_bars, do_bars, q_empty, do_empty, k_row, off_kvh * k_ch,
                              v_row, off_kvh * v_ch, off_b * q_rb, q_rh, q_ch, off_b * do_rb, do_rh, do_ch, h0, mt0,
                              n_m, n_iter, T, (off_b * H + h0) * (T // BLOCK_M) + mt0, BLOCK_M, STAGES, True, True)),
        ], [4, 4, 1], [KV_REGS, DQ_REGS, _PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------------
def _launches(q, k, v, do, dk, dv, dq_acc, lse2, delta, s: float, causal: bool, cfg):
    """[(kernel, grid, args, constexprs)] of pass A and pass B; CUDA tensors or CPU stand-ins."""
    bma, sta, pipe, stb, nds, slots, kv_regs, dq_regs, *rest = cfg
    dqh, abl = (list(rest) + [False, 0])[:2]
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    views = {n: _row_view(x) for n, x in (("q", q), ("do", do), ("k", k), ("v", v), ("dk", dk), ("dv", dv))}
    co = {}
    for n, (_, rb, rh, ch) in views.items():
        co.update({f"{n}_rb": rb, f"{n}_rh": rh, f"{n}_ch": ch})
    nb = T // (2 * KH)
    tail = GB.tail_heads(nb, B * Hkv, FA.grid_sms(q.device))
    common = dict(qk_scale=s * LOG2E, H=H, GROUP=H // Hkv, T=T, TAIL=tail)
    lse_a = _row_view(lse2.view(B, H, T // bma, bma))[0]
    a = dict(q_desc=_desc(views["q"][0], bma, D), do_desc=_desc(views["do"][0], bma, D),
             k_desc=_desc(views["k"][0], KH, D), dv_desc=_desc(views["dv"][0], KH, D), lse_desc=_desc(lse_a, 1, bma),
             **common, **{x: co[x] for x in co if x[:2] in ("q_", "do", "k_", "dv")})
    ca = dict(HEAD_DIM=D, BLOCK_M=bma, STAGES=sta, CAUSAL=bool(causal), PIPE=bool(pipe))
    lse_b = _row_view(lse2.view(B, H, T // BLOCK_M, BLOCK_M))[0]
    delta_b = _row_view(delta.view(B, H, T // BLOCK_M, BLOCK_M))[0]
    b = dict(q_desc=_desc(views["q"][0], BLOCK_M, D), do_desc=_desc(views["do"][0], BLOCK_M, D),
             k_desc=_desc(views["k"][0], KH, D), v_desc=_desc(views["v"][0], KH, D),
             dk_desc=_desc(views["dk"][0], KH, D),
             dq_desc=_desc(dq_acc.view(B * H * T, D), BLOCK_M, D // 2 if dqh else D),
             lse_desc=_desc(lse_b, 1, BLOCK_M), delta_desc=_desc(delta_b, 1, BLOCK_M), sm_scale=s, **common,
             **{x: co[x] for x in co if x[:2] in ("q_", "do", "k_", "v_", "dk")})
    cb = dict(HEAD_DIM=D, BLOCK_M=BLOCK_M, STAGES=stb, SLOTS=slots, NDS=nds, CAUSAL=bool(causal), KV_REGS=kv_regs,
              DQ_REGS=dq_regs, DQH=bool(dqh), ABL=int(abl))
    grid = (nb * B * Hkv, )
    return [(_a_kernel, grid, a, ca), (_b_kernel, grid, b, cb)]


def six_bwd(do, q, k, v, o, lse, dq=None, dk=None, dv=None, causal: bool = True, variant: str = "six",
            parts: str = "ab"):
    """The probe's backward: delta preprocess (lse·log2e beside it), pass B on this stream and pass A on the side
    stream, then the dQ convert. ``parts``: "a" or "b" launches that pass alone (timing only)."""
    op = "six_bwd"
    do, lse2, dq, dk, dv, delta, s, _ = GB._prologue(op, GB.supported_bwd, GB.HEAD_DIMS, do, q, k, v, o, lse, None,
                                                     dq, dk, dv, base2=True)
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    (ka, ga, aa, ca), (kb, gb, ab, cb) = _launches(q, k, v, do, dk, dv, acc, lse2, delta, s, causal,
                                                   VARIANTS[variant])

    def run_a():
        ka[ga](**aa, **ca, num_warps=4)

    def run_b():
        kb[gb](**ab, **cb, num_warps=4)

    if parts == "ab":
        run_side_by_side(q.device, run_b, run_a)
    elif parts == "a":
        run_a()
    else:
        run_b()
    OP.dq_convert(acc, dq, s)
    return dq, dk, dv


def compile_sm90(variant: str, causal: bool = True, D: int = 128, T: int = 256, mha: bool = True):
    """Both passes compiled for sm_90 without a GPU. Returns [(name, CompiledKernel)]."""
    q, k = GB.stand_ins(D, T, 4, 4 if mha else 2, False)
    acc = torch.empty(1, 4, T, D)
    lse = torch.empty(1, 4, T)
    out = []
    for name, (kern, _, args, consts) in zip(("A", "B"), _launches(q, k, k, q, k, k, acc, lse, lse, 0.125, causal,
                                                                   VARIANTS[variant])):
        out.append((name, GB._compile(kern, args, dict(consts, GROUP=1) if mha else consts)))
    return out


def _parts_row(D: int, T: int, r: int, name: str, ins, cud) -> None:
    """One --parts line: pass A alone, pass B alone, both, the split and cuDNN (``cud``), GPU time in ms."""
    from bench._gpu import gpu_time

    ta = gpu_time(lambda: six_bwd(*ins, variant=name, parts="a"))["ms"]
    tb = gpu_time(lambda: six_bwd(*ins, variant=name, parts="b"))["ms"]
    tab = gpu_time(lambda: six_bwd(*ins, variant=name))["ms"]
    tsp = gpu_time(lambda: GB.flash_attention_bwd_gluon(*ins, causal=True))["ms"]
    tc = gpu_time(cud)["ms"]
    print(f"D={D} T={T:5d} r{r} {name:10s} A {ta:.3f} B {tb:.3f} six {tab:.3f} split {tsp:.3f} cuDNN {tc:.3f}  "
          f"cuDNN/six {tc / tab:.3f} cuDNN/split {tc / tsp:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="128")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--parts", action="store_true", help="time pass A alone, pass B alone, both, the library's split "
                    "and cuDNN's backward, ms (bench/_gpu.py)")
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    variants = args.variants.split(",")
    dims = [int(x) for x in args.head_dims.split(",")]
    if args.compile_only:
        from bench.gluon_flash_bwd_onepass import ptxas_report

        for name in variants:
            for D in dims:
                for causal in (True, False):
                    for part, ck in compile_sm90(name, causal, D):
                        print(f"{name:10s} pass {part} D={D} causal={causal!s:5s} smem {ck.metadata.shared} "
                              f"{ptxas_report(ck)}", flush=True)
        return
    from bench import isolated

    if not args.no_check:
        for name in [v for v in variants if v in CORRECT]:
            err = isolated.bwd_worst_error(name, dims, lambda *a, name=name: six_bwd(*a[:6], *a[6:], variant=name))
            print(f"{name}: worst rel-norm error {err:.2e} {'PASS' if err < 1e-2 else 'FAIL'}", flush=True)
            if not err < 1e-2:
                sys.exit(1)
    if args.parts:
        print("ms: pass A alone, pass B alone, six (both, two streams), split (library), cuDNN", flush=True)
        for D in dims:
            for T in (int(x) for x in args.seqs.split(",")):
                q, k, v, do = isolated.bench_inputs(D, T)
                o, lse = FA.flash_attention_fwd_triton(q, k, v, causal=True)
                cud = isolated.cudnn_bwd(q, k, v, do, True)
                for r in range(args.rounds):
                    for name in variants:
                        _parts_row(D, T, r, name, (do, q, k, v, o, lse), cud)
        return
    rows = []
    for D in dims:
        for T in (int(x) for x in args.seqs.split(",")):
            for r in range(args.rounds):
                runs = [(n, lambda do, q, k, v, o, lse, dq, dk, dv, n=n: six_bwd(do, q, k, v, o, lse, dq, dk, dv,
                                                                                 variant=n)) for n in variants]
                row = isolated.bwd_bench_row(D, T, runs, warmup=5, rep=20)
                rows.append(row)
                cud = row.get("cudnn")
                print(f"D={D} T={T} round {r}: " + " ".join(
                    f"{c} {row[c]:.0f}" + (f" ({row[c] / cud:.2f})" if cud else "")
                    for c in ["cudnn", "triton", *variants] if c in row), flush=True)
    print("\nTFLOP/s (ratio to cuDNN); 'triton' = the library's default route (the split at hd128)")
    for row in rows:
        cud = row.get("cudnn")
        print(f"D={row['D']} T={row['T']:5d} " + " ".join(
            f"{c}={row[c]:.0f}" + (f"({row[c] / cud:.2f})" if cud else "")
            for c in ["cudnn", "triton", *variants] if c in row))


if __name__ == "__main__":
    main()
