"""Serving over the model's one forward: token ids in, token ids out (nothing here knows text or tokenizers).

``Engine`` runs prefill (a prompt [T0] into its cache row -> its last logits) and decode (one token [B] for every
running row, each at its own position) through ``Model.forward`` with the slot cache (``serve/cache.py``) and its
``Cached`` mask: the blocks that train are the blocks that serve. On CUDA a decode step is a graph replay
(``DecodeGraphs``). ``Batcher`` is continuous batching over one slot cache and a bounded waiting list, and the one
generation loop (DESIGN.md, "Serving and sampling"). Each step admits waiting requests into free slots (each is
prefilled alone), decodes every active row at once, samples on the device (``xtrain.sampling.sample_rows``: each
row with its own settings and seeded generator, so its tokens do not depend on its neighbours) and retires the
rows that hit eos or their budget or were cancelled. The server runs the loop on the batcher's thread,
``Engine.generate`` on the caller's. ``submit`` past ``EngineConfig.max_queue`` raises ``QueueFull`` at once. A
``slide`` sequence (``xtrain sample``) may outgrow its row: a full row is refilled from its last max_len // 2 tokens.

Shapes: B batch, T0 prompt length, V vocab, S cache slots.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from xtrain.autograd import no_grad
from xtrain.mask import Cached
from xtrain.sampling import Sampling, greedy_ids, sample_rows
from xtrain.serve.cache import SlotCache


class DecodeGraphs:
    """The decode step as CUDA graphs (DESIGN.md, "Decode graphs"): one per (cache, B, S rounded up to a multiple
    of ``bucket``; keys past a row's position are masked), replayed from static buffers that the host fills with
    the step's tokens, slots and positions. Eager and replayed steps agree bit for bit (a GPU test). All graphs
    share one memory pool: they never run at the same time. A failed capture turns the graphs off, saying so."""

    def __init__(self, engine: Engine, bucket: int = 256, say=None):
        self.engine, self.bucket = engine, bucket
        self.graphs: dict = {}
        self.pool = None
        self.captures = 0
        self.say = say or (lambda msg: print(f"xtrain: {msg}", file=sys.stderr))

    def s_bucket(self, S: int, max_len: int) -> int:
        return min(max_len, -(-S // self.bucket) * self.bucket)

    def run(self, cache: SlotCache, slots: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor, S: int):
        """-> (logits [B, V], greedy ids [B]): the graph's own output buffers, valid until its next replay. The
        step's slots, tokens and positions travel in one copy from a pinned buffer."""
        eng = self.engine
        key = (id(cache), slots.shape[0], S)
        g = self.graphs.get(key)
        if g is None:
            B = slots.shape[0]
            host = torch.empty(3, B, dtype=torch.int64, pin_memory=True)  # slots, tokens, positions
            idx = torch.empty(3, B, dtype=torch.int64, device=eng.device)
            done = torch.cuda.Event()  # the copy out of ``host`` has run: host may be written again
            g = (None, idx, host, None, cache, done)
            self._fill(g, slots, tokens, start)

            def step():
                logits = eng._decode(cache, Cached(idx[0], idx[2], 1, S), idx[1])  # the mask inside the graph
                return logits, greedy_ids(logits)

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: Triton JIT, cuBLAS handles, allocator, off the graph
                step()
            torch.cuda.current_stream().wait_stream(side)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    out = step()
            except Exception as e:  # a failed capture ran nothing: decode without graphs from now on
                eng.graphs = None
                self.say(f"decode CUDA graphs off: capture failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
                return step()
            self.graphs[key] = g = (graph, idx, host, out, cache, done)  # the cache held: its id stays its own
            self.captures += 1
        else:
            self._fill(g, slots, tokens, start)
        g[0].replay()
        return g[3]

    @staticmethod
    def _fill(g, slots, tokens, start) -> None:
        _, idx, host, _, _, done = g
        done.synchronize()  # the last step's copy has left the pinned buffer
        for row, t in zip(host, (slots, tokens, start)):
            row.copy_(t)
        idx.copy_(host, non_blocking=True)
        done.record()


class Engine:
    """Prefill and decode steps over ``model.forward`` with a slot cache, and ``generate`` (the batcher's loop on
    this thread). ``cuda_graph``: decode steps as CUDA graphs (``DecodeGraphs``); default on for a CUDA model."""

    def __init__(self, model, cuda_graph: bool | None = None):
        self.model, self.config, self.device = model, model.config, model.device
        if cuda_graph is None:
            cuda_graph = self.device.type == "cuda"
        if cuda_graph and self.device.type != "cuda":
            raise ValueError(f"Engine: cuda_graph needs a CUDA model, this one is on {self.device}")
        self.graphs = DecodeGraphs(self) if cuda_graph else None
        self._batchers: dict[int, Batcher] = {}  # generate's, by row count: their caches (and graphs) are kept

    def prefill(self, cache: SlotCache, slot: int, ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt ids [T0] into cache row ``slot`` from position 0 -> fp32 logits [V] of its last position
        (on the model's device)."""
        cache.lengths[slot] = 0
        mask = cache.mask(torch.tensor([slot]), ids.shape[0])
        with no_grad():
            logits = self.model.forward(ids.to(self.device)[None], mask=mask, cache=cache, last=True)
        cache.lengths[slot] = ids.shape[0]
        return logits.data[0, 0].float()

    def decode(self, cache: SlotCache, slots: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One step for several rows at once: tokens [B] go to cache rows slots [B] (CPU int64) at each row's own
        position (its length) -> fp32 logits [B, V] on the device; each row's length grows by one. With CUDA
        graphs on, the step is a replay over a bucketed key length."""
        logits, _ = self.step(cache, slots, tokens)
        return logits if self.graphs is None else logits.clone()

    def step(self, cache: SlotCache, slots: torch.Tensor, tokens: torch.Tensor):
        """``decode`` for the batcher -> (logits [B, V], greedy ids [B] or None). With CUDA graphs the two are the
        graph's buffers (valid until the next step; the greedy pick made inside the graph, so a greedy step reads
        back only the ids), else the step's logits and None."""
        if self.graphs is None:
            out = self._decode(cache, cache.mask(slots, 1), tokens.to(self.device)), None
        else:
            start = cache.lengths[slots]  # [B] (CPU)
            S = int(start.max()) + 1  # the longest row after this step
            if S > cache.max_len:
                raise ValueError(f"Engine.decode: rows {slots.tolist()} are full ({cache.max_len} positions)")
            out = self.graphs.run(cache, slots, tokens, start, self.graphs.s_bucket(S, cache.max_len))
        cache.lengths[slots] += 1
        return out

    def _decode(self, cache: SlotCache, mask: Cached, tokens_d: torch.Tensor) -> torch.Tensor:
        """The device work of ``decode`` (what a graph captures): tokens [B] on the device at the mask's rows and
        positions. Nothing here reads a value back to the host."""
        with no_grad():
            logits = self.model.forward(tokens_d[:, None], mask=mask, cache=cache, last=True)
        return logits.data[:, 0].float()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling | list = Sampling(), *,
                 eos_id: int | None = None, slide: bool = False) -> list[list[int]]:  # fmt: skip
        """Continue each prompt (token ids) by up to ``max_new_tokens`` -> each one's new tokens (an ``eos_id``
        ends its row and is not included). The prompts decode together, each with ``sampling`` (one for all, or
        one per prompt) and a generator of its own, so each gets the tokens it gets alone; ``slide``: a row may
        outgrow the context (module docstring). ValueError for a request the batcher refuses or a row that ends
        in an error."""
        if max_new_tokens == 0:
            return [[] for _ in prompts]
        b = self._batchers.get(len(prompts))
        if b is None:
            b = self._batchers[len(prompts)] = Batcher(self, EngineConfig(slots=len(prompts), max_queue=0))
        smp = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        outs = [Collect() for _ in prompts]
        b.submit([(list(p), max_new_tokens, smp[i], eos_id, outs[i]) for i, p in enumerate(prompts)], slide)
        b.run()
        for c in outs:
            if c.finish is None or c.finish.startswith("error"):
                raise ValueError(f"generate: {c.finish}")
        return [c.tokens for c in outs]


@dataclass(frozen=True)
class EngineConfig:
    """How many sequences decode together (KV-cache rows) and how many requests may wait for a row."""

    slots: int = 16
    max_queue: int = 64
    max_len: int | None = None  # positions per cache row (default: the model's max_seq_len)

    def validate(self) -> EngineConfig:
        if self.slots < 1 or self.max_queue < 0 or (self.max_len is not None and self.max_len < 2):
            raise ValueError(f"EngineConfig: need slots >= 1, max_queue >= 0, max_len >= 2, got {self}")
        return self


def _error(e: Exception) -> str:
    return f"error: {type(e).__name__}: {e}"


class QueueFull(RuntimeError):
    """Every slot is busy and the waiting list is at ``EngineConfig.max_queue``."""


class Collect:
    """An ``on_event`` listener that keeps a sequence's tokens and its finish reason (``done`` set at the end)."""

    def __init__(self):
        self.tokens, self.finish, self.done = [], None, threading.Event()

    def __call__(self, tok, lp, fin) -> None:
        if tok is not None:
            self.tokens.append(tok)
        if fin is not None:
            self.finish = fin
            self.done.set()


class Sequence:
    """One request inside the batcher. ``on_event(token, logprobs, finish)`` is called from the loop's
    thread: once per new token (finish None; logprobs None or (token logprob, [(id, logprob), ...])) and
    once at the end with token None and finish "stop" (eos), "length" (budget), "cancelled" or
    "error: <message>". The eos token itself is not reported."""

    def __init__(self, ids: list[int], max_new_tokens: int, sampling: Sampling, eos_id, on_event: Callable, slide):
        self.ids, self.max_new_tokens, self.sampling, self.eos_id = ids, max_new_tokens, sampling, eos_id
        self.on_event, self.slide = on_event, slide
        self.generator = torch.Generator().manual_seed(sampling.seed)
        self.generated = 0
        self.slot: int | None = None
        self.last: int | None = None  # the newest token, reported and not yet in the cache
        self.cancelled = False
        self.done = False

    def cancel(self) -> None:
        """Ask the engine to drop this sequence; its slot is freed before the next decode step."""
        self.cancelled = True


class Batcher:
    """Continuous batching over one ``Engine`` (see the module docstring). ``submit`` is thread-safe; the
    model runs only on the batcher's own thread, started by ``start()`` and stopped by ``close()`` (or on the
    caller's thread in ``run()``, for a batcher that is not started)."""

    def __init__(self, engine: Engine, config: EngineConfig = EngineConfig()):
        self.engine, self.config = engine, config.validate()
        self.max_len = min(config.max_len or engine.config.max_seq_len, engine.config.max_seq_len)
        self.cache = SlotCache(engine.model, config.slots, self.max_len)
        self.free = list(range(config.slots - 1, -1, -1))
        self.active: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.draining = False  # ``drain()``: no new requests, the running ones go on
        self.steps = 0  # decode steps run (a test hook: did requests share steps?)
        self.max_batch = 0  # the largest decode batch so far

    # -- public ------------------------------------------------------------------------------------------
    def check(self, ids: list[int], max_new_tokens: int, slide: bool = False) -> None:
        """ValueError when a request cannot run: empty prompt, ids outside the vocab, no room in a row (for a
        ``slide`` request: for the prompt)."""
        V, n = self.engine.config.vocab_size, max_new_tokens
        if not ids or n < 1:
            raise ValueError(f"Batcher: need a non-empty prompt and max_new_tokens >= 1, got {len(ids)} ids, {n}")
        if min(ids) < 0 or max(ids) >= V:
            raise ValueError(f"Batcher: token ids must lie in [0, {V})")
        if len(ids) + (0 if slide else n) > self.max_len:
            raise ValueError(f"Batcher: prompt {len(ids)} + {n} new tokens exceeds the context of {self.max_len}")

    def submit(self, requests: list[tuple[list[int], int, Sampling, int | None, Callable]], slide: bool = False):
        """Queue (ids, max_new_tokens, sampling, eos_id, on_event) requests, all or none: raises QueueFull
        when they do not all fit the waiting list, ValueError (from ``check``) for a bad one -> the Sequences."""
        for ids, n, smp, *_ in requests:
            self.check(ids, n, slide)
            smp.validate()
        seqs = [Sequence(list(ids), n, smp, eos, cb, slide) for ids, n, smp, eos, cb in requests]
        with self.cond:
            if self.stopping or self.draining:
                raise QueueFull("the engine is shutting down")
            cfg, waiting = self.config, len(self.waiting)
            if len(seqs) > len(self.free) - waiting + cfg.max_queue:
                msg = f"{cfg.slots} running, {waiting} waiting of {cfg.max_queue}"
                raise QueueFull(f"the server is at capacity ({msg}); retry later")
            self.waiting.extend(seqs)
            self.cond.notify()
        return seqs

    def generate(self, ids: list[int], max_new_tokens: int, sampling: Sampling = Sampling(), eos_id=None):
        """Blocking helper for a started batcher: -> (new token ids, finish reason)."""
        c = Collect()
        self.submit([(ids, max_new_tokens, sampling, eos_id, c)])
        c.done.wait()
        return c.tokens, c.finish

    def start(self) -> Batcher:
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="xtrain-batcher", daemon=True)
            self.thread.start()
        return self

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def withdraw(self, seqs: list[Sequence]) -> None:
        """Cancel ``seqs`` (their client went away): those still waiting leave the waiting list now, finished
        "cancelled", so they free their place in the queue at once; running ones free their slot before the next
        step."""
        with self.cond:
            waiting = [s for s in seqs if s in self.waiting]
            for s in waiting:
                self.waiting.remove(s)
        for s in seqs:
            s.cancel()
        for s in waiting:
            self._finish(s, "cancelled")

    def drain(self) -> None:
        """Refuse new requests from now on (``submit`` raises QueueFull) and withdraw every waiting one; the
        running ones go on to their end (a server's graceful shutdown)."""
        with self.cond:
            self.draining = True
            waiting = list(self.waiting)
        self.withdraw(waiting)

    def load(self) -> dict:
        with self.cond:
            return {"running": len(self.active), "waiting": len(self.waiting), "slots": self.config.slots}

    def run(self) -> None:
        """The loop on the caller's thread, until nothing waits or runs (``Engine.generate``)."""
        if self.thread is not None:
            raise RuntimeError("Batcher.run: this batcher's own thread is running it")
        with no_grad():
            while self.waiting or self.active:
                self._step(self._admit())

    # -- the loop ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        with no_grad():  # this thread's grad mode (kept per thread): a trainer beside it still records
            while True:
                with self.cond:
                    while not self.stopping and not self.waiting and not self.active:
                        self.cond.wait()
                    if self.stopping:
                        for s in list(self.waiting) + self.active:
                            self._finish(s, "cancelled")
                        return
                self._step(self._admit())

    def _admit(self) -> list[Sequence]:
        with self.cond:
            newcomers = []
            while self.waiting and self.free:
                s = self.waiting.popleft()
                s.slot = self.free.pop()
                newcomers.append(s)
            return newcomers

    def _step(self, newcomers: list[Sequence]) -> None:
        try:
            self._run_step(newcomers)
        except Exception as e:  # the model failed: fail these requests, keep serving others
            for s in newcomers + self.active:
                self._finish(s, _error(e))
            self._retire()

    def _run_step(self, newcomers: list[Sequence]) -> None:
        """Prefill the newcomers (and the ``slide`` rows that are full, from their last max_len // 2 tokens), then
        one decode step for every other running sequence. A failure that belongs to one sequence (its prefill,
        its decode row, its logits) ends that sequence alone with "error: ..."; the others go on with the tokens
        they would get alone."""
        eng, lengths, n = self.engine, self.cache.lengths, self.max_len
        full = [s for s in self.active if s.slide and s.last is not None and not s.done and lengths[s.slot] == n]
        self.active.extend(newcomers)
        for s in newcomers + full:  # one at a time; each gives its next token
            if s.cancelled:
                continue
            try:
                ids = s.ids if s.last is None else s.ids[-(n // 2) :]
                logits = eng.prefill(self.cache, s.slot, torch.tensor(ids, dtype=torch.long))
            except Exception as e:
                self._finish(s, _error(e))
                continue
            self._emit([s], logits[None])
        self._retire()
        fresh = set(map(id, newcomers + full))
        running = [s for s in self.active if s.last is not None and not s.cancelled and id(s) not in fresh]
        if running:
            logits, ids = self._decode(running)
            self.steps += 1
            self.max_batch = max(self.max_batch, len(running))
            self._emit(running, logits, ids)
            self._retire()

    def _decode(self, running: list[Sequence]):
        """(logits [B, V], greedy ids [B] or None) of one decode step for ``running`` (``Engine.step``). When the
        batched step raises, each row is
        decoded alone (its cache position put back first): a row that fails alone too ends its sequence (its
        row of logits nan), and the others get their own row's logits."""
        eng, lengths = self.engine, self.cache.lengths
        slots = torch.tensor([s.slot for s in running], dtype=torch.long)
        tokens = torch.tensor([s.last for s in running], dtype=torch.long)
        pos = lengths[slots].clone()
        try:
            return eng.step(self.cache, slots, tokens)
        except Exception as e:
            failed = e
        rows = []
        for b, s in enumerate(running):
            lengths[slots[b]] = pos[b]
            try:
                if len(running) == 1:
                    raise failed
                rows.append(eng.decode(self.cache, slots[b : b + 1], tokens[b : b + 1])[0])  # a copy
            except Exception as e:
                lengths[slots[b]] = pos[b]
                self._finish(s, _error(e))
                rows.append(torch.full((eng.config.vocab_size,), float("nan"), device=eng.device))
        return torch.stack(rows), None

    def _emit(self, seqs: list[Sequence], logits: torch.Tensor, greedy: torch.Tensor | None = None) -> None:
        """Sample one token for each live sequence from its row of logits [B, V] (on the device: only the ids
        come back) and report it; ``greedy``: the rows' greedy ids when the step made them (taken when every row
        is greedy). A row with nan or inf logits ends its own sequence with an error; the other rows are sampled
        exactly as they would be alone."""
        live = [b for b, s in enumerate(seqs) if not s.done]
        if not live:
            return
        rows = logits if len(live) == len(seqs) else logits[live]
        try:
            if greedy is not None and len(live) == len(seqs) and all(s.sampling.greedy for s in seqs):
                picked = greedy.tolist()  # what sample_rows gives for greedy rows (greedy_ids), made in the graph
            else:
                smp, gen = [seqs[b].sampling for b in live], [seqs[b].generator for b in live]
                picked = sample_rows(rows, smp, gen).tolist()
        except Exception as e:
            for b in live:
                self._finish(seqs[b], _error(e))
            return
        logp = None
        for b, tok in zip(live, picked):
            s = seqs[b]
            if tok < 0:
                self._finish(s, "error: the model's logits for this sequence hold nan or inf")
                continue
            s.generated += 1
            if s.eos_id is not None and tok == s.eos_id:
                self._finish(s, "stop")
                continue
            lp = None
            if s.sampling.logprobs > 0:
                if logp is None:
                    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
                top = torch.topk(logp[b], min(s.sampling.logprobs, logp.shape[1]))
                lp = (float(logp[b, tok]), list(zip(top.indices.tolist(), top.values.tolist())))
            s.last = tok
            if s.slide:
                s.ids.append(tok)  # the whole text so far: a full row is refilled from its end
            self._call(s, tok, lp, None)
            if s.generated >= s.max_new_tokens:
                self._finish(s, "length")

    def _finish(self, s: Sequence, reason: str) -> None:
        if not s.done:
            s.done = True
            self._call(s, None, None, reason)

    @staticmethod
    def _call(s: Sequence, tok, lp, finish) -> None:
        try:
            s.on_event(tok, lp, finish)
        except Exception:  # a listener that fails (its client went away) drops its own sequence only
            s.cancelled = True

    def _retire(self) -> None:
        """Free the slot of every finished or cancelled sequence."""
        keep = []
        for s in self.active:
            if s.cancelled:
                self._finish(s, "cancelled")
            if s.done:
                with self.cond:
                    self.free.append(s.slot)
            else:
                keep.append(s)
        self.active = keep
