"""Speed of the scalar engine: ``python -m xtrain.micro.bench``.

Two numbers, both forward + backward on one CPU core:

* primitive ops/s: n nodes of ``+ * ** log exp relu`` (one node per op), built, then ``backward()``
  (which includes its topological sort).
* microGPT step: the default model (C=16, 1 layer) on real names; counts nodes and edges (child links,
  i.e. ``child.grad += local * grad`` updates), since one fused ``dot`` node stands for 2C edges.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time

from xtrain.micro.engine import Value, vsum


def primitive_ops_per_second(n: int = 300_000, seed: int = 0) -> tuple[float, float, float]:
    """(forward, backward, forward+backward) primitive nodes per second: n/6 groups of the six primitives
    ``relu(exp(log((a + b) * a) ** 0.5))`` over 64 shared leaves, summed by one ``vsum`` node."""
    rng = random.Random(seed)
    leaves = [Value(rng.uniform(0.5, 1.5)) for _ in range(64)]
    pairs = [(leaves[rng.randrange(64)], leaves[rng.randrange(64)]) for _ in range(n // 6)]
    t0 = time.perf_counter()
    outs = [((((a + b) * a) ** 0.5).log().exp()).relu() for a, b in pairs]
    loss = vsum(outs)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    nodes = 6 * len(outs)
    return nodes / (t1 - t0), nodes / (t2 - t1), nodes / (t2 - t0)


def microgpt_step(steps: int = 50, seed: int = 42) -> dict:
    from xtrain.micro.data import CharTokenizer, load_names
    from xtrain.micro.gpt import Adam, MicroConfig, MicroGPT, gc_paused

    docs = load_names()
    tok = CharTokenizer.from_docs(docs)
    rng = random.Random(seed)
    model = MicroGPT(MicroConfig(vocab_size=tok.vocab_size), rng)
    rng.shuffle(docs)
    opt = Adam(model.params)
    nodes = edges = 0
    t_fwd = t_bwd = 0.0
    for step in range(steps):
        with gc_paused():  # as train() does
            t0 = time.perf_counter()
            loss = model.loss(tok.encode(docs[step]))
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            topo = loss._topo()
            del loss
        opt.step(0.01)
        nodes += len(topo)
        edges += sum(len(v._children) for v in topo)
        del topo
        t_fwd += t1 - t0
        t_bwd += t2 - t1
    t = t_fwd + t_bwd
    return {
        "ms_per_step": 1000 * t / steps,
        "nodes_per_step": nodes / steps,
        "edges_per_step": edges / steps,
        "nodes_per_s": nodes / t,
        "edges_per_s": edges / t,
        "fwd_share": t_fwd / t,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=300_000)
    p.add_argument("--steps", type=int, default=50)
    a = p.parse_args()
    from xtrain.micro.gpt import gc_paused

    for label in ("gc on", "gc paused"):
        with gc_paused() if label == "gc paused" else contextlib.nullcontext():
            f, b, fb = primitive_ops_per_second(a.nodes)
        print(
            f"primitive graph ({a.nodes} ops, {label}): forward {f / 1e6:.2f} M nodes/s, backward "
            f"{b / 1e6:.2f} M nodes/s, forward+backward {fb / 1e6:.2f} M nodes/s"
        )
    r = microgpt_step(a.steps)
    print(
        f"microGPT step (C=16, 1 layer, {a.steps} names): {r['ms_per_step']:.1f} ms/step, "
        f"{r['nodes_per_step']:.0f} nodes and {r['edges_per_step']:.0f} edges per step -> "
        f"{r['nodes_per_s'] / 1e6:.2f} M nodes/s, {r['edges_per_s'] / 1e6:.2f} M edges/s forward+backward "
        f"(forward {100 * r['fwd_share']:.0f}% of it; gc paused, as in training)"
    )


if __name__ == "__main__":
    main()
