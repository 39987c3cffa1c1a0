"""Run-directory checkpoints: safetensors and JSON only, written atomically, checked before loading.

A run directory holds four files:

    config.json             {"format": FORMAT, "model": ModelConfig, "train": TrainConfig | null}
    model.safetensors       the master weights under their Hugging Face Qwen3 names (fp32)
    optimizer.safetensors   "exp_avg.<name>", "exp_avg_sq.<name>" per parameter; metadata: step, hyperparams
    trainer_state.json      step, seeds, skip count, tokens seen, data-loader position, schedule

Writing: each file goes to a temporary name in the same directory, is flushed and fsync'ed, then renamed
over the real name (``os.replace`` is atomic), so a crash never leaves a half-written file under a real
name. trainer_state.json is written last. Every file carries the step it belongs to (safetensors metadata,
JSON field), so a crash *between* files (new model, old optimizer) is caught at load time as a mismatch.

Loading (``read_checkpoint``): every file is read and parsed, steps are cross-checked, and the tensors are
checked against the model and optimizer (names, shapes) before anything is copied in (``restore``), so a
truncated, corrupt or mismatched checkpoint raises ``CheckpointError`` naming the file and nothing is
half-loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from xtrain.config import ModelConfig, TrainConfig
from xtrain.fileio import atomic_write_bytes, atomic_write_json  # noqa: F401 (re-exported)

FORMAT = "xtrain-checkpoint/1"
CONFIG, MODEL, OPTIMIZER, STATE = "config.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json"
FILES = (CONFIG, MODEL, OPTIMIZER, STATE)


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt, or does not match the model / the other files."""


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}


def save_checkpoint(
    run_dir: str | Path, *, model, optimizer, trainer_state: dict, train_config: TrainConfig | None = None
) -> Path:
    """Write the four files of a checkpoint of ``model`` / ``optimizer`` at ``trainer_state["step"]``."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    step = int(trainer_state["step"])
    meta = {"format": FORMAT, "step": str(step)}
    atomic_write_json(
        run_dir / CONFIG,
        {
            "format": FORMAT,
            "model": model.config.to_dict(),
            "train": None if train_config is None else train_config.to_dict(),
        },
    )
    atomic_write_bytes(run_dir / MODEL, st_save(_cpu(model.state_dict()), metadata=meta))
    opt_meta = dict(meta, optimizer=json.dumps(optimizer.state_meta()))
    atomic_write_bytes(run_dir / OPTIMIZER, st_save(_cpu(optimizer.state_tensors()), metadata=opt_meta))
    atomic_write_json(run_dir / STATE, dict(trainer_state, format=FORMAT))
    return run_dir


# -- reading ------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (a checkpoint directory needs {', '.join(FILES)})")
    try:
        obj = json.loads(path.read_text())
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
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (a checkpoint directory needs {', '.join(FILES)})")
    data = path.read_bytes()
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


def read_config(run_dir: str | Path) -> tuple[ModelConfig, TrainConfig | None]:
    """The model and train configs stored in ``run_dir/config.json`` (validated)."""
    path = Path(run_dir) / CONFIG
    obj = _read_json(path)
    try:
        model_cfg = ModelConfig.from_dict(obj.get("model")).validate()
        train_cfg = None if obj.get("train") is None else TrainConfig.from_dict(obj["train"]).validate()
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    return model_cfg, train_cfg


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


def read_checkpoint(run_dir: str | Path, *, with_optimizer: bool = True) -> Checkpoint:
    """Read and cross-check every file of a checkpoint; loads nothing into any model."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: no such checkpoint directory")
    model_cfg, train_cfg = read_config(run_dir)
    state = _read_json(run_dir / STATE)
    step = state.get("step")
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{run_dir / STATE}: 'step' must be an integer >= 0, got {step!r}")
    model_state, meta = _read_safetensors(run_dir / MODEL)
    if meta.get("step") != str(step):
        raise CheckpointError(
            f"{run_dir / MODEL}: holds step {meta.get('step')}, but {STATE} says step {step} "
            "(files from different saves: an interrupted checkpoint?)"
        )
    optim_state = optim_meta = None
    if with_optimizer:
        optim_state, ometa = _read_safetensors(run_dir / OPTIMIZER)
        if ometa.get("step") != str(step):
            raise CheckpointError(
                f"{run_dir / OPTIMIZER}: holds step {ometa.get('step')}, but {STATE} says "
                f"step {step} (files from different saves: an interrupted checkpoint?)"
            )
        try:
            optim_meta = json.loads(ometa.get("optimizer", ""))
        except json.JSONDecodeError:
            raise CheckpointError(f"{run_dir / OPTIMIZER}: optimizer metadata is not valid JSON") from None
    for k, t in model_state.items():
        if not torch.isfinite(t).all():
            raise CheckpointError(f"{run_dir / MODEL}: tensor {k} holds nan or inf")
    return Checkpoint(run_dir, model_cfg, train_cfg, model_state, optim_state, optim_meta, state, step)


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
