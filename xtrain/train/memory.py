"""How much memory the tape holds: the bytes of every tensor a graph keeps alive for its backward.

``retained_bytes(loss, exclude=model.parameters())`` walks the graph from ``loss`` and collects every
tensor reachable from a node: its output (``.data``) and everything its backward closure captured (the
closure cells, looking inside tuples, lists, dicts, Vars and nested closures). Tensors are counted once per
storage (views share one), and the storages of ``exclude`` (the parameters) are left out, so the number
is the activation memory the forward leaves for the backward. It is exact for what the tape holds and
needs no allocator support, so it works the same on CPU and GPU; on CUDA ``torch.cuda.max_memory_allocated``
additionally gives the true peak (which includes one block's recomputed activations during backward).
"""

from __future__ import annotations

import torch

from xtrain.autograd import Var


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr()), s.nbytes()


def _tensors_in(obj, out: list[torch.Tensor], seen: set[int], depth: int = 0) -> None:
    if depth > 6 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, Var):
        out.append(obj.data)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            _tensors_in(x, out, seen, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensors_in(x, out, seen, depth + 1)
    elif callable(obj) and getattr(obj, "__closure__", None):
        for cell in obj.__closure__:
            try:
                _tensors_in(cell.cell_contents, out, seen, depth + 1)
            except ValueError:  # empty cell
                pass


def retained_bytes(root: Var, exclude=()) -> int:
    """Bytes of distinct tensor storages the graph under ``root`` keeps for backward (see module doc)."""
    skip = {_storage_key(p.data if isinstance(p, Var) else p)[0] for p in exclude}
    tensors: list[torch.Tensor] = []
    seen_obj: set[int] = set()
    stack, visited = [root], set()
    while stack:
        node = stack.pop()
        if id(node) in visited:
            continue
        visited.add(id(node))
        tensors.append(node.data)
        if node._backward is not None:
            _tensors_in(node._backward, tensors, seen_obj)
        stack.extend(node._parents)
    total, counted = 0, set()
    for t in tensors:
        key, n = _storage_key(t)
        if key in skip or key in counted:
            continue
        counted.add(key)
        total += n
    return total
