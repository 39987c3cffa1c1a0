"""Every command's bad arguments: one line on stderr, exit code 2, nothing written.

The rule under test is ``xtrain.cli.Parser`` (argparse errors in one line) with the shared argument types of
``xtrain.argtypes`` (each value checked while the command line is parsed), plus each command's early checks of
what depends on two arguments or on a file (``--stop-after`` within the steps, a resumed run's ``--steps``,
``--out`` replacing only what xtrain wrote). The commands run in this process through ``xtrain.cli.main`` (a
refused command line costs no process start), with a workspace of a prepared corpus, a one-step run and files
xtrain did not write; every file and folder of the workspace is compared before and after each case (inode,
size, modification time).
"""

import shutil
from pathlib import Path

import pytest
import torch

from xtrain.cli import main

TINY = ["--batch-size", "4", "--seq-len", "32", "--warmup", "1", "--eval-every", "0", "--eval-batches", "1"]
QUIET = ["--no-progress", "--sample-tokens", "0"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """The workspace: a corpus, its prepared data (byte tokenizer), finished one-step and two-step runs, and files
    that xtrain did not write (a text file, a folder of someone's files, a PNG, a Hugging Face model folder)."""
    import inspect
    import json
    import pathlib

    d = tmp_path_factory.mktemp("args")
    mp = pytest.MonkeyPatch()
    mp.setenv("XTRAIN_CACHE", str(d / "cache"))
    try:
        (d / "corpus").mkdir()
        src = inspect.getsource(json) + inspect.getsource(pathlib)
        for i in range(30):
            (d / "corpus" / f"doc{i:02d}.py").write_text(src[i * 1500 : (i + 1) * 1500])
        assert (
            main(
                [
                    "data",
                    "prepare",
                    "--corpus",
                    str(d / "corpus"),
                    "--vocab-size",
                    "256",
                    "--out",
                    str(d / "data"),
                    "--no-progress",
                ]
            )
            == 0
        )
        assert main(["train", "--data", str(d / "data"), "--out", str(d / "run"), "--steps", "1", *TINY, *QUIET]) == 0
        assert main(["train", "--data", str(d / "data"), "--out", str(d / "run2"), "--steps", "2", *TINY, *QUIET]) == 0
    finally:
        mp.undo()
    (d / "notes.txt").write_text("my notes\n")
    (d / "mine").mkdir()  # someone's folder: a file of theirs beside one named like a run's
    (d / "mine" / "notes.txt").write_text("mine")
    (d / "mine" / "metrics.jsonl").write_text('{"step": 1}\n')
    (d / "mine.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)  # a PNG someone else drew
    (d / "hf").mkdir()  # a Hugging Face model downloaded by hand
    (d / "hf" / "config.json").write_text('{"model_type": "qwen3"}\n')
    (d / "hf" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return d


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under root (folders too) -> (inode, size, mtime in ns): any write, rename or new file shows
    (cheaper than hashing the run's weights for each of the ~90 cases)."""
    return {
        p.relative_to(root).as_posix(): (st.st_ino, st.st_size, st.st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if (st := p.stat())
    }


# (arguments, a piece of the one line on stderr); {ws} is the workspace
BAD = [
    # train: each value, then what depends on two arguments or on the run
    (["train", "--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
    (["train", "--steps", "abc"], "argument --steps: 'abc' is not an integer"),
    (["train", "--batch-size", "0"], "argument --batch-size"),
    (["train", "--seq-len", "-3"], "argument --seq-len"),
    (["train", "--lr", "nan"], "argument --lr: must be a finite number > 0, got nan"),
    (["train", "--lr", "-1"], "argument --lr"),
    (["train", "--lr", "1e999"], "argument --lr"),
    (["train", "--warmup", "-1"], "argument --warmup"),
    (["train", "--grad-accum", "0"], "argument --grad-accum"),
    (["train", "--dropout", "1"], "argument --dropout: must be a finite number >= 0 and < 1"),
    (["train", "--seed", "-1"], "argument --seed"),
    (["train", "--seed", str(2**64)], "argument --seed"),
    (["train", "--eval-every", "-1"], "argument --eval-every"),
    (["train", "--eval-batches", "0"], "argument --eval-batches"),
    (["train", "--ckpt-every", "-2"], "argument --ckpt-every"),
    (["train", "--sample-tokens", "-1"], "argument --sample-tokens"),
    (["train", "--stop-after", "0"], "argument --stop-after: must be an integer >= 1"),
    (["train", "--stop-after", "-1"], "argument --stop-after"),
    (["train", "--vocab-size", "1"], "argument --vocab-size: must be an integer >= 256"),
    (["train", "--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    (["train", "--dtype", "float16"], "argument --dtype: invalid choice"),
    (["train", "--attention", "fast"], "argument --attention: invalid choice"),
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    # the corpus is not prepared (nothing is written) when the arguments cannot train
    (["train", "--data", "{ws}/corpus", "--grad-accum", "3", "--batch-size", "4"], "--grad-accum 3: must divide"),
    (["train", "--data", "{ws}/corpus", "--steps", "2", "--stop-after", "3"], "--stop-after 3: more than the run's 2"),
    (["train", "--data", "{ws}/data", "--out", "{ws}/notes.txt"], "--out {ws}/notes.txt: exists and is not a dir"),
    (["train", "--data", "{ws}/nothere"], "corpus '{ws}/nothere' is not"),
    (
        ["train", "--data", "{ws}/data", "--out", "{ws}/mine", "--steps", "1"],
        "--out {ws}/mine: not empty and not an xtrain run (holds notes.txt)",
    ),
    (
        ["train", "--data", "{ws}/data", "--out", "{ws}/mine", "--steps", "1", "--restart"],
        "not empty and not an xtrain run (holds notes.txt)",
    ),
    (
        [
            "train",
            "--data",
            "{ws}/data",
            "--out",
            "{ws}/huge",
            "--steps",
            "1",
            "--seq-len",
            "100000",
            "--batch-size",
            "16",
        ],
        "batch 16 x seq-len 100000 needs about",
    ),
    (["train", "--device", "tpu"], "--device tpu"),
    (["train", "--resume", "{ws}/run", "--steps", "0"], "argument --steps"),
    (["train", "--resume", "{ws}/run", "--stop-after", "0"], "argument --stop-after"),
    (["train", "--resume", "{ws}/run", "--stop-after", "5"], "--stop-after 5: more than the 0 steps left of 1"),
    (["train", "--resume", "{ws}/run", "--steps", "3", "--stop-after", "3"], "more than the 2 steps left of 3"),
    (["train", "--resume", "{ws}/nothere"], "--resume {ws}/nothere: no such run directory"),
    (["train", "--resume", "{ws}/run", "--lr", "1"], "cannot change --lr"),
    (
        ["train", "--resume", "{ws}/run", "--eval-batches", "3", "--lr", "0.1"],
        ("cannot change --lr 0.1", "--eval-batches 3 (the run has 1)"),
    ),  # every changed setting, in the one line
    (["train", "--resume", "{ws}/run2", "--steps", "1"], "--steps 1: {ws}/run2 is already at step 2"),
    # sample
    (["sample", "{ws}/run", "--prompt", b"def \xff\xfe".decode("utf-8", "surrogateescape")], "not valid UTF-8"),
    (["sample", "{ws}/run", "--max-new-tokens", "-1"], "argument --max-new-tokens"),
    (["sample", "{ws}/run", "--max-new-tokens", "100000"], "argument --max-new-tokens: must be an integer in [0, "),
    (["sample", "{ws}/run", "--temperature", "nan"], "argument --temperature"),
    (["sample", "{ws}/run", "--temperature", "-1"], "argument --temperature"),
    (["sample", "{ws}/run", "--top-p", "0"], "argument --top-p: must be a finite number > 0 and <= 1"),
    (["sample", "{ws}/run", "--top-p", "1.5"], "argument --top-p"),
    (["sample", "{ws}/run", "--top-k", "-1"], "argument --top-k"),
    (["sample", "{ws}/run", "--num-samples", "0"], "argument --num-samples"),
    (["sample", "{ws}/run", "--seed", "-1"], "argument --seed"),
    (["sample", "{ws}/nothere"], "{ws}/nothere"),
    (["sample", "{ws}/run", "--device", "tpu"], "--device tpu"),
    *(
        []
        if torch.cuda.is_available()
        else [(["sample", "{ws}/run", "--device", "cuda"], "xtrain sample: --device cuda:")]
    ),
    (["sample"], "the following arguments are required: run"),
    # export
    (["export", "{ws}/nothere", "--out", "{ws}/e"], "{ws}/nothere: no such checkpoint directory"),
    (["export", "{ws}/run", "--out", "{ws}/notes.txt"], "exists and is not a directory"),
    (["export", "{ws}/run", "--out", "{ws}/run"], "is the run directory itself"),
    (["export", "{ws}/run", "--out", "{ws}/run2"], "--out {ws}/run2 is an xtrain run directory"),
    (["export", "{ws}/run", "--out", "{ws}/data"], "not a previous xtrain export"),
    (["export", "{ws}/run", "--out", "{ws}/hf"], "not a previous xtrain export"),
    (["export", "{ws}/run", "--out", "{ws}/e", "--dtype", "int8"], "argument --dtype: invalid choice"),
    (["export", "{ws}/run"], "the following arguments are required: --out"),
    # serve (checked before the port is bound and the run is loaded)
    (["serve", "{ws}/run", "--port", "-1"], "argument --port"),
    (["serve", "{ws}/run", "--port", "70000"], "argument --port"),
    (["serve", "{ws}/run", "--threads", "0"], "argument --threads"),
    (["serve", "{ws}/run", "--slots", "0"], "argument --slots"),
    (["serve", "{ws}/run", "--max-queue", "-1"], "argument --max-queue"),
    (["serve", "{ws}/nothere", "--port", "0"], "{ws}/nothere"),
    # plot: only a new file, or a chart xtrain drew
    (["plot", "{ws}/nothere"], "no metrics.jsonl"),
    (["plot", "{ws}/run", "--out", "{ws}/notes.txt"], "exists and is not a chart xtrain drew"),
    (["plot", "{ws}/run", "--out", "{ws}/mine.png"], "exists and is not a chart xtrain drew"),
    (["plot", "{ws}/run", "--out", "{ws}/hf/config.json"], "exists and is not a chart xtrain drew"),
    (["plot", "{ws}/run", "--out", "{ws}/nodir/x.png"], "no such directory"),
    (["plot", "{ws}/run", "--out", "{ws}/data"], "is a directory"),
    (["plot"], "the following arguments are required: runs"),
    # micro
    (["micro", "--steps", "0"], "argument --steps"),
    (["micro", "--layers", "0"], "argument --layers"),
    (["micro", "--embd", "0"], "argument --embd"),
    (["micro", "--heads", "3"], "n_embd (16) must be divisible by n_head (3)"),
    (["micro", "--block-size", "0"], "argument --block-size"),
    (["micro", "--lr", "nan"], "argument --lr"),
    (["micro", "--lr", "-0.1"], "argument --lr"),
    (["micro", "--temperature", "inf"], "argument --temperature"),
    (["micro", "--samples", "-1"], "argument --samples"),
    (["micro", "--data", "{ws}/nothere.txt"], "cannot read documents from"),
    # check
    (["check", "--seed", "-1"], "argument --seed"),
    (["check", "--kernels", "0"], "argument --kernels"),
    (["check", "--kernels", "abc"], "argument --kernels: 'abc' is not an integer"),
    # data info, and the command itself
    (["data", "info", "{ws}/nothere"], "not found"),
    (["data", "info", "{ws}/notes.txt"], "notes.txt"),
    (["data", "info"], "the following arguments are required: path"),
    (["data"], "the following arguments are required: ACTION"),
    ([], "the following arguments are required: COMMAND"),
    (["nosuchcommand"], "invalid choice: 'nosuchcommand'"),
]


@pytest.mark.parametrize("args,first", BAD, ids=[" ".join(a)[:60] for a, _ in BAD])
def test_a_bad_argument_is_one_line_exit_2_and_writes_nothing(ws, args, first, capsys, monkeypatch):
    """``first``: a piece of the one line, or a tuple of pieces it must all hold."""
    monkeypatch.chdir(ws)
    monkeypatch.setenv("XTRAIN_CACHE", str(ws / "cache"))
    args = [a.replace("{ws}", str(ws)) for a in args]
    before = snapshot(ws)
    capsys.readouterr()
    rc = main(args)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, (rc, err[-3000:])
    for piece in first if isinstance(first, tuple) else (first,):
        assert piece.replace("{ws}", str(ws)) in lines[0], lines[0]
    assert lines[0].startswith("xtrain") and "Traceback" not in err
    assert snapshot(ws) == before


def test_plot_redraws_only_the_charts_it_drew(ws, tmp_path, capsys):
    """plot writes a new file, then redraws that chart (its PNG says it is xtrain's) and a run's loss.png, leaving
    no temporary file; a file it did not draw is refused (the cases above)."""
    run = tmp_path / "run"
    shutil.copytree(ws / "run", run)
    chart = tmp_path / "chart.png"
    assert main(["plot", str(run), "--out", str(chart)]) == 0
    assert main(["plot", str(run), "--out", str(chart)]) == 0
    assert main(["plot", str(run)]) == 0  # RUN/loss.png
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chart.png", "run"]


def test_sampling_values_at_the_far_ends_of_their_ranges_are_taken(ws, capsys):
    """A temperature of 1e-40 and a top-p of 1e-300 are valid values: ``sample`` takes them, prints text, exit
    code 0, and writes nothing (tests/test_preemption.py does the same as a real process, in the slow tier)."""
    before = snapshot(ws)
    capsys.readouterr()
    args = ["sample", str(ws / "run"), "--temperature", "1e-40", "--top-p", "1e-300", "--max-new-tokens", "3"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out and "Traceback" not in err
    assert snapshot(ws) == before


@pytest.mark.slow  # a resumed training step
def test_good_arguments_at_the_edges_are_taken(ws, tmp_path, capsys, monkeypatch):
    """The bounds themselves are accepted: an empty prompt (the default), no new tokens, greedy sampling, top-p 1;
    ``--steps`` equal to the checkpoint's step plus the ``--stop-after`` that uses every step left."""
    monkeypatch.setenv("XTRAIN_CACHE", str(ws / "cache"))
    run = tmp_path / "run"
    shutil.copytree(ws / "run", run)
    assert (
        main(["sample", str(run), "--prompt", "", "--max-new-tokens", "0", "--temperature", "0", "--top-p", "1"]) == 0
    )
    assert main(["train", "--resume", str(run), "--steps", "2", "--stop-after", "1", *QUIET]) == 0
    assert '"step": 2' in (run / "trainer_state.json").read_text()
