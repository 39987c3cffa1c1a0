"""Session 17 probe for the fp32 embedding backward: the rows grid confined to part of the GPU by a CUDA green
context, so the frequent rows' chain (keys, sort, walks, merge) has SMs of its own beside it.

    PYTHONPATH=. python3 bench/embedding_green_probe.py [--sms 128,120,112,104,96] [--timeline]

Why: since session 7 the chain's latency-bound kernels wait 2-13 us each for a grid program to retire before
they get an SM, and the grid then loses the slots they hold; the op ends when the chain does (~122 us against
the grid's ~100 us alone). A green context (``torch.cuda.green_contexts``, CUDA 12.8+) partitions the SMs: the
grid's programs run only on its SMs, and the chain, on the ordinary high-priority side stream, finds the rest
idle. Timing only; on the bench's Zipf-like ids (N = 16k, V = 32000, C = 2048, fp32), GPU time (``bench/_gpu.py``):
  op                     the library's embedding_bwd_triton (the "rows" form)
  rows grid [n SMs]      the rows kernel alone on prepared counts and slots, on all SMs or on a green context's n
  chain                  keys, sort, walks and merge alone
  grid [n] + chain       the two side by side: the grid on the green context's stream, the chain on the op's
                         high-priority side stream
The green context's work goes on its ``GreenContext.Stream()`` (torch 2.11 has it; the probe says so and stops
where a torch does not).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import embedding_tma_probe as P  # noqa: E402
from bench._gpu import warm_up  # noqa: E402
from bench.kernels import copy_bandwidth, zipf_ids  # noqa: E402
from xtrain.kernels import embedding as K  # noqa: E402
from xtrain.kernels._dispatch import side_stream  # noqa: E402


class Green:
    """n SMs of the device as a green context; ``run(fn)`` launches fn's kernels on its stream, ordered after the
    current stream's work, and the current stream waits for them."""

    def __init__(self, n_sms: int):
        from torch.cuda import green_contexts as G

        self.gc = G.GreenContext.create(num_sms=n_sms, device_id=torch.cuda.current_device())
        self.stream = self.gc.Stream()

    def run(self, fn):
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            fn()
        main.wait_stream(self.stream)


def main(argv=None) -> int:
    ap = P.probe_parser(__doc__)
    ap.add_argument("--sms", default="128,120,112,104,96")
    ap.add_argument("--timeline", action="store_true")
    args = ap.parse_args(argv)
    from torch.cuda import green_contexts as G

    print(
        f"torch {torch.__version__}, green contexts supported: {G.SUPPORTED}; "
        f"GreenContext has Stream: {hasattr(G.GreenContext, 'Stream')}",
        flush=True,
    )
    if not (G.SUPPORTED and hasattr(G.GreenContext, "Stream")):
        return 1
    N, V, C = args.N, args.V, args.C
    torch.manual_seed(0)
    dev = torch.device("cuda")
    ids = zipf_ids(N, V)
    d = torch.randn(N, C, device=dev)
    ref = K.embedding_bwd_ref(d, ids, V)
    warm_up()
    copy_tbs = copy_bandwidth() / 1e12
    must = (N * C + V * C) * 4 + 8 * N
    dtable, rows_grid, chain = P.rows_and_chain(d, ids, V)

    def side_by_side(grid_runner):
        """The chain on the high-priority side stream, the grid through grid_runner, both after this stream."""
        main = torch.cuda.current_stream()
        side = side_stream(dev, high_priority=True)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            chain()
        grid_runner(rows_grid)
        main.wait_stream(side)

    row = P.Recorder(args.reps, copy_tbs, 36)

    row("op", lambda: K.embedding_bwd_triton(d, ids, V), must)
    row("rows grid, all SMs", rows_grid)
    row("chain", chain)
    row("grid (all SMs) + chain", lambda: side_by_side(lambda f: f()))
    greens = {}
    for n in (int(s) for s in args.sms.split(",")):
        try:
            greens[n] = Green(n)
        except Exception as e:  # noqa: BLE001 (a probe: say why and go on)
            print(f"green context of {n} SMs: {type(e).__name__}: {e}", flush=True)
            continue
        g = greens[n]
        dtable.fill_(float("nan"))
        try:
            side_by_side(g.run)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"green {n} SMs: {type(e).__name__}: {e}", flush=True)
            return 1
        err = (dtable - ref).abs().max().item()
        print(f"green {n} SMs: grid + chain max |err| vs reference {err:.3g}", flush=True)
        row(f"rows grid, green {n} SMs", lambda g=g: g.run(rows_grid))
        row(f"grid (green {n}) + chain", lambda g=g: side_by_side(g.run), must)
    if args.timeline:
        from bench.embedding_timeline import print_timeline, timeline

        for n, g in greens.items():
            print_timeline(f"grid (green {n}) + chain", timeline(lambda g=g: side_by_side(g.run)))
    print(f"\ncopy {copy_tbs:.2f} TB/s; op bytes {must / 1e6:.0f} MB")
    P.print_table(row.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
