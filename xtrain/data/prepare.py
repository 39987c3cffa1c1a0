"""Prepare a corpus for training: tokenizer + token shards + meta.json in one directory.

Layout of a prepared data directory::

    tokenizer.json        Hugging Face BPE tokenizer (or the xtrain byte tokenizer's JSON)
    train_000000.bin ...  llm.c token shards (see shards.py), at most shard_tokens tokens each
    val_000000.bin ...
    meta.json             what was built from what (below); written last, so its presence means complete

meta.json (format ``xtrain-data`` version 1; ``load_meta`` checks every field below that a reader uses)::

    {"format": "xtrain-data", "version": 1,
     "config": {"corpus": {...}, ...}, # everything the data depends on: corpus (with a fingerprint of its
                                      # files and its split rule), tokenizer kind, requested vocab, shard
                                      # size, eot placement; data is reused only when this matches exactly
     "vocab_size": 4096, "eot_id": 4095, "tokenizer": "tokenizer.json", "tokenizer_kind": "bpe",
     "train": {"files": [["train_000000.bin", N], ...], "tokens": N, "docs": D, "bytes": B,
               "bytes_per_token": B / N},
     "val":   {...},
     "unigram_val_loss": 6.1,         # nats/token, see below
     "uniform_loss": 8.3178,          # ln(vocab_size)
     "seconds": {"tokenizer": ..., "encode": ...}, ...}

Where it writes. The output folder must be missing, empty, or an xtrain data directory (a ``meta.json`` of
format ``xtrain-data``) holding nothing but what ``prepare`` writes; anything else is refused
(``OutDirRefused``) before a byte is written. A build is staged: everything is written into a sibling
folder ``.<name>.staging-<pid>``, and only when it is complete is it swapped in (the old directory renamed
to ``.<name>.old-<pid>``, the new one renamed into place, the old one deleted; signals are held off between
the two renames). A build that fails or is interrupted removes its staging folder, so the previous data is
untouched; one killed outright leaves its hidden folders behind, and the next ``prepare`` for that folder
removes them (restoring the old directory if the kill fell between the two renames) and says so. A disk
that refuses a write (full, file too large for ``ulimit -f``, read-only) raises ``DataWriteError`` naming
the path and the cause.

Token stream: every document is preceded by the end-of-text token: ``eot doc0 eot doc1 ...`` (llm.c's
convention), and the stream is cut into shards at exactly ``shard_tokens`` (a document may straddle two
shards; loader windows never cross a shard boundary).

Unigram baseline: the cross-entropy of the val tokens under the train tokens' unigram distribution with
add-one smoothing, ``p(v) = (count_train(v) + 1) / (N_train + V)``, in nats per token:
``-(1/N_val) * sum over val tokens of ln p(v)``. A model that has learned nothing but token frequencies
scores this; the trainer prints it next to the loss. ``uniform_loss = ln V`` is the loss at init.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from xtrain.data.corpus import DEFAULT_VAL_FRACTION, Corpus, open_corpus
from xtrain.data.shards import HEADER_BYTES, ShardWriter, token_dtype
from xtrain.data.tokenizer import load_tokenizer, make_tokenizer
from xtrain.fileio import DISK_ERRORS, WriteFailed, atomic_write_text, fsync_dir

DEFAULT_VOCAB_SIZE = 4096
DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_TOKENIZER_MAX_BYTES = 64_000_000  # BPE is trained on at most this much train text
META_FORMAT = "xtrain-data"
META_VERSION = 1
_ENCODE_BATCH_BYTES = 4_000_000  # documents are encoded in batches of about this many bytes
DISK_ERRNOS = frozenset(DISK_ERRORS)  # a disk that will not take a write: fileio's one classification
_SHARD_NAME = re.compile(r"(train|val)_\d{6}\.bin")
_TEMP_NAME = re.compile(r"\..+\.tmp-?\d+")  # shards' and atomic writes' temporary names


class OutDirRefused(ValueError):
    """The output folder holds something ``prepare`` did not write: nothing was changed."""


class DataWriteError(WriteFailed):
    """A disk refused a write of ``prepare`` (full, file too large, read-only): ``str()`` is one line naming
    the path (its final name, not the staging one) and the cause; the output folder is as it was before. A
    ``fileio.WriteFailed``, so every command reports it as one line and exit 74."""

    def __init__(self, err: int, message: str):
        super().__init__(err, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


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


# ----------------------------------------------------------------------------------------------------
# meta.json


def _read_meta_json(path: Path) -> dict:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT or meta.get("version") != META_VERSION:
        raise ValueError(f"{path}: not an {META_FORMAT} v{META_VERSION} meta file")
    return meta


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _plain_file_name(x) -> bool:
    """A name inside the data directory: no folder part, so a meta.json cannot point a reader elsewhere."""
    return isinstance(x, str) and x not in ("", ".", "..") and "/" not in x and "\\" not in x and "\0" not in x


def check_meta(meta: dict, path: str | os.PathLike = "meta.json") -> dict:
    """Check every field of a parsed ``meta.json`` that a reader uses (data info, train, the reuse check):
    ValueError naming ``path`` and the first bad field, in one line. Returns ``meta``."""

    def bad(field: str, want: str):
        value = meta
        for part in re.findall(r"[^.\[\]]+", field):
            try:
                value = value[int(part)] if isinstance(value, list) else value[part]
            except (KeyError, IndexError, TypeError, ValueError):
                return ValueError(f"{path}: field '{field}' is missing (it must be {want}); prepare the data again")
        shown = json.dumps(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return ValueError(f"{path}: field '{field}' must be {want}, not {shown}; prepare the data again")

    if not isinstance(meta.get("config"), dict):
        raise bad("config", "an object")
    if not isinstance(meta["config"].get("corpus"), dict):
        raise bad("config.corpus", "an object")
    vocab = meta.get("vocab_size")
    if not (_is_int(vocab) and vocab >= 1):
        raise bad("vocab_size", "an integer >= 1")
    if not (_is_int(meta.get("eot_id")) and 0 <= meta["eot_id"] < vocab):
        raise bad("eot_id", f"an integer in [0, {vocab})")
    if not _plain_file_name(meta.get("tokenizer")):
        raise bad("tokenizer", "a file name in the data directory")
    if not isinstance(meta.get("tokenizer_kind"), str):
        raise bad("tokenizer_kind", "a string")
    for split in ("train", "val"):
        part = meta.get(split)
        if not isinstance(part, dict):
            raise bad(split, "an object")
        if not isinstance(part.get("files"), list):
            raise bad(f"{split}.files", "a list of [file name, token count]")
        for i, entry in enumerate(part["files"]):
            ok = isinstance(entry, list) and len(entry) == 2 and _SHARD_NAME.fullmatch(str(entry[0]))
            if not (ok and entry[0].startswith(split) and _is_int(entry[1]) and entry[1] >= 0):
                raise bad(f"{split}.files[{i}]", f"[a file name {split}_NNNNNN.bin, a token count >= 0]")
        for key in ("tokens", "docs", "bytes"):
            if not (_is_int(part.get(key)) and part[key] >= 0):
                raise bad(f"{split}.{key}", "an integer >= 0")
        if part["tokens"] != sum(n for _, n in part["files"]):
            raise bad(f"{split}.tokens", f"the sum of the files' token counts ({sum(n for _, n in part['files'])})")
        if not _is_number(part.get("bytes_per_token")):
            raise bad(f"{split}.bytes_per_token", "a number")
    for key in ("unigram_val_loss", "uniform_loss"):
        if not _is_number(meta.get(key)):
            raise bad(key, "a number")
    return meta


def load_meta(data_dir: str | os.PathLike) -> dict:
    """Read and check ``meta.json`` of a prepared directory (FileNotFoundError / ValueError, one line)."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: prepare the data first (xtrain data prepare --out {data_dir})")
    return check_meta(_read_meta_json(path), path)


def _complete(out_dir: Path, config: dict) -> dict | None:
    """The existing meta if ``out_dir`` holds complete data built with exactly ``config`` (whose corpus part
    has no ``split``), else None."""
    try:
        meta = load_meta(out_dir)
    except (FileNotFoundError, ValueError):
        return None
    stored = meta["config"]
    # ``config`` leaves out the corpus's split rule (deciding it may read the whole corpus): the rule is a
    # function of what the rest of the config pins (the corpus fingerprint, max_bytes, val_fraction), so data
    # that records one is reused; data prepared before the rules were recorded is rebuilt
    if "split" not in stored["corpus"]:
        return None
    if {**stored, "corpus": {k: v for k, v in stored["corpus"].items() if k != "split"}} != config:
        return None
    try:  # a tokenizer.json replaced since (another vocabulary, unreadable) makes the data incomplete
        load_tokenizer(out_dir / meta["tokenizer"], vocab_size=meta["vocab_size"], expected_by=f"{out_dir}/meta.json")
    except (FileNotFoundError, ValueError):
        return None
    itemsize = token_dtype(meta["vocab_size"]).itemsize
    for split in ("train", "val"):
        for name, n in meta[split]["files"]:
            f = out_dir / name
            if not f.is_file() or f.stat().st_size != HEADER_BYTES + n * itemsize:
                return None
    return meta


# ----------------------------------------------------------------------------------------------------
# where prepare writes: the output folder rule, staging, the swap, leftovers of killed runs


def _data_dir_meta(path: Path) -> dict | None:
    """The parsed meta.json when ``path`` is an xtrain data directory (recognised by the format of its
    meta.json alone: the fields may be broken, a re-prepare mends them), else None."""
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == META_FORMAT else None


def check_out_dir(out_dir: str | os.PathLike) -> None:
    """Refuse (OutDirRefused, one line) an output folder that ``prepare`` may not write: allowed are a
    missing path, an empty folder, and an xtrain data directory holding only what ``prepare`` writes."""
    p = Path(out_dir)
    if not p.exists():
        if p.is_symlink():
            raise OutDirRefused(f"{p}: a dangling symbolic link; prepare into a new or empty folder")
        return
    if not p.is_dir():
        raise OutDirRefused(f"{p} exists and is not a folder; prepare into a new or empty folder")
    names = sorted(os.listdir(p))
    if not names:
        return
    meta = _data_dir_meta(p)
    if meta is None:
        raise OutDirRefused(
            f"{p} is not empty and is not an xtrain data directory (no meta.json of format {META_FORMAT}); "
            "prepare into a new or empty folder, or remove what is there"
        )
    tok_name = meta["tokenizer"] if _plain_file_name(meta.get("tokenizer")) else "tokenizer.json"

    def ours(name: str) -> bool:
        if not (p / name).is_file() or (p / name).is_symlink():
            return False
        return name in ("meta.json", tok_name) or bool(_SHARD_NAME.fullmatch(name) or _TEMP_NAME.fullmatch(name))

    foreign = [n for n in names if not ours(n)]
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise OutDirRefused(
            f"{p} is an xtrain data directory but also holds {foreign[0]}{more}, which xtrain did not write "
            "there; move it out, or prepare into another folder"
        )


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: alive, another user's
        return True
    return True


def _side_name(target: Path, kind: str, pid: int | None = None) -> Path:
    """``.<name>.<kind>-<pid>`` beside ``target``: the staging folder of a build, or the old directory
    during a swap."""
    return target.parent / f".{target.name}.{kind}-{os.getpid() if pid is None else pid}"


def clean_leftovers(target: Path, log=print) -> None:
    """Remove the staging/old folders that a killed ``prepare`` of ``target`` left beside it (not those of
    a live process), restoring the old directory when the kill fell between the swap's two renames."""
    if not target.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(staging|old)-(\d+)")
    for p in sorted(target.parent.iterdir()):
        m = pattern.fullmatch(p.name)
        if m is None or not p.is_dir() or p.is_symlink():
            continue
        pid = int(m[2])
        if pid != os.getpid() and _process_alive(pid):
            continue  # another prepare of the same folder is running: its folders are not leftovers
        if m[1] == "old" and not target.exists() and _data_dir_meta(p) is not None:
            os.rename(p, target)
            log(f"data: restored {target} from {p.name}, left by a prepare (process {pid}) killed while swapping")
        else:
            shutil.rmtree(p)
            log(f"data: removed {p}, left by a prepare (process {pid}) that did not finish")


@contextmanager
def _signals_held():
    """SIGINT/SIGTERM/SIGHUP that arrive inside the block are recorded and raised again when it ends (the
    handler that was installed, Ctrl-C's KeyboardInterrupt included, then runs), so no signal lands between
    two renames that must both happen. Python handlers, not a signal mask: a mask is per thread, and the
    tokenizers library's threads would take the signal. Only the main thread may set handlers; elsewhere
    the block runs unprotected."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None and signal.getsignal(sig) not in (signal.SIG_IGN, None):
            old[sig] = signal.signal(sig, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for signum in caught:
            signal.raise_signal(signum)


def _swap_in(staging: Path, target: Path, done: list) -> None:
    """Put the complete ``staging`` folder at ``target``: a missing ``target`` is one rename, an empty one
    receives the files (meta.json last); an existing data directory is renamed aside, the new one renamed
    in, the old one deleted.
    Appends to ``done`` once the new data is in place (a signal held off meanwhile lands after that)."""
    with _signals_held():
        if target.is_dir() and not any(target.iterdir()):
            # the files move into the user's empty folder (it may be their shell's working directory, which
            # a rename over it would leave deleted); meta.json, which marks the data complete, moves last
            moved = []
            try:
                for name in sorted(os.listdir(staging), key=lambda n: n == "meta.json"):
                    os.rename(staging / name, target / name)
                    moved.append(name)
            except BaseException:
                for name in moved:
                    os.rename(target / name, staging / name)
                raise
            staging.rmdir()
        elif target.exists():
            old = _side_name(target, "old")
            os.rename(target, old)
            try:
                os.rename(staging, target)
            except BaseException:
                os.rename(old, target)
                raise
            shutil.rmtree(old, ignore_errors=True)  # if this is cut short, the next prepare removes the rest
        else:
            os.rename(staging, target)
        done.append(True)
    fsync_dir(target.parent)


def _make_parents(folder: Path) -> list[Path]:
    """mkdir -p ``folder``; returns the folders it created, deepest first (removed again on failure)."""
    missing = []
    p = folder
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    folder.mkdir(parents=True, exist_ok=True)
    return missing


@contextmanager
def _naming(path: Path):
    """An OSError without a file name (a failed write() or flush()) gets ``path`` as its file name."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise


def _disk_error(e: OSError, target: Path, staging: Path, existed: bool, default_dir: bool) -> DataWriteError:
    where = Path(e.filename) if e.filename is not None else target
    try:
        where = target / where.relative_to(staging)  # the user knows the final name, not the staging one
    except ValueError:
        pass
    cause = f"{DISK_ERRORS.get(e.errno) or e.strerror} ({errno.errorcode.get(e.errno, e.errno)})"  # fileio's words
    state = f"the data in {target} is unchanged" if existed else "nothing was left behind"
    hint = ""
    if default_dir:
        hint = (
            "; the default data folder is $XTRAIN_CACHE/data (XTRAIN_CACHE defaults to ~/.cache/xtrain): "
            "set XTRAIN_CACHE to a writable folder, or pass --out"
        )
    return DataWriteError(e.errno, f"cannot write {where}: {cause}; {state}{hint}")


# ----------------------------------------------------------------------------------------------------
# prepare


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
    settings (unless ``force``). ``out_dir`` must be missing, empty or an xtrain data directory
    (``OutDirRefused`` otherwise); the build is staged and swapped in (module docstring).

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
    default_dir = out_dir is None
    out_dir = Path(out_dir) if out_dir is not None else default_data_dir(vocab_size, corpus.name)
    target = Path(os.path.abspath(out_dir.expanduser()))
    if target.is_symlink() and target.resolve().is_dir():
        target = target.resolve()  # swap the folder the link points to, not the link
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
    staging = _side_name(target, "staging")
    existed = False
    created: list[Path] = []
    swapped: list = []
    try:
        clean_leftovers(target, log)
        check_out_dir(target)
        existed = target.is_dir() and any(target.iterdir())
        config = {
            "corpus": corpus.describe(with_split=False),
            "tokenizer": tok.kind if tok is not None else tokenizer,
            "vocab_size": tok.vocab_size if tok is not None else vocab_size,
            "tokenizer_source": tok_source,
            "tokenizer_max_bytes": tokenizer_max_bytes,
            "shard_tokens": shard_tokens,
            "eot": "before-each-document",
        }
        if not force:
            meta = _complete(target, config)
            if meta is not None:
                log(
                    f"data: reusing {out_dir} ({meta['train']['tokens']:,} train / {meta['val']['tokens']:,} "
                    f"val tokens, vocab {meta['vocab_size']})"
                )
                return {**meta, "dir": str(out_dir)}
        config["corpus"] = corpus.describe()  # with the split rule, decided now
        log(f"data: {corpus.split_note()}")
        created = _make_parents(target.parent)
        staging.mkdir()
        meta = _build(
            corpus, config, tok, tokenizer, vocab_size, tokenizer_max_bytes, shard_tokens, progress, log, staging
        )
        meta["seconds"]["total"] = round(time.perf_counter() - t_start, 3)
        with _naming(staging / "meta.json"):
            atomic_write_text(staging / "meta.json", json.dumps(meta, indent=2) + "\n")
        _swap_in(staging, target, swapped)
    except BaseException as e:
        if swapped:  # a signal held off during the swap lands here: the new data is complete and in place
            log(f"data: wrote {out_dir} (complete) before stopping")
            raise
        shutil.rmtree(staging, ignore_errors=True)
        for folder in created:  # deepest first; only those still empty
            try:
                folder.rmdir()
            except OSError:
                break
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS and not isinstance(e, DataWriteError):
            raise _disk_error(e, target, staging, existed, default_dir) from None
        raise
    n_tok = {s: meta[s]["tokens"] for s in ("train", "val")}
    log(
        f"data: wrote {out_dir}: {n_tok['train']:,} train / {n_tok['val']:,} val tokens "
        f"({meta['train']['docs']} / {meta['val']['docs']} docs), vocab {meta['vocab_size']}, "
        f"unigram val loss {meta['unigram_val_loss']:.4f} nats (uniform {meta['uniform_loss']:.4f}), "
        f"{meta['seconds']['total']:.1f}s"
    )
    if n_tok["val"] == 0:
        rule = corpus.split()["rule"]
        why = {"none": "val_fraction is 0", "val-file": "the val file is empty"}.get(
            rule, f"{corpus.val_fraction * 100:g}% of {meta['train']['bytes']} bytes is less than one line"
        )
        log(f"data: warning: the val split is empty ({why})")
    return {**meta, "dir": str(out_dir)}


def _build(corpus, config, tok, tokenizer, vocab_size, tokenizer_max_bytes, shard_tokens, progress, log, dest):
    """Train (or take) the tokenizer and write tokenizer.json and the shards into the empty folder
    ``dest``; returns the meta dict (``prepare`` writes it)."""
    # 1. tokenizer
    t0 = time.perf_counter()
    if tok is None:
        log(f"data: training {tokenizer} tokenizer (vocab {vocab_size}) on {corpus.name} ...")
        tok = make_tokenizer(tokenizer, vocab_size, corpus.train_texts(max_bytes=tokenizer_max_bytes))
        if tok.vocab_size < vocab_size and tok.kind == "bpe":
            log(f"data: note: the corpus ran out of pairs to merge; vocab is {tok.vocab_size}, not {vocab_size}")
    with _naming(dest / "tokenizer.json"):
        tok.save(dest / "tokenizer.json")
    t_tok = time.perf_counter() - t0

    # 2. encode documents in batches, streaming tokens into shards
    t0 = time.perf_counter()
    writers = {s: ShardWriter(dest, s, tok.vocab_size, shard_tokens) for s in ("train", "val")}
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

    counts = {s: w.counts for s, w in writers.items()}
    n_tok = {s: int(counts[s].sum()) for s in counts}
    if n_tok["train"] == 0:
        raise ValueError(f"corpus {corpus.name} produced no train documents")
    return {
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
        "seconds": {"tokenizer": round(t_tok, 3), "encode": round(t_enc, 3)},
    }
