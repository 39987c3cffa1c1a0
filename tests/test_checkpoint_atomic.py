"""A checkpoint is committed as one unit: a process killed at any instant of a save leaves the previous
checkpoint or the new one, complete, bit for bit; readers racing a save never see a mix.

The kill is exhaustive and needs no hook in the library: a forked child saves with every filesystem call
(open, mkdir, fsync, rename, unlink, rmtree) counted, and dies by ``os._exit`` (no ``finally``, no atexit:
what SIGKILL leaves) right before call number n, for n = 1, 2, ... until a save completes. The CLI cases
(``xtrain train`` killed with SIGKILL while checkpointing every step, then ``--resume`` and ``sample``) are
in test_preemption.py."""

import builtins
import os
import shutil
import threading

import pytest
import torch

from tests._cli import tree_hash  # noqa: E402
from tests.test_serve import small
from xtrain.train import checkpoint as ckpt_io
from xtrain.train.optim import AdamW

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _state(step: int, seed: int):
    """A model and optimizer whose weights and moments are a function of seed, and a trainer state."""
    m = small()
    g = torch.Generator().manual_seed(seed)
    for p in m.params.values():
        p.data.copy_(torch.randn(p.data.shape, generator=g))
    opt = AdamW(m.params)
    for a, b in zip(opt.exp_avgs, opt.exp_avg_sqs):
        a.copy_(torch.randn(a.shape, generator=g))
        b.copy_(torch.rand(b.shape, generator=g))
    opt.step_count = step
    return m, opt, {"step": step, "data": None, "optimizer_step": step}


def _save(run, step, seed):
    m, opt, st = _state(step, seed)
    ckpt_io.save_checkpoint(run, model=m, optimizer=opt, trainer_state=st)
    return {k: v.clone() for k, v in m.state_dict().items()}, {k: v.clone() for k, v in opt.state_tensors().items()}


FS_CALLS = [(os, "replace"), (os, "rename"), (os, "fsync"), (os, "mkdir"), (os, "unlink"), (shutil, "rmtree")]


def _save_dying_at(run, n: int) -> bool:
    """Save step 2 (seed 2) over ``run`` in a forked child that dies before its n-th filesystem call.
    -> True when the child died (the save did not finish)."""
    return _dying_at(n, lambda: _save(run, 2, 2))


def _dying_at(n: int, work) -> bool:
    """Run ``work()`` in a forked child that dies before its n-th filesystem call -> True when it died."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            count = [0]

            def counted(f):
                def call(*a, **k):
                    count[0] += 1
                    if count[0] == n:
                        os._exit(137)
                    return f(*a, **k)

                return call

            for mod, name in FS_CALLS:
                setattr(mod, name, counted(getattr(mod, name)))
            real_open = builtins.open
            builtins.open = lambda f, mode="r", *a, **k: (counted(real_open) if "w" in mode else real_open)(
                f, mode, *a, **k
            )
            work()
            os._exit(0)
        except BaseException:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 137), f"the child failed otherwise (exit {code})"
    return code == 137


def test_one_state_saves_to_the_same_bytes(tmp_path):
    """Saves of one state are the same files byte for byte (safetensors writes its metadata keys in a random
    order; the writer sorts them), so ``cmp`` can compare a resumed run's checkpoint with an uninterrupted one's."""
    m, opt, st = _state(3, 5)
    hashes = []
    for i in range(6):
        ckpt_io.save_checkpoint(tmp_path / f"r{i}", model=m, optimizer=opt, trainer_state=st)
        hashes.append(tree_hash(tmp_path / f"r{i}"))
    assert hashes[0] and all(h == hashes[0] for h in hashes)


def test_a_kill_at_every_point_of_a_save_leaves_a_complete_checkpoint(tmp_path):
    torch.set_num_threads(1)
    old = _save(tmp_path / "ref_old", 1, 1)
    new = _save(tmp_path / "ref_new", 2, 2)
    seen, notes_seen = {}, set()
    n = 0
    while True:
        n += 1
        assert n < 200, "the save never finished"
        run = tmp_path / f"run{n}"
        _save(run, 1, 1)
        died = _save_dying_at(run, n)
        ck = ckpt_io.read_checkpoint(run)
        want = {1: old, 2: new}[ck.step]
        assert all(torch.equal(ck.model_state[k], v) for k, v in want[0].items()), (n, ck.step)
        assert all(torch.equal(ck.optim_state[k], v) for k, v in want[1].items()), (n, ck.step)
        assert len(ck.notes) <= 1, ck.notes
        for note in ck.notes:
            notes_seen.add(ckpt_io.COMMITTED if ckpt_io.COMMITTED in note else ckpt_io.STAGING)
        seen[ck.step] = seen.get(ck.step, 0) + 1
        # the owner's next save (what --resume and the next checkpoint do) settles the directory
        _save(run, 3, 3)
        assert ckpt_io.read_checkpoint(run).step == 3 and not ckpt_io.read_checkpoint(run).notes
        assert sorted(p.name for p in run.iterdir()) == sorted(ckpt_io.FILES)
        shutil.rmtree(run)
        if not died:
            break
    assert n > 10  # the save's every step was a kill point
    assert seen.get(1, 0) > 3 and seen.get(2, 0) > 3, seen  # kills before and after the commit point
    assert notes_seen == {ckpt_io.COMMITTED, ckpt_io.STAGING}, notes_seen


def test_an_interrupted_commit_is_finished_by_the_owner(tmp_path):
    run = tmp_path / "run"
    _save(run, 1, 1)
    new = _save(tmp_path / "ref", 2, 2)
    # a commit folder holding the config and state of step 2, model and optimizer already moved in place
    (run / ckpt_io.COMMITTED).mkdir()
    for name in (ckpt_io.CONFIG, ckpt_io.STATE):
        shutil.copyfile(tmp_path / "ref" / name, run / ckpt_io.COMMITTED / name)
    for name in (ckpt_io.MODEL, ckpt_io.OPTIMIZER):
        shutil.copyfile(tmp_path / "ref" / name, run / name)
    ck = ckpt_io.read_checkpoint(run)
    assert ck.step == 2 and "committed but a crash stopped it" in ck.notes[0]
    assert all(torch.equal(ck.model_state[k], v) for k, v in new[0].items())
    assert ckpt_io.finish_commit(run) and not (run / ckpt_io.COMMITTED).exists()
    assert ckpt_io.read_checkpoint(run).step == 2 and not ckpt_io.read_checkpoint(run).notes


def test_a_save_in_progress_of_a_live_owner_is_read_silently(tmp_path):
    """The save folders of a run whose lock names a live process are that owner's save in progress: a reader
    takes the current checkpoint (the committed files still waiting in ``.checkpoint-commit/``) and says nothing;
    the same folders once the owner is gone are reported, one line each. Caught: the notes added without asking
    the lock (the first read then says a crash stopped the save)."""
    import json
    import subprocess
    import sys

    run = tmp_path / "run"
    _save(run, 1, 1)
    new = _save(tmp_path / "ref", 2, 2)
    # step 2 committed, config and state still in the commit folder; a next save already staging
    (run / ckpt_io.COMMITTED).mkdir()
    for name in (ckpt_io.CONFIG, ckpt_io.STATE):
        shutil.copyfile(tmp_path / "ref" / name, run / ckpt_io.COMMITTED / name)
    for name in (ckpt_io.MODEL, ckpt_io.OPTIMIZER):
        shutil.copyfile(tmp_path / "ref" / name, run / name)
    shutil.copytree(tmp_path / "ref", run / ckpt_io.STAGING)
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / ".xtrain.lock").write_text(json.dumps({"pid": owner.pid}) + "\n")
        ck = ckpt_io.read_checkpoint(run)
        assert ck.step == 2 and ck.notes == [], ck.notes
        assert all(torch.equal(ck.model_state[k], v) for k, v in new[0].items())
    finally:
        owner.kill()
        owner.wait()
    ck = ckpt_io.read_checkpoint(run)
    assert ck.step == 2 and len(ck.notes) == 2, ck.notes
    assert "committed but a crash stopped it" in ck.notes[0] and ckpt_io.STAGING in ck.notes[1]


def test_files_mixed_by_hand_are_still_refused(tmp_path):
    run = tmp_path / "run"
    _save(run, 1, 1)
    _save(tmp_path / "other", 2, 2)
    shutil.copyfile(tmp_path / "other" / ckpt_io.STATE, run / ckpt_io.STATE)
    with pytest.raises(ckpt_io.CheckpointError, match="holds step 1, but trainer_state.json says step 2"):
        ckpt_io.read_checkpoint(run)


def test_readers_racing_a_writer_never_see_a_mix(tmp_path):
    torch.set_num_threads(1)
    run = tmp_path / "run"
    states = [_state(s, s) for s in (1, 2)]
    ckpt_io.save_checkpoint(run, model=states[0][0], optimizer=states[0][1], trainer_state=states[0][2])
    want = {s: states[s - 1][0].state_dict()["model.norm.weight"].clone() for s in (1, 2)}
    stop, errors, reads = threading.Event(), [], [0]

    def writer():
        i = 0
        while not stop.is_set():
            m, opt, st = states[i % 2]
            ckpt_io.save_checkpoint(run, model=m, optimizer=opt, trainer_state=st)
            i += 1

    def reader():
        while not stop.is_set():
            try:
                ck = ckpt_io.read_checkpoint(run)
                assert torch.equal(ck.model_state["model.norm.weight"], want[ck.step])
                reads[0] += 1
            except Exception as e:  # noqa: BLE001 - any failure is the finding
                errors.append(repr(e))

    th = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in th:
        t.start()
    deadline = threading.Event()
    deadline.wait(3.0)
    stop.set()
    for t in th:
        t.join(30)
    assert not errors, errors[:3]
    assert reads[0] > 5


@pytest.mark.parametrize("previous", [False, True])
def test_a_kill_at_every_point_of_an_export_leaves_the_old_or_the_new_export(tmp_path, previous):
    from xtrain.export import check_export_dir, export_hf

    torch.set_num_threads(1)
    old_m, new_m = _state(1, 1)[0], _state(2, 2)[0]
    export_hf(old_m.config, old_m.state_dict(), tmp_path / "ref_old", "float32")
    export_hf(new_m.config, new_m.state_dict(), tmp_path / "ref_new", "float32")
    want_old, want_new = tree_hash(tmp_path / "ref_old"), tree_hash(tmp_path / "ref_new")
    seen = set()
    n = 0
    while True:
        n += 1
        assert n < 200, "the export never finished"
        parent = tmp_path / f"p{n}"
        parent.mkdir()
        out = parent / "hf"
        if previous:
            export_hf(old_m.config, old_m.state_dict(), out, "float32")
        died = _dying_at(n, lambda out=out: export_hf(new_m.config, new_m.state_dict(), out, "float32"))
        got = tree_hash(out)
        assert got in ({}, want_new) + ((want_old,) if previous else ()), (n, sorted(got))
        seen.add("new" if got == want_new else "old" if got == want_old else "none")
        check_export_dir(out)  # a re-export is allowed, and it cleans what the killed one left
        export_hf(new_m.config, new_m.state_dict(), out, "float32")
        assert tree_hash(out) == want_new and [p.name for p in parent.iterdir()] == ["hf"]
        shutil.rmtree(parent)
        if not died:
            break
    assert n > 5
    assert seen == ({"old", "new"} if previous else {"none", "new"}), seen
