"""``xtrain bench kernels``: every fused Triton kernel vs its plain-torch reference, against the copy ceiling.

For each kernel and size: the Triton time, the reference time (the same function's plain-torch path on
the GPU), the speed-up, and the achieved bandwidth = the bytes the op must move (each input read once,
each output written once; formulas in ``CASES`` below) / time, also as a fraction of the device-to-device
copy bandwidth measured first in the same run (bytes read + written by ``dst.copy_(src)`` on 1 GiB).
Then fused linear + cross-entropy: peak memory and time of one forward + backward against the unfused
path (logits matmul, Triton cross-entropy forward and backward, two gradient matmuls) and against the
plain-torch unfused path.
Timing: ``bench._gpu.gpu_time`` (CUDA events, warm-up, median, the L2 flushed before each call, the host
queueing every call while the GPU sleeps first), so a time is the kernels' GPU time and not the host's
launch overhead, which is printed beside it ("host us": one call's launch cost on the CPU, measured with the
GPU busy) together with ``triton.testing.do_bench``'s figure, which holds the host's time wherever the host
launches slower than the GPU runs. Random normal data, never zeros.

``--only a,b`` runs only those groups (e.g. cross_entropy,embedding,linear_ce).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch

from xtrain.fileio import atomic_write_text


def zipf_ids(N: int, V: int, device="cuda", generator=None) -> torch.Tensor:
    """The embedding bench's ids: N draws in [0, V) with Zipf-like repeats (u³·V, u uniform: id 0 about N / V^(1/3)
    times), int64."""
    return (torch.rand(N, device=device, generator=generator) ** 3 * V).long().clamp_max(V - 1)


def _bench(fn, rep: int = 100) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")  # ms


def _gpu(fn) -> dict:
    """``bench._gpu.gpu_time``: {"ms": GPU ms per call, "host_ms": the host's ms per call, "queue_full"}."""
    from bench._gpu import gpu_time

    g = gpu_time(fn)
    if not g["queue_full"]:
        print("# warning: the host did not stay ahead of the GPU; this time may include launch overhead", flush=True)
    return g


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting read + write."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = _gpu(lambda: dst.copy_(src))["ms"]
    return 2 * src.numel() * 4 / (ms * 1e-3)


def _rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return (scale * torch.randn(*shape, device="cuda")).to(dtype)


def _esize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32")


# Each case builder returns (label, bytes that must move, triton fn, reference fn).


def rms_cases():
    for N, C, dt in [
        (16384, 4096, torch.bfloat16),
        (65536, 768, torch.bfloat16),
        (8192, 8192, torch.bfloat16),
        (16384, 4096, torch.float32),
    ]:
        yield from _rms(N, C, dt)


def _rms(N, C, dt):
    from xtrain.kernels import rms_norm as K

    e = _esize(dt)
    x, dy, w = _rand(N, C, dtype=dt), _rand(N, C, dtype=dt), _rand(C, dtype=dt)
    _, r = K.rms_norm_fwd_triton(x, w, 1e-6)
    yield (
        f"rms_norm fwd {N}x{C} {_name(dt)}",
        2 * N * C * e + C * e + 4 * N,
        lambda: K.rms_norm_fwd_triton(x, w, 1e-6),
        lambda: K.rms_norm_fwd_ref(x, w, 1e-6),
    )
    yield (
        f"rms_norm bwd {N}x{C} {_name(dt)}",
        3 * N * C * e + C * e + 4 * N,
        lambda: K.rms_norm_bwd_triton(dy, x, w, r),
        lambda: K.rms_norm_bwd_ref(dy, x, w, r),
    )


def rope_cases():
    for shape, batched, dt in [
        ((4, 32, 4096, 128), False, torch.bfloat16),
        ((4, 32, 4096, 128), False, torch.float32),
        ((2, 16, 16384, 128), True, torch.bfloat16),
    ]:
        yield from _rope(shape, batched, dt)


def _rope(shape, batched, dt):
    from xtrain.kernels import rope as K

    x = _rand(*shape, dtype=dt)
    T = shape[-2]
    pos = torch.randint(0, 16384, (shape[0], T), device="cuda") if batched else torch.arange(T, device="cuda")
    nbytes = 2 * x.numel() * _esize(dt)
    lbl = f"{'x'.join(map(str, shape))} {'pos[B,T]' if batched else 'pos[T]'} {_name(dt)}"
    yield (f"rope fwd {lbl}", nbytes, lambda: K.rope_fwd_triton(x, pos, 1e6), lambda: K.rope_fwd_ref(x, pos, 1e6))
    yield (
        f"rope bwd {lbl}",
        nbytes,
        lambda: K.rope_bwd_triton(x, pos, 1e6),
        lambda: K.rope_bwd_ref(x, pos, 1e6),
    )


def qk_norm_rope_cases():
    # the seed preset's q and k (12 and 4 heads of 64, 8 x 1024 tokens) and a wide model's q (32 heads of 128)
    for B, T, G, D, dt in [(8, 1024, 12, 64, torch.bfloat16), (8, 1024, 4, 64, torch.bfloat16),
                           (4, 4096, 32, 128, torch.bfloat16), (8, 1024, 12, 64, torch.float32)]:  # fmt: skip
        yield from _qk_norm_rope(B, T, G, D, dt)


def _qk_norm_rope(B, T, G, D, dt):
    from xtrain.kernels import qk_norm_rope as K

    e, R = _esize(dt), B * T * G
    x, w = _rand(B * T, G * D, dtype=dt), _rand(D, dtype=dt)
    pos = torch.arange(T, device="cuda")
    table = K.rope_table(pos, D, 1e6, torch.float32)
    y, r = K.qk_norm_rope_fwd_triton(x, w, G, 1e-6, pos, table)
    dy = _rand(B, G, T, D, dtype=dt)  # contiguous, as the flash backward returns dq
    lbl = f"{B * T}x{G}x{D} {_name(dt)}"
    yield (
        f"qk_norm_rope fwd {lbl}",
        2 * R * D * e + 4 * R,
        lambda: K.qk_norm_rope_fwd_triton(x, w, G, 1e-6, pos, table),
        lambda: K.qk_norm_rope_fwd_ref(x, w, G, 1e-6, pos, 1e6, table),
    )
    yield (
        f"qk_norm_rope bwd {lbl}",
        3 * R * D * e + 4 * R,
        lambda: K.qk_norm_rope_bwd_triton(dy, x, w, G, r, pos, table),
        lambda: K.qk_norm_rope_bwd_ref(dy, x, w, G, r, pos, 1e6, table),
    )


def swiglu_cases():
    for shape, dt in [((8192, 14336), torch.bfloat16), ((4096, 14336), torch.float32)]:
        yield from _swiglu(shape, dt)


def _swiglu(shape, dt):
    from xtrain.kernels import swiglu as K

    n, e = shape[0] * shape[1], _esize(dt)
    g, u, dy = _rand(*shape, dtype=dt), _rand(*shape, dtype=dt), _rand(*shape, dtype=dt)
    lbl = f"{shape[0]}x{shape[1]} {_name(dt)}"
    yield (f"swiglu fwd {lbl}", 3 * n * e, lambda: K.swiglu_fwd_triton(g, u), lambda: K.swiglu_fwd_ref(g, u))
    yield (f"swiglu bwd {lbl}", 5 * n * e, lambda: K.swiglu_bwd_triton(dy, g, u), lambda: K.swiglu_bwd_ref(dy, g, u))


def dropout_cases():
    for shape, dt in [((8192, 14336), torch.bfloat16), ((4096, 14336), torch.float32)]:
        yield from _dropout(shape, dt)


def _dropout(shape, dt):
    from xtrain.kernels import dropout as K

    x = _rand(*shape, dtype=dt)
    seed = K.seed_tensor(1234, x.device)  # on the device, as the model passes it (an int would copy per call)
    yield (
        f"dropout fwd {shape[0]}x{shape[1]} {_name(dt)}",
        2 * x.numel() * _esize(dt),
        lambda: K.dropout_fwd_triton(x, 0.1, seed),
        lambda: K.dropout_fwd_ref(x, 0.1, seed),
    )


def ce_cases():
    for N, V, dt in [(8192, 32768, torch.bfloat16), (8192, 131072, torch.bfloat16), (4096, 131072, torch.float32)]:
        yield from _ce(N, V, dt)


def _ce(N, V, dt):
    from xtrain.kernels import cross_entropy as K

    e = _esize(dt)
    logits = _rand(N, V, dtype=dt, scale=3.0)
    t = torch.randint(0, V, (N,), device="cuda")
    _, lse, denom = K.cross_entropy_fwd_triton(logits, t)
    dl = torch.tensor(1.0, device="cuda")
    lbl = f"{N}x{V} {_name(dt)}"
    yield (
        f"cross_entropy fwd {lbl}",
        N * V * e + 16 * N,
        lambda: K.cross_entropy_fwd_triton(logits, t),
        lambda: K.cross_entropy_fwd_ref(logits, t),
    )
    yield (
        f"cross_entropy bwd {lbl}",
        2 * N * V * e + 12 * N,
        lambda: K.cross_entropy_bwd_triton(dl, logits, t, lse, -100, denom),
        lambda: K.cross_entropy_bwd_ref(dl, logits, t, lse, -100, denom),
    )


def adamw_cases():
    from xtrain.kernels import adamw as K

    # a 24-layer, width-1024 model: ~340M parameters in 217 tensors
    shapes = [(32000, 1024)] + 24 * ([(1024, 1024)] * 4 + [(2816, 1024)] * 3 + [(1024,)] * 2)
    n = sum(torch.Size(s).numel() for s in shapes)

    def state():
        ps = [_rand(*s, dtype=torch.float32) for s in shapes]
        gs = [_rand(*s, dtype=torch.float32) for s in shapes]
        ms = [_rand(*s, dtype=torch.float32, scale=0.1) for s in shapes]
        vs = [torch.rand(*s, device="cuda") * 0.01 for s in shapes]
        cs = [torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
        return ps, gs, ms, vs, cs

    st = state()
    kw = dict(step=10, lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decays=[0.1] * len(shapes))
    yield (
        f"adamw {n / 1e6:.0f}M params / {len(shapes)} tensors, +bf16 copies",
        30 * n,
        lambda: K.adamw_step_triton(*st[:4], copies=st[4], **kw),
        lambda: K.adamw_step_ref(*st[:4], copies=st[4], **kw),
    )


def embedding_cases():
    # each shipped form: bf16 "side", fp32 "tiers" (and at the bf16 row's shape, a table 8x the tokens' rows where
    # the zero rows dominate), fp32 "rows" above TIERS_MAX_N tokens
    for N, V, C, dt in [
        (16384, 131072, 4096, torch.bfloat16),
        (16384, 32000, 2048, torch.float32),
        (16384, 131072, 4096, torch.float32),
        (65536, 32000, 2048, torch.float32),
    ]:
        yield from _embedding(N, V, C, dt)


def _embedding(N, V, C, dt):
    from xtrain.kernels import embedding as K

    e = _esize(dt)
    ids = zipf_ids(N, V)
    d = _rand(N, C, dtype=dt)
    cfg = K.embedding_bwd_config(dt, N)  # the form the library ships for this dtype and token count
    yield (
        f"embedding bwd ({cfg.form}) N={N} V={V} C={C} {_name(dt)}",
        N * C * e + V * C * e + 8 * N,
        lambda: K.embedding_bwd_triton(d, ids, V, config=cfg),
        lambda: K.embedding_bwd_ref(d, ids, V),
    )
    plan = K.embedding_bwd_plan_triton(ids, V, C, dt, cfg)
    if plan is None:  # the backward's form here takes no plan (side, rows)
        return
    # what ops.embedding runs in training: the forward launches the backward's ids-only part (the slots pass and
    # lists) on a side stream beside its gather, and the backward starts at its rows grid. First the backward given a
    # plan made before; then forward + backward, the plan made in the forward, against both without a plan
    yield (
        f"embedding bwd ({cfg.form}) N={N} V={V} C={C} {_name(dt)}, plan made before",
        N * C * e + V * C * e + 8 * N,
        lambda: K.embedding_bwd_triton(d, ids, V, plan, cfg),
        lambda: K.embedding_bwd_ref(d, ids, V),
    )
    table = _rand(V, C, dtype=dt)

    def planned():
        out, p = K.embedding_fwd_planned(ids, table)
        return out, K.embedding_bwd_triton(d, ids, V, p)

    yield (
        f"embedding fwd + bwd N={N} V={V} C={C} {_name(dt)}, plan made in the fwd (ref: Triton, no plan)",
        3 * N * C * e + V * C * e + 16 * N,
        planned,
        lambda: (K.embedding_fwd(ids, table), K.embedding_bwd_triton(d, ids, V)),
    )


GROUPS = {
    "rms_norm": rms_cases,
    "rope": rope_cases,
    "qk_norm_rope": qk_norm_rope_cases,
    "swiglu": swiglu_cases,
    "dropout": dropout_cases,
    "cross_entropy": ce_cases,
    "adamw": adamw_cases,
    "embedding": embedding_cases,
}


def linear_ce_rows(sizes):
    """Peak memory (beyond inputs) and time of one forward + backward: fused vs unfused."""
    rows = []
    for N, C, V in sizes:
        rows.append(_linear_ce_row(N, C, V))
        torch.cuda.empty_cache()
    return rows


def _linear_ce_row(N, C, V):
    from xtrain.kernels import cross_entropy as K_ce
    from xtrain.kernels import linear_cross_entropy as K

    x = _rand(N, C)
    w = _rand(V, C, scale=C**-0.5)
    t = torch.randint(0, V, (N,), device="cuda")
    one = torch.tensor(1.0, device="cuda")

    def fused():
        loss, dx, dw = K.linear_cross_entropy_fwd_triton(x, w, t)
        return K.linear_cross_entropy_bwd(one, dx, dw)

    def unfused(ce_fwd=K_ce.cross_entropy_fwd_triton, ce_bwd=K_ce.cross_entropy_bwd_triton):
        logits = x @ w.t()  # [N, V] bf16
        loss, lse, denom = ce_fwd(logits, t)
        dlog = ce_bwd(one, logits, t, lse, -100, denom)  # as ops.cross_entropy: not in place
        return dlog @ w, dlog.t() @ x

    def unfused_ref():
        return unfused(K_ce.cross_entropy_fwd_ref, K_ce.cross_entropy_bwd_ref)

    res = {}
    for name, fn in (("fused", fused), ("unfused", unfused), ("unfused_ref", unfused_ref)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        ms = _bench(fn, rep=400)
        res[name] = (peak, ms)
    return dict(
        N=N,
        C=C,
        V=V,
        **{f"{k}_peak_gib": v[0] / 2**30 for k, v in res.items()},
        **{f"{k}_ms": v[1] for k, v in res.items()},
        time_ratio=res["fused"][1] / res["unfused"][1],
        mem_saved_gib=(res["unfused"][0] - res["fused"][0]) / 2**30,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="xtrain bench kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help=f"run these groups only ({', '.join(sorted(GROUPS))}, linear_ce)")
    ap.add_argument("--json", help="write every row to this JSON file")
    args = ap.parse_args(argv)
    only = [x for o in (args.only or []) for x in o.split(",") if x] or None
    if not torch.cuda.is_available():
        print("xtrain bench kernels: needs a CUDA GPU", file=sys.stderr)
        return 1
    import triton

    dev = torch.cuda.get_device_name()
    print(f"# {dev}, torch {torch.__version__}, triton {triton.__version__}")
    from bench._gpu import warm_up

    warm_up()  # cold clocks read the first rows slow (bench/_gpu.py)
    bw = copy_bandwidth()
    print(f"# copy bandwidth (read + write): {bw / 1e12:.2f} TB/s")
    rows = []
    for gname, builder in GROUPS.items():
        if only and gname not in only:
            continue
        try:
            for label, nbytes, f_tri, f_ref in builder():
                g = _gpu(f_tri)
                t_ms, db_ms = g["ms"], _bench(f_tri)
                r_ms = _gpu(f_ref)["ms"]
                rows.append(
                    dict(
                        kernel=label,
                        triton_ms=t_ms,
                        ref_ms=r_ms,
                        speedup=r_ms / t_ms,
                        tbps=nbytes / (t_ms * 1e-3) / 1e12,
                        of_copy=nbytes / (t_ms * 1e-3) / bw,
                        host_us=g["host_ms"] * 1e3,
                        do_bench_ms=db_ms,
                        do_bench_of_copy=nbytes / (db_ms * 1e-3) / bw,
                    )
                )
                r = rows[-1]
                print(
                    f"{label:58s} {t_ms:8.3f} ms  {r['tbps']:5.2f} TB/s  {r['of_copy']:5.0%}  "
                    f"host {r['host_us']:6.1f} us  do_bench {db_ms:8.3f} ms {r['do_bench_of_copy']:5.0%}  "
                    f"ref {r_ms:8.3f} ms  x{r['speedup']:.1f}",
                    flush=True,
                )
        except Exception:  # keep the table going; the traceback says what broke
            traceback.print_exc()
        torch.cuda.empty_cache()
    lce = []
    if not only or "linear_ce" in only:
        try:
            lce = linear_ce_rows([(8192, 4096, 32768), (8192, 4096, 131072)])
        except Exception:
            traceback.print_exc()
    if args.json:
        atomic_write_text(
            args.json,
            json.dumps(
                dict(
                    device=dev,
                    torch=torch.__version__,
                    triton=triton.__version__,
                    copy_tbps=bw / 1e12,
                    kernels=rows,
                    linear_cross_entropy=lce,
                ),
                indent=1,
            ),
        )
    print(
        f"\n## Fused kernels: {dev}, torch {torch.__version__}, triton {triton.__version__}, "
        f"copy {bw / 1e12:.2f} TB/s\n"
    )
    print("| kernel | Triton ms | TB/s | of copy | host us/call | do_bench ms (of copy) | reference ms | speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['kernel']} | {r['triton_ms']:.3f} | {r['tbps']:.2f} | {r['of_copy']:.0%} | {r['host_us']:.0f} "
            f"| {r['do_bench_ms']:.3f} ({r['do_bench_of_copy']:.0%}) | {r['ref_ms']:.3f} | {r['speedup']:.1f}x |"
        )
    if lce:
        print(
            "\n| linear+CE (bf16) N x C x V | fused peak GiB | unfused peak GiB | torch-ref peak GiB | fused ms "
            "| unfused ms | torch-ref ms | fused/unfused time |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in lce:
            print(
                f"| {r['N']}x{r['C']}x{r['V']} | {r['fused_peak_gib']:.2f} | {r['unfused_peak_gib']:.2f} | "
                f"{r['unfused_ref_peak_gib']:.2f} | {r['fused_ms']:.2f} | {r['unfused_ms']:.2f} | "
                f"{r['unfused_ref_ms']:.2f} | {r['time_ratio']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
