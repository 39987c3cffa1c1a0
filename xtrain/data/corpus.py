"""Corpora: where training text comes from, one document at a time.

A corpus is a lazy stream of documents, each tagged with the split it belongs to::

    for split, doc in corpus.documents():     # split is "train" or "val"
        doc.key   # a stable name: "asyncio/events.py", "stories.txt#1041", "data.jsonl#17"
        doc.text  # the document as a str

Nothing is loaded whole: files are read one at a time, ``.txt`` files are split on ``<|endoftext|>`` while
streaming, ``.jsonl`` line by line, ``.parquet`` batch by batch. Iterating twice gives the same documents in
the same order.

Sources (``open_corpus(spec)``):

``pystdlib`` (the default)
    The ``.py`` files of the running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``),
    one document per file, walked in sorted relative-path order, decoded as UTF-8 with errors replaced.
    Skipped: ``site-packages``/``dist-packages``, ``__pycache__``, and the test suites (any directory named
    ``test``, ``tests`` or ``idle_test``): they are ~60% of the bytes and full of deliberately odd code
    (bad encodings, syntax errors, huge generated tables). What is left is ~12 MB on CPython 3.11,
    capped by ``DEFAULT_MAX_BYTES`` (16 MB) so another Python version cannot make the default run slow.
    The corpus depends on the Python version; ``describe()`` records it.

``tinystories``
    ``TinyStoriesV2-GPT4-train.txt`` / ``-valid.txt`` from the Hugging Face dataset
    ``roneneldan/TinyStories``, downloaded through ``huggingface_hub`` (only when asked for by name).
    The valid file is the val split.

a path
    A text file (``.txt`` split on ``<|endoftext|>``; any other suffix is one document), a ``.jsonl`` file
    (one JSON object per line with a ``text`` field), a ``.parquet`` file (a ``text`` column; needs
    pyarrow), or a directory, walked in sorted order, whose ``.txt``/``.md``/``.py`` files are read as
    above.

Train/val split (``Corpus.split``), one of four rules, recorded in ``describe()["split"]``:

``val-file``  the source has its own val file (``tinystories``, ``--val-corpus``): that file is val.
``none``      ``val_fraction`` is 0: everything is train.
``by-name``   a document is in val when ``sha256(key)`` (first 8 bytes, as an integer) mod 10**6 is below
              ``val_fraction * 10**6``: a pure function of the document's name, so adding or removing other
              documents never moves it between splits. Used when the corpus (after ``max_bytes``) has at least
              ``MIN_DOCS_BY_NAME`` (100) documents and this puts at least one of them on each side.
``tail``      otherwise (one ``input.txt`` with no separator, a handful of files, or a name split that left
              one side empty): val is the end of the text. Of the corpus's T UTF-8 bytes (documents in
              stream order), train is the first ``int(T * (1 - val_fraction))`` bytes and val the rest, with
              the cut moved forward to the next line start (the byte after a newline, or the start of the
              next document; to the next character boundary when neither follows). The document the cut
              falls in is split there into two documents.

Deciding reads the document stream once up to the point where the rule is settled (the first 100 or so
documents for a large corpus; the whole text when the tail rule applies, whose length it needs). The
default ``val_fraction`` is 2%.

Binary files: a file is binary when it holds a NUL byte or when more than ``MAX_INVALID_UTF8`` (1%) of
its bytes are not valid UTF-8 (``binary_reason``: checked on each file's first 64 KB before reading it,
and on every chunk while streaming a ``.txt``). A single-file corpus that is binary is refused (ValueError
naming the file); a directory corpus skips its binary files, listed in ``Corpus.skipped`` and counted in
the log of ``xtrain data prepare``.

``max_bytes`` caps the UTF-8 bytes taken: documents are taken in stream order, the one that crosses the cap
is cut at it, and the stream stops (the val file of a two-file source is capped separately at
``max_bytes * val_fraction``).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

EOT_TEXT = "<|endoftext|>"
DEFAULT_MAX_BYTES = 16_000_000  # cap for the pystdlib corpus (it is ~12 MB on CPython 3.11)
DEFAULT_VAL_FRACTION = 0.02
TEXT_SUFFIXES = (".txt", ".md", ".py")  # what a directory walk picks up
MIN_DOCS_BY_NAME = 100  # fewer documents than this: the val split is the tail of the text, not by name
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})

TINYSTORIES_REPO = "roneneldan/TinyStories"
TINYSTORIES_FILES = {"train": "TinyStoriesV2-GPT4-train.txt", "val": "TinyStoriesV2-GPT4-valid.txt"}

READ_CHUNK = 1 << 20  # bytes read at a time when streaming a .txt file
SNIFF_BYTES = 1 << 16  # bytes of each file checked for binary content before it is read
MAX_INVALID_UTF8 = 0.01  # fraction of bytes that may fail to decode before a file counts as binary


def binary_reason(data: bytes) -> str | None:
    """Why ``data`` (a file's bytes, or a prefix of them) is not text, or None when it is text."""
    if not data:
        return None
    nul = data.find(b"\0")
    if nul != -1:
        return f"binary, not text: a NUL byte at offset {nul}"
    # an incomplete character cut at the end of a prefix is not an error
    bad = data.decode("utf-8", errors="replace").count("\ufffd") - data.count("\ufffd".encode())
    tail = len(data) - len(data.rstrip(bytes(range(0x80, 0x100))))
    bad = max(0, bad - (1 if tail else 0))
    if bad > MAX_INVALID_UTF8 * len(data):
        return f"binary, not text: {bad} of {len(data)} bytes are not valid UTF-8"
    return None


def sniff_binary(path: Path) -> str | None:
    """``binary_reason`` of the first SNIFF_BYTES of the file at ``path``."""
    with open(path, "rb") as f:
        return binary_reason(f.read(SNIFF_BYTES))


class Document(NamedTuple):
    key: str  # stable name, used for the train/val hash split
    text: str


def is_val_key(key: str, val_fraction: float) -> bool:
    """True when the document named ``key`` belongs to the val split (a pure function of the name)."""
    h = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "little")
    return h % 1_000_000 < round(val_fraction * 1_000_000)


# ----------------------------------------------------------------------------------------------------
# readers: each yields Documents lazily


def read_text_file(path: Path, key_prefix: str | None = None, *, chunk_bytes: int = READ_CHUNK) -> Iterator[Document]:
    """A ``.txt`` file split on ``<|endoftext|>`` (each piece stripped, empty pieces dropped); any other
    suffix is one document. Keys are ``name#i`` for split files and ``name`` for whole files. A ``.txt`` file is
    streamed ``chunk_bytes`` at a time (a separator or a UTF-8 character may straddle two chunks)."""
    path = Path(path)
    name = key_prefix if key_prefix is not None else path.name
    if path.suffix != ".txt":
        data = path.read_bytes()
        if (why := binary_reason(data)) is not None:
            raise ValueError(f"{path}: {why}; xtrain reads UTF-8 text")
        yield Document(name, data.decode("utf-8", errors="replace"))
        return
    # stream: decode incrementally, split on the separator, keep the unfinished tail in the buffer
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buf, i, search = "", 0, 0
    seen = bad = 0  # bytes read, characters that failed to decode
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_bytes)
            text = decoder.decode(chunk, final=not chunk)
            if (nul := chunk.find(b"\0")) != -1:
                raise ValueError(
                    f"{path}: binary, not text: a NUL byte at offset {seen + nul}; xtrain reads UTF-8 text"
                )
            seen += len(chunk)
            bad += text.count("\ufffd") - chunk.count("\ufffd".encode())
            if bad > MAX_INVALID_UTF8 * max(seen, SNIFF_BYTES):
                raise ValueError(
                    f"{path}: binary, not text: {bad} of the first {seen} bytes are not valid UTF-8; "
                    "xtrain reads UTF-8 text"
                )
            buf += text
            start = 0
            # search only the new text (plus a separator's length of overlap), so a huge document with no
            # separator costs O(n), not O(n^2)
            while (j := buf.find(EOT_TEXT, search)) != -1:
                part = buf[start:j].strip()
                if part:
                    yield Document(f"{name}#{i}", part)
                    i += 1
                start = search = j + len(EOT_TEXT)
            buf = buf[start:]
            search = max(0, len(buf) - len(EOT_TEXT) + 1)
            if not chunk:
                break
    buf = buf.strip()
    if buf:
        yield Document(f"{name}#{i}" if i else name, buf)


def read_jsonl(path: Path) -> Iterator[Document]:
    """One JSON object per line with a string ``text`` field; blank lines are skipped."""
    path = Path(path)
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a string 'text' field")
            yield Document(f"{path.name}#{lineno}", obj["text"])


def read_parquet(path: Path) -> Iterator[Document]:
    """The ``text`` column of a parquet file, read in record batches (needs pyarrow)."""
    path = Path(path)
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow (or convert it to .jsonl/.txt)") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid for non-parquet files
        raise ValueError(f"{path}: not a readable parquet file ({e})") from None
    if "text" not in pf.schema_arrow.names:
        raise ValueError(f"{path}: parquet file has no 'text' column (columns: {pf.schema_arrow.names})")
    i = 0
    for batch in pf.iter_batches(columns=["text"], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text:
                yield Document(f"{path.name}#{i}", text)
            i += 1


def read_path(path: Path, skip: frozenset[Path] = frozenset()) -> Iterator[Document]:
    """Any accepted local path: a file by its suffix, or a directory walked in sorted order (leaving out
    the files in ``skip``)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus path {path} does not exist")
    if path.is_dir():
        for f in _walk_sorted(path, TEXT_SUFFIXES, skip_dirs=frozenset({"__pycache__"})):
            if f not in skip:
                yield from read_text_file(f, key_prefix=f.relative_to(path).as_posix())
    elif path.suffix == ".jsonl":
        yield from read_jsonl(path)
    elif path.suffix == ".parquet":
        yield from read_parquet(path)
    else:
        yield from read_text_file(path)


def _walk_sorted(root: Path, suffixes: tuple[str, ...], skip_dirs: frozenset[str]) -> list[Path]:
    """Files under ``root`` with one of ``suffixes``, sorted by relative path components (a fixed order on
    every platform: os.walk's order is the filesystem's)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs]
        found.extend(Path(dirpath) / name for name in filenames if name.endswith(suffixes))
    return sorted(found, key=lambda f: f.relative_to(root).parts)


def _files_fingerprint(files: list[Path], root: Path, with_mtime: bool) -> str:
    """sha256 over (relative path, size[, mtime]) of the files: cheap, and changes when the corpus does."""
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        rel = f.relative_to(root).as_posix() if f != root else f.name
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns if with_mtime else 0}\n".encode())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------
# corpora


@dataclass
class Corpus:
    """A named document stream with a train/val split and a byte cap.

    ``name`` is ``pystdlib``, ``tinystories`` or the path given. Use ``open_corpus`` to build one.
    """

    name: str
    kind: str  # "pystdlib" | "tinystories" | "path"
    max_bytes: int | None
    val_fraction: float
    _train_source: Callable[[], Iterator[Document]] | None = None
    _val_source: Callable[[], Iterator[Document]] | None = None  # None: hash split of the train source
    _describe: dict | None = None
    size_hint: int | None = None  # total bytes, for progress bars (None if unknown)
    skipped: tuple[str, ...] = ()  # binary files of a directory corpus, left out ("name: reason")
    _split: dict | None = field(default=None, repr=False)  # split(), decided on first use

    def documents(self) -> Iterator[tuple[str, Document]]:
        """Yield ``(split, Document)`` lazily: in stream order for the by-name and tail rules (see the
        module docstring), all train then all val for a source with a val file."""
        rule = self.split()["rule"]
        if rule == "val-file":
            for doc in _capped(self._train_source(), self.max_bytes):
                yield "train", doc
            val_cap = None if self.max_bytes is None else max(1, int(self.max_bytes * self.val_fraction))
            for doc in _capped(self._val_source(), val_cap):
                yield "val", doc
        elif rule == "tail":
            yield from _tail_split(_capped(self._train_source(), self.max_bytes), self.split()["cut"])
        else:  # "by-name", or "none" (val_fraction 0: is_val_key is never true)
            for doc in _capped(self._train_source(), self.max_bytes):
                yield ("val" if is_val_key(doc.key, self.val_fraction) else "train"), doc

    def split(self) -> dict:
        """How this corpus is split, decided once (module docstring): ``{"rule", "docs", "cut", "why"}``.
        ``docs`` counts the documents read to decide (all of them for the tail rule); ``cut`` is the nominal
        byte offset where val starts under the tail rule (before moving to a line start), else None."""
        if self._split is None:
            self._split = self._decide_split()
        return self._split

    def _decide_split(self) -> dict:
        f = self.val_fraction
        if self._val_source is not None:
            return {"rule": "val-file", "docs": None, "cut": None, "why": "the source has its own val file"}
        if f == 0:
            return {"rule": "none", "docs": None, "cut": None, "why": "val_fraction is 0"}
        n = n_val = total = 0
        for doc in _capped(self._train_source(), self.max_bytes):
            n += 1
            n_val += is_val_key(doc.key, f)
            total += len(doc.text.encode("utf-8"))
            if n >= MIN_DOCS_BY_NAME and 0 < n_val < n:
                return {"rule": "by-name", "docs": n, "cut": None, "why": f"at least {MIN_DOCS_BY_NAME} documents"}
        if n < MIN_DOCS_BY_NAME:
            why = f"{n} document{'s' if n != 1 else ''}, fewer than {MIN_DOCS_BY_NAME} to split by name"
        else:
            why = f"the split by name put all {n} documents on one side"
        return {"rule": "tail", "docs": n, "cut": int(total * (1 - f)), "why": why}

    def split_note(self) -> str:
        """One line for the log: which rule splits this corpus, and why."""
        s, pct = self.split(), f"{self.val_fraction * 100:g}%"
        text = {
            "val-file": "val is the source's own val file",
            "none": "no val split (val_fraction 0)",
            "by-name": f"val is the documents whose name hashes into the lowest {pct}",
            "tail": f"val is the last {pct} of the text bytes, from a line start",
        }[s["rule"]]
        return f"{text} ({s['why']})"

    def train_texts(self, max_bytes: int | None = None) -> Iterator[str]:
        """The train documents' texts (for tokenizer training), optionally capped further."""

        val_comes_last = self.split()["rule"] in ("val-file", "tail")

        def train_docs() -> Iterator[Document]:
            for split, doc in self.documents():
                if split == "train":
                    yield doc
                elif val_comes_last:
                    return  # all of train came before the first val document: no need to read on

        for doc in _capped(train_docs(), max_bytes):
            yield doc.text

    def describe(self, with_split: bool = True) -> dict:
        """JSON-able description, recorded in meta.json and compared to decide whether prepared data can
        be reused (it includes a fingerprint of the source files). ``with_split`` adds the split rule, which
        may read the whole corpus to decide."""
        return {
            "name": self.name,
            "kind": self.kind,
            "max_bytes": self.max_bytes,
            "val_fraction": self.val_fraction,
            **({"split": self.split()["rule"]} if with_split else {}),
            **(self._describe or {}),
        }


def _capped(docs: Iterator[Document], max_bytes: int | None) -> Iterator[Document]:
    """Documents in order until ``max_bytes`` UTF-8 bytes; the one that crosses the cap is cut there (at a
    character boundary), so the total never exceeds the cap and one huge document cannot empty it."""
    taken = 0
    for doc in docs:
        if max_bytes is not None:
            data = doc.text.encode("utf-8")
            if taken + len(data) > max_bytes:
                head = data[: max_bytes - taken].decode("utf-8", errors="ignore")  # drop a split character
                if head:
                    yield Document(doc.key, head)
                return
            taken += len(data)
        yield doc


def _tail_split(docs: Iterator[Document], cut: int) -> Iterator[tuple[str, Document]]:
    """The tail rule: documents before byte offset ``cut`` of the stream are train, those after it val; the
    one that straddles it is split at its first line start at or after the cut (or, with none, at the next
    document when there is one, else at the next character boundary)."""
    pos = 0
    nxt = next(docs, None)
    while nxt is not None:
        doc, nxt = nxt, next(docs, None)  # one document of lookahead: is there a next document?
        data = doc.text.encode("utf-8")
        end = pos + len(data)
        if end <= cut:
            yield "train", doc
        elif pos >= cut:
            yield "val", doc
        else:
            k = cut - pos  # 0 < k < len(data)
            nl = data.find(b"\n", k - 1)  # a newline at k-1 or later starts a line at k or later
            if nl != -1 and nl + 1 < len(data):
                k = nl + 1
            elif nxt is not None:
                k = len(data)  # the next document's start is the next line start
            else:
                while k < len(data) and data[k] & 0xC0 == 0x80:  # a UTF-8 continuation byte
                    k += 1
            if k > 0:
                yield "train", Document(doc.key, data[:k].decode("utf-8"))
            if k < len(data):
                yield "val", Document(f"{doc.key}#tail", data[k:].decode("utf-8"))
        pos = end


def stdlib_files(include_tests: bool = False) -> tuple[Path, list[Path]]:
    """(stdlib root, its .py files in sorted relative-path order) for the running interpreter."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory {root} not found (sysconfig 'stdlib' path)")
    skip = SKIP_DIRS if not include_tests else SKIP_DIRS - {"test", "tests", "idle_test"}
    return root, _walk_sorted(root, (".py",), skip_dirs=skip)


def open_corpus(
    spec: str | os.PathLike = "pystdlib",
    *,
    max_bytes: int | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    val_path: str | os.PathLike | None = None,
    include_tests: bool = False,
) -> Corpus:
    """Build a corpus from ``pystdlib``, ``tinystories`` or a local path.

    ``max_bytes``: None means the corpus default (``DEFAULT_MAX_BYTES`` for pystdlib, unlimited for the
    others); 0 means unlimited. ``val_path``: an explicit val source (then there is no hash split).
    ``tinystories`` downloads through huggingface_hub; nothing else touches the network.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    spec = os.fspath(spec)
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    if spec == "pystdlib":
        cap = DEFAULT_MAX_BYTES if max_bytes is None else (max_bytes or None)
        root, files = stdlib_files(include_tests)

        def source() -> Iterator[Document]:
            for f in files:
                yield Document(f.relative_to(root).as_posix(), f.read_bytes().decode("utf-8", "replace"))

        total = sum(f.stat().st_size for f in files)
        info = {
            "python": sys.version.split()[0],
            "include_tests": include_tests,
            "num_files": len(files),
            "fingerprint": _files_fingerprint(files, root, with_mtime=False),
        }
        corpus = Corpus(
            spec, "pystdlib", cap, val_fraction, source, None, info, size_hint=min(total, cap) if cap else total
        )
    elif spec == "tinystories":
        cap = max_bytes or None
        train_file, val_file = download_tinystories()
        info = {
            "files": [train_file.name, val_file.name],
            "fingerprint": _files_fingerprint([train_file, val_file], train_file.parent, with_mtime=False),
        }
        corpus = Corpus(
            spec,
            "tinystories",
            cap,
            val_fraction,
            lambda: read_text_file(train_file),
            lambda: read_text_file(val_file),
            info,
            size_hint=cap or train_file.stat().st_size,
        )
    else:
        cap = max_bytes or None
        path = Path(spec).expanduser().resolve()
        if not path.exists():
            raise FileNotFoundError(f"corpus {spec!r} is not 'pystdlib', 'tinystories' or an existing file/directory")
        files = _walk_sorted(path, TEXT_SUFFIXES, frozenset({"__pycache__"})) if path.is_dir() else [path]
        if not files:
            raise ValueError(f"corpus directory {path} has no {'/'.join(TEXT_SUFFIXES)} files")
        skipped: dict[Path, str] = {}
        if path.suffix != ".parquet":
            for f in files:
                if (why := sniff_binary(f)) is not None:
                    if not path.is_dir():
                        raise ValueError(f"{f}: {why}; xtrain data prepare reads UTF-8 text")
                    skipped[f] = why
        if skipped and len(skipped) == len(files):
            first = next(iter(skipped))
            raise ValueError(f"corpus directory {path}: every file is binary ({first}: {skipped[first]})")
        skip = frozenset(skipped)
        info = {"path": str(path), "fingerprint": _files_fingerprint(files, path, with_mtime=True)}
        total = sum(f.stat().st_size for f in files if f not in skip)
        corpus = Corpus(
            str(path),
            "path",
            cap,
            val_fraction,
            lambda: read_path(path, skip),
            None,
            info,
            size_hint=min(total, cap) if cap else total,
            skipped=tuple(f"{f.relative_to(path).as_posix()}: {why}" for f, why in skipped.items()),
        )
    if val_path is not None:
        vp = Path(val_path).expanduser().resolve()
        if not vp.exists():
            raise FileNotFoundError(f"val corpus path {vp} does not exist")
        corpus._val_source = lambda: read_path(vp)
        corpus._describe = {
            **corpus._describe,
            "val_path": str(vp),
            "val_fingerprint": _files_fingerprint([vp], vp, with_mtime=True),
        }
    return corpus


def download_tinystories() -> tuple[Path, Path]:
    """(train file, valid file) of TinyStories V2 (GPT-4), fetched through the huggingface_hub cache."""
    hint = (
        "download TinyStoriesV2-GPT4-train.txt and -valid.txt from "
        f"https://huggingface.co/datasets/{TINYSTORIES_REPO} yourself and pass the local path: "
        "--corpus /path/TinyStoriesV2-GPT4-train.txt --val-corpus /path/TinyStoriesV2-GPT4-valid.txt"
    )
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise RuntimeError(
            f"--corpus tinystories needs huggingface_hub (pip install huggingface_hub), or {hint}"
        ) from None
    paths = []
    for split in ("train", "val"):
        try:
            paths.append(Path(hf_hub_download(TINYSTORIES_REPO, TINYSTORIES_FILES[split], repo_type="dataset")))
        except Exception as e:  # offline, no such file, auth: all end the same way for the user
            raise RuntimeError(
                f"could not fetch {TINYSTORIES_FILES[split]} from the Hugging Face hub "
                f"({type(e).__name__}: {e}); {hint}"
            ) from None
    return paths[0], paths[1]
