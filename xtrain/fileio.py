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


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the renames inside the directory ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


# -- ownership of a directory -------------------------------------------------------------------------

LOCK_NAME = ".xtrain.lock"


class DirectoryBusyError(RuntimeError):
    """Another live process owns the directory (its lock file names that process)."""


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    except OSError:
        return False
    return True


def lock_owner(directory: str | os.PathLike) -> int | None:
    """The PID of the live process holding ``directory``'s lock, or None (no lock, or a stale one)."""
    try:
        pid = int(json.loads((Path(directory) / LOCK_NAME).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if _pid_alive(pid) and pid != os.getpid() else None


class DirLock:
    """Exclusive ownership of a directory by this process: ``DIR/.xtrain.lock`` created with
    O_CREAT | O_EXCL (atomic: of two processes racing, exactly one creates it) holding ``{"pid": ...}``.

    ``acquire()`` raises DirectoryBusyError naming the owner's PID when a live process holds the lock; a
    lock whose PID is no longer running (a killed process) is stale: it is taken over and ``log`` says so in
    one line. ``release()`` (also at interpreter exit, and by ``with``) removes the file if it is still ours.
    The directory is created when missing."""

    def __init__(self, directory: str | os.PathLike, log=None):
        self.dir = Path(directory)
        self.path = self.dir / LOCK_NAME
        self.log = log
        self.held = False

    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"pid": os.getpid()}) + "\n")
        return True

    def acquire(self) -> DirLock:
        import atexit

        self.dir.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            if self._try_create():
                self.held = True
                atexit.register(self.release)
                return self
            try:
                text = self.path.read_text()
                pid = int(json.loads(text)["pid"])
            except FileNotFoundError:
                continue  # released between our two looks: try again
            except (OSError, ValueError, KeyError, TypeError):
                pid = -1  # unreadable: a process killed while writing it
            if pid == os.getpid():
                raise DirectoryBusyError(f"{self.dir}: already locked by this process ({self.path})")
            if _pid_alive(pid):
                raise DirectoryBusyError(
                    f"{self.dir}: in use by process {pid} (lock file {self.path}); wait for it to finish, "
                    "or pick another directory"
                )
            # stale: move it aside atomically (of two processes taking over, one rename wins), then retry
            try:
                os.replace(self.path, self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}"))
            except FileNotFoundError:
                continue
            self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}").unlink(missing_ok=True)
            if self.log is not None:
                self.log(f"{self.dir}: taking over a stale lock of process {pid}, which is no longer running")
        raise DirectoryBusyError(f"{self.dir}: could not take the lock {self.path} (contended)")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            if int(json.loads(self.path.read_text())["pid"]) == os.getpid():
                self.path.unlink()
        except (OSError, ValueError, KeyError, TypeError):
            pass

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
