"""Helpers shared by the tests and the benchmarks (no test framework needed)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def poisoned():
    """Every float tensor that ``torch.empty`` / ``torch.empty_like`` allocates inside the block starts as
    NaN, so an output element a kernel fails to write shows up as NaN in the comparison."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    torch.empty = lambda *a, **k: fill(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: fill(real_empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def _written(func, args, kwargs):
    """The tensors an aten call writes in place (its schema's ``Tensor(a!)`` arguments, lists included)."""
    from torch.utils._pytree import tree_leaves

    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            yield from (t for t in tree_leaves(v) if isinstance(t, torch.Tensor))


def replay_capture(fn):
    """A CPU stand-in for ``cuda_graph_capture`` with a CUDA graph's semantics (a drop-in for the trainer's
    ``graph_capture``): -> (replay, outputs).

    Capturing runs ``fn()`` once under a dispatch mode that records every aten call (op, arguments, outputs).
    ``replay()`` re-executes the recorded calls in order on the same tensor objects and copies each result into
    the recorded output tensor (a view or an in-place result already is that memory), so later calls read the
    new values; ``outputs`` are the tensors fn returned, rewritten by each replay. Python is not re-run: what fn
    computed on the host (an int seed, a branch) is frozen at its capture-time value, as in a CUDA graph, and only
    the contents of tensors reach a replay. As a CUDA graph capture executes nothing, the capture leaves every
    tensor that existed before it as it found it: the bytes of each one the recorded calls write in place are
    saved before the first write and put back after fn returns (tensors allocated during the capture are the
    graph's own memory; their contents are whatever the recording left)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    calls: list = []
    fresh: set = set()  # storages allocated by the recorded calls
    saved: dict = {}  # storage address -> (storage, its bytes before the capture first wrote it)

    def key(t):
        return t.untyped_storage().data_ptr()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for t in _written(func, args, kwargs):
                st = t.untyped_storage()
                if st.nbytes() and key(t) not in fresh and key(t) not in saved:
                    saved[key(t)] = (st, st.clone())
            given = {key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            out = func(*args, **kwargs)
            fresh.update(key(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor) and key(t) not in given)
            calls.append((func, args, kwargs, out))  # holds every tensor alive: no address is reused
            return out

    with Record():
        outputs = fn()
    for st, before in saved.values():
        st.copy_(before)

    def replay():
        for func, args, kwargs, out in calls:
            res = func(*args, **kwargs)
            for o, r in zip(tree_leaves(out), tree_leaves(res)):
                if isinstance(o, torch.Tensor) and o.data_ptr() != r.data_ptr():
                    o.copy_(r)
                elif isinstance(r, torch.ScriptObject) and hasattr(r, "wait"):
                    # a collective's work handle (c10d): the caller waited for it outside the dispatcher; a
                    # graph's later kernels are ordered after the collective on the stream, so wait here
                    r.wait()

    return replay, outputs
