"""A probe (session 25): the one-pass hd128 backward with its work split by ROLE rather than by key half.

    PYTHONPATH=. python3 bench/onepass_roles_probe.py --compile-only           # no GPU: ptxas facts (sm_90)
    PYTHONPATH=. python3 bench/onepass_roles_probe.py [--seqs 1024,...,16384]  # GPU: fp64 check, then time

Why. The split (the library's hd128 backward) runs 7 matrix products per (query, key) tile pair; a one-pass
form runs 5 (FlashAttention-3's count), but at hd128 every one-pass partition tried here so far was either
register-bound (two dK/dV warpgroups of 64 keys each, sessions 4-5: ~232 registers each, no room for a dQ
warpgroup) or ran 64-key programs whose one busy warpgroup did most of a step in series (session 9's ``k64`` and
``dvq``: 0.76-0.87x cuDNN). Session 9 guessed the 64-key forms were bound by L2 traffic (each step's Q/dO tiles
and dQ reduce-add serve half as many keys) and did not measure it. cuDNN's own hd128 backward runs 132 x 384
threads with "64x64x128" tiles (session 13's Nsight reading), i.e. probably 64-key programs too.

This probe keeps 64 keys per program and gives each warpgroup one role, so that no role's chain is long:
  * S warpgroup (the default partition): per step Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (two async wgmmas, both issued before
    either is waited on), Pᵀ = exp2(Sᵀ·scale·log2e − lse·log2e) (the causal mask applied to S as −inf BEFORE the
    exponential: session 24's ptxas lesson), Pᵀ into shared buffer b, dSᵀ = Pᵀ (dPᵀ − delta) into shared buffer b.
    It holds no accumulator across steps, so it can run NDS steps ahead of the others.
  * KV warpgroup: dV += Pᵀ dO and dK += dSᵀ Q, A operands from the shared buffers; dK·scale and dV out at the end.
  * Q warpgroup: dQ_step = dS K (A = the transposed view of the stored dSᵀ), staged in fp32 and added into an fp32
    [B·H·T, D] accumulator by one TMA reduce-add per step; a convert kernel scales and casts it (the library's
    ``dq_convert``).
  * producer warp: K and V once, then each step's Q and dO into a STAGES-deep ring.
Barriers: q_bars / do_bars (ready, per ring slot), slot_empty (count 2: S after its Sᵀ and dPᵀ retired, KV after
dV and dK retired), p_full (EARLYP: Pᵀ stored, so dV can start under the dS arithmetic), ds_full (dSᵀ stored),
buf_empty (count 2: KV and Q have retired the products that read buffer b).

Probe switches (constexprs): NORED skips the TMA reduce-add (dQ is still computed and staged): what the L2 side
of dQ costs. NODQ skips the dQ product as well (the 4-product floor of this partition). Neither is correct; they
are timed only.

Not in the library: measured and recorded in bench/RESULTS.md (session 25). Its oracle is the library's plain-torch
reference ``flash_attention_bwd_ref``, against which the GPU run checks it first (``isolated.bwd_worst_error``).
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
from xtrain.kernels.flash_attention_gluon import HAVE_GLUON, LOG2E, _desc, _row_view  # noqa: E402

KH = 64  # keys per program
BLOCK_M = 64  # queries per step
# name -> (STAGES, NDS, SLOTS, KV_REGS, Q_REGS, EARLYP, NORED, NODQ[, KREG[, DQATOM]]); the S warpgroup gets
# 512 - 24 - KV - Q. KREG: K and V loaded once into the S warpgroup's registers (register A operands of Sᵀ, dPᵀ:
# each of those wgmmas then reads only its B tile from shared memory). DQATOM: dQ added from registers by
# per-element fp32 atomics (relaxed), no staging tile, no TMA reduce-add (SLOTS unused).
VARIANTS = {
    "roles": (3, 2, 1, 192, 120, True, False, False),
    "kreg": (3, 2, 1, 184, 120, True, False, False, True),
    "kreg_s2": (3, 2, 2, 184, 120, True, False, False, True),
    "kreg_atom": (3, 2, 1, 184, 120, True, False, False, True, True),
    "atom": (3, 2, 1, 192, 120, True, False, False, False, True),
    "kreg_red2": (3, 2, 1, 184, 120, True, False, False, True, 2),
    "spipe": (3, 2, 2, 160, 120, True, False, False, True, 0, True),  # S software-pipelined (S gets 208)
    "spipe_kv168": (3, 2, 2, 168, 120, True, False, False, True, 0, True),
    "spipe_nds3": (2, 3, 2, 160, 120, True, False, False, True, 0, True),  # S up to three steps ahead
    "spipe_nodq": (3, 2, 2, 160, 120, True, True, True, True, 0, True),  # PROBE
    "kvlag": (3, 2, 2, 184, 120, True, False, False, True, 0, False, True),  # KV's products retire a step late
    "kvlag_nds3": (2, 3, 2, 184, 120, True, False, False, True, 0, False, True),
    "split4": (3, 2, 2, 184, 120, True, False, False, True, 0, False, False, True),  # dQ staged as 4 [64, 32]
    "split4_kvlag": (3, 2, 2, 184, 120, True, False, False, True, 0, False, True, True),
    "pf": (3, 2, 2, 184, 120, True, False, False, True, 0, False, False, False, True),  # kreg_s2 + lse/delta prefetch
    "pf_kv168": (3, 2, 2, 168, 120, True, False, False, True, 0, False, False, False, True),
    "pf_s216": (3, 2, 2, 160, 112, True, False, False, True, 0, False, False, False, True),
    "pf_kvlag": (3, 2, 2, 168, 120, True, False, False, True, 0, False, True, False, True),
    "pf_nodq": (3, 2, 2, 184, 120, True, True, True, True, 0, False, False, False, True),  # PROBE
    "kreg_nored": (3, 2, 1, 184, 120, True, True, False, True),  # PROBE
    "kreg_nodq": (3, 2, 1, 184, 120, True, True, True, True),  # PROBE
    "roles_late": (3, 2, 1, 192, 120, False, False, False),  # dV waits for dSᵀ too (one barrier less in S)
    "roles_s2": (3, 2, 2, 192, 120, True, False, False),  # two dQ staging tiles
    "roles_nds3": (3, 3, 1, 192, 120, True, False, False),  # S may run three steps ahead
    "roles_nored": (3, 2, 1, 192, 120, True, True, False),  # PROBE: no reduce-add (wrong dq)
    "roles_nodq": (3, 2, 1, 192, 120, True, True, True),  # PROBE: no dQ product (wrong dq)
}
CORRECT = [n for n, c in VARIANTS.items() if not (c[6] or c[7])]

if HAVE_GLUON:
    from xtrain.kernels.flash_attention_gluon import (
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
    from xtrain.kernels.flash_attention_gluon_bwd import _acc_layout, _tail_order
    from xtrain.kernels.flash_attention_gluon_onepass import _tma_reduce_add

    # fp32 reduction of a column pair into global memory; $1 is the second element's address (unused: the pair
    # is contiguous), the results are dummies
    RED_V2 = gl.constexpr("red.global.add.v2.f32 [$2], {$4, $5};\n\tmov.b32 $0, 0;\n\tmov.b32 $1, 0;")

    @gluon.jit
    def _producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_bars, do_bars,
                  slot_empty, k_row, k_col, v_row, v_col, q_base, q_rh, q_ch, do_base, do_rh, do_ch, h0, mt0, n_m,
                  n_iter, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
        _tma_load(k_desc, [k_row, k_col], kv_bar, k_smem)
        _tma_load(v_desc, [v_row, v_col], kv_bar, v_smem)
        for it in range(n_iter):
            h = h0 + it // n_m
            start_m = (mt0 + it % n_m) * BLOCK_M
            slot = it % STAGES
            mbarrier.wait(slot_empty.index(slot), ((it // STAGES) & 1) ^ 1)  # fresh barriers: the first lap passes
            mbarrier.expect(q_bars.index(slot), q_desc.block_type.nbytes)
            _tma_load(q_desc, [q_base + h * q_rh + start_m, h * q_ch], q_bars.index(slot), q_smem.index(slot))
            mbarrier.expect(do_bars.index(slot), do_desc.block_type.nbytes)
            _tma_load(do_desc, [do_base + h * do_rh + start_m, h * do_ch], do_bars.index(slot), do_smem.index(slot))

    @gluon.jit
    def _s_role(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_bars, do_bars, slot_empty, p_full,
                ds_full, buf_empty, lse_ptr, delta_ptr, lse_row0, T, mt0, n_m, n_iter, start_n, qk_scale,
                dtype: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, NDS: gl.constexpr,
                CAUSAL: gl.constexpr, EARLYP: gl.constexpr, KREG: gl.constexpr, PF: gl.constexpr):
        """PF: step it + 1's lse and delta are loaded at the top of step it (their latency hidden by its work)."""
        KH: gl.constexpr = k_smem.shape[0]
        s_layout: gl.constexpr = _acc_layout(BLOCK_M)
        cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        offs_k = start_n + gl.arange(0, KH, layout=gl.SliceLayout(1, s_layout))
        s_zero = gl.zeros([KH, BLOCK_M], gl.float32, s_layout)
        mbarrier.wait(kv_bar, 0)
        if KREG:
            op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
            k_a = k_smem.load(op_layout)
            v_a = v_smem.load(op_layout)
        else:
            k_a = k_smem
            v_a = v_smem
        lse2 = gl.load(lse_ptr + lse_row0 + mt0 * BLOCK_M + cols)
        delta = gl.load(delta_ptr + lse_row0 + mt0 * BLOCK_M + cols)
        for it in range(n_iter):
            start_m = (mt0 + it % n_m) * BLOCK_M
            if PF:
                nxt = gl.minimum(it + 1, n_iter - 1)
                row_n = lse_row0 + (nxt // n_m) * T + (mt0 + nxt % n_m) * BLOCK_M
                lse2_n = gl.load(lse_ptr + row_n + cols)
                delta_n = gl.load(delta_ptr + row_n + cols)
            else:
                row = lse_row0 + (it // n_m) * T + start_m
                lse2 = gl.load(lse_ptr + row + cols)  # lse·log2(e) (the prologue's base2 buffer)
                delta = gl.load(delta_ptr + row + cols)
            slot = it % STAGES
            phase = (it // STAGES) & 1
            mbarrier.wait(q_bars.index(slot), phase)
            st = warpgroup_mma(k_a, q_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(do_bars.index(slot), phase)
            dpt = warpgroup_mma(v_a, do_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            st = warpgroup_mma_wait(1, deps=(st, ))  # retires Sᵀ; dPᵀ may still run
            if CAUSAL:
                if start_m < start_n + KH:  # the diagonal step: mask S before the exponential
                    keep = gl.expand_dims(start_m + cols, 0) >= gl.expand_dims(offs_k, 1)
                    st = gl.where(keep, st, float("-inf"))
            pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
            b = it % NDS
            mbarrier.wait(buf_empty.index(b), ((it // NDS) & 1) ^ 1)  # fresh barriers: the first lap passes
            p_smem.index(b).store(pt.to(dtype))
            if EARLYP:
                fence_async_shared()
                _cta_barrier()  # every thread's Pᵀ store is fenced before the one arrival
                mbarrier.arrive(p_full.index(b), count=1)
            dpt = warpgroup_mma_wait(0, deps=(dpt, ))
            mbarrier.arrive(slot_empty.index(slot), count=1)  # this warpgroup's reads of Q and dO retired
            ds_smem.index(b).store((pt * (dpt - gl.expand_dims(delta, 0))).to(dtype))
            fence_async_shared()
            _cta_barrier()
            mbarrier.arrive(ds_full.index(b), count=1)
            if PF:
                lse2 = lse2_n
                delta = delta_n

    @gluon.jit
    def _s_p_out(st, start_m, lse2, p_smem, p_full, buf_empty, b, lap, offs_k, cols, start_n, qk_scale,
                 KH: gl.constexpr, CAUSAL: gl.constexpr, dtype: gl.constexpr):
        """Pᵀ of a step from its retired Sᵀ (masked before the exponential on the diagonal step) into buffer b,
        fenced, and announced on p_full[b]. Returns Pᵀ in fp32."""
        if CAUSAL:
            if start_m < start_n + KH:
                keep = gl.expand_dims(start_m + cols, 0) >= gl.expand_dims(offs_k, 1)
                st = gl.where(keep, st, float("-inf"))
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
        mbarrier.wait(buf_empty.index(b), (lap & 1) ^ 1)  # fresh barriers: the first lap passes
        p_smem.index(b).store(pt.to(dtype))
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(p_full.index(b), count=1)
        return pt

    @gluon.jit
    def _s_ds_out(pt, dpt, delta, ds_smem, ds_full, b, dtype: gl.constexpr):
        """dSᵀ = Pᵀ (dPᵀ − delta) into buffer b, fenced, announced on ds_full[b]."""
        ds_smem.index(b).store((pt * (dpt - gl.expand_dims(delta, 0))).to(dtype))
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(ds_full.index(b), count=1)

    @gluon.jit
    def _s_role_pipe(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_bars, do_bars, slot_empty, p_full,
                     ds_full, buf_empty, lse_ptr, delta_ptr, lse_row0, T, mt0, n_m, n_iter, start_n, qk_scale,
                     dtype: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, NDS: gl.constexpr,
                     CAUSAL: gl.constexpr):
        """The S warpgroup, software-pipelined (SPIPE, with KREG and EARLYP): step it's Sᵀ is issued before step
        it − 1's dSᵀ is computed and stored, so that product runs under that arithmetic; then dPᵀ, and step it's
        exponentials run under dPᵀ."""
        KH: gl.constexpr = k_smem.shape[0]
        s_layout: gl.constexpr = _acc_layout(BLOCK_M)
        cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        offs_k = start_n + gl.arange(0, KH, layout=gl.SliceLayout(1, s_layout))
        s_zero = gl.zeros([KH, BLOCK_M], gl.float32, s_layout)
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        mbarrier.wait(kv_bar, 0)
        k_a = k_smem.load(op_layout)
        v_a = v_smem.load(op_layout)
        # step 0
        start_m = mt0 * BLOCK_M
        lse2 = gl.load(lse_ptr + lse_row0 + start_m + cols)
        delta = gl.load(delta_ptr + lse_row0 + start_m + cols)
        mbarrier.wait(q_bars.index(0), 0)
        st = warpgroup_mma(k_a, q_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_bars.index(0), 0)
        dpt = warpgroup_mma(v_a, do_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=(st, ))
        pt = _s_p_out(st, start_m, lse2, p_smem, p_full, buf_empty, 0, 0, offs_k, cols, start_n, qk_scale, KH, CAUSAL,
                      dtype)
        dpt = warpgroup_mma_wait(0, deps=(dpt, ))
        mbarrier.arrive(slot_empty.index(0), count=1)
        for it in range(1, n_iter):
            start_m = (mt0 + it % n_m) * BLOCK_M
            row = lse_row0 + (it // n_m) * T + start_m
            lse2 = gl.load(lse_ptr + row + cols)
            delta_n = gl.load(delta_ptr + row + cols)
            slot = it % STAGES
            phase = (it // STAGES) & 1
            mbarrier.wait(q_bars.index(slot), phase)
            st = warpgroup_mma(k_a, q_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            _s_ds_out(pt, dpt, delta, ds_smem, ds_full, (it - 1) % NDS, dtype)  # step it - 1's, under Sᵀ
            mbarrier.wait(do_bars.index(slot), phase)
            dpt = warpgroup_mma(v_a, do_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            st = warpgroup_mma_wait(1, deps=(st, ))
            pt = _s_p_out(st, start_m, lse2, p_smem, p_full, buf_empty, it % NDS, it // NDS, offs_k, cols, start_n,
                          qk_scale, KH, CAUSAL, dtype)
            dpt = warpgroup_mma_wait(0, deps=(dpt, ))
            mbarrier.arrive(slot_empty.index(slot), count=1)
            delta = delta_n
        _s_ds_out(pt, dpt, delta, ds_smem, ds_full, (n_iter - 1) % NDS, dtype)

    @gluon.jit
    def _kv_role(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, q_bars, do_bars, slot_empty, p_full, ds_full,
                 buf_empty, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col, n_iter, sm_scale, dtype: gl.constexpr,
                 HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, NDS: gl.constexpr, EARLYP: gl.constexpr,
                 KVLAG: gl.constexpr):
        """KVLAG: step it's dV and dK stay in flight while step it + 1's are issued; a step's buffers are released
        once its products retire, one step later."""
        KH: gl.constexpr = dk_desc.block_type.shape[0]
        a_layout: gl.constexpr = _acc_layout(HEAD_DIM)
        dk = gl.zeros([KH, HEAD_DIM], gl.float32, a_layout)
        dv = gl.zeros([KH, HEAD_DIM], gl.float32, a_layout)
        for it in range(n_iter):
            slot = it % STAGES
            phase = (it // STAGES) & 1
            b = it % NDS
            bph = (it // NDS) & 1
            if EARLYP:
                mbarrier.wait(p_full.index(b), bph)
            else:
                mbarrier.wait(ds_full.index(b), bph)
            mbarrier.wait(do_bars.index(slot), phase)  # complete already; makes the dO tile visible here
            dv = warpgroup_mma(p_smem.index(b), do_smem.index(slot), dv, is_async=True)
            if EARLYP:
                mbarrier.wait(ds_full.index(b), bph)
            mbarrier.wait(q_bars.index(slot), phase)
            dk = warpgroup_mma(ds_smem.index(b), q_smem.index(slot), dk, is_async=True)
            if KVLAG:
                dv, dk = warpgroup_mma_wait(2, deps=(dv, dk))  # retires step it - 1's pair
                if it > 0:
                    mbarrier.arrive(buf_empty.index((it - 1) % NDS), count=1)
                    mbarrier.arrive(slot_empty.index((it - 1) % STAGES), count=1)
            else:
                dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
                mbarrier.arrive(buf_empty.index(b), count=1)
                mbarrier.arrive(slot_empty.index(slot), count=1)
        if KVLAG:
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
            mbarrier.arrive(buf_empty.index((n_iter - 1) % NDS), count=1)
            mbarrier.arrive(slot_empty.index((n_iter - 1) % STAGES), count=1)
        # K and V are dead once the S warpgroup's last Sᵀ, dPᵀ retired (before its last ds_full arrival, waited
        # above) and the Q warpgroup's last dQ retired (its arrival on the last step's buf_empty)
        last = n_iter - 1
        mbarrier.wait(buf_empty.index(last % NDS), (last // NDS) & 1)
        k_smem.store((dk * sm_scale).to(dtype))
        v_smem.store(dv.to(dtype))
        fence_async_shared()
        _cta_barrier()
        _tma_store(dk_desc, [dk_row, dk_col], k_smem)
        _tma_store(dv_desc, [dv_row, dv_col], v_smem)
        tma.store_wait(0)

    @gluon.jit
    def _col_halves(x):
        """The left and right column halves of a [R, N] register tensor (no data movement: each thread's
        accumulator registers already fall into the two halves)."""
        R: gl.constexpr = x.shape[0]
        N: gl.constexpr = x.shape[1]
        return gl.split(gl.permute(gl.reshape(x, [R, 2, N // 2]), (0, 2, 1)))

    @gluon.jit
    def _dq_stage4(dq, dq_smem, dq_desc, row, it, SLOTS: gl.constexpr):
        """DQSPLIT: dQ_step [64, 128] staged as four [64, 32] fp32 tiles (rows of one 128-byte swizzle span, so
        the accumulator's 8-byte stores meet no bank conflicts), four TMA reduce-adds of [64, 32] boxes."""
        s = it % SLOTS
        tma.store_wait(4 * SLOTS - 4)  # the four reduce-adds that last read these staging tiles are done
        _cta_barrier()
        lo, hi = _col_halves(dq)
        c0, c1 = _col_halves(lo)
        c2, c3 = _col_halves(hi)
        dq_smem.index(4 * s).store(c0)
        dq_smem.index(4 * s + 1).store(c1)
        dq_smem.index(4 * s + 2).store(c2)
        dq_smem.index(4 * s + 3).store(c3)
        fence_async_shared()
        _cta_barrier()
        W: gl.constexpr = dq_desc.block_type.shape[1]
        _tma_reduce_add(dq_desc, [row, 0], dq_smem.index(4 * s))
        _tma_reduce_add(dq_desc, [row, W], dq_smem.index(4 * s + 1))
        _tma_reduce_add(dq_desc, [row, 2 * W], dq_smem.index(4 * s + 2))
        _tma_reduce_add(dq_desc, [row, 3 * W], dq_smem.index(4 * s + 3))

    @gluon.jit
    def _dq_stage(dq, dq_smem, dq_desc, row, it, SLOTS: gl.constexpr, NORED: gl.constexpr):
        """dQ_step into staging tile it % SLOTS, then one TMA reduce-add of it (NORED: not issued)."""
        s = it % SLOTS
        if not NORED:
            tma.store_wait(SLOTS - 1)  # the reduce-add that last read this staging tile is done
        _cta_barrier()
        dq_smem.index(s).store(dq)
        fence_async_shared()
        _cta_barrier()
        if not NORED:
            _tma_reduce_add(dq_desc, [row, 0], dq_smem.index(s))

    @gluon.jit
    def _q_role(k_smem, ds_smem, dq_smem, kv_bar, ds_full, buf_empty, dq_desc, dq_ptr, dq_row0, T, mt0, n_m, n_iter,
                BLOCK_M: gl.constexpr, NDS: gl.constexpr, SLOTS: gl.constexpr, NORED: gl.constexpr,
                NODQ: gl.constexpr, DQATOM: gl.constexpr, DQSPLIT: gl.constexpr):
        D: gl.constexpr = k_smem.shape[1]
        a_layout: gl.constexpr = _acc_layout(D)
        dq_zero = gl.zeros([BLOCK_M, D], gl.float32, a_layout)
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, a_layout))
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, a_layout))
        tile_offs = gl.expand_dims(offs_m, 1) * D + gl.expand_dims(offs_d, 0)
        mbarrier.wait(kv_bar, 0)
        for it in range(n_iter):
            b = it % NDS
            mbarrier.wait(ds_full.index(b), (it // NDS) & 1)
            if NODQ:
                mbarrier.arrive(buf_empty.index(b), count=1)
            else:
                dq = warpgroup_mma(ds_smem.index(b).permute((1, 0)), k_smem, dq_zero, use_acc=False, is_async=True)
                dq = warpgroup_mma_wait(0, deps=(dq, ))
                mbarrier.arrive(buf_empty.index(b), count=1)
                row = dq_row0 + (it // n_m) * T + (mt0 + it % n_m) * BLOCK_M
                if DQATOM == 2:  # two adjacent columns per instruction (each thread holds column pairs)
                    gl.inline_asm_elementwise(RED_V2, "=r,=r,l,l,f,f", [(dq_ptr + row.to(gl.int64) * D + tile_offs).to(gl.int64), dq],
                                              dtype=gl.int32, is_pure=False, pack=2)
                elif DQATOM:
                    gl.atomic_add(dq_ptr + row.to(gl.int64) * D + tile_offs, dq, sem="relaxed")
                elif DQSPLIT:
                    _dq_stage4(dq, dq_smem, dq_desc, row, it, SLOTS)
                else:
                    _dq_stage(dq, dq_smem, dq_desc, row, it, SLOTS, NORED)
        tma.store_wait(0)

    @gluon.jit
    def _roles_kernel(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, dq_desc, dq_ptr, lse_ptr, delta_ptr, qk_scale,
                      sm_scale, H, GROUP, T, TAIL, q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, k_rb, k_rh, k_ch, v_rb,
                      v_rh, v_ch, dk_rb, dk_rh, dk_ch, dv_rb, dv_rh, dv_ch, HEAD_DIM: gl.constexpr,
                      BLOCK_M: gl.constexpr, STAGES: gl.constexpr, NDS: gl.constexpr, SLOTS: gl.constexpr,
                      CAUSAL: gl.constexpr, EARLYP: gl.constexpr, NORED: gl.constexpr, NODQ: gl.constexpr,
                      KV_REGS: gl.constexpr, Q_REGS: gl.constexpr, KREG: gl.constexpr, DQATOM: gl.constexpr,
                      SPIPE: gl.constexpr, KVLAG: gl.constexpr, DQSPLIT: gl.constexpr, PF: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        KH: gl.constexpr = k_desc.block_type.shape[0]
        pid_n, off_bkv = _tail_order(gl.program_id(0), T // KH, TAIL)  # key tile 0 (heaviest when causal) first
        Hkv = H // GROUP
        off_b = off_bkv // Hkv
        off_kvh = off_bkv % Hkv
        start_n = pid_n * KH
        h0 = off_kvh * GROUP
        lse_row0 = (off_b * H + h0).to(gl.int64) * T
        dq_row0 = (off_b * H + h0) * T
        if CAUSAL:
            mt0 = start_n // BLOCK_M
        else:
            mt0 = 0
        n_m = T // BLOCK_M - mt0
        n_iter = GROUP * n_m

        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [KH, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [KH, HEAD_DIM], v_desc.layout)
        t_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KH, BLOCK_M], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [NDS, KH, BLOCK_M], t_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [NDS, KH, BLOCK_M], t_layout)
        if DQSPLIT:
            gl.static_assert(dq_desc.block_type.shape[1] * 4 == HEAD_DIM)
            dq_smem = gl.allocate_shared_memory(gl.float32, [4 * SLOTS, BLOCK_M, HEAD_DIM // 4], dq_desc.layout)
        else:
            dq_smem = gl.allocate_shared_memory(gl.float32, [SLOTS, BLOCK_M, HEAD_DIM], dq_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        slot_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        p_full = gl.allocate_shared_memory(gl.int64, [NDS, 1], mbarrier.MBarrierLayout())
        ds_full = gl.allocate_shared_memory(gl.int64, [NDS, 1], mbarrier.MBarrierLayout())
        buf_empty = gl.allocate_shared_memory(gl.int64, [NDS, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_bars.index(i), count=1)
            mbarrier.init(do_bars.index(i), count=1)
            mbarrier.init(slot_empty.index(i), count=2)  # the S and KV warpgroups
        for i in gl.static_range(NDS):
            mbarrier.init(p_full.index(i), count=1)
            mbarrier.init(ds_full.index(i), count=1)
            mbarrier.init(buf_empty.index(i), count=2)  # the KV and Q warpgroups
        fence_async_shared()

        k_row = off_b * k_rb + off_kvh * k_rh + start_n
        v_row = off_b * v_rb + off_kvh * v_rh + start_n
        dk_row = off_b * dk_rb + off_kvh * dk_rh + start_n
        dv_row = off_b * dv_rb + off_kvh * dv_rh + start_n
        if SPIPE:
            gl.static_assert(KREG and EARLYP)
            gl.warp_specialize([
                (_s_role_pipe, (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_bars, do_bars, slot_empty, p_full,
                           ds_full, buf_empty, lse_ptr, delta_ptr, lse_row0, T, mt0, n_m, n_iter, start_n, qk_scale,
                           dtype, BLOCK_M, STAGES, NDS, CAUSAL)),
                (_kv_role, (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, q_bars, do_bars, slot_empty, p_full,
                            ds_full, buf_empty, dk_desc, dv_desc, dk_row, off_kvh * dk_ch, dv_row, off_kvh * dv_ch,
                            n_iter, sm_scale, dtype, HEAD_DIM, STAGES, NDS, EARLYP, KVLAG)),
                (_q_role, (k_smem, ds_smem, dq_smem, kv_bar, ds_full, buf_empty, dq_desc, dq_ptr, dq_row0, T, mt0, n_m,
                           n_iter, BLOCK_M, NDS, SLOTS, NORED, NODQ, DQATOM, DQSPLIT)),
                (_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_bars, do_bars,
                             slot_empty, k_row, off_kvh * k_ch, v_row, off_kvh * v_ch, off_b * q_rb, q_rh, q_ch,
                             off_b * do_rb, do_rh, do_ch, h0, mt0, n_m, n_iter, BLOCK_M, STAGES)),
            ], [4, 4, 1], [KV_REGS, Q_REGS, _PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_s_role, (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_bars, do_bars, slot_empty, p_full,
                           ds_full, buf_empty, lse_ptr, delta_ptr, lse_row0, T, mt0, n_m, n_iter, start_n, qk_scale,
                           dtype, BLOCK_M, STAGES, NDS, CAUSAL, EARLYP, KREG, PF)),
                (_kv_role, (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, q_bars, do_bars, slot_empty, p_full,
                            ds_full, buf_empty, dk_desc, dv_desc, dk_row, off_kvh * dk_ch, dv_row, off_kvh * dv_ch,
                            n_iter, sm_scale, dtype, HEAD_DIM, STAGES, NDS, EARLYP, KVLAG)),
                (_q_role, (k_smem, ds_smem, dq_smem, kv_bar, ds_full, buf_empty, dq_desc, dq_ptr, dq_row0, T, mt0, n_m,
                           n_iter, BLOCK_M, NDS, SLOTS, NORED, NODQ, DQATOM, DQSPLIT)),
                (_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, q_bars, do_bars,
                             slot_empty, k_row, off_kvh * k_ch, v_row, off_kvh * v_ch, off_b * q_rb, q_rh, q_ch,
                             off_b * do_rb, do_rh, do_ch, h0, mt0, n_m, n_iter, BLOCK_M, STAGES)),
            ], [4, 4, 1], [KV_REGS, Q_REGS, _PRODUCER_REGS])


def _launch(q, k, v, do, dk, dv, dq_acc, lse2, delta, s: float, causal: bool, cfg):
    """(kernel, grid, args, constexprs); CUDA tensors or CPU stand-ins."""
    stages, nds, slots, kv_regs, q_regs, earlyp, nored, nodq, *rest = cfg
    kreg, dqatom, spipe, kvlag, dqsplit, pf = (list(rest) + [False, 0, False, False, False, False])[:6]
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    views = {n: _row_view(x) for n, x in (("q", q), ("do", do), ("k", k), ("v", v), ("dk", dk), ("dv", dv))}
    args = dict(dq_ptr=dq_acc, lse_ptr=lse2, delta_ptr=delta, qk_scale=s * LOG2E, sm_scale=s, H=H, GROUP=H // Hkv, T=T)
    for n, (_, rb, rh, ch) in views.items():
        args.update({f"{n}_rb": rb, f"{n}_rh": rh, f"{n}_ch": ch})
    args.update(q_desc=_desc(views["q"][0], BLOCK_M, D), do_desc=_desc(views["do"][0], BLOCK_M, D),
                k_desc=_desc(views["k"][0], KH, D), v_desc=_desc(views["v"][0], KH, D),
                dk_desc=_desc(views["dk"][0], KH, D), dv_desc=_desc(views["dv"][0], KH, D),
                dq_desc=_desc(dq_acc.view(B * H * T, D), BLOCK_M, D // 4 if dqsplit else D))
    nb = T // KH
    args["TAIL"] = GB.tail_heads(nb, B * Hkv, FA.grid_sms(q.device))
    consts = dict(HEAD_DIM=D, BLOCK_M=BLOCK_M, STAGES=stages, NDS=nds, SLOTS=slots, CAUSAL=bool(causal),
                  EARLYP=bool(earlyp), NORED=bool(nored), NODQ=bool(nodq), KV_REGS=kv_regs, Q_REGS=q_regs,
                  KREG=bool(kreg), DQATOM=int(dqatom), SPIPE=bool(spipe), KVLAG=bool(kvlag), DQSPLIT=bool(dqsplit), PF=bool(pf))
    return _roles_kernel, (nb * B * Hkv,), args, consts


def roles_bwd(do, q, k, v, o, lse, dq=None, dk=None, dv=None, causal: bool = True, variant: str = "roles"):
    """The probe's backward: delta preprocess (lse·log2e beside it), the roles kernel, the dQ convert."""
    op = "roles_bwd"
    do, lse2, dq, dk, dv, delta, s, _ = GB._prologue(op, GB.supported_bwd, GB.HEAD_DIMS, do, q, k, v, o, lse, None,
                                                     dq, dk, dv, base2=True)
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kern, grid, args, consts = _launch(q, k, v, do, dk, dv, acc, lse2, delta, s, causal, VARIANTS[variant])
    kern[grid](**args, **consts, num_warps=4)
    OP.dq_convert(acc, dq, s)
    return dq, dk, dv


def compile_sm90(variant: str, causal: bool = True, D: int = 128, T: int = 256, mha: bool = True):
    q, k = GB.stand_ins(D, T, 4, 4 if mha else 2, False)
    acc = torch.empty(1, 4, T, D)
    lse = torch.empty(1, 4, T)
    kern, _, args, consts = _launch(q, k, k, q, k, k, acc, lse, lse, 0.125, causal, VARIANTS[variant])
    return GB._compile(kern, args, dict(consts, GROUP=1) if mha else consts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="128")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--ncu", type=int, default=0, metavar="T",
                    help="launch each variant once at this T inside cudaProfilerStart/Stop (run under ncu "
                         "--profile-from-start off -k regex:_roles_kernel); nothing is timed")
    args = ap.parse_args()
    variants = args.variants.split(",")
    dims = [int(x) for x in args.head_dims.split(",")]
    if args.compile_only:
        from bench.gluon_flash_bwd_onepass import ptxas_report

        for name in variants:
            for D in dims:
                for causal in (True, False):
                    ck = compile_sm90(name, causal, D)
                    print(f"{name:12s} D={D} causal={causal!s:5s} smem {ck.metadata.shared} {ptxas_report(ck)}",
                          flush=True)
        return
    from bench import isolated

    if args.ncu:
        q, k, v, do = isolated.bench_inputs(dims[0], args.ncu)
        o, lse = FA.flash_attention_fwd_triton(q, k, v, True)
        for name in variants:  # compile outside the profiled range
            roles_bwd(do, q, k, v, o, lse, variant=name)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for name in variants:
            roles_bwd(do, q, k, v, o, lse, variant=name)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    for name in [v for v in variants if v in CORRECT]:
        err = isolated.bwd_worst_error(name, dims, lambda *a, name=name: roles_bwd(*a[:6], *a[6:], variant=name))
        print(f"{name}: worst rel-norm error {err:.2e} {'PASS' if err < 1e-2 else 'FAIL'}", flush=True)
        if not err < 1e-2:
            sys.exit(1)
    rows = []
    for D in dims:
        for T in (int(x) for x in args.seqs.split(",")):
            for r in range(args.rounds):
                runs = [(n, lambda do, q, k, v, o, lse, dq, dk, dv, n=n: roles_bwd(do, q, k, v, o, lse, dq, dk, dv,
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
