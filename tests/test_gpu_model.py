"""Model-level checks on a CUDA GPU (marked ``gpu``, skipped without one): the fused paths must compute the model
the composed reference paths compute.

* flash attention vs composed attention: logits, loss and every parameter gradient;
* Triton kernels vs the plain-torch references (``XTRAIN_KERNELS`` backend switch), fused linear+CE on;
* the Gluon attention kernels (T = 1024, sm_90) vs composed attention, with the launch plans as the evidence of
  which backward ran;
* a bf16 training step runs on CUDA and reduces the loss;
* the trainer's step as a CUDA graph, with dropout, trains exactly as the same step without a graph.

Tolerances. fp32: the two paths compared directly, normwise relative error ||a - b|| / ||b|| <= 1e-4 for the
logits, the loss and each gradient. Each path's own error is a few hundred fp32 roundings (2^-24 = 6e-8) at most
(online vs two-pass softmax, fp32 dots without TF32 in different orders, through two layers and the backward;
the CPU's references of the same paths differ by 1e-6), so 1e-4 is far above the paths' difference and 100 times
below a 1% error: no oracle is needed.

bf16: the paths differ by bf16's own noise (a gradient's normwise error against fp64 is ~1e-2 here), so any
direct bound that passes them passes a 1% error too (the flat 3e-2 did). Instead each bf16 path P is measured
against an fp64 oracle O, the same model (same seed, same ids) computed in float64 with the composed paths (fp64
always runs the plain-torch references), and its error is bounded by that of the composed bf16 path C, the
yardstick: C carries bf16's own rounding and nothing else, as the bf16 reference of ``tests/test_model.py``'s
bf16 parity does. ``oracle_check``, per tensor x (the logits, the loss, each gradient), o its oracle, n its size:
  * rel(x) = ||x - o|| / ||o||:                       rel(P) <= 1.5 rel(C) + 2^-10;
  * bias(x) = <x - o, o> / <o, o> (the error's component along o, ``_bias`` of tests/test_model.py):
                                                      |bias(P) - bias(C)| <= max(2^-9, 4 rel(C) / sqrt(n));
  * the yardstick itself:                             rel(C) <= 5e-2 (tests/test_model.py's bound of bf16 against
    fp64, a dozen roundings of 2^-9), so a broken composed path cannot widen the bounds.
Why these. The paths round at different points (flash keeps scores and probabilities in fp32 registers, the
composed path materialises them in bf16; kernels sum in other orders) but as often and at the same precision, so
their errors against fp64 are of one size: on the CPU, at these shapes, the flash (tiled reference) and math paths
measure rel(P) / rel(C) in 0.8 .. 1.16 over 6 batches (the loss aside); 1.5 leaves room for the GPU kernels'
orders. The floor 2^-10 (a quarter of bf16's eps 2^-8, half of one rounding's 2^-9) matters only where rel(C) is
small by chance (the loss, a mean of fp32 log-softmaxes: rel(C) ~ 1e-5); it is a tenth of 1%. Round-to-nearest
errors are unbiased and nearly cancel along o: |bias(P) - bias(C)| is about rel(C) / sqrt(n) for independent
errors (measured within 2.4 of it for the 64 .. 256-element norm weights; the large matrices' errors are
correlated, up to 9 times it, but below 5e-4), so the bound is 4 of those or 2^-9 (a systematic error below one
rounding), whichever is larger.
What fails. A factor 1.01 (or 0.99) on any one tensor moves its bias by 1e-2: 5 times the 2^-9 floor and 1.3
times the widest bias bound (the 64-element q/k norm weights: 4 * 1.5e-2 / 8 = 7.5e-3). 1% of noise in a random
direction: in the logits rel(P) becomes sqrt(rel(C)^2 + 1e-4) = 1.15e-2 > 1.5 * 5.6e-3 + 2^-10 = 9.4e-3, it fails;
the loss is a scalar (noise is a factor). A gradient's rel(C) is itself ~1e-2: noise fails there only from about
1.2 rel(C) (1.2 .. 1.8% of the gradient), an error along the gradient from 2^-9 (its bias bound).
``test_oracle_check_catches_a_planted_1pct_error`` plants each of these in real bf16 model outputs on the CPU.
Each bf16 check prints its table (the logits, the loss, then the gradients that use most of their bounds: rel(P),
rel(C), their ratio, bias(P) - bias(C), both bounds and the fraction used); ``-s`` or ``-rA`` (dev/gpu_tol.sh)
records them, to tune 1.5 and 4 from the GPU's numbers.
"""

import math
from dataclasses import dataclass

import pytest
import torch

from xtrain.autograd import no_grad
from xtrain.config import preset
from xtrain.kernels import backend
from xtrain.model import Model

REL_MULTIPLE = 1.5  # rel(P) <= REL_MULTIPLE * rel(C) + REL_FLOOR
REL_FLOOR = 2.0**-10
BIAS_FLOOR = 2.0**-9  # |bias(P) - bias(C)| <= max(BIAS_FLOOR, BIAS_SIGMAS * rel(C) / sqrt(n))
BIAS_SIGMAS = 4.0
YARDSTICK_MAX = 5e-2  # rel(C) <= YARDSTICK_MAX


@dataclass(frozen=True)
class Row:
    """One tensor's errors against the fp64 oracle: ``rel`` / ``bias`` of the path checked, ``rel_c`` / ``bias_c``
    of the composed bf16 path (the yardstick); n elements."""

    name: str
    n: int
    rel: float
    rel_c: float
    bias: float
    bias_c: float

    @property
    def rel_bound(self) -> float:
        return REL_MULTIPLE * self.rel_c + REL_FLOOR

    @property
    def bias_bound(self) -> float:
        return max(BIAS_FLOOR, BIAS_SIGMAS * self.rel_c / math.sqrt(self.n))

    @property
    def used(self) -> float:
        """The largest fraction of a bound this tensor uses (> 1 fails; nan fails)."""
        return max(self.rel / self.rel_bound, abs(self.bias - self.bias_c) / self.bias_bound)

    @property
    def ok(self) -> bool:
        return self.used <= 1.0 and self.rel_c <= YARDSTICK_MAX  # False for nan


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-300))


def _bias(a, b) -> float:
    """<a - b, b> / <b, b>: the component of the error a - b along b, relative to b."""
    a, b = a.double().flatten(), b.double().flatten()
    return float((a - b) @ b / (b @ b).clamp_min(1e-300))


def oracle_check(path: dict, base: dict, oracle: dict) -> list[Row]:
    """Per tensor of ``oracle`` (name -> fp64 tensor), the errors of ``path`` and of ``base`` (the composed bf16
    path) against it; a row's ``ok`` is the bound of the module docstring."""
    assert set(path) == set(base) == set(oracle), (set(path) ^ set(oracle), set(base) ^ set(oracle))
    return [_row(k, path[k], base[k], o) for k, o in oracle.items()]


def _row(name: str, p: torch.Tensor, c: torch.Tensor, o: torch.Tensor) -> Row:
    assert p.shape == c.shape == o.shape, (name, p.shape, c.shape, o.shape)
    return Row(name, o.numel(), _rel(p, o), _rel(c, o), _bias(p, o), _bias(c, o))


def oracle_table(title: str, rows: list[Row], worst: int = 6) -> str:
    """The logits and loss rows, then the ``worst`` other rows by the fraction of their bound used, and the largest
    ratio rel(P) / rel(C) over all rows."""
    head = (
        f"{title}: rel(P) <= {REL_MULTIPLE} rel(C) + 2^-10, |bias(P) - bias(C)| <= max(2^-9, {BIAS_SIGMAS} "
        f"rel(C) / sqrt(n))\n{'tensor':>44} {'n':>7} {'rel(P)':>9} {'rel(C)':>9} {'ratio':>6} {'rel bnd':>9} "
        f"{'bias(P)':>10} {'bias(C)':>10} {'|dbias|':>9} {'bias bnd':>9} {'used':>6}"
    )
    top = [r for r in rows if r.name in ("logits", "loss")]
    rest = sorted((r for r in rows if r.name not in ("logits", "loss")), key=lambda r: -r.used)
    lines = [head]
    for r in top + rest[:worst]:
        lines.append(
            f"{r.name[-44:]:>44} {r.n:>7} {r.rel:9.2e} {r.rel_c:9.2e} {r.rel / max(r.rel_c, 1e-300):6.2f} "
            f"{r.rel_bound:9.2e} {r.bias:+10.2e} {r.bias_c:+10.2e} {abs(r.bias - r.bias_c):9.2e} "
            f"{r.bias_bound:9.2e} {r.used:6.2f}{'' if r.ok else '  FAIL'}"
        )
    big = max(rows, key=lambda r: r.rel / max(r.rel_c, 1e-300))
    lines.append(
        f"{'':>44} largest ratio {big.rel / max(big.rel_c, 1e-300):.2f} ({big.name}); largest rel(C) "
        f"{max(r.rel_c for r in rows):.2e}; {sum(not r.ok for r in rows)} of {len(rows)} tensors fail"
    )
    return "\n".join(lines)


def assert_within_oracle(title: str, path: dict, base: dict, oracle: dict) -> None:
    """``oracle_check`` printed (the GPU run records it) and asserted."""
    rows = oracle_check(path, base, oracle)
    table = oracle_table(title, rows)
    print("\n" + table)
    assert all(r.ok for r in rows), "\n" + table


def assert_direct(title: str, path: dict, base: dict, tol: float) -> None:
    """fp32: every tensor's normwise relative error against ``base`` <= tol; the worst few printed."""
    assert set(path) == set(base), set(path) ^ set(base)
    errs = sorted(((_rel(path[k], base[k]), k) for k in base), reverse=True)
    table = f"{title}: rel(P, C) <= {tol:g}, worst: " + ", ".join(f"{k} {e:.2e}" for e, k in errs[:6])
    print("\n" + table)
    assert errs[0][0] <= tol, table


def _cfg(dtype, attention, loss="composed", **kw):
    base = dict(
        vocab_size=512,
        n_layer=2,
        n_embd=256,
        n_head=4,
        n_kv_head=2,
        head_dim=64,
        ffn_dim=512,
        max_seq_len=512,
        compute_dtype=dtype,
        attention=attention,
        loss=loss,
    )
    base.update(kw)
    return preset("tiny", **base)


def _run(cfg, ids, seed=0) -> dict:
    """{"logits", "loss", each parameter's name: its gradient} of the model on ids [B, T + 1] (its device)."""
    m = Model(cfg, device=ids.device, seed=seed)
    with no_grad():
        logits = m.forward(ids[:, :-1]).data
    loss = m.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return {"logits": logits, "loss": loss.data.reshape(1), **{k: p.grad.clone() for k, p in m.params.items()}}


def test_oracle_check_catches_a_planted_1pct_error():
    """The bf16 bound on the CPU, with real model outputs: the flash path (the tiled reference on the CPU) and the
    composed path in bf16, the oracle in fp64, as the GPU tests run them. Unchanged, the flash path passes. An
    error planted in one tensor fails, for every tensor in turn: a factor 1.01 or 0.99 (the bias bound), 1% of
    noise in a random direction in the logits (the rel bound), and 3% of noise in a random direction in any one
    gradient (the rel bound: a gradient's own bf16 error is ~1e-2, so 1% of noise is within it; module docstring)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 512, (2, 129), generator=g)
    oracle = _run(_cfg("float64", "composed"), ids)
    base = _run(_cfg("bfloat16", "composed"), ids)
    path = _run(_cfg("bfloat16", "flash"), ids)
    assert path["logits"].dtype == torch.bfloat16 and oracle["logits"].dtype == torch.float64
    rows = oracle_check(path, base, oracle)
    print("\n" + oracle_table("flash (CPU reference) bf16", rows))
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]
    for name, x in path.items():
        o, x = oracle[name], x.double()
        noise = torch.randn(x.shape, generator=g, dtype=torch.float64)
        noise *= torch.linalg.vector_norm(o) / torch.linalg.vector_norm(noise)  # ||noise|| = ||o||
        planted = [x * 1.01, x * 0.99] + ([x + 0.01 * noise] if name == "logits" else [])
        planted += [x + 0.03 * noise] if name not in ("logits", "loss") else []
        for i, bad in enumerate(planted):
            assert not _row(name, bad, base[name], o).ok, (name, i, _row(name, bad, base[name], o))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flash_equals_composed_in_the_model(dtype):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (3, 301), generator=g).cuda()  # T = 300: ragged last tiles
    flash = _run(_cfg(dtype, "flash"), ids)
    composed = _run(_cfg(dtype, "composed"), ids)
    if dtype == "float32":
        assert_direct("flash fp32 vs composed fp32", flash, composed, 1e-4)
    else:
        oracle = _run(_cfg("float64", "composed"), ids)
        assert_within_oracle("flash bf16 vs fp64 (C: composed bf16)", flash, composed, oracle)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_kernels_equal_references_in_the_model(dtype):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (4, 129), generator=g).cuda()
    with backend("triton"):
        triton = _run(_cfg(dtype, "flash", "fused"), ids)
    with backend("reference"):
        ref = _run(_cfg(dtype, "composed", "composed"), ids)
    if dtype == "float32":
        assert_direct("Triton fp32 vs references fp32", triton, ref, 1e-4)
    else:
        oracle = _run(_cfg("float64", "composed"), ids)
        assert_within_oracle(
            "Triton (flash, fused CE) bf16 vs fp64 (C: references, composed bf16)", triton, ref, oracle
        )


@pytest.mark.gpu
def test_bf16_training_on_cuda_reduces_loss():
    from xtrain.config import TrainConfig
    from xtrain.train.trainer import Trainer

    g = torch.Generator().manual_seed(2)
    batch = torch.randint(0, 512, (8, 65), generator=g)
    cfg = _cfg("bfloat16", "auto", "auto")
    tc = TrainConfig(steps=30, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=3, min_lr=3e-4)
    m = Model(cfg, device="cuda")
    tr = Trainer(m, tc, lambda: batch.cuda())
    hist = tr.fit()
    assert all(p.data.dtype == torch.float32 for p in m.params.values())
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"]


@pytest.mark.gpu
def test_bf16_compute_copies_on_cuda_are_exact_casts():
    """On CUDA the Triton AdamW writes the bf16 compute copies in its update pass: training with them is bit
    for bit training with a cast of every weight in every forward."""
    from xtrain.config import TrainConfig
    from xtrain.train.trainer import Trainer

    g = torch.Generator().manual_seed(3)
    batch = torch.randint(0, 512, (8, 65), generator=g)
    out = []
    for use in (True, False):
        m = Model(_cfg("bfloat16", "auto", "auto"), device="cuda")
        tr = Trainer(m, TrainConfig(steps=4, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=1), lambda: batch.cuda())
        if not use:
            m.weight_copy = None
        hist = tr.fit()
        if use:
            assert any(c is not None for c in tr.optimizer.copies)
            for p, c in zip(tr.optimizer.params, tr.optimizer.copies):
                if c is not None:
                    assert torch.equal(c, p.data.to(torch.bfloat16))
        out.append(([h["loss"] for h in hist], {k: p.data.clone() for k, p in m.params.items()}))
    assert out[0][0] == out[1][0]
    for k in out[0][1]:
        assert torch.equal(out[0][1][k], out[1][1][k]), k


@pytest.mark.gpu
def test_cuda_graph_step_is_the_eager_step_bit_for_bit():
    """The trainer's step replayed as a CUDA graph and the same step run eagerly (device scalars, the clip folded
    into the update kernel): the same losses, norms and weights bit for bit over 5 steps, with the clip active and
    two micro-batches."""
    from xtrain.config import TrainConfig
    from xtrain.train.trainer import Trainer

    g = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, 512, (8, 65), generator=g) for _ in range(5)]
    tc = TrainConfig(steps=5, batch_size=8, seq_len=64, grad_accum=2, lr=3e-3, warmup_steps=2, grad_clip=0.05)
    runs = []
    for graph in (True, False):
        it = iter(batches)
        m = Model(_cfg("bfloat16", "auto", "auto"), device="cuda")
        tr = Trainer(m, tc, lambda it=it: next(it).cuda(), cuda_graph=graph)
        assert (tr.graphed is not None and tr.graphed.enabled) == graph
        hist = tr.fit()
        if graph:
            assert tr.graphed.captures == 1
        runs.append(([(h["loss"], h["grad_norm"]) for h in hist], {k: p.data.clone() for k, p in m.params.items()}))
    assert all(norm > 0.05 for _, norm in runs[0][0])  # the clip acted on every step
    assert runs[0][0] == runs[1][0]
    for k in runs[0][1]:
        assert torch.equal(runs[0][1][k], runs[1][1][k]), k


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gluon_attention_paths_equal_composed_in_the_model(head_dim):
    """At T = 1024 in bf16 on an H100/H200 the model's flash attention runs the Gluon kernels: the forward
    (q2 / pp) and the backward (hd64: the one-pass kernel, whose dq is summed by reduce-adds; hd128: the
    two-kernel split). The evidence is the dispatcher's own: only a Gluon path keeps a launch plan
    (attention._FWD_PLANS / _BWD_PLANS, emptied before each test by tests/conftest.py). The forward runs 4 times
    (2 layers, for the logits and for the loss): the first takes the full path and keeps a plan, the 3 others run
    it. The backward runs twice: the first layer to run backward takes the full path and keeps a plan, the second
    has the same inputs' signature and runs it. ``bwd_route``, asked about the kept plan's signature (the inputs
    the model passed), names the one-pass kernel for hd64 and the two-kernel Gluon backward for hd128. The model
    matches the composed path within the bf16 oracle bound (module docstring)."""
    from xtrain.kernels import attention as FA

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 only")
    if not FA.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    assert FA.ONEPASS_MIN_T <= 1024 and FA.GLUON_BWD_MIN_T[128] <= 1024
    cfg = dict(head_dim=head_dim, max_seq_len=1024)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 512, (2, 1025), generator=g).cuda()
    fwd, bwd = FA._FWD_PLANS, FA._BWD_PLANS
    before = (fwd.hits, fwd.misses, bwd.hits, bwd.misses)
    flash = _run(_cfg("bfloat16", "flash", **cfg), ids)
    bwd_counts = (bwd.hits - before[2], bwd.misses - before[3])  # (plan ran, full path where a plan could run)
    assert bwd_counts == (1, 1) and len(bwd) == 1, ("backward (hits, misses), plans", bwd_counts, list(bwd))
    fwd_counts = (fwd.hits - before[0], fwd.misses - before[1])
    assert fwd_counts == (3, 1) and len(fwd) == 1, ("forward (hits, misses), plans", fwd_counts, list(fwd))
    # the plan key is plan_signature: (kind, backend, scale, causal, deterministic) + (shape, stride, dtype, device)
    # of do, q, k, v, o, lse in that order: tensors of that layout take the route the model's backward took
    (key,) = bwd
    ts = [torch.empty_strided(shape, stride, dtype=dt, device=dev) for shape, stride, dt, dev in key[-6:]]
    assert FA.plan_signature("bwd", ts, key[2], key[3]) == key
    route, _ = FA.bwd_route(*ts, causal=key[3])
    assert route == ("onepass" if head_dim == 64 else "gluon"), route
    composed = _run(_cfg("bfloat16", "composed", **cfg), ids)
    oracle = _run(_cfg("float64", "composed", **cfg), ids)
    assert_within_oracle(f"Gluon attention hd{head_dim} bf16 vs fp64 (C: composed bf16)", flash, composed, oracle)


@pytest.mark.gpu
@pytest.mark.parametrize("recompute,accum", [(False, 1), (True, 2)])
def test_cuda_graph_with_dropout_trains_as_the_step_without_a_graph(recompute, accum):
    """Dropout 0.1, bf16 compute: the trainer's step captured as a CUDA graph (one eager warm-up step, then
    replays) against the same step run eagerly (``cuda_graph=False``), same weights and batches,
    5 steps. Bit for bit: the graph replays the very kernels the eager step launches, on the same values; the
    dropout seeds reach each replay through the model's seed buffer (frozen host seeds would change the
    losses from the third step on)."""
    import dataclasses

    from xtrain.config import TrainConfig
    from xtrain.train.trainer import Trainer

    g = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, 512, (8, 65), generator=g) for _ in range(5)]
    cfg = dataclasses.replace(_cfg("bfloat16", "auto", "auto"), dropout=0.1, recompute=recompute)
    tc = TrainConfig(steps=5, batch_size=8, seq_len=64, grad_accum=accum, lr=3e-3, warmup_steps=1)
    out = []
    for graph in (True, False):
        it = iter(batches)
        m = Model(cfg, device="cuda")
        tr = Trainer(m, tc, lambda it=it: next(it), cuda_graph=graph)
        msgs = []
        if graph:
            tr.graphed.warmup, tr.graphed.say = 1, msgs.append
        hist = tr.fit()
        if graph:
            assert tr.graphed.enabled and tr.graphed.captures == 1 and not msgs, msgs
        out.append(([h["loss"] for h in hist], {k: p.data.clone() for k, p in m.params.items()}))
    assert out[0][0] == out[1][0], out
    for k in out[0][1]:
        assert torch.equal(out[0][1][k], out[1][1][k]), k


@pytest.mark.gpu
def test_default_cuda_step_captures_and_resumes_bit_for_bit(tmp_path):
    """The trainer's default on CUDA is the graph, and it must really capture: every step after the warm-up is
    a replay (``graph`` in the metrics), one capture, no fallback. A run stopped after 4 steps, saved, and
    resumed in a fresh trainer (which captures again) ends with the uninterrupted run's weights bit for bit."""
    from xtrain.config import TrainConfig
    from xtrain.train.trainer import Trainer

    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 512, (4, 65), generator=g) for _ in range(9)]
    tc = TrainConfig(steps=9, batch_size=4, seq_len=64, lr=3e-3, warmup_steps=2, grad_clip=1.0)

    class Data:
        def __init__(self):
            self.i = 0

        def next_batch(self):
            self.i += 1
            return batches[self.i - 1]

        def state_dict(self):
            return {"i": self.i}

        def load_state_dict(self, d):
            self.i = d["i"]

    def trainer(run_dir=None):
        m = Model(_cfg("bfloat16", "auto", "auto"), device="cuda", seed=0)
        return Trainer(m, tc, Data(), run_dir=run_dir)

    whole = trainer()
    hist = whole.fit(9)
    assert [h["graph"] for h in hist] == ["warm-up"] * 3 + ["replay"] * 6
    assert whole.graphed.captures == 1 and whole.graphed.fallbacks == 0
    first = trainer(tmp_path / "run")
    first.fit(4)
    second = trainer(tmp_path / "run")
    assert second.resume() == 4
    hist2 = second.fit(9)
    assert hist2[-1]["graph"] == "replay" and second.graphed.captures == 1
    assert [h["loss"] for h in hist2] == [h["loss"] for h in hist[4:]]
    for k, p in whole.model.params.items():
        assert torch.equal(p.data, second.model.params[k].data), k
