"""What bounds the fp32 embedding backward's rows kernel (session 12): the kernel alone against probes that
move the same bytes with one thing changed.

    PYTHONPATH=. python3 bench/embedding_rows_probe.py [--reps 30] [--plan | --tiles 8x512/8 1x2048/8 ...] [--C 2048]

The rows kernel (``xtrain/kernels/embedding.py``, the "rows" form) writes the whole [V, C] table and gathers
the dout rows of every row seen at most K times (random rows of dout, in table-row order). Probes, all on the
same ids (the bench's Zipf-like ids, N = 16k, V = 32k, C = 2048, fp32) and GPU time (``bench/_gpu.py``):
  zero tiles        the same grid and tiles, zeros stored, nothing loaded (the write ceiling of this tiling)
  sequential reads  the rows kernel with each row's tokens read from consecutive dout rows (same bytes, same
                    control flow; only the gather addresses differ): does the gathers' randomness cost?
  rows kernel       the library's kernel, several tilings, one launch per tile or persistent (n per SM)
  swizzled          the rows kernel with its row blocks visited in a scattered order (frequent, read-heavy
                    low ids spread over the whole launch instead of all at its start)
  gather / scatter / copy   13k rows of 8 KB: random reads and sequential writes, the reverse, and a plain copy
``--plan`` instead times only the default op split at its ids-only preparation (counts, slots, sort keys,
sort): the op, the preparation alone, and the rest given a prepared plan (bits checked against the op).
``--tiles`` times the op with the given rows-kernel tiles (rows x columns / warps), for other widths C.
The last lines are a table: ms, the bytes moved, and the fraction of the copy bandwidth (a 1 GiB copy, measured
in the run).
Probes are timing only (their outputs are not the op's); the rows kernel's output is checked against the
reference on the rows it owns.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._gpu import gpu_time, warm_up  # noqa: E402
from bench.kernels import zipf_ids  # noqa: E402
from xtrain.kernels import embedding as K  # noqa: E402
from xtrain.kernels._dispatch import sm_count, tl, triton  # noqa: E402
from xtrain.kernels.embedding import _row_add, _rows_tile  # noqa: E402


@triton.jit
def _zero_tiles(DTABLE, V, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(
        DTABLE + rows[:, None] * C + cols[None, :],
        tl.zeros([BLOCK_R, BLOCK_C], tl.float32),
        mask=(rows < V)[:, None] & (cols < C)[None, :],
    )


@triton.jit
def _rows_seq(DOUT, COUNTS, BASE, DTABLE, V, C, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The rows kernel's tile with row r's j-th token read from dout row BASE[r] + j (consecutive rows)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    cnt = tl.load(COUNTS + rows, mask=rows < V, other=K + 1)
    own = cnt <= K
    base = tl.load(BASE + rows, mask=own, other=0)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        acc = _row_add(acc, DOUT, base + j, own & (cnt > j), cols, cmask, C, "")
    tl.store(DTABLE + rows[:, None] * C + cols[None, :], acc, mask=own[:, None] & cmask[None, :])


@triton.jit
def _rows_swizzled(
    DOUT,
    COUNTS,
    SLOTS,
    DTABLE,
    V,
    C,
    n_rb,
    n_cb,
    STRIDE: tl.constexpr,
    K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """The rows kernel's tile, its row block (pid // n_cb) * STRIDE mod n_rb (a bijection: n_rb a power of two,
    STRIDE odd)."""
    pid = tl.program_id(0)
    rb = ((pid // n_cb).to(tl.int64) * STRIDE) % n_rb
    _rows_tile(rb, pid % n_cb, DOUT, COUNTS, SLOTS, DTABLE, V, C, K, BLOCK_R, BLOCK_C, "", False)


@triton.jit
def _row_copy(SRC, SRC_IDX, DST, DST_IDX, C, BLOCK_C: tl.constexpr):
    """dst[DST_IDX[i]] = src[SRC_IDX[i]], one program per (row i, column block)."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    s = tl.load(SRC_IDX + i).to(tl.int64)
    d = tl.load(DST_IDX + i).to(tl.int64)
    tl.store(DST + d * C + cols, tl.load(SRC + s * C + cols, mask=cols < C), mask=cols < C)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--N", type=int, default=16384)
    ap.add_argument("--V", type=int, default=32768)
    ap.add_argument("--C", type=int, default=2048)
    ap.add_argument("--plan", action="store_true", help="only the op split at its ids-only preparation")
    ap.add_argument(
        "--tiles",
        nargs="*",
        default=None,
        metavar="BRxBC/W",
        help="only the op with these rows-kernel tiles (e.g. 8x512/8 1x2048/8), at --C",
    )
    args = ap.parse_args()
    N, V, C = args.N, args.V, args.C
    dev = "cuda"
    torch.manual_seed(0)
    warm_up(3.0)
    ids = zipf_ids(N, V, dev)
    d = torch.randn(N, C, device=dev)
    table = torch.empty(V, C, device=dev)
    big = torch.empty(N, C, device=dev)
    src = torch.empty(1 << 28, device=dev)  # 1 GiB
    dst = torch.empty_like(src)
    copy_bytes = 2 * src.numel() * 4
    copy_ms = gpu_time(lambda: dst.copy_(src), reps=args.reps)["ms"]
    copy_bw = copy_bytes / copy_ms / 1e9
    src = dst = None  # noqa: F841 (freed)
    rows = [
        ("copy 1 GiB -> 1 GiB (the yardstick)", copy_ms, copy_bytes),
        (
            f"copy of dout, {d.numel() * 4 / 1e6:.0f} MB",
            gpu_time(lambda: big.copy_(d), reps=args.reps)["ms"],
            2 * d.numel() * 4,
        ),
    ]

    table_bytes = V * C * 4
    ref = K.embedding_bwd_ref(d, ids, V)
    if args.tiles is not None:
        op_bytes = N * C * 4 + V * C * 4 + 8 * N
        for t in args.tiles:
            shape, w = t.split("/")
            br, bc = (int(x) for x in shape.split("x"))
            K.ROWS = (4, br, bc, int(w))
            rows.append(
                (
                    f"the op, rows tiles {br}x{bc} on {w} warps",
                    gpu_time(lambda: K.embedding_bwd_triton(d, ids, V), reps=args.reps)["ms"],
                    op_bytes,
                )
            )
        K.ROWS = None
        rows.append(
            ("the op, the default", gpu_time(lambda: K.embedding_bwd_triton(d, ids, V), reps=args.reps)["ms"], op_bytes)
        )
        _report(rows, copy_bw, N, V, C)
        return
    if args.plan:
        rows += _plan_split(ids, d, V, C, args.reps)
        _report(rows, copy_bw, N, V, C)
        return
    for k in (2, 4):
        counts, slots = _slots(ids, V, k)
        light = int(counts[counts <= k].sum())
        own = counts <= k
        nbytes = table_bytes + light * C * 4
        for br, bc, w in (
            (8, 512, 8),
            (4, 512, 4),
            (2, 1024, 8),
            (2, 2048, 8),
            (1, 2048, 4),
            (4, 1024, 8),
            (16, 512, 8),
            (8, 256, 4),
        ):
            n_rb, n_cb = triton.cdiv(V, br), triton.cdiv(C, bc)

            def run(br=br, bc=bc, w=w, n_rb=n_rb, n_cb=n_cb, counts=counts, slots=slots, k=k):
                K._embedding_bwd_rows_kernel[(n_rb, n_cb)](
                    d, counts, slots, table, V, C, n_cb, n_rb * n_cb, K=k, BLOCK_R=br, BLOCK_C=bc, num_warps=w
                )

            run()
            err = (table[own] - ref[own]).abs().max().item()
            rows.append(
                (f"rows kernel K{k} {br}x{bc} w{w} (max err {err:.1e})", gpu_time(run, reps=args.reps)["ms"], nbytes)
            )
        if k == 4:
            for br, bc, w in ((8, 512, 8), (4, 512, 4), (2, 2048, 8)):
                n_rb, n_cb = triton.cdiv(V, br), triton.cdiv(C, bc)
                for per_sm in (1, 2, 3, 4):
                    grid = (min(n_rb * n_cb, per_sm * sm_count(d.device)),)

                    def run(br=br, bc=bc, w=w, n_rb=n_rb, n_cb=n_cb, grid=grid, counts=counts, slots=slots):
                        K._embedding_bwd_rows_kernel[grid](
                            d,
                            counts,
                            slots,
                            table,
                            V,
                            C,
                            n_cb,
                            n_rb * n_cb,
                            K=4,
                            BLOCK_R=br,
                            BLOCK_C=bc,
                            PERSISTENT=True,
                            num_warps=w,
                        )

                    rows.append(
                        (
                            f"rows kernel K4 {br}x{bc} w{w} persistent {per_sm}/SM",
                            gpu_time(run, reps=args.reps)["ms"],
                            nbytes,
                        )
                    )
                # the same bytes with the reads consecutive
                base = torch.zeros(V, dtype=torch.int32, device=dev)
                c_own = torch.where(own, counts, torch.zeros_like(counts))
                base[1:] = torch.cumsum(c_own, 0)[:-1].to(torch.int32)

                def run_seq(br=br, bc=bc, w=w, n_rb=n_rb, n_cb=n_cb, base=base, counts=counts):
                    _rows_seq[(n_rb, n_cb)](d, counts, base, table, V, C, K=4, BLOCK_R=br, BLOCK_C=bc, num_warps=w)

                rows.append(
                    (f"probe: sequential reads K4 {br}x{bc} w{w}", gpu_time(run_seq, reps=args.reps)["ms"], nbytes)
                )

                def run_zero(br=br, bc=bc, w=w, n_rb=n_rb, n_cb=n_cb):
                    _zero_tiles[(n_rb, n_cb)](table, V, C, BLOCK_R=br, BLOCK_C=bc, num_warps=w)

                rows.append(
                    (f"probe: zero tiles {br}x{bc} w{w}", gpu_time(run_zero, reps=args.reps)["ms"], table_bytes)
                )
                if n_rb & (n_rb - 1) == 0:
                    for stride in (1, 97, 1021):

                        def run_swz(br=br, bc=bc, w=w, n_rb=n_rb, n_cb=n_cb, stride=stride, counts=counts, slots=slots):
                            _rows_swizzled[(n_rb * n_cb,)](
                                d,
                                counts,
                                slots,
                                table,
                                V,
                                C,
                                n_rb,
                                n_cb,
                                STRIDE=stride,
                                K=4,
                                BLOCK_R=br,
                                BLOCK_C=bc,
                                num_warps=w,
                            )

                        run_swz()
                        err = (table[own] - ref[own]).abs().max().item()
                        rows.append(
                            (
                                f"swizzled K4 {br}x{bc} w{w} stride {stride} (max err {err:.1e})",
                                gpu_time(run_swz, reps=args.reps)["ms"],
                                nbytes,
                            )
                        )
            rows.append(("zero_() of the table", gpu_time(table.zero_, reps=args.reps)["ms"], table_bytes))
            # 13k rows of 8 KB: random reads / random writes / neither
            n_l = light
            perm = torch.randperm(N, device=dev)[:n_l].to(torch.int32)
            seq = torch.arange(n_l, device=dev, dtype=torch.int32)
            for name, si, di in (
                ("gather: random reads, sequential writes", perm, seq),
                ("scatter: sequential reads, random writes", seq, perm),
                ("copy: both sequential", seq, seq),
            ):

                def run_copy(si=si, di=di, n_l=n_l):
                    _row_copy[(n_l, triton.cdiv(C, 2048))](d, si, big, di, C, BLOCK_C=2048, num_warps=4)

                rows.append((f"{name} ({n_l} rows)", gpu_time(run_copy, reps=args.reps)["ms"], 2 * n_l * C * 4))
    _report(rows, copy_bw, N, V, C)


def _slots(ids, V, k):
    """The rows form's counts and slots for these ids (the library's slots pass, K = k)."""
    N = ids.numel()
    counts = torch.zeros(V, dtype=torch.int32, device=ids.device)
    slots = torch.empty(k, V, dtype=torch.int32, device=ids.device)
    K._embedding_slots_kernel[(triton.cdiv(N, K.SLOTS_BLOCK),)](
        ids, counts, slots, N, V, K=k, BLOCK=K.SLOTS_BLOCK, num_warps=4
    )
    return counts, slots


def _report(rows, copy_bw, N, V, C) -> None:
    print(
        f"\nGPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
        f"N={N} V={V} C={C} fp32; copy {copy_bw:.2f} TB/s"
    )
    print(f"{'probe':<64} {'ms':>7} {'MB':>6} {'of copy':>8}")
    for name, ms, nb in rows:
        print(f"{name:<64} {ms:7.4f} {nb / 1e6:6.0f} {nb / ms / 1e9 / copy_bw:8.1%}")


def _plan_split(ids, d, V, C, reps) -> list:
    """The default fp32 op (rows form, K = 4) split at its ids-only preparation: the counts and slots, the
    frequent tokens' sort keys and the sort depend on the ids alone, so a training step could build them
    before dout exists. Times the op, the preparation alone, and the rest (the rows grid beside the chain's
    walks and merge) given a prepared plan; checks the split op's bits against the op's."""
    from xtrain.kernels._dispatch import run_side_by_side

    N = ids.numel()
    k = 4
    br, bc, w = K.ROWS_DEFAULTS[4][1:4]
    CHUNK, BLOCK_C, nw, _, key_bits, idx_ahead = K.DEFAULTS[4]  # the op's own fp32 settings
    n_chunks, n_cb = triton.cdiv(N, CHUNK), triton.cdiv(C, BLOCK_C)
    n_rb, n_rcb = triton.cdiv(V, br), triton.cdiv(C, bc)
    op_bytes = N * C * 4 + V * C * 4 + 8 * N

    def prep():
        counts, slots = _slots(ids, V, k)
        keys, bias, _ = K._sort_keys(ids, V, key_bits, False, counts, k)
        srt, order = torch.sort(keys, stable=True)
        return counts, slots, srt, order, bias

    plan = prep()

    def rest(plan=plan):
        counts, slots, srt, order, bias = plan
        dtable = torch.empty(V, C, device=d.device)
        part = torch.empty(n_chunks, 2, C, device=d.device)

        def grid_pass():
            K._embedding_bwd_rows_kernel[(n_rb, n_rcb)](
                d, counts, slots, dtable, V, C, n_rcb, n_rb * n_rcb, K=k, BLOCK_R=br, BLOCK_C=bc, num_warps=w
            )

        def chain():
            K._walk_and_merge(
                d, order, srt, dtable, part, N, V, C, n_chunks, n_cb, CHUNK, BLOCK_C, idx_ahead, False, bias, nw
            )

        run_side_by_side(d.device, grid_pass, chain, high_priority=True)
        return dtable

    same = torch.equal(rest(), K.embedding_bwd_triton(d, ids, V))
    return [
        ("the op (default, fp32)", gpu_time(lambda: K.embedding_bwd_triton(d, ids, V), reps=reps)["ms"], op_bytes),
        ("its ids-only preparation alone (counts, slots, keys, sort)", gpu_time(prep, reps=reps)["ms"], 8 * N),
        (
            f"the rest given the preparation (rows grid + walks/merge; bits equal {same})",
            gpu_time(rest, reps=reps)["ms"],
            op_bytes,
        ),
    ]


if __name__ == "__main__":
    main()
