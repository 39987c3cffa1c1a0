"""Decode speed of this checkout against an older one, on the same machine in one run (issue 58's CPU goals).

    git archive 3319483 | (mkdir -p /tmp/xtrain-base && tar -x -C /tmp/xtrain-base)
    python dev/decode_old_new.py --old /tmp/xtrain-base [--reps 5] [--threads 1]

Two measurements, each in a fresh subprocess per checkout (PYTHONPATH set to it), the checkouts alternating
within every round (the machine is shared: interleaving spreads load changes over both), medians reported:

1. batch-1 decode: the tiny preset (random weights, seed 0), a 16-token prompt continued by 128 greedy tokens
   with the checkout's KV-cache engine (``Engine.generate``; prefill included), median of 5 calls after a
   warm-up call; tokens/s = 128 / time. Also the median decode step alone (``Engine.decode``). The two
   checkouts' greedy tokens must agree (within the context both compute the same function).
2. ``xtrain sample RUN --max-new-tokens 1000 --temperature 0`` (the CLI, wall time of the process: start-up,
   loading and tokenizer included) on a run directory of the tiny preset (random weights, a BPE tokenizer of
   4096 ids trained here on the standard library's sources). The number of tokens each produced is counted
   once, in-process, outside the timing (an end-of-text would stop a sample early).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NEW = Path(__file__).resolve().parents[1]

DECODE = r"""
import json, statistics, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
from xtrain.autograd import no_grad
from xtrain.config import preset
from xtrain.model import Model
import xtrain.serve.engine as E
m = Model(preset("tiny"), seed=0).eval()
eng = E.Engine(m)
ids = torch.randint(1, m.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
new_api = hasattr(E, "SlotCache") and "model" in E.SlotCache.__init__.__code__.co_varnames[:2]
def gen():
    with no_grad():
        if new_api:
            return eng.generate([ids[0].tolist()], 128, E.Sampling(temperature=0))[0]
        return eng.generate(ids, 128, temperature=0)[0, 16:].tolist()
toks = gen()
calls = []
for _ in range(5):
    t = time.perf_counter(); gen(); calls.append(time.perf_counter() - t)
with no_grad():
    cache = E.SlotCache(m if new_api else eng, 1, 256)
    eng.prefill(cache, 0, ids[0])
    slots, tok, steps = torch.tensor([0]), torch.tensor([5]), []
    for _ in range(128):
        t = time.perf_counter(); eng.decode(cache, slots, tok); steps.append(time.perf_counter() - t)
print(json.dumps({"call": statistics.median(calls), "step": statistics.median(steps), "tokens": toks}))
"""

COUNT = r"""
import json, sys, torch
from pathlib import Path
from xtrain.autograd import no_grad
from xtrain.train import checkpoint as ck
from xtrain.train.sample_cli import load_run_tokenizer
run, n = Path(sys.argv[1]), int(sys.argv[2])
tok = load_run_tokenizer(run)
model = ck.load_model(run).eval()
ids = [tok.eot_id] + tok.encode("def ")
with no_grad():
    if hasattr(model, "generate"):
        new = model.generate(torch.tensor([ids]), n, temperature=0.0, eos_id=tok.eot_id)[0, len(ids):].tolist()
        new = new[: new.index(tok.eot_id)] if tok.eot_id in new else new
    else:
        from xtrain.sampling import Sampling
        from xtrain.serve.engine import Engine
        new = Engine(model).generate([ids], n, Sampling(temperature=0), eos_id=tok.eot_id, slide=True)[0]
print(json.dumps({"tokens": len(new)}))
"""


def env_for(root: Path, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS=str(threads))
    env.pop("TRITON_INTERPRET", None)
    return env


def py(root: Path, threads: int, code: str, *args) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env_for(root, threads), capture_output=True,
                       text=True, timeout=1800, cwd=tempfile.gettempdir())  # fmt: skip
    if r.returncode != 0:
        raise SystemExit(f"{root}: failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def cli_seconds(root: Path, threads: int, run: Path, n: int) -> float:
    cmd = [sys.executable, "-m", "xtrain.cli", "sample", str(run), "--prompt", "def ", "--max-new-tokens", str(n),
           "--temperature", "0", "--device", "cpu"]  # fmt: skip
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env_for(root, threads), capture_output=True, text=True, timeout=3600,
                       cwd=tempfile.gettempdir())  # fmt: skip
    if r.returncode != 0:
        raise SystemExit(f"{root}: xtrain sample failed:\n{r.stderr[-3000:]}")
    return time.perf_counter() - t


def make_run(d: Path) -> Path:
    """A run directory of the tiny preset: random weights (seed 0), a 4096-id BPE tokenizer of stdlib sources."""
    import inspect
    import json as json_mod
    import pathlib

    from xtrain.config import preset
    from xtrain.data.tokenizer import Tokenizer
    from xtrain.model import Model
    from xtrain.train import checkpoint as ck
    from xtrain.train.optim import AdamW

    src = "".join(inspect.getsource(m) for m in (json_mod, pathlib, inspect, argparse, subprocess))
    tok = Tokenizer.train([src[i : i + 4000] for i in range(0, len(src), 4000)], vocab_size=4096)
    m = Model(preset("tiny", vocab_size=tok.vocab_size), seed=0)
    run = d / "run"
    ck.save_checkpoint(run, model=m, optimizer=AdamW(m.params, lr=1e-3), trainer_state={"step": 0})
    tok.save(run / "tokenizer.json")
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, required=True, help="a checkout of the older commit")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads in each subprocess")
    p.add_argument("--tokens", type=int, default=1000, help="xtrain sample --max-new-tokens")
    p.add_argument("--skip-sample", action="store_true")
    args = p.parse_args()
    roots = {"old": args.old.resolve(), "new": NEW}
    print(f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}, torch threads {args.threads}")
    with tempfile.TemporaryDirectory() as d:
        run = make_run(Path(d))
        if not args.skip_sample:
            counts = {k: py(r, args.threads, COUNT, run, args.tokens)["tokens"] for k, r in roots.items()}
            print(f"xtrain sample tokens produced (greedy, prompt 'def '): {counts}")
        res = {k: {"call": [], "step": [], "sample": []} for k in roots}
        toks = {}
        for rep in range(args.reps):
            for k in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                out = py(roots[k], args.threads, DECODE, args.threads)
                res[k]["call"].append(out["call"])
                res[k]["step"].append(out["step"])
                toks[k] = out["tokens"]
                if not args.skip_sample:
                    res[k]["sample"].append(cli_seconds(roots[k], args.threads, run, args.tokens))
            print(f"round {rep + 1}: " + ", ".join(f"{k} {res[k]['call'][-1]:.3f}s" for k in roots), flush=True)
    med = {k: {m: statistics.median(v) if v else float("nan") for m, v in r.items()} for k, r in res.items()}
    print(f"\nbatch-1 decode, tiny preset, prompt 16 + 128 greedy tokens, median of {args.reps} rounds (each the "
          f"median of 5 calls), load average now {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("| checkout | generate s | tokens/s | decode step ms | xtrain sample --max-new-tokens "
          f"{args.tokens} s |\n|---|---|---|---|---|")  # fmt: skip
    for k in roots:
        m = med[k]
        print(f"| {k} ({roots[k]}) | {m['call']:.3f} | {128 / m['call']:.0f} | {1e3 * m['step']:.2f} | "
              f"{m['sample']:.1f} |")  # fmt: skip
    print(
        f"new / old tokens/s: {med['old']['call'] / med['new']['call']:.2f}x; decode step old / new: "
        f"{med['old']['step'] / med['new']['step']:.2f}x; xtrain sample speed-up: "
        f"{med['old']['sample'] / med['new']['sample']:.1f}x; same greedy tokens: {toks['old'] == toks['new']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
