"""``xtrain bench serve`` (bench/serve.py): the OpenAI-compatible server under concurrent streaming clients,
and batch-1 decode against transformers' ``generate`` on the exported model.

1. Serving. A model of the preset (random weights: speed does not depend on them) behind the real server
   (FastAPI + uvicorn on a loopback port, in this process) with ``--slots`` cache slots. ``--clients``
   streaming completion requests of ``--tokens`` tokens each (``ignore_eos``, so every one runs to the end)
   are sent (a) one at a time and (b) all at once, by asyncio ``httpx`` clients that read the server-sent
   events. Per request: time to first token (request sent -> first content chunk) and the gaps between
   content chunks (inter-token latency); p50 / p95 over all requests. Throughput = tokens / wall time;
   the ratio (b) / (a) is what continuous batching buys. A failure is a non-200 answer, a missing
   ``[DONE]`` or a token count other than ``--tokens``.
2. Batch-1 decode. One prompt of ``--prompt-len`` tokens continued by ``--tokens`` greedy tokens with our
   KV-cache engine (``Engine.generate``: the model's forward with a slot cache, sampling on the device, decode CUDA
   graphs on a GPU) and with ``transformers`` ``generate(do_sample=False)`` on
   ``export_hf`` of the same weights (Qwen3ForCausalLM, its own KV cache, on the model's device in its compute
   dtype), same process,
   interleaved, median of ``--reps``. tokens/s = new tokens / time of the whole call (prefill included on
   both sides). The two must produce the same tokens (printed).

    xtrain bench serve [--preset tiny] [--clients 16] [--tokens 64] [--threads N] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time

import torch

from xtrain.config import preset
from xtrain.model import Model
from xtrain.serve.api import Service
from xtrain.serve.engine import Engine, EngineConfig, Sampling
from xtrain.serve.server import serve_in_thread


class IdTokenizer:
    """Token id i <-> the character U+4E00 + i (any vocab; every id one printable character); eot is id 0."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.eot_id = vocab_size, 0

    def encode(self, text: str) -> list[int]:
        return [(ord(ch) - 0x4E00) % self.vocab_size for ch in text]

    def decode(self, ids) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def one_request(client, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    times, n_text, done = [], 0, False
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"ok": False, "why": f"HTTP {r.status_code}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                if c.get("text"):
                    times.append(time.perf_counter())
                    n_text += len(c["text"])
    ok = done and n_text == body["max_tokens"]
    return {
        "ok": ok,
        "why": "" if ok else f"done={done} chars={n_text}",
        "ttft": times[0] - t0 if times else float("nan"),
        "itl": [b - a for a, b in zip(times, times[1:])],
        "end": time.perf_counter(),
    }


async def run_clients(url: str, bodies: list[dict], concurrent: bool):
    import httpx

    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        if concurrent:
            res = await asyncio.gather(*(one_request(client, url, b) for b in bodies))
        else:
            res = [await one_request(client, url, b) for b in bodies]
        return res, time.perf_counter() - t0


def serving(model, args) -> None:
    tok = IdTokenizer(model.config.vocab_size)
    svc = Service(model, tok, "bench", EngineConfig(slots=args.slots, max_queue=4 * args.clients))
    url, stop = serve_in_thread(svc)
    g = torch.Generator().manual_seed(0)
    bodies = [
        {
            "model": "bench",
            "prompt": tok.decode(torch.randint(1, model.config.vocab_size, (args.prompt_len,), generator=g).tolist()),
            "max_tokens": args.tokens,
            "temperature": 0.8,
            "top_k": 50,
            "seed": i,
            "stream": True,
            "ignore_eos": True,
        }
        for i in range(args.clients)
    ]
    try:
        asyncio.run(run_clients(url, bodies[:2], True))  # warm-up
        rows = []
        for name, conc in (("one at a time", False), (f"{args.clients} concurrent", True)):
            steps0 = svc.batcher.steps
            res, wall = asyncio.run(run_clients(url, bodies, conc))
            fails = [r["why"] for r in res if not r["ok"]]
            ttft = [r["ttft"] for r in res if r["ok"]]
            itl = [x for r in res if r["ok"] for x in r["itl"]]
            toks = args.clients * args.tokens
            rows.append((name, wall, toks / wall, ttft, itl, len(fails), svc.batcher.steps - steps0))
            if fails:
                print(f"  {name}: failures: {fails[:3]}")
    finally:
        stop()
    print(
        f"\nserving: {args.clients} streaming requests x {args.tokens} tokens, prompt {args.prompt_len} tokens, "
        f"{args.slots} slots"
    )
    print(
        "| mode | wall s | tokens/s | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms | decode steps | failures |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, wall, tps, ttft, itl, nf, steps in rows:
        print(
            f"| {name} | {wall:.2f} | {tps:.0f} | {1e3 * pct(ttft, 0.5):.1f} | {1e3 * pct(ttft, 0.95):.1f} | "
            f"{1e3 * pct(itl, 0.5):.1f} | {1e3 * pct(itl, 0.95):.1f} | {steps} | {nf} |"
        )
    print(f"throughput ratio concurrent / one at a time: {rows[1][2] / rows[0][2]:.2f}x (goal >= 4x)")


def batch1(model, args) -> None:
    import transformers

    from xtrain.export import export_hf

    with tempfile.TemporaryDirectory() as d:
        export_hf(model.config, model.state_dict(), d, dtype="float32")
        # on the model's device in its compute dtype: the same work as ours
        hf = transformers.AutoModelForCausalLM.from_pretrained(d).to(model.device, model.compute_dtype).eval()
    eng = Engine(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (1, args.prompt_len), generator=g).to(model.device)
    prompt = ids[0].tolist()
    n = args.tokens

    def ours():
        return eng.generate([prompt], n, Sampling(temperature=0))[0]

    eng_plain = Engine(model, cuda_graph=False) if model.device.type == "cuda" else None

    def ours_plain():
        return eng_plain.generate([prompt], n, Sampling(temperature=0))[0]

    def theirs():
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
                eos_token_id=None,
            )
        return out[0, ids.shape[1] :].tolist()

    def sync():
        if model.device.type == "cuda":
            torch.cuda.synchronize()

    a, b = ours(), theirs()  # warm-up, and the tokens to compare
    t_ours, t_hf, t_plain = [], [], []
    if eng_plain is not None:
        assert ours_plain() == a, "decode with and without CUDA graphs gave different greedy tokens"
    for _ in range(args.reps):
        if eng_plain is not None:
            sync()
            t = time.perf_counter()
            ours_plain()
            sync()
            t_plain.append(time.perf_counter() - t)
        sync()
        t = time.perf_counter()
        ours()
        sync()
        t_ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        theirs()
        sync()
        t_hf.append(time.perf_counter() - t)
    mo, mh = statistics.median(t_ours), statistics.median(t_hf)
    same = sum(x == y for x, y in zip(a, b))
    print(f"\nbatch-1 decode: prompt {args.prompt_len} + {n} greedy tokens, median of {args.reps}")
    print("| engine | s per call | tokens/s |")
    print("|---|---|---|")
    print(f"| xtrain Engine.generate (KV cache) | {mo:.3f} | {n / mo:.0f} |")
    if t_plain:
        mp = statistics.median(t_plain)
        print(f"| xtrain Engine.generate, no CUDA graphs | {mp:.3f} | {n / mp:.0f} |")
    hf_name = f"transformers {transformers.__version__} generate ({str(model.compute_dtype)[6:]}, {model.device.type})"
    print(f"| {hf_name} | {mh:.3f} | {n / mh:.0f} |")
    print(f"ratio xtrain / transformers: {mh / mo:.2f}x ; same greedy tokens: {same}/{n}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="xtrain bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--skip", choices=["serving", "batch1"], default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the model's compute dtype")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = Model(preset(args.preset, compute_dtype=args.dtype), device=args.device, seed=0).eval()
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    print(
        f"bench serve: preset {args.preset} ({model.num_params() / 1e6:.1f}M params), device {args.device}, "
        f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}, load average {load[0]:.2f}"
    )
    if args.skip != "serving":
        serving(model, args)
    if args.skip != "batch1":
        batch1(model, args)
    return 0
