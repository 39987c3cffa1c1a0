"""Prepare a corpus for training: tokenizer + token shards + meta.json in one directory.

Layout of a prepared data directory::

    tokenizer.json        Hugging Face BPE tokenizer (or the xtrain byte tokenizer's JSON)
    train_000000.bin ...  llm.c token shards (see shards.py), at most shard_tokens tokens each
    val_000000.bin ...
    meta.json             what was built from what (below); written last, so its presence means complete

meta.json (format ``xtrain-data`` version 1)::

    {"format": "xtrain-data", "version": 1,
     "config": {...},                 # everything the data depends on: corpus (with a fingerprint of its
                                      # files), tokenizer kind, requested vocab, shard size, eot placement;
                                      # prepared data is reused only when this matches exactly
     "vocab_size": 4096, "eot_id": 4095, "tokenizer": "tokenizer.json", "tokenizer_kind": "bpe",
     "train": {"files": [["train_000000.bin", N], ...], "tokens": N, "docs": D, "bytes": B},
     "val":   {...},
     "unigram_val_loss": 6.1,         # nats/token, see below
     "uniform_loss": 8.3178,          # ln(vocab_size)
     "seconds": {"tokenizer": ..., "encode": ...}, ...}

Token stream: every document is preceded by the end-of-text token: ``eot doc0 eot doc1 ...`` (llm.c's
convention), and the stream is cut into shards at exactly ``shard_tokens`` (a document may straddle two
shards; loader windows never cross a shard boundary).

Unigram baseline: the cross-entropy of the val tokens under the train tokens' unigram distribution with
add-one smoothing, ``p(v) = (count_train(v) + 1) / (N_train + V)``, in nats per token:
``-(1/N_val) * sum over val tokens of ln p(v)``. A model that has learned nothing but token frequencies
scores this; the trainer prints it next to the loss. ``uniform_loss = ln V`` is the loss at init.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from xtrain.data.corpus import DEFAULT_VAL_FRACTION, Corpus, open_corpus
from xtrain.data.shards import HEADER_BYTES, ShardWriter, token_dtype
from xtrain.data.tokenizer import load_tokenizer, make_tokenizer
from xtrain.fileio import atomic_write_text

DEFAULT_VOCAB_SIZE = 4096
DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_TOKENIZER_MAX_BYTES = 64_000_000  # BPE is trained on at most this much train text
META_FORMAT = "xtrain-data"
META_VERSION = 1
_ENCODE_BATCH_BYTES = 4_000_000  # documents are encoded in batches of about this many bytes


def default_data_dir(vocab_size: int = DEFAULT_VOCAB_SIZE, corpus: str = "pystdlib") -> Path:
    """``$XTRAIN_CACHE/data/<corpus>-v<vocab>``, with ``XTRAIN_CACHE`` defaulting to ``~/.cache/xtrain``.
    For a path corpus, ``<corpus>`` is the file/dir name plus a hash of the absolute path."""
    cache = Path(os.environ.get("XTRAIN_CACHE") or Path.home() / ".cache" / "xtrain")
    corpus = os.fspath(corpus)
    if corpus in ("pystdlib", "tinystories"):
        name = corpus
    else:
        p = Path(corpus).expanduser().resolve()
        stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in p.stem)[:40] or "corpus"
        name = f"{stem}-{hashlib.sha256(str(p).encode()).hexdigest()[:8]}"
    return cache / "data" / f"{name}-v{vocab_size}"


def load_meta(data_dir: str | os.PathLike) -> dict:
    """Read and check ``meta.json`` of a prepared directory (FileNotFoundError / ValueError if not)."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: prepare the data first (xtrain data prepare --out {data_dir})")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT or meta.get("version") != META_VERSION:
        raise ValueError(f"{path}: not an {META_FORMAT} v{META_VERSION} meta file")
    return meta


def _complete(out_dir: Path, config: dict) -> dict | None:
    """The existing meta if ``out_dir`` holds complete data built with exactly ``config``, else None."""
    try:
        meta = load_meta(out_dir)
    except (FileNotFoundError, ValueError):
        return None
    if meta.get("config") != config or not (out_dir / meta.get("tokenizer", "tokenizer.json")).is_file():
        return None
    itemsize = token_dtype(meta["vocab_size"]).itemsize
    for split in ("train", "val"):
        for name, n in meta[split]["files"]:
            f = out_dir / name
            if not f.is_file() or f.stat().st_size != HEADER_BYTES + n * itemsize:
                return None
    return meta


def unigram_loss(train_counts: np.ndarray, val_counts: np.ndarray) -> float:
    """Cross-entropy (nats/token) of val under add-one-smoothed train unigram frequencies."""
    V = len(train_counts)
    n_val = int(val_counts.sum())
    if n_val == 0:
        return float("nan")
    logp = np.log((train_counts + 1.0) / (train_counts.sum() + V))  # (V,)
    return float(-(val_counts * logp).sum() / n_val)


def _set_workers(workers: int | None) -> None:
    # The tokenizers library encodes batches on a Rayon thread pool sized from RAYON_NUM_THREADS when
    # the pool is first used; after that the setting is fixed for the process (best effort).
    if workers is not None and workers > 0:
        os.environ.setdefault("RAYON_NUM_THREADS", str(workers))
        if workers == 1:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"


def prepare(
    corpus: str | os.PathLike | Corpus = "pystdlib",
    out_dir: str | os.PathLike | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    tokenizer: str = "auto",
    tokenizer_path: str | os.PathLike | None = None,
    max_bytes: int | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    tokenizer_max_bytes: int = DEFAULT_TOKENIZER_MAX_BYTES,
    workers: int | None = None,
    force: bool = False,
    progress: bool = False,
    log=print,
) -> dict:
    """Tokenize ``corpus`` into ``out_dir`` and return its meta dict (also in ``out_dir/meta.json``,
    plus ``meta["dir"]``). Reuses the directory when it already holds complete data built with the same
    settings (unless ``force``).

    corpus:          "pystdlib" | "tinystories" | a path | a Corpus (then max_bytes/val_fraction unused)
    vocab_size:      BPE vocab (incl. eot); 256 or 257 means the byte tokenizer (vocab 257)
    tokenizer:       "auto" | "bpe" | "bytes"
    tokenizer_path:  use this tokenizer.json instead of training one
    max_bytes:       corpus cap in UTF-8 bytes (None: the corpus default; 0: no cap)
    workers:         encoding threads (tokenizers' Rayon pool; None: all cores)
    """
    t_start = time.perf_counter()
    if not isinstance(corpus, Corpus):
        corpus = open_corpus(corpus, max_bytes=max_bytes, val_fraction=val_fraction)
    if corpus.skipped:
        more = f" (and {len(corpus.skipped) - 1} more)" if len(corpus.skipped) > 1 else ""
        log(f"data: skipped {len(corpus.skipped)} binary file(s) of {corpus.name}: {corpus.skipped[0]}{more}")
    out_dir = Path(out_dir) if out_dir is not None else default_data_dir(vocab_size, corpus.name)
    _set_workers(workers)

    if tokenizer_path is not None:
        tok = load_tokenizer(tokenizer_path)
        tok_source = {
            "path": str(Path(tokenizer_path).resolve()),
            "sha256": hashlib.sha256(Path(tokenizer_path).read_bytes()).hexdigest()[:16],
        }
    else:
        tok, tok_source = None, None
        if tokenizer == "auto":
            tokenizer = "bytes" if vocab_size in (256, 257) else "bpe"
    config = {
        "corpus": corpus.describe(),
        "tokenizer": tok.kind if tok is not None else tokenizer,
        "vocab_size": tok.vocab_size if tok is not None else vocab_size,
        "tokenizer_source": tok_source,
        "tokenizer_max_bytes": tokenizer_max_bytes,
        "shard_tokens": shard_tokens,
        "eot": "before-each-document",
    }
    if not force:
        meta = _complete(out_dir, config)
        if meta is not None:
            log(
                f"data: reusing {out_dir} ({meta['train']['tokens']:,} train / {meta['val']['tokens']:,} "
                f"val tokens, vocab {meta['vocab_size']})"
            )
            return {**meta, "dir": str(out_dir)}

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "meta.json").unlink(missing_ok=True)  # from here on the directory is incomplete

    # 1. tokenizer
    t0 = time.perf_counter()
    if tok is None:
        log(f"data: training {tokenizer} tokenizer (vocab {vocab_size}) on {corpus.name} ...")
        tok = make_tokenizer(tokenizer, vocab_size, corpus.train_texts(max_bytes=tokenizer_max_bytes))
    if tok.vocab_size < vocab_size and tokenizer_path is None and tok.kind == "bpe":
        log(f"data: note: the corpus ran out of pairs to merge; vocab is {tok.vocab_size}, not {vocab_size}")
    tok.save(out_dir / "tokenizer.json")
    t_tok = time.perf_counter() - t0

    # 2. encode documents in batches, streaming tokens into shards
    t0 = time.perf_counter()
    writers = {s: ShardWriter(out_dir, s, tok.vocab_size, shard_tokens) for s in ("train", "val")}
    stats = {s: {"docs": 0, "bytes": 0} for s in ("train", "val")}
    pending: dict[str, list[str]] = {"train": [], "val": []}
    pending_bytes = {"train": 0, "val": 0}

    def flush(split: str) -> None:
        if pending[split]:
            writers[split].add(tok.encode_documents(pending[split]))  # (N,) eot doc eot doc ...
            pending[split], pending_bytes[split] = [], 0

    from tqdm import tqdm

    bar = tqdm(total=corpus.size_hint, unit="B", unit_scale=True, desc="encode", disable=None if progress else True)
    try:
        for split, doc in corpus.documents():
            n = len(doc.text.encode("utf-8"))
            pending[split].append(doc.text)
            pending_bytes[split] += n
            stats[split]["docs"] += 1
            stats[split]["bytes"] += n
            bar.update(n)
            if pending_bytes[split] >= _ENCODE_BATCH_BYTES:
                flush(split)
        for split in writers:
            flush(split)
        files = {s: w.close() for s, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        bar.close()
    t_enc = time.perf_counter() - t0

    # 3. remove shards left from an earlier, larger build (a loader globbing train_*.bin would read them)
    keep = {name for s in files for name, _ in files[s]}
    for split in ("train", "val"):
        for f in out_dir.glob(f"{split}_*.bin"):
            if f.name not in keep:
                f.unlink()

    counts = {s: w.counts for s, w in writers.items()}
    n_tok = {s: int(counts[s].sum()) for s in counts}
    if n_tok["train"] == 0:
        raise ValueError(f"corpus {corpus.name} produced no train documents")
    meta = {
        "format": META_FORMAT,
        "version": META_VERSION,
        "config": config,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "tokenizer": "tokenizer.json",
        "tokenizer_kind": tok.kind,
        "token_dtype": token_dtype(tok.vocab_size).name,
        **{
            s: {
                "files": [list(x) for x in files[s]],
                "tokens": n_tok[s],
                **stats[s],
                "bytes_per_token": round(stats[s]["bytes"] / max(n_tok[s], 1), 4),
            }
            for s in ("train", "val")
        },
        "unigram_val_loss": round(unigram_loss(counts["train"], counts["val"]), 6),
        "uniform_loss": round(math.log(tok.vocab_size), 6),
        "seconds": {
            "tokenizer": round(t_tok, 3),
            "encode": round(t_enc, 3),
            "total": round(time.perf_counter() - t_start, 3),
        },
    }
    atomic_write_text(out_dir / "meta.json", json.dumps(meta, indent=2) + "\n")
    log(
        f"data: wrote {out_dir}: {n_tok['train']:,} train / {n_tok['val']:,} val tokens "
        f"({stats['train']['docs']} / {stats['val']['docs']} docs), vocab {tok.vocab_size}, "
        f"unigram val loss {meta['unigram_val_loss']:.4f} nats (uniform {meta['uniform_loss']:.4f}), "
        f"{meta['seconds']['total']:.1f}s"
    )
    if n_tok["val"] == 0:
        log("data: warning: the val split is empty (corpus too small for val_fraction)")
    return {**meta, "dir": str(out_dir)}
