"""Session 20: how fast can the fp32 embedding backward's byte mix move at all?

    PYTHONPATH=. python3 bench/mix_probe.py [--rounds 3]

The rows grid of the "tiers" form writes the whole 262 MB table (V = 32000, C = 2048, fp32) and reads the dout rows
of the rows seen at most 4 times (~105 MB), and it runs at ~89 % of copy alone. Sessions 7-19 moved every other part
of the op and left that rate as the bound. This probe times simpler kernels with the same mix, each a timing-only
stand-in (their outputs are not the gradient, except where said):

- torch: ``zero_`` of the table; an ``amax`` over dout (read only); both at once on two streams; ``index_select``
  of the named rows' first tokens (a gather of 8 KB rows, read + write);
- "mimic": one Triton program per table row, zeros or one dout row copied (sel[row] >= 0), one load of sel and one
  of the row: the rows grid less its slots and sorting network;
- "split": the zero rows and the copied rows as two Triton grids over lists, on two streams at once;
- "roles": one Triton grid whose programs copy rows (from a list in row order, or shuffled as the library's named
  list is) and whose other programs write zeros, in either order or interleaved; with N copy places, those past the
  list's end exiting at once (as the library's grid at ``ROWS_ROLES = -1``), with several zero rows per program, or
  as two passes over all rows in row order (session 21);
- the library's rows kernel alone on prepared counts and slots, in row order and in its two roles, and the whole op.

Each prints GPU time (``bench/_gpu.py``: L2 flushed by a write before each call) and its bytes against the 1 GiB
copy's rate, in alternating rounds.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@triton.jit
def _mimic_kernel(DOUT, SEL, OUT, C, BLOCK_C: tl.constexpr, ROWS: tl.constexpr):
    """ROWS table rows per program: zeros, or dout row SEL[row] copied (timing stand-in for the rows grid)."""
    for r in tl.static_range(ROWS):
        row = tl.program_id(0) * ROWS + r
        cols = tl.arange(0, BLOCK_C)
        s = tl.load(SEL + row)
        x = tl.load(DOUT + tl.maximum(s, 0).to(tl.int64) * C + cols, mask=cols < tl.where(s >= 0, C, 0), other=0.0)
        tl.store(OUT + row.to(tl.int64) * C + cols, x, mask=cols < C)


@triton.jit
def _list_kernel(DOUT, ROWS_OF, SRC_OF, OUT, C, BLOCK_C: tl.constexpr, COPY: tl.constexpr):
    """Program p: table row ROWS_OF[p] gets zeros (COPY False) or dout row SRC_OF[p] (COPY True)."""
    p = tl.program_id(0)
    row = tl.load(ROWS_OF + p).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    if COPY:
        x = tl.load(DOUT + tl.load(SRC_OF + p).to(tl.int64) * C + cols, mask=cols < C, other=0.0)
    else:
        x = tl.zeros([BLOCK_C], dtype=tl.float32)
    tl.store(OUT + row * C + cols, x, mask=cols < C)


@triton.jit
def _roles_kernel(
    DOUT, CNT, FEW, SRC_OF, OUT, V, n_few, n_copy, C, BLOCK_C: tl.constexpr, ORDER: tl.constexpr, ZR: tl.constexpr = 1
):
    """One grid, two roles: n_copy copy places (place i < n_few: table row FEW[i] gets dout row SRC_OF[i]; places
    past n_few exit, as the library's named-row programs past its list's end) and zero programs, each over ZR rows
    (row r gets zeros if CNT[r] == 0, else nothing). ORDER 0: copies first; 1: zeros first; 2: interleaved, 3 copies
    then 10 zero programs in every group of 13; 3: two passes in row order, the first over every row copying the
    few rows (SRC_OF[r] >= 0, FEW unused), the second writing the zero rows."""
    p = tl.program_id(0)
    n_zero = tl.cdiv(V, ZR)
    if ORDER == 0:
        is_copy = p < n_copy
        i = p
        z = p - n_copy
    elif ORDER == 1:
        is_copy = p >= n_zero
        i = p - n_zero
        z = p
    elif ORDER == 2:
        g = p // 13
        k = p % 13
        is_copy = k < 3
        i = g * 3 + k
        z = g * 10 + k - 3
    else:
        is_copy = p < V
        i = p
        z = p - V
    cols = tl.arange(0, BLOCK_C)
    if is_copy:
        if ORDER == 3:
            s = tl.load(SRC_OF + i)
            if s >= 0:
                x = tl.load(DOUT + s.to(tl.int64) * C + cols, mask=cols < C, other=0.0)
                tl.store(OUT + i.to(tl.int64) * C + cols, x, mask=cols < C)
        elif i < n_few:
            row = tl.load(FEW + i).to(tl.int64)
            x = tl.load(DOUT + tl.load(SRC_OF + i).to(tl.int64) * C + cols, mask=cols < C, other=0.0)
            tl.store(OUT + row * C + cols, x, mask=cols < C)
    elif z < n_zero:
        for j in tl.static_range(ZR):
            r = z * ZR + j
            if r < V:
                if tl.load(CNT + r) == 0:
                    tl.store(OUT + r.to(tl.int64) * C + cols, tl.zeros([BLOCK_C], dtype=tl.float32), mask=cols < C)


def main(argv=None) -> int:
    from bench._gpu import gpu_time, warm_up
    from bench.kernels import zipf_ids
    from xtrain.kernels import embedding as K
    from xtrain.kernels._dispatch import run_side_by_side

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    N, V, C = 16384, 32000, 2048
    ids = zipf_ids(N, V)
    d = torch.randn(N, C, device="cuda")
    table = torch.empty(V, C, device="cuda")
    cnt = torch.bincount(ids, minlength=V)
    named = torch.nonzero(cnt > 0).flatten()
    few = torch.nonzero((cnt > 0) & (cnt <= 4)).flatten()
    zero_rows = torch.nonzero(cnt == 0).flatten().int()
    first = torch.full((V,), N, dtype=torch.int64, device="cuda").scatter_reduce_(
        0, ids, torch.arange(N, device="cuda"), "amin"
    )
    sel = torch.where(cnt > 0, first, -1).int()
    src_few = first[few].int()
    sel_few = torch.where((cnt > 0) & (cnt <= 4), first, -1).int()
    few_i = few.int()
    reads_few = int(cnt[few].sum()) * C * 4
    print(
        f"rows named {named.numel()}, at most 4 times {few.numel()} ({int(cnt[few].sum())} tokens), zero "
        f"{zero_rows.numel()}"
    )
    big = torch.randn(1 << 28, device="cuda")
    big_out = torch.empty_like(big)
    row_b = C * 4
    dpart = d[: reads_few // row_b]
    cnt32 = cnt.int()
    n_few = few_i.numel()

    def side_by_side(main, other):  # the library's two-stream launch (the side stream of default priority)
        return lambda: run_side_by_side(d.device, main, other)

    def mimic(rows):
        return lambda: _mimic_kernel[(V // rows,)](d, sel, table, C, BLOCK_C=2048, ROWS=rows, num_warps=8)

    def copy_only():
        _list_kernel[(n_few,)](d, few_i, src_few, table, C, BLOCK_C=2048, COPY=True, num_warps=8)

    def zero_only():
        _list_kernel[(zero_rows.numel(),)](d, zero_rows, zero_rows, table, C, BLOCK_C=2048, COPY=False, num_warps=8)

    def split_seq():
        zero_only()
        copy_only()

    def zero_all_rows():  # the zero grid over every row, no list (a named row's program exits)
        _roles_kernel[(V,)](d, cnt32, few_i, src_few, table, V, 0, 0, C, BLOCK_C=2048, ORDER=1, num_warps=8)

    def roles(order, rows=few_i, srcs=src_few, n_copy=None, zr=1):
        n_copy = n_few if n_copy is None else n_copy
        n_zero = triton.cdiv(V, zr)
        n = {
            0: n_copy + n_zero,
            1: n_copy + n_zero,
            2: 13 * max(triton.cdiv(n_copy, 3), triton.cdiv(n_zero, 10)),
            3: 2 * V,
        }[order]
        return lambda: _roles_kernel[(n,)](
            d, cnt32, rows, srcs, table, V, n_few, n_copy, C, BLOCK_C=2048, ORDER=order, ZR=zr, num_warps=8
        )

    # the library's named list is in the order the slots pass met the ids (token order of first use), not row order
    shuffle = torch.randperm(n_few, device="cuda")
    few_shuffled, src_shuffled = few_i[shuffle], src_few[shuffle]

    # the library's rows kernel alone, on counts and slots the tiers form's slots pass made
    counts = torch.zeros(V + 2, dtype=torch.int32, device="cuda")
    slots = torch.empty(4 * V, dtype=torch.int32, device="cuda").view(4, V)
    K._embedding_slots_kernel[(triton.cdiv(N, 256),)](ids, counts, slots, N, V, K=4, BLOCK=256, num_warps=4)
    rcfg = K.ROWS_DEFAULTS[4]

    def rows_alone():
        K._rows_grid(d, counts, slots, table, V, rcfg, False)

    # ... and in the tiers form's two roles, on a named list of every named row in first-use order
    named_fu = named[torch.argsort(first[named])].int()
    named_n = torch.tensor([named_fu.numel()], dtype=torch.int32, device="cuda")

    def rows_roles_alone():
        K._rows_grid(d, counts, slots, table, V, rcfg, False, K._roles_args(named_fu, named_n, -1, N, 0))

    ntab = V * C * 4
    split_b = (zero_rows.numel() + 2 * n_few) * row_b
    cases = [
        ("copy 1 GiB (the yardstick)", lambda: big_out.copy_(big), 2 * big.numel() * 4),
        ("torch zero_ of the table", lambda: table.zero_(), ntab),
        ("torch amax over all dout (read only)", lambda: d.amax(), N * row_b),
        ("torch zero_ table || amax over the few rows' bytes", side_by_side(table.zero_, dpart.amax), ntab + reads_few),
        (
            "torch index_select of the few rows' first tokens",
            lambda: torch.index_select(d, 0, first[few]),
            2 * few.numel() * row_b,
        ),
        ("triton list: copy the few rows", copy_only, 2 * n_few * row_b),
        ("triton list: zero rows only", zero_only, zero_rows.numel() * row_b),
        ("triton split: zero list || copy list", side_by_side(zero_only, copy_only), split_b),
        ("triton split, one stream (zeros, then copies)", split_seq, split_b),
        ("triton split: zero grid over all rows || copy list", side_by_side(zero_all_rows, copy_only), split_b),
        ("triton one grid, roles: copies first", roles(0), split_b),
        ("triton one grid, roles: copies first, rows shuffled", roles(0, few_shuffled, src_shuffled), split_b),
        ("triton roles: copies first, shuffled, N copy places", roles(0, few_shuffled, src_shuffled, N), split_b),
        (
            "triton roles: copies first, shuffled, N places, 4 zero rows/prog",
            roles(0, few_shuffled, src_shuffled, N, 4),
            split_b,
        ),
        ("triton roles: copies first, in order, 4 zero rows/prog", roles(0, zr=4), split_b),
        ("triton roles: two row-order passes (copies, then zeros)", roles(3, srcs=sel_few), split_b),
        ("triton one grid, roles: zeros first", roles(1), split_b),
        ("triton one grid, roles: interleaved 3 : 10", roles(2), split_b),
        ("triton mimic, 1 row per program", mimic(1), ntab + few.numel() * row_b),
        ("triton mimic, 2 rows per program", mimic(2), ntab + few.numel() * row_b),
        ("library rows kernel alone (K = 4 sums)", rows_alone, ntab + reads_few),
        ("library rows kernel alone, roles (named list first-use order)", rows_roles_alone, ntab + reads_few),
        ("library op (tiers)", lambda: K.embedding_bwd_triton(d, ids, V), (N * C + V * C) * 4),
    ]
    warm_up()
    res = {name: [] for name, _, _ in cases}
    for rnd in range(args.rounds):
        for name, fn, _ in cases if rnd % 2 == 0 else cases[::-1]:
            res[name].append(gpu_time(fn)["ms"])
    copy_ms = sorted(res[cases[0][0]])[len(res[cases[0][0]]) // 2]
    copy_bw = cases[0][2] / copy_ms
    print(f"{'call':55s} {'ms (rounds)':>30s}  MB   of copy")
    for name, _, nbytes in cases:
        ts = res[name]
        med = sorted(ts)[len(ts) // 2]
        print(
            f"{name:55s} {' / '.join(f'{t:.4f}' for t in ts):>30s}  {nbytes / 1e6:5.0f} "
            f"{nbytes / med / copy_bw * 100:5.1f} %"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
