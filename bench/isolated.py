"""What the Gluon variant benches share (bench/gluon_flash_fwd.py, bench/gluon_flash_bwd.py,
bench/gluon_flash_bwd_onepass.py): GPU correctness checks of kernel variants in child processes, so that
one broken variant costs a timeout or a restart instead of the whole run; the check / time / table flow;
the backward's fp64 check (``bwd_worst_error``) and timing row (``bwd_bench_row``); the report of an
offline sm_90 compile.

A kernel that deadlocks (an mbarrier wait that is never satisfied) never returns, and a CUDA fault poisons
the process's context for every variant after it. So the parent starts ``script --check-only --variants
a,b,...``; the child checks the variants in order, printing ``@@START name`` and ``@@RESULT name VERDICT``
around each (``check_one``) and stopping at its first exception; the parent echoes the child's output,
kills it when a variant is silent for ``per_variant_s`` (reported HANG), and starts a new child for the
variants left.
"""

from __future__ import annotations

import argparse
import queue
import subprocess
import sys
import threading
import time


def check_one(name: str, check) -> str:
    """Run ``check() -> (ok, detail)`` for variant ``name`` in this process between the markers the parent
    parses. Returns "PASS", "FAIL" (wrong numbers) or "ERROR" (an exception, with its root cause)."""
    print(f"@@START {name}")
    sys.stdout.flush()
    t0 = time.time()
    try:
        ok, detail = check()
        verdict = "PASS" if ok else "FAIL"
        print(f"[{name}] {verdict}: {detail} ({time.time() - t0:.1f}s incl. compile)")
    except Exception as e:  # noqa: BLE001 - any failure is this variant's result
        verdict = "ERROR"
        print(f"[{name}] ERROR {type(e).__name__}: {str(e)[:800]}")
        root = e
        while root.__cause__ is not None:
            root = root.__cause__
        if root is not e:
            print(f"[{name}]   caused by {type(root).__name__}: {str(root)[:800]}")
    print(f"@@RESULT {name} {verdict}")
    sys.stdout.flush()
    return verdict


def run_checks(script: str, variants, extra_args=(), startup_s: float = 180.0, per_variant_s: float = 120.0):
    """Check ``variants`` through child processes of ``script`` (see the module docstring). Returns the
    passing variants, in the given order."""
    passing, todo = [], list(variants)
    while todo:
        cmd = [sys.executable, script, "--check-only", "--variants", ",".join(todo), *extra_args]
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        lines: queue.Queue = queue.Queue()

        def pump(stream=child.stdout, sink=lines):
            for ln in stream:
                sink.put(ln)
            sink.put(None)

        threading.Thread(target=pump, daemon=True).start()
        current, progressed, deadline = None, False, time.time() + startup_s
        while True:
            try:
                ln = lines.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                child.kill()  # the child this function started, by its handle
                child.wait()
                victim = current or todo[0]
                print(f"[{victim}] HANG: no result within {per_variant_s if current else startup_s:.0f}s, child killed")
                todo.remove(victim)
                break
            if ln is None:
                child.wait()
                if current is not None:
                    print(f"[{current}] ERROR: the check process died (exit code {child.returncode})")
                    todo.remove(current)
                elif not progressed and todo:
                    print(f"check process exited with code {child.returncode} before checking {todo}")
                    todo = []
                break
            if ln.startswith("@@START "):
                current = ln.split()[1]
                deadline = time.time() + per_variant_s
            elif ln.startswith("@@RESULT "):
                _, name, verdict = ln.split()
                if verdict == "PASS":
                    passing.append(name)
                todo.remove(name)
                current, progressed, deadline = None, True, time.time() + per_variant_s
            else:
                print(ln, end="")
            sys.stdout.flush()
    return [v for v in variants if v in passing]


def add_variant_args(ap, *, seqs: str, head_dims: str, variants, variants_help: str, replay_help: str) -> None:
    """The arguments every variant bench takes: --seqs, --head-dims, --variants (comma lists), --compile-only,
    --replay, --no-isolate, and the hidden --check-only of the child processes (``run_checks``)."""
    ap.add_argument("--seqs", default=seqs)
    ap.add_argument("--head-dims", default=head_dims)
    ap.add_argument("--variants", default=variants, help=variants_help)
    ap.add_argument("--compile-only", action="store_true", help="compile every variant for sm_90 (no GPU)")
    ap.add_argument("--replay", action="store_true", help=replay_help)
    ap.add_argument("--no-isolate", action="store_true", help="run the correctness checks in this process")
    ap.add_argument("--check-only", action="store_true", help=argparse.SUPPRESS)


def variant_lists(ap, args, known):
    """(seqs, head_dims, variants) from the comma lists of ``add_variant_args``; an unknown variant is a usage
    error naming the ``known`` ones."""
    seqs = [int(x) for x in args.seqs.split(",") if x]
    head_dims = [int(x) for x in args.head_dims.split(",") if x]
    variants = [x for x in args.variants.split(",") if x]
    for name in variants:
        if name not in known:
            ap.error(f"unknown variant {name!r}; have {','.join(known)}")
    return seqs, head_dims, variants


def check_then_time(
    variants, head_dims, seqs, *, check_only: bool, no_isolate: bool, check_fn, checks_fn, bench_row, title: str
) -> int:
    """The main flow of a variant bench. As the child (check_only): check each variant, stop at the first
    exception. Else: check (in child processes unless no_isolate), time the passing variants with
    ``bench_row(D, T, passing) -> {"D", "T", "cudnn", "triton", variant: TFLOP/s}`` and print the table
    of TFLOP/s and ratios to cuDNN under ``title``."""
    t_start = time.time()
    if check_only:
        for name in variants:
            if check_fn(name, head_dims) == "ERROR":
                return 3
        return 0
    if no_isolate:
        passing = [name for name in variants if check_fn(name, head_dims) == "PASS"]
    else:
        passing = checks_fn(variants, head_dims)
    print(f"passing variants: {passing}  ({time.time() - t_start:.0f}s)")
    sys.stdout.flush()
    rows = []
    for D in head_dims:
        for T in seqs:
            row = bench_row(D, T, passing)
            rows.append(row)
            print("  " + "  ".join(f"{c}={x:.0f}" if isinstance(x, float) else f"{c}={x}" for c, x in row.items()))
            sys.stdout.flush()
    cols = ["cudnn", "triton"] + passing
    print(f"\n{title}")
    print(f"{'D':>4} {'T':>6} " + " ".join(f"{c:>15}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            if c not in r:
                cells.append(f"{'-':>15}")
            elif c == "cudnn" or "cudnn" not in r:
                cells.append(f"{r[c]:>15.0f}")
            else:
                cells.append(f"{r[c]:>7.0f} ({r[c] / r['cudnn']:.2f}x)")
        print(f"{r['D']:>4} {r['T']:>6} " + " ".join(cells))
    print(f"\ntotal {time.time() - t_start:.0f}s")
    return 0


def res_usage(cubin: bytes) -> str:
    """Registers and local-memory (spill) bytes per thread from ``cuobjdump -res-usage`` (ships with triton),
    best effort. Warp-specialised kernels: the count is the launch budget; setmaxnreg moves it per partition."""
    import os
    import re
    import tempfile

    try:
        import triton.backends.nvidia as nv

        tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            txt = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, timeout=60).stdout
        m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", txt)
        return f"{m.group(1)} regs, {m.group(2)} B local" if m else "res-usage n/a"
    except Exception as e:  # noqa: BLE001
        return f"res-usage n/a ({type(e).__name__})"


def ptx_summary(ck, keys) -> str:
    """Shared memory, registers/spills and how often each PTX instruction in ``keys`` occurs in a compiled
    kernel, with the setmaxnreg values of a warp-specialised one."""
    import re

    ptx = ck.asm.get("ptx", "")
    counts = ", ".join(f"{key} x{ptx.count(key)}" for key in keys if ptx.count(key))
    regs = sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)))
    return (
        f"smem {getattr(ck.metadata, 'shared', '?')} B; {res_usage(ck.asm.get('cubin', b''))}; "
        f"setmaxnreg {regs}; PTX: {counts}"
    )


def rel_norm(x, ref) -> float:
    """||x - ref|| / ||ref|| in fp64; inf when x has a non-finite element (an unwritten, NaN-poisoned one)."""
    x, ref = x.double(), ref.double()
    if not x.isfinite().all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def bwd_worst_error(name: str, head_dims, run) -> float:
    """Worst relative-norm error of a flash-attention backward variant's dq, dk, dv against the fp64
    reference: B=1, H=4, Hkv=2, T = 1024 and 2048, causal, bf16 inputs, outputs NaN-poisoned.
    ``run(do, q, k, v, o, lse, dq, dk, dv)`` writes the gradients into the given buffers."""
    import torch

    from xtrain.kernels.attention import flash_attention_bwd_ref, flash_attention_fwd_ref

    worst = 0.0
    for D in head_dims:
        for T in (1024, 2048):
            B, H, Hkv = 1, 4, 2
            g = torch.Generator(device="cuda").manual_seed(T + D)
            q, k, v, do = (
                torch.randn(B, h, T, D, generator=g, device="cuda", dtype=torch.bfloat16) for h in (H, Hkv, Hkv, H)
            )
            o64, lse64 = flash_attention_fwd_ref(q.double(), k.double(), v.double(), True)
            o, lse = o64.to(torch.bfloat16), lse64.float()
            dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
            run(do, q, k, v, o, lse, dq, dk, dv)
            torch.cuda.synchronize()
            ref = flash_attention_bwd_ref(
                do.double(), q.double(), k.double(), v.double(), o.double(), lse.double(), True
            )
            errs = [rel_norm(x, r) for x, r in zip((dq, dk, dv), ref)]
            print(f"    {name} D={D} T={T} causal: rel-norm err dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e}")
            worst = max(worst, *errs)
    return worst


def bench_inputs(D: int, T: int, dtype=None, seed: int = 0, tokens: int = 16384, width: int = 2048):
    """q, k, v, do of the attention bench shapes on the GPU: B = tokens / T, H = Hkv = width / D, random normal
    (bf16 unless ``dtype``), from a generator seeded with ``seed``."""
    import torch

    B, H = tokens // T, width // D
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(B, H, T, D, generator=g, device="cuda", dtype=dtype or torch.bfloat16) for _ in range(4))


def cudnn_bwd(q, k, v, do, causal: bool = True):
    """cuDNN's attention backward alone, as a call: ``torch.autograd.grad`` on an SDPA graph saved once (the
    caller drops the call to free the graph). Raises where cuDNN refuses the inputs."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
    return lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)


def bwd_bench_row(D: int, T: int, runs, warmup: int, rep: int) -> dict:
    """Backward TFLOP/s of cuDNN (``torch.autograd.grad`` on a saved SDPA graph: the backward alone), the
    library default (``attention.flash_attention_bwd``) and each ``(column, run)`` of ``runs``, with
    ``run(do, q, k, v, o, lse, dq, dk, dv)``; causal bf16, B = 16k / T, H = Hkv = 2048 / D, GPU time
    (``bench._gpu.gpu_time``: median, host kept ahead; ``warmup`` calls first, ``rep`` timed calls).
    FLOPs = 2.5 x forward FLOPs (4·B·H·T²·D/2). A column that raises is
    reported and left out."""
    import torch

    from bench._gpu import gpu_time
    from xtrain.kernels.attention import flash_attention_bwd, flash_attention_fwd

    B, H = 16384 // T, 2048 // D
    q, k, v, do = bench_inputs(D, T, seed=T * 7 + D)
    flops = 2.5 * 4.0 * B * H * T * T * D / 2
    row = {"D": D, "T": T}

    def timed(col, fn):
        try:
            row[col] = flops / gpu_time(fn, reps=rep, warmup=warmup)["ms"] * 1e-9
        except Exception as e:  # noqa: BLE001
            print(f"  {col} D={D} T={T}: {type(e).__name__}: {str(e)[:300]}")

    try:
        timed("cudnn", cudnn_bwd(q, k, v, do))  # the saved graph is freed with the call, before the other timings
    except Exception as e:  # noqa: BLE001
        print(f"  cudnn D={D} T={T}: {type(e).__name__}: {str(e)[:300]}")
    o, lse = flash_attention_fwd(q, k, v, True)
    timed("triton", lambda: flash_attention_bwd(do, q, k, v, o, lse, True))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for col, run in runs:
        timed(col, lambda run=run: run(do, q, k, v, o, lse, dq, dk, dv))
    return row
