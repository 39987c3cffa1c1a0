"""TokenLoader: deterministic, resumable, data-parallel batches of token windows from llm.c shards.

Legend: B = batch size per rank, T = sequence length, W = number of windows, R = world size.

Windows. A window is T+1 consecutive tokens of one shard; windows start every T tokens
(0, T, 2T, ... while start + T + 1 <= shard length), so consecutive windows share one token and every
token is a target exactly once per epoch. Windows never cross shard boundaries. A batch is B windows:
``ids[B, T+1]``, with ``inputs = ids[:, :-1]`` and ``targets = ids[:, 1:]``.

Order (training, ``next_batch``). Epoch e visits the W windows in the order
``numpy.random.default_rng([seed, e]).permutation(W)``: a pure function of (seed, epoch). Global batch k
of an epoch is windows ``perm[k*B*R : (k+1)*B*R]`` and rank r takes ``[r::R]`` of it, so ranks never
overlap and together see exactly what one rank with batch B*R would. An epoch ends when fewer than B*R
windows are left (the remainder is dropped for that epoch; the next permutation differs).

State. ``state_dict()`` is ``{"seed", "epoch", "position", ...}`` where position counts windows of the
current epoch already handed out (globally, over all ranks); ``load_state_dict`` continues with exactly
the next batch an uninterrupted loader would give, even if B*R changes between runs.

Evaluation (``val_batches``). Windows in file order (no shuffle), global batches of B*R, rank r takes
``[r::R]``; only full global batches, so every rank yields the same number of batches.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from xtrain.data.shards import read_shard

STATE_VERSION = 1


def resolve_files(pattern_or_files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """A glob pattern, one shard path, or a list of shard paths -> sorted list of existing files."""
    if isinstance(pattern_or_files, (str, os.PathLike)):
        spec = os.fspath(pattern_or_files)
        if glob.has_magic(spec):
            files = sorted(Path(p) for p in glob.glob(spec))
            if not files:
                raise FileNotFoundError(f"no shard files match {spec!r}")
            return files
        files = [Path(spec)]
    else:
        files = [Path(p) for p in pattern_or_files]
        if not files:
            raise ValueError("TokenLoader: empty list of shard files")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"shard {f} not found")
    return files


class TokenLoader:
    """Batches ``[B, T+1]`` of token ids (torch.int64, CPU) from llm.c shards, memory-mapped.

    >>> loader = TokenLoader("data/train_*.bin", batch_size=8, seq_len=256, rank=0, world_size=1, seed=0)
    >>> ids = loader.next_batch()                  # (B, T+1)
    >>> x, y = ids[:, :-1], ids[:, 1:]             # (B, T) inputs, (B, T) targets
    """

    def __init__(
        self,
        pattern_or_files: str | os.PathLike | Sequence[str | os.PathLike],
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        vocab_size: int | None = None,
    ):
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"TokenLoader: batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"TokenLoader: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.files = resolve_files(pattern_or_files)
        self.B, self.T = batch_size, seq_len
        self.rank, self.world_size = rank, world_size
        self.seed = int(seed)
        # every shard validated up front (header, size, and ids < vocab_size when given)
        self.shards = [read_shard(f, vocab_size) for f in self.files]
        self.num_tokens = sum(len(s) for s in self.shards)
        # windows per shard: starts 0, T, 2T, ... with start + T + 1 <= n
        per_shard = np.array([max(0, (len(s) - 1) // seq_len) for s in self.shards], dtype=np.int64)
        self._first_window = np.concatenate([[0], np.cumsum(per_shard)])  # (num_shards+1,)
        self.num_windows = int(self._first_window[-1])
        if self.num_windows == 0:
            raise ValueError(
                f"TokenLoader: shards {[str(f) for f in self.files]} hold {self.num_tokens} tokens, "
                f"no shard has the {seq_len + 1} needed for one window of seq_len {seq_len}"
            )
        self.epoch = 0
        self.position = 0  # windows of this epoch already handed out, over all ranks
        self._perm: np.ndarray | None = None
        self._perm_epoch = -1

    # -- geometry ------------------------------------------------------------------------------------
    @property
    def global_batch(self) -> int:
        return self.B * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_windows // self.global_batch

    def _window(self, g: int) -> np.ndarray:
        """Window g (global index) as int64 (T+1,)."""
        s = int(np.searchsorted(self._first_window, g, side="right")) - 1
        start = (g - int(self._first_window[s])) * self.T
        return self.shards[s][start : start + self.T + 1]

    def _gather(self, windows: np.ndarray) -> torch.Tensor:
        rows = [self._window(int(g)) for g in windows]
        return torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T+1)

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._perm_epoch = epoch
        return self._perm

    # -- training batches ----------------------------------------------------------------------------
    def next_batch(self) -> torch.Tensor:
        """The next training batch, ``torch.int64 [B, T+1]``; advances the state."""
        gb = self.global_batch
        if gb > self.num_windows:
            raise ValueError(
                f"TokenLoader: one global batch needs {gb} windows (B={self.B} x world_size="
                f"{self.world_size}) but the shards hold only {self.num_windows} of T+1={self.T + 1}"
            )
        if self.position + gb > self.num_windows:  # not enough left for a full global batch
            self.epoch += 1
            self.position = 0
        perm = self._permutation(self.epoch)
        windows = perm[self.position : self.position + gb][self.rank :: self.world_size]  # (B,)
        self.position += gb
        return self._gather(windows)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """JSON-able position in the stream (same on every rank)."""
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "seq_len": self.T,
            "num_windows": self.num_windows,
            "num_tokens": self.num_tokens,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (seed, epoch and position are taken from it). Raises ValueError if the
        shards or seq_len differ from the run that saved it (the windows would not be the same)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"TokenLoader state: unknown version {state.get('version')!r}")
        for key, mine in (("seq_len", self.T), ("num_windows", self.num_windows), ("num_tokens", self.num_tokens)):
            if state.get(key) != mine:
                raise ValueError(
                    f"TokenLoader state: {key} was {state.get(key)} when saved, now {mine} "
                    "(different data or seq_len; cannot resume the same stream)"
                )
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), int(state["position"])

    # -- evaluation ----------------------------------------------------------------------------------
    def val_batches(self, max_batches: int | None = None) -> Iterator[torch.Tensor]:
        """Fixed evaluation batches ``torch.int64 [B, T+1]``: windows in file order, this rank's slice of
        each global batch, at most ``max_batches`` (per rank). Does not touch the training state."""
        gb = self.global_batch
        n = self.num_windows // gb
        if n == 0:
            raise ValueError(
                f"TokenLoader: val shards {[str(f) for f in self.files]} hold {self.num_windows} "
                f"windows of T+1={self.T + 1}, fewer than one global batch of {gb}"
            )
        if max_batches is not None:
            n = min(n, max_batches)
        for k in range(n):
            windows = np.arange(k * gb, (k + 1) * gb)[self.rank :: self.world_size]  # (B,)
            yield self._gather(windows)

    def __repr__(self) -> str:
        return (
            f"TokenLoader({len(self.files)} shards, {self.num_tokens:,} tokens, {self.num_windows:,} windows, "
            f"B={self.B}, T={self.T}, rank {self.rank}/{self.world_size}, seed={self.seed})"
        )
