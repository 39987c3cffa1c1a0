"""Full and read-only disks, as real commands: a write the disk refuses (ENOSPC, EDQUOT, EFBIG from ``ulimit -f``,
EROFS) is one line on stderr naming the file and the cause and exit code 74; the previous checkpoint or export is
bit for bit as it was and still loads; nothing half-written stays (staging folders, temporary files, torn lines).

EFBIG is real: the child runs under ``RLIMIT_FSIZE`` (SIGXFSZ ignored, as Python does anyway). A full or
read-only file system needs no mount: ``tests/_faults/sitecustomize.py``, first on the child's PYTHONPATH,
makes the child's file system calls under a path answer ENOSPC or EROFS from a chosen point on, so the
library's own code runs unchanged. One tiny run (vocab 300, two steps) is built once per test process
(conftest.py ``cli_base``)."""

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._cli import QUIET, ROOT, TINY, env, tree_hash
from xtrain.fileio import EXIT_WRITE_FAILED, LOCK_NAME, WriteFailed, lock_owner, write_failure, writing
from xtrain.train import checkpoint as ckpt_io

FAULTS = ROOT / "tests" / "_faults"
CKPT = set(ckpt_io.FILES)


@pytest.fixture(scope="module")
def base(cli_base):
    """{"dir": workdir, "data": prepared data dir, "run": a finished 2-step run}: tests/conftest.py cli_base, built
    once per test process."""
    return cli_base


def _child_setup(fsize):
    def setup():
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a parent run in the background ignores SIGINT
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return setup


def faulty(*args, cwd, fault=None, prefix=None, at=None, budget=0, fsize=None, extra=None, wait=True):
    """``xtrain ARGS`` in a child whose file system under ``prefix`` answers ``fault`` (ENOSPC, EROFS) from
    the first change to a path named like ``at`` on (after ``budget`` more bytes), or that runs under a
    file-size limit of ``fsize`` bytes. ``wait=False``: the Popen (the caller ends it)."""
    e = {**env(cwd), **(extra or {})}
    if fault is not None:
        e.update(
            PYTHONPATH=os.pathsep.join([str(FAULTS), str(ROOT)]),
            XTRAIN_FAULT=fault,
            XTRAIN_FAULT_PREFIX=os.pathsep.join(map(str, prefix if isinstance(prefix, list) else [prefix])),
            XTRAIN_FAULT_BUDGET=str(budget),
        )
        if at is not None:
            e["XTRAIN_FAULT_AT"] = at
    cmd = [sys.executable, "-m", "xtrain.cli", *map(str, args)]
    kw = dict(cwd=cwd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return subprocess.Popen(cmd, preexec_fn=_child_setup(fsize), **kw)
    return subprocess.run(cmd, preexec_fn=_child_setup(fsize), timeout=300, **kw)


def one_line(r, pattern: str):
    """Exit 74, and stderr is exactly one line, matching ``pattern`` (a regex), with no traceback."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == EXIT_WRITE_FAILED, (r.returncode, r.stdout[-1500:], r.stderr[-3000:])
    assert len(lines) == 1, r.stderr[-3000:]
    assert re.fullmatch(pattern, lines[0]), (pattern, lines[0])


def copy_run(base, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base["run"], run)
    return run


def assert_checkpoint_as_before(run: Path, before: dict[str, str], step: int = 2, read_only: bool = False):
    """The run holds exactly the files it held (no staging folder, no temporary file, no lock), every one
    bit-identical but metrics.jsonl, whose old rows are intact; the checkpoint loads, with no note.
    ``read_only``: the lock could not be removed either; it must name no live process (a stale lock)."""
    after = tree_hash(run)
    if read_only and LOCK_NAME in after:
        assert lock_owner(run) is None
        del after[LOCK_NAME]
    assert set(after) == set(before), sorted(set(after) ^ set(before))
    assert all(after[n] == before[n] for n in before if n != "metrics.jsonl"), "a file of the run changed"
    ck = ckpt_io.read_checkpoint(run)
    assert ck.step == step and not ck.notes, (ck.step, ck.notes)


def train_rows(run: Path) -> list[int]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [m["step"] for m in rows if m.get("kind") == "train"]


# -- the rule -------------------------------------------------------------------------------------------------


def test_the_classification_names_the_file_and_the_cause(tmp_path):
    import errno

    for code, cause in [(errno.ENOSPC, "no space left"), (errno.EFBIG, "file too large"), (errno.EROFS, "read-only")]:
        with pytest.raises(WriteFailed) as e, writing(tmp_path / "f"):
            raise OSError(code, os.strerror(code))
        assert str(e.value).startswith(f"cannot write {tmp_path / 'f'}: {cause}"), str(e.value)
    assert write_failure(PermissionError(errno.EACCES, "denied")) is None  # not the disk's: handled elsewhere
    assert write_failure(ValueError("x")) is None
    assert "cannot write /x/y: no space" in str(write_failure(OSError(errno.ENOSPC, "No space", "/x/y")))


# -- checkpoints: periodic, final, on a signal -----------------------------------------------------------------


def test_a_full_disk_in_a_periodic_save_stops_the_run_and_keeps_the_checkpoint(base, tmp_path):
    run = copy_run(base, tmp_path)
    before = tree_hash(run)
    r = faulty(
        "train", "--resume", run, "--steps", 6, "--ckpt-every", 1, *QUIET,
        cwd=tmp_path, fault="ENOSPC", prefix=run, at="model.safetensors", budget=4096,
    )  # fmt: skip
    one_line(r, rf"xtrain train: cannot write {run}/\.checkpoint-next/model\.safetensors: no space left on device")
    assert_checkpoint_as_before(run, before)
    assert train_rows(run)[-1] == 3  # the save of step 3 failed: the run stopped there, not at step 6


def test_a_file_size_limit_in_the_final_save(base, tmp_path):
    run = copy_run(base, tmp_path)
    before = tree_hash(run)
    r = faulty("train", "--resume", run, "--steps", 3, *QUIET, cwd=tmp_path, fsize=1 << 20)
    one_line(r, rf"xtrain train: cannot write {run}/\.checkpoint-next/model\.safetensors: file too large .*ulimit -f.*")
    assert_checkpoint_as_before(run, before)


def test_a_read_only_file_system_at_the_save(base, tmp_path):
    run = copy_run(base, tmp_path)
    before = tree_hash(run)
    r = faulty(
        "train", "--resume", run, "--steps", 3, *QUIET, cwd=tmp_path, fault="EROFS", prefix=run, at=".checkpoint-next"
    )
    one_line(r, rf"xtrain train: cannot write {run}/\.checkpoint-next: read-only file system")
    assert_checkpoint_as_before(run, before, read_only=True)


@pytest.mark.slow
def test_a_file_system_turning_read_only_mid_save_leaves_the_previous_checkpoint(base, tmp_path):
    """Nothing can be removed any more: the staging folder stays, readers ignore it, and the next --resume
    (the disk writable again) drops it and continues."""
    run = copy_run(base, tmp_path)
    before = tree_hash(run)
    r = faulty(
        "train", "--resume", run, "--steps", 3, *QUIET, cwd=tmp_path, fault="EROFS", prefix=run, at="model.safetensors"
    )
    one_line(r, rf"xtrain train: cannot write {run}/\.checkpoint-next/model\.safetensors: read-only file system")
    after = tree_hash(run)
    assert lock_owner(run) is None  # the lock could not be removed either: a stale one, taken over next time
    assert {n for n in after if not n.startswith(ckpt_io.STAGING)} - {LOCK_NAME} == set(before)
    assert all(after[n] == before[n] for n in before if n != "metrics.jsonl")
    ck = ckpt_io.read_checkpoint(run)
    assert ck.step == 2 and "ignoring .checkpoint-next/" in ck.notes[0], ck.notes
    r = faulty("train", "--resume", run, "--steps", 3, *QUIET, cwd=tmp_path)
    assert r.returncode == 0 and "dropped .checkpoint-next/" in r.stdout, r.stderr[-2000:]
    assert ckpt_io.read_checkpoint(run).step == 3 and not (run / ckpt_io.STAGING).exists()


@pytest.mark.slow
def test_the_save_on_sigterm_on_a_full_disk(base, tmp_path):
    """The signal's save fails: exit 74 (not 143), one line, the previous checkpoint kept. (SIGINT and SIGHUP
    stop through the same save, at the end of ``Trainer.fit``.)"""
    run = copy_run(base, tmp_path)
    before = tree_hash(run)
    p = faulty(
        "train", "--resume", run, "--steps", 2000, *QUIET,
        cwd=tmp_path, fault="ENOSPC", prefix=run, at="model.safetensors", wait=False,
    )  # fmt: skip
    try:
        deadline = time.time() + 120
        while not (run / "metrics.jsonl").read_text().count('"step": 4,'):
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    one_line(r, rf"xtrain train: cannot write {run}/\.checkpoint-next/model\.safetensors: no space left on device")
    assert "checkpoint saved" not in out
    assert_checkpoint_as_before(run, before)
    assert 4 <= train_rows(run)[-1] < 2000


# -- the run directory's other files ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_metrics_row_the_disk_refuses_is_taken_back(base, tmp_path):
    run = copy_run(base, tmp_path)
    before = tree_hash(run)
    r = faulty(
        "train", "--resume", run, "--steps", 4, *QUIET, cwd=tmp_path, fault="ENOSPC", prefix=run, at="metrics.jsonl",
        budget=40,
    )  # fmt: skip
    one_line(r, rf"xtrain train: cannot write {run}/metrics\.jsonl: no space left on device")
    assert_checkpoint_as_before(run, before)
    assert tree_hash(run)["metrics.jsonl"] == before["metrics.jsonl"]  # the torn row is gone; the run stopped


@pytest.mark.slow
def test_the_loss_plot_on_a_full_disk(base, tmp_path):
    """Training and its checkpoint are done; the plot fails: one line, the old loss.png, no temporary file."""
    run = copy_run(base, tmp_path)
    before = tree_hash(run)
    r = faulty(
        "train",
        "--resume",
        run,
        "--steps",
        3,
        *QUIET,
        cwd=tmp_path,
        fault="ENOSPC",
        prefix=run,
        at="loss.png",
        budget=1000,
    )
    one_line(r, rf"xtrain train: cannot write {run}/loss\.png: no space left on device")
    after = tree_hash(run)
    assert set(after) == set(before) and after["loss.png"] == before["loss.png"]
    assert ckpt_io.read_checkpoint(run).step == 3


@pytest.mark.slow
def test_a_new_run_on_a_full_disk(base, tmp_path):
    """The tokenizer copy fails part-way, then (another try) making the run directory: each one line, and
    nothing half-written is left."""
    new = tmp_path / "new"
    args = ("train", "--data", base["data"], "--out", new, "--steps", 2, *TINY, *QUIET)
    r = faulty(*args, cwd=tmp_path, fault="ENOSPC", prefix=tmp_path, at="tokenizer.json", budget=100)
    one_line(r, rf"xtrain train: cannot write {new}/tokenizer\.json: no space left on device")
    assert os.listdir(new) == []
    shutil.rmtree(new)
    r = faulty(*args, cwd=tmp_path, fault="ENOSPC", prefix=new)
    one_line(r, rf"xtrain train: cannot write {new}: no space left on device")
    assert not new.exists()


@pytest.mark.slow
def test_home_and_the_cache_on_a_read_only_file_system(base, tmp_path):
    """A run with prepared data caches nothing: it finishes and says nothing on stderr (matplotlib's own
    cache falls back quietly); data that must first be prepared into $XTRAIN_CACHE is one line."""
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    ro = dict(fault="EROFS", prefix=[home, cache], extra={"HOME": str(home), "XTRAIN_CACHE": str(cache)})
    r = faulty(
        "train", "--data", base["data"], "--out", tmp_path / "r", "--steps", 2, *TINY, *QUIET, cwd=tmp_path, **ro
    )
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr[-3000:]
    assert ckpt_io.read_checkpoint(tmp_path / "r").step == 2 and (tmp_path / "r" / "loss.png").is_file()
    r = faulty("export", tmp_path / "r", "--out", tmp_path / "hf", cwd=tmp_path, **ro)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr[-3000:]
    r = faulty("train", "--data", base["dir"] / "corpus", "--out", tmp_path / "r2", *TINY, *QUIET, cwd=tmp_path, **ro)
    one_line(r, rf"xtrain train: cannot write {cache}\S*: read-only file system \(EROFS\); .*")
    assert os.listdir(home) == [] and not cache.exists()


# -- export ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(base) -> Path:
    """A finished export of the base run (bfloat16), made in this process."""
    from xtrain.cli import main

    out = base["dir"] / "hf"
    assert main(["export", str(base["run"]), "--out", str(out)]) == 0
    return out


def _previous_export(exported, tmp_path) -> tuple[Path, dict]:
    out = tmp_path / "hf"
    shutil.copytree(exported, out)
    return out, tree_hash(out)


def test_export_on_a_full_disk_keeps_the_previous_export(base, exported, tmp_path):
    out, before = _previous_export(exported, tmp_path)
    r = faulty(
        "export", base["run"], "--out", out, "--dtype", "float32",
        cwd=tmp_path, fault="ENOSPC", prefix=tmp_path, at="model.safetensors", budget=4096,
    )  # fmt: skip
    one_line(r, rf"xtrain export: cannot write {tmp_path}/\.hf\.export-\d+/model\.safetensors: no space left on device")
    assert tree_hash(out) == before and os.listdir(tmp_path) == ["hf"]  # no staging folder left


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["EFBIG", "EROFS", "ENOSPC-tokenizer"])
def test_export_failures_keep_the_previous_export(base, exported, tmp_path, fault):
    out, before = _previous_export(exported, tmp_path)
    args = ("export", base["run"], "--out", out)
    if fault == "EFBIG":
        r = faulty(*args, cwd=tmp_path, fsize=1 << 20)
        cause, name = r"file too large .*", r"model\.safetensors"
    elif fault == "EROFS":  # read-only from the start of the staging folder
        r = faulty(*args, cwd=tmp_path, fault="EROFS", prefix=tmp_path, at=".hf.export-")
        cause, name = "read-only file system", ""
    else:
        r = faulty(*args, cwd=tmp_path, fault="ENOSPC", prefix=tmp_path, at="tokenizer.json", budget=100)
        cause, name = "no space left on device", r"tokenizer\.json"
    staged = rf"{tmp_path}/\.hf\.export-\d+" + (f"/{name}" if name else "")
    one_line(r, rf"xtrain export: cannot write {staged}: {cause}")
    assert tree_hash(out) == before and os.listdir(tmp_path) == ["hf"]
