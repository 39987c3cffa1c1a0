"""Flash-attention forward for Hopper (sm_90) in Gluon: warp-specialised, TMA-fed, async wgmma.

Same contract as ``flash_attention.flash_attention_fwd_triton`` (q [B, H, T, D], k/v [B, Hkv, T, D], query
head h reads K/V head h // (H // Hkv); returns o in q.dtype and lse [B, H, T], the natural-log row
logsumexp in fp32), for what it takes: bf16/fp16, D in (64, 128), T a multiple of 128, on an sm_90 GPU.
``flash_attention.flash_attention_fwd_triton`` sends such calls here where it measured faster (its
``GLUON_FWD`` table); everything else stays on the Triton kernel. The oracle is the plain-torch tiled
reference of the same algorithm, ``flash_attention_fwd_ref`` (``reference`` below is that function).

Gluon (``triton.experimental.gluon``, shipped with Triton >= 3.5) is Triton's lower-level dialect: the
kernel states its own register layouts, shared-memory allocations, TMA copies, mbarriers, warpgroup MMAs
and warp specialisation, which plain Triton decides for itself. It has no CPU interpreter, so this kernel
is checked on the GPU only (tests/test_flash_attention.py, ``gpu``); on CPU the tests compile it for
sm_90 (no GPU needed) so a Triton upgrade that breaks it shows up in CI.

Design, after FlashAttention-3 (Shah, Bikshandi, Zhang, Thakkar, Ramani & Dao, 2024), in the idioms of the
Gluon tutorials of the Triton repository (TMA, wgmma, warp specialisation). One program owns BLOCK_M = 128
query rows of one (batch, head) and runs three partitions:
  * a producer warp (24 registers) that issues every TMA copy: the two 64-row halves of the Q tile once,
    then the K and V tiles of the program's causal range into a STAGES-deep ring of shared-memory slots,
    each slot guarded by a "full" mbarrier (TMA transaction bytes) and an "empty" one (released by both
    consumers);
  * two consumer warpgroups (4 warps each, up to 232 registers), one per 64-row half of the query tile.
    Each runs the online softmax of FlashAttention in the base-2 domain (log2(e) folded into the scale,
    exp2 throughout) and overlaps it with the tensor cores: iteration j issues S_j = Q K_jᵀ and then
    O += P_{j-1} V_{j-1} as async wgmmas, retires S_j alone (wgmma groups retire in order), computes the
    softmax of S_j while P·V still runs, then retires P·V and rescales O. P is rounded to 16 bits in
    registers and fed to the P·V wgmma as its register operand: it never touches shared memory. Being
    separate partitions, the two warpgroups drift apart, so one's softmax overlaps the other's wgmmas
    (FA3 enforces that ping-pong with named barriers; this kernel lets it happen).
  * Causal: the K/V tiles left of the diagonal run unmasked; only tiles that meet the diagonal pay for the
    mask; query tiles are launched heaviest first. The output is normalised in registers, written into the
    consumer's (dead) Q slot and stored by TMA.
Tensor layouts: the TMA descriptors are 2-D row views. A contiguous [B, Hx, T, D] tensor is the view
[B·Hx·T, D] (row of (b, h, t) = (b·Hx + h)·T + t, column 0); a [B, T, Hx, D] tensor seen as [B, Hx, T, D]
through a transpose (the model's v) is the view [B·T, Hx·D] (row b·T + t, column h·D). Either way a
tile of 64 or 128 rows never straddles two heads, since T is a multiple of 128.

H200, causal bf16, B·T = 16k, H·D = 2048 (bench/RESULTS.md, 2026-11-29): hd128 0.88 / 0.95 / 0.94 / 1.00
/ 1.06x cuDNN at T = 1k / 2k / 4k / 8k / 16k (the Triton kernel: 0.81 / 0.82 / 0.78 / 0.85 / 0.91); hd64
with a 3-slot ring 0.75 / 0.85 / 0.95 / 0.98 / 1.04 (Triton: 0.86 / 0.88 / 0.93 / 0.93 / 0.96). Measured
and slower (code in git history, bench/gluon_flash_fwd.py at commit 8c4a983): one 8-warp consumer
partition (0.62-0.87x), no warp specialisation with and without the wgmma/softmax overlap (0.63-0.91x),
64-wide K/V tiles (0.62-0.96x).
"""

from __future__ import annotations

import math

import torch

try:  # Gluon and its Hopper module: Triton >= 3.5 (3.6 on the GPU machines, 3.9 here)
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

    HAVE_GLUON = True
except Exception:  # pragma: no cover - depends on the install
    HAVE_GLUON = False

from xtrain.kernels.flash_attention import flash_attention_fwd_ref  # noqa: E402

reference = flash_attention_fwd_ref  # the oracle: the plain-torch tiled reference of the same algorithm

BLOCK_M = 128  # query rows per program (two warpgroups of 64)
HALF_M = 64
HEAD_DIMS = (64, 128)
CONSUMER_REGS = 232  # registers per thread of the second consumer partition (setmaxnreg)
PRODUCER_REGS = 24
LOG2E = 1.4426950408889634

if HAVE_GLUON:
    # Gluon renamed a few builtins after 3.6; module-level aliases resolve as globals inside @gluon.jit
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    HALF_ROWS = gl.constexpr(HALF_M)  # globals a @gluon.jit body reads must be constexpr objects
    _CONSUMER_REGS = gl.constexpr(CONSUMER_REGS)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)

    @gluon.constexpr_function
    def _mma_layouts(BLOCK_N, HEAD_DIM):
        """wgmma accumulator layouts of one warpgroup: S [64, BLOCK_N] and O [64, HEAD_DIM]."""
        s_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
        return s_layout, o_layout

    @gluon.jit
    def _softmax_tile(s, m_i, l_i, qk_scale, start_m, start_n, s_layout: gl.constexpr, ROWS: gl.constexpr,
                      BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """One online-softmax step on the unscaled fp32 scores s = Q K_jᵀ. Returns (p, m, l, alpha): m in
        the log2 domain (scores times qk_scale), alpha = exp2(m_old - m_new) rescales what was accumulated."""
        if CAUSAL:
            if start_n + BLOCK_N > start_m:  # the tile meets the diagonal: mask keys right of the query
                offs_m = start_m + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
                offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                s = gl.where(gl.expand_dims(offs_m, 1) >= gl.expand_dims(offs_n, 0), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _consumer_loop(q_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, n_tiles, qk_scale, start_m,
                       s_layout: gl.constexpr, o_layout: gl.constexpr, dtype: gl.constexpr,
                       HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       CAUSAL: gl.constexpr):
        """Iteration j: issue S_j = Q K_jᵀ, issue O += P_{j-1} V_{j-1}; wait(1) retires S_j only, so the
        softmax of S_j overlaps the P·V wgmma; wait(0) retires P·V, then O is rescaled to the new max.
        A slot's empty barrier is arrived on once the wgmma that read it has retired."""
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        m_i = gl.full([HALF_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.full([HALF_ROWS], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([HALF_ROWS, HEAD_DIM], gl.float32, o_layout)
        s_zero = gl.zeros([HALF_ROWS, BLOCK_N], gl.float32, s_layout)

        mbarrier.wait(k_full.index(0), 0)  # tile 0: scores and softmax only
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        mbarrier.arrive(k_empty.index(0), count=1)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, start_m, 0, s_layout, HALF_ROWS, BLOCK_N, CAUSAL)
        p16 = gl.convert_layout(p.to(dtype), p_layout)

        for j in range(1, n_tiles):
            slot = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(k_full.index(slot), (j // STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            mbarrier.wait(v_full.index(prev), ((j - 1) // STAGES) & 1)
            o_tok = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
            mbarrier.arrive(k_empty.index(slot), count=1)
            p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, start_m, j * BLOCK_N, s_layout, HALF_ROWS,
                                               BLOCK_N, CAUSAL)
            p16_next = gl.convert_layout(p.to(dtype), p_layout)
            acc, p16 = warpgroup_mma_wait(0, deps=(o_tok, p16))  # P_{j-1} stays alive until its wgmma retires
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p16 = p16_next

        last = (n_tiles - 1) % STAGES
        mbarrier.wait(v_full.index(last), ((n_tiles - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(p16, v_smem.index(last), acc, is_async=True)
        acc, p16 = warpgroup_mma_wait(0, deps=(o_tok, p16))
        mbarrier.arrive(v_empty.index(last), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, v_full, k_empty, v_empty,
                  q_row, q_col, kv_row0, kv_col, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """The TMA warp: both Q halves, then every K/V tile, each into its ring slot once both consumers
        have released the slot's previous tile."""
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row, q_col], q_bar, q_smem.index(0))
        _tma_load(q_desc, [q_row + HALF_ROWS, q_col], q_bar, q_smem.index(1))
        for t in range(n_tiles):
            slot = t % STAGES
            phase = ((t // STAGES) & 1) ^ 1  # the first lap passes on the fresh barriers
            mbarrier.wait(k_empty.index(slot), phase)
            mbarrier.expect(k_full.index(slot), k_desc.block_type.nbytes)
            _tma_load(k_desc, [kv_row0 + t * BLOCK_N, kv_col], k_full.index(slot), k_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), phase)
            mbarrier.expect(v_full.index(slot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [kv_row0 + t * BLOCK_N, kv_col], v_full.index(slot), v_smem.index(slot))

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, q_bar, k_full, v_full, k_empty, v_empty, o_desc, lse_ptr, q_row, q_col,
                  lse_row, n_tiles, qk_scale, start_m, dtype: gl.constexpr, HEAD_DIM: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, HALF: gl.constexpr):
        """One warpgroup: query rows [start_m + 64·HALF, +64) of the program's 128. Both consumers walk all
        n_tiles K/V tiles; then o = acc / l through the Q slot and a TMA store, lse = (m + log2 l) · ln 2."""
        layouts: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM)
        s_layout: gl.constexpr = layouts[0]
        o_layout: gl.constexpr = layouts[1]
        q_half = q_smem.index(HALF)
        mbarrier.wait(q_bar, 0)
        acc, m_i, l_i = _consumer_loop(q_half, k_smem, v_smem, k_full, v_full, k_empty, v_empty, n_tiles,
                                       qk_scale, start_m + HALF * HALF_ROWS, s_layout, o_layout, dtype, HEAD_DIM,
                                       BLOCK_N, STAGES, CAUSAL)
        o = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
        q_half.store(o.to(dtype))
        fence_async_shared()
        _cta_barrier()
        _tma_store(o_desc, [q_row + HALF * HALF_ROWS, q_col], q_half)
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
        offs = gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, s_layout))
        gl.store(lse_ptr + lse_row + HALF * HALF_ROWS + offs, lse)
        tma.store_wait(0)

    @gluon.jit
    def _flash_fwd_gluon_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, H, GROUP, T,
                                q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch,
                                HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                CAUSAL: gl.constexpr):
        """Program (query tile, batch·head). num_warps = 4: the default partition is consumer warpgroup 0,
        the workers are consumer warpgroup 1 and the producer warp. Descriptor rows/columns of (b, h, t):
        row b·rb + h·rh + t, column h·ch (q and o share a layout; k and v share one)."""
        dtype: gl.constexpr = q_desc.dtype
        pid_m = gl.program_id(0)
        off_bh = gl.program_id(1)
        if CAUSAL:  # heaviest query tiles first: the short diagonal programs fill the tail of the grid
            pid_m = gl.num_programs(0) - 1 - pid_m
        off_b = off_bh // H
        off_h = off_bh % H
        off_hk = off_h // GROUP
        start_m = pid_m * (2 * HALF_ROWS)
        q_row = off_b * q_rb + off_h * q_rh + start_m
        q_col = off_h * q_ch
        kv_row0 = off_b * kv_rb + off_hk * kv_rh
        kv_col = off_hk * kv_ch
        lse_row = off_bh.to(gl.int64) * T + start_m
        if CAUSAL:
            n_tiles = (start_m + 2 * HALF_ROWS) // BLOCK_N
        else:
            n_tiles = T // BLOCK_N

        q_smem = gl.allocate_shared_memory(dtype, [2, HALF_ROWS, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_full.index(i), count=1)
            mbarrier.init(v_full.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer warpgroup
            mbarrier.init(v_empty.index(i), count=2)
        fence_async_shared()

        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_full, v_full, k_empty, v_empty, o_desc, lse_ptr, q_row,
                         q_col, lse_row, n_tiles, qk_scale, start_m, dtype, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, 0)),
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_full, v_full, k_empty, v_empty, o_desc, lse_ptr, q_row,
                         q_col, lse_row, n_tiles, qk_scale, start_m, dtype, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, 1)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, v_full, k_empty, v_empty,
                         q_row, q_col, kv_row0, kv_col, n_tiles, BLOCK_N, STAGES)),
        ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])  # worker_num_regs: required by Gluon 3.6

    _GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


# ---------------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------------
STAGES = {64: 3, 128: 2}  # K/V ring slots by head dim (H200: hd64 gains from the third slot, hd128 does not)
BLOCK_N = 128


def _row_view(x: torch.Tensor):
    """(2-D view, rb, rh, ch) of x [B, Hx, T, D] for the TMA descriptor, or None when x has neither layout
    (contiguous [B, Hx, T, D], or a [B, T, Hx, D] tensor seen through a transpose)."""
    B, Hx, T, D = x.shape
    if x.is_contiguous():
        return x.view(B * Hx * T, D), Hx * T, T, 0
    if x.stride() == (T * Hx * D, D, Hx * D, 1):
        return x.transpose(1, 2).view(B * T, Hx * D), T, 0, D
    return None


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether this kernel takes these inputs: Gluon present, an sm_90 GPU, bf16/fp16, D in (64, 128), T a
    multiple of 128, and q (k, v alike) in one of the two layouts of ``_row_view``."""
    if not (HAVE_GLUON and q.is_cuda) or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    B, H, T, D = q.shape
    if D not in HEAD_DIMS or T % BLOCK_M or T == 0:
        return False
    if k.stride() != v.stride():
        return False
    return _row_view(q) is not None and _row_view(k) is not None


def _desc(view: torch.Tensor, rows: int, D: int):
    gdt = _GL_DTYPES[view.dtype]
    layout = gl.NVMMASharedLayout.get_default_for([rows, D], gdt)
    return TensorDescriptor(view, list(view.shape), list(view.stride()), [rows, D], layout)


def flash_attention_fwd_gluon(q, k, v, causal: bool = True, scale: float | None = None, *, o=None, lse=None,
                              stages: int | None = None):
    """Launch the Gluon forward (callers check ``supported`` first; flash_attention_fwd_triton does). q, k, v
    must share a dtype; ``o``/``lse``: optional output buffers, o in q's layout, lse contiguous fp32."""
    op = "flash_attention_fwd_gluon"
    if not supported(q, k, v):
        raise ValueError(f"{op}: needs bf16/fp16 q, k, v on an sm_90 GPU, D in {HEAD_DIMS}, T a multiple of "
                         f"{BLOCK_M}, contiguous or [B, T, H, D]-transposed layouts; got q {tuple(q.shape)} "
                         f"{q.dtype} strides {q.stride()}, k {tuple(k.shape)} strides {k.stride()}")
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not (s > 0.0 and math.isfinite(s)):
        raise ValueError(f"{op}: scale must be a finite number > 0, got {scale!r}")
    if o is None:  # o in q's layout, so one set of descriptor coordinates serves both
        o = torch.empty_like(q) if q.is_contiguous() else torch.empty(
            B, T, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    if o.shape != q.shape or o.dtype != q.dtype or o.stride() != q.stride():
        raise ValueError(f"{op}: o must be like q (shape, dtype, strides), got {tuple(o.shape)} {o.dtype} "
                         f"strides {o.stride()} vs q strides {q.stride()}")
    if lse is None:
        lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    if lse.shape != (B, H, T) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"{op}: lse must be contiguous fp32 [B, H, T], got {tuple(lse.shape)} {lse.dtype}")
    q2, q_rb, q_rh, q_ch = _row_view(q)
    k2, kv_rb, kv_rh, kv_ch = _row_view(k)
    v2 = _row_view(v)[0]
    o2 = _row_view(o)[0]
    n_stages = stages or STAGES[D]
    grid = (T // BLOCK_M, B * H)
    _flash_fwd_gluon_kernel[grid](
        _desc(q2, HALF_M, D), _desc(k2, BLOCK_N, D), _desc(v2, BLOCK_N, D), _desc(o2, HALF_M, D), lse,
        s * LOG2E, H, H // Hkv, T, q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch,
        HEAD_DIM=D, BLOCK_N=BLOCK_N, STAGES=n_stages, CAUSAL=bool(causal), num_warps=4)
    return o, lse


def compile_sm90(D: int = 128, causal: bool = True, stages: int | None = None, transposed_kv: bool = False):
    """Compile the kernel for sm_90 without a GPU (CPU tensors stand in for the descriptors' shapes): the CI
    check that a Triton upgrade has not broken it. Returns the compiled kernel (its .asm["ptx"])."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    B, H, Hkv, T = 1, 4, 2, 256
    q = torch.empty(B, H, T, D, dtype=torch.bfloat16)
    kv = (torch.empty(B, T, Hkv, D, dtype=torch.bfloat16).transpose(1, 2) if transposed_kv
          else torch.empty(B, Hkv, T, D, dtype=torch.bfloat16))
    q2, q_rb, q_rh, q_ch = _row_view(q)
    k2, kv_rb, kv_rh, kv_ch = _row_view(kv)
    args = dict(q_desc=_desc(q2, HALF_M, D), k_desc=_desc(k2, BLOCK_N, D), v_desc=_desc(k2, BLOCK_N, D),
                o_desc=_desc(q2, HALF_M, D), lse_ptr=torch.empty(B, H, T), qk_scale=0.125 * LOG2E, H=H,
                GROUP=H // Hkv, T=T, q_rb=q_rb, q_rh=q_rh, q_ch=q_ch, kv_rb=kv_rb, kv_rh=kv_rh, kv_ch=kv_ch)
    consts = dict(HEAD_DIM=D, BLOCK_N=BLOCK_N, STAGES=stages or STAGES[D], CAUSAL=causal)
    sig = {a: "constexpr" if a in consts else mangle_type(args[a]) for a in _flash_fwd_gluon_kernel.arg_names}
    src = GluonASTSource(_flash_fwd_gluon_kernel, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
