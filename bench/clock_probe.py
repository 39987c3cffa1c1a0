"""The SM clock while a kernel runs: xtrain's flash-attention backward against cuDNN's, under the same load.

    PYTHONPATH=. python3 bench/clock_probe.py [--seqs 8192,16384] [--head-dims 128] [--reps 40] [--parts]
    PYTHONPATH=. python3 bench/clock_probe.py --energy 3 [--seqs ...]   # mJ per call instead (NVML counter)
    PYTHONPATH=. python3 bench/clock_probe.py --timeline 60 [--block 20] [--quiet]   # time, W, MHz, C per block

Under sustained tensor-core load the H200 lowers its SM clock (nvidia-smi sampling in session 10 read 1665-1725
MHz during the long backward benchmarks against 1980 MHz at light load). If one backward runs at a lower clock
than the other, part of the time ratio is power, not schedule. The probe: one single-warp Triton program on a
side stream spins for a given time while the main stream runs ``reps`` back-to-back calls, and reads the SM's
cycle counter (``%clock64``) and the global nanosecond timer (``%globaltimer``) at both ends; cycles / ns is
the mean clock over the window. It takes one SM of 132 (both backwards lose it alike). Reports per backward:
ms per call (CUDA events over the reps) and the mean clock, and the time ratio at equal clocks; ``--parts``
first times the Gluon split's two kernels alone the same way, then the two back to back on one stream (is the
whole slower than its parts, and is it the sequence or the rest of the backward?). ``--energy SECONDS``: energy
per call from NVML's energy counter over SECONDS of back-to-back calls: under the power cap, time follows energy.
Give it 3 s or more: a smoke run at 0.5 s (session 14) read 631-809 W and 1.03-1.30 pJ per FLOP for the same
kernels that read 676-708 W and 1.03-1.10 over 3 s. ``--timeline SECONDS``: blocks of ``--block`` back-to-back calls,
xtrain's and cuDNN's in turn, for SECONDS; per block the ms per call (CUDA events), and from NVML the mean power
over the block, the SM clock and the temperature at its end. Prints every block (or, with ``--quiet``, a histogram
per contender), the per-pair ratio, and whether the two contenders' times move together and with the temperature
and clock: is a time's spread the GPU's state or the contender's own? NVML's energy counter updates too coarsely for
blocks of ~0.1 s (single blocks read 0 W or 1100+ W); only the power means over many blocks say anything.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl


@triton.jit
def _read_clocks(dummy):
    c = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,l", [dummy], dtype=tl.int64, is_pure=False, pack=1)
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [dummy], dtype=tl.int64, is_pure=False, pack=1)
    return c, t


@triton.jit
def _spin_kernel(OUT, ns):
    dummy = tl.zeros([1], tl.int64)
    c0, t0 = _read_clocks(dummy)
    t = t0
    c = c0
    while tl.max(t - t0) < ns:
        c, t = _read_clocks(dummy)
    tl.store(OUT + tl.arange(0, 1), c - c0)
    tl.store(OUT + 1 + tl.arange(0, 1), t - t0)


def mean_mhz_during(fn, reps: int, ms_guess: float) -> tuple:
    """(ms per call of fn, mean SM MHz over a window inside the reps)."""
    out = torch.zeros(2, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream(priority=-1)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(100_000_000)  # the host queues everything while the GPU sleeps (~50 ms)
    s.record()
    for i in range(reps):
        fn()
        if i == 1:  # after two calls: the window covers the middle of the run
            ev = torch.cuda.Event()
            ev.record()
            side.wait_event(ev)
            with torch.cuda.stream(side):
                _spin_kernel[(1,)](out, int(ms_guess * (reps - 4) * 1e6), num_warps=1)
    e.record()
    torch.cuda.synchronize()
    cycles, ns = out.tolist()
    return s.elapsed_time(e) / reps, cycles / ns * 1e3


_NVML = None


def _nvml() -> tuple:
    """(libnvidia-ml, handle of device 0), through ctypes: no Python NVML package needed (the probe runs on cuda:0)."""
    global _NVML
    import ctypes

    if _NVML is None:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            raise RuntimeError("clock_probe: nvmlInit_v2 failed")
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) != 0:
            raise RuntimeError("clock_probe: nvmlDeviceGetHandleByIndex_v2(0) failed")
        _NVML = (lib, handle)
    return _NVML


def _nvml_energy_mj() -> int:
    """The GPU's total energy counter (NVML ``nvmlDeviceGetTotalEnergyConsumption``, mJ since the driver loaded)."""
    import ctypes

    lib, handle = _nvml()
    mj = ctypes.c_ulonglong()
    if lib.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(mj)) != 0:
        raise RuntimeError("clock_probe: nvmlDeviceGetTotalEnergyConsumption failed")
    return mj.value


def _nvml_state() -> tuple:
    """(SM clock MHz, temperature C) of device 0 now, from NVML."""
    import ctypes

    lib, handle = _nvml()
    mhz, temp = ctypes.c_uint(), ctypes.c_uint()
    if lib.nvmlDeviceGetClockInfo(handle, 1, ctypes.byref(mhz)) != 0:  # NVML_CLOCK_SM
        raise RuntimeError("clock_probe: nvmlDeviceGetClockInfo failed")
    if lib.nvmlDeviceGetTemperature(handle, 0, ctypes.byref(temp)) != 0:  # NVML_TEMPERATURE_GPU
        raise RuntimeError("clock_probe: nvmlDeviceGetTemperature failed")
    return mhz.value, temp.value


def timeline(D: int, T: int, seconds: float, block: int, quiet: bool = False) -> None:
    """Alternating blocks of ``block`` calls of xtrain's and cuDNN's backward for ``seconds`` (module docstring)."""
    import statistics
    import time

    fns, _ = backward_calls(D, T)
    names = list(fns)
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    rows = []  # (seconds since start, name, ms per call, W, MHz, C)
    t_start = time.perf_counter()
    i = 0
    while time.perf_counter() - t_start < seconds:
        name = names[i % 2]
        i += 1
        fn = fns[name]
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        e0, t0 = _nvml_energy_mj(), time.perf_counter()
        s.record()
        for _ in range(block):
            fn()
        e.record()
        e.synchronize()
        e1, t1 = _nvml_energy_mj(), time.perf_counter()
        mhz, temp = _nvml_state()
        rows.append((t0 - t_start, name, s.elapsed_time(e) / block, (e1 - e0) / 1e3 / (t1 - t0), mhz, temp))
    if len(rows) < 4:
        print(f"{D:>4} {T:>6} | --timeline {seconds} s ran {len(rows)} blocks: too few to compare, give it longer")
        return
    if not quiet:
        for t, name, ms, w, mhz, temp in rows:
            print(f"{D:>4} {T:>6} | t {t:7.2f} s {name:>7}: {ms:.3f} ms/call {w:4.0f} W {mhz:5d} MHz {temp:3d} C")
    for name in names:
        ms = sorted(r[2] for r in rows if r[1] == name)
        lo, hi = ms[0], ms[-1]
        edges = [lo + (hi - lo) * k / 8 for k in range(9)]
        counts = [sum(1 for m in ms if edges[k] <= m and (m < edges[k + 1] or (k == 7 and m <= hi))) for k in range(8)]
        print(
            f"{D:>4} {T:>6} | {name:>7}: {len(ms)} blocks, ms/call median {statistics.median(ms):.3f}, min {lo:.3f}, "
            f"max {hi:.3f}; histogram (8 bins from min to max) {counts}",
            flush=True,
        )
    # do the contenders' fast blocks coincide? each block against the median of its own contender, paired with the
    # other contender's next block
    med = {n: statistics.median(r[2] for r in rows if r[1] == n) for n in names}
    pairs = [(rows[j][2] / med[rows[j][1]], rows[j + 1][2] / med[rows[j + 1][1]]) for j in range(0, len(rows) - 1, 2)]
    fast_a = [p for p in pairs if p[0] < 0.97]
    fast_b = [p for p in pairs if p[1] < 0.97]
    both = [p for p in pairs if p[0] < 0.97 and p[1] < 0.97]
    print(
        f"{D:>4} {T:>6} | pairs of adjacent blocks: {len(pairs)}; {names[0]} fast (< 0.97 of its median) in "
        f"{len(fast_a)}, {names[1]} fast in {len(fast_b)}, both in {len(both)}",
        flush=True,
    )

    def corr(a, b):  # Pearson's r; nan where one side never changed
        try:
            return statistics.correlation(a, b)
        except statistics.StatisticsError:
            return float("nan")

    adj = [(rows[j][2], rows[j + 1][2]) for j in range(0, len(rows) - 1, 2)]  # (names[0]'s block, names[1]'s next)
    ratios = sorted(b / a for a, b in adj)
    n = len(ratios)
    print(
        f"{D:>4} {T:>6} | {names[1]} / {names[0]} ms per adjacent pair: median {ratios[n // 2]:.3f}, 10-90 % "
        f"{ratios[n // 10]:.3f}-{ratios[(9 * n) // 10]:.3f}; correlation of the pair's times "
        f"{corr([a for a, _ in adj], [b for _, b in adj]):.2f}",
        flush=True,
    )
    for name in names:
        sel = [r for r in rows if r[1] == name]
        ms_sel = [r[2] for r in sel]
        print(
            f"{D:>4} {T:>6} | {name:>7}: correlation of ms with the temperature "
            f"{corr(ms_sel, [r[5] for r in sel]):.2f}, with the clock {corr(ms_sel, [r[4] for r in sel]):.2f}",
            flush=True,
        )
        fast = [r for r in sel if r[2] < 0.97 * med[name]]
        slow = [r for r in sel if r[2] >= 0.97 * med[name]]
        for label, grp in (("fast", fast), ("rest", slow)):
            if grp:
                w = statistics.mean(r[3] for r in grp)
                print(
                    f"{D:>4} {T:>6} | {name:>7} {label}: {len(grp)} blocks, mean {w:.0f} W, "
                    f"{statistics.mean(r[4] for r in grp):.0f} MHz, {statistics.mean(r[5] for r in grp):.1f} C, "
                    f"first at {grp[0][0]:.1f} s",
                    flush=True,
                )


def energy_per_call(fn, seconds: float = 3.0) -> tuple:
    """(ms per call, mJ per call, mean W) of ``fn`` run back to back for about ``seconds``: the energy counter read
    around the whole run (synchronised at both ends, so the few ms of launching before the first kernel starts
    count too, at idle power: well under 1 % of a 3 s run at 600 W)."""
    import time

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    n = max(3, int(seconds / max(time.perf_counter() - t0, 1e-4)))
    e0, t0 = _nvml_energy_mj(), time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    e1, t1 = _nvml_energy_mj(), time.perf_counter()
    return (t1 - t0) * 1e3 / n, (e1 - e0) / n, (e1 - e0) / 1e3 / (t1 - t0)


def backward_calls(D: int, T: int, parts: bool = False) -> tuple:
    """The calls both probes time, on the bench shapes (causal bf16), and (B, H): ({"xtrain": the library's
    backward, "cudnn": cuDNN's}, (B, H)); ``parts`` puts first the Gluon split's two kernels, each alone, and the two
    back to back."""
    from bench import isolated
    from xtrain.kernels import flash_attention as FA

    q, k, v, do = isolated.bench_inputs(D, T)
    o, lse = FA.flash_attention_fwd_triton(q, k, v, causal=True)
    fns = {
        "xtrain": lambda: FA.flash_attention_bwd_triton(do, q, k, v, o, lse, True),
        "cudnn": isolated.cudnn_bwd(q, k, v, do, True),
    }
    if parts:
        from bench.gluon_bwd_alone import split_kernels

        dkdv, dq = split_kernels(q, k, v, do, o, lse, True)
        fns = {"dK/dV alone": dkdv, "dQ alone": dq, "pair": lambda: (dkdv(), dq()), **fns}
    return fns, tuple(q.shape[:2])


def energy_gemm(seconds: float) -> None:
    """The yardstick: a bf16 8192^3 matmul back to back, pJ per FLOP (tensor work and little else)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms, mj, w = energy_per_call(lambda: a @ b, seconds)
    flop = 2 * 8192**3
    print(
        f"bf16 matmul 8192^3: {ms:.3f} ms ({flop / ms / 1e9:.0f} TFLOP/s), {mj:.0f} mJ per call, {w:.0f} W, "
        f"{mj * 1e9 / flop:.2f} pJ per FLOP",
        flush=True,
    )


def energy(D: int, T: int, seconds: float) -> None:
    """Energy per backward call: xtrain's (and its two kernels alone) against cuDNN's, twice, alternating. pJ per
    FLOP: per FLOP a kernel executes (the Gluon split's kernels: 4 and 3 products of B·H·T²·D FLOPs each, causal),
    and for the whole backwards per nominal FLOP (2.5 x the forward's: 5 products), the same denominator for
    both, so that column compares their energies."""
    fns, (B, H) = backward_calls(D, T, parts=True)
    prod = B * H * T * T * D  # one causal product's FLOPs (2·B·H·T²·D halved)
    n_prods = {"dK/dV alone": 4, "dQ alone": 3, "xtrain": 5, "cudnn": 5}
    for _ in range(2):
        for name, n_prod in n_prods.items():
            ms, mj, w = energy_per_call(fns[name], seconds)
            print(
                f"{D:>4} {T:>6} | energy {name:>12}: {ms:.3f} ms, {mj:.0f} mJ per call, {w:.0f} W, "
                f"{mj * 1e9 / (n_prod * prod):.2f} pJ per FLOP",
                flush=True,
            )


def probe(D: int, T: int, reps: int, parts: bool = False) -> list:
    """Two alternations of (xtrain, cuDNN): [(xtrain ms, MHz, cuDNN ms, MHz)] x 2; ``parts``: the two Gluon
    kernels alone and then back to back first, [(dK/dV ms, MHz, dQ ms, MHz, pair ms, MHz, xtrain ms, MHz, cuDNN
    ms, MHz)] x 2."""
    fns, _ = backward_calls(D, T, parts)
    res = []
    for _ in range(2):
        row = ()
        for fn in fns.values():
            fn()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            row += mean_mhz_during(fn, reps, s.elapsed_time(e))
        res.append(row)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="8192,16384")
    ap.add_argument("--head-dims", default="128")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--parts", action="store_true", help="also the hd128 Gluon split's two kernels, each alone")
    ap.add_argument(
        "--energy",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="instead of the clock windows: energy per call from NVML's counter over SECONDS of "
        "back-to-back calls (xtrain's backward, its two kernels alone, cuDNN's)",
    )
    ap.add_argument(
        "--timeline",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="alternating blocks of xtrain's and cuDNN's backward for SECONDS: time, power, clock and "
        "temperature per block",
    )
    ap.add_argument("--block", type=int, default=20, help="calls per --timeline block")
    ap.add_argument("--quiet", action="store_true", help="--timeline: the summary only, not every block")
    ap.add_argument(
        "--config",
        default=None,
        help="the Gluon backward's config for this run (a name in "
        "flash_attention_gluon_bwd.CONFIGS or a tuple written with colons, 64:2:64:4:510; default: the "
        "library's)",
    )
    a = ap.parse_args()
    if a.block < 1:
        ap.error(f"--block must be at least 1, got {a.block}")
    from bench._gpu import warm_up

    if a.config is not None:
        from bench.gluon_bwd_alone import config_arg
        from xtrain.kernels import flash_attention_gluon_bwd as GB

        cfg = config_arg(a.config)
        GB._config("clock_probe", cfg, 128)  # a ValueError now for an unknown name or a bad tuple
        GB.DEFAULT = cfg  # read at each call when no config is given

    _spin_kernel[(1,)](torch.zeros(2, dtype=torch.int64, device="cuda"), 0, num_warps=1)  # compiled before timing
    warm_up()
    if a.timeline:
        for D in (int(d) for d in a.head_dims.split(",")):
            for T in (int(t) for t in a.seqs.split(",")):
                timeline(D, T, a.timeline, a.block, a.quiet)
        return 0
    if a.energy:
        energy_gemm(a.energy)
        for D in (int(d) for d in a.head_dims.split(",")):
            for T in (int(t) for t in a.seqs.split(",")):
                energy(D, T, a.energy)
        return 0
    print(f"{'D':>4} {'T':>6} | {'xtrain ms':>9} {'MHz':>5} | {'cuDNN ms':>8} {'MHz':>5} | ratio | at equal clocks")
    for D in (int(d) for d in a.head_dims.split(",")):
        for T in (int(t) for t in a.seqs.split(",")):
            for row in probe(D, T, a.reps, a.parts):
                *alone, xm, xf, cm, cf = row
                if alone:
                    print(
                        f"{D:>4} {T:>6} | dK/dV alone {alone[0]:.3f} ms {alone[1]:.0f} MHz, dQ alone {alone[2]:.3f} "
                        f"ms {alone[3]:.0f} MHz: sum {alone[0] + alone[2]:.3f} ms; the two back to back on one "
                        f"stream (no preprocess) {alone[4]:.3f} ms {alone[5]:.0f} MHz"
                    )
                print(
                    f"{D:>4} {T:>6} | {xm:9.3f} {xf:5.0f} | {cm:8.3f} {cf:5.0f} | {cm / xm:.3f} | "
                    f"{cm / xm * cf / xf:.3f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
