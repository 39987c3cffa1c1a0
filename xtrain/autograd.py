"""The tape: define-by-run, reverse-mode automatic differentiation over torch tensors.

A ``Var`` wraps a ``torch.Tensor`` (``.data``). An op computes its output with plain tensor maths (a kernel),
then records one node with ``Var.from_op(value, parents, backward_fn, name)``: the parents it read and a
closure that maps the upstream gradient dL/d(out) to one gradient (or ``None``) per parent. The closure
captures whatever the op saved for its backward (inputs, ``inv_rms``, the softmax output, ...).

``loss.backward()`` orders the graph topologically (iteratively: a chain of 100,000 ops must not hit
Python's recursion limit), seeds dL/dL = 1, and walks the order in reverse. Gradients that reach one Var
from several consumers are summed (fan-out; ``mul(x, x)`` passes x twice and gets both halves). Leaf Vars
created as requiring a gradient keep their gradient in ``.grad`` and accumulate across backward calls
until ``zero_grad()``; intermediate gradients live only while backward needs them.

Memory: when a node's backward has run, its gradient, closure (and with it every saved tensor) and its
parent links are dropped, so activations are freed as backward walks down the graph, as in a production
engine. A second backward through a freed graph raises an error unless the first used ``retain_graph=True``.

PyTorch's own autograd is never used here: no torch tensor is ever marked as needing a gradient; all
derivatives are ours.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Sequence

import torch

BackwardFn = Callable[[torch.Tensor], Sequence[torch.Tensor | None]]


class _GradMode(threading.local):
    """Grad mode, per thread (as torch keeps its own): a server's batcher thread running under ``no_grad``
    leaves a trainer in another thread recording its tape. Every thread starts with recording on."""

    enabled = True
    replaying = None  # the function ``checkpoint`` is re-running, during backward


_grad_mode = _GradMode()


def is_grad_enabled() -> bool:
    """Whether ops record on the tape in the calling thread."""
    return _grad_mode.enabled


def replaying():
    """The segment function the calling thread is re-running for ``checkpoint``'s backward, or None. The replay's
    output values are read by nothing (only its nodes are), so that function may skip computing a value that only its
    output depends on and that no backward reads."""
    return _grad_mode.replaying


@contextlib.contextmanager
def _grad_set(enabled: bool):
    mode = _grad_mode
    prev = mode.enabled
    mode.enabled = enabled
    try:
        yield
    finally:
        mode.enabled = prev


def no_grad():
    """Within this block the calling thread's ops record nothing on the tape (inference, optimizer updates,
    recompute). Other threads are not affected."""
    return _grad_set(False)


def enable_grad():
    """Within this block the calling thread's ops record on the tape (recompute's replay inside backward)."""
    return _grad_set(True)


@contextlib.contextmanager
def gc_paused():
    """Pause Python's cyclic garbage collector (restored on exit).

    The tape is acyclic (a node's closure references its parents, never its children), so reference
    counting frees every node; the cyclic collector only re-scans the growing graph of Vars and closures,
    which on graphs of many small ops costs more than the engine itself (measured in bench/engine.py).
    ``backward`` always runs with it paused; the trainer pauses it for the whole step.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Var:
    """A tensor on the tape. Leaves are made by the user; every other Var comes from ``Var.from_op``."""

    __slots__ = ("data", "grad", "requires_grad", "name", "_parents", "_backward", "_freed", "__weakref__")

    # make ``tensor + var`` etc. defer to Var's reflected operators
    __array_priority__ = 1000

    def __init__(self, data: torch.Tensor, requires_grad: bool = False, name: str = "leaf"):
        if isinstance(data, Var):
            raise TypeError("Var(...) expects a torch.Tensor, got a Var (use .detach() to cut the tape)")
        if not isinstance(data, torch.Tensor):
            data = torch.as_tensor(data)
        if requires_grad and not (data.is_floating_point() or data.is_complex()):
            raise ValueError(f"Var: only floating-point tensors can require grad, got {data.dtype}")
        self.data = data
        self.grad: torch.Tensor | None = None
        self.requires_grad = bool(requires_grad)
        self.name = name
        self._parents: tuple[Var, ...] = ()
        self._backward: BackwardFn | None = None
        self._freed = False

    # -- construction of op nodes ------------------------------------------------------------------
    @staticmethod
    def from_op(value: torch.Tensor, parents: Sequence[Var], backward_fn: BackwardFn, name: str) -> Var:
        """Record an op: ``value`` computed from ``parents``; ``backward_fn(dout)`` returns one gradient
        (or None) per parent, in order. Under ``no_grad`` or when no parent requires grad, no node is
        recorded and the closure (with its saved tensors) is dropped at once."""
        out = Var.__new__(Var)
        out.data = value
        out.grad = None
        out.name = name
        out._freed = False
        out.requires_grad = False
        out._parents = ()
        out._backward = None
        if _grad_mode.enabled:
            for p in parents:  # a plain loop: any(genexpr) costs more than the check itself
                if p.requires_grad:
                    out.requires_grad = True
                    out._parents = tuple(parents)
                    out._backward = backward_fn
                    break
        return out

    @property
    def is_leaf(self) -> bool:
        return self._backward is None and not self._freed

    # -- tensor-like accessors -------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def ndim(self) -> int:
        return self.data.dim()

    def dim(self) -> int:
        return self.data.dim()

    def numel(self) -> int:
        return self.data.numel()

    def size(self, dim: int | None = None):
        return self.data.shape if dim is None else self.data.shape[dim]

    def item(self) -> float:
        return self.data.item()

    def detach(self) -> Var:
        """A new leaf sharing the same tensor, cut from the tape."""
        return Var(self.data, requires_grad=False, name=self.name)

    def zero_grad(self) -> None:
        self.grad = None

    def __repr__(self) -> str:
        g = ", requires grad" if self.requires_grad else ""
        return f"Var({self.name}, shape={tuple(self.data.shape)}, dtype={self.data.dtype}{g})"

    def __len__(self) -> int:
        return len(self.data)

    # -- backward ------------------------------------------------------------------------------------
    def backward(self, grad: torch.Tensor | None = None, retain_graph: bool = False) -> None:
        """Reverse-mode sweep from this Var. ``grad`` is dL/d(self); it may be omitted for a scalar."""
        if not self.requires_grad:
            raise RuntimeError(
                f"backward: {self!r} does not require grad (no leaf that requires grad "
                "reaches it, or it was computed under no_grad)"
            )
        if grad is None:
            if self.data.numel() != 1:
                raise RuntimeError(
                    f"backward: an explicit grad is needed for a non-scalar output of shape "
                    f"{tuple(self.data.shape)}; pass grad= with that shape"
                )
            grad = torch.ones_like(self.data)
        else:
            if isinstance(grad, Var):
                grad = grad.data
            if grad.shape != self.data.shape:
                raise ValueError(f"backward: grad shape {tuple(grad.shape)} != output shape {tuple(self.data.shape)}")
        run_backward(self, grad, retain_graph)

    # -- operators map to xtrain.ops (imported lazily: ops imports this module) -----------------
    def __add__(self, other):
        from xtrain.ops import add

        return add(self, other)

    def __radd__(self, other):
        from xtrain.ops import add

        return add(other, self)

    def __sub__(self, other):
        from xtrain.ops import sub

        return sub(self, other)

    def __rsub__(self, other):
        from xtrain.ops import sub

        return sub(other, self)

    def __mul__(self, other):
        from xtrain.ops import mul

        return mul(self, other)

    def __rmul__(self, other):
        from xtrain.ops import mul

        return mul(other, self)

    def __truediv__(self, other):
        from xtrain.ops import div

        return div(self, other)

    def __rtruediv__(self, other):
        from xtrain.ops import div

        return div(other, self)

    def __matmul__(self, other):
        from xtrain.ops import matmul

        return matmul(self, other)

    def __rmatmul__(self, other):
        from xtrain.ops import matmul

        return matmul(other, self)

    def __neg__(self):
        from xtrain.ops import neg

        return neg(self)

    # Vars are graph nodes, hashed by identity (the engine keys on id()).
    __hash__ = object.__hash__


def _accumulate(node: Var, g: torch.Tensor, is_leaf: bool, owned: bool = False) -> None:
    if node.grad is None:
        # A leaf keeps the tensor it was handed, so it must own it: the op that produced g may hand the
        # same tensor to another parent (add returns dout for both), and a later += would alias. ``owned``
        # says the engine knows g is a fresh tensor nobody else holds, so the copy can be skipped.
        node.grad = g if (owned or not is_leaf) else g.clone()
    elif is_leaf:
        node.grad += g
    else:
        # Intermediate: a fresh sum, never in place (g may be a tensor the producing op still holds).
        node.grad = node.grad + g


def adds_into(fn: Callable) -> Callable:
    """Mark a backward closure that can fold the gradient sum of a parent into its own kernels.

    A node read by several ops (the residual stream: the next block's add and its norm; a norm's output: the
    q, k and v projections) collects one gradient per reader, and the engine adds them: one more pass over
    the activation each time. A backward marked ``adds_into`` is called ``fn(dout, acc)``: ``acc[i]`` is parent
    i's gradient summed so far when parent i is an intermediate node that already has one (and appears once
    among the op's parents), else None. For each parent handed an ``acc[i]`` the backward returns ``acc[i]``
    plus its own gradient (the matmul's epilogue adds it: ``addmm``; the norm's kernel reads it), as a new
    tensor: ``acc[i]`` is only read. The engine then sets that sum as the parent's gradient instead of adding.
    """
    fn.adds_into = True
    return fn


def _acc_of(p: Var, parents) -> torch.Tensor | None:
    """Parent p's gradient so far, offered to an ``adds_into`` backward: intermediate nodes only (a leaf's
    gradient is summed in place), and only when p is not read twice by the same op (two sums of one acc)."""
    if p.grad is None or p._backward is None:
        return None
    return p.grad if _count_same(parents, p) == 1 else None


def _count_same(grads, t) -> int:
    """How many entries of grads are the tensor t itself (a plain loop: cheaper than any(genexpr))."""
    n = 0
    for o in grads:
        if o is t:
            n += 1
    return n


def _topological_order(root: Var) -> list[Var]:
    """Nodes reachable from root that need a gradient, parents before children (iterative DFS)."""
    order: list[Var] = []
    visited: set[int] = set()
    stack: list[tuple[Var, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in visited:
            continue
        if node._freed:
            raise RuntimeError(
                f"backward: the graph through '{node.name}' was already freed by an earlier backward; "
                "pass retain_graph=True to the first backward() to go through it twice"
            )
        visited.add(id(node))
        stack.append((node, True))
        for p in node._parents:
            if p.requires_grad and id(p) not in visited:
                stack.append((p, False))
    return order


def run_backward(root: Var, grad: torch.Tensor, retain_graph: bool = False) -> None:
    with gc_paused():
        _run_backward(root, grad, retain_graph)


def _run_backward(root: Var, grad: torch.Tensor, retain_graph: bool) -> None:
    order = _topological_order(root)
    root_is_leaf = root._backward is None
    _accumulate(root, grad, root_is_leaf)
    for i in range(len(order) - 1, -1, -1):
        node = order[i]
        order[i] = None  # type: ignore[call-overload]  # let freed activations go
        fn = node._backward
        if fn is None:  # a leaf: its .grad is the result
            continue
        g = node.grad
        parents = node._parents
        if not retain_graph:
            node.grad = None
            node._backward = None
            node._parents = ()
            node._freed = True
        else:
            node.grad = None
        if g is None:  # nothing flowed here (e.g. every consumer returned None)
            continue
        if getattr(fn, "adds_into", False):
            accs = tuple(_acc_of(p, parents) for p in parents)
            grads = fn(g, accs)
        else:
            accs = None
            grads = fn(g)
        if len(grads) != len(parents):
            raise RuntimeError(f"backward of '{node.name}' returned {len(grads)} gradients for {len(parents)} parents")
        for j, (p, pg) in enumerate(zip(parents, grads)):
            if pg is None or not p.requires_grad:
                continue
            if pg.shape != p.data.shape:
                raise RuntimeError(
                    f"backward of '{node.name}' returned a gradient of shape "
                    f"{tuple(pg.shape)} for a parent of shape {tuple(p.data.shape)}"
                )
            if accs is not None and accs[j] is not None:
                p.grad = pg  # the op returned acc + its gradient: the sum is done
                continue
            leaf = p._backward is None
            # A gradient the op computed afresh (not the upstream g, not a view, not handed to another
            # parent too) is owned by its leaf outright; anything else is copied on first arrival. With
            # retain_graph the closure lives on and may return the same tensor again, so it is copied.
            owned = (
                leaf
                and not retain_graph
                and pg is not g
                and pg._base is None
                and (len(grads) == 1 or _count_same(grads, pg) == 1)
            )
            _accumulate(p, pg, leaf, owned)


# -- activation recompute ---------------------------------------------------------------------------


def checkpoint(fn: Callable[..., Var], *inputs):
    """Run ``fn(*inputs)`` keeping only its inputs; re-run its forward during backward.

    The forward runs under ``no_grad``, so none of the segment's activations are kept. During backward
    the segment is run again with the tape on, from fresh entry nodes holding the same input tensors, and the
    upstream gradient is pushed through that inner graph. An input that is a leaf enters as a fresh leaf; any
    other enters as an intermediate node that hands its total gradient back, so the engine sums an input's
    gradients the same way as in the plain graph (``adds_into`` for intermediates, in place for leaves).
    Parameters that ``fn`` reads directly (not via ``inputs``) are leaves, so the inner backward accumulates
    straight into their ``.grad``, as the outer one would. ``fn`` must be deterministic (dropout is: its mask
    is a pure function of the seed), so the recomputed forward equals the first one bit for bit. Non-Var
    inputs are passed through as is.
    """
    if not _grad_mode.enabled:
        return fn(*inputs)
    var_inputs = [x for x in inputs if isinstance(x, Var)]
    with no_grad():
        out = fn(*inputs)
    if not isinstance(out, Var):
        raise TypeError("checkpoint: fn must return a single Var")

    parents = list(var_inputs)
    if not any(x.requires_grad for x in var_inputs):
        # Parameters read only inside fn make the output need a gradient even when no input does: a
        # sentinel parent that requires grad keeps the node on the tape (its gradient is always None).
        parents.append(
            Var(torch.zeros((), dtype=out.data.dtype, device=out.data.device), True, name="checkpoint-sentinel")
        )

    def backward(dout: torch.Tensor):
        got: dict[int, torch.Tensor] = {}  # id(input) -> its gradient, from the entry node
        anchor = Var(torch.zeros((), dtype=out.data.dtype, device=out.data.device), True, name="checkpoint-anchor")

        def entry(x: Var) -> Var:
            if x._backward is None:  # a leaf outside, a leaf inside: its gradient lands in .grad
                return Var(x.data, requires_grad=x.requires_grad, name=x.name)

            def hand_back(d, key=id(x)):
                got[key] = d
                return (None,)

            with enable_grad():
                return Var.from_op(x.data, (anchor,), hand_back, "checkpoint-input")

        fresh = {id(x): entry(x) for x in var_inputs}
        replay = [fresh[id(x)] if isinstance(x, Var) else x for x in inputs]
        with enable_grad():
            _grad_mode.replaying, was = fn, _grad_mode.replaying
            try:
                inner = fn(*replay)
            finally:
                _grad_mode.replaying = was
        if inner.requires_grad:
            run_backward(inner, dout)
        grads = tuple(got.get(id(x), fresh[id(x)].grad) for x in var_inputs)
        return grads + (None,) * (len(parents) - len(grads))

    return Var.from_op(out.data, parents, backward, "checkpoint")
