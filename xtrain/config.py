"""Typed configuration: the model (``ModelConfig``, named ``PRESETS``) and the training run (``TrainConfig``).

Both are plain dataclasses. ``validate()`` rejects a configuration that cannot work *before* any work
starts (no parameter is allocated, no file is written), raising ``ConfigError`` (a ``ValueError``) that
names every bad field at once. ``to_dict()`` / ``from_dict()`` round-trip through JSON (checkpoints store
them in ``config.json``); ``from_dict`` rejects unknown keys so a typo never silently falls back to a
default. CLI flags override fields with ``dataclasses.replace``.

Shape letters: C width (n_embd), L layers, H query heads, Hkv key/value heads, D head dim, F ffn width,
T context length (max_seq_len), V vocab.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

ATTENTION_IMPLS = ("composed", "math", "flash", "auto")
LOSS_IMPLS = ("composed", "fused", "auto")
COMPUTE_DTYPES = ("float32", "bfloat16", "float64")
DOC_STARTS = ("at_eot", "after_eot")


class ConfigError(ValueError):
    """A configuration that cannot work; the message lists every problem found."""


def _from_dict(cls, d: dict, what: str):
    if not isinstance(d, dict):
        raise ConfigError(f"{what}: expected a JSON object, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"{what}: unknown field(s) {unknown}; known: {sorted(names)}")
    kw = dict(d)
    for k, v in kw.items():  # JSON has no tuples
        if isinstance(v, list):
            kw[k] = tuple(v)
    return cls(**kw)


def _raise(problems: list[str], what: str) -> None:
    if problems:
        raise ConfigError(f"invalid {what}: " + "; ".join(problems))


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer in the Qwen3 layout (see ``xtrain.model``).

    ``head_dim`` is independent of ``n_embd`` (Qwen3 allows H * D != C); q has H * D features, k and v
    Hkv * D. ``compute_dtype`` is the dtype of the forward/backward activations; master weights are fp32
    (fp64 when compute_dtype is "float64", which exists for exact tests). ``attention``: "composed" is the
    tape composition, "math" one node with a hand-written backward (``xtrain.ops.math_attention``), "flash"
    the fused op (``xtrain.ops.flash_attention``); "auto" picks flash on CUDA, and on the CPU math up to
    T = 2048 (fastest there) and flash's tiled O(T)-memory reference beyond, where [T, T] scores grow large. ``loss``:
    "fused" uses ``xtrain.ops.linear_cross_entropy`` (LM head + loss without materialising [N, V]
    logits), "auto" picks it when available on CUDA.
    """

    vocab_size: int = 4096
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_kv_head: int = 2
    head_dim: int = 64
    ffn_dim: int = 768
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    dropout: float = 0.0
    attention: str = "auto"
    loss: str = "auto"
    recompute: bool = False
    compute_dtype: str = "float32"
    init_std: float = 0.02

    def validate(self) -> ModelConfig:
        p: list[str] = []
        for name in ("vocab_size", "n_layer", "n_embd", "n_head", "n_kv_head", "head_dim", "ffn_dim", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                p.append(f"{name}={v!r} must be a positive integer")
        if (
            isinstance(self.n_head, int)
            and isinstance(self.n_kv_head, int)
            and self.n_kv_head > 0
            and self.n_head % self.n_kv_head != 0
        ):
            p.append(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head} (grouped-query attention)")
        if isinstance(self.head_dim, int) and self.head_dim % 2 != 0:
            p.append(f"head_dim={self.head_dim} must be even (RoPE rotates pairs of features)")
        if not (isinstance(self.rope_theta, (int, float)) and math.isfinite(self.rope_theta) and self.rope_theta > 0):
            p.append(f"rope_theta={self.rope_theta!r} must be a finite number > 0")
        if not (isinstance(self.norm_eps, (int, float)) and 0 < self.norm_eps < 1):
            p.append(f"norm_eps={self.norm_eps!r} must lie in (0, 1)")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            p.append(f"dropout={self.dropout!r} must lie in [0, 1)")
        if self.attention not in ATTENTION_IMPLS:
            p.append(f"attention={self.attention!r} must be one of {ATTENTION_IMPLS}")
        if self.loss not in LOSS_IMPLS:
            p.append(f"loss={self.loss!r} must be one of {LOSS_IMPLS}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            p.append(f"compute_dtype={self.compute_dtype!r} must be one of {COMPUTE_DTYPES}")
        if not (isinstance(self.init_std, (int, float)) and math.isfinite(self.init_std) and self.init_std > 0):
            p.append(f"init_std={self.init_std!r} must be a finite number > 0")
        if not isinstance(self.tie_embeddings, bool):
            p.append(f"tie_embeddings={self.tie_embeddings!r} must be a bool")
        if not isinstance(self.recompute, bool):
            p.append(f"recompute={self.recompute!r} must be a bool")
        _raise(p, "ModelConfig")
        return self

    def num_params(self) -> int:
        C, D, F, V, L = self.n_embd, self.head_dim, self.ffn_dim, self.vocab_size, self.n_layer
        H, Hkv = self.n_head, self.n_kv_head
        attn = C * H * D + 2 * C * Hkv * D + H * D * C + 2 * D  # q, k, v, o, q_norm, k_norm
        mlp = 3 * C * F
        block = attn + mlp + 2 * C  # + two RMSNorm weights
        return V * C + L * block + C + (0 if self.tie_embeddings else V * C)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        return _from_dict(cls, d, "ModelConfig")


# Named presets (STYLE.md 11). Parameter counts from ModelConfig.num_params().
PRESETS: dict[str, ModelConfig] = {
    # CPU default, ~4.2M parameters with V=4096 (tied): learns character/BPE statistics in minutes on 2 cores.
    "tiny": ModelConfig(
        vocab_size=4096,
        n_layer=4,
        n_embd=256,
        n_head=4,
        n_kv_head=2,
        head_dim=64,
        ffn_dim=768,
        max_seq_len=256,
        tie_embeddings=True,
    ),
    # the reference project's model size: ~120M parameters with V=32768 (untied), GQA 12/4
    "seed": ModelConfig(
        vocab_size=32768, n_layer=8, n_embd=768, n_head=12, n_kv_head=4, head_dim=64, ffn_dim=3072, max_seq_len=1024
    ),
    # the GPT-2 small class: MHA, tied embeddings, ~110M parameters with V=32768
    "gpt2-small": ModelConfig(
        vocab_size=32768,
        n_layer=12,
        n_embd=768,
        n_head=12,
        n_kv_head=12,
        head_dim=64,
        ffn_dim=2048,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A preset with fields overridden (e.g. ``preset("tiny", vocab_size=tok.vocab_size)``), validated."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides).validate()


MAX_SEED = 1 << 63  # run seeds lie in [0, MAX_SEED)


@dataclass(frozen=True)
class TrainConfig:
    """One training run. ``batch_size`` is the number of sequences per optimizer step; with
    ``grad_accum`` = k the step runs k micro-batches of batch_size / k sequences each (same update).

    Learning rate: linear warmup over ``warmup_steps`` to ``lr``, then cosine decay to ``min_lr`` at
    ``steps`` ("cosine"), or held at ``lr`` ("constant"). ``grad_clip`` > 0 clips the global grad norm;
    0 disables clipping. ``skip_nonfinite``: a step whose loss or grad norm is nan/inf is skipped (counted,
    weights untouched) instead of stopping the run; at most ``max_skips`` skips before stopping anyway.
    ``ckpt_every`` / ``eval_every``: 0 means never (a checkpoint is still written at the end when the
    trainer has a run directory). ``doc_mask``: the packed documents of a window are kept apart (attention within
    each document, RoPE positions restarting at each): with ``doc_start`` "at_eot" a document starts at its
    ``eot_id`` token (the data's end-of-text id, which inference prepends as BOS), with "after_eot" right after it
    (packed chat conversations: the eot closes each one, and a prompt at inference starts with the chat template's
    first token); training and evaluation both run so.
    """

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 50
    schedule: str = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1337
    ckpt_every: int = 0
    eval_every: int = 0
    skip_nonfinite: bool = False
    max_skips: int = 10
    doc_mask: bool = False
    eot_id: int | None = None  # the data's end-of-text token: where documents start (needed by doc_mask)
    doc_start: str = "at_eot"  # "at_eot": a document starts at its eot; "after_eot": right after one
    extra: dict = field(default_factory=dict)  # free-form notes kept in config.json (e.g. data paths)

    def validate(self) -> TrainConfig:
        p: list[str] = []
        for name in ("steps", "batch_size", "seq_len", "grad_accum"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                p.append(f"{name}={v!r} must be a positive integer")
        for name in ("warmup_steps", "ckpt_every", "eval_every", "max_skips", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                p.append(f"{name}={v!r} must be an integer >= 0")
        if not isinstance(self.doc_mask, bool):
            p.append(f"doc_mask={self.doc_mask!r} must be a bool")
        if self.eot_id is not None and (
            not isinstance(self.eot_id, int) or isinstance(self.eot_id, bool) or self.eot_id < 0
        ):
            p.append(f"eot_id={self.eot_id!r} must be an integer >= 0 (or None)")
        if self.doc_start not in DOC_STARTS:
            p.append(f"doc_start={self.doc_start!r} must be one of {DOC_STARTS}")
        if self.doc_mask is True and self.eot_id is None:
            p.append("doc_mask needs eot_id (the token a document starts with)")
        if isinstance(self.seed, int) and self.seed >= MAX_SEED:
            p.append(f"seed={self.seed} must be below 2**63 (torch's generators take 64-bit signed seeds)")
        if (
            isinstance(self.batch_size, int)
            and isinstance(self.grad_accum, int)
            and self.grad_accum > 0
            and self.batch_size % self.grad_accum != 0
        ):
            p.append(f"grad_accum={self.grad_accum} must divide batch_size={self.batch_size}")

        def finite(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not (finite(self.lr) and self.lr > 0):
            p.append(f"lr={self.lr!r} must be a finite number > 0")
        if not (finite(self.min_lr) and 0 <= self.min_lr <= (self.lr if finite(self.lr) else math.inf)):
            p.append(f"min_lr={self.min_lr!r} must lie in [0, lr]")
        if self.schedule not in ("cosine", "constant"):
            p.append(f"schedule={self.schedule!r} must be 'cosine' or 'constant'")
        if not (finite(self.weight_decay) and self.weight_decay >= 0):
            p.append(f"weight_decay={self.weight_decay!r} must be a finite number >= 0")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not (finite(v) and 0 <= v < 1):
                p.append(f"{name}={v!r} must lie in [0, 1)")
        if not (finite(self.eps) and self.eps > 0):
            p.append(f"eps={self.eps!r} must be a finite number > 0")
        if not (finite(self.grad_clip) and self.grad_clip >= 0):
            p.append(f"grad_clip={self.grad_clip!r} must be a finite number >= 0 (0 = off)")
        if not isinstance(self.extra, dict):
            p.append("extra must be a dict")
        _raise(p, "TrainConfig")
        return self

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.grad_accum

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        return _from_dict(cls, d, "TrainConfig")


def check_compatible(model: ModelConfig, train: TrainConfig) -> None:
    """Checks that need both configs (called by the trainer before any work)."""
    model.validate()
    train.validate()
    if train.seq_len > model.max_seq_len:
        raise ConfigError(
            f"invalid TrainConfig: seq_len={train.seq_len} exceeds the model's max_seq_len={model.max_seq_len}"
        )
