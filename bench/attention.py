"""``xtrain bench attention``: xtrain flash attention vs torch SDPA backends vs the composed path.

Causal bf16 attention at B·T = tokens (16k) and H·D = width (2048), head dims 64 and 128, T = 1k .. 16k.
For every size: forward and backward TFLOP/s of xtrain's Triton kernels, of every torch
``scaled_dot_product_attention`` backend that runs (flash, cuDNN, efficient, chosen with
``torch.nn.attention.sdpa_kernel``; their backward through torch.autograd), and of xtrain's composed
``ops.attention`` where its T×T tensors fit; the ratio of xtrain to the fastest SDPA backend; and the peak
memory of one forward + backward (beyond the inputs) for xtrain and for the composed path. Ratios print to three
decimals, starred below 1.0, and a goal line under the table names every cell where xtrain is under 1.0x
(``goal_summary``).

FLOPs (the convention of the FlashAttention papers and the Triton tutorial):
    forward  = 4 · B · H · T² · D      (two matmuls of 2·T²·D each), halved when causal
    backward = 2.5 · forward           (five matmuls instead of two)
Timing: ``bench._gpu.gpu_time`` (CUDA events, warm-up, median, L2 flushed before each call, the host kept
ahead of the GPU), so every contender's time is its GPU time, not its host launch overhead; that overhead
(one call's launch cost on the CPU, measured with the GPU busy) is printed in a table of its own, for xtrain
and cuDNN. (``triton.testing.do_bench`` lets the GPU wait for the host inside the timed interval: on the
H200 xtrain's forward at T = 1k took 0.26-0.37 ms of host time per call for 0.16-0.21 ms
of GPU time, so do_bench read it 15-40 % slow.) Random normal data.

``--rounds R`` times every contender R times per size in alternating order (xtrain first, then last, ...) and
takes medians; a second table gives the range of the per-round ratios. Under sustained load the H200 sits at its
700 W power cap, so a long backward's time follows its energy and the GPU's temperature; one round per size (the
default) compares contenders measured a few hundred milliseconds apart, which at hd128 T = 16k read anywhere
from 0.89 to 1.00 across processes (bench/RESULTS.md).

``--sweep`` first times a few kernel configs per head dim at one T and uses the fastest in the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from xtrain.fileio import atomic_write_text
from xtrain.kernels import attention as FA
from xtrain.kernels.attention import Tiles, TritonBwdConfig, TritonFwdConfig

F, TM = False, True  # pointer loads / tensor-descriptor (TMA) loads
FWD_SWEEP = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages, TMA)
    64: [
        (128, 64, 4, 3, F),
        (128, 64, 4, 3, TM),
        (128, 64, 4, 4, TM),
        (128, 128, 8, 3, TM),
        (128, 32, 4, 4, TM),
        (64, 64, 4, 3, TM),
        (256, 64, 8, 3, TM),
    ],
    128: [
        (128, 128, 8, 3, F),
        (128, 128, 8, 3, TM),
        (128, 64, 8, 3, TM),
        (128, 64, 8, 4, TM),
        (64, 64, 4, 3, TM),
        (256, 64, 8, 2, TM),
    ],
}
DKDV_SWEEP = {  # (BLOCK_M1, BLOCK_N1, num_warps, num_stages, TMA), timed with the default dQ kernel
    64: [
        (64, 64, 4, 3, F),
        (64, 64, 4, 3, TM),
        (32, 64, 4, 3, TM),
        (64, 128, 8, 3, TM),
        (32, 128, 4, 3, TM),
        (64, 128, 4, 3, TM),
        (128, 128, 8, 2, TM),
    ],
    128: [
        (64, 64, 4, 2, F),
        (64, 64, 4, 2, TM),
        (64, 64, 4, 3, TM),
        (32, 64, 4, 3, TM),
        (64, 128, 8, 2, TM),
        (32, 128, 8, 3, TM),
    ],
}
DQ_SWEEP = {  # (BLOCK_M2, BLOCK_N2, num_warps, num_stages, TMA), timed with the best dK/dV kernel
    64: [
        (64, 64, 4, 3, F),
        (64, 64, 4, 3, TM),
        (128, 64, 8, 3, TM),
        (128, 32, 4, 3, TM),
        (64, 32, 4, 3, TM),
        (128, 128, 8, 2, TM),
    ],
    128: [
        (64, 64, 4, 2, F),
        (64, 64, 4, 2, TM),
        (64, 64, 4, 3, TM),
        (128, 64, 8, 2, TM),
        (128, 32, 8, 3, TM),
        (64, 32, 4, 3, TM),
    ],
}


def attn_flops(B, H, T, D, causal=True) -> float:
    f = 4.0 * B * H * T * T * D
    return f / 2 if causal else f


def ratio_cell(fwd: float, bwd: float) -> str:
    """The table's ratio cell: xtrain / fastest backend, fwd/bwd, to three decimals, with a '*' on any below 1.0
    (the goal), so that a 0.998 does not print as 1.00."""
    return "/".join(f"{x:.3f}" + ("*" if x < 1.0 else "") for x in (fwd, bwd))


def goal_summary(rows: list) -> str:
    """One line on the goal (forward and backward each >= 1.0x the fastest SDPA backend, medians): how many of the
    rows' cells meet it, and each one that does not (D, T, direction, ratio)."""
    missed = [
        f"D={r['D']} T={r['T']} {name} {r['ratio'][i]:.3f}"
        for r in rows
        for i, name in enumerate(("fwd", "bwd"))
        if not r["ratio"][i] >= 1.0
    ]
    n = 2 * len(rows)
    head = f"goal (>= 1.0x the fastest SDPA backend, medians): met at {n - len(missed)} of {n} cells"
    return head + (f"; missed at {', '.join(missed)}" if missed else "")


def fwd(q, k, v, causal, cfg=None, **bufs):
    """The library's forward (the routing's choice) when ``cfg`` is None, else the Triton kernel with tiles
    ``cfg`` = (BLOCK_M, BLOCK_N, num_warps, num_stages, TMA); ``bufs``: o / lse output buffers (Triton)."""
    if cfg is None:
        return FA.flash_attention_fwd(q, k, v, causal)
    return FA.flash_attention_fwd_triton(q, k, v, causal, config=TritonFwdConfig(Tiles(*cfg)), **bufs)


def bwd(do, q, k, v, o, lse, causal, cfg=None, **bufs):
    """The library's backward when ``cfg`` is None, else the Triton kernels with (dK/dV tiles, dQ tiles)."""
    if cfg is None:
        return FA.flash_attention_bwd(do, q, k, v, o, lse, causal)
    config = TritonBwdConfig(Tiles(*cfg[0]), Tiles(*cfg[1]))
    return FA.flash_attention_bwd_triton(do, q, k, v, o, lse, causal, config=config, **bufs)


def default_dq_tiles(D: int) -> tuple:
    """The dQ kernel's tiles of the library's 16-bit Triton backward at head dim D (the sweep's fixed half)."""
    t = FA.choose(None, torch.bfloat16, 4096, D, True, False).bwd[-1].dq
    return (t.block_m, t.block_n, t.warps, t.stages, t.tma)


def _bench(fn, host: list | None = None, **kw) -> float:
    """GPU ms per call of ``fn`` (``bench._gpu.gpu_time``, ``kw`` passed on); appends the host's ms per call to
    ``host``."""
    from bench._gpu import gpu_time

    g = gpu_time(fn, **kw)
    if not g["queue_full"]:
        print(
            "# warning: the host did not stay ahead of the GPU; this time may include launch overhead",
            file=sys.stderr,
            flush=True,
        )
    if host is not None:
        host.append(g["host_ms"])
    return g["ms"]


def _inputs(B, H, T, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g, device="cuda", dtype=dtype) for _ in range(4)]  # q k v do


def time_xtrain(q, k, v, do, causal, fcfg=None, bcfg=None, host: list | None = None):
    """(fwd_ms, bwd_ms) GPU time; the host ms per call of each are appended to ``host``."""
    fwd_ms = _bench(lambda: fwd(q, k, v, causal, fcfg), host)
    o, lse = fwd(q, k, v, causal, fcfg)
    bwd_ms = _bench(lambda: bwd(do, q, k, v, o, lse, causal, bcfg), host)
    return fwd_ms, bwd_ms


def sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }


def time_sdpa(backend, q, k, v, do, causal, host: list | None = None):
    """(fwd_ms, bwd_ms) of one SDPA backend, or None if it refuses these inputs; host ms as time_xtrain."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    try:
        with sdpa_kernel(backend):
            fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            fwd()
            fwd_ms = _bench(fwd, host)
            out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
            bwd = lambda: torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True)
            bwd()
            bwd_ms = _bench(bwd, host)
        return fwd_ms, bwd_ms
    except RuntimeError as e:  # backend not available for these inputs
        print(f"  sdpa {backend}: {str(e).splitlines()[0][:100]}", file=sys.stderr)
        return None


def timed_rounds(q, k, v, do, causal, cfg, rounds: int, host: dict) -> dict:
    """{contender: [(fwd_ms, bwd_ms) per round]} for xtrain and every SDPA backend that runs these inputs.

    Each round times every contender once, in alternating order (even rounds xtrain first, odd rounds xtrain
    last), so that none is always measured on a GPU the others have just heated: under sustained load the H200
    sits at its power cap and a kernel's time follows the energy it spends (docs/performance.md).
    The host cost of a call is recorded in the first round only (``host``: {name: [ms, ...]})."""
    names = ["xtrain", *sdpa_backends()]
    times: dict = {n: [] for n in names}
    refused: set = set()
    for rd in range(rounds):
        for n in names if rd % 2 == 0 else names[::-1]:
            if n in refused:
                continue
            h = host.get(n) if rd == 0 else None
            t = (
                time_xtrain(q, k, v, do, causal, *cfg, host=h)
                if n == "xtrain"
                else time_sdpa(sdpa_backends()[n], q, k, v, do, causal, host=h)
            )
            if t is None:
                refused.add(n)
            else:
                times[n].append(t)
    return {n: ts for n, ts in times.items() if n not in refused}


def time_composed(q, k, v, do, causal):
    """xtrain's composed ops.attention on the tape: (fwd_ms, bwd_ms, peak_bytes); bwd = (fwd+bwd) − fwd."""
    from xtrain.autograd import Var, no_grad
    from xtrain.ops import attention

    def fwd():
        with no_grad():
            attention(Var(q), Var(k), Var(v), causal=causal)

    def fwd_bwd():
        vs = [Var(t, requires_grad=True) for t in (q, k, v)]
        attention(*vs, causal=causal).backward(do)

    few = dict(reps=3, warmup=1, host_calls=1)  # 0.1-2 s per call: a few calls are a stable median
    fwd_ms = _bench(fwd, **few)
    total_ms = _bench(fwd_bwd, **few)
    return fwd_ms, max(total_ms - fwd_ms, 0.0), peak_bytes(fwd_bwd)


def peak_bytes(fn) -> int:
    """Peak memory allocated during fn() above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def xtrain_peak(q, k, v, do, causal, fcfg=None, bcfg=None) -> int:
    def fn():
        o, lse = fwd(q, k, v, causal, fcfg)
        bwd(do, q, k, v, o, lse, causal, bcfg)

    return peak_bytes(fn)


def sweep(D, T, tokens, width, dtype, causal, log):
    """Time each candidate config at one size; return (best fwd config, best bwd config)."""
    B, H = tokens // T, width // D
    q, k, v, do = _inputs(B, H, T, D, dtype)
    fl = attn_flops(B, H, T, D, causal)
    best_f = (None, 0.0)
    for cfg in FWD_SWEEP[D]:
        try:
            ms = _bench(lambda cfg=cfg: fwd(q, k, v, causal, cfg))
        except Exception as e:  # a config that does not compile (shared memory) is skipped
            print(f"sweep D={D} T={T} fwd {cfg}: failed {type(e).__name__}: {str(e)[:120]}")
            continue
        tf = fl / ms * 1e-9
        print(f"sweep D={D} T={T} fwd {cfg}: {ms:.3f} ms {tf:.0f} TFLOP/s", flush=True)
        log.append({"kind": "sweep_fwd", "D": D, "T": T, "config": cfg, "ms": ms, "tflops": tf})
        if tf > best_f[1]:
            best_f = (cfg, tf)
    o, lse = fwd(q, k, v, causal, best_f[0])
    default_dq = default_dq_tiles(D)
    best_dkdv, best_dq = (None, 0.0), (None, 0.0)
    for part, cands in (("dkdv", DKDV_SWEEP[D]), ("dq", DQ_SWEEP[D])):
        for c in cands:
            cfg = (c, default_dq) if part == "dkdv" else (best_dkdv[0], c)
            try:
                ms = _bench(lambda cfg=cfg: bwd(do, q, k, v, o, lse, causal, cfg))
            except Exception as e:
                print(f"sweep D={D} T={T} bwd {part} {c}: failed {type(e).__name__}: {str(e)[:120]}")
                continue
            tf = 2.5 * fl / ms * 1e-9
            print(f"sweep D={D} T={T} bwd {part} {c}: {ms:.3f} ms {tf:.0f} TFLOP/s (whole bwd)", flush=True)
            log.append({"kind": f"sweep_bwd_{part}", "D": D, "T": T, "config": cfg, "ms": ms, "tflops": tf})
            if part == "dkdv" and tf > best_dkdv[1]:
                best_dkdv = (c, tf)
            if part == "dq" and tf > best_dq[1]:
                best_dq = (c, tf)
    best_b = ((best_dkdv[0], best_dq[0]), best_dq[1])
    return best_f[0], best_b[0]


def verify(D, fcfg, bcfg, causal, T=4096, B=1, H=4, Hkv=2):
    """Check chosen configs against the fp64 reference (NaN-poisoned outputs): max rel norm error."""
    q, k, v, do = _inputs(B, H, T, D, torch.bfloat16, seed=99)
    k, v = k[:, :Hkv].contiguous(), v[:, :Hkv].contiguous()
    nan = lambda t: torch.full_like(t, float("nan"))  # noqa: E731
    if fcfg is None:  # the library's routing allocates its outputs
        o, lse = fwd(q, k, v, causal)
    else:
        o, lse = fwd(q, k, v, causal, fcfg, o=nan(q), lse=torch.full((B, H, T), float("nan"), device="cuda"))
    bufs = {} if bcfg is None else {"dq": nan(q), "dk": nan(k), "dv": nan(v)}
    got = (o, *bwd(do, q, k, v, o, lse, causal, bcfg, **bufs))
    qd, kd, vd, dod = (t.double() for t in (q, k, v, do))
    o_ref, lse_ref = FA.flash_attention_fwd_ref(qd, kd, vd, causal)
    want = (o_ref, *FA.flash_attention_bwd_ref(dod, qd, kd, vd, o_ref, lse_ref, causal))
    return max(float((a.double() - b).norm() / b.norm()) for a, b in zip(got, want))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="xtrain bench attention", description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--tokens", type=int, default=16384, help="B·T")
    ap.add_argument("--width", type=int, default=2048, help="H·D")
    ap.add_argument("--non-causal", action="store_true")
    ap.add_argument("--no-composed", action="store_true", help="skip xtrain's composed path")
    ap.add_argument(
        "--composed-max-gib",
        type=float,
        default=40.0,
        help="skip the composed path when one [B, H, T, T] bf16 tensor exceeds this / 4",
    )
    ap.add_argument("--sweep", action="store_true", help="sweep kernel configs first and use the fastest")
    ap.add_argument("--sweep-T", type=int, default=4096)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time every contender this many times per size, in alternating order; the table takes "
        "the medians and a second table gives the range of the per-round ratios",
    )
    ap.add_argument("--json", default=None, help="write every measurement to this JSON file")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available():
        print("xtrain bench attention: needs a CUDA GPU", file=sys.stderr)
        return 1
    import triton

    dtype, causal = torch.bfloat16, not args.non_causal
    log: list[dict] = []
    from bench._gpu import warm_up

    warm_up()  # cold clocks read the first sizes slow (bench/_gpu.py)
    print(
        f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
        f"{'causal' if causal else 'non-causal'} bf16, B·T={args.tokens}, H·D={args.width}",
        flush=True,
    )
    cfgs = {}
    for D in args.head_dims:
        cfgs[D] = sweep(D, args.sweep_T, args.tokens, args.width, dtype, causal, log) if args.sweep else (None, None)
        print(f"# D={D}: fwd config {cfgs[D][0] or 'default'}, bwd config {cfgs[D][1] or 'default'}")
        for T in (1000, 2048, 4096):  # ragged and even, short-T and long-T config paths
            err = verify(D, *cfgs[D], causal, T=T)
            print(
                f"# D={D}: configs vs fp64 reference (T={T}, GQA 4/2, NaN-poisoned outputs): max rel error "
                f"{err:.2e} {'OK' if err < 1e-2 else 'FAILED'}",
                flush=True,
            )
    rows = []
    for D in args.head_dims:
        for T in args.seqs:
            B, H = args.tokens // T, args.width // D
            q, k, v, do = _inputs(B, H, T, D, dtype, seed=T + D)
            fl = attn_flops(B, H, T, D, causal)
            tf = lambda ms, mult=1.0, fl=fl: mult * fl / ms * 1e-9
            r = {"D": D, "T": T, "B": B, "H": H}
            r["host_us"] = {"xtrain": [], "cudnn": []}
            times = timed_rounds(q, k, v, do, causal, cfgs[D], args.rounds, r["host_us"])
            med = {
                n: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)) for n, ts in times.items()
            }
            fwd_ms, bwd_ms = med["xtrain"]
            r["xtrain"] = (tf(fwd_ms), tf(bwd_ms, 2.5))
            r["gpu_us"] = {"xtrain": (fwd_ms * 1e3, bwd_ms * 1e3)}
            r["xtrain_peak_mib"] = xtrain_peak(q, k, v, do, causal, *cfgs[D]) / 2**20
            for name in sdpa_backends():
                t = med.get(name)
                r[name] = None if t is None else (tf(t[0]), tf(t[1], 2.5))
                if t is not None and name == "cudnn":
                    r["gpu_us"]["cudnn"] = (t[0] * 1e3, t[1] * 1e3)
            # per round: xtrain's time against the fastest backend's in the same round (fwd, bwd)
            backends = [n for n in sdpa_backends() if n in times]
            r["rounds_ms"] = times
            r["ratio_rounds"] = (
                [
                    tuple(min(times[n][i][j] for n in backends) / times["xtrain"][i][j] for j in (0, 1))
                    for i in range(args.rounds)
                ]
                if backends
                else []
            )
            r["host_us"] = {n: [1e3 * h for h in hs] for n, hs in r["host_us"].items()}
            scores_gib = B * H * T * T * 2 / 2**30
            r["composed"], r["composed_peak_mib"] = None, None
            if not args.no_composed and 4 * scores_gib <= args.composed_max_gib:
                try:
                    cf, cb, cp = time_composed(q, k, v, do, causal)
                    r["composed"], r["composed_peak_mib"] = (tf(cf), tf(cb, 2.5)), cp / 2**20
                except torch.OutOfMemoryError:
                    r["composed"] = "oom"
                torch.cuda.empty_cache()
            best = [max((r[n][i] for n in sdpa_backends() if r[n]), default=float("nan")) for i in (0, 1)]
            r["ratio"] = (r["xtrain"][0] / best[0], r["xtrain"][1] / best[1])
            rows.append(r)
            log.append({"kind": "row", **{k2: v2 for k2, v2 in r.items()}})
            print(f"  D={D} T={T} done: xtrain fwd {r['xtrain'][0]:.0f} bwd {r['xtrain'][1]:.0f} TFLOP/s", flush=True)
            del q, k, v, do
            torch.cuda.empty_cache()

    def cell(x, i):
        return "-" if x is None else ("oom" if x == "oom" else f"{x[i]:.0f}")

    print("\nTFLOP/s fwd / bwd (causal bf16; ratio = xtrain / fastest SDPA backend); peak MiB of fwd+bwd")
    hdr = (
        f"{'D':>4} {'T':>6} | {'xtrain':>9} | {'flash':>9} | {'cudnn':>9} | {'efficient':>9} | "
        f"{'composed':>9} | {'ratio':>13} | {'peak xt':>8} {'peak comp':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        cells = [f"{cell(r[n], 0)}/{cell(r[n], 1)}" for n in ("xtrain", "flash", "cudnn", "efficient", "composed")]
        cp = "-" if r["composed_peak_mib"] is None else f"{r['composed_peak_mib']:.0f}"
        print(
            f"{r['D']:>4} {r['T']:>6} | "
            + " | ".join(f"{c:>9}" for c in cells)
            + f" | {ratio_cell(*r['ratio']):>13} | {r['xtrain_peak_mib']:>8.0f} {cp:>9}"
        )
    print(goal_summary(rows))
    if args.rounds > 1:
        print(
            f"\nxtrain / fastest SDPA backend per round ({args.rounds} rounds, alternating order): min-max, fwd | bwd"
        )

        def span(rr, j):
            return f"{min(x[j] for x in rr):.2f}-{max(x[j] for x in rr):.2f}" if rr else "-"

        for r in rows:
            print(f"{r['D']:>4} {r['T']:>6} | {span(r['ratio_rounds'], 0):>9} | {span(r['ratio_rounds'], 1):>9}")
    print("\nHost time per call (us, the CPU's launch cost, GPU kept busy) next to GPU time (us), fwd / bwd")
    print(f"{'D':>4} {'T':>6} | {'xtrain host':>13} | {'xtrain GPU':>13} | {'cudnn host':>13} | {'cudnn GPU':>13}")
    for r in rows:
        hx, hc = r["host_us"]["xtrain"], r["host_us"]["cudnn"]
        gx, gc = r["gpu_us"]["xtrain"], r["gpu_us"].get("cudnn")
        two = lambda p: "-" if not p or len(p) < 2 else f"{p[0]:.0f}/{p[1]:.0f}"  # noqa: E731
        print(f"{r['D']:>4} {r['T']:>6} | {two(hx):>13} | {two(gx):>13} | {two(hc):>13} | {two(gc):>13}")
    if args.json:
        atomic_write_text(
            args.json,
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "triton": triton.__version__,
                    "configs": {str(k): v for k, v in cfgs.items()},
                    "log": log,
                },
                indent=1,
                default=str,
            ),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
