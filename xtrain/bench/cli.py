"""``xtrain bench NAME [args]``: runs ``xtrain.bench.NAME.main(args)``.

Each benchmark module measures xtrain and its baseline side by side in one process and prints a table with
a ratio column. Results that matter are recorded in ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil

import xtrain.bench as _pkg


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(_pkg.__path__) if m.name not in ("cli", "common"))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="run a benchmark: " + ", ".join(available()),
                              description="Run a benchmark module of xtrain.bench.")
    p.add_argument("name", choices=available(), help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    p.set_defaults(func=run)


def run(args) -> int:
    mod = importlib.import_module(f"xtrain.bench.{args.name}")
    return int(mod.main(args.args) or 0)
