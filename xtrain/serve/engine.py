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

Shapes: B batch, T0 prompt length, C width, H / Hkv heads, D head dim, Tmax = prompt + new tokens.
"""

from __future__ import annotations

import math

import torch

from xtrain.kernels import rms_norm as K_rms
from xtrain.kernels import rope as K_rope
from xtrain.kernels import swiglu as K_swiglu
from xtrain.sampling import next_token


class Engine:
    def __init__(self, model):
        self.model = model
        self.config = cfg = model.config
        dt = model.compute_dtype
        # compute-dtype copies of the weights, cast once (the model casts inside every forward instead)
        self.w = {k: p.data.to(dt) for k, p in model.params.items()}
        self.head = self.w["model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"]
        self.dtype = dt
        self.device = model.device

    # -- one layer, for a block of new positions --------------------------------------------------------
    def _layer(
        self, i: int, x: torch.Tensor, pos: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], t0: int
    ) -> torch.Tensor:
        """x [B, Tn, C] (fp32 residual) at positions t0 .. t0+Tn-1; writes K/V into cache[:, :, t0:t0+Tn]."""
        cfg, w, dt = self.config, self.w, self.dtype
        p = f"model.layers.{i}."
        B, Tn, C = x.shape
        H, Hkv, D, eps = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.norm_eps
        master = self.model.params  # the residual-stream norms read the fp32 masters, as the model does
        h = K_rms.rms_norm_fwd(x, master[p + "input_layernorm.weight"].data, eps)[0].to(dt)  # [B, Tn, C]
        q = (h @ w[p + "self_attn.q_proj.weight"].t()).reshape(B, Tn, H, D)
        k = (h @ w[p + "self_attn.k_proj.weight"].t()).reshape(B, Tn, Hkv, D)
        v = (h @ w[p + "self_attn.v_proj.weight"].t()).reshape(B, Tn, Hkv, D)
        q = K_rms.rms_norm_fwd(q, w[p + "self_attn.q_norm.weight"], eps)[0]
        k = K_rms.rms_norm_fwd(k, w[p + "self_attn.k_norm.weight"], eps)[0]
        q = K_rope.rope_fwd(q.transpose(1, 2), pos, cfg.rope_theta)  # [B, H, Tn, D]
        k = K_rope.rope_fwd(k.transpose(1, 2), pos, cfg.rope_theta)  # [B, Hkv, Tn, D]
        ck, cv = cache
        ck[:, :, t0 : t0 + Tn] = k
        cv[:, :, t0 : t0 + Tn] = v.transpose(1, 2)
        keys, vals = ck[:, :, : t0 + Tn], cv[:, :, : t0 + Tn]  # [B, Hkv, S, D], S = t0 + Tn
        G = H // Hkv
        qg = q.reshape(B, Hkv, G * Tn, D)  # the G query heads of one K/V head, stacked (as math_attention)
        s = (qg @ keys.transpose(-1, -2)).float() * (1.0 / math.sqrt(D))  # [B, Hkv, G*Tn, S]
        if Tn > 1:  # prefill: new position t0+j sees cached positions <= t0+j
            S = t0 + Tn
            future = torch.ones(Tn, S, dtype=torch.bool, device=x.device).triu(t0 + 1)
            s.view(B, Hkv, G, Tn, S).masked_fill_(future, float("-inf"))
        a = (torch.softmax(s, dim=-1).to(dt) @ vals).reshape(B, H, Tn, D)  # [B, H, Tn, D]
        a = a.transpose(1, 2).reshape(B, Tn, H * D) @ w[p + "self_attn.o_proj.weight"].t()
        x = x + a.to(x.dtype)
        h = K_rms.rms_norm_fwd(x, master[p + "post_attention_layernorm.weight"].data, eps)[0].to(dt)
        y = K_swiglu.swiglu_fwd(h @ w[p + "mlp.gate_proj.weight"].t(), h @ w[p + "mlp.up_proj.weight"].t())
        return x + (y @ w[p + "mlp.down_proj.weight"].t()).to(x.dtype)

    def _forward(self, ids: torch.Tensor, caches, t0: int) -> torch.Tensor:
        """ids [B, Tn] at positions t0.. -> logits of the last position [B, V] (fp32)."""
        cfg = self.config
        x = self.model.params["model.embed_tokens.weight"].data[ids]  # [B, Tn, C] in the master dtype
        pos = torch.arange(t0, t0 + ids.shape[1], device=ids.device)
        for i in range(cfg.n_layer):
            x = self._layer(i, x, pos, caches[i], t0)
        h = K_rms.rms_norm_fwd(x[:, -1:], self.model.params["model.norm.weight"].data, cfg.norm_eps)[0]
        return (h.to(self.dtype) @ self.head.t())[:, 0].float()  # [B, V]

    def new_caches(self, B: int, Tmax: int):
        cfg = self.config
        shape = (B, cfg.n_kv_head, Tmax, cfg.head_dim)
        return [
            (
                torch.empty(shape, dtype=self.dtype, device=self.device),
                torch.empty(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(cfg.n_layer)
        ]

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
        caches = self.new_caches(B, T0 + max_new_tokens)
        out = [ids]
        logits = self._forward(ids, caches, 0)  # prefill
        t = T0
        for step in range(max_new_tokens):
            nxt = next_token(logits.cpu(), temperature, top_k, top_p, g).to(self.device)  # [B]
            out.append(nxt[:, None])
            if stream is not None:
                stream(step, nxt)
            if eos_id is not None and bool((nxt == eos_id).all()):
                break
            if step + 1 < max_new_tokens:
                logits = self._forward(nxt[:, None], caches, t)  # decode one position
                t += 1
        return torch.cat(out, dim=1)
