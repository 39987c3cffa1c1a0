"""Loss curves from run directories: ``xtrain plot RUN [RUN ...] [--out FILE]``.

A run directory's ``metrics.jsonl`` holds one JSON object per line: training steps carry ``step``,
``loss``, ``lr``, ``grad_norm``, ``tokens``, ``time``; evaluations carry ``step`` and ``eval_loss``. The
chart shows each run's training loss (light) with its validation loss (dark markers) on one axis.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import sys

from xtrain.fileio import atomic_write_bytes


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl in this run directory")
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    rows = []
    for n, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n == len(lines):  # a run killed mid-write can leave one torn last line
                break
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
    return rows


def plot_runs(
    run_dirs, out: str | os.PathLike, title: str | None = None, baseline: float | None = None
) -> pathlib.Path:
    """Draw training and validation loss of every run on one chart and save it (written atomically).
    ``baseline`` (e.g. the data's unigram loss) is drawn as a dashed horizontal line."""
    import logging

    # With HOME read-only matplotlib cannot make its config and font-cache folder: it uses a temporary one
    # (removed at exit) and says so in two warnings. A cache there only costs time, so it says nothing here.
    mpl_log = logging.getLogger("matplotlib")
    level = mpl_log.level
    mpl_log.setLevel(logging.ERROR)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    finally:
        mpl_log.setLevel(level)

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for i, run in enumerate(run_dirs):
        rows = read_metrics(run)
        color = f"C{i % 10}"
        label = pathlib.Path(run).name or str(run)
        train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        val = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
        if train:
            ax.plot(*zip(*train), color=color, alpha=0.45, linewidth=1, label=f"{label} train")
        if val:
            ax.plot(*zip(*val), color=color, marker="o", markersize=3, linewidth=1.8, label=f"{label} val")
    if baseline is not None and baseline == baseline:  # not nan
        ax.axhline(baseline, color="grey", linestyle="--", linewidth=1, label=f"unigram baseline {baseline:.2f}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title(title or "xtrain loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = pathlib.Path(out)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(out, buf.getvalue())
    return out


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plot",
        help="draw loss curves of one or more runs on one chart",
        description="Redraw loss curves from run directories (their metrics.jsonl).",
    )
    p.add_argument("runs", nargs="+", help="run directories")
    p.add_argument("--out", default=None, help="output PNG (default: RUN/loss.png for one run, ./loss.png else)")
    p.add_argument("--title", default=None)
    p.set_defaults(func=run)


def run(args) -> int:
    out = args.out or (str(pathlib.Path(args.runs[0]) / "loss.png") if len(args.runs) == 1 else "loss.png")
    try:
        path = plot_runs(args.runs, out, args.title)
    except (FileNotFoundError, ValueError) as e:
        print(f"xtrain plot: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0
