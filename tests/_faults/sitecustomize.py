"""A disk that fills up or turns read-only, for one child process (tests/test_disk_faults.py).

Python imports ``sitecustomize`` at start-up from its path; the tests put this folder first on the child's
PYTHONPATH and describe the fault in the environment. Without ``XTRAIN_FAULT`` nothing is changed.

    XTRAIN_FAULT         ENOSPC, EDQUOT or EROFS: the errno the file system answers with
    XTRAIN_FAULT_PREFIX  the paths on that file system (os.pathsep-separated); nothing else is touched
    XTRAIN_FAULT_AT      optional: the fault starts at the first change to a path whose name contains this
                         (e.g. "model.safetensors", ".checkpoint-next"); unset: from the start
    XTRAIN_FAULT_BUDGET  bytes still written under the prefix once the fault started (default 0); the write
                         that passes it writes what fits, then fails, as on a real full disk

Once the budget is spent, on a full disk (ENOSPC, EDQUOT) creating a file or folder and writing fail, while
removing and renaming work (they free space); on a read-only one (EROFS) every change fails, removal
included. The calls wrapped are the ones the library's writers reach: ``open`` (builtins and io, so pathlib and
os.fdopen too) in a writing mode, ``os.open`` with a writing flag, ``os.write``, ``os.mkdir``,
``os.rename``, ``os.replace``, ``os.unlink``, ``os.remove``, ``os.rmdir``, ``os.truncate``, ``os.ftruncate``,
``os.sendfile`` (shutil.copyfile).
The library's own code runs unchanged: only the answers of the file system are faked.
"""

import builtins
import errno
import io
import os

_KIND = os.environ.get("XTRAIN_FAULT")


class _Disk:
    def __init__(self, kind: str):
        self.errno = getattr(errno, kind)
        self.read_only = self.errno == errno.EROFS
        self.prefixes = [os.path.abspath(p) for p in os.environ["XTRAIN_FAULT_PREFIX"].split(os.pathsep) if p]
        self.at = os.environ.get("XTRAIN_FAULT_AT") or None
        self.armed = self.at is None
        self.budget = int(os.environ.get("XTRAIN_FAULT_BUDGET", "0"))
        self.fds: dict[int, str] = {}  # descriptors open for writing on the faulty file system -> their path

    def ours(self, path) -> bool:
        path = os.path.abspath(os.fsdecode(path))
        return any(path == p or path.startswith(p + os.sep) for p in self.prefixes)

    def fail(self, path):
        raise OSError(self.errno, os.strerror(self.errno), os.fsdecode(path))

    def change(self, path, kind: str) -> None:
        """Before a change to ``path``: "create" (a new file or folder), "write", or "other" (open an existing
        file for writing, rename, remove, truncate: they need no space, but a read-only file system refuses
        them too)."""
        if not self.ours(path):
            return
        if not self.armed and self.at in os.path.basename(os.fsdecode(path)):
            self.armed = True
        if self.armed and self.budget <= 0 and (self.read_only or kind != "other"):
            self.fail(path)

    def allowed(self, path, n: int) -> int:
        """How many of ``n`` bytes written to ``path`` fit (all when not ours or not armed)."""
        if not self.ours(path) or not self.armed:
            return n
        self.change(path, "write")
        k = min(n, self.budget)
        self.budget -= k
        return k


def _resolve(path, dir_fd):
    if dir_fd is None or isinstance(path, int):
        return path
    return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), os.fsdecode(path))


class _File:
    """A file object opened for writing on the faulty file system: its writes are counted."""

    def __init__(self, f, path):
        self._f, self._path = f, path

    def write(self, data):
        size = len(data.encode() if isinstance(data, str) else data)
        k = DISK.allowed(self._path, size)
        if k < size:
            if k:
                self._f.write(data[:k])
                self._f.flush()
            DISK.fail(self._path)
        return self._f.write(data)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        if not self._f.closed:
            DISK.fds.pop(self._f.fileno(), None)
        return self._f.close()

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _install(disk: _Disk) -> None:
    real = {n: getattr(os, n) for n in ("open", "write", "close", "mkdir", "rename", "replace", "unlink", "remove")}
    real.update(rmdir=os.rmdir, truncate=os.truncate, ftruncate=os.ftruncate, sendfile=os.sendfile, io_open=io.open)

    def open_(file, mode="r", *a, **k):
        writes = any(c in mode for c in "wax+")
        path = disk.fds.get(file) if isinstance(file, int) else file
        if not writes or path is None or not disk.ours(path):
            return real["io_open"](file, mode, *a, **k)
        if not isinstance(file, int):
            disk.change(path, "other" if os.path.exists(path) else "create")
        f = real["io_open"](file, mode, *a, **k)
        disk.fds[f.fileno()] = os.fsdecode(path)  # for os.sendfile into it (shutil.copyfile)
        return _File(f, path)

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        full = _resolve(path, dir_fd)
        writes = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        exists = os.path.lexists(full)
        if writes and disk.ours(full) and not (exists and flags & os.O_EXCL):  # EEXIST comes first
            disk.change(full, "other" if exists else "create")
        fd = real["open"](path, flags, mode, dir_fd=dir_fd)
        if writes and disk.ours(full):
            disk.fds[fd] = os.fsdecode(full)
        return fd

    def os_write(fd, data):
        path = disk.fds.get(fd)
        if path is None:
            return real["write"](fd, data)
        k = disk.allowed(path, len(data))
        if k < len(data):
            if k:
                return real["write"](fd, bytes(data)[:k])  # a short write; the next one fails
            disk.fail(path)
        return real["write"](fd, data)

    def sendfile(out_fd, in_fd, offset, count):
        path = disk.fds.get(out_fd)
        if path is not None:
            count = disk.allowed(path, count)
            if count == 0:
                disk.fail(path)
        return real["sendfile"](out_fd, in_fd, offset, count)

    def os_close(fd):
        disk.fds.pop(fd, None)
        return real["close"](fd)

    def removing(name):
        def call(path, *a, dir_fd=None, **k):
            disk.change(_resolve(path, dir_fd), "other")
            return real[name](path, *a, dir_fd=dir_fd, **k)

        return call

    def mkdir(path, mode=0o777, *, dir_fd=None):
        if not os.path.lexists(_resolve(path, dir_fd)):  # EEXIST comes first
            disk.change(_resolve(path, dir_fd), "create")
        return real["mkdir"](path, mode, dir_fd=dir_fd)

    def renaming(name):
        def call(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
            disk.change(_resolve(src, src_dir_fd), "other")
            disk.change(_resolve(dst, dst_dir_fd), "other")
            return real[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

        return call

    def truncate(path, length):
        disk.change(disk.fds.get(path, "") if isinstance(path, int) else path, "other")
        return real["truncate"](path, length)

    def ftruncate(fd, length):
        if fd in disk.fds:
            disk.change(disk.fds[fd], "other")
        return real["ftruncate"](fd, length)

    builtins.open = io.open = open_
    os.open, os.write, os.close, os.mkdir = os_open, os_write, os_close, mkdir
    os.rename, os.replace = renaming("rename"), renaming("replace")
    os.unlink, os.remove, os.rmdir = removing("unlink"), removing("remove"), removing("rmdir")
    os.truncate, os.ftruncate, os.sendfile = truncate, ftruncate, sendfile


if _KIND:
    DISK = _Disk(_KIND)
    _install(DISK)
