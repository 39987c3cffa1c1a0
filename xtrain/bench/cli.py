"""``xtrain bench NAME [args]``: runs the benchmark module ``bench/NAME.py`` of the checkout.

Benchmarks live in the repository's top-level ``bench/`` folder, beside the package rather than inside it:
they import their baselines (PyTorch's autograd, torch SDPA, an eager PyTorch model), which library code
must never use. Each measures xtrain and its baseline side by side in one process and prints a table
with a ratio column. Results that matter are recorded in ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys

BENCH_DIR = pathlib.Path(__file__).resolve().parents[2] / "bench"


def available() -> list[str]:
    if not BENCH_DIR.is_dir():
        return []
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_") and p.stem != "common")


def add_parser(subparsers) -> None:
    names = available()
    p = subparsers.add_parser(
        "bench",
        help="run a benchmark: " + (", ".join(names) or "(needs a source checkout)"),
        description="Run a benchmark from the checkout's bench/ folder.",
    )
    p.add_argument("name", choices=names or None, help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    p.set_defaults(func=run)


def run(args) -> int:
    path = BENCH_DIR / f"{args.name}.py"
    if not path.is_file():
        print(f"xtrain bench: no benchmark {path} (benchmarks need a source checkout)", file=sys.stderr)
        return 2
    if str(BENCH_DIR.parent) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR.parent))
    mod = importlib.import_module(f"bench.{args.name}")  # registered in sys.modules (dataclasses need it)
    return int(mod.main(args.args) or 0)
