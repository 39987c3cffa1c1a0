"""Engine overhead: our tape vs torch.autograd on graphs of many small ops.

Two graphs, built identically in both engines on tiny tensors so per-node bookkeeping dominates:
  chain:  y = x; repeat N/2 times: y = y * w + b              (N nodes in a line)
  fanout: h = x * 1.0001; y = sum_i (h * w_i)  for i < N/2    (one node read by N/2 consumers)
  silu:   y = x; repeat N/2 times: y = silu(y * 1.0001)       (our silu backward is several torch
          kernels where torch's is one fused kernel, so this row measures op maths + engine)
Both engines issue the same torch kernels in the chain and fanout rows, so their ratio is the engine's
per-node overhead (Python closures and bookkeeping vs torch.autograd's C++). Two xtrain columns: the forward
with Python's cyclic GC on (backward always pauses it), and the whole graph under ``gc_paused()`` as the
trainer runs a step; the GC re-scanning the growing graph of Python objects is most of the difference.
For each we time forward+backward (median of repeats) and report per-node microseconds and the ratio
ours / torch.autograd. Peak memory: a chain over large tensors, in a fresh subprocess per engine,
reporting the peak resident set (CPU) or torch.cuda.max_memory_allocated (CUDA).

    xtrain bench engine [--nodes 20000] [--device cpu]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys
import time

import torch


def _ours_chain(x0, n):
    import xtrain.ops as ops
    from xtrain import Var

    x = Var(x0, requires_grad=True)
    y = x
    for _ in range(n):
        y = ops.silu(ops.scale(y, 1.0001))
    ops.sum(y).backward()
    return x.grad


def _torch_chain(x0, n):
    import torch.nn.functional as F

    x = x0.clone().requires_grad_()
    y = x
    for _ in range(n):
        y = F.silu(y * 1.0001)
    y.sum().backward()
    return x.grad


def _ours_affine(x0, w, b, n):
    import xtrain.ops as ops
    from xtrain import Var

    x = Var(x0, requires_grad=True)
    y = x
    for _ in range(n):
        y = ops.add(ops.mul(y, w), b)
    ops.sum(y).backward()
    return x.grad


def _torch_affine(x0, w, b, n):
    x = x0.clone().requires_grad_()
    y = x
    for _ in range(n):
        y = y * w + b
    y.sum().backward()
    return x.grad


def _ours_fanout(x0, ws, n):
    import xtrain.ops as ops
    from xtrain import Var

    x = Var(x0, requires_grad=True)
    h = ops.scale(x, 1.0001)
    acc = None
    for w in ws:
        t = ops.mul(h, w)
        acc = t if acc is None else ops.add(acc, t)
    ops.sum(acc).backward()
    return x.grad


def _torch_fanout(x0, ws, n):
    x = x0.clone().requires_grad_()
    h = x * 1.0001
    acc = None
    for w in ws:
        t = h * w
        acc = t if acc is None else acc + t
    acc.sum().backward()
    return x.grad


def _time(fn, repeat, device):
    ts = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _peak_child(engine: str, device: str, numel: int, n: int) -> float:
    """Run one chain in this process and print the peak memory in MB (called in a subprocess)."""
    x0 = torch.randn(numel, device=device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    (_ours_chain if engine == "xtrain" else _torch_chain)(x0, n)
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="xtrain bench engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nodes", type=int, default=20000, help="ops per graph (default 20000)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mem-numel", type=int, default=1 << 20, help="elements per tensor for the memory run")
    ap.add_argument("--mem-nodes", type=int, default=64)
    ap.add_argument("--_peak", choices=["xtrain", "torch"], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._peak:
        print(f"{_peak_child(a._peak, a.device, a.mem_numel, a.mem_nodes):.1f}")
        return 0
    torch.manual_seed(0)
    n = a.nodes
    x0 = torch.randn(16, device=a.device)
    ws = [torch.randn(16, device=a.device) for _ in range(n // 2)]
    from xtrain import Var
    from xtrain.autograd import gc_paused

    wv = [Var(w) for w in ws]
    g1, g2 = _ours_chain(x0, n // 2), _torch_chain(x0, n // 2)
    assert torch.allclose(g1, g2, rtol=1e-4, atol=1e-6), "chain gradients differ"
    w1, b1 = torch.rand(16, device=a.device) + 0.5, torch.randn(16, device=a.device)
    w1v, b1v = Var(w1), Var(b1)
    rows = []
    for name, ours, theirs, nodes in [
        ("chain", lambda: _ours_affine(x0, w1v, b1v, n // 2), lambda: _torch_affine(x0, w1, b1, n // 2), n),
        ("fanout", lambda: _ours_fanout(x0, wv, n), lambda: _torch_fanout(x0, ws, n), n),
        ("silu", lambda: _ours_chain(x0, n // 2), lambda: _torch_chain(x0, n // 2), n),
    ]:
        ours(), theirs()  # warm-up
        t_o, t_t = _time(ours, a.repeat, a.device), _time(theirs, a.repeat, a.device)

        def paused(f=ours):
            with gc_paused():
                f()

        t_p = _time(paused, a.repeat, a.device)
        rows.append((name, nodes, t_o / nodes * 1e6, t_p / nodes * 1e6, t_t / nodes * 1e6, t_o / t_t, t_p / t_t))
    peaks = {}
    for eng in ("xtrain", "torch"):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.engine",
                "--_peak",
                eng,
                "--device",
                a.device,
                "--mem-numel",
                str(a.mem_numel),
                "--mem-nodes",
                str(a.mem_nodes),
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=str(pathlib.Path(__file__).resolve().parents[1]),
        )
        peaks[eng] = float(out.stdout.strip().splitlines()[-1])
    print(f"engine overhead, {a.device}, torch {torch.__version__}, forward+backward on 16-element tensors")
    print(
        f"{'graph':<8} {'nodes':>7} {'xtrain us/node':>15} {'gc paused':>10} {'torch us/node':>14} "
        f"{'ratio':>7} {'ratio paused':>13}"
    )
    for name, nodes, uo, up, ut, ratio, ratio_p in rows:
        print(f"{name:<8} {nodes:>7} {uo:>15.2f} {up:>10.2f} {ut:>14.2f} {ratio:>6.2f}x {ratio_p:>12.2f}x")
    what = "max_memory_allocated" if a.device == "cuda" else "peak RSS of a fresh process"
    print(
        f"peak memory, chain of {a.mem_nodes} silu(scale) pairs on {a.mem_numel} floats ({what}): "
        f"xtrain {peaks['xtrain']:.0f} MiB, torch {peaks['torch']:.0f} MiB, "
        f"ratio {peaks['xtrain'] / peaks['torch']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
