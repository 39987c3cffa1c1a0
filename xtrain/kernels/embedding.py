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
dtable is zero-filled first for ids that never occur: by torch.zeros for 4-byte dtypes, by
``_embedding_zero_absent_kernel`` (only rows with no id) for 2-byte dtypes, whichever measured faster.
Options (CONFIG / DEFAULTS), measured on the H200 (bench/RESULTS.md): int32 sort keys (half the radix
passes: the default, 0.415 vs 0.440 ms bf16, 0.195 vs 0.225 ms fp32); the source index loaded one step
ahead of its row (default for fp32 only; no gain measured); ``_embedding_bwd_fused_kernel``, the zero
tiles of absent rows and the chunk walks in one launch (slower: 0.497-0.514 ms bf16).
It is written in dout.dtype directly: the fp32 sum is rounded once, as in the reference, which
accumulates a whole fp32 [V, C] table instead.
Measured and dropped (H200, 2026-11-29, bench/RESULTS.md): one program per run (the first version:
0.552 ms bf16 / 0.384 ms fp32, a frequent id summed serially); a segmented-scan chunk kernel
(tl.associative_scan over an [8, 512] tile: 0.565 / 0.239 ms) vs the running-sum walk kept here
(0.444 / 0.222 ms).
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
def _chunk_body(c, cb, DOUT, ORDER, SORTED, DTABLE, PART, N, C, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
                IDX_AHEAD: tl.constexpr):
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
    prev_id = tl.load(SORTED + tl.maximum(s - 1, 0), mask=s > 0, other=-1)
    next_id = tl.load(SORTED + e, mask=e < N, other=-1)
    src0 = tl.load(ORDER + s)
    x0 = tl.load(DOUT + src0 * C + cols, mask=cmask, other=0.0)
    src1 = tl.load(ORDER + s + 1, mask=s + 1 < e, other=0)
    x1 = tl.load(DOUT + src1 * C + cols, mask=cmask & (cols * 0 + s + 1 < e), other=0.0)
    if IDX_AHEAD:
        src2 = tl.load(ORDER + s + 2, mask=s + 2 < e, other=0)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    cur = tl.load(SORTED + s)
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
        nid = tl.load(SORTED + k + 1, mask=k + 1 < N, other=-1)
        if (nid != cur) | (k == e - 1):  # the run of ``cur`` ends here (or at the chunk's end)
            ends_after = (k == e - 1) & (cur == next_id)
            if run_starts_before:
                tl.store(PART + (c.to(tl.int64) * 2) * C + cols, acc, mask=cmask)
            elif ends_after:
                tl.store(PART + (c.to(tl.int64) * 2 + 1) * C + cols, acc, mask=cmask)
            else:
                tl.store(DTABLE + cur.to(tl.int64) * C + cols, acc.to(DTABLE.dtype.element_ty), mask=cmask)
            acc = tl.zeros([BLOCK_C], dtype=tl.float32)
            run_starts_before = False
            cur = nid


@_jit
def _embedding_bwd_chunk_kernel(DOUT, ORDER, SORTED, DTABLE, PART, N, C, CHUNK: tl.constexpr,
                                BLOCK_C: tl.constexpr, IDX_AHEAD: tl.constexpr = False):
    """Program (chunk, column block): ``_chunk_body``."""
    _chunk_body(tl.program_id(0), tl.program_id(1), DOUT, ORDER, SORTED, DTABLE, PART, N, C, CHUNK, BLOCK_C,
                IDX_AHEAD)


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
                                ZBLOCK_R: tl.constexpr, ZBLOCK_C: tl.constexpr):
    """The chunk pass and the zero fill of absent rows in one launch (they write disjoint rows): the first
    n_chunk_progs programs are (chunk, column block) pairs, the rest zero tiles, so the latency-bound
    chunk walks run while the zero tiles stream their writes, instead of one pass after the other."""
    pid = tl.program_id(0)
    if pid < n_chunk_progs:
        _chunk_body(pid // n_cb, pid % n_cb, DOUT, ORDER, SORTED, DTABLE, PART, N, C, CHUNK, BLOCK_C, IDX_AHEAD)
    else:
        _zero_body(pid - n_chunk_progs, PRESENT, DTABLE, V, C, n_zcb, ZBLOCK_R, ZBLOCK_C)


@_jit
def _embedding_bwd_merge_kernel(SORTED, PART, DTABLE, N, C, n_chunks,
                                CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (chunk, column block): if this chunk's last run starts here and continues into the next
    chunks, sum its partials in chunk order (PART[c, 1], then PART[c', 0] of every later chunk c' the
    run reaches) and write the dtable row. Fixed order: the result does not depend on scheduling."""
    c = tl.program_id(0)
    s = c.to(tl.int64) * CHUNK
    e = tl.minimum(s + CHUNK, N)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    last = tl.load(SORTED + e - 1)
    first = tl.load(SORTED + s)
    prev_id = tl.load(SORTED + tl.maximum(s - 1, 0), mask=s > 0, other=-1)
    next_id = tl.load(SORTED + e, mask=e < N, other=-1)
    starts_here = (first != last) | (prev_id != last)
    if starts_here & (next_id == last):
        acc = tl.load(PART + (c.to(tl.int64) * 2 + 1) * C + cols, mask=cmask, other=0.0)
        cc = c + 1
        go = True
        while go:  # the run reaches chunk cc (its first token has id ``last``)
            acc += tl.load(PART + (cc.to(tl.int64) * 2) * C + cols, mask=cmask, other=0.0)
            cc += 1
            nid = tl.load(SORTED + tl.minimum(cc, n_chunks - 1).to(tl.int64) * CHUNK)
            go = (cc < n_chunks) & (nid == last)
        tl.store(DTABLE + last.to(tl.int64) * C + cols, acc.to(DTABLE.dtype.element_ty), mask=cmask)


@_jit
def _embedding_zero_absent_kernel(PRESENT, DTABLE, V, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Zero the dtable rows of ids that never occur (the others are written by the chunk/merge passes)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    absent = tl.load(PRESENT + rows, mask=rows < V, other=1) == 0
    zero = tl.zeros([BLOCK_R, BLOCK_C], dtype=DTABLE.dtype.element_ty)
    tl.store(DTABLE + rows[:, None] * C + cols[None, :], zero, mask=absent[:, None] & (cols < C)[None, :])


@_jit
def _embedding_zero_kernel(DTABLE, n, BLOCK: tl.constexpr):
    """Zero the whole table: a plain store stream. H200: 1 GiB of bf16 in 0.237 ms, where torch.zeros
    (its fill kernel) takes 0.320 ms (bench/RESULTS.md)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DTABLE + offs, tl.zeros([BLOCK], dtype=DTABLE.dtype.element_ty), mask=offs < n)


CONFIG = None  # (CHUNK, BLOCK_C, num_warps, zero fill[, sort32[, idx_ahead]]) override, for the bench's sweep
# zero fill: "torch" (torch.zeros first), "absent" (_embedding_zero_absent_kernel, then the chunk pass),
# "absent_side" (the same zero kernel on a side CUDA stream, concurrent with the sort and chunk passes),
# "store" (_embedding_zero_kernel over the whole table, then the chunk pass), "store_side" (that, with the
# sort on a side CUDA stream meanwhile),
# "fused" (_embedding_bwd_fused_kernel: zero tiles and chunk walks in one launch); sort32: sort the ids as
# int32 (half the radix passes of int64 keys; ids < 2^31); idx_ahead: see _chunk_body
# measured best on the H200 (bench/RESULTS.md), by dout element size:
DEFAULTS = {2: (16, 1024, 4, "absent", True, False), 4: (16, 512, 4, "torch", True, True)}  # H200 sweep 2


def embedding_bwd_triton(dout: torch.Tensor, ids: torch.Tensor, V: int) -> torch.Tensor:
    C = dout.shape[-1]
    if ids.shape != dout.shape[:-1]:
        raise ValueError(f"embedding_bwd: dout {tuple(dout.shape)} must be ids {tuple(ids.shape)} + [C]")
    d2 = dout.reshape(-1, C).contiguous()  # [N, C]
    N = ids.numel()
    cfg = CONFIG if CONFIG is not None else DEFAULTS[2 if dout.element_size() <= 2 else 4]
    CHUNK, BLOCK_C, num_warps, zero = cfg[:4]
    sort32 = bool(cfg[4]) if len(cfg) > 4 and V <= 2**31 - 1 else False
    idx_ahead = bool(cfg[5]) if len(cfg) > 5 else False
    flat = ids.reshape(-1).to(torch.int32 if sort32 else torch.int64)  # [N]
    BLOCK_C = min(BLOCK_C, triton.next_power_of_2(C))
    n_cb = triton.cdiv(C, BLOCK_C)
    side_sort = zero == "store_side" and dout.is_cuda
    if N == 0 or zero == "torch":
        dtable = torch.zeros(V, C, dtype=dout.dtype, device=dout.device)
        if N == 0:
            return dtable
    elif zero in ("store", "store_side"):
        dtable = torch.empty(V, C, dtype=dout.dtype, device=dout.device)
        if side_sort:  # the sort (ids only) runs on a side stream while the table is zeroed
            main = torch.cuda.current_stream(dout.device)
            side = side_stream(dout.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                sorted_ids, order = torch.sort(flat, stable=True)
        _embedding_zero_kernel[(triton.cdiv(V * C, 8192),)](dtable, V * C, BLOCK=8192, num_warps=8)
        if side_sort:
            main.wait_stream(side)
            for t in (sorted_ids, order):  # made on the side stream, used and freed on the main one
                t.record_stream(main)
    else:
        dtable = torch.empty(V, C, dtype=dout.dtype, device=dout.device)
        present = torch.zeros(V, dtype=torch.int8, device=dout.device)
        present[flat] = 1  # every writer stores the same 1: deterministic
        def zero_absent():
            _embedding_zero_absent_kernel[(triton.cdiv(V, 8), n_cb)](present, dtable, V, C, BLOCK_R=8,
                                                                     BLOCK_C=BLOCK_C, num_warps=4)
        if zero == "absent":
            zero_absent()
        elif zero == "absent_side" and dout.is_cuda:
            # the zero tiles write only rows no id names, the chunk and merge passes only rows ids name:
            # disjoint, so the zero fill runs on a side stream while the ids are sorted and summed
            main = torch.cuda.current_stream(dout.device)
            side = side_stream(dout.device)
            side.wait_stream(main)  # present, dtable ready
            with torch.cuda.stream(side):
                zero_absent()
        elif zero == "absent_side":
            zero_absent()
    if not side_sort:
        sorted_ids, order = torch.sort(flat, stable=True)
    n_chunks = triton.cdiv(N, CHUNK)
    part = torch.empty(n_chunks, 2, C, dtype=torch.float32, device=dout.device)  # boundary partials only
    if zero == "fused":
        n_zr = triton.cdiv(V, 8)
        _embedding_bwd_fused_kernel[(n_chunks * n_cb + n_zr * n_cb,)](
            d2, order, sorted_ids, dtable, part, present, N, V, C, n_cb, n_chunks * n_cb, n_cb, CHUNK=CHUNK,
            BLOCK_C=BLOCK_C, IDX_AHEAD=idx_ahead, ZBLOCK_R=8, ZBLOCK_C=BLOCK_C, num_warps=num_warps)
    else:
        _embedding_bwd_chunk_kernel[(n_chunks, n_cb)](d2, order, sorted_ids, dtable, part, N, C, CHUNK=CHUNK,
                                                      BLOCK_C=BLOCK_C, IDX_AHEAD=idx_ahead, num_warps=num_warps)
    _embedding_bwd_merge_kernel[(n_chunks, n_cb)](sorted_ids, part, dtable, N, C, n_chunks,
                                                  CHUNK=CHUNK, BLOCK_C=BLOCK_C, num_warps=4)
    if zero == "absent_side" and dout.is_cuda:
        main.wait_stream(side)  # later work on the main stream (and reuse of present's memory) after both
    return dtable


def embedding_bwd(dout: torch.Tensor, ids: torch.Tensor, V: int) -> torch.Tensor:
    if dout.dtype != torch.float64 and use_triton(dout, ids):
        return embedding_bwd_triton(dout, ids, V)
    return embedding_bwd_ref(dout, ids, V)
