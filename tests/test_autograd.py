"""The tape engine: fan-out, repeated parents, deep chains, memory release, errors, no_grad, recompute,
and a guard that library code never touches torch.autograd."""

import ast
import gc
import os
import pathlib
import sys
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode

import xtrain.ops as ops
from xtrain import Var, checkpoint, no_grad
from xtrain.gradcheck import gradcheck


def r(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_fanout_sums_gradients():
    # y = x*x + x*x  =>  dL/dx = 4x (four uses of x, every path summed)
    x = Var(r(6), requires_grad=True)
    y = ops.sum(x * x + x * x)
    y.backward()
    torch.testing.assert_close(x.grad, 4 * x.data, rtol=0, atol=1e-15)


def test_same_var_twice_in_one_op():
    x = Var(r(3, 4), requires_grad=True)
    ops.sum(ops.mul(x, x)).backward()
    torch.testing.assert_close(x.grad, 2 * x.data, rtol=0, atol=1e-15)


def test_adds_into_gets_the_sum_so_far_of_intermediates_only():
    # a backward marked adds_into is offered parent i's gradient so far: an intermediate's, never a leaf's,
    # never one read twice by the op; it returns acc + its own gradient and the engine takes that as the sum
    from xtrain.autograd import adds_into

    seen = []

    def op(*parents):
        @adds_into
        def backward(d, acc):
            seen.append(tuple(a is not None for a in acc))
            return tuple(d.sum() * torch.ones_like(p.data) + (0 if a is None else a) for p, a in zip(parents, acc))

        return Var.from_op(sum(p.data.sum() for p in parents), parents, backward, "probe")

    x = Var(r(4), requires_grad=True)
    h = ops.scale(x, 2.0)  # intermediate, read by three ops
    y = ops.add(ops.add(ops.sum(h * h), op(h, x)), op(h, h))
    y.backward()
    assert sorted(seen) == [(False, False), (True, False)]  # h read twice by one op: no acc; x a leaf: none
    torch.testing.assert_close(x.grad, 2 * (4 * x.data + 1 + 2) + 1, rtol=0, atol=1e-13)


def test_linear_and_norm_fold_the_sum_of_a_shared_input():
    # a norm's output read by three linears and the residual read by a norm and an add (the model's pattern):
    # the matmul epilogues and the norm kernel add the gradient so far; torch.autograd is the oracle
    x0, w = r(6, 8), [r(8, 8, seed=s) for s in (1, 2, 3)]
    g = r(8, seed=4)
    xs = Var(x0.clone(), requires_grad=True)
    res = ops.scale(xs, 1.5)
    h = ops.rms_norm(res, Var(g), 1e-6)
    out = ops.add(res, ops.add(ops.add(ops.linear(h, Var(w[0])), ops.linear(h, Var(w[1]))), ops.linear(h, Var(w[2]))))
    ops.sum(out * out).backward()
    xt = x0.clone().requires_grad_()
    rt = 1.5 * xt
    ht = rt * torch.rsqrt((rt * rt).mean(-1, keepdim=True) + 1e-6) * g
    ot = rt + ht @ w[0].t() + ht @ w[1].t() + ht @ w[2].t()
    (ot * ot).sum().backward()
    torch.testing.assert_close(xs.grad, xt.grad, rtol=1e-12, atol=1e-12)


def test_fanout_through_intermediate():
    x = Var(r(5), requires_grad=True)
    h = ops.scale(x, 3.0)  # used by two consumers
    y = ops.sum(h * h + ops.neg(h))
    y.backward()
    torch.testing.assert_close(x.grad, 3 * (2 * 3 * x.data - 1), rtol=0, atol=1e-13)


# 20k ops already need 20 times the recursion limit; the 100k of xtrain/autograd.py's docstring run in the slow tier
@pytest.mark.parametrize("n", [20_000, pytest.param(100_000, marks=pytest.mark.slow)])
def test_deep_chain_no_recursion_limit(n):
    x = Var(torch.ones(()), requires_grad=True)
    y = x
    for _ in range(n):
        y = ops.scale(y, 1.0)
    assert sys.getrecursionlimit() < n  # a backward that raised the limit past the chain would pass unseen
    y.backward()
    assert x.grad.item() == 1.0


def test_leaf_grads_accumulate_until_zero_grad():
    x = Var(r(4), requires_grad=True)
    for _ in range(3):
        ops.sum(ops.scale(x, 2.0)).backward()
    torch.testing.assert_close(x.grad, torch.full((4,), 6.0, dtype=torch.float64))
    x.zero_grad()
    assert x.grad is None
    ops.sum(x).backward()
    torch.testing.assert_close(x.grad, torch.ones(4, dtype=torch.float64))


def test_leaf_grad_does_not_alias_upstream():
    # add returns the same upstream tensor to both parents; the leaves must own their grads
    a, b = Var(r(3), requires_grad=True), Var(r(3, seed=1), requires_grad=True)
    ops.sum(a + b).backward()
    a.grad += 1
    torch.testing.assert_close(b.grad, torch.ones(3, dtype=torch.float64))


def test_nonscalar_needs_grad_and_shape_checked():
    x = Var(r(3), requires_grad=True)
    y = ops.scale(x, 2.0)
    with pytest.raises(RuntimeError, match="explicit grad"):
        y.backward()
    with pytest.raises(ValueError, match="grad shape"):
        y.backward(torch.ones(4, dtype=torch.float64))
    y.backward(torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0, dtype=torch.float64))


def test_second_backward_through_freed_graph_raises():
    x = Var(r(3), requires_grad=True)
    y = ops.sum(ops.mul(x, x))
    y.backward()
    with pytest.raises(RuntimeError, match="already freed"):
        y.backward()


def test_retain_graph_allows_second_backward():
    x = Var(r(3), requires_grad=True)
    y = ops.sum(ops.mul(x, x))
    y.backward(retain_graph=True)
    y.backward()
    torch.testing.assert_close(x.grad, 4 * x.data)


def test_activations_are_freed_during_backward():
    # Once a node's backward has run, nothing of the engine may keep its output tensor alive.
    x = Var(r(64), requires_grad=True)
    h = ops.silu(x)
    ref = weakref.ref(h.data)
    y = ops.sum(ops.silu(h))
    del h
    gc.collect()
    assert ref() is not None  # still needed for backward
    y.backward()
    gc.collect()
    assert ref() is None


def test_backward_without_requires_grad_raises():
    with pytest.raises(RuntimeError, match="does not require grad"):
        ops.sum(Var(r(3))).backward()


def test_no_grad_records_nothing():
    x = Var(r(3), requires_grad=True)
    with no_grad():
        y = ops.mul(x, x)
    assert not y.requires_grad and y._backward is None


def test_grad_mode_value_checks_and_backend_are_per_thread():
    """A thread inside no_grad, value_checks_off and backend("reference") changes none of them for another
    thread, which records its tape, checks values and keeps the backend it started with; each block restores its
    own thread's state on exit, whatever the other thread did meanwhile."""
    import threading

    from xtrain.autograd import is_grad_enabled
    from xtrain.kernels import backend, get_backend
    from xtrain.ops.basic import check_values

    start = get_backend()
    inside, release, seen = threading.Event(), threading.Event(), {}

    def hold():
        with no_grad(), ops.value_checks_off(), backend("reference"):
            seen["holder"] = (is_grad_enabled(), check_values(torch.zeros(1)), get_backend())
            inside.set()
            release.wait(30)
        seen["after"] = (is_grad_enabled(), check_values(torch.zeros(1)), get_backend())

    th = threading.Thread(target=hold)
    th.start()
    try:
        assert inside.wait(30)
        x = Var(r(3), requires_grad=True)
        y = ops.mul(x, x)  # recorded in this thread while the other holds no_grad
        assert y.requires_grad and is_grad_enabled()
        assert check_values(torch.zeros(1)) and get_backend() == start
        with no_grad():  # and this thread's block ends before the other's
            assert not is_grad_enabled()
    finally:
        release.set()
        th.join(30)
    assert seen["holder"] == (False, False, "reference")
    assert seen["after"] == (True, True, start)
    assert is_grad_enabled() and check_values(torch.zeros(1)) and get_backend() == start


def test_detach_cuts_the_tape():
    x = Var(r(3), requires_grad=True)
    y = ops.sum(ops.mul(x.detach(), x))
    y.backward()
    torch.testing.assert_close(x.grad, x.data)


def test_operators_map_to_ops():
    a, b = Var(r(2, 3), requires_grad=True), Var(r(3, 4, seed=1), requires_grad=True)
    y = ops.sum((-(a * 2.0 + 1.0 - a / 3.0)) @ b)
    y.backward()
    ta, tb = a.data.clone().requires_grad_(), b.data.clone().requires_grad_()
    (-(ta * 2.0 + 1.0 - ta / 3.0) @ tb).sum().backward()
    torch.testing.assert_close(a.grad, ta.grad)
    torch.testing.assert_close(b.grad, tb.grad)


def test_gradcheck_catches_a_wrong_backward():
    # The harness must be able to fail: a backward missing a factor 2 is caught.
    def bad_square(x):
        return Var.from_op(x.data * x.data, (x,), lambda d: (d * x.data,), "bad_square")

    (err,) = gradcheck(bad_square, [r(5)])
    assert err > 0.1


def _block(x, w):
    return ops.sum(ops.silu(ops.linear(ops.silu(ops.linear(x, w)), w)), dim=-1, keepdim=True) * x


def test_checkpoint_matches_plain_bitwise():
    x1, w1 = Var(r(4, 6), requires_grad=True), Var(r(6, 6, seed=2), requires_grad=True)
    x2, w2 = Var(x1.data.clone(), requires_grad=True), Var(w1.data.clone(), requires_grad=True)
    y1 = ops.sum(_block(_block(x1, w1), w1))
    # parameters are read inside the segment (as the model does), so they accumulate in the same order;
    # a Var passed as an input gets its segment's contributions summed first, which can differ in the ulp
    blk = lambda a: _block(a, w2)
    y2 = ops.sum(checkpoint(blk, checkpoint(blk, x2)))
    assert torch.equal(y1.data, y2.data)
    y1.backward()
    y2.backward()
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(w1.grad, w2.grad)


def test_checkpoint_reaches_parameters_read_inside():
    w = Var(r(5, 5), requires_grad=True)
    x = Var(r(3, 5, seed=1), requires_grad=True)
    y = ops.sum(checkpoint(lambda a: ops.silu(ops.linear(a, w)), x))
    y.backward()
    tw, tx = w.data.clone().requires_grad_(), x.data.clone().requires_grad_()
    torch.nn.functional.silu(tx @ tw.t()).sum().backward()
    torch.testing.assert_close(w.grad, tw.grad)
    torch.testing.assert_close(x.grad, tx.grad)


def _root(node):
    """The name an attribute chain / call chain starts from (``a`` for ``a.b(c).d``), or None."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _dotted(node) -> str | None:
    """``torch.nn.Parameter`` for that attribute chain, None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


FORBIDDEN = ("torch.autograd", "torch.enable_grad", "torch.set_grad_enabled", "torch.func", "torch.nn.Parameter",
             "torch.nn.parameter", "functorch")  # fmt: skip


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def autograd_offences(src: str) -> list[tuple[int, str]]:
    """(line, what) for every use of torch.autograd in a module's source, by syntax and by what is imported:

    * torch.autograd, torch.enable_grad / set_grad_enabled, torch.func, nn.Parameter reached through any alias
      (``import torch as t``, ``import torch.autograd as ag``, ``from torch import autograd, nn``, ``from
      torch.autograd import grad`` -- the import itself is the offence);
    * ``.requires_grad_()``, ``t.requires_grad = ...`` on a torch tensor t (a ``Var``'s own flag is legal),
      ``torch.*(..., requires_grad=<not False>)``;
    * ``.backward()`` on a torch tensor: on an expression built from torch, on ``.data`` / ``.grad`` (a
      ``Var``'s tensors), or on a name assigned from one of those in the same module. ``Var.backward()``
      (our engine) is legal: a name bound to an ``ops`` result or a ``Var`` is not a torch tensor.
    """
    tree = ast.parse(src)
    alias: dict[str, str] = {}  # local name -> dotted torch name it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _forbidden(a.name):
                    found.append((node.lineno, f"import {a.name}"))
                if a.name == "torch" or a.name.startswith("torch."):
                    if a.asname:
                        alias[a.asname] = a.name
                    else:
                        alias["torch"] = "torch"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if _forbidden(node.module) or _forbidden(full):
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
                if node.module == "torch" or node.module.startswith("torch."):
                    alias[a.asname or a.name] = full

    def resolve(node) -> str | None:
        d = _dotted(node)
        if d is None:
            return None
        head, _, rest = d.partition(".")
        return None if head not in alias else alias[head] + ("." + rest if rest else "")

    def torch_rooted(node) -> bool:
        r = _root(node)
        return r is not None and r in alias

    tensor_names: set[str] = set()  # names assigned from torch expressions or a Var's tensors

    def tensorish(node) -> bool:
        """An expression whose value is a torch tensor, as far as syntax tells: built from torch (through an
        alias), from a Var's ``.data`` / ``.grad``, or from a name assigned from one of those."""
        if isinstance(node, ast.Name):
            return node.id in tensor_names or node.id in alias
        if isinstance(node, ast.Attribute):
            return node.attr in ("data", "grad") or tensorish(node.value)
        if isinstance(node, ast.Call):
            return tensorish(node.func)
        if isinstance(node, ast.Subscript):
            return tensorish(node.value)
        if isinstance(node, ast.BinOp):
            return tensorish(node.left) or tensorish(node.right)
        if isinstance(node, ast.UnaryOp):
            return tensorish(node.operand)
        return False

    assigns = [n for n in ast.walk(tree) if isinstance(n, ast.Assign) and len(n.targets) == 1]
    for _ in range(3):  # names assigned from names assigned from tensors, a few levels deep
        for node in assigns:
            if isinstance(node.targets[0], ast.Name) and tensorish(node.value):
                tensor_names.add(node.targets[0].id)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = resolve(node)
            if name is not None and _forbidden(name) and not _forbidden(resolve(node.value) or ""):
                found.append((node.lineno, name))
            if node.attr == "requires_grad" and isinstance(node.ctx, ast.Store) and tensorish(node.value):
                found.append((node.lineno, ".requires_grad = ..."))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and _forbidden(alias.get(node.id, "")):
            found.append((node.lineno, alias[node.id]))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr == "requires_grad_":
                found.append((node.lineno, ".requires_grad_()"))
            elif torch_rooted(f) and any(
                k.arg == "requires_grad" and not (isinstance(k.value, ast.Constant) and not k.value.value)
                for k in node.keywords
            ):
                found.append((node.lineno, "torch.*(requires_grad=...)"))
            elif f.attr == "backward":
                if tensorish(f.value):
                    found.append((node.lineno, "torch tensor .backward()"))
    return sorted(set(found))


def test_library_never_uses_torch_autograd():
    """Library code may not touch torch.autograd (tests may, as an oracle): ``autograd_offences`` over every
    module of the package (our own ``Var(..., requires_grad=True)`` and ``Var.backward()`` are legal)."""
    root = pathlib.Path(__file__).resolve().parents[1] / "xtrain"
    offenders = [
        f"{path.relative_to(root.parent)}:{line}: {what}"
        for path in sorted(root.rglob("*.py"))
        for line, what in autograd_offences(path.read_text())
    ]
    assert not offenders, "library code uses torch.autograd:\n" + "\n".join(offenders)


OFFENCES = [
    "import torch\ntorch.autograd.grad(y, x)",
    "import torch\nclass F(torch.autograd.Function):\n    pass",
    "from torch.autograd import grad",
    "from torch.autograd.functional import jacobian",
    "import torch.autograd as ag",
    "import torch.autograd",
    "from torch import autograd",
    "from torch import autograd as ag\nag.grad(y, x)",
    "import torch as t\nt.autograd.backward(y)",
    "import torch\nwith torch.enable_grad():\n    pass",
    "from torch import set_grad_enabled",
    "from torch.func import grad",
    "import torch\nw = torch.nn.Parameter(torch.zeros(3))",
    "from torch import nn\nw = nn.Parameter(x)",
    "import torch.nn as nn\nw = nn.Parameter(x)",
    "from torch.nn import Parameter",
    "from torch.nn.parameter import Parameter",
    "import torch\nx = torch.zeros(3, requires_grad=True)",
    "import torch\nx = torch.zeros(3)\nx.requires_grad_()",
    "import torch\nx = torch.zeros(3)\nx.requires_grad = True",
    "import torch\nloss = (torch.ones(3) * 2).sum()\nloss.backward()",
    "import torch\ntorch.ones(3).sum().backward()",
    "from xtrain import Var\ndef f(v: Var):\n    v.data.sum().backward()",
    "def f(v):\n    g = v.grad\n    g.backward()",
]
LEGAL = [
    "from xtrain import Var, ops\nloss = ops.sum(Var(x, requires_grad=True))\nloss.backward()",
    "from xtrain import ops\ndef step(model, x, y):\n    ops.scale(model.loss(x, y), 0.5).backward()",
    "import torch\nwith torch.no_grad():\n    y = torch.zeros(3, requires_grad=False)",
    "from xtrain.micro.engine import Value\nloss = Value(2.0) * Value(3.0)\nloss.backward()",
    "class V:\n    def __init__(self, data):\n        self.data = data\n        self.requires_grad = True",
]


@pytest.mark.parametrize("src", OFFENCES)
def test_scan_flags_every_form(src):
    assert autograd_offences(src), src


@pytest.mark.parametrize("src", LEGAL)
def test_scan_passes_our_engine(src):
    assert autograd_offences(src) == [], src


class NoTorchAutograd(TorchFunctionMode):
    """Fails on any torch call whose inputs or outputs include a tensor that torch.autograd tracks
    (``requires_grad`` or a ``grad_fn``): every torch function and tensor method called from Python passes
    through here, so library code that builds a torch graph (an nn.Parameter, ``requires_grad_``, an
    autograd.Function, ``.backward()``) fails at its first such call, whatever its syntax."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._check(func, (args, kwargs), "input")
        out = func(*args, **kwargs)
        self._check(func, out, "output")
        self.calls += 1
        return out

    @staticmethod
    def _check(func, tree, what):
        for t in torch.utils._pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor) and (t.requires_grad or t.grad_fn is not None):
                raise AssertionError(f"torch.autograd tracks an {what} of {getattr(func, '__name__', func)}")


def test_guard_catches_torch_autograd():
    with pytest.raises(AssertionError, match="torch.autograd tracks"), NoTorchAutograd():
        torch.zeros(3, requires_grad=True) * 2
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(AssertionError, match="torch.autograd tracks"), NoTorchAutograd():
        w.sum()


def test_train_sample_serve_export_never_touch_torch_autograd(tmp_path):
    """The rule at run time: training steps (dropout and grad accumulation on), sampling (the KV-cache engine's
    generate, past the context too, the batcher's slots) and export + import run under ``NoTorchAutograd``."""
    from xtrain.config import ModelConfig, TrainConfig
    from xtrain.export import export_hf, import_hf
    from xtrain.model import Model
    from xtrain.serve.engine import Batcher, Engine, EngineConfig, Sampling
    from xtrain.train.trainer import Trainer

    cfg = ModelConfig(vocab_size=61, n_layer=2, n_embd=16, n_head=4, n_kv_head=2, head_dim=4, ffn_dim=32,
                      max_seq_len=16, dropout=0.1)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    batches = lambda: torch.randint(0, cfg.vocab_size, (4, 9), generator=g)  # noqa: E731
    guard = NoTorchAutograd()
    with guard:
        tc = TrainConfig(steps=2, batch_size=4, seq_len=8, grad_accum=2, lr=1e-2, warmup_steps=1, grad_clip=0.5)
        tr = Trainer(Model(cfg, seed=0), tc, batches)
        for _ in range(2):
            assert not tr.train_step()["skipped"]
        model = tr.model.eval()
        ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=g).tolist()
        Engine(model).generate(ids, 4, Sampling(temperature=0.8, top_k=10, top_p=0.9, seed=1))
        Engine(model).generate(ids, 14, Sampling(temperature=0.0), slide=True)  # past the context of 16
        b = Batcher(Engine(model), EngineConfig(slots=2, max_queue=2))
        seqs = b.submit([([1, 2, 3], 3, Sampling(temperature=0), None, lambda *a: None),
                         ([4, 5], 3, Sampling(temperature=1.0, seed=2), None, lambda *a: None)])  # fmt: skip
        b.run()  # the batcher's loop, on this thread (the guard is per thread)
        assert all(s.done for s in seqs)
        export_hf(cfg, model.state_dict(), tmp_path / "hf", dtype="float32")
        import_hf(tmp_path / "hf")
    assert guard.calls > 1000  # the guard saw the work


def test_torch_tensors_never_require_grad_in_ops():
    # Run a graph and check no torch tensor it produced is tracked by torch.autograd.
    x = Var(r(2, 3, 4, 8, dtype=torch.float32), requires_grad=True)
    y = ops.attention(x, x, x)
    ops.sum(y).backward()
    assert not y.data.requires_grad and not x.grad.requires_grad


def test_leaf_grad_owned_only_when_safe():
    # an op whose backward hands back a tensor it saved: with retain_graph the closure returns it again,
    # so the leaf must not adopt it (a later += would corrupt what the closure returns)
    saved = torch.ones(3, dtype=torch.float64)
    x = Var(torch.zeros(3, dtype=torch.float64), requires_grad=True)
    y = Var.from_op(x.data * 2, (x,), lambda d: (saved,), "returns_saved")
    y.backward(torch.ones(3, dtype=torch.float64), retain_graph=True)
    y.backward(torch.ones(3, dtype=torch.float64))
    assert torch.equal(saved, torch.ones(3, dtype=torch.float64))
    assert torch.equal(x.grad, torch.full((3,), 2.0, dtype=torch.float64))


def test_everything_imports_and_trains_without_triton():
    """A CPU-only install without Triton: every module imports and a step runs on the references."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'): raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, xtrain.ops as ops\n"
        "from xtrain.kernels import HAVE_TRITON\n"
        "from xtrain.config import preset\n"
        "from xtrain.model import Model\n"
        "import xtrain.kernels.adamw, xtrain.kernels.attention, xtrain.kernels.linear_cross_entropy\n"
        "assert not HAVE_TRITON\n"
        "m = Model(preset('tiny', vocab_size=64, n_layer=1, max_seq_len=16))\n"
        "ids = torch.randint(0, 64, (2, 9))\n"
        "m.loss(ids[:, :-1], ids[:, 1:]).backward()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


_CPU_TORCH = torch.version.cuda is None and getattr(torch.version, "hip", None) is None
_IMPORTS = (
    "import sys, xtrain.model, xtrain.serve.engine, xtrain.train.sample_cli, xtrain.ops.fused\n"
    "from xtrain.kernels import HAVE_TRITON\n"
    "print(HAVE_TRITON, 'triton' in sys.modules)\n"
)


def _loads_triton(**env) -> list[str]:
    """(HAVE_TRITON, whether triton was imported) in a child that imports the inference path with ``env``."""
    import subprocess

    base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "XTRAIN_KERNELS")}
    out = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True, timeout=120,
                         env=dict(base, **env))  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(not _CPU_TORCH, reason="a torch built for a GPU loads Triton")
def test_cpu_only_torch_does_not_import_triton():
    """On a CPU-only torch no Triton kernel can run: the model, the engine and the sample command import without
    Triton (start-up time)."""
    assert _loads_triton() == ["False", "False"]


@pytest.mark.slow
@pytest.mark.skipif(not _CPU_TORCH, reason="a torch built for a GPU loads Triton")
def test_cpu_only_torch_imports_triton_when_asked():
    """The interpreter (TRITON_INTERPRET=1) or XTRAIN_KERNELS=triton (compile_check) load Triton on a CPU torch."""
    pytest.importorskip("triton")
    assert _loads_triton(XTRAIN_KERNELS="triton") == ["True", "True"]
    assert _loads_triton(TRITON_INTERPRET="1") == ["True", "True"]


def test_checkpoint_when_only_parameters_need_grad():
    # the segment's input needs no gradient (e.g. token ids turned into a constant), its weights do
    w1 = Var(r(5, 5), requires_grad=True)
    w2 = Var(w1.data.clone(), requires_grad=True)
    x = Var(r(3, 5, seed=1))
    ops.sum(ops.silu(ops.linear(x, w1))).backward()
    y = ops.sum(checkpoint(lambda a: ops.silu(ops.linear(a, w2)), x))
    y.backward()
    assert torch.equal(w1.grad, w2.grad)
