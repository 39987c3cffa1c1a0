"""Embedding lookup and its scatter-add backward.

Contract: embedding_fwd(ids[...], table[V, C]) -> out[..., C] (table.dtype)
          embedding_bwd(dout[..., C], ids, V) -> dtable[V, C] (dout.dtype): rows of dout added into the
          rows their ids name (an id seen k times gets k rows summed). No [N, V] one-hot is ever built.

Triton backward (deterministic, no atomics, no [V, C] temporary besides the gradient itself):
    order, sorted = stable sort of the N ids         (torch.sort, stable: a fixed summation order)
    end[j]        = first position after j's run of equal ids   (torch.searchsorted, no host sync)
    _embedding_bwd_kernel: program (j, c-block) returns at once unless j starts a run; the run's first
        program sums dout[order[j:end[j]]] in fp32 and writes the row dtable[sorted[j]] once. (Tried:
        8 rows of a run per step with 512-column blocks, to shorten the serial chain of a frequent id:
        slower on the H200, 0.98 vs 0.55 ms at N = 16k, V = 128k, C = 4096 bf16.)
dtable is zero-filled first (ids that never occur keep a zero row) and written in dout.dtype directly:
the fp32 sum is rounded once, as in the reference, which accumulates a whole fp32 [V, C] table instead.
"""

from __future__ import annotations

import torch

from xtrain.kernels._dispatch import jit as _jit
from xtrain.kernels._dispatch import tl, triton, use_triton


def embedding_fwd(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[ids]


def embedding_bwd_ref(dout: torch.Tensor, ids: torch.Tensor, V: int) -> torch.Tensor:
    C = dout.shape[-1]
    acc = torch.float64 if dout.dtype == torch.float64 else torch.float32
    dtable = torch.zeros(V, C, dtype=acc, device=dout.device)
    dtable.index_add_(0, ids.reshape(-1), dout.reshape(-1, C).to(acc))
    return dtable.to(dout.dtype)


# ------------------------------------------------------------------------------------------------ Triton

@_jit
def _embedding_bwd_kernel(DOUT, ORDER, SORTED, END, DTABLE, C, BLOCK_C: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    row_id = tl.load(SORTED + j)
    prev_id = tl.load(SORTED + tl.maximum(j - 1, 0))
    if (j == 0) | (prev_id != row_id):  # j starts a run of equal ids: this program owns the row
        end = tl.load(END + j)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for k in range(j, end):
            src = tl.load(ORDER + k)  # int64 row of dout
            acc += tl.load(DOUT + src * C + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(DTABLE + row_id * C + cols, acc.to(DTABLE.dtype.element_ty), mask=cmask)


def embedding_bwd_triton(dout: torch.Tensor, ids: torch.Tensor, V: int) -> torch.Tensor:
    C = dout.shape[-1]
    if ids.shape != dout.shape[:-1]:
        raise ValueError(f"embedding_bwd: dout {tuple(dout.shape)} must be ids {tuple(ids.shape)} + [C]")
    d2 = dout.reshape(-1, C).contiguous()  # [N, C]
    flat = ids.reshape(-1).to(torch.int64)  # [N]
    N = flat.numel()
    dtable = torch.zeros(V, C, dtype=dout.dtype, device=dout.device)
    if N == 0:
        return dtable
    sorted_ids, order = torch.sort(flat, stable=True)
    end = torch.searchsorted(sorted_ids, sorted_ids, right=True)  # [N] end of each position's run
    BLOCK_C = min(1024, triton.next_power_of_2(C))
    _embedding_bwd_kernel[(N, triton.cdiv(C, BLOCK_C))](d2, order, sorted_ids, end, dtable, C,
                                                        BLOCK_C=BLOCK_C, num_warps=4)
    return dtable


def embedding_bwd(dout: torch.Tensor, ids: torch.Tensor, V: int) -> torch.Tensor:
    if dout.dtype != torch.float64 and use_triton(dout, ids):
        return embedding_bwd_triton(dout, ids, V)
    return embedding_bwd_ref(dout, ids, V)
