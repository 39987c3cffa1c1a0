"""Choosing the next token from logits, on the device the model ran on: greedy, temperature, top-k, top-p.

``Sampling`` is one sequence's settings; ``sample_rows`` picks one token per row of logits [B, V], each row with its
own settings and its own seeded ``torch.Generator`` (on the CPU: a seed gives the same tokens on any device the
model ran on). The host draws one uniform number per sampled row and sends it with the settings (one small copy);
the sort, softmax, filters and the pick run where the logits are, and what comes back is the ids [B].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# A temperature below this samples greedily (argmax). Dividing fp32 logits by a tinier one can overflow them
# to inf and turn the softmax into nan; and below it a token whose logit trails the best by 2e-3 or more
# already has probability under exp(-20), so only near-ties could be drawn differently.
GREEDY_BELOW = 1e-4


@dataclass(frozen=True)
class Sampling:
    """One sequence's sampling settings: temperature 0 (or below ``GREEDY_BELOW``) is greedy; ``top_k`` keeps the k
    most likely tokens (None or 0: off), then ``top_p`` the most likely ones whose mass reaches p (nucleus; None or
    1: off); ``seed`` seeds the sequence's generator; ``logprobs`` > 0 also reports that many top
    log-probabilities at each step (of the unfiltered, temperature-1 distribution, as OpenAI's ``logprobs``).
    Degenerate but finite values are safe: a tiny temperature samples greedily, a top_p that rounds to 0 keeps
    the most likely token, a top_k past the vocabulary keeps all; ``validate`` refuses the rest."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    logprobs: int = 0

    def validate(self) -> Sampling:
        ok = (
            isinstance(self.temperature, (int, float))
            and math.isfinite(self.temperature)
            and self.temperature >= 0
            and (self.top_k is None or (isinstance(self.top_k, int) and self.top_k >= 0))
            and (self.top_p is None or (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1))
            and isinstance(self.seed, int)
            and 0 <= self.logprobs
        )
        if not ok:
            raise ValueError(f"Sampling: need a finite temperature >= 0, top_k >= 0, 0 < top_p <= 1, got {self}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def sample_rows(logits: torch.Tensor, settings: list[Sampling], generators: list) -> torch.Tensor:
    """One token per row of logits [B, V] (any float dtype and device), row b with its own settings and
    generator -> ids int64 [B] on logits' device; -1 for a row no token can be drawn from (a nan or +inf, or
    every entry -inf).

    Greedy rows take the argmax and draw nothing. The others: logits / temperature (fp32), sorted once; keep
    the top_k ranks, then drop a token when the tokens ranked above it already hold top_p of the mass (never
    the first); then one uniform u from the row's generator (float64, rounded to fp32) picks the token where
    the kept mass's running sum first exceeds u * (kept mass). Every step works row by row, so a row's token
    depends on its own logits, settings and seed only, never on its neighbours in the batch."""
    B, V = logits.shape
    sampled = [b for b, s in enumerate(settings) if not s.greedy]
    if not sampled:
        return greedy_ids(logits)
    x = logits.float()
    best, ids = x.max(dim=-1)  # the argmax (the first of equal maxima); a nan propagates into best
    # per row: sampled?, temperature, top_k, top_p, u (greedy rows: 0, 1, V, 0, 0); one copy to the device
    host = torch.zeros(5, B, dtype=torch.float64)
    host[1], host[2] = 1.0, V
    for b in sampled:
        s = settings[b]
        u = float(torch.rand((), generator=generators[b], dtype=torch.float64))
        host[:, b] = torch.tensor([1.0, s.temperature, s.top_k or V, 1.0 if s.top_p is None else s.top_p, u])
    dev = host.to(x.device)
    temp, k, p, u = dev[1].float()[:, None], dev[2].long()[:, None], dev[3].float()[:, None], dev[4].float()
    sorted_logits, order = torch.sort(x / temp, dim=-1, descending=True)  # [B, V]
    rank = torch.arange(V, device=x.device)[None, :]
    probs = torch.softmax(sorted_logits.masked_fill(rank >= k, float("-inf")), dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= p
    drop[:, 0] = False  # the first token is never dropped (a top_p that rounds to 0 in fp32 would drop all)
    probs = probs.masked_fill(drop, 0.0)
    cdf = probs.cumsum(dim=-1)  # [B, V]
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=V - 1)  # [B, 1]
    pick = torch.minimum(pick, (probs > 0).sum(dim=-1, keepdim=True) - 1)  # never past the kept tokens
    pick.clamp_(min=0)  # a non-finite row keeps nothing (its id is -1 below)
    return _finite_rows(best, torch.where(dev[0] > 0, order.gather(1, pick)[:, 0], ids))


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """``sample_rows`` when every row is greedy: the argmax of each row of logits [B, V] (the first of equal maxima)
    -> int64 [B] on logits' device, -1 for a row whose best is nan or +-inf. Device ops only."""
    return _finite_rows(*logits.float().max(dim=-1))


def _finite_rows(best: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """ids, with -1 where the row's best logit is nan or +-inf (no token can be drawn from it)."""
    return torch.where((best > float("-inf")) & (best < float("inf")), ids, -1)
