"""Embedding lookup and its scatter-add backward.

Contract: embedding_fwd(ids[...], table[V, C]) -> out[..., C] (table.dtype)
          embedding_bwd(dout[..., C], ids, V) -> dtable[V, C] (dout.dtype): rows of dout added into the
          rows their ids name (an id seen k times gets k rows summed). No [N, V] one-hot is ever built.
"""

from __future__ import annotations

import torch


def embedding_fwd(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[ids]


def embedding_bwd(dout: torch.Tensor, ids: torch.Tensor, V: int) -> torch.Tensor:
    C = dout.shape[-1]
    acc = torch.float64 if dout.dtype == torch.float64 else torch.float32
    dtable = torch.zeros(V, C, dtype=acc, device=dout.device)
    dtable.index_add_(0, ids.reshape(-1), dout.reshape(-1, C).to(acc))
    return dtable.to(dout.dtype)
