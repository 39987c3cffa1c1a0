"""Experiment: a one-pass (5-product) hd128 flash-attention backward whose registers fit, by splitting the head dim.

    PYTHONPATH=. python3 bench/gluon_bwd_dsplit.py --compile-only          # offline sm_90 build, SASS report
    PYTHONPATH=. python3 bench/gluon_bwd_dsplit.py --check                 # GPU: against fp64 and the split
    PYTHONPATH=. python3 bench/gluon_bwd_dsplit.py --seqs 4096,8192,16384  # GPU: time against split and cuDNN

Why (bench/RESULTS.md, session 14): at T = 8k-16k the H200 runs the hd128 backward at its 700 W cap, so time
follows energy. The library's two-kernel split spends about a bf16 matmul's energy per FLOP but executes 7
products per tile pair where cuDNN's count is 5. Every 5-product form tried at hd128 so far lost: the two dK/dV
warpgroups need ~232 registers each (dK + dV of 64 keys at D = 128: 128 fp32 registers per thread), which leaves
no room for a dQ warpgroup beside them.

This form divides the work differently. One program = 128 keys of one (batch, kv head); its steps walk the
64-query tiles of the group's heads (causal: at or below the diagonal), as the split's dK/dV kernel does:
  * softmax warpgroup (the default partition): per step and per 64-key half kh, Sᵀ_kh = K_kh Qᵀ and
    dPᵀ_kh = V_kh dOᵀ (async wgmmas over the whole head dim), Pᵀ = exp2(Sᵀ·scale − lse·log2e) (causal mask on
    the diagonal), dSᵀ = Pᵀ ∘ (dPᵀ − delta); Pᵀ and dSᵀ rounded to 16 bits and stored into buffer b = step % NB
    ([kh] halves of [64 keys, 64 queries]), one arrival on p_full[b]. No dK/dV/dQ accumulator.
  * two product warpgroups, one per half dh of the head dim (64 columns each): per step, wait p_full[b], then
    dV[kh][:, dh] += Pᵀ_kh dO[:, dh], dK[kh][:, dh] += dSᵀ_kh Q[:, dh] (both operands from shared memory) and
    dQ_step[:, dh] = Σ_kh dS_kh K_kh[:, dh] (A = the transposed view of the stored dSᵀ halves); arrive p_empty[b]
    once they retired; dQ_step goes to a staging tile and one fp32 TMA reduce-add of [64, 64] into the dQ
    accumulator. dK and dV of 128 keys x 64 columns: 128 accumulator registers, + 32 for dQ_step (192 in all,
    below).
  * producer warp: K and V once, each step's Q and dO tiles and lse·log2e / delta rows (the split's producer
    with OPT_LEAN | OPT_SMEM); a Q/dO slot is free once the three consumers arrived on its "empty" barrier.
Tensor work per step: softmax warpgroup 4 units (Sᵀ and dPᵀ of two key halves), each product warpgroup 3 (dV,
dK, dQ over one column half): 10 units, where the split executes 14 for the same keys and queries. The dQ
reduce-add traffic per step is FlashAttention-3's (an fp32 [64, 128] tile per 128 keys).
The idea of a softmax warpgroup feeding product warpgroups is FlashAttention-3's producer/consumer split taken
one step further; the head-dim split of the products is this experiment's.

NOT deterministic (dQ by reduce-adds, like the hd64 one-pass kernel). Checks: --check compares dq, dk, dv with the
fp64 reference (relative norm < 1e-2, the bf16 bound of the library's tests) and with the split, on NaN-poisoned
buffers, causal and not, MHA and GQA.

Registers (offline, triton 3.9): ptxas serialised every wgmma with the product warpgroups at 160-184 (also with dQ
retired before dV and dK are issued), and with them at 200 (the softmax warpgroup then at 88). At 192 / 192 / 24 the
softmax warpgroup has 104 and spills (44-47 STL causal, 16-17 not); nothing is serialised. Shared memory: 230952
B with NB = 2, 198184 B with NB = 1.

Session 14, H200 (bench/RESULTS.md): correct at the first run (dk and dv bit-identical to the split's, dq within
1.5e-4 of it, 2.3-2.4e-3 from fp64), but 0.56-0.62x cuDNN at T = 4k-16k ("ds_nb1": 2.35 / 4.35 / 8.40 ms against
the split's 1.37 / 2.68 / 5.29). The ablations at 8k (4.35 ms) put the bound in the softmax warpgroup: alone (the
product warpgroups skip their products) it takes 2.89 ms, more than the whole split. With no exponentials and no dQ
products and reduce-adds it takes 1.96 ms (1.40x cuDNN). One warpgroup does all the element work of 128 keys, with
each half's Sᵀ and dPᵀ latency in series and spills. Two softmax warpgroups would need 2 x ~104 + 2 x 192 + 24 =
616 registers per thread-slot, over the 512 there are. So the head-dim split moves the register wall rather than
removing it.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from xtrain.kernels import flash_attention as FA
from xtrain.kernels import flash_attention_gluon_bwd as GB
from xtrain.kernels import flash_attention_gluon_onepass as OP
from xtrain.kernels.flash_attention_gluon import HAVE_GLUON, LOG2E, _desc, _row_view

RESIDENT = 128
KH = 64  # keys per half
BLOCK_M = 64  # queries per step
DH = 64  # head-dim columns per product warpgroup
# name -> (STAGES, NB (Pᵀ/dSᵀ buffers), PROD_REGS (each product warpgroup's setmaxnreg))
# (with the product warpgroups at 160-184 or 200 registers, ptxas serialised every wgmma: offline, triton 3.9)
# (a fourth element: timing-only ablations, wrong results by design: 1 no dQ reduce-add (the compiler then drops
# the dQ products too), 2 no products in the product warpgroups, 4 no exponentials / mask / dS arithmetic in the
# softmax warpgroup)
CONFIGS = {
    "ds": (2, 2, 192),
    "ds_nb1": (2, 1, 192),
    "~nored": (2, 1, 192, 1),
    "~noprod": (2, 1, 192, 2),
    "~noexp": (2, 1, 192, 4),
    "~nored_noexp": (2, 1, 192, 5),
}

if HAVE_GLUON:
    from xtrain.kernels.flash_attention_gluon import (
        _PRODUCER_REGS,
        _cta_barrier,
        _tma_store,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from xtrain.kernels.flash_attention_gluon_bwd import _acc_layout, _dkdv_producer, _kv_rows, _next_query_tile

    _RESIDENT, _KH, _BLOCK_M, _DH = (gl.constexpr(x) for x in (RESIDENT, KH, BLOCK_M, DH))  # for the kernels

    @gluon.jit
    def _softmax_wg(
        q_smem,
        do_smem,
        k_smem,
        v_smem,
        lse_smem,
        delta_smem,
        p_smem,
        ds_smem,
        kv_bar,
        q_bars,
        do_bars,
        q_empty,
        p_full,
        p_empty,
        T,
        mt0,
        n_iter,
        start_n,
        qk_scale,
        dtype: gl.constexpr,
        STAGES: gl.constexpr,
        NB: gl.constexpr,
        CAUSAL: gl.constexpr,
        ABL: gl.constexpr,
    ):
        s_layout: gl.constexpr = _acc_layout(_BLOCK_M)  # [_KH keys, _BLOCK_M queries]
        s_zero = gl.zeros([_KH, _BLOCK_M], gl.float32, s_layout)
        cols = gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        start_m = mt0 * _BLOCK_M
        mbarrier.wait(kv_bar, 0)
        for it in range(n_iter):
            slot = it % STAGES
            phase = (it // STAGES) & 1
            q_t = q_smem.index(slot)
            do_t = do_smem.index(slot)
            b = it % NB
            mbarrier.wait(q_bars.index(slot), phase)
            mbarrier.wait(do_bars.index(slot), phase)
            for kh in gl.static_range(2):
                st = warpgroup_mma(k_smem.index(kh), q_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                dpt = warpgroup_mma(v_smem.index(kh), do_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                st = warpgroup_mma_wait(1, deps=(st,))
                if ABL & 4:  # timing only: no exponentials, mask or dS arithmetic
                    pt = st
                else:
                    pt = gl.exp2(st * qk_scale - lse_smem.index(slot).load(s_layout))
                if CAUSAL and not (ABL & 4):
                    k_lo = start_n + kh * _KH
                    if start_m < k_lo + _KH:
                        offs_k = k_lo + gl.arange(0, _KH, layout=gl.SliceLayout(1, s_layout))
                        keep = gl.expand_dims(start_m + cols, 0) >= gl.expand_dims(offs_k, 1)
                        pt = gl.where(keep, pt, 0.0)
                dpt = warpgroup_mma_wait(0, deps=(dpt,))
                if ABL & 4:
                    ds16 = dpt.to(dtype)
                else:
                    ds16 = (pt * (dpt - delta_smem.index(slot).load(s_layout))).to(dtype)
                if kh == 0:  # the product warpgroups have retired their reads of buffer b (NB steps ago)
                    mbarrier.wait(p_empty.index(b), ((it // NB) & 1) ^ 1)  # fresh barrier: the first lap passes
                p_smem.index(2 * b + kh).store(pt.to(dtype))
                ds_smem.index(2 * b + kh).store(ds16)
            fence_async_shared()
            _cta_barrier()  # every thread's stores are fenced before the one arrival
            mbarrier.arrive(p_full.index(b), count=1)
            mbarrier.arrive(q_empty.index(slot), count=1)  # Sᵀ and dPᵀ (this warpgroup's reads) retired
            start_m, _ = _next_query_tile(start_m, _BLOCK_M, T, mt0 * _BLOCK_M)

    @gluon.jit
    def _product_wg(
        q_smem,
        do_smem,
        k_smem,
        v_smem,
        p_smem,
        ds_smem,
        dq_smem,
        kv_bar,
        q_bars,
        do_bars,
        q_empty,
        p_full,
        p_empty,
        dq_desc,
        dk_desc,
        dv_desc,
        dq_row0,
        T,
        mt0,
        n_m,
        n_iter,
        dk_row,
        dk_col,
        dv_row,
        dv_col,
        sm_scale,
        dtype: gl.constexpr,
        STAGES: gl.constexpr,
        NB: gl.constexpr,
        DHALF: gl.constexpr,
        ABL: gl.constexpr,
    ):
        a_layout: gl.constexpr = _acc_layout(_DH)  # [64, _DH]
        zero = gl.zeros([_KH, _DH], gl.float32, a_layout)
        dv0 = zero
        dv1 = zero
        dk0 = zero
        dk1 = zero
        mbarrier.wait(kv_bar, 0)
        k0 = k_smem.index(0).slice(DHALF * _DH, _DH, dim=1)  # [_KH keys, _DH] columns of this warpgroup
        k1 = k_smem.index(1).slice(DHALF * _DH, _DH, dim=1)
        for it in range(n_iter):
            slot = it % STAGES
            phase = (it // STAGES) & 1
            b = it % NB
            q_h = q_smem.index(slot).slice(DHALF * _DH, _DH, dim=1)  # [_BLOCK_M queries, _DH]
            do_h = do_smem.index(slot).slice(DHALF * _DH, _DH, dim=1)
            mbarrier.wait(p_full.index(b), (it // NB) & 1)
            # the slot's Q and dO landed before Pᵀ was made; wait on their barriers too, so this warpgroup sees the
            # TMA writes itself (the phase cannot move on before this warpgroup releases the slot)
            mbarrier.wait(q_bars.index(slot), phase)
            mbarrier.wait(do_bars.index(slot), phase)
            p0 = p_smem.index(2 * b)
            p1 = p_smem.index(2 * b + 1)
            s0 = ds_smem.index(2 * b)
            s1 = ds_smem.index(2 * b + 1)
            if ABL & 2:  # timing only: no products
                mbarrier.arrive(p_empty.index(b), count=1)
                mbarrier.arrive(q_empty.index(slot), count=1)
            else:
                dv0 = warpgroup_mma(p0, do_h, dv0, is_async=True)
                dv1 = warpgroup_mma(p1, do_h, dv1, is_async=True)
                dk0 = warpgroup_mma(s0, q_h, dk0, is_async=True)
                dk1 = warpgroup_mma(s1, q_h, dk1, is_async=True)
                dq = warpgroup_mma(
                    s0.permute((1, 0)),
                    k0,
                    gl.zeros([_BLOCK_M, _DH], gl.float32, a_layout),
                    use_acc=False,
                    is_async=True,
                )
                dq = warpgroup_mma(s1.permute((1, 0)), k1, dq, is_async=True)
                dv0, dv1, dk0, dk1, dq = warpgroup_mma_wait(0, deps=(dv0, dv1, dk0, dk1, dq))
                mbarrier.arrive(p_empty.index(b), count=1)
                mbarrier.arrive(q_empty.index(slot), count=1)
                if not (ABL & 1):  # (ABL 1, timing only: no dQ reduce-add)
                    tma.store_wait(0)  # the last reduce-add has read the staging tile
                    _cta_barrier()
                    dq_smem.store(dq)
                    fence_async_shared()
                    _cta_barrier()
                    row = dq_row0 + (it // n_m) * T + (mt0 + it % n_m) * _BLOCK_M
                    OP._tma_reduce_add(dq_desc, [row, DHALF * _DH], dq_smem)
        tma.store_wait(0)
        # out through this warpgroup's dead K / V column halves: the softmax warpgroup's last reads of K and V
        # came before its last p_full arrival, which this warpgroup waited on; the other product warpgroup reads
        # only its own columns of K
        k0.store((dk0 * sm_scale).to(dtype))
        k1.store((dk1 * sm_scale).to(dtype))
        v_smem.index(0).slice(DHALF * _DH, _DH, dim=1).store(dv0.to(dtype))
        v_smem.index(1).slice(DHALF * _DH, _DH, dim=1).store(dv1.to(dtype))
        fence_async_shared()
        _cta_barrier()
        for kh in gl.static_range(2):
            _tma_store(
                dk_desc, [dk_row + kh * _KH, dk_col + DHALF * _DH], k_smem.index(kh).slice(DHALF * _DH, _DH, dim=1)
            )
            _tma_store(
                dv_desc, [dv_row + kh * _KH, dv_col + DHALF * _DH], v_smem.index(kh).slice(DHALF * _DH, _DH, dim=1)
            )
        tma.store_wait(0)

    @gluon.jit
    def _dsplit_kernel(
        q_desc,
        do_desc,
        k_desc,
        v_desc,
        dk_desc,
        dv_desc,
        dq_desc,
        lse_desc,
        delta_desc,
        qk_scale,
        sm_scale,
        H,
        GROUP,
        T,
        q_rb,
        q_rh,
        q_ch,
        do_rb,
        do_rh,
        do_ch,
        k_rb,
        k_rh,
        k_ch,
        v_rb,
        v_rh,
        v_ch,
        dk_rb,
        dk_rh,
        dk_ch,
        dv_rb,
        dv_rh,
        dv_ch,
        TAIL,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
        NB: gl.constexpr,
        CAUSAL: gl.constexpr,
        PROD_REGS: gl.constexpr,
        ABL: gl.constexpr = 0,
    ):
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert(HEAD_DIM == 2 * _DH)
        # the program's place, as the hd64 one-pass kernel's (key tile of 128 in the split's order)
        off_b, off_kvh, start_n, h0, _, dq_row0, mt0, n_m, n_iter = OP._program(
            H, GROUP, T, TAIL, _KH, _BLOCK_M, CAUSAL
        )

        q_smem = gl.allocate_shared_memory(dtype, [STAGES, _BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, _BLOCK_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2, _KH, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, _KH, HEAD_DIM], v_desc.layout)
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, _BLOCK_M], lse_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, _BLOCK_M], delta_desc.layout)
        pt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_KH, _BLOCK_M], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [2 * NB, _KH, _BLOCK_M], pt_layout)  # [buffer·2 + key half]
        ds_smem = gl.allocate_shared_memory(dtype, [2 * NB, _KH, _BLOCK_M], pt_layout)
        dq_smem0 = gl.allocate_shared_memory(gl.float32, [_BLOCK_M, _DH], dq_desc.layout)
        dq_smem1 = gl.allocate_shared_memory(gl.float32, [_BLOCK_M, _DH], dq_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        p_full = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        p_empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_bars.index(i), count=1)
            mbarrier.init(do_bars.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=3)  # the softmax and both product warpgroups
        for i in gl.static_range(NB):
            mbarrier.init(p_full.index(i), count=1)
            mbarrier.init(p_empty.index(i), count=2)
        fence_async_shared()

        k_row, v_row, dk_row, dv_row = _kv_rows(
            off_b, off_kvh, start_n, k_rb, k_rh, v_rb, v_rh, dk_rb, dk_rh, dv_rb, dv_rh
        )
        gl.warp_specialize(
            [
                (
                    _softmax_wg,
                    (
                        q_smem,
                        do_smem,
                        k_smem,
                        v_smem,
                        lse_smem,
                        delta_smem,
                        p_smem,
                        ds_smem,
                        kv_bar,
                        q_bars,
                        do_bars,
                        q_empty,
                        p_full,
                        p_empty,
                        T,
                        mt0,
                        n_iter,
                        start_n,
                        qk_scale,
                        dtype,
                        STAGES,
                        NB,
                        CAUSAL,
                        ABL,
                    ),
                ),
                (
                    _product_wg,
                    (
                        q_smem,
                        do_smem,
                        k_smem,
                        v_smem,
                        p_smem,
                        ds_smem,
                        dq_smem0,
                        kv_bar,
                        q_bars,
                        do_bars,
                        q_empty,
                        p_full,
                        p_empty,
                        dq_desc,
                        dk_desc,
                        dv_desc,
                        dq_row0,
                        T,
                        mt0,
                        n_m,
                        n_iter,
                        dk_row,
                        off_kvh * dk_ch,
                        dv_row,
                        off_kvh * dv_ch,
                        sm_scale,
                        dtype,
                        STAGES,
                        NB,
                        0,
                        ABL,
                    ),
                ),
                (
                    _product_wg,
                    (
                        q_smem,
                        do_smem,
                        k_smem,
                        v_smem,
                        p_smem,
                        ds_smem,
                        dq_smem1,
                        kv_bar,
                        q_bars,
                        do_bars,
                        q_empty,
                        p_full,
                        p_empty,
                        dq_desc,
                        dk_desc,
                        dv_desc,
                        dq_row0,
                        T,
                        mt0,
                        n_m,
                        n_iter,
                        dk_row,
                        off_kvh * dk_ch,
                        dv_row,
                        off_kvh * dv_ch,
                        sm_scale,
                        dtype,
                        STAGES,
                        NB,
                        1,
                        ABL,
                    ),
                ),
                (
                    _dkdv_producer,
                    (
                        q_desc,
                        do_desc,
                        k_desc,
                        v_desc,
                        lse_desc,
                        delta_desc,
                        q_smem,
                        do_smem,
                        k_smem,
                        v_smem,
                        lse_smem,
                        delta_smem,
                        kv_bar,
                        q_bars,
                        do_bars,
                        q_empty,
                        q_empty,
                        k_row,
                        off_kvh * k_ch,
                        v_row,
                        off_kvh * v_ch,
                        off_b * q_rb,
                        q_rh,
                        q_ch,
                        off_b * do_rb,
                        do_rh,
                        do_ch,
                        h0,
                        mt0,
                        n_m,
                        n_iter,
                        T,
                        (off_b * H + h0) * (T // _BLOCK_M) + mt0,
                        _BLOCK_M,
                        STAGES,
                        True,
                        True,
                    ),
                ),
            ],
            [4, 4, 1],
            [PROD_REGS, PROD_REGS, _PRODUCER_REGS],
        )


def _launch(q, k, v, do, dk, dv, dq_acc, lse2, delta, s: float, causal: bool, cfg):
    stages, nb, prod_regs, abl = (tuple(cfg) + (0,))[:4]
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    views = {n: _row_view(x) for n, x in (("q", q), ("do", do), ("k", k), ("v", v), ("dk", dk), ("dv", dv))}
    args = dict(qk_scale=s * LOG2E, sm_scale=s, H=H, GROUP=H // Hkv, T=T)
    for n, (_, rb, rh, ch) in views.items():
        args.update({f"{n}_rb": rb, f"{n}_rh": rh, f"{n}_ch": ch})
    (l2, *_), (d2, *_) = (_row_view(x.view(B, H, T // BLOCK_M, BLOCK_M)) for x in (lse2, delta))
    args.update(
        q_desc=_desc(views["q"][0], BLOCK_M, D),
        do_desc=_desc(views["do"][0], BLOCK_M, D),
        k_desc=_desc(views["k"][0], KH, D),
        v_desc=_desc(views["v"][0], KH, D),
        dk_desc=_desc(views["dk"][0], KH, DH),
        dv_desc=_desc(views["dv"][0], KH, DH),
        dq_desc=_desc(dq_acc.view(B * H * T, D), BLOCK_M, DH),
        lse_desc=_desc(l2, 1, BLOCK_M),
        delta_desc=_desc(d2, 1, BLOCK_M),
    )
    consts = dict(HEAD_DIM=D, STAGES=stages, NB=nb, CAUSAL=bool(causal), PROD_REGS=prod_regs, ABL=abl)
    nb_tiles = T // RESIDENT
    args["TAIL"] = GB.tail_heads(nb_tiles, B * Hkv, FA.grid_sms(q.device))
    return _dsplit_kernel, (nb_tiles * B * Hkv,), args, consts


def bwd_dsplit(do, q, k, v, o, lse, causal: bool = True, config: str = "ds", dq=None, dk=None, dv=None):
    """(dq, dk, dv) by the D-split one-pass kernel: the split's prologue (delta, lse·log2e), the kernel into a
    zeroed fp32 dQ accumulator, the one-pass module's dQ convert."""
    op = "bwd_dsplit"
    if q.shape[-1] != 128:
        raise ValueError(f"{op}: head dim 128 only, got {tuple(q.shape)}")
    do, lse2, dq, dk, dv, delta, s, _ = GB._prologue(
        op, GB.supported_bwd, GB.HEAD_DIMS, do, q, k, v, o, lse, None, dq, dk, dv, base2=True
    )
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kern, grid, args, consts = _launch(q, k, v, do, dk, dv, acc, lse2, delta, s, causal, CONFIGS[config])
    kern[grid](**args, **consts, num_warps=4)
    OP.dq_convert(acc, dq, s)
    return dq, dk, dv


def compile_sm90(causal: bool = True, config: str = "ds", T: int = 1024):
    q, k = GB.stand_ins(128, T, 4, 2, False)
    acc = torch.empty(1, 4, T, 128)
    lse = torch.empty(1, 4, T)
    kern, _, args, consts = _launch(q, k, k, q, k, k, acc, lse, lse, 0.125, causal, CONFIGS[config])
    return GB._compile(kern, args, consts)


def check(configs) -> bool:
    ok = True
    for cfg in configs:
        for B, H, Hkv, T in ((1, 4, 2, 1024), (2, 4, 4, 256), (1, 16, 16, 4096)):
            for causal in (True, False):
                g = torch.Generator(device="cuda").manual_seed(T + H)
                q, k, v, do = (
                    torch.randn(B, h, T, 128, generator=g, device="cuda", dtype=torch.bfloat16)
                    for h in (H, Hkv, Hkv, H)
                )
                o, lse = FA.flash_attention_fwd_triton(q, k, v, causal=causal)
                bufs = {n: torch.full_like(x, float("nan")) for n, x in (("dq", q), ("dk", k), ("dv", v))}
                got = bwd_dsplit(do, q, k, v, o, lse, causal, cfg, **bufs)
                split = GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, causal)
                errs = []
                if T <= 1024:
                    want = FA.flash_attention_bwd_ref(
                        do.double(), q.double(), k.double(), v.double(), o.double(), lse.double(), causal
                    )
                    errs = [float((a.double() - w).norm() / w.norm()) for a, w in zip(got, want)]
                serrs = [float((a.double() - w.double()).norm() / w.double().norm()) for a, w in zip(got, split)]
                finite = all(bool(torch.isfinite(a).all()) for a in got)
                good = finite and all(e < 1e-2 for e in errs + serrs)
                ok &= good
                print(
                    f"{cfg} B={B} H={H} Hkv={Hkv} T={T} causal={causal}: {'OK' if good else 'FAIL'} finite={finite} "
                    f"vs fp64 {[f'{e:.2e}' for e in errs]} vs split {[f'{e:.2e}' for e in serrs]}",
                    flush=True,
                )
    return ok


def timing(seqs, configs) -> None:
    from bench import isolated
    from bench._gpu import gpu_time, warm_up

    warm_up()
    for T in seqs:
        q, k, v, do = isolated.bench_inputs(128, T)
        o, lse = FA.flash_attention_fwd_triton(q, k, v, causal=True)
        B, H = q.shape[:2]
        nominal = 2.5 * 2 * B * H * T * T * 128  # 2.5 x the causal forward's FLOPs
        xs = (do, q, k, v, o, lse)
        rows = {
            "split": lambda xs=xs: GB.flash_attention_bwd_gluon(*xs, True),
            **{c: (lambda c=c, xs=xs: bwd_dsplit(*xs, True, c)) for c in configs},
            "cudnn": isolated.cudnn_bwd(q, k, v, do, True),
        }
        res = {n: gpu_time(f)["ms"] for n, f in rows.items()}
        print(
            f"T={T}: "
            + ", ".join(
                f"{n} {ms:.3f} ms ({nominal / ms / 1e9:.0f} TFLOP/s, x{res['cudnn'] / ms:.2f})" for n, ms in res.items()
            ),
            flush=True,
        )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--seqs", default="")
    ap.add_argument("--configs", default="ds")
    a = ap.parse_args()
    configs = a.configs.split(",")
    if a.compile_only:
        from bench.gluon_flash_bwd_onepass import ptxas_report

        for c in configs:
            for causal in (True, False):
                t0 = time.time()
                ck = compile_sm90(causal, c)
                print(
                    f"{c} causal={causal}: {ptxas_report(ck)}, smem {ck.metadata.shared} B, {time.time() - t0:.0f} s",
                    flush=True,
                )
        return 0
    ok = True
    if a.check:
        ok = check(configs)
    if a.seqs:
        timing([int(t) for t in a.seqs.split(",")], configs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
