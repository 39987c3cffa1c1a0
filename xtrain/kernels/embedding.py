"""Embedding lookup and its scatter-add backward.

Contract:
    embedding_fwd(ids[...], table[V, C]) -> out[..., C] (table.dtype)
    embedding_bwd(dout[..., C], ids, V, plan=None) -> dtable[V, C] (dout.dtype): the dout rows added
        into the rows their ids name, in fp32, rounded once; no [N, V] one-hot and no floating-point atomics, so the
        bits are the same run to run. ``plan``: the ids-only part of the "tiers" form made ahead (None elsewhere).

The backward writes every row of dtable exactly once, in one of three forms (``embedding_bwd_config``):
    "side" (16-bit gradients): sort keys and present marks, then a zero fill of the absent rows on this stream beside
        a stable sort, chunk walks (CHUNK sorted tokens per program, each run of equal ids summed in fp32; runs cut by
        a chunk edge go to fp32 partials) and the merge of cut runs on a high-priority side stream. The table is large
        next to the tokens' rows, so the fill hides the latency-bound chain.
    "tiers" (fp32, N <= TIERS_MAX_N): a slots pass (each token takes the next slot of its id by an integer atomic);
        the rows grid writes every row seen at most K = 4 times (zeros, or its tokens' sum in token order), beside
        tier A (rows seen K < count <= K2 times, slots ranked into token order) and tier B (heavier ids, token lists
        from a scan of the ids, summed in SEG-token segments merged in order) on two high-priority side streams. No
        sort: most rows of a Zipf-like batch are named at most 4 times.
    "rows" (fp32, larger N): the slots pass and rows grid, and the sort / walk / merge chain for the ids seen more
        than K times only (the heavy lists' scans grow as N x heavy ids, one sort does not).
Every sum's order is set by token indices alone, so the bits do not depend on scheduling ("tiers" and "rows" differ
from each other for rows seen more than K times: a tier tile is added by a fixed tree, a walk left to right). H200:
"tiers" at V = 32000, C = 2048, N = 16k fp32 0.106 ms with a plan (88 % of copy); "side" at V = 128k, C = 4096 bf16
0.31 ms (91 %); the frequent rows cost ~20 us wherever they run, which bounds both.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class EmbeddingBwdConfig:
    """One form of the Triton backward and its launch shapes (``embedding_bwd_config`` picks the one that ships).

    form: "side", "rows" or "tiers" (module docstring).
    chunk, chain_block_c, chain_warps: the sort / walk / merge chain ("side", "rows"): tokens per walk program,
        columns per program, warps.
    rows_block_c, rows_warps: the rows grid ("rows", "tiers"), one table row per program.
    k2, mt, a_block_c, a_warps, a_per_sm: tier A (rows seen K < count <= K2 times; K2 is capped at the table's
        width, but at least 2K, so its [K2, V] slots stay no larger than an fp32 table): tokens per gathered tile,
        columns per step, warps, persistent programs per SM.
    ht, b_block_c, b_warps, b_per_sm, seg: tier B (ids seen more than K2 times): tokens per tile, columns per item,
        warps, programs per SM, tokens per segment (an id longer than seg is summed as fp32 partials merged in
        order, so a batch of mostly one id is not summed by only C / b_block_c programs).
    scan: ids per step of the heavy lists' scan. slots_block: tokens per slots-pass program."""

    form: str
    chunk: int = 16
    chain_block_c: int = 512
    chain_warps: int = 4
    rows_block_c: int = 2048
    rows_warps: int = 8
    k2: int = 64
    mt: int = 8
    a_block_c: int = 2048
    a_warps: int = 4
    a_per_sm: int = 1
    ht: int = 256
    b_block_c: int = 64
    b_warps: int = 8
    b_per_sm: int = 4
    seg: int = 1024
    scan: int = 4096
    slots_block: int = 256

    def __post_init__(self):
        pow2 = (self.chunk, self.chain_block_c, self.rows_block_c, self.k2, self.mt, self.a_block_c, self.ht)
        pow2 += (self.b_block_c, self.seg, self.scan, self.slots_block)
        if self.form not in ("side", "rows", "tiers") or not all(x >= 1 and x & (x - 1) == 0 for x in pow2):
            raise ValueError(f"EmbeddingBwdConfig: form must be side, rows or tiers and sizes powers of two: {self}")
        if self.k2 <= K or self.seg % self.ht or min(self.a_per_sm, self.b_per_sm) < 1:
            raise ValueError(f"EmbeddingBwdConfig: needs k2 > {K}, seg a multiple of ht, per_sm >= 1: {self}")


K = 4  # the rows grid's slots per row: a row seen at most K times is summed there (sorting network of 4)
TIERS_MAX_N = 32768  # the tiers form up to this many tokens (its heavy lists scan all N ids per heavy id)
SIDE = EmbeddingBwdConfig("side", chain_block_c=1024)
TIERS = EmbeddingBwdConfig("tiers")
ROWS = EmbeddingBwdConfig("rows")
SHIPPED = (SIDE, TIERS, ROWS)


def embedding_bwd_config(dtype: torch.dtype, n_tokens: int) -> EmbeddingBwdConfig:
    """The form that ships: "side" for 16-bit gradients, else "tiers" up to TIERS_MAX_N tokens and "rows" above
    (H200 fp32, V = 32000, C = 2048: tiers / rows 0.120 / 0.127 ms at N = 16k, 0.274 / 0.246 at 64k). The same on
    every CUDA capability (sm_90+ only adds programmatic dependent launches, which change no bits)."""
    if dtype.itemsize <= 2:
        return SIDE
    return TIERS if n_tokens <= TIERS_MAX_N else ROWS


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
    """The table row of sorted key i as int64 (int16 keys are ids - 32768: ID_BIAS = 32768), -1 where not ok. The
    sentinel is applied after the bias: -1 is a valid int16 key (id 32767)."""
    k = tl.load(SORTED + i, mask=ok, other=0)
    return tl.where(ok, k.to(tl.int64) + ID_BIAS, -1)


@_jit
def _embedding_bwd_chunk_kernel(
    DOUT, ORDER, SORTED, DTABLE, PART, N, V, C, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, ID_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Program (chunk c, column block): the CHUNK sorted tokens [s, e) walked one by one with a running fp32 row
    sum flushed at each run end; two rows and the index of a third are loaded ahead of the row being added, so
    loads stay in flight while the sum waits. A run wholly inside the chunk is written to its dtable row; a run cut
    by the chunk's start goes to PART[c, 0], one cut only by its end to PART[c, 1] (the merge finishes both). Ids
    >= V (the rows form's sentinel, sorted last) are never written. PDL: let the merge, launched as this kernel's
    programmatic dependent, be scheduled as soon as every program here has started."""
    if PDL:
        gdc_launch_dependents()
    c = tl.program_id(0)
    s = c.to(tl.int64) * CHUNK
    if _load_id(SORTED, s, True, ID_BIAS) < V:
        e = tl.minimum(s + CHUNK, N)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        prev_id = _load_id(SORTED, tl.maximum(s - 1, 0), s > 0, ID_BIAS)
        next_id = _load_id(SORTED, e, e < N, ID_BIAS)
        src0 = tl.load(ORDER + s)
        x0 = tl.load(DOUT + src0 * C + cols, mask=cmask, other=0.0)
        src1 = tl.load(ORDER + s + 1, mask=s + 1 < e, other=0)
        # (masks built as tensors: the interpreter rejects a tensor & scalar mask)
        x1 = tl.load(DOUT + src1 * C + cols, mask=cmask & (cols * 0 + s + 1 < e), other=0.0)
        src2 = tl.load(ORDER + s + 2, mask=s + 2 < e, other=0)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        cur = _load_id(SORTED, s, s < N, ID_BIAS)
        run_starts_before = cur == prev_id  # the first run: does it continue a run of an earlier chunk?
        for k in range(s, e):
            x = x0
            x0 = x1
            x1 = tl.load(DOUT + src2 * C + cols, mask=cmask & (cols * 0 + k + 2 < e), other=0.0)
            src2 = tl.load(ORDER + k + 3, mask=k + 3 < e, other=0)
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
def _embedding_bwd_merge_kernel(
    SORTED, PART, DTABLE, N, V, C, n_chunks, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, ID_BIAS: tl.constexpr,
    MERGE_BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (chunk c, column block): if c's last run starts here and goes on into later chunks, add its
    partials (PART[c, 1], then PART[c', 0] of every chunk c' it reaches, MERGE_BLOCK chunks per step: a frequent id
    spans dozens of chunks, and one per step would be a chain of dependent loads) and write the row. PDL: started
    while the chunk kernel runs, it waits here for that grid's writes."""
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
        ccs = c + 1 + tl.arange(0, MERGE_BLOCK)
        go = True
        while go:  # the run reaches chunk cc where cc's first token has id ``last`` (sorted: one stretch)
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
    """Zero the dtable rows of ids that never occur (the walks and the merge write the others)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    absent = tl.load(PRESENT + rows, mask=rows < V, other=1) == 0
    zero = tl.zeros([BLOCK_R, BLOCK_C], dtype=DTABLE.dtype.element_ty)
    tl.store(DTABLE + rows[:, None] * C + cols[None, :], zero, mask=absent[:, None] & (cols < C)[None, :])


@_jit
def _embedding_keys_kernel(
    IDS, KEYS, PRESENT, COUNTS, N, ID_BIAS: tl.constexpr, MARK: tl.constexpr, HEAVY_K: tl.constexpr,
    SENTINEL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The sort keys (ids - ID_BIAS in KEYS' dtype: int16 keys sort in half the radix passes of int32) and, if MARK,
    the present marks (every writer stores the same 1). HEAVY_K > 0 (rows form): only the tokens of ids seen more
    than HEAVY_K times (COUNTS) keep their key; the others get SENTINEL, which sorts last and names no row."""
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
def _take_slots(
    IDS, COUNTS, SLOTS, N, V, KEEP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr
):
    """This program's BLOCK tokens each take the next slot of their id (an integer atomic, relaxed: only atomicity
    matters, the readers run after this grid) and write their index to SLOTS[slot, id] below KEEP; returns (valid
    mask, ids, slots, token indices). Which token takes which slot depends on scheduling; every reader orders a row's
    slots by token index. PDL: the next kernel may be scheduled at once. WAIT: launched as the counts' zero fill's
    programmatic dependent, wait for it before the atomics (the ids are loaded first)."""
    if PDL:
        gdc_launch_dependents()
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    ids = tl.load(IDS + i, mask=m, other=0)
    if WAIT:
        gdc_wait()
    slot = tl.atomic_add(COUNTS + ids, 1, mask=m, sem="relaxed")
    tl.store(SLOTS + slot.to(tl.int64) * V + ids, i.to(tl.int32), mask=m & (slot < KEEP))
    return m, ids, slot, i


@_jit
def _embedding_slots_kernel(IDS, COUNTS, SLOTS, N, V, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """The rows form's slots pass (``_take_slots`` with K slots)."""
    _take_slots(IDS, COUNTS, SLOTS, N, V, K, BLOCK, PDL, False)


@_jit
def _places(COUNT, take, SEM: tl.constexpr):
    """The list places of the entries where take, after the COUNT[0] entries there: one atomic for the program (none
    where it adds nothing), places within it by a prefix sum."""
    t = take.to(tl.int32)
    n = tl.sum(t, axis=0)
    return tl.atomic_add(COUNT, n, mask=n > 0, sem=SEM) + tl.cumsum(t, axis=0) - 1


@_jit
def _embedding_tier_slots_kernel(
    IDS, COUNTS, SLOTS, MED, HEAVY, NLIST, NAMED, FIRST, N, V, K: tl.constexpr, K2: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr, WAIT: tl.constexpr,
):  # fmt: skip
    """The tiers form's slots pass (``_take_slots`` with K2 slots). The token taking slot K appends its id to MED,
    the one taking slot K2 to HEAVY, the one taking slot 0 to NAMED and its own index to FIRST at the same place
    (NLIST[0..2] count them). The three lists' atomics are issued before any of their stores, so their round trips
    overlap."""
    m, ids, slot, i = _take_slots(IDS, COUNTS, SLOTS, N, V, K2, BLOCK, PDL, WAIT)
    pm = _places(NLIST, m & (slot == K), "relaxed")
    ph = _places(NLIST + 1, m & (slot == K2), "relaxed")
    pn = _places(NLIST + 2, m & (slot == 0), "relaxed")
    tl.store(NAMED + pn, ids.to(tl.int32), mask=m & (slot == 0))
    tl.store(FIRST + pn, i.to(tl.int32), mask=m & (slot == 0))
    tl.store(MED + pm, ids.to(tl.int32), mask=m & (slot == K))
    tl.store(HEAVY + ph, ids.to(tl.int32), mask=m & (slot == K2))


@_jit
def _zero_i32_kernel(X, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """X[:n] = 0 (int32). PDL: the slots pass, its programmatic dependent, may be scheduled at once."""
    if PDL:
        gdc_launch_dependents()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + i, tl.zeros([BLOCK], dtype=tl.int32), mask=i < n)


@_jit
def _cx(a, b):
    """A compare-exchange of a sorting network: (min, max), elementwise."""
    return tl.minimum(a, b), tl.maximum(a, b)


@_jit
def _dout_rows(DOUT, src, take, cols, cmask, C):
    """The dout rows src, columns cols, in fp32: a [len(src), len(cols)] tile, zeros where not take."""
    x = tl.load(DOUT + src.to(tl.int64)[:, None] * C + cols[None, :], mask=take[:, None] & cmask[None, :], other=0.0)
    return x.to(tl.float32)


@_jit
def _rows_sum(rows, cols, cmask, cnt, own, DOUT, SLOTS, DTABLE, V, C, BLOCK_C: tl.constexpr):
    """Rows (a [1] vector) seen at most 4 times (own), written whole: zeros, or their tokens' dout rows added in
    token order in fp32, ((0 + x0) + x1) + ..., rounded once. The 4 slots are put in token order by a sorting
    network (5 exchanges) in registers; the 4 gathers are independent, so all are in flight together."""
    s0 = tl.load(SLOTS + 0 * V + rows, mask=own & (cnt > 0), other=2**31 - 1)
    s1 = tl.load(SLOTS + 1 * V + rows, mask=own & (cnt > 1), other=2**31 - 1)
    s2 = tl.load(SLOTS + 2 * V + rows, mask=own & (cnt > 2), other=2**31 - 1)
    s3 = tl.load(SLOTS + 3 * V + rows, mask=own & (cnt > 3), other=2**31 - 1)
    s0, s1 = _cx(s0, s1)
    s2, s3 = _cx(s2, s3)
    s0, s2 = _cx(s0, s2)
    s1, s3 = _cx(s1, s3)
    s1, s2 = _cx(s1, s2)
    acc = tl.zeros([1, BLOCK_C], dtype=tl.float32) + _dout_rows(DOUT, s0, own & (cnt > 0), cols, cmask, C)
    acc += _dout_rows(DOUT, s1, own & (cnt > 1), cols, cmask, C)
    acc += _dout_rows(DOUT, s2, own & (cnt > 2), cols, cmask, C)
    acc += _dout_rows(DOUT, s3, own & (cnt > 3), cols, cmask, C)
    tl.store(
        DTABLE + rows[:, None] * C + cols[None, :], acc.to(DTABLE.dtype.element_ty), mask=own[:, None] & cmask[None, :]
    )


@_jit
def _embedding_bwd_rows_kernel(
    DOUT, COUNTS, SLOTS, DTABLE, V, C, K: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr, NAMED=None,
    NAMED_N=None, GP: tl.constexpr = 0, FIRST=None,
):  # fmt: skip
    """The rows grid: every row seen at most K = 4 times written whole (``_rows_sum``), one row per program. PDL
    (launched as the slots pass's programmatic dependent): wait for that grid's writes first.
    GP > 0 (tiers form): two roles. The first GP programs write the named rows (the list NAMED, NAMED_N[0] long, by
    the slots pass), program p entries p, p + GP, ...; a row of one token straight from FIRST, with no slot to load.
    The rest, one per row, write zeros where the row's count is 0. Gathers first, zero rows after: on the H200 the
    same bytes moved 9 % faster in that order than interleaved in row order."""
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    if GP == 0:
        rows = pid.to(tl.int64) + tl.arange(0, 1)
        cnt = tl.load(COUNTS + rows, mask=rows < V, other=K + 1)
        _rows_sum(rows, cols, cmask, cnt, cnt <= K, DOUT, SLOTS, DTABLE, V, C, BLOCK_C)
    elif pid < GP:
        for e in range(pid, tl.load(NAMED_N), GP):
            f = tl.load(NAMED + e).to(tl.int64)
            tok = tl.load(FIRST + e).to(tl.int64)
            c1 = tl.load(COUNTS + f)
            if c1 == 1:
                x = tl.load(DOUT + tok * C + cols, mask=cmask, other=0.0)
                acc = tl.zeros([BLOCK_C], dtype=tl.float32) + x.to(tl.float32)  # (0 + x: _rows_sum's bits)
                tl.store(DTABLE + f * C + cols, acc.to(DTABLE.dtype.element_ty), mask=cmask)
            elif c1 <= K:
                rows = f + tl.arange(0, 1)
                cnt = c1 + tl.zeros([1], dtype=tl.int32)
                _rows_sum(rows, cols, cmask, cnt, cnt <= K, DOUT, SLOTS, DTABLE, V, C, BLOCK_C)
    else:
        r = (pid - GP).to(tl.int64)
        zero = tl.load(COUNTS + r) == 0
        tl.store(
            DTABLE + r * C + cols,
            tl.zeros([BLOCK_C], dtype=DTABLE.dtype.element_ty),
            mask=cmask & (cols < tl.where(zero, C, 0)),
        )


@_jit
def _embedding_tier_a_kernel(
    IDS, DOUT, COUNTS, SLOTS, MED, HEAVY, NLIST, HLIST, HBASE, DTABLE, N, V, C, K2: tl.constexpr, MT: tl.constexpr,
    BLOCK_C: tl.constexpr, SCAN: tl.constexpr, DO_HEAVY: tl.constexpr, DO_MED: tl.constexpr,
):  # fmt: skip
    """Persistent over the lists. DO_HEAVY: each heavy id's token list, in token order, into HLIST from HBASE[h] (the
    counts of the heavy ids listed before it), by a scan of the ids SCAN at a time placing each hit by a running
    prefix sum; and NLIST[3] = the largest heavy count (tier B's segments). DO_MED: each medium row (K < count <= K2)
    whole (``_med_row``), four rows of this program's share listed at once and each row's slots loaded while the
    row before it is gathered (a chain of dependent loads per four rows, not per row)."""
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
    q = tl.arange(0, 4)
    for e0 in range(pid, n_med, P * 4):
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
    """Medium row f (K < cnt <= K2): its slots s (K2 token indices, the largest int32 past cnt) ranked into token
    order by a [K2, K2] comparison, gathered MT at a time, each tile added by a fixed reduction tree and the tiles in
    order, in fp32, rounded once."""
    rank = tl.sum((s[None, :] < s[:, None]).to(tl.int32), axis=1)
    row = f.to(tl.int64) * C
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cm = cols < C
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for t in range(0, cnt, MT):
            r = t + tl.arange(0, MT)
            src = tl.sum(tl.where(rank[None, :] == r[:, None], s[None, :], 0), axis=1)
            acc += tl.sum(_dout_rows(DOUT, src, r < cnt, cols, cm, C), axis=0)
        tl.store(DTABLE + row + cols, acc.to(DTABLE.dtype.element_ty), mask=cm)


@_jit
def _embedding_tier_b_kernel(
    DOUT, COUNTS, HEAVY, NLIST, HLIST, HBASE, DTABLE, PART, C, n_cb, HT: tl.constexpr, BLOCK_C: tl.constexpr,
    SEG: tl.constexpr,
):  # fmt: skip
    """Persistent over (heavy id, segment, column block) items, a segment SEG consecutive tokens of the id's list (as
    many per id as the longest id has, NLIST[3]; those past an id's count exit): the listed tokens gathered HT at a
    time, each tile added by a fixed reduction tree and the tiles in order, in fp32. An id of at most SEG tokens is
    written rounded once; a longer one's segments go to fp32 rows of PART (row HBASE[h] // SEG + h + segment: no two
    ids share a row), which ``_embedding_tier_b_merge_kernel`` adds in order."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    n_heavy = tl.load(NLIST + 1)
    nseg = tl.cdiv(tl.load(NLIST + 3), SEG)
    for it in range(pid, n_heavy * nseg * n_cb, P):
        hs = it // n_cb
        h = hs // nseg
        seg = hs % nseg
        f = tl.load(HEAVY + h)
        cnt = tl.load(COUNTS + f)
        t0 = seg * SEG
        if t0 < cnt:
            t1 = tl.minimum(cnt, t0 + SEG)
            base = tl.load(HBASE + h)
            cols = (it % n_cb) * BLOCK_C + tl.arange(0, BLOCK_C)
            cm = cols < C
            acc = tl.zeros([BLOCK_C], dtype=tl.float32)
            for t in range(t0, t1, HT):
                r = t + tl.arange(0, HT)
                tok = tl.load(HLIST + base + r, mask=r < t1, other=0)
                acc += tl.sum(_dout_rows(DOUT, tok, r < t1, cols, cm, C), axis=0)
            if t1 - t0 == cnt:  # the whole id in this segment
                tl.store(DTABLE + f.to(tl.int64) * C + cols, acc.to(DTABLE.dtype.element_ty), mask=cm)
            else:
                tl.store(PART + (base // SEG + h + seg).to(tl.int64) * C + cols, acc, mask=cm)


@_jit
def _embedding_tier_b_merge_kernel(
    COUNTS, HEAVY, NLIST, HBASE, PART, DTABLE, C, n_cb, SEG: tl.constexpr, BLOCK_C: tl.constexpr
):
    """After ``_embedding_tier_b_kernel``: each heavy id of more than SEG tokens, by (id, column block) items, its
    segments' fp32 partial rows added in segment order and rounded once."""
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


# ------------------------------------------------------------------------------------------------ launchers


def _sort_keys(ids: torch.Tensor, V: int, mark: bool, counts=None, heavy_k: int = 0):
    """(keys [N] to sort, ID_BIAS, present marks or None): int16 keys (ids - 32768) where V allows, else int32 or
    int64; the [V] int8 present marks if ``mark``; ``heavy_k`` > 0: only ids seen more than heavy_k times keep their
    key, the rest get the key dtype's largest value, whose id must be >= V."""
    N = ids.numel()
    room = 1 if heavy_k else 0  # the sentinel's id (the dtype's top) must name no row
    if V <= 2**16 - room:
        kdt, bias = torch.int16, 2**15
    elif V <= 2**31 - 1 - room:
        kdt, bias = torch.int32, 0
    else:
        kdt, bias = torch.int64, 0
    present = torch.zeros(V, dtype=torch.int8, device=ids.device) if mark else None
    keys = torch.empty(N, dtype=kdt, device=ids.device)
    _embedding_keys_kernel[(triton.cdiv(N, 1024),)](
        ids, keys, present, counts, N, ID_BIAS=bias, MARK=mark, HEAVY_K=heavy_k, SENTINEL=torch.iinfo(kdt).max,
        BLOCK=1024, num_warps=4,
    )  # fmt: skip
    return keys, bias, present


def _sort_walk_merge(d2, keys, bias, dtable, V, cfg: EmbeddingBwdConfig) -> None:
    """The stable sort, the chunk walks and the merge of the runs they cut (the merge as the walks' programmatic
    dependent on sm_90+, its programs resident and waiting when the walks end)."""
    N, C = d2.shape
    sorted_ids, order = torch.sort(keys, stable=True)
    bc = min(cfg.chain_block_c, triton.next_power_of_2(C))
    grid = (triton.cdiv(N, cfg.chunk), triton.cdiv(C, bc))
    part = torch.empty(grid[0], 2, C, dtype=torch.float32, device=d2.device)  # boundary partials only
    pdl = pdl_ok(d2)
    _embedding_bwd_chunk_kernel[grid](
        d2, order, sorted_ids, dtable, part, N, V, C, CHUNK=cfg.chunk, BLOCK_C=bc, ID_BIAS=bias, PDL=pdl,
        num_warps=cfg.chain_warps,
    )  # fmt: skip
    _embedding_bwd_merge_kernel[grid](
        sorted_ids, part, dtable, N, V, C, grid[0], CHUNK=cfg.chunk, BLOCK_C=bc, ID_BIAS=bias, MERGE_BLOCK=16,
        PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip


def _side(d2, flat, dtable, V, cfg: EmbeddingBwdConfig) -> None:
    """The side form: keys and marks, then the absent rows' zero fill here beside the sort / walk / merge chain on
    the high-priority side stream (disjoint rows)."""
    C = d2.shape[1]
    keys, bias, present = _sort_keys(flat, V, True)
    zbc = min(triton.next_power_of_2(C), 4096)
    zbr = max(1, 8192 // zbc)

    def fill():
        _embedding_zero_absent_kernel[(triton.cdiv(V, zbr), triton.cdiv(C, zbc))](
            present, dtable, V, C, BLOCK_R=zbr, BLOCK_C=zbc, num_warps=8
        )

    def chain():
        _sort_walk_merge(d2, keys, bias, dtable, V, cfg)

    if d2.is_cuda:
        run_side_by_side(d2.device, fill, chain, high_priority=True)
    else:
        fill()
        chain()


def _rows(d2, flat, dtable, V, cfg: EmbeddingBwdConfig) -> None:
    """The rows form: the slots pass, then the rows grid (issued first, the slots pass's programmatic dependent on
    sm_90+) here beside the chain for the ids seen more than K times on the high-priority side stream."""
    N, C = d2.shape
    counts = torch.zeros(V, dtype=torch.int32, device=d2.device)
    slots = torch.empty(K, V, dtype=torch.int32, device=d2.device)
    pdl = pdl_ok(d2)
    _embedding_slots_kernel[(triton.cdiv(N, cfg.slots_block),)](
        flat, counts, slots, N, V, K=K, BLOCK=cfg.slots_block, PDL=pdl, num_warps=4
    )
    rbc = min(cfg.rows_block_c, triton.next_power_of_2(C))

    def grid_pass():
        _embedding_bwd_rows_kernel[(V, triton.cdiv(C, rbc))](
            d2, counts, slots, dtable, V, C, K=K, BLOCK_C=rbc, PDL=pdl, num_warps=cfg.rows_warps,
            **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip

    def chain():
        keys, bias, _ = _sort_keys(flat, V, False, counts, K)
        _sort_walk_merge(d2, keys, bias, dtable, V, cfg)

    if d2.is_cuda:
        run_side_by_side(d2.device, grid_pass, chain, high_priority=True, main_first=True)
    else:
        grid_pass()
        chain()


_TIER_PLANS = PlanCache()  # the tiers form's launches on CUDA, by everything that decides them


class _Tiers:
    """The tiers form for one (N, V, C, element size, config): its int32 workspace, one allocation holding the
    counts, the three list lengths and the largest heavy count (zeroed together), the slots [K2, V], the medium ids,
    the heavy ids, their list offsets, the heavy lists, the named ids and their slot-0 tokens, each 128-byte aligned."""

    def __init__(self, N: int, V: int, C: int, esize: int, cfg: EmbeddingBwdConfig, dev: torch.device):
        self.N, self.V, self.C, self.esize, self.cfg = N, V, C, esize, cfg
        self.k2 = k2 = min(cfg.k2, max(2 * K, 1 << (C.bit_length() - 1)))  # [K2, V] slots <= an fp32 table
        self.hcap = hcap = N // (k2 + 1) + 1  # ids seen more than K2 times
        sizes = [V + 4, k2 * V, N // (K + 1) + 1, hcap, hcap, N, N, N]
        padded = [-(-n // 32) * 32 for n in sizes]
        self.ws = torch.empty(sum(padded), dtype=torch.int32, device=dev)
        self.zeroed, slots, self.med, self.heavy, self.hbase, self.hlist, self.named, self.first = (
            v[:n] for v, n in zip(torch.split(self.ws, padded), sizes)
        )
        self.slots = slots.view(k2, V)
        self.counts, self.nlist = self.zeroed[:V], self.zeroed[V:]
        self.pdl = pdl_ok(self.ws)
        self.n_sm = sm_count(dev) if self.ws.is_cuda else 1
        self.abc = min(cfg.a_block_c, triton.next_power_of_2(C))
        self.bbc = min(cfg.b_block_c, triton.next_power_of_2(C))

    def launcher(self, *parts):
        """(launch, done): launch(name, kernel, grid, args, **options) runs a launch; on CUDA through the plan cached
        under (sizes, config, workspace alignment, parts) (``CachedLaunch``: only the per-call tensors are passed),
        or the first time through the JIT while keeping the plan, which done() stores. The interpreter: the JIT."""
        key = (self.N, self.V, self.C, self.esize, self.ws.device, self.cfg, self.ws.data_ptr() % 128) + parts
        key = key if self.ws.is_cuda else None
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

    def tier_a(self, launch, name: str, programs: int, heavy: bool, med: bool, flat, d2=None, dtable=None):
        """Tier A: heavy, the heavy ids' token lists (ids only: without d2 the gradient pointers are the counts, never
        read through them); med, the medium rows."""
        cfg, ws = self.cfg, self
        args = dict(
            IDS=flat, DOUT=ws.counts if d2 is None else d2, COUNTS=ws.counts, SLOTS=ws.slots, MED=ws.med,
            HEAVY=ws.heavy, NLIST=ws.nlist, HLIST=ws.hlist, HBASE=ws.hbase,
            DTABLE=ws.counts if dtable is None else dtable, N=self.N, V=self.V, C=self.C, K2=self.k2, MT=cfg.mt,
            BLOCK_C=self.abc, SCAN=cfg.scan, DO_HEAVY=heavy, DO_MED=med,
        )  # fmt: skip
        launch(name, _embedding_tier_a_kernel, (programs,), args, num_warps=cfg.a_warps)

    def ids_part(self, launch, flat, rows_pdl: bool) -> None:
        """The counts zeroed and the slots pass (rows_pdl: the rows grid comes next, as its programmatic dependent)."""
        N, V = self.N, self.V
        if self.pdl:
            args = dict(X=self.zeroed, n=V + 4, BLOCK=4096, PDL=True)
            launch("fill", _zero_i32_kernel, (triton.cdiv(V + 4, 4096),), args, num_warps=4)
        else:
            self.zeroed.zero_()
        args = dict(
            IDS=flat, COUNTS=self.counts, SLOTS=self.slots, MED=self.med, HEAVY=self.heavy, NLIST=self.nlist,
            NAMED=self.named, FIRST=self.first, N=N, V=V, K=K, K2=self.k2, BLOCK=self.cfg.slots_block, PDL=rows_pdl,
            WAIT=self.pdl,
        )  # fmt: skip
        grid = (triton.cdiv(N, self.cfg.slots_block),)
        launch(
            "slots", _embedding_tier_slots_kernel, grid, args, num_warps=4, **({"launch_pdl": True} if self.pdl else {})
        )


class EmbeddingBwdPlan:
    """The ids-only part of the tiers form, made ahead of the backward (``embedding_bwd_plan``,
    ``embedding_fwd_planned``): the counts, slots and lists of the slots pass and the heavy ids' token lists. The
    backward given it launches only the rows grid and tiers A and B, and only reads it, so one plan serves any number
    of backward calls with the same ids (which must not change in between). Its int32 workspace is (V + 4 + K2 V +
    ~3 N) x 4 bytes, 8.5 MB at N = 16k, V = 32000."""

    __slots__ = ("_t", "ids", "flat", "ready")

    def __init__(self, t: _Tiers, ids: torch.Tensor, flat: torch.Tensor):
        self._t, self.ids, self.flat = t, ids, flat  # flat: the ids contiguous (a copy where ids are not)
        self.ready = None  # made on a side stream (``embedding_fwd_planned``): its end, for the backward to wait for

    def check(self, dout: torch.Tensor, ids: torch.Tensor, V: int, cfg: EmbeddingBwdConfig) -> None:
        """ValueError unless the backward's ids are the plan's (the same tensor: memory, shape and strides; not
        compared by value), and V, C, the element size and the config are as when it was made."""
        t, mine = self._t, self.ids
        if (t.N, t.V, t.C, t.esize, t.cfg) != (ids.numel(), V, dout.shape[-1], _esize(dout.dtype), cfg) or (
            ids.data_ptr(),
            ids.shape,
            ids.stride(),
        ) != (mine.data_ptr(), mine.shape, mine.stride()):
            raise ValueError(
                f"embedding_bwd: the plan was made for ids {tuple(mine.shape)} at {mine.data_ptr():#x}, V = {t.V}, "
                f"C = {t.C}, {t.esize}-byte elements, {t.cfg.form}; got dout {tuple(dout.shape)} ({dout.dtype}), "
                f"ids {tuple(ids.shape)} at {ids.data_ptr():#x}, V = {V}, {cfg.form}"
            )


def _esize(dtype: torch.dtype) -> int:
    return 2 if dtype.itemsize <= 2 else 4


def _plan_start(ids: torch.Tensor, V: int, C: int, dtype: torch.dtype, config: EmbeddingBwdConfig | None):
    """The plan, its workspace allocated on the current stream and nothing launched yet, or None (no use for one)."""
    if not isinstance(V, int) or not isinstance(C, int) or V < 1 or C < 1:
        raise ValueError(
            f"embedding_bwd_plan: V and C must be positive integers, got V = {V!r}, C = {C!r} for ids "
            f"{tuple(ids.shape)}"
        )
    cfg = config or embedding_bwd_config(dtype, ids.numel())
    if cfg.form != "tiers" or ids.numel() == 0:
        return None
    flat = ids.reshape(-1).contiguous()
    return EmbeddingBwdPlan(_Tiers(flat.numel(), V, C, _esize(dtype), cfg, ids.device), ids, flat)


def _plan_launches(plan: EmbeddingBwdPlan) -> None:
    t, flat = plan._t, plan.flat
    launch, done = t.launcher("plan", flat.dtype, flat.stride(), flat.data_ptr() % 16)
    t.ids_part(launch, flat, rows_pdl=False)
    t.tier_a(launch, "tier a, heavy", min(t.hcap, t.n_sm), True, False, flat)
    done()


def embedding_bwd_plan_triton(
    ids: torch.Tensor, V: int, C: int, dtype: torch.dtype, config: EmbeddingBwdConfig | None = None
) -> EmbeddingBwdPlan | None:
    """The ids-only part of the backward for dout of [..., C] in dtype, launched now on the current stream (fill,
    slots pass, heavy lists: ~6 us on the H200 at N = 16k), or None where the backward takes another form."""
    plan = _plan_start(ids, V, C, dtype, config)
    if plan is not None:
        _plan_launches(plan)
    return plan


def embedding_bwd_plan(ids: torch.Tensor, V: int, C: int, dtype: torch.dtype) -> EmbeddingBwdPlan | None:
    """``embedding_bwd_plan_triton`` where the backward runs Triton (CUDA), else None (the reference needs no plan)."""
    if dtype == torch.float64 or not use_triton(ids):
        return None
    return embedding_bwd_plan_triton(ids, V, C, dtype)


def embedding_fwd_planned(ids: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, EmbeddingBwdPlan | None]:
    """(``embedding_fwd(ids, table)``, ``embedding_bwd_plan(ids, V, C, table.dtype)``). On CUDA the plan's small
    launches go to a high-priority side stream beside the gather, and this stream does not wait for them: the
    backward waits for its event instead. The plan's workspace (and the ids' contiguous copy) is allocated on this
    stream and marked as used by the side stream, so the caching allocator reuses neither before it is done."""
    V, C = table.shape
    if table.dtype == torch.float64 or not use_triton(ids, table):
        return embedding_fwd(ids, table), None
    plan = _plan_start(ids, int(V), int(C), table.dtype, None)
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


def _tiers(d2, flat, dtable, V: int, cfg: EmbeddingBwdConfig, plan: EmbeddingBwdPlan | None) -> None:
    """The tiers form: the slots pass (or the plan's), then the rows grid here beside two high-priority side streams,
    one for tier A's medium rows, one for the heavy lists (without a plan) and tier B. On CUDA the launches are kept
    as ``CachedLaunch`` plans keyed on shapes, dtypes, strides, alignments and config: the JIT's binding costs tens of
    microseconds of host time per launch."""
    N, C = d2.shape
    dev = d2.device
    t = _Tiers(N, V, C, _esize(d2.dtype), cfg, dev) if plan is None else plan._t
    seg = cfg.seg
    # fp32 partial rows of the segments of ids longer than seg (rows HBASE[h] // seg + h + segment)
    part = torch.empty(N // seg + t.hcap + 1, C, dtype=torch.float32, device=dev)
    pdl = t.pdl and plan is None
    strides = (d2.stride(), flat.stride(), d2.data_ptr() % 16, flat.data_ptr() % 16, dtable.data_ptr() % 16)
    launch, done = t.launcher("bwd", plan is not None, d2.dtype, flat.dtype, *strides)
    if plan is None:
        t.ids_part(launch, flat, pdl)
    elif plan.ready is not None:
        torch.cuda.current_stream(dev).wait_event(plan.ready)  # the plan's launches, on another stream
    n_hcb = triton.cdiv(C, t.bbc)
    common = dict(COUNTS=t.counts, HEAVY=t.heavy, NLIST=t.nlist, HBASE=t.hbase, PART=part, DTABLE=dtable, C=C)
    common.update(n_cb=n_hcb, SEG=seg, BLOCK_C=t.bbc)

    def tier_b():
        grid = (cfg.b_per_sm * t.n_sm,)
        launch(
            "tier b",
            _embedding_tier_b_kernel,
            grid,
            dict(DOUT=d2, HLIST=t.hlist, HT=cfg.ht, **common),
            num_warps=cfg.b_warps,
        )
        launch("tier b merge", _embedding_tier_b_merge_kernel, grid, common, num_warps=cfg.b_warps)

    def grid_pass():
        rbc = min(cfg.rows_block_c, triton.next_power_of_2(C))
        gp = -(N // -2)  # a named-row program per two places of the named list (at most N long)
        args = dict(DOUT=d2, COUNTS=t.counts, SLOTS=t.slots, DTABLE=dtable, V=V, C=C, K=K, BLOCK_C=rbc, PDL=pdl)
        args.update(NAMED=t.named, NAMED_N=t.nlist[2:], GP=gp, FIRST=t.first)
        options = {"num_warps": cfg.rows_warps, **({"launch_pdl": True} if pdl else {})}
        launch("rows", _embedding_bwd_rows_kernel, (V + gp, triton.cdiv(C, rbc)), args, **options)

    def side():
        here = torch.cuda.current_stream(dev)
        second = side_stream(dev, high_priority=True, which=1)
        second.wait_stream(here)
        with torch.cuda.stream(second):
            t.tier_a(launch, "tier a, medium", cfg.a_per_sm * t.n_sm, False, True, flat, d2, dtable)
        if plan is None:
            t.tier_a(launch, "tier a, heavy", min(t.hcap, t.n_sm), True, False, flat, d2, dtable)
        tier_b()
        here.wait_stream(second)

    if d2.is_cuda:
        run_side_by_side(dev, grid_pass, side, high_priority=True, main_first=True)
    else:
        grid_pass()
        t.tier_a(launch, "tier a", cfg.a_per_sm * t.n_sm, plan is None, True, flat, d2, dtable)
        tier_b()
    done()


def embedding_bwd_triton(
    dout: torch.Tensor,
    ids: torch.Tensor,
    V: int,
    plan: EmbeddingBwdPlan | None = None,
    config: EmbeddingBwdConfig | None = None,
) -> torch.Tensor:
    """The Triton backward (module docstring) in ``config``'s form (None: ``embedding_bwd_config``'s); plan: the
    tiers form's ids-only part for these ids (checked), or None."""
    C = dout.shape[-1]
    if ids.shape != dout.shape[:-1]:
        raise ValueError(f"embedding_bwd: dout {tuple(dout.shape)} must be ids {tuple(ids.shape)} + [C]")
    d2 = dout.reshape(-1, C).contiguous()  # [N, C]
    N = ids.numel()
    cfg = config or embedding_bwd_config(dout.dtype, N)
    if plan is not None:
        if not isinstance(plan, EmbeddingBwdPlan):
            raise ValueError(f"embedding_bwd: plan must be an EmbeddingBwdPlan or None, got {type(plan).__name__}")
        plan.check(d2, ids, V, cfg)
    if N == 0:
        return torch.zeros(V, C, dtype=dout.dtype, device=dout.device)
    dtable = torch.empty(V, C, dtype=dout.dtype, device=dout.device)
    flat = plan.flat if plan is not None else ids.reshape(-1).contiguous()
    {"side": _side, "rows": _rows}[cfg.form](d2, flat, dtable, V, cfg) if cfg.form != "tiers" else _tiers(
        d2, flat, dtable, V, cfg, plan
    )
    return dtable


def embedding_bwd(dout: torch.Tensor, ids: torch.Tensor, V: int, plan: EmbeddingBwdPlan | None = None) -> torch.Tensor:
    """dtable from dout: Triton on CUDA (fp16 / bf16 / fp32, the form ``embedding_bwd_config`` ships), the reference
    elsewhere."""
    if dout.dtype != torch.float64 and use_triton(dout, ids):
        return embedding_bwd_triton(dout, ids, V, plan)
    return embedding_bwd_ref(dout, ids, V)
