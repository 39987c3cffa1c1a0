"""A decoder-only transformer in the Qwen3 layout, written only with ``xtrain.ops``.

Legend: B batch, T time, C width (n_embd), H query heads, Hkv key/value heads, D head dim, F ffn width,
V vocab, L layers.

    x = embed_tokens[ids]                                              [B, T, C]
    L times:
        h = rms_norm(x)                                                 input_layernorm
        q, k, v = h Wqᵀ, h Wkᵀ, h Wvᵀ (no bias)                         [B, T, H*D], [B, T, Hkv*D] x2
        q, k = rms_norm over D per head (q_norm, k_norm), then RoPE     [B, H, T, D], [B, Hkv, T, D]
        a = causal attention (query head h reads kv head h // (H/Hkv))  [B, H, T, D]
        x = x + dropout(a Woᵀ)                                          o_proj
        x = x + dropout(down(silu(gate(h')) * up(h'))), h' = rms_norm(x)   post_attention_layernorm, mlp
    logits = rms_norm(x) W_headᵀ                                        norm, lm_head (or tied embedding)

Parameters are fp32 leaf ``Var``s (fp64 when compute_dtype is "float64", for exact tests) in an ordered
dict keyed by the Hugging Face Qwen3 names, so export is a checked one-to-one map. With tied embeddings
there is no ``lm_head.weight``: the head reads ``model.embed_tokens.weight``.

Initialisation (``init_weights``; deterministic from ``seed``, drawn on the CPU in the key order below, so
the same seed gives the same weights on every device):
  * embed_tokens, q/k/v_proj, gate/up_proj, lm_head:   N(0, init_std²)           (init_std = 0.02)
  * o_proj, down_proj (the two writes into the residual stream): N(0, (init_std / sqrt(2L))²), the GPT-2
    scaling that keeps the residual stream's variance independent of depth at init
  * every RMSNorm weight (input/post_attention_layernorm, q_norm, k_norm, norm): ones.

Precision (DESIGN.md, "Compute copies"): each weight matrix enters its matmul in the compute dtype (``linear``'s
``w_compute``): the bf16 copy AdamW writes in its update pass (``weight_copy``), else a cast inside the block (so
activation recompute re-casts); its gradient lands in fp32 on the master, the cast folded into the weight-gradient
matmul. Norm weights are read as their masters; the LM head goes through ``ops.cast_as``. The residual stream ``x``
stays in the master dtype (as under torch autocast), so norm statistics, residual adds, softmax and the loss are
fp32; each RMSNorm of the stream writes its output in the compute dtype (``rms_norm(..., dtype)``) and each residual
add promotes its branch inside the add (``add_cast``), bit for bit the separate casts. In fp32 every cast is the
identity and records nothing.

Dropout (DESIGN.md, "Conventions", randomness; residual path only, at the attention and MLP outputs, never on
attention probabilities): the mask of a site is a pure function of ``site_seed(step_seed, layer, site)`` and of the
element's place in the step's global batch (``forward``'s ``dropout_rows = (row_start, row_stride)``: row b of the
input is global row ``row_start + b * row_stride``). The site seeds live on the device in one int64 buffer
(``dropout_seeds``, an entry per (layer, site), allocated once so its address never changes) that
``set_dropout_step(step_seed)`` rewrites with one host-to-device copy: a captured CUDA graph of the step draws the
masks of whatever step the buffer holds when it replays. The buffer must not be rewritten between a forward and its
backward (the dropout op checks). ``model.eval()`` (and p == 0) builds no dropout node at all.

Masks (``xtrain.mask``; DESIGN.md, "Masks are values"), built once per batch and handed to every block:
``forward(ids, mask=...)`` takes None (plain causal), ``Documents.of(ids, eot_id)`` (packed documents, each computed
as if it ran alone from its eot) or ``Cached`` (new tokens over a KV cache). The mask gives the attention form and
the RoPE positions, whose cos/sin rows it takes from ``rope_table`` (every position's, computed once here).

Training, prefill and decode are this one forward (DESIGN.md, "One model"). With ``cache`` (such as
``serve.cache.SlotCache``) and its ``Cached`` mask, each block writes its new keys and values into the cache and
attends over the cache rows: inference only (under ``no_grad``; never drops out), each projection an
``ops.rows_linear`` over the stacked decode weights (``_decode_weights``) with the norm before it and the residual
add after it inside. Without a cache the forward is the training forward, every op as the tape records it.

Activation recompute (``config.recompute``): each block runs under ``xtrain.autograd.checkpoint``: only
its input is kept; its forward is re-run during backward (less one product: DESIGN.md, "Recompute"). Loss and
gradients are bit-identical to the plain path.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from xtrain import ops
from xtrain.autograd import Var, checkpoint, is_grad_enabled, no_grad, replaying
from xtrain.config import ModelConfig
from xtrain.mask import CAUSAL, Mask, doc_starts
from xtrain.ops.fused import stacked

__all__ = ["BLOCK_KEYS", "BLOCK_SHAPES", "Model", "doc_starts", "mix_seed", "param_shapes", "site_seed"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
_MASK64 = (1 << 64) - 1

SITE_ATTN = 0xA77  # dropout site constants, mixed into the per-site seed
SITE_MLP = 0xF77
SITES = (SITE_ATTN, SITE_MLP)  # entry (layer, k) of the seed buffer is the seed of site SITES[k]

# per-layer parameters after "model.layers.{i}.", in init order -> shape in the legend's letters ([out, in] for
# linear weights); ``param_shapes`` gives the sizes of a config
BLOCK_SHAPES = {
    "input_layernorm.weight": ("C",),
    "self_attn.q_proj.weight": ("H*D", "C"),
    "self_attn.k_proj.weight": ("Hkv*D", "C"),
    "self_attn.v_proj.weight": ("Hkv*D", "C"),
    "self_attn.q_norm.weight": ("D",),
    "self_attn.k_norm.weight": ("D",),
    "self_attn.o_proj.weight": ("C", "H*D"),
    "post_attention_layernorm.weight": ("C",),
    "mlp.gate_proj.weight": ("F", "C"),
    "mlp.up_proj.weight": ("F", "C"),
    "mlp.down_proj.weight": ("C", "F"),
}
BLOCK_KEYS = tuple(BLOCK_SHAPES)


def splitmix64(x: int) -> int:
    """The splitmix64 finalizer on a Python int (a bijection of 64-bit integers with good avalanche)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*parts: int) -> int:
    """Hash a tuple of integers to one 64-bit seed (order matters)."""
    h = 0
    for p in parts:
        h = splitmix64(h ^ (int(p) & _MASK64))
    return h


def site_seed(step_seed: int, layer: int, site: int) -> int:
    """The dropout seed of one site: a pure function of the step's seed, the layer index and the site."""
    return mix_seed(step_seed, layer, site)


def param_shapes(cfg: ModelConfig) -> OrderedDict[str, tuple[int, ...]]:
    """Every parameter's Hugging Face Qwen3 name and shape ([out, in] for linear weights), in init order."""
    C, D, V = cfg.n_embd, cfg.head_dim, cfg.vocab_size
    size = {"C": C, "D": D, "F": cfg.ffn_dim, "H*D": cfg.n_head * D, "Hkv*D": cfg.n_kv_head * D}
    shapes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
    shapes["model.embed_tokens.weight"] = (V, C)
    for i in range(cfg.n_layer):
        for k, dims in BLOCK_SHAPES.items():
            shapes[f"model.layers.{i}.{k}"] = tuple(size[d] for d in dims)
    shapes["model.norm.weight"] = (C,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, C)
    return shapes


class Model:
    """The Qwen3-style decoder. ``Model(config, device, seed)``; parameters in ``model.params``."""

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu", seed: int = 0):
        self.config = config.validate()
        self.device = torch.device(device)
        self.compute_dtype = _DTYPES[config.compute_dtype]
        self.master_dtype = torch.float64 if self.compute_dtype == torch.float64 else torch.float32
        self.training = True
        # the per-site dropout seeds [L, len(SITES)] on the device: one buffer, rewritten in place each step
        self.dropout_seeds = torch.zeros((config.n_layer, len(SITES)), dtype=torch.int64, device=self.device)
        # optional hook p -> compute-dtype copy of p.data or None (the trainer sets AdamW.copy_for)
        self.weight_copy = None
        # RoPE cos/sin of every position in the master dtype, computed once (a forward takes its rows: ``Mask.rope``)
        positions = torch.arange(config.max_seq_len, device=self.device)
        self.rope_table = ops.rope_table(positions, config.head_dim, config.rope_theta, self.master_dtype)
        self._attention = config.attention  # "auto": the op picks its form from the device (no device branch here)
        # the LM head + loss op (x [N, C], w [V, C], targets [N]); "auto": the op picks the fused form by device
        self._fused_loss = {"composed": None, "fused": ops.linear_cross_entropy, "auto": ops.lm_head_loss}[config.loss]
        self.params: OrderedDict[str, Var] = OrderedDict(
            (name, Var(torch.empty(shape, dtype=self.master_dtype, device=self.device), requires_grad=True, name=name))
            for name, shape in param_shapes(config).items()
        )
        self._layers = [{k: self.params[f"model.layers.{i}.{k}"] for k in BLOCK_KEYS} for i in range(config.n_layer)]
        # what the decode weights hold: the matmul weights and q_norm/k_norm
        self._decode_params = [p for n, p in self.params.items() if p.ndim == 2 or n.endswith(("q_norm.weight",
                               "k_norm.weight"))]  # fmt: skip
        self.init_weights(seed)
        self.set_dropout_step(0)

    # -- parameters -----------------------------------------------------------------------------------
    def init_weights(self, seed: int) -> None:
        """The documented initialisation (module docstring), drawn on the CPU in key order."""
        cfg = self.config
        g = torch.Generator(device="cpu").manual_seed(int(seed))
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        with no_grad():
            for name, p in self.params.items():
                if name.endswith("norm.weight"):
                    t = torch.ones(p.shape, dtype=self.master_dtype)
                else:
                    std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else cfg.init_std
                    t = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=g)
                p.data.copy_(t.to(self.master_dtype))

    def named_parameters(self):
        return self.params.items()

    def parameters(self) -> list[Var]:
        return list(self.params.values())

    def num_params(self) -> int:
        return sum(p.numel() for p in self.params.values())

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def state_dict(self) -> OrderedDict[str, torch.Tensor]:
        """Name -> the master tensor itself (not a copy)."""
        return OrderedDict((k, v.data) for k, v in self.params.items())

    def load_state_dict(self, sd: dict[str, torch.Tensor], source: str = "state dict") -> None:
        """Copy tensors into the parameters in place. Everything is checked first (key set, shapes,
        finite floating values); on any problem nothing is written and a ValueError names ``source``."""
        want = param_shapes(self.config)
        missing = [k for k in want if k not in sd]
        extra = [k for k in sd if k not in want]
        if missing or extra:
            few = lambda keys: f"{keys[:5]}{'...' if len(keys) > 5 else ''}"  # noqa: E731
            msg = f"parameter names do not match the model config (missing {few(missing)}, unexpected {few(extra)})"
            raise ValueError(f"{source}: {msg}")
        for k, shape in want.items():
            t = sd[k]
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(f"{source}: {k} is not a floating-point tensor")
            if tuple(t.shape) != shape:
                raise ValueError(f"{source}: {k} has shape {tuple(t.shape)}, the model expects {shape}")
        for k in want:
            self.params[k].data.copy_(sd[k])

    # -- dropout seeds ---------------------------------------------------------------------------------
    def set_dropout_step(self, step_seed: int) -> None:
        """Make the dropout masks those of ``step_seed``: every site's ``site_seed(step_seed, layer, site)`` is
        computed on the host and written into ``dropout_seeds`` with one host-to-device copy (a write, never a
        read; the buffer keeps its address, so a captured graph reads the new seeds). Nothing to write when p
        is 0. Call it before a step's forward, never between a forward and its backward."""
        if self.config.dropout == 0.0:
            return
        seeds = [site_seed(step_seed, i, site) for i in range(self.config.n_layer) for site in SITES]  # unsigned
        host = torch.tensor([s - (1 << 64) if s >> 63 else s for s in seeds], dtype=torch.int64)  # two's complement
        # non_blocking, as AdamW's decay table: the driver stages the pageable host tensor before it returns, and
        # stream order puts the copy after the previous step's reads of the buffer and before this step's
        self.dropout_seeds.copy_(host.reshape(self.dropout_seeds.shape), non_blocking=True)

    # -- modes -----------------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> Model:
        self.training = bool(mode)
        return self

    def eval(self) -> Model:
        return self.train(False)

    # -- forward ---------------------------------------------------------------------------------------
    def _compute(self, p: Var) -> torch.Tensor | None:
        """A weight's values in the compute dtype: the optimizer's current compute copy when one is attached
        (``weight_copy``, set by the trainer: no cast launch), else a cast (None when the dtypes agree)."""
        dt = self.compute_dtype
        if p.dtype == dt:
            return None
        c = self.weight_copy(p) if self.weight_copy is not None else None
        return c if c is not None and c.dtype == dt else p.data.to(dt)

    def _compute_stack(self, *ps: Var) -> tuple[torch.Tensor, ...] | None:
        """Weights' values in the compute dtype (gate and up; q, k and v) stacked in one buffer
        (``ops.fused.stacked``), so that ``ops.swiglu_linear`` and ``ops.qkv_norm_rope_linear`` take their stacked
        paths whether the values come from the optimizer's copies (which lie so when aligned) or from casts, and a
        run with copies stays bit for bit a run without (None when the dtypes agree)."""
        dt = self.compute_dtype
        if ps[0].dtype == dt:
            return None
        cs = [self.weight_copy(p) if self.weight_copy is not None else None for p in ps]
        copies = all(c is not None and c.dtype == dt for c in cs)
        if copies and stacked(*cs) is not None:
            return tuple(cs)
        src = cs if copies else [p.data for p in ps]
        buf = torch.empty((sum(p.shape[0] for p in ps), *ps[0].shape[1:]), dtype=dt, device=ps[0].data.device)
        out, at = [], 0
        for t in src:
            out.append(buf[at : at + t.shape[0]].copy_(t))
            at += t.shape[0]
        return tuple(out)

    def _w(self, p: Var) -> Var:
        """A weight as a Var in the compute dtype (a cast node over ``_compute``'s values; p itself when the dtypes
        agree), for the ops that take no ``w_compute``."""
        c = self._compute(p)
        return p if c is None else ops.cast_as(p, c)

    def _linear(self, x: Var, p: Var, values: bool = True) -> Var:
        """x @ p^T in the compute dtype; p's gradient comes back in its master dtype (the cast folded in)."""
        return ops.linear(x, p, w_compute=self._compute(p), values=values)

    def _dropout(self, x: Var, seed: tuple | None, layer: int, site: int, T: int) -> Var:
        """Dropout of x [B*T, C]; the mask is keyed by (row of the batch, position, feature), so it is drawn on
        the [B, T, C] view. The seed is the buffer's entry of (layer, site)."""
        if seed is None:
            return x  # no node: p == 0 (or eval) builds exactly the graph of a model without dropout
        seeds, row_start, row_stride = seed
        N, C = x.shape
        x = ops.reshape(x, (N // T, T, C))  # [B, T, C]
        y = ops.dropout(x, self.config.dropout, seeds[layer, SITES.index(site)], True, row_start, row_stride)
        return ops.reshape(y, (N, C))

    def _decode_weights(self) -> dict:
        """The decode path's weights (module docstring): per layer the matmul weights "qkv", "o", "gate_up", "down",
        and "head", each [in, out] in the compute dtype (``ops.rows_linear``'s w, laid out by ``rows_linear_weight``),
        and "qk_norm" [H + Hkv, D] in the master dtype: q_norm's weight in H rows, then k_norm's in Hkv
        (``ops.qkv_norm_rope``). Made on first use; written again, in place, when a parameter changed since."""
        W = self.__dict__.get("_decode_w")
        key = [(id(p.data), p.data._version) for p in self._decode_params]
        if W is not None and W["key"] == key:
            return W
        cfg, dt = self.config, self.compute_dtype
        L = [f"model.layers.{i}.{{}}.weight" for i in range(cfg.n_layer)]
        stack = lambda *names: torch.cat([self.params[n].data for n in names]).to(dt).t()  # noqa: E731 - [in, out]
        qk = (("self_attn.q_norm", cfg.n_head), ("self_attn.k_norm", cfg.n_kv_head))  # [heads, D] rows each
        norms = lambda p: torch.cat([self.params[p.format(n)].data.expand(g, -1) for n, g in qk])  # noqa: E731
        new = {
            "qkv": [stack(*(p.format(f"self_attn.{n}_proj") for n in "qkv")) for p in L],
            "o": [stack(p.format("self_attn.o_proj")) for p in L],
            "gate_up": [stack(p.format("mlp.gate_proj"), p.format("mlp.up_proj")) for p in L],
            "down": [stack(p.format("mlp.down_proj")) for p in L],
            "head": [stack(self.head_weight.name)],
            "qk_norm": [norms(p) for p in L],
        }
        if W is None:  # each stored as ``rows_linear`` reads it fastest on this device
            W = self._decode_w = {k: [ops.rows_linear_weight(t) for t in v] for k, v in new.items()}
        else:  # in place: a captured decode graph reads the new values
            for k, v in new.items():
                for old, t in zip(W[k], v):
                    old.copy_(t)
        W["key"] = key
        return W

    def _block(self, x: Var, i: int, mask: Mask, rope: tuple, seed: tuple | None, cache=None, W=None, h=None,
               next_norm: Var | None = None):  # fmt: skip
        """One transformer block on the residual stream x [B*T, C] (master dtype; kept 2-D so every linear is one mm
        without reshapes). ``mask`` (``xtrain.mask``) picks the attention; ``rope`` is (positions, table): the mask's
        RoPE positions ([T] or [B, T]) and their cos/sin (``ops.rope_table``), shared by every layer. ``seed`` is (seed
        buffer, row_start, row_stride) taken at forward time (None: no dropout); a recompute in backward reads the same
        buffer, which holds the same step's seeds until the next ``set_dropout_step``. ``cache`` (inference): the new
        keys and values go into it (``ops.qkv_norm_rope``) and attention reads its rows; ``W``: the decode weights
        (``_decode_weights``), or None for the parameters themselves (training). ``h``: the block's normed input when
        the previous block made it (see ``next_norm``), else None. ``next_norm``: the weight of the norm that reads this
        block's output (the next block's input norm, or the final norm): the last residual add and that norm are then
        one ``add_rms_norm`` and the block returns (x, normed x), else x alone."""
        cfg, P, dt = self.config, self._layers[i], self.compute_dtype
        H, Hkv, eps = cfg.n_head, cfg.n_kv_head, cfg.norm_eps
        table, T = rope[1], rope[0].shape[-1]

        if W is not None:  # decode (no tape): each norm, SwiGLU and residual add inside a product (``rows_linear``);
            # q normed and roped, k (the same) and v written into the layer's cache; attention over that cache
            qkv = ops.rows_linear(x.data, W["qkv"][i], "norm", P["input_layernorm.weight"].data, eps)
            q = ops.qkv_norm_rope(qkv, W["qk_norm"][i], H, Hkv, mask, table, eps, cache.kv[i])
            x = ops.rows_linear(ops.cached_attention(q, *cache.kv[i], mask).data, W["o"][i], res=x.data)  # [B*T, C]
            gu = ops.rows_linear(x, W["gate_up"][i], "norm", P["post_attention_layernorm.weight"].data, eps)
            return Var(ops.rows_linear(gu, W["down"][i], "glu", res=x))  # [B*T, 2F] -> [B*T, C]
        if h is None:
            h = ops.rms_norm(x, P["input_layernorm.weight"], eps, dt)  # [B*T, C], normed straight into dt
        # the q/k/v projections (one product over the stacked weights), q_norm/k_norm and RoPE: q [B, H, T, D],
        # k [B, Hkv, T, D], v [B*T, Hkv*D]; the norm weights straight from their masters (an fp32 master with
        # bf16/fp16 activations is read in fp32)
        ws = tuple(P[f"self_attn.{n}_proj.weight"] for n in "qkv")
        norms = (P["self_attn.q_norm.weight"], P["self_attn.k_norm.weight"])
        q, k, v = ops.qkv_norm_rope_linear(h, ws, norms, H, Hkv, rope, eps, w_compute=self._compute_stack(*ws))
        a = ops.attention_rows(q, k, v, mask, impl=self._attention)  # [B*T, H*D]
        a = self._linear(a, P["self_attn.o_proj.weight"])  # [B*T, C]
        # the branch promoted to the master dtype in the add, and the sum normed in the same pass: [B*T, C] each
        x, h = ops.add_rms_norm(
            x, self._dropout(a, seed, i, SITE_ATTN, T), P["post_attention_layernorm.weight"], eps, dt
        )
        # silu(h Wgᵀ) * (h Wuᵀ) as one node                                      [B*T, F]
        wg, wu = P["mlp.gate_proj.weight"], P["mlp.up_proj.weight"]
        s = ops.swiglu_linear(h, wg, wu, w_compute=self._compute_stack(wg, wu))
        y = self._linear(s, P["mlp.down_proj.weight"], values=replaying() != self._block)  # (DESIGN.md, "Recompute")
        y = self._dropout(y, seed, i, SITE_MLP, T)  # [B*T, C]
        return ops.add_cast(x, y) if next_norm is None else ops.add_rms_norm(x, y, next_norm, eps, dt)

    @property
    def head_weight(self) -> Var:
        return self.params["model.embed_tokens.weight" if self.config.tie_embeddings else "lm_head.weight"]

    def forward(
        self,
        ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        mask: Mask | None = None,
        cache=None,
        reduction: str = "mean",
        ignore_index: int = -100,
        dropout_rows: tuple[int, int] = (0, 1),
        last: bool = False,
    ) -> Var:
        """ids [B, T] -> logits [B, T, V] (compute dtype), or, with targets [B, T], the scalar fp32 loss
        (cross-entropy, "mean" over counted targets or "sum"; targets equal to ignore_index count for
        nothing). ``mask`` (``xtrain.mask``): None is plain causal; ``Documents.of(ids, eot_id)`` packed
        documents, each computed as if alone; ``Cached`` with ``cache`` (inference): the new tokens of cache rows
        (module docstring). ``dropout_rows = (row_start, row_stride)``: where the rows of ``ids`` sit in the step's
        global batch (row b is global row ``row_start + b * row_stride``), which keys the dropout masks; (0, 1)
        for a batch that is the whole global batch. ``last`` (inference): the logits of each row's last position
        only, [B, 1, V]."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"Model: ids must be an int32/int64 tensor [B, T], got "
                f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}"
            )
        if ids.shape[1] > self.config.max_seq_len:
            raise ValueError(f"Model: sequence length {ids.shape[1]} exceeds max_seq_len={self.config.max_seq_len}")
        B, T = ids.shape
        mask = CAUSAL if mask is None else mask
        if not isinstance(mask, Mask) or (mask.kind == "cached") != (cache is not None):
            raise ValueError(f"Model: mask must be a Mask (xtrain.mask), Cached exactly when a cache is given; got "
                             f"{type(mask).__name__} {mask!r} with cache {type(cache).__name__}")  # fmt: skip
        mask.check("Model", B, T, ids.device)
        if (last or cache is not None) and (targets is not None or is_grad_enabled()):
            raise ValueError("Model: a forward with a cache or last=True is inference: no targets, under no_grad()")
        cfg = self.config
        W = None if cache is None else self._decode_weights()
        rope = mask.rope(self.rope_table, T)  # positions [T] or [B, T] and their cos/sin: shared by every layer
        # [B*T, C] in the master dtype
        x = ops.embedding(ids.reshape(B * T), self.params["model.embed_tokens.weight"], tied=cfg.tie_embeddings)
        recompute = cfg.recompute and is_grad_enabled()
        dropout = self.training and cfg.dropout > 0.0 and cache is None  # inference (a cache) never drops
        seed = (self.dropout_seeds, *dropout_rows) if dropout else None
        # without recompute each block's last residual add is fused with the norm that reads it (``_block``); a
        # recomputed block keeps its input alone, so it returns x and the next block norms it
        final_norm, h = self.params["model.norm.weight"], None
        norms = [self._layers[i + 1]["input_layernorm.weight"] for i in range(cfg.n_layer - 1)]
        norms.append(final_norm if not (last and T > 1) else None)  # last: the final norm after the slice
        if W is not None:  # decode: each norm runs inside the product that reads it
            norms = [None] * cfg.n_layer
        for i in range(cfg.n_layer):
            if recompute:
                x = checkpoint(self._block, x, i, mask, rope, seed)
            elif norms[i] is None:
                x = self._block(x, i, mask, rope, seed, cache, W, h)
            else:
                x, h = self._block(x, i, mask, rope, seed, cache, W, h, norms[i])
        if last and T > 1:  # [B, C]: each row's last position
            x, T = Var(x.data.view(B, T, -1)[:, -1]), 1
        if W is not None:  # decode: the final norm inside the head's product
            return Var(ops.rows_linear(x.data, W["head"][0], "norm", final_norm.data, cfg.norm_eps).view(B, T, -1))
        if recompute or norms[-1] is None:
            h = ops.rms_norm(x, final_norm, cfg.norm_eps, self.compute_dtype)  # [N, C]
        if targets is None:
            return ops.reshape(ops.linear(h, self._w(self.head_weight)), (B, T, cfg.vocab_size))  # [B, T, V]
        if not isinstance(targets, torch.Tensor) or targets.shape != ids.shape:
            raise ValueError(
                f"Model: targets must be a tensor of the ids' shape {tuple(ids.shape)}, got "
                f"{tuple(getattr(targets, 'shape', ()))}"
            )
        t = targets.reshape(B * T)  # [N]
        if self._fused_loss is not None:  # the head's gradient delivered by the loss node, in the master dtype
            wc = self._compute(self.head_weight)
            return self._fused_loss(
                h, self.head_weight, t, ignore_index=ignore_index, reduction=reduction, w_compute=wc
            )
        w = self._w(self.head_weight)  # [V, C]
        return ops.cross_entropy(ops.linear(h, w), t, ignore_index=ignore_index, reduction=reduction)

    __call__ = forward

    def loss(self, ids: torch.Tensor, targets: torch.Tensor, reduction: str = "mean", ignore_index: int = -100,
             dropout_rows: tuple[int, int] = (0, 1), mask: Mask | None = None) -> Var:  # fmt: skip
        """The cross-entropy of ``forward(ids, targets, ...)`` (see there for ``dropout_rows`` and ``mask``)."""
        return self.forward(ids, targets, reduction=reduction, ignore_index=ignore_index, dropout_rows=dropout_rows,
                            mask=mask)  # fmt: skip
