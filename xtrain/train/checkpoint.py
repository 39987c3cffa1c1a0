"""Run-directory checkpoints: safetensors and JSON only, written atomically, checked before loading.

A run directory holds four files:

    config.json             {"format": FORMAT, "model": ModelConfig, "train": TrainConfig | null}
    model.safetensors       the master weights under their Hugging Face Qwen3 names (fp32)
    optimizer.safetensors   "exp_avg.<name>", "exp_avg_sq.<name>" per parameter; metadata: step, hyperparams
    trainer_state.json      step, seeds, skip count, tokens seen, data-loader position, schedule

Writing is one commit (``save_checkpoint``): the four files are written (each fsync'ed) into the staging
folder ``RUN/.checkpoint-next/``; renaming that folder to ``RUN/.checkpoint-commit/`` is the commit point
(one atomic rename); the files are then moved over the run directory's own (``os.replace``, one at a time)
and the empty folder removed. Until the commit the run directory's files are the previous checkpoint,
untouched and complete; after it, the new checkpoint is each file in ``.checkpoint-commit/`` if still there,
else in the run directory (a moved file left the folder by the same rename that put it in place). So a
``kill -9`` at any instant leaves one complete checkpoint: the previous one (a torn staging folder is
ignored, with one line) or the new one (readers take the files still waiting in the commit folder, with one
line; the next save or ``--resume`` finishes the moves). Every file also carries the step it belongs to
(safetensors metadata, JSON field), so files mixed by hand are caught as a mismatch.

Readers (``read_checkpoint``, ``read_config``) never write. A reader racing a save (``xtrain sample`` while
training checkpoints) may read files of two commits; it notices that the directory changed under it and
reads again, so it never reports a spurious mismatch. It reports a save folder left behind (the lines in
``Checkpoint.notes``) only when no live process holds the run's lock (``.xtrain.lock``): the folders of the
owner's save in progress are no crash, and are read around in silence.

Loading (``read_checkpoint``): every file is read and parsed, steps are cross-checked, and the tensors are
checked against the model and optimizer (names, shapes) before anything is copied in (``restore``), so a
truncated, corrupt or mismatched checkpoint raises ``CheckpointError`` naming the file and nothing is
half-loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load

from xtrain.config import ModelConfig, TrainConfig
from xtrain.fileio import atomic_write_bytes, atomic_write_json, lock_owner, safetensors_bytes, writing  # noqa: F401
from xtrain.fileio import fsync_dir as _fsync_dir

FORMAT = "xtrain-checkpoint/1"
CONFIG, MODEL, OPTIMIZER, STATE = "config.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json"
FILES = (CONFIG, MODEL, OPTIMIZER, STATE)
STAGING, COMMITTED = ".checkpoint-next", ".checkpoint-commit"


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt, or does not match the model / the other files."""


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}


def save_checkpoint(
    run_dir: str | Path, *, model, optimizer, trainer_state: dict, train_config: TrainConfig | None = None
) -> Path:
    """Commit a checkpoint of ``model`` / ``optimizer`` at ``trainer_state["step"]`` as one unit (see the
    module docstring): staged, committed by one rename, then moved into place."""
    run_dir = Path(run_dir)
    with writing(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
    finish_commit(run_dir)  # a commit a crash left half moved goes into place first
    stage = run_dir / STAGING
    with writing(stage):
        if stage.exists():
            shutil.rmtree(stage)  # a save a crash interrupted before its commit: never current, drop it
        stage.mkdir()
    step = int(trainer_state["step"])
    meta = {"format": FORMAT, "step": str(step)}
    try:
        atomic_write_json(
            stage / CONFIG,
            {
                "format": FORMAT,
                "model": model.config.to_dict(),
                "train": None if train_config is None else train_config.to_dict(),
            },
        )
        atomic_write_bytes(stage / MODEL, safetensors_bytes(_cpu(model.state_dict()), meta))
        opt_meta = dict(meta, optimizer=json.dumps(optimizer.state_meta()))
        atomic_write_bytes(stage / OPTIMIZER, safetensors_bytes(_cpu(optimizer.state_tensors()), opt_meta))
        atomic_write_json(stage / STATE, dict(trainer_state, format=FORMAT))
        _fsync_dir(stage)
        with writing(run_dir / COMMITTED):
            os.replace(stage, run_dir / COMMITTED)  # the commit point
    except BaseException:
        # not committed (a full disk, a file-size limit, an error of ours): the previous checkpoint stays the
        # current one; the staging folder goes, so a full disk gets its space back (on a file system that
        # turned read-only nothing can be removed: it stays, and readers and the next save ignore it)
        shutil.rmtree(stage, ignore_errors=True)
        raise
    _fsync_dir(run_dir)
    finish_commit(run_dir)
    return run_dir


def finish_commit(run_dir: str | Path) -> bool:
    """Move the files of a committed checkpoint (``.checkpoint-commit/``) over the run directory's and remove
    the folder; a no-op without one. Idempotent, so a crash inside it is finished by the next call. Only the
    process that owns the run directory calls it (a save, ``--resume``). Returns whether there was one."""
    run_dir = Path(run_dir)
    commit = run_dir / COMMITTED
    if not commit.is_dir():
        return False
    for name in FILES:
        if (commit / name).is_file():
            with writing(run_dir / name):
                os.replace(commit / name, run_dir / name)
    _fsync_dir(run_dir)
    with writing(commit):
        shutil.rmtree(commit)
    return True


# -- reading ------------------------------------------------------------------------------------------


def _missing(path: Path) -> CheckpointError:
    return CheckpointError(f"{path}: missing (a checkpoint directory needs {', '.join(FILES)})")


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
    except (FileNotFoundError, IsADirectoryError):
        raise _missing(path) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON (truncated or corrupt?): {e}") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: not an xtrain checkpoint file (format {obj.get('format')!r} != {FORMAT!r})"
            if isinstance(obj, dict)
            else f"{path}: expected a JSON object"
        )
    return obj


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        raise _missing(path) from None
    try:
        tensors = st_load(data)
        # the metadata lives in the JSON header: 8-byte little-endian length, then the header
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
    except Exception as e:  # safetensors raises its own error type; any failure here means a bad file
        raise CheckpointError(f"{path}: not a valid safetensors file (truncated or corrupt?): {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: missing xtrain metadata (format {meta.get('format')!r} != {FORMAT!r})")
    return tensors, meta


def current_files(run_dir: str | Path) -> dict[str, Path]:
    """Where each file of the run's current checkpoint is: in ``.checkpoint-commit/`` while a committed save
    is being moved into place, else in the run directory."""
    run_dir = Path(run_dir)
    commit = run_dir / COMMITTED
    return {n: commit / n if (commit / n).is_file() else run_dir / n for n in FILES}


def _signature(run_dir: Path) -> tuple:
    """What changes when a save renames anything in the run directory (inode, mtime, size of each file)."""
    sig = []
    for base in (run_dir, run_dir / COMMITTED):
        for n in FILES:
            try:
                st = os.stat(base / n)
                sig.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                sig.append(None)
    return tuple(sig)


def _consistent(run_dir: Path, read):
    """``read()`` again while a save renamed files under it (a reader racing a writer); a failure on a
    directory that did not change while it was read is a real one and is raised."""
    for attempt in range(20):
        before = _signature(run_dir)
        try:
            return read()
        except CheckpointError:
            if attempt == 19 or _signature(run_dir) == before:
                raise
        time.sleep(0.02 * (attempt + 1))


def read_config(run_dir: str | Path) -> tuple[ModelConfig, TrainConfig | None]:
    """The model and train configs stored in the run's ``config.json`` (validated)."""
    return _consistent(Path(run_dir), lambda: _read_config(run_dir))


def _read_config(run_dir: str | Path) -> tuple[ModelConfig, TrainConfig | None]:
    path = current_files(run_dir)[CONFIG]
    obj = _read_json(path)
    try:
        model_cfg = ModelConfig.from_dict(obj.get("model")).validate()
        train_cfg = None if obj.get("train") is None else TrainConfig.from_dict(obj["train"]).validate()
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    return model_cfg, train_cfg


def read_step(run_dir: str | Path) -> int:
    """The step of the run's current checkpoint, from its ``trainer_state.json`` alone."""

    def read() -> int:
        path = current_files(run_dir)[STATE]
        step = _read_json(path).get("step")
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"{path}: 'step' must be an integer >= 0, got {step!r}")
        return step

    return _consistent(Path(run_dir), read)


@dataclass
class Checkpoint:
    run_dir: Path
    model_config: ModelConfig
    train_config: TrainConfig | None
    model_state: dict[str, torch.Tensor]
    optim_state: dict[str, torch.Tensor] | None
    optim_meta: dict | None
    trainer_state: dict
    step: int
    notes: list[str]  # one line each for what a reader should tell the user (an interrupted save)


def read_checkpoint(run_dir: str | Path, *, with_optimizer: bool = True) -> Checkpoint:
    """Read and cross-check every file of the run's current checkpoint; loads nothing into any model."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: no such checkpoint directory")
    ck = _consistent(run_dir, lambda: _read_checkpoint(run_dir, with_optimizer))
    ck.notes.extend(_interrupted_saves(run_dir, ck.step))
    return ck


def _interrupted_saves(run_dir: Path, step: int) -> list[str]:
    """One line for each save folder that a stopped process left behind. While the run's lock has a live owner
    (a trainer checkpointing), its folders are a save in progress, read around silently: no line. A folder is
    reported only if it is still there after the owner was found gone, since a trainer that exits cleanly
    finishes its save first (it may do so between the two looks)."""
    found = [name for name in (COMMITTED, STAGING) if (run_dir / name).is_dir()]
    if not found or lock_owner(run_dir) is not None:
        return []
    notes = []
    if COMMITTED in found and (run_dir / COMMITTED).is_dir():
        notes.append(
            f"{run_dir}: checkpoint step {step} was committed but a crash stopped it before all its files "
            f"were moved into place; reading them from {COMMITTED}/ (the next save or --resume finishes it)"
        )
    if STAGING in found and (run_dir / STAGING).is_dir():
        notes.append(
            f"{run_dir}: ignoring {STAGING}/, a checkpoint save that has not finished (interrupted, or still "
            f"being written); using the last complete checkpoint, step {step}"
        )
    return notes


def _read_checkpoint(run_dir: Path, with_optimizer: bool) -> Checkpoint:
    files = current_files(run_dir)
    model_cfg, train_cfg = _read_config(run_dir)
    state = _read_json(files[STATE])
    step = state.get("step")
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{files[STATE]}: 'step' must be an integer >= 0, got {step!r}")
    model_state, meta = _read_safetensors(files[MODEL])
    if meta.get("step") != str(step):
        raise CheckpointError(
            f"{files[MODEL]}: holds step {meta.get('step')}, but {STATE} says step {step} "
            "(files from different saves, and no interrupted commit to explain them: edited by hand?)"
        )
    optim_state = optim_meta = None
    if with_optimizer:
        optim_state, ometa = _read_safetensors(files[OPTIMIZER])
        if ometa.get("step") != str(step):
            raise CheckpointError(
                f"{files[OPTIMIZER]}: holds step {ometa.get('step')}, but {STATE} says "
                f"step {step} (files from different saves, and no interrupted commit to explain them: edited by hand?)"
            )
        try:
            optim_meta = json.loads(ometa.get("optimizer", ""))
        except json.JSONDecodeError:
            raise CheckpointError(f"{files[OPTIMIZER]}: optimizer metadata is not valid JSON") from None
    for k, t in model_state.items():
        if not torch.isfinite(t).all():
            raise CheckpointError(f"{files[MODEL]}: tensor {k} holds nan or inf")
    return Checkpoint(run_dir, model_cfg, train_cfg, model_state, optim_state, optim_meta, state, step, [])


def restore(ckpt: Checkpoint, model, optimizer=None) -> None:
    """Copy a checked checkpoint into ``model`` (and ``optimizer``). Everything is validated first:
    on any mismatch a CheckpointError names the file and neither object has been touched."""
    if ckpt.model_config != model.config:
        diff = {
            k: (v, getattr(model.config, k))
            for k, v in ckpt.model_config.to_dict().items()
            if getattr(model.config, k) != v
        }
        raise CheckpointError(
            f"{ckpt.run_dir / CONFIG}: model config differs from the model being loaded "
            f"(field: (checkpoint, model)) {diff}"
        )
    try:
        _check_model_state(model, ckpt.model_state)
    except ValueError as e:
        raise CheckpointError(f"{ckpt.run_dir / MODEL}: {e}") from None
    if optimizer is not None:
        if ckpt.optim_state is None:
            raise CheckpointError(f"{ckpt.run_dir / OPTIMIZER}: not read (read_checkpoint(with_optimizer=False))")
        try:
            optimizer.check_state(ckpt.optim_state, ckpt.optim_meta, str(ckpt.run_dir / OPTIMIZER))
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    model.load_state_dict(ckpt.model_state, source=str(ckpt.run_dir / MODEL))
    if optimizer is not None:
        optimizer.load_state(ckpt.optim_state, ckpt.optim_meta, str(ckpt.run_dir / OPTIMIZER))


def _check_model_state(model, sd: dict[str, torch.Tensor]) -> None:
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(want) - set(sd))
    extra = sorted(set(sd) - set(want))
    if missing or extra:
        raise ValueError(f"parameter names do not match the model (missing {missing[:5]}, unexpected {extra[:5]})")
    for k, shape in want.items():
        if tuple(sd[k].shape) != shape:
            raise ValueError(f"{k} has shape {tuple(sd[k].shape)}, the model expects {shape}")


def load_model(run_dir: str | Path, device: str | torch.device = "cpu", **overrides):
    """A ``Model`` built from ``run_dir/config.json`` with the weights of ``model.safetensors``
    (for sampling, eval and export). ``overrides`` replace config fields that do not change the
    parameters (e.g. attention="composed", compute_dtype="bfloat16", dropout=0.0)."""
    import dataclasses

    from xtrain.model import Model

    ckpt = read_checkpoint(run_dir, with_optimizer=False)
    cfg = dataclasses.replace(ckpt.model_config, **overrides).validate() if overrides else ckpt.model_config
    model = Model(cfg, device=device)
    try:
        _check_model_state(model, ckpt.model_state)
    except ValueError as e:
        raise CheckpointError(f"{ckpt.run_dir / MODEL}: {e}") from None
    model.load_state_dict(ckpt.model_state, source=str(ckpt.run_dir / MODEL))
    return model
