"""xtrain.micro: the scalar Value engine, the microGPT on it, and the microGPT vs the tensor engine.

torch.autograd (float64) is the oracle for Value; the microGPT is then the oracle for ``xtrain.ops``.
"""

from __future__ import annotations

import argparse
import math
import random
import sys

import pytest
import torch

from xtrain.micro import Value, dot, vsum
from xtrain.micro.data import CharTokenizer, load_docs, load_names
from xtrain.micro.gpt import Adam, MicroConfig, MicroGPT, train

# -- Value vs torch.autograd on random expression graphs -------------------------------------------

OPS = [
    "add",
    "mul",
    "pow",
    "log",
    "exp",
    "relu",
    "neg",
    "sub",
    "div",
    "radd",
    "rsub",
    "rmul",
    "rdiv",
    "add_const",
    "mul_const",
    "sub_const",
    "div_const",
    "vsum",
    "dot",
]


def _random_graph(seed: int, n_leaves: int = 6, n_ops: int = 60):
    """Build the same random expression with Values and with float64 torch scalars; operands are drawn
    from everything built so far, so subexpressions are shared (fan-out). Ops whose result would be out of
    a safe range (log of <= 0, huge values) are redrawn."""
    rng = random.Random(seed)
    leaves_v, leaves_t = [], []
    for _ in range(n_leaves):
        x = rng.uniform(-2.0, 2.0)
        leaves_v.append(Value(x))
        leaves_t.append(torch.tensor(x, dtype=torch.float64, requires_grad=True))
    pool = list(zip(leaves_v, leaves_t))
    used = set()

    def pick():
        # favour recent nodes (deep graphs) but keep reaching back (shared subexpressions)
        i = len(pool) - 1 - min(int(rng.expovariate(0.3)), len(pool) - 1)
        return pool[i]

    while len(pool) < n_leaves + n_ops:
        op = rng.choice(OPS)
        (a, at), (b, bt) = pick(), pick()
        c = rng.choice([-1.5, -0.5, 0.25, 2.0, 3])
        if op == "add":
            r, rt = a + b, at + bt
        elif op == "mul":
            r, rt = a * b, at * bt
        elif op == "pow":
            n = rng.choice([2, 3, -1, 0.5, -0.5, 1.5, -2])
            if abs(a.data) < 0.2 or (a.data < 0 and not float(n).is_integer()):
                continue
            r, rt = a**n, at**n
        elif op == "log":
            if a.data <= 0.05:
                continue
            r, rt = a.log(), at.log()
        elif op == "exp":
            if a.data > 3:
                continue
            r, rt = a.exp(), at.exp()
        elif op == "relu":
            r, rt = a.relu(), at.relu()
        elif op == "neg":
            r, rt = -a, -at
        elif op == "sub":
            r, rt = a - b, at - bt
        elif op == "div":
            if abs(b.data) < 0.2:
                continue
            r, rt = a / b, at / bt
        elif op == "radd":
            r, rt = c + a, c + at
        elif op == "rsub":
            r, rt = c - a, c - at
        elif op == "rmul":
            r, rt = c * a, c * at
        elif op == "rdiv":
            if abs(a.data) < 0.2:
                continue
            r, rt = c / a, c / at
        elif op == "add_const":
            r, rt = a + c, at + c
        elif op == "mul_const":
            r, rt = a * c, at * c
        elif op == "sub_const":
            r, rt = a - c, at - c
        elif op == "div_const":
            r, rt = a / c, at / c
        elif op == "vsum":
            items = [pick() for _ in range(rng.randint(1, 5))]
            r, rt = vsum([v for v, _ in items]), sum((t for _, t in items), torch.zeros((), dtype=torch.float64))
        else:  # dot
            k = rng.randint(1, 4)
            ws, xs = [pick() for _ in range(k)], [pick() for _ in range(k)]
            r = dot([v for v, _ in ws], [v for v, _ in xs])
            rt = sum((w * x for (_, w), (_, x) in zip(ws, xs)), torch.zeros((), dtype=torch.float64))
        if not abs(r.data) < 50:
            continue
        used.add(op)
        if rt.requires_grad:
            rt.retain_grad()
        pool.append((r, rt))
    # the output mixes the last nodes and a few random ones, so most of the graph carries gradient
    tail = pool[-5:] + [pick() for _ in range(3)]
    out = vsum([v * (i + 1.0) for i, (v, _) in enumerate(tail)])
    out_t = sum((t * (i + 1.0) for i, (_, t) in enumerate(tail)), torch.zeros((), dtype=torch.float64))
    return pool, out, out_t, used


def test_value_matches_torch_autograd_on_random_graphs():
    used_all = set()
    for seed in range(40):
        pool, out, out_t, used = _random_graph(seed)
        used_all |= used
        out.backward()
        out_t.backward()
        assert out.data == pytest.approx(out_t.item(), rel=1e-12, abs=1e-12)
        for v, t in pool:  # every node, leaves and intermediates: value and dL/dnode
            assert v.data == pytest.approx(t.item(), rel=1e-12, abs=1e-12)
            tg = 0.0 if t.grad is None else t.grad.item()
            assert v.grad == pytest.approx(tg, rel=1e-10, abs=1e-10), f"seed {seed}"
    assert used_all == set(OPS), f"ops never exercised: {set(OPS) - used_all}"


def test_shared_subexpression_and_fused_helpers():
    a, b = Value(1.5), Value(-0.7)
    d = a * b  # used three times below
    y = dot([d, a, d], [d, b, Value(2.0)]) + vsum([d, d, a])
    y.backward()
    at = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    bt = torch.tensor(-0.7, dtype=torch.float64, requires_grad=True)
    dt = at * bt
    yt = dt * dt + at * bt + dt * 2.0 + dt + dt + at
    yt.backward()
    assert y.data == pytest.approx(yt.item(), rel=1e-14)
    assert a.grad == pytest.approx(at.grad.item(), rel=1e-14)
    assert b.grad == pytest.approx(bt.grad.item(), rel=1e-14)


# 20k steps already need 40 times the recursion limit; the 200k of the engine's docstring run in the slow tier
@pytest.mark.parametrize("n", [20_000, pytest.param(200_000, marks=pytest.mark.slow)])
def test_deep_chain_no_recursion_error(n):
    x = Value(0.3)
    y = x
    for _ in range(n):
        y = y * 1.000001 + 0.001  # 2 nodes per step: a chain of 2n nodes
    assert sys.getrecursionlimit() < n
    y.backward()
    assert x.grad == pytest.approx(1.000001**n, rel=1e-9)


def test_backward_twice_with_and_without_zero_grad():
    rng = random.Random(3)
    xs = [Value(rng.uniform(0.5, 2.0)) for _ in range(4)]
    h = [(x * xs[0]).log() + x.exp() / (1.0 + x) for x in xs]
    loss = vsum([hi.relu() * hi for hi in h]) ** 0.5
    loss.backward()
    first = [x.grad for x in xs]
    inner_first = h[2].grad
    # the documented rule: leaf grads accumulate, so zero them between backward calls
    loss.zero_grad()
    assert all(x.grad == 0.0 for x in xs) and h[2].grad == 0.0 and loss.grad == 0.0
    loss.backward()
    assert [x.grad for x in xs] == first and h[2].grad == inner_first
    # without zeroing, intermediates are recomputed and each leaf gets its gradient once more (up to the
    # order of float additions: a leaf's paths now land on a non-zero start)
    loss.backward()
    assert [x.grad for x in xs] == pytest.approx([2 * g for g in first], rel=1e-14)
    assert h[2].grad == inner_first


@pytest.mark.parametrize(
    "fn, exc, match",
    [
        (lambda: Value(0.0).log(), ValueError, "log"),
        (lambda: Value(-1.0).log(), ValueError, "log"),
        (lambda: Value(2.0) ** Value(2.0), TypeError, r"\*\*"),
        (lambda: 2.0 ** Value(2.0), TypeError, r"\*\*"),
        (lambda: Value(0.0) ** -1, ZeroDivisionError, r"\*\*"),
        (lambda: Value(-8.0) ** (1 / 3), ValueError, r"\*\*"),
        (lambda: Value(1.0) / Value(0.0), ZeroDivisionError, r"\*\*"),
        (lambda: Value(1.0) / 0, ZeroDivisionError, "/"),
        (lambda: Value(1.0) + "a", TypeError, r"\+"),
        (lambda: "a" + Value(1.0), TypeError, r"\+"),
        (lambda: Value(1.0) * None, TypeError, r"\*"),
        (lambda: [1.0] * Value(1.0), TypeError, r"\*"),
        (lambda: Value(1.0) - "a", TypeError, "-"),
        (lambda: "a" / Value(1.0), TypeError, "/"),
        (lambda: Value("1.0"), TypeError, "leaf"),
        (lambda: Value(True), TypeError, "leaf"),
        (lambda: Value(1000.0).exp(), OverflowError, "exp"),
        (lambda: Value(1e200) ** 2, OverflowError, r"\*\*"),
        (lambda: vsum([]), ValueError, "vsum"),
        (lambda: vsum([Value(1.0), 2.0]), TypeError, "vsum"),
        (lambda: dot([Value(1.0)], [Value(1.0), Value(2.0)]), ValueError, "dot"),
        (lambda: dot([Value(1.0)], [1.0]), TypeError, "dot"),
    ],
)
def test_bad_input_raises_clear_errors(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def test_numbers_accepted_as_operands():
    import fractions

    v = Value(2.0)
    assert (v + 1).data == 3.0 and (v * fractions.Fraction(1, 2)).data == 1.0
    assert (1 - v).data == -1.0 and (8 / v).data == 4.0 and (3 * v).data == 6.0
    z = Value(0.0)
    y = z**0 + z**1 + z**2  # edge exponents at 0: finite slopes 0, 1, 0
    y.backward()
    assert y.data == 1.0 and z.grad == 1.0


# -- microGPT vs the tensor engine ------------------------------------------------------------------


def _tensor_gpt_loss(model: MicroGPT, tokens: list[int]):
    """The microGPT of xtrain/micro/gpt.py written with xtrain.ops on the whole sequence at once (the
    architecture is spelled out in test_microgpt_matches_tensor_engine). Returns (loss Var, {name: Var})."""
    ops = pytest.importorskip("xtrain.ops")
    from xtrain.autograd import Var

    c = model.config
    f64 = torch.float64
    P = {
        name: Var(torch.tensor([[p.data for p in row] for row in mat], dtype=f64), requires_grad=True)
        for name, mat in model.state.items()
    }
    T, C, H, D = min(c.block_size, len(tokens) - 1), c.n_embd, c.n_head, c.head_dim
    ids = torch.tensor(tokens[:T])
    tgt = torch.tensor(tokens[1 : T + 1])
    ones = Var(torch.ones(C, dtype=f64))

    def relu(x):  # xtrain.ops has no relu (the Qwen3 model uses swiglu)
        mask = x.data > 0
        return Var.from_op(x.data * mask, (x,), lambda d: (d * mask,), "relu")

    def heads(x):  # [T, C] -> [1, H, T, D]
        return ops.transpose(ops.reshape(x, (1, T, H, D)), 1, 2)

    x = ops.add(ops.embedding(ids, P["wte"]), ops.embedding(torch.arange(T), P["wpe"]))
    x = ops.rms_norm(x, ones, c.eps)
    for i in range(c.n_layer):
        h = ops.rms_norm(x, ones, c.eps)
        q, k, v = (heads(ops.linear(h, P[f"layer{i}.attn_{w}"])) for w in ("wq", "wk", "wv"))
        o = ops.attention(q, k, v, mask=True)  # [1, H, T, D]
        o = ops.reshape(ops.transpose(o, 1, 2), (T, C))
        x = ops.add(x, ops.linear(o, P[f"layer{i}.attn_wo"]))
        h = relu(ops.linear(ops.rms_norm(x, ones, c.eps), P[f"layer{i}.mlp_fc1"]))
        x = ops.add(x, ops.linear(h, P[f"layer{i}.mlp_fc2"]))
    logits = ops.linear(x, P["lm_head"])  # [T, V]
    return ops.cross_entropy(logits, tgt), P


@pytest.mark.parametrize("n_layer, n_head, seq_len", [(2, 2, 7), (1, 4, 12)])
def test_microgpt_matches_tensor_engine(n_layer, n_head, seq_len):
    """The microGPT (scalar Values, token by token) and the same network on xtrain.ops (tensors, whole
    sequence): the loss and every parameter gradient agree to 1e-9 in float64 (measured: loss exactly,
    gradients to ~3e-15). seq_len 12 > block_size 8 + 1 also checks the truncation to block_size positions.

    Architecture (both implementations; C = n_embd, H heads of D = C/H, V vocab, T = min(block_size,
    len(tokens) - 1) positions, no biases anywhere, every linear weight [out, in]):
        x  = rmsnorm(wte[tokens[:T]] + wpe[0:T])                    [T, C]
        per layer:
            h = rmsnorm(x);  q, k, v = h Wq^T, h Wk^T, h Wv^T       [T, C] -> [1, H, T, D]
            o = softmax(q k^T / sqrt(D) + causal mask) v             [1, H, T, D] -> [T, C]
            x = x + o Wo^T
            x = x + relu(rmsnorm(x) W1^T) W2^T                       W1 [4C, C], W2 [C, 4C]
        logits = x lm_head^T                                         [T, V]
        loss = mean_t -log softmax(logits[t])[tokens[t + 1]]
    rmsnorm(x) = x / sqrt(mean(x^2) + 1e-5), without a learned weight (the tensor op gets a constant
    weight of ones). The micro version sees one token at a time with a growing key/value cache; the
    causal mask makes the full-sequence version compute the same function.
    """
    ops = pytest.importorskip("xtrain.ops")
    if not all(hasattr(ops, n) for n in ("linear", "attention", "rms_norm", "cross_entropy", "embedding")):
        pytest.skip("xtrain.ops is not complete in this checkout")
    rng = random.Random(11)
    # a larger init than training's 0.08 so attention is far from uniform and relus both fire and don't
    config = MicroConfig(vocab_size=7, n_layer=n_layer, n_embd=8, n_head=n_head, block_size=8, init_std=0.5)
    model = MicroGPT(config, rng)
    tokens = [6] + [rng.randrange(6) for _ in range(seq_len - 2)] + [6]
    loss = model.loss(tokens)
    loss.backward()
    loss_t, P = _tensor_gpt_loss(model, tokens)
    loss_t.backward()
    assert abs(loss.data - loss_t.item()) < 1e-9
    n_checked = 0
    for name, mat in model.state.items():
        g_micro = torch.tensor([[p.grad for p in row] for row in mat], dtype=torch.float64)
        g_tensor = P[name].grad if P[name].grad is not None else torch.zeros_like(g_micro)
        torch.testing.assert_close(g_micro, g_tensor, rtol=0, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")
        n_checked += g_micro.numel()
    assert n_checked == len(model.params)
    assert any(abs(p.grad) > 1e-3 for p in model.state["layer0.attn_wq"][0])  # attention really trained


# -- data, training, sampling ----------------------------------------------------------------------


def test_names_corpus_and_tokenizer():
    docs = load_names()
    assert len(docs) == len(set(docs)) > 5000
    assert docs[:3] == ["mary", "patricia", "linda"]  # female file first, in its own order
    assert all(d.isalpha() and d == d.lower() for d in docs)
    tok = CharTokenizer.from_docs(docs)
    assert tok.vocab_size == 27 and tok.bos == 26
    assert tok.encode("ann") == [26, 0, 13, 13, 26] and tok.decode(tok.encode("ann")) == "ann"
    with pytest.raises(ValueError, match="encode"):
        tok.encode("an!")


def test_missing_names_package_says_what_to_do(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "names" else real(n, *a))
    with pytest.raises(RuntimeError, match="pip install names"):
        load_names()


def test_load_docs_from_file(tmp_path):
    p = tmp_path / "docs.txt"
    p.write_text("  alpha\n\nbeta \ngamma\n", encoding="utf-8")
    assert load_docs(str(p)) == ["alpha", "beta", "gamma"]
    with pytest.raises(RuntimeError, match="nope.txt"):
        load_docs(str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(RuntimeError, match="no documents"):
        load_docs(str(tmp_path / "empty.txt"))


def _mean_loss(model: MicroGPT, docs: list[list[int]]) -> float:
    return sum(model.loss(d).data for d in docs) / len(docs)


def _unigram_loss(train_docs: list[list[int]], eval_docs: list[list[int]], V: int) -> float:
    """The same per-document mean NLL for the best context-free model: next-token frequencies of the
    training documents (add-one smoothed). A model below this uses the context."""
    counts = [1.0] * V
    for d in train_docs:
        for t in d[1:]:
            counts[t] += 1
    total = sum(counts)
    return sum(sum(-math.log(counts[t] / total) for t in d[1:]) / (len(d) - 1) for d in eval_docs) / len(eval_docs)


@pytest.mark.slow  # quick tier: test_training_fits_three_documents_and_sampling_is_reproducible (the same, tiny)
def test_training_reduces_loss_below_unigram_and_sampling_is_reproducible():
    """300 steps (seed 42) on names, evaluated on 200 held-out names. Measured when written: eval loss
    3.302 before training (log 27 = 3.296: the 0.08 init is almost uniform), 2.388 after; the best
    context-free (unigram) model scores 2.807 on the same names, a bigram table ~2.33 on the corpus. The
    threshold 2.60 sits between: the model must use the context to pass, and the ~0.2 margin absorbs
    float-order differences across platforms (the run itself is deterministic)."""
    docs = load_names()
    tok = CharTokenizer.from_docs(docs)
    rng = random.Random(42)
    model = MicroGPT(MicroConfig(vocab_size=tok.vocab_size), rng)
    rng.shuffle(docs)
    ids = [tok.encode(d) for d in docs]
    train_ids, eval_ids = ids[:-200], ids[-200:]
    before = _mean_loss(model, eval_ids)
    assert abs(before - math.log(27)) < 0.05
    losses = train(model, train_ids, 300, lr=0.01)
    after = _mean_loss(model, eval_ids)
    unigram = _unigram_loss(train_ids, eval_ids, tok.vocab_size)
    print(
        f"eval loss before {before:.4f}, after {after:.4f}, unigram {unigram:.4f}, "
        f"train first/last 50 {sum(losses[:50]) / 50:.4f} {sum(losses[-50:]) / 50:.4f}"
    )
    assert unigram > 2.7
    assert after < 2.60 < unigram
    assert sum(losses[-50:]) / 50 < sum(losses[:50]) / 50 - 0.3

    s1 = [tok.decode(model.sample(random.Random(7), tok.bos, 0.5)) for _ in range(3)]
    s2 = [tok.decode(model.sample(random.Random(7), tok.bos, 0.5)) for _ in range(3)]
    assert s1 == s2
    r = random.Random(8)
    samples = [model.sample(r, tok.bos, 0.5) for _ in range(10)]
    assert all(len(s) <= model.config.block_size and tok.bos not in s for s in samples)
    assert sum(len(s) > 1 for s in samples) >= 5


def test_training_fits_three_documents_and_sampling_is_reproducible():
    """The quick tier's learning check (the names run above is the slow one): 60 steps on three short documents
    (vocabulary 6, BOS = 5) take the loss from about ln 6 = 1.79 to below 0.5 (measured when written: 1.69 over the
    first pass, 0.29 over the last); a seeded sample repeats, and samples hold no BOS and fit the block."""
    ids = [[5, 0, 1, 2, 5], [5, 3, 4, 5], [5, 2, 2, 1, 0, 5]]
    model = MicroGPT(MicroConfig(vocab_size=6, n_embd=8, n_head=2), random.Random(0))
    losses = train(model, ids, 60, lr=0.02)
    assert sum(losses[:3]) / 3 > 1.5 and sum(losses[-3:]) / 3 < 0.5, (losses[:3], losses[-3:])
    s1 = [model.sample(random.Random(7), 5, 0.5) for _ in range(3)]
    s2 = [model.sample(random.Random(7), 5, 0.5) for _ in range(3)]
    assert s1 == s2
    r = random.Random(8)
    samples = [model.sample(r, 5, 0.5) for _ in range(10)]
    assert all(len(s) <= model.config.block_size and 5 not in s for s in samples)
    assert sum(len(s) > 1 for s in samples) >= 5


def test_training_is_deterministic():
    ids = [[5, 0, 1, 2, 5], [5, 3, 4, 5], [5, 2, 2, 1, 0, 5]]

    def run():
        m = MicroGPT(MicroConfig(vocab_size=6, n_embd=8, n_head=2), random.Random(0))
        return train(m, ids, 12, lr=0.02), [p.data for p in m.params]

    assert run() == run()


def test_adam_matches_torch_adam():
    rng = random.Random(5)
    ps = [Value(rng.uniform(-1, 1)) for _ in range(5)]
    pt = torch.tensor([p.data for p in ps], dtype=torch.float64, requires_grad=True)
    opt = Adam(ps)
    opt_t = torch.optim.Adam([pt], lr=0.01, betas=(0.85, 0.99), eps=1e-8)
    for _ in range(5):
        loss = vsum([(p * p * (i + 1.0)).exp() for i, p in enumerate(ps)])
        loss.backward()
        opt.step(0.01)
        opt_t.zero_grad()
        (pt * pt * torch.arange(1.0, 6.0, dtype=torch.float64)).exp().sum().backward()
        opt_t.step()
    assert all(p.grad == 0.0 for p in ps)
    torch.testing.assert_close(
        torch.tensor([p.data for p in ps], dtype=torch.float64), pt.detach(), rtol=1e-12, atol=1e-12
    )


def test_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        MicroConfig(n_embd=10, n_head=4)
    with pytest.raises(ValueError, match="n_layer"):
        MicroConfig(n_layer=0)
    m = MicroGPT(MicroConfig(vocab_size=5, block_size=4), random.Random(0))
    with pytest.raises(ValueError, match="position"):
        m.forward(0, 4, *m.new_cache())
    with pytest.raises(ValueError, match="temperature"):
        m.sample(random.Random(0), 4, temperature=0.0)


# -- CLI --------------------------------------------------------------------------------------------


def _cli(argv):
    from xtrain.micro import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["micro", *argv])
    return args.func(args)


def test_cli_trains_and_samples_from_a_file(tmp_path, capsys):
    data = tmp_path / "words.txt"
    data.write_text("\n".join(["abba", "baba", "abab", "bbaa", "aabb"]) + "\n")
    rc = _cli(["--data", str(data), "--steps", "6", "--embd", "8", "--heads", "2", "--samples", "3", "--seed", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "5 documents" in out and "step     6/6" in out and "sample  3:" in out


def test_cli_errors(tmp_path, capsys):
    assert _cli(["--data", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    data = tmp_path / "w.txt"
    data.write_text("ab\n")
    assert _cli(["--data", str(data), "--embd", "10", "--heads", "4"]) == 2
    assert "divisible" in capsys.readouterr().err
    from xtrain.cli import main  # a value its type refuses stops while the command line is parsed

    assert main(["micro", "--data", str(data), "--temperature", "0"]) == 2
    assert "argument --temperature: must be a finite number > 0" in capsys.readouterr().err
