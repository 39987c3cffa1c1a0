"""``xtrain bench host`` (bench/host.py): the host cost of one training step, xtrain vs eager PyTorch.

On a GPU a small model's step is bound by the host (Python, dispatch, launches), not by the GPU. This
measures that cost on the CPU where the arithmetic is negligible: the seed preset's structure (8 blocks,
GQA 12/4 heads, untied head) at tiny widths (C=32, D=8, F=96, V=512), B=1, T=16, one thread.

Both sides run the same architecture with the same weights and batch: forward, backward, global-norm clip,
AdamW, zero grads. The torch side is ``bench.train.TorchQwen3`` (nn.Module, SDPA, torch.autograd) with
``torch.optim.AdamW(fused=True)`` and ``clip_grad_norm_(foreach=True)``. Two xtrain rows: ``xtrain step``
(the model's loss, backward, clip, AdamW, zero grads, as bench/train.py times it) and ``xtrain trainer``
(``Trainer.train_step``: the batch checks, the schedule, the metrics too). Steps are interleaved side by
side; the table shows the median and quartiles of ``--steps`` steps, and the aten ops one step dispatches
(counted with a ``TorchDispatchMode``), and the ratios to eager PyTorch.

    xtrain bench host [--steps 300] [--layers 8] [--width 32] [--batch-size 1] [--seq-len 16] [--profile N]

``--profile N`` prints cProfile's top N functions (by own time) over the xtrain step instead.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import os
import pstats
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.train import TorchQwen3
from xtrain.autograd import gc_paused
from xtrain.config import PRESETS, TrainConfig
from xtrain.model import Model
from xtrain.train.optim import AdamW, clip_grads_, decays, grad_norm
from xtrain.train.trainer import Trainer


class CountOps(TorchDispatchMode):
    """Counts every aten op dispatched inside it (by name)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn) -> collections.Counter:
    with CountOps() as m:
        fn()
    return m.counts


def tiny_config(preset: str, layers: int, width: int):
    """The preset's structure (depth, head counts, tying) at tiny widths."""
    p = PRESETS[preset]
    return dataclasses.replace(
        p, n_layer=layers, n_embd=width, head_dim=8, ffn_dim=3 * width, vocab_size=512, max_seq_len=64
    ).validate()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="xtrain bench host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="seed", choices=sorted(PRESETS), help="structure to copy (default seed)")
    ap.add_argument("--layers", type=int, default=None, help="blocks (default: the preset's)")
    ap.add_argument("--width", type=int, default=32, help="n_embd (default 32)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300, help="timed steps per side (default 300)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's top N instead")
    ap.add_argument("--ops", action="store_true", help="also print the per-op-name aten counts of both sides")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    c = tiny_config(args.preset, args.layers or PRESETS[args.preset].n_layer, args.width)
    B, T = args.batch_size, args.seq_len
    model = Model(c, seed=0)
    opt = AdamW.for_model(model, lr=1e-3, weight_decay=0.1)
    ref = TorchQwen3(c, "sdpa")
    ref.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, strict=True)
    named = dict(ref.named_parameters())
    groups = [
        {"params": [p for n, p in named.items() if decays(n, p.shape)], "weight_decay": 0.1},
        {"params": [p for n, p in named.items() if not decays(n, p.shape)], "weight_decay": 0.0},
    ]
    topt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (B, T + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]

    def step_xtrain():
        with gc_paused():  # as the trainer runs a step
            loss = model.loss(x, y)
            loss.backward()
            grads = opt.grads()
            clip_grads_(grads, 1.0, grad_norm(grads))
            opt.step()
            opt.zero_grad()
        return loss

    def step_torch():
        loss = ref(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, foreach=True)
        topt.step()
        topt.zero_grad(set_to_none=True)
        return loss

    tmodel = Model(c, seed=0)
    tcfg = TrainConfig(steps=10**9, batch_size=B, seq_len=T, lr=1e-3, warmup_steps=0, schedule="constant")
    trainer = Trainer(tmodel, tcfg, lambda: ids)

    sides = [("torch eager", step_torch), ("xtrain step", step_xtrain), ("xtrain trainer", trainer.train_step)]
    first = (float(step_xtrain().data), float(step_torch().detach()))
    for _ in range(args.warmup):
        for _, fn in sides:
            fn()
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step_xtrain()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
        return 0
    counts = {name: count_ops(fn) for name, fn in sides}
    times = {name: [] for name, _ in sides}
    for i in range(args.steps):  # interleaved, rotating who goes first, so noise hits every side alike
        for name, fn in sides[i % 3 :] + sides[: i % 3]:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    load = os.getloadavg()[0]
    print(
        f"xtrain bench host: {args.preset} structure, L={c.n_layer} C={c.n_embd} H={c.n_head} Hkv={c.n_kv_head} "
        f"D={c.head_dim} F={c.ffn_dim} V={c.vocab_size} B={B} T={T} threads={torch.get_num_threads()} "
        f"torch={torch.__version__} load={load:.1f} steps={args.steps}"
    )
    print(f"  first-step loss: xtrain {first[0]:.6f}, torch {first[1]:.6f}")
    tm, to = statistics.median(times["torch eager"]), sum(counts["torch eager"].values())
    print(f"{'side':<16}{'ms/step':>10}{'p25-p75':>14}{'aten ops':>10}{'time ratio':>12}{'ops ratio':>11}")
    for name, _ in sides:
        ts = times[name]
        m, qs = statistics.median(ts), statistics.quantiles(ts, n=4)
        n = sum(counts[name].values())
        print(f"{name:<16}{m * 1e3:>10.2f}{f'{qs[0] * 1e3:.2f}-{qs[2] * 1e3:.2f}':>14}{n:>10}{m / tm:>11.2f}x"
              f"{n / to:>10.2f}x")  # fmt: skip
    if args.ops:
        names = sorted(set().union(*counts.values()), key=lambda k: -counts["xtrain step"][k])
        print(f"{'aten op':<32}" + "".join(f"{n:>16}" for n, _ in sides))
        for k in names:
            print(f"{k:<32}" + "".join(f"{counts[n][k]:>16}" for n, _ in sides))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
