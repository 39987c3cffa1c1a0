"""Packed documents in training (``TrainConfig.doc_mask``): the trainer's half. The model's half (attention and
positions confined to each document, equal to the documents run separately) is tests/test_doc_mask.py.

Batches here hold several documents per window (token 0 is the end-of-text token a document starts with), so a
trainer that ignored the setting, computed the document starts once outside the captured step, or took them
from another micro-batch's rows would give other losses."""

import math
import subprocess
import sys

import pytest
import torch

from xtrain.config import ConfigError, ModelConfig, TrainConfig
from xtrain.mask import Documents
from xtrain.model import Model
from xtrain.train.trainer import Trainer, evaluate

EOT = 0
CFG = ModelConfig(vocab_size=64, n_layer=2, n_embd=16, n_head=4, n_kv_head=2, head_dim=4, ffn_dim=32,
                  max_seq_len=16, dropout=0.1)  # fmt: skip


def _batches(seed=0, B=4, T=12):
    """[B, T+1] ids with an end-of-text token at random places (each window 2-4 documents, rows differ)."""
    g = torch.Generator().manual_seed(seed)

    def next_batch():
        ids = torch.randint(1, CFG.vocab_size, (B, T + 1), generator=g)
        for b in range(B):
            ids[b, torch.randperm(T, generator=g)[: 1 + b % 3]] = EOT
        return ids

    return next_batch


def _tc(**kw):
    base = dict(steps=100, batch_size=4, seq_len=12, grad_accum=1, lr=1e-2, warmup_steps=2, doc_mask=True, eot_id=EOT)
    return TrainConfig(**{**base, **kw})


def test_the_step_scores_each_micro_batch_with_its_own_document_starts():
    """One step's loss is the model's loss with the document starts of its own batch; two micro-batches give the
    one-micro-batch step's loss and weights (fp64: equal to rounding), and the mask changes the loss."""
    cfg = ModelConfig(**{**CFG.to_dict(), "dropout": 0.0, "compute_dtype": "float64"})
    batch = _batches()()
    x, y = batch[:, :-1], batch[:, 1:]
    want = Model(cfg, seed=0).loss(x, y, reduction="mean", mask=Documents.of(x, EOT))
    plain = Model(cfg, seed=0).loss(x, y, reduction="mean")
    assert abs(float(want.data) - float(plain.data)) > 1e-3  # the windows really hold several documents
    runs = []
    for accum in (1, 2):
        tr = Trainer(Model(cfg, seed=0), _tc(grad_accum=accum), lambda: batch)
        runs.append((tr.train_step()["loss"], tr.model))
    assert math.isclose(runs[0][0], float(want.data), rel_tol=1e-12)
    assert math.isclose(runs[1][0], float(want.data), rel_tol=1e-12)
    for n, p in runs[0][1].params.items():
        torch.testing.assert_close(runs[1][1].params[n].data, p.data, rtol=1e-10, atol=1e-12)


def test_graph_stand_in_with_doc_mask_matches_the_step_without_a_graph():
    """The document starts are computed inside the captured step from the static input buffer: replays (Python
    not re-run) train bit for bit as the step without a graph, with dropout and two micro-batches."""
    from xtrain.testing import replay_capture

    a = Trainer(Model(CFG, seed=0), _tc(grad_accum=2), _batches())
    b = Trainer(Model(CFG, seed=0), _tc(grad_accum=2), _batches(), cuda_graph=True, graph_capture=replay_capture)
    b.graphed.warmup, b.graphed.say = 1, pytest.fail
    for _ in range(4):
        ma, mb = a.train_step(), b.train_step()
        assert (ma["loss"], ma["grad_norm"]) == (mb["loss"], mb["grad_norm"])
    assert b.graphed.captures == 1
    for n, p in a.model.params.items():
        assert torch.equal(p.data, b.model.params[n].data), n


def test_evaluate_keeps_documents_apart_when_asked():
    cfg = ModelConfig(**{**CFG.to_dict(), "dropout": 0.0})
    m = Model(cfg, seed=0)
    batches = [_batches(1)() for _ in range(2)]
    on, off = evaluate(m, batches, doc_eot=EOT), evaluate(m, batches)
    x, y = batches[0][:, :-1], batches[0][:, 1:]
    first = float(m.loss(x, y, reduction="sum", mask=Documents.of(x, EOT)).data)
    x2, y2 = batches[1][:, :-1], batches[1][:, 1:]
    second = float(m.loss(x2, y2, reduction="sum", mask=Documents.of(x2, EOT)).data)
    assert math.isclose(on["eval_loss"], (first + second) / on["eval_tokens"], rel_tol=1e-6)
    assert on["eval_loss"] != off["eval_loss"]


def test_doc_mask_settings_are_checked_and_resume_refuses_a_change(tmp_path):
    with pytest.raises(ConfigError, match="doc_mask needs eot_id"):
        TrainConfig(doc_mask=True).validate()
    with pytest.raises(ConfigError, match="eot_id"):
        TrainConfig(eot_id=-1).validate()
    tr = Trainer(Model(CFG, seed=0), _tc(steps=1), _batches(), run_dir=tmp_path / "run")
    tr.fit()
    other = Trainer(Model(CFG, seed=0), _tc(steps=2, doc_mask=False), _batches(), run_dir=tmp_path / "run")
    with pytest.raises(Exception, match="doc_mask"):
        other.resume()


@pytest.mark.slow
def test_cli_records_the_doc_mask_and_resume_refuses_another(corpus, tmp_path):
    """`xtrain train --doc-mask on` trains and records it; `--resume` with `--doc-mask off` is one line, exit 2."""
    env_py = [sys.executable, "-m", "xtrain.cli", "train"]
    common = ["--preset", "tiny", "--data", str(corpus), "--vocab-size", "300", "--batch-size", "4", "--seq-len", "32",
              "--warmup", "1", "--eval-every", "0", "--no-progress", "--sample-tokens", "0"]  # fmt: skip
    run = tmp_path / "run"
    r = subprocess.run(env_py + common + ["--steps", "2", "--doc-mask", "on", "--out", str(run)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    tc = json.loads((run / "config.json").read_text())["train"]
    assert tc["doc_mask"] is True and isinstance(tc["eot_id"], int)
    r = subprocess.run(env_py + ["--resume", str(run), "--steps", "3", "--doc-mask", "off"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)  # fmt: skip
    assert r.returncode == 2 and "--doc-mask off" in r.stderr, r.stderr[-2000:]


@pytest.mark.gpu
def test_cuda_graph_with_doc_mask_is_the_eager_step_bit_for_bit():
    """On a GPU: the default trainer with the document mask (bf16, flash attention: the Triton kernels with the
    mask, their per-tile bounds computed on the device inside the captured step) replays its CUDA graph and trains
    bit for bit as the same step without a graph; the windows hold several documents whose places change every
    step, so starts captured once would give other losses."""
    cfg = ModelConfig(vocab_size=512, n_layer=2, n_embd=256, n_head=4, n_kv_head=2, head_dim=64, ffn_dim=512,
                      max_seq_len=256, compute_dtype="bfloat16", attention="flash")  # fmt: skip
    g = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(6):
        ids = torch.randint(1, 512, (4, 257), generator=g)
        ids[torch.rand(ids.shape, generator=g) < 0.02] = EOT  # ~5 documents per window, at new places each step
        batches.append(ids)
    tc = TrainConfig(steps=6, batch_size=4, seq_len=256, grad_accum=2, lr=3e-3, warmup_steps=2, doc_mask=True,
                     eot_id=EOT)  # fmt: skip
    runs = []
    for graph in (True, False):
        it = iter(batches)
        m = Model(cfg, device="cuda", seed=0)
        tr = Trainer(m, tc, lambda it=it: next(it).cuda(), cuda_graph=graph)
        hist = tr.fit()
        if graph:
            assert tr.graphed.captures == 1 and tr.graphed.fallbacks == 0
            assert hist[-1]["graph"] == "replay"
        runs.append(([(h["loss"], h["grad_norm"]) for h in hist], {k: p.data.clone() for k, p in m.params.items()}))
    assert runs[0][0] == runs[1][0]
    for k in runs[0][1]:
        assert torch.equal(runs[0][1][k], runs[1][1][k]), k
    plain = Model(cfg, device="cuda", seed=0)  # the mask matters on these batches
    x = batches[0][:, :-1].cuda()
    with_mask = plain.loss(x, batches[0][:, 1:].cuda(), mask=Documents.of(x, EOT))
    without = plain.loss(x, batches[0][:, 1:].cuda())
    assert abs(float(with_mask.data) - float(without.data)) > 1e-3
