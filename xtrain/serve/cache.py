"""The KV cache of the serving engine: one row ("slot") per sequence, every layer's keys and values.

    kv[i] = (k, v), each [S, Hkv, Tmax, D] in the model's compute dtype; lengths [S] (int64, CPU): the number of
    cached positions of each row

``mask(slots, new)`` is the ``Cached`` mask (``xtrain.mask``) of a step that appends ``new`` tokens to each of
the rows ``slots``: the model's forward takes it with the cache, and each block calls ``store``, which writes
the new keys and values at the row's next positions, then ``ops.cached_attention`` over its layer's cache.
Sequences of different lengths share a step: each row reads its own positions, the mask hides the rest.
"""

from __future__ import annotations

import torch

from xtrain.autograd import Var
from xtrain.mask import Cached


class SlotCache:
    def __init__(self, model, slots: int, max_len: int):
        cfg = model.config
        if slots < 1 or not 1 <= max_len <= cfg.max_seq_len:
            raise ValueError(f"SlotCache: need slots >= 1, 1 <= max_len <= {cfg.max_seq_len}; got {slots}, {max_len}")
        shape = (slots, cfg.n_kv_head, max_len, cfg.head_dim)
        dt, dev = model.compute_dtype, model.device
        self.kv = [(torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev))
                   for _ in range(cfg.n_layer)]  # fmt: skip
        self.lengths = torch.zeros(slots, dtype=torch.int64)
        self.slots, self.max_len, self.device = slots, max_len, dev

    def mask(self, slots: torch.Tensor, new: int, keys: int | None = None) -> Cached:
        """The mask of ``new`` tokens appended to each cache row ``slots`` (int64 [B], CPU), at the rows' current
        lengths. ``keys``: the positions attention reads (default: the longest row after the step; more, e.g. a
        decode graph's bucket, are hidden). ValueError when a row would overflow."""
        if slots.shape[0] == 1:  # a lone row (batch-1 decode): its slot and position as host ints, no reduction
            s = int(slots[0])
            p = int(self.lengths[s])
            row, start, need = (s, p), torch.tensor([p]), p + new  # start [1] (CPU, not a view of lengths)
        else:
            row, start = None, self.lengths[slots]  # [B] (CPU)
            need = int(start.max()) + new
        if need > self.max_len or (keys is not None and not need <= keys <= self.max_len):
            raise ValueError(f"SlotCache: rows {slots.tolist()} at {start.tolist()} + {new} new tokens do not fit "
                             f"{self.max_len} positions (keys {keys})")  # fmt: skip
        return Cached(slots.to(self.device), start.to(self.device), new, need if keys is None else keys, row)

    def store(self, layer: int, k: Var, v: Var, mask: Cached) -> None:
        """Write layer ``layer``'s new keys k [B, Hkv, Tn, D] and values v [B*Tn, Hkv*D] (the v projection's
        rows) at the mask's positions of its rows; attention then reads them from ``kv[layer]``
        (``ops.cached_attention``). Device ops only (a decode graph captures them)."""
        ck, cv = self.kv[layer]
        B, Hkv, Tn, D = k.shape
        if mask.row is not None:  # one row known on the host: narrowed views (no gather, no indexing parse)
            s, p = mask.row
            ck.narrow(0, s, 1).narrow(2, p, Tn).copy_(k.data)
            cv.narrow(0, s, 1).narrow(2, p, Tn).copy_(v.data.view(1, Tn, Hkv, D).transpose(1, 2))
            return
        rows, pos = mask.slots[:, None], mask.positions(Tn, k.device)  # [B, 1], [B, Tn]
        ck[rows, :, pos] = k.data.transpose(1, 2)  # the advanced indices first: the target is [B, Tn, Hkv, D]
        cv[rows, :, pos] = v.data.reshape(B, Tn, Hkv, D)
