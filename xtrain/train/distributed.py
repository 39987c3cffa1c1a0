"""Data parallel training over torch.distributed: NCCL on GPUs, gloo on CPUs, launched by torchrun.

Each rank holds a full model replica and draws its own slice of every global batch (``TokenLoader`` with
``rank``/``world_size``). After the backward of a step, the trainer calls ``all_reduce_sum`` on
[gradients..., loss sum, non-finite flag]: since every rank divides its loss by the *global* count of
target tokens (also all-reduced, before the micro-batches), the summed gradient is exactly the gradient of
the mean loss over the global batch, as on one process with the whole batch. All ranks then take the same
clip and AdamW step from the same numbers, so the replicas stay identical without broadcasting weights.

    torchrun --nproc_per_node 2 -m xtrain.cli train --batch-size 8     # 8 sequences per rank per step

The model file knows nothing of this (DESIGN.md); the trainer's ``all_reduce`` hook is the only seam.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from xtrain.device import resolve_device

BUCKET_BYTES = 32 << 20  # gradients are flattened into buckets of about this size: few, large collectives


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(device: str | None = None) -> DistInfo:
    """Join the process group torchrun set up (env:// rendezvous). One process: nothing to join. ``device``: the
    ``--device`` flag, checked by ``xtrain.device.resolve_device`` (ValueError); each rank takes the GPU of its
    LOCAL_RANK."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = resolve_device(device).startswith("cuda")
    if use_cuda:
        if torch.cuda.device_count() <= local:
            raise RuntimeError(f"rank {rank}: LOCAL_RANK {local} but only {torch.cuda.device_count()} GPUs")
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return DistInfo(rank, world, local, dev)


def all_reduce_sum(tensors: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum every tensor across ranks, in place. Tensors of one dtype and device are packed into flat
    buckets so a step issues a few large collectives instead of one per parameter."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        bucket, size = [], 0
        for t in group + [None]:
            if t is not None:
                bucket.append(t)
                size += t.numel() * t.element_size()
            if bucket and (t is None or size >= bucket_bytes):
                flat = torch.cat([b.reshape(-1) for b in bucket])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                for b, part in zip(bucket, torch.split(flat, [b.numel() for b in bucket])):
                    b.copy_(part.view_as(b))
                bucket, size = [], 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
