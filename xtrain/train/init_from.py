"""``xtrain train --init-from DIR|REPO_ID``: fine-tune a Hugging Face Qwen3 checkpoint, and the schedule flags
(peak and minimum learning rate, weight decay, warmup as a fraction) a fine-tune needs.

The model config comes from the checkpoint's config.json (``xtrain.hf``: width, heads, GQA, head_dim, tied or
not, RoPE base, norm eps, vocabulary, context); only xtrain's own settings (compute dtype, attention, recompute,
dropout) come from flags. Every tensor's name, shape and dtype is checked before the run directory is made; the
weights are read into the model's fp32 masters once the run is locked.

``--data`` with ``--init-from``: a ``.jsonl`` of ``{"messages": [...]}`` conversations is rendered with the
checkpoint's chat template and packed for ``--seq-len`` windows (``xtrain.data.chat``, cached like a prepared
corpus), the loss on assistant tokens only, each conversation kept apart by the document mask (a document starts
after each separator: ``TrainConfig.doc_start = "after_eot"``); any other corpus is tokenized with the checkpoint's
tokenizer (continued pretraining); a prepared directory must have been made with the checkpoint's tokenizer.

The run directory keeps the checkpoint's tokenizer files unchanged (tokenizer.json, tokenizer_config.json,
chat_template.jinja, generation_config.json, ...), so ``xtrain export`` writes them back beside the fine-tuned
weights and ``xtrain serve`` renders chats with the template and stops at its end-of-turn token.

Defaults with ``--init-from`` (each a flag): peak lr 2e-5, --min-lr 0.1 x lr, --weight-decay 0, --warmup-frac
0.03, --seq-len 1024 (or the checkpoint's context if shorter), --steps one epoch of the training windows.
Without it: --min-lr 0.1 x lr, --weight-decay 0.1, --warmup 20 steps. The values are recorded in the run's
config.json (train.lr, min_lr, weight_decay, warmup_steps; train.extra holds warmup_frac and init_from).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

from xtrain.hf import TOKENIZER_FILES

FINETUNE = dict(lr=2e-5, min_lr_ratio=0.1, weight_decay=0.0, warmup_frac=0.03, seq_len=1024)
PRETRAIN = dict(min_lr_ratio=0.1, weight_decay=0.1)


def add_arguments(p) -> None:
    p.add_argument(
        "--init-from",
        default=None,
        metavar="DIR|REPO_ID",
        help="start from a Hugging Face Qwen3 checkpoint (a directory, or a Hub id through the hub extra): model "
        "config, weights and tokenizer from it; --data a .jsonl of chat messages trains on assistant tokens",
    )
    p.add_argument("--min-lr", type=float, default=None, help="learning rate at the end of the cosine (default lr/10)")
    p.add_argument(
        "--weight-decay",
        type=float,
        default=None,
        help="AdamW weight decay (default 0.1; 0 with --init-from)",
    )
    p.add_argument(
        "--warmup-frac",
        type=float,
        default=None,
        metavar="F",
        help="linear warmup over this fraction of the steps, instead of --warmup N (default 0.03 with --init-from)",
    )


@dataclass
class InitFrom:
    spec: str  # as given on the command line
    path: Path  # the local checkpoint directory
    ckpt: object  # xtrain.hf.HFCheckpoint
    chat: object | None  # xtrain.data.chat.ChatTemplate, when the checkpoint has a chat template

    def record(self) -> dict:
        cfg = (self.path / "config.json").read_bytes()
        return {"spec": self.spec, "path": str(self.path.resolve()), "config_sha256": _sha(cfg)}


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()[:16]


def check_args(args) -> None:
    """ConfigError (one line) for flag combinations and values that cannot work, before anything is read."""
    from xtrain.config import ConfigError

    if args.init_from is not None:
        for flag, v in (("--preset", args.preset), ("--vocab-size", args.vocab_size)):
            if v is not None:
                raise ConfigError(f"{flag} and --init-from exclude each other (the checkpoint fixes the model)")
    if args.warmup is not None and args.warmup_frac is not None:
        raise ConfigError("--warmup and --warmup-frac exclude each other")
    if args.warmup_frac is not None and not (math.isfinite(args.warmup_frac) and 0 <= args.warmup_frac <= 1):
        raise ConfigError(f"--warmup-frac {args.warmup_frac}: must lie in [0, 1]")
    if args.weight_decay is not None and not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise ConfigError(f"--weight-decay {args.weight_decay}: must be a finite number >= 0")
    if args.min_lr is not None and not (math.isfinite(args.min_lr) and args.min_lr >= 0):
        raise ConfigError(f"--min-lr {args.min_lr}: must be a finite number >= 0")


def resolve(args) -> InitFrom | None:
    """The checkpoint of ``--init-from``, checked (config, every tensor's header, tokenizer and chat template);
    None without the flag. Reads no weights."""
    if args.init_from is None:
        return None
    from xtrain.data.chat import ChatError, ChatTemplate
    from xtrain.hf import CheckpointFormatError, open_checkpoint, resolve_checkpoint

    path = resolve_checkpoint(args.init_from)
    ckpt = open_checkpoint(path)
    if not (path / "tokenizer.json").is_file():
        raise CheckpointFormatError(f"{path}: no tokenizer.json (xtrain fine-tunes a checkpoint with its tokenizer)")
    chat = None
    if (path / "chat_template.jinja").is_file() or "chat_template" in _json(path / "tokenizer_config.json"):
        try:
            chat = ChatTemplate.from_dir(path)
        except ChatError as e:
            raise CheckpointFormatError(str(e)) from None
        if chat.vocab_size > ckpt.hf_config["vocab_size"]:
            raise CheckpointFormatError(
                f"{path / 'tokenizer.json'}: {chat.vocab_size} tokens, more than the model's vocab_size "
                f"{ckpt.hf_config['vocab_size']}"
            )
    return InitFrom(args.init_from, path, ckpt, chat)


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}


def default_seq_len(init: InitFrom) -> int:
    """--seq-len's default with --init-from: 1024, or the checkpoint's context when that is shorter."""
    return min(FINETUNE["seq_len"], int(init.ckpt.hf_config.get("max_position_embeddings", 2048)))


def model_config(init: InitFrom, args, device: str):
    """The checkpoint's model with xtrain's own settings from the flags (bf16 compute on CUDA, fp32 on the CPU)."""
    return init.ckpt.model_config(
        compute_dtype=args.dtype or ("bfloat16" if str(device).startswith("cuda") else "float32"),
        attention=args.attention or "auto",
        recompute=bool(args.recompute),
        dropout=args.dropout or 0.0,
    )


def _is_chat_jsonl(path: Path) -> bool:
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except ValueError:
                    return False
                return isinstance(obj, dict) and "messages" in obj
    return False


def resolve_data(init: InitFrom, spec: str | None, seq_len: int, log=print) -> dict:
    """The data directory's meta for a fine-tune (see the module docstring), prepared and cached when needed."""
    from xtrain.config import ConfigError
    from xtrain.data.chat import prepare_chat
    from xtrain.data.prepare import load_meta, prepare

    if spec is None:
        raise ConfigError("--init-from needs --data: a .jsonl of chat messages, a corpus, or a prepared directory")
    tok_sha = _sha((init.path / "tokenizer.json").read_bytes())
    if (Path(spec) / "meta.json").is_file():
        meta = load_meta(spec)
        meta.setdefault("dir", str(Path(spec)))
        tok = Path(spec) / meta.get("tokenizer", "tokenizer.json")
        if not tok.is_file() or _sha(tok.read_bytes()) != tok_sha:
            chat_src = (meta.get("config") or {}).get("tokenizer_source") or {}
            if chat_src.get("sha256") != tok_sha:
                raise ConfigError(
                    f"--data {spec}: prepared with another tokenizer than {init.path / 'tokenizer.json'}; its token "
                    "ids would mean other words to the checkpoint"
                )
    elif _is_chat_jsonl(Path(spec)):
        if init.chat is None:
            raise ConfigError(f"--data {spec} holds chat messages, but {init.path} has no chat template")
        meta = prepare_chat(spec, init.path, None, seq_len, log=log)
    else:
        vocab = init.chat.vocab_size if init.chat is not None else init.ckpt.hf_config["vocab_size"]
        meta = prepare(spec, None, vocab, tokenizer_path=init.path / "tokenizer.json", progress=True, log=log)
    if meta["vocab_size"] > init.ckpt.hf_config["vocab_size"]:
        raise ConfigError(
            f"--data {spec}: token ids up to {meta['vocab_size'] - 1}, the model's vocabulary has "
            f"{init.ckpt.hf_config['vocab_size']}"
        )
    return meta


def check_chat_data(meta: dict, seq_len: int, doc_mask_flag) -> None:
    """Chat data is packed for one window length and always trains with the document mask."""
    from xtrain.config import ConfigError

    chat = meta.get("chat")
    if chat is None:
        return
    if chat["seq_len"] != seq_len:
        raise ConfigError(
            f"--data {meta['dir']}: the conversations were packed for --seq-len {chat['seq_len']}, not {seq_len}; "
            "pass that, or prepare the .jsonl again for this length"
        )
    if doc_mask_flag == "off":
        raise ConfigError("--doc-mask off: chat data keeps its conversations apart with the document mask")


def schedule(args, fine_tune: bool, steps: int, lr_default: float, warmup_default: int) -> dict:
    """TrainConfig fields lr, min_lr, weight_decay, warmup_steps (and the extra ``warmup_frac``) from the flags
    and the defaults of a fine-tune or a pretraining run."""
    d = FINETUNE if fine_tune else PRETRAIN
    lr = args.lr if args.lr is not None else (FINETUNE["lr"] if fine_tune else lr_default)
    frac = args.warmup_frac if args.warmup_frac is not None else (d["warmup_frac"] if fine_tune else None)
    if args.warmup is not None or frac is None:
        warmup = min(args.warmup if args.warmup is not None else warmup_default, steps)
    else:
        warmup = min(steps, round(frac * steps))
    min_lr = args.min_lr if args.min_lr is not None else lr * d["min_lr_ratio"]
    wd = args.weight_decay if args.weight_decay is not None else d["weight_decay"]
    return {"lr": lr, "min_lr": min_lr, "weight_decay": wd, "warmup_steps": warmup, "warmup_frac": frac}


def epoch_steps(meta: dict, batch_size: int, seq_len: int, world: int) -> int:
    """Optimizer steps in one pass over the training windows (at least 1)."""
    windows = max(0, (meta["train"]["tokens"] - 1) // seq_len)
    return max(1, windows // (batch_size * world))


def resume_conflicts(args, stored) -> list[str]:
    """The flags of this module given on --resume with a value other than the run's."""
    extra = stored.extra
    given = {
        "--min-lr": (args.min_lr, stored.min_lr),
        "--weight-decay": (args.weight_decay, stored.weight_decay),
        "--warmup-frac": (args.warmup_frac, extra.get("warmup_frac")),
        "--init-from": (args.init_from, (extra.get("init_from") or {}).get("spec")),
    }
    return [f"{k} {new} (the run has {old})" for k, (new, old) in given.items() if new is not None and new != old]


def copy_tokenizer_files(init: InitFrom, run_dir: Path) -> None:
    """The checkpoint's tokenizer and generation files into the run directory, unchanged."""
    for name in TOKENIZER_FILES:
        if (init.path / name).is_file() and not (run_dir / name).exists():
            shutil.copyfile(init.path / name, run_dir / name)


def sample_chat(model, chat, prompt: str, max_new_tokens: int, seed: int, **sampling) -> str:
    """A reply to one user message, rendered with the chat template, up to its end-of-turn token (the engine's
    one generation loop, with the KV cache)."""
    from xtrain.sampling import Sampling
    from xtrain.serve.engine import Engine

    ids = chat.prompt_ids([{"role": "user", "content": prompt}])
    ids = ids[-(model.config.max_seq_len - max_new_tokens) :]
    smp = Sampling(seed=seed, **sampling).validate()
    new = Engine(model).generate([ids], max_new_tokens, smp, eos_id=chat.end_of_turn_id)[0]
    return chat.decode(new)
