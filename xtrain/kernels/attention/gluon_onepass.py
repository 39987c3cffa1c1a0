"""Flash-attention backward for Hopper (sm_90) in Gluon, one pass, head dim 64: dQ by a third warpgroup.

Contract: that of ``reference.flash_attention_bwd_ref`` (the oracle) for what ``supported_bwd`` takes: those of the
split backward (``gluon_common.supported_bwd``) with D = 64. NOT bit-identical run to run: dQ is summed over key tiles
by fp32 TMA reduce-adds from many programs, in whatever order they land (``runs_agree`` states how far two runs may
differ); dK and dV are summed inside one program each. So the routing sends the causal 16-bit hd64 backward here from
T = 1024 except under ``torch.use_deterministic_algorithms(True)``.

Algorithm: FlashAttention-3's one-pass backward (5 matrix products per (query, key) tile pair instead of the split's 7):
one program per 128 keys of a (batch, kv head), K and V resident, walking the 64-row query tiles of every head of the
GQA group (causal only: at or below the diagonal), dK and dV accumulated in registers, dQ partials added into an fp32
[B·H·T, D] buffer by TMA reduce-adds, then scaled and cast into dq by a small Triton kernel (``dq_convert``). Where FA3
splits the dQ product between the two MMA warpgroups (exchanging dSᵀ halves every step), a THIRD consumer warpgroup does
all of it, so the dK/dV warpgroups never wait on each other. Four partitions: the split's producer warp (K, V once, then
Q and dO per step into a 3-deep ring); dK/dV warpgroups 0 and 1 (Sᵀ, dPᵀ, Pᵀ with the next step's lse and delta
prefetched, dV += Pᵀ dO, dSᵀ into one of two shared dS buffers, dK += dSᵀ Q); the dQ warpgroup (dQ_step = dS K per step,
staged in one of two fp32 tiles, one [64, D] reduce-add each). Registers (setmaxnreg): dK/dV warpgroup 1 208, dQ
warpgroup 72, producer 24, warpgroup 0 the rest. H200, bf16 causal, bench shapes: 1.06-1.09x cuDNN at T = 2k-16k (the
Triton backward 0.90-1.02x). hd128 does not fit: the two dK/dV warpgroups alone need ~232 registers each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xtrain.kernels._consts import LOG2E
from xtrain.kernels._dispatch import HAVE_TRITON, launch_cached
from xtrain.kernels.attention.gluon_common import (
    HALF_M,
    HAVE_GLUON,
    RESIDENT,
    _compile,
    _desc,
    _prologue,
    check_inputs,
    descriptor_templates,
    plan_outputs,
    rebase_all,
    row_coords,
    stand_ins,
    tail_heads,
    tma_args,
)
from xtrain.kernels.attention.gluon_common import supported_bwd as _split_supported
from xtrain.kernels.attention.reference import _shapes
from xtrain.kernels.attention.triton import grid_sms

BLOCK_M = 64  # queries per step (one wgmma M of the dQ product)
HEAD_DIMS = (64,)
CONVERT_ROWS = 64  # rows of dq per program of the convert kernel


@dataclass(frozen=True)
class OnepassConfig:
    """The one-pass kernel's build: Q/dO ring depth, dQ staging tiles, dS buffers, and the setmaxnreg register
    counts of dK/dV warpgroup 1 and of the dQ warpgroup (2·kv_regs + dq_regs <= 488)."""

    stages: int = 3
    slots: int = 2
    nds: int = 2
    kv_regs: int = 208
    dq_regs: int = 72


if HAVE_GLUON:
    from xtrain.kernels.attention.gluon_common import (
        _LOG2E,
        _PRODUCER_REGS,
        _acc_layout,
        _cta_barrier,
        _dkdv_producer,
        _dkdv_store,
        _kv_rows,
        _ring_init,
        _tail_order,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    _tma_reduce_add = getattr(tma, "async_atomic_add", None)
    if _tma_reduce_add is None:  # Gluon 3.6: the builder op exists (tl's descriptor atomic_add uses it) but
        # Gluon has no wrapper; wrap it as newer Gluon does
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin as _builtin

        @_builtin
        def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(
                _ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
            )

    @gluon.jit
    def _lse_delta(lse_ptr, delta_ptr, lse_row0, T, mt0, n_m, it, BLOCK_M: gl.constexpr):
        """lse·log2(e) and delta of step ``it``'s queries, in the Sᵀ column layout."""
        cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, _acc_layout(BLOCK_M)))
        row = lse_row0 + (it // n_m) * T + (mt0 + it % n_m) * BLOCK_M  # int64 row of the [B·H·T] lse / delta
        return gl.load(lse_ptr + row + cols) * _LOG2E, gl.load(delta_ptr + row + cols)

    @gluon.jit
    def _program(H, GROUP, T, TAIL, KH: gl.constexpr, BLOCK_M: gl.constexpr):
        """The program's place: key tile of 2·KH keys and (batch, kv head), from the linear program id in the
        split's ``_tail_order`` (key tile 0, the heaviest causal one, first). Returns off_b, off_kvh,
        start_n, h0 (first query head of the group), lse_row0 (int64 row of the [B·H·T] lse / delta), dq_row0
        (int32 TMA row of the fp32 dQ accumulator), mt0 (first query tile), n_m (query tiles per head),
        n_iter (steps = GROUP·n_m)."""
        pid_n, off_bkv = _tail_order(gl.program_id(0), T // (2 * KH), TAIL)
        Hkv = H // GROUP
        off_b = off_bkv // Hkv
        off_kvh = off_bkv % Hkv
        start_n = pid_n * (2 * KH)
        h0 = off_kvh * GROUP
        lse_row0 = (off_b * H + h0).to(gl.int64) * T
        dq_row0 = (off_b * H + h0) * T
        mt0 = start_n // BLOCK_M
        n_m = T // BLOCK_M - mt0
        return off_b, off_kvh, start_n, h0, lse_row0, dq_row0, mt0, n_m, GROUP * n_m

    @gluon.jit
    def _kv_step(
        it, q_smem, do_smem, k_half, v_half, ds_smem, q_bars, do_bars, ds_empty, ds_full, lse2, delta, dv, dk, mt0, n_m,
        k_lo, qk_scale, dtype: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
        HALF: gl.constexpr, NDS: gl.constexpr,
    ):  # fmt: skip
        """Step ``it`` of dK/dV warpgroup HALF up to the dS hand-off (module docstring). Returns the in-flight
        dv, dk and the register A operand p_op that must stay alive until dV retires. Its first half repeats
        the split's ``_dkdv_consumer`` loop body on purpose: one shared function moved the
        SASS spill stores of the split's hd128 causal dK/dV kernel from 37 to 39 (triton 3.6), or, with the
        mask indices hoisted as the split has them, this kernel's from 57 to 53 / 60 (3.6 / 3.9); both are
        tuned and measured as they are."""
        KH: gl.constexpr = k_half.shape[0]
        s_layout: gl.constexpr = _acc_layout(BLOCK_M)
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_acc_layout(HEAD_DIM), k_width=2)
        start_m = (mt0 + it % n_m) * BLOCK_M
        slot = it % STAGES
        phase = (it // STAGES) & 1
        q_t = q_smem.index(slot)
        do_t = do_smem.index(slot)
        s_zero = gl.zeros([KH, BLOCK_M], gl.float32, s_layout)
        mbarrier.wait(q_bars.index(slot), phase)
        st = warpgroup_mma(k_half, q_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_bars.index(slot), phase)
        dpt = warpgroup_mma(v_half, do_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=(st,))  # retires Sᵀ; dPᵀ may still run
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
        if start_m < k_lo + KH:  # some query of the tile precedes some key of this half: mask
            offs_k = k_lo + gl.arange(0, KH, layout=gl.SliceLayout(1, s_layout))
            cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
            keep = gl.expand_dims(start_m + cols, 0) >= gl.expand_dims(offs_k, 1)
            pt = gl.where(keep, pt, 0.0)
        p_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv = warpgroup_mma(p_op, do_t, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=(dpt,))  # retires dPᵀ; dV may still run
        ds16 = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
        b = it % NDS
        mbarrier.wait(ds_empty.index(b), ((it // NDS) & 1) ^ 1)  # fresh barrier: the first lap passes
        ds_half = ds_smem.index(2 * b + HALF)
        ds_half.store(ds16)
        fence_async_shared()
        _cta_barrier()  # every thread's store is fenced before the wgmma and the one arrival
        dk = warpgroup_mma(ds_half, q_t, dk, is_async=True)  # A from shared memory: 16 fewer live registers
        mbarrier.arrive(ds_full.index(b), count=1)
        return dv, dk, p_op

    @gluon.jit
    def _kv_consumer(
        kv, dtype: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
        HALF: gl.constexpr, NDS: gl.constexpr,
    ):  # fmt: skip
        """dK/dV warpgroup HALF: keys [start_n + HALF·64, +64). Each step's lse and delta are loaded in the step
        before, ahead of its products. Its only wait on another consumer is ds_empty (the dQ warpgroup NDS steps
        behind)."""
        (
            q_smem, do_smem, k_smem, v_smem, ds_smem, kv_bar, q_bars, do_bars, q_empty, do_empty, ds_full, ds_empty,
            dk_desc, dv_desc, lse_ptr, delta_ptr, lse_row0, T, dk_row, dk_col, dv_row, dv_col, mt0, n_m, n_iter,
            start_n, qk_scale, sm_scale,
        ) = kv  # fmt: skip
        KH: gl.constexpr = dk_desc.block_type.shape[0]
        a_layout: gl.constexpr = _acc_layout(HEAD_DIM)
        k_half = k_smem.index(HALF)
        v_half = v_smem.index(HALF)
        k_lo = start_n + HALF * KH
        dk = gl.zeros([KH, HEAD_DIM], gl.float32, a_layout)
        dv = gl.zeros([KH, HEAD_DIM], gl.float32, a_layout)
        lse2, delta = _lse_delta(lse_ptr, delta_ptr, lse_row0, T, mt0, n_m, 0, BLOCK_M)
        mbarrier.wait(kv_bar, 0)
        for it in range(n_iter):
            nxt = gl.minimum(it + 1, n_iter - 1)  # the next step's statistics, loaded ahead (the last: its own)
            lse2n, deltan = _lse_delta(lse_ptr, delta_ptr, lse_row0, T, mt0, n_m, nxt, BLOCK_M)
            dv, dk, p_op = _kv_step(
                it, q_smem, do_smem, k_half, v_half, ds_smem, q_bars, do_bars, ds_empty, ds_full, lse2, delta, dv, dk,
                mt0, n_m, k_lo, qk_scale, dtype=dtype, HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, STAGES=STAGES, HALF=HALF,
                NDS=NDS,
            )  # fmt: skip
            dv, dk, p_op = warpgroup_mma_wait(0, deps=(dv, dk, p_op))
            slot = it % STAGES
            mbarrier.arrive(q_empty.index(slot), count=1)  # dV, dK were the last readers of Q, dO
            mbarrier.arrive(do_empty.index(slot), count=1)
            lse2, delta = lse2n, deltan
        # both K halves feed the dQ warpgroup's products: its ds_empty arrival of the last step comes after its
        # last dQ wgmmas retired (and, in its program order, every earlier one)
        last = n_iter - 1
        mbarrier.wait(ds_empty.index(last % NDS), (last // NDS) & 1)
        _dkdv_store(k_half, v_half, dk, dv, sm_scale, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col, dtype, HALF)

    @gluon.jit
    def _dq_consumer(args, BLOCK_M: gl.constexpr, NDS: gl.constexpr, SLOTS: gl.constexpr):
        """The dQ warpgroup (module docstring): the only issuer of reduce-adds, so its own
        tma.store_wait(SLOTS - 1) frees a staging tile."""
        k_smem, ds_smem, dq_smem, kv_bar, ds_full, ds_empty, dq_desc, dq_row0, T, mt0, n_m, n_iter = args
        D: gl.constexpr = dq_desc.block_type.shape[1]
        dq_zero = gl.zeros([BLOCK_M, D], gl.float32, _acc_layout(D))
        mbarrier.wait(kv_bar, 0)
        k0 = k_smem.index(0)
        k1 = k_smem.index(1)
        for it in range(n_iter):
            b = it % NDS
            mbarrier.wait(ds_full.index(b), (it // NDS) & 1)
            dq = warpgroup_mma(ds_smem.index(2 * b).permute((1, 0)), k0, dq_zero, use_acc=False, is_async=True)
            dq = warpgroup_mma(ds_smem.index(2 * b + 1).permute((1, 0)), k1, dq, is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq,))
            mbarrier.arrive(ds_empty.index(b), count=1)
            s = it % SLOTS
            tma.store_wait(SLOTS - 1)  # the reduce-add of step it - SLOTS (same tile) has read it
            _cta_barrier()  # the issuing thread's wait covers every thread's store below
            dq_smem.index(s).store(dq)
            fence_async_shared()
            _cta_barrier()  # every thread's store is fenced before the one reduce-add
            row = dq_row0 + (it // n_m) * T + (mt0 + it % n_m) * BLOCK_M
            _tma_reduce_add(dq_desc, [row, 0], dq_smem.index(s))
        tma.store_wait(0)  # no CTA exit while a reduce-add still reads shared memory

    @gluon.jit
    def _onepass_kernel(
        q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, dq_desc, lse_ptr, delta_ptr, qk_scale, sm_scale, H, GROUP, T,
        q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, dk_rb, dk_rh, dk_ch, dv_rb, dv_rh,
        dv_ch, TAIL, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, SLOTS: gl.constexpr,
        NDS: gl.constexpr, KV_REGS: gl.constexpr, DQ_REGS: gl.constexpr,
    ):  # fmt: skip
        """Program (key tile of 128, batch·kv head); num_warps = 4 (the default partition is dK/dV warpgroup
        0). dq_desc: the fp32 accumulator [B·H·T, D] with [BLOCK_M, D] tiles."""
        dtype: gl.constexpr = q_desc.dtype
        KH: gl.constexpr = k_desc.block_type.shape[0]
        gl.static_assert(BLOCK_M == 64)
        gl.static_assert(dq_desc.block_type.shape[1] == HEAD_DIM)
        off_b, off_kvh, start_n, h0, lse_row0, dq_row0, mt0, n_m, n_iter = _program(H, GROUP, T, TAIL, KH, BLOCK_M)

        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2, KH, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, KH, HEAD_DIM], v_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KH, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [2 * NDS, KH, BLOCK_M], ds_layout)  # [buffer·2 + half]
        dq_smem = gl.allocate_shared_memory(gl.float32, [SLOTS, BLOCK_M, HEAD_DIM], dq_desc.layout)
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
            mbarrier.init(ds_full.index(i), count=2)  # one arrival per dK/dV warpgroup
            mbarrier.init(ds_empty.index(i), count=1)  # the dQ warpgroup, once its dQ wgmmas retired
        fence_async_shared()

        k_row, v_row, dk_row, dv_row = _kv_rows(
            off_b, off_kvh, start_n, k_rb, k_rh, v_rb, v_rh, dk_rb, dk_rh, dv_rb, dv_rh
        )
        # the partitions' runtime arguments; their constexprs are added at the call (an assigned tuple's constants
        # would become tensors)
        kv = (
            q_smem, do_smem, k_smem, v_smem, ds_smem, kv_bar, q_bars, do_bars, q_empty, do_empty, ds_full, ds_empty,
            dk_desc, dv_desc, lse_ptr, delta_ptr, lse_row0, T, dk_row, off_kvh * dk_ch, dv_row, off_kvh * dv_ch, mt0,
            n_m, n_iter, start_n, qk_scale, sm_scale,
        )  # fmt: skip
        dq = (k_smem, ds_smem, dq_smem, kv_bar, ds_full, ds_empty, dq_desc, dq_row0, T, mt0, n_m, n_iter)
        producer = (
            q_desc, do_desc, k_desc, v_desc, q_desc, do_desc, q_smem, do_smem, k_smem, v_smem, q_smem, do_smem, kv_bar,
            q_bars, do_bars, q_empty, do_empty, k_row, off_kvh * k_ch, v_row, off_kvh * v_ch, off_b * q_rb, q_rh, q_ch,
            off_b * do_rb, do_rh, do_ch, h0, mt0, n_m, n_iter, T,
        )  # fmt: skip
        gl.warp_specialize(
            [
                (_kv_consumer, (kv, dtype, HEAD_DIM, BLOCK_M, STAGES, 0, NDS)),
                (_kv_consumer, (kv, dtype, HEAD_DIM, BLOCK_M, STAGES, 1, NDS)),
                (_dq_consumer, (dq, BLOCK_M, NDS, SLOTS)),
                # the one-pass walk: no lse / delta statistics (their descriptors and buffers are stand-ins)
                (_dkdv_producer, (producer, 0, BLOCK_M, STAGES, False, False)),
            ],
            [4, 4, 1],
            [KV_REGS, DQ_REGS, _PRODUCER_REGS],
        )


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _dq_convert_kernel(
        ACC, DQ, scale, H, T, stride_b, stride_h, stride_t, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr
    ):
        """DQ[b, h, t, :] = scale · ACC[(b·H + h)·T + t, :] in DQ's dtype; ACC contiguous fp32, DQ any strides with
        a unit last one. Program (row block, b·H + h)."""
        bh = tl.program_id(1)
        t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, HEAD_DIM)
        mask = (t < T)[:, None]
        src = ACC + (bh.to(tl.int64) * T + t)[:, None] * HEAD_DIM + cols[None, :]
        x = tl.load(src, mask=mask)
        dst = (
            DQ
            + (bh // H).to(tl.int64) * stride_b
            + (bh % H).to(tl.int64) * stride_h
            + t[:, None].to(tl.int64) * stride_t
        )
        tl.store(dst + cols[None, :], (x * scale).to(DQ.dtype.element_ty), mask=mask)


def runs_agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two dq of the one-pass kernel on the same inputs differ only as a different order of the fp32
    reduce-adds can make them: every element within 2 units in the last place of its dtype at its own
    magnitude plus 2^-10·max|b| (an fp32 sum of ≤ 256 partials reordered moves by far less than that before the
    final rounding, which moves it by at most one unit), and the relative norm of the difference ≤ 1e-3.
    A missing, doubled or stale partial moves a 64-row tile by about its own size and fails both."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a64, b64 = a.double(), b.double()
    ulp = torch.finfo(b.dtype).eps * b64.abs()
    floor = 2.0**-10 * float(b64.abs().max()) if b.numel() else 0.0
    diff = (a64 - b64).abs()
    return bool((diff <= 2 * ulp + floor).all()) and float(diff.norm()) <= 1e-3 * float(b64.norm())


def convert_ref(acc: torch.Tensor, dq: torch.Tensor, scale: float) -> torch.Tensor:
    """The plain-torch reference of ``_dq_convert_kernel``: dq ← (acc · scale) in dq's dtype, acc [B, H, T, D]."""
    dq.copy_((acc.view(dq.shape) * scale).to(dq.dtype))
    return dq


def dq_convert(acc: torch.Tensor, dq: torch.Tensor, scale: float, cached: bool = False):
    """Launch ``_dq_convert_kernel``: acc contiguous fp32 [B, H, T, D] (or its [B·H·T, D] view), dq [B, H, T, D]
    with unit last stride. Returns dq, or with ``cached`` the launch as a ``CachedLaunch``."""
    op = "dq_convert"
    if dq.ndim != 4 or acc.dtype != torch.float32 or not acc.is_contiguous() or acc.numel() != dq.numel():
        raise ValueError(
            f"{op}: need a contiguous fp32 acc with dq's element count and a 4-D dq, got acc "
            f"{_shapes(acc)} dq {_shapes(dq)}"
        )
    if dq.stride(-1) != 1 or dq.shape[-1] & (dq.shape[-1] - 1):
        raise ValueError(
            f"{op}: dq needs a unit last stride and a power-of-two head dim, got {_shapes(dq)} strides {dq.stride()}"
        )
    B, H, T, D = dq.shape
    args = dict(ACC=acc, DQ=dq, scale=scale, H=H, T=T, stride_b=dq.stride(0), stride_h=dq.stride(1))
    args.update(stride_t=dq.stride(2), HEAD_DIM=D, ROWS=CONVERT_ROWS)
    grid = (triton.cdiv(T, CONVERT_ROWS), B * H)
    if cached:
        return launch_cached(_dq_convert_kernel, grid, args, num_warps=4)
    _dq_convert_kernel[grid](**args, num_warps=4)
    return dq


# ---------------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------------
def supported_bwd(do, q, k, v, o, lse, *, dq=None, dk=None, dv=None) -> bool:
    """Whether these inputs take the one-pass backward: those of the two-kernel Gluon backward
    (``gluon_common.supported_bwd``) with D = 64."""
    return (
        isinstance(q, torch.Tensor)
        and q.ndim == 4
        and q.shape[-1] in HEAD_DIMS
        and _split_supported(do, q, k, v, o, lse, dq=dq, dk=dk, dv=dv)
    )


def _launch(q, k, v, do, dk, dv, dq_acc, lse, delta, s: float, cfg: OnepassConfig):
    """(kernel, grid, args, constexprs) of the one-pass kernel; CUDA tensors or CPU stand-ins."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    views, coords = {}, {}
    for name, x in (("q", q), ("do", do), ("k", k), ("v", v), ("dk", dk), ("dv", dv)):
        views[name], coords[name] = row_coords(name, x)
    args = tma_args(D, views, coords, q=BLOCK_M, do=BLOCK_M, k=HALF_M, v=HALF_M, dk=HALF_M, dv=HALF_M)
    args.update(lse_ptr=lse, delta_ptr=delta, qk_scale=s * LOG2E, sm_scale=s, H=H, GROUP=H // Hkv, T=T)
    args["dq_desc"] = _desc(dq_acc.view(B * H * T, D), BLOCK_M, D)  # the fp32 accumulator
    consts = dict(HEAD_DIM=D, BLOCK_M=BLOCK_M, STAGES=cfg.stages, SLOTS=cfg.slots, NDS=cfg.nds)
    consts.update(KV_REGS=cfg.kv_regs, DQ_REGS=cfg.dq_regs)
    nb = T // RESIDENT
    args["TAIL"] = tail_heads(nb, B * Hkv, grid_sms(q.device))
    return _onepass_kernel, (nb * B * Hkv,), args, consts


def flash_attention_bwd_gluon_onepass(
    do,
    q,
    k,
    v,
    o,
    lse,
    causal: bool = True,
    scale: float | None = None,
    *,
    dq=None,
    dk=None,
    dv=None,
    config: OnepassConfig = OnepassConfig(),
    checked: bool = False,
    plan: bool = False,
):
    """Delta preprocess, the one-pass kernel, the dQ convert. Returns (dq, dk, dv). ``dq``/``dk``/``dv``:
    optional output buffers (contiguous or [B, T, H, D]-transposed); ``config``: an ``OnepassConfig``. Holds
    an fp32 dQ accumulator [B, H, T, D] while it runs.
    ``checked``: the caller has just checked the inputs and ``supported_bwd`` (``check_inputs``). ``plan``: also
    return a ``_OnepassPlan`` that repeats these launches for inputs of the same signature (dq, dk, dv left to
    this function). Causal only."""
    op = "flash_attention_bwd_gluon_onepass"
    if not causal:
        raise ValueError(f"{op}: causal attention only (non-causal calls run the Triton kernels), got causal=False")
    if plan and (dq is not None or dk is not None or dv is not None):
        raise ValueError(f"{op}: plan=True allocates dq, dk, dv itself; got buffers")
    if not checked:
        check_inputs(op, supported_bwd, HEAD_DIMS, do, q, k, v, o, lse)
    do, lse, dq, dk, dv, delta, s, pre = _prologue(op, do, q, k, v, o, lse, scale, dq, dk, dv, plan=plan)
    cfg = config
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kern, grid, args, consts = _launch(q, k, v, do, dk, dv, dq_acc, lse, delta, s, cfg)
    if not plan:
        kern[grid](**args, **consts, num_warps=4)
        dq_convert(dq_acc, dq, s)
        return dq, dk, dv
    main = launch_cached(kern, grid, {**args, **consts}, num_warps=4)
    conv = dq_convert(dq_acc, dq, s, cached=True)
    return dq, dk, dv, _OnepassPlan(pre, main, conv, args)


class _OnepassPlan:
    """``flash_attention_bwd_gluon_onepass`` for one signature of inputs with its host work done once (see
    ``gluon_fwd._FwdPlan``): allocates dq, dk, dv, delta and the zeroed fp32 dQ accumulator, then
    launches the compiled preprocess, one-pass kernel and dQ convert with re-based descriptors."""

    __slots__ = ("pre", "main", "conv", "descs")

    def __init__(self, pre, main, conv, args: dict):
        self.pre, self.main, self.conv = pre, main, conv
        self.descs = descriptor_templates(args)

    def __call__(self, do, q, k, v, o, lse):
        dq, dk, dv, delta, _, _ = plan_outputs(self.pre, do, q, k, v, o)
        acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        ts = {"q": q, "do": do, "k": k, "v": v, "dk": dk, "dv": dv, "dq": acc}
        self.main(lse_ptr=lse, delta_ptr=delta, **rebase_all(self.descs, ts))
        self.conv(ACC=acc, DQ=dq)
        return dq, dk, dv


def compile_sm90(config: OnepassConfig = OnepassConfig(), transposed: bool = False, T: int = 256, D: int = 64):
    """Compile the one-pass kernel for sm_90 without a GPU (CPU tensors stand in for the descriptors' shapes).
    ``transposed``: q, do, k, v, dk, dv as [B, T, Hx, D] seen through a transpose. Returns the CompiledKernel."""
    cfg = config
    q, k = stand_ins(D, T, 4, 2, transposed)
    acc = torch.empty(1, 4, T, D)
    lse = torch.empty(1, 4, T)
    kern, _, args, consts = _launch(q, k, k, q, k, k, acc, lse, lse, 0.125, cfg)
    return _compile(kern, args, consts)
