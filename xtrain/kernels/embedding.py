"""Embedding lookup and its scatter-add backward.

Contract: embedding_fwd(ids[...], table[V, C]) -> out[..., C] (table.dtype)
          embedding_bwd(dout[..., C], ids, V) -> dtable[V, C] (dout.dtype): rows of dout added into the
          rows their ids name (an id seen k times gets k rows summed). No [N, V] one-hot is ever built.

Triton backward (deterministic, no atomics, no [V, C] temporary besides the gradient itself):
    order, sorted = stable sort of the N ids   (torch.sort, stable: a fixed summation order)
    _embedding_bwd_chunk_kernel  program (chunk, column block) takes CHUNK consecutive sorted tokens and
        sums each run of equal ids in fp32; runs inside the chunk are written to dtable directly, runs cut
        by a chunk edge go to a small fp32 buffer PART[n_chunks, 2, C] (at most two per chunk)
    _embedding_bwd_merge_kernel  for each run that crosses chunk edges, adds its partials in chunk order
        and writes the row. Every program has at most CHUNK tokens, so a frequent id no longer makes one
        long serial chain (idea from the issue thread: fixed-size token chunks of the sorted ids).
The rows no id names are zeroed by ``_embedding_zero_absent_kernel`` (marked by ``_embedding_keys_kernel``,
which also writes the sort keys) on the current stream while the sort, the chunk walks and the merge run on a
high-priority side stream (CONFIG zero fill "side", the default): the zero fill is a bandwidth-bound grid
over most of the table, the other three a chain of small latency-bound kernels, and with the side stream's
priority their programs take SMs as the zero tiles retire, so the chain runs under the fill
(``SIDE_HIGH_PRIORITY = False`` gives the side stream the default priority: on the H200 that form took 0.381
ms bf16 / 0.175 ms fp32 against 0.313 / 0.154 ms with the priority, and the fused launch before it 0.354 /
0.162 ms). CONFIG also selects torch.zeros first, ``_embedding_zero_absent_kernel`` first, or the zero tiles
and the walks in one launch (``_embedding_bwd_fused_kernel``, the default before session 6).
Chunk bodies: ``_chunk_body`` walks a chunk's tokens one by one; ``_chunk_tile_body`` gathers a chunk's
CHUNK rows as one tile, all in flight at once, and sums runs by a segmented scan held in each thread's
registers (the walk waits on an index load per token: the chunk + merge stage alone ran at 36-39% of copy).
Sort keys: int32 (half the radix passes of int64) or int16 (ids - 32768, V <= 65536: half again).
It is written in dout.dtype directly: the fp32 sum is rounded once, as in the reference, which accumulates a
whole fp32 [V, C] table instead. Defaults (H200, bench/RESULTS.md, session 6, GPU time): the side streams with
the walk, bf16 0.312 ms at V = 128k, C = 4096 (91% of copy), fp32 0.149 ms at V = 32k, C = 2048 (63%: there the
chain itself, a 37 us sort and 80 us of walks and merge, is longer than the fill beside it).
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

from xtrain.kernels._dispatch import jit as _jit
from xtrain.kernels._dispatch import side_stream, tl, triton, use_triton


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
def _chunk_body(c, cb, DOUT, ORDER, SORTED, DTABLE, PART, N, C, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
                IDX_AHEAD: tl.constexpr, ID_BIAS: tl.constexpr):
    """Chunk c, column block cb: the CHUNK sorted tokens [s, e) of this chunk, walked one by one with a
    running fp32 row sum that is flushed at each run end; two rows are loaded ahead of the one being
    added, so loads stay in flight while the sum waits. IDX_AHEAD: the source index of a row is loaded
    one step before the row itself, so no step waits on an index load before it can issue its row load.
    A run that lies wholly inside the chunk is written to its dtable row; a run cut by the chunk's start
    goes to PART[chunk, 0], a run cut only by its end to PART[chunk, 1] (the merge pass finishes both)."""
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
            else:
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
def _chunk_tile_body(c, cb, DOUT, ORDER, SORTED, DTABLE, PART, N, C, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
                     ID_BIAS: tl.constexpr):
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
    x = tl.load(DOUT + src[:, None] * C + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)  # [CHUNK, BLOCK_C]
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
    direct = is_end & (ids != prev_id) & (ids != next_id)  # only the first run can be prev_id's, the last next_id's
    tl.store(DTABLE + ids[:, None] * C + cols[None, :], run.to(DTABLE.dtype.element_ty),
             mask=direct[:, None] & cmask[None, :])
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
def _embedding_bwd_chunk_kernel(DOUT, ORDER, SORTED, DTABLE, PART, N, C, CHUNK: tl.constexpr,
                                BLOCK_C: tl.constexpr, IDX_AHEAD: tl.constexpr = False,
                                TILE: tl.constexpr = False, ID_BIAS: tl.constexpr = 0):
    """Program (chunk, column block): ``_chunk_tile_body`` (TILE) or ``_chunk_body``."""
    if TILE:
        _chunk_tile_body(tl.program_id(0), tl.program_id(1), DOUT, ORDER, SORTED, DTABLE, PART, N, C, CHUNK,
                         BLOCK_C, ID_BIAS)
    else:
        _chunk_body(tl.program_id(0), tl.program_id(1), DOUT, ORDER, SORTED, DTABLE, PART, N, C, CHUNK, BLOCK_C,
                    IDX_AHEAD, ID_BIAS)


@_jit
def _zero_body(z, PRESENT, DTABLE, V, C, n_zcb, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Zero tile z (row block z // n_zcb, column block z % n_zcb): the rows of ids that never occur."""
    rows = (z // n_zcb).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (z % n_zcb) * BLOCK_C + tl.arange(0, BLOCK_C)
    absent = tl.load(PRESENT + rows, mask=rows < V, other=1) == 0
    zero = tl.zeros([BLOCK_R, BLOCK_C], dtype=DTABLE.dtype.element_ty)
    tl.store(DTABLE + rows[:, None] * C + cols[None, :], zero, mask=absent[:, None] & (cols < C)[None, :])


@_jit
def _embedding_bwd_fused_kernel(DOUT, ORDER, SORTED, DTABLE, PART, PRESENT, N, V, C, n_cb, n_chunk_progs, n_zcb,
                                CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, IDX_AHEAD: tl.constexpr,
                                ZBLOCK_R: tl.constexpr, ZBLOCK_C: tl.constexpr, TILE: tl.constexpr = False,
                                ID_BIAS: tl.constexpr = 0):
    """The chunk pass and the zero fill of absent rows in one launch (they write disjoint rows): the first
    n_chunk_progs programs are (chunk, column block) pairs, the rest zero tiles, so the latency-bound
    chunk walks run while the zero tiles stream their writes, instead of one pass after the other."""
    pid = tl.program_id(0)
    if pid < n_chunk_progs:
        if TILE:
            _chunk_tile_body(pid // n_cb, pid % n_cb, DOUT, ORDER, SORTED, DTABLE, PART, N, C, CHUNK, BLOCK_C,
                             ID_BIAS)
        else:
            _chunk_body(pid // n_cb, pid % n_cb, DOUT, ORDER, SORTED, DTABLE, PART, N, C, CHUNK, BLOCK_C,
                        IDX_AHEAD, ID_BIAS)
    else:
        _zero_body(pid - n_chunk_progs, PRESENT, DTABLE, V, C, n_zcb, ZBLOCK_R, ZBLOCK_C)


@_jit
def _embedding_bwd_merge_kernel(SORTED, PART, DTABLE, N, C, n_chunks,
                                CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, ID_BIAS: tl.constexpr = 0,
                                MERGE_BLOCK: tl.constexpr = 1):
    """Program (chunk, column block): if this chunk's last run starts here and continues into the next
    chunks, sum its partials (PART[c, 1], then PART[c', 0] of every later chunk c' the run reaches) and
    write the dtable row: one chunk per step (MERGE_BLOCK = 1), or MERGE_BLOCK chunks per step, their first
    ids and partial rows loaded together and the [MERGE_BLOCK, BLOCK_C] tile summed over its rows (the ids
    are sorted, so the chunks a run reaches are one unbroken stretch). A frequent id spans many chunks (one
    seen 521 times spans 33 chunks of 16 tokens): one chunk per step makes that a chain of dependent loads.
    Fixed shapes, fixed order: the result does not depend on scheduling."""
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
    if starts_here & (next_id == last):
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
                tile = tl.load(PART + (ccs.to(tl.int64) * 2)[:, None] * C + cols[None, :],
                               mask=reach[:, None] & cmask[None, :], other=0.0)
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
def _embedding_keys_kernel(IDS, KEYS, PRESENT, N, ID_BIAS: tl.constexpr, MARK: tl.constexpr, BLOCK: tl.constexpr):
    """The sort keys (ids - ID_BIAS in KEYS' dtype: int16 keys sort in two radix passes where int32 take
    four) and, if MARK, the present marks (PRESENT[id] = 1; every writer stores the same 1, so the result
    does not depend on their order) in one launch: torch needed a cast and an index_put."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    ids = tl.load(IDS + i, mask=m, other=0)
    tl.store(KEYS + i, (ids - ID_BIAS).to(KEYS.dtype.element_ty), mask=m)
    if MARK:
        tl.store(PRESENT + ids, tl.full([BLOCK], 1, dtype=PRESENT.dtype.element_ty), mask=m)


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
DEFAULTS = {2: (16, 1024, 4, "side", 16, True), 4: (16, 512, 4, "side", 16, True)}
SIDE_HIGH_PRIORITY = True  # "side": the side stream of the highest priority (False: the default priority)
MERGE_BLOCK = 1  # later chunks per step of the merge pass (_embedding_bwd_merge_kernel); H200, session 6: 4 and 16
# within the run-to-run spread of 1 (bf16 0.312-0.313 ms all three; fp32 0.147-0.156 ms)


def _sort_keys(ids: torch.Tensor, V: int, key_bits, mark: bool):
    """(keys [N] to sort, ID_BIAS, present marks or None): ids as int16 / int32 / int64 sort keys, and the
    [V] int8 present marks if ``mark``."""
    N = ids.numel()
    flat = ids.reshape(-1)
    if key_bits == 16 and V <= 2**16:
        kdt, bias = torch.int16, 2**15  # ids - 32768 fits int16 and keeps their order
    elif key_bits and V <= 2**31 - 1:  # True or 32
        kdt, bias = torch.int32, 0
    else:
        kdt, bias = torch.int64, 0
    if not mark and bias == 0:
        return flat.to(kdt), 0, None
    present = torch.zeros(V, dtype=torch.int8, device=ids.device) if mark else None
    keys = torch.empty(N, dtype=kdt, device=ids.device)
    _embedding_keys_kernel[(triton.cdiv(N, 1024),)](flat.contiguous(), keys, present, N, ID_BIAS=bias, MARK=mark,
                                                    BLOCK=1024, num_warps=4)
    return keys, bias, present


def embedding_bwd_triton(dout: torch.Tensor, ids: torch.Tensor, V: int) -> torch.Tensor:
    C = dout.shape[-1]
    if ids.shape != dout.shape[:-1]:
        raise ValueError(f"embedding_bwd: dout {tuple(dout.shape)} must be ids {tuple(ids.shape)} + [C]")
    d2 = dout.reshape(-1, C).contiguous()  # [N, C]
    N = ids.numel()
    cfg = CONFIG if CONFIG is not None else DEFAULTS[2 if dout.element_size() <= 2 else 4]
    CHUNK, BLOCK_C, num_warps, zero = cfg[:4]
    if zero not in ("torch", "absent", "fused", "side"):
        raise ValueError(f"embedding_bwd: CONFIG zero fill must be 'torch', 'absent', 'fused' or 'side', got {zero!r}")
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
    mark = zero in ("absent", "fused", "side")
    keys, bias, present = _sort_keys(ids, V, key_bits, mark)
    n_chunks = triton.cdiv(N, CHUNK)

    def sort_walk_merge():
        """The sort, the chunk walks (present rows and boundary partials) and the merge of cut runs."""
        sorted_ids, order = torch.sort(keys, stable=True)
        part = torch.empty(n_chunks, 2, C, dtype=torch.float32, device=dout.device)  # boundary partials only
        _embedding_bwd_chunk_kernel[(n_chunks, n_cb)](d2, order, sorted_ids, dtable, part, N, C, CHUNK=CHUNK,
                                                      BLOCK_C=BLOCK_C, IDX_AHEAD=idx_ahead, TILE=tile,
                                                      ID_BIAS=bias, num_warps=num_warps)
        _embedding_bwd_merge_kernel[(n_chunks, n_cb)](sorted_ids, part, dtable, N, C, n_chunks,
                                                      CHUNK=CHUNK, BLOCK_C=BLOCK_C, ID_BIAS=bias,
                                                      MERGE_BLOCK=MERGE_BLOCK, num_warps=4)

    if zero == "side":
        # the absent rows' zero fill (a bandwidth-bound grid, most of the table) on this stream, while the
        # sort, the walks and the merge (a chain of small latency-bound kernels) run on a high-priority side
        # stream: their programs take an SM as soon as one frees, so the chain runs under the zero fill
        # instead of before it. Disjoint rows: the walks and the merge write only rows ids name.
        zbc = min(triton.next_power_of_2(C), 4096)
        zbr = max(1, 8192 // zbc)

        def zero_absent():
            _embedding_zero_absent_kernel[(triton.cdiv(V, zbr), triton.cdiv(C, zbc))](
                present, dtable, V, C, BLOCK_R=zbr, BLOCK_C=zbc, num_warps=8)
        if dout.is_cuda:
            main = torch.cuda.current_stream(dout.device)
            side = side_stream(dout.device, high_priority=SIDE_HIGH_PRIORITY)
            side.wait_stream(main)  # keys, marks and dtable ready
            with torch.cuda.stream(side):
                sort_walk_merge()
            zero_absent()
            main.wait_stream(side)  # dtable complete; later work (and memory reuse) ordered after both
        else:
            zero_absent()
            sort_walk_merge()
        return dtable
    if zero == "absent":
        _embedding_zero_absent_kernel[(triton.cdiv(V, 8), n_cb)](present, dtable, V, C, BLOCK_R=8,
                                                                 BLOCK_C=BLOCK_C, num_warps=4)
    if zero != "fused":
        sort_walk_merge()
        return dtable
    sorted_ids, order = torch.sort(keys, stable=True)
    part = torch.empty(n_chunks, 2, C, dtype=torch.float32, device=dout.device)  # boundary partials only
    n_zr = triton.cdiv(V, 8)
    _embedding_bwd_fused_kernel[(n_chunks * n_cb + n_zr * n_cb,)](
        d2, order, sorted_ids, dtable, part, present, N, V, C, n_cb, n_chunks * n_cb, n_cb, CHUNK=CHUNK,
        BLOCK_C=BLOCK_C, IDX_AHEAD=idx_ahead, ZBLOCK_R=8, ZBLOCK_C=BLOCK_C, TILE=tile, ID_BIAS=bias,
        num_warps=num_warps)
    _embedding_bwd_merge_kernel[(n_chunks, n_cb)](sorted_ids, part, dtable, N, C, n_chunks,
                                                  CHUNK=CHUNK, BLOCK_C=BLOCK_C, ID_BIAS=bias, MERGE_BLOCK=MERGE_BLOCK,
                                                  num_warps=4)
    return dtable


def embedding_bwd(dout: torch.Tensor, ids: torch.Tensor, V: int) -> torch.Tensor:
    if dout.dtype != torch.float64 and use_triton(dout, ids):
        return embedding_bwd_triton(dout, ids, V)
    return embedding_bwd_ref(dout, ids, V)
