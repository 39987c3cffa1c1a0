"""Flash-attention backward for Hopper (sm_90) in Gluon: two warp-specialised, TMA-fed, async-wgmma kernels.

Contract: that of ``reference.flash_attention_bwd_ref`` (the oracle) for what ``supported_bwd`` takes:
bf16/fp16, D in (64, 128), T a multiple of 128, an sm_90 GPU, q/k/v/do (and given dq/dk/dv buffers) each
contiguous [B, Hx, T, D] or a [B, T, Hx, D] tensor seen through a transpose. Causal only; no atomics: bit-identical
run to run. The routing sends the causal 16-bit hd128 backward here from T = 1024, and the hd64 one from T = 4096 in
deterministic mode (where the one-pass kernel may not run).

Algorithm (FlashAttention-2's backward by recomputation in FlashAttention-3's warp-specialised form): the
delta preprocess (Triton) writes delta = rowsum(dO ∘ O) and lse·log2(e); then two independent kernels run
concurrently on two CUDA streams, each with a producer warp issuing every TMA copy into a shared-memory ring
and two consumer warpgroups that own 64 rows each of the program's resident 128-row tile:
  * dK/dV kernel: 128 keys of one (batch, kv head) resident, walking the 64-row query tiles of every head
    of the GQA group, transposed ([keys, queries]): Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, dV += Pᵀ dO, dK += dSᵀ Q, P and
    dS rounded to 16 bits in registers and fed to the next wgmma as its A operand. Each head's diagonal
    steps are peeled into a loop of their own (the mask a compile-time choice), the steps wholly above a
    warpgroup's keys skipped. lse and delta come by TMA beside Q and dO; with ``lse_mma`` (hd128 bf16) they
    reach the step through the tensor cores instead: the preprocess writes -lse·log2(e)/qk_scale and -delta
    as three 16-bit parts in the first columns of a [B·H·T, 16] buffer, and Sᵀ's and dPᵀ's wgmma chains take
    one more k16 slice against a tile of ones, so no thread loads a statistic.
  * dQ kernel: 128 query rows resident, walking the 64-key tiles up to the diagonal: S = Q Kᵀ, dP = dO Vᵀ,
    dQ += dS K, tile j - 1's dQ wgmma issued behind tile j's S and dP (a 4-deep K/V ring); warpgroup 0
    skips its fully masked tile; with ``doreg`` (hd128) the resident dO half is dP's A operand in registers.
7 matrix products per (query, key) tile pair. H200, bf16 causal, bench shapes: hd128 1.18 / 1.12 / 1.08 /
1.06 / 0.99x cuDNN at T = 1k / 2k / 4k / 8k / 16k; the deterministic hd64 backward 1.77 / 3.38 / 6.78 ms
at T = 4k / 8k / 16k against the Triton kernels' 1.81-1.87 / 3.68 / 7.05 (same bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xtrain.kernels._consts import LOG2E
from xtrain.kernels._dispatch import launch_cached, run_side_by_side
from xtrain.kernels.attention.gluon_common import (
    HALF_M,
    HAVE_GLUON,
    HEAD_DIMS,
    LSE_COLS,
    RESIDENT,
    _compile,
    _desc,
    _prologue,
    _row_view,
    check_inputs,
    descriptor_templates,
    new_columns,
    plan_outputs,
    rebase_all,
    row_coords,
    stand_ins,
    supported_bwd,
    tail_heads,
    tma_args,
)
from xtrain.kernels.attention.triton import grid_sms


@dataclass(frozen=True)
class GluonBwdConfig:
    """The split backward's build: ``lse_mma`` takes lse and delta through the tensor cores (bf16 only: fp16's
    range does not hold every fp32 lse / scale and delta), ``doreg`` keeps the dQ kernel's dO half in registers;
    ``tail_waves``: the program order's tile-major tail. The query step (64), the key step (64) and the ring depths
    (2 and 4) are fixed; on CUDA the two kernels run concurrently on two streams."""

    lse_mma: bool = False
    doreg: bool = False
    tail_waves: int = 2


BLOCK_M1, STAGES1, BLOCK_N2, STAGES2 = 64, 2, 64, 4

if HAVE_GLUON:
    from xtrain.kernels.attention.gluon_common import (
        _CONSUMER_REGS,
        _PRODUCER_REGS,
        _acc_layout,
        _cta_barrier,
        _dkdv_producer,
        _dkdv_store,
        _kv_rows,
        _ring_init,
        _tail_order,
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

    _LSE_COLS = gl.constexpr(LSE_COLS)

    # -----------------------------------------------------------------------------------------------------
    # dK/dV kernel
    # -----------------------------------------------------------------------------------------------------
    @gluon.jit
    def _dkdv_issue_sdp(
        k_half, v_half, q_smem, do_smem, q_bars, do_bars, s_zero, it, ones_smem, lse_smem, delta_smem,
        STAGES: gl.constexpr, LSE_MMA: gl.constexpr,
    ):  # fmt: skip
        """Step ``it``'s Sᵀ = K Qᵀ and dPᵀ = V dOᵀ wgmmas, each once its tile has landed; LSE_MMA: each chain with
        one more k16 slice, ``ones_smem`` against the slot's lse (delta) columns. Returns the ring slot, its Q and
        dO tiles and the two in-flight products."""
        slot = it % STAGES
        phase = (it // STAGES) & 1
        q_t = q_smem.index(slot)
        do_t = do_smem.index(slot)
        mbarrier.wait(q_bars.index(slot), phase)
        st = warpgroup_mma(k_half, q_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if LSE_MMA:
            st = warpgroup_mma(ones_smem, lse_smem.index(slot).permute((1, 0)), st, is_async=True)
        mbarrier.wait(do_bars.index(slot), phase)
        dpt = warpgroup_mma(v_half, do_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if LSE_MMA:
            dpt = warpgroup_mma(ones_smem, delta_smem.index(slot).permute((1, 0)), dpt, is_async=True)
        return slot, q_t, do_t, st, dpt

    @gluon.jit
    def _dkdv_step(
        k_half, v_half, q_smem, do_smem, lse_smem, delta_smem, ones_smem, q_bars, do_bars, q_empty, dk, dv, s_zero,
        it, start_m, offs_k, cols, qk_scale, dtype: gl.constexpr, s_layout: gl.constexpr, op_layout: gl.constexpr,
        STAGES: gl.constexpr, MASK: gl.constexpr, LSE_MMA: gl.constexpr,
    ):  # fmt: skip
        """One step of the walk (``_dkdv_consumer``) with the causal mask a compile-time choice (MASK: the step's
        query tile starts at start_m) instead of a branch in every step. lse·log2(e) and delta come from the
        slot's shared rows just before their use, so no register holds them across the step; LSE_MMA: Sᵀ and dPᵀ
        arrive with them subtracted instead (``_dkdv_issue_sdp``: the shared [64, LSE_COLS] tile ``ones_smem``, 1
        in its first three columns, against the slot's columns, -lse·log2(e) / qk_scale and -delta in three bf16
        parts each), so no thread reads a statistic."""
        slot, q_t, do_t, st, dpt = _dkdv_issue_sdp(
            k_half, v_half, q_smem, do_smem, q_bars, do_bars, s_zero, it, ones_smem, lse_smem, delta_smem,
            STAGES=STAGES, LSE_MMA=LSE_MMA,
        )  # fmt: skip
        if LSE_MMA:
            st = warpgroup_mma_wait(1, deps=(st,))
            pt = gl.exp2(st * qk_scale)
        else:
            lse_b = lse_smem.index(slot).load(s_layout)  # [1, BLOCK_M] lse·log2(e), broadcast over the keys
            st = warpgroup_mma_wait(1, deps=(st,))  # retires Sᵀ; dPᵀ may still run
            pt = gl.exp2(st * qk_scale - lse_b)
        if MASK:
            keep = gl.expand_dims(start_m + cols, 0) >= gl.expand_dims(offs_k, 1)
            pt = gl.where(keep, pt, 0.0)
        p_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv_tok = warpgroup_mma(p_op, do_t, dv, is_async=True)
        if LSE_MMA:
            dpt = warpgroup_mma_wait(1, deps=(dpt,))
            dst = pt * dpt
        else:
            delta_b = delta_smem.index(slot).load(s_layout)
            dpt = warpgroup_mma_wait(1, deps=(dpt,))  # retires dPᵀ; dV may still run
            dst = pt * (dpt - delta_b)
        ds_op = gl.convert_layout(dst.to(dtype), op_layout)
        dk_tok = warpgroup_mma(ds_op, q_t, dk, is_async=True)
        dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_op))
        mbarrier.arrive(q_empty.index(slot), count=1)
        return dk, dv

    @gluon.jit
    def _dkdv_skip(q_bars, do_bars, q_empty, it, STAGES: gl.constexpr):
        """A step whose queries all precede this half's keys (P = 0: nothing to add): the slot is only waited
        for and released."""
        slot = it % STAGES
        phase = (it // STAGES) & 1
        mbarrier.wait(q_bars.index(slot), phase)
        mbarrier.wait(do_bars.index(slot), phase)
        mbarrier.arrive(q_empty.index(slot), count=1)

    @gluon.jit
    def _dkdv_consumer(
        args, dtype: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
        HALF: gl.constexpr, LSE_MMA: gl.constexpr,
    ):  # fmt: skip
        """One warpgroup: keys [start_n + HALF·64, +64), on [keys, queries] tiles (module docstring). Each group
        head's walk in three parts: the steps wholly above this half's keys skipped (``_dkdv_skip``), the
        diagonal ones masked, the rest with no mask code (``_dkdv_step``)."""
        (
            q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_bar, q_bars, do_bars, q_empty, dk_desc, dv_desc,
            dk_row, dk_col, dv_row, dv_col, mt0, n_m, n_iter, start_n, qk_scale, sm_scale, ones_smem,
        ) = args  # fmt: skip
        KH: gl.constexpr = dk_desc.block_type.shape[0]
        s_layout: gl.constexpr = _acc_layout(BLOCK_M)  # [KH, BLOCK_M] Sᵀ, dPᵀ
        a_layout: gl.constexpr = _acc_layout(HEAD_DIM)  # [KH, HEAD_DIM] dK, dV
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
        k_half = k_smem.index(HALF)
        v_half = v_smem.index(HALF)
        k_lo = start_n + HALF * KH
        offs_k = k_lo + gl.arange(0, KH, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([KH, BLOCK_M], gl.float32, s_layout)
        dk = gl.zeros([KH, HEAD_DIM], gl.float32, a_layout)
        dv = gl.zeros([KH, HEAD_DIM], gl.float32, a_layout)
        start_m = mt0 * BLOCK_M
        mbarrier.wait(kv_bar, 0)
        # the first steps of each head's walk (start_m from start_n = mt0·BLOCK_M) hold queries before some key of
        # this half; those entirely before it (the first HALF·KH / BLOCK_M) add nothing
        n_skip: gl.constexpr = (HALF * KH) // BLOCK_M
        n_diag: gl.constexpr = ((HALF + 1) * KH + BLOCK_M - 1) // BLOCK_M - n_skip
        it = 0
        for _g in range(n_iter // n_m):
            for _i in gl.static_range(n_skip):
                _dkdv_skip(q_bars, do_bars, q_empty, it, STAGES)
                it += 1
            for i in gl.static_range(n_diag):
                dk, dv = _dkdv_step(
                    k_half, v_half, q_smem, do_smem, lse_smem, delta_smem, ones_smem, q_bars, do_bars, q_empty, dk, dv,
                    s_zero, it, start_m + (n_skip + i) * BLOCK_M, offs_k, cols, qk_scale,
                    dtype=dtype, s_layout=s_layout, op_layout=op_layout, STAGES=STAGES, MASK=True, LSE_MMA=LSE_MMA,
                )  # fmt: skip
                it += 1
            for _i in range(n_m - n_skip - n_diag):
                dk, dv = _dkdv_step(
                    k_half, v_half, q_smem, do_smem, lse_smem, delta_smem, ones_smem, q_bars, do_bars, q_empty, dk, dv,
                    s_zero, it, start_m, offs_k, cols, qk_scale,
                    dtype=dtype, s_layout=s_layout, op_layout=op_layout, STAGES=STAGES, MASK=False, LSE_MMA=LSE_MMA,
                )  # fmt: skip
                it += 1
        _dkdv_store(k_half, v_half, dk, dv, sm_scale, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col, dtype, HALF)

    @gluon.jit
    def _bwd_dkdv_kernel(
        q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, lse_desc, delta_desc, qk_scale, sm_scale, H, GROUP, T,
        q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, dk_rb, dk_rh, dk_ch, dv_rb, dv_rh,
        dv_ch, TAIL, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, LSE_MMA: gl.constexpr,
    ):  # fmt: skip
        """Program (key tile, batch·kv head) of a 1-D grid in ``_tail_order`` (key tile 0, the heaviest causal
        one, first); num_warps = 4 (the default partition is consumer warpgroup 0). K/V/dK/dV descriptors have
        64-row tiles (one warpgroup's half), Q/dO BLOCK_M-row tiles; lse and delta come through lse_desc and
        delta_desc (the row views, or with LSE_MMA the column views)."""
        dtype: gl.constexpr = q_desc.dtype
        KH: gl.constexpr = k_desc.block_type.shape[0]
        gl.static_assert((2 * KH) % BLOCK_M == 0)
        pid_n, off_bkv = _tail_order(gl.program_id(0), T // (2 * KH), TAIL)
        Hkv = H // GROUP
        off_b = off_bkv // Hkv
        off_kvh = off_bkv % Hkv
        start_n = pid_n * (2 * KH)
        h0 = off_kvh * GROUP  # first query head of the group
        mt0 = start_n // BLOCK_M  # query tiles above the key tile see none of it
        n_m = T // BLOCK_M - mt0
        n_iter = GROUP * n_m

        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2, KH, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, KH, HEAD_DIM], v_desc.layout)
        ones_smem = k_smem  # a stand-in unless LSE_MMA
        if LSE_MMA:  # the lse and delta column tiles in the ring, and the constant [KH, LSE_COLS] tile
            gl.static_assert(KH == BLOCK_M)
            LC: gl.constexpr = _LSE_COLS
            lse_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, LC], lse_desc.layout)
            ones_smem = gl.allocate_shared_memory(dtype, [KH, LC], lse_desc.layout)
            delta_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, LC], delta_desc.layout)
            ones_l: gl.constexpr = gl.BlockedLayout([1, LC], [32, 1], [4, 1], [1, 0])
            c = gl.arange(0, LC, layout=gl.SliceLayout(0, ones_l))
            one_row = gl.expand_dims((c < 3).to(gl.float32), 0)
            ones_smem.store((gl.zeros([KH, LC], gl.float32, ones_l) + one_row).to(dtype))
        else:  # the lse and delta rows in the ring
            lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], lse_desc.layout)
            delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], delta_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        _ring_init(q_bars, q_empty, STAGES)
        _ring_init(do_bars, do_empty, STAGES)
        fence_async_shared()

        k_row, v_row, dk_row, dv_row = _kv_rows(
            off_b, off_kvh, start_n, k_rb, k_rh, v_rb, v_rh, dk_rb, dk_rh, dv_rb, dv_rh
        )
        # each partition's runtime arguments as one tuple, its constexprs beside it (a tuple assigned to a name
        # holds values, not constexprs)
        kv = (
            q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_bar, q_bars, do_bars, q_empty, dk_desc, dv_desc,
            dk_row, off_kvh * dk_ch, dv_row, off_kvh * dv_ch, mt0, n_m, n_iter, start_n, qk_scale, sm_scale, ones_smem,
        )  # fmt: skip
        loads = (
            q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem, lse_smem,
            delta_smem, kv_bar, q_bars, do_bars, q_empty, do_empty, k_row, off_kvh * k_ch, v_row, off_kvh * v_ch,
            off_b * q_rb, q_rh, q_ch, off_b * do_rb, do_rh, do_ch, h0, mt0, n_m, n_iter, T,
        )  # fmt: skip
        gl.warp_specialize(
            [
                (_dkdv_consumer, (kv, dtype, HEAD_DIM, BLOCK_M, STAGES, 0, LSE_MMA)),
                (_dkdv_consumer, (kv, dtype, HEAD_DIM, BLOCK_M, STAGES, 1, LSE_MMA)),
                (_dkdv_producer, (loads, (off_b * H + h0) * (T // BLOCK_M) + mt0, BLOCK_M, STAGES, True, LSE_MMA)),
            ],
            [4, 1],
            [_CONSUMER_REGS, _PRODUCER_REGS],  # worker_num_regs: required by Gluon 3.6
        )

    # -----------------------------------------------------------------------------------------------------
    # dQ kernel
    # -----------------------------------------------------------------------------------------------------
    @gluon.jit
    def _dq_producer(args, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """The TMA warp: both halves of Q and dO once, then every K/V tile into the ring."""
        (
            q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_bars, v_bars, k_empty, v_empty,
            q_row, q_col, do_row, do_col, k_row0, k_col, v_row0, v_col, n_tiles,
        ) = args  # fmt: skip
        QH: gl.constexpr = q_desc.block_type.shape[0]
        mbarrier.expect(q_bar, 4 * q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row, q_col], q_bar, q_smem.index(0))
        _tma_load(q_desc, [q_row + QH, q_col], q_bar, q_smem.index(1))
        _tma_load(do_desc, [do_row, do_col], q_bar, do_smem.index(0))
        _tma_load(do_desc, [do_row + QH, do_col], q_bar, do_smem.index(1))
        for t in range(n_tiles):
            slot = t % STAGES
            phase = ((t // STAGES) & 1) ^ 1  # fresh barriers: the first lap passes
            mbarrier.wait(k_empty.index(slot), phase)
            mbarrier.expect(k_bars.index(slot), k_desc.block_type.nbytes)
            _tma_load(k_desc, [k_row0 + t * BLOCK_N, k_col], k_bars.index(slot), k_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), phase)
            mbarrier.expect(v_bars.index(slot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [v_row0 + t * BLOCK_N, v_col], v_bars.index(slot), v_smem.index(slot))

    @gluon.jit
    def _dq_issue_sdp(q_half, do_half, k_smem, v_smem, k_bars, v_bars, s_zero, j, STAGES: gl.constexpr):
        """Issue tile j's S = Q Kᵀ and dP = dO Vᵀ wgmmas (each once its tile has landed)."""
        slot = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_bars.index(slot), phase)
        s = warpgroup_mma(q_half, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_bars.index(slot), phase)
        dp = warpgroup_mma(do_half, v_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        return s, dp

    @gluon.jit
    def _dq_p(s, lse2, q_lo, offs_q, cols, start_n, qk_scale, BLOCK_N: gl.constexpr):
        """P of a retired S tile, causal mask applied."""
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
        if start_n + BLOCK_N > q_lo + 1:  # some key of the tile follows some query of this half
            keep = gl.expand_dims(q_lo + offs_q, 1) >= gl.expand_dims(start_n + cols, 0)
            p = gl.where(keep, p, 0.0)
        return p

    @gluon.jit
    def _dq_loop_pipelined(
        q_half, do_half, k_smem, v_smem, k_bars, v_bars, k_empty, v_empty, lse2, delta, dq, s_zero, q_lo, offs_q, cols,
        n_tiles, qk_scale, dtype: gl.constexpr, op_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        """The dQ consumer's walk with tile j - 1's dQ wgmma issued behind tile j's S and dP, so it runs while S_j's
        exponentials and dS_j are computed (FlashAttention-3's intra-warpgroup overlap). K_{j-1}'s slot is
        released only when dQ_{j-1} retires, at the end of step j: give the ring at least 3 stages (the default
        has 4: 1-3 % faster than 3 on the H200)."""
        s, dp = _dq_issue_sdp(q_half, do_half, k_smem, v_smem, k_bars, v_bars, s_zero, 0, STAGES)
        s = warpgroup_mma_wait(1, deps=(s,))
        p = _dq_p(s, lse2, q_lo, offs_q, cols, 0, qk_scale, BLOCK_N)
        dp = warpgroup_mma_wait(0, deps=(dp,))
        mbarrier.arrive(v_empty.index(0), count=1)
        ds_op = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), op_layout)
        for j in range(1, n_tiles):
            s, dp = _dq_issue_sdp(q_half, do_half, k_smem, v_smem, k_bars, v_bars, s_zero, j, STAGES)
            prev = (j - 1) % STAGES
            dq_tok = warpgroup_mma(ds_op, k_smem.index(prev), dq, is_async=True)
            s = warpgroup_mma_wait(2, deps=(s,))  # S_j retired; dP_j and dQ_{j-1} may run
            p = _dq_p(s, lse2, q_lo, offs_q, cols, j * BLOCK_N, qk_scale, BLOCK_N)
            dp = warpgroup_mma_wait(1, deps=(dp,))
            mbarrier.arrive(v_empty.index(j % STAGES), count=1)
            ds_new = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), op_layout)
            dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
            mbarrier.arrive(k_empty.index(prev), count=1)
            ds_op = ds_new
        last = (n_tiles - 1) % STAGES
        dq_tok = warpgroup_mma(ds_op, k_smem.index(last), dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
        mbarrier.arrive(k_empty.index(last), count=1)
        return dq

    @gluon.jit
    def _dq_consumer(
        args, dtype: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        HALF: gl.constexpr, DOREG: gl.constexpr,
    ):  # fmt: skip
        """One warpgroup: query rows [start_m + HALF·64, +64), its Q/dO halves resident, walking the K/V ring
        (``_dq_loop_pipelined``). The tiles whose keys all follow this half's queries (P = 0) are only
        waited for and released, not computed (with BLOCK_N = 64: warpgroup 0's last tile)."""
        (
            q_smem, do_smem, k_smem, v_smem, q_bar, k_bars, v_bars, k_empty, v_empty, dq_desc, lse_ptr, delta_ptr,
            lse_row, dq_row, dq_col, start_m, n_tiles, qk_scale, sm_scale,
        ) = args  # fmt: skip
        QH: gl.constexpr = dq_desc.block_type.shape[0]
        s_layout: gl.constexpr = _acc_layout(BLOCK_N)  # [QH, BLOCK_N] S, dP
        a_layout: gl.constexpr = _acc_layout(HEAD_DIM)  # [QH, HEAD_DIM] dQ
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
        q_half = q_smem.index(HALF)
        do_half = do_smem.index(HALF)
        q_lo = start_m + HALF * QH
        offs_q = gl.arange(0, QH, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        lse2 = gl.load(lse_ptr + lse_row + HALF * QH + offs_q)  # lse·log2(e)
        delta = gl.load(delta_ptr + lse_row + HALF * QH + offs_q)
        s_zero = gl.zeros([QH, BLOCK_N], gl.float32, s_layout)
        dq = gl.zeros([QH, HEAD_DIM], gl.float32, a_layout)
        mbarrier.wait(q_bar, 0)
        do_a = do_half
        if DOREG:  # the resident dO half as dP's A operand in registers (32 per thread), read from shared memory once
            do_a = do_half.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        n_all = n_tiles
        # tiles starting at or after this half's last query + 1 (q_lo + QH) add nothing
        n_tiles = gl.minimum(n_tiles, (q_lo + QH + BLOCK_N - 1) // BLOCK_N)
        dq = _dq_loop_pipelined(
            q_half, do_a, k_smem, v_smem, k_bars, v_bars, k_empty, v_empty, lse2, delta, dq, s_zero, q_lo, offs_q, cols,
            n_tiles, qk_scale, dtype=dtype, op_layout=op_layout, BLOCK_N=BLOCK_N, STAGES=STAGES,
        )  # fmt: skip
        for j in range(n_tiles, n_all):  # the tiles past this half's queries, released unread
            slot = j % STAGES
            phase = (j // STAGES) & 1
            mbarrier.wait(k_bars.index(slot), phase)
            mbarrier.wait(v_bars.index(slot), phase)
            mbarrier.arrive(v_empty.index(slot), count=1)
            mbarrier.arrive(k_empty.index(slot), count=1)
        q_half.store((dq * sm_scale).to(dtype))  # through Q's dead half and a TMA store
        fence_async_shared()
        _cta_barrier()
        _tma_store(dq_desc, [dq_row + HALF * QH, dq_col], q_half)
        tma.store_wait(0)

    @gluon.jit
    def _bwd_dq_kernel(
        q_desc, do_desc, k_desc, v_desc, dq_desc, lse_ptr, delta_ptr, qk_scale, sm_scale, H, GROUP, T, q_rb, q_rh, q_ch,
        do_rb, do_rh, do_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, dq_rb, dq_rh, dq_ch, TAIL, HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DOREG: gl.constexpr,
    ):  # fmt: skip
        """Program (query tile, batch·head) of a 1-D grid in ``_tail_order``, heaviest causal tiles first;
        num_warps = 4. Q/dO/dQ descriptors have 64-row tiles (one warpgroup's half), K/V BLOCK_N-row tiles."""
        dtype: gl.constexpr = q_desc.dtype
        QH: gl.constexpr = q_desc.block_type.shape[0]
        gl.static_assert((2 * QH) % BLOCK_N == 0)
        pid_m, off_bh = _tail_order(gl.program_id(0), T // (2 * QH), TAIL)
        pid_m = T // (2 * QH) - 1 - pid_m
        off_b = off_bh // H
        off_h = off_bh % H
        off_hk = off_h // GROUP
        start_m = pid_m * (2 * QH)
        lse_row = off_bh.to(gl.int64) * T + start_m
        n_tiles = (start_m + 2 * QH) // BLOCK_N

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
        _ring_init(k_bars, k_empty, STAGES)
        _ring_init(v_bars, v_empty, STAGES)
        fence_async_shared()

        q_row = off_b * q_rb + off_h * q_rh + start_m
        do_row = off_b * do_rb + off_h * do_rh + start_m
        dq_row = off_b * dq_rb + off_h * dq_rh + start_m
        dq = (
            q_smem, do_smem, k_smem, v_smem, q_bar, k_bars, v_bars, k_empty, v_empty, dq_desc, lse_ptr, delta_ptr,
            lse_row, dq_row, off_h * dq_ch, start_m, n_tiles, qk_scale, sm_scale,
        )  # fmt: skip
        loads = (
            q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_bars, v_bars, k_empty, v_empty,
            q_row, off_h * q_ch, do_row, off_h * do_ch, off_b * k_rb + off_hk * k_rh, off_hk * k_ch,
            off_b * v_rb + off_hk * v_rh, off_hk * v_ch, n_tiles,
        )  # fmt: skip
        gl.warp_specialize(
            [
                (_dq_consumer, (dq, dtype, HEAD_DIM, BLOCK_N, STAGES, 0, DOREG)),
                (_dq_consumer, (dq, dtype, HEAD_DIM, BLOCK_N, STAGES, 1, DOREG)),
                (_dq_producer, (loads, BLOCK_N, STAGES)),
            ],
            [4, 1],
            [_CONSUMER_REGS, _PRODUCER_REGS],
        )


# ---------------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------------
def _launches(q, k, v, dq, dk, dv, do, lse, delta, s: float, cfg: GluonBwdConfig, cols=None):
    """[(kernel, grid, args, constexprs)] of the dK/dV and the dQ kernel of ``cfg``; CUDA tensors, or CPU tensors
    standing in for shapes and strides (``compile_sm90``). ``cols``: ``lse_mma``'s (lse, delta) column buffers
    (``new_columns``) as the preprocess wrote them (``_prologue(cols=...)``)."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    views, coords = {}, {}
    for name, x in (("q", q), ("do", do), ("k", k), ("v", v), ("dq", dq), ("dk", dk), ("dv", dv)):
        views[name], coords[name] = row_coords(name, x)
    common = dict(qk_scale=s * LOG2E, sm_scale=s, H=H, GROUP=H // Hkv, T=T)
    # lse and delta as [B·H·T / BLOCK_M1, BLOCK_M1] rows for the dK/dV kernel's TMA loads, or (lse_mma)
    # -lse·log2(e) / qk_scale and -delta as the columns of a k16 slice, [B·H·T, LSE_COLS]
    if cfg.lse_mma:
        lse_d, delta_d = (_desc(c.view(B * H * T, LSE_COLS), BLOCK_M1, LSE_COLS) for c in cols)
    else:
        lse_d, delta_d = (_desc(_row_view(x.view(B, H, T // BLOCK_M1, BLOCK_M1))[0], 1, BLOCK_M1) for x in (lse, delta))
    dkdv = dict(tma_args(D, views, coords, q=BLOCK_M1, do=BLOCK_M1, k=HALF_M, v=HALF_M, dk=HALF_M, dv=HALF_M))
    dkdv.update(lse_desc=lse_d, delta_desc=delta_d, **common)
    dqa = dict(tma_args(D, views, coords, q=HALF_M, do=HALF_M, k=BLOCK_N2, v=BLOCK_N2, dq=HALF_M))
    dqa.update(lse_ptr=lse, delta_ptr=delta, **common)
    c1 = dict(HEAD_DIM=D, BLOCK_M=BLOCK_M1, STAGES=STAGES1, LSE_MMA=cfg.lse_mma)
    c2 = dict(HEAD_DIM=D, BLOCK_N=BLOCK_N2, STAGES=STAGES2, DOREG=cfg.doreg)
    nb = T // RESIDENT
    n_sm = grid_sms(q.device)
    dkdv["TAIL"] = tail_heads(nb, B * Hkv, n_sm, cfg.tail_waves)
    dqa["TAIL"] = tail_heads(nb, B * H, n_sm, cfg.tail_waves)
    return [(_bwd_dkdv_kernel, (nb * B * Hkv,), dkdv, c1), (_bwd_dq_kernel, (nb * B * H,), dqa, c2)]


def _side_by_side(q: torch.Tensor, launch_dkdv, launch_dq) -> None:
    """The two kernels: on CUDA the dQ kernel on the side stream, joined before returning; elsewhere (the offline
    compiles) one after the other."""
    if q.is_cuda:
        run_side_by_side(q.device, launch_dkdv, launch_dq)
    else:
        launch_dkdv()
        launch_dq()


class _SplitPlan:
    """``flash_attention_bwd_gluon`` for one signature of inputs with its host work done once (see
    ``gluon_fwd._FwdPlan``): allocates dq, dk, dv and delta, then launches the compiled delta
    preprocess and the two kernels (on two streams as the full path does) with re-based descriptors."""

    __slots__ = ("pre", "dkdv", "dq", "dkdv_descs", "dq_descs", "bm1", "columns")

    def __init__(self, pre, dkdv, dq, a1: dict, a2: dict, columns: bool):
        self.pre, self.dkdv, self.dq = pre, dkdv, dq
        self.dkdv_descs, self.dq_descs = descriptor_templates(a1), descriptor_templates(a2)
        self.columns = columns  # lse_mma puts lse's and delta's descriptors on column buffers
        self.bm1 = a1["q_desc"].block_shape[0]  # the dK/dV kernel's query step: lse / delta rows per TMA tile

    def __call__(self, do, q, k, v, o, lse):
        dq, dk, dv, delta, lse, c = plan_outputs(self.pre, do, q, k, v, o, lse, self.columns)  # lse·log2(e)
        B, H, T, _ = q.shape
        ts = dict(q=q, do=do, k=k, v=v, dq=dq, dk=dk, dv=dv)
        if self.columns:
            ts["lse"], ts["delta"] = c
        else:
            ts["lse"], ts["delta"] = (x.view(B, H, T // self.bm1, self.bm1) for x in (lse, delta))

        def launch_dkdv():
            self.dkdv(**rebase_all(self.dkdv_descs, ts))

        def launch_dq():
            self.dq(lse_ptr=lse, delta_ptr=delta, **rebase_all(self.dq_descs, ts))

        _side_by_side(q, launch_dkdv, launch_dq)
        return dq, dk, dv


def flash_attention_bwd_gluon(
    do,
    q,
    k,
    v,
    o,
    lse,
    causal: bool = True,
    scale: float | None = None,
    *,
    config: GluonBwdConfig,
    dq=None,
    dk=None,
    dv=None,
    checked: bool = False,
    plan: bool = False,
):
    """Launch the delta preprocess, then the dK/dV and dQ kernels of ``config``. Returns (dq, dk, dv).
    ``dq``/``dk``/``dv``: optional output buffers (contiguous or [B, T, H, D]-transposed). ``checked``: the
    caller has just checked the inputs and ``supported_bwd``. ``plan``: also return a ``_SplitPlan`` that
    repeats these launches for inputs of the same signature (dq, dk, dv left to this function). Causal only."""
    op = "flash_attention_bwd_gluon"
    if not causal:
        raise ValueError(f"{op}: causal attention only (non-causal calls run the Triton kernels), got causal=False")
    if plan and (dq is not None or dk is not None or dv is not None):
        raise ValueError(f"{op}: plan=True allocates dq, dk, dv itself; got buffers")
    if not checked:
        check_inputs(op, supported_bwd, HEAD_DIMS, do, q, k, v, o, lse)
    if config.lse_mma and q.dtype != torch.bfloat16:
        raise ValueError(f"{op}: lse_mma takes bf16 inputs only, got {q.dtype}")
    cols = new_columns(q, config.lse_mma)  # the preprocess also writes the lse / delta columns
    do, lse, dq, dk, dv, delta, s, pre = _prologue(
        op, do, q, k, v, o, lse, scale, dq, dk, dv, plan=plan, base2=True, cols=cols
    )
    launches = _launches(q, k, v, dq, dk, dv, do, lse, delta, s, config, cols)
    cached = {}  # (the side stream's dQ launch is issued first)

    def launcher(i, kern, grid, args, consts):
        if plan:
            return lambda: cached.update({i: launch_cached(kern, grid, {**args, **consts}, num_warps=4)})
        return lambda: kern[grid](**args, **consts, num_warps=4)

    _side_by_side(q, *(launcher(i, *launch) for i, launch in enumerate(launches)))
    if plan:
        return dq, dk, dv, _SplitPlan(pre, cached[0], cached[1], launches[0][2], launches[1][2], config.lse_mma)
    return dq, dk, dv


def compile_sm90(D: int, config: GluonBwdConfig, transposed: bool = False, T: int = 256, mha: bool = False):
    """Compile both kernels of ``config`` for sm_90 without a GPU (CPU tensors stand in for the descriptors'
    shapes). ``transposed``: q, do, k, v, dk, dv as [B, T, Hx, D] seen through a transpose (dq contiguous). GQA
    (4 query heads on 2 K/V heads) unless ``mha``: then GROUP = 1 is compiled in as a constant, as Triton's
    launcher specialises an argument equal to 1. Returns {"dkdv": CompiledKernel, "dq": CompiledKernel}."""
    q, k = stand_ins(D, T, 4, 4 if mha else 2, transposed)
    dq = torch.empty(1, 4, T, D, dtype=torch.bfloat16)
    lse = torch.empty(1, 4, T)
    launches = _launches(q, k, k, dq, k, k, q, lse, lse, 0.125, config, new_columns(q, config.lse_mma))
    return {
        name: _compile(kern, args, dict(consts, GROUP=1) if mha else consts)
        for name, (kern, _, args, consts) in zip(("dkdv", "dq"), launches)
    }
