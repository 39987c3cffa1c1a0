"""``xtrain sample RUN``: text from a trained run.

Loads the run's config and weights (model.safetensors) and its tokenizer (the run's tokenizer.json, or the
data directory's), encodes the prompt, and samples token by token through the serving engine (KV cache; the
samples of --num-samples decode together, each what its seed gives alone): logits of the last position divided
by the temperature, cut to the top-k tokens and then to the smallest set whose probability reaches top-p
(nucleus sampling), drawn with a generator seeded per sample. Temperature 0 is greedy (argmax), with no
randomness. Past the model's context a sample goes on from its last half context (re-read once per half
context).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

MAX_NEW_TOKENS = 16384  # past this a CPU sample runs for many minutes without a line of output


def load_run_tokenizer(run_dir: Path, vocab_size: int | None = None):
    """The run's tokenizer (its own tokenizer.json, else its data directory's); with ``vocab_size`` (the
    model's), one of another vocabulary is refused (ValueError); a run fine-tuned from a Hugging Face checkpoint
    (its tokenizer_config.json kept) may have a model vocabulary padded past the tokenizer's."""
    from xtrain.data.tokenizer import load_tokenizer
    from xtrain.train import checkpoint as ckpt_io

    if (run_dir / "tokenizer.json").is_file():  # a run fine-tuned from a Hugging Face checkpoint may be padded
        padded = (run_dir / "tokenizer_config.json").is_file()
        return load_tokenizer(run_dir / "tokenizer.json", vocab_size, padded=padded)
    _, tcfg = ckpt_io.read_config(run_dir)
    data_dir = tcfg.extra.get("data_dir") if tcfg else None
    if data_dir and Path(data_dir).is_dir():
        return load_tokenizer(data_dir, vocab_size)
    raise FileNotFoundError(f"{run_dir}: no tokenizer.json in the run directory or its data directory")


def load_run(run_dir: Path, device: str | None, prog: str):
    """-> (model in eval mode on ``device`` (None: cuda when available), tokenizer) of a run, for inference
    (``xtrain sample``, ``xtrain serve``); the checkpoint's notes go to stderr after ``prog``. A missing or corrupt
    tokenizer stops before the weights load, one of another vocabulary right after (ValueError). On the CPU a run
    trained in bf16 or fp16 (on a GPU) computes in float32 from its fp32 masters, as training on the CPU does:
    the CPU's half-precision matmuls are slower than its fp32 ones (said on stderr)."""
    from xtrain.device import resolve_device
    from xtrain.model import Model
    from xtrain.train import checkpoint as ckpt_io

    device = resolve_device(device)
    load_run_tokenizer(run_dir)
    ck = ckpt_io.read_checkpoint(run_dir, with_optimizer=False)
    for note in ck.notes:
        print(f"{prog}: {note}", file=sys.stderr)
    tok = load_run_tokenizer(run_dir, ck.model_config.vocab_size)
    cfg = ck.model_config
    if device == "cpu" and cfg.compute_dtype in ("bfloat16", "float16"):
        print(f"{prog}: computing in float32 on the CPU (the run trained in {cfg.compute_dtype})", file=sys.stderr)
        ck = dataclasses.replace(ck, model_config=dataclasses.replace(cfg, compute_dtype="float32"))
    model = Model(ck.model_config, device=device).eval()
    ckpt_io.restore(ck, model)
    return model, tok


SAMPLE_ROWS = 8  # samples decoded together: a cache row each (the whole context of every layer)


def sample_texts(model, run_dir, prompt: str, max_new_tokens: int, temperature: float, top_k: int | None,
                 top_p: float | None, seeds: list[int], tokenizer=None) -> list[str]:  # fmt: skip
    """One continuation of ``prompt`` per seed, each ending at the tokenizer's end-of-text, decoded together (up
    to SAMPLE_ROWS at a time) by ``Engine.generate``: each is what its seed gives alone. ``tokenizer``: the run's,
    when the caller has it (``load_run``'s), else read from ``run_dir``."""
    from xtrain.sampling import Sampling
    from xtrain.serve.engine import Engine

    tok = tokenizer or load_run_tokenizer(Path(run_dir), model.config.vocab_size)
    ids = [tok.eot_id] + tok.encode(prompt)  # documents start after an end-of-text token in training
    ids = ids[-model.config.max_seq_len :]  # a prompt longer than the context keeps its end
    engine = Engine(model)
    smp = [Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=s).validate() for s in seeds]
    out = []
    for i in range(0, len(seeds), SAMPLE_ROWS):
        part = smp[i : i + SAMPLE_ROWS]
        out += engine.generate([ids] * len(part), max_new_tokens, part, eos_id=tok.eot_id, slide=True)
    return [prompt + tok.decode(new) for new in out]


def sample_text(model, run_dir, prompt: str = "", max_new_tokens: int = 200, temperature: float = 1.0,
                top_k: int | None = None, top_p: float | None = None, seed: int = 0) -> str:  # fmt: skip
    """One continuation of ``prompt`` (``sample_texts`` with one seed)."""
    return sample_texts(model, run_dir, prompt, max_new_tokens, temperature, top_k, top_p, [seed])[0]


def add_parser(subparsers) -> None:
    from xtrain import argtypes as A

    p = subparsers.add_parser(
        "sample",
        help="sample text from a trained run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", help="run directory (written by xtrain train)")
    p.add_argument("--prompt", type=A.utf8_text, default="", help="text to continue, UTF-8 (default: empty)")
    p.add_argument(
        "--max-new-tokens",
        type=A.int_in(0, MAX_NEW_TOKENS),
        default=200,
        help=f"tokens to generate, at most {MAX_NEW_TOKENS} (default 200)",
    )
    p.add_argument(
        "--temperature",
        type=A.nonnegative_float,
        default=0.8,
        help="softmax temperature; 0 = greedy (default 0.8)",
    )
    p.add_argument("--top-k", type=A.count, default=50, help="keep the k most likely tokens (0: off; default 50)")
    p.add_argument(
        "--top-p",
        type=A.float_in(0.0, 1.0, lo_open=True),
        default=0.95,
        help="nucleus probability mass (1: off; default 0.95)",
    )
    p.add_argument("--seed", type=A.seed, default=0, help="sampling seed (default 0)")
    p.add_argument(
        "--num-samples", type=A.int_in(1, 1000), default=1, help="how many samples (seeds seed, seed+1, ...)"
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.set_defaults(func=run)


def run(args) -> int:
    run_dir = Path(args.run)
    try:
        model, tok = load_run(run_dir, args.device, "xtrain sample")
        seeds = [args.seed + i for i in range(args.num_samples)]
        texts = sample_texts(model, run_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_k or None,
                             args.top_p, seeds, tok)  # fmt: skip
        for i, text in enumerate(texts):
            if args.num_samples > 1:
                print(f"--- sample {i + 1} (seed {args.seed + i}) ---")
            print(text)
    except (ValueError, FileNotFoundError) as e:
        print(f"xtrain sample: {e}", file=sys.stderr)
        return 2
    return 0
