"""Argument types shared by every ``xtrain`` subcommand.

Each is an argparse ``type=``: it parses one value and raises ``ArgumentTypeError`` stating the rule, so a bad
value is refused while the command line is parsed: one line on stderr and exit code 2 (``xtrain.cli.Parser``),
before the command reads or writes anything. What depends on two arguments or on a file (``--stop-after``
against ``--steps``, a resumed run's step) is each command's early validation, which runs before its first
write.
"""

from __future__ import annotations

import argparse
import math

from xtrain.config import MAX_SEED


def int_in(lo: int, hi: int | None = None, what: str = "an integer"):
    """An integer in [lo, hi] (hi None: no upper bound)."""
    rule = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {what} {rule}, got {v}")
        return v

    parse.__name__ = f"int {rule}"
    return parse


def float_in(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False):
    """A finite number in the interval from lo to hi (None: unbounded on that side; ``*_open``: the bound itself
    excluded). nan and inf are always refused."""
    rule = " and ".join(
        s
        for s in (
            None if lo is None else f"{'>' if lo_open else '>='} {lo:g}",
            None if hi is None else f"{'<' if hi_open else '<='} {hi:g}",
        )
        if s
    )
    rule = f"a finite number {rule}".rstrip()

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        bad = not math.isfinite(v)
        bad |= lo is not None and (v <= lo if lo_open else v < lo)
        bad |= hi is not None and (v >= hi if hi_open else v > hi)
        if bad:
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return v

    parse.__name__ = rule
    return parse


positive_int = int_in(1)
count = int_in(0)  # 0 allowed (usually: off / none)
seed = int_in(0, MAX_SEED - 1, what="a seed")
port = int_in(0, 65535, what="a port (0 picks a free one)")
positive_float = float_in(0.0, lo_open=True)
nonnegative_float = float_in(0.0)


def utf8_text(text: str) -> str:
    """Text given on the command line that is valid UTF-8. Python hands undecodable argument bytes over as lone
    surrogates (PEP 383); they cannot be tokenized, so they are refused here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise argparse.ArgumentTypeError(f"not valid UTF-8 text (undecodable bytes at character {e.start})") from None
    return text
