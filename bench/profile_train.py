"""``xtrain bench profile_train``: where one xtrain training step spends its time (torch.profiler).

Runs a few warm-up steps of a preset, then profiles steps and prints: the wall time per step, the GPU
busy time per step (sum of kernel times), the number of kernel launches per step, and the kernels and
host-side ops that take the most time. A GPU busy time far below the wall time means the step is bound
by the host (Python and launch overhead), not by the kernels.

    xtrain bench profile_train --device cuda --preset seed --batch-size 8 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from xtrain.autograd import gc_paused
from xtrain.config import PRESETS
from xtrain.model import Model
from xtrain.train.optim import AdamW, clip_grads_, grad_norm


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="xtrain bench profile_train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args(argv)
    c = dataclasses.replace(PRESETS[a.preset], compute_dtype=a.dtype).validate()
    dev = torch.device(a.device)
    B, T = a.batch_size, a.seq_len or c.max_seq_len
    model = Model(c, device=dev, seed=0)
    opt = AdamW.for_model(model, lr=1e-3, weight_decay=0.1)  # as the trainer sets it up
    ids = torch.randint(0, c.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0)).to(dev)

    def step():
        with gc_paused():  # as the trainer runs a step
            loss = model.loss(ids[:, :-1], ids[:, 1:])
            loss.backward()
            grads = opt.grads()
            clip_grads_(grads, 1.0, grad_norm(grads))
            opt.step()
            opt.zero_grad()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):
        step()
    sync()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(a.steps):
            step()
        sync()
    wall = (time.perf_counter() - t0) / a.steps
    events = prof.key_averages()
    print(f"profile: preset={a.preset} B={B} T={T} dtype={a.dtype} device={dev} torch={torch.__version__}")
    if dev.type == "cuda":
        kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in kernels) / 1e3 / a.steps  # ms
        launches = sum(e.count for e in kernels) / a.steps
        print(f"wall {wall * 1e3:.1f} ms/step (profiled), GPU busy {busy:.1f} ms/step, {launches:.0f} kernels/step")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=a.top, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
