"""Token shards in the llm.c ``.bin`` layout.

A shard is a header of 256 little-endian int32 followed by the tokens::

    header[0] = magic     20240520 (uint16 tokens)  or 20240801 (uint32 tokens)
    header[1] = version   1                          or 7
    header[2] = N         number of tokens
    header[3:256] = 0     (reserved)
    then N tokens, little-endian uint16 or uint32   (file size = 1024 + N * itemsize)

uint16 is used whenever every id fits (vocab_size <= 65536), uint32 otherwise; readers follow the header.
These are the files llm.c's ``dataloader.h`` reads (GPT-2 and Llama 3 variants), so shards can be shared.

``write_shard`` writes to a temporary name and renames; ``ShardWriter`` streams a long token stream into
numbered shards the same way. ``read_shard`` validates and returns a read-only ``np.memmap`` of the tokens.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# magic -> (version, token dtype)
FORMATS = {
    20240520: (1, np.dtype("<u2")),
    20240801: (7, np.dtype("<u4")),
}
MAX_TOKENS_PER_SHARD = 2**31 - 1  # header[2] is an int32
CHECK_CHUNK = 1 << 24  # tokens scanned at a time when checking ids (bounded memory for big shards)


def magic_for_vocab(vocab_size: int) -> int:
    """The header magic to use for ``vocab_size`` (uint16 when all ids fit, else uint32)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if vocab_size > 2**32:
        raise ValueError(f"vocab_size {vocab_size} does not fit in uint32 tokens")
    return 20240520 if vocab_size <= 2**16 else 20240801


def token_dtype(vocab_size: int) -> np.dtype:
    return FORMATS[magic_for_vocab(vocab_size)][1]


def _header(magic: int, n: int) -> bytes:
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[0], h[1], h[2] = magic, FORMATS[magic][0], n
    return h.tobytes()


def check_token_range(tokens: np.ndarray, vocab_size: int, what: str, chunk_tokens: int = CHECK_CHUNK) -> None:
    """Raise ValueError naming ``what`` and the first bad id's position if any token is outside [0, vocab_size);
    scans ``chunk_tokens`` at a time so huge memmaps stay cheap."""
    for start in range(0, len(tokens), chunk_tokens):
        chunk = tokens[start : start + chunk_tokens]
        lo, hi = int(chunk.min()), int(chunk.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            pos = start + int(np.argmax(chunk == bad))
            raise ValueError(f"{what}: token id {bad} at position {pos} is outside [0, {vocab_size})")


def write_shard(path: str | os.PathLike, tokens, vocab_size: int) -> Path:
    """Write ``tokens`` (any int array-like, shape (N,)) as one shard; atomic (temp name + rename)."""
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"write_shard {path}: tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"write_shard {path}: tokens must be integers, got {tokens.dtype}")
    with ShardWriter(path.parent, path.name, vocab_size, shard_tokens=MAX_TOKENS_PER_SHARD) as w:
        w.add(tokens)
    return path


class ShardWriter:
    """Stream tokens into shards ``{prefix}_000000.bin, {prefix}_000001.bin, ...`` of at most
    ``shard_tokens`` tokens each (if ``prefix`` ends in ``.bin`` it is one exact file name instead, and
    the stream must fit in one shard).

    Each shard is written under a temporary name; the header (with the final count) is written last,
    then the file is renamed. ``close()`` returns ``[(file name, token count), ...]``. Also keeps a
    histogram of the ids written (``counts``, shape (vocab_size,)), for the unigram baseline.
    """

    def __init__(self, out_dir: str | os.PathLike, prefix: str, vocab_size: int, shard_tokens: int = 100_000_000):
        if not 1 <= shard_tokens <= MAX_TOKENS_PER_SHARD:
            raise ValueError(f"shard_tokens must be in [1, {MAX_TOKENS_PER_SHARD}], got {shard_tokens}")
        self.out_dir = Path(out_dir)
        self.prefix = prefix
        self.vocab_size = vocab_size
        self.magic = magic_for_vocab(vocab_size)
        self.dtype = FORMATS[self.magic][1]
        self.shard_tokens = shard_tokens
        self.counts = np.zeros(vocab_size, dtype=np.int64)
        self.shards: list[tuple[str, int]] = []
        self._f = None  # open temp file of the current shard
        self._n = 0  # tokens in the current shard
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def _name(self, index: int) -> str:
        return self.prefix if self.prefix.endswith(".bin") else f"{self.prefix}_{index:06d}.bin"

    def _tmp(self, name: str) -> Path:
        return self.out_dir / f".{name}.tmp{os.getpid()}"

    def _open(self) -> None:
        name = self._name(len(self.shards))
        self._f = open(self._tmp(name), "wb")
        self._f.write(_header(self.magic, 0))  # placeholder; the real count is written on finish
        self._n = 0

    def _finish(self) -> None:
        name = self._name(len(self.shards))
        f = self._f
        f.seek(0)
        f.write(_header(self.magic, self._n))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self._f = None
        os.replace(self._tmp(name), self.out_dir / name)
        self.shards.append((name, self._n))

    def add(self, tokens) -> None:
        """Append tokens (int array-like, (N,)); ids are checked against vocab_size."""
        tokens = np.asarray(tokens).reshape(-1)
        if tokens.size == 0:
            return
        check_token_range(tokens, self.vocab_size, f"{self.out_dir / self._name(len(self.shards))}")
        self.counts += np.bincount(tokens, minlength=self.vocab_size)
        tokens = tokens.astype(self.dtype, copy=False)
        with self._naming():
            while tokens.size:
                if self._f is None:
                    self._open()
                room = self.shard_tokens - self._n
                if room == 0:
                    if self.prefix.endswith(".bin"):
                        raise ValueError(f"{self.out_dir / self.prefix}: more than {self.shard_tokens} tokens")
                    self._finish()
                    continue
                part, tokens = tokens[:room], tokens[room:]
                self._f.write(part.tobytes())
                self._n += part.size

    def close(self) -> list[tuple[str, int]]:
        """Finish the last shard (an empty stream still writes one empty shard) and return the list."""
        with self._naming():
            if self._f is None and not self.shards:
                self._open()
            if self._f is not None:
                self._finish()
        return self.shards

    def abort(self) -> None:
        """Drop the shard in progress (its temp file); finished shards stay. Safe after a failed write."""
        if self._f is not None:
            f, self._f = self._f, None
            try:
                f.close()  # flushes what is buffered: on a full disk this fails again
            except OSError:
                pass
            self._tmp(self._name(len(self.shards))).unlink(missing_ok=True)

    @contextmanager
    def _naming(self):
        """A failed write()/flush() raises an OSError with no file name: name the shard being written."""
        try:
            yield
        except OSError as e:
            if e.filename is None:
                e.filename = str(self.out_dir / self._name(len(self.shards)))
            raise

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _header_ints(path: Path, what: str, why_missing: str) -> tuple[int, int, int, int]:
    """-> (file size, magic, version, count) of a shard's 256-int header; errors name ``what`` and the file."""
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} not found{why_missing}")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ValueError(f"{what} {path}: truncated header ({size} bytes, expected at least {HEADER_BYTES})")
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    return size, int(header[0]), int(header[1]), int(header[2])


def read_header(path: str | os.PathLike) -> dict:
    """Validate a shard's header and size; return ``{"magic", "version", "num_tokens", "dtype"}``.
    Raises ``FileNotFoundError`` or ``ValueError`` naming the file and what is wrong."""
    path = Path(path)
    size, magic, version, n = _header_ints(path, "shard", "")
    if magic not in FORMATS:
        raise ValueError(
            f"shard {path}: bad magic {magic} (expected one of {sorted(FORMATS)}); not an llm.c token shard"
        )
    want_version, dtype = FORMATS[magic]
    if version != want_version:
        raise ValueError(f"shard {path}: magic {magic} needs version {want_version}, header says {version}")
    if n < 0:
        raise ValueError(f"shard {path}: negative token count {n} in header")
    expected = HEADER_BYTES + n * dtype.itemsize
    if size < expected:
        raise ValueError(f"shard {path}: truncated: header says {n} tokens ({expected} bytes), file has {size}")
    if size > expected:
        raise ValueError(
            f"shard {path}: too long: header says {n} tokens ({expected} bytes), "
            f"file has {size} (trailing {size - expected} bytes)"
        )
    return {"magic": magic, "version": version, "num_tokens": n, "dtype": dtype.name}


def read_shard(path: str | os.PathLike, vocab_size: int | None = None) -> np.ndarray:
    """The tokens of a shard as a read-only ``np.memmap`` (N,) of uint16/uint32 (nothing is read into
    memory until used). Validates magic, version and file size against the header; if ``vocab_size`` is
    given, also that every id is < vocab_size (a chunked scan: this reads the whole shard once)."""
    path = Path(path)
    h = read_header(path)
    dtype, n = np.dtype(h["dtype"]).newbyteorder("<"), h["num_tokens"]
    if n == 0:
        tokens = np.zeros(0, dtype=dtype)  # np.memmap cannot map zero bytes
    else:
        tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(n,))
    if vocab_size is not None:
        check_token_range(tokens, vocab_size, f"shard {path}")
    return tokens


# -- loss-mask shards -------------------------------------------------------------------------------------
# A chat data directory keeps, beside each token shard NAME.bin, a mask shard NAME.mask (not *.bin, so a glob for
# token shards never picks one up): the same 256-int32 header with its own magic, then one uint8 per token, 1 where
# that token is a trained target (an assistant token), 0 elsewhere. The token shard itself is a plain llm.c shard.
MASK_MAGIC, MASK_VERSION = 20250611, 1


def mask_path(shard: str | os.PathLike) -> Path:
    """The mask shard that goes with a token shard: ``train_000000.bin`` -> ``train_000000.mask``."""
    shard = Path(shard)
    return shard.with_suffix(".mask")


def write_mask_shard(path: str | os.PathLike, mask) -> Path:
    """Write a 0/1 mask (N,) as a mask shard; atomic (temp name + rename)."""
    path = Path(path)
    mask = np.asarray(mask)
    if mask.ndim != 1 or (mask.size and not np.isin(mask, (0, 1)).all()):
        raise ValueError(f"write_mask_shard {path}: the mask must be 1-D and hold only 0 and 1")
    if mask.size > MAX_TOKENS_PER_SHARD:
        raise ValueError(f"write_mask_shard {path}: more than {MAX_TOKENS_PER_SHARD} tokens")
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[0], h[1], h[2] = MASK_MAGIC, MASK_VERSION, mask.size
    tmp = path.parent / f".{path.name}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(h.tobytes())
            f.write(mask.astype(np.uint8).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_mask_shard(path: str | os.PathLike, num_tokens: int | None = None) -> np.ndarray:
    """A mask shard as a read-only uint8 memmap (N,); its header and size are checked, and N against
    ``num_tokens`` (its token shard's count) when given. Values are checked to be 0 or 1 (one chunked scan)."""
    path = Path(path)
    size, magic, version, n = _header_ints(path, "mask shard", " (chat data keeps one beside each token shard)")
    if magic != MASK_MAGIC or version != MASK_VERSION:
        raise ValueError(f"mask shard {path}: magic {magic} version {version}, expected {MASK_MAGIC} {MASK_VERSION}")
    if size != HEADER_BYTES + n:
        raise ValueError(f"mask shard {path}: header says {n} entries, the file holds {size - HEADER_BYTES}")
    if num_tokens is not None and n != num_tokens:
        raise ValueError(f"mask shard {path}: {n} entries for a token shard of {num_tokens} tokens")
    if n == 0:
        return np.zeros(0, dtype=np.uint8)
    mask = np.memmap(path, dtype=np.uint8, mode="r", offset=HEADER_BYTES, shape=(n,))
    for start in range(0, n, CHECK_CHUNK):
        if int(mask[start : start + CHECK_CHUNK].max()) > 1:
            raise ValueError(f"mask shard {path}: holds values other than 0 and 1")
    return mask
