"""Nothing lost, as real commands: a run stopped by SIGTERM/SIGHUP saves at a step boundary and resumes
bit for bit; kill -9 while checkpointing every step never leaves a run that cannot resume, and `sample` run
meanwhile never fails; `train --out` writes only into a new or empty directory or its own run; `--data` is
recorded absolute with a fingerprint; another world size keeps the global batch; bad values stop with one
line and exit code 2 before anything is written.

Each case runs ``python -m xtrain.cli ...`` in a subprocess and compares every file's sha256 before and
after where nothing may change. One tiny run (tiny preset, vocab 300, two steps) is built once per test process
(conftest.py ``cli_base``)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests._cli import QUIET, ROOT, TINY, check, first_line, tree_hash, xtrain, xtrain_popen


@pytest.fixture(scope="module")
def base(cli_base):
    """{"dir": workdir, "data": prepared data dir, "run": a finished 2-step run}: tests/conftest.py cli_base, built
    once per test process."""
    return cli_base


def _rows(run: Path) -> list[dict]:
    """The training rows of metrics.jsonl (evaluation rows left out)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [m for m in rows if m.get("kind") == "train"]


def _same_tensors(x: Path, y: Path) -> bool:
    """Bit-identical tensors (the files' bytes may differ: safetensors orders the metadata as it likes)."""
    a, b = load_file(x), load_file(y)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _step(run: Path) -> int:
    return json.loads((run / "trainer_state.json").read_text())["step"]


def _wait_for_rows(p, run: Path, n: int, timeout: float = 120):
    deadline = time.time() + timeout
    while not (run / "metrics.jsonl").exists() or len(_rows_safe(run)) < n:
        assert p.poll() is None, p.communicate()
        assert time.time() < deadline, "the run did not start"
        time.sleep(0.05)


def _rows_safe(run: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []


def _stop(p):
    if p.poll() is None:
        p.kill()
    p.communicate()


# slower steps than TINY so a signal lands mid-run: ~0.1-0.3 s a step on a loaded 2-core machine
SLOWER = ["--batch-size", "8", "--seq-len", "64", "--warmup", "1", "--eval-every", "0", "--eval-batches", "1"]


# -- signals --------------------------------------------------------------------------------------------------


def _ignore_terminal_signals():
    """In the child before exec: what ``nohup xtrain train ... &`` gives a run (SIGHUP and SIGINT ignored)."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def test_sigterm_mid_run_saves_and_exits_143_and_an_inherited_sig_ign_is_kept(base, tmp_path):
    """The quick tier's SIGTERM case, on a run started as ``nohup xtrain train ... &`` starts it (SIGINT and SIGHUP
    inherited as ignored): SIGINT and SIGHUP leave it training, SIGTERM stops it at a step boundary with exit 143,
    a checkpoint of the last logged step, no lock, and a state that resumes (loaded into a trainer with the same
    data, it continues from that step). Caught: StopSignals without SIGTERM (the run dies by the signal, rc -15);
    StopSignals overriding an inherited SIG_IGN (rc 130, stopped by SIGINT)."""
    from xtrain.data.loader import TokenLoader
    from xtrain.train import checkpoint as ckpt_io
    from xtrain.train.trainer import build_trainer

    a = tmp_path / "a"
    args = ["--steps", 100000, *TINY, *QUIET]
    p = xtrain_popen(
        "train", "--data", base["data"], "--out", a, *args, cwd=tmp_path, preexec_fn=_ignore_terminal_signals
    )
    try:
        _wait_for_rows(p, a, 1)
        p.send_signal(signal.SIGINT)
        p.send_signal(signal.SIGHUP)
        n = len(_rows(a))
        _wait_for_rows(p, a, n + 2)  # two more steps after both: still training
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        _stop(p)
    assert p.returncode == 143, (p.returncode, out[-1000:], err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    k = _step(a)
    assert f"interrupted at step {k} by SIGTERM; checkpoint saved" in out, out[-1000:]
    assert k >= n + 2 and [m["step"] for m in _rows(a)] == list(range(1, k + 1))
    assert not (a / ".xtrain.lock").exists() and not (a / ckpt_io.STAGING).exists()
    meta = json.loads((base["data"] / "meta.json").read_text())
    stored = ckpt_io.read_config(a)[1]
    loader = TokenLoader(
        [base["data"] / f for f, _ in meta["train"]["files"]],
        stored.batch_size,
        stored.seq_len,
        seed=stored.seed,
        vocab_size=meta["vocab_size"],
    )
    tr = build_trainer(a, loader)
    assert tr.step == k and tr.optimizer.step_count == k
    tr.fit(1)
    assert tr.step == k + 1 and _step(a) == k + 1


@pytest.mark.slow
def test_sigterm_stops_at_a_step_boundary_saves_and_resumes_bit_exactly(base, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    p = xtrain_popen("train", "--data", base["data"], "--out", a, "--steps", 200, *SLOWER, *QUIET, cwd=tmp_path)
    try:
        _wait_for_rows(p, a, 2)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        _stop(p)
    assert p.returncode == 143, (p.returncode, err[-2000:])
    assert "Traceback" not in err
    k = _step(a)
    assert f"interrupted at step {k} by SIGTERM; checkpoint saved" in out, out[-1000:]
    assert 2 <= k < 200 and [m["step"] for m in _rows(a)] == list(range(1, k + 1))
    assert not (a / ".xtrain.lock").exists()
    # the state saved at the signal is exactly the state after k steps of the same run
    r = xtrain(
        "train", "--data", base["data"], "--out", b, "--steps", 200, "--stop-after", k, *SLOWER, *QUIET, cwd=tmp_path
    )
    check(r, 0, "")
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert _same_tensors(a / name, b / name), name
    # and both continue identically, the resumed log without a repeated step
    for run in (a, b):
        check(xtrain("train", "--resume", run, "--stop-after", 2, *QUIET, cwd=tmp_path), 0, "")
    assert _same_tensors(a / "model.safetensors", b / "model.safetensors")
    assert [m["step"] for m in _rows(a)] == list(range(1, k + 3))


@pytest.mark.slow
def test_sighup_saves_and_exits_129(base, tmp_path):
    a = tmp_path / "a"
    p = xtrain_popen("train", "--data", base["data"], "--out", a, "--steps", 200, *SLOWER, *QUIET, cwd=tmp_path)
    try:
        _wait_for_rows(p, a, 1)
        p.send_signal(signal.SIGHUP)
        out, err = p.communicate(timeout=120)
    finally:
        _stop(p)
    assert p.returncode == 129 and "Traceback" not in err, err[-2000:]
    assert f"interrupted at step {_step(a)} by SIGHUP" in out


# -- kill -9 while checkpointing every step; readers meanwhile -------------------------------------------------


@pytest.mark.slow
def test_kill_9_while_checkpointing_every_step_always_resumes(base, tmp_path):
    run = tmp_path / "run"
    args = ["--steps", 100000, "--ckpt-every", 1, *TINY, *QUIET]
    p = xtrain_popen("train", "--data", base["data"], "--out", run, *args, cwd=tmp_path)
    try:
        _wait_for_rows(p, run, 3)
        r = xtrain("sample", run, "--max-new-tokens", 2, cwd=tmp_path)  # a reader while every step saves
        check(r, 0, "")
        for delay in (0.0, 0.37):
            time.sleep(delay)
            p.kill()
            p.communicate()
            r = xtrain("sample", run, "--max-new-tokens", 2, cwd=tmp_path)
            check(r, 0, "")
            step = _step(run)
            p = xtrain_popen("train", "--resume", run, "--ckpt-every", 1, *QUIET, cwd=tmp_path)
            _wait_for_rows(p, run, step + 2)
    finally:
        _stop(p)
    rows = [m["step"] for m in _rows(run)]
    assert rows == sorted(set(rows)), "a resumed run repeated or skipped a logged step"


@pytest.mark.slow
def test_readers_racing_a_run_that_saves_every_step_read_silently(base, tmp_path):
    """`train --ckpt-every 1` saves all the time (a save folder exists about half of the time): reads racing it
    (in this process, then `sample` and `export` as commands) each take a complete checkpoint and say nothing,
    since the run's lock has a live owner. Caught: the notes added without asking the lock (the in-process reads
    then say they ignore .checkpoint-next/, or that a crash stopped a committed save)."""
    from xtrain.train import checkpoint as ckpt_io

    run, readers = tmp_path / "run", []
    p = xtrain_popen(
        "train", "--data", base["data"], "--out", run, "--steps", 100000, "--ckpt-every", 1, *TINY, *QUIET, cwd=tmp_path
    )
    try:
        _wait_for_rows(p, run, 2)
        steps, notes, deadline = [], [], time.time() + 120
        while len(steps) < 8 or len(set(steps)) < 3:
            assert time.time() < deadline and p.poll() is None
            ck = ckpt_io.read_checkpoint(run, with_optimizer=False)
            steps.append(ck.step)
            notes += ck.notes
        assert notes == [] and steps == sorted(steps), (notes[:2], steps)
        readers += [
            xtrain_popen("sample", run, "--max-new-tokens", 2, cwd=tmp_path),
            xtrain_popen("export", run, "--out", tmp_path / "hf", cwd=tmp_path),
        ]
        for r in readers:
            _, err = r.communicate(timeout=300)
            assert r.returncode == 0 and err == "", (r.args, err[-2000:])
        assert p.poll() is None  # the trainer ran throughout
    finally:
        for r in [p, *readers]:
            _stop(r)


# -- train --out: only a new or empty directory, or the run's own -------------------------------------------


@pytest.mark.slow
def test_out_onto_a_run_killed_before_its_first_checkpoint(base, tmp_path):
    run = tmp_path / "killed"
    p = xtrain_popen("train", "--data", base["data"], "--out", run, "--steps", 100000, *SLOWER, *QUIET, cwd=tmp_path)
    try:
        _wait_for_rows(p, run, 1)
        p.kill()  # no checkpoint yet (--ckpt-every 0): metrics, tokenizer and a stale lock are left
    finally:
        _stop(p)
    assert not (run / "config.json").exists() and (run / "metrics.jsonl").exists()
    before = tree_hash(run)
    r = xtrain("train", "--data", base["data"], "--out", run, "--steps", 2, *TINY, *QUIET, cwd=tmp_path)
    check(r, 2, "holds a run that stopped before its first checkpoint")
    assert "--restart" in first_line(r.stderr) and tree_hash(run) == before
    r = xtrain("train", "--resume", run, "--steps", 2, *QUIET, cwd=tmp_path)
    check(r, 2, "nothing to resume")
    assert tree_hash(run) == before
    r = xtrain("train", "--data", base["data"], "--out", run, "--restart", "--steps", 2, *TINY, *QUIET, cwd=tmp_path)
    check(r, 0, "")
    assert [m["step"] for m in _rows(run)] == [1, 2]  # the old rows are gone, not mixed in


@pytest.mark.slow  # quick tier: tests/test_cli_args.py, the same refusals in one process ("--out {ws}/mine")
def test_out_into_a_foreign_directory_is_refused_before_any_write(base, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (mine / "metrics.jsonl").write_text('{"step": 1}\n')
    before = tree_hash(mine)
    for extra in ([], ["--restart"]):
        r = xtrain("train", "--data", base["data"], "--out", mine, "--steps", 1, *extra, *TINY, *QUIET, cwd=tmp_path)
        check(r, 2, "not empty and not an xtrain run (holds notes.txt)")
        assert tree_hash(mine) == before
    f = tmp_path / "a_file"
    f.write_text("x")
    r = xtrain("train", "--data", base["data"], "--out", f, "--steps", 1, *TINY, *QUIET, cwd=tmp_path)
    check(r, 2, "exists and is not a directory")
    assert f.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_places_are_one_line(base, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    run = tmp_path / "run"
    shutil.copytree(base["run"], run)
    os.chmod(ro, 0o555)
    os.chmod(run, 0o555)
    try:
        r = xtrain("train", "--data", base["data"], "--out", ro / "x", "--steps", 1, *TINY, *QUIET, cwd=tmp_path)
        check(r, 2, "is not writable")
        check(xtrain("train", "--resume", run, "--steps", 3, *QUIET, cwd=tmp_path), 2, "not writable")
        check(xtrain("export", base["run"], "--out", ro / "hf", cwd=tmp_path), 2, "is not writable")
        r = xtrain("data", "prepare", "--corpus", base["dir"] / "corpus", "--out", ro / "d", cwd=tmp_path)
        check(r, 2, "xtrain data: error:")
    finally:
        os.chmod(ro, 0o755)
        os.chmod(run, 0o755)


# -- data recorded absolute, with a fingerprint -----------------------------------------------------------------


@pytest.mark.slow
def test_a_relative_data_path_resumes_from_anywhere_and_changed_data_is_refused(base, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(base["data"], work / "data")
    run = work / "run"
    check(xtrain("train", "--data", "data", "--out", "run", "--steps", 2, *TINY, *QUIET, cwd=work), 0, "")
    extra = json.loads((run / "config.json").read_text())["train"]["extra"]
    assert extra["data_dir"] == str((work / "data").resolve()) and len(extra["data_fingerprint"]) == 16
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # from another working directory, naming the same data by its absolute path
    r = xtrain("train", "--resume", run, "--data", (work / "data").resolve(), "--steps", 3, *QUIET, cwd=elsewhere)
    check(r, 0, "")
    meta = json.loads((work / "data" / "meta.json").read_text())
    meta["val"]["docs"] += 1  # another preparation of the data
    (work / "data" / "meta.json").write_text(json.dumps(meta))
    before = tree_hash(run)
    r = xtrain("train", "--resume", run, "--steps", 4, *QUIET, cwd=elsewhere)
    check(r, 2, "changed since the run started")
    assert tree_hash(run) == before


# -- cheap checks first: one line, exit 2, nothing written ---------------------------------------------------


@pytest.mark.slow  # quick tier: tests/test_cli_args.py runs each of these in one process
def test_bad_values_are_one_line_and_change_nothing(base, tmp_path):
    """The same rule as tests/test_cli_args.py (which runs every command's bad arguments in one process), here as
    real processes: one line on stderr, exit code 2, nothing written."""
    out = tmp_path / "never"
    r = xtrain("train", "--data", base["data"], "--out", out, "--seed", 2**64, *TINY, *QUIET, cwd=tmp_path)
    check(r, 2, "xtrain train: error: argument --seed: must be a seed in [0, 9223372036854775807]")
    assert not out.exists() and len(r.stderr.strip().splitlines()) == 1
    before = tree_hash(base["run"])
    r = xtrain("sample", base["run"], "--max-new-tokens", -3, cwd=tmp_path)
    check(r, 2, "xtrain sample: error: argument --max-new-tokens: must be an integer in [0, 16384], got -3")
    assert len(r.stderr.strip().splitlines()) == 1
    r = xtrain("sample", base["run"], "--temperature", 1e-40, "--top-p", 1e-300, "--max-new-tokens", 3, cwd=tmp_path)
    check(r, 0, "")
    r = xtrain("serve", base["run"], "--port", 99999, cwd=tmp_path, timeout=60)
    check(r, 2, "xtrain serve: error: argument --port")
    assert len(r.stderr.strip().splitlines()) == 1
    r = xtrain("train", "--resume", base["run"], "--steps", 1, cwd=tmp_path)
    check(r, 2, f"xtrain train: --steps 1: {base['run']} is already at step 2")
    assert tree_hash(base["run"]) == before


def test_resume_with_a_corrupt_tokenizer_stops_before_training(base, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base["run"], run)
    (run / "tokenizer.json").write_text('{"model": ')
    before = tree_hash(run)
    r = xtrain("train", "--resume", run, "--steps", 3, "--no-progress", cwd=tmp_path)
    check(r, 2, "tokenizer.json")
    assert tree_hash(run) == before


# -- another world size keeps the global batch -----------------------------------------------------------------


def test_resume_batch_size_keeps_the_global_batch():
    from xtrain.config import ConfigError, TrainConfig
    from xtrain.train.cli import resume_batch_size

    def cfg(b, world, accum=1):
        return TrainConfig(steps=4, batch_size=b, seq_len=8, grad_accum=accum, extra={"world_size": world})

    assert resume_batch_size(cfg(4, 1), 2) == 2
    assert resume_batch_size(cfg(2, 2), 1) == 4
    assert resume_batch_size(cfg(3, 1), 1) == 3
    assert resume_batch_size(TrainConfig(steps=4, batch_size=3, seq_len=8), 2) == 3  # recorded nothing
    with pytest.raises(ConfigError, match="global batch of 3 sequences .* cannot be split evenly over 2 ranks"):
        resume_batch_size(cfg(3, 1), 2)
    with pytest.raises(ConfigError, match="grad-accum 2"):
        resume_batch_size(cfg(4, 1, accum=2), 4)


@pytest.mark.slow
def test_resume_under_two_ranks_keeps_the_global_batch(base, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(base["run"], one)  # 2 steps on one process, batch 4
    shutil.copytree(base["run"], two)
    check(xtrain("train", "--resume", one, "--steps", 3, *QUIET, cwd=tmp_path), 0, "")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XTRAIN_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "xtrain.cli", "train", "--resume", str(two), "--steps", "3", "--device", "cpu", *QUIET]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 sequences each keep the run's global batch of 4" in r.stdout
    train = json.loads((two / "config.json").read_text())["train"]
    assert train["batch_size"] == 2 and train["extra"]["world_size"] == 2
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    # the same step on the same 4 sequences, summed in another order (with 8 sequences it would differ ~1e-3)
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=2e-6) for k in a)
    assert any(not torch.equal(a[k], load_file(base["run"] / "model.safetensors")[k]) for k in a)


# -- xtrain serve: only JSON posts, only its own Host names -------------------------------------------------------


@pytest.mark.slow
def test_xtrain_serve_checks_host_and_content_type(base, tmp_path):
    import re

    import httpx

    p = xtrain_popen("serve", base["run"], "--port", 0, "--allow-host", "box.lan", cwd=tmp_path)
    try:
        line = p.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert m, (line, p.poll())
        url = f"http://127.0.0.1:{m.group(1)}"
        body = {"prompt": "def ", "max_tokens": 2, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert httpx.post(url + "/v1/completions", json=body, headers={"Host": "box.lan"}).status_code == 200
        r = httpx.post(url + "/v1/completions", json=body, headers={"Host": "attacker.example"}, timeout=60)
        assert r.status_code == 403 and "--allow-host attacker.example" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", content=json.dumps(body), headers={"Content-Type": "text/plain"})
        assert r.status_code == 415
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.communicate(timeout=30)
        finally:
            _stop(p)
