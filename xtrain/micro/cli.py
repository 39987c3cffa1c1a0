"""``xtrain micro``: train the scalar-Value microGPT on a list of names, then sample new ones.

xtrain micro                        # names from the `names` package, ~1 minute on one CPU core
xtrain micro --data words.txt --steps 3000 --embd 32 --layers 2
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    from xtrain import argtypes as A

    p = subparsers.add_parser(
        "micro",
        help="train the scalar-autograd microGPT on names and sample from it",
        description="Train a tiny GPT built only from scalar Values (xtrain.micro) on one document per "
        "step, then print samples. Default data: first names from the `names` package.",
    )
    p.add_argument(
        "--steps", type=A.positive_int, default=2000, help="training steps, one document each (default 2000)"
    )
    p.add_argument("--layers", type=A.positive_int, default=1, help="transformer layers (default 1)")
    p.add_argument("--embd", type=A.positive_int, default=16, help="model width C (default 16)")
    p.add_argument("--heads", type=A.positive_int, default=4, help="attention heads; must divide --embd (default 4)")
    p.add_argument(
        "--block-size",
        type=A.positive_int,
        default=16,
        help="max positions per document; longer ones are cut (default 16)",
    )
    p.add_argument("--seed", type=int, default=42, help="seeds init, document order and sampling")
    p.add_argument(
        "--data",
        metavar="FILE",
        default=None,
        help="text file with one document per line (default: the `names` package)",
    )
    p.add_argument("--lr", type=A.positive_float, default=0.01, help="peak Adam learning rate, decayed linearly to 0")
    p.add_argument("--temperature", type=A.positive_float, default=0.5, help="sampling temperature > 0 (default 0.5)")
    p.add_argument("--samples", type=A.count, default=20, help="documents to sample after training")
    p.set_defaults(func=run)
    return p


def _fail(msg: str) -> int:
    print(f"xtrain micro: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from xtrain.micro.data import CharTokenizer, load_docs
    from xtrain.micro.gpt import MicroConfig, MicroGPT, train

    try:
        docs = load_docs(args.data)
    except RuntimeError as e:
        return _fail(str(e))
    tok = CharTokenizer.from_docs(docs)
    try:
        config = MicroConfig(
            vocab_size=tok.vocab_size,
            n_layer=args.layers,
            n_embd=args.embd,
            n_head=args.heads,
            block_size=args.block_size,
        )
    except ValueError as e:
        return _fail(str(e))

    rng = random.Random(args.seed)  # one stream: init, then document order, then sampling
    model = MicroGPT(config, rng)
    rng.shuffle(docs)
    ids = [tok.encode(d) for d in docs]
    source = args.data or "the `names` package"
    print(
        f"{len(docs)} documents from {source}, vocab {tok.vocab_size} (uniform loss "
        f"{math.log(tok.vocab_size):.3f}), {len(model.params)} parameters"
    )

    tty = sys.stdout.isatty()
    every = max(1, args.steps // 20)
    recent: list[float] = []
    t0 = time.perf_counter()

    def log(step: int, loss: float) -> None:
        recent.append(loss)
        del recent[:-100]
        avg = sum(recent) / len(recent)
        line = (
            f"step {step + 1:5d}/{args.steps} | loss {loss:.4f} | avg(last {len(recent)}) {avg:.4f} | "
            f"{time.perf_counter() - t0:6.1f}s"
        )
        if tty:
            print("\r" + line, end="\n" if step + 1 == args.steps else "", flush=True)
        elif (step + 1) % every == 0 or step == 0:
            print(line, flush=True)

    losses = train(model, ids, args.steps, args.lr, log)
    dt = time.perf_counter() - t0
    k = min(100, len(losses))
    print(
        f"trained {args.steps} steps in {dt:.1f}s ({1000 * dt / args.steps:.1f} ms/step); mean loss of the "
        f"first {k} steps {sum(losses[:k]) / k:.4f}, of the last {k} {sum(losses[-k:]) / k:.4f}"
    )

    if args.samples:
        print(f"--- {args.samples} samples (temperature {args.temperature}) ---")
        for i in range(args.samples):
            text = tok.decode(model.sample(rng, tok.bos, args.temperature))
            print(f"sample {i + 1:2d}: {text}")
    return 0
