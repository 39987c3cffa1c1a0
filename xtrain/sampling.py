"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus).

Shared by ``Model.generate`` and the serving engine (``xtrain.serve.engine``). Works on fp32 logits [B, V] on
the CPU with a seeded ``torch.Generator``, so a seed gives the same tokens on any device the model ran on.
"""

from __future__ import annotations

import math

import torch

# A temperature below this samples greedily (argmax). Dividing fp32 logits by a tinier one can overflow them
# to inf and turn the softmax into nan; and below it a token whose logit trails the best by 2e-3 or more
# already has probability under exp(-20), so only near-ties could be drawn differently.
GREEDY_BELOW = 1e-4


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """logits [B, V] with everything outside the top-k, then outside the top-p nucleus, set to -inf."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p; the first is always kept (a top_p
        # that rounds to 0 in fp32 would otherwise drop every token)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """bool [B]: the rows of logits [B, V] no token can be drawn from (a nan or +inf, or every entry -inf)."""
    return torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1) | torch.isneginf(logits).all(-1)


def next_token(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator
) -> torch.Tensor:
    """The next token id per row of fp32 CPU logits [B, V]; temperature 0 (or below ``GREEDY_BELOW``) is
    greedy (argmax)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"sample: temperature must be a finite number >= 0, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"sample: top_p must lie in (0, 1], got {top_p}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"sample: top_k must be >= 0 (0: off), got {top_k}")
    if bool(nonfinite_rows(logits).any()):
        raise ValueError("sample: the model's logits hold nan or inf (a diverged checkpoint?)")
    if temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / temperature, top_k, top_p)
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(1)
