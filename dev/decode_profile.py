"""Probe (GPU): where a batch-1 decode token's time goes at the seed preset. Per dtype: Engine.generate tokens/s;
one decode graph replayed back to back (the GPU's floor per token); the eager decode step under the profiler
(kernels per token, their summed time, the largest); and the host's part (generate's per-token time less the
replay floor)."""

import statistics
import time
from dataclasses import replace

import torch

from xtrain.config import preset
from xtrain.model import Model
from xtrain.sampling import Sampling
from xtrain.serve.cache import SlotCache
from xtrain.serve.engine import Engine

torch.manual_seed(0)
for dtype in ("float32", "bfloat16"):
    model = Model(replace(preset("seed"), compute_dtype=dtype), device="cuda", seed=0).eval()
    prompt = torch.randint(0, model.config.vocab_size, (16,)).tolist()
    eng = Engine(model)
    greedy = Sampling(temperature=0)
    eng.generate([prompt], 128, greedy)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.generate([prompt], 128, greedy)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    gen = statistics.median(times)
    # the graph alone: replay the captured step (the one key generate used most) back to back
    graph = max(eng.graphs.graphs.values(), key=lambda g: 0)[0]
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    floor = (time.perf_counter() - t0) / 200
    # eager decode steps under the profiler
    plain = Engine(model, cuda_graph=False)
    cache = SlotCache(model, 1, 256)
    plain.prefill(cache, 0, torch.tensor(prompt))
    slots, tok = torch.tensor([0]), torch.tensor([1])
    for _ in range(3):
        plain.decode(cache, slots, tok)
    steps = 10
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            plain.decode(cache, slots, tok)
        torch.cuda.synchronize()
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    tot = sum(e.device_time for e in kern) / steps
    by = {}
    for e in kern:
        n, t = by.get(e.name, (0, 0.0))
        by[e.name] = (n + 1, t + e.device_time)
    print(f"[{dtype}] generate 128 tokens: {gen * 1e3:.1f} ms = {128 / gen:.0f} tok/s ({gen / 128 * 1e6:.0f} us/token "
          f"incl. prefill); graph replay back to back {floor * 1e6:.0f} us; eager step: {len(kern) / steps:.0f} "
          f"kernels, {tot:.0f} us of kernel time")  # fmt: skip
    for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"   {t / steps:8.1f} us  {n / steps:5.1f}x  {name[:110]}")
