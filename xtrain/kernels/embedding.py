"""Embedding lookup and its scatter-add backward.

Contract: embedding_fwd(ids[...], table[V, C]) -> out[..., C] (table.dtype)
          embedding_bwd(dout[..., C], ids, V) -> dtable[V, C] (dout.dtype): rows of dout added into the
          rows their ids name (an id seen k times gets k rows summed). No [N, V] one-hot is ever built.
          embedding_bwd(dout, ids, V, plan): the same, given ``embedding_bwd_plan(ids, V, C, dtype)`` or the plan of
          ``embedding_fwd_planned(ids, table) -> (out, plan)`` (None where the backward takes no plan: CPU, bf16's
          form, more than TIERS_MAX_N tokens), the backward's ids-only part made ahead.

Triton backward (deterministic: no floating-point atomics; no [V, C] temporary besides the gradient itself):
    order, sorted = stable sort of the N ids   (torch.sort, stable: a fixed summation order)
    _embedding_bwd_chunk_kernel  program (chunk, column block) takes CHUNK consecutive sorted tokens and
        sums each run of equal ids in fp32; runs inside the chunk are written to dtable directly, runs cut
        by a chunk edge go to a small fp32 buffer PART[n_chunks, 2, C] (at most two per chunk)
    _embedding_bwd_merge_kernel  for each run that crosses chunk edges, adds its partials in chunk order
        and writes the row. Every program has at most CHUNK tokens, so a frequent id no longer makes one
        long serial chain (idea from the issue thread: fixed-size token chunks of the sorted ids).
The rows no id names are zeroed by ``_embedding_zero_absent_kernel`` (marked by ``_embedding_keys_kernel``,
which also writes the sort keys) on the current stream while the sort, the chunk walks and the merge run on a
high-priority side stream (CONFIG zero fill "side", the bf16 default): the zero fill is a bandwidth-bound grid
over most of the table, the other three a chain of small latency-bound kernels, and with the side stream's
priority their programs take SMs as the zero tiles retire, so the chain runs under the fill
(``SIDE_HIGH_PRIORITY = False`` gives the side stream the default priority: on the H200 that form took 0.381
ms bf16 / 0.175 ms fp32 against 0.313 / 0.154 ms with the priority, and the fused launch before it 0.354 /
0.162 ms). CONFIG also selects torch.zeros first, ``_embedding_zero_absent_kernel`` first, or the zero tiles
and the walks in one launch (``_embedding_bwd_fused_kernel``, the default before session 6).
Chunk bodies: ``_chunk_body`` walks a chunk's tokens one by one; ``_chunk_tile_body`` gathers a chunk's
CHUNK rows as one tile, all in flight at once, and sums runs by a segmented scan held in each thread's
registers (the walk waits on an index load per token: the chunk + merge stage alone ran at 36-39% of copy).
"rows" form (CONFIG zero fill "rows", the fp32 default since session 7): most rows are named by few tokens
(Zipf-like ids, N = 16k, V = 32k: 9.5k of 9.8k named rows at most 4 times), so those need no sort at all:
    _embedding_slots_kernel      each token takes the next slot of its id by an integer atomic (COUNTS[id];
                                 the counts do not depend on the order) and writes its index to SLOTS[slot, id]
                                 if slot < K
    _embedding_bwd_rows_kernel   (current stream) a grid over the whole table: every row seen at most K times
                                 is written whole, zeros or its tokens' sum in token order (a sorting network
                                 orders the row's slots, so the atomics' order does not reach the result)
    the chain (high-priority side stream) for the rows seen more than K times: their tokens keep their sort
    key, all others get a sentinel that sorts last and that the walks and the merge skip.
"tiers" form (CONFIG zero fill "tiers", the fp32 default since session 18): of the ~310 ids the chain above takes
(N = 16k, V = 32k), only ~4 are seen more than K2 = 64 times, so the rest need no sort either:
    _zero_i32_kernel             the counts zeroed; its programmatic dependent is the slots pass, which loads its
                                 ids before it waits for the fill (FILL_PDL: the pass starts ~1.5 us sooner)
    _embedding_tier_slots_kernel the slots pass with K2 slots per id (SLOTS[K2, V] int32, K2 capped at the
                                 table's width C but at least 2K: no larger than an fp32 table where C >= 2K);
                                 the token taking slot K appends its id to the medium list, the one taking slot
                                 K2 to the heavy list (and with ROWS_ROLES the one taking slot 0 to the named list)
    _embedding_bwd_rows_kernel   (current stream) rows seen at most K times, as in the rows form; with ROWS_ROLES
                                 (the default where ROWS has one row per program, since session 20) in two roles:
                                 the named rows first, one program per two places of the named list, then one
                                 program per row writing the zero rows (not the two kinds interleaved in row order)
    _embedding_tier_a_kernel     (side stream 2, persistent) each medium row (K < count <= K2): its slots ranked
                                 into token order by a [K2, K2] comparison, gathered MT tokens at a time, each tile
                                 added by a fixed reduction tree and the tiles in order; a program lists 4 of its rows
                                 at a time and loads each row's slots while the row before it is gathered
                                 (side stream 1, persistent) each heavy id's tokens listed in token order by a
                                 scan of the ids with a running prefix sum
    _embedding_tier_b_kernel     (side stream 1, persistent) each heavy row by (id, column block) items over its
                                 list, HT tokens a tile, tiles in order
Every sum has an order fixed by the token indices alone, so the result is bit for bit repeatable (its bits are
not the rows form's: a tile's rows are added by a tree, not left to right). Each heavy id's list is a scan of all
N ids, so the form is for batches of up to ``TIERS_MAX_N`` tokens; above that the rows form runs (its one sort
scales better: at N = 64k-256k the tiers form took 1.1-1.5x its time). H200, fp32 (bench/RESULTS.md): 0.120-
0.122 ms at V = 32k, C = 2048 (77-78 % of copy) against the rows form's 0.127-0.130; the side chains end inside the
grid, which they stretch from ~99 to ~109 us with their ~30 MB of gathers. Session 20 (bench/mix_probe.py): a
grid of the same bytes ran 85 us with its gathering programs first and 93 us with them interleaved among the
zero-row programs; in the op the roles took 0.8-1.4 us off at V = 32000 (0.116-0.118 ms, 79-80 %) and brought V = 128k,
C = 4096 from 0.653 to 0.588-0.596 ms (87 -> 95-97 %). Measured there and removed: the medium rows by the rows grid's
first programs (sorted by ``tl.sort`` and written back in place, then added one by one: the grid's registers went
from 32 to 46-94, 0.119-0.177 ms), tier A with that medium-row body (0.127-0.138). Persistent named-row programs
(ROWS_ROLES = 2-12 per SM) took 0.120-0.143 ms and stay a setting only. Session 21 (V = 32000, fp32): a named-row
program per two list places instead of one (-1 left ~6600 of its 16k programs nothing to do), tier A's medium rows
listed four at a time with the next row's slots in flight (its kernel ~60 us instead of ~90 beside the grid), and the
slots pass's atomics relaxed (4.6 us instead of 6.1) took the op from 0.117 to 0.112 ms (83 %). Measured and removed:
the named rows' slots loaded beside their counts (0.1156 ms), zero rows started on a counter the slots pass raises
once its counts are in, ahead of the named rows (level; the pass slowed by 1-2 us), the list lengths 128 bytes apart
(level). A batch of one id takes 0.387 ms (bench/slots_probe.py): tier B walks that id's 16k tokens with one
program per 64 columns; with TIER_B_SEG (segments, then an ordered merge; 1024 by default since session 22) 0.185-0.191
ms, and a batch half padding 0.160 ms instead of 0.252.
Session 22: the slots pass's three list atomics issued before their stores and the one-token rows written from a list
of slot-0 tokens (SLOTS_APPEND_TOGETHER, ROWS_FIRST): 0.111-0.113 ms (83-84 %). And the plan (``EmbeddingBwdPlan``):
the fill, the slots pass and the heavy lists read only the ids, so the forward can make them
(``embedding_fwd_planned``, which ``ops.embedding`` uses when the table needs a gradient) on a high-priority side
stream beside its gather, without waiting for them; the backward given the plan waits for its event and launches only
the rows grid and the tier A / tier B sums: 0.106 ms (88 %), the rows grid starting at once instead of ~5 us in, and
forward + backward 0.174 ms against 0.177-0.179 without a plan.
Sort keys: int32 (half the radix passes of int64) or int16 (ids - 32768, V <= 65536: half again).
It is written in dout.dtype directly: the fp32 sum is rounded once, as in the reference, which accumulates a
whole fp32 [V, C] table instead. Defaults (H200, bench/RESULTS.md, GPU time): bf16 the side streams with
the walk, 0.312 ms at V = 128k, C = 4096 (91% of copy; session 6); fp32 the rows form, 0.133-0.137 ms at V =
32k, C = 2048 (68-70%; session 7; "side" 0.153-0.156 ms; since session 12, with whole-row tiles and the merge
taking 16 chunks per step, 0.127-0.128 ms, 74 %). What kept fp32 short of the goal in session 7 (a profile with
the host kept ahead): the rows kernel alone takes 0.093-0.103 ms (84-88% of its bytes), but the chain beside
it (keys, cub's radix sort in five kernels, walks, merge) stretches from ~65 us alone to ~128 us under the grid,
each of its kernels waiting 6-14 us for a grid program to retire before it gets an SM.
Session 12 (fp32; bench/embedding_rows_probe.py, bench/embedding_timeline.py; GPU time): the rows kernel alone
takes 0.099-0.101 ms on its 372 MB with whole 2048-column rows per program (1x2048 on 4 warps, 2x2048 on 8),
against 0.109-0.110 ms for the 8x512 tiles before; the new default, 1x2048 on 8 warps, ran 98.4-98.7 us in the op's
timelines, and the op takes 0.129-0.131 ms against 0.132-0.134. Reading each row's tokens from consecutive dout
rows (the same bytes) gains 0-3 us and a scattered row-block order loses 5-7 us, so the gathers' randomness is not
the cost. Beside the chain the whole-row grid runs at its own speed (98.7 us, ending 107 us into the op), so the op
would take ~0.108 ms (87 %) if the chain ended by then; it ends at ~128 us: its kernels are latency-bound and each
starts 2-13 us after the one before it ends. Measured and dropped: (1) "blocks" (code at commit aa815c1), the
frequent rows in two kernels with no global sort (per block of TB tokens a tl.sort of its frequent tokens, their
runs summed into partial rows, then each id's partials added in block order): 0.132-0.222 ms; its first kernel (168
registers) took the SMs ahead of the rows grid for 15-18 us under the side stream's priority, and its merge ran
81-136 us. (2) the rows kernel persistent and software-pipelined (the next tile's counts and slots loaded first;
commit 7e8083b): alone 0.105-0.27 ms at 1-6 programs per SM, the op 0.147-0.192 ms. Its programs held every SM's
shared-memory configuration: cub's onesweep blocks (46 KB of shared memory each) started only as the grid drained.
With the rows kernel's preferred shared-memory carveout set to 100 % (cuFuncSetAttribute) they started 60 us sooner
and the op took 0.131 ms, level with the default: it fits an SM running blocks of several kernels together only
under one L1/shared split (an inference from these two timelines). For the default, whose programs are short, the
carveout changed nothing (0.130-0.131 ms at 0, 50 and 100 %). (3) "pieces" (commit 7bdb3a7): three kernels, no
global sort (per block of TB tokens a tl.sort of its frequent tokens; pieces of SUB sorted tokens gathered as one
tile and summed by a segmented scan; each id's pieces added in a fixed order set by the data): its chain ended at
99-116 us, inside the rows grid, yet the op took 0.147-0.208 ms, because the grid stretched to 156-164 us:
thousands of latency-bound programs, started first under the side stream's priority, held the SM slots the grid
needed. The sort chain costs less there, being few blocks. (4) The ids-only part of the op (counts, slots, keys,
sort: 0.044 ms alone) depends on the ids alone and could be built before dout exists; given it, the rest (the rows
grid beside the walks and merge) still takes 0.118 ms (80 %), so moving it out of the backward would not reach the
goal either; not built. (5) "list" (commit 2902439): the chain's keys and cub sort replaced by one program per
frequent id, which places the id's tokens, in token order, after those of the smaller frequent ids (one scan of the
ids, compacted by a prefix sum): the chain's exact bits with two kernels fewer. The chain then ended at 87 us
instead of 128, but the rows grid beside it stretched from 98 to 124 us (its walks and merge now ran inside the
grid instead of after it): 0.131-0.152 ms fp32, bf16 0.357-0.388 against 0.313. Across these forms the frequent
rows cost the op 22 us or more (against the grid's end at ~107 us) wherever they run. What 85 % (0.111 ms) needs:
the frequent rows finished within the rows grid's ~100 us, under its traffic, at little cost in SM slots; no form
so far does that.
Session 15 (bench/embedding_tma_probe.py, a probe): the lightest grid there is, TMA bulk stores of one shared zero
tile into every row from one or two programs per SM, writes the table at 95-98 % of copy alone (0.063-0.065 ms) but
beside the chain takes 0.100-0.102 ms, the chain slowing under its traffic (from 60 to 93 us) and it under the chain's
(from 64 to 92 us); before the slots pass and the 110 MB of reads a real rows grid adds. So no TMA rows grid was built.
Session 16 (fp32; bench/embedding_timeline.py): the rows grid, issued after the chain's launches, started ~5 us
after the slots pass ended and ran 113-114 us beside the chain (99 us alone). Issued first and launched as the
slots kernel's programmatic dependent (``ROWS_PDL``, ``ROWS_MAIN_FIRST``, the defaults since), it starts under the
slots pass and runs at its own speed (99.8 us, ending at 104 us), and the chain, then the longer branch, ends the op
at ~122 us: 0.125-0.127 ms against 0.127-0.128 (four processes; 0-2 us, 73-75 %). Measured and dropped: "list"
again, beside the early grid (code at commit c04c5c7): its listing launch took 36-69 us under the grid and the
grid stretched to 122-130 us (0.127-0.143 ms);
"sum" (commit 6af1aa2): the frequent rows summed by (column block, id) programs from per-id token lists, no walks
and no merge: a frequent id's 553 tokens became one program's serial chain of tile gathers, 131 us under the grid
(0.159-0.251 ms); the sort over all ids made on the side stream before the slots pass, then reordered by one
program (commit 2e2418f, the chain's bits): the sort still ended at 83 us under the grid (0.139-0.158 ms); "place"
(commit db530fd, the sort's bits): each frequent token put at its sorted place by one launch from per-block counts
the slots pass kept, its programs of 512-1024 tokens on 16-32 warps slow to start and to run under the grid
(0.131-0.434 ms). What the
timelines say: the frequent rows cost the op ~20 us wherever they run; inside the grid's lifetime their
latency-bound programs take its SM slots, after it they are its tail.
Measured and dropped (session 11, fp32; code at commit 7ca4268): "inline", the frequent rows inside the rows
kernel's own launch (the slots pass lists them; the first programs, one per SM, build each one's token list by
a scan of the ids, meet at a barrier, and sum the rows in segments whose partials the last arrival adds in
order; no sort, no side stream): 0.137-0.149 ms against 0.133. Its launch with no frequent-row work at all took
0.119 ms: the list-building branch set the whole launch's registers (86 in an offline sm_90 build, so 2
programs of 8 warps per SM, where the tiles alone fit 3), and the latency-bound programs held slots the tiles
needed. The form's floor from its stages alone (slots pass 0.013 ms + rows kernel K = 4 0.101-0.103 ms) is
80-81 % of copy even if the frequent rows cost nothing, so 85 % needs a faster rows kernel. A register cap on
the rows kernel (maxnreg 64 / 56: 4 programs per SM) changed nothing (0.133 ms).
Measured and dropped (session 10, fp32): the rows kernel's stores streaming (.cs) or L2-only (.cg), 0.132-0.134 ms
against 0.133 (the H200 writes 262 MB of zeros at 4.37 TB/s, above the 4.15-4.25 of a copy: writing is not the
ceiling).
Measured and dropped (session 9, fp32; code at commits 20c1b47 and d587f69): the frequent ids summed by fp32
atomic adds instead of the chain (their rows zeroed by one pass, then every token of such an id added into its
row; bit for bit repeatable no more, so it would have had to yield to the chain under deterministic mode):
0.129-0.146 ms against the chain's 0.134 ms, beside the rows kernel or before it. The add pass alone took
25-27 us for 30 MB (the atomics of the most frequent rows serialise), and the rows kernel beside it still
stretched to 124-132 us.
Measured and dropped (session 8, fp32): the chain's keys + radix sort as one program's ``tl.sort`` of 16k packed
(key, index) values (0.45-0.49 ms alone against 0.038 ms: a bitonic network that size is slow in one program);
the rows kernel's slot loads issued beside its count load and masked after (0.103 vs 0.101 ms alone: the
dependent load is not the bound); chain chunks of 8, 32 or 64 tokens, walk or tile body (0.133-0.141 ms).
Measured and dropped (session 7): the rows kernel persistent (2-6 programs per SM, so there is always room
for the chain): its programs never retire, so the radix sort's passes waited for the grid to drain, 0.155-0.239
ms; K = 8 (0.141-0.187 ms fp32, 0.71-0.92 ms bf16); K = 1 (0.153-0.160 ms: more rows left to the chain); K = 2
(0.146-0.157 ms fp32); bf16 in the rows form (K = 2: 0.344-0.351 ms, K = 4: 0.39-0.45 ms, against 0.312).
Measured and dropped (H200, 2026-11-29, bench/RESULTS.md): one program per run (the first version:
0.552 ms bf16 / 0.384 ms fp32, a frequent id summed serially); a segmented-scan chunk kernel
(tl.associative_scan over an [8, 512] tile: 0.565 / 0.239 ms) vs the running-sum walk kept here
(0.444 / 0.222 ms); session 3: the absent-row zero fill on a side stream concurrent with the walk (0.440 /
0.254 ms), a whole-table Triton store then the walk, with or without the sort on a side stream (0.376-0.391
bf16), zeroing only absent rows while sorting on a side stream (0.36-0.39 bf16, 0.21-0.33 fp32): vs the
fused launch's 0.355 / 0.169 ms (code in git history, commit 59de5bf).
"""

from __future__ import annotations

import torch

from xtrain.kernels._dispatch import (
    PlanCache,
    gdc_launch_dependents,
    gdc_wait,
    is_per_call,
    launch_cached,
    pdl_ok,
    run_side_by_side,
    side_stream,
    sm_count,
    tl,
    triton,
    use_triton,
)
from xtrain.kernels._dispatch import jit as _jit


def embedding_fwd(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[ids]


def embedding_bwd_ref(dout: torch.Tensor, ids: torch.Tensor, V: int) -> torch.Tensor:
    C = dout.shape[-1]
    acc = torch.float64 if dout.dtype == torch.float64 else torch.float32
    dtable = torch.zeros(V, C, dtype=acc, device=dout.device)
    dtable.index_add_(0, ids.reshape(-1), dout.reshape(-1, C).to(acc))
    return dtable.to(dout.dtype)


# ------------------------------------------------------------------------------------------------ Triton


@_jit
def _load_id(SORTED, i, ok, ID_BIAS: tl.constexpr):
    """The table row of sorted key i as int64 (keys may be int16 ids - 32768: ID_BIAS = 32768), -1 where
    not ok. The sentinel is applied after the bias: -1 is a valid int16 key (id 32767)."""
    k = tl.load(SORTED + i, mask=ok, other=0)
    return tl.where(ok, k.to(tl.int64) + ID_BIAS, -1)


@_jit
def _chunk_body(
    c,
    cb,
    DOUT,
    ORDER,
    SORTED,
    DTABLE,
    PART,
    N,
    V,
    C,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    IDX_AHEAD: tl.constexpr,
    ID_BIAS: tl.constexpr,
):
    """Chunk c, column block cb: the CHUNK sorted tokens [s, e) of this chunk, walked one by one with a
    running fp32 row sum that is flushed at each run end; two rows are loaded ahead of the one being
    added, so loads stay in flight while the sum waits. IDX_AHEAD: the source index of a row is loaded
    one step before the row itself, so no step waits on an index load before it can issue its row load.
    A run that lies wholly inside the chunk is written to its dtable row; a run cut by the chunk's start
    goes to PART[chunk, 0], a run cut only by its end to PART[chunk, 1] (the merge pass finishes both).
    Ids >= V (the "rows" form's sentinel: tokens another kernel handles, sorted last) are never written."""
    s = c.to(tl.int64) * CHUNK
    e = tl.minimum(s + CHUNK, N)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    prev_id = _load_id(SORTED, tl.maximum(s - 1, 0), s > 0, ID_BIAS)
    next_id = _load_id(SORTED, e, e < N, ID_BIAS)
    src0 = tl.load(ORDER + s)
    x0 = tl.load(DOUT + src0 * C + cols, mask=cmask, other=0.0)
    src1 = tl.load(ORDER + s + 1, mask=s + 1 < e, other=0)
    x1 = tl.load(DOUT + src1 * C + cols, mask=cmask & (cols * 0 + s + 1 < e), other=0.0)
    if IDX_AHEAD:
        src2 = tl.load(ORDER + s + 2, mask=s + 2 < e, other=0)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    cur = _load_id(SORTED, s, s < N, ID_BIAS)
    run_starts_before = cur == prev_id  # the first run: does it continue a run of an earlier chunk?
    for k in range(s, e):
        x = x0
        x0 = x1
        if IDX_AHEAD:
            x1 = tl.load(DOUT + src2 * C + cols, mask=cmask & (cols * 0 + k + 2 < e), other=0.0)
            src2 = tl.load(ORDER + k + 3, mask=k + 3 < e, other=0)
        else:
            src2 = tl.load(ORDER + k + 2, mask=k + 2 < e, other=0)
            # (masks built as tensors here and above: the interpreter rejects a tensor & scalar mask)
            x1 = tl.load(DOUT + src2 * C + cols, mask=cmask & (cols * 0 + k + 2 < e), other=0.0)
        acc += x.to(tl.float32)
        nid = _load_id(SORTED, k + 1, k + 1 < N, ID_BIAS)
        if (nid != cur) | (k == e - 1):  # the run of ``cur`` ends here (or at the chunk's end)
            ends_after = (k == e - 1) & (cur == next_id)
            if run_starts_before:
                tl.store(PART + (c.to(tl.int64) * 2) * C + cols, acc, mask=cmask)
            elif ends_after:
                tl.store(PART + (c.to(tl.int64) * 2 + 1) * C + cols, acc, mask=cmask)
            elif cur < V:
                tl.store(DTABLE + cur * C + cols, acc.to(DTABLE.dtype.element_ty), mask=cmask)
            acc = tl.zeros([BLOCK_C], dtype=tl.float32)
            run_starts_before = False
            cur = nid


@_jit
def _seg_add(start_a, v_a, start_b, v_b):
    """The segmented-sum combine: (run starts in b?, sum). A range in which a run starts does not take the
    sum on its left; flags or together. Associative (the textbook segmented scan)."""
    return start_a | start_b, tl.where(start_b != 0, v_b, v_a + v_b)


@_jit
def _chunk_tile_body(
    c, cb, DOUT, ORDER, SORTED, DTABLE, PART, N, V, C, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, ID_BIAS: tl.constexpr
):
    """The same contract as ``_chunk_body``, with the chunk's CHUNK rows gathered as one [CHUNK, BLOCK_C]
    tile (every load in flight at once, no per-token wait on an index) and each run summed by a
    segmented scan over the tokens. Pick BLOCK_C = 16 bytes x 32 lanes x num_warps (1024 bf16 on 4 warps,
    512 fp32): the tile's column extent is then exactly one pass of every lane, so each thread holds all
    CHUNK rows of its 16 bytes and the scan is a sequential sum in its registers, with no shuffle, shared
    memory or barrier (checked in the sm_90 PTX); the order is the walk's, ((x0 + x1) + x2) + ...
    (The first tile kernel, 2026-11-29, scanned an [8, 512] bf16 tile on 4 warps: rows across warps, a
    shared-memory scan, and int64 ids carried through it; it lost to the walk.)"""
    s = c.to(tl.int64) * CHUNK
    e = tl.minimum(s + CHUNK, N)
    rows = s + tl.arange(0, CHUNK)  # [CHUNK]
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    rmask = rows < e
    cmask = cols < C
    ids = _load_id(SORTED, rows, rmask, ID_BIAS)  # [CHUNK] int64, -1 past the chunk
    before = _load_id(SORTED, tl.maximum(rows - 1, 0), rows > 0, ID_BIAS)  # the id before each token
    after = _load_id(SORTED, rows + 1, rows + 1 < N, ID_BIAS)  # the id after each token
    src = tl.load(ORDER + rows, mask=rmask, other=0)  # [CHUNK] int64 row of dout
    x = tl.load(DOUT + src[:, None] * C + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(
        tl.float32
    )  # [CHUNK, BLOCK_C]
    # run starts, int32 and broadcast over the columns (the scan takes operands of one shape; the copies
    # along a thread's columns are one register after compilation)
    start = ((ids != before) | (rows == s)).to(tl.int32)[:, None] + tl.zeros([CHUNK, BLOCK_C], dtype=tl.int32)
    _, run = tl.associative_scan((start, x), 0, _seg_add)  # run[k] = the sum of k's run up to token k
    is_end = rmask & ((ids != after) | (rows == e - 1))  # the last token of a run within this chunk
    prev_id = _load_id(SORTED, tl.maximum(s - 1, 0), s > 0, ID_BIAS)  # the id before the chunk (-1: none)
    next_id = _load_id(SORTED, e, e < N, ID_BIAS)  # the id after the chunk
    first_id = _load_id(SORTED, s, s < N, ID_BIAS)
    last_id = _load_id(SORTED, e - 1, e > 0, ID_BIAS)
    cut_first = first_id == prev_id  # the chunk's first run began in an earlier chunk
    cut_last = (last_id == next_id) & (last_id != prev_id)  # its last run goes on (a chunk inside one run: slot 0)
    direct = is_end & (ids != prev_id) & (ids != next_id) & (ids < V)  # only the first run can be prev_id's, ...
    tl.store(
        DTABLE + ids[:, None] * C + cols[None, :],
        run.to(DTABLE.dtype.element_ty),
        mask=direct[:, None] & cmask[None, :],
    )
    # the two cut runs' partials, each taken out of the tile as one row by a masked sum over the tokens
    # (in-thread adds of zeros: exact). A 2-D fp32 store of the tile would be re-laid out through shared
    # memory for bf16 (its 16-byte stores hold 4 fp32 where the tile's lanes hold 8 columns): 31 barriers.
    if cut_first:
        p0 = tl.sum(tl.where((is_end & (ids == first_id))[:, None], run, 0.0), axis=0)
        tl.store(PART + (c.to(tl.int64) * 2) * C + cols, p0, mask=cmask)
    if cut_last:
        p1 = tl.sum(tl.where((rows == e - 1)[:, None], run, 0.0), axis=0)
        tl.store(PART + (c.to(tl.int64) * 2 + 1) * C + cols, p1, mask=cmask)


@_jit
def _embedding_bwd_chunk_kernel(
    DOUT,
    ORDER,
    SORTED,
    DTABLE,
    PART,
    N,
    V,
    C,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    IDX_AHEAD: tl.constexpr = False,
    TILE: tl.constexpr = False,
    ID_BIAS: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    """Program (chunk, column block): ``_chunk_tile_body`` (TILE) or ``_chunk_body``; a chunk that starts
    with an id >= V (all sentinel keys: the ids are sorted) has nothing to do. PDL: let the merge kernel,
    launched as its programmatic dependent, be scheduled as soon as every program here has started."""
    if PDL:
        gdc_launch_dependents()
    c = tl.program_id(0)
    if _load_id(SORTED, c.to(tl.int64) * CHUNK, True, ID_BIAS) < V:
        if TILE:
            _chunk_tile_body(c, tl.program_id(1), DOUT, ORDER, SORTED, DTABLE, PART, N, V, C, CHUNK, BLOCK_C, ID_BIAS)
        else:
            _chunk_body(
                c, tl.program_id(1), DOUT, ORDER, SORTED, DTABLE, PART, N, V, C, CHUNK, BLOCK_C, IDX_AHEAD, ID_BIAS
            )


@_jit
def _zero_body(z, PRESENT, DTABLE, V, C, n_zcb, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Zero tile z (row block z // n_zcb, column block z % n_zcb): the rows of ids that never occur."""
    rows = (z // n_zcb).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (z % n_zcb) * BLOCK_C + tl.arange(0, BLOCK_C)
    absent = tl.load(PRESENT + rows, mask=rows < V, other=1) == 0
    zero = tl.zeros([BLOCK_R, BLOCK_C], dtype=DTABLE.dtype.element_ty)
    tl.store(DTABLE + rows[:, None] * C + cols[None, :], zero, mask=absent[:, None] & (cols < C)[None, :])


@_jit
def _embedding_bwd_fused_kernel(
    DOUT,
    ORDER,
    SORTED,
    DTABLE,
    PART,
    PRESENT,
    N,
    V,
    C,
    n_cb,
    n_chunk_progs,
    n_zcb,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    IDX_AHEAD: tl.constexpr,
    ZBLOCK_R: tl.constexpr,
    ZBLOCK_C: tl.constexpr,
    TILE: tl.constexpr = False,
    ID_BIAS: tl.constexpr = 0,
):
    """The chunk pass and the zero fill of absent rows in one launch (they write disjoint rows): the first
    n_chunk_progs programs are (chunk, column block) pairs, the rest zero tiles, so the latency-bound
    chunk walks run while the zero tiles stream their writes, instead of one pass after the other."""
    pid = tl.program_id(0)
    if pid < n_chunk_progs:
        if TILE:
            _chunk_tile_body(
                pid // n_cb, pid % n_cb, DOUT, ORDER, SORTED, DTABLE, PART, N, V, C, CHUNK, BLOCK_C, ID_BIAS
            )
        else:
            _chunk_body(
                pid // n_cb, pid % n_cb, DOUT, ORDER, SORTED, DTABLE, PART, N, V, C, CHUNK, BLOCK_C, IDX_AHEAD, ID_BIAS
            )
    else:
        _zero_body(pid - n_chunk_progs, PRESENT, DTABLE, V, C, n_zcb, ZBLOCK_R, ZBLOCK_C)


@_jit
def _embedding_bwd_merge_kernel(
    SORTED,
    PART,
    DTABLE,
    N,
    V,
    C,
    n_chunks,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ID_BIAS: tl.constexpr = 0,
    MERGE_BLOCK: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    """Program (chunk, column block): if this chunk's last run starts here and continues into the next
    chunks, sum its partials (PART[c, 1], then PART[c', 0] of every later chunk c' the run reaches) and
    write the dtable row: one chunk per step (MERGE_BLOCK = 1), or MERGE_BLOCK chunks per step, their first
    ids and partial rows loaded together and the [MERGE_BLOCK, BLOCK_C] tile summed over its rows (the ids
    are sorted, so the chunks a run reaches are one unbroken stretch). A frequent id spans many chunks (one
    seen 521 times spans 33 chunks of 16 tokens): one chunk per step makes that a chain of dependent loads.
    Fixed shapes, fixed order: the result does not depend on scheduling. Ids >= V (sentinels) are skipped.
    PDL (launched as the chunk kernel's programmatic dependent): the programs may start while the chunk
    kernel still runs, and wait here until its grid has finished and its writes are visible."""
    if PDL:
        gdc_wait()
    c = tl.program_id(0)
    s = c.to(tl.int64) * CHUNK
    e = tl.minimum(s + CHUNK, N)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    last = _load_id(SORTED, e - 1, e > 0, ID_BIAS)
    first = _load_id(SORTED, s, s < N, ID_BIAS)
    prev_id = _load_id(SORTED, tl.maximum(s - 1, 0), s > 0, ID_BIAS)
    next_id = _load_id(SORTED, e, e < N, ID_BIAS)
    starts_here = (first != last) | (prev_id != last)
    if starts_here & (next_id == last) & (last < V):
        acc = tl.load(PART + (c.to(tl.int64) * 2 + 1) * C + cols, mask=cmask, other=0.0)
        if MERGE_BLOCK == 1:  # one chunk per step
            cc = c + 1
            go = True
            while go:  # the run reaches chunk cc (its first token has id ``last``)
                acc += tl.load(PART + (cc.to(tl.int64) * 2) * C + cols, mask=cmask, other=0.0)
                cc += 1
                nid = _load_id(SORTED, tl.minimum(cc, n_chunks - 1).to(tl.int64) * CHUNK, cc < n_chunks, ID_BIAS)
                go = (cc < n_chunks) & (nid == last)
        else:
            ccs = c + 1 + tl.arange(0, MERGE_BLOCK)
            go = True
            while go:  # the run reaches chunk cc where cc's first token has id ``last``
                inside = ccs < n_chunks
                nid = _load_id(SORTED, tl.minimum(ccs, n_chunks - 1).to(tl.int64) * CHUNK, inside, ID_BIAS)
                reach = inside & (nid == last)
                tile = tl.load(
                    PART + (ccs.to(tl.int64) * 2)[:, None] * C + cols[None, :],
                    mask=reach[:, None] & cmask[None, :],
                    other=0.0,
                )
                acc += tl.sum(tile, axis=0)
                go = tl.sum(reach.to(tl.int32), axis=0) == MERGE_BLOCK  # all reached: the run may go on
                ccs += MERGE_BLOCK
        tl.store(DTABLE + last * C + cols, acc.to(DTABLE.dtype.element_ty), mask=cmask)


@_jit
def _embedding_zero_absent_kernel(PRESENT, DTABLE, V, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Zero the dtable rows of ids that never occur (the others are written by the chunk/merge passes)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    absent = tl.load(PRESENT + rows, mask=rows < V, other=1) == 0
    zero = tl.zeros([BLOCK_R, BLOCK_C], dtype=DTABLE.dtype.element_ty)
    tl.store(DTABLE + rows[:, None] * C + cols[None, :], zero, mask=absent[:, None] & (cols < C)[None, :])


@_jit
def _embedding_keys_kernel(
    IDS,
    KEYS,
    PRESENT,
    COUNTS,
    N,
    ID_BIAS: tl.constexpr,
    MARK: tl.constexpr,
    HEAVY_K: tl.constexpr,
    SENTINEL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The sort keys (ids - ID_BIAS in KEYS' dtype: int16 keys sort in two radix passes where int32 take
    four) and, if MARK, the present marks (PRESENT[id] = 1; every writer stores the same 1, so the result
    does not depend on their order) in one launch: torch needed a cast and an index_put. HEAVY_K > 0 (the
    "rows" form): only the tokens of ids seen more than HEAVY_K times (COUNTS) keep their key; the others get
    SENTINEL, the largest key, which sorts last and names no row (its id is >= V)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    ids = tl.load(IDS + i, mask=m, other=0)
    keys = (ids - ID_BIAS).to(KEYS.dtype.element_ty)
    if HEAVY_K > 0:
        heavy = tl.load(COUNTS + ids, mask=m, other=0) > HEAVY_K
        keys = tl.where(heavy, keys, tl.full([BLOCK], SENTINEL, KEYS.dtype.element_ty))
    tl.store(KEYS + i, keys, mask=m)
    if MARK:
        tl.store(PRESENT + ids, tl.full([BLOCK], 1, dtype=PRESENT.dtype.element_ty), mask=m)


@_jit
def _embedding_slots_kernel(
    IDS,
    COUNTS,
    SLOTS,
    N,
    V,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
    NAMED=None,
    NAMED_N=None,
    LIST_NAMED: tl.constexpr = False,
    SEM: tl.constexpr = "acq_rel",
):
    """The "rows" form's first pass: each token takes the next slot of its id (COUNTS[id], an integer
    atomic: the final counts do not depend on the order) and, if the slot is below K, writes its token
    index to SLOTS[slot, id]. Which token gets which slot depends on scheduling; the rows kernel sorts a
    row's slots, so the sum it forms does not. PDL: the rows kernel, launched as this kernel's programmatic
    dependent, may be scheduled at once (it waits for this grid's end before its first load)."""
    m, ids, slot, _ = _take_slots(IDS, COUNTS, SLOTS, N, V, K, BLOCK, PDL, False, SEM)
    if LIST_NAMED:  # ROWS_FORM_ROLES: the token taking slot 0 lists its id (NAMED_N[0] counts them)
        _append(NAMED, NAMED_N, m & (slot == 0), ids.to(tl.int32), SEM)


@_jit
def _take_slots(
    IDS,
    COUNTS,
    SLOTS,
    N,
    V,
    KEEP: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    WAIT: tl.constexpr,
    SEM: tl.constexpr = "acq_rel",
):
    """The slots passes' common part: this program's BLOCK tokens each take the next slot of their id and write
    their index to SLOTS[slot, id] below KEEP; returns (the valid-token mask, the ids, the slots, the token
    indices). WAIT: this
    kernel was launched as the counts' zero fill's programmatic dependent; wait for that grid before the
    atomics (the ids are loaded first)."""
    if PDL:
        gdc_launch_dependents()
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    ids = tl.load(IDS + i, mask=m, other=0)
    if WAIT:
        gdc_wait()
    slot = tl.atomic_add(COUNTS + ids, 1, mask=m, sem=SEM)
    tl.store(SLOTS + slot.to(tl.int64) * V + ids, i.to(tl.int32), mask=m & (slot < KEEP))
    return m, ids, slot, i


@_jit
def _append(LIST, COUNT, take, vals, SEM: tl.constexpr = "acq_rel", LIST2=None, vals2=None):
    """vals where take, appended to LIST after the COUNT[0] entries there (one atomic for the program; places
    within it by a prefix sum); LIST2: vals2 at the same places of a second list."""
    if tl.sum(take.to(tl.int32), axis=0) > 0:  # (most programs add no heavy id: no atomic)
        pos = _places(COUNT, take, SEM)
        tl.store(LIST + pos, vals, mask=take)
        if LIST2 is not None:
            tl.store(LIST2 + pos, vals2, mask=take)


@_jit
def _places(COUNT, take, SEM: tl.constexpr):
    """The list places of the entries where take, after the COUNT[0] entries there: one atomic for the program (none
    where it adds nothing), places within it by a prefix sum."""
    t = take.to(tl.int32)
    n = tl.sum(t, axis=0)
    return tl.atomic_add(COUNT, n, mask=n > 0, sem=SEM) + tl.cumsum(t, axis=0) - 1


@_jit
def _cx(a, b):
    """A compare-exchange of a sorting network: (min, max), elementwise."""
    return tl.minimum(a, b), tl.maximum(a, b)


@_jit
def _row_slot(SLOTS, j: tl.constexpr, rows, own, cnt, V):
    """Slot j of each row (a token index), or the largest int32 where the row has no j-th token."""
    return tl.load(SLOTS + j * V + rows, mask=own & (cnt > j), other=2**31 - 1)


@_jit
def _row_add(acc, DOUT, src, take, cols, cmask, C, EVICT: tl.constexpr):
    """acc + the dout rows src (one per table row of the tile), where take (EVICT: an L2 eviction policy for
    these loads, "" for none)."""
    return acc + _dout_rows(DOUT, src, take, cols, cmask, C, EVICT)


@_jit
def _dout_rows(DOUT, src, take, cols, cmask, C, EVICT: tl.constexpr):
    """The dout rows src, columns cols, in fp32: a [len(src), len(cols)] tile, zeros where not take."""
    x = tl.load(
        DOUT + src.to(tl.int64)[:, None] * C + cols[None, :],
        mask=take[:, None] & cmask[None, :],
        other=0.0,
        eviction_policy=EVICT,
    )
    return x.to(tl.float32)


@_jit
def _rows_tile(
    rb,
    cb,
    DOUT,
    COUNTS,
    SLOTS,
    DTABLE,
    V,
    C,
    K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    EVICT: tl.constexpr,
    ZERO_FAST: tl.constexpr,
):
    """Tile (row block rb, column block cb) of the "rows" form: every row seen at most K times (1, 2, 4 or 8) is
    written here, whole: zeros for a row no token names, else the sum of its tokens' dout rows in token
    order (fp32, ((0 + x0) + x1) + ..., rounded once). A row's K slots are put in token order by a sorting
    network on per-row vectors: elementwise min/max in the registers that hold the row (the first version
    sorted a [BLOCK_R, K] tile with tl.sort and took each column out with a min-reduction; on the H200 the two
    measured the same, so the sort was not the cost). The K gathers are independent, so a tile's loads are
    all in flight together. The kernel slows with K (alone, fp32: 88% of copy with K = 2, 84-85% with K = 4;
    bf16 87-88% and 68-70%; not profiled: the unrolled masked gathers are the suspect). Rows seen more often are
    left to the sort/walk/merge chain (a frequent id has too many rows for one program)."""
    rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    cnt = tl.load(COUNTS + rows, mask=rows < V, other=K + 1)
    own = cnt <= K
    if ZERO_FAST:  # a tile whose rows no token names (most of a large table): zeros, no slots, no gathers
        if tl.max(tl.where(own, cnt, 0), axis=0) == 0:
            tl.store(
                DTABLE + rows[:, None] * C + cols[None, :],
                tl.zeros([BLOCK_R, BLOCK_C], dtype=DTABLE.dtype.element_ty),
                mask=own[:, None] & cmask[None, :],
            )
        else:
            _rows_sum(rows, cols, cmask, cnt, own, DOUT, SLOTS, DTABLE, V, C, K, BLOCK_R, BLOCK_C, EVICT)
    else:
        _rows_sum(rows, cols, cmask, cnt, own, DOUT, SLOTS, DTABLE, V, C, K, BLOCK_R, BLOCK_C, EVICT)


@_jit
def _rows_sum(
    rows,
    cols,
    cmask,
    cnt,
    own,
    DOUT,
    SLOTS,
    DTABLE,
    V,
    C,
    K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    EVICT: tl.constexpr,
):
    """``_rows_tile``'s sums: the rows' slots in token order, the K gathers, the store."""
    s0 = _row_slot(SLOTS, 0, rows, own, cnt, V)
    if K >= 2:
        s1 = _row_slot(SLOTS, 1, rows, own, cnt, V)
    if K >= 4:
        s2 = _row_slot(SLOTS, 2, rows, own, cnt, V)
        s3 = _row_slot(SLOTS, 3, rows, own, cnt, V)
    if K >= 8:
        s4 = _row_slot(SLOTS, 4, rows, own, cnt, V)
        s5 = _row_slot(SLOTS, 5, rows, own, cnt, V)
        s6 = _row_slot(SLOTS, 6, rows, own, cnt, V)
        s7 = _row_slot(SLOTS, 7, rows, own, cnt, V)
    if K == 2:
        s0, s1 = _cx(s0, s1)
    if K == 4:  # 5 exchanges
        s0, s1 = _cx(s0, s1)
        s2, s3 = _cx(s2, s3)
        s0, s2 = _cx(s0, s2)
        s1, s3 = _cx(s1, s3)
        s1, s2 = _cx(s1, s2)
    if K == 8:  # Batcher's odd-even merge sort, 19 exchanges
        s0, s1 = _cx(s0, s1)
        s2, s3 = _cx(s2, s3)
        s4, s5 = _cx(s4, s5)
        s6, s7 = _cx(s6, s7)
        s0, s2 = _cx(s0, s2)
        s1, s3 = _cx(s1, s3)
        s4, s6 = _cx(s4, s6)
        s5, s7 = _cx(s5, s7)
        s1, s2 = _cx(s1, s2)
        s5, s6 = _cx(s5, s6)
        s0, s4 = _cx(s0, s4)
        s1, s5 = _cx(s1, s5)
        s2, s6 = _cx(s2, s6)
        s3, s7 = _cx(s3, s7)
        s2, s4 = _cx(s2, s4)
        s3, s5 = _cx(s3, s5)
        s1, s2 = _cx(s1, s2)
        s3, s4 = _cx(s3, s4)
        s5, s6 = _cx(s5, s6)
    acc = _row_add(tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32), DOUT, s0, own & (cnt > 0), cols, cmask, C, EVICT)
    if K >= 2:
        acc = _row_add(acc, DOUT, s1, own & (cnt > 1), cols, cmask, C, EVICT)
    if K >= 4:
        acc = _row_add(acc, DOUT, s2, own & (cnt > 2), cols, cmask, C, EVICT)
        acc = _row_add(acc, DOUT, s3, own & (cnt > 3), cols, cmask, C, EVICT)
    if K >= 8:
        acc = _row_add(acc, DOUT, s4, own & (cnt > 4), cols, cmask, C, EVICT)
        acc = _row_add(acc, DOUT, s5, own & (cnt > 5), cols, cmask, C, EVICT)
        acc = _row_add(acc, DOUT, s6, own & (cnt > 6), cols, cmask, C, EVICT)
        acc = _row_add(acc, DOUT, s7, own & (cnt > 7), cols, cmask, C, EVICT)
    tl.store(
        DTABLE + rows[:, None] * C + cols[None, :], acc.to(DTABLE.dtype.element_ty), mask=own[:, None] & cmask[None, :]
    )


@_jit
def _embedding_bwd_rows_kernel(
    DOUT,
    COUNTS,
    SLOTS,
    DTABLE,
    V,
    C,
    n_cb,
    n_tiles,
    K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PERSISTENT: tl.constexpr = False,
    EVICT: tl.constexpr = "",
    ZERO_FAST: tl.constexpr = False,
    PDL: tl.constexpr = False,
    NAMED=None,
    NAMED_N=None,
    GP: tl.constexpr = 0,
    FIRST=None,
):
    """The "rows" form's grid (``_rows_tile``): one program per (row block, column block), or PERSISTENT, a
    fixed number of programs walking the tiles t = pid, pid + G, ... (row block t // n_cb, column block
    t % n_cb). Persistent, the grid leaves room on every SM, so the side stream's chain kernels find an SM
    slot at once instead of waiting for tiles to retire. PDL (launched as the slots kernel's programmatic
    dependent): wait here for that grid's end and its writes.
    GP > 0 (``ROWS_ROLES``, ``ROWS_FORM_ROLES``; one row per program, not persistent): the grid in two roles. The
    first GP programs of axis 0 write the named rows (the list NAMED, NAMED_N[0] long, made by the slots pass) seen
    at most K times, program p the list's entries p, p + GP, ...; the rest, one per row, write zeros where the row's
    count is 0. So the gathers come first and the zero rows after them instead of interleaved in row order: on the
    H200 the same bytes moved 9 % faster in that order (bench/mix_probe.py, session 20)."""
    if PDL:
        gdc_wait()
    if GP > 0:
        pid = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        if pid < GP:
            for e in range(pid, tl.load(NAMED_N), GP):
                if FIRST is not None:  # a row of one token: its index from the list, no slot to load
                    f = tl.load(NAMED + e).to(tl.int64)
                    tok = tl.load(FIRST + e).to(tl.int64)
                    c1 = tl.load(COUNTS + f)
                    if c1 == 1:
                        x = tl.load(DOUT + tok * C + cols, mask=cmask, other=0.0, eviction_policy=EVICT)
                        acc = tl.zeros([BLOCK_C], dtype=tl.float32) + x.to(tl.float32)  # (0 + x: _rows_sum's bits)
                        tl.store(DTABLE + f * C + cols, acc.to(DTABLE.dtype.element_ty), mask=cmask)
                    elif c1 <= K:
                        rows = f + tl.arange(0, 1)
                        cnt = c1 + tl.zeros([1], dtype=tl.int32)
                        _rows_sum(rows, cols, cmask, cnt, cnt <= K, DOUT, SLOTS, DTABLE, V, C, K, 1, BLOCK_C, EVICT)
                else:
                    rows = tl.load(NAMED + e).to(tl.int64) + tl.arange(0, 1)
                    cnt = tl.load(COUNTS + rows)
                    own = cnt <= K
                    if tl.max(own.to(tl.int32), axis=0) > 0:
                        _rows_sum(rows, cols, cmask, cnt, own, DOUT, SLOTS, DTABLE, V, C, K, 1, BLOCK_C, EVICT)
        else:
            r = (pid - GP).to(tl.int64)
            zero = tl.load(COUNTS + r) == 0
            tl.store(
                DTABLE + r * C + cols,
                tl.zeros([BLOCK_C], dtype=DTABLE.dtype.element_ty),
                mask=cmask & (cols < tl.where(zero, C, 0)),
            )
    elif PERSISTENT:
        for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
            _rows_tile(t // n_cb, t % n_cb, DOUT, COUNTS, SLOTS, DTABLE, V, C, K, BLOCK_R, BLOCK_C, EVICT, ZERO_FAST)
    else:
        _rows_tile(
            tl.program_id(0), tl.program_id(1), DOUT, COUNTS, SLOTS, DTABLE, V, C, K, BLOCK_R, BLOCK_C, EVICT, ZERO_FAST
        )


@_jit
def _embedding_tier_slots_kernel(
    IDS,
    COUNTS,
    SLOTS,
    MED,
    HEAVY,
    NLIST,
    N,
    V,
    K: tl.constexpr,
    K2: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
    WAIT: tl.constexpr = False,
    NAMED=None,
    LIST_NAMED: tl.constexpr = False,
    SEM: tl.constexpr = "acq_rel",
    TOGETHER: tl.constexpr = False,
    FIRST=None,
):
    """The "tiers" form's first pass: each token takes the next slot of its id (COUNTS[id], an integer atomic) and
    writes its index to SLOTS[slot, id] if the slot is below K2. The token that takes slot K appends its id to the
    medium list MED, the one that takes slot K2 to the heavy list HEAVY (NLIST[0] and NLIST[1] count them; one
    atomic per program and list, positions within the program by a prefix sum). Which token takes which slot, and
    where an id lands in a list, depend on scheduling; the later passes order each row's tokens by index, so the
    sums do not. PDL: as ``_embedding_slots_kernel``. WAIT: as ``_take_slots``. LIST_NAMED (``ROWS_ROLES``): the token
    that takes slot 0 appends its id to NAMED (NLIST[2] counts them): every id the batch names, once. TOGETHER
    (``SLOTS_APPEND_TOGETHER``): the lists' atomics issued one after the other before any of their stores (masked
    where the program adds nothing), not each list's atomic, then its stores, then the next list's. FIRST
    (``ROWS_FIRST``): the token that appends an id to NAMED also writes its own index to FIRST at the same place."""
    m, ids, slot, i = _take_slots(IDS, COUNTS, SLOTS, N, V, K2, BLOCK, PDL, WAIT, SEM)
    tok = i.to(tl.int32)
    if TOGETHER:
        pm = _places(NLIST, m & (slot == K), SEM)
        ph = _places(NLIST + 1, m & (slot == K2), SEM)
        if LIST_NAMED:
            pn = _places(NLIST + 2, m & (slot == 0), SEM)
            tl.store(NAMED + pn, ids.to(tl.int32), mask=m & (slot == 0))
            if FIRST is not None:
                tl.store(FIRST + pn, tok, mask=m & (slot == 0))
        tl.store(MED + pm, ids.to(tl.int32), mask=m & (slot == K))
        tl.store(HEAVY + ph, ids.to(tl.int32), mask=m & (slot == K2))
    else:
        _append(MED, NLIST, m & (slot == K), ids.to(tl.int32), SEM)
        _append(HEAVY, NLIST + 1, m & (slot == K2), ids.to(tl.int32), SEM)
        if LIST_NAMED:
            _append(NAMED, NLIST + 2, m & (slot == 0), ids.to(tl.int32), SEM, FIRST, tok)


@_jit
def _zero_i32_kernel(X, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """X[:n] = 0 (int32). PDL: the kernel after it (the slots pass, launched as its programmatic dependent, waiting
    with gdc_wait before its atomics) may be scheduled at once instead of after this grid's end."""
    if PDL:
        gdc_launch_dependents()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + i, tl.zeros([BLOCK], dtype=tl.int32), mask=i < n)


@_jit
def _embedding_tier_a_kernel(
    IDS,
    DOUT,
    COUNTS,
    SLOTS,
    MED,
    HEAVY,
    NLIST,
    HLIST,
    HBASE,
    DTABLE,
    N,
    V,
    C,
    K2: tl.constexpr,
    MT: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SCAN: tl.constexpr,
    DO_HEAVY: tl.constexpr,
    DO_MED: tl.constexpr,
    AHEAD: tl.constexpr = 0,
    MAXC: tl.constexpr = False,
):
    """Persistent over the lists. DO_HEAVY: each heavy id's token list, in token order, into HLIST from offset
    HBASE[h] (the counts of the heavy ids listed before it): a scan of the ids SCAN at a time, each hit placed by a
    running prefix sum. DO_MED: each medium row (K < count <= K2), whole: its K2 slots put in token order by their
    ranks (a [K2, K2] comparison of token indices; an empty slot, the largest int32, ranks at the count), its
    tokens gathered MT at a time in that order, each tile's rows added by a fixed reduction tree and the tiles in
    order, in fp32, rounded once."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    n_med = 0
    n_heavy = 0
    if DO_MED:
        n_med = tl.load(NLIST)
    if DO_HEAVY:
        n_heavy = tl.load(NLIST + 1)
    for h in range(pid, n_heavy, P):
        f = tl.load(HEAVY + h)
        if MAXC:  # the largest heavy count, for tier B's segments
            tl.atomic_max(NLIST + 3, tl.load(COUNTS + f), sem="relaxed")
        base = 0
        for c0 in range(0, h, 1024):
            hh = c0 + tl.arange(0, 1024)
            before = hh < h
            fs = tl.load(HEAVY + hh, mask=before, other=0)
            base += tl.sum(tl.load(COUNTS + fs, mask=before, other=0), axis=0)
        tl.store(HBASE + h, base)
        run = base
        for t0 in range(0, N, SCAN):
            t = t0 + tl.arange(0, SCAN)
            hit = (tl.load(IDS + t, mask=t < N, other=-1) == f).to(tl.int32)
            tl.store(HLIST + run + tl.cumsum(hit, axis=0) - 1, t.to(tl.int32), mask=hit != 0)
            run += tl.sum(hit, axis=0)
    j = tl.arange(0, K2)
    if AHEAD == 0:
        for e in range(pid, n_med, P):
            f = tl.load(MED + e)
            cnt = tl.load(COUNTS + f)
            if cnt <= K2:
                s = tl.load(SLOTS + j.to(tl.int64) * V + f, mask=j < cnt, other=2**31 - 1)
                _med_row(f, cnt, s, DOUT, DTABLE, C, K2, MT, BLOCK_C)
    else:
        # AHEAD rows of this program's share at once: their ids and counts in one step each, every row's slots
        # loaded before the row ahead of it is gathered (a chain of dependent loads per step, not per row)
        q = tl.arange(0, AHEAD)
        for e0 in range(pid, n_med, P * AHEAD):
            e = e0 + q * P
            ok = e < n_med
            fs = tl.load(MED + e, mask=ok, other=0)
            cnts = tl.load(COUNTS + fs, mask=ok, other=0)
            raw = tl.load(SLOTS + j.to(tl.int64) * V + tl.sum(tl.where(q == 0, fs, 0), axis=0))
            for i in range(0, tl.sum(ok.to(tl.int32), axis=0)):
                f = tl.sum(tl.where(q == i, fs, 0), axis=0)
                cnt = tl.sum(tl.where(q == i, cnts, 0), axis=0)
                # the next row's slots (row 0's, unused, after the last): in flight during this row's gathers
                raw_next = tl.load(SLOTS + j.to(tl.int64) * V + tl.sum(tl.where(q == i + 1, fs, 0), axis=0))
                if cnt <= K2:
                    _med_row(f, cnt, tl.where(j < cnt, raw, 2**31 - 1), DOUT, DTABLE, C, K2, MT, BLOCK_C)
                raw = raw_next


@_jit
def _med_row(f, cnt, s, DOUT, DTABLE, C, K2: tl.constexpr, MT: tl.constexpr, BLOCK_C: tl.constexpr):
    """Tier A's medium row f (K < cnt <= K2), whole: its slots s (K2 token indices, the largest int32 past cnt)
    ranked into token order, gathered MT at a time."""
    rank = tl.sum((s[None, :] < s[:, None]).to(tl.int32), axis=1)
    row = f.to(tl.int64) * C
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cm = cols < C
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for t in range(0, cnt, MT):
            r = t + tl.arange(0, MT)
            src = tl.sum(tl.where(rank[None, :] == r[:, None], s[None, :], 0), axis=1)
            acc += tl.sum(_dout_rows(DOUT, src, r < cnt, cols, cm, C, ""), axis=0)
        tl.store(DTABLE + row + cols, acc.to(DTABLE.dtype.element_ty), mask=cm)


@_jit
def _embedding_tier_b_kernel(
    DOUT,
    COUNTS,
    HEAVY,
    NLIST,
    HLIST,
    HBASE,
    DTABLE,
    C,
    n_cb,
    HT: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PART=None,
    SEG: tl.constexpr = 0,
):
    """Persistent over (heavy id, column block) items: the id's listed tokens (HLIST, token order) gathered HT at
    a time, each tile added by a fixed reduction tree and the tiles in order, in fp32, rounded once.
    SEG > 0 (``TIER_B_SEG``, a multiple of HT): items (heavy id, segment, column block), a segment SEG consecutive
    tokens of the id's list (as many segments per id as the longest id has, NLIST[3] being the largest count, which
    tier A's heavy part wrote; those past an id's count exit). An id of at most SEG
    tokens is written as above (the same bits); a longer one's segments go to fp32 rows of PART, at row
    HBASE[h] // SEG + h + segment (no two ids' segments share a row), which ``_embedding_tier_b_merge_kernel`` adds in
    order: a single id with most of the batch's tokens is then summed by many programs, not by one per column block."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    n_heavy = tl.load(NLIST + 1)
    nseg = 1  # SEG == 0: one segment, the whole id
    if SEG > 0:
        nseg = tl.cdiv(tl.load(NLIST + 3), SEG)
    for it in range(pid, n_heavy * nseg * n_cb, P):
        hs = it // n_cb
        h = hs // nseg
        seg = hs % nseg
        f = tl.load(HEAVY + h)
        cnt = tl.load(COUNTS + f)
        t0 = seg * SEG
        if t0 < cnt:
            t1 = cnt
            if SEG > 0:
                t1 = tl.minimum(cnt, t0 + SEG)
            base = tl.load(HBASE + h)
            cols = (it % n_cb) * BLOCK_C + tl.arange(0, BLOCK_C)
            cm = cols < C
            acc = _heavy_tiles(DOUT, HLIST, base, t0, t1, cols, cm, C, HT, BLOCK_C)
            dst = DTABLE + f.to(tl.int64) * C + cols
            if SEG == 0:  # one segment, the whole id (a compile-time branch: PART is None here, which triton 3.6
                tl.store(dst, acc.to(DTABLE.dtype.element_ty), mask=cm)  # will not compile even where dead)
            else:
                if t1 - t0 == cnt:  # the whole id in this segment
                    tl.store(dst, acc.to(DTABLE.dtype.element_ty), mask=cm)
                else:
                    row = (base // SEG + h + seg).to(tl.int64)
                    tl.store(PART + row * C + cols, acc, mask=cm)


@_jit
def _heavy_tiles(DOUT, HLIST, base, t0, t1, cols, cm, C, HT: tl.constexpr, BLOCK_C: tl.constexpr):
    """The fp32 sum of the dout rows of list places base + t0 .. base + t1 - 1, HT at a time (each tile by a fixed
    reduction tree, the tiles in order)."""
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for t in range(t0, t1, HT):
        r = t + tl.arange(0, HT)
        ok = r < t1
        tok = tl.load(HLIST + base + r, mask=ok, other=0)
        acc += tl.sum(_dout_rows(DOUT, tok, ok, cols, cm, C, ""), axis=0)
    return acc


@_jit
def _embedding_tier_b_merge_kernel(
    COUNTS, HEAVY, NLIST, HBASE, PART, DTABLE, C, n_cb, SEG: tl.constexpr, BLOCK_C: tl.constexpr
):
    """After ``_embedding_tier_b_kernel`` with SEG: each heavy id of more than SEG tokens, by (id, column block) items,
    its segments' fp32 partial rows added in segment order and rounded once."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    n_heavy = tl.load(NLIST + 1)
    for it in range(pid, n_heavy * n_cb, P):
        h = it // n_cb
        f = tl.load(HEAVY + h)
        cnt = tl.load(COUNTS + f)
        if cnt > SEG:
            first = (tl.load(HBASE + h) // SEG + h).to(tl.int64)
            cols = (it % n_cb) * BLOCK_C + tl.arange(0, BLOCK_C)
            cm = cols < C
            acc = tl.zeros([BLOCK_C], dtype=tl.float32)
            for seg in range(0, tl.cdiv(cnt, SEG)):
                acc += tl.load(PART + (first + seg) * C + cols, mask=cm, other=0.0)
            tl.store(DTABLE + f.to(tl.int64) * C + cols, acc.to(DTABLE.dtype.element_ty), mask=cm)


CONFIG = None  # (CHUNK, BLOCK_C, num_warps, zero fill[, sort keys[, idx_ahead[, chunk body]]]) override, for
# the bench's sweep.
# zero fill: "torch" (torch.zeros first), "absent" (_embedding_zero_absent_kernel, then the chunk pass),
# "fused" (_embedding_bwd_fused_kernel: zero tiles of absent rows and chunk walks in one launch), "side" (the
# absent rows zeroed on the current stream while the sort, walks and merge run on a high-priority side stream).
# sort keys: False (int64 ids), True or 32 (int32: half the radix passes of int64; ids < 2^31), 16 (int16
# ids - 32768 where V <= 65536, else int32: half again). idx_ahead: see _chunk_body.
# chunk body: "walk" (_chunk_body) or "tile" (_chunk_tile_body).
# measured best on the H200 (bench/RESULTS.md), by dout element size:
# session 3 sweep: bf16 (V = 128k, C = 4096) the fused launch (zero tiles + walks) with keys and marks from
# _embedding_keys_kernel, 0.373 -> 0.355 ms (76 -> 80% of copy); fp32 (V = 32k, C = 2048) the tile body, fused,
# int16 keys, 0.195 -> 0.169 ms (48 -> 55%).
# session 6 sweep (GPU time, host kept ahead; bench/RESULTS.md): the "side" streams, walk body, int16 keys where
# V <= 65536: bf16 0.354 -> 0.312 ms (80 -> 91% of copy), fp32 0.162 -> 0.149 ms (58 -> 63%; the tile body and
# chunks of 32 within 1%).
# session 7 (GPU time): fp32 the "rows" form, 0.153-0.156 -> 0.133-0.137 ms (60 -> 68-70% of copy); bf16 stays
# "side" (rows K2 0.344 ms against 0.312-0.314: there the table is 8x the tokens' rows and the zero fill hides
# the whole chain already).
DEFAULTS = {2: (16, 1024, 4, "side", 16, True), 4: (16, 512, 4, "tiers", 16, True)}
SIDE_HIGH_PRIORITY = True  # "side": the side stream of the highest priority (False: the default priority)
# "rows" (zero fill mode): (slots per row K, BLOCK_R, BLOCK_C, num_warps[, programs per SM: persistent]) of
# _embedding_bwd_rows_kernel, by dout element size; ROWS overrides for the bench's sweep
# fp32: whole 2048-column rows, one per program, since session 12 (whole-row tiles alone 0.099-0.101 ms against
# 0.109-0.110 for 8x512; the op 0.129-0.131 against 0.132-0.134 ms; bench/embedding_rows_probe.py, RESULTS.md).
# Narrower tables keep one row per program: at C = 512 / 1024 the op took 0.078 / 0.092 ms against 0.078 / 0.093
# for 8x512, and keeping 2048 elements per program (4x512, 2x1024) was no better (0.078 / 0.099); C = 4096 (V =
# 16k): 0.169 against 0.174.
ROWS_DEFAULTS = {2: (2, 4, 2048, 8), 4: (4, 1, 2048, 8)}
ROWS = None
# the rows kernel's gathers: "" or an L2 eviction policy ("evict_first": each row is read once); and a branch for
# tiles whose rows no token names (zeros, no slots, no gathers). H200, session 7, fp32: every combination over
# four tilings 0.132-0.137 ms against the default's 0.134 (within the spread), so both stay off; the zero branch
# did help the rows form in bf16 with K = 4 (0.39-0.46 -> 0.35-0.37 ms), still behind "side" (0.313).
ROWS_EVICT = ""
ROWS_ZERO_FAST = False
PDL = True  # the merge kernel as the chunk kernel's programmatic dependent ("side" and "rows" forms, sm_90+):
# its programs are resident and waiting when the walks end, instead of waiting then for an SM (H200, session 7:
# the chain ended ~17 us sooner in the timeline; the op 0.133-0.134 vs 0.136 ms fp32, 0.311-0.313 vs 0.314 bf16)
# the rows form's launches (session 16): ROWS_PDL the rows kernel as the slots kernel's programmatic dependent (sm_90+:
# its launch overlaps the slots pass, its programs wait for that grid's end); ROWS_MAIN_FIRST the rows grid issued
# before the chain's kernels. H200 fp32 (bench/RESULTS.md): the rows grid then starts ~7 us sooner and runs at its
# own speed (99.8 us; 113.5 us when issued after the chain), the op 0.125-0.127 ms against 0.127-0.128 (four processes)
ROWS_PDL = True
ROWS_MAIN_FIRST = True
# "tiers" (zero fill mode; the fp32 default since session 18): (K2, MT, BLOCK_C, num_warps, programs per SM of tier
# A's medium rows, HT, BLOCK_C, num_warps, programs per SM of tier B, SCAN) by dout element size (the rows grid
# takes ROWS_DEFAULTS); TIERS overrides for the bench's sweep. H200, fp32, N = 16k (bench/embedding_tiers_probe.py,
# bench/RESULTS.md): 0.121-0.122 ms against the rows form's 0.128-0.130 at V = 32000, C = 2048; 0.076 against 0.088
# at C = 1024; 0.664 against 0.674 at V = 128k, C = 4096. Session 23, tier B (the heavy ids, with TIER_B_SEG = 1024)
# at 8 warps and 4 programs per SM instead of 4 and 1 (bench/slots_probe.py --knobs, one process each, ms): padding
# (half the tokens one id) 0.128 against 0.160-0.162, every token one id 0.131 against 0.186; the bench's Zipf-like,
# uniform and distinct ids 0.1117 / 0.1113 / 0.1128 against 0.1128-0.1141 / 0.1105-0.1106 / 0.1119-0.1127. (4, 4):
# 0.135 / 0.135; (4, 8): 0.134 / 0.135; (8, 2): 0.131-0.132 / 0.144-0.145; 128 columns per program or HT = 64 at
# (4, 4): Zipf-like ids 0.121-0.122. fp32 only (bf16's default form is "side")
TIERS_DEFAULTS = {2: (64, 8, 2048, 4, 1, 256, 64, 4, 1, 4096), 4: (64, 8, 2048, 4, 1, 256, 64, 8, 4, 4096)}
TIERS = None
# tier A's medium rows: 0, each row's id, count, slots and tokens loaded one after the other (four dependent loads a
# row, under the rows grid's traffic); n (a power of two), n rows of a program's share listed at once and each row's
# slots loaded while the row before it is gathered. Same bits either way. H200, session 21 (with ROWS_ROLES = -2): tier
# A's medium kernel 55-65 us instead of 86-102 in the timelines; op 0.1134-0.1138 ms at 4, 0.1135-0.1136 at 8,
# 0.1138-0.1142 at 2, 0.1142-0.1148 at 0 (one process)
TIER_A_AHEAD = 4
# tier B's heavy ids (seen more than K2 times) in segments of this many of their tokens (0: each id whole, by one
# program per column block), an id longer than one segment summed as fp32 partial rows that a second small kernel
# adds in order: otherwise a batch of mostly one id (padding, say) is summed by only C / BLOCK_C programs. H200,
# session 21 (bench/slots_probe.py): every token one id, N = 16k, V = 32000, C = 2048: 0.387 ms with 0. Session 22:
# 0.185-0.191 ms with 256, 512, 1024 or 2048 (the same with each: the rest is the one id's 13.7 us slots pass on one
# counter and the listing); on the bench's Zipf-like ids 1024 / 256 took 0.1125-0.1129 / 0.1125-0.1127 ms against
# 0.1124-0.1126 off, and 512 with the two list settings below 0.1124-0.1128 against their 0.1114-0.1117 (the merge
# launch ends the heavy chain). Then (bench/slots_probe.py [--plan], one process each) 1024 against 0: Zipf-like ids
# 0.1122-0.1125 / 0.1120-0.1123 ms (three rounds), with the plan made before 0.1065-0.1068 / 0.1061-0.1065; half the
# tokens one id (padding) 0.160 / 0.252 ms, with the plan 0.140 / 0.232; every token one id 0.186 / 0.387. So 1024
# (at most 0.3 us on the bench's ids, 1.6-2.1x on a padded batch); tier B's segments then read at ~1 TB/s (one id:
# 129 us for its 134 MB); session 23's tier B launch shape (TIERS_DEFAULTS) took the one id to 0.131 ms
TIER_B_SEG = 1024
# the memory order of the slots passes' integer atomics (the counts and the list lengths): "acq_rel" (Triton's
# default) or "relaxed". Only their atomicity is needed: the passes that read the slots and lists run after this
# grid's end, so no order among this kernel's own loads and stores matters. H200, session 21: the tiers slots pass
# 4.6 us instead of 6.1 in the timelines, op 0.1121-0.1129 ms against 0.1135-0.1139 (two processes)
SLOTS_SEM = "relaxed"
# the tiers slots pass's three list appends (medium, heavy, named ids): False, each list's atomic then its stores,
# then the next list's (each store waits for its atomic's answer, so the three round trips follow one another);
# True, the three atomics first. bench/slots_probe.py (session 21): the pass took 4.9 us on the bench's Zipf-like
# ids (most programs append to two lists), 3.5 on uniform ids and 2.9 on distinct ones (one list). Session 22, with
# ROWS_FIRST (bench/embedding_tiers_probe.py, two processes, three alternating rounds): 0.1114-0.1117 / 0.1122-0.1126 ms
# against 0.1124-0.1126 / 0.1131-0.1132 for both off; ROWS_FIRST alone 0.1123-0.1128, this alone 0.1129-0.1130
SLOTS_APPEND_TOGETHER = True
# with ROWS_ROLES: the slots pass also lists each named id's slot-0 token beside it, and the rows grid writes a row of
# one token (~3 in 4 of the named rows on the bench's ids) from that list, without loading the row's slots (one
# dependent load fewer per program). Same bits. Measured with SLOTS_APPEND_TOGETHER (above): both on took ~1 us off
ROWS_FIRST = True
# the tiers form for at most this many tokens, the rows form above: each heavy id's list is a scan of all N ids, so
# the listing grows as N x (ids seen more than K2 times). H200, fp32, V = 32000, C = 2048, Zipf-like ids
# (bench/embedding_tiers_probe.py --N): tiers / rows 0.120 / 0.127 ms at N = 16k, 0.161-0.164 / 0.165-0.166 at 32k,
# 0.274 / 0.246 at 64k (33 heavy ids), 0.51 / 0.42 at 128k, 1.24 / 0.80 at 256k (287 heavy ids)
TIERS_MAX_N = 32768
# the tiers form's counts zeroed by a Triton kernel whose programmatic dependent is the slots pass (session 19; H200,
# fp32, V = 32000, C = 2048, three alternating rounds: 0.1184-0.1187 ms against 0.1205-0.1209 with torch's fill; the
# slots pass starts 1.3 us into the op instead of 2.8). Measured and dropped there: no lists in the slots pass, the
# medium rows found by tier A from the final counts (each program ids p, p + P, ...) and the heavy ids by a small
# kernel on the heavy chain: the slots pass took 3.7 us instead of 5.4-5.7, but tier A ran 109-110 us instead of
# 90-97 and ended the op (0.1253-0.1273 ms)
FILL_PDL = True
# the tiers form's rows grid in two roles (session 20): the named rows first, from a list the slots pass makes (-k:
# one program per k places of the list, which is at most N long, so ceil(N / k) programs, program p taking places p,
# p + ceil(N / k), ...; n > 0: n persistent programs per SM walking the list), then one program per row writing the
# zero rows; None: one program per row, zero and named rows in row order. Used where ROWS has one row per program (the
# fp32 default). H200, fp32, N = 16k, three alternating rounds each (bench/embedding_tiers_probe.py, bench/RESULTS.md):
# V = 32000, C = 2048 -1 0.1163-0.1179 ms against None's 0.1173-0.1186 (session 20, three processes, faster in every
# round), n = 4 per SM 0.120-0.122, 2 / 6 / 8 / 12 0.124-0.143; V = 128k, C = 4096 -1 0.588-0.596 ms (95-97 % of copy)
# against 0.653; N = 32k level (0.160-0.162). Session 21: -2 0.1148-0.1156 against -1's 0.1169-0.1174 (-1 leaves
# ~6600 of its 16k named-row programs nothing to do: bench/mix_probe.py timed such empty programs at 2.5 us), -3
# 0.1150-0.1160, -4 0.1158-0.1171, -8 0.1219-0.1224
ROWS_ROLES = -2
# the same two roles for the "rows" form's grid (the fp32 form above TIERS_MAX_N tokens): -k, n per SM or None.
# Session 21, N = 64k: -1 0.269-0.270 ms, -4 0.244-0.245, None 0.243-0.245, so off
ROWS_FORM_ROLES = None
SLOTS_BLOCK = 256  # tokens per program of _embedding_slots_kernel (H200 fp32: 256 and 128 0.133-0.134 ms, 1024
# 0.137 ms: more programs spread the atomics)
MERGE_BLOCK = 16  # later chunks per step of the merge pass (_embedding_bwd_merge_kernel); H200, session 6: 4 and 16
# within the run-to-run spread of 1 (bf16 0.312-0.313 ms all three; fp32 0.147-0.156 ms, the "side" form). Session
# 12: 16 since, with whole-row tiles the chain ends the fp32 op and its merge walked a frequent id's ~32 chunks one
# by one: fp32 0.128-0.129 against 0.130-0.132 ms (four processes), bf16 "side" unchanged (0.312-0.313)


def _sort_keys(ids: torch.Tensor, V: int, key_bits, mark: bool, counts=None, heavy_k: int = 0):
    """(keys [N] to sort, ID_BIAS, present marks or None): ids as int16 / int32 / int64 sort keys, and the
    [V] int8 present marks if ``mark``. ``heavy_k`` > 0 (the "rows" form): only ids seen more than heavy_k
    times (``counts``) keep their key, the rest get the key dtype's largest value, whose id must be >= V."""
    N = ids.numel()
    flat = ids.reshape(-1)
    room = 1 if heavy_k else 0  # the sentinel's id (the dtype's top) must name no row
    if key_bits == 16 and V <= 2**16 - room:
        kdt, bias = torch.int16, 2**15  # ids - 32768 fits int16 and keeps their order
    elif key_bits and V <= 2**31 - 1 - room:  # True or 32
        kdt, bias = torch.int32, 0
    else:
        kdt, bias = torch.int64, 0
    if not mark and bias == 0 and not heavy_k:
        return flat.to(kdt), 0, None
    present = torch.zeros(V, dtype=torch.int8, device=ids.device) if mark else None
    keys = torch.empty(N, dtype=kdt, device=ids.device)
    _embedding_keys_kernel[(triton.cdiv(N, 1024),)](
        flat.contiguous(),
        keys,
        present,
        counts,
        N,
        ID_BIAS=bias,
        MARK=mark,
        HEAVY_K=heavy_k,
        SENTINEL=torch.iinfo(kdt).max,
        BLOCK=1024,
        num_warps=4,
    )
    return keys, bias, present


def _merge(sorted_ids, part, dtable, N, V, C, n_chunks, n_cb, CHUNK, BLOCK_C, bias, pdl=False):
    """The merge pass over the runs the chunk pass cut (pdl: launched as the chunk pass's programmatic
    dependent, its programs resident and waiting when the chunk pass ends)."""
    _embedding_bwd_merge_kernel[(n_chunks, n_cb)](
        sorted_ids,
        part,
        dtable,
        N,
        V,
        C,
        n_chunks,
        CHUNK=CHUNK,
        BLOCK_C=BLOCK_C,
        ID_BIAS=bias,
        MERGE_BLOCK=MERGE_BLOCK,
        PDL=pdl,
        num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )


def _walk_and_merge(
    d2, order, sorted_ids, dtable, part, N, V, C, n_chunks, n_cb, CHUNK, BLOCK_C, idx_ahead, tile, bias, num_warps
):
    """The chunk walks, then the merge of the runs they cut (PDL: the merge launched as the walks'
    programmatic dependent, so its programs are resident and waiting when the walks end)."""
    pdl = bool(PDL) and pdl_ok(d2)
    _embedding_bwd_chunk_kernel[(n_chunks, n_cb)](
        d2,
        order,
        sorted_ids,
        dtable,
        part,
        N,
        V,
        C,
        CHUNK=CHUNK,
        BLOCK_C=BLOCK_C,
        IDX_AHEAD=idx_ahead,
        TILE=tile,
        ID_BIAS=bias,
        PDL=pdl,
        num_warps=num_warps,
    )
    _merge(sorted_ids, part, dtable, N, V, C, n_chunks, n_cb, CHUNK, BLOCK_C, bias, pdl)


def _rows_config(esize: int) -> tuple:
    """ROWS, or the defaults for this element size, checked."""
    rcfg = ROWS if ROWS is not None else ROWS_DEFAULTS[esize]
    if rcfg[0] not in (1, 2, 4, 8):
        raise ValueError(f"embedding_bwd: ROWS slots per row must be 1, 2, 4 or 8, got {rcfg[0]}")
    return rcfg


def _rows_launch(d2, counts, slots, dtable, V, rcfg, pdl: bool, roles: dict | None = None) -> tuple:
    """The rows kernel over the whole table (the "rows" and "tiers" forms) as (kernel, grid, arguments by name, launch
    options): a grid of tiles, or with a fifth ROWS element, that many programs per SM walking them (the CPU
    interpreter: that many in all). pdl: launched as the slots pass's programmatic dependent. roles (the "tiers" form
    with ``ROWS_ROLES``, the "rows" form with ``ROWS_FORM_ROLES``; one row per program): NAMED, NAMED_N and GP, the GP
    named-row programs ahead of the rows."""
    C = d2.shape[1]
    heavy_k, rbr, rbc, rwarps = rcfg[:4]
    per_sm = rcfg[4] if len(rcfg) > 4 else 0
    rbc = min(rbc, triton.next_power_of_2(C))
    n_rb, n_rcb = triton.cdiv(V, rbr), triton.cdiv(C, rbc)
    if per_sm:
        n_sm = sm_count(d2.device) if d2.is_cuda else 1
        grid = (min(n_rb * n_rcb, per_sm * n_sm),)
    else:
        grid = (n_rb + (roles["GP"] if roles else 0), n_rcb)
    args = dict(
        DOUT=d2,
        COUNTS=counts,
        SLOTS=slots,
        DTABLE=dtable,
        V=V,
        C=C,
        n_cb=n_rcb,
        n_tiles=n_rb * n_rcb,
        K=heavy_k,
        BLOCK_R=rbr,
        BLOCK_C=rbc,
        PERSISTENT=len(grid) == 1,
        EVICT=ROWS_EVICT,
        ZERO_FAST=ROWS_ZERO_FAST,
        PDL=pdl,
        **(roles or {}),
    )
    return _embedding_bwd_rows_kernel, grid, args, {"num_warps": rwarps, **({"launch_pdl": True} if pdl else {})}


def _rows_grid(d2, counts, slots, dtable, V, rcfg, pdl: bool, roles: dict | None = None) -> None:
    """Launch ``_rows_launch``'s rows kernel."""
    kernel, grid, args, options = _rows_launch(d2, counts, slots, dtable, V, rcfg, pdl, roles)
    kernel[grid](**args, **options)


def _roles_on(value, name: str, rcfg) -> bool:
    """Whether the rows grid runs in two roles (``ROWS_ROLES``, ``ROWS_FORM_ROLES``): set, and a grid of one row per
    program (the fp32 rows default; other ROWS keep the rows in order); a value that is neither -1 nor programs per SM
    >= 1 raises."""
    on = bool(value) and rcfg[1] == 1 and len(rcfg) == 4
    if on and not (isinstance(value, int) and not isinstance(value, bool)):
        raise ValueError(
            f"embedding_bwd: {name} must be None, -k (a program per k list places) or programs per SM "
            f"n >= 1, got {value!r}"
        )
    return on


def _roles_args(named, named_n, value: int, N: int, n_sm: int, first=None) -> dict:
    """The rows kernel's arguments for its two roles: the named list, its length's address, and GP (-k: a program per
    k places of the list, which is at most N long: ceil(N / k) programs; else value programs per SM); first: the list
    of each named id's slot-0 token (``ROWS_FIRST``) or None."""
    return dict(NAMED=named, NAMED_N=named_n, GP=-(N // value) if value < 0 else value * n_sm, FIRST=first)


def _slots_sem() -> str:
    """SLOTS_SEM, checked."""
    if SLOTS_SEM not in ("relaxed", "acq_rel"):
        raise ValueError(f"embedding_bwd: SLOTS_SEM must be 'relaxed' or 'acq_rel', got {SLOTS_SEM!r}")
    return SLOTS_SEM


def _esize(dtype: torch.dtype) -> int:
    """The key of the settings tables (DEFAULTS, TIERS_DEFAULTS, ...): 2 for 16-bit gradients, 4 otherwise."""
    return 2 if dtype.itemsize <= 2 else 4


def _pow2(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


_TIER_PLANS = PlanCache()  # the tiers form's launches on CUDA, by everything that decides them (``_tiers``)
TIER_PLANS = True  # use them (False: every call launches through the JIT)


def _tiers_settings(esize: int) -> tuple:
    """Every module setting the tiers form reads, for its launch-plan keys and to check a made-ahead plan."""
    return (
        CONFIG,
        TIERS_MAX_N,
        TIERS if TIERS is not None else TIERS_DEFAULTS[esize],
        _rows_config(esize),
        bool(FILL_PDL),
        bool(ROWS_PDL),
        bool(ROWS_MAIN_FIRST),
        ROWS_EVICT,
        ROWS_ZERO_FAST,
        SLOTS_BLOCK,
        SLOTS_SEM,
        bool(SLOTS_APPEND_TOGETHER),
        bool(ROWS_FIRST),
        ROWS_ROLES,
        TIER_A_AHEAD,
        TIER_B_SEG,
    )


class _Tiers:
    """The tiers form's settings for one (N, V, C, element size), checked, and its int32 workspace: one allocation
    holding the counts, the three list lengths and the largest heavy count (zeroed), the slots, the medium ids (seen
    more than K times), the heavy ids, their list offsets, the heavy lists, and with ROWS_ROLES the named ids (and with
    ROWS_FIRST their slot-0 tokens), each at a 128-byte boundary."""

    def __init__(self, N: int, V: int, C: int, esize: int, dev: torch.device):
        self.N, self.V, self.C, self.esize = N, V, C, esize
        self.settings = _tiers_settings(esize)
        tiers = self.settings[2]
        k2, self.mt, abc, self.aw, self.aps, self.ht, bbc, self.bw, self.bps, self.scan = tiers
        self.rcfg = rcfg = _rows_config(esize)
        self.heavy_k = heavy_k = rcfg[0]
        # the [K2, V] int32 slots stay no larger than an fp32 [V, C] table where C >= 2K
        self.k2 = k2 = min(k2, max(2 * heavy_k, 1 << (C.bit_length() - 1)))
        if not (
            k2 > heavy_k
            and all(_pow2(x) for x in (k2, self.mt, abc, self.ht, bbc, self.scan))
            and self.aps >= 1
            and self.bps >= 1
        ):
            raise ValueError(
                f"embedding_bwd: TIERS needs K2 above the rows' K = {heavy_k}, powers of two for K2, MT, "
                f"the column blocks, HT and SCAN, and programs per SM >= 1, got {TIERS!r}"
            )
        if not (TIER_A_AHEAD == 0 or (isinstance(TIER_A_AHEAD, int) and _pow2(TIER_A_AHEAD))):
            raise ValueError(f"embedding_bwd: TIER_A_AHEAD must be 0 or a power of two, got {TIER_A_AHEAD!r}")
        self.seg = seg = TIER_B_SEG
        if seg and not (_pow2(seg) and seg % self.ht == 0):
            raise ValueError(
                f"embedding_bwd: TIER_B_SEG must be 0 or a power of two and a multiple of HT = {self.ht}, got {seg!r}"
            )
        self.sem = _slots_sem()
        self.hcap = hcap = N // (k2 + 1) + 1  # ids seen more than K2 times
        self.roles = roles = _roles_on(ROWS_ROLES, "ROWS_ROLES", rcfg)
        first_on = roles and bool(ROWS_FIRST)
        sizes = (
            [V + 4, k2 * V, N // (heavy_k + 1) + 1, hcap, hcap, N] + ([N] if roles else []) + ([N] if first_on else [])
        )
        padded = [-(-n // 32) * 32 for n in sizes]
        self.ws = torch.empty(sum(padded), dtype=torch.int32, device=dev)
        self.zeroed, slots, self.med, self.heavy, self.hbase, self.hlist, *lists = (
            v[:n] for v, n in zip(torch.split(self.ws, padded), sizes)
        )
        self.named = lists[0] if roles else None
        self.first = lists[1] if first_on else None
        self.slots = slots.view(k2, V)
        self.counts, self.nlist = self.zeroed[:V], self.zeroed[V:]
        self.fill_pdl = bool(FILL_PDL) and pdl_ok(self.ws)
        self.pdl = bool(ROWS_PDL) and pdl_ok(self.ws)
        self.n_sm = sm_count(dev) if self.ws.is_cuda else 1
        self.abc, self.bbc = min(abc, triton.next_power_of_2(C)), min(bbc, triton.next_power_of_2(C))
        self.n_hcb = triton.cdiv(C, self.bbc)

    def launcher(self, key):
        """(launch, done): launch(name, kernel, grid, args, **options) runs a launch, on CUDA through the plan cached
        under key (``CachedLaunch``: only the per-call tensors are passed) or, the first time, through the JIT while
        keeping the plan, which done() stores; key None (the CPU interpreter, TIER_PLANS off): the JIT every time."""
        plan = _TIER_PLANS.get(key) if key is not None else None
        made = {}

        def launch(name, kernel, grid, args, **options):
            if plan is not None:
                plan[name](**{k: v for k, v in args.items() if is_per_call(v)})
            elif key is not None:
                made[name] = launch_cached(kernel, grid, args, **options)
            else:
                kernel[grid](**args, **options)

        def done():
            if key is not None and plan is None:
                _TIER_PLANS.put(key, made)

        return launch, done

    def key(self, *parts):
        """A launch-plan key: the settings, the sizes, the workspace's alignment and the given parts (None on the CPU
        interpreter or with TIER_PLANS off)."""
        if self.ws.is_cuda and TIER_PLANS:
            return (self.N, self.V, self.C, self.esize, self.ws.device, self.settings, self.ws.data_ptr() % 128) + parts
        return None

    def tier_a(self, launch, name: str, programs: int, heavy_part: bool, med_part: bool, flat, d2=None, dtable=None):
        """Tier A's kernel: heavy_part, the heavy ids' token lists (ids only: with no d2, the gradient pointers are
        the counts, which that part never reads through them); med_part, the medium rows."""
        launch(
            name,
            _embedding_tier_a_kernel,
            (programs,),
            dict(
                IDS=flat,
                DOUT=self.counts if d2 is None else d2,
                COUNTS=self.counts,
                SLOTS=self.slots,
                MED=self.med,
                HEAVY=self.heavy,
                NLIST=self.nlist,
                HLIST=self.hlist,
                HBASE=self.hbase,
                DTABLE=self.counts if dtable is None else dtable,
                N=self.N,
                V=self.V,
                C=self.C,
                K2=self.k2,
                MT=self.mt,
                BLOCK_C=self.abc,
                SCAN=self.scan,
                DO_HEAVY=heavy_part,
                DO_MED=med_part,
                AHEAD=TIER_A_AHEAD if med_part else 0,
                MAXC=heavy_part and self.seg > 0,
            ),
            num_warps=self.aw,
        )

    def ids_part(self, launch, flat, rows_pdl: bool) -> None:
        """The counts zeroed and the slots pass (rows_pdl: the rows grid comes next, as its programmatic dependent)."""
        N, V = self.N, self.V
        if self.fill_pdl:
            launch(
                "fill",
                _zero_i32_kernel,
                (triton.cdiv(V + 4, 4096),),
                dict(X=self.zeroed, n=V + 4, BLOCK=4096, PDL=True),
                num_warps=4,
            )
        else:
            self.zeroed.zero_()
        launch(
            "slots",
            _embedding_tier_slots_kernel,
            (triton.cdiv(N, SLOTS_BLOCK),),
            dict(
                IDS=flat,
                COUNTS=self.counts,
                SLOTS=self.slots,
                MED=self.med,
                HEAVY=self.heavy,
                NLIST=self.nlist,
                N=N,
                V=V,
                K=self.heavy_k,
                K2=self.k2,
                BLOCK=SLOTS_BLOCK,
                PDL=rows_pdl,
                WAIT=self.fill_pdl,
                NAMED=self.named,
                LIST_NAMED=self.roles,
                SEM=self.sem,
                TOGETHER=bool(SLOTS_APPEND_TOGETHER),
                FIRST=self.first,
            ),
            num_warps=4,
            **({"launch_pdl": True} if self.fill_pdl else {}),
        )


class EmbeddingBwdPlan:
    """The ids-only part of the fp32 backward's tiers form, made ahead of the backward (``embedding_bwd_plan``,
    ``embedding_fwd_planned``): the counts, slots and lists of the slots pass and the heavy ids' token lists. The
    backward given it launches only the rows grid and the medium and heavy sums, and reads it without writing, so one
    plan serves any number of backward calls with the same ids (which must not change in between). It holds the
    form's int32 workspace: (V + 4 + K2 V + ~3 N) x 4 bytes, 8.5 MB at N = 16k, V = 32000."""

    __slots__ = ("_t", "ids", "flat", "ready")

    def __init__(self, t: _Tiers, ids: torch.Tensor, flat: torch.Tensor):
        self._t, self.ids, self.flat = t, ids, flat  # flat: the ids contiguous (a copy where ids are not)
        self.ready = None  # made on a side stream (``embedding_fwd_planned``): its end, for the backward to wait for

    def check(self, dout: torch.Tensor, ids: torch.Tensor, V: int, esize: int) -> None:
        """ValueError unless the backward's ids are the plan's (the same tensor: its memory, shape and strides; not
        compared by value), V, C, the element size and the tiers settings as when it was made."""
        t, mine = self._t, self.ids
        if (t.N, t.V, t.C, t.esize) != (ids.numel(), V, dout.shape[-1], esize) or (
            ids.data_ptr(),
            ids.shape,
            ids.stride(),
        ) != (mine.data_ptr(), mine.shape, mine.stride()):
            raise ValueError(
                f"embedding_bwd: the plan was made for ids {tuple(mine.shape)} at {mine.data_ptr():#x}, "
                f"V = {t.V}, C = {t.C}, {t.esize}-byte elements; got dout {tuple(dout.shape)} "
                f"({dout.dtype}), ids {tuple(ids.shape)} at {ids.data_ptr():#x}, V = {V}"
            )
        if t.settings != _tiers_settings(esize):
            raise ValueError("embedding_bwd: the tiers settings changed since the plan was made; make a new one")


def _plans_for(N: int, esize: int) -> bool:
    """Whether the backward takes the tiers form (so a plan has a use) for N tokens of this element size."""
    cfg = CONFIG if CONFIG is not None else DEFAULTS[esize]
    return cfg[3] == "tiers" and 0 < N <= TIERS_MAX_N


def embedding_bwd_plan_triton(ids: torch.Tensor, V: int, C: int, dtype: torch.dtype) -> EmbeddingBwdPlan | None:
    """The ids-only part of ``embedding_bwd_triton`` for dout of [..., C] in dtype, launched now on the current stream
    (fill, slots pass, heavy lists: ~6 us on the H200 at N = 16k), or None where the backward takes another form."""
    plan = _plan_start(ids, V, C, dtype)
    if plan is not None:
        _plan_launches(plan)
    return plan


def _plan_start(ids: torch.Tensor, V: int, C: int, dtype: torch.dtype):
    """The plan, its workspace allocated on the current stream and nothing launched yet, or None (no plan's use)."""
    if not isinstance(V, int) or not isinstance(C, int) or V < 1 or C < 1:
        raise ValueError(
            f"embedding_bwd_plan: V and C must be positive integers, got V = {V!r}, C = {C!r} for ids "
            f"{tuple(ids.shape)}"
        )
    esize = _esize(dtype)
    if not _plans_for(ids.numel(), esize):
        return None
    flat = ids.reshape(-1).contiguous()
    return EmbeddingBwdPlan(_Tiers(flat.numel(), V, C, esize, ids.device), ids, flat)


def _plan_launches(plan: EmbeddingBwdPlan) -> None:
    t, flat = plan._t, plan.flat
    launch, done = t.launcher(t.key("plan", flat.dtype, flat.stride(), flat.data_ptr() % 16))
    t.ids_part(launch, flat, rows_pdl=False)
    t.tier_a(launch, "tier a, heavy", min(t.hcap, t.n_sm), True, False, flat)
    done()


def embedding_bwd_plan(ids: torch.Tensor, V: int, C: int, dtype: torch.dtype) -> EmbeddingBwdPlan | None:
    """``embedding_bwd_plan_triton`` where the backward runs Triton (CUDA), else None (the reference needs no plan)."""
    if dtype == torch.float64 or not use_triton(ids):
        return None
    return embedding_bwd_plan_triton(ids, V, C, dtype)


def embedding_fwd_planned(ids: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, EmbeddingBwdPlan | None]:
    """(``embedding_fwd(ids, table)``, ``embedding_bwd_plan(ids, V, C, table.dtype)``). On CUDA the plan's launches
    (small and latency-bound) go to a high-priority side stream beside the gather, and this stream does not wait for
    them: the backward given the plan waits for its event instead, so the steps after the forward overlap the plan
    too. The plan's workspace (and a contiguous copy of the ids, if one was made) is allocated on this stream before
    and marked as used by the side stream, so the caching allocator reuses neither before the side stream is done."""
    V, C = table.shape
    if table.dtype == torch.float64 or not use_triton(ids, table):
        return embedding_fwd(ids, table), None
    plan = _plan_start(ids, int(V), int(C), table.dtype)
    if plan is None:
        return embedding_fwd(ids, table), None
    out = []
    plan.ready = run_side_by_side(
        table.device,
        lambda: out.append(embedding_fwd(ids, table)),
        lambda: _plan_launches(plan),
        high_priority=True,
        main_first=True,
        join=False,
    )
    side = side_stream(table.device, high_priority=True)
    plan._t.ws.record_stream(side)
    plan.flat.record_stream(side)
    return out[0], plan


def _tiers(
    d2: torch.Tensor, flat: torch.Tensor, dtable: torch.Tensor, V: int, esize: int, plan: EmbeddingBwdPlan | None = None
) -> torch.Tensor:
    """The "tiers" form (module docstring): the slots pass, then the rows grid (rows seen at most K times) on this
    stream beside two high-priority side streams, one for the medium rows (tier A), one for the heavy ids' lists
    (tier A) and sums (tier B). Every row is written once. Given a plan (``embedding_bwd_plan``), the slots pass and
    the heavy lists are its, made before: the rows grid starts at once.
    On CUDA the launches are kept as a plan (``_dispatch.CachedLaunch``) under a key of the shapes, dtypes,
    device, pointer alignments and every module setting read here; later calls with that key pass only their
    tensors (the JIT's binding and specialisation cost tens of microseconds of host time per launch)."""
    N, C = d2.shape
    dev = d2.device
    t = _Tiers(N, V, C, esize, dev) if plan is None else plan._t
    seg, hcap = t.seg, t.hcap
    # fp32 partial rows of the segments of ids longer than seg (rows HBASE[h] // seg + h + segment: N // seg + hcap)
    part = torch.empty(N // seg + hcap + 1, C, dtype=torch.float32, device=dev) if seg else None
    pdl = t.pdl and plan is None
    launch, done = t.launcher(
        t.key(
            "bwd",
            plan is not None,
            d2.dtype,
            flat.dtype,
            d2.stride(),
            flat.stride(),
            d2.data_ptr() % 16,
            flat.data_ptr() % 16,
            dtable.data_ptr() % 16,
        )
    )
    if plan is None:
        t.ids_part(launch, flat, pdl)
    elif plan.ready is not None:
        torch.cuda.current_stream(dev).wait_event(plan.ready)  # the plan's launches, on another stream

    def tier_b():
        launch(
            "tier b",
            _embedding_tier_b_kernel,
            (t.bps * t.n_sm,),
            dict(
                DOUT=d2,
                COUNTS=t.counts,
                HEAVY=t.heavy,
                NLIST=t.nlist,
                HLIST=t.hlist,
                HBASE=t.hbase,
                DTABLE=dtable,
                C=C,
                n_cb=t.n_hcb,
                HT=t.ht,
                BLOCK_C=t.bbc,
                PART=part,
                SEG=seg,
            ),
            num_warps=t.bw,
        )
        if seg:
            launch(
                "tier b merge",
                _embedding_tier_b_merge_kernel,
                (t.bps * t.n_sm,),
                dict(
                    COUNTS=t.counts,
                    HEAVY=t.heavy,
                    NLIST=t.nlist,
                    HBASE=t.hbase,
                    PART=part,
                    DTABLE=dtable,
                    C=C,
                    n_cb=t.n_hcb,
                    SEG=seg,
                    BLOCK_C=t.bbc,
                ),
                num_warps=t.bw,
            )

    rargs = _roles_args(t.named, t.nlist[2:], ROWS_ROLES, N, t.n_sm, t.first) if t.roles else None

    def grid_pass():
        kernel, grid, args, options = _rows_launch(d2, t.counts, t.slots, dtable, V, t.rcfg, pdl, rargs)
        launch("rows", kernel, grid, args, **options)

    def side():
        here = torch.cuda.current_stream(dev)
        second = side_stream(dev, high_priority=True, which=1)
        second.wait_stream(here)
        with torch.cuda.stream(second):
            t.tier_a(launch, "tier a, medium", t.aps * t.n_sm, False, True, flat, d2, dtable)
        if plan is None:
            t.tier_a(launch, "tier a, heavy", min(hcap, t.n_sm), True, False, flat, d2, dtable)
        tier_b()
        here.wait_stream(second)

    if d2.is_cuda:
        run_side_by_side(dev, grid_pass, side, high_priority=True, main_first=bool(ROWS_MAIN_FIRST))
    else:
        grid_pass()
        t.tier_a(launch, "tier a", t.aps * t.n_sm, plan is None, True, flat, d2, dtable)
        tier_b()
    done()
    return dtable


def embedding_bwd_triton(
    dout: torch.Tensor, ids: torch.Tensor, V: int, plan: EmbeddingBwdPlan | None = None
) -> torch.Tensor:
    """The Triton backward (module docstring); plan: ``embedding_bwd_plan``'s for these ids (checked), or None."""
    C = dout.shape[-1]
    if ids.shape != dout.shape[:-1]:
        raise ValueError(f"embedding_bwd: dout {tuple(dout.shape)} must be ids {tuple(ids.shape)} + [C]")
    d2 = dout.reshape(-1, C).contiguous()  # [N, C]
    N = ids.numel()
    esize = _esize(dout.dtype)
    if plan is not None:
        if not isinstance(plan, EmbeddingBwdPlan):
            raise ValueError(f"embedding_bwd: plan must be an EmbeddingBwdPlan or None, got {type(plan).__name__}")
        plan.check(d2, ids, V, esize)  # so the tiers form below, and the plan's contiguous ids
    cfg = CONFIG if CONFIG is not None else DEFAULTS[esize]
    CHUNK, BLOCK_C, num_warps, zero = cfg[:4]
    if zero not in ("torch", "absent", "fused", "side", "rows", "tiers"):
        raise ValueError(
            f"embedding_bwd: CONFIG zero fill must be 'torch', 'absent', 'fused', 'side', 'rows' or "
            f"'tiers', got {zero!r}"
        )
    key_bits = cfg[4] if len(cfg) > 4 else False
    idx_ahead = bool(cfg[5]) if len(cfg) > 5 else False
    tile = len(cfg) > 6 and cfg[6] == "tile"
    BLOCK_C = min(BLOCK_C, triton.next_power_of_2(C))
    n_cb = triton.cdiv(C, BLOCK_C)
    if N == 0 or zero == "torch":
        dtable = torch.zeros(V, C, dtype=dout.dtype, device=dout.device)
        if N == 0:
            return dtable
    else:
        dtable = torch.empty(V, C, dtype=dout.dtype, device=dout.device)
    n_chunks = triton.cdiv(N, CHUNK)
    flat = plan.flat if plan is not None else ids.reshape(-1).contiguous()
    if zero == "tiers" and N > TIERS_MAX_N:
        zero = "rows"
    if zero == "tiers":
        return _tiers(d2, flat, dtable, V, esize, plan)
    heavy_k, counts, slots = 0, None, None
    if zero == "rows":
        rcfg = _rows_config(esize)
        heavy_k = rcfg[0]
        roles = _roles_on(ROWS_FORM_ROLES, "ROWS_FORM_ROLES", rcfg)
        counts = torch.zeros(V + 1, dtype=torch.int32, device=dout.device)  # and the named list's length
        counts, named_n = counts[:V], counts[V:]
        named = torch.empty(N, dtype=torch.int32, device=dout.device) if roles else None
        slots = torch.empty(heavy_k, V, dtype=torch.int32, device=dout.device)
        rows_pdl = bool(ROWS_PDL) and pdl_ok(d2)
        _embedding_slots_kernel[(triton.cdiv(N, SLOTS_BLOCK),)](
            flat,
            counts,
            slots,
            N,
            V,
            K=heavy_k,
            BLOCK=SLOTS_BLOCK,
            PDL=rows_pdl,
            NAMED=named,
            NAMED_N=named_n,
            LIST_NAMED=roles,
            SEM=_slots_sem(),
            num_warps=4,
        )
        rargs = None
        if roles:
            rargs = _roles_args(named, named_n, ROWS_FORM_ROLES, N, sm_count(d2.device) if d2.is_cuda else 1)
    mark = zero in ("absent", "fused", "side")

    def sort_walk_merge(keys=None, bias=0):
        """The sort keys (unless given), the sort, the chunk walks (present rows and boundary partials) and the
        merge of cut runs ("rows": only the ids seen more than heavy_k times); returns the present marks."""
        present = None
        if keys is None:
            keys, bias, present = _sort_keys(flat, V, key_bits, mark, counts, heavy_k)
        sorted_ids, order = torch.sort(keys, stable=True)
        part = torch.empty(n_chunks, 2, C, dtype=torch.float32, device=dout.device)  # boundary partials only
        _walk_and_merge(
            d2,
            order,
            sorted_ids,
            dtable,
            part,
            N,
            V,
            C,
            n_chunks,
            n_cb,
            CHUNK,
            BLOCK_C,
            idx_ahead,
            tile,
            bias,
            num_warps,
        )
        return present

    if zero in ("side", "rows"):
        # a bandwidth-bound grid over the table on this stream ("side": the absent rows' zero fill; "rows":
        # every row seen at most heavy_k times, zeros included), while the sort, the walks and the merge (a
        # chain of small latency-bound kernels) run on a high-priority side stream: their programs take an SM
        # as soon as one frees, so the chain runs under the grid instead of before it. Disjoint rows.
        if zero == "side":
            # the marks the zero fill needs come from the keys kernel: made here, on this stream
            keys, bias, present = _sort_keys(flat, V, key_bits, True)
            zbc = min(triton.next_power_of_2(C), 4096)
            zbr = max(1, 8192 // zbc)

            def grid_pass():
                _embedding_zero_absent_kernel[(triton.cdiv(V, zbr), triton.cdiv(C, zbc))](
                    present, dtable, V, C, BLOCK_R=zbr, BLOCK_C=zbc, num_warps=8
                )

            def chain():
                sort_walk_merge(keys, bias)
        else:

            def grid_pass():
                _rows_grid(d2, counts, slots, dtable, V, rcfg, rows_pdl, rargs)

            chain = sort_walk_merge
        if dout.is_cuda:
            run_side_by_side(
                dout.device,
                grid_pass,
                chain,
                high_priority=SIDE_HIGH_PRIORITY,
                main_first=zero == "rows" and ROWS_MAIN_FIRST,
            )
        else:
            grid_pass()
            chain()
        return dtable
    if zero != "fused":
        present = sort_walk_merge()
        if zero == "absent":  # after the walks here: they write only rows ids name, this only the others
            _embedding_zero_absent_kernel[(triton.cdiv(V, 8), n_cb)](
                present, dtable, V, C, BLOCK_R=8, BLOCK_C=BLOCK_C, num_warps=4
            )
        return dtable
    keys, bias, present = _sort_keys(flat, V, key_bits, True)
    sorted_ids, order = torch.sort(keys, stable=True)
    part = torch.empty(n_chunks, 2, C, dtype=torch.float32, device=dout.device)  # boundary partials only
    n_zr = triton.cdiv(V, 8)
    _embedding_bwd_fused_kernel[(n_chunks * n_cb + n_zr * n_cb,)](
        d2,
        order,
        sorted_ids,
        dtable,
        part,
        present,
        N,
        V,
        C,
        n_cb,
        n_chunks * n_cb,
        n_cb,
        CHUNK=CHUNK,
        BLOCK_C=BLOCK_C,
        IDX_AHEAD=idx_ahead,
        ZBLOCK_R=8,
        ZBLOCK_C=BLOCK_C,
        TILE=tile,
        ID_BIAS=bias,
        num_warps=num_warps,
    )
    _merge(sorted_ids, part, dtable, N, V, C, n_chunks, n_cb, CHUNK, BLOCK_C, bias)
    return dtable


def embedding_bwd(dout: torch.Tensor, ids: torch.Tensor, V: int, plan: EmbeddingBwdPlan | None = None) -> torch.Tensor:
    """dtable from dout; plan (optional): ``embedding_bwd_plan``'s or ``embedding_fwd_planned``'s for these ids, which
    the Triton backward then need not make (the reference needs none)."""
    if dout.dtype != torch.float64 and use_triton(dout, ids):
        return embedding_bwd_triton(dout, ids, V, plan)
    return embedding_bwd_ref(dout, ids, V)
