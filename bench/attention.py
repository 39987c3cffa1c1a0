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

``--docs [MEAN ...]``: packed documents (default mean lengths 256 512 1024 2048; ``bench/_docs.py`` draws
geometric lengths per row, a row opening mid-document), causal bf16 at T = 4k, 8k, 16k, head dims 64 and 128.
Contenders, fwd and bwd each: xtrain's ``flash_attention_fwd/bwd`` with ``doc_starts``; FlexAttention under
``torch.compile`` with the same mask (``create_block_mask``, causal and same document; its build timed apart on
the wall clock, since training builds one per batch; its backward through torch.autograd); full causal SDPA
without the document mask (the fastest backend per direction), the anchor that a mask has to beat by skipping
work. Ratios are speeds (the other's ms / xtrain's); goal lines: xtrain fwd+bwd >= 1.2x FlexAttention at every
cell, and faster than full causal SDPA where the mean document is at most T/4. xtrain's outputs (o, dq, dk, dv)
are checked against FlexAttention's at every cell, from the timed calls. Without CUDA (or ``--device cpu``) it
runs fp32 at T = 256 .. 1024 with FlexAttention eager (unfused; torch has no FlexAttention backward on the CPU,
so its bwd cells print '-'; ``--flex compiled`` compiles it, about 20 s per shape on two cores).
"""

from __future__ import annotations

import argparse
import inspect
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
            attention(Var(q), Var(k), Var(v), causal)

    def fwd_bwd():
        vs = [Var(t, requires_grad=True) for t in (q, k, v)]
        attention(*vs, causal).backward(do)

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


# -- packed documents (--docs) --------------------------------------------------------------------------------

DOC_MEANS = {"cuda": [256, 512, 1024, 2048], "cpu": [64, 256]}
DOC_DEFAULTS = {  # per device: seqs, head dims, tokens (B·T), width (H·D), timed calls per measurement
    "cuda": dict(seqs=[4096, 8192, 16384], head_dims=[64, 128], tokens=16384, width=2048, reps=30),
    "cpu": dict(seqs=[256, 512, 1024], head_dims=[64], tokens=2048, width=256, reps=5),
}
FLEX_BLOCK = 128  # create_block_mask's BLOCK_SIZE (its default)


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def wall_ms(fn, dev, reps: int, warmup: int = 1) -> float:
    """Median wall-clock ms of ``fn()`` (the device synchronised around each call)."""
    import time

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def time_ms(fn, dev, reps: int) -> float:
    """ms per call: GPU time (``bench._gpu.gpu_time`` through ``_bench``) on CUDA, the wall clock on the CPU."""
    if dev.type == "cuda":
        return _bench(fn, reps=reps)
    return wall_ms(fn, dev, reps)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def kept_fraction(ds: torch.Tensor) -> float:
    """The fraction of the causal mask's (query, key) pairs that the document mask keeps."""
    T = ds.shape[-1]
    t = torch.arange(T, device=ds.device)
    return float((t - ds + 1).sum()) / (ds.shape[0] * T * (T + 1) / 2)


def doc_mask_mod(ds: torch.Tensor):
    """FlexAttention mask_mod: causal, and the key in the query's document (doc_starts[b, q] <= kv)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (ds[b, q_idx] <= kv_idx)

    return mask_mod


class Flex:
    """FlexAttention with a document mask: ``mode`` "compiled" (``torch.compile(flex_attention, dynamic=False)``,
    block masks built with ``create_block_mask(..., _compile=True)`` where that option exists) or "eager" (the
    unfused implementation, which materialises the scores: a correctness check and plumbing, not a speed)."""

    def __init__(self, mode: str, dev):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self.mode, self.dev, self._create = mode, dev, create_block_mask
        self.fn = flex_attention
        self.mask_kw = {"device": dev, "BLOCK_SIZE": FLEX_BLOCK}
        if mode == "compiled":
            import torch._dynamo

            cfg = torch._dynamo.config
            for name in ("recompile_limit", "cache_size_limit"):  # one compile per (T, D) and per grad mode
                if hasattr(cfg, name):
                    setattr(cfg, name, max(64, getattr(cfg, name)))
                    break
            if hasattr(cfg, "fail_on_recompile_limit_hit"):  # never time the unfused eager fallback as "compiled"
                cfg.fail_on_recompile_limit_hit = True
            self.fn = torch.compile(flex_attention, dynamic=False)
            if "_compile" in inspect.signature(create_block_mask).parameters:
                import warnings

                self.mask_kw["_compile"] = True
                warnings.filterwarnings("ignore", message="_compile flag on create_block_mask")  # newer torch
        else:
            import warnings

            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")

    @property
    def label(self) -> str:
        if self.mode == "compiled":
            return "flex (compiled" + (", mask compiled)" if self.mask_kw.get("_compile") else ")")
        return "flex (eager, unfused)"

    def block_mask(self, ds: torch.Tensor):
        B, T = ds.shape
        try:
            return self._create(doc_mask_mod(ds), B, None, T, T, **self.mask_kw)
        except Exception:
            if not self.mask_kw.pop("_compile", False):
                raise
            print("  flex: create_block_mask(_compile=True) failed; building masks uncompiled", flush=True)
            return self._create(doc_mask_mod(ds), B, None, T, T, **self.mask_kw)

    def __call__(self, q, k, v, bm):
        return self.fn(q, k, v, block_mask=bm)


def _inputs_on(B, H, T, D, dtype, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g, device=dev, dtype=dtype) for _ in range(4)]  # q k v do


class Failures:
    """Prints a contender's failure in one line, once per (contender, part, message)."""

    def __init__(self):
        self.seen: set = set()

    def __call__(self, who: str, e: Exception) -> None:
        msg = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
        if (who, msg) not in self.seen:
            self.seen.add((who, msg))
            print(f"  {who} failed ({msg}); its cells print '-'", flush=True)


def time_xtrain_docs(q, k, v, do, ds, dev, reps):
    """(fwd_ms, bwd_ms, (o, dq, dk, dv)) of xtrain's flash attention with the document mask."""
    f = lambda: FA.flash_attention_fwd(q, k, v, True, doc_starts=ds)  # noqa: E731
    fwd_ms = time_ms(f, dev, reps)
    o, lse = f()
    b = lambda: FA.flash_attention_bwd(do, q, k, v, o, lse, True, doc_starts=ds)  # noqa: E731
    bwd_ms = time_ms(b, dev, reps)
    return fwd_ms, bwd_ms, (o, *b())


def time_flex_docs(flex, q, k, v, do, ds, dev, reps, fail):
    """{"mask": ms, "fwd": ms, "bwd": ms} (a part that failed is missing) and the outputs [o, dq, dk, dv] that
    ran. The block mask's build is timed on the wall clock (host work, device synchronised): a training step
    builds it for every batch. The backward runs through torch.autograd; compiled flex refuses a graph kept for a
    second backward (donated buffers), so forward + backward is timed as one call and bwd = that - fwd."""
    ms, outs = {}, []
    try:
        flex.block_mask(ds)  # warm-up (compiles once per shape)
        ms["mask"] = wall_ms(lambda: flex.block_mask(ds), dev, max(3, reps // 3), warmup=0)
        bm = flex.block_mask(ds)
        f = lambda: flex(q, k, v, bm)  # noqa: E731
        ms["fwd"] = time_ms(f, dev, reps)
        outs.append(f())
    except Exception as e:
        fail(flex.label + " forward", e)
        return ms, outs
    try:
        qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        fb = lambda: torch.autograd.grad(flex(qr, kr, vr, bm), (qr, kr, vr), do)  # noqa: E731
        ms["bwd"] = time_ms(fb, dev, reps) - ms["fwd"]
        outs += list(fb())
    except Exception as e:
        fail(flex.label + " backward", e)
    return ms, outs


def time_sdpa_docs(q, k, v, do, dev, reps, fail):
    """Full causal SDPA (no document mask): {"fwd", "bwd", "backend"} of the fastest backend per direction
    (CUDA: every backend of ``sdpa_backends`` that runs, as the plain table; CPU: torch's default)."""
    if dev.type == "cuda":
        got = {n: time_sdpa(b, q, k, v, do, True) for n, b in sdpa_backends().items()}
        got = {n: t for n, t in got.items() if t is not None}
        if not got:
            fail("sdpa", RuntimeError("no backend runs these inputs"))
            return {}
        fwd_n, bwd_n = (min(got, key=lambda n, i=i: got[n][i]) for i in (0, 1))
        return {"fwd": got[fwd_n][0], "bwd": got[bwd_n][1], "backend": f"{fwd_n}/{bwd_n}", "all": got}
    import torch.nn.functional as F

    try:
        ms = {"fwd": time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), dev, reps)}
        qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
        b = lambda: torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True)  # noqa: E731
        ms["bwd"] = time_ms(b, dev, reps)
        ms["backend"] = "default"
        return ms
    except Exception as e:
        fail("sdpa", e)
        return {}


def _total(ms: dict) -> float | None:
    return ms["fwd"] + ms["bwd"] if "fwd" in ms and "bwd" in ms else None


def speed_ratios(xt: dict, other: dict) -> dict:
    """other's ms / xtrain's ms (above 1: xtrain faster) for fwd, bwd and fwd+bwd, where both were timed."""
    out = {p: other[p] / xt[p] for p in ("fwd", "bwd") if p in other and p in xt}
    if _total(xt) is not None and _total(other) is not None:
        out["total"] = _total(other) / _total(xt)
    return out


def docs_goals(rows: list) -> list[str]:
    """The two goal lines: xtrain fwd+bwd >= 1.2x FlexAttention at every cell; faster than full causal SDPA
    where mean doc <= T/4. Cells without both totals are counted apart."""

    def line(head, cells, ratio_of, bar):
        got = [(r, ratio_of(r)) for r in cells]
        meas = [(r, x) for r, x in got if x is not None]
        missed = [f"T={r['T']} D={r['D']} doc={r['mean']} {x:.2f}" for r, x in meas if not x >= bar]
        s = f"goal: {head}: met at {len(meas) - len(missed)} of {len(meas)} cells"
        s += f"; missed at {', '.join(missed)}" if missed else ""
        return s + (f" ({len(got) - len(meas)} cells without both fwd+bwd times)" if len(meas) < len(got) else "")

    return [
        line(
            "xtrain fwd+bwd >= 1.2x FlexAttention at every cell (block mask build not counted)",
            rows,
            lambda r: r["vs_flex"].get("total"),
            1.2,
        ),
        line(
            "xtrain fwd+bwd faster than full causal SDPA where mean doc <= T/4",
            [r for r in rows if r["mean"] <= r["T"] / 4],
            lambda r: r["vs_sdpa"].get("total"),
            1.0,
        ),
    ]


def _ms_cell(ms: dict) -> str:
    f = lambda p: f"{ms[p]:.2f}" if p in ms else "-"  # noqa: E731
    return f"{f('fwd')}/{f('bwd')}"


def _ratio_cell(r: dict) -> str:
    f = lambda p: f"{r[p]:.2f}" if p in r else "-"  # noqa: E731
    return f"{f('fwd')}/{f('bwd')}/{f('total')}"


def docs_table(rows: list, flex_label: str, sdpa_note: str) -> list[str]:
    hdr = (
        f"{'T':>6} {'D':>4} {'doc':>5} {'kept':>5} | {'xtrain':>13} | {'flex':>13} {'mask':>6} | {'sdpa':>13} | "
        f"{'vs flex':>14} | {'vs sdpa':>14} | {'err':>7}"
    )
    out = [
        f"\nms fwd/bwd; flex = {flex_label}, mask = its block mask build (wall clock, its own column); "
        f"sdpa = full causal, no document mask ({sdpa_note}); vs X = X's ms / xtrain's ms, fwd/bwd/fwd+bwd "
        "(above 1: xtrain faster); doc = mean document length; kept = share of the causal mask the documents keep; "
        "err = xtrain vs flex outputs (o, dq, dk, dv), max relative norm error",
        hdr,
        "-" * len(hdr),
    ]
    for r in rows:
        mask = f"{r['flex']['mask']:.2f}" if "mask" in r["flex"] else "-"
        err = "-" if r["err"] is None else f"{r['err']:.1e}"
        out.append(
            f"{r['T']:>6} {r['D']:>4} {r['mean']:>5} {r['kept']:>5.2f} | {_ms_cell(r['xtrain']):>13} | "
            f"{_ms_cell(r['flex']):>13} {mask:>6} | {_ms_cell(r['sdpa']):>13} | {_ratio_cell(r['vs_flex']):>14} | "
            f"{_ratio_cell(r['vs_sdpa']):>14} | {err:>7}"
        )
    return out


def docs_main(args, means: list) -> int:
    """``--docs``: xtrain's doc-masked flash attention vs FlexAttention with the same mask vs full causal SDPA."""
    from bench._docs import random_doc_starts

    if args.device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("xtrain bench attention --docs: --device cuda needs a CUDA GPU", file=sys.stderr)
        return 1
    d = DOC_DEFAULTS[dev.type]
    seqs, dims = args.seqs or d["seqs"], args.head_dims or d["head_dims"]
    tokens, width = args.tokens or d["tokens"], args.width or d["width"]
    reps = args.reps or d["reps"]
    means = means or DOC_MEANS[dev.type]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    flex_mode = args.flex if args.flex != "auto" else ("compiled" if dev.type == "cuda" else "eager")
    fail = Failures()
    try:
        flex = Flex(flex_mode, dev)
    except Exception as e:  # no FlexAttention in this torch
        fail("flex", e)
        flex = None
    if dev.type == "cuda":
        from bench._gpu import warm_up

        warm_up()
        name = torch.cuda.get_device_name()
    else:
        name = f"CPU ({torch.get_num_threads()} threads)"
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "-"
    print(
        f"# {name} | torch {torch.__version__} | triton {tv} | document-masked causal {str(dtype)[6:]}, "
        f"B·T={tokens}, H·D={width}, mean document lengths {means}",
        flush=True,
    )
    rows: list[dict] = []
    cell = 0
    for D in dims:
        for T in seqs:
            B, H = max(1, tokens // T), max(1, width // D)
            q, k, v, do = _inputs_on(B, H, T, D, dtype, dev, seed=T + D)
            sdpa = time_sdpa_docs(q, k, v, do, dev, reps, fail)
            flex_ok = flex is not None  # a forward that fails at these shapes is not retried at the next mean
            for mean in means:
                ds = random_doc_starts(B, T, mean, seed=T + mean, device=dev)
                r = {"T": T, "D": D, "B": B, "H": H, "mean": mean, "kept": kept_fraction(ds), "sdpa": sdpa}
                fb = getattr(FA, "doc_mask_fallbacks", lambda: {})()
                order = ["xtrain", "flex"] if cell % 2 == 0 else ["flex", "xtrain"]  # neither always first
                outs = {}
                for who in order:
                    if who == "xtrain":
                        try:
                            fwd_ms, bwd_ms, outs["xtrain"] = time_xtrain_docs(q, k, v, do, ds, dev, reps)
                            r["xtrain"] = {"fwd": fwd_ms, "bwd": bwd_ms}
                        except Exception as e:
                            fail("xtrain", e)
                            r["xtrain"] = {}
                    elif not flex_ok:
                        r["flex"] = {}
                    else:
                        r["flex"], outs["flex"] = time_flex_docs(flex, q, k, v, do, ds, dev, reps, fail)
                        flex_ok = "fwd" in r["flex"]
                fb2 = getattr(FA, "doc_mask_fallbacks", lambda: {})()
                r["xtrain_path"] = (  # doc_mask_fallbacks: Triton run where the unmasked call takes a Gluon kernel
                    "reference (CPU)" if dev.type != "cuda" else "triton (gluon route)" if fb2 != fb else "triton"
                )
                pairs = list(zip(outs.get("xtrain", ()), outs.get("flex", ())))
                r["err"] = max((rel_err(a, b) for a, b in pairs), default=None)
                r["err_parts"] = len(pairs)
                r["vs_flex"] = speed_ratios(r["xtrain"], r["flex"])
                r["vs_sdpa"] = speed_ratios(r["xtrain"], {p: sdpa[p] for p in ("fwd", "bwd") if p in sdpa})
                rows.append(r)
                cell += 1
                print(
                    f"  T={T} D={D} doc={mean} done: xtrain {_ms_cell(r['xtrain'])} ms ({r['xtrain_path']}), "
                    f"vs flex {_ratio_cell(r['vs_flex'])}, vs sdpa {_ratio_cell(r['vs_sdpa'])}",
                    flush=True,
                )
                del ds, outs
            del q, k, v, do
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    sdpa_note = "fastest backend per direction" if dev.type == "cuda" else "torch's CPU default"
    flex_label = "-" if flex is None else flex.label
    lines = docs_table(rows, flex_label, sdpa_note)
    goals = docs_goals(rows)
    print("\n".join(lines + goals))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
    bad = [f"T={r['T']} D={r['D']} doc={r['mean']} {r['err']:.1e}" for r in rows if r["err"] and r["err"] > tol]
    checked = sum(r["err"] is not None for r in rows)
    print(
        f"check: xtrain vs flex at {checked} of {len(rows)} cells, relative error <= {tol:g}: "
        + (f"FAILED at {', '.join(bad)}" if bad else "OK")
    )
    if args.json:
        atomic_write_text(
            args.json,
            json.dumps(
                {
                    "mode": "docs",
                    "device": name,
                    "torch": torch.__version__,
                    "triton": tv,
                    "dtype": str(dtype),
                    "flex": flex_label,
                    "sdpa": sdpa_note,
                    "tokens": tokens,
                    "width": width,
                    "reps": reps,
                    "means": means,
                    "rows": rows,
                    "goals": goals,
                    "check_ok": not bad,
                },
                indent=1,
                default=str,
            ),
        )
    return 0 if not bad else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="xtrain bench attention", description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=None, help="default 64 128 (--docs on a CPU: 64)")
    ap.add_argument(
        "--seqs",
        type=int,
        nargs="+",
        default=None,
        help="default 1024 .. 16384 (--docs: 4096 8192 16384; CPU 256 .. 1024)",
    )
    ap.add_argument("--tokens", type=int, default=None, help="B·T (default 16384; --docs on a CPU: 2048)")
    ap.add_argument("--width", type=int, default=None, help="H·D (default 2048; --docs on a CPU: 256)")
    ap.add_argument(
        "--docs",
        type=int,
        nargs="*",
        default=None,
        metavar="MEAN",
        help="packed documents of these mean lengths (default 256 512 1024 2048; CPU 64 256): xtrain's "
        "document-masked attention vs FlexAttention with the same mask vs full causal SDPA",
    )
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="--docs: where to run")
    ap.add_argument(
        "--flex",
        default="auto",
        choices=["auto", "compiled", "eager"],
        help="--docs: FlexAttention under torch.compile or eager (auto: compiled on CUDA, eager on the CPU)",
    )
    ap.add_argument("--reps", type=int, default=None, help="--docs: timed calls per measurement (CUDA 30, CPU 5)")
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
    if args.docs is not None:
        if any(m < 1 for m in args.docs):
            ap.error(f"--docs: mean document lengths must be >= 1, got {args.docs}")
        return docs_main(args, args.docs)
    args.head_dims = args.head_dims or [64, 128]
    args.seqs = args.seqs or [1024, 2048, 4096, 8192, 16384]
    args.tokens = args.tokens or 16384
    args.width = args.width or 2048
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
