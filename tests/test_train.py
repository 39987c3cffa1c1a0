"""Training: AdamW and clipping vs torch (bit for bit), schedule, gradient accumulation, resume, checkpoint
files and their errors, non-finite steps, overfitting one batch, dropout training, the bench smoke test."""

import dataclasses
import json
import math
import os

import numpy as np
import pytest
import torch

import xtrain.ops as ops
from xtrain.autograd import Var
from xtrain.config import ConfigError, ModelConfig, TrainConfig
from xtrain.model import Model
from xtrain.train import checkpoint as ck
from xtrain.train.optim import AdamW, clip_grads_, decays, grad_norm
from xtrain.train.schedule import Schedule
from xtrain.train.trainer import NonFiniteError, Trainer, build_trainer, evaluate


def mcfg(**kw):
    base = dict(
        vocab_size=61,
        n_layer=2,
        n_embd=32,
        n_head=4,
        n_kv_head=2,
        head_dim=8,
        ffn_dim=64,
        max_seq_len=16,
        attention="composed",
        loss="composed",
    )
    base.update(kw)
    return ModelConfig(**base)


def tcfg(**kw):
    base = dict(steps=6, batch_size=4, seq_len=12, grad_accum=1, lr=1e-2, min_lr=1e-3, warmup_steps=2)
    base.update(kw)
    return TrainConfig(**base)


class Source:
    """A deterministic, resumable batch source: batch i is a pure function of (seed, i)."""

    def __init__(self, B, T, V, seed=0, ignore_frac=0.0):
        self.B, self.T, self.V, self.seed, self.pos, self.ignore_frac = B, T, V, seed, 0, ignore_frac

    def next_batch(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.pos)
        self.pos += 1
        ids = torch.randint(0, self.V, (self.B, self.T + 1), generator=g)
        if not self.ignore_frac:
            return ids
        x, y = ids[:, :-1], ids[:, 1:].clone()
        y[torch.rand(y.shape, generator=g) < self.ignore_frac] = -100
        return x, y

    def state_dict(self):
        return {"pos": self.pos, "seed": self.seed}

    def load_state_dict(self, d):
        self.pos, self.seed = int(d["pos"]), int(d["seed"])


def weights(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


# -- optimizer, clipping, schedule --------------------------------------------------------------------


def test_adamw_matches_torch_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (11, 6),
        "model.layers.0.mlp.up_proj.weight": (7, 6),
        "model.layers.0.input_layernorm.weight": (6,),
        "lm_head.weight": (11, 6),
    }
    mine = {n: Var(torch.randn(s, generator=g), requires_grad=True, name=n) for n, s in shapes.items()}
    theirs = {n: torch.nn.Parameter(v.data.clone()) for n, v in mine.items()}
    opt = AdamW(mine, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    groups = [
        {"params": [p for n, p in theirs.items() if decays(n, p.shape)], "weight_decay": 0.1},
        {"params": [p for n, p in theirs.items() if not decays(n, p.shape)], "weight_decay": 0.0},
    ]
    assert [len(gr["params"]) for gr in groups] == [2, 2]  # up_proj and lm_head decay; embedding, norm not
    # on the CPU AdamW runs torch's fused kernel, one call per decay group: what fused=True computes
    topt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    for step in range(6):
        lr = 3e-3 * (0.5 + 0.1 * step)  # the schedule changes lr every step
        for n in shapes:
            gr = torch.randn(shapes[n], generator=g) * (10.0 ** (step % 3 - 1))
            mine[n].grad = gr.clone()
            theirs[n].grad = gr.clone()
        for gr in topt.param_groups:
            gr["lr"] = lr
        opt.step(lr)
        topt.step()
        for n in shapes:
            assert torch.equal(mine[n].data, theirs[n].data), (step, n)
            st = topt.state[theirs[n]]
            i = opt.names.index(n)
            assert torch.equal(opt.exp_avgs[i], st["exp_avg"]) and torch.equal(opt.exp_avg_sqs[i], st["exp_avg_sq"])


def test_adamw_reference_matches_torch_single_tensor_adamw_fp64():
    """``adamw_step_ref`` is the oracle of the Triton and the device AdamW kernels (tests/test_kernels_triton.py),
    so it is checked against torch's own single-tensor AdamW (foreach=False), in fp64 where no rounding order
    can hide a wrong term: six steps with weight decay on some tensors, the learning rate changing every step and
    gradients of different magnitudes. The two compute the same formula in the same order: bit for bit."""
    from xtrain.kernels.adamw import adamw_step_ref

    g = torch.Generator().manual_seed(4)
    shapes, wds = [(7, 5), (6,), (3, 4, 2), (1,)], [0.1, 0.0, 0.05, 0.0]
    ps = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    theirs = [torch.nn.Parameter(p.clone()) for p in ps]
    start = [p.clone() for p in ps]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    betas, eps = (0.9, 0.95), 1e-8
    groups = [{"params": [t], "weight_decay": wd} for t, wd in zip(theirs, wds)]
    topt = torch.optim.AdamW(groups, lr=1e-2, betas=betas, eps=eps, foreach=False, fused=False)
    for step in range(1, 7):
        lr = 1e-2 * (1.2 - 0.15 * step)
        grads = [torch.randn(s, generator=g, dtype=torch.float64) * 10.0 ** (step % 3 - 1) for s in shapes]
        for t, gr in zip(theirs, grads):
            t.grad = gr.clone()
        for gr in topt.param_groups:
            gr["lr"] = lr
        topt.step()
        adamw_step_ref(ps, grads, ms, vs, step=step, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                       weight_decays=wds)  # fmt: skip
        for i, t in enumerate(theirs):
            st = topt.state[t]
            assert torch.equal(ps[i], t.data), (step, i, float((ps[i] - t.data).abs().max()))
            assert torch.equal(ms[i], st["exp_avg"]) and torch.equal(vs[i], st["exp_avg_sq"]), (step, i)
    assert all(not torch.equal(p, p0) for p, p0 in zip(ps, start))  # every tensor moved


def test_clip_matches_torch():
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(5, 7, generator=g), torch.randn(3, generator=g) * 4]
    params = [torch.nn.Parameter(torch.zeros_like(x)) for x in grads]
    for p, x in zip(params, grads):
        p.grad = x.clone()
    tn = torch.nn.utils.clip_grad_norm_(params, 1.5, foreach=False)
    mine = [x.clone() for x in grads]
    n = grad_norm(mine)
    assert torch.equal(n, tn)
    coef = clip_grads_(mine, 1.5, n)
    assert coef < 1
    for p, x in zip(params, mine):
        assert torch.equal(p.grad, x)
    # below the threshold: untouched
    same = [x.clone() for x in grads]
    assert clip_grads_(same, 1e6, grad_norm(same)) == 1.0 and all(torch.equal(a, b) for a, b in zip(same, grads))


def test_schedule():
    s = Schedule(lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=14)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(4) == 1.0 and abs(s(9) - 0.55) < 1e-12 and abs(s(14) - 0.1) < 1e-12 and s(100) == 0.1
    assert all(s(i) >= s(i + 1) for i in range(3, 20))
    assert Schedule(lr=1.0, kind="constant", warmup_steps=2)(50) == 1.0
    with pytest.raises(ValueError):
        Schedule(lr=0.0)


# -- gradient accumulation ----------------------------------------------------------------------------


def _grads_after(model_cfg, k, ignore_frac, B=8):
    m = Model(model_cfg, seed=0)
    tr = Trainer(m, tcfg(batch_size=B, grad_accum=k), Source(B, 12, model_cfg.vocab_size))
    src = Source(B, 12, model_cfg.vocab_size, seed=3, ignore_frac=ignore_frac)
    x, y = src.next_batch()
    y[0, :] = -100  # the first micro-batch counts far fewer tokens than the others
    y[1, :5] = -100
    loss_sum, n = tr.accumulate(x, y, tr.step_settings())
    return float(loss_sum) / int(n), {k_: p.grad.clone() for k_, p in m.params.items()}


def test_grad_accumulation_fp64():
    c = mcfg(compute_dtype="float64", dropout=0.0)
    l1, g1 = _grads_after(c, 1, 0.3)
    for k in (2, 4, 8):
        lk, gk = _grads_after(c, k, 0.3)
        assert abs(lk - l1) <= 1e-12 * abs(l1)
        for n in g1:
            torch.testing.assert_close(gk[n], g1[n], rtol=1e-12, atol=1e-14, msg=n)


def test_grad_accumulation_fp32():
    """fp32: k micro-batches vs one batch differ only by summation order; stated tolerance 1e-5 of each
    gradient's largest entry (observed ~1e-7)."""
    c = mcfg(compute_dtype="float32")
    l1, g1 = _grads_after(c, 1, 0.3)
    l4, g4 = _grads_after(c, 4, 0.3)
    assert abs(l4 - l1) <= 1e-6 * abs(l1)
    for n in g1:
        assert (g4[n] - g1[n]).abs().max() <= 1e-5 * g1[n].abs().max(), n


def test_grad_accumulation_same_update_through_steps():
    c = mcfg(compute_dtype="float64")
    out = {}
    for k in (1, 4):
        m = Model(c, seed=0)
        Trainer(m, tcfg(batch_size=8, grad_accum=k, steps=3), Source(8, 12, 61, ignore_frac=0.2)).fit()
        out[k] = weights(m)
    for n in out[1]:
        torch.testing.assert_close(out[4][n], out[1][n], rtol=1e-11, atol=1e-13, msg=n)


@pytest.mark.parametrize("graph", [False, True])
def test_fp64_trajectory_matches_an_independent_torch_oracle(graph):
    """A whole float64 training trajectory (grad accumulation 2, weight decay, a token count that is not a power
    of two and changes every step) against an independent float64 oracle: the torch.nn Qwen3 of
    tests/test_model.py on the whole batch at once (mean cross-entropy over the counted targets), torch.autograd
    and ``torch.optim.AdamW`` (single-tensor) at the trainer's lrs; with ``graph`` the trainer's step runs under
    the CPU stand-in for a CUDA graph (replayed aten calls). fp64 leaves no room for a rounded intermediate: loss
    and every weight agree to 1e-12 relative after each step (observed ~1e-15). Clipping is off because an
    active clip rescales the gradient to the same norm whatever its scale, hiding a wrong seed. Caught: the
    backward seed 1/N rounded to float32 (the weights then differ by 1.5e-12 relative after the first step, 1e-9 after
    the fourth)."""
    from tests.test_model import RefQwen3
    from xtrain.testing import replay_capture

    c = mcfg(compute_dtype="float64", dropout=0.0, init_std=0.1)
    t = tcfg(steps=4, batch_size=6, grad_accum=2, grad_clip=0.0, lr=3e-3, min_lr=1e-3, weight_decay=0.1)
    m = Model(c, seed=0)
    ref = RefQwen3(c).double()
    ref.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, strict=True)
    tr = Trainer(m, t, Source(6, 12, 61, seed=5, ignore_frac=0.3), cuda_graph=graph, graph_capture=replay_capture)
    if graph:
        tr.graphed.warmup = 1
        tr.graphed.say = pytest.fail  # no fallback, no re-capture
    named = dict(ref.named_parameters())
    groups = [
        {"params": [p for n, p in named.items() if decays(n, p.shape)], "weight_decay": t.weight_decay},
        {"params": [p for n, p in named.items() if not decays(n, p.shape)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=False)
    oracle_src = Source(6, 12, 61, seed=5, ignore_frac=0.3)
    counts = []
    for _ in range(t.steps):
        h = tr.train_step()
        counts.append(h["tokens"])
        x, y = oracle_src.next_batch()
        _, loss = ref(x, y, torch.float64)
        opt.zero_grad()
        loss.backward()
        for gr in opt.param_groups:
            gr["lr"] = h["lr"]
        opt.step()
        assert abs(loss.item() - h["loss"]) <= 1e-12 * loss.item(), (h["step"], loss.item(), h["loss"])
        for n, p in named.items():
            err = float((m.params[n].data - p.detach()).abs().max() / p.detach().abs().max())
            assert err <= 1e-12, (h["step"], n, err)
    assert len(set(counts)) > 1 and all(n & (n - 1) for n in counts), counts  # none a power of two
    assert not graph or tr.graphed.captures == 1


# -- resume -------------------------------------------------------------------------------------------


def test_resume_is_bit_identical(tmp_path):
    """N steps straight == k steps, save, fresh process state, resume, N - k steps (dropout and grad
    accumulation on, so the masks and the data position must be restored exactly)."""
    c = mcfg(dropout=0.1)
    t = tcfg(steps=7, grad_accum=2, grad_clip=0.5)
    straight = Model(c, seed=0)
    Trainer(straight, t, Source(4, 12, 61)).fit()

    first = Model(c, seed=0)
    Trainer(first, t, Source(4, 12, 61), run_dir=tmp_path).fit(3)
    assert sorted(os.listdir(tmp_path)) == sorted(ck.FILES)
    resumed = build_trainer(tmp_path, Source(4, 12, 61))
    assert resumed.step == 3 and resumed.data.pos == 3
    resumed.fit()
    for n, w in weights(straight).items():
        assert torch.equal(resumed.model.params[n].data, w), n
    # the final checkpoint is also the state of the straight run
    again = ck.load_model(tmp_path)
    assert all(torch.equal(again.params[n].data, w) for n, w in weights(straight).items())


def test_checkpoint_files_are_safetensors_and_json(tmp_path):
    m = Model(mcfg(), seed=0)
    tr = Trainer(m, tcfg(steps=2), Source(4, 12, 61), run_dir=tmp_path)
    tr.fit()
    for f in (ck.CONFIG, ck.STATE):
        json.loads((tmp_path / f).read_text())
    st = json.loads((tmp_path / ck.STATE).read_text())
    assert st["step"] == 2 and st["data"] == {"pos": 2, "seed": 0} and st["schedule"]["total_steps"] == 2
    for f in (ck.MODEL, ck.OPTIMIZER):
        raw = (tmp_path / f).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        assert json.loads(raw[8 : 8 + n])["__metadata__"]["step"] == "2"
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]
    cfg = json.loads((tmp_path / ck.CONFIG).read_text())
    assert ModelConfig.from_dict(cfg["model"]) == m.config and TrainConfig.from_dict(cfg["train"]) == tr.config


def _saved_run(tmp_path, steps=2):
    m = Model(mcfg(), seed=0)
    Trainer(m, tcfg(steps=steps), Source(4, 12, 61), run_dir=tmp_path).fit()
    return m


def _fresh_trainer():
    m = Model(mcfg(), seed=9)
    tr = Trainer(m, tcfg(steps=4), Source(4, 12, 61))
    return tr, weights(m), [x.clone() for x in tr.optimizer.exp_avgs]


def _assert_untouched(tr, w0, m0):
    assert tr.step == 0 and tr.data.pos == 0
    assert all(torch.equal(tr.model.params[n].data, w) for n, w in w0.items())
    assert all(torch.equal(a, b) for a, b in zip(tr.optimizer.exp_avgs, m0))


@pytest.mark.parametrize("victim", [ck.MODEL, ck.OPTIMIZER, ck.STATE, ck.CONFIG])
def test_truncated_checkpoint_names_the_file(tmp_path, victim):
    _saved_run(tmp_path)
    raw = (tmp_path / victim).read_bytes()
    (tmp_path / victim).write_bytes(raw[: len(raw) // 2])
    tr, w0, m0 = _fresh_trainer()
    with pytest.raises(ck.CheckpointError, match=victim.replace(".", r"\.")):
        tr.resume(tmp_path)
    _assert_untouched(tr, w0, m0)


def test_missing_file_named(tmp_path):
    _saved_run(tmp_path)
    os.remove(tmp_path / ck.OPTIMIZER)
    tr, w0, m0 = _fresh_trainer()
    with pytest.raises(ck.CheckpointError, match=r"optimizer\.safetensors: missing"):
        tr.resume(tmp_path)
    _assert_untouched(tr, w0, m0)


def test_files_from_different_saves_rejected(tmp_path):
    """A crash between files leaves a new model.safetensors with an old trainer_state.json: caught."""
    _saved_run(tmp_path / "a", steps=2)
    _saved_run(tmp_path / "b", steps=3)
    (tmp_path / "a" / ck.MODEL).write_bytes((tmp_path / "b" / ck.MODEL).read_bytes())
    tr, w0, m0 = _fresh_trainer()
    with pytest.raises(ck.CheckpointError, match=r"model\.safetensors: holds step 3.*says step 2"):
        tr.resume(tmp_path / "a")
    _assert_untouched(tr, w0, m0)


def test_mismatched_model_rejected(tmp_path):
    _saved_run(tmp_path)
    m = Model(mcfg(n_layer=3), seed=0)
    tr = Trainer(m, tcfg(steps=4), Source(4, 12, 61))
    w0 = weights(m)
    with pytest.raises(ck.CheckpointError, match=r"config\.json.*n_layer"):
        tr.resume(tmp_path)
    assert all(torch.equal(m.params[n].data, w) for n, w in w0.items())
    # a different train config (other than steps & co.) is not the same run either
    tr2 = Trainer(Model(mcfg(), seed=0), tcfg(steps=9, lr=5e-3), Source(4, 12, 61))
    with pytest.raises(ck.CheckpointError, match="lr"):
        tr2.resume(tmp_path)


def test_bad_data_state_leaves_everything_untouched(tmp_path):
    _saved_run(tmp_path)

    class Picky(Source):
        def load_state_dict(self, d):
            raise ValueError("different shards")

    m = Model(mcfg(), seed=9)
    tr = Trainer(m, tcfg(steps=4), Picky(4, 12, 61))
    w0 = weights(m)
    with pytest.raises(ck.CheckpointError, match=r"trainer_state\.json.*different shards"):
        tr.resume(tmp_path)
    assert tr.step == 0 and all(torch.equal(m.params[n].data, w) for n, w in w0.items())


def test_atomic_write_keeps_old_file_on_crash(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"old")

    def boom(*a):
        raise OSError("disk gone")

    import xtrain.fileio

    monkeypatch.setattr(xtrain.fileio.os, "replace", boom)
    with pytest.raises(OSError):
        ck.atomic_write_bytes(path, b"new contents")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["model.safetensors"]


# -- bad values ----------------------------------------------------------------------------------------


def test_bad_config_rejected_before_any_work(tmp_path):
    calls = []
    with pytest.raises(ConfigError, match="lr"):
        Trainer(Model(mcfg()), tcfg(lr=0.0), lambda: calls.append(1), run_dir=tmp_path)
    with pytest.raises(ConfigError, match="grad_accum"):
        Trainer(Model(mcfg()), tcfg(batch_size=6, grad_accum=4), lambda: calls.append(1), run_dir=tmp_path)
    assert not calls and not os.listdir(tmp_path)


def _poisoned(model, at_call, kind):
    """Wrap model.loss so that its ``at_call``-th call gives a nan loss ("loss") or a finite loss with
    inf gradients ("grad")."""
    orig, n = model.loss, [0]

    def loss(*a, **k):
        out = orig(*a, **k)
        n[0] += 1
        if n[0] != at_call:
            return out
        if kind == "loss":
            return ops.scale(out, float("nan"))
        return Var.from_op(out.data, (out,), lambda d: (d * float("inf"),), "poison")

    model.loss = loss


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_nonfinite_stops_naming_the_step(kind):
    m = Model(mcfg(), seed=0)
    tr = Trainer(m, tcfg(steps=6), Source(4, 12, 61))
    tr.fit(2)
    w2 = weights(m)
    _poisoned(m, 1, kind)
    with pytest.raises(NonFiniteError, match="step 3"):
        tr.fit()
    assert all(torch.equal(m.params[n].data, w) for n, w in w2.items())  # never poisons the weights
    assert all(torch.isfinite(v).all() for v in tr.optimizer.exp_avg_sqs)


def test_nonfinite_skipped_under_flag():
    m = Model(mcfg(), seed=0)
    seen = []
    tr = Trainer(m, tcfg(steps=5, skip_nonfinite=True, grad_accum=2), Source(4, 12, 61), on_metrics=seen.append)
    tr.fit(2)
    w2 = weights(m)
    _poisoned(m, 2, "loss")  # the second micro-batch of step 3
    tr.fit(1)
    assert tr.skips == 1 and seen[-1]["skipped"] and seen[-1]["step"] == 3
    assert all(torch.equal(m.params[n].data, w) for n, w in w2.items())
    tr.fit()
    assert tr.step == 5 and tr.skips == 1 and all(torch.isfinite(p.data).all() for p in m.parameters())
    tr2 = Trainer(Model(mcfg(), seed=0), tcfg(steps=5, skip_nonfinite=True, max_skips=0), Source(4, 12, 61))
    _poisoned(tr2.model, 1, "loss")
    with pytest.raises(NonFiniteError, match="max_skips"):
        tr2.fit()


def test_interrupted_step_leaves_a_consistent_state(tmp_path):
    """Ctrl-C in the middle of a step (second micro-batch): weights, moments, step and data position are
    as before the step, so save + resume (what the CLI does on Ctrl-C) continues the same run exactly."""
    c, t = mcfg(dropout=0.1), tcfg(steps=5, grad_accum=2)
    straight = Model(c, seed=0)
    Trainer(straight, t, Source(4, 12, 61)).fit()

    m = Model(c, seed=0)
    tr = Trainer(m, t, Source(4, 12, 61), run_dir=tmp_path)
    tr.fit(2)
    w2 = weights(m)
    orig, calls = m.loss, [0]

    def interrupted(*a, **k):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return orig(*a, **k)

    m.loss = interrupted
    with pytest.raises(KeyboardInterrupt):
        tr.fit()
    assert tr.step == 2 and tr.data.pos == 2 and all(p.grad is None for p in m.parameters())
    assert all(torch.equal(m.params[n].data, w) for n, w in w2.items())
    tr.save()
    resumed = build_trainer(tmp_path, Source(4, 12, 61))
    resumed.fit()
    assert all(torch.equal(resumed.model.params[n].data, w) for n, w in weights(straight).items())


def test_sigint_during_the_step_lands_after_it(tmp_path, default_sigint):
    """A real Ctrl-C (SIGINT) while the step computes is delivered after the step and its bookkeeping: the step
    counts, the data position moved on, the weights are that step's; save + resume continues the same run.
    ``default_sigint``: SIGINT raises here even when the suite runs with SIGINT ignored (a background job)."""
    import signal

    c, t = mcfg(dropout=0.1), tcfg(steps=5, grad_accum=2)
    straight = Model(c, seed=0)
    Trainer(straight, t, Source(4, 12, 61)).fit()

    m = Model(c, seed=0)
    tr = Trainer(m, t, Source(4, 12, 61), run_dir=tmp_path)
    tr.fit(2)
    orig, calls = m.loss, [0]

    def interrupted(*a, **k):
        calls[0] += 1
        if calls[0] == 2:  # the second micro-batch of step 3
            os.kill(os.getpid(), signal.SIGINT)
        return orig(*a, **k)

    m.loss = interrupted
    with pytest.raises(KeyboardInterrupt):
        tr.fit()
    assert tr.step == 3 and tr.data.pos == 3 and tr.optimizer.step_count == 3 and tr.history[-1]["step"] == 3
    tr.save()
    resumed = build_trainer(tmp_path, Source(4, 12, 61))
    resumed.fit()
    assert all(torch.equal(resumed.model.params[n].data, w) for n, w in weights(straight).items())


def test_update_defers_sigint():
    import signal

    from xtrain.train.trainer import _deferred_sigint

    # the disposition set here, not inherited: under a parent that ignores SIGINT (a background job, some CI
    # runners) Python starts with SIG_IGN, and the deferred interrupt would rightly be dropped
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        done = []
        with pytest.raises(KeyboardInterrupt):
            with _deferred_sigint():
                os.kill(os.getpid(), signal.SIGINT)
                done.append(1)  # still runs: the interrupt waits for the end of the block
        assert done == [1] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        # an ignored SIGINT stays ignored: the block neither raises nor changes the disposition
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with _deferred_sigint():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, inherited)


# -- training works -----------------------------------------------------------------------------------


def test_metrics_each_step_and_eval():
    seen = []
    m = Model(mcfg(), seed=0)
    val = [Source(4, 12, 61, seed=5).next_batch() for _ in range(2)]
    tr = Trainer(
        m,
        tcfg(steps=4, eval_every=2),
        Source(4, 12, 61),
        on_metrics=seen.append,
        eval_fn=lambda model: evaluate(model, val),
    )
    tr.fit()
    train = [r for r in seen if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert {"loss", "lr", "grad_norm", "tokens", "time", "tokens_per_s"} <= set(r)
        assert math.isfinite(r["loss"]) and r["tokens"] == 4 * 12
    assert [r["step"] for r in seen if r["kind"] == "eval"] == [2, 4]
    assert m.training  # eval restores the mode


def test_overfit_one_batch():
    """A 2-layer model memorises one batch of 4 random sequences of 16 tokens (V=61). Chance is
    ln 61 = 4.11 nats; every target is determined by its prefix (the sequences are distinct), so the
    optimum is ~0. Below 0.1 nats the model puts > 90% on the right token on average: memorised."""
    c = mcfg(max_seq_len=16)
    batch = Source(4, 16, 61, seed=1).next_batch()
    m = Model(c, seed=0)
    tr = Trainer(
        m,
        tcfg(steps=80, seq_len=16, lr=1e-2, min_lr=1e-2, warmup_steps=10, weight_decay=0.0, schedule="constant"),
        lambda: batch,
    )
    hist = tr.fit()
    assert hist[0]["loss"] > 3.5 and hist[-1]["loss"] < 0.1, (hist[0]["loss"], hist[-1]["loss"])


def test_dropout_training_is_finite_and_learns():
    c = mcfg(dropout=0.2, max_seq_len=16)
    batch = Source(4, 16, 61, seed=1).next_batch()
    m = Model(c, seed=0)
    hist = Trainer(
        m, tcfg(steps=60, seq_len=16, lr=1e-2, min_lr=1e-2, warmup_steps=5, schedule="constant"), lambda: batch
    ).fit()
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in hist)
    assert hist[-1]["loss"] < 0.6 * hist[0]["loss"]


def test_bf16_training_runs():
    c = mcfg(compute_dtype="bfloat16", max_seq_len=16)
    batch = Source(4, 16, 61, seed=1).next_batch()
    m = Model(c, seed=0)
    hist = Trainer(m, tcfg(steps=30, seq_len=16, lr=1e-2, warmup_steps=3), lambda: batch).fit()
    assert all(p.dtype == torch.float32 for p in m.parameters())
    assert hist[-1]["loss"] < 0.8 * hist[0]["loss"]


def _bf16_run(steps, use_copies, restore_after=None, ffn_dim=64):
    c = mcfg(compute_dtype="bfloat16", max_seq_len=16, ffn_dim=ffn_dim)
    batch = Source(4, 16, 61, seed=1).next_batch()
    m = Model(c, seed=0)
    tr = Trainer(m, tcfg(steps=steps, seq_len=16, lr=1e-2, warmup_steps=3), lambda: batch)
    if not use_copies:
        m.weight_copy = None
    hist = tr.fit(restore_after) if restore_after else tr.fit()
    return m, tr, hist


@pytest.mark.parametrize("ffn_dim", [64, 20])
def test_bf16_compute_copies_are_exact_casts(ffn_dim):
    """The optimizer's bf16 copies (written in its update pass, read by the forward through ops.cast_as)
    give bit-for-bit the training of casting every weight in every forward; at ffn_dim 20 the gate and up copies
    do not lie one after the other (the optimizer aligns each copy), and the model stacks them as it stacks casts."""
    m1, tr1, h1 = _bf16_run(5, True, ffn_dim=ffn_dim)
    m2, _, h2 = _bf16_run(5, False, ffn_dim=ffn_dim)
    assert any(c is not None for c in tr1.optimizer.copies)
    assert [h["loss"] for h in h1] == [h["loss"] for h in h2]
    for n in m1.params:
        assert torch.equal(m1.params[n].data, m2.params[n].data), n
    for p, c in zip(tr1.optimizer.params, tr1.optimizer.copies):
        if c is not None:
            assert torch.equal(c, p.data.to(torch.bfloat16))


def test_bf16_compute_copy_goes_stale_when_master_changes():
    """A master changed outside the optimizer (in place, or replaced) is never read through its old copy."""
    m, tr, _ = _bf16_run(2, True)
    name = "model.layers.0.self_attn.q_proj.weight"
    p = m.params[name]
    assert tr.optimizer.copy_for(p) is not None
    p.data.mul_(2.0)  # e.g. a user's edit or a checkpoint restore (copy_)
    assert tr.optimizer.copy_for(p) is None
    assert m._w(p).data.equal(p.data.to(torch.bfloat16))  # the forward casts instead
    tr.optimizer.step(1e-3)  # the next update rewrites the copy from the changed master
    assert tr.optimizer.copy_for(p) is not None and tr.optimizer.copy_for(p).equal(p.data.to(torch.bfloat16))
    p.data = p.data.clone()  # a replaced tensor
    assert tr.optimizer.copy_for(p) is None
    assert tr.optimizer.copy_for(m.params["model.norm.weight"]) is None  # 1-D: no copy kept


def test_cast_as_checks_and_gradient():
    x = Var(torch.randn(3, 4, dtype=torch.float32), requires_grad=True)
    y = ops.cast_as(x, x.data.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    y.backward(torch.ones(3, 4, dtype=torch.bfloat16))
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, torch.ones(3, 4))
    with pytest.raises(ValueError, match="cast_as"):
        ops.cast_as(x, torch.zeros(4, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="cast_as"):
        ops.cast_as(x, x.data.clone())  # same dtype
    with pytest.raises(ValueError, match="cast_as"):
        ops.cast_as(x, [1, 2])


def test_with_token_loader(tmp_path):
    loader_mod = pytest.importorskip("xtrain.data.loader")
    shards = pytest.importorskip("xtrain.data.shards")
    rng = np.random.default_rng(0)
    shards.write_shard(tmp_path / "train_000.bin", rng.integers(0, 61, 2000), vocab_size=61)
    make = lambda: loader_mod.TokenLoader(str(tmp_path / "train_*.bin"), batch_size=4, seq_len=12, seed=1)
    straight = Model(mcfg(), seed=0)
    Trainer(straight, tcfg(steps=4), make()).fit()
    run = tmp_path / "run"
    Trainer(Model(mcfg(), seed=0), tcfg(steps=4), make(), run_dir=run).fit(2)
    tr = build_trainer(run, make())
    tr.fit()
    assert all(torch.equal(tr.model.params[n].data, w) for n, w in weights(straight).items())


def test_bench_train_smoke(capsys):
    from xtrain.bench.cli import BENCH_DIR
    from xtrain.cli import main

    if not (BENCH_DIR / "train.py").is_file():
        pytest.skip("bench/ is not part of this checkout")
    assert (
        main(
            [
                "bench",
                "train",
                "--preset",
                "tiny",
                "--batch-size",
                "1",
                "--seq-len",
                "16",
                "--vocab",
                "128",
                "--steps",
                "1",
                "--warmup",
                "0",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "tokens/s" in out and "xtrain" in out and "torch eager" in out
    # same model, same batch: the first-step losses of every side agree
    line = [ln for ln in out.splitlines() if "first-step loss" in ln][0]
    losses = dict(part.strip().rsplit(" ", 1) for part in line.split(":", 1)[1].split(", "))
    assert {"torch eager", "xtrain"} <= set(losses)
    assert abs(float(losses["xtrain"]) - float(losses["torch eager"])) < 1e-4


@pytest.mark.parametrize("step", ["xtrain", "trainer"])
def test_bench_profile_train_smoke(capsys, step):
    from xtrain.bench.cli import BENCH_DIR
    from xtrain.cli import main

    if not (BENCH_DIR / "profile_train.py").is_file():
        pytest.skip("bench/ is not part of this checkout")
    args = ["bench", "profile_train", "--device", "cpu", "--step", step, "--seq-len", "16", "--batch-size", "1"]
    assert main(args + ["--steps", "1", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert f"profile: step={step}" in out and "Self CPU" in out


def test_model_config_roundtrip_in_checkpoint(tmp_path):
    m = _saved_run(tmp_path)
    m2 = ck.load_model(tmp_path, dropout=0.0)
    assert all(torch.equal(m2.params[n].data, w) for n, w in weights(m).items())
    mc, tc = ck.read_config(tmp_path)
    assert mc == m.config and tc.steps == 2
    assert dataclasses.replace(mc) == mc


def test_out_of_range_ids_stop_the_step_with_its_number():
    m = Model(mcfg(), seed=0)
    w0 = {k: p.data.clone() for k, p in m.params.items()}
    bad = torch.randint(0, 61, (4, 13))
    bad[1, 3] = 61
    tr = Trainer(m, tcfg(), lambda: bad)
    with pytest.raises(ValueError, match=r"step 1: input ids must lie in \[0, 61\)"):
        tr.train_step()
    assert tr.step == 0 and all(torch.equal(w0[k], p.data) for k, p in m.params.items())
