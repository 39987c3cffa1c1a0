"""The tape engine: fan-out, repeated parents, deep chains, memory release, errors, no_grad, recompute,
and a guard that library code never touches torch.autograd."""

import ast
import gc
import pathlib
import weakref

import pytest
import torch

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


def test_deep_chain_no_recursion_limit():
    x = Var(torch.ones(()), requires_grad=True)
    y = x
    for _ in range(100_000):
        y = ops.scale(y, 1.0)
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


def _rooted_at_torch(node) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "torch"


def test_library_never_uses_torch_autograd():
    """Library code may not touch torch.autograd (tests may, as an oracle). A syntax-level scan of every
    module: any ``torch.autograd`` / ``torch.enable_grad`` attribute, any ``.requires_grad_(...)`` call, and
    any ``torch.*(..., requires_grad=True)`` call is an offence (our own ``Var(..., requires_grad=True)``
    is not)."""
    root = pathlib.Path(__file__).resolve().parents[1] / "xtrain"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            bad = None
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("autograd", "enable_grad", "set_grad_enabled")
                and isinstance(node.value, ast.Name)
                and node.value.id == "torch"
            ):
                bad = f"torch.{node.attr}"
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "requires_grad_":
                    bad = ".requires_grad_()"
                elif _rooted_at_torch(node.func) and any(
                    k.arg == "requires_grad" and not (isinstance(k.value, ast.Constant) and not k.value.value)
                    for k in node.keywords
                ):
                    bad = "torch.*(requires_grad=...)"
            if bad:
                offenders.append(f"{path.relative_to(root.parent)}:{node.lineno}: {bad}")
    assert not offenders, "library code uses torch.autograd:\n" + "\n".join(offenders)


def test_scan_would_catch_an_offence(tmp_path):
    src = "import torch\nx = torch.zeros(3, requires_grad=True)\ntorch.autograd.grad(x, x)\n"
    found = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Attribute) and n.attr == "autograd"]
    assert found and any(isinstance(n, ast.Call) and _rooted_at_torch(n.func) for n in ast.walk(ast.parse(src)))


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


def test_checkpoint_when_only_parameters_need_grad():
    # the segment's input needs no gradient (e.g. token ids turned into a constant), its weights do
    w1 = Var(r(5, 5), requires_grad=True)
    w2 = Var(w1.data.clone(), requires_grad=True)
    x = Var(r(3, 5, seed=1))
    ops.sum(ops.silu(ops.linear(x, w1))).backward()
    y = ops.sum(checkpoint(lambda a: ops.silu(ops.linear(a, w2)), x))
    y.backward()
    assert torch.equal(w1.grad, w2.grad)
