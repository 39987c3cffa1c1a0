"""``xtrain bench train`` (bench/train.py): one full training step of xtrain vs an equivalent PyTorch eager model.

Both sides run the same architecture with the same weights and the same batch: forward, backward (torch
side: torch.autograd), global-norm clipping, AdamW step, zero grads. The PyTorch side is written the way
one writes it in eager PyTorch: ``nn.Linear``, ``F.rms_norm``, ``F.scaled_dot_product_attention`` (causal,
GQA; ``--torch-attention composed`` for the materialised-softmax form xtrain's composed op computes),
``F.silu``, ``F.cross_entropy``, ``torch.optim.AdamW`` (fused on CUDA, foreach=False on the CPU). The xtrain
side runs its step as the trainer does: Python's cyclic GC paused for the step, and (with a lower compute
dtype) AdamW's compute copies of the weights read by the forward (``--no-copies``: a cast per weight per
forward instead).

Rows: torch eager; xtrain (its plain step, host reads included); on CUDA (``--graph-rows``) the trainer's own
step (``Trainer.train_step``, capture-ready) with the CUDA graph on and off; and the torch sides a speed-minded
user would try (``--torch-modes``): on CUDA by default the model under ``torch.compile`` in its default,
``max-autotune-no-cudagraphs`` and ``reduce-overhead`` modes with fused AdamW; opt-in, eager / default /
max-autotune with the whole step (forward, backward, clip, fused AdamW with ``capturable=True``) captured as one
CUDA graph (see ``TORCH_MODES`` for why they are not in the default set). Under CUDA graphs (reduce-overhead, the
step graphs) the torch side's SDPA may take FlashAttention-2 or the memory-efficient kernel but not cuDNN's, which
faults there (pytorch#169849); elsewhere SDPA picks freely, and the graph rows' autocast keeps no weight cache
(PyTorch's rule for capture). The RoPE tables are module buffers built once, as HF, torchtitan and nanoGPT-style
code keep them. Every side starts from the same weights and batch; the first-step losses are printed (they must
agree). The fastest torch side is named on the last line and is the "vs best torch" column's reference.

``--doc-mask MEAN``: the batch holds packed documents of mean length MEAN (``bench/_docs.py``: geometric lengths,
an eot, id 0, at each document start and nowhere else), and two more rows time the trainer's step on it with the
document mask on and off (``TrainConfig.doc_mask``; the CUDA graph on CUDA); a last line gives their tokens/s and
the ratio on/off. The other rows run the same batch unmasked.

Timing: wall clock per step after warm-up, median (and quartiles) over ``--steps`` steps (CUDA events around the
same call beside it, the GPU's view), the sides
interleaved step by step so machine noise hits all alike (the host's speed drifts between processes by
more than most changes measured here: compare variants inside one process, e.g. ``--compare-copies``).
tokens/s = B * T / median step time.

Peak memory (CUDA): each side is built and warmed up alone, before any timing; its peak is the most memory
allocated during that (``torch.cuda.max_memory_allocated``) above what the sides built before it hold: its
weights, optimizer state, compute copies, activations and, for the graph, what the capture allocated.

FLOPs per token: 6 * (parameters, the LM head counted once) for the matmuls, forward and backward, plus
attention's 12 * L * H * D * T (nanoGPT's estimate for the full T x T square) halved for the causal mask:
6 * L * H * D * T. MFU = tokens/s * FLOPs per token / the tensor cores' dense peak (H100/H200 bf16:
989.4 TFLOP/s; ``--peak-tflops`` for other devices).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from xtrain.autograd import gc_paused
from xtrain.config import PRESETS
from xtrain.model import Model
from xtrain.train.optim import AdamW, clip_grads_, decays, grad_norm

# -- the PyTorch eager baseline ------------------------------------------------------------------------


class _RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rope_cos_sin(T: int, D: int, theta: float, device):
    """RoPE tables [T, D] in fp32, built once per model (``TorchQwen3`` keeps them as buffers, as HF, torchtitan and
    nanoGPT-style code do: computed inside a compiled forward, Inductor inlines the pow/cos/sin chain into every
    q/k element of every layer, forward and backward)."""
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64, device=device) / D)
    ang = torch.outer(torch.arange(T, dtype=torch.float64, device=device), inv).float()  # [T, D/2]
    ang = torch.cat([ang, ang], dim=-1)  # [T, D]
    return ang.cos(), ang.sin()


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class _Attention(nn.Module):
    def __init__(self, c, impl: str):
        super().__init__()
        self.c, self.impl = c, impl
        H, K, D, C = c.n_head, c.n_kv_head, c.head_dim, c.n_embd
        self.q_proj = nn.Linear(C, H * D, bias=False)
        self.k_proj = nn.Linear(C, K * D, bias=False)
        self.v_proj = nn.Linear(C, K * D, bias=False)
        self.o_proj = nn.Linear(H * D, C, bias=False)
        self.q_norm = _RMSNorm(D, c.norm_eps)
        self.k_norm = _RMSNorm(D, c.norm_eps)

    def forward(self, x, cos, sin):
        c = self.c
        B, T, _ = x.shape
        H, K, D = c.n_head, c.n_kv_head, c.head_dim
        q = self.q_norm(self.q_proj(x).view(B, T, H, D)).transpose(1, 2)  # [B, H, T, D]
        k = self.k_norm(self.k_proj(x).view(B, T, K, D)).transpose(1, 2)  # [B, K, T, D]
        v = self.v_proj(x).view(B, T, K, D).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.impl == "sdpa":
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=(K != H))
        elif self.impl == "sdpa-no-cudnn":  # under CUDA graphs: cuDNN's SDPA can fault there (pytorch#169849)
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=(K != H))
        else:
            k = k.repeat_interleave(H // K, dim=1)
            v = v.repeat_interleave(H // K, dim=1)
            s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(D))
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            a = torch.softmax(s, dim=-1) @ v
        return self.o_proj(a.transpose(1, 2).reshape(B, T, H * D))


class _Block(nn.Module):
    def __init__(self, c, impl):
        super().__init__()
        self.input_layernorm = _RMSNorm(c.n_embd, c.norm_eps)
        self.self_attn = _Attention(c, impl)
        self.post_attention_layernorm = _RMSNorm(c.n_embd, c.norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(c.n_embd, c.ffn_dim, bias=False)
        self.mlp.up_proj = nn.Linear(c.n_embd, c.ffn_dim, bias=False)
        self.mlp.down_proj = nn.Linear(c.ffn_dim, c.n_embd, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class TorchQwen3(nn.Module):
    """The same architecture in eager PyTorch, state_dict keys = the Hugging Face / xtrain names."""

    def __init__(self, c, attention: str = "sdpa"):
        super().__init__()
        self.c = c
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.n_embd)
        self.model.layers = nn.ModuleList([_Block(c, attention) for _ in range(c.n_layer)])
        self.model.norm = _RMSNorm(c.n_embd, c.norm_eps)
        if not c.tie_embeddings:
            self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        cos, sin = _rope_cos_sin(c.max_seq_len, c.head_dim, c.rope_theta, None)  # [Tmax, D], moved with .to()
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, ids, targets):
        c = self.c
        T = ids.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.model.embed_tokens(ids)
        for blk in self.model.layers:
            x = blk(x, cos, sin)
        x = self.model.norm(x)
        w = self.model.embed_tokens.weight if c.tie_embeddings else self.lm_head.weight
        logits = x @ w.t()  # [B, T, V]
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


# -- the benchmark -------------------------------------------------------------------------------------


def _torch_opt(model, dev, fused_cpu: bool, capturable: bool = False):
    """AdamW over the torch model with the two decay groups; the fused kernel on CUDA (``capturable``: its step
    count and lr on the device, so a CUDA graph can hold the step), the plain loop on CPU."""
    named = dict(model.named_parameters())
    groups = [
        {"params": [p for n, p in named.items() if decays(n, p.shape)], "weight_decay": 0.1},
        {"params": [p for n, p in named.items() if not decays(n, p.shape)], "weight_decay": 0.0},
    ]
    fused = dev.type == "cuda"
    return torch.optim.AdamW(
        groups,
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=None if fused or fused_cpu else False,
        fused=fused or None,
        capturable=capturable,
    )


@dataclasses.dataclass(frozen=True)
class TorchMode:
    """One way a speed-minded PyTorch user runs the step. ``compile``: None (eager) or a ``torch.compile`` mode
    of the model ("default", "max-autotune-no-cudagraphs", "reduce-overhead": CUDA graphs of the forward and
    backward); ``step_graph``: the whole step (forward, backward, clip, fused AdamW with ``capturable=True``)
    captured as one CUDA graph after a warm-up on a side stream, PyTorch's whole-network capture recipe."""

    compile: str | None = None
    step_graph: bool = False

    @property
    def name(self) -> str:
        base = "torch eager" if self.compile is None else f"torch.compile {self.compile}"
        return base + (" + step graph" if self.step_graph else "")


# the torch sides (--torch-modes); eager comes first and is the "vs eager" reference. "auto" on CUDA takes the three
# compile modes. The "+graph" sides are opt-in: on an H100 (torch 2.11) their replays ran during the build but a
# replay faulted (illegal memory access) once the sides were timed interleaved in one process, at both presets;
# not diagnosed (cuDNN's SDPA was already kept out of them)
TORCH_MODES = {
    "eager": TorchMode(),
    "default": TorchMode("default"),
    "max-autotune": TorchMode("max-autotune-no-cudagraphs"),
    "reduce-overhead": TorchMode("reduce-overhead"),
    "eager+graph": TorchMode(None, True),
    "default+graph": TorchMode("default", True),
    "max-autotune+graph": TorchMode("max-autotune-no-cudagraphs", True),
}


def torch_step(ref, x, y, autocast, dev, mode: TorchMode = TorchMode()):
    """-> step(): one optimizer step of the torch model ``ref`` run as ``mode`` says, returning the loss (a float:
    one read per step, as xtrain's trainer reads its metrics). A step-graph ``step`` carries ``first_loss``, the
    loss of its first warm-up step (the same weights and batch as every other side's first step)."""
    opt = _torch_opt(ref, dev, fused_cpu=False, capturable=mode.step_graph)
    fwd = ref
    if mode.compile is not None:
        fwd = torch.compile(ref, mode=None if mode.compile == "default" else mode.compile)

    def one_step():
        with autocast:
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, foreach=dev.type == "cuda" or mode.compile is not None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if not mode.step_graph:
        return lambda: float(one_step())
    if dev.type != "cuda":
        raise RuntimeError("a step graph needs CUDA")
    side = torch.cuda.Stream()  # warm up on a side stream (lazy inits, compilation, autotuning) before capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        first = float(one_step())
        for _ in range(2):
            one_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = one_step()  # gradients come from the graph's pool and are static across replays

    def step():
        graph.replay()
        return float(static_loss)

    step.first_loss = first
    return step


def trainer_step(c, dev, ids, B: int, graph: bool, doc_eot: int | None = None):
    """The trainer's own step (``Trainer.train_step``: capture-ready, lr as a device tensor, one read per step),
    with the CUDA graph on or off. On a machine without CUDA the graph falls back (one line) and runs eagerly.
    ``doc_eot``: packed documents kept apart, each starting at this token (``TrainConfig.doc_mask``); None: off."""
    from xtrain.config import TrainConfig
    from xtrain.train.trainer import Trainer

    T = ids.shape[1] - 1
    tcfg = TrainConfig(
        steps=10**9,
        batch_size=B,
        seq_len=T,
        lr=1e-3,
        warmup_steps=0,
        schedule="constant",
        doc_mask=doc_eot is not None,
        eot_id=doc_eot,
    )
    batch = ids.cpu()  # as a loader hands it over: on the host, moved by the step
    tr = Trainer(Model(c, device=dev, seed=0), tcfg, lambda: batch, cuda_graph=graph)

    def step():
        m = tr.train_step()
        if graph and m.get("graph") == "off":  # never time a fallback under the graph's name
            raise GraphFellBack(tr.graphed.off_reason)
        return m["loss"]

    if graph:  # warm up through the capture: the timed calls are replays
        step.min_warmup = tr.graphed.warmup + 1
    return step


class GraphFellBack(RuntimeError):
    pass


DOC_EOT = 0  # --doc-mask: the token every document starts with


# dense matmul peak of the tensor cores (no sparsity), FLOP/s, by device name and compute dtype (datasheets)
# (the fp32 rows are TF32's peak, what torch's fp32 matmuls may use)
_PEAK = {
    ("H100", "bfloat16"): 989.4e12,
    ("H200", "bfloat16"): 989.4e12,
    ("H100", "float32"): 494.7e12,
    ("H200", "float32"): 494.7e12,
}


def peak_matmul_flops(dev, dtype: str) -> float | None:
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    return next((v for (k, dt), v in _PEAK.items() if k in name and dt == dtype), None)


def flops_per_token(c, T: int) -> float:
    n = c.num_params() - c.vocab_size * c.n_embd * (0 if c.tie_embeddings else 1)  # head counted once
    return 6.0 * n + 6.0 * c.n_layer * T * c.n_head * c.head_dim


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="xtrain bench train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=None, help="default: the preset's max_seq_len")
    ap.add_argument("--vocab", type=int, default=None, help="override the preset's vocab size")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: as is)")
    ap.add_argument(
        "--attention",
        default="auto",
        choices=["composed", "math", "flash", "auto"],
        help="xtrain attention op (auto: the model's rule, flash on CUDA and on CPU for T >= 192)",
    )
    ap.add_argument("--loss", default="auto", choices=["composed", "fused", "auto"], help="xtrain loss op")
    ap.add_argument("--torch-attention", default="sdpa", choices=["sdpa", "composed"])
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument(
        "--no-copies",
        action="store_true",
        help="cast every weight in every forward instead of reading AdamW's compute copies",
    )
    ap.add_argument(
        "--compare-copies",
        action="store_true",
        help="also time a second xtrain model with the copies the other way, interleaved",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's peak for MFU (default: H100/H200)")
    ap.add_argument(
        "--graph-rows",
        choices=["auto", "on", "off"],
        default="auto",
        help="also time the trainer's step with the CUDA graph on and off (auto: on CUDA)",
    )
    ap.add_argument(
        "--torch-modes",
        default="auto",
        help="comma-separated torch sides beside eager, from: "
        + ", ".join(k for k in TORCH_MODES if k != "eager")
        + "; 'all'; 'none' (auto: the three compile modes on CUDA, none on the CPU). 'X+graph' captures the whole step "
        "(fused AdamW, capturable) as one CUDA graph (opt-in: it faulted on an H100 when interleaved with other sides)",
    )
    ap.add_argument(
        "--doc-mask",
        type=int,
        default=None,
        metavar="MEAN",
        help="packed documents of this mean length in the batch (an eot, id 0, at each document start); adds the "
        "trainer's step with the document mask on and off (the CUDA graph on CUDA), on the same data",
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="compute dtype: xtrain's compute_dtype (fp32 masters) vs torch autocast to the same dtype",
    )
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    over = {"attention": args.attention, "loss": args.loss, "recompute": args.recompute, "compute_dtype": args.dtype}
    if args.vocab:
        over["vocab_size"] = args.vocab
    if args.seq_len and args.seq_len > PRESETS[args.preset].max_seq_len:  # a longer context than the preset's
        over["max_seq_len"] = args.seq_len
    c = dataclasses.replace(PRESETS[args.preset], **over).validate()
    B, T = args.batch_size, args.seq_len or c.max_seq_len
    dev = torch.device(args.device)

    if dev.type == "cuda":
        from bench._gpu import warm_up

        warm_up()
    if args.doc_mask is not None and args.doc_mask < 1:
        ap.error(f"--doc-mask: the mean document length must be >= 1, got {args.doc_mask}")
    if args.doc_mask is None:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, c.vocab_size, (B, T + 1), generator=g).to(dev)
    else:  # the eot (id DOC_EOT) at each document start, nowhere else
        from bench._docs import packed_ids

        ids = packed_ids(B, T + 1, args.doc_mask, c.vocab_size, eot=DOC_EOT, seed=0).to(dev)
    x, y = ids[:, :-1], ids[:, 1:]
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else contextlib.nullcontext()
    init = Model(c, device="cpu", seed=0).state_dict()  # every side starts from these weights (seed 0)

    def xtrain_side(copies: bool):
        def build():
            model = Model(c, device=dev, seed=0)
            opt = AdamW.for_model(model, copies=copies, lr=1e-3, weight_decay=0.1)  # as the trainer does

            def step():
                with gc_paused():  # as the trainer runs a step (the tape is acyclic; see autograd.gc_paused)
                    loss = model.loss(x, y)
                    loss.backward()
                    grads = opt.grads()
                    clip_grads_(grads, 1.0, grad_norm(grads))
                    opt.step()
                    opt.zero_grad()
                    return float(loss.data)

            return step

        return build

    def torch_side(mode: TorchMode):
        def build():
            attn = args.torch_attention
            graphed = mode.step_graph or mode.compile == "reduce-overhead"
            if attn == "sdpa" and graphed and dev.type == "cuda":
                attn = "sdpa-no-cudnn"  # cuDNN's SDPA under CUDA graphs can fault (pytorch#169849)
            ref = TorchQwen3(c, attn).to(dev)
            ref.load_state_dict({k: v.to(dev) for k, v in init.items()}, strict=True)
            ac = autocast
            if mode.step_graph and args.dtype == "bfloat16":  # autocast's weight cache must be off under capture
                ac = torch.autocast(dev.type, dtype=torch.bfloat16, cache_enabled=False)
            return torch_step(ref, x, y, ac, dev, mode)

        return build

    if args.torch_modes == "auto":  # the step graphs are opt-in: see TORCH_MODES
        modes = [k for k in TORCH_MODES if k != "eager" and not TORCH_MODES[k].step_graph] if dev.type == "cuda" else []
    elif args.torch_modes == "all":
        modes = [k for k in TORCH_MODES if k != "eager"]
    elif args.torch_modes == "none":
        modes = []
    else:
        modes = [m.strip() for m in args.torch_modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in TORCH_MODES]
        if bad:
            ap.error(f"--torch-modes: unknown {', '.join(bad)}; choose from {', '.join(TORCH_MODES)}")

    copies = not args.no_copies and args.dtype != "float32"
    builders = [("torch eager", torch_side(TORCH_MODES["eager"])), ("xtrain", xtrain_side(not args.no_copies))]
    if args.compare_copies:  # the same step with the copies the other way, in the same process, interleaved
        if args.dtype == "float32":
            ap.error("--compare-copies needs a compute dtype below the fp32 masters (--dtype bfloat16)")
        builders.append(("xtrain, copies " + ("on" if args.no_copies else "off"), xtrain_side(args.no_copies)))
    if args.graph_rows == "on" or (args.graph_rows == "auto" and dev.type == "cuda"):
        builders += [
            ("xtrain trainer, graph", lambda: trainer_step(c, dev, ids, B, True)),
            ("xtrain trainer, no graph", lambda: trainer_step(c, dev, ids, B, False)),
        ]
    builders += [(TORCH_MODES[m].name, torch_side(TORCH_MODES[m])) for m in modes if m != "eager"]
    doc_rows = []
    if args.doc_mask is not None:  # the trainer's step with the document mask on and off, on the same batch
        graph = dev.type == "cuda"
        for on in (True, False):
            name = (
                f"trainer{'+graph' if graph else ''} doc mask {'on' if on else 'off'}"  # no comma: see the losses line
            )
            doc_rows.append(name)
            eot = DOC_EOT if on else None
            builders.append((name, lambda eot=eot, graph=graph: trainer_step(c, dev, ids, B, graph, doc_eot=eot)))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    # build each side and warm it up alone: its first loss (every side the same weights and batch: they must
    # agree) and, on CUDA, its peak memory: the most allocated during its build and warm-up above what the
    # sides built before it hold (its weights, optimizer state, graph pool, activations)
    sides, first, peak = [], {}, {}
    for name, build in builders:
        sync()
        base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        try:
            fn = build()
            first[name] = getattr(fn, "first_loss", None) or fn()
            for _ in range(max(args.warmup, getattr(fn, "min_warmup", 0))):
                fn()
        except GraphFellBack as e:
            print(f"  graph: fell back ({e}); no '{name}' row")
            continue
        except Exception as e:  # e.g. torch.compile without a C++ compiler / Triton for inductor here
            print(f"  {name} row skipped: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        sync()
        if dev.type == "cuda":
            peak[name] = torch.cuda.max_memory_allocated(dev) - base
        print(f"  built {name}: first loss {first[name]:.6f}", flush=True)  # a crash later names the last built
        sides.append((name, fn))
    times = {name: [] for name, _ in sides}
    gpu_times = {name: [] for name, _ in sides}  # CUDA events around the call: the GPU's view of the same step
    for _ in range(args.steps):  # interleaved step by step, so machine noise hits every side alike
        for name, fn in sides:
            sync()
            if dev.type == "cuda":
                ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev[0].record()
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                ev[1].record()
            sync()
            times[name].append(time.perf_counter() - t0)
            if dev.type == "cuda":
                gpu_times[name].append(ev[0].elapsed_time(ev[1]) / 1e3)
    med = {n: statistics.median(t) for n, t in times.items()}
    gmed = {n: statistics.median(t) for n, t in gpu_times.items() if t}
    q = {n: statistics.quantiles(t, n=4) if len(t) >= 2 else [t[0]] * 3 for n, t in times.items()}
    mt = med["torch eager"]
    tok = B * T
    fpt = flops_per_token(c, T)
    peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else peak_matmul_flops(dev, args.dtype)
    print(
        f"xtrain bench train: preset={args.preset} params={c.num_params() / 1e6:.2f}M B={B} T={T} "
        f"V={c.vocab_size} device={dev}{' (' + torch.cuda.get_device_name(dev) + ')' if dev.type == 'cuda' else ''} "
        f"dtype={args.dtype} threads={torch.get_num_threads()} torch={torch.__version__}"
    )
    print(
        f"  xtrain attention={args.attention} loss={args.loss} recompute={args.recompute} "
        f"compute copies={'on' if copies else 'off'}; torch attention={args.torch_attention}; "
        f"GFLOP/token {fpt / 1e9:.3f}; "
        + (f"MFU against {peak_flops / 1e12:.1f} TFLOP/s" if peak_flops else "no peak known for MFU (--peak-tflops)")
    )
    print("  first-step loss: " + ", ".join(f"{n} {v:.6f}" for n, v in first.items()))
    torch_rows = [n for n in med if n.startswith("torch")]
    best = min(torch_rows, key=med.get) if torch_rows else None
    w = max(26, *(len(n) + 2 for n in med))
    print(
        f"{'impl':<{w}}{'step ms':>9}{'event ms':>10}{'p25-p75 ms':>14}{'tokens/s':>11}{'MFU %':>7}{'peak GiB':>10}"
        f"{'vs eager':>10}{'vs best torch':>15}"
    )
    for name, _ in sides:
        m = med[name]
        mfu = f"{100 * tok * fpt / m / peak_flops:.1f}" if peak_flops else "-"
        mem = f"{peak[name] / 2**30:.2f}" if name in peak else "-"
        ev = f"{gmed[name] * 1e3:.2f}" if name in gmed else "-"
        print(
            f"{name:<{w}}{m * 1e3:>9.2f}{ev:>10}{f'{q[name][0] * 1e3:.1f}-{q[name][2] * 1e3:.1f}':>14}{tok / m:>11.0f}"
            f"{mfu:>7}{mem:>10}{mt / m:>10.2f}{med[best] / m:>15.2f}"
        )
    if best:
        print(f"best torch side: {best} ({med[best] * 1e3:.2f} ms)")
    if args.doc_mask is not None:
        from xtrain.model import doc_starts

        starts = doc_starts(x, DOC_EOT)
        t = torch.arange(T, device=starts.device)
        kept = float((t - starts + 1).sum()) / (B * T * (T + 1) / 2)
        n_docs = int((x == DOC_EOT).sum())
        on, off = (med.get(n) for n in doc_rows)
        print(
            f"doc mask (mean document {args.doc_mask} tokens, eot id {DOC_EOT}, {n_docs} document starts in the "
            f"batch, {100 * kept:.1f} % of the causal mask kept): "
            + (f"on {tok / on:.0f} tokens/s" if on else "on -")
            + (f", off {tok / off:.0f} tokens/s" if off else ", off -")
            + (f", on/off {off / on:.3f} (tokens/s)" if on and off else "")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
