"""Flash-attention forward for Hopper (sm_90) in Gluon: persistent, warp-specialised, TMA-fed, async wgmma.

Same contract as ``flash_attention.flash_attention_fwd_triton`` (q [B, H, T, D], k/v [B, Hkv, T, D], query
head h reads K/V head h // (H // Hkv); returns o in q.dtype and lse [B, H, T], the natural-log row
logsumexp in fp32), for what it takes: bf16/fp16, D in (64, 128), T a multiple of 128, on an sm_90 GPU.
``flash_attention.flash_attention_fwd_triton`` sends such calls here where it measured faster (its
``GLUON_FWD_MIN_T`` table); everything else stays on the Triton kernel. The oracle is the plain-torch tiled
reference of the same algorithm, ``flash_attention_fwd_ref`` (``reference`` below is that function).

Gluon (``triton.experimental.gluon``, shipped with recent Triton; tested with 3.6 and 3.9) is Triton's
lower-level dialect: the kernel states its own register layouts, shared-memory allocations, TMA copies,
mbarriers, warpgroup MMAs and warp specialisation, which plain Triton decides for itself. It has no CPU
interpreter, so these kernels are checked on the GPU only (tests/test_flash_attention.py, ``gpu``); on CPU the
tests compile every variant for sm_90 (no GPU needed) so a Triton upgrade that breaks one shows up in CI.

Design, after FlashAttention-3 (Shah, Bikshandi, Zhang, Thakkar, Ramani & Dao, 2024: producer/consumer
warpgroups, intra-warpgroup overlap, ping-pong scheduling, a persistent tile scheduler), in the idioms of
the Gluon tutorials of the Triton repository (TMA, wgmma, warp specialisation, persistent kernels); the
code is this project's own. A work item is BLOCK_M = 128 query rows of one (batch, head); three partitions
share it:
  * a producer warp (24 registers) that issues every TMA copy: the two 64-row halves of the Q tile, then
    the K and V tiles of the item's causal range into a STAGES-deep ring of shared-memory slots, each slot
    guarded by a "full" mbarrier (TMA transaction bytes) and an "empty" one (released by both consumers);
  * two consumer warpgroups (4 warps each, up to 232 registers), one per 64-row half of the query tile.
    Each runs the online softmax of FlashAttention in the base-2 domain (log2(e) folded into the scale,
    exp2 throughout) and overlaps it with the tensor cores: step j issues S_j = Q K_jᵀ and then
    O += P_{j-1} V_{j-1} as async wgmmas, retires S_j alone (wgmma groups retire in order), computes the
    softmax of S_j while P·V still runs, then retires P·V and rescales O. P is rounded to 16 bits in
    registers and fed to the P·V wgmma as its register operand: it never touches shared memory.
  * Causal: the K/V tiles left of the diagonal run unmasked; only the tile on the diagonal pays for the
    mask. Up to ``HALF_DIAG_MAX_T``, the first warpgroup's diagonal step takes the tile's first 64 keys only
    (the rest are masked for all of its rows): hd64 T = 1k 1.006 -> 1.035x cuDNN, hd128 1k 1.014 -> 1.033x.
    The output is normalised in registers and leaves by a TMA store; lse by plain stores.

Two kernels run that design (``VARIANTS``):
  lib   one program per item, grid (T / 128, B·H), heaviest query tiles first; O leaves through the (dead)
        Q slot. Every program pays its prologue (barrier init, partition start, the Q load, the first K/V
        tiles) and epilogue with nothing to overlap them, which costs at short T (T = 1k: 1..8 K/V tiles
        per item).
  pers  PERSISTENT: grid = the number of SMs; each program walks a static list of items, and the mbarrier
        phases run on across items: the K/V ring keeps one running tile counter t (slot t % STAGES, phase
        (t // STAGES) & 1) in the producer and both consumers; Q has its own full/empty pair and is
        released as soon as the item's last S = Q Kᵀ has retired, so the producer loads the next item's Q
        and K/V while the consumers finish the last P·V and the epilogue; O leaves through a buffer of its
        own whose TMA store is waited for only before that buffer is written again, one item later.
        Schedule: with n_m = T / 128 query tiles, the items of a head are ordered heaviest/lightest
        alternately (tiles n_m-1, 0, n_m-2, 1, ...), heads one after another; the list is cut into pairs of
        consecutive items (causal: every pair costs n_m + 1 K/V tiles) and pair k goes to program k mod G.
        Pairs of equal cost make the static round-robin balanced (FA3 uses a dynamic scheduler with an
        atomic counter instead) and deterministic; head-major order keeps the G programs in flight on
        about G / (n_m / 2) consecutive heads, so a head's K/V comes from DRAM about once and from L2 for
        its other query tiles (a tile-major order would sweep 128 MB of K/V between two reads of one head
        at the bench shapes, against 50 MB of L2).
        The last round of pairs is where this loses (session 8): at T = 1k and B·H = 512, 2048 pairs on 132
        programs leave 68 programs a 16th pair while 64 idle (3 % of the kernel). So by default
        (``SCHEDULE = "tail"``) the host writes the order as a table (``schedule``; the kernel's TABLE
        path reads it, each item's code loaded one item ahead): the pairs' rounds as above except the last
        SCHED_TAIL_ROUNDS full rounds and the partial one, whose items are dealt one by one, heaviest
        first, to the program with the least work so far (longest-processing-time first; an item costs
        its K/V tiles + 1). Those items come from the last heads only, so L2 still serves their K/V.
        H200, `bench/gluon_fwd_schedule.py` at the bench shapes, x cuDNN, pairs -> tail: hd64 q2 T = 1k
        0.95 -> 1.00, 2k 0.98 -> 1.04, 4k w3 1.01 -> 1.04, 8k w3 1.00 -> 1.08; hd128 q2pp 2k-8k +1-3 %.
        The same dealing for every item ("lpt") lost 1-12 %: it scatters a head's items over the whole
        run, so their K/V come from DRAM each time.
  q2    pers with two Q buffers: the next item's Q lands while the current item still runs (hd128: 224 KB
        of shared memory, just under the 227 KB limit).
  pp    pers with FA3's enforced ping-pong of the two consumer warpgroups: one issues its wgmmas while the
        other runs its softmax. Gluon 3.6 exposes no named barrier (bar.sync id), so the hand-off is two
        mbarriers (count 1): a warpgroup waits on its own before issuing a step's wgmmas and arrives on the
        other's once they are issued; warpgroup 0 starts on the free "previous phase" of a fresh barrier.
        Each item takes n + 1 steps (S_0 | S_j + P_{j-1}V_{j-1}, j = 1..n-1 | P_{n-1}V_{n-1}) in both
        warpgroups, so the alternation holds across items. (lib and pers let the warpgroups drift apart
        instead, which overlaps them less reliably.)
  q2pp  both.
  w3    q2 with THREE consumer warpgroups and 192-row items (FlashAttention-3's hd64 tile: kBlockM = 192),
        hd64 only (``VARIANT_HEAD_DIMS``): 160-168 registers each. T being a multiple of 128, the item grid
        of a head starts 0, 64 or 128 rows before the sequence, so its first item is the partial one: the
        warpgroups whose rows lie before 0 compute nothing and only release Q and each K/V tile after it
        lands (``_skip_tiles``: an earlier arrival would count towards the slot's previous use); causal,
        each warpgroup computes the tiles up to its own diagonal and skips the rest.
The schedule and the barrier protocol were replayed on CPU before the first GPU run (bench/gluon_flash_fwd.py
--replay: random interleavings and TMA latencies, coverage, balance, negative controls).

H200, causal bf16, B·T = 16k, H·D = 2048, TFLOP/s ratio to cuDNN at T = 1k / 2k / 4k / 8k / 16k
(bench/RESULTS.md, third round; the spread between processes is up to ~0.1 at short T):
  hd64:  lib 0.78/0.90/0.92/0.97/1.03  pers 0.86/0.96/0.96/0.99/1.03  q2 0.94/1.02/0.97/0.98/1.05
         pp 0.91/0.99/0.95/0.99/1.02  q2pp 0.93/1.02/0.97/0.91/0.93  (Triton kernel 0.86/0.91/0.88/0.92/0.96)
  hd128: lib 0.89/0.94/1.07/1.06/1.08  pers 0.77/1.08/1.07/1.09/1.06  q2 0.69/1.07/1.06/1.09/1.07
         pp 1.02/1.09/1.07/1.08/1.07  q2pp 0.68/1.12/1.12/1.10/1.09  (Triton kernel 0.82/0.80/0.84/0.90/0.90)
Session 5, same process (bench/gluon_flash_fwd.py --variants q2,w3 --head-dims 64): hd64 q2 0.95 / 0.98 /
1.00 / 0.99 / 1.01, w3 0.60 / 0.76 / 0.98 / 1.04 / 1.07 with the partial item last; with the grid shifted
so it comes first, another run: q2 0.95 / 0.99 / 1.02 / 1.02 / 0.99, w3 0.62 / 0.69 / 1.03 / 1.02 / 1.04
(short T: the cause was not found; bench/RESULTS.md, fifth round). Session 7, three processes at T = 2k / 4k:
q2 0.98 / 0.99-1.00, w3 0.68 / 1.01 every time.
So ``VARIANT_BY_T`` picks q2 at hd64 up to T = 2k and w3 above, and, at hd128, pp up to T = 1k
and q2pp above (at hd128 T = 1k both two-Q-buffer variants fall to 0.68-0.69x; the cause was not
profiled). Measured and slower (code in git history): one 8-warp consumer partition (0.62-0.87x), no warp
specialisation with and without the wgmma/softmax overlap (0.63-0.91x), 64-wide K/V tiles in the per-item
kernel (0.62-0.96x) and in the persistent one (4 slots, 0.73-0.99x; bench/gluon_flash_fwd.py at commit
7e733b1). Not tried: FA3's 176/192-wide K/V tiles at hd128 (Gluon's TensorDescriptor and register tensors
want power-of-two shapes; it would take S as two wgmmas over three 64-row copies per tile).

Tensor layouts: the TMA descriptors are 2-D row views. A contiguous [B, Hx, T, D] tensor is the view
[B·Hx·T, D] (row of (b, h, t) = (b·Hx + h)·T + t, column 0); a [B, T, Hx, D] tensor seen as [B, Hx, T, D]
through a transpose (the model's v) is the view [B·T, Hx·D] (row b·T + t, column h·D). Either way a
tile of 64 or 128 rows never straddles two heads, since T is a multiple of 128.
"""

from __future__ import annotations

import math

import torch

try:  # Gluon and its Hopper module (tested: triton 3.6 on the GPU machines, 3.9 here)
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

from xtrain.kernels._dispatch import PlanCache, capability, launch_cached, rebased, sm_count  # noqa: E402
from xtrain.kernels.flash_attention import flash_attention_fwd_ref  # noqa: E402

reference = flash_attention_fwd_ref  # the oracle: the plain-torch tiled reference of the same algorithm

BLOCK_M = 128  # query rows per work item (two warpgroups of 64)
HALF_M = 64
BLOCK_N = 128  # K/V rows per tile
HEAD_DIMS = (64, 128)
CONSUMER_REGS = 232  # registers per thread of the second consumer partition (setmaxnreg)
PRODUCER_REGS = 24
CONSUMER3_REGS = 160  # the two worker consumers when three consumer warpgroups share the 512 (NW = 3)
LOG2E = 1.4426950408889634  # 1 / ln 2

if HAVE_GLUON:
    # Gluon renamed a few builtins after 3.6; module-level aliases resolve as globals inside @gluon.jit
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    HALF_ROWS = gl.constexpr(HALF_M)  # globals a @gluon.jit body reads must be constexpr objects
    _CONSUMER_REGS = gl.constexpr(CONSUMER_REGS)
    _CONSUMER3_REGS = gl.constexpr(CONSUMER3_REGS)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)

    @gluon.constexpr_function
    def _mma_layouts(BLOCK_N, HEAD_DIM):
        """wgmma accumulator layouts of one warpgroup: S [64, BLOCK_N] and O [64, HEAD_DIM]."""
        s_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
        return s_layout, o_layout

    @gluon.jit
    def _tile_coords(
        bh,
        pid_m,
        H,
        GROUP,
        T,
        q_rb,
        q_rh,
        q_ch,
        kv_rb,
        kv_rh,
        kv_ch,
        BLOCK_N: gl.constexpr,
        CAUSAL: gl.constexpr,
        NW: gl.constexpr = 2,
    ):
        """Descriptor coordinates of item (query tile pid_m of NW·64 rows, batch·head bh): row b·rb + h·rh + t,
        column h·ch (q and o share a layout; k and v share one). Returns (start_m, q_row, q_col, kv_row0,
        kv_col, lse_row, n_tiles), n_tiles = the K/V tiles the item reads (causal: up to its diagonal). NW = 3:
        T is a multiple of 128, not of 192, so the item grid starts 0, 64 or 128 rows before the sequence and
        its FIRST item is the partial one (a few rows, one or two K/V tiles), never its heaviest; start_m may
        then be negative and the rows below 0 belong to nobody."""
        off_b = bh // H
        off_h = bh % H
        off_hk = off_h // GROUP
        if NW == 2:  # (the NW = 2 forms keep the measured two-warpgroup kernels' code as it was)
            start_m = pid_m * (NW * HALF_ROWS)
        else:
            items = (T + NW * HALF_ROWS - 1) // (NW * HALF_ROWS)
            start_m = pid_m * (NW * HALF_ROWS) - (items * NW * HALF_ROWS - T)
        q_row = off_b * q_rb + off_h * q_rh + start_m
        q_col = off_h * q_ch
        kv_row0 = off_b * kv_rb + off_hk * kv_rh
        kv_col = off_hk * kv_ch
        lse_row = bh.to(gl.int64) * T + start_m
        if CAUSAL:
            if NW == 2:
                n_tiles = (start_m + 2 * HALF_ROWS) // BLOCK_N
            else:
                n_tiles = (start_m + NW * HALF_ROWS + BLOCK_N - 1) // BLOCK_N  # the last item ends at T
        else:
            n_tiles = T // BLOCK_N
        return start_m, q_row, q_col, kv_row0, kv_col, lse_row, n_tiles

    @gluon.jit
    def _softmax_tile(
        s,
        m_i,
        l_i,
        qk_scale,
        start_m,
        start_n,
        s_layout: gl.constexpr,
        ROWS: gl.constexpr,
        BLOCK_N: gl.constexpr,
        CAUSAL: gl.constexpr,
    ):
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
        q_smem,
        k_smem,
        v_smem,
        k_full,
        v_full,
        k_empty,
        v_empty,
        q_empty,
        sched,
        t0,
        sc0,
        n_tiles,
        qk_scale,
        start_m,
        s_layout: gl.constexpr,
        o_layout: gl.constexpr,
        dtype: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        HALF: gl.constexpr,
        PINGPONG: gl.constexpr,
        RELEASE_Q: gl.constexpr,
        HALF_DIAG: gl.constexpr = False,
    ):
        """One warpgroup's pass over an item's n_tiles K/V tiles, ring tiles t0 .. t0 + n_tiles - 1 (slot
        t % STAGES, phase (t // STAGES) & 1). Step j issues S_j = Q K_jᵀ and O += P_{j-1} V_{j-1}; wait(1)
        retires S_j only, so the softmax of S_j overlaps the P·V wgmma; wait(0) retires P·V, then O is
        rescaled to the new max. A slot's empty barrier is arrived on once the wgmma that read it retired.
        PINGPONG: steps sc0 .. sc0 + n_tiles take turns with the other warpgroup (``_pp_enter``). RELEASE_Q:
        arrive on q_empty once the last Q Kᵀ has retired (the persistent kernel's next Q may land).
        HALF_DIAG (causal, the item's first 64 rows, whose diagonal is the first half of its last tile): the
        last tile's keys past the warpgroup's own 64 are masked for every one of its rows, so its S and P·V
        products take only the tile's first 64 keys (``_diag_only`` for a one-tile item, the end of
        ``_consumer_steps`` otherwise): half the products and exponentials of that tile. The skipped keys would
        add exact zeros (p = exp2(-inf)), so the bits are the same."""
        if HALF_DIAG:
            if n_tiles == 1:
                acc, m_i, l_i = _diag_only(
                    q_smem,
                    k_smem,
                    v_smem,
                    k_full,
                    v_full,
                    k_empty,
                    v_empty,
                    q_empty,
                    sched,
                    t0,
                    sc0,
                    qk_scale,
                    start_m,
                    s_layout,
                    o_layout,
                    dtype,
                    HEAD_DIM,
                    STAGES,
                    HALF,
                    PINGPONG,
                    RELEASE_Q,
                )
            else:
                acc, m_i, l_i = _consumer_steps(
                    q_smem,
                    k_smem,
                    v_smem,
                    k_full,
                    v_full,
                    k_empty,
                    v_empty,
                    q_empty,
                    sched,
                    t0,
                    sc0,
                    n_tiles,
                    qk_scale,
                    start_m,
                    s_layout,
                    o_layout,
                    dtype,
                    HEAD_DIM,
                    BLOCK_N,
                    STAGES,
                    CAUSAL,
                    HALF,
                    PINGPONG,
                    RELEASE_Q,
                    True,
                )
        else:
            acc, m_i, l_i = _consumer_steps(
                q_smem,
                k_smem,
                v_smem,
                k_full,
                v_full,
                k_empty,
                v_empty,
                q_empty,
                sched,
                t0,
                sc0,
                n_tiles,
                qk_scale,
                start_m,
                s_layout,
                o_layout,
                dtype,
                HEAD_DIM,
                BLOCK_N,
                STAGES,
                CAUSAL,
                HALF,
                PINGPONG,
                RELEASE_Q,
                False,
            )
        return acc, m_i, l_i

    @gluon.constexpr_function
    def _half_layout():
        """The wgmma accumulator layout of a [64, 64] S (the half-width diagonal step)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_M, 16])

    @gluon.jit
    def _diag_only(
        q_smem,
        k_smem,
        v_smem,
        k_full,
        v_full,
        k_empty,
        v_empty,
        q_empty,
        sched,
        t0,
        sc0,
        qk_scale,
        start_m,
        s_layout: gl.constexpr,
        o_layout: gl.constexpr,
        dtype: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
        HALF: gl.constexpr,
        PINGPONG: gl.constexpr,
        RELEASE_Q: gl.constexpr,
    ):
        """``_consumer_loop`` with HALF_DIAG for an item of one tile (the head's first): S and P·V over the
        tile's first 64 keys only."""
        h_layout: gl.constexpr = _half_layout()
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
        p, m_i, l_i, alpha = _softmax_tile(
            s, m_i, l_i, qk_scale, start_m, start_m, h_layout, HALF_ROWS, HALF_ROWS, True
        )
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        if RELEASE_Q:
            mbarrier.arrive(q_empty, count=1)
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
        q_smem,
        k_smem,
        v_smem,
        k_full,
        v_full,
        k_empty,
        v_empty,
        q_empty,
        sched,
        t0,
        sc0,
        n_tiles,
        qk_scale,
        start_m,
        s_layout: gl.constexpr,
        o_layout: gl.constexpr,
        dtype: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        HALF: gl.constexpr,
        PINGPONG: gl.constexpr,
        RELEASE_Q: gl.constexpr,
        HALF_DIAG: gl.constexpr,
    ):
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
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, start_m, 0, s_layout, HALF_ROWS, BLOCK_N, CAUSAL)
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
            p, m_i, l_i, alpha = _softmax_tile(
                s, m_i, l_i, qk_scale, start_m, j * BLOCK_N, s_layout, HALF_ROWS, BLOCK_N, CAUSAL
            )
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
            # variant, the measured ones included, in session 17, when no GPU was left to time it)
            h_layout: gl.constexpr = _half_layout()
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
            ph, mh, lh, alpha = _softmax_tile(
                s,
                gl.convert_layout(m_i, gl.SliceLayout(1, h_layout)),
                gl.convert_layout(l_i, gl.SliceLayout(1, h_layout)),
                qk_scale,
                start_m,
                start_m,
                h_layout,
                HALF_ROWS,
                HALF_ROWS,
                True,
            )
            ph16 = gl.convert_layout(ph.to(dtype), p_layout)
            acc, p16 = warpgroup_mma_wait(0, deps=(o_tok, p16))
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            m_i = gl.convert_layout(mh, gl.SliceLayout(1, s_layout))
            l_i = gl.convert_layout(lh, gl.SliceLayout(1, s_layout))
            if RELEASE_Q:  # every Q Kᵀ wgmma of the item has retired
                mbarrier.arrive(q_empty, count=1)
            _pp_enter(sched, sc0 + n_tiles, HALF, PINGPONG)
            mbarrier.wait(v_full.index(last), (t_last // STAGES) & 1)
            o_tok = warpgroup_mma(ph16, v_smem.index(last).slice(0, HALF_ROWS), acc, is_async=True)
            _pp_leave(sched, HALF, PINGPONG)
            acc, ph16 = warpgroup_mma_wait(0, deps=(o_tok, ph16))
            mbarrier.arrive(v_empty.index(last), count=1)
        else:
            if RELEASE_Q:  # every Q Kᵀ wgmma of the item has retired
                mbarrier.arrive(q_empty, count=1)
            _pp_enter(sched, sc0 + n_tiles, HALF, PINGPONG)
            mbarrier.wait(v_full.index(last), (t_last // STAGES) & 1)
            o_tok = warpgroup_mma(p16, v_smem.index(last), acc, is_async=True)
            _pp_leave(sched, HALF, PINGPONG)
            acc, p16 = warpgroup_mma_wait(0, deps=(o_tok, p16))
            mbarrier.arrive(v_empty.index(last), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _epilogue(
        acc,
        m_i,
        l_i,
        o_buf,
        o_desc,
        o_row,
        o_col,
        lse_ptr,
        lse_row,
        s_layout: gl.constexpr,
        o_layout: gl.constexpr,
        dtype: gl.constexpr,
    ):
        """o = acc / l through the shared buffer o_buf and a TMA store (left in flight: the caller waits),
        lse = (m + log2 l) · ln 2 by plain stores."""
        o = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
        o_buf.store(o.to(dtype))
        fence_async_shared()
        _cta_barrier()
        _tma_store(o_desc, [o_row, o_col], o_buf)
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453  # ln 2
        offs = gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, s_layout))
        gl.store(lse_ptr + lse_row + offs, lse)

    @gluon.jit
    def _load_item(
        q_desc,
        k_desc,
        v_desc,
        q_smem,
        qb,
        q_bar,
        k_smem,
        v_smem,
        k_full,
        v_full,
        k_empty,
        v_empty,
        q_row,
        q_col,
        kv_row0,
        kv_col,
        t0,
        n_tiles,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        NW: gl.constexpr = 2,
    ):
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
    def _init_ring(k_full, v_full, k_empty, v_empty, STAGES: gl.constexpr, NW: gl.constexpr = 2):
        for i in gl.static_range(STAGES):
            mbarrier.init(k_full.index(i), count=1)
            mbarrier.init(v_full.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=NW)  # one arrival per consumer warpgroup
            mbarrier.init(v_empty.index(i), count=NW)

    # ---- lib: one program per item ------------------------------------------------------------------------
    @gluon.jit
    def _producer(
        q_desc,
        k_desc,
        v_desc,
        q_smem,
        k_smem,
        v_smem,
        q_bar,
        k_full,
        v_full,
        k_empty,
        v_empty,
        q_row,
        q_col,
        kv_row0,
        kv_col,
        n_tiles,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        _load_item(
            q_desc,
            k_desc,
            v_desc,
            q_smem,
            0,
            q_bar,
            k_smem,
            v_smem,
            k_full,
            v_full,
            k_empty,
            v_empty,
            q_row,
            q_col,
            kv_row0,
            kv_col,
            0,
            n_tiles,
            BLOCK_N,
            STAGES,
        )

    @gluon.jit
    def _consumer(
        q_smem,
        k_smem,
        v_smem,
        q_bar,
        k_full,
        v_full,
        k_empty,
        v_empty,
        o_desc,
        lse_ptr,
        q_row,
        q_col,
        lse_row,
        n_tiles,
        qk_scale,
        start_m,
        dtype: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        HALF: gl.constexpr,
    ):
        """One warpgroup: query rows [start_m + 64·HALF, +64) of the program's 128; O leaves through the
        warpgroup's (dead) Q half."""
        layouts: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM)
        s_layout: gl.constexpr = layouts[0]
        o_layout: gl.constexpr = layouts[1]
        q_half = q_smem.index(HALF)
        mbarrier.wait(q_bar, 0)
        acc, m_i, l_i = _consumer_loop(
            q_half,
            k_smem,
            v_smem,
            k_full,
            v_full,
            k_empty,
            v_empty,
            None,
            None,
            0,
            0,
            n_tiles,
            qk_scale,
            start_m + HALF * HALF_ROWS,
            s_layout,
            o_layout,
            dtype,
            HEAD_DIM,
            BLOCK_N,
            STAGES,
            CAUSAL,
            HALF,
            False,
            False,
        )
        _epilogue(
            acc,
            m_i,
            l_i,
            q_half,
            o_desc,
            q_row + HALF * HALF_ROWS,
            q_col,
            lse_ptr,
            lse_row + HALF * HALF_ROWS,
            s_layout,
            o_layout,
            dtype,
        )
        tma.store_wait(0)

    @gluon.jit
    def _flash_fwd_gluon_kernel(
        q_desc,
        k_desc,
        v_desc,
        o_desc,
        lse_ptr,
        qk_scale,
        H,
        GROUP,
        T,
        q_rb,
        q_rh,
        q_ch,
        kv_rb,
        kv_rh,
        kv_ch,
        HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
    ):
        """Program (query tile, batch·head). num_warps = 4: the default partition is consumer warpgroup 0,
        the workers are consumer warpgroup 1 and the producer warp."""
        dtype: gl.constexpr = q_desc.dtype
        pid_m = gl.program_id(0)
        if CAUSAL:  # heaviest query tiles first: the short diagonal programs fill the tail of the grid
            pid_m = gl.num_programs(0) - 1 - pid_m
        start_m, q_row, q_col, kv_row0, kv_col, lse_row, n_tiles = _tile_coords(
            gl.program_id(1), pid_m, H, GROUP, T, q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch, BLOCK_N, CAUSAL
        )

        q_smem = gl.allocate_shared_memory(dtype, [2, HALF_ROWS, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        _init_ring(k_full, v_full, k_empty, v_empty, STAGES)
        fence_async_shared()

        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        q_smem,
                        k_smem,
                        v_smem,
                        q_bar,
                        k_full,
                        v_full,
                        k_empty,
                        v_empty,
                        o_desc,
                        lse_ptr,
                        q_row,
                        q_col,
                        lse_row,
                        n_tiles,
                        qk_scale,
                        start_m,
                        dtype,
                        HEAD_DIM,
                        BLOCK_N,
                        STAGES,
                        CAUSAL,
                        0,
                    ),
                ),
                (
                    _consumer,
                    (
                        q_smem,
                        k_smem,
                        v_smem,
                        q_bar,
                        k_full,
                        v_full,
                        k_empty,
                        v_empty,
                        o_desc,
                        lse_ptr,
                        q_row,
                        q_col,
                        lse_row,
                        n_tiles,
                        qk_scale,
                        start_m,
                        dtype,
                        HEAD_DIM,
                        BLOCK_N,
                        STAGES,
                        CAUSAL,
                        1,
                    ),
                ),
                (
                    _producer,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        q_smem,
                        k_smem,
                        v_smem,
                        q_bar,
                        k_full,
                        v_full,
                        k_empty,
                        v_empty,
                        q_row,
                        q_col,
                        kv_row0,
                        kv_col,
                        n_tiles,
                        BLOCK_N,
                        STAGES,
                    ),
                ),
            ],
            [4, 1],
            [_CONSUMER_REGS, _PRODUCER_REGS],
        )  # worker_num_regs: required by Gluon 3.6

    # ---- pers, q2, pp, q2pp: persistent programs ----------------------------------------------------------
    @gluon.jit
    def _n_local(pid, n_prog, U):
        """Items of program pid: it owns pairs k = pid, pid + n_prog, ... of the U items (pair k = items 2k,
        2k + 1); the last pair is a single item when U is odd. The host launches n_prog <= pairs."""
        n_pairs = (U + 1) // 2
        m_count = (n_pairs - pid + n_prog - 1) // n_prog
        last = pid + (m_count - 1) * n_prog
        return 2 * m_count - (U % 2) * (last == n_pairs - 1).to(gl.int32)

    @gluon.jit
    def _item(idx, pid, n_prog, n_m):
        """(batch·head, query tile) of the program's idx-th item: global item u = 2·(pid + (idx // 2)·n_prog)
        + idx % 2, head u // n_m, and the r-th tile of the order n_m-1, 0, n_m-2, 1, ... (r = u % n_m)."""
        u = 2 * (pid + (idx // 2) * n_prog) + idx % 2
        r = u % n_m
        odd = r % 2
        return u // n_m, odd * (r // 2) + (1 - odd) * (n_m - 1 - r // 2)

    @gluon.jit
    def _items_begin(ord_off, ord_items, pid, n_prog, U, TABLE: gl.constexpr):
        """(count, first index into ord_items, the first item's code) of the program's items: from the host's
        schedule table (TABLE: program pid owns ord_items[ord_off[pid] .. ord_off[pid + 1]), each code
        bh · n_m + pid_m, see ``schedule``) or from the pair rule of ``_n_local`` / ``_item``."""
        if TABLE:
            base = gl.load(ord_off + pid)
            return gl.load(ord_off + pid + 1) - base, base, gl.load(ord_items + base)
        else:
            return _n_local(pid, n_prog, U), pid * 0, pid * 0

    @gluon.jit
    def _items_next(ord_items, base, idx, n_loc, code, pid, n_prog, n_m, TABLE: gl.constexpr):
        """(batch·head, query tile) of the program's idx-th item and the next item's code. TABLE: the code of
        item idx was loaded one item ahead, so no item start waits on the table; the next one is loaded now
        (the table has one entry of padding past its end)."""
        if TABLE:
            nxt = gl.load(ord_items + base + gl.minimum(idx + 1, n_loc - 1))
            return code // n_m, code % n_m, nxt
        else:
            bh, pid_m = _item(idx, pid, n_prog, n_m)
            return bh, pid_m, code

    @gluon.jit
    def _pers_producer(
        q_desc,
        k_desc,
        v_desc,
        q_smem,
        k_smem,
        v_smem,
        q_full,
        q_empty,
        k_full,
        v_full,
        k_empty,
        v_empty,
        pid,
        n_prog,
        U,
        n_m,
        H,
        GROUP,
        T,
        q_rb,
        q_rh,
        q_ch,
        kv_rb,
        kv_rh,
        kv_ch,
        ord_off,
        ord_items,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        NUM_Q: gl.constexpr,
        NW: gl.constexpr = 2,
        TABLE: gl.constexpr = False,
    ):
        """The TMA warp: per item, its NW Q tiles into Q slot idx % NUM_Q once every consumer released it,
        then the item's K/V tiles into the ring (running counter t, continued across items)."""
        t = pid * 0
        n_loc, base, code = _items_begin(ord_off, ord_items, pid, n_prog, U, TABLE)
        for idx in range(n_loc):
            bh, pid_m, code = _items_next(ord_items, base, idx, n_loc, code, pid, n_prog, n_m, TABLE)
            start_m, q_row, q_col, kv_row0, kv_col, lse_row, n_tiles = _tile_coords(
                bh, pid_m, H, GROUP, T, q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch, BLOCK_N, CAUSAL, NW
            )
            qs = idx % NUM_Q
            mbarrier.wait(q_empty.index(qs), ((idx // NUM_Q) & 1) ^ 1)  # first use passes on a fresh barrier
            _load_item(
                q_desc,
                k_desc,
                v_desc,
                q_smem,
                NW * qs,
                q_full.index(qs),
                k_smem,
                v_smem,
                k_full,
                v_full,
                k_empty,
                v_empty,
                q_row,
                q_col,
                kv_row0,
                kv_col,
                t,
                n_tiles,
                BLOCK_N,
                STAGES,
                NW,
            )
            t += n_tiles

    @gluon.jit
    def _pers_consumer(
        q_smem,
        o_smem,
        k_smem,
        v_smem,
        q_full,
        q_empty,
        k_full,
        v_full,
        k_empty,
        v_empty,
        sched,
        o_desc,
        lse_ptr,
        qk_scale,
        pid,
        n_prog,
        U,
        n_m,
        H,
        GROUP,
        T,
        q_rb,
        q_rh,
        q_ch,
        kv_rb,
        kv_rh,
        kv_ch,
        ord_off,
        ord_items,
        dtype: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        NUM_Q: gl.constexpr,
        PINGPONG: gl.constexpr,
        HALF: gl.constexpr,
        NW: gl.constexpr = 2,
        TABLE: gl.constexpr = False,
        HALF_DIAG: gl.constexpr = False,
    ):
        """Consumer warpgroup HALF: query rows 64·HALF .. +64 of every item of the program. NW = 3: its rows
        may lie before the sequence (a head's first item, ``_tile_coords``) and, causal, its diagonal may come
        before the item's last tile: it computes its own first n_mine tiles and only waits for and releases
        the rest (``_skip_tiles``)."""
        layouts: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM)
        s_layout: gl.constexpr = layouts[0]
        o_layout: gl.constexpr = layouts[1]
        o_half = o_smem.index(HALF)
        t = pid * 0  # running K/V tile counter (ring slot and phase), continued across items
        sc = pid * 0  # running ping-pong step counter: n_tiles + 1 steps per item
        n_loc, base, code = _items_begin(ord_off, ord_items, pid, n_prog, U, TABLE)
        for idx in range(n_loc):
            bh, pid_m, code = _items_next(ord_items, base, idx, n_loc, code, pid, n_prog, n_m, TABLE)
            start_m, q_row, q_col, kv_row0, kv_col, lse_row, n_tiles = _tile_coords(
                bh, pid_m, H, GROUP, T, q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch, BLOCK_N, CAUSAL, NW
            )
            qs = idx % NUM_Q
            mbarrier.wait(q_full.index(qs), (idx // NUM_Q) & 1)
            if NW == 2:
                acc, m_i, l_i = _consumer_loop(
                    q_smem.index(2 * qs + HALF),
                    k_smem,
                    v_smem,
                    k_full,
                    v_full,
                    k_empty,
                    v_empty,
                    q_empty.index(qs),
                    sched,
                    t,
                    sc,
                    n_tiles,
                    qk_scale,
                    start_m + HALF * HALF_ROWS,
                    s_layout,
                    o_layout,
                    dtype,
                    HEAD_DIM,
                    BLOCK_N,
                    STAGES,
                    CAUSAL,
                    HALF,
                    PINGPONG,
                    True,
                    CAUSAL and HALF_DIAG and HALF == 0,
                )
                _store_half(
                    acc, m_i, l_i, o_half, o_desc, q_row, q_col, lse_ptr, lse_row, s_layout, o_layout, dtype, HALF
                )
            else:
                row0 = start_m + HALF * HALF_ROWS  # this warpgroup's first query row
                if CAUSAL:  # tiles up to its own diagonal
                    n_mine = gl.minimum((row0 + HALF_ROWS + BLOCK_N - 1) // BLOCK_N, n_tiles)
                else:
                    n_mine = n_tiles
                if row0 >= 0:
                    acc, m_i, l_i = _consumer_loop(
                        q_smem.index(NW * qs + HALF),
                        k_smem,
                        v_smem,
                        k_full,
                        v_full,
                        k_empty,
                        v_empty,
                        q_empty.index(qs),
                        sched,
                        t,
                        sc,
                        n_mine,
                        qk_scale,
                        row0,
                        s_layout,
                        o_layout,
                        dtype,
                        HEAD_DIM,
                        BLOCK_N,
                        STAGES,
                        CAUSAL,
                        HALF,
                        False,
                        True,
                    )
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
        acc,
        m_i,
        l_i,
        o_half,
        o_desc,
        q_row,
        q_col,
        lse_ptr,
        lse_row,
        s_layout: gl.constexpr,
        o_layout: gl.constexpr,
        dtype: gl.constexpr,
        HALF: gl.constexpr,
    ):
        """Warpgroup HALF's rows of the item out (``_epilogue``), once the previous item's O store has finished
        reading o_half."""
        tma.store_wait(0)
        _cta_barrier()
        _epilogue(
            acc,
            m_i,
            l_i,
            o_half,
            o_desc,
            q_row + HALF * HALF_ROWS,
            q_col,
            lse_ptr,
            lse_row + HALF * HALF_ROWS,
            s_layout,
            o_layout,
            dtype,
        )

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
        q_desc,
        k_desc,
        v_desc,
        o_desc,
        lse_ptr,
        qk_scale,
        H,
        GROUP,
        T,
        U,
        n_m,
        q_rb,
        q_rh,
        q_ch,
        kv_rb,
        kv_rh,
        kv_ch,
        ord_off,
        ord_items,
        HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        NUM_Q: gl.constexpr,
        PINGPONG: gl.constexpr,
        NW: gl.constexpr = 2,
        TABLE: gl.constexpr = False,
        HALF_DIAG: gl.constexpr = False,
    ):
        """Persistent program over U = B·H·n_m items of NW·64 query rows (n_m = ceil(T / (NW·64))), grid <=
        ceil(U / 2). num_warps = 4 (default partition = consumer 0; workers: the other NW - 1 consumers (4 warps
        each), producer (1 warp))."""
        dtype: gl.constexpr = q_desc.dtype
        pid = gl.program_id(0)
        n_prog = gl.num_programs(0)
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

        if NW == 3:
            gl.warp_specialize(
                [
                    (
                        _pers_consumer,
                        (
                            q_smem,
                            o_smem,
                            k_smem,
                            v_smem,
                            q_full,
                            q_empty,
                            k_full,
                            v_full,
                            k_empty,
                            v_empty,
                            sched,
                            o_desc,
                            lse_ptr,
                            qk_scale,
                            pid,
                            n_prog,
                            U,
                            n_m,
                            H,
                            GROUP,
                            T,
                            q_rb,
                            q_rh,
                            q_ch,
                            kv_rb,
                            kv_rh,
                            kv_ch,
                            ord_off,
                            ord_items,
                            dtype,
                            HEAD_DIM,
                            BLOCK_N,
                            STAGES,
                            CAUSAL,
                            NUM_Q,
                            False,
                            0,
                            3,
                            TABLE,
                        ),
                    ),
                    (
                        _pers_consumer,
                        (
                            q_smem,
                            o_smem,
                            k_smem,
                            v_smem,
                            q_full,
                            q_empty,
                            k_full,
                            v_full,
                            k_empty,
                            v_empty,
                            sched,
                            o_desc,
                            lse_ptr,
                            qk_scale,
                            pid,
                            n_prog,
                            U,
                            n_m,
                            H,
                            GROUP,
                            T,
                            q_rb,
                            q_rh,
                            q_ch,
                            kv_rb,
                            kv_rh,
                            kv_ch,
                            ord_off,
                            ord_items,
                            dtype,
                            HEAD_DIM,
                            BLOCK_N,
                            STAGES,
                            CAUSAL,
                            NUM_Q,
                            False,
                            1,
                            3,
                            TABLE,
                        ),
                    ),
                    (
                        _pers_consumer,
                        (
                            q_smem,
                            o_smem,
                            k_smem,
                            v_smem,
                            q_full,
                            q_empty,
                            k_full,
                            v_full,
                            k_empty,
                            v_empty,
                            sched,
                            o_desc,
                            lse_ptr,
                            qk_scale,
                            pid,
                            n_prog,
                            U,
                            n_m,
                            H,
                            GROUP,
                            T,
                            q_rb,
                            q_rh,
                            q_ch,
                            kv_rb,
                            kv_rh,
                            kv_ch,
                            ord_off,
                            ord_items,
                            dtype,
                            HEAD_DIM,
                            BLOCK_N,
                            STAGES,
                            CAUSAL,
                            NUM_Q,
                            False,
                            2,
                            3,
                            TABLE,
                        ),
                    ),
                    (
                        _pers_producer,
                        (
                            q_desc,
                            k_desc,
                            v_desc,
                            q_smem,
                            k_smem,
                            v_smem,
                            q_full,
                            q_empty,
                            k_full,
                            v_full,
                            k_empty,
                            v_empty,
                            pid,
                            n_prog,
                            U,
                            n_m,
                            H,
                            GROUP,
                            T,
                            q_rb,
                            q_rh,
                            q_ch,
                            kv_rb,
                            kv_rh,
                            kv_ch,
                            ord_off,
                            ord_items,
                            BLOCK_N,
                            STAGES,
                            CAUSAL,
                            NUM_Q,
                            3,
                            TABLE,
                        ),
                    ),
                ],
                [4, 4, 1],
                [_CONSUMER3_REGS, _CONSUMER3_REGS, _PRODUCER_REGS],
            )
            return

        gl.warp_specialize(
            [
                (
                    _pers_consumer,
                    (
                        q_smem,
                        o_smem,
                        k_smem,
                        v_smem,
                        q_full,
                        q_empty,
                        k_full,
                        v_full,
                        k_empty,
                        v_empty,
                        sched,
                        o_desc,
                        lse_ptr,
                        qk_scale,
                        pid,
                        n_prog,
                        U,
                        n_m,
                        H,
                        GROUP,
                        T,
                        q_rb,
                        q_rh,
                        q_ch,
                        kv_rb,
                        kv_rh,
                        kv_ch,
                        ord_off,
                        ord_items,
                        dtype,
                        HEAD_DIM,
                        BLOCK_N,
                        STAGES,
                        CAUSAL,
                        NUM_Q,
                        PINGPONG,
                        0,
                        2,
                        TABLE,
                        HALF_DIAG,
                    ),
                ),
                (
                    _pers_consumer,
                    (
                        q_smem,
                        o_smem,
                        k_smem,
                        v_smem,
                        q_full,
                        q_empty,
                        k_full,
                        v_full,
                        k_empty,
                        v_empty,
                        sched,
                        o_desc,
                        lse_ptr,
                        qk_scale,
                        pid,
                        n_prog,
                        U,
                        n_m,
                        H,
                        GROUP,
                        T,
                        q_rb,
                        q_rh,
                        q_ch,
                        kv_rb,
                        kv_rh,
                        kv_ch,
                        ord_off,
                        ord_items,
                        dtype,
                        HEAD_DIM,
                        BLOCK_N,
                        STAGES,
                        CAUSAL,
                        NUM_Q,
                        PINGPONG,
                        1,
                        2,
                        TABLE,
                        HALF_DIAG,
                    ),
                ),
                (
                    _pers_producer,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        q_smem,
                        k_smem,
                        v_smem,
                        q_full,
                        q_empty,
                        k_full,
                        v_full,
                        k_empty,
                        v_empty,
                        pid,
                        n_prog,
                        U,
                        n_m,
                        H,
                        GROUP,
                        T,
                        q_rb,
                        q_rh,
                        q_ch,
                        kv_rb,
                        kv_rh,
                        kv_ch,
                        ord_off,
                        ord_items,
                        BLOCK_N,
                        STAGES,
                        CAUSAL,
                        NUM_Q,
                        2,
                        TABLE,
                    ),
                ),
            ],
            [4, 1],
            [_CONSUMER_REGS, _PRODUCER_REGS],
        )

    _GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


# ---------------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------------
STAGES = {64: 3, 128: 2}  # K/V ring slots by head dim (H200: hd64 gains from the third slot, hd128 does not)
# variant -> (NUM_Q, PINGPONG) of the persistent kernel; "lib" is the one-program-per-item kernel
VARIANTS = {"lib": None, "pers": (1, False), "q2": (2, False), "pp": (1, True), "q2pp": (2, True), "w3": (2, False, 3)}
# variants that only some head dims take: w3's three consumer warpgroups get 160-168 registers each, which
# at hd128 makes ptxas serialise every wgmma (and spill)
VARIANT_HEAD_DIMS = {"w3": (64,)}
# The variant flash_attention_fwd_gluon runs by head dim: the first (T_max, variant) with T <= T_max. H200,
# causal bf16, x cuDNN at T = 1k/2k/4k/8k/16k (module docstring): hd128 pp 1.02/1.09/1.07/1.08/1.07 and
# q2pp 0.68/1.12/1.12/1.10/1.09; hd64 q2 0.94/1.02/0.97/0.98/1.05, the best or within 0.01 at every T but 8k
# (pers 0.99 there), and ahead of the Triton kernel (0.86/0.91/0.88/0.92/0.96) everywhere.
# hd64 from T = 4k: w3 (session 7: 1.01x against q2's 0.99-1.00x at 4k in three processes).
VARIANT_BY_T = {128: ((1024, "pp"), (math.inf, "q2pp")), 64: ((2048, "q2"), (math.inf, "w3"))}
# The persistent variants' order of work: "pairs" (the rule of ``_n_local`` / ``_item``, computed in the
# kernel), or a table made by ``schedule`` and read by the kernel (TABLE): "tail" keeps the pairs for all but
# the last SCHED_TAIL_ROUNDS full rounds and the partial round, whose items go one by one, heaviest first, each
# to the program with the least work so far (longest-processing-time first); "lpt" does that for every item.
# An item's cost is its K/V tiles + SCHED_ITEM_COST (its Q load and epilogue, in tiles).
SCHEDULE = "tail"
# HALF_DIAG_MAX_T: causal, two consumer warpgroups (q2, pp, q2pp, pers), T <= this (by head dim): the first
# warpgroup's diagonal step over the tile's first 64 keys only (``_consumer_loop``; the same bits). H200, session
# 17 (bench/gluon_fwd_halfdiag.py, x cuDNN off -> on): hd64 q2 1k 1.006 -> 1.035, 2k 1.037 -> 1.047; hd128 pp 1k
# 1.014 -> 1.033; but hd128 q2pp 2k 1.126 -> 1.124, 4k 1.126 -> 1.119, 8k 1.107 -> 1.102, 16k 1.095 -> 1.087, so
# there it stays off
HALF_DIAG_MAX_T = {64: 2048, 128: 1024}
SCHED_TAIL_ROUNDS = 2
SCHED_ITEM_COST = 1.0
_SCHEDULES = PlanCache()  # (device, shape of the work, grid, policy) -> (ord_off, ord_items) on the device


def pick_variant(D: int, T: int) -> str:
    """The variant ``VARIANT_BY_T`` gives head dim D at sequence length T."""
    return next(name for t_max, name in VARIANT_BY_T[D] if T <= t_max)


def item_tiles(pid_m: int, n_m: int, T: int, NW: int, causal: bool) -> int:
    """The K/V tiles item pid_m of a head reads (``_tile_coords``' n_tiles, on the host)."""
    if not causal:
        return T // BLOCK_N
    start_m = pid_m * NW * HALF_M - (n_m * NW * HALF_M - T if NW != 2 else 0)
    if NW == 2:
        return (start_m + 2 * HALF_M) // BLOCK_N
    return (start_m + NW * HALF_M + BLOCK_N - 1) // BLOCK_N


def schedule(
    BH: int,
    n_m: int,
    T: int,
    NW: int,
    causal: bool,
    G: int,
    policy: str,
    tail_rounds: int | None = None,
    item_cost: float | None = None,
) -> tuple[list, list]:
    """(offsets [G + 1], codes) of the persistent grid's work: program p takes the items codes[offsets[p] ..
    offsets[p + 1]) in order, code = bh · n_m + pid_m. "pairs": the kernel's own rule (pair k = items 2k, 2k + 1
    of the heaviest/lightest order to program k mod G), as a table. "tail": those pairs for the first
    max(0, P // G - tail_rounds) rounds, then the rest item by item, heaviest first, each to the program with
    the least work (ties: the lower program), appended after its pairs. "lpt": every item that way (no pairs).
    Tail items keep the heads of the last rounds in flight together, so their K/V still come from L2."""
    tail_rounds = SCHED_TAIL_ROUNDS if tail_rounds is None else tail_rounds
    item_cost = SCHED_ITEM_COST if item_cost is None else item_cost
    if policy not in ("pairs", "tail", "lpt"):
        raise ValueError(f"flash_attention_fwd_gluon: schedule must be 'pairs', 'tail' or 'lpt', got {policy!r}")
    U = BH * n_m
    P = (U + 1) // 2

    def code(u: int) -> int:  # global item u of the pair rule -> bh * n_m + pid_m (``_item``)
        r = u % n_m
        pid_m = r // 2 if r % 2 else n_m - 1 - r // 2
        return (u // n_m) * n_m + pid_m

    def cost(c: int) -> float:
        return item_tiles(c % n_m, n_m, T, NW, causal) + item_cost

    rounds = P // G + 1 if policy == "pairs" else (0 if policy == "lpt" else max(0, P // G - tail_rounds))
    per = [[] for _ in range(G)]
    for k in range(min(P, rounds * G)):
        per[k % G] += [code(u) for u in (2 * k, 2 * k + 1) if u < U]
    tail = [code(u) for u in range(2 * min(P, rounds * G), U)]
    if tail:
        import heapq

        heap = [(sum(cost(c) for c in per[p]), p) for p in range(G)]
        heapq.heapify(heap)
        for c in sorted(tail, key=lambda c: -cost(c)):  # stable: equal costs keep their order
            load, p = heapq.heappop(heap)
            per[p].append(c)
            heapq.heappush(heap, (load + cost(c), p))
    offsets = [0]
    for items in per:
        offsets.append(offsets[-1] + len(items))
    return offsets, [c for items in per for c in items]


def _schedule_tensors(device, BH: int, n_m: int, T: int, NW: int, causal: bool, G: int):
    """``schedule`` under the module settings as device int32 tensors (the codes padded by one entry: the
    kernel loads one item ahead), cached by everything that decides it."""
    key = (str(device), BH, n_m, T, NW, bool(causal), G, SCHEDULE, SCHED_TAIL_ROUNDS, SCHED_ITEM_COST)
    hit = _SCHEDULES.get(key)
    if hit is None:
        off, codes = schedule(BH, n_m, T, NW, causal, G, SCHEDULE)
        hit = (
            torch.tensor(off, dtype=torch.int32, device=device),
            torch.tensor(codes + [0], dtype=torch.int32, device=device),
        )
        _SCHEDULES.put(key, hit)
    return hit


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
    """Whether these kernels take these inputs: Gluon present, an sm_90 GPU, bf16/fp16, D in (64, 128), T a
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


_LAYOUTS: dict = {}


def _desc(view: torch.Tensor, rows: int, D: int):
    """A TMA descriptor over the 2-D row view, one tile = rows x D. The shared-memory layout is looked up once
    per (rows, D, dtype): building it took ~5 us of host time per descriptor (session 6, H200 machine)."""
    key = (rows, D, view.dtype)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for([rows, D], _GL_DTYPES[view.dtype])
    return TensorDescriptor(view, list(view.shape), list(view.stride()), [rows, D], layout)


def descriptor_templates(args: dict) -> dict:
    """The tensor descriptors among a launch's arguments, as templates that hold no tensor (``rebased``)."""
    return {name: rebased(val, None) for name, val in args.items() if name.endswith("_desc")}


def rebase_all(descs: dict, ts: dict) -> dict:
    """The descriptors ``descs`` ({"q_desc": template, ...}) re-based on the tensors ``ts`` ({"q": q, ...}; the
    name before "_desc"), through the same 2-D views the templates were made over."""
    return {name: rebased(tmpl, _row_view(ts[name[:-5]])[0]) for name, tmpl in descs.items()}


def _launch(q, k, v, o, lse, causal: bool, scale: float, variant: str, stages: int | None, n_prog: int):
    """(kernel, grid, runtime args, constexpr args) of ``variant``; q/k/v/o CUDA tensors, or CPU tensors
    standing in for their shapes and strides (``compile_sm90``). n_prog: the persistent grid's cap."""
    B, H, T, D = q.shape
    if D not in VARIANT_HEAD_DIMS.get(variant, HEAD_DIMS):
        raise ValueError(
            f"flash_attention_fwd_gluon: variant {variant!r} takes head dims {VARIANT_HEAD_DIMS[variant]}, got {D}"
        )
    q2, q_rb, q_rh, q_ch = _row_view(q)
    k2, kv_rb, kv_rh, kv_ch = _row_view(k)
    v2, o2 = _row_view(v)[0], _row_view(o)[0]
    args = dict(
        q_desc=_desc(q2, HALF_M, D),
        k_desc=_desc(k2, BLOCK_N, D),
        v_desc=_desc(v2, BLOCK_N, D),
        o_desc=_desc(o2, HALF_M, D),
        lse_ptr=lse,
        qk_scale=scale * LOG2E,
        H=H,
        GROUP=H // k.shape[1],
        T=T,
    )
    coords = dict(q_rb=q_rb, q_rh=q_rh, q_ch=q_ch, kv_rb=kv_rb, kv_rh=kv_rh, kv_ch=kv_ch)
    consts = dict(HEAD_DIM=D, BLOCK_N=BLOCK_N, STAGES=stages or STAGES[D], CAUSAL=bool(causal))
    if VARIANTS[variant] is None:
        return _flash_fwd_gluon_kernel, (T // BLOCK_M, B * H), {**args, **coords}, consts
    NUM_Q, PINGPONG, NW = (VARIANTS[variant] + (2,))[:3]
    n_m = -(-T // (NW * HALF_M))  # items per head (NW = 3: the last may hold fewer than 192 rows)
    U = B * H * n_m  # work items; programs take them in pairs, so more than ceil(U / 2) would idle
    grid = (max(1, min(n_prog, (U + 1) // 2)),)
    table = SCHEDULE != "pairs"
    if table:
        ord_off, ord_items = _schedule_tensors(q.device, B * H, n_m, T, NW, causal, grid[0])
    else:  # unused by the kernel (TABLE False): any pointer
        ord_off = ord_items = lse
    consts = {
        **consts,
        "NUM_Q": NUM_Q,
        "PINGPONG": PINGPONG,
        "NW": NW,
        "TABLE": table,
        "HALF_DIAG": bool(causal and NW == 2 and T <= HALF_DIAG_MAX_T.get(D, 0)),
    }
    return (
        _flash_fwd_gluon_pers_kernel,
        grid,
        {**args, "U": U, "n_m": n_m, **coords, "ord_off": ord_off, "ord_items": ord_items},
        consts,
    )


def flash_attention_fwd_gluon(
    q,
    k,
    v,
    causal: bool = True,
    scale: float | None = None,
    *,
    o=None,
    lse=None,
    variant: str | None = None,
    stages: int | None = None,
    programs: int | None = None,
    checked: bool = False,
    plan: bool = False,
):
    """Launch the Gluon forward (callers check ``supported`` first; flash_attention_fwd_triton does). q, k, v
    must share a dtype; ``o``/``lse``: optional output buffers, o in q's layout, lse contiguous fp32.
    ``variant``: a name of ``VARIANTS`` (None: ``pick_variant``); ``stages``: K/V ring slots (None:
    ``STAGES``); ``programs``: the persistent grid (None: the device's SM count). The last three are for
    the bench. ``checked``: the caller has just seen ``supported(q, k, v)`` hold (the check is host time).
    ``plan``: also return a ``_FwdPlan`` that repeats this launch for inputs of the same signature (o and lse
    must then be left to this function)."""
    op = "flash_attention_fwd_gluon"
    if plan and (o is not None or lse is not None):
        raise ValueError(f"{op}: plan=True allocates o and lse itself; got buffers")
    if not checked and not supported(q, k, v):
        raise ValueError(
            f"{op}: needs bf16/fp16 q, k, v on an sm_90 GPU, D in {HEAD_DIMS}, T a multiple of "
            f"{BLOCK_M}, contiguous or [B, T, H, D]-transposed layouts; got q {tuple(q.shape)} "
            f"{q.dtype} strides {q.stride()}, k {tuple(k.shape)} strides {k.stride()}"
        )
    B, H, T, D = q.shape
    variant = pick_variant(D, T) if variant is None else variant
    if variant not in VARIANTS:
        raise ValueError(f"{op}: unknown variant {variant!r}; have {', '.join(VARIANTS)}")
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not (s > 0.0 and math.isfinite(s)):
        raise ValueError(f"{op}: scale must be a finite number > 0, got {scale!r}")
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
    kernel, grid, args, consts = _launch(q, k, v, o, lse, causal, s, variant, stages, programs or sm_count(q.device))
    if not plan:
        kernel[grid](**args, **consts, num_warps=4)
        return o, lse
    launch = launch_cached(kernel, grid, {**args, **consts}, num_warps=4)
    return o, lse, _FwdPlan(launch, args, q)


class _FwdPlan:
    """``flash_attention_fwd_gluon`` for one signature of inputs (shapes, strides, dtype, device, scale), its
    host work done once: calling it allocates o and lse, re-bases the four TMA descriptors on the new tensors
    and launches the compiled kernel directly (``_dispatch.CachedLaunch``). Made by the first call with
    ``plan=True``; ``flash_attention.flash_attention_fwd_triton`` keeps them by signature. On the H200 machine
    of session 6 the full forward call took 0.12-0.33 ms of host time per call, as long as the kernel itself
    at T = 1k."""

    __slots__ = ("launch", "descs", "shape", "contiguous", "table", "lse_args")

    def __init__(self, launch, args: dict, q: torch.Tensor):
        self.launch = launch
        self.descs = descriptor_templates(args)
        self.shape = tuple(q.shape)
        self.contiguous = q.is_contiguous()
        # the persistent kernel's schedule table (kept alive here); where it reads none, lse stands in for it
        order = [n for n in ("ord_off", "ord_items") if n in args]
        self.table = {n: args[n] for n in order if args[n] is not args["lse_ptr"]}
        self.lse_args = ("lse_ptr", *(n for n in order if n not in self.table))

    def __call__(self, q, k, v):
        B, H, T, D = self.shape
        o = (
            torch.empty_like(q)
            if self.contiguous
            else torch.empty(B, T, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
        )
        lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
        self.launch(
            **self.table,
            **dict.fromkeys(self.lse_args, lse),
            **rebase_all(self.descs, {"q": q, "k": k, "v": v, "o": o}),
        )
        return o, lse


def plan_salt(D: int) -> tuple:
    """The module settings a cached forward plan depends on (part of its key): the variant and ring depth
    this head dim gets."""
    return (
        VARIANT_BY_T.get(D),
        STAGES.get(D),
        HAVE_GLUON,
        SCHEDULE,
        SCHED_TAIL_ROUNDS,
        SCHED_ITEM_COST,
        tuple(sorted(HALF_DIAG_MAX_T.items())),
    )


def compile_sm90(
    D: int = 128, causal: bool = True, stages: int | None = None, transposed_kv: bool = False, variant: str = "lib"
):
    """Compile ``variant`` for sm_90 without a GPU (CPU tensors stand in for the descriptors' shapes): the CI
    check that a Triton upgrade has not broken it. Returns the compiled kernel (its .asm["ptx"])."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    B, H, Hkv, T = 1, 4, 2, 256
    q = torch.empty(B, H, T, D, dtype=torch.bfloat16)
    kv = (
        torch.empty(B, T, Hkv, D, dtype=torch.bfloat16).transpose(1, 2)
        if transposed_kv
        else torch.empty(B, Hkv, T, D, dtype=torch.bfloat16)
    )
    lse = torch.empty(B, H, T)
    kernel, _, args, consts = _launch(q, kv, kv, q, lse, causal, D**-0.5, variant, stages, 132)
    sig = {a: "constexpr" if a in consts else mangle_type(args[a]) for a in kernel.arg_names}
    src = GluonASTSource(kernel, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
