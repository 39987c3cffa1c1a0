"""Helpers shared by the tests and the benchmarks (no test framework needed)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def poisoned():
    """Every float tensor that ``torch.empty`` / ``torch.empty_like`` allocates inside the block starts as
    NaN, so an output element a kernel fails to write shows up as NaN in the comparison."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    torch.empty = lambda *a, **k: fill(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: fill(real_empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like
