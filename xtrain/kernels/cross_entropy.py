"""Cross-entropy over a vocabulary, from logits, in fp32 whatever the logits dtype.

    lse[n]  = log sum_v exp(logits[n, v])                      (safe: max subtracted first)
    loss    = sum_{n counted} (lse[n] - logits[n, t_n]) / denom  (denom = count for "mean", 1 for "sum")
    dlogits = dloss * (softmax(logits[n]) - onehot(t_n)) / denom for counted rows, 0 for ignored rows

Contract:
    cross_entropy_fwd(logits[N, V], targets[N], ignore_index, reduction) -> (loss 0-dim fp32, lse[N] fp32,
        denom: float). lse is saved so the backward needs no second reduction.
    cross_entropy_bwd(dloss, logits, targets, lse, ignore_index, denom, inplace=False) -> dlogits
        (logits.dtype; written into ``logits`` itself when inplace=True and the caller no longer needs it).
A batch where every target is ignored has loss 0 and zero gradient under "mean" (not nan), so an
all-padding micro-batch cannot poison an accumulated step.
"""

from __future__ import annotations

import torch


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def cross_entropy_fwd(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                      reduction: str = "mean"):
    lf = logits.to(_acc(logits))
    lse = torch.logsumexp(lf, dim=-1)  # [N]
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, torch.zeros_like(targets))
    picked = lf.gather(1, safe_t[:, None]).squeeze(1)  # [N]
    nll = torch.where(valid, lse - picked, torch.zeros_like(lse))
    count = int(valid.sum().item())
    denom = float(max(count, 1)) if reduction == "mean" else 1.0
    loss = nll.sum() / denom
    return loss, lse, denom


def cross_entropy_bwd(dloss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                      ignore_index: int = -100, denom: float = 1.0, inplace: bool = False) -> torch.Tensor:
    acc = _acc(logits)
    valid = targets != ignore_index
    scale = dloss.to(acc) / denom
    probs = torch.exp(logits.to(acc) - lse.to(acc)[:, None])  # [N, V]
    safe_t = torch.where(valid, targets, torch.zeros_like(targets))
    probs.scatter_add_(1, safe_t[:, None], -torch.ones_like(lse)[:, None])
    probs *= (valid.to(acc) * scale)[:, None]
    if inplace:
        logits.copy_(probs)
        return logits
    return probs.to(logits.dtype)
