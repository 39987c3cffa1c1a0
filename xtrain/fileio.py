"""Atomic file writes: every file xtrain writes (checkpoints, tokenizers, data meta) goes to a temporary
name in the same directory, is flushed to disk, then renamed over the real name, so a crash never leaves a
half-written file under the real name (``os.replace`` is atomic on POSIX and Windows).

Write failures of the disk: a write that fails because the file system is full (ENOSPC, EDQUOT), a file would
pass the file-size limit (EFBIG: ``ulimit -f``; Python ignores SIGXFSZ, so the write fails instead of the
process dying) or the file system is read-only (EROFS) is raised as ``WriteFailed``, whose text is one line
naming the file and the cause ("cannot write RUN/model.safetensors: no space left on device"). Every writer
of xtrain goes through ``writing(path)`` (the atomic writers and ``AppendLog`` do it for theirs), and the
``xtrain`` command turns a ``WriteFailed`` (or any OSError of these kinds that reaches it) into that line
on stderr and exit code ``EXIT_WRITE_FAILED``. The writers clean up what the failed write left (a temporary
file, a staging folder) before raising, so what was there before stays as it was.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path

EXIT_WRITE_FAILED = 74  # sysexits.h EX_IOERR: a write failed (disk full, file too large, read-only)

# errno -> the cause, as the one-line message says it
DISK_ERRORS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (over the file-size limit, ulimit -f)",
    errno.EROFS: "read-only file system",
}


class WriteFailed(OSError):
    """A write failed for a reason of the file system (``DISK_ERRORS``); ``str()`` is the one-line message.
    ``filename`` is the file (or folder) being written, ``errno`` the cause."""

    def __str__(self) -> str:
        return f"cannot write {self.filename}: {self.strerror}"


def write_failure(e: BaseException, path: str | os.PathLike | None = None) -> WriteFailed | None:
    """The one classification of write errors: a ``WriteFailed`` naming ``path`` (else the file the error
    names) when ``e`` is an OSError of the disk, None for anything else (a bug, a permission, a missing
    folder: those keep their own handling)."""
    if isinstance(e, WriteFailed):
        return e
    if not isinstance(e, OSError) or e.errno not in DISK_ERRORS:
        return None
    where = path if path is not None else (e.filename if e.filename is not None else "(a file)")
    return WriteFailed(e.errno, DISK_ERRORS[e.errno], os.fspath(where))


def not_writable(path: str | os.PathLike) -> str | None:
    """Why the existing folder ``path`` cannot be written into ("read-only file system", "no write
    permission"), or None when it can: for refusing an output folder before anything is written."""
    if os.access(path, os.W_OK | os.X_OK):
        return None
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs (Windows)
        read_only = False
    return "read-only file system" if read_only else "no write permission"


@contextlib.contextmanager
def writing(path: str | os.PathLike):
    """Writes in this block that fail for a reason of the disk raise ``WriteFailed`` naming ``path``."""
    try:
        yield
    except OSError as e:
        failed = write_failure(e, path)
        if failed is None or failed is e:
            raise
        raise failed from e


def safetensors_bytes(tensors: dict, metadata: dict[str, str]) -> bytes:
    """The safetensors file of ``tensors`` with ``metadata``, the same bytes for the same tensors and metadata.
    safetensors writes a metadata map's keys in a random order, so two saves of one state could differ byte for
    byte; the header is re-written with the keys sorted (the same keys and values, so the same length)."""
    from safetensors.torch import save

    data = bytearray(save(tensors, metadata=metadata))
    n = int.from_bytes(data[:8], "little")
    header = json.loads(bytes(data[8 : 8 + n]))
    header = {"__metadata__": dict(sorted(header.pop("__metadata__").items())), **header}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > n:  # not the compact JSON safetensors writes: keep its bytes rather than guess
        return bytes(data)
    data[8 : 8 + n] = text + b" " * (n - len(text))
    return bytes(data)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary name, fsync'ed, then renamed over it. On any failure the
    temporary file is removed and ``path`` is as it was; a failure of the disk is ``WriteFailed`` naming
    ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with writing(path):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):  # on a read-only file system nothing can be removed either
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


class AppendLog:
    """A file that grows by whole lines (metrics.jsonl): each ``write(line)`` appends it with unbuffered
    writes. A line that cannot be written completely is taken back (the file is cut to its size before it,
    which needs no space), so the file never ends in a torn line, and ``WriteFailed`` names the file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with writing(self.path):
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, line: str) -> None:
        data = line.encode("utf-8")
        size = os.fstat(self.fd).st_size
        try:
            with writing(self.path):
                view = memoryview(data)
                while view:
                    view = view[os.write(self.fd, view) :]
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, size)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


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
        with writing(self.path):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps({"pid": os.getpid()}) + "\n")
            except BaseException:  # an empty lock file would read as a stale one: leave none
                with contextlib.suppress(OSError):
                    self.path.unlink()
                raise
        return True

    def acquire(self) -> DirLock:
        import atexit

        with writing(self.dir):
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
                with writing(self.path):
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
