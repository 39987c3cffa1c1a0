"""Synthetic packed documents for the document-mask benchmarks (``bench attention --docs``, ``bench train
--doc-mask``).

A row of T tokens is cut into documents whose lengths are geometric with the given mean (support 1, 2, ...;
P(length = n) = p (1 - p)^(n - 1), p = 1 / mean), drawn from a seeded generator, each row its own draws. A row
opens at a uniform offset into its first document, so most rows begin mid-document (that document's tokens then
start at 0, as ``xtrain.model.doc_starts`` has it) and some begin on a document start. A document starts at its
``eot`` token, so ``packed_ids`` places the eot at every document start inside the row.
"""

from __future__ import annotations

import torch


def _geometric(n: int, p: float, g: torch.Generator) -> torch.Tensor:
    """n draws (int64) of the geometric distribution on 1, 2, ... with success probability p (1: all ones)."""
    if p >= 1.0:
        return torch.ones(n, dtype=torch.int64)
    return torch.empty(n, dtype=torch.float64).geometric_(p, generator=g).long()


def doc_boundaries(B: int, T: int, mean: float, seed: int = 0) -> list[list[int]]:
    """For each of B rows of T tokens, the sorted positions in [0, T) where a document starts (where its eot
    sits). 0 is among them only when the row begins exactly on a document start."""
    if not (isinstance(mean, (int, float)) and mean >= 1):
        raise ValueError(f"doc_boundaries: mean document length must be >= 1 token, got {mean!r}")
    if B < 1 or T < 1:
        raise ValueError(f"doc_boundaries: need B >= 1 and T >= 1, got B={B}, T={T}")
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / float(mean)
    rows = []
    for _ in range(B):
        first = int(_geometric(1, p, g))  # the length of the document the row opens in
        offset = int(torch.randint(0, first, (1,), generator=g))  # how far into it the row begins
        starts, pos = ([0] if offset == 0 else []), first - offset
        while pos < T:
            n = int(2 * (T - pos) / mean) + 16  # enough draws to pass T, most of the time
            chain = [pos, *(pos + _geometric(n, p, g).cumsum(0)).tolist()]  # document starts, increasing
            starts += [s for s in chain[:-1] if s < T]
            pos = chain[-1]  # the next start: below T only when every draw fell inside the row
        rows.append(starts)
    return rows


def starts_tensor(boundaries: list[list[int]], T: int, device="cpu") -> torch.Tensor:
    """int64 [B, T]: for each position, the first position of its document (0 before a row's first boundary),
    built from the documents' lengths (``repeat_interleave``), not from the ids."""
    out = []
    for b in boundaries:
        firsts = b if b and b[0] == 0 else [0, *b]
        lengths = torch.diff(torch.tensor([*firsts, T]))
        out.append(torch.tensor(firsts).repeat_interleave(lengths))
    return torch.stack(out).to(device=device, dtype=torch.int64)


def random_doc_starts(B: int, T: int, mean: float, seed: int = 0, device="cpu") -> torch.Tensor:
    """doc_starts int64 [B, T] for B rows of packed documents of the given mean length (see the module)."""
    return starts_tensor(doc_boundaries(B, T, mean, seed), T, device)


def packed_ids(B: int, T: int, mean: float, vocab: int, eot: int = 0, seed: int = 0) -> torch.Tensor:
    """Token ids int64 [B, T] (CPU): random tokens other than ``eot`` from [0, vocab), and ``eot`` at every
    document start of ``doc_boundaries(B, T, mean, seed)``."""
    if not 0 <= eot < vocab or vocab < 2:
        raise ValueError(f"packed_ids: need 0 <= eot < vocab and vocab >= 2, got eot={eot}, vocab={vocab}")
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab - 1, (B, T), generator=g)
    ids += (ids >= eot).long()  # skip the eot id
    for b, starts in enumerate(doc_boundaries(B, T, mean, seed)):
        ids[b, starts] = eot
    return ids
