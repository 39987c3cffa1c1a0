"""Attention masks as values: built once per batch (checked where they are built), handed to every block.

Which keys a query sees, and at which RoPE position each token sits, are one decision; a mask holds both, so
the model, the attention ops and the serving cache ask the mask instead of branching on optional tensors.

    CAUSAL          one sequence per row from position 0: query t sees keys 0 .. t            positions [T]
    FULL            every query sees every key (not causal; the generic attention ops only)  positions [T]
    Documents       packed documents (``Documents.of(ids, eot_id)``): query t sees keys
                    starts[b, t] .. t, its own document; RoPE restarts at each document       positions [B, T]
    Cached          new tokens of cache rows (``serve/cache.py``): row b's Tn new tokens sit at
                    start[b] .. start[b] + Tn - 1 of cache row slots[b]; query t sees the row's
                    keys 0 .. start[b] + t (keys past it belong to a longer neighbour or are
                    stale)                                                                   positions [B, Tn]

What the kernels take comes from the mask: ``causal`` (bool) and ``doc_starts`` (int64 [B, T], or None for the
plain causal kernels: the one place where "no document mask" is spelled None). Building a mask reads no values
back to the host (device ops only), so a CUDA graph can capture it: the trainer builds ``Documents`` inside its
captured step, the decode graphs build ``Cached`` from their static buffers.
"""

from __future__ import annotations

import torch

__all__ = ["CAUSAL", "FULL", "Cached", "Causal", "Documents", "Mask", "as_mask", "doc_starts"]


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).replace('torch.', '')} {tuple(t.shape)} {t.device}"
    return type(t).__name__


class Mask:
    """The mask interface: ``causal`` and ``doc_starts`` for the kernels, ``positions(T, device)`` for RoPE,
    ``rope(table, T)`` the positions with their rows of a RoPE table, ``check(op, B, T, device)`` that the mask
    fits a batch of B rows of T queries (shapes only)."""

    kind = "mask"
    causal = True
    doc_starts: torch.Tensor | None = None

    def positions(self, T: int, device) -> torch.Tensor:
        return torch.arange(T, device=device)

    def rope(self, table: tuple, T: int) -> tuple:
        """(positions, (cos, sin)) of T queries, the rows of ``table``, the cos/sin of every position 0, 1, ...
        (``ops.rope_table(arange(n), ...)``: each row is what a table of that position alone holds, bit for bit),
        as ``qk_norm_rope`` reads them: [T, D/2] slices for [T] positions, [B, 1, T, D/2] rows for [B, T]."""
        p = self.positions(T, table[0].device)
        if p.dim() == 1:
            return p, (table[0][:T], table[1][:T])
        return p, (table[0][p][:, None], table[1][p][:, None])

    def check(self, op: str, B: int, T: int, device) -> None:
        pass

    def __repr__(self) -> str:
        return self.kind


class Causal(Mask):
    kind = "causal"


class Full(Mask):
    kind = "full"
    causal = False


CAUSAL, FULL = Causal(), Full()


def doc_starts(ids: torch.Tensor, eot_id: int, after: bool = False) -> torch.Tensor:
    """ids int [B, T] -> int64 [B, T] on ids' device: for each position, the index (within the window) of the
    first token of its document. A document starts AT its ``eot_id`` token (the BOS inference prepends, so it
    belongs to the document after it), or with ``after`` right AFTER it (the eot closes the document before it:
    packed chat conversations, whose prompts at inference start with the template's first token, not an eot);
    tokens before the window's first document start belong to a document that began before the window, and
    start at 0. Device ops only (a running max over T), no host read, so a CUDA graph can capture it."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"doc_starts: ids must be an int32/int64 tensor [B, T], got {_desc(ids)}")
    t = torch.arange(ids.shape[1], dtype=torch.int64, device=ids.device)  # [T]
    is_start = ids == eot_id  # [B, T]
    if after:  # t starts a document when t - 1 is an eot
        is_start = torch.nn.functional.pad(is_start[:, :-1], (1, 0))
    starts = torch.where(is_start, t, 0)  # [B, T]: t where a document starts, else 0
    return torch.cummax(starts, dim=1).values  # the latest start at or before t


class Documents(Mask):
    """Packed documents: ``starts`` int64 [B, T], where each query's document starts in the window (0 for the
    document the window opens in). The values are trusted (``Documents.of`` computes them on the device);
    starts[b, t] > t would leave query t without keys."""

    kind = "documents"

    def __init__(self, starts: torch.Tensor):
        if not isinstance(starts, torch.Tensor) or starts.dtype != torch.int64 or starts.dim() != 2:
            raise ValueError(f"Documents: starts must be an int64 tensor [B, T], got {_desc(starts)}")
        self.doc_starts = starts

    @classmethod
    def of(cls, ids: torch.Tensor, eot_id: int, after: bool = False) -> Documents:
        """The documents of a window of token ids, each starting at its ``eot_id`` (or right after it with
        ``after``; ``doc_starts``)."""
        return cls(doc_starts(ids, eot_id, after))

    def positions(self, T: int, device) -> torch.Tensor:
        return torch.arange(T, device=device)[None, :] - self.doc_starts  # [B, T]: t - start of t's document

    def check(self, op: str, B: int, T: int, device) -> None:
        s = self.doc_starts
        if tuple(s.shape) != (B, T) or s.device != torch.device(device):
            raise ValueError(f"{op}: the document mask is {_desc(s)}, the batch is [{B}, {T}] on {device}")


class Cached(Mask):
    """Tn new tokens per row of a KV cache: ``slots`` int64 [B] (the cache rows), ``start`` int64 [B] (the row's cached
    positions before these tokens: token t of row b sits at start[b] + t), ``keys`` S (host int): the cache
    positions read, at least max(start) + Tn (a decode graph rounds it up; positions past a row's own are hidden);
    ``ends`` int64 [B] = start + Tn, each row's length after the step. ``hidden`` bool [B, 1, 1, Tn, S] (over the
    Hkv and G heads) is True where query t of row b may not see key j: j > start[b] + t (None when a lone row's
    decode step reads just its own keys: nothing to hide). Built on the device from device tensors (no host read).
    ``row``: (slot, start) of a lone row as Python ints when the builder has them (not in a captured graph), or
    None; the positions are then [Tn], the RoPE rows a slice, and the cache writes and reads the row through plain
    slices."""

    kind = "cached"

    def __init__(self, slots: torch.Tensor, start: torch.Tensor, new: int, keys: int, row: tuple | None = None):
        ok = isinstance(slots, torch.Tensor) and isinstance(start, torch.Tensor)
        if not (ok and slots.dtype == start.dtype == torch.int64 and slots.dim() == 1 and start.shape == slots.shape
                and slots.device == start.device and 1 <= int(new) <= int(keys)
                and (row is None or slots.shape[0] == 1)):  # fmt: skip
            raise ValueError(
                f"Cached: need slots and start int64 [B] on one device, 1 <= new <= keys, and a host row only for "
                f"B = 1; got slots {_desc(slots)}, start {_desc(start)}, new={new}, keys={keys}, row={row}"
            )
        self.slots, self.start, self.new, self.keys, self.row = slots, start, int(new), int(keys), row
        self.ends = start + self.new  # [B] each row's length after the step (the keys its last query sees)
        dev = start.device
        if row is not None:  # one row from a position known on the host: positions [Tn]
            p = row[1]
            self._positions = torch.arange(p, p + self.new, device=dev)
            hides = self.new > 1 or self.keys > p + 1  # a lone decode step reading just its own keys: nothing
            if hides:
                cols = torch.arange(self.keys, device=dev)
                self.hidden = (cols[None, :] > self._positions[:, None])[None, None, None]
            else:
                self.hidden = None
        else:
            self._positions = start[:, None] + torch.arange(self.new, device=dev)  # [B, Tn]
            cols = torch.arange(self.keys, device=dev)
            self.hidden = (cols[None, None, :] > self._positions[:, :, None])[:, None, None]  # [B, 1, 1, Tn, S]

    def positions(self, T: int, device) -> torch.Tensor:
        return self._positions

    def rope(self, table: tuple, T: int) -> tuple:
        if self.row is None:
            return super().rope(table, T)
        p = self.row[1]
        return self._positions, (table[0][p : p + T], table[1][p : p + T])

    def check(self, op: str, B: int, T: int, device) -> None:
        if (B, T) != (self.slots.shape[0], self.new) or self.slots.device != torch.device(device):
            raise ValueError(
                f"{op}: the cache mask holds {self.slots.shape[0]} rows of {self.new} new tokens on "
                f"{self.slots.device}, the batch is [{B}, {T}] on {device}"
            )


def as_mask(mask) -> Mask:
    """A Mask as is; True / False for the generic ops: CAUSAL / FULL."""
    if isinstance(mask, Mask):
        return mask
    if isinstance(mask, bool):
        return CAUSAL if mask else FULL
    raise ValueError(f"attention: mask must be a Mask (xtrain.mask) or a bool, got {type(mask).__name__}")
