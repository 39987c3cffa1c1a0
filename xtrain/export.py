"""Hugging Face export and import: a run's weights as a ``Qwen3ForCausalLM`` checkpoint, and back.

    xtrain export RUN --out DIR [--dtype bfloat16|float32]

DIR then holds ``config.json`` (model_type "qwen3"), ``model.safetensors``, ``generation_config.json`` and,
when the run has one, the tokenizer (``tokenizer.json`` + ``tokenizer_config.json``), so that
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads it (tested: same logits as xtrain).

The parameter names are mapped through an explicit table (``hf_key``), and every tensor's shape is checked
against the shape the Hugging Face config implies (``hf_shapes``, derived from the HF field names, not from
xtrain's own table), so a layout mismatch fails here instead of loading garbage. With tied embeddings
there is no ``lm_head.weight`` in the file (HF ties it to ``model.embed_tokens.weight``).

An export is committed as one unit: its files are written into a staging folder beside DIR
(``.DIR.export-PID``) and the folder is renamed to DIR, or, over a previous export, swapped with it in one
atomic step (Linux ``renameat2``; elsewhere the old one is renamed aside first) and the old one removed.
A kill at any instant leaves DIR as it was (absent, empty, or the previous export) or the complete new
export, never a mix; the next export removes the staging folders a killed one left (their process gone).
A write that fails (disk full, ``ulimit -f``, read-only file system) stops the export with one line naming
the file and the cause and exit code 74; DIR is as it was and the staging folder is removed.

DIR must be new, empty, or a previous export (only the files an export writes, its model.safetensors marked
``EXPORT_MARK``): a run directory, a Hugging Face model that xtrain did not write, or any other non-empty
directory, is refused before anything is written. The exported tokenizer's post-processor
puts ``<|endoftext|>`` in front of every encoded text, as every training document starts with it, so
``tokenizer(prompt)`` + ``generate`` continue a prompt exactly as ``xtrain sample`` does.

A run fine-tuned from a Hugging Face checkpoint (``xtrain train --init-from``) keeps that checkpoint's tokenizer
files; its export writes them back unchanged (tokenizer.json, tokenizer_config.json, chat_template.jinja,
special_tokens_map.json, generation_config.json: whichever the checkpoint had), with the original bos/eos/pad ids
in config.json, so ``apply_chat_template`` + ``generate`` work on it as on the original (tested).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from xtrain.config import ModelConfig
from xtrain.fileio import (
    _pid_alive,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    not_writable,
    safetensors_bytes,
    writing,
)
from xtrain.fileio import fsync_dir as _fsync_dir

# xtrain parameter name (per layer, after "model.layers.{i}.") -> Hugging Face Qwen3 name. The same strings
# today (xtrain adopted the HF names), kept as an explicit table so a rename on either side is one edit here.
LAYER_KEYS = {
    k: k
    for k in (
        "input_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "self_attn.o_proj.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    )
}
TOP_KEYS = {
    "model.embed_tokens.weight": "model.embed_tokens.weight",
    "model.norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def hf_key(name: str) -> str:
    if name in TOP_KEYS:
        return TOP_KEYS[name]
    prefix, _, rest = name.partition(".layers.")
    i, _, key = rest.partition(".")
    if prefix != "model" or not i.isdigit() or key not in LAYER_KEYS:
        raise ValueError(f"export: no Hugging Face name for parameter {name!r}")
    return f"model.layers.{i}.{LAYER_KEYS[key]}"


def hf_config(cfg: ModelConfig, dtype: str) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_cache": True,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
        "use_sliding_window": False,
    }


def hf_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """The tensor shapes a Qwen3 checkpoint with this HF config must have (HF field names only)."""
    C, F, V = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    D, H, Hkv = hf["head_dim"], hf["num_attention_heads"], hf["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (C,),
                p + "post_attention_layernorm.weight": (C,),
                p + "self_attn.q_proj.weight": (H * D, C),
                p + "self_attn.k_proj.weight": (Hkv * D, C),
                p + "self_attn.v_proj.weight": (Hkv * D, C),
                p + "self_attn.o_proj.weight": (C, H * D),
                p + "self_attn.q_norm.weight": (D,),
                p + "self_attn.k_norm.weight": (D,),
                p + "mlp.gate_proj.weight": (F, C),
                p + "mlp.up_proj.weight": (F, C),
                p + "mlp.down_proj.weight": (C, F),
            }
        )
    if not hf["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, C)
    return shapes


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EXPORT_FILES = frozenset(
    {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "special_tokens_map.json",
    }
)
# the safetensors metadata of an export's model.safetensors: "format" is what transformers reads; "producer" marks
# the folder as xtrain's, so a later export replaces it and never a Hugging Face model someone downloaded there
EXPORT_MARK = {"format": "pt", "producer": "xtrain export"}


def _marked_safetensors(tensors: dict) -> bytes:
    """The safetensors bytes of ``tensors`` with ``EXPORT_MARK`` as metadata, the same bytes for the same tensors."""
    return safetensors_bytes(tensors, EXPORT_MARK)


def _is_export(out: Path) -> bool:
    """Whether ``out`` holds an export written by xtrain (its model.safetensors carries ``EXPORT_MARK``)."""
    try:
        with open(out / "model.safetensors", "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(min(n, 1 << 24)))
        return header.get("__metadata__", {}).get("producer") == EXPORT_MARK["producer"]
    except (OSError, ValueError, AttributeError):
        return False


def check_export_dir(out_dir: str | Path, run_dir: str | Path | None = None) -> None:
    """ValueError unless ``out_dir`` is missing, empty, or a previous export (nothing but EXPORT_FILES, its
    model.safetensors marked as xtrain's): never write over a run or files xtrain did not write."""
    out = Path(out_dir)
    if run_dir is not None and out.exists() and out.resolve() == Path(run_dir).resolve():
        raise ValueError(f"export: --out {out} is the run directory itself; pick a new directory")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if why := not_writable(parent):
        raise ValueError(f"export: --out {out}: {parent} is not writable ({why})")
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"export: --out {out} exists and is not a directory")
    names = {p.name for p in out.iterdir()}
    if not names:
        return
    if "trainer_state.json" in names or "optimizer.safetensors" in names:
        raise ValueError(f"export: --out {out} is an xtrain run directory; pick a new directory")
    if not (names <= EXPORT_FILES and _is_export(out)):
        shown = ", ".join(sorted(names)[:4]) + (" ..." if len(names) > 4 else "")
        raise ValueError(
            f"export: --out {out} is not empty and not a previous xtrain export (holds {shown}); pick a new directory"
        )


def hf_tokenizer_json(tokenizer_json: str | Path, eos_id: int) -> str:
    """The run's tokenizer.json with a post-processor that prepends the end-of-text token (id ``eos_id``)
    to every encoding, the way training documents start."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    tok = HFTokenizer.from_file(str(tokenizer_json))
    eot = tok.id_to_token(eos_id)
    if eot is None:
        raise ValueError(f"export: {tokenizer_json} has no token with id {eos_id}")
    tok.post_processor = TemplateProcessing(
        single=f"{eot} $A", pair=f"{eot} $A {eot} $B:1", special_tokens=[(eot, eos_id)]
    )
    return tok.to_str(pretty=True)


def export_hf(
    model_config: ModelConfig,
    state: dict[str, torch.Tensor],
    out_dir: str | Path,
    dtype: str = "bfloat16",
    tokenizer_json: str | Path | None = None,
    eos_id: int | None = None,
    hf_files: str | Path | None = None,
) -> Path:
    """Write a Hugging Face Qwen3 checkpoint of ``state`` (xtrain names -> tensors) into out_dir. ``hf_files``: a
    directory holding a Hugging Face checkpoint's tokenizer files (a run fine-tuned from one): they are written
    unchanged (``xtrain.hf.TOKENIZER_FILES``) and the config's bos/eos ids come from its generation_config.json,
    instead of the tokenizer_config.json and the end-of-text post-processor made for xtrain's own tokenizers."""
    if dtype not in _DTYPES:
        raise ValueError(f"export: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    hf = hf_config(model_config, dtype)
    expected = hf_shapes(hf)
    tensors = {}
    for name, t in state.items():
        key = hf_key(name)
        if key not in expected:
            raise ValueError(f"export: {name} -> {key} is not part of a Qwen3 checkpoint with this config")
        if tuple(t.shape) != expected[key]:
            raise ValueError(f"export: {name} has shape {tuple(t.shape)}, the HF config needs {expected[key]}")
        tensors[key] = t.detach().to("cpu", _DTYPES[dtype]).contiguous()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"export: missing tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    out = Path(out_dir)
    tok_text = None
    if tokenizer_json is not None and Path(tokenizer_json).is_file():
        tok_text = Path(tokenizer_json).read_text()
        if eos_id is not None and json.loads(tok_text).get("model") is not None:  # an HF tokenizer.json
            tok_text = hf_tokenizer_json(tokenizer_json, eos_id)
    final = out
    with writing(final.parent):
        final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(final)
    stage = final.parent / f".{final.name}.export-{os.getpid()}"
    with writing(stage):
        if stage.exists():
            shutil.rmtree(stage)
        stage.mkdir()
    try:
        if hf_files is not None:
            _write_hf_files(stage, tensors, hf, Path(hf_files))
        else:
            _write_export(stage, tensors, hf, eos_id, tok_text, tokenizer_json, model_config)
        _fsync_dir(stage)
        with writing(final):
            old = _commit_export(stage, final)
    except BaseException:
        # not committed (a full disk, a file-size limit, ...): DIR is as it was; the staging folder goes, so a
        # full disk gets its space back (on a file system that turned read-only it stays, for the next export)
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if old is not None:  # the previous export, now aside; one left behind is removed by the next export
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(final.parent)
    return final


def _commit_export(stage: Path, final: Path) -> Path | None:
    """Put the complete export ``stage`` in place as ``final``; -> where the previous export (if any) now is.
    On failure ``final`` is as it was."""
    if not final.exists():
        os.replace(stage, final)  # the commit point
        return None
    # empty, or a previous export (check_export_dir): swapped with the new one in one step, then dropped
    if _exchange(stage, final):
        return stage
    # no atomic swap here: a kill between these two renames leaves no DIR (the old export aside)
    aside = final.parent / f".{final.name}.export-old-{os.getpid()}"
    os.replace(final, aside)
    try:
        os.replace(stage, final)
    except BaseException:
        os.replace(aside, final)  # the previous export back in place
        raise
    return aside


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system has no such call."""
    import ctypes
    import errno

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove_stale_staging(final: Path) -> None:
    """Drop the staging folders (``.NAME.export-PID``, ``.NAME.export-old-PID``) of exports to ``final`` whose
    process is gone (killed mid-export)."""
    prefix = f".{final.name}.export-"
    for p in final.parent.glob(prefix + "*"):
        pid = p.name[len(prefix) :].removeprefix("old-")
        if p.is_dir() and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _write_hf_files(out: Path, tensors, hf: dict, src: Path) -> None:
    """A fine-tuned checkpoint's export: the weights, config.json with the original bos/eos/pad ids, and the
    original tokenizer, chat template and generation files, byte for byte."""
    from xtrain.hf import TOKENIZER_FILES

    atomic_write_bytes(out / "model.safetensors", _marked_safetensors(tensors))
    gen = {}
    if (src / "generation_config.json").is_file():
        gen = json.loads((src / "generation_config.json").read_text())
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if gen.get(k) is not None:
            hf[k] = gen[k]
    atomic_write_json(out / "config.json", hf)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            atomic_write_bytes(out / name, (src / name).read_bytes())


def _write_export(out: Path, tensors, hf: dict, eos_id, tok_text, tokenizer_json, model_config) -> None:
    atomic_write_bytes(out / "model.safetensors", _marked_safetensors(tensors))
    if eos_id is not None:
        hf["eos_token_id"] = hf["bos_token_id"] = eos_id
    atomic_write_json(out / "config.json", hf)
    atomic_write_json(
        out / "generation_config.json",
        {k: v for k, v in (("eos_token_id", eos_id), ("bos_token_id", eos_id)) if v is not None},
    )
    if tok_text is not None:
        atomic_write_text(out / "tokenizer.json", tok_text)
        # split_special_tokens: a literal "<|endoftext|>" in a prompt is text, as xtrain's tokenizer reads it
        # (transformers would otherwise turn it into the control token: prompt text could inject one)
        tcfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model_config.max_seq_len,
            "split_special_tokens": True,
        }
        if eos_id is not None:
            tok = json.loads(Path(tokenizer_json).read_text())
            names = {a["id"]: a["content"] for a in tok.get("added_tokens", [])}
            if eos_id in names:
                tcfg.update(eos_token=names[eos_id], bos_token=names[eos_id])
        atomic_write_json(out / "tokenizer_config.json", tcfg)


def import_hf(hf_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A Qwen3 checkpoint directory (one ``model.safetensors`` or shards with their index; bf16, fp16 or fp32)
    -> (ModelConfig, xtrain state dict in fp32); names, shapes and dtypes checked first (``xtrain.hf``)."""
    from xtrain.hf import open_checkpoint

    ck = open_checkpoint(hf_dir)
    ck.check_tied_head()
    return ck.model_config(), ck.state(torch.float32)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="export a run as a Hugging Face Qwen3 checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", help="run directory (written by xtrain train)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES), help="stored dtype (default bfloat16)")
    p.set_defaults(func=run)


def run(args) -> int:
    from xtrain.train import checkpoint as ckpt_io

    run_dir = Path(args.run)
    try:
        check_export_dir(args.out, run_dir)
        ck = ckpt_io.read_checkpoint(run_dir, with_optimizer=False)
        for note in ck.notes:
            print(f"xtrain export: {note}", file=sys.stderr)
        eos = None
        tok_path = run_dir / "tokenizer.json"
        # a run fine-tuned from a Hugging Face checkpoint keeps its tokenizer files (tokenizer_config.json among
        # them): those go out unchanged
        hf_files = run_dir if (run_dir / "tokenizer_config.json").is_file() else None
        if tok_path.is_file() and hf_files is None:
            from xtrain.data.tokenizer import load_tokenizer

            eos = load_tokenizer(tok_path, ck.model_config.vocab_size).eot_id
        out = export_hf(ck.model_config, ck.model_state, args.out, args.dtype, tok_path, eos, hf_files)
    except (ValueError, FileNotFoundError) as e:
        print(f"xtrain export: {e}", file=sys.stderr)
        return 2
    except PermissionError as e:
        print(f"xtrain export: {e.filename}: permission denied ({e.strerror})", file=sys.stderr)
        return 2
    print(
        f"wrote {out}/ ({', '.join(sorted(p.name for p in out.iterdir()))}): load with "
        f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})"
    )
    return 0
