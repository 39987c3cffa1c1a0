"""Tokenizers: byte-level BPE (Hugging Face ``tokenizers``) and a plain byte tokenizer, same interface.

``Tokenizer`` (kind ``"bpe"``) is GPT-2-style byte-level BPE: text is split by the GPT-2 regex, each piece
is mapped to bytes (every byte has a token, so nothing is ever unknown), and merges learned by
``Tokenizer.train`` are applied. Vocabulary: ids 0..255 are the 256 bytes (in the byte-level alphabet's
order), then the merges, and ``<|endoftext|>`` is the last id (as in GPT-2, where it is 50256). Saved as
a standard Hugging Face ``tokenizer.json`` (loadable by ``tokenizers.Tokenizer.from_file``, ``transformers``).

``ByteTokenizer`` (kind ``"bytes"``): id = UTF-8 byte value (0..255), id 256 = ``<|endoftext|>``,
vocab 257. Saved as a small JSON file ``{"xtrain_tokenizer": "bytes", "version": 1, ...}``.

Both round-trip exactly: ``decode(encode(s)) == s`` for every str. The special token is never matched
inside text: a document that happens to contain the characters ``<|endoftext|>`` is encoded as those
characters, and the end-of-text id only appears where the data pipeline puts it (``encode_documents``).

``load_tokenizer(path, vocab_size)`` opens either kind, and refuses one whose vocabulary is not ``vocab_size``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from xtrain.fileio import atomic_write_text

EOT_TOKEN = "<|endoftext|>"


class Tokenizer:
    """Byte-level BPE over Hugging Face ``tokenizers``.

    >>> tok = Tokenizer.train(texts, vocab_size=4096)
    >>> ids = tok.encode("def f(x):\\n    return x")     # list[int]
    >>> tok.decode(ids)                                   # the same str
    """

    kind = "bpe"

    def __init__(self, hf_tokenizer, source: str = "<memory>"):
        self._tok = hf_tokenizer
        if hasattr(self._tok, "encode_special_tokens"):  # tokenizers >= 0.15: text is always text
            self._tok.encode_special_tokens = True
        eot = self._tok.token_to_id(EOT_TOKEN)
        if eot is None:
            raise ValueError(f"tokenizer {source} has no {EOT_TOKEN} token")
        self.eot_id: int = eot
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        # an upper bound on the UTF-8 bytes one token stands for (a byte-level token's string spends 1 or 2
        # bytes per byte it stands for), so a text of n bytes has at least n / max_token_bytes tokens: a
        # server can refuse an over-long prompt without tokenizing it
        self.max_token_bytes: int = max(len(t.encode("utf-8")) for t in self._tok.get_vocab(with_added_tokens=True))

    # -- training ------------------------------------------------------------------------------------
    @classmethod
    def train(
        cls, docs: Iterable[str], vocab_size: int, *, min_frequency: int = 2, show_progress: bool = False
    ) -> Tokenizer:
        """Learn BPE merges from ``docs`` until the vocab (256 bytes + eot + merges) has ``vocab_size``
        entries (fewer if the text runs out of pairs seen ``min_frequency`` times)."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if vocab_size <= 257:
            raise ValueError(
                f"BPE needs vocab_size > 257 (256 bytes + {EOT_TOKEN}); got {vocab_size}. "
                "Use ByteTokenizer (vocab 257) for a byte-level model."
            )
        tok = HFTokenizer(models.BPE())
        # add_prefix_space=False keeps the round trip exact (no space invented at the start of a text)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            # the trainer would put special tokens at id 0; we keep ids 0..255 for the bytes and add
            # eot after the merges, so train one entry fewer
            vocab_size=vocab_size - 1,
            min_frequency=min_frequency,
            special_tokens=[],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=show_progress,
        )
        tok.train_from_iterator(docs, trainer=trainer)
        tok.add_special_tokens([EOT_TOKEN])
        return cls(tok)

    # -- files ---------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write a Hugging Face ``tokenizer.json`` (atomically)."""
        atomic_write_text(Path(path), self._tok.to_str(pretty=True))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {path} not found")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"tokenizer file {path} is not a valid tokenizer.json ({e})") from None
        return cls(tok, source=str(path))

    # -- encode / decode -----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts at once (parallel over texts in the Rust library's thread pool)."""
        texts = list(texts)
        # encode_batch_fast skips computing character offsets: ~1.7x faster (tokenizers >= 0.20)
        fn = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in fn(texts, add_special_tokens=False)]

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        """The token stream of a list of documents: ``[eot, doc0..., eot, doc1..., ...]`` as int64 (N,).
        Each document is preceded by the end-of-text token (the llm.c / GPT-2 convention), so the model
        learns to start a document after eot and sampling can start from ``[eot]``."""
        out: list[int] = []
        for ids in self.encode_batch(texts):
            out.append(self.eot_id)
            out.extend(ids)
        return np.asarray(out, dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        _check_ids(ids, self.vocab_size)
        return self._tok.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer(kind='bpe', vocab_size={self.vocab_size}, eot_id={self.eot_id})"


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is ``<|endoftext|>``; vocab_size 257."""

    kind = "bytes"
    FORMAT = "bytes"

    def __init__(self):
        self.eot_id: int = 256
        self.vocab_size: int = 257
        self.max_token_bytes: int = 1

    @classmethod
    def train(cls, docs: Iterable[str] = (), vocab_size: int = 257, **_) -> ByteTokenizer:
        """Nothing to learn; accepts the same call as ``Tokenizer.train``."""
        if vocab_size not in (256, 257):
            raise ValueError(f"ByteTokenizer has vocab 257 (256 bytes + {EOT_TOKEN}); got {vocab_size}")
        return cls()

    def save(self, path: str | os.PathLike) -> None:
        doc = {
            "xtrain_tokenizer": self.FORMAT,
            "version": 1,
            "vocab_size": self.vocab_size,
            "eot_id": self.eot_id,
            "eot_token": EOT_TOKEN,
        }
        atomic_write_text(Path(path), json.dumps(doc, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> ByteTokenizer:
        doc = _read_json(Path(path))
        if doc.get("xtrain_tokenizer") != cls.FORMAT or doc.get("version") != 1:
            raise ValueError(f"tokenizer file {path} is not an xtrain byte tokenizer (version 1)")
        return cls()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        """``[eot, doc0 bytes..., eot, doc1 bytes..., ...]`` as int64 (N,); see ``Tokenizer``."""
        parts = []
        for t in texts:
            parts.append(np.array([self.eot_id], dtype=np.int64))
            parts.append(np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        _check_ids(ids, self.vocab_size)
        # bytes between eot tokens are decoded together, so multi-byte characters survive
        out, run = [], bytearray()
        for i in ids:
            if i == self.eot_id:
                out.append(run.decode("utf-8", errors="replace"))
                out.append(EOT_TOKEN)
                run = bytearray()
            else:
                run.append(i)
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, eot_id=256)"


def _check_ids(ids: list[int], vocab_size: int) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} not found")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"tokenizer file {path} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"tokenizer file {path}: expected a JSON object")
    return doc


class TokenizerMismatchError(ValueError):
    """A tokenizer whose vocabulary is not the one its model (or data) was built with."""


def load_tokenizer(
    path: str | os.PathLike, vocab_size: int | None = None, expected_by: str = "the model", padded: bool = False
) -> Tokenizer | ByteTokenizer:
    """Open a ``tokenizer.json`` of either kind (a Hugging Face BPE file or an xtrain byte tokenizer).
    ``path`` may be the file or the data directory that holds it.

    ``vocab_size``: the vocabulary the caller's model (or data) has. When given, a tokenizer of another size
    raises TokenizerMismatchError (a ValueError) naming both sizes: every command that pairs a model with a
    tokenizer (train, --resume, sample, serve, export) opens it here, so a tokenizer.json replaced by one of
    another run never encodes or decodes silently wrong ids. ``padded``: the model's vocabulary may be larger
    than the tokenizer's (a Hugging Face checkpoint pads it: Qwen3's 151,936 rows for 151,669 tokens), never
    smaller."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    doc = _read_json(path)
    tok = ByteTokenizer.load(path) if "xtrain_tokenizer" in doc else Tokenizer.load(path)
    if vocab_size is not None and (tok.vocab_size > vocab_size if padded else tok.vocab_size != vocab_size):
        raise TokenizerMismatchError(
            f"{path}: this tokenizer has a vocabulary of {tok.vocab_size} tokens but {expected_by} has "
            f"{vocab_size}; it belongs to another model or data (use the tokenizer.json it was trained with)"
        )
    return tok


def make_tokenizer(kind: str, vocab_size: int, docs: Iterable[str] = (), **kw) -> Tokenizer | ByteTokenizer:
    """Train a tokenizer of ``kind`` (``"bpe"`` or ``"bytes"``); ``"auto"`` means bytes for vocab 256/257."""
    if kind == "auto":
        kind = "bytes" if vocab_size in (256, 257) else "bpe"
    if kind == "bytes":
        return ByteTokenizer.train(docs, vocab_size)
    if kind == "bpe":
        return Tokenizer.train(docs, vocab_size, **kw)
    raise ValueError(f"unknown tokenizer kind {kind!r} (expected 'bpe', 'bytes' or 'auto')")
