"""``xtrain bench finetune`` (bench/finetune.py): a fine-tuning step of xtrain vs transformers' Qwen3ForCausalLM.

The shape is Qwen3-0.6B's (``--shape qwen3-0.6b``: 28 layers, hidden 1024, 16 query / 8 key-value heads, head_dim
128, FFN 3072, vocabulary 151,936, tied embeddings), with random weights, bf16 compute on fp32 master weights,
T = 2048 (``--seq-len``). Both sides take the same batch of random ids and run forward, backward, global-norm
clipping at 1.0 and AdamW:

* xtrain: the trainer's own step (``Trainer.train_step``: fused LM head + loss, flash attention, the one-launch
  AdamW writing bf16 compute copies, the whole step one CUDA graph on CUDA; ``bench.train.trainer_step``), with
  every activation kept ("plain") and with activation recompute ("recompute"; ``--xtrain`` picks).
  transformers' side keeps every activation (no gradient checkpointing): the speed goal compares it with the plain
  side; the recompute side is the memory a user can trade for its extra forward.
* transformers: ``Qwen3ForCausalLM`` built from the same config (fp32 parameters, ``torch.autocast`` to bf16, SDPA
  attention), its forward and the loss (``F.cross_entropy`` on the fp32-upcast logits, as its own loss does) under
  ``torch.compile`` in each mode of ``--compile-modes`` (default: default and max-autotune-no-cudagraphs; "eager"
  for none; a mode ending in "/layers", e.g. "max-autotune-no-cudagraphs/layers", compiles each decoder layer and
  the head + loss apart, PyTorch's regional compilation: one layer graph to compile and autotune instead of 28),
  ``torch.optim.AdamW(fused=True)`` and ``clip_grad_norm_`` as a skilled user writes it. The fastest mode is the
  baseline the ratios are against.

Each side is built, warmed up and timed alone (``--steps`` steps after ``--warmup``, wall clock with the device
synchronised, median), then freed; its peak memory is the most allocated from its build to its last step above
what was allocated before it (``torch.cuda.max_memory_allocated``), and "held" what stays allocated between steps
(weights, optimizer state, compute copies, graph buffers): the peak less held is what a step adds at its top.
``--max-batch``: for each side, the largest batch (doubling from ``--batch-size``, then bisection, up to
``--max-batch-limit``) whose steps run without running out of memory (``max_batch`` says how each side tries a
batch).

The issue's goals (one H100, Qwen3-0.6B, T = 2048): xtrain's tokens/s >= 1.3x transformers' best compile mode at the
same batch, peak memory <= 0.5x, largest batch >= 2x. The last lines say whether each holds.

On the CPU the same code runs at ``--shape tiny`` for a smoke test (fp32, compile modes "eager" by default there).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from xtrain.config import ModelConfig

SHAPES = {
    "qwen3-0.6b": dict(
        vocab_size=151936, n_layer=28, n_embd=1024, n_head=16, n_kv_head=8, head_dim=128, ffn_dim=3072, tied=True
    ),
    "tiny": dict(vocab_size=512, n_layer=2, n_embd=64, n_head=4, n_kv_head=2, head_dim=128, ffn_dim=192, tied=True),
}


def model_config(shape: str, T: int, dtype: str) -> ModelConfig:
    s = dict(SHAPES[shape])
    tied = s.pop("tied")
    return ModelConfig(
        **s, max_seq_len=T, rope_theta=1e6, tie_embeddings=tied, compute_dtype=dtype, attention="auto", loss="auto"
    ).validate()


def hf_config(c: ModelConfig):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.n_embd,
        intermediate_size=c.ffn_dim,
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        num_key_value_heads=c.n_kv_head,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_seq_len,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings,
        attn_implementation="sdpa",
    )


def xtrain_side(c: ModelConfig, dev, B: int, T: int):
    from bench.train import trainer_step

    ids = torch.randint(0, c.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0))
    return trainer_step(c, dev, ids, B, graph=dev.type == "cuda")


_INITIAL: dict = {}  # repr(config) -> xtrain's initial weights on the CPU, drawn once per config (every build reads)


def initial_state(c: ModelConfig) -> dict:
    """xtrain's initial weights for ``c`` (seed 0, Hugging Face names), drawn once: each transformers build (one
    per compile mode and per batch ``--max-batch`` tries) loads them instead of drawing 0.6B normals again."""
    from xtrain.model import Model

    if repr(c) not in _INITIAL:
        _INITIAL[repr(c)] = Model(c, device="cpu", seed=0).state_dict()
    return _INITIAL[repr(c)]


def transformers_side(c: ModelConfig, dev, B: int, T: int, mode: str):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(hf_config(c)).train()  # fp32 parameters: the master weights
    # xtrain's initial weights (the same Hugging Face names), so both sides' first losses agree
    missing, unexpected = model.load_state_dict(initial_state(c), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ValueError(f"bench finetune: weights do not map: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model = model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=dev.type == "cuda")
    batch: dict = {}

    def resize(b: int) -> None:  # the batch of b rows the next steps take (the same build: see max_batch)
        ids = torch.randint(0, c.vocab_size, (b, T + 1), generator=torch.Generator().manual_seed(0)).to(dev)
        batch["x"], batch["y"] = ids[:, :-1], ids[:, 1:]

    resize(B)
    low = c.compute_dtype == "bfloat16"

    mode, regional = mode.removesuffix("/layers"), mode.endswith("/layers")
    kw = dict(backend="eager") if mode == "eager" else dict(mode=None if mode == "default" else mode)

    def loss_fn(x, y):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=low):
            logits = model(input_ids=x).logits  # [B, T, V]
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    if regional:  # PyTorch's regional compilation: each decoder layer (one compiled graph for all 28) and the head
        for layer in model.model.layers:
            layer.compile(**kw)
        head = torch.compile(lambda h, y: F.cross_entropy(model.lm_head(h).float().flatten(0, 1), y.flatten()), **kw)

        def loss_fn(x, y):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=low):
                return head(model.model(input_ids=x).last_hidden_state, y)  # the final norm inside model.model
    elif mode != "eager":
        loss_fn = torch.compile(loss_fn, **kw)

    def step():
        try:
            loss = loss_fn(batch["x"], batch["y"])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        finally:  # also after running out of memory mid-step, so a smaller batch starts clean
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    step.resize = resize
    return step


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _free(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def run_side(build, dev, steps: int, warmup: int) -> dict:
    """Build, warm up and time one side alone -> {"ms": median step, "peak": bytes or None, "held": bytes allocated
    after the last step or None, "loss": first}."""
    _free(dev)
    _sync(dev)
    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    fn = build()
    first = float(fn())
    for _ in range(max(warmup, getattr(fn, "min_warmup", 0))):
        fn()
    times = []
    for _ in range(steps):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    cuda = dev.type == "cuda"
    peak = torch.cuda.max_memory_allocated(dev) - base if cuda else None
    held = torch.cuda.memory_allocated(dev) - base if cuda else None
    del fn
    _free(dev)
    return {"ms": statistics.median(times) * 1e3, "peak": peak, "held": held, "loss": first}


def fits(step, dev) -> bool:
    """Whether two steps (at least the step's own warm-up) run without running out of device memory."""
    _free(dev)
    try:
        for _ in range(max(2, getattr(step, "min_warmup", 0))):
            step()
        _sync(dev)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        _free(dev)


def largest(fits_b, start: int, limit: int, within: int = 16) -> int:
    """The largest batch b in [start, limit] with fits_b(b) (0: not even start), assuming that fitting is
    monotone in b: doubling from start to the first batch that does not fit, then bisection between the two until
    the gap is at most lo / ``within`` (the answer fits; the true largest is below lo * (1 + 1 / within))."""
    lo, hi = 0, None
    b = start
    while b <= limit:
        if not fits_b(b):
            hi = b
            break
        lo, b = b, 2 * b
    if lo == 0:
        return 0
    hi = hi if hi is not None else limit + 1
    while hi - lo > max(1, lo // within):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_b(mid) else (lo, mid)
    return lo


def max_batch(make, dev, start: int, limit: int, resize: bool) -> int:
    """The largest batch that fits (``largest``). ``resize`` False (xtrain): each batch tried in a fresh build (its
    step graph is captured for one shape). True (transformers): one build whose inputs are resized
    (``step.resize``); torch.compile traces the second shape with a dynamic batch dimension (its automatic dynamic
    shapes), so the tries after it reuse one compiled graph instead of compiling the 0.6B model once per batch."""
    if not resize:

        def fresh(b):
            try:
                return fits(make(b), dev)
            except torch.cuda.OutOfMemoryError:  # the build itself did not fit
                return False
            finally:
                _free(dev)  # the try's step is gone: nothing holds it

        return largest(fresh, start, limit)
    step = make(start)

    def resized(b):
        step.resize(b)
        return fits(step, dev)

    try:
        return largest(resized, start, limit)
    finally:
        step = None  # drop the build before the next side
        _free(dev)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="xtrain bench finetune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: qwen3-0.6b on CUDA, tiny on CPU")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 4 on CUDA, 2 on CPU)")
    ap.add_argument("--seq-len", type=int, default=None, help="T (default 2048 on CUDA, 64 on CPU)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--compile-modes",
        nargs="+",
        default=None,
        help="torch.compile modes for transformers (default: default max-autotune-no-cudagraphs on CUDA, eager on "
        "CPU); MODE/layers compiles each decoder layer and the head apart",
    )
    ap.add_argument(
        "--xtrain",
        nargs="+",
        default=["plain", "recompute"],
        choices=["plain", "recompute"],
        help="xtrain sides: plain (every activation kept) and/or recompute (activation recompute, each block's "
        "forward re-run in backward); default both",
    )
    ap.add_argument("--max-batch", action="store_true", help="also find each side's largest batch that fits")
    ap.add_argument("--max-batch-limit", type=int, default=256)
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    shape = args.shape or ("qwen3-0.6b" if cuda else "tiny")
    B = args.batch_size or (4 if cuda else 2)
    T = args.seq_len or (2048 if cuda else 64)
    modes = args.compile_modes or (["default", "max-autotune-no-cudagraphs"] if cuda else ["eager"])
    dtype = "bfloat16" if cuda else "float32"
    c = model_config(shape, T, dtype)
    if cuda:
        from bench._gpu import warm_up

        warm_up()
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    print(
        f"xtrain bench finetune: shape={shape} params={c.num_params() / 1e6:.1f}M B={B} T={T} V={c.vocab_size} "
        f"device={dev} ({name}) dtype={dtype} (fp32 masters) torch={torch.__version__}"
    )
    rows = {}
    variants = {"plain": ("xtrain trainer", c), "recompute": ("xtrain trainer, recompute", replace(c, recompute=True))}
    builders = [(variants[v][0], lambda b, cv=variants[v][1]: xtrain_side(cv, dev, b, T)) for v in args.xtrain]
    builders += [(f"transformers {m}", lambda b, m=m: transformers_side(c, dev, b, T, m)) for m in modes]
    print(f"{'side':<42}{'step ms':>10}{'tokens/s':>12}{'peak GiB':>10}{'held GiB':>10}{'max batch':>11}"
          f"{'first loss':>12}")  # fmt: skip
    for label, make in builders:  # each row printed as its side ends (a long run cut short keeps what it measured)
        try:
            r = rows[label] = run_side(lambda make=make: make(B), dev, args.steps, args.warmup)
        except Exception as e:  # a compile mode that does not build here, a graph that falls back, out of memory
            print(f"  {label}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})")
            continue
        peak, held = (f"{r[k] / 2**30:.2f}" if r[k] is not None else "-" for k in ("peak", "held"))
        print(
            f"{label:<42}{r['ms']:>10.1f}{B * T / r['ms'] * 1e3:>12.0f}{peak:>10}{held:>10}{'':>11}{r['loss']:>12.4f}"
        )
        if args.max_batch:
            r["max_batch"] = max_batch(make, dev, B, args.max_batch_limit, resize=label.startswith("transformers"))
            lim = args.max_batch_limit
            print(f"  {label}: largest batch that fits {r['max_batch']} (to 1/16, limit {lim})", flush=True)
    hf = [r for k, r in rows.items() if k.startswith("transformers")]
    best = min(hf, key=lambda r: r["ms"]) if hf else None
    for label in (variants[v][0] for v in args.xtrain):
        ours = rows.get(label)
        if not (ours and best):
            continue
        print(f"{label} / transformers' fastest mode: tokens/s {best['ms'] / ours['ms']:.2f}x (goal >= 1.3x)", end="")
        if ours["peak"] is not None and best["peak"]:
            print(f", peak memory {ours['peak'] / best['peak']:.2f}x (goal <= 0.5x)", end="")
        if "max_batch" in ours and best.get("max_batch"):
            print(f", largest batch {ours['max_batch'] / best['max_batch']:.2f}x (goal >= 2x)", end="")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
