"""``xtrain bench profile_train``: where one training step spends its time (torch.profiler).

Runs a few warm-up steps of a preset, then profiles steps and prints: the wall time per step, the GPU
busy time per step (sum of kernel times), the number of kernel launches per step, the GPU time per kind of
work (matmuls, attention, the fused kernels, AdamW, elementwise, ...), and the kernels and host-side ops
that take the most time. A GPU busy time far below the wall time means the step is bound by the host (Python
and launch overhead), not by the kernels.

``--step`` picks what is profiled: ``xtrain`` (forward, backward, clip, AdamW with host reads: the plain
step), ``trainer`` (``Trainer.device_step``, eagerly: the work the CUDA graph replays, kernel for kernel), or
``compile`` (the eager PyTorch model of ``bench/train.py`` under ``torch.compile``, autocast, fused AdamW).

    xtrain bench profile_train --device cuda --preset seed --batch-size 8 --dtype bfloat16 --step trainer
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import time

import torch

from bench.train import TorchMode, TorchQwen3, torch_step
from xtrain.autograd import gc_paused
from xtrain.config import PRESETS, TrainConfig
from xtrain.model import Model
from xtrain.train.optim import AdamW, clip_grads_, grad_norm

# kernel name -> kind of work; the first pattern contained in the (lower-cased) name wins
KINDS = [
    ("adamw", "optimizer"),
    ("multi_tensor", "optimizer"),
    ("foreach", "optimizer"),
    ("flash", "attention"),
    ("fmha", "attention"),
    ("attention", "attention"),
    ("gemm", "matmul"),
    ("nvjet", "matmul"),
    ("xmma", "matmul"),
    ("cutlass", "matmul"),
    ("cublas", "matmul"),
    ("splitk", "matmul"),
    ("cross_entropy", "loss"),
    ("_ce_", "loss"),
    ("embedding", "embedding"),
    ("rms_norm", "norm"),
    ("rope", "rope"),
    ("swiglu", "swiglu"),
    ("dropout", "dropout"),
    ("reduce", "reductions"),
    ("norm", "reductions"),
    ("triton_", "inductor fused"),
    ("elementwise", "elementwise"),
    ("copy", "copy/cast"),
    ("cast", "copy/cast"),
    ("fill", "fill/zero"),
    ("memset", "fill/zero"),
]


def kind_of(name: str) -> str:
    n = name.lower()
    return next((k for pat, k in KINDS if pat in n), "other")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="xtrain bench profile_train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--step", default="xtrain", choices=["xtrain", "trainer", "compile"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args(argv)
    c = dataclasses.replace(PRESETS[a.preset], compute_dtype=a.dtype).validate()
    dev = torch.device(a.device)
    B, T = a.batch_size, a.seq_len or c.max_seq_len
    ids = torch.randint(0, c.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0)).to(dev)
    x, y = ids[:, :-1], ids[:, 1:]

    if a.step == "compile":
        ref = TorchQwen3(c).to(dev)
        bf16 = a.dtype == "bfloat16"
        autocast = torch.autocast(dev.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        step = torch_step(ref, x, y, autocast, dev, TorchMode("default"))
    elif a.step == "trainer":
        from xtrain.train.trainer import Trainer

        tc = TrainConfig(steps=10**9, batch_size=B, seq_len=T, lr=1e-3, warmup_steps=0, schedule="constant")
        tr = Trainer(Model(c, device=dev, seed=0), tc, lambda: ids, cuda_graph=False)
        lr = torch.tensor(1e-3, dtype=torch.float64, device=dev)

        def step():
            with gc_paused():
                tr.device_step(x, y, lr)
    else:
        model = Model(c, device=dev, seed=0)
        opt = AdamW.for_model(model, lr=1e-3, weight_decay=0.1)  # as the trainer sets it up

        def step():
            with gc_paused():  # as the trainer runs a step
                loss = model.loss(x, y)
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
    print(
        f"profile: step={a.step} preset={a.preset} B={B} T={T} dtype={a.dtype} device={dev} torch={torch.__version__}"
    )
    if dev.type == "cuda":
        kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in kernels) / 1e3 / a.steps  # ms
        launches = sum(e.count for e in kernels) / a.steps
        print(f"wall {wall * 1e3:.1f} ms/step (profiled), GPU busy {busy:.2f} ms/step, {launches:.0f} kernels/step")
        by_kind: dict = collections.defaultdict(lambda: [0.0, 0])
        for e in kernels:
            k = by_kind[kind_of(e.key)]
            k[0] += e.self_device_time_total / 1e3 / a.steps
            k[1] += e.count / a.steps
        print(f"{'kind of work':<16}{'GPU ms/step':>12}{'share':>8}{'kernels':>9}")
        for kind, (ms, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
            print(f"{kind:<16}{ms:>12.3f}{100 * ms / busy:>7.1f}%{n:>9.0f}")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=a.top, max_name_column_width=90))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
