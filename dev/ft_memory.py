"""Probe (GPU): where the peak of xtrain's fine-tuning step lies (bench finetune's shape, Qwen3-0.6B, recompute and
plain, B = 4, T = 2048 by default; argv: B T). For each side: the memory held between steps (weights, optimizer
state, compute copies, gradients) and the step's peak above it, with the CUDA graph as the bench runs it; then one
eager step under the allocator's history: the moment of the peak, what was live then that the step had allocated
(largest first, each with the innermost xtrain frame that asked for it), and the order of the largest allocations."""

import gc
import sys
from collections import Counter
from dataclasses import replace

import torch

from bench.finetune import model_config
from bench.train import trainer_step

B, T = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (4, 2048)
dev = torch.device("cuda")
GiB = 2**30


def frame_of(frames) -> str:
    for f in frames:  # innermost first
        name = f.get("filename", "")
        if "/xtrain/" in name or "/bench/" in name:
            return f"{name.split('/xtrain/')[-1].split('/bench/')[-1]}:{f.get('line')} {f.get('name')}"
    return "?"


for side in ("recompute", "plain"):
    c = model_config("qwen3-0.6b", T, "bfloat16")
    c = replace(c, recompute=side == "recompute")
    for graph in (True, False):
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        ids = torch.randint(0, c.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0))
        step = trainer_step(c, dev, ids, B, graph=graph)  # bench finetune's xtrain side, the graph on or off
        for _ in range(getattr(step, "min_warmup", 2) + 1):
            step()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated(dev) - base
        peak = torch.cuda.max_memory_allocated(dev) - base
        print(f"[{side}, graph {graph}] held between steps {held / GiB:.2f} GiB, peak {peak / GiB:.2f} GiB "
              f"(+{(peak - held) / GiB:.2f})")  # fmt: skip
        if not graph:
            torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
            start = torch.cuda.memory_allocated(dev)
            step()
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            trace = [e for t in snap["device_traces"] for e in t]
            live, cur, best, best_live, big = {}, 0, 0, {}, []
            for i, e in enumerate(trace):
                if e["action"] == "alloc":
                    live[e["addr"]] = e
                    cur += e["size"]
                    if e["size"] >= 64 << 20:
                        big.append((i, e["size"], frame_of(e.get("frames", []))))
                elif e["action"] == "free_completed" and e["addr"] in live:
                    cur -= live.pop(e["addr"])["size"]
                if cur > best:
                    best, best_live, at = cur, dict(live), i
            print(f"  eager step: held {start / GiB:.2f} GiB at its start (all), peak +{best / GiB:.2f} GiB at event "
                  f"{at} of {len(trace)}; live then, allocated by the step:")  # fmt: skip
            by = Counter()
            for e in best_live.values():
                by[frame_of(e.get("frames", []))] += e["size"]
            for where, size in by.most_common(12):
                print(f"    {size / GiB:7.3f} GiB  {where}")
            print("  allocations >= 64 MiB in order (event, MiB, where):")
            for i, size, where in big[:40]:
                print(f"    {i:7d} {size / 2**20:8.1f}  {where}")
        del step
        gc.collect()
        torch.cuda.empty_cache()
