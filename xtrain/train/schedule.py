"""Learning-rate schedule: linear warmup, then cosine decay (or constant).

``Schedule(step)`` is the learning rate of the optimizer step with 0-based index ``step``:

    step < warmup:            lr * (step + 1) / warmup          (the first step already moves: lr / warmup)
    cosine, warmup <= step:   min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2,
                              progress = (step - warmup) / (total - warmup), clamped to [0, 1]
    constant:                 lr

A pure function of the step, so a resumed run needs only the step count to continue the curve.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    lr: float
    min_lr: float = 0.0
    warmup_steps: int = 0
    total_steps: int = 1
    kind: str = "cosine"

    def __post_init__(self):
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"Schedule: lr must be a finite number > 0, got {self.lr}")
        if not (0 <= self.min_lr <= self.lr):
            raise ValueError(f"Schedule: min_lr must lie in [0, lr], got {self.min_lr}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(
                f"Schedule: need warmup_steps >= 0 and total_steps >= 1, got {self.warmup_steps}, {self.total_steps}"
            )
        if self.kind not in ("cosine", "constant"):
            raise ValueError(f"Schedule: kind must be 'cosine' or 'constant', got {self.kind!r}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.lr
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, max(0.0, (step - self.warmup_steps) / span))
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))

    @classmethod
    def from_train_config(cls, cfg) -> Schedule:
        return cls(
            lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps, kind=cfg.schedule
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
