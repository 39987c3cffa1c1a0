"""Atomic file writes: every file xtrain writes (checkpoints, tokenizers, data meta) goes to a temporary
name in the same directory, is flushed to disk, then renamed over the real name, so a crash never leaves a
half-written file under the real name (``os.replace`` is atomic on POSIX and Windows)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")
