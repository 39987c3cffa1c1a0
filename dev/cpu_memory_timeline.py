"""Probe (CPU): the allocator's total over one training forward + backward at Qwen3-0.6B's shape (tied, fp32,
activation recompute, fused loss; B = 1, T = 1024), from the profiler's memory events: the most allocated during
the step above what was allocated before it, the ops just before that moment, and what stays allocated after it
(the gradients). Compare two trees by running it with PYTHONPATH set to each:

    PYTHONPATH=/tmp/old:. python dev/cpu_memory_timeline.py old; PYTHONPATH=. python dev/cpu_memory_timeline.py new

The CPU runs the reference kernels, whose temporaries are not the GPU kernels', so this shows where the large
allocations of the step's own (gradients, the embedding's and the LM head's [V, C] tensors) fall, not the GPU's peak
(``dev/ft_memory.py`` measures that). About a minute on 2 cores and 6 GB."""

import json
import sys
import tempfile
import time
from dataclasses import replace

import torch

from bench.finetune import model_config
from xtrain.model import Model

label = sys.argv[1] if len(sys.argv) > 1 else "tree"
L = int(sys.argv[2]) if len(sys.argv) > 2 else 28
c = replace(model_config("qwen3-0.6b", 1024, "float32"), n_layer=L, loss="fused", recompute=True).validate()
m = Model(c, seed=0)
ids = torch.randint(0, c.vocab_size, (1, 1025), generator=torch.Generator().manual_seed(0))
t0 = time.time()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
    m.loss(ids[:, :-1], ids[:, 1:]).backward()
with tempfile.NamedTemporaryFile(suffix=".json") as f:
    prof.export_chrome_trace(f.name)
    events = json.load(open(f.name))["traceEvents"]
mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
total = [e["args"]["Total Allocated"] for e in mem]
before = total[0] - mem[0]["args"]["Bytes"]
top = max(range(len(mem)), key=total.__getitem__)
near = [o["name"] for o in ops if o["ts"] <= mem[top]["ts"]][-4:]
GiB = 2**30
print(
    f"{label} (L={L}): peak {(total[top] - before) / GiB:.2f} GiB above the start, after the ops {near}; "
    f"{(total[-1] - before) / GiB:.2f} GiB held after backward; {time.time() - t0:.0f} s"
)
