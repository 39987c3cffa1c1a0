"""The command line under bad inputs and contested files: each case runs the real command in a subprocess
(``python -m xtrain.cli ...``, cwd a temporary directory) and checks the exit code, the first line of what
it said on stderr, and that no file that existed before changed (every file's sha256, before and after).

One tiny run (tiny preset, vocab 300, two steps) is built once per test process (conftest.py ``cli_base``,
shared with test_preemption.py and test_disk_faults.py) and copied where a case needs a run it may touch."""

import hashlib
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

from tests._cli import QUIET, ROOT, TINY, first_line, tree_hash
from tests._cli import xtrain as _xtrain


def xtrain(*args, cwd, timeout=300, env=None):
    return _xtrain(*args, cwd=cwd, timeout=timeout, env_extra=env)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _default_sigint():
    """Run in the child before exec: SIGINT back to its default disposition, whatever the parent's (a parent
    started in the background, or by some CI runners, ignores SIGINT, and children inherit SIG_IGN: Python
    would then install no KeyboardInterrupt handler and Ctrl-C would be ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def spawn(tmp_path):
    """Start ``xtrain ...`` without waiting (SIGINT at its default disposition); every process started is
    killed when the test ends, also when it fails, so no trainer outlives its test."""
    procs = []

    def start(*args, cwd=tmp_path):
        e = {**os.environ, "PYTHONPATH": str(ROOT), "XTRAIN_CACHE": str(Path(cwd) / "cache")}
        p = subprocess.Popen(
            [sys.executable, "-m", "xtrain.cli", *map(str, args)],
            cwd=cwd,
            env=e,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_default_sigint,
        )
        procs.append(p)
        return p

    try:
        yield start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


def wait_for(cond, p, seconds=180, what=""):
    """Poll cond() until true; fails when p ends first (with its output) or the time runs out."""
    deadline = time.time() + seconds
    while not cond():
        if p.poll() is not None:
            out, err = p.communicate()
            raise AssertionError(f"process ended (rc {p.returncode}) before {what}: {out[-1500:]} {err[-1500:]}")
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def train_steps_logged(run: Path) -> int:
    try:
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.endswith("}")]
    except (FileNotFoundError, json.JSONDecodeError):
        return 0
    return max((r["step"] for r in rows if r.get("kind") == "train"), default=0)


@pytest.fixture(scope="module")
def base(cli_base):
    """{"dir": workdir, "data": prepared data dir, "run": a finished 2-step run}: tests/conftest.py cli_base, built
    once per test process."""
    return cli_base


def check(r, rc: int, first: str):
    assert r.returncode == rc, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    if first:
        assert first in first_line(r.stderr), r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def copy_run(base, name) -> Path:
    dst = base["dir"] / name
    shutil.copytree(base["run"], dst)
    return dst


# -- export ------------------------------------------------------------------------------------------------


@pytest.mark.slow  # quick tier: tests/test_cli_args.py "export {ws}/run --out {ws}/run", in one process
def test_export_into_the_run_itself_is_refused(base, tmp_path):
    before = tree_hash(base["run"])
    r = xtrain("export", base["run"], "--out", base["run"], cwd=tmp_path)
    check(r, 2, "xtrain export: export: --out")
    assert "run directory itself" in first_line(r.stderr)
    assert tree_hash(base["run"]) == before


@pytest.mark.slow  # quick tier: tests/test_cli_args.py "--out {ws}/run2" and "--out {ws}/data", in one process
def test_export_into_another_run_or_a_full_directory_is_refused(base, tmp_path):
    other = copy_run(base, "other_run_export")
    before = tree_hash(other)
    r = xtrain("export", base["run"], "--out", other, cwd=tmp_path)
    check(r, 2, "is an xtrain run directory")
    assert tree_hash(other) == before
    full = tmp_path / "notes"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    r = xtrain("export", base["run"], "--out", full, cwd=tmp_path)
    check(r, 2, "not empty and not a previous xtrain export")
    assert tree_hash(full) == {"notes.txt": hashlib.sha256(b"mine").hexdigest()}


@pytest.mark.slow  # quick tier: test_checkpoint_atomic.py (re-export over a previous export), test_disk_faults.py
def test_export_over_a_previous_export_is_allowed(base, tmp_path):
    before = tree_hash(base["run"])
    for _ in range(2):
        r = xtrain("export", base["run"], "--out", tmp_path / "hf", "--dtype", "float32", cwd=tmp_path)
        check(r, 0, "")
    assert tree_hash(base["run"]) == before
    tok = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    assert tok["post_processor"]["type"] == "TemplateProcessing"


# -- ownership of a run directory ------------------------------------------------------------------------------


def test_train_onto_a_directory_a_live_process_owns(base, tmp_path):
    owned = tmp_path / "owned"
    owned.mkdir()
    (owned / ".xtrain.lock").write_text(json.dumps({"pid": os.getpid()}))
    before = tree_hash(owned)
    r = xtrain("train", "--data", base["data"], "--out", owned, "--steps", 2, *TINY, *QUIET, cwd=tmp_path)
    check(r, 2, f"in use by process {os.getpid()}")
    assert tree_hash(owned) == before


@pytest.mark.slow  # quick tier: test_a_trainer_holding_the_lock_turns_the_second_away (--resume of a locked run)
def test_resume_of_a_run_a_live_process_owns(base, tmp_path):
    run = copy_run(base, "owned_resume")
    (run / ".xtrain.lock").write_text(json.dumps({"pid": os.getpid()}))
    before = tree_hash(run)
    r = xtrain("train", "--resume", run, "--steps", 3, *QUIET, cwd=tmp_path)
    check(r, 2, f"in use by process {os.getpid()}")
    assert tree_hash(run) == before


def test_a_stale_lock_is_taken_over_and_released(base, tmp_path):
    out = tmp_path / "stale"
    out.mkdir()
    pid = dead_pid()
    (out / ".xtrain.lock").write_text(json.dumps({"pid": pid}))
    r = xtrain("train", "--data", base["data"], "--out", out, "--steps", 1, *TINY, *QUIET, cwd=tmp_path)
    check(r, 0, f"taking over a stale lock of process {pid}")
    assert (out / "model.safetensors").is_file() and not (out / ".xtrain.lock").exists()


def test_dir_lock_excludes_a_second_owner_then_takes_over_a_dead_ones(tmp_path):
    """DirLock itself, deterministically: while another process holds the lock, acquire() fails naming it and
    leaves its lock file alone; once that process is dead, the stale lock is taken over (with a log line) and
    released again."""
    from xtrain.fileio import DirectoryBusyError, DirLock

    code = "import sys, time; from xtrain.fileio import DirLock; DirLock(sys.argv[1]).acquire(); "
    code += "print('held', flush=True); time.sleep(600)"
    e = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "d")], env=e, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = (tmp_path / "d" / ".xtrain.lock").read_text()
        with pytest.raises(DirectoryBusyError, match=f"in use by process {holder.pid}"):
            DirLock(tmp_path / "d").acquire()
        assert (tmp_path / "d" / ".xtrain.lock").read_text() == before
    finally:
        holder.kill()
        holder.wait()
    said = []
    lock = DirLock(tmp_path / "d", log=said.append).acquire()
    assert said and f"stale lock of process {holder.pid}" in said[0]
    assert json.loads((tmp_path / "d" / ".xtrain.lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / "d" / ".xtrain.lock").exists()


def test_a_trainer_holding_the_lock_turns_the_second_away(base, tmp_path, spawn):
    """Deterministic: the first trainer is seen holding the lock (its PID in .xtrain.lock) before the second
    starts, so the second can only be turned away by the lock: `--resume` of the running run (which has written
    no checkpoint yet) must name the first trainer's PID. (Two trainings started together also meet the
    config.json check, which would hide a lock that does nothing.)"""
    out = tmp_path / "held"
    first = spawn("train", "--data", base["data"], "--out", out, "--steps", 100000, *TINY, *QUIET)
    lock = out / ".xtrain.lock"

    def first_holds_the_lock():
        try:
            return json.loads(lock.read_text())["pid"] == first.pid
        except (FileNotFoundError, json.JSONDecodeError):
            return False

    wait_for(first_holds_the_lock, first, what="the first trainer to take the lock")
    r = xtrain("train", "--resume", out, *QUIET, cwd=tmp_path)
    check(r, 2, f"in use by process {first.pid}")
    assert first.poll() is None and json.loads(lock.read_text())["pid"] == first.pid


# -- resume keeps what may not change, and its log agrees with its weights -----------------------------------


@pytest.mark.slow  # quick tier: tests/test_cli_args.py "--resume {ws}/run --eval-batches 3 --lr 0.1", in one process
def test_resume_refuses_a_changed_setting(base, tmp_path):
    run = copy_run(base, "changed")
    before = tree_hash(run)
    r = xtrain("train", "--resume", run, "--steps", 3, "--eval-batches", 3, "--lr", 0.1, *QUIET, cwd=tmp_path)
    check(r, 2, "cannot change --lr 0.1")
    assert "--eval-batches 3 (the run has 1)" in r.stderr and "--steps" in r.stderr
    assert tree_hash(run) == before


def test_resume_drops_metrics_past_the_checkpoint(base, tmp_path):
    run = copy_run(base, "killed")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(m["step"] for m in rows) == 2
    # as after SIGKILL: steps logged past the last checkpoint, and a torn last line
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "train", "step": 3, "loss": 9.0}) + "\n" + '{"kind": "tr')
    r = xtrain("train", "--resume", run, "--steps", 4, *QUIET, cwd=tmp_path)
    check(r, 0, "")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_steps = [m["step"] for m in rows if m["kind"] == "train"]
    assert train_steps == [1, 2, 3, 4]
    assert all(m.get("loss") != 9.0 for m in rows)
    assert json.loads((run / "config.json").read_text())["train"]["extra"]["eval_batches"] == 1


# -- unavailable devices, impossible sizes: no run directory left ------------------------------------------------


# "tpu" is in the slow tier: tests/test_cli_args.py refuses --device tpu in one process
@pytest.mark.parametrize("device", ["cuda", pytest.param("tpu", marks=pytest.mark.slow)])
def test_train_on_an_unavailable_device(base, tmp_path, device):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "never"
    r = xtrain("train", "--data", base["data"], "--out", out, "--device", device, *TINY, *QUIET, cwd=tmp_path)
    check(r, 2, f"xtrain train: --device {device}:")
    assert len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


# slow tier: tests/test_cli_args.py refuses both in one process (cuda where there is none)
@pytest.mark.parametrize("device", [pytest.param(d, marks=pytest.mark.slow) for d in ("cuda", "tpu")])
def test_sample_on_an_unavailable_device(base, tmp_path, device):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    before = tree_hash(base["run"])
    r = xtrain("sample", base["run"], "--device", device, "--max-new-tokens", 2, cwd=tmp_path)
    check(r, 2, f"xtrain sample: --device {device}:")
    assert tree_hash(base["run"]) == before


@pytest.mark.slow  # quick tier: tests/test_cli_args.py "--seq-len 100000 --batch-size 16", in one process
def test_a_sequence_length_that_cannot_fit(base, tmp_path):
    out = tmp_path / "huge"
    r = xtrain(
        "train", "--data", base["data"], "--out", out, "--seq-len", 100000, "--batch-size", 16, *QUIET, cwd=tmp_path
    )
    check(r, 2, "xtrain train: batch 16 x seq-len 100000 needs about")
    assert not out.exists()


# -- bad data --------------------------------------------------------------------------------------------------


def _llmc_shard(path: Path):
    header = torch.zeros(256, dtype=torch.int32)
    header[0], header[1], header[2] = 20240520, 1, 1000
    path.write_bytes(header.numpy().tobytes() + torch.arange(1000, dtype=torch.int16).numpy().tobytes())


@pytest.mark.parametrize("kind", ["random", "elf", "llmc"])
def test_prepare_refuses_a_binary_file(tmp_path, kind):
    if kind == "random":
        f = tmp_path / "random.txt"
        f.write_bytes(os.urandom(50_000))
    elif kind == "elf":
        f = tmp_path / "prog"
        shutil.copyfile(sys.executable if Path(sys.executable).stat().st_size < 50_000_000 else "/bin/ls", f)
    else:
        f = tmp_path / "train_000000.bin"
        _llmc_shard(f)
    before = tree_hash(tmp_path)
    r = xtrain("data", "prepare", "--corpus", f, "--vocab-size", 257, "--out", tmp_path / "out", cwd=tmp_path)
    check(r, 2, f"xtrain data: error: {f.resolve()}: binary, not text")
    assert tree_hash(tmp_path) == before and not (tmp_path / "out").exists()


def test_prepare_skips_binary_files_of_a_directory(tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    for i in range(5):
        (d / f"t{i}.txt").write_text(f"plain text number {i}\n" * 50)
    (d / "blob.txt").write_bytes(b"\x7fELF\x00\x01" + os.urandom(4000))
    r = xtrain(
        "data", "prepare", "--corpus", d, "--vocab-size", 257, "--out", tmp_path / "out", "--no-progress", cwd=tmp_path
    )
    check(r, 0, "")
    assert "data: skipped 1 binary file(s)" in r.stdout and "blob.txt: binary, not text" in r.stdout
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    # the five text files are train (too few to split by name: val is the tail of the last one, counted in both)
    assert meta["train"]["docs"] == 5 and meta["config"]["corpus"]["split"] == "tail"


# -- what was already handled: corrupt checkpoints and shards ---------------------------------------------------


# sample reads the checkpoint through the same reader (checkpoint.read_checkpoint) as --resume: slow tier
@pytest.mark.parametrize("command", ["resume", pytest.param("sample", marks=pytest.mark.slow)])
def test_truncated_checkpoint_is_named(base, tmp_path, command):
    run = copy_run(base, f"truncated_{command}")
    data = (run / "model.safetensors").read_bytes()
    (run / "model.safetensors").write_bytes(data[: len(data) // 2])
    before = tree_hash(run)
    cmd = {"sample": ["sample", run, "--max-new-tokens", 2], "resume": ["train", "--resume", run, "--steps", 3, *QUIET]}
    r = xtrain(*cmd[command], cwd=tmp_path)
    check(r, 2, f"{run / 'model.safetensors'}: not a valid safetensors file")
    assert tree_hash(run) == before


# quick tier: test_train.py::test_files_from_different_saves_rejected (the check, at resume, nothing changed) and the
# truncated checkpoint above (a checkpoint error at --resume as one line, exit 2, nothing changed)
@pytest.mark.slow
def test_mismatched_checkpoint_files_are_named(base, tmp_path):
    run = copy_run(base, "mismatched")
    st = json.loads((run / "trainer_state.json").read_text())
    st["step"] = 7
    (run / "trainer_state.json").write_text(json.dumps(st))
    before = tree_hash(run)
    r = xtrain("train", "--resume", run, "--steps", 9, *QUIET, cwd=tmp_path)
    check(r, 2, f"{run / 'model.safetensors'}: holds step 2, but trainer_state.json says step 7")
    assert tree_hash(run) == before


def test_mismatched_shard_is_named(base, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(base["data"], data)
    shard = data / "train_000000.bin"
    raw = bytearray(shard.read_bytes())
    raw[8:12] = (10**9).to_bytes(4, "little")  # the header's token count no longer matches the file
    shard.write_bytes(bytes(raw))
    before = tree_hash(data)
    r = xtrain("train", "--data", data, "--out", tmp_path / "run", "--steps", 1, *TINY, *QUIET, cwd=tmp_path)
    check(r, 2, f"xtrain train: shard {shard}: truncated")
    assert tree_hash(data) == before and not (tmp_path / "run").exists()


# -- Ctrl-C ---------------------------------------------------------------------------------------------------


@pytest.mark.slow  # three short trainings: about a minute on a busy 2-core machine
def test_ctrl_c_then_resume_equals_an_uninterrupted_run(base, tmp_path, spawn):
    """A real SIGINT to `xtrain train` mid-run: it saves a checkpoint of the last finished step and exits 130
    within seconds, leaving no lock; `--resume` then ends at the weights and optimizer state of a run that was
    never interrupted, bit for bit."""
    from safetensors.torch import load_file

    n = 6
    common = ["train", "--data", base["data"], "--steps", n, *TINY, *QUIET]
    straight = spawn(*common, "--out", tmp_path / "straight")
    cut = tmp_path / "cut"
    p = spawn(*common, "--out", cut)
    wait_for(lambda: train_steps_logged(cut) >= 2, p, what="two logged steps")
    t0 = time.time()
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, (stdout[-2000:], stderr[-2000:])
    assert time.time() - t0 < 15 and "Traceback" not in stderr, stderr[-3000:]
    step = json.loads((cut / "trainer_state.json").read_text())["step"]
    assert 2 <= step < n and f"interrupted at step {step}" in stdout, (step, stdout[-2000:])
    assert not (cut / ".xtrain.lock").exists()
    r = xtrain("train", "--resume", cut, *QUIET, cwd=tmp_path)
    check(r, 0, "")
    assert straight.wait(timeout=300) == 0, straight.communicate()[1][-2000:]
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(str(tmp_path / "straight" / name)), load_file(str(cut / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert json.loads((cut / "trainer_state.json").read_text())["step"] == n
