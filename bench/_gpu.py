"""What the GPU benchmarks share: a warm-up before the first timing.

An idle GPU's clocks (and the power state behind them) take a while to come up: in a fresh process the first
timings can read slow (bench/RESULTS.md: 10-30 % for 0.1 ms kernels). ``warm_up`` keeps the GPU busy with
large matmuls for a few seconds first. It is not enough on a machine that has just started: on an H200 the
first ``xtrain bench kernels`` process on a fresh machine read some RMSNorm backward rows at
59-83 % of copy with this warm-up (62-66 % without it) where later processes read 83-90 %, every time. Trust
a number once a second process agrees.
"""

from __future__ import annotations

import time


def warm_up(seconds: float = 3.0) -> float:
    """Run bf16 matmuls on the current CUDA device for about ``seconds``; returns the seconds spent."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            a = (a @ a).clamp_(-1.0, 1.0)
        torch.cuda.synchronize()
    del a
    torch.cuda.empty_cache()
    return time.perf_counter() - t0


_SLEEP_CYCLES_PER_MS = None


def _cycles_per_ms() -> float:
    """torch.cuda._sleep's cycles per millisecond on this GPU (measured once with CUDA events)."""
    global _SLEEP_CYCLES_PER_MS
    if _SLEEP_CYCLES_PER_MS is None:
        import torch

        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        s.record()
        torch.cuda._sleep(20_000_000)
        e.record()
        e.synchronize()
        _SLEEP_CYCLES_PER_MS = 20_000_000 / s.elapsed_time(e)
    return _SLEEP_CYCLES_PER_MS


def gpu_time(
    fn, reps: int = 30, warmup: int = 5, flush_mb: int = 256, host_calls: int = 5, flush: str = "write"
) -> dict:
    """Time ``fn`` on the GPU alone, with the host kept ahead of it; returns ms per call (median), the
    host's ms per call, and whether the launch queue stayed full.

    ``triton.testing.do_bench`` records a start event, then lets the host launch ``fn``: where the host needs
    longer to launch ``fn``'s kernels than the GPU needs to run the preceding cache flush, the GPU waits
    for the host inside the timed interval, so that time is host launch overhead (Python, argument
    binding, allocation), not kernel time. Here a GPU sleep long enough to cover every launch goes first;
    the host then queues ``reps`` x (L2 flush, start event, ``fn``, end event) while the GPU still sleeps,
    so each interval holds only ``fn``'s kernels and the gaps between them. ``queue_full`` says the host
    finished queueing before the sleep ended (otherwise the numbers may still hold host time, and the
    call is repeated once with a longer sleep). In a training step the host runs ahead of the GPU the
    same way, as long as its per-step launch time stays under the step's GPU time; ``host_ms`` (``fn``
    launched with the GPU busy, no synchronisation, mean of ``host_calls``) says how much of that budget ``fn``
    takes."""
    import time

    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if flush not in ("write", "read", "none"):
        raise ValueError(f"gpu_time: flush must be 'write', 'read' or 'none', got {flush!r}")
    cache = torch.empty(flush_mb << 18, dtype=torch.int32, device="cuda")  # flush_mb MiB
    sink = torch.empty((), dtype=torch.int32, device="cuda")
    do_flush = {"write": cache.zero_, "read": lambda: torch.amax(cache, dim=0, out=sink), "none": lambda: None}[flush]
    cpm = _cycles_per_ms()
    # the host's cost of one call, measured while the GPU is busy (so no launch waits on a full queue)
    torch.cuda._sleep(int(cpm * 50))
    t0 = time.perf_counter()
    for _ in range(host_calls):
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3 / host_calls
    torch.cuda.synchronize()
    for attempt in range(2):
        flushes, starts, ends = ([torch.cuda.Event(enable_timing=True) for _ in range(reps)] for _ in range(3))
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sleep_ms = (2 + attempt * 4) * reps * (host_ms + 0.05) + 5
        s0.record()
        torch.cuda._sleep(int(cpm * sleep_ms))
        s1.record()
        t0 = time.perf_counter()
        for i in range(reps):
            flushes[i].record()
            do_flush()
            starts[i].record()
            fn()
            ends[i].record()
        queued_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        # the host stayed ahead if it finished queueing inside the sleep, or (a call of thousands of launches
        # fills CUDA's launch queue, and the host then waits on the GPU, not the other way round) if the GPU
        # never sat idle between the calls: the time from the sleep's end to the last call's end is the sum
        # of the (flush + call) intervals but for the event gaps
        busy = sum(f.elapsed_time(e) for f, e in zip(flushes, ends))
        idle = s1.elapsed_time(ends[-1]) - busy
        full = queued_ms < s0.elapsed_time(s1) or idle < 0.01 * busy + 0.005 * reps
        if full:
            break
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return {"ms": times[len(times) // 2], "host_ms": host_ms, "queue_full": full}
