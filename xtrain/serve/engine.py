"""KV-cache inference engine: token ids in, token ids out (it knows nothing of text or tokenizers).

Training re-runs the whole window for every new token; here each layer keeps the keys and values of the
tokens it has seen, so a new token costs one row of work per layer:

    prefill   the prompt [B, T0] goes through every layer at once; K, V [B, Hkv, T0, D] go into the cache
    decode    one token per step: q, k, v of the new position; k, v appended to the cache; the new query
              attends to all cached positions (no mask needed: nothing in the cache lies in its future)

The maths is the model's forward (``xtrain.model``) written for inference with the same kernels
(``K.rms_norm_fwd``, ``K.rope_fwd``, ``K.swiglu_fwd``) and no tape; a test checks that the cached logits
equal the model's full-window logits and that greedy decoding produces the same tokens. Weights are read
from the model's fp32 masters and cast once to the model's compute dtype.

Continuous batching (``Batcher``): one KV cache of ``slots`` rows per layer, [S, Hkv, Tmax, D], and one
thread that loops

    admit     waiting requests take free slots; each is prefilled into its slot alone (B = 1 view)
    decode    one step for every active slot at once: token [B] at per-slot positions pos [B]; the new
              k, v go to cache[slot, :, pos]; query b attends to cache[slot_b, :, :pos_b + 1] (a mask
              hides the rows of longer neighbours: sequences of different lengths share the batch)
    sample    each row with its own settings and its own seeded generator, so a request's tokens do not
              depend on who else is in the batch
    retire    a row that hit eos, its token budget, or was cancelled (client gone, stop string) frees its
              slot before the next step

Requests that arrive during a decode join at the next admit. The waiting list is bounded
(``EngineConfig.max_queue``): ``submit`` past it raises ``QueueFull`` at once, never an unbounded backlog.

Shapes: B batch, T0 prompt length, C width, H / Hkv heads, D head dim, Tmax = prompt + new tokens,
S cache slots.
"""

from __future__ import annotations

import math
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from xtrain.kernels import rms_norm as K_rms
from xtrain.kernels import rope as K_rope
from xtrain.kernels import swiglu as K_swiglu
from xtrain.sampling import GREEDY_BELOW, next_token, nonfinite_rows


class SlotCache:
    """K and V of every layer for ``slots`` sequences: kv[i] = (k, v), each [S, Hkv, Tmax, D], and the
    number of cached positions of each row, lengths [S] (int64, CPU)."""

    def __init__(self, engine: Engine, slots: int, max_len: int):
        cfg = engine.config
        shape = (slots, cfg.n_kv_head, max_len, cfg.head_dim)
        dt, dev = engine.dtype, engine.device
        self.kv = [
            (torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev))
            for _ in range(cfg.n_layer)
        ]
        self.lengths = torch.zeros(slots, dtype=torch.int64)
        self.slots, self.max_len = slots, max_len


class DecodeGraphs:
    """The decode step as CUDA graphs: on a GPU a batch-1 step of a small model is a few hundred small
    launches, and the host issuing them one by one is what limits tokens/s, not the card. A step's work
    depends only on its batch size B and on how many cached positions it reads, so each (cache, B, S
    bucket) is captured once (S rounded up to a multiple of ``bucket``: keys past a row's position are
    masked, as rows of longer neighbours already are) and replayed from static buffers that the host fills
    with the step's tokens, slots and positions (plain host-to-device copies outside the graph). Eager and
    replayed steps run the same kernels on the same values, so they agree bit for bit (a GPU test). All
    graphs share one memory pool: they never run at the same time."""

    def __init__(self, engine: Engine, bucket: int = 256, say=None):
        self.engine, self.bucket = engine, bucket
        self.graphs: dict = {}
        self.pool = None
        self.captures = 0
        self.say = say or (lambda msg: print(f"xtrain: {msg}", file=sys.stderr))

    def s_bucket(self, S: int, max_len: int) -> int:
        return min(max_len, -(-S // self.bucket) * self.bucket)

    def run(self, cache: SlotCache, slots: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor, S: int):
        eng = self.engine
        key = (id(cache), slots.shape[0], S)
        g = self.graphs.get(key)
        if g is None:
            dev = eng.device
            bufs = [t.to(dev) for t in (slots, tokens, pos)]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: Triton JIT, cuBLAS handles, allocator, off the graph
                eng._decode(cache, *bufs, S)
            torch.cuda.current_stream().wait_stream(side)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    out = eng._decode(cache, *bufs, S)
            except Exception as e:  # a failed capture ran nothing: decode without graphs from now on
                eng.graphs = None
                self.say(f"decode CUDA graphs off: capture failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
                return eng._decode(cache, *bufs, S)
            self.graphs[key] = g = (graph, bufs, out, cache)  # the cache held: its id stays its own
            self.captures += 1
        graph, bufs, out, _ = g
        for b, t in zip(bufs, (slots, tokens, pos)):
            b.copy_(t, non_blocking=True)
        graph.replay()
        return out.clone()


class Engine:
    def __init__(self, model, cuda_graph: bool | None = None):
        """``cuda_graph``: decode steps as CUDA graphs (``DecodeGraphs``); default on for a CUDA model."""
        self.model = model
        self.config = cfg = model.config
        dt = model.compute_dtype
        # compute-dtype copies of the weights, cast once (the model casts inside every forward instead)
        self.w = {k: p.data.to(dt) for k, p in model.params.items()}
        # matmul weights stacked where one input feeds several (q/k/v, gate/up) and stored transposed,
        # [in, out] contiguous: x @ Wt is one launch per stack, and for a single row (batch-1 decode) the CPU
        # GEMM runs 2.6x faster on this layout than on W.t() (measured at [1, 256] x [256, 4096])
        T = lambda t: t.t().contiguous()
        L = [f"model.layers.{i}." for i in range(cfg.n_layer)]
        self.qkv_t = [T(torch.cat([self.w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])) for p in L]
        self.o_t = [T(self.w[p + "self_attn.o_proj.weight"]) for p in L]
        self.gate_up_t = [
            T(torch.cat([self.w[p + "mlp.gate_proj.weight"], self.w[p + "mlp.up_proj.weight"]])) for p in L
        ]
        self.down_t = [T(self.w[p + "mlp.down_proj.weight"]) for p in L]
        self.head_t = T(self.w["model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"])
        self.dtype = dt
        self.device = model.device
        if cuda_graph is None:
            cuda_graph = self.device.type == "cuda"
        if cuda_graph and self.device.type != "cuda":
            raise ValueError(f"Engine: cuda_graph needs a CUDA model, this one is on {self.device}")
        self.graphs = DecodeGraphs(self) if cuda_graph else None
        self._gen_cache: SlotCache | None = None  # generate's cache, kept between calls (``_generate_cache``)

    # -- one layer, for a block of new positions --------------------------------------------------------
    def _qkv(self, i: int, x: torch.Tensor, pos: torch.Tensor):
        """x [B, Tn, C] (fp32 residual) at positions pos ([Tn] or [B, Tn]) -> q [B, H, Tn, D],
        k [B, Hkv, Tn, D], v [B, Hkv, Tn, D] (compute dtype, q and k normed and rotated).
        One matmul with the stacked q/k/v weights, one RoPE call over the stacked q and k heads: the same
        element-wise maths as three linears and two RoPE calls, with fewer launches (a decode step is
        launch-bound)."""
        cfg, w, dt = self.config, self.w, self.dtype
        p = f"model.layers.{i}."
        B, Tn, C = x.shape
        H, Hkv, D, eps = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.norm_eps
        master = self.model.params  # the residual-stream norms read the fp32 masters, as the model does
        h = K_rms.rms_norm_fwd(x, master[p + "input_layernorm.weight"].data, eps)[0].to(dt)  # [B, Tn, C]
        qkv = (h @ self.qkv_t[i]).reshape(B, Tn, H + 2 * Hkv, D)  # [B, Tn, H + 2Hkv, D]
        q = K_rms.rms_norm_fwd(qkv[:, :, :H], w[p + "self_attn.q_norm.weight"], eps)[0]  # [B, Tn, H, D]
        k = K_rms.rms_norm_fwd(qkv[:, :, H : H + Hkv], w[p + "self_attn.k_norm.weight"], eps)[0]
        qk = K_rope.rope_fwd(torch.cat([q, k], dim=2).transpose(1, 2), pos, cfg.rope_theta)  # [B, H+Hkv, Tn, D]
        return qk[:, :H], qk[:, H:], qkv[:, :, H + Hkv :].transpose(1, 2)

    def _out_and_mlp(self, i: int, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Attention output a [B, H, Tn, D] -> o_proj, residual add, then the MLP half of the block."""
        cfg, dt = self.config, self.dtype
        p = f"model.layers.{i}."
        B, H, Tn, D = a.shape
        a = a.transpose(1, 2).reshape(B, Tn, H * D) @ self.o_t[i]
        x = x + a.to(x.dtype)
        master = self.model.params
        h = K_rms.rms_norm_fwd(x, master[p + "post_attention_layernorm.weight"].data, cfg.norm_eps)[0].to(dt)
        g, u = (h @ self.gate_up_t[i]).chunk(2, dim=-1)  # [B, Tn, F] each
        return x + (K_swiglu.swiglu_fwd(g, u) @ self.down_t[i]).to(x.dtype)

    def _layer(
        self, i: int, x: torch.Tensor, pos: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], t0: int
    ) -> torch.Tensor:
        """x [B, Tn, C] (fp32 residual) at positions t0 .. t0+Tn-1; writes K/V into cache[:, :, t0:t0+Tn]."""
        B, Tn, C = x.shape
        H, Hkv, D = self.config.n_head, self.config.n_kv_head, self.config.head_dim
        q, k, v = self._qkv(i, x, pos)
        ck, cv = cache
        ck[:, :, t0 : t0 + Tn] = k
        cv[:, :, t0 : t0 + Tn] = v
        keys, vals = ck[:, :, : t0 + Tn], cv[:, :, : t0 + Tn]  # [B, Hkv, S, D], S = t0 + Tn
        G = H // Hkv
        qg = q.reshape(B, Hkv, G * Tn, D)  # the G query heads of one K/V head, stacked (as math_attention)
        s = (qg @ keys.transpose(-1, -2)).float() * (1.0 / math.sqrt(D))  # [B, Hkv, G*Tn, S]
        if Tn > 1:  # prefill: new position t0+j sees cached positions <= t0+j
            S = t0 + Tn
            future = torch.ones(Tn, S, dtype=torch.bool, device=x.device).triu(t0 + 1)
            s.view(B, Hkv, G, Tn, S).masked_fill_(future, float("-inf"))
        a = (torch.softmax(s, dim=-1).to(self.dtype) @ vals).reshape(B, H, Tn, D)  # [B, H, Tn, D]
        return self._out_and_mlp(i, x, a)

    def _head(self, x_last: torch.Tensor) -> torch.Tensor:
        """Final norm and head of x [B, 1, C] -> fp32 logits [B, V]."""
        h = K_rms.rms_norm_fwd(x_last, self.model.params["model.norm.weight"].data, self.config.norm_eps)[0]
        return (h.to(self.dtype) @ self.head_t)[:, 0].float()  # [B, V]

    def _forward(self, ids: torch.Tensor, caches, t0: int) -> torch.Tensor:
        """ids [B, Tn] at positions t0.. -> logits of the last position [B, V] (fp32)."""
        cfg = self.config
        x = self.model.params["model.embed_tokens.weight"].data[ids]  # [B, Tn, C] in the master dtype
        pos = torch.arange(t0, t0 + ids.shape[1], device=ids.device)
        for i in range(cfg.n_layer):
            x = self._layer(i, x, pos, caches[i], t0)
        return self._head(x[:, -1:])

    # -- slots: one cache row per sequence, sequences of different lengths in one batch -----------------
    def prefill(self, cache: SlotCache, slot: int, ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt ids [T0] into cache row ``slot`` (positions 0..T0-1) -> logits [V] of its last
        position. The row is used as a B = 1 cache, so prefill is exactly ``generate``'s."""
        views = [(k[slot : slot + 1], v[slot : slot + 1]) for k, v in cache.kv]
        logits = self._forward(ids.to(self.device)[None], views, 0)[0]
        cache.lengths[slot] = ids.shape[0]
        return logits

    def decode(self, cache: SlotCache, slots: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One step for several sequences at once: tokens [B] go to cache rows slots [B] (CPU int64) at each
        row's own position pos_b = cache.lengths[slot_b] -> logits [B, V]; each row's length grows by one.
        With CUDA graphs on, the step is a replay (``DecodeGraphs``) over a bucketed key length."""
        pos = cache.lengths[slots]  # [B] (CPU int64)
        S = int(pos.max()) + 1  # the longest row after this step
        if self.graphs is not None:
            logits = self.graphs.run(cache, slots, tokens, pos, self.graphs.s_bucket(S, cache.max_len))
        else:
            dev = self.device
            logits = self._decode(cache, slots.to(dev), tokens.to(dev), pos.to(dev), S)
        cache.lengths[slots] = pos + 1
        return logits

    def _decode(self, cache: SlotCache, slots_d, tokens_d, pos_d, S: int) -> torch.Tensor:
        """The device work of ``decode``: slots, tokens, positions [B] on the device; keys 0..S-1 are read,
        those past a row's position hidden. Nothing here reads a value back to the host (a graph captures
        it)."""
        cfg = self.config
        B = slots_d.shape[0]
        H, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        G = H // Hkv
        # key j of row b is visible when j <= pos_b; the rows past it belong to a longer neighbour or are stale
        hidden = torch.arange(S, device=self.device)[None, :] > pos_d[:, None]  # [B, S]
        hidden = hidden[:, None, None, :]  # [B, 1, 1, S] over [B, Hkv, G, S]
        x = self.model.params["model.embed_tokens.weight"].data[tokens_d][:, None]  # [B, 1, C]
        for i in range(cfg.n_layer):
            q, k, v = self._qkv(i, x, pos_d[:, None])  # q [B, H, 1, D], k, v [B, Hkv, 1, D]
            ck, cv = cache.kv[i]
            ck[slots_d, :, pos_d] = k[:, :, 0]  # advanced indices first: the target is [B, Hkv, D]
            cv[slots_d, :, pos_d] = v[:, :, 0]
            keys, vals = ck[slots_d, :, :S], cv[slots_d, :, :S]  # [B, Hkv, S, D] (gathered rows)
            s = (q.reshape(B, Hkv, G, D) @ keys.transpose(-1, -2)).float() * (1.0 / math.sqrt(D))  # [B, Hkv, G, S]
            s.masked_fill_(hidden, float("-inf"))
            a = (torch.softmax(s, dim=-1).to(self.dtype) @ vals).reshape(B, H, 1, D)
            x = self._out_and_mlp(i, x, a)
        return self._head(x)

    def generate(
        self,
        ids: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        eos_id: int | None = None,
        stream=None,
    ) -> torch.Tensor:
        """Continue ids [B, T0] by up to max_new_tokens (all rows stop when every row has emitted eos_id).
        ``stream(step, tokens [B])`` is called with each new column, e.g. to send tokens as they come."""
        cfg = self.config
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"Engine.generate: ids must be an integer tensor [B, T], got "
                f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}"
            )
        B, T0 = ids.shape
        if T0 == 0 or max_new_tokens < 0:
            raise ValueError(
                f"Engine.generate: need a non-empty prompt and max_new_tokens >= 0, got T0={T0}, "
                f"max_new_tokens={max_new_tokens}"
            )
        if T0 + max_new_tokens > cfg.max_seq_len:
            raise ValueError(
                f"Engine.generate: prompt {T0} + {max_new_tokens} new tokens exceeds the model's "
                f"max_seq_len {cfg.max_seq_len}"
            )
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
            raise ValueError(f"Engine.generate: token ids must lie in [0, {cfg.vocab_size})")
        ids = ids.to(self.device)
        g = torch.Generator().manual_seed(int(seed))
        # one cache row per sequence, as the batcher's: prefill all rows at once, then ``decode`` steps
        # (CUDA graphs where on)
        cache = self._generate_cache(B, T0 + max_new_tokens)
        rows = torch.arange(B)
        out = [ids.cpu()]
        logits = self._forward(ids, cache.kv, 0)  # prefill
        cache.lengths[:] = T0
        for step in range(max_new_tokens):
            nxt = next_token(logits.cpu(), temperature, top_k, top_p, g)  # [B] (CPU)
            out.append(nxt[:, None])
            if stream is not None:
                stream(step, nxt)
            if eos_id is not None and bool((nxt == eos_id).all()):
                break
            if step + 1 < max_new_tokens:
                logits = self.decode(cache, rows, nxt)  # decode one position
        return torch.cat(out, dim=1).to(self.device)

    def _generate_cache(self, B: int, need: int) -> SlotCache:
        """A slot cache for ``generate``, kept between calls of the same batch size (its decode graphs with
        it), grown to the model's context when a call needs more than it holds."""
        c = self._gen_cache
        if c is None or c.slots != B or c.max_len < need:
            if c is not None and self.graphs is not None:  # graphs of the old cache go with it
                self.graphs.graphs = {k: v for k, v in self.graphs.graphs.items() if v[3] is not c}
            max_len = need if self.graphs is None else max(need, min(self.config.max_seq_len, 256))
            c = self._gen_cache = SlotCache(self, B, max_len)
        return c


# ---------------------------------------------------------------------------------------- continuous batching
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


@dataclass(frozen=True)
class Sampling:
    """One sequence's sampling settings: temperature 0 (or below ``xtrain.sampling.GREEDY_BELOW``) is
    greedy; top_k / top_p as in ``xtrain.sampling``; ``logprobs`` > 0 also reports that many top
    log-probabilities at each step (of the unfiltered, temperature-1 distribution, as OpenAI's ``logprobs``).
    Degenerate but finite values are safe: a tiny temperature samples greedily, a top_p that rounds to 0 keeps
    the most likely token, a top_k past the vocabulary keeps all; ``validate`` refuses the rest."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    logprobs: int = 0

    def validate(self) -> Sampling:
        ok = (
            isinstance(self.temperature, (int, float))
            and math.isfinite(self.temperature)
            and self.temperature >= 0
            and (self.top_k is None or (isinstance(self.top_k, int) and self.top_k >= 0))
            and (self.top_p is None or (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1))
            and isinstance(self.seed, int)
            and 0 <= self.logprobs
        )
        if not ok:
            raise ValueError(f"Sampling: need a finite temperature >= 0, top_k >= 0, 0 < top_p <= 1, got {self}")
        return self


def sample_rows(logits: torch.Tensor, settings: list[Sampling], generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of fp32 CPU logits [B, V], row b with its own settings and generator -> ids [B].

    Greedy rows (temperature below ``GREEDY_BELOW``) take the argmax. The others, all at once: logits /
    temperature, sorted once; the same filters as ``xtrain.sampling.filter_logits`` (keep the top_k ranks,
    then drop a token when the tokens ranked above it already hold top_p of the mass, never the first);
    then one uniform u from the row's generator picks the token where the kept mass's running sum first
    exceeds u * (kept mass). One draw per row, so a row's tokens depend on its own seed only, never on its
    neighbours in the batch."""
    B, V = logits.shape
    out = logits.argmax(dim=-1)  # [B]
    rows = [b for b, s in enumerate(settings) if s.temperature >= GREEDY_BELOW]
    if not rows:
        return out
    idx = torch.tensor(rows)
    temp = torch.tensor([settings[b].temperature for b in rows], dtype=torch.float32)[:, None]
    k = torch.tensor([settings[b].top_k or V for b in rows])[:, None]  # [R, 1]
    p = torch.tensor([settings[b].top_p or 1.0 for b in rows], dtype=torch.float32)[:, None]
    sorted_logits, order = torch.sort(logits[idx].float() / temp, dim=-1, descending=True)  # [R, V]
    rank = torch.arange(V)[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= p
    drop[:, 0] = False  # the first token is never dropped (a top_p that rounds to 0 in fp32 would drop all)
    probs = probs.masked_fill(drop, 0.0)
    cdf = probs.cumsum(dim=-1)  # [R, V]
    u = torch.stack([torch.rand((), generator=generators[b], dtype=torch.float64) for b in rows]).float()
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=V - 1)  # [R, 1]
    pick = torch.minimum(pick, (probs > 0).sum(dim=-1, keepdim=True) - 1)  # never past the kept tokens
    out[idx] = order.gather(1, pick)[:, 0]
    return out


def _error(e: Exception) -> str:
    return f"error: {type(e).__name__}: {e}"


class QueueFull(RuntimeError):
    """Every slot is busy and the waiting list is at ``EngineConfig.max_queue``."""


class Sequence:
    """One request inside the batcher. ``on_event(token, logprobs, finish)`` is called from the engine's
    thread: once per new token (finish None; logprobs None or (token logprob, [(id, logprob), ...])) and
    once at the end with token None and finish "stop" (eos), "length" (budget), "cancelled" or
    "error: <message>". The eos token itself is not reported."""

    def __init__(self, ids: list[int], max_new_tokens: int, sampling: Sampling, eos_id, on_event: Callable):
        self.ids, self.max_new_tokens, self.sampling, self.eos_id = ids, max_new_tokens, sampling, eos_id
        self.on_event = on_event
        self.generator = torch.Generator().manual_seed(sampling.seed)
        self.generated = 0
        self.slot: int | None = None
        self.last: int | None = None
        self.cancelled = False
        self.done = False

    def cancel(self) -> None:
        """Ask the engine to drop this sequence; its slot is freed before the next decode step."""
        self.cancelled = True


class Batcher:
    """Continuous batching over one ``Engine`` (see the module docstring). ``submit`` is thread-safe; the
    model runs only on the batcher's own thread, started by ``start()`` and stopped by ``close()``."""

    def __init__(self, engine: Engine, config: EngineConfig = EngineConfig()):
        self.engine, self.config = engine, config.validate()
        self.max_len = min(config.max_len or engine.config.max_seq_len, engine.config.max_seq_len)
        self.cache = SlotCache(engine, config.slots, self.max_len)
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
    def check(self, ids: list[int], max_new_tokens: int) -> None:
        """ValueError when a request cannot run: empty prompt, ids outside the vocab, no room in a row."""
        V = self.engine.config.vocab_size
        if not ids or max_new_tokens < 1:
            raise ValueError(
                f"Batcher: need a non-empty prompt and max_new_tokens >= 1, got {len(ids)} ids, {max_new_tokens}"
            )
        if min(ids) < 0 or max(ids) >= V:
            raise ValueError(f"Batcher: token ids must lie in [0, {V})")
        if len(ids) + max_new_tokens > self.max_len:
            raise ValueError(
                f"Batcher: prompt {len(ids)} + {max_new_tokens} new tokens exceeds the context of {self.max_len}"
            )

    def submit(self, requests: list[tuple[list[int], int, Sampling, int | None, Callable]]) -> list[Sequence]:
        """Queue (ids, max_new_tokens, sampling, eos_id, on_event) requests, all or none: raises QueueFull
        when they do not all fit the waiting list, ValueError (from ``check``) for a bad one."""
        for ids, n, smp, *_ in requests:
            self.check(ids, n)
            smp.validate()
        seqs = [Sequence(list(ids), n, smp, eos, cb) for ids, n, smp, eos, cb in requests]
        with self.cond:
            if self.stopping or self.draining:
                raise QueueFull("the engine is shutting down")
            room = len(self.free) - len(self.waiting) + self.config.max_queue
            if len(seqs) > room:
                raise QueueFull(
                    f"the server is at capacity ({self.config.slots} running, {len(self.waiting)} waiting of "
                    f"{self.config.max_queue}); retry later"
                )
            self.waiting.extend(seqs)
            self.cond.notify()
        return seqs

    def generate(self, ids: list[int], max_new_tokens: int, sampling: Sampling = Sampling(), eos_id=None):
        """Blocking helper: -> (new token ids, finish reason)."""
        out, done = [], threading.Event()
        finish = []

        def on_event(tok, lp, fin):
            if tok is not None:
                out.append(tok)
            if fin is not None:
                finish.append(fin)
                done.set()

        self.submit([(ids, max_new_tokens, sampling, eos_id, on_event)])
        done.wait()
        return out, finish[0]

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

    # -- the loop ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        from xtrain.autograd import no_grad

        with no_grad():  # this thread's grad mode (kept per thread): a trainer beside it still records
            while True:
                with self.cond:
                    while not self.stopping and not self.waiting and not self.active:
                        self.cond.wait()
                    if self.stopping:
                        for s in list(self.waiting) + self.active:
                            self._finish(s, "cancelled")
                        return
                    newcomers = []
                    while self.waiting and self.free:
                        s = self.waiting.popleft()
                        s.slot = self.free.pop()
                        newcomers.append(s)
                try:
                    self._step(newcomers)
                except Exception as e:  # the model failed: fail these requests, keep serving others
                    for s in newcomers + self.active:
                        self._finish(s, f"error: {type(e).__name__}: {e}")
                    self._retire()

    def _step(self, newcomers: list[Sequence]) -> None:
        """Prefill the newcomers, then one decode step for every running sequence. A failure that belongs to
        one sequence (its prefill, its decode row, its logits, its sampling) ends that sequence alone with
        "error: ..."; the others go on with the tokens they would get alone."""
        eng = self.engine
        for s in newcomers:  # prefill one at a time; each gives its first token
            self.active.append(s)
            if s.cancelled:
                continue
            try:
                logits = eng.prefill(self.cache, s.slot, torch.tensor(s.ids, dtype=torch.long))
            except Exception as e:
                self._finish(s, _error(e))
                continue
            self._emit([s], logits[None].cpu())
        self._retire()
        running = [s for s in self.active if s.last is not None and not s.cancelled and s not in newcomers]
        if running:
            logits = self._decode(running)
            self.steps += 1
            self.max_batch = max(self.max_batch, len(running))
            self._emit(running, logits)
            self._retire()

    def _decode(self, running: list[Sequence]) -> torch.Tensor:
        """Logits [B, V] of one decode step for ``running``. When the batched step raises, each row is
        decoded alone (the cache positions put back first): a row that fails alone too gets nan logits,
        which ``_emit`` turns into that sequence's error, and the others get their own row's logits."""
        eng = self.engine
        slots = torch.tensor([s.slot for s in running], dtype=torch.long)
        tokens = torch.tensor([s.last for s in running], dtype=torch.long)
        pos = self.cache.lengths[slots].clone()
        try:
            return eng.decode(self.cache, slots, tokens).cpu()  # [B, V]
        except Exception as e:
            if len(running) == 1:
                self.cache.lengths[slots] = pos
                return self._failed_rows(running, [e])
            errors, rows = [], []
            for b in range(len(running)):
                self.cache.lengths[slots[b : b + 1]] = pos[b : b + 1]
                try:
                    rows.append(eng.decode(self.cache, slots[b : b + 1], tokens[b : b + 1]).cpu()[0])
                    errors.append(None)
                except Exception as e_b:
                    self.cache.lengths[slots[b : b + 1]] = pos[b : b + 1]
                    rows.append(None)
                    errors.append(e_b)
            V = next((r.shape[0] for r in rows if r is not None), eng.config.vocab_size)
            out = torch.stack([torch.full((V,), float("nan")) if r is None else r for r in rows])
            for s, err in zip(running, errors):
                if err is not None:
                    self._finish(s, _error(err))
            return out

    def _failed_rows(self, seqs: list[Sequence], errors: list[Exception]) -> torch.Tensor:
        for s, e in zip(seqs, errors):
            self._finish(s, _error(e))
        return torch.full((len(seqs), self.engine.config.vocab_size), float("nan"))

    def _emit(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample one token for each sequence from its row of logits [B, V] and report it. A row with nan or
        inf logits, or whose sampling raises, ends its own sequence with an error; the other rows are sampled
        exactly as they would be alone (every step of ``sample_rows`` works row by row)."""
        bad = nonfinite_rows(logits).tolist()
        for s, b in zip(seqs, bad):
            if b:
                self._finish(s, "error: the model's logits for this sequence hold nan or inf")
        live = [b for b, s in enumerate(seqs) if not bad[b] and not s.done]
        if not live:
            return
        rows = logits if len(live) == len(seqs) else logits[live]
        try:
            picked = sample_rows(rows, [seqs[b].sampling for b in live], [seqs[b].generator for b in live]).tolist()
        except Exception:  # find the row at fault: each row sampled alone draws what it draws in the batch
            picked = []
            for j, b in enumerate(live):
                try:
                    picked.append(int(sample_rows(rows[j : j + 1], [seqs[b].sampling], [seqs[b].generator])[0]))
                except Exception as e:
                    self._finish(seqs[b], _error(e))
                    picked.append(None)
        logp = None
        for b, tok in zip(live, picked):
            s = seqs[b]
            if tok is None:
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
