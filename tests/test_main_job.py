"""The main job end to end through the command line, offline: prepare a small corpus, train a few steps,
checkpoint, resume (bit-identical to an uninterrupted run), sample, plot."""

import json
import socket

import pytest
import torch
from safetensors.torch import load_file

from xtrain.cli import main


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*a, **k):
        raise OSError("network access is blocked in this test")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _train(args, tmp_path, monkeypatch):
    monkeypatch.setenv("XTRAIN_CACHE", str(tmp_path / "cache"))
    return main(["train", *args])


COMMON = [
    "--vocab-size",
    "300",
    "--batch-size",
    "4",
    "--seq-len",
    "32",
    "--eval-every",
    "2",
    "--eval-batches",
    "1",
    "--no-progress",
    "--warmup",
    "2",
]


def test_train_resume_sample_plot_offline(corpus, tmp_path, monkeypatch, no_network, capsys):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert (
        _train(
            ["--data", str(corpus), "--steps", "6", "--out", str(straight), "--sample-tokens", "0", *COMMON],
            tmp_path,
            monkeypatch,
        )
        == 0
    )
    assert (
        _train(
            [
                "--data",
                str(corpus),
                "--steps",
                "6",
                "--stop-after",
                "4",
                "--out",
                str(split),
                "--sample-tokens",
                "8",
                *COMMON,
            ],
            tmp_path,
            monkeypatch,
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "unigram baseline" in out and "--- sample" in out
    assert "timing: " in out and "expected " in out  # the expected duration, from the first steps' speed
    for name in (
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
        "metrics.jsonl",
        "loss.png",
        "tokenizer.json",
    ):
        assert (split / name).is_file(), name
    assert json.loads((split / "trainer_state.json").read_text())["step"] == 4
    # a run directory is never overwritten by a new run
    assert _train(["--data", str(corpus), "--steps", "4", "--out", str(split), *COMMON], tmp_path, monkeypatch) == 2
    # resume 4 -> 6 equals 6 straight, bit for bit
    assert _train(["--resume", str(split), "--no-progress", "--sample-tokens", "0"], tmp_path, monkeypatch) == 0
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(split / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [
        json.loads(line)["step"]
        for line in (split / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "train"
    ]
    assert steps == [1, 2, 3, 4, 5, 6]
    # sampling: greedy is deterministic; seeded sampling is reproducible
    capsys.readouterr()
    args = ["sample", str(split), "--prompt", "def ", "--max-new-tokens", "12"]
    assert main([*args, "--temperature", "0"]) == 0
    g1 = capsys.readouterr().out
    assert main([*args, "--temperature", "0"]) == 0
    assert capsys.readouterr().out == g1 and g1.startswith("def ")
    assert main([*args, "--seed", "3"]) == 0
    s1 = capsys.readouterr().out
    assert main([*args, "--seed", "3"]) == 0
    assert capsys.readouterr().out == s1
    # plot two runs on one chart
    assert main(["plot", str(straight), str(split), "--out", str(tmp_path / "both.png")]) == 0
    assert (tmp_path / "both.png").stat().st_size > 1000


def test_bad_flags_fail_before_work(corpus, tmp_path, monkeypatch, capsys):
    assert (
        _train(["--data", str(corpus), "--lr", "-1", "--out", str(tmp_path / "r"), *COMMON], tmp_path, monkeypatch) == 2
    )
    assert "lr" in capsys.readouterr().err
    assert not (tmp_path / "r" / "model.safetensors").exists()
    assert main(["sample", str(tmp_path / "missing")]) == 2


def test_expected_duration_line():
    """The README's duration claim is measured, not asserted: `xtrain train` prints its tokens/s after the first
    steps and the time the rest should take. Here the line's arithmetic on known timings: the first step (its
    warm-up) left out, the remaining steps at the measured speed, evaluations as forward passes at a third of a
    step's cost per token."""
    from xtrain.config import TrainConfig
    from xtrain.train.cli import _expected_duration

    tc = TrainConfig(steps=160, batch_size=16, seq_len=128, eval_every=40, warmup_steps=2)
    timing = [(30.0, 2048), (1.0, 2048), (0.5, 2048), (0.5, 2048)]  # 6144 tokens in 2 s after the first step
    line = _expected_duration(timing, 4, tc, eval_batches=3, world=1)
    # 156 steps of 2048 tokens + 4 evaluations (steps 40, 80, 120, 160) of 3 batches of 2048 tokens at 1/3:
    # (156 * 2048 + 4 * 3 * 2048 / 3) / 3072 = 106.67 s
    assert line == "timing: 3,072 tokens/s over steps 2-4; expected 1m46s more for 156 steps and 4 evaluation(s)"
    # two ranks: the same per-rank speed reads as twice the tokens/s, the time left does not change
    assert _expected_duration(timing, 4, tc, 3, 2).startswith("timing: 6,144 tokens/s")


def test_top_p_and_top_k_filtering():
    from xtrain.sampling import Sampling, sample_rows

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(2000, 4)
    gens = [torch.Generator().manual_seed(i) for i in range(2000)]
    drawn = set(sample_rows(logits, [Sampling(top_p=0.7)] * 2000, gens).tolist())
    assert drawn == {0, 1}  # 0.5 < 0.7, so the second token is still needed
    assert set(sample_rows(logits, [Sampling(top_k=1)] * 2000, gens).tolist()) == {0}
