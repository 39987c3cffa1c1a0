"""Model-level checks on a CUDA GPU (skipped without one): the fused paths must compute the model the
composed reference paths compute.

* flash attention vs composed attention: logits, loss and every parameter gradient;
* Triton kernels vs the plain-torch references (``XTRAIN_KERNELS`` backend switch), fused linear+CE on;
* a bf16 training step runs on CUDA and reduces the loss;
* the trainer's step as a CUDA graph, with dropout, trains exactly as the same step without a graph.

Tolerances, as normwise relative errors ||a - b|| / ||b||: fp32 1e-4 (both paths round differently in
fp32 — online vs two-pass softmax, tf32-free fp32 dots in different orders — through a few layers, a few
hundred ulps at most); bf16 3e-2 (bf16 operands carry 8 bits of mantissa, ~4e-3 per rounding, and the two
paths round at different points: the composed path materialises bf16 scores and probabilities, flash keeps
them in fp32 registers; through two layers and the backward this compounds to about 1e-2).
"""

import pytest
import torch

from xtrain.config import preset
from xtrain.kernels import backend
from xtrain.model import Model

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _cfg(dtype, attention, loss="composed"):
    return preset(
        "tiny",
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


def _run(cfg, ids, seed=0):
    m = Model(cfg, device="cuda", seed=seed)
    logits = m.forward(ids[:, :-1]).data.float()
    loss = m.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return logits, loss.data.float(), {k: p.grad.clone() for k, p in m.params.items()}


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_flash_equals_composed_in_the_model(dtype, tol):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (3, 301), generator=g).cuda()  # T = 300: ragged last tiles
    lf, Lf, gf = _run(_cfg(dtype, "flash"), ids)
    lc, Lc, gc = _run(_cfg(dtype, "composed"), ids)
    assert _rel(lf, lc) < tol
    assert abs(float(Lf - Lc)) / float(Lc) < tol
    worst = max(_rel(gf[k], gc[k]) for k in gc)
    assert worst < tol, {k: _rel(gf[k], gc[k]) for k in gc}


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_triton_kernels_equal_references_in_the_model(dtype, tol):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (4, 129), generator=g).cuda()
    with backend("triton"):
        lt, Lt, gt = _run(_cfg(dtype, "flash", "fused"), ids)
    with backend("reference"):
        lr, Lr, gr = _run(_cfg(dtype, "composed", "composed"), ids)
    assert _rel(lt, lr) < tol
    assert abs(float(Lt - Lr)) / float(Lr) < tol
    worst = max(_rel(gt[k], gr[k]) for k in gr)
    assert worst < tol, {k: _rel(gt[k], gr[k]) for k in gr}


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


@pytest.mark.parametrize("head_dim", [64, 128])
def test_gluon_attention_paths_equal_composed_in_the_model(head_dim, monkeypatch):
    """At T = 1024 in bf16 on an H100/H200 the model's flash attention runs the Gluon kernels: the forward
    (q2 / pp) and the backward (hd64: the one-pass kernel, whose dq is summed by reduce-adds; hd128: the
    two-kernel split). Counted per layer: the first layer's backward takes the full path and leaves a launch
    plan (attention._BWD_PLANS), the second layer's has the same inputs' signature and runs the plan.
    The model matches the composed path within the bf16 tolerance."""
    from xtrain.kernels import attention as FA
    from xtrain.kernels.attention import gluon_bwd as GB
    from xtrain.kernels.attention import gluon_onepass as OP

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 only")
    if not GB.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon")
    mod, name = (OP, "flash_attention_bwd_gluon_onepass") if head_dim == 64 else (GB, "flash_attention_bwd_gluon")
    calls, real = [], getattr(mod, name)

    def counted(*a, **kw):
        calls.append("full")
        out = real(*a, **kw)
        if kw.get("plan"):
            plan = out[3]

            def planned(*pa):
                calls.append("plan")
                return plan(*pa)

            out = (*out[:3], planned)
        return out

    monkeypatch.setattr(mod, name, counted)
    cfg = dict(
        vocab_size=512,
        n_layer=2,
        n_embd=256,
        n_head=4,
        n_kv_head=2,
        head_dim=head_dim,
        ffn_dim=512,
        max_seq_len=1024,
        compute_dtype="bfloat16",
        loss="composed",
    )
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 512, (2, 1025), generator=g).cuda()
    lf, Lf, gf = _run(preset("tiny", attention="flash", **cfg), ids)
    assert calls == ["full", "plan"], f"{name} for 2 layers: {calls}"
    assert FA.ONEPASS_MIN_T <= 1024 and FA.GLUON_BWD_MIN_T[128] <= 1024
    lc, Lc, gc = _run(preset("tiny", attention="composed", **cfg), ids)
    tol = 3e-2
    assert _rel(lf, lc) < tol
    assert abs(float(Lf - Lc)) / float(Lc) < tol
    worst = max(_rel(gf[k], gc[k]) for k in gc)
    assert worst < tol, {k: _rel(gf[k], gc[k]) for k in gc}


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
