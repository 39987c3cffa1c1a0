"""The data side under faults (issue 59): the split of a corpus too small to split by name, what
``data prepare --out`` may write into, a re-prepare that fails or is stopped midway, meta.json field checks,
tokenizers of another vocabulary, and full / too-large / read-only disks.

Disk faults run the real command in a child process: EFBIG through a real RLIMIT_FSIZE (SIGXFSZ ignored);
ENOSPC, EROFS and signals at chosen points through ``tests/fault_site/sitecustomize.py``, which replaces
only the syscall's answer (real errno values) and leaves the code paths under test as they are."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests._cli import ROOT, first_line
from xtrain.cli import main
from xtrain.data.corpus import EOT_TEXT, MIN_DOCS_BY_NAME, Document, _tail_split, is_val_key, open_corpus
from xtrain.data.prepare import OutDirRefused, load_meta, prepare
from xtrain.data.shards import ShardWriter, read_shard
from xtrain.data.tokenizer import ByteTokenizer, TokenizerMismatchError, load_tokenizer

FAULT_SITE = ROOT / "tests" / "fault_site"


def quiet(*_a, **_k):
    pass


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under root (hidden ones and folders included) -> sha256 of a file, "dir" for a folder,
    "-> target" for a symbolic link."""

    def what(p: Path) -> str:
        if p.is_symlink():
            return f"-> {os.readlink(p)}"
        return "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()

    return {p.relative_to(root).as_posix(): what(p) for p in sorted(root.rglob("*"))}


def lines_text(n: int) -> str:
    return "".join(f"{i:05d} the quick brown fox é jumps over the lazy dog {i * 7919 % 1000}\n" for i in range(n))


@pytest.fixture
def work(tmp_path):
    """tmp/work/{corpus/ (40 source files), data/ (prepared from it, BPE vocab 300)}."""
    import inspect
    import pathlib

    w = tmp_path / "work"
    corpus = w / "corpus"
    corpus.mkdir(parents=True)
    src = inspect.getsource(json) + inspect.getsource(pathlib)
    for i in range(40):
        (corpus / f"doc{i:02d}.py").write_text(src[i * 1500 : (i + 1) * 1500])
    prepare(str(corpus), w / "data", vocab_size=300, log=quiet)
    return w


def xtrain_child(*args, cwd, fault=None, prefix=None, env=None, preexec_fn=None, timeout=240):
    """``python -m xtrain.cli ARGS`` in a child, with the fault site on its path when ``fault`` is given."""
    path = [str(FAULT_SITE)] if fault else []
    e = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(ROOT)]), "XTRAIN_CACHE": str(Path(cwd) / "cache")}
    e.pop("XTRAIN_FAULT", None)
    if fault:
        e.update(XTRAIN_FAULT=fault, XTRAIN_FAULT_PREFIX=str(prefix))
    e.update(env or {})
    e = {k: v for k, v in e.items() if v is not None}
    return subprocess.run(
        [sys.executable, "-m", "xtrain.cli", *map(str, args)],
        cwd=cwd,
        env=e,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )


def prepare_args(corpus, out=None, *extra):
    return ["data", "prepare", "--corpus", corpus, "--vocab-size", 300, *(["--out", out] if out else []), *extra]


def one_line(r, rc: int, *needles: str):
    assert r.returncode == rc, (r.returncode, r.stdout[-1500:], r.stderr[-1500:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) == 1, r.stderr
    for n in needles:
        assert n in first_line(r.stderr), r.stderr


# ------------------------------------------------------------------------------------------------------
# the split of a corpus too small to split by name


def test_one_file_without_separators_has_its_tail_as_val(tmp_path):
    text = lines_text(2000)  # ~130 KB, one document
    src = tmp_path / "input.txt"
    src.write_text(text)
    logs = []
    meta = prepare(str(src), tmp_path / "data", vocab_size=257, log=logs.append)
    assert meta["train"]["tokens"] > 0 and meta["val"]["tokens"] > 0
    assert meta["config"]["corpus"]["split"] == "tail"
    assert any("val is the last 2% of the text bytes, from a line start (1 document" in ln for ln in logs), logs
    tok = ByteTokenizer()
    train = tok.decode(read_shard(tmp_path / "data" / "train_000000.bin").tolist())
    val = tok.decode(read_shard(tmp_path / "data" / "val_000000.bin").tolist())
    assert train.startswith(EOT_TEXT) and val.startswith(EOT_TEXT)
    train, val = train[len(EOT_TEXT) :], val[len(EOT_TEXT) :]
    body = text.strip()
    assert train + val == body  # val is exactly the tail, train the rest
    assert train.endswith("\n")  # cut at a line start
    cut = int(len(body.encode()) * 0.98)
    line = len(text.splitlines()[0].encode()) + 1
    assert cut <= len(train.encode()) < cut + line


def test_a_file_name_that_hashes_into_val_still_trains(tmp_path):
    name = next(f"input{i}.txt" for i in range(1000) if is_val_key(f"input{i}.txt", 0.02))
    src = tmp_path / name
    src.write_text(lines_text(300))
    meta = prepare(str(src), tmp_path / "data", vocab_size=257, log=quiet)
    assert meta["train"]["tokens"] > 0.9 * len(src.read_bytes()) and meta["val"]["tokens"] > 0


def test_the_split_rule_follows_the_document_count(tmp_path):
    def corpus_of(n: int, name: str):
        d = tmp_path / name
        d.mkdir()
        for i in range(n):
            (d / f"d{i:03d}.txt").write_text(f"document {i}\nsecond line\n")
        return d

    few = open_corpus(corpus_of(MIN_DOCS_BY_NAME - 1, "few"))
    assert few.split()["rule"] == "tail" and "99 documents, fewer than 100" in few.split_note()
    many = open_corpus(corpus_of(MIN_DOCS_BY_NAME + 20, "many"))
    assert many.split()["rule"] == "by-name" and many.describe()["split"] == "by-name"
    docs = list(many.documents())
    assert {s for s, _ in docs} == {"train", "val"}
    assert all(s == ("val" if is_val_key(d.key, 0.02) else "train") for s, d in docs)
    # enough documents, but a val fraction below the lowest of their name hashes: the tail rule, saying why
    lowest = min(int.from_bytes(hashlib.sha256(d.key.encode()).digest()[:8], "little") % 10**6 for _, d in docs)
    f = lowest / 2 / 10**6
    lone = open_corpus(tmp_path / "many", val_fraction=f)
    assert lowest >= 4 and not any(is_val_key(d.key, f) for _, d in docs)
    assert lone.split()["rule"] == "tail" and "all 120 documents on one side" in lone.split_note()
    assert [s for s, _ in lone.documents()][-1] == "val"


def test_tail_cut_points():
    def split(texts, cut):
        return [(s, d.text) for s, d in _tail_split(iter([Document(f"k{i}", t) for i, t in enumerate(texts)]), cut)]

    # inside a document: the cut moves forward to the next line start
    assert split(["ab\ncd\nef", "gh"], 4) == [("train", "ab\ncd\n"), ("val", "ef"), ("val", "gh")]
    # in a document's last line, with a next document: val starts at the next document
    assert split(["ab\ncdef", "gh"], 4) == [("train", "ab\ncdef"), ("val", "gh")]
    # in the last line of the last document: at the next character boundary (é is 2 bytes)
    assert split(["abé€xyz"], 3) == [("train", "abé"), ("val", "€xyz")]
    # on a document boundary
    assert split(["abc", "def"], 3) == [("train", "abc"), ("val", "def")]


# ------------------------------------------------------------------------------------------------------
# where data prepare may write


@pytest.mark.parametrize("case", ["run", "user-shards", "file", "data-plus-a-user-file", "dangling-link"])
def test_out_refuses_what_xtrain_did_not_write(work, case, capsys):
    out = work / "out"
    if case == "run":  # a run directory: its tokenizer.json must not be replaced
        out.mkdir()
        (out / "tokenizer.json").write_text('{"run": "tokenizer"}')
        (out / "config.json").write_text("{}")
    elif case == "user-shards":  # the user's own shards: train_000001.bin must not be deleted
        out.mkdir()
        (out / "train_000000.bin").write_bytes(b"mine")
        (out / "train_000001.bin").write_bytes(b"mine too")
    elif case == "file":
        out.write_text("a file")
    elif case == "data-plus-a-user-file":
        shutil.copytree(work / "data", out)
        (out / "notes.md").write_text("my notes")
    else:
        out.symlink_to(work / "nowhere")
    before = snapshot(work)
    rc = main([str(a) for a in prepare_args(work / "corpus", out, "--no-progress", "--force")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"xtrain data: error: {out}") and len(err.strip().splitlines()) == 1, err
    assert snapshot(work) == before
    with pytest.raises(OutDirRefused):
        prepare(str(work / "corpus"), out, vocab_size=300, force=True, log=quiet)


def test_out_takes_a_new_or_empty_folder_or_a_data_dir(work):
    (work / "empty").mkdir()
    inode = (work / "empty").stat().st_ino
    for out in (work / "empty", work / "new" / "deeper", work / "data"):
        meta = prepare(str(work / "corpus"), out, vocab_size=257, force=True, log=quiet)
        assert load_meta(out)["vocab_size"] == 257 == meta["vocab_size"]
    assert (work / "empty").stat().st_ino == inode  # the user's folder itself (maybe their shell's cwd) stays
    assert not [p for p in work.iterdir() if p.name.startswith(".")]


def test_reuse_needs_no_split_decision_and_old_data_is_rebuilt(work, monkeypatch):
    from xtrain.data.corpus import Corpus

    logs = []
    with monkeypatch.context() as m:  # reusing must not read the corpus to decide its split
        m.setattr(Corpus, "split", lambda self: pytest.fail("split decided for a reuse"))
        prepare(str(work / "corpus"), work / "data", vocab_size=300, log=logs.append)
    assert "reusing" in logs[-1]
    # data prepared before the split rule was recorded (possibly with an empty val split) is rebuilt
    meta = json.loads((work / "data" / "meta.json").read_text())
    del meta["config"]["corpus"]["split"]
    (work / "data" / "meta.json").write_text(json.dumps(meta))
    prepare(str(work / "corpus"), work / "data", vocab_size=300, log=logs.append)
    assert "wrote" in logs[-1] and load_meta(work / "data")["config"]["corpus"]["split"] == "tail"


@pytest.mark.parametrize("fault", [ValueError("a failure in the middle"), KeyboardInterrupt()])
def test_a_reprepare_that_fails_midway_keeps_the_old_data(work, fault, monkeypatch):
    before = snapshot(work)
    real_add, calls = ShardWriter.add, []

    def failing_add(self, tokens):
        calls.append(1)
        real_add(self, tokens)  # the first batch lands on disk, then the build fails
        raise fault

    monkeypatch.setattr(ShardWriter, "add", failing_add)
    with pytest.raises(type(fault)):
        prepare(str(work / "corpus"), work / "data", vocab_size=257, force=True, log=quiet)
    assert calls and snapshot(work) == before  # old data as it was, meta.json included; no staging folder
    assert load_meta(work / "data")["vocab_size"] == 300


def test_leftovers_of_a_killed_prepare_are_cleaned_up(work):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        before = snapshot(work / "data")
        # killed between the swap's two renames: the old data aside, nothing at the real name
        os.rename(work / "data", work / f".data.old-{dead.pid}")
        (work / f".data.staging-{dead.pid}").mkdir()
        (work / f".data.staging-{dead.pid}" / "train_000000.bin").write_bytes(b"half")
        (work / f".data.staging-{alive.pid}").mkdir()  # another prepare, still running
        logs = []
        prepare(str(work / "corpus"), work / "data", vocab_size=300, log=logs.append)
        assert any(f"restored {work / 'data'} from .data.old-{dead.pid}" in ln for ln in logs), logs
        assert any(f"removed {work / f'.data.staging-{dead.pid}'}" in ln for ln in logs), logs
        assert "reusing" in logs[-1] and snapshot(work / "data") == before
        assert sorted(p.name for p in work.iterdir() if p.name.startswith(".")) == [f".data.staging-{alive.pid}"]
    finally:
        alive.kill()
        alive.wait()


# ------------------------------------------------------------------------------------------------------
# meta.json fields


def _drop(key):
    return lambda m: m.pop(key)


BROKEN_META = {
    "vocab_size": (_drop("vocab_size"), "field 'vocab_size' is missing"),
    "eot_id": (lambda m: m.update(eot_id="4095"), "field 'eot_id' must be an integer in [0, 300)"),
    "train.files": (lambda m: m["train"].update(files={"a": 1}), "field 'train.files' must be a list"),
    "val.files[0]": (lambda m: m["val"]["files"][0].__setitem__(0, "../x.bin"), "field 'val.files[0]' must be"),
    "train.tokens": (lambda m: m["train"].update(tokens=m["train"]["tokens"] + 1), "field 'train.tokens' must be"),
    "tokenizer": (lambda m: m.update(tokenizer="/etc/passwd"), "field 'tokenizer' must be a file name"),
    "config.corpus": (lambda m: m["config"].pop("corpus"), "field 'config.corpus' is missing"),
    "val": (_drop("val"), "field 'val' is missing"),
    "unigram_val_loss": (lambda m: m.update(unigram_val_loss=None), "field 'unigram_val_loss' must be a number"),
}


@pytest.mark.parametrize("field", sorted(BROKEN_META))
def test_meta_json_fields_are_checked(work, field, capsys):
    edit, message = BROKEN_META[field]
    path = work / "data" / "meta.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=f"^{path}: ") as e:
        load_meta(work / "data")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert main(["data", "info", str(work / "data")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"xtrain data: error: {path}: ") and message in err and err.count("\n") == 1, err


def test_train_refuses_a_broken_meta_json(work, capsys, monkeypatch):
    monkeypatch.setenv("XTRAIN_CACHE", str(work / "cache"))
    path = work / "data" / "meta.json"
    meta = json.loads(path.read_text())
    del meta["train"]["files"]
    path.write_text(json.dumps(meta))
    rc = main(["train", "--data", str(work / "data"), "--out", str(work / "run"), "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{path}: field 'train.files' is missing" in err and err.count("\n") == 1, err
    assert not (work / "run").exists()


# ------------------------------------------------------------------------------------------------------
# tokenizers of another vocabulary


def test_a_tokenizer_of_another_vocabulary_is_refused(work, capsys, monkeypatch):
    tok_path = work / "data" / "tokenizer.json"
    assert load_tokenizer(tok_path, 300).vocab_size == 300
    with pytest.raises(TokenizerMismatchError, match=f"^{tok_path}: .* vocabulary of 300 tokens but the model has 257"):
        load_tokenizer(tok_path, 257)
    # train reading a data dir whose tokenizer.json was replaced by one of another size
    ByteTokenizer().save(tok_path)
    monkeypatch.setenv("XTRAIN_CACHE", str(work / "cache"))
    rc = main(["train", "--data", str(work / "data"), "--out", str(work / "run"), "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "vocabulary of 257 tokens" in err and "has 300" in err, err
    assert not (work / "run").exists()


@pytest.mark.slow
def test_sample_serve_export_resume_refuse_a_tokenizer_of_another_vocabulary(work, capsys, monkeypatch):
    monkeypatch.setenv("XTRAIN_CACHE", str(work / "cache"))
    run = work / "run"
    tiny = ["--batch-size", "4", "--seq-len", "32", "--warmup", "1", "--eval-every", "0", "--eval-batches", "1"]
    train = ["train", "--data", str(work / "data"), "--out", str(run), "--no-progress", "--sample-tokens", "0"]
    assert main([*train, "--steps", "2", *tiny]) == 0
    capsys.readouterr()
    ByteTokenizer().save(run / "tokenizer.json")  # another run's tokenizer (vocab 257) over this one's (300)
    before = snapshot(work)
    commands = {
        "sample": ["sample", str(run), "--max-new-tokens", "2"],
        "export": ["export", str(run), "--out", str(work / "hf")],
        "resume": ["train", "--resume", str(run), "--steps", "3", "--no-progress"],
    }
    for name, argv in commands.items():
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2, (name, rc, err)
        assert err.count("\n") == 1 and "vocabulary of 257 tokens but the model has 300" in err, (name, err)
        assert snapshot(work) == before, name
    # serve: what `xtrain serve` loads before it listens (main() would serve forever if the check were gone;
    # it prints a ValueError from here as one line with exit 2)
    from xtrain.serve.server import load_service

    try:
        service = load_service(run)
    except TokenizerMismatchError as e:
        assert "vocabulary of 257 tokens but the model has 300" in str(e)
    else:
        service.close()
        pytest.fail("serve loaded a tokenizer of another vocabulary")


# ------------------------------------------------------------------------------------------------------
# full, too-large and read-only disks; signals


@pytest.mark.parametrize("budget", [pytest.param(5_000, marks=pytest.mark.slow), 30_000])  # tokenizer.json / a shard
def test_a_full_disk_keeps_the_old_data(work, budget):
    before = snapshot(work)
    r = xtrain_child(
        *prepare_args("corpus", "data", "--force", "--no-progress"), cwd=work, fault=f"ENOSPC:{budget}", prefix=work
    )
    where = "tokenizer.json" if budget < 7000 else "train_000000.bin"
    one_line(r, 74, f"cannot write {work / 'data' / where}: no space left on device (ENOSPC)", "is unchanged")
    assert snapshot(work) == before


def test_a_full_disk_leaves_nothing_in_a_new_folder(work):
    before = snapshot(work)
    out = work / "new" / "deeper" / "data"
    r = xtrain_child(*prepare_args("corpus", out, "--no-progress"), cwd=work, fault="ENOSPC:30000", prefix=work)
    one_line(r, 74, f"cannot write {out / 'train_000000.bin'}: no space left on device (ENOSPC)", "nothing was left")
    assert snapshot(work) == before  # not even the parent folders it made


def test_a_file_size_limit_keeps_the_old_data(work):
    """``ulimit -f``: a real RLIMIT_FSIZE in the child, SIGXFSZ ignored, so write() fails with EFBIG."""

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    before = snapshot(work)
    r = xtrain_child(*prepare_args("corpus", "data", "--force", "--no-progress"), cwd=work, preexec_fn=limit)
    too_large = "file too large (over the file-size limit, ulimit -f) (EFBIG)"
    one_line(r, 74, f"cannot write {work / 'data' / 'train_000000.bin'}: {too_large}", "is unchanged")
    assert snapshot(work) == before


@pytest.mark.parametrize("where", ["out", "existing-data", "XTRAIN_CACHE", "HOME"])
def test_a_read_only_filesystem(work, where):
    ro = work / "ro"  # the mount point: it exists, nothing under it can be written
    ro.mkdir()
    env, out = {}, None
    if where == "out":
        out, named = ro / "data", ro / "data"
    elif where == "existing-data":
        shutil.copytree(work / "data", ro / "data")
        out, named = ro / "data", ro / "data"
    elif where == "XTRAIN_CACHE":
        env, named = {"XTRAIN_CACHE": str(ro / "cache")}, ro / "cache"
    else:
        (ro / "home").mkdir()
        env, named = {"XTRAIN_CACHE": None, "HOME": str(ro / "home")}, ro / "home" / ".cache"
    before = snapshot(work)
    args = prepare_args("corpus", out, "--force", "--no-progress")
    r = xtrain_child(*args, cwd=work, fault="EROFS", prefix=ro, env=env)
    one_line(r, 74, f"cannot write {named}", "read-only file system (EROFS)")
    if out is None:
        assert "set XTRAIN_CACHE to a writable folder, or pass --out" in r.stderr
    assert snapshot(work) == before


@pytest.mark.slow
def test_train_with_a_read_only_cache(work):
    ro = work / "ro"
    ro.mkdir()
    before = snapshot(work)
    r = xtrain_child(
        "train", "--data", "corpus", "--out", "run", "--steps", "1", "--no-progress",
        cwd=work, fault="EROFS", prefix=ro, env={"XTRAIN_CACHE": str(ro / "cache")},
    )  # fmt: skip
    one_line(r, 74, "xtrain train: cannot write", f"{ro / 'cache'}: read-only file system (EROFS)")
    assert snapshot(work) == before


@pytest.mark.parametrize(
    "fault, rc",
    [
        ("SIGINT:30000", 130),
        pytest.param("SIGTERM:30000", 143, marks=pytest.mark.slow),
        pytest.param("SIGINT:rename=data", 130, marks=pytest.mark.slow),
        ("SIGTERM:rename=data", 143),
    ],
)
def test_a_signal_during_a_reprepare(work, fault, rc):
    """Mid-build the old data stays; between the swap's two renames the signal waits until the new data is in."""
    before = snapshot(work)
    r = xtrain_child(*prepare_args("corpus", "data", "--force", "--no-progress"), cwd=work, fault=fault, prefix=work)
    sig = fault.split(":")[0]
    one_line(r, rc, f"({sig}); nothing half-built was left")
    if "rename" in fault:
        assert "data: wrote data (complete) before stopping" in r.stdout
        assert load_meta(work / "data")["config"]["corpus"]["split"] == "tail"
        assert {k for k in snapshot(work)} == {k for k in before}  # the same files, no leftovers
    else:
        assert snapshot(work) == before


@pytest.mark.parametrize("fault", ["SIGKILL:30000", "SIGKILL:rename=data"])
def test_kill_9_leaves_folders_the_next_run_cleans_up(work, fault):
    before = snapshot(work)
    r = xtrain_child(*prepare_args("corpus", "data", "--force", "--no-progress"), cwd=work, fault=fault, prefix=work)
    assert r.returncode == -signal.SIGKILL
    left = sorted(p.name for p in work.iterdir() if p.name.startswith("."))
    assert left and all(n.startswith((".data.staging-", ".data.old-")) for n in left)
    r = xtrain_child(*prepare_args("corpus", "data", "--no-progress"), cwd=work)
    assert r.returncode == 0, r.stderr
    assert "left by a prepare" in r.stdout and "reusing" in r.stdout
    assert snapshot(work) == before
