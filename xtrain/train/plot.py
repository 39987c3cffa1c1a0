"""Loss curves from run directories: ``xtrain plot RUN [RUN ...] [--out FILE]``.

``--out`` is written only where it replaces nothing that xtrain did not write: a new file, a chart xtrain drew (its
PNG's "Software" text is ``MARK``), or a run directory's ``loss.png``; anything else is refused (exit code 2).

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
    fig.savefig(buf, format="png", metadata={"Software": MARK})
    plt.close(fig)
    atomic_write_bytes(out, buf.getvalue())
    return out


# the PNG text chunk ("Software") of every chart xtrain draws: only a file carrying it is redrawn in place
MARK = "xtrain plot"


def _png_software(path: pathlib.Path) -> str | None:
    """The "Software" text of a PNG file (None: not a PNG, or no such chunk)."""
    with open(path, "rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            return None
        while len(head := f.read(8)) == 8:
            n, kind = int.from_bytes(head[:4], "big"), head[4:]
            data = f.read(n)
            f.read(4)  # crc
            if kind == b"tEXt" and data.startswith(b"Software\x00"):
                return data[len(b"Software\x00") :].decode("latin-1")
            if kind == b"IEND" or len(data) < n:
                return None
    return None


def check_out(out: pathlib.Path) -> None:
    """ValueError (one line) unless ``out`` may be written: a new file in an existing directory, a chart xtrain
    drew (its PNG says ``MARK``), or the ``loss.png`` of an xtrain run directory (runs written before the mark).
    Nothing that xtrain did not write is replaced."""
    if out.is_dir():
        raise ValueError(f"--out {out}: is a directory; name the PNG file to write")
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: no such directory {out.parent}")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {out.parent} is not writable")
    if not out.exists():
        return
    if out.is_file() and _png_software(out) == MARK:
        return
    if out.name == "loss.png" and (out.parent / "metrics.jsonl").is_file() and (out.parent / "config.json").is_file():
        return
    raise ValueError(f"--out {out}: exists and is not a chart xtrain drew; pick a new file name")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plot",
        help="draw loss curves of one or more runs on one chart",
        description="Redraw loss curves from run directories (their metrics.jsonl).",
    )
    p.add_argument("runs", nargs="+", help="run directories")
    p.add_argument(
        "--out",
        default=None,
        help="output PNG (default: RUN/loss.png for one run, ./loss.png else); an existing file is replaced only "
        "if it is a chart xtrain drew",
    )
    p.add_argument("--title", default=None)
    p.set_defaults(func=run)


def run(args) -> int:
    out = pathlib.Path(args.out or (pathlib.Path(args.runs[0]) / "loss.png" if len(args.runs) == 1 else "loss.png"))
    try:
        for r in args.runs:
            read_metrics(r)  # every run readable before anything is drawn
        check_out(out)
        path = plot_runs(args.runs, out, args.title)
    except (FileNotFoundError, ValueError) as e:
        print(f"xtrain plot: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"xtrain plot: {e.filename or out}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0
