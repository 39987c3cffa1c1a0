"""Disk-fault injection for a child process: put this folder first on the child's PYTHONPATH and Python
imports it at start-up. Set by environment variables (nothing happens without XTRAIN_FAULT_PREFIX):

XTRAIN_FAULT_PREFIX   absolute path: only files and folders under it are affected
XTRAIN_FAULT          what happens there:
  EROFS               a read-only mount: opening a file for writing, mkdir (of a folder whose parent
                      exists), rename, unlink and rmdir raise OSError(EROFS), as the kernel does
  ENOSPC:N            a full disk: writes to files opened under the prefix succeed for N bytes in all,
                      then raise OSError(ENOSPC) with no file name (as a failed write()/flush() does)
  SIGINT:N / SIGTERM:N / SIGKILL:N
                      the process sends itself that signal when N bytes have been written under the
                      prefix (a real signal, delivered mid-write: Ctrl-C, a scheduler's stop, kill -9)
  SIGINT:rename=NAME  the process sends itself SIGINT right after it renamed a path under the prefix whose
                      base name is NAME (a Ctrl-C that lands between two renames)

The errors carry the real errno values and strerror texts; the code under test runs its own paths (its
open(), write(), os.replace()) and only the syscall's answer is replaced. Used by tests/test_data_faults.py.
"""

import builtins
import errno
import io
import os
import signal

_PREFIX = os.environ.get("XTRAIN_FAULT_PREFIX")
_FAULT = os.environ.get("XTRAIN_FAULT", "")


def _under(path) -> bool:
    try:
        p = os.path.abspath(os.fspath(path))
    except TypeError:  # a file descriptor
        return False
    return p == _PREFIX or p.startswith(_PREFIX.rstrip(os.sep) + os.sep)


def _err(code: int, path=None) -> OSError:
    return OSError(code, os.strerror(code), *([os.fspath(path)] if path is not None else []))


if _PREFIX and _FAULT:
    _kind, _, _n = _FAULT.partition(":")
    _rename_trigger = _n.partition("rename=")[2] if _n.startswith("rename=") else None
    _budget = [1 << 62 if _rename_trigger is not None else int(_n or 0)]
    _real_open, _real_os_open = io.open, os.open
    _real = {name: getattr(os, name) for name in ("mkdir", "rename", "replace", "unlink", "remove", "rmdir")}

    class _Counted:
        """A file object whose writes draw on the shared byte budget."""

        def __init__(self, f):
            self._f = f

        def write(self, data):
            n = len(data)
            if _budget[0] < n:
                if _kind == "ENOSPC":
                    raise _err(errno.ENOSPC)
                _budget[0] = 1 << 62  # signal once
                os.kill(os.getpid(), getattr(signal, _kind))
            _budget[0] -= n
            return self._f.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

        def __iter__(self):
            return iter(self._f)

        def __getattr__(self, name):
            return getattr(self._f, name)

    def _open(file, mode="r", *args, **kw):
        writing = any(c in mode for c in "wax+")
        if writing and _under(file):
            if _kind == "EROFS":
                raise _err(errno.EROFS, file)
            return _Counted(_real_open(file, mode, *args, **kw))
        return _real_open(file, mode, *args, **kw)

    def _os_open(path, flags, *args, **kw):
        if _kind == "EROFS" and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and _under(path):
            raise _err(errno.EROFS, path)
        return _real_os_open(path, flags, *args, **kw)

    def _mkdir(path, *args, **kw):
        if _kind == "EROFS" and _under(path) and os.path.isdir(os.path.dirname(os.path.abspath(path))):
            if os.path.exists(path):
                raise _err(errno.EEXIST, path)
            raise _err(errno.EROFS, path)
        return _real["mkdir"](path, *args, **kw)

    def _guard(name):
        real = _real[name]

        def wrapper(*paths, **kw):
            named = [p for p in paths if isinstance(p, (str, bytes, os.PathLike))]
            if _kind == "EROFS" and any(_under(p) for p in named):
                raise _err(errno.EROFS, paths[0])
            out = real(*paths, **kw)
            if (
                _rename_trigger is not None
                and name in ("rename", "replace")
                and _under(paths[0])
                and os.path.basename(os.fspath(paths[0])) == _rename_trigger
            ):
                os.kill(os.getpid(), getattr(signal, _kind))
            return out

        return wrapper

    builtins.open = io.open = _open
    os.open = _os_open
    os.mkdir = _mkdir
    for _name in ("rename", "replace", "unlink", "remove", "rmdir"):
        setattr(os, _name, _guard(_name))
