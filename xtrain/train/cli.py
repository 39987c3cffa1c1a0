"""``xtrain train``: the main job. Prepare data (cached), build the model, train with a progress bar,
evaluate, checkpoint, plot, and print a sample.

With no arguments it trains the ``tiny`` preset on the default corpus (this Python's standard library
source, tokenized into ``$XTRAIN_CACHE/data`` on first use) and writes a run directory under ``runs/``:

    config.json            model + train config (and the data dir in train.extra)
    model.safetensors      fp32 master weights, Hugging Face Qwen3 names
    optimizer.safetensors  AdamW moments
    trainer_state.json     step, seeds, data-loader position, schedule
    metrics.jsonl          one JSON object per step (loss, lr, grad_norm, tokens/s) and per evaluation
    loss.png               training and validation loss
    tokenizer.json         copy of the tokenizer, so the run directory is self-contained for sampling

``xtrain train --resume RUN [--steps N]`` continues RUN bit-exactly (weights, optimizer, data position).
On resume only --steps, --eval-every, --ckpt-every, --skip-nonfinite, --stop-after, --device and the
output flags may change; every other setting (eval-batches included) keeps the run's saved value, and
passing a different one is an error. metrics.jsonl is cut back to the checkpoint's step.

SIGTERM, SIGINT and SIGHUP stop the run at the next step boundary: the checkpoint is saved and the command
exits with 143, 130 or 129 (128 + the signal); ``--resume`` continues bit-exactly. SIGINT and SIGHUP that the
process inherits as ignored (a background job, ``nohup``) stay ignored; SIGTERM is always handled. A write the
disk refuses (full, ``ulimit -f``, read-only) stops the run at once with one line naming the file and exit code
74: a failed checkpoint save (periodic, final or on a signal) leaves the previous checkpoint as it was, a refused
metrics.jsonl row is taken back. ``--out`` must be new or empty: a directory holding a run is refused (use
--resume), one holding a run that stopped before its first checkpoint needs ``--restart``, anything else is
refused before anything is written. ``--data`` is recorded
as an absolute path with its meta.json fingerprint; resuming on another number of ranks keeps the global
batch (the per-rank batch becomes global / ranks) or refuses with one line.

``xtrain train --init-from DIR|REPO_ID --data chats.jsonl`` fine-tunes a Hugging Face Qwen3 checkpoint instead of
building a preset: model config, weights and tokenizer from the checkpoint, the loss on the assistant turns of the
conversations, fine-tuning defaults for --lr, --min-lr, --weight-decay and --warmup-frac (``xtrain.train.init_from``).

A run directory is owned by one process at a time (the lock file .xtrain.lock, holding its PID): a second
`xtrain train --out DIR` or `--resume DIR` on it stops with that PID; a lock left by a killed process is
taken over. Unavailable devices and sizes whose memory estimate exceeds what the device has stop with one
line and exit code 2 before the run directory is made.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from xtrain.train import init_from

# Defaults of the main job, sized so `xtrain train` (data preparation included) finishes in under 4 minutes
# on 2 CPU cores that train the tiny preset at ~2,100 tokens/s; see README "The main job".
DEFAULTS = dict(
    preset="tiny", steps=160, batch_size=16, seq_len=128, lr=3e-3, warmup=20, eval_every=80, eval_batches=8, seed=1337
)
# settings a resumed run may change; every other flag must match the run's saved value
RESUME_MAY_CHANGE = ("--steps", "--eval-every", "--ckpt-every", "--skip-nonfinite", "--stop-after", "--device")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model (default: tiny preset on the Python stdlib corpus, under 4 min on 2 CPU cores)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from xtrain import argtypes as A
    from xtrain.config import PRESETS
    from xtrain.train.sample_cli import MAX_NEW_TOKENS

    d = DEFAULTS
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help=f"model preset (default {d['preset']})")
    p.add_argument(
        "--data",
        default=None,
        help="a prepared data dir (with meta.json), or a corpus to prepare: pystdlib, tinystories, "
        "or a .txt/.jsonl/.parquet file or directory (default: pystdlib, cached)",
    )
    p.add_argument(
        "--vocab-size",
        type=A.int_in(256),
        default=None,
        help="tokenizer vocab when preparing data: 256 or 257 for bytes, more for BPE (default 4096)",
    )
    p.add_argument("--out", default=None, help="run directory (default runs/<preset>-<date>-<time>)")
    p.add_argument("--steps", type=A.positive_int, default=None, help=f"optimizer steps (default {d['steps']})")
    p.add_argument(
        "--batch-size",
        type=A.positive_int,
        default=None,
        help=f"sequences per optimizer step, all micro-batches together (default {d['batch_size']})",
    )
    p.add_argument(
        "--seq-len", type=A.positive_int, default=None, help=f"tokens per sequence T (default {d['seq_len']})"
    )
    p.add_argument("--lr", type=A.positive_float, default=None, help=f"peak learning rate (default {d['lr']})")
    p.add_argument("--warmup", type=A.count, default=None, help=f"linear warmup steps (default {d['warmup']})")
    p.add_argument(
        "--grad-accum",
        type=A.positive_int,
        default=None,
        help="split each step's batch into this many micro-batches (same update, less memory)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="compute dtype (master weights and optimizer state stay fp32; default bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument(
        "--recompute",
        action="store_true",
        default=None,
        help="recompute each block's activations in backward (less memory, ~1/3 more compute)",
    )
    p.add_argument(
        "--dropout", type=A.float_in(0.0, 1.0, hi_open=True), default=None, help="residual dropout p (default 0)"
    )
    p.add_argument(
        "--attention",
        choices=["auto", "composed", "math", "flash"],
        default=None,
        help="attention implementation (auto: flash on CUDA, math on the CPU)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--cuda-graph",
        choices=["on", "off"],
        default=None,
        help="replay each optimizer step as one CUDA graph (default: on for CUDA; falls back with a message)",
    )
    p.add_argument(
        "--doc-mask",
        choices=["on", "off"],
        default=None,
        help="keep the packed documents of a window apart: attention within each document, RoPE positions "
        "restarting at each (a document starts at the data's end-of-text token; default off)",
    )
    p.add_argument("--resume", default=None, metavar="RUN", help="continue the run in this directory")
    p.add_argument(
        "--restart",
        action="store_true",
        help="--out holds a run that stopped before its first checkpoint: delete its files and start afresh",
    )
    p.add_argument(
        "--stop-after",
        type=A.positive_int,
        default=None,
        metavar="N",
        help="stop (with a checkpoint) after N steps of this invocation, at most the steps left; --resume "
        "continues the same schedule, bit-identical to an uninterrupted run",
    )
    p.add_argument(
        "--seed", type=A.seed, default=None, help=f"run seed: init, data order, dropout (default {d['seed']})"
    )
    p.add_argument(
        "--eval-every", type=A.count, default=None, help=f"validate every N steps (default {d['eval_every']})"
    )
    p.add_argument(
        "--eval-batches",
        type=A.positive_int,
        default=None,
        help=f"validation batches per evaluation (default {d['eval_batches']})",
    )
    p.add_argument("--ckpt-every", type=A.count, default=None, help="also checkpoint every N steps (default: end only)")
    p.add_argument(
        "--skip-nonfinite", action="store_true", default=None, help="skip (and count) steps with nan/inf loss"
    )
    init_from.add_arguments(p)
    p.add_argument(
        "--sample-tokens", type=A.int_in(0, MAX_NEW_TOKENS), default=120, help="tokens to sample at the end (0: none)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (one line per eval instead)")
    p.set_defaults(func=run)


# what a run directory holds before its first checkpoint is complete (``--restart`` deletes these); temporary
# files of atomic writes (".NAME.tmp-PID") and a stale lock's leftovers count too
RUN_LEFTOVERS = (
    "metrics.jsonl",
    "tokenizer.json",
    "loss.png",
    ".checkpoint-next",
    ".checkpoint-commit",
    *init_from.TOKENIZER_FILES,
)


def _leftover(name: str) -> bool:
    return name in RUN_LEFTOVERS or (name.startswith(".") and ".tmp-" in name) or name.startswith(".xtrain.lock")


def check_out_dir(run_dir: Path, restart: bool) -> list[Path]:
    """Refuse (ConfigError, one line) an ``--out`` that ``train`` may not write into: anything but a new or
    empty directory, or one holding only the files of a run stopped before its first checkpoint (then only
    with ``restart``; those files are returned, to delete once the directory is locked). Nothing is written."""
    from xtrain.config import ConfigError
    from xtrain.fileio import not_writable
    from xtrain.train import checkpoint as ckpt_io

    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--out {run_dir}: exists and is not a directory")
    if ckpt_io.current_files(run_dir)[ckpt_io.CONFIG].is_file():
        raise ConfigError(f"{run_dir}: already holds a run; pass --resume {run_dir} or another --out")
    parent = run_dir
    while not parent.exists():
        parent = parent.parent
    if why := not_writable(parent):
        raise ConfigError(f"--out {run_dir}: {parent} is not writable ({why})")
    if not run_dir.exists():
        return []
    names = sorted(n for n in os.listdir(run_dir) if n != ".xtrain.lock")
    if not names:
        return []
    foreign = [n for n in names if not _leftover(n)]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ConfigError(
            f"--out {run_dir}: not empty and not an xtrain run (holds {shown}); pick a new or empty directory"
        )
    if not restart:
        raise ConfigError(
            f"--out {run_dir}: holds a run that stopped before its first checkpoint ({', '.join(names)}); "
            f"pass --restart to delete those files and start afresh there, or pick another --out"
        )
    return [run_dir / n for n in names]


def resume_batch_size(stored, world: int) -> int:
    """The per-rank batch that keeps a run's global batch (its batch_size x the ranks it was started on,
    ``extra["world_size"]``) when it resumes on ``world`` ranks; ConfigError (one line) when the ranks cannot
    share it evenly. The data order is a function of the global batch only (``TokenLoader``), and dropout is
    keyed by the global row, so the run continues the same steps. Runs that did not record their world size
    keep their per-rank batch."""
    from xtrain.config import ConfigError

    was = stored.extra.get("world_size")
    if was is None or was == world:
        return stored.batch_size
    global_batch = stored.batch_size * was
    if global_batch % world or (global_batch // world) % stored.grad_accum:
        raise ConfigError(
            f"--resume: the run's global batch of {global_batch} sequences ({was} rank(s) x {stored.batch_size}, "
            f"grad-accum {stored.grad_accum}) cannot be split evenly over {world} ranks; resume on a number of "
            "ranks that divides it"
        )
    return global_batch // world


def data_fingerprint(data_dir: str | Path) -> str:
    """sha256 of the data directory's meta.json, which lists every shard with its token count (and the
    tokenizer): a different preparation of the data has a different fingerprint."""
    import hashlib

    return hashlib.sha256((Path(data_dir) / "meta.json").read_bytes()).hexdigest()[:16]


def check_steps(steps: int, stop_after: int | None, done: int = 0, resume: Path | None = None) -> None:
    """The step counts a run is given, before anything is written (ConfigError, one line): a resumed run's
    ``--steps`` reaches at least the checkpoint's step ``done``, and ``--stop-after`` stops within the steps
    left."""
    from xtrain.config import ConfigError

    if steps < done:
        raise ConfigError(f"--steps {steps}: {resume} is already at step {done}; pass --steps {done} or more")
    if stop_after is not None and stop_after > steps - done:
        left = f"the {steps - done} steps left of {steps}" if resume else f"the run's {steps} steps"
        raise ConfigError(f"--stop-after {stop_after}: more than {left}; leave it out to run to the end")


def _pick(v, default):
    return default if v is None else v


def resolve_data(spec: str | None, vocab_size: int, log=print) -> dict:
    """A prepared data dir's meta (preparing and caching a corpus first when needed)."""
    from xtrain.data.prepare import load_meta, prepare
    from xtrain.data.tokenizer import load_tokenizer

    if spec and (Path(spec) / "meta.json").is_file():
        meta = load_meta(spec)
        meta.setdefault("dir", str(Path(spec)))
    else:
        meta = prepare(spec or "pystdlib", None, vocab_size, progress=True, log=log)
    # the model is built with the data's vocabulary: a tokenizer.json of another size there is refused
    load_tokenizer(Path(meta["dir"]) / meta["tokenizer"], meta["vocab_size"], f"{meta['dir']}/meta.json")
    return meta


def _loaders(meta: dict, batch_size: int, seq_len: int, seed: int, rank: int = 0, world_size: int = 1):
    from xtrain.data.loader import TokenLoader

    root = Path(meta["dir"])
    kw = dict(seed=seed, vocab_size=meta["vocab_size"], rank=rank, world_size=world_size)
    if "chat" in meta:  # targets outside the assistant turns are ignore_index (xtrain.data.chat)
        from xtrain.data.chat import MaskedTokenLoader as TokenLoader
    train = TokenLoader([root / f for f, _ in meta["train"]["files"]], batch_size, seq_len, **kw)
    if meta["val"]["tokens"] < batch_size * world_size * (seq_len + 1):
        if rank == 0:
            print(
                f"xtrain train: warning: the validation split of {root} holds {meta['val']['tokens']} tokens, "
                f"less than one batch of {batch_size * world_size} x {seq_len + 1}; training without "
                "validation",
                file=sys.stderr,
            )
        return train, None
    val = TokenLoader([root / f for f, _ in meta["val"]["files"]], batch_size, seq_len, **kw)
    return train, val


class MetricsLog:
    """Appends one JSON line per metrics row, written at once (a crash loses at most the current line). A row
    the disk refuses is taken back and raises ``WriteFailed``, which stops the run (``xtrain.fileio.AppendLog``)."""

    def __init__(self, path: Path):
        from xtrain.fileio import AppendLog

        self.f = AppendLog(path)

    def __call__(self, m: dict) -> None:
        self.f.write(json.dumps(m) + "\n")

    def close(self):
        self.f.close()


def run(args) -> int:
    from xtrain.train import distributed as D

    try:
        info = D.init(args.device) if D.launched_by_torchrun() else None
    except ValueError as e:  # the device flag (xtrain.device.resolve_device)
        print(f"xtrain train: {e}", file=sys.stderr)
        return 2
    try:
        return _run(args, info)
    finally:
        if info is not None:
            D.shutdown()


def available_memory(device: str) -> int | None:
    """Bytes the device can still give (free GPU memory, or the OS's MemAvailable); None when unknown."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def estimate_train_bytes(mc, tc, device: str) -> int:
    """A lower estimate of one training step's memory: weights, grads and AdamW moments (fp32), plus the
    activations the tape keeps for backward (per layer: the [B, T, *] tensors of the norms, projections and
    MLP, and, unless attention is flash, the [B, H, T, T] scores and probabilities), plus the logits and
    their gradient. Used to refuse sizes that cannot fit before any work starts."""
    B, T = tc.micro_batch_size, tc.seq_len
    C, F, V, L = mc.n_embd, mc.ffn_dim, mc.vocab_size, mc.n_layer
    H, Hkv, D = mc.n_head, mc.n_kv_head, mc.head_dim
    es = 2 if mc.compute_dtype in ("bfloat16", "float16") else 4
    flash = mc.attention == "flash" or (mc.attention == "auto" and device.startswith("cuda"))
    layer = B * T * (4 * C + 2 * (H + 2 * Hkv) * D + 3 * F) * es
    if not flash:
        layer += 2 * B * H * T * T * es
    acts = layer * L if not mc.recompute else B * T * C * es * L + layer
    logits = 2 * B * T * V * 4
    return acts + logits + mc.num_params() * 16


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _resume_conflicts(args, model_cfg, stored, eval_batches: int) -> list[str]:
    """Flags given on --resume whose value differs from the run's saved one (those may not change)."""
    from xtrain.config import preset

    given = {
        "--batch-size": (args.batch_size, stored.batch_size),
        "--seq-len": (args.seq_len, stored.seq_len),
        "--lr": (args.lr, stored.lr),
        "--warmup": (args.warmup, stored.warmup_steps),
        "--grad-accum": (args.grad_accum, stored.grad_accum),
        "--seed": (args.seed, stored.seed),
        "--eval-batches": (args.eval_batches, eval_batches),
        "--vocab-size": (args.vocab_size, model_cfg.vocab_size),
        "--dtype": (args.dtype, model_cfg.compute_dtype),
        "--recompute": (args.recompute, model_cfg.recompute),
        "--dropout": (args.dropout, model_cfg.dropout),
        "--attention": (args.attention, model_cfg.attention),
        "--doc-mask": (args.doc_mask, "on" if stored.doc_mask else "off"),
    }
    out = [f"{k} {new} (the run has {old})" for k, (new, old) in given.items() if new is not None and new != old]
    out += init_from.resume_conflicts(args, stored)
    if args.preset is not None:
        shape = ("n_layer", "n_embd", "n_head", "n_kv_head", "head_dim", "ffn_dim")
        try:
            p = preset(args.preset)
            same = all(getattr(p, f) == getattr(model_cfg, f) for f in shape)
        except ValueError:
            same = False
        if not same:
            out.append(f"--preset {args.preset} (the run's model differs)")
    data_dir = stored.extra.get("data_dir")
    if args.data is not None and (data_dir is None or Path(args.data).resolve() != Path(data_dir).resolve()):
        out.append(f"--data {args.data} (the run reads {data_dir})")
    return out


TIMING_STEPS = 4  # steps timed for the expected-duration line (the first one, with its warm-up, is left out)


def _expected_duration(timing: list[tuple[float, int]], step: int, tcfg, eval_batches: int, world: int) -> str:
    """One line: the tokens/s of the first steps and the time the rest of the run should take (the
    remaining steps, plus evaluations counted as forward passes, about a third of a step per batch)."""
    secs = sum(t for t, _ in timing[1:]) or 1e-9
    tok_s = sum(n for _, n in timing[1:]) / secs
    left = tcfg.steps - step
    every = tcfg.eval_every
    evals = (tcfg.steps // every - step // every + (1 if tcfg.steps % every else 0)) if every else 1
    eval_tokens = evals * eval_batches * tcfg.batch_size * tcfg.seq_len
    eta = (left * tcfg.tokens_per_step + eval_tokens / 3) / tok_s
    return (
        f"timing: {tok_s * world:,.0f} tokens/s over steps {step - len(timing) + 2}-{step}; "
        f"expected {int(eta) // 60}m{int(eta) % 60:02d}s more for {left} steps and {evals} evaluation(s)"
    )


def truncate_metrics(path: Path, step: int) -> int:
    """Cut metrics.jsonl back to the rows of steps <= ``step`` (and drop a torn last line), rewriting it
    atomically, so a resumed run's log agrees with its weights. Returns the number of rows dropped."""
    from xtrain.fileio import atomic_write_text

    if not path.is_file():
        return 0
    keep, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
            ok = isinstance(row, dict) and int(row.get("step", 0)) <= step
        except (ValueError, TypeError):
            ok = False
        if ok:
            keep.append(line)
        elif line.strip():
            dropped += 1
    if dropped:
        atomic_write_text(path, "".join(x + "\n" for x in keep))
    return dropped


def _run(args, info) -> int:

    from xtrain.config import ConfigError, ModelConfig, TrainConfig, preset
    from xtrain.data.prepare import DataWriteError
    from xtrain.device import resolve_device
    from xtrain.fileio import DirectoryBusyError, DirLock, lock_owner, not_writable
    from xtrain.train import checkpoint as ckpt_io
    from xtrain.train import distributed as D

    t_start = time.perf_counter()
    rank, world = (info.rank, info.world_size) if info else (0, 1)
    main = rank == 0
    d = DEFAULTS
    preset_name = _pick(args.preset, d["preset"])
    init = None
    try:
        init_from.check_args(args)
        device = info.device if info else resolve_device(args.device)
        if args.resume:
            run_dir = Path(args.resume)
            if main and (owner := lock_owner(run_dir)) is not None:
                raise DirectoryBusyError(f"{run_dir}: in use by process {owner} (lock file {run_dir / '.xtrain.lock'})")
            if not run_dir.is_dir():
                raise ConfigError(f"--resume {run_dir}: no such run directory")
            if not ckpt_io.current_files(run_dir)[ckpt_io.CONFIG].is_file() and any(
                _leftover(n) for n in os.listdir(run_dir)
            ):
                raise ConfigError(
                    f"--resume {run_dir}: the run stopped before its first checkpoint, so there is nothing to "
                    f"resume; start it afresh with --out {run_dir} --restart"
                )
            if why := not_writable(run_dir):
                raise ConfigError(f"--resume {run_dir}: the run directory is not writable ({why})")
            model_cfg, stored = ckpt_io.read_config(run_dir)
            if (run_dir / "tokenizer.json").is_file():  # the final sample reads it: a corrupt one stops now
                from xtrain.data.tokenizer import load_tokenizer

                padded = (run_dir / "tokenizer_config.json").is_file()  # a fine-tune of an HF checkpoint
                load_tokenizer(run_dir / "tokenizer.json", model_cfg.vocab_size, padded=padded)
            if stored is None:
                raise ConfigError(f"{run_dir / 'config.json'}: holds no train config")
            eval_batches = int(stored.extra.get("eval_batches", 16))  # runs made before it was saved used 16
            conflicts = _resume_conflicts(args, model_cfg, stored, eval_batches)
            if conflicts:
                raise ConfigError(
                    f"--resume {run_dir}: cannot change {'; '.join(conflicts)}; a resumed run may change only "
                    f"{', '.join(RESUME_MAY_CHANGE)}"
                )
            changes = {"steps": _pick(args.steps, stored.steps)}
            check_steps(changes["steps"], args.stop_after, done=ckpt_io.read_step(run_dir), resume=run_dir)
            per_rank = resume_batch_size(stored, world)
            if per_rank != stored.batch_size:
                changes.update(batch_size=per_rank, extra={**stored.extra, "world_size": world})
                if main:
                    print(
                        f"resuming on {world} rank(s): {per_rank} sequences each keep the run's global batch of "
                        f"{per_rank * world}"
                    )
            for k in ("eval_every", "ckpt_every", "skip_nonfinite"):
                if getattr(args, k) is not None:
                    changes[k] = getattr(args, k)
            tcfg = TrainConfig.from_dict({**stored.to_dict(), **changes}).validate()
            data_spec = stored.extra.get("data_dir")
        else:
            data_spec = args.data
            eval_batches = _pick(args.eval_batches, d["eval_batches"])
            init = init_from.resolve(args)  # the checkpoint checked (config, tensors, tokenizer); no weights read
            name = init.path.resolve().name if init else preset_name
            run_dir = Path(args.out or f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
            if not (init and args.steps is None):  # a fine-tune's default length (an epoch) is known after its data
                check_steps(_pick(args.steps, d["steps"]), args.stop_after)
            batch, accum = _pick(args.batch_size, d["batch_size"]), _pick(args.grad_accum, 1)
            if batch % accum:
                raise ConfigError(f"--grad-accum {accum}: must divide --batch-size {batch}")
            if main and (owner := lock_owner(run_dir)) is not None:
                raise DirectoryBusyError(f"{run_dir}: in use by process {owner} (lock file {run_dir / '.xtrain.lock'})")
            if main:
                check_out_dir(run_dir, args.restart)
        if not main:
            D.barrier()  # rank 0 prepares the data first; the others then find it complete and reuse it
        log = print if main else (lambda *a, **k: None)
        if init is not None:
            seq_len = _pick(args.seq_len, init_from.default_seq_len(init))
            meta = init_from.resolve_data(init, data_spec, seq_len, log=log)
        else:
            meta = resolve_data(data_spec, _pick(args.vocab_size, 4096), log=log)
        if main:
            D.barrier()
        fingerprint = data_fingerprint(meta["dir"])
        if args.resume and stored.extra.get("data_fingerprint") not in (None, fingerprint):
            raise ConfigError(
                f"--resume {run_dir}: the data in {meta['dir']} changed since the run started (meta.json "
                f"fingerprint {fingerprint}, the run recorded {stored.extra['data_fingerprint']}); resuming "
                "would not continue the same run"
            )
        if not args.resume and init is not None:
            model_cfg = init_from.model_config(init, args, device)
        if not args.resume:
            seq_len = _pick(args.seq_len, init_from.default_seq_len(init) if init else d["seq_len"])
            init_from.check_chat_data(meta, seq_len, args.doc_mask)
            base = preset(preset_name)
        if not args.resume and init is None:
            model_cfg = ModelConfig.from_dict(
                {
                    **base.to_dict(),
                    "vocab_size": meta["vocab_size"],
                    "max_seq_len": max(base.max_seq_len, seq_len),
                    "dropout": _pick(args.dropout, base.dropout),
                    "recompute": _pick(args.recompute, base.recompute),
                    # bf16 compute (fp32 masters) on GPUs, where it is the fast path; fp32 on CPUs
                    "compute_dtype": _pick(
                        args.dtype, "bfloat16" if str(device).startswith("cuda") else base.compute_dtype
                    ),
                    "attention": _pick(args.attention, base.attention),
                }
            ).validate()
        if not args.resume:
            batch_size = _pick(args.batch_size, d["batch_size"])
            steps = args.steps or (init_from.epoch_steps(meta, batch_size, seq_len, world) if init else d["steps"])
            sched = init_from.schedule(args, init is not None, steps, d["lr"], d["warmup"])
            chat = "chat" in meta  # conversations: each closed by the eot, the document mask always on
            tcfg = TrainConfig(
                steps=steps,
                batch_size=batch_size,
                seq_len=seq_len,
                grad_accum=_pick(args.grad_accum, 1),
                lr=sched["lr"],
                min_lr=sched["min_lr"],
                weight_decay=sched["weight_decay"],
                warmup_steps=sched["warmup_steps"],
                seed=_pick(args.seed, d["seed"]),
                eval_every=_pick(args.eval_every, d["eval_every"]),
                ckpt_every=_pick(args.ckpt_every, 0),
                skip_nonfinite=bool(args.skip_nonfinite),
                doc_mask=args.doc_mask == "on" or chat,
                eot_id=int(meta["eot_id"]),
                doc_start="after_eot" if chat else "at_eot",
                extra={
                    "data_dir": str(Path(meta["dir"]).resolve()),
                    "data_fingerprint": fingerprint,
                    "eval_batches": eval_batches,
                    "world_size": world,
                    "warmup_frac": sched["warmup_frac"],
                    **({"init_from": init.record()} if init else {}),
                },
            ).validate()
        need, have = estimate_train_bytes(model_cfg, tcfg, str(device)), available_memory(str(device))
        if have is not None and need > have:
            raise ConfigError(
                f"batch {tcfg.micro_batch_size} x seq-len {tcfg.seq_len} needs about {_gib(need)} for one step "
                f"({model_cfg.n_layer} layers, {model_cfg.attention} attention), more than the {_gib(have)} "
                f"{device} has free; lower --seq-len or --batch-size, or use --grad-accum / --recompute"
            )
        train_data, val_data = _loaders(meta, tcfg.batch_size, tcfg.seq_len, tcfg.seed, rank, world)
    except (ConfigError, ValueError, FileNotFoundError, DirectoryBusyError) as e:
        print(f"xtrain train: {e}", file=sys.stderr)
        return 2
    except PermissionError as e:
        print(f"xtrain train: {e.filename or run_dir}: permission denied ({e.strerror})", file=sys.stderr)
        return 2
    except DataWriteError as e:  # preparing the data: a full or read-only disk (one line; nothing left)
        print(f"xtrain train: {e}", file=sys.stderr)
        return 74

    lock = None
    if main:
        try:
            lock = DirLock(run_dir, log=lambda msg: print(f"xtrain train: {msg}", file=sys.stderr)).acquire()
            if not args.resume:  # again under the lock: another process may have started a run here meanwhile
                for leftover in check_out_dir(run_dir, args.restart):
                    if leftover.is_dir():
                        shutil.rmtree(leftover)
                    else:
                        leftover.unlink()
        except (DirectoryBusyError, ConfigError) as e:
            if lock is not None:
                lock.release()
            print(f"xtrain train: {e}", file=sys.stderr)
            return 2
        except PermissionError as e:
            print(f"xtrain train: {e.filename or run_dir}: permission denied ({e.strerror})", file=sys.stderr)
            return 2
        if args.resume:
            _settle_checkpoint(run_dir)
    try:
        with StopSignals() as stop:
            return _train(
                args,
                info,
                run_dir,
                meta,
                model_cfg,
                tcfg,
                eval_batches,
                device,
                train_data,
                val_data,
                t_start,
                stop,
                init,
            )
    finally:
        if lock is not None:
            lock.release()


def _run_label(args, init) -> str:
    if args.resume:
        return "resumed"
    return f"Qwen3 from {init.spec}" if init is not None else _pick(args.preset, DEFAULTS["preset"])


def _settle_checkpoint(run_dir: Path) -> None:
    """Under the run's lock, before resuming: finish a save a crash stopped after its commit, drop one it
    stopped before (each with one line), so the run directory holds exactly its last complete checkpoint."""
    from xtrain.train import checkpoint as ckpt_io

    if ckpt_io.finish_commit(run_dir):
        print(f"xtrain train: {run_dir}: finished moving an interrupted save's committed checkpoint into place")
    if (run_dir / ckpt_io.STAGING).is_dir():
        shutil.rmtree(run_dir / ckpt_io.STAGING)
        print(
            f"xtrain train: {run_dir}: dropped {ckpt_io.STAGING}/, a checkpoint save a crash stopped before its commit"
        )


# exit codes of a run stopped by a signal (128 + the signal's number, as a shell reports a signal's death)
STOP_EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143, "SIGHUP": 129}
# the terminal's signals: inherited as ignored (nohup, a background job), they stay ignored (see StopSignals)
KEEPS_IGNORED = ("SIGINT", "SIGHUP")


class StopSignals:
    """SIGTERM, SIGINT and SIGHUP (a scheduler's preemption, Ctrl-C, a closed terminal) ask the run to stop
    at the next step boundary: the step in flight finishes, the checkpoint is saved, and the run exits with
    ``STOP_EXIT_CODES``. A second Ctrl-C stops at once (the step in flight is undone; the state before it is
    saved). Once training is over (``immediate``: the evaluation, plot and sample that follow save nothing)
    a signal exits at once with its code. Installed only on the main thread (elsewhere signals cannot be
    handled).

    A terminal's signals that the process inherited as ignored stay ignored (``KEEPS_IGNORED``): ``nohup``
    ignores SIGHUP and a shell starts a background job with SIGINT ignored precisely so that a closed terminal or
    a Ctrl-C meant for the foreground does not stop the run (the classic ``if (signal(SIGINT, SIG_IGN) !=
    SIG_IGN)`` rule). SIGTERM is always handled: it is how schedulers and ``kill`` ask a run to stop before the
    SIGKILL that follows, and ignoring it would lose the steps since the last checkpoint."""

    def __init__(self):
        self.signum: int | None = None
        self.old: dict = {}
        self.immediate = False

    def __enter__(self) -> StopSignals:
        import threading

        if threading.current_thread() is threading.main_thread():
            for name in STOP_EXIT_CODES:
                sig = getattr(signal, name, None)
                if sig is None or (name in KEEPS_IGNORED and signal.getsignal(sig) is signal.SIG_IGN):
                    continue
                self.old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.immediate:
            raise SystemExit(STOP_EXIT_CODES[signal.Signals(signum).name])
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum is None:
            self.signum = signum

    def __exit__(self, *exc) -> None:
        for sig, old in self.old.items():
            signal.signal(sig, old)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


def _train(
    args, info, run_dir, meta, model_cfg, tcfg, eval_batches, device, train_data, val_data, t_start, stop, init=None
) -> int:
    import torch

    from xtrain.data.chat import load_chat_template
    from xtrain.fileio import atomic_write_bytes
    from xtrain.model import Model
    from xtrain.train import distributed as D
    from xtrain.train.trainer import NonFiniteError, Trainer, evaluate

    rank, world = (info.rank, info.world_size) if info else (0, 1)
    main = rank == 0
    if main and init is not None:
        init_from.copy_tokenizer_files(init, run_dir)
    if main:
        tok_src = Path(meta["dir"]) / meta.get("tokenizer", "tokenizer.json")
        if tok_src.is_file() and not (run_dir / "tokenizer.json").exists():
            atomic_write_bytes(run_dir / "tokenizer.json", tok_src.read_bytes())

    def eval_fn(model):
        res = evaluate(
            model,
            val_data.val_batches(eval_batches),
            doc_eot=tcfg.eot_id if tcfg.doc_mask else None,
            doc_after=tcfg.doc_start == "after_eot",
        )
        if world > 1:  # each rank scored its slice of the validation batches: sum the totals
            t = torch.tensor(
                [res["eval_loss"] * res["eval_tokens"], res["eval_tokens"]], dtype=torch.float64, device=device
            )
            D.all_reduce_sum([t])
            loss = float(t[0] / t[1].clamp(min=1))
            res = {"eval_loss": loss, "eval_tokens": int(t[1]), "eval_ppl": math.exp(min(loss, 50.0))}
        return res

    log = None
    bar = None
    if main and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=tcfg.steps, unit="step", dynamic_ncols=True, file=sys.stdout, mininterval=0.5)
    last_val, last_train = {}, {}
    timing: list[tuple[float, int]] = []  # (seconds, tokens) of this invocation's first steps

    def on_metrics(m: dict) -> None:
        (last_val if m.get("kind") == "eval" else last_train).update(m)
        if not main:
            return
        log(m)
        if m.get("kind") != "eval" and len(timing) < TIMING_STEPS:
            timing.append((m["time"], m["tokens"]))
            if len(timing) == TIMING_STEPS:
                (bar.write if bar else print)(_expected_duration(timing, m["step"], tcfg, eval_batches, world))
        if m.get("kind") == "eval":
            msg = f"step {m['step']}: val loss {m.get('eval_loss', float('nan')):.4f}"
            (bar.write if bar else print)(msg)
        elif bar is not None:
            bar.n = m["step"]
            bar.set_postfix_str(
                f"loss {m['loss']:.3f} lr {m['lr']:.2e} |g| {m['grad_norm']:.2f} {m['tokens_per_s'] * world:.0f} tok/s",
                refresh=False,
            )
            bar.refresh()

    model = Model(model_cfg, device=device, seed=tcfg.seed)
    if init is not None and not args.resume:
        try:  # the checkpoint's weights (names, shapes and dtypes were checked before the run began)
            init.ckpt.load_into(model)
        except ValueError as e:  # a corrupt tensor, nan or inf in a weight
            print(f"xtrain train: {e}", file=sys.stderr)
            return 2
    trainer = Trainer(
        model,
        tcfg,
        train_data,
        run_dir=run_dir if main else None,
        eval_fn=eval_fn if val_data else None,
        on_metrics=on_metrics,
        all_reduce=D.all_reduce_sum if world > 1 else None,
        rank=rank,
        world_size=world,
        cuda_graph=None if args.cuda_graph is None else args.cuda_graph == "on",
    )
    if args.resume:
        try:
            trainer.resume(run_dir)
        except ValueError as e:
            print(f"xtrain train: {e}", file=sys.stderr)
            return 2
        if main and (n := truncate_metrics(run_dir / "metrics.jsonl", trainer.step)):
            print(f"metrics.jsonl: dropped {n} rows past the checkpoint's step {trainer.step}")
    if main:
        log = MetricsLog(run_dir / "metrics.jsonl")
    if bar is not None:
        bar.n = trainer.step
        bar.refresh()
    if main:
        dp = f", data parallel over {world} ranks ({tcfg.batch_size} sequences each)" if world > 1 else ""
        print(
            f"run {run_dir}: {_run_label(args, init)} model, "
            f"{model.num_params() / 1e6:.2f}M params, {device}, {model_cfg.compute_dtype}{dp}; "
            f"data {meta['dir']} ({meta['train']['tokens']:,} train tokens, vocab {meta['vocab_size']}); "
            f"{tcfg.steps} steps x {tcfg.tokens_per_step * world} tokens from step {trainer.step}"
        )

    def should_stop() -> bool:
        if world == 1:
            return stop.signum is not None
        # every rank must stop at the same step (a rank alone in the next all-reduce would wait forever)
        flag = torch.tensor([0.0 if stop.signum is None else 1.0], dtype=torch.float64, device=device)
        D.all_reduce_sum([flag])
        if flag.item() > 0 and stop.signum is None:
            stop.signum = signal.SIGTERM  # another rank got the signal
        return flag.item() > 0

    try:
        trainer.fit(args.stop_after, should_stop=should_stop)
        stop.immediate = True  # the checkpoint is saved: from here a signal needs no step boundary
        if stop.signum is not None:
            if main:
                print(
                    f"\ninterrupted at step {trainer.step} by {stop.name}; checkpoint saved, continue with: "
                    f"xtrain train --resume {run_dir}",
                    flush=True,
                )
            return STOP_EXIT_CODES[stop.name]
        if val_data is not None and (not trainer.history or trainer.history[-1].get("kind") != "eval"):
            trainer.run_eval()
    except NonFiniteError as e:
        print(f"xtrain train: stopped: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        if main:
            trainer.save(run_dir)
            print(
                f"\ninterrupted at step {trainer.step}; checkpoint saved, continue with: "
                f"xtrain train --resume {run_dir}"
            )
        return 130
    finally:
        if bar:
            bar.close()
        if log:
            log.close()
    if not main:
        return 0

    from xtrain.train.plot import plot_runs

    plot_runs([run_dir], run_dir / "loss.png", baseline=meta.get("unigram_val_loss"))

    val = last_val.get("eval_loss", float("nan"))
    uni = meta.get("unigram_val_loss", float("nan"))
    if math.isfinite(val):
        print(
            f"val loss {val:.4f} nats/token  vs  unigram baseline {uni:.4f}  vs  uniform ln V "
            f"{math.log(meta['vocab_size']):.4f}"
        )
    else:  # no validation split (one document) or no evaluation ran: say so rather than print nan
        print(
            f"no validation loss (no validation run); last train loss {last_train.get('loss', math.nan):.4f} nats/token"
        )
    print(
        f"wrote {run_dir}/ (config.json, model.safetensors, optimizer.safetensors, trainer_state.json, "
        f"metrics.jsonl, loss.png) in {time.perf_counter() - t_start:.0f}s"
    )
    chat = load_chat_template(run_dir) if args.sample_tokens > 0 else None
    if chat is not None:
        prompt = "Hello! Who are you?"
        text = init_from.sample_chat(model, chat, prompt, args.sample_tokens, tcfg.seed, temperature=0.8, top_k=50)
        print(f"--- sample (chat template, user: {prompt!r}, temperature 0.8, top-k 50) ---")
        print(text)
    elif args.sample_tokens > 0:
        from xtrain.train.sample_cli import sample_text

        text = sample_text(
            model,
            run_dir,
            prompt="def ",
            max_new_tokens=args.sample_tokens,
            temperature=0.8,
            top_k=50,
            top_p=0.95,
            seed=tcfg.seed,
        )
        print("--- sample (prompt 'def ', temperature 0.8, top-k 50, top-p 0.95) ---")
        print(text)
    return 0
