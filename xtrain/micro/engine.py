"""The scalar autograd engine: one ``Value`` per number, one node per op.

Each ``Value`` holds its number (``data``), dL/d(self) (``grad``), the Values it was computed from
(``_children``) and, in the same order, the local derivative d(self)/d(child) (``_local_grads``). The
local derivatives are known the moment an op runs, so they are stored then; ``backward()`` only has to
apply the chain rule, ``child.grad += local * v.grad``, walking the graph from the loss to the leaves.

Primitive ops (each writes its own local derivative):

    a + b      d/da = 1, d/db = 1
    a * b      d/da = b, d/db = a
    a ** n     d/da = n * a**(n-1)       (n a plain number; Value ** Value is not supported)
    a.log()    d/da = 1/a                (a > 0)
    a.exp()    d/da = exp(a)
    a.relu()   d/da = 1 if a > 0 else 0  (the subgradient 0 at a == 0)
    vsum(xs)   one node, len(xs) children, each local derivative 1
    dot(ws,xs) one node, 2n children: d/dw_i = x_i, d/dx_i = w_i

Derived ops are compositions, so their gradients come for free: ``-a = a * -1``, ``a - b = a + (-b)``,
``a / b = a * b**-1``, and the reflected forms ``2 + a``, ``2 - a``, ``2 * a``, ``2 / a``. A plain-number
operand is folded into the node as a constant (``a + 2`` is one node with one child), so constants never
appear in the graph.

``vsum`` and ``dot`` are the fused helpers that make a pure-Python GPT bearable: ``sum(xs)`` builds a chain
of n-1 add nodes, ``vsum(xs)`` one node with n children; ``dot`` is the body of a linear layer.

Gradients accumulate into leaves. ``backward()`` first resets every intermediate node's ``grad`` to 0, then
adds each path's contribution (``+=``: that is how fan-out is summed), so a leaf's ``grad`` grows by dL/dleaf
on every call. Zero leaf grads between backward calls (``Adam.step`` does; ``loss.zero_grad()`` zeroes
every node reachable from ``loss``): two backward calls with a zero in between give the same grads, two
without one give exactly twice the grads.
"""

from __future__ import annotations

import math
import numbers
import operator

__all__ = ["Value", "vsum", "dot"]


def _number(x, op: str) -> float:
    """A plain-number operand for ``op``, or a TypeError naming the op."""
    t = type(x)
    if t is float:  # the fast path: the ABC check below costs ~10x more
        return x
    if t is int:
        return float(x)
    if isinstance(x, numbers.Real) and not isinstance(x, bool):  # numpy scalars, Fractions, ...
        return float(x)
    raise TypeError(f"Value {op}: operand must be a Value or a real number, got {type(x).__name__}")


class Value:
    """A scalar in the computation graph. Leaves (parameters, inputs) are built as ``Value(number)``."""

    # No per-instance __dict__: a training step makes ~10^5 nodes, and slots are smaller and faster.
    __slots__ = ("data", "grad", "_children", "_local_grads")

    def __init__(self, data, children: tuple = (), local_grads: tuple = ()):
        if not children:  # a leaf: check the number once here (op results are floats by construction)
            data = _number(data, "leaf")
        self.data = data
        self.grad = 0.0
        self._children = children
        self._local_grads = local_grads

    def __repr__(self) -> str:
        return f"Value(data={self.data:.6g}, grad={self.grad:.6g})"

    # -- primitive ops -------------------------------------------------------------------------------
    def __add__(self, other):
        if isinstance(other, Value):
            return Value(self.data + other.data, (self, other), (1.0, 1.0))
        return Value(self.data + _number(other, "+"), (self,), (1.0,))

    def __mul__(self, other):
        if isinstance(other, Value):
            return Value(self.data * other.data, (self, other), (other.data, self.data))
        c = _number(other, "*")
        return Value(self.data * c, (self,), (c,))

    def __pow__(self, n):
        if isinstance(n, Value):
            raise TypeError(
                "Value **: the exponent must be a plain number, not a Value "
                "(Value ** Value is not supported; write (b * a.log()).exp() for a**b)"
            )
        n = _number(n, "**")
        x = self.data
        if x == 0.0 and n < 1.0 and n != 0.0:
            # 0**-1 is a division by zero; 0**0.5 is finite but its slope is not
            raise ZeroDivisionError(f"Value **: 0.0 ** {n} has no finite derivative (division by zero?)")
        if x < 0.0 and not n.is_integer():
            raise ValueError(f"Value **: negative base {x} with non-integer exponent {n} is not real")
        try:
            return Value(x**n, (self,), (n * x ** (n - 1.0) if n != 0.0 else 0.0,))
        except OverflowError:
            raise OverflowError(f"Value **: {x} ** {n} overflows a float") from None

    def __rpow__(self, base):
        raise TypeError(
            f"Value **: the exponent must be a plain number, not a Value "
            f"({type(base).__name__} ** Value is not supported; write (v * math.log(base)).exp())"
        )

    def log(self):
        x = self.data
        if x <= 0.0:
            raise ValueError(f"Value log: input must be positive, got {x}")
        return Value(math.log(x), (self,), (1.0 / x,))

    def exp(self):
        try:
            e = math.exp(self.data)
        except OverflowError:
            raise OverflowError(f"Value exp: exp({self.data}) overflows a float") from None
        return Value(e, (self,), (e,))

    def relu(self):
        x = self.data
        return Value(x if x > 0.0 else 0.0, (self,), (1.0 if x > 0.0 else 0.0,))

    # -- derived ops: compositions of the primitives ---------------------------------------------------
    def __neg__(self):
        return self * -1.0

    def __sub__(self, other):
        if isinstance(other, Value):
            return self + (-other)
        return self + (-_number(other, "-"))

    def __truediv__(self, other):
        if isinstance(other, Value):
            return self * other**-1.0
        c = _number(other, "/")
        if c == 0.0:
            raise ZeroDivisionError("Value /: division by zero")
        return self * (1.0 / c)

    def __radd__(self, other):  # 2 + v
        return self + _number(other, "+")

    def __rsub__(self, other):  # 2 - v
        return (-self) + _number(other, "-")

    def __rmul__(self, other):  # 2 * v
        return self * _number(other, "*")

    def __rtruediv__(self, other):  # 2 / v
        return self**-1.0 * _number(other, "/")

    # -- backward ------------------------------------------------------------------------------------
    def _topo(self) -> list[Value]:
        """Every node reachable from self, each after all of its children (iterative post-order DFS:
        a 200k-long chain must not hit Python's recursion limit)."""
        topo: list[Value] = []
        visited: set[Value] = set()  # Values hash by identity
        stack: list[tuple[Value, bool]] = [(self, False)]
        append, pop, push, seen = topo.append, stack.pop, stack.append, visited.add
        while stack:
            v, expanded = pop()
            if expanded:  # all of v's children are in topo now
                append(v)
                continue
            if v in visited:  # pushed twice (shared subexpression) and expanded already
                continue
            seen(v)
            push((v, True))
            for c in v._children:
                # A child that is visited but not yet in topo would have to be an ancestor of v (its
                # (c, True) entry is still below v on the stack): a cycle, impossible in a DAG. So
                # skipping visited children never lets a parent land before its child.
                if c not in visited:
                    push((c, False))
        return topo

    def backward(self) -> None:
        """dL/d(node) for every node reachable from self (L = self), by the chain rule in reverse
        topological order.

        Leaves (parameters, inputs) accumulate: their ``grad`` grows by this backward's contribution, so
        zero them between steps (``Adam.step`` does; ``zero_grad()`` zeroes the whole graph). Intermediate
        nodes are reset to 0 first, so a second backward through the same graph adds exactly the same
        amount to each leaf again, as in torch.
        """
        topo = self._topo()
        for v in topo:
            if v._children:
                v.grad = 0.0
        self.grad += 1.0  # dL/dL = 1 (self was just reset to 0 unless it is a leaf)
        for v in reversed(topo):
            g = v.grad
            for c, local in zip(v._children, v._local_grads):
                c.grad += local * g

    def zero_grad(self) -> None:
        """Set ``grad = 0`` on self and every node it was computed from."""
        for v in self._topo():
            v.grad = 0.0


def vsum(xs) -> Value:
    """sum(xs) as one node with len(xs) children (each local derivative 1), not a chain of adds."""
    xs = tuple(xs)
    if not xs:
        raise ValueError("vsum: needs at least one Value")
    try:
        total = sum([x.data for x in xs])
    except AttributeError:
        bad = next(x for x in xs if not isinstance(x, Value))
        raise TypeError(f"vsum: every item must be a Value, got {type(bad).__name__}") from None
    return Value(total, xs, (1.0,) * len(xs))


def dot(ws, xs) -> Value:
    """sum_i ws[i] * xs[i] as one node with 2n children: d/dws[i] = xs[i].data, d/dxs[i] = ws[i].data.
    The body of a linear layer; a Value may appear in both lists (dot(x, x) = sum of squares)."""
    ws, xs = tuple(ws), tuple(xs)
    if len(ws) != len(xs) or not ws:
        raise ValueError(f"dot: needs two non-empty sequences of equal length, got {len(ws)} and {len(xs)}")
    try:
        wd = [w.data for w in ws]
        xd = [x.data for x in xs]
    except AttributeError:
        bad = next(v for v in ws + xs if not isinstance(v, Value))
        raise TypeError(f"dot: every item must be a Value, got {type(bad).__name__}") from None
    return Value(sum(map(operator.mul, wd, xd)), ws + xs, tuple(xd + wd))
