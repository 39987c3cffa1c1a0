"""The packed-document benchmarks on the CPU: ``xtrain bench attention --docs`` (table, goal lines, JSON, the
xtrain-vs-FlexAttention check), ``xtrain bench train --doc-mask`` (the mask on and off rows), and the synthetic
documents they run on (``bench/_docs.py``) against ``xtrain.model.doc_starts``."""

from __future__ import annotations

import json

import pytest
import torch

from xtrain.bench.cli import BENCH_DIR
from xtrain.model import doc_starts

pytestmark = pytest.mark.skipif(not (BENCH_DIR / "_docs.py").is_file(), reason="bench/ is not part of this checkout")


@pytest.mark.parametrize(
    "B, T, mean, seed",
    [(4, 64, 8, 0), (3, 100, 1, 1), (2, 50, 500, 2), (8, 300, 3.5, 3), (1, 1, 4, 4)],
)
def test_generated_starts_match_doc_starts_of_the_ids(B, T, mean, seed):
    from bench._docs import doc_boundaries, packed_ids, random_doc_starts

    eot = 2
    ids = packed_ids(B, T, mean, vocab=5, eot=eot, seed=seed)  # 4 other tokens: a stray eot would show
    want = random_doc_starts(B, T, mean, seed=seed)  # from the lengths, not from the ids
    assert want.dtype == torch.int64 and want.shape == (B, T)
    assert torch.equal(doc_starts(ids, eot), want)
    bounds = doc_boundaries(B, T, mean, seed)
    assert [sorted(set(b)) for b in bounds] == bounds and all(0 <= s < T for b in bounds for s in b)
    assert int((ids == eot).sum()) == sum(map(len, bounds))  # the eot at document starts and nowhere else
    assert torch.equal(random_doc_starts(B, T, mean, seed=seed), want)  # seeded


def test_generated_documents_have_the_mean_and_open_mid_document():
    from bench._docs import doc_boundaries

    bounds = doc_boundaries(64, 4096, 64, seed=0)
    lengths = [b - a for row in bounds for a, b in zip(row, row[1:])]
    assert abs(sum(lengths) / len(lengths) - 64) < 4  # ~4000 geometric draws, sd of the mean ~1
    assert min(lengths) >= 1
    assert len({tuple(r) for r in bounds}) == 64  # every row its own draws
    assert sum(r[0] != 0 for r in bounds) > 48  # most rows begin mid-document (P(begin on a start) ~ 1/64)
    with pytest.raises(ValueError, match="doc_boundaries"):
        doc_boundaries(1, 8, 0.5)


def test_bench_attention_docs_cpu(tmp_path, capsys):
    from xtrain.cli import main

    out_json = tmp_path / "docs.json"
    args = ["bench", "attention", "--docs", "8", "32", "--device", "cpu", "--seqs", "64", "--head-dims", "16"]
    args += ["--tokens", "128", "--width", "32", "--reps", "1", "--json", str(out_json)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "vs flex" in out and "vs sdpa" in out and "flex (eager, unfused)" in out
    assert "goal: xtrain fwd+bwd >= 1.2x FlexAttention" in out and "goal: xtrain fwd+bwd faster than full causal" in out
    assert "relative error <= 0.001: OK" in out
    d = json.loads(out_json.read_text())
    assert d["mode"] == "docs" and d["flex"] == "flex (eager, unfused)" and len(d["goals"]) == 2 and d["check_ok"]
    assert [(r["T"], r["D"], r["mean"], r["B"], r["H"]) for r in d["rows"]] == [(64, 16, 8, 2, 2), (64, 16, 32, 2, 2)]
    for r in d["rows"]:
        assert r["xtrain"]["fwd"] > 0 and r["xtrain"]["bwd"] > 0
        assert r["sdpa"]["fwd"] > 0 and r["sdpa"]["bwd"] > 0 and r["vs_sdpa"]["total"] > 0
        assert r["flex"]["fwd"] > 0 and r["flex"]["mask"] > 0 and r["vs_flex"]["fwd"] > 0
        assert r["err"] < 1e-5 and r["err_parts"] >= 1  # at least o compared (the CPU has no flex backward)
        assert 0 < r["kept"] <= 1


def test_bench_train_doc_mask(capsys):
    from xtrain.cli import main

    args = ["bench", "train", "--preset", "tiny", "--batch-size", "1", "--seq-len", "16", "--vocab", "128"]
    assert main(args + ["--steps", "2", "--warmup", "0", "--doc-mask", "4"]) == 0
    out = capsys.readouterr().out
    assert any(ln.startswith("trainer doc mask on ") for ln in out.splitlines())
    assert any(ln.startswith("trainer doc mask off ") for ln in out.splitlines())
    line = [ln for ln in out.splitlines() if ln.startswith("doc mask (mean document 4 tokens")][0]
    assert "on/off" in line and "tokens/s" in line
    first = [ln for ln in out.splitlines() if "first-step loss" in ln][0]
    losses = dict(part.strip().rsplit(" ", 1) for part in first.split(":", 1)[1].split(", "))
    # the same weights and batch: unmasked, the trainer agrees with xtrain's plain step; masked, it differs
    assert abs(float(losses["trainer doc mask off"]) - float(losses["xtrain"])) < 5e-6
    assert abs(float(losses["trainer doc mask on"]) - float(losses["trainer doc mask off"])) > 1e-4
