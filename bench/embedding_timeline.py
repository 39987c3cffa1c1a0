"""The GPU timeline of one embedding backward: each kernel's stream, start (from the call's first kernel) and
duration, for the library's forms side by side (H200, session 7: how the rows kernel and the sort/walk/merge
chain overlap on their two streams; session 16: the rows grid's launch). The forms without their own launch
knobs take the library's (since session 16 the rows grid a programmatic dependent, issued first).

    PYTHONPATH=. python3 bench/embedding_timeline.py [--bf16]

Three calls are profiled (torch.profiler, CUDA activity) behind a ~30 ms GPU sleep, so the profiler's slower
host launches stay ahead of the GPU and the timeline is the GPU's own; the last call is printed. A CUDA-graph
replay is timed too, but its timeline is not the eager one: the graph's nodes lose the side stream's priority
(there the chain waits for the whole grid).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

from bench.kernels import zipf_ids
from xtrain.kernels import embedding as K

# name: (CONFIG, ROWS[, other module knobs]) for fp32; bf16 doubles the column blocks
FORMS = {
    "side": ((16, 512, 4, "side", 16, True), None),
    "rows K4 8x512 w8": ((16, 512, 4, "rows", 16, True), (4, 8, 512, 8)),
    "rows K4 1x2048 w8": ((16, 512, 4, "rows", 16, True), (4, 1, 2048, 8)),
    "rows K4 1x2048 w8, merge 1 (before session 12)": (
        (16, 512, 4, "rows", 16, True),
        (4, 1, 2048, 8),
        {"MERGE_BLOCK": 1},
    ),
    "rows K4 1x2048 w8, tile chain": ((16, 512, 4, "rows", 16, False, "tile"), (4, 1, 2048, 8)),
    "rows K4 2x2048 w16": ((16, 512, 4, "rows", 16, True), (4, 2, 2048, 16)),
    "rows K4 4x2048 w16": ((16, 512, 4, "rows", 16, True), (4, 4, 2048, 16)),
    "rows K2 2x1024 w8": ((16, 512, 4, "rows", 16, True), (2, 2, 1024, 8)),
    "rows K4 4x512 w4, persistent 3/SM": ((16, 512, 4, "rows", 16, True), (4, 4, 512, 4, 3)),
    "rows K4 1x2048 w8, launched as before session 16": (
        (16, 512, 4, "rows", 16, True),
        (4, 1, 2048, 8),
        {"ROWS_PDL": False, "ROWS_MAIN_FIRST": False},
    ),
    "rows K4 1x2048 w8, pdl": (
        (16, 512, 4, "rows", 16, True),
        (4, 1, 2048, 8),
        {"ROWS_PDL": True, "ROWS_MAIN_FIRST": False},
    ),
    "rows K4 1x2048 w8, main first": (
        (16, 512, 4, "rows", 16, True),
        (4, 1, 2048, 8),
        {"ROWS_PDL": False, "ROWS_MAIN_FIRST": True},
    ),
}


def graph_us(fn) -> float:
    """Median of 20 CUDA-graph replays of fn, in microseconds."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(25):
        st.record()
        g.replay()
        en.record()
        torch.cuda.synchronize()
        ts.append(st.elapsed_time(en) * 1000)
    return sorted(ts[5:])[10]


def timeline(fn, calls: int = 3) -> list[dict]:
    """The kernels of the last of ``calls`` profiled calls, in start order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(60_000_000)  # ~30 ms at the H200's clock
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            ev = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel" and "sleep" not in e["name"]]
    ev.sort(key=lambda e: e["ts"])
    return ev[-(len(ev) // calls) :]


def main() -> int:
    bf16 = "--bf16" in sys.argv
    N, V, C, dt = (16384, 131072, 4096, torch.bfloat16) if bf16 else (16384, 32000, 2048, torch.float32)
    torch.manual_seed(0)
    ids = zipf_ids(N, V)
    d = torch.randn(N, C, device="cuda").to(dt)
    base = {k: getattr(K, k) for f in FORMS.values() if len(f) > 2 for k in f[2]}
    for name, (cfg, rows, *knobs) in FORMS.items():
        for k, v in {**base, **(knobs[0] if knobs else {})}.items():
            setattr(K, k, v)
        if bf16:
            cfg = (cfg[0], 2 * cfg[1]) + cfg[2:]
            rows = rows and (rows[0], rows[1], 2 * rows[2]) + rows[3:]
        K.CONFIG, K.ROWS = cfg, rows
        fn = lambda: K.embedding_bwd_triton(d, ids, V)  # noqa: E731
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        g = graph_us(fn)
        ev = timeline(fn)
        t0 = ev[0]["ts"]
        end = max(e["ts"] + e["dur"] for e in ev) - t0
        print(
            f"\n== {name}, N={N} V={V} C={C} {dt}: {len(ev)} kernels, first start to last end {end:.1f} us "
            f"(graph replay {g:.1f} us)"
        )
        print_kernels(ev, detail=True)
    return 0


def print_kernels(ev: list, detail: bool = False) -> None:
    """One line per kernel of a ``timeline``: stream, start from the first kernel's, duration, name (detail: and
    its block, registers and shared memory)."""
    t0 = ev[0]["ts"]
    for e in ev:
        a = e["args"]
        line = f"  stream {a.get('stream')!s:>4}  +{e['ts'] - t0:7.1f} us  {e['dur']:7.1f} us  "
        if detail:
            line += (
                f"{e['name'][:60]:<60} block {a.get('block')} regs {a.get('registers per thread')} "
                f"smem {a.get('shared memory')}"
            )
        else:
            line += e["name"][:60]
        print(line)


def print_timeline(name: str, ev: list) -> None:
    """A ``timeline`` under a title: its first start to last end, then ``print_kernels``."""
    print(f"\n== {name}: first start to last end {max(e['ts'] + e['dur'] for e in ev) - ev[0]['ts']:.1f} us")
    print_kernels(ev)


if __name__ == "__main__":
    raise SystemExit(main())
