"""Session 15 probe for the fp32 embedding backward: can a persistent grid of TMA bulk stores write the table at
the zero-fill rate while the frequent rows' chain runs beside it at its own speed?

    PYTHONPATH=. python3 bench/embedding_tma_probe.py [--reps 30]

Timing only (the zero grid writes zeros to every row). On the bench's Zipf-like ids (N = 16k, V = 32000,
C = 2048, fp32), GPU time (``bench/_gpu.py``):
  op                    the library's embedding_bwd_triton (the "rows" form)
  rows grid             the library's rows kernel alone, on prepared counts and slots
  chain                 keys, sort, walks and merge alone (the frequent rows), on the current stream
  rows grid + chain     the two side by side, as the op runs them after its slots pass
  tma zero P/SM w       a Gluon kernel, P programs per SM of w warps, each program storing one shared 8 KB zero
                        tile into row after row by TMA (cp.async.bulk.tensor), waiting only at its end
  tma zero + chain      that kernel beside the chain (the chain on the op's high-priority side stream)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._gpu import gpu_time, warm_up  # noqa: E402
from bench.kernels import copy_bandwidth, zipf_ids  # noqa: E402
from xtrain.kernels import embedding as K  # noqa: E402
from xtrain.kernels._dispatch import run_side_by_side, sm_count, triton  # noqa: E402
from xtrain.kernels.attention.gluon_common import HAVE_GLUON  # noqa: E402

if HAVE_GLUON:
    from xtrain.kernels.attention.gluon_common import TensorDescriptor, _tma_store, fence_async_shared, gl, gluon, tma

    @gluon.jit
    def _tma_zero_kernel(desc, V, SUB: gl.constexpr):
        """Program p stores a zero [SUB, W] tile (one table row) into rows p, p + G, ... by TMA."""
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [gl.num_warps(), 1], [1, 0])
        W: gl.constexpr = desc.block_type.shape[1]
        zero = gl.allocate_shared_memory(gl.float32, [SUB, W], desc.layout)
        zero.store(gl.zeros([SUB, W], gl.float32, layout))
        fence_async_shared()
        for r in range(gl.program_id(0), V, gl.num_programs(0)):
            _tma_store(desc, [r * SUB, 0], zero)
        tma.store_wait(0)


_LIBCUDA = None


def prefer_shared_memory(compiled, percent: int) -> bool:
    """cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT) on a compiled kernel: applies to its
    later launches (session 12's knob, from commit 7e8083b)."""
    global _LIBCUDA
    import ctypes

    if _LIBCUDA is None:
        _LIBCUDA = ctypes.CDLL("libcuda.so.1")
    return _LIBCUDA.cuFuncSetAttribute(ctypes.c_void_p(compiled.function), 9, int(percent)) == 0


def tma_zero(dtable: torch.Tensor, per_sm: int, warps: int, carveout: int | None = None):
    V, C = dtable.shape
    W = 256
    view = dtable.view(V * (C // W), W)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    desc = TensorDescriptor(view, list(view.shape), list(view.stride()), [C // W, W], layout)
    grid = (per_sm * sm_count(dtable.device),)

    def run():
        _tma_zero_kernel[grid](desc, V, SUB=C // W, num_warps=warps)

    if carveout is not None:
        k = _tma_zero_kernel[grid](desc, V, SUB=C // W, num_warps=warps)
        assert prefer_shared_memory(k, carveout)
    return run


def rows_and_chain(d: torch.Tensor, ids: torch.Tensor, V: int):
    """The fp32 "rows" form's two branches as separate launches, at the library's defaults: the slots pass run
    once here, then (dtable, rows_grid, chain): the rows kernel over the whole table, and the frequent rows'
    keys, sort, walks and merge. Each writes its own rows of dtable."""
    N, C = d.shape
    dev = d.device
    CHUNK, BLOCK_C, nw, _, key_bits, idx_ahead = K.DEFAULTS[4]
    heavy_k, rbr, rbc, rwarps = K.ROWS_DEFAULTS[4][:4]
    flat = ids.reshape(-1).contiguous()
    counts = torch.zeros(V, dtype=torch.int32, device=dev)
    slots = torch.empty(heavy_k, V, dtype=torch.int32, device=dev)
    K._embedding_slots_kernel[(triton.cdiv(N, K.SLOTS_BLOCK),)](
        flat, counts, slots, N, V, K=heavy_k, BLOCK=K.SLOTS_BLOCK, num_warps=4
    )
    dtable = torch.empty(V, C, device=dev)
    n_chunks = triton.cdiv(N, CHUNK)
    n_cb = triton.cdiv(C, BLOCK_C)
    n_rb, n_rcb = triton.cdiv(V, rbr), triton.cdiv(C, rbc)

    def rows_grid():
        K._embedding_bwd_rows_kernel[(n_rb, n_rcb)](
            d, counts, slots, dtable, V, C, n_rcb, n_rb * n_rcb, K=heavy_k, BLOCK_R=rbr, BLOCK_C=rbc, num_warps=rwarps
        )

    def chain():
        keys, bias, _ = K._sort_keys(flat, V, key_bits, False, counts, heavy_k)
        sorted_ids, order = torch.sort(keys, stable=True)
        part = torch.empty(n_chunks, 2, C, dtype=torch.float32, device=dev)
        K._walk_and_merge(
            d, order, sorted_ids, dtable, part, N, V, C, n_chunks, n_cb, CHUNK, BLOCK_C, idx_ahead, False, bias, nw
        )

    return dtable, rows_grid, chain


def probe_parser(doc: str) -> argparse.ArgumentParser:
    """The embedding probes' common options: timed calls per row and the bench's shape (N, V, C)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--N", type=int, default=16384)
    ap.add_argument("--V", type=int, default=32000)
    ap.add_argument("--C", type=int, default=2048)
    return ap


def main(argv=None) -> int:
    ap = probe_parser(__doc__)
    ap.add_argument("--timeline", action="store_true", help="also print three GPU timelines (torch.profiler)")
    args = ap.parse_args(argv)
    N, V, C = args.N, args.V, args.C
    torch.manual_seed(0)
    dev = torch.device("cuda")
    ids = zipf_ids(N, V)
    d = torch.randn(N, C, device=dev)
    warm_up()
    copy_tbs = copy_bandwidth() / 1e12
    must = (N * C + V * C) * 4 + 8 * N
    dtable, rows_grid, chain = rows_and_chain(d, ids, V)

    row = Recorder(args.reps, copy_tbs, 32)

    row("op", lambda: K.embedding_bwd_triton(d, ids, V), must)
    row("rows grid", rows_grid)
    row("chain", chain)
    row("rows grid + chain", lambda: run_side_by_side(dev, rows_grid, chain, high_priority=True))
    row("torch zero_", lambda: dtable.zero_(), V * C * 4)
    for per_sm, warps in ((1, 1), (1, 4), (2, 4)):
        z = tma_zero(dtable, per_sm, warps)
        row(f"tma zero {per_sm}/SM w{warps}", z, V * C * 4)
    for cv in (None, 100, 50):
        for per_sm, warps in ((1, 1), (1, 4), (2, 4)):
            z = tma_zero(dtable, per_sm, warps, cv)
            row(
                f"tma zero {per_sm}/SM w{warps} cv{cv} + chain",
                lambda z=z: run_side_by_side(dev, z, chain, high_priority=True),
            )
    z = tma_zero(dtable, 1, 4, 100)
    row("tma zero 1/SM w4 cv100 + chain, low prio", lambda: run_side_by_side(dev, z, chain, high_priority=False))
    z = tma_zero(dtable, 1, 4)
    z()
    torch.cuda.synchronize()
    assert int((dtable != 0).sum()) == 0, "the TMA zero kernel left nonzero elements"
    if args.timeline:
        from bench.embedding_timeline import print_timeline, timeline

        z = tma_zero(dtable, 1, 4)
        for name, fn in (
            ("chain alone", chain),
            ("rows grid + chain", lambda: run_side_by_side(dev, rows_grid, chain, True)),
            ("tma zero 1/SM w4 + chain", lambda: run_side_by_side(dev, z, chain, True)),
        ):
            print_timeline(name, timeline(fn))
    print(f"\ncopy {copy_tbs:.2f} TB/s; op bytes {must / 1e6:.0f} MB, zero bytes {V * C * 4 / 1e6:.0f} MB")
    print_table(row.rows)
    return 0


class Recorder:
    """``row(name, fn, nbytes=None)`` times fn (GPU time, ``reps`` calls), prints it and keeps (name, ms, the
    fraction of copy bandwidth nbytes took) in ``rows``."""

    def __init__(self, reps: int, copy_tbs: float, width: int = 32):
        self.reps, self.copy_tbs, self.width, self.rows = reps, copy_tbs, width, []

    def __call__(self, name: str, fn, nbytes: int | None = None) -> None:
        ms = gpu_time(fn, reps=self.reps)["ms"]
        frac = f"{nbytes / ms / 1e9 / self.copy_tbs:.0%}" if nbytes else ""
        self.rows.append((name, ms, frac))
        print(f"{name:{self.width}s} {ms:.4f} ms {frac}", flush=True)


def print_table(rows: list) -> None:
    """(what, ms, fraction of copy) rows as a markdown table."""
    print("| what | ms | of copy |\n|---|---:|---:|")
    for name, ms, frac in rows:
        print(f"| {name} | {ms:.4f} | {frac} |")


if __name__ == "__main__":
    sys.exit(main())
