"""Flash-attention forward for Hopper (sm_90) in Gluon: persistent, warp-specialised, TMA-fed, async wgmma.

Contract: that of ``reference.flash_attention_fwd_ref`` (the oracle) for what ``supported`` takes: bf16/fp16,
D in (64, 128), T a multiple of 128, an sm_90 GPU, q (k, v alike) contiguous [B, Hx, T, D] or a [B, T, Hx, D]
tensor seen through a transpose. Returns o in q's layout and lse [B, H, T] fp32 (natural log). The routing
sends the causal 16-bit forward here from T = 1024; shorter T stays on the Triton kernel.

Algorithm (FlashAttention-3: Shah et al. 2024). A work item is 64·NW query rows of one (batch, head); each
program of a persistent grid (one per SM) walks a list of items, and every item has
  * a producer warp (24 registers) issuing every TMA copy: the Q tile (into one of ``num_q`` buffers, so the
    next item's Q lands while this one runs), then the item's K/V tiles (128 rows) into a ``stages``-deep
    ring of shared-memory slots guarded by "full" (TMA bytes) and "empty" mbarriers;
  * NW consumer warpgroups of 64 query rows each, running the online softmax in the base-2 domain and
    overlapping it with the tensor cores: step j issues S_j = Q K_jᵀ and O += P_{j-1} V_{j-1} as async
    wgmmas, retires S_j, computes its softmax while P·V runs, then rescales O. P stays in registers as the
    P·V wgmma's A operand. With ``pingpong`` the two warpgroups alternate (one issues wgmmas while the other
    runs its softmax), handed over by two mbarriers. NW = 3 (hd64 at long T, 192-row items, 160 registers
    each): the item grid of a head starts before the sequence, so its first item is the partial one.
  * Causal: tiles left of the diagonal run unmasked; with ``half_diag`` the first warpgroup's diagonal step
    takes the tile's first 64 keys only. O leaves normalised by a TMA store from a buffer of its own.
The host deals the items (``schedule``): per head, heaviest and lightest query tiles paired (equal causal
cost), pairs dealt round-robin head by head so a head's K/V comes from DRAM about once; the last two full
rounds and the partial one are dealt item by item, heaviest first, to the least-loaded program.
H200, bf16 causal, bench shapes, x cuDNN at T = 1k / 2k / 4k / 8k / 16k: hd128 1.03 / 1.12 / 1.12 / 1.10 /
1.09; hd64 1.04 / 1.05 / 1.04 / 1.08 / 1.07 (the Triton kernel 0.82-0.96).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from xtrain.kernels._consts import LOG2E
from xtrain.kernels._dispatch import PlanCache, launch_cached, sm_count
from xtrain.kernels.attention.gluon_common import (
    HALF_M,
    HAVE_GLUON,
    HEAD_DIMS,
    _compile,
    _desc,
    _row_view,
    capability,
    descriptor_templates,
    rebase_all,
    row_coords,
)
from xtrain.kernels.attention.reference import _scale

BLOCK_M = 128  # query rows of a two-warpgroup item
BLOCK_N = 128  # K/V rows per tile
CONSUMER3_REGS = 160  # the two worker consumers when three consumer warpgroups share the 512 (NW = 3)
TAIL_ROUNDS = 2  # rounds of pairs at the end of the schedule dealt item by item instead
ITEM_COST = 1.0  # an item's fixed cost in K/V tiles (its Q load and epilogue), for that dealing


@dataclass(frozen=True)
class GluonFwdConfig:
    """The persistent kernel's build: Q buffers (1 or 2), warpgroup ping-pong, consumer warpgroups (2, or 3 at
    hd64), K/V ring slots, and the causal half-width diagonal step of the first warpgroup (NW = 2)."""

    num_q: int
    pingpong: bool
    warpgroups: int
    stages: int
    half_diag: bool


if HAVE_GLUON:
    from xtrain.kernels.attention.gluon_common import (
        _CONSUMER_REGS,
        _LN2,
        _PRODUCER_REGS,
        HALF_ROWS,
        _acc_layout,
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

    _CONSUMER3_REGS = gl.constexpr(CONSUMER3_REGS)

    @gluon.constexpr_function
    def _exact(NW):
        """Whether items of NW·64 query rows tile every T the kernel takes (a multiple of BLOCK_M = 128) exactly:
        NW = 2. Then every item lies inside the sequence and a causal item's last K/V tile ends on its diagonal,
        and the kernel computes neither the grid's offset nor a rounding up (NW = 3: ``_tile_coords``)."""
        return BLOCK_M % (NW * HALF_M) == 0

    @gluon.jit
    def _tile_coords(
        bh, pid_m, H, GROUP, T, q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch, BLOCK_N: gl.constexpr, NW: gl.constexpr,
    ):  # fmt: skip
        """Descriptor coordinates of item (query tile pid_m of NW·64 rows, batch·head bh): row b·rb + h·rh + t,
        column h·ch (q and o share a layout; k and v share one). Returns (start_m, q_row, q_col, kv_row0,
        kv_col, lse_row, n_tiles), n_tiles = the K/V tiles the item reads (up to its diagonal). NW = 3:
        T is a multiple of 128, not of 192, so the item grid starts 0, 64 or 128 rows before the sequence and
        its FIRST item is the partial one (a few rows, one or two K/V tiles), never its heaviest; start_m may
        then be negative and the rows below 0 belong to nobody."""
        ROWS: gl.constexpr = NW * HALF_ROWS
        off_b = bh // H
        off_h = bh % H
        off_hk = off_h // GROUP
        if _exact(NW):
            start_m = pid_m * ROWS
        else:
            items = (T + ROWS - 1) // ROWS
            start_m = pid_m * ROWS - (items * ROWS - T)
        q_row = off_b * q_rb + off_h * q_rh + start_m
        q_col = off_h * q_ch
        kv_row0 = off_b * kv_rb + off_hk * kv_rh
        kv_col = off_hk * kv_ch
        lse_row = bh.to(gl.int64) * T + start_m
        if _exact(NW):
            n_tiles = (start_m + ROWS) // BLOCK_N
        else:
            n_tiles = (start_m + ROWS + BLOCK_N - 1) // BLOCK_N  # the last item ends at T
        return start_m, q_row, q_col, kv_row0, kv_col, lse_row, n_tiles

    @gluon.jit
    def _softmax_tile(
        s, m_i, l_i, qk_scale, start_m, start_n, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
    ):  # fmt: skip
        """One online-softmax step on the unscaled fp32 scores s = Q K_jᵀ of one warpgroup's 64 query rows (from
        start_m) and BLOCK_N keys (from start_n). Returns (p, m, l, alpha): m in the log2 domain (scores times
        qk_scale), alpha = exp2(m_old - m_new) rescales what was accumulated."""
        if start_n + BLOCK_N > start_m:  # the tile meets the diagonal: mask keys right of the query
            offs_m = start_m + gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, s_layout))
            offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(gl.expand_dims(offs_m, 1) >= gl.expand_dims(offs_n, 0), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, m_new, l_i, alpha

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
    def _consumer_loop(
        q_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, q_empty, sched, t0, sc0, n_tiles, qk_scale, start_m,
        s_layout: gl.constexpr, o_layout: gl.constexpr, dtype: gl.constexpr, HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HALF: gl.constexpr, PINGPONG: gl.constexpr,
        HALF_DIAG: gl.constexpr,
    ):  # fmt: skip
        """One warpgroup's pass over an item's n_tiles K/V tiles, ring tiles t0 .. t0 + n_tiles - 1 (slot
        t % STAGES, phase (t // STAGES) & 1). Step j issues S_j = Q K_jᵀ and O += P_{j-1} V_{j-1}; wait(1)
        retires S_j only, so the softmax of S_j overlaps the P·V wgmma; wait(0) retires P·V, then O is
        rescaled to the new max. A slot's empty barrier is arrived on once the wgmma that read it retired.
        PINGPONG: steps sc0 .. sc0 + n_tiles take turns with the other warpgroup (``_pp_enter``). q_empty is
        arrived on once the last Q Kᵀ has retired (the persistent kernel's next Q may land).
        HALF_DIAG (causal, the item's first 64 rows, whose diagonal is the first half of its last tile): the
        last tile's keys past the warpgroup's own 64 are masked for every one of its rows, so its S and P·V
        products take only the tile's first 64 keys (``_diag_only`` for a one-tile item, the end of
        ``_consumer_steps`` otherwise): half the products and exponentials of that tile. The skipped keys would
        add exact zeros (p = exp2(-inf)), so the bits are the same."""
        if HALF_DIAG:
            if n_tiles == 1:
                acc, m_i, l_i = _diag_only(
                    q_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, q_empty, sched, t0, sc0, qk_scale,
                    start_m, s_layout=s_layout, o_layout=o_layout, dtype=dtype, HEAD_DIM=HEAD_DIM, STAGES=STAGES,
                    HALF=HALF, PINGPONG=PINGPONG,
                )  # fmt: skip
            else:
                acc, m_i, l_i = _consumer_steps(
                    q_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, q_empty, sched, t0, sc0, n_tiles,
                    qk_scale, start_m, s_layout=s_layout, o_layout=o_layout, dtype=dtype, HEAD_DIM=HEAD_DIM,
                    BLOCK_N=BLOCK_N, STAGES=STAGES, HALF=HALF, PINGPONG=PINGPONG, HALF_DIAG=True,
                )  # fmt: skip
        else:
            acc, m_i, l_i = _consumer_steps(
                q_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, q_empty, sched, t0, sc0, n_tiles, qk_scale,
                start_m, s_layout=s_layout, o_layout=o_layout, dtype=dtype, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N,
                STAGES=STAGES, HALF=HALF, PINGPONG=PINGPONG, HALF_DIAG=False,
            )  # fmt: skip
        return acc, m_i, l_i

    @gluon.jit
    def _diag_only(
        q_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, q_empty, sched, t0, sc0, qk_scale, start_m,
        s_layout: gl.constexpr, o_layout: gl.constexpr, dtype: gl.constexpr, HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr, HALF: gl.constexpr, PINGPONG: gl.constexpr,
    ):  # fmt: skip
        """``_consumer_loop`` with HALF_DIAG for an item of one tile (the head's first): S and P·V over the
        tile's first 64 keys only."""
        h_layout: gl.constexpr = _acc_layout(HALF_ROWS)  # [64, 64] S: the tile's first 64 keys
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        m_i = gl.full([HALF_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, h_layout))
        l_i = gl.full([HALF_ROWS], 0.0, gl.float32, gl.SliceLayout(1, h_layout))
        acc = gl.zeros([HALF_ROWS, HEAD_DIM], gl.float32, o_layout)
        slot = t0 % STAGES
        _pp_enter(sched, sc0, HALF, PINGPONG)
        mbarrier.wait(k_full.index(slot), (t0 // STAGES) & 1)
        s = warpgroup_mma(
            q_smem,
            k_smem.index(slot).slice(0, HALF_ROWS).permute((1, 0)),
            gl.zeros([HALF_ROWS, HALF_ROWS], gl.float32, h_layout),
            use_acc=False,
            is_async=True,
        )
        _pp_leave(sched, HALF, PINGPONG)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(slot), count=1)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, start_m, start_m, h_layout, BLOCK_N=HALF_ROWS)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        mbarrier.arrive(q_empty, count=1)  # the item's only Q Kᵀ wgmma has retired
        _pp_enter(sched, sc0 + 1, HALF, PINGPONG)
        mbarrier.wait(v_full.index(slot), (t0 // STAGES) & 1)
        o_tok = warpgroup_mma(p16, v_smem.index(slot).slice(0, HALF_ROWS), acc, is_async=True)
        _pp_leave(sched, HALF, PINGPONG)
        acc, p16 = warpgroup_mma_wait(0, deps=(o_tok, p16))
        mbarrier.arrive(v_empty.index(slot), count=1)
        return (
            acc,
            gl.convert_layout(m_i, gl.SliceLayout(1, s_layout)),
            gl.convert_layout(l_i, gl.SliceLayout(1, s_layout)),
        )

    @gluon.jit
    def _consumer_steps(
        q_smem, k_smem, v_smem, k_full, v_full, k_empty, v_empty, q_empty, sched, t0, sc0, n_tiles, qk_scale, start_m,
        s_layout: gl.constexpr, o_layout: gl.constexpr, dtype: gl.constexpr, HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HALF: gl.constexpr, PINGPONG: gl.constexpr,
        HALF_DIAG: gl.constexpr,
    ):  # fmt: skip
        """``_consumer_loop``'s steps (HALF_DIAG: n_tiles >= 2, the last tile a half-width step)."""
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        m_i = gl.full([HALF_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.full([HALF_ROWS], 0.0, gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([HALF_ROWS, HEAD_DIM], gl.float32, o_layout)
        s_zero = gl.zeros([HALF_ROWS, BLOCK_N], gl.float32, s_layout)

        slot = t0 % STAGES  # step 0: scores and softmax only
        _pp_enter(sched, sc0, HALF, PINGPONG)
        mbarrier.wait(k_full.index(slot), (t0 // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        _pp_leave(sched, HALF, PINGPONG)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(slot), count=1)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, start_m, 0, s_layout, BLOCK_N=BLOCK_N)
        p16 = gl.convert_layout(p.to(dtype), p_layout)

        n_full = n_tiles - 1 if HALF_DIAG else n_tiles  # the full-width tiles
        for j in range(1, n_full):
            t = t0 + j
            slot = t % STAGES
            prev = (t - 1) % STAGES
            _pp_enter(sched, sc0 + j, HALF, PINGPONG)
            mbarrier.wait(k_full.index(slot), (t // STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_full.index(prev), ((t - 1) // STAGES) & 1)
            o_tok = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
            _pp_leave(sched, HALF, PINGPONG)
            s = warpgroup_mma_wait(1, deps=(s_tok,))
            mbarrier.arrive(k_empty.index(slot), count=1)
            p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, start_m, j * BLOCK_N, s_layout, BLOCK_N=BLOCK_N)
            p16_next = gl.convert_layout(p.to(dtype), p_layout)
            acc, p16 = warpgroup_mma_wait(0, deps=(o_tok, p16))  # P_{j-1} stays alive until its wgmma retires
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p16 = p16_next

        t_last = t0 + n_tiles - 1
        last = t_last % STAGES
        if HALF_DIAG:
            # the diagonal tile: S over its first 64 keys, issued ahead of the previous tile's P·V as above (the
            # loop's issue order written out again: a helper shared with the loop changed the SASS of every
            # variant, the measured ones included)
            h_layout: gl.constexpr = _acc_layout(HALF_ROWS)
            prev = (t_last - 1) % STAGES
            _pp_enter(sched, sc0 + n_tiles - 1, HALF, PINGPONG)
            mbarrier.wait(k_full.index(last), (t_last // STAGES) & 1)
            s_tok = warpgroup_mma(
                q_smem,
                k_smem.index(last).slice(0, HALF_ROWS).permute((1, 0)),
                gl.zeros([HALF_ROWS, HALF_ROWS], gl.float32, h_layout),
                use_acc=False,
                is_async=True,
            )
            mbarrier.wait(v_full.index(prev), ((t_last - 1) // STAGES) & 1)
            o_tok = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
            _pp_leave(sched, HALF, PINGPONG)
            s = warpgroup_mma_wait(1, deps=(s_tok,))
            mbarrier.arrive(k_empty.index(last), count=1)
            m_h = gl.convert_layout(m_i, gl.SliceLayout(1, h_layout))
            l_h = gl.convert_layout(l_i, gl.SliceLayout(1, h_layout))
            ph, mh, lh, alpha = _softmax_tile(s, m_h, l_h, qk_scale, start_m, start_m, h_layout, BLOCK_N=HALF_ROWS)
            ph16 = gl.convert_layout(ph.to(dtype), p_layout)
            acc, p16 = warpgroup_mma_wait(0, deps=(o_tok, p16))
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            m_i = gl.convert_layout(mh, gl.SliceLayout(1, s_layout))
            l_i = gl.convert_layout(lh, gl.SliceLayout(1, s_layout))
            mbarrier.arrive(q_empty, count=1)  # every Q Kᵀ wgmma of the item has retired
            _pp_enter(sched, sc0 + n_tiles, HALF, PINGPONG)
            mbarrier.wait(v_full.index(last), (t_last // STAGES) & 1)
            o_tok = warpgroup_mma(ph16, v_smem.index(last).slice(0, HALF_ROWS), acc, is_async=True)
            _pp_leave(sched, HALF, PINGPONG)
            acc, ph16 = warpgroup_mma_wait(0, deps=(o_tok, ph16))
            mbarrier.arrive(v_empty.index(last), count=1)
        else:
            mbarrier.arrive(q_empty, count=1)  # every Q Kᵀ wgmma of the item has retired
            _pp_enter(sched, sc0 + n_tiles, HALF, PINGPONG)
            mbarrier.wait(v_full.index(last), (t_last // STAGES) & 1)
            o_tok = warpgroup_mma(p16, v_smem.index(last), acc, is_async=True)
            _pp_leave(sched, HALF, PINGPONG)
            acc, p16 = warpgroup_mma_wait(0, deps=(o_tok, p16))
            mbarrier.arrive(v_empty.index(last), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _epilogue(
        acc, m_i, l_i, o_buf, o_desc, o_row, o_col, lse_ptr, lse_row, s_layout: gl.constexpr, o_layout: gl.constexpr,
        dtype: gl.constexpr,
    ):  # fmt: skip
        """o = acc / l through the shared buffer o_buf and a TMA store (left in flight: the caller waits),
        lse = (m + log2 l) · ln 2 by plain stores."""
        o = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
        o_buf.store(o.to(dtype))
        fence_async_shared()
        _cta_barrier()
        _tma_store(o_desc, [o_row, o_col], o_buf)
        lse = (m_i + gl.log2(l_i)) * _LN2  # log2 domain -> natural log
        offs = gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, s_layout))
        gl.store(lse_ptr + lse_row + offs, lse)

    @gluon.jit
    def _load_item(
        q_desc, k_desc, v_desc, q_smem, qb, q_bar, k_smem, v_smem, k_full, v_full, k_empty, v_empty, q_row, q_col,
        kv_row0, kv_col, t0, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NW: gl.constexpr,
    ):  # fmt: skip
        """The producer's work for one item: its NW 64-row Q tiles into q_smem[qb .. qb + NW) (q_bar counts
        their bytes), then every K/V tile into its ring slot (running tile t0 + j) once every consumer has
        released the slot's last tile."""
        mbarrier.expect(q_bar, NW * q_desc.block_type.nbytes)
        for w in gl.static_range(NW):
            _tma_load(q_desc, [q_row + w * HALF_ROWS, q_col], q_bar, q_smem.index(qb + w))
        for j in range(n_tiles):
            t = t0 + j
            slot = t % STAGES
            phase = ((t // STAGES) & 1) ^ 1  # the first lap passes on the fresh barriers
            mbarrier.wait(k_empty.index(slot), phase)
            mbarrier.expect(k_full.index(slot), k_desc.block_type.nbytes)
            _tma_load(k_desc, [kv_row0 + j * BLOCK_N, kv_col], k_full.index(slot), k_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), phase)
            mbarrier.expect(v_full.index(slot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [kv_row0 + j * BLOCK_N, kv_col], v_full.index(slot), v_smem.index(slot))

    @gluon.jit
    def _init_ring(k_full, v_full, k_empty, v_empty, STAGES: gl.constexpr, NW: gl.constexpr):
        for i in gl.static_range(STAGES):
            mbarrier.init(k_full.index(i), count=1)
            mbarrier.init(v_full.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=NW)  # one arrival per consumer warpgroup
            mbarrier.init(v_empty.index(i), count=NW)

    @gluon.jit
    def _items_begin(ord_off, ord_items, pid):
        """(count, first index into ord_items, the first item's code) of the program's items: program pid owns
        ord_items[ord_off[pid] .. ord_off[pid + 1]) of the host's schedule table, each code bh · n_m + pid_m."""
        base = gl.load(ord_off + pid)
        return gl.load(ord_off + pid + 1) - base, base, gl.load(ord_items + base)

    @gluon.jit
    def _items_next(ord_items, base, idx, n_loc, code, n_m):
        """(batch·head, query tile) of the program's idx-th item and the next item's code. The code of item idx
        was loaded one item ahead, so no item start waits on the table; the next one is loaded now (the table
        has one entry of padding past its end)."""
        nxt = gl.load(ord_items + base + gl.minimum(idx + 1, n_loc - 1))
        return code // n_m, code % n_m, nxt

    @gluon.jit
    def _pers_producer(
        ring, work, q_desc, k_desc, v_desc, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_Q: gl.constexpr,
        NW: gl.constexpr,
    ):  # fmt: skip
        """The TMA warp: per item, its NW Q tiles into Q slot idx % NUM_Q once every consumer released it,
        then the item's K/V tiles into the ring (running counter t, continued across items)."""
        q_smem, _, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty, _ = ring
        pid, n_m, H, GROUP, T, q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch, ord_off, ord_items = work
        t = pid * 0
        n_loc, base, code = _items_begin(ord_off, ord_items, pid)
        for idx in range(n_loc):
            bh, pid_m, code = _items_next(ord_items, base, idx, n_loc, code, n_m)
            start_m, q_row, q_col, kv_row0, kv_col, lse_row, n_tiles = _tile_coords(
                bh, pid_m, H, GROUP, T, q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch, BLOCK_N=BLOCK_N, NW=NW
            )
            qs = idx % NUM_Q
            mbarrier.wait(q_empty.index(qs), ((idx // NUM_Q) & 1) ^ 1)  # first use passes on a fresh barrier
            _load_item(
                q_desc, k_desc, v_desc, q_smem, NW * qs, q_full.index(qs), k_smem, v_smem, k_full, v_full, k_empty,
                v_empty, q_row, q_col, kv_row0, kv_col, t, n_tiles, BLOCK_N=BLOCK_N, STAGES=STAGES, NW=NW,
            )  # fmt: skip
            t += n_tiles

    @gluon.jit
    def _pers_consumer(
        ring, work, out, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_Q: gl.constexpr, PINGPONG: gl.constexpr,
        HALF: gl.constexpr, NW: gl.constexpr, HALF_DIAG: gl.constexpr,
    ):  # fmt: skip
        """Consumer warpgroup HALF: query rows 64·HALF .. +64 of every item of the program. NW = 3: its rows
        may lie before the sequence (a head's first item, ``_tile_coords``) and its diagonal may come
        before the item's last tile: it computes its own first n_mine tiles and only waits for and releases
        the rest (``_skip_tiles``)."""
        q_smem, o_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty, sched = ring
        pid, n_m, H, GROUP, T, q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch, ord_off, ord_items = work
        o_desc, lse_ptr, qk_scale = out
        dtype: gl.constexpr = q_smem.dtype
        HEAD_DIM: gl.constexpr = q_smem.shape[2]
        s_layout: gl.constexpr = _acc_layout(BLOCK_N)  # [64, BLOCK_N] S
        o_layout: gl.constexpr = _acc_layout(HEAD_DIM)  # [64, HEAD_DIM] O
        o_half = o_smem.index(HALF)
        t = pid * 0  # running K/V tile counter (ring slot and phase), continued across items
        sc = pid * 0  # running ping-pong step counter: n_tiles + 1 steps per item
        n_loc, base, code = _items_begin(ord_off, ord_items, pid)
        for idx in range(n_loc):
            bh, pid_m, code = _items_next(ord_items, base, idx, n_loc, code, n_m)
            start_m, q_row, q_col, kv_row0, kv_col, lse_row, n_tiles = _tile_coords(
                bh, pid_m, H, GROUP, T, q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch, BLOCK_N=BLOCK_N, NW=NW
            )
            qs = idx % NUM_Q
            mbarrier.wait(q_full.index(qs), (idx // NUM_Q) & 1)
            if _exact(NW):  # every row of the item in the sequence, its diagonal on the item's last tile
                acc, m_i, l_i = _consumer_loop(
                    q_smem.index(NW * qs + HALF), k_smem, v_smem, k_full, v_full, k_empty, v_empty, q_empty.index(qs),
                    sched, t, sc, n_tiles, qk_scale, start_m + HALF * HALF_ROWS, s_layout=s_layout, o_layout=o_layout,
                    dtype=dtype, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, STAGES=STAGES, HALF=HALF, PINGPONG=PINGPONG,
                    HALF_DIAG=HALF_DIAG and HALF == 0,
                )  # fmt: skip
                _store_half(
                    acc, m_i, l_i, o_half, o_desc, q_row, q_col, lse_ptr, lse_row, s_layout, o_layout, dtype, HALF
                )
            else:
                row0 = start_m + HALF * HALF_ROWS  # this warpgroup's first query row
                n_mine = gl.minimum((row0 + HALF_ROWS + BLOCK_N - 1) // BLOCK_N, n_tiles)  # up to its own diagonal
                if row0 >= 0:
                    acc, m_i, l_i = _consumer_loop(
                        q_smem.index(NW * qs + HALF), k_smem, v_smem, k_full, v_full, k_empty, v_empty,
                        q_empty.index(qs), sched, t, sc, n_mine, qk_scale, row0, s_layout=s_layout, o_layout=o_layout,
                        dtype=dtype, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, STAGES=STAGES, HALF=HALF, PINGPONG=False,
                        HALF_DIAG=False,
                    )  # fmt: skip
                    _skip_tiles(k_full, v_full, k_empty, v_empty, t, n_mine, n_tiles, STAGES)
                    _store_half(
                        acc, m_i, l_i, o_half, o_desc, q_row, q_col, lse_ptr, lse_row, s_layout, o_layout, dtype, HALF
                    )
                else:  # rows before the sequence (the first item's offset): nothing to compute or store
                    mbarrier.arrive(q_empty.index(qs), count=1)
                    _skip_tiles(k_full, v_full, k_empty, v_empty, t, 0, n_tiles, STAGES)
            t += n_tiles
            sc += n_tiles + 1
        tma.store_wait(0)

    @gluon.jit
    def _store_half(
        acc, m_i, l_i, o_half, o_desc, q_row, q_col, lse_ptr, lse_row, s_layout: gl.constexpr, o_layout: gl.constexpr,
        dtype: gl.constexpr, HALF: gl.constexpr,
    ):  # fmt: skip
        """Warpgroup HALF's rows of the item out (``_epilogue``), once the previous item's O store has finished
        reading o_half."""
        tma.store_wait(0)
        _cta_barrier()
        _epilogue(
            acc, m_i, l_i, o_half, o_desc, q_row + HALF * HALF_ROWS, q_col, lse_ptr, lse_row + HALF * HALF_ROWS,
            s_layout, o_layout, dtype,
        )  # fmt: skip

    @gluon.jit
    def _skip_tiles(k_full, v_full, k_empty, v_empty, t0, j0, n_tiles, STAGES: gl.constexpr):
        """Ring tiles t0 + j0 .. t0 + n_tiles - 1 that this warpgroup does not compute: it still releases each
        one, after its full barrier says it landed (an earlier arrival would count towards the slot's previous
        use)."""
        for j in range(j0, n_tiles):
            t = t0 + j
            slot = t % STAGES
            mbarrier.wait(k_full.index(slot), (t // STAGES) & 1)
            mbarrier.arrive(k_empty.index(slot), count=1)
            mbarrier.wait(v_full.index(slot), (t // STAGES) & 1)
            mbarrier.arrive(v_empty.index(slot), count=1)

    @gluon.jit
    def _flash_fwd_gluon_pers_kernel(
        q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, H, GROUP, T, U, n_m, q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch,
        ord_off, ord_items, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_Q: gl.constexpr,
        PINGPONG: gl.constexpr, NW: gl.constexpr, HALF_DIAG: gl.constexpr,
    ):  # fmt: skip
        """Persistent program over U = B·H·n_m items of NW·64 query rows (n_m = ceil(T / (NW·64))), grid <=
        ceil(U / 2). num_warps = 4 (default partition = consumer 0; workers: the other NW - 1 consumers (4 warps
        each), producer (1 warp))."""
        dtype: gl.constexpr = q_desc.dtype
        pid = gl.program_id(0)
        gl.static_assert(NW == 2 or not PINGPONG)
        q_smem = gl.allocate_shared_memory(dtype, [NW * NUM_Q, HALF_ROWS, HEAD_DIM], q_desc.layout)
        o_smem = gl.allocate_shared_memory(dtype, [NW, HALF_ROWS, HEAD_DIM], o_desc.layout)
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
            mbarrier.init(q_empty.index(i), count=NW)  # one arrival per consumer warpgroup
        _init_ring(k_full, v_full, k_empty, v_empty, STAGES, NW)
        for i in gl.static_range(2):
            mbarrier.init(sched.index(i), count=1)
        fence_async_shared()

        # the partitions' shared-memory buffers and barriers, and the work's place; constexprs go beside them (a
        # tuple assigned to a name holds values, not constexprs)
        ring = (q_smem, o_smem, k_smem, v_smem, q_full, q_empty, k_full, v_full, k_empty, v_empty, sched)
        work = (pid, n_m, H, GROUP, T, q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch, ord_off, ord_items)
        out = (o_desc, lse_ptr, qk_scale)
        if NW == 3:
            gl.warp_specialize(
                [
                    (_pers_consumer, (ring, work, out, BLOCK_N, STAGES, NUM_Q, False, 0, 3, False)),
                    (_pers_consumer, (ring, work, out, BLOCK_N, STAGES, NUM_Q, False, 1, 3, False)),
                    (_pers_consumer, (ring, work, out, BLOCK_N, STAGES, NUM_Q, False, 2, 3, False)),
                    (_pers_producer, (ring, work, q_desc, k_desc, v_desc, BLOCK_N, STAGES, NUM_Q, 3)),
                ],
                [4, 4, 1],
                [_CONSUMER3_REGS, _CONSUMER3_REGS, _PRODUCER_REGS],
            )
            return
        gl.warp_specialize(
            [
                (_pers_consumer, (ring, work, out, BLOCK_N, STAGES, NUM_Q, PINGPONG, 0, 2, HALF_DIAG)),
                (_pers_consumer, (ring, work, out, BLOCK_N, STAGES, NUM_Q, PINGPONG, 1, 2, HALF_DIAG)),
                (_pers_producer, (ring, work, q_desc, k_desc, v_desc, BLOCK_N, STAGES, NUM_Q, 2)),
            ],
            [4, 1],
            [_CONSUMER_REGS, _PRODUCER_REGS],
        )


# ---------------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------------
_SCHEDULES = PlanCache()  # (device, shape of the work, grid) -> (ord_off, ord_items) on the device


def item_tiles(pid_m: int, n_m: int, T: int, NW: int) -> int:
    """The K/V tiles item pid_m of a head reads (``_tile_coords``' n_tiles, on the host)."""
    rows = NW * HALF_M
    start_m = pid_m * rows - (n_m * rows - T)  # (the grid's offset: 0 for NW = 2)
    return -(-(start_m + rows) // BLOCK_N)


def schedule(BH: int, n_m: int, T: int, NW: int, G: int) -> tuple[list, list]:
    """(offsets [G + 1], codes) of the persistent grid's work: program p takes the items codes[offsets[p] ..
    offsets[p + 1]) in order, code = bh · n_m + pid_m. Items of a head in the order n_m-1, 0, n_m-2, 1, ...
    (heaviest, lightest), heads in turn; pair k = items 2k, 2k + 1 goes to program k mod G for the first
    max(0, P // G - TAIL_ROUNDS) rounds; the rest item by item, heaviest first, each to the program with the
    least work so far (ties: the lower program; an item costs its K/V tiles + ITEM_COST)."""
    U = BH * n_m
    P = (U + 1) // 2

    def code(u: int) -> int:  # global item u -> bh * n_m + pid_m
        r = u % n_m
        pid_m = r // 2 if r % 2 else n_m - 1 - r // 2
        return (u // n_m) * n_m + pid_m

    def cost(c: int) -> float:
        return item_tiles(c % n_m, n_m, T, NW) + ITEM_COST

    rounds = max(0, P // G - TAIL_ROUNDS)
    per = [[] for _ in range(G)]
    for k in range(min(P, rounds * G)):
        per[k % G] += [code(u) for u in (2 * k, 2 * k + 1) if u < U]
    heap = [(sum(cost(c) for c in per[p]), p) for p in range(G)]
    heapq.heapify(heap)
    for c in sorted((code(u) for u in range(2 * min(P, rounds * G), U)), key=lambda c: -cost(c)):  # stable
        load, p = heapq.heappop(heap)
        per[p].append(c)
        heapq.heappush(heap, (load + cost(c), p))
    offsets = [0]
    for items in per:
        offsets.append(offsets[-1] + len(items))
    return offsets, [c for items in per for c in items]


def _schedule_tensors(device, BH: int, n_m: int, T: int, NW: int, G: int):
    """``schedule`` as device int32 tensors (the codes padded by one entry: the kernel loads one item ahead),
    cached by everything that decides it."""
    key = (str(device), BH, n_m, T, NW, G)
    hit = _SCHEDULES.get(key)
    if hit is None:
        off, codes = schedule(BH, n_m, T, NW, G)
        hit = (
            torch.tensor(off, dtype=torch.int32, device=device),
            torch.tensor(codes + [0], dtype=torch.int32, device=device),
        )
        _SCHEDULES.put(key, hit)
    return hit


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether this kernel takes these inputs: Gluon present, an sm_90 GPU, bf16/fp16, D in (64, 128), T a
    multiple of 128, and q (k, v alike) in one of the two layouts of ``_row_view``."""
    if not (HAVE_GLUON and q.is_cuda) or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if capability(q.device) != (9, 0):
        return False
    B, H, T, D = q.shape
    if D not in HEAD_DIMS or T % BLOCK_M or T == 0:
        return False
    if k.stride() != v.stride():
        return False
    return _row_view(q) is not None and _row_view(k) is not None


def _launch(q, k, v, o, lse, scale: float, config: GluonFwdConfig, n_prog: int):
    """(kernel, grid, runtime args, constexpr args) of ``config``; q/k/v/o CUDA tensors, or CPU tensors standing
    in for their shapes and strides (``compile_sm90``). n_prog: the persistent grid's cap."""
    B, H, T, D = q.shape
    NW = config.warpgroups
    if NW not in (2, 3) or (NW == 3 and (D != 64 or config.half_diag)):
        raise ValueError(f"flash_attention_fwd_gluon: 3 warpgroups take D = 64 and no half_diag, got {config}, D={D}")
    q2, q_coords = row_coords("q", q)  # (o shares q's layout, v k's)
    k2, kv_coords = row_coords("kv", k)
    v2, o2 = _row_view(v)[0], _row_view(o)[0]
    n_m = -(-T // (NW * HALF_M))  # items per head (NW = 3: the last may hold fewer than 192 rows)
    U = B * H * n_m  # work items; programs take them in pairs, so more than ceil(U / 2) would idle
    grid = (max(1, min(n_prog, (U + 1) // 2)),)
    ord_off, ord_items = _schedule_tensors(q.device, B * H, n_m, T, NW, grid[0])
    args = dict(q_desc=_desc(q2, HALF_M, D), k_desc=_desc(k2, BLOCK_N, D), v_desc=_desc(v2, BLOCK_N, D))
    args.update(o_desc=_desc(o2, HALF_M, D), lse_ptr=lse, qk_scale=scale * LOG2E, H=H, GROUP=H // k.shape[1], T=T)
    args.update(U=U, n_m=n_m, **q_coords, **kv_coords, ord_off=ord_off, ord_items=ord_items)
    consts = dict(HEAD_DIM=D, BLOCK_N=BLOCK_N, STAGES=config.stages, NUM_Q=config.num_q, PINGPONG=config.pingpong)
    consts.update(NW=NW, HALF_DIAG=config.half_diag)
    return _flash_fwd_gluon_pers_kernel, grid, args, consts


def flash_attention_fwd_gluon(
    q,
    k,
    v,
    causal: bool = True,
    scale: float | None = None,
    *,
    config: GluonFwdConfig,
    o=None,
    lse=None,
    programs: int | None = None,
    checked: bool = False,
    plan: bool = False,
):
    """Launch the Gluon forward of ``config`` (causal only: the routing never sends a non-causal call here). q, k, v
    must share a dtype; ``o``/``lse``: optional output buffers, o in q's layout, lse contiguous fp32. ``programs``: the
    persistent grid (None: the device's SM count). ``checked``: the caller has just seen ``supported(q, k, v)`` hold.
    ``plan``: also return a ``_FwdPlan`` that repeats this launch for inputs of the same signature (o and lse must then
    be left to this function)."""
    op = "flash_attention_fwd_gluon"
    if not causal:
        raise ValueError(f"{op}: causal attention only (non-causal calls run the Triton kernel), got causal=False")
    if plan and (o is not None or lse is not None):
        raise ValueError(f"{op}: plan=True allocates o and lse itself; got buffers")
    if not checked and not supported(q, k, v):
        raise ValueError(
            f"{op}: needs bf16/fp16 q, k, v on an sm_90 GPU, D in {HEAD_DIMS}, T a multiple of "
            f"{BLOCK_M}, contiguous or [B, T, H, D]-transposed layouts; got q {tuple(q.shape)} "
            f"{q.dtype} strides {q.stride()}, k {tuple(k.shape)} strides {k.stride()}"
        )
    B, H, T, D = q.shape
    s = _scale(op, scale, D)
    if o is None:  # o in q's layout, so one set of descriptor coordinates serves both
        o = (
            torch.empty_like(q)
            if q.is_contiguous()
            else torch.empty(B, T, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
        )
    if o.shape != q.shape or o.dtype != q.dtype or o.stride() != q.stride():
        raise ValueError(
            f"{op}: o must be like q (shape, dtype, strides), got {tuple(o.shape)} {o.dtype} "
            f"strides {o.stride()} vs q strides {q.stride()}"
        )
    if lse is None:
        lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    if lse.shape != (B, H, T) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"{op}: lse must be contiguous fp32 [B, H, T], got {tuple(lse.shape)} {lse.dtype}")
    kernel, grid, args, consts = _launch(q, k, v, o, lse, s, config, programs or sm_count(q.device))
    if not plan:
        kernel[grid](**args, **consts, num_warps=4)
        return o, lse
    launch = launch_cached(kernel, grid, {**args, **consts}, num_warps=4)
    return o, lse, _FwdPlan(launch, args, q)


class _FwdPlan:
    """``flash_attention_fwd_gluon`` for one signature of inputs (shapes, strides, dtype, device, scale), its host
    work done once: calling it allocates o and lse, re-bases the four TMA descriptors on the new tensors and
    launches the compiled kernel directly (``_dispatch.CachedLaunch``)."""

    __slots__ = ("launch", "descs", "shape", "contiguous", "table")

    def __init__(self, launch, args: dict, q: torch.Tensor):
        self.launch = launch
        self.descs = descriptor_templates(args)
        self.shape = tuple(q.shape)
        self.contiguous = q.is_contiguous()
        self.table = {n: args[n] for n in ("ord_off", "ord_items")}  # the schedule, kept alive here

    def __call__(self, q, k, v):
        B, H, T, D = self.shape
        o = (
            torch.empty_like(q)
            if self.contiguous
            else torch.empty(B, T, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
        )
        lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
        self.launch(**self.table, lse_ptr=lse, **rebase_all(self.descs, {"q": q, "k": k, "v": v, "o": o}))
        return o, lse


def compile_sm90(D: int, config: GluonFwdConfig, transposed_kv: bool = False):
    """Compile ``config`` for sm_90 without a GPU (CPU tensors stand in for the descriptors' shapes): the CI check
    that a Triton upgrade has not broken it. Returns the compiled kernel (its .asm["ptx"])."""
    B, H, Hkv, T = 1, 4, 2, 256
    q = torch.empty(B, H, T, D, dtype=torch.bfloat16)
    kv = (
        torch.empty(B, T, Hkv, D, dtype=torch.bfloat16).transpose(1, 2)
        if transposed_kv
        else torch.empty(B, Hkv, T, D, dtype=torch.bfloat16)
    )
    lse = torch.empty(B, H, T)
    kernel, _, args, consts = _launch(q, kv, kv, q, lse, D**-0.5, config, 132)
    return _compile(kernel, args, consts)
