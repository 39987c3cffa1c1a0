"""microGPT: a GPT written with nothing but scalar ``Value``s and Python lists.

Shape letters: V vocab, C = n_embd model width, H heads, D = C // H head dim, L layers, T positions seen
so far. A vector is a ``list[Value]`` of length C; a matrix is a list of rows, each a ``tuple[Value, ...]``,
in the ``[out][in]`` layout (the Hugging Face / ``xtrain.ops.linear`` layout).

The network (the same one tests/test_micro.py writes again with the tensor engine ``xtrain.ops``):

    x = rmsnorm(wte[token] + wpe[pos])                    # (C)   the extra norm feeds the residual stream
    for each of L layers:
        h = rmsnorm(x)
        q, k, v = Wq h, Wk h, Wv h                        # (C) each, no biases
        append k, v to this layer's cache                 # keys/values: T lists of (C)
        per head: a_t = softmax_t(q_h . k_h[t] / sqrt(D)) # causal by construction: only past keys exist
                  o_h = sum_t a_t v_h[t]                  # (D)
        x = x + Wo concat(o_1..o_H)
        x = x + W2 relu(W1 rmsnorm(x))                    # W1 (4C x C), W2 (C x 4C)
    logits = lm_head x                                    # (V)
    loss_t = -log softmax(logits)[target]

``rmsnorm(x) = x * (mean(x^2) + eps)^-1/2`` has no learned weight, as in Karpathy's microgpt: the next
linear layer can absorb any per-channel scale. A document is processed token by token, as at inference:
each position appends its key and value to a growing per-layer cache and attends over everything in it.
The loss of a document is the mean of loss_t over its first min(block_size, len(tokens) - 1) positions.

All parameters start as Gaussian(0, init_std). ``Adam`` (beta1 0.85, beta2 0.99, bias-corrected) updates
them after each document, with a learning rate that decays linearly to zero, as in the article.

Speed: every linear layer row is one fused ``dot`` node (2C children) rather than C multiply nodes and a
chain of adds, sums are one ``vsum`` node, and Python's cyclic garbage collector is paused while a step
builds, walks and frees its graph: every Value is a container object, so the collector would rescan the
growing graph again and again (measured: steps ~1.4x slower with it on). Pausing it is safe because the
graph has no cycles (children never point back at parents): reference counting frees it.
"""

from __future__ import annotations

import gc
import math
import operator
import random
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from xtrain.micro.engine import Value, dot, vsum

__all__ = ["Adam", "MicroConfig", "MicroGPT", "gc_paused", "linear", "rmsnorm", "softmax", "train"]

Vector = list[Value]
Matrix = list[tuple[Value, ...]]


@dataclass
class MicroConfig:
    vocab_size: int = 27
    n_layer: int = 1
    n_embd: int = 16
    n_head: int = 4
    block_size: int = 16
    init_std: float = 0.08
    eps: float = 1e-5  # inside rmsnorm's square root

    def __post_init__(self):
        for name in ("vocab_size", "n_layer", "n_embd", "n_head", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"MicroConfig: {name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"MicroConfig: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# -- building blocks on lists of Values ----------------------------------------------------------------


def linear(x: Vector, w: Matrix) -> Vector:
    """y = W x for W in [out][in] layout: one fused dot node per output (see ``engine.dot``)."""
    xt = tuple(x)
    xd = [v.data for v in xt]
    out = []
    for row in w:
        rd = [p.data for p in row]
        # d y / d row[i] = x[i],  d y / d x[i] = row[i]
        out.append(Value(sum(map(operator.mul, rd, xd)), row + xt, tuple(xd + rd)))
    return out


def softmax(logits: Vector) -> Vector:
    # Subtracting the max changes nothing mathematically (it cancels in the ratio) and keeps exp from
    # overflowing; it is a plain number, so no gradient flows through it.
    m = max(v.data for v in logits)
    exps = [(v - m).exp() for v in logits]
    inv_total = vsum(exps) ** -1.0
    return [e * inv_total for e in exps]


def rmsnorm(x: Vector, eps: float = 1e-5) -> Vector:
    ms = dot(x, x) * (1.0 / len(x))
    scale = (ms + eps) ** -0.5
    return [xi * scale for xi in x]


@contextmanager
def gc_paused():
    """Pause the cyclic garbage collector (see the module docstring for why that is safe here)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# -- the model -----------------------------------------------------------------------------------------


class MicroGPT:
    """Parameters live in ``state`` (name -> matrix, in a fixed order); ``params`` is the flat list."""

    def __init__(self, config: MicroConfig, rng: random.Random):
        self.config = c = config

        def matrix(n_out: int, n_in: int) -> Matrix:
            return [tuple(Value(rng.gauss(0.0, c.init_std)) for _ in range(n_in)) for _ in range(n_out)]

        self.state: dict[str, Matrix] = {"wte": matrix(c.vocab_size, c.n_embd), "wpe": matrix(c.block_size, c.n_embd)}
        for i in range(c.n_layer):
            self.state[f"layer{i}.attn_wq"] = matrix(c.n_embd, c.n_embd)
            self.state[f"layer{i}.attn_wk"] = matrix(c.n_embd, c.n_embd)
            self.state[f"layer{i}.attn_wv"] = matrix(c.n_embd, c.n_embd)
            self.state[f"layer{i}.attn_wo"] = matrix(c.n_embd, c.n_embd)
            self.state[f"layer{i}.mlp_fc1"] = matrix(4 * c.n_embd, c.n_embd)
            self.state[f"layer{i}.mlp_fc2"] = matrix(c.n_embd, 4 * c.n_embd)
        self.state["lm_head"] = matrix(c.vocab_size, c.n_embd)
        self.params: list[Value] = [p for mat in self.state.values() for row in mat for p in row]

    def new_cache(self) -> tuple[list[list[Vector]], list[list[Vector]]]:
        """Empty per-layer key and value caches for one document."""
        n = self.config.n_layer
        return [[] for _ in range(n)], [[] for _ in range(n)]

    def forward(self, token_id: int, pos_id: int, keys: list[list[Vector]], values: list[list[Vector]]) -> Vector:
        """Logits (V) for the next token after ``token_id`` at ``pos_id``; appends to the caches."""
        c, s = self.config, self.state
        if not 0 <= pos_id < c.block_size:
            raise ValueError(f"MicroGPT.forward: position {pos_id} outside the block size {c.block_size}")
        if not 0 <= token_id < c.vocab_size:
            raise ValueError(f"MicroGPT.forward: token id {token_id} outside the vocabulary {c.vocab_size}")
        D = c.head_dim
        inv_sqrt_d = 1.0 / math.sqrt(D)
        x = [t + p for t, p in zip(s["wte"][token_id], s["wpe"][pos_id])]  # (C)
        x = rmsnorm(x, c.eps)
        for li in range(c.n_layer):
            # 1) causal multi-head self-attention over the cache
            h = rmsnorm(x, c.eps)
            q = linear(h, s[f"layer{li}.attn_wq"])
            keys[li].append(linear(h, s[f"layer{li}.attn_wk"]))
            values[li].append(linear(h, s[f"layer{li}.attn_wv"]))
            ks, vs = keys[li], values[li]  # T vectors (C) each
            heads: Vector = []
            for hd in range(c.n_head):
                lo, hi = hd * D, (hd + 1) * D
                q_h = q[lo:hi]
                att = softmax([dot(q_h, k[lo:hi]) * inv_sqrt_d for k in ks])  # (T)
                heads.extend(dot(att, [v[j] for v in vs]) for j in range(lo, hi))  # (D)
            x = [a + b for a, b in zip(linear(heads, s[f"layer{li}.attn_wo"]), x)]
            # 2) ReLU MLP
            h = rmsnorm(x, c.eps)
            h = [u.relu() for u in linear(h, s[f"layer{li}.mlp_fc1"])]  # (4C)
            x = [a + b for a, b in zip(linear(h, s[f"layer{li}.mlp_fc2"]), x)]
        return linear(x, s["lm_head"])  # (V)

    def loss(self, tokens: Sequence[int]) -> Value:
        """Mean next-token NLL over the first min(block_size, len(tokens) - 1) positions of one document,
        fed token by token."""
        n = min(self.config.block_size, len(tokens) - 1)
        if n < 1:
            raise ValueError("MicroGPT.loss: a document needs at least two tokens (BOS ... BOS)")
        keys, values = self.new_cache()
        losses = []
        for pos in range(n):
            probs = softmax(self.forward(tokens[pos], pos, keys, values))
            losses.append(-probs[tokens[pos + 1]].log())
        return vsum(losses) * (1.0 / n)

    def sample(self, rng: random.Random, bos: int, temperature: float = 0.5) -> list[int]:
        """One document's token ids (without the BOS markers), at most block_size of them.
        Temperature < 1 sharpens the distribution, > 1 flattens it."""
        if not temperature > 0.0:
            raise ValueError(f"MicroGPT.sample: temperature must be > 0, got {temperature}")
        keys, values = self.new_cache()
        token, out = bos, []
        with gc_paused():
            for pos in range(self.config.block_size):
                logits = self.forward(token, pos, keys, values)
                probs = softmax([z * (1.0 / temperature) for z in logits])
                token = rng.choices(range(self.config.vocab_size), weights=[p.data for p in probs])[0]
                if token == bos:
                    break
                out.append(token)
            del keys, values, logits, probs  # free the graph before the collector is back on
        return out


class Adam:
    """Adam with bias correction (the article's betas: 0.85, 0.99). ``step(lr)`` updates every parameter
    from its ``grad`` and then zeroes the grad, ready for the next backward."""

    def __init__(self, params: list[Value], beta1: float = 0.85, beta2: float = 0.99, eps: float = 1e-8):
        self.params, self.beta1, self.beta2, self.eps = params, beta1, beta2, eps
        self.m = [0.0] * len(params)
        self.v = [0.0] * len(params)
        self.t = 0

    def step(self, lr: float) -> None:
        self.t += 1
        b1, b2, eps = self.beta1, self.beta2, self.eps
        c1, c2 = 1.0 - b1**self.t, 1.0 - b2**self.t
        m, v = self.m, self.v
        for i, p in enumerate(self.params):
            g = p.grad
            m[i] = b1 * m[i] + (1.0 - b1) * g
            v[i] = b2 * v[i] + (1.0 - b2) * g * g
            p.data -= lr * (m[i] / c1) / ((v[i] / c2) ** 0.5 + eps)
            p.grad = 0.0


def train(
    model: MicroGPT,
    docs: list[list[int]],
    steps: int,
    lr: float = 0.01,
    log: Callable[[int, float], None] | None = None,
) -> list[float]:
    """One document per step: ``docs[step % len(docs)]`` (token ids, BOS ... BOS). Learning rate
    ``lr * (1 - step / steps)``. Returns the loss of every step; ``log(step, loss)`` is called after each."""
    if not docs:
        raise ValueError("train: no documents")
    opt = Adam(model.params)
    losses = []
    for step in range(steps):
        with gc_paused():
            loss = model.loss(docs[step % len(docs)])
            loss.backward()
            losses.append(loss.data)
            del loss  # reference counting frees the whole graph here, before the collector is back on
        opt.step(lr * (1.0 - step / steps))
        if log is not None:
            log(step, losses[-1])
    return losses
