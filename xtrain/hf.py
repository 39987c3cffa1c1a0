"""Hugging Face Qwen3 checkpoints in: the model config, the weights (one file or shards, bf16/fp16/fp32) and
the tokenizer files that ``xtrain train --init-from DIR|REPO_ID`` starts from.

A checkpoint directory is what transformers' ``save_pretrained`` writes and what the Hub serves::

    config.json                      model_type "qwen3" (the model config: nothing comes from a preset)
    model.safetensors                the weights in one file, or
    model.safetensors.index.json     {"weight_map": {tensor name: shard file}} beside the shard files
    tokenizer.json                   a Hugging Face ``tokenizers`` file
    tokenizer_config.json            special tokens; the chat template (or in chat_template.jinja beside it)
    generation_config.json           optional: bos/eos ids

Everything is checked before a weight is read: the config's fields (a feature xtrain's model does not have,
such as attention biases, sliding windows or scaled RoPE, is refused by name), then every tensor's name,
shape and dtype from the safetensors headers against the shapes the config implies
(``xtrain.export.hf_shapes``); a mismatch names the tensor and the file. The weights are then read one
tensor at a time (``load_into``), straight into the model's fp32 (or fp64) masters.

A ``REPO_ID`` (``owner/name``) is downloaded through ``huggingface_hub`` (``pip install -e '.[hub]'``) into its
cache; without the package or without a network (and not cached) it is a one-line error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from xtrain.config import ModelConfig

# the tokenizer and generation files a run keeps from its checkpoint (and an export writes back unchanged)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)
_LOAD_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]


class CheckpointFormatError(ValueError):
    """A Hugging Face checkpoint xtrain cannot start from; the message names the file and what is wrong."""


def resolve_checkpoint(spec: str) -> Path:
    """``--init-from``'s argument -> a local checkpoint directory: an existing directory as given, an
    ``owner/name`` Hub id through huggingface_hub (downloaded, or taken from its cache)."""
    p = Path(spec).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise CheckpointFormatError(f"--init-from {spec}: not a directory (a checkpoint is a directory)")
    if not _REPO_ID.match(spec):
        raise CheckpointFormatError(f"--init-from {spec}: no such directory, and not a Hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointFormatError(
            f"--init-from {spec}: no such directory; downloading it from the Hugging Face Hub needs the hub extra "
            "(pip install -e '.[hub]'), or download it yourself and pass the directory"
        ) from None
    try:
        return Path(snapshot_download(spec, allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # offline, no such repo, gated: huggingface_hub raises many types
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointFormatError(
            f"--init-from {spec}: could not download it from the Hugging Face Hub ({type(e).__name__}: {first}); "
            "offline, download it elsewhere and pass the directory"
        ) from None


def read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointFormatError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointFormatError(f"{path}: expected a JSON object")
    return obj


def rope_theta(hf: dict, where: str) -> float:
    """RoPE's base from a config: ``rope_parameters`` (transformers >= 5) or top-level ``rope_theta`` with the
    older ``rope_scaling``; a scaled RoPE (YaRN, linear, dynamic, ...) is refused, xtrain's RoPE is plain."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    for what, d in (("rope_parameters", params), ("rope_scaling", scaling)):
        if d is None:
            continue
        if not isinstance(d, dict):
            raise CheckpointFormatError(f"{where}: {what} must be an object, got {json.dumps(d)[:60]}")
        kind = d.get("rope_type", d.get("type", "default"))
        if kind != "default":
            raise CheckpointFormatError(f"{where}: {what} has rope_type {kind!r}; xtrain's RoPE is the default one")
    theta = (params or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise CheckpointFormatError(f"{where}: rope_theta must be a number, got {json.dumps(theta)[:60]}")
    return float(theta)


def model_config_from_hf(hf: dict, where: str = "config.json", **overrides) -> ModelConfig:
    """A Qwen3 ``config.json`` (as a dict) -> ModelConfig; ``overrides`` set xtrain's own fields (compute dtype,
    attention, recompute, dropout). Fields xtrain's model has no equivalent for are refused by name."""
    if hf.get("model_type") != "qwen3":
        raise CheckpointFormatError(f"{where}: model_type {hf.get('model_type')!r}; only 'qwen3' is supported")
    need = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
    )
    missing = [k for k in need if k not in hf]
    if missing:
        raise CheckpointFormatError(f"{where}: missing {', '.join(missing)}")
    refused = []
    if hf.get("hidden_act", "silu") != "silu":
        refused.append(f"hidden_act {hf['hidden_act']!r} (xtrain's MLP is SwiGLU)")
    if hf.get("attention_bias", False):
        refused.append("attention_bias true (xtrain's projections have no bias)")
    if hf.get("use_sliding_window", False):
        refused.append("use_sliding_window true (xtrain's attention is full causal)")
    layer_types = hf.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        refused.append("layer_types other than full_attention")
    if refused:
        raise CheckpointFormatError(f"{where}: not supported: {'; '.join(refused)}")
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            n_layer=hf["num_hidden_layers"],
            n_embd=hf["hidden_size"],
            n_head=hf["num_attention_heads"],
            n_kv_head=hf["num_key_value_heads"],
            head_dim=hf["head_dim"],
            ffn_dim=hf["intermediate_size"],
            max_seq_len=hf.get("max_position_embeddings", 2048),
            rope_theta=rope_theta(hf, where),
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=hf.get("initializer_range", 0.02),
            **overrides,
        ).validate()
    except (TypeError, ValueError) as e:
        raise CheckpointFormatError(f"{where}: {e}") from None


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint, known from its safetensors header (nothing read yet)."""

    file: Path
    dtype: str  # the safetensors dtype string: F32, BF16, F16, ...
    shape: tuple[int, ...]


def _header(path: Path) -> dict:
    """A safetensors file's JSON header, checked against the file's size (a truncated shard is caught here)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointFormatError(f"{path}: not a safetensors file (shorter than its 8-byte header size)")
            n = int.from_bytes(raw, "little")
            size = path.stat().st_size
            if n > size - 8:
                raise CheckpointFormatError(f"{path}: truncated (header of {n} bytes, file of {size})")
            head = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointFormatError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{path}: not a safetensors file ({e})") from None
    try:
        end = max((int(v["data_offsets"][1]) for k, v in head.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, IndexError, ValueError, AttributeError):
        raise CheckpointFormatError(f"{path}: not a safetensors file (a tensor entry without data_offsets)") from None
    if 8 + n + end > size:
        raise CheckpointFormatError(f"{path}: truncated (its tensors end at byte {8 + n + end}, the file has {size})")
    return head


def checkpoint_index(ckpt: Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint in ``ckpt`` (one ``model.safetensors`` or the shards its
    ``model.safetensors.index.json`` names), from the headers: name -> TensorEntry."""
    single, index = ckpt / "model.safetensors", ckpt / "model.safetensors.index.json"
    if index.is_file():
        wm = read_json(index).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise CheckpointFormatError(f"{index}: no weight_map")
        files = sorted(set(wm.values()))
        for f in files:
            if not isinstance(f, str) or Path(f).name != f:
                raise CheckpointFormatError(f"{index}: shard name {f!r} is not a file name in the checkpoint")
    elif single.is_file():
        wm, files = None, ["model.safetensors"]
    else:
        raise CheckpointFormatError(f"{ckpt}: no model.safetensors or model.safetensors.index.json")
    out: dict[str, TensorEntry] = {}
    for f in files:
        head = _header(ckpt / f)
        for name, v in head.items():
            if name == "__metadata__":
                continue
            if wm is not None and name in wm and wm[name] != f:
                raise CheckpointFormatError(f"{ckpt / f}: holds {name}, which the index puts in {wm.get(name)!r}")
            try:
                out[name] = TensorEntry(ckpt / f, str(v["dtype"]), tuple(int(d) for d in v["shape"]))
            except (KeyError, TypeError, ValueError):
                raise CheckpointFormatError(f"{ckpt / f}: the header entry of {name} has no dtype or shape") from None
    if wm is not None:
        absent = sorted(set(wm) - set(out))
        if absent:
            raise CheckpointFormatError(f"{index}: names {absent[0]} in {wm[absent[0]]}, which does not hold it")
    return out


def _ignored(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")  # a buffer older transformers saved; recomputed by every reader


def check_tensors(ckpt: Path, hf: dict, entries: dict[str, TensorEntry]) -> dict[str, str]:
    """Check the checkpoint's tensors against the shapes ``hf`` implies (every name present, no unknown one,
    shapes and dtypes right), naming the tensor on any mismatch; -> HF name -> xtrain parameter name."""
    from xtrain.export import hf_key, hf_shapes
    from xtrain.model import param_shapes

    expected = hf_shapes(hf)
    cfg = model_config_from_hf(hf, str(ckpt / "config.json"))
    inverse = {hf_key(name): name for name in param_shapes(cfg)}  # HF name -> xtrain name
    for key, shape in expected.items():
        e = entries.get(key)
        if e is None:
            raise CheckpointFormatError(f"{ckpt}: missing tensor {key} (config.json needs it, shape {shape})")
        if e.shape != shape:
            raise CheckpointFormatError(f"{e.file}: {key} has shape {e.shape}, config.json needs {shape}")
        if e.dtype not in _LOAD_DTYPES:
            raise CheckpointFormatError(f"{e.file}: {key} has dtype {e.dtype}; readable: {', '.join(_LOAD_DTYPES)}")
    extra = sorted(k for k in set(entries) - set(expected) if not _ignored(k))
    tied_head = hf.get("tie_word_embeddings") and extra == ["lm_head.weight"]
    if extra and not tied_head:
        raise CheckpointFormatError(
            f"{entries[extra[0]].file}: unexpected tensor {extra[0]} (not part of a Qwen3 model with this config.json)"
        )
    return {k: inverse[k] for k in expected}


@dataclass
class HFCheckpoint:
    """A checked Qwen3 checkpoint directory: config, tensor index, and the map to xtrain's names."""

    path: Path
    hf_config: dict
    entries: dict[str, TensorEntry]
    names: dict[str, str]  # HF tensor name -> xtrain parameter name

    def model_config(self, **overrides) -> ModelConfig:
        return model_config_from_hf(self.hf_config, str(self.path / "config.json"), **overrides)

    def dtypes(self) -> list[str]:
        return sorted({self.entries[k].dtype for k in self.names})

    def read(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        e = self.entries[key]
        try:
            with safe_open(str(e.file), framework="pt") as f:
                t = f.get_tensor(key)
        except Exception as ex:  # safetensors' own error type: a corrupt file
            raise CheckpointFormatError(f"{e.file}: cannot read {key} ({ex})") from None
        return t

    def state(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The whole state dict under xtrain's names, in ``dtype`` (holds every tensor at once)."""
        return {name: self.read(key).to(dtype) for key, name in self.names.items()}

    def check_tied_head(self) -> None:
        """A tied checkpoint that also stores lm_head.weight must store the embedding there (transformers ties the
        two when it loads; a different matrix would be silently dropped)."""
        if "lm_head.weight" in self.entries and "lm_head.weight" not in self.names:
            if not torch.equal(self.read("lm_head.weight"), self.read("model.embed_tokens.weight")):
                raise CheckpointFormatError(
                    f"{self.entries['lm_head.weight'].file}: lm_head.weight differs from model.embed_tokens.weight "
                    "although config.json ties them"
                )

    def load_into(self, model) -> None:
        """Copy every weight into ``model``'s masters, one tensor at a time (its config must be this one's)."""
        from xtrain.autograd import no_grad

        want = model.state_dict()
        if set(want) != set(self.names.values()):
            raise CheckpointFormatError(f"{self.path}: the model's parameters are not this checkpoint's")
        self.check_tied_head()
        with no_grad():
            for key, name in self.names.items():
                t = self.read(key)
                if not torch.isfinite(t).all():
                    raise CheckpointFormatError(f"{self.entries[key].file}: {key} holds nan or inf")
                want[name].copy_(t)


def open_checkpoint(path: str | Path) -> HFCheckpoint:
    """Read and check a Qwen3 checkpoint directory (config, every tensor's header) without reading weights."""
    path = Path(path)
    hf = read_json(path / "config.json")
    model_config_from_hf(hf, str(path / "config.json"))
    entries = checkpoint_index(path)
    names = check_tensors(path, hf, entries)
    return HFCheckpoint(path, hf, entries, names)
