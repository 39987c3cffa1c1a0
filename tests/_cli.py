"""Helpers shared by the command-line fault tests: run ``python -m xtrain.cli`` in a subprocess, hash a
directory tree, check an exit code and the first line of stderr."""

import hashlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--batch-size", "4", "--seq-len", "32", "--warmup", "1", "--eval-every", "0", "--eval-batches", "1"]
QUIET = ["--no-progress", "--sample-tokens", "0"]


def env(cwd) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "XTRAIN_CACHE": str(Path(cwd) / "cache")}


def make_base(d: Path) -> dict:
    """A prepared corpus (the source of json and pathlib cut into 40 documents, vocab 300) and a finished
    2-step tiny run under ``d``: {"dir": d, "data": prepared data dir, "run": the run}. Made in this process
    (``xtrain.cli.main``, cwd ``d``, XTRAIN_CACHE ``d/cache``): the tests start their own processes on it."""
    import inspect
    import json
    import pathlib

    import pytest

    from xtrain.cli import main

    corpus = d / "corpus"
    corpus.mkdir()
    src = inspect.getsource(json) + inspect.getsource(pathlib)
    for i in range(40):
        (corpus / f"doc{i:02d}.py").write_text(src[i * 1500 : (i + 1) * 1500])
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(d)
        mp.setenv("XTRAIN_CACHE", str(d / "cache"))
        prepare = ["data", "prepare", "--corpus", corpus, "--vocab-size", 300, "--out", d / "data", "--no-progress"]
        assert main([str(a) for a in prepare]) == 0
        train = ["train", "--data", d / "data", "--out", d / "run", "--steps", 2, *TINY, *QUIET]
        assert main([str(a) for a in train]) == 0
    return {"dir": d, "data": d / "data", "run": d / "run"}


def terminal_signals_default():
    """Run in a child before exec: SIGINT and SIGHUP back to their default dispositions, whatever the test
    process inherited. Under a parent that ignores them (a background job ignores SIGINT, ``nohup`` SIGHUP, and so
    do some CI runners) the child would inherit SIG_IGN, and xtrain keeps an inherited SIG_IGN for these two (as
    a run started so should), so a test that sends them would see them ignored."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def xtrain(*args, cwd, timeout=300, env_extra=None):
    return subprocess.run(
        [sys.executable, "-m", "xtrain.cli", *map(str, args)],
        cwd=cwd,
        env={**env(cwd), **(env_extra or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=terminal_signals_default,
    )


def xtrain_popen(*args, cwd, preexec_fn=terminal_signals_default, **kw):
    """``xtrain ...`` started without waiting; SIGINT and SIGHUP at their defaults unless ``preexec_fn`` says
    otherwise."""
    return subprocess.Popen(
        [sys.executable, "-m", "xtrain.cli", *map(str, args)],
        cwd=cwd,
        env=env(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec_fn,
        **kw,
    )


def first_line(text: str) -> str:
    return next((ln for ln in text.splitlines() if ln.strip()), "")


def tree_hash(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under root (hidden ones included); {} when root is missing."""
    root = Path(root)
    if not root.exists():
        return {}
    if root.is_file():
        return {root.name: hashlib.sha256(root.read_bytes()).hexdigest()}
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def check(r, rc: int, first: str):
    assert r.returncode == rc, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    if first:
        assert first in first_line(r.stderr), r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def has_ipv6_loopback() -> bool:
    """Whether this machine can bind ::1 (the IPv6 server tests skip without it)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False
