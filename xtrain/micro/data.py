"""Documents for the microGPT: one per line, tokenized one character at a time.

The default corpus is the first names that the ``names`` package (PyPI) ships: its files
``dist.female.first`` and ``dist.male.first`` (Census tables: a name, then three numbers, per line). We take
the first column, lower-case it and drop repeats, female file first, each file in its own order, so the
list (5163 names with names 0.3.0) is the same on every machine. Any text file with one document per line
can be used instead (``load_docs(path)``, ``xtrain micro --data FILE``).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from functools import cached_property

__all__ = ["CharTokenizer", "load_docs", "load_names"]

_NAMES_FILES = ("dist.female.first", "dist.male.first")


def load_names() -> list[str]:
    """First names from the ``names`` package, lower-cased and de-duplicated in a fixed order."""
    spec = importlib.util.find_spec("names")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default microGPT corpus comes from the 'names' package, which is not "
            "installed: run `pip install names`, or pass --data FILE (one document per line)"
        )
    pkg_dir = list(spec.submodule_search_locations)[0]
    docs: list[str] = []
    seen: set[str] = set()
    for fname in _NAMES_FILES:
        path = os.path.join(pkg_dir, fname)
        if not os.path.isfile(path):
            raise RuntimeError(
                f"the 'names' package at {pkg_dir} has no file {fname}: reinstall it "
                "(`pip install --force-reinstall names`) or pass --data FILE"
            )
        with open(path, encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if not fields:
                    continue
                name = fields[0].lower()
                if name not in seen:
                    seen.add(name)
                    docs.append(name)
    return docs


def load_docs(path: str | None = None) -> list[str]:
    """Documents from ``path`` (one per line; surrounding whitespace stripped, blank lines skipped),
    or the ``names`` corpus when path is None."""
    if path is None:
        return load_names()
    try:
        with open(path, encoding="utf-8") as f:
            docs = [line.strip() for line in f]
    except OSError as e:
        raise RuntimeError(f"cannot read documents from {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise RuntimeError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    docs = [d for d in docs if d]
    if not docs:
        raise RuntimeError(f"{path} has no documents (expected one per line)")
    return docs


@dataclass(frozen=True)
class CharTokenizer:
    """Characters -> ids 0..len(chars)-1, plus one BOS id (= len(chars)) that opens and closes each
    document: ``encode("ann") == [BOS, a, n, n, BOS]``."""

    chars: str

    @classmethod
    def from_docs(cls, docs: list[str]) -> CharTokenizer:
        return cls("".join(sorted(set("".join(docs)))))

    @property
    def bos(self) -> int:
        return len(self.chars)

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    @cached_property
    def _index(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.chars)}

    def encode(self, doc: str) -> list[int]:
        try:
            return [self.bos] + [self._index[c] for c in doc] + [self.bos]
        except KeyError as e:
            raise ValueError(f"CharTokenizer.encode: character {e.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids if i != self.bos)
