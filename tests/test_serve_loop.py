"""The closed loop run -> export -> serve, on a model whose greedy continuation depends on the whole prompt:
for prompts of different lengths, the server (prompts submitted together, and streamed over HTTP at the same
time), ``xtrain sample --temperature 0`` and the model's own full-window ``generate`` give the tokens of
transformers' ``generate(do_sample=False)`` on ``xtrain export`` of the same run; two exports are
byte-identical.

The run is a real run directory (``config.json``, weights, tokenizer) whose weights are drawn at std 0.3
rather than trained: a few training steps give a model that repeats one token for every prompt, on which a
broken KV cache, RoPE offset, mask or batching would pass. The test first checks that the continuations
differ between prompts, also between two prompts that end in the same tokens (a decoder that saw only the
last token would give them the same continuation), and that every greedy choice wins by a margin far above
fp32 rounding (so two correct implementations cannot disagree on a near-tie)."""

import hashlib
import inspect
import json
import pathlib
import shutil
import threading

import pytest
import torch

from xtrain.autograd import no_grad
from xtrain.cli import main
from xtrain.config import ModelConfig
from xtrain.data.tokenizer import Tokenizer
from xtrain.model import Model
from xtrain.serve.engine import Sampling
from xtrain.serve.server import load_service, serve_in_thread
from xtrain.train import checkpoint as ck
from xtrain.train.optim import AdamW

# different lengths; the last two end in the same tokens ("\n    return ")
PROMPTS = ["def ", "class Path(object):\n    def __init__(self, *args):\n        return ", "x = 1\n    return "]
NEW = 24


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models: intra-op threads only add wake-up latency, which on a loaded 2-core machine turned a
    one-second test into twenty-five."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as ``xtrain train`` writes it: tokenizer.json, config.json, weights, trainer state."""
    run = tmp_path_factory.mktemp("loop") / "run"
    src = "".join(inspect.getsource(m)[:40_000] for m in (json, pathlib, inspect))
    tok = Tokenizer.train([src[i * 2000 : (i + 1) * 2000] for i in range(60)], vocab_size=300)
    cfg = ModelConfig(vocab_size=tok.vocab_size, n_layer=2, n_embd=64, n_head=4, n_kv_head=2, head_dim=16,
                      ffn_dim=128, max_seq_len=96, init_std=0.3, attention="composed", loss="composed")  # fmt: skip
    m = Model(cfg, seed=1)
    ck.save_checkpoint(run, model=m, optimizer=AdamW(m.params, lr=1e-3), trainer_state={"step": 0})
    tok.save(run / "tokenizer.json")
    return run


def _md5(path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _cut(new, eot):
    return new[: new.index(eot)] if eot in new else new


def test_server_equals_sample_equals_transformers(run_dir, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    openai = pytest.importorskip("openai")
    from xtrain.train.sample_cli import load_run_tokenizer

    tok = load_run_tokenizer(run_dir)
    prompts = [[tok.eot_id] + tok.encode(p) for p in PROMPTS]  # the end-of-text prepend, as training and export
    assert len({len(p) for p in prompts}) == len(prompts) and prompts[1][-3:] == prompts[2][-3:]
    for d in ("e1", "e2"):
        assert main(["export", str(run_dir), "--out", str(tmp_path / d), "--dtype", "float32"]) == 0
    assert _md5(tmp_path / "e1" / "model.safetensors") == _md5(tmp_path / "e2" / "model.safetensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "e1")).float().eval()

    # the oracle: transformers' own KV cache and RoPE, one prompt at a time
    want = []
    for ids in prompts:
        with torch.no_grad():
            mask = torch.ones(1, len(ids), dtype=torch.long)
            kw = dict(eos_token_id=tok.eot_id, pad_token_id=tok.eot_id, attention_mask=mask)
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW, **kw)
        want.append(_cut(out[0, len(ids) :].tolist(), tok.eot_id))
    # the inputs can tell a broken decoder from a working one
    assert all(len(w) == NEW for w in want), [len(w) for w in want]  # real continuations, no early end
    assert len({tuple(w) for w in want}) == len(want), want  # depends on the prompt ...
    assert want[1][:4] != want[2][:4]  # ... and on more than its last tokens
    assert all(len(set(w)) > NEW // 2 for w in want), want  # not one token repeated
    with torch.no_grad():  # every greedy choice is clear: top-1 beats top-2 by far more than fp32 rounding
        for ids, w in zip(prompts, want):
            logits = hf(torch.tensor([ids + w])).logits[0, len(ids) - 1 : -1]  # [NEW, V]
            top2 = logits.topk(2, dim=-1).values
            assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3

    # greedy decoding with the model's full-window forward (no cache)
    model = ck.load_model(run_dir)
    with no_grad():
        for ids, w in zip(prompts, want):
            seq = list(ids)
            for _ in range(NEW):
                seq.append(int(model.forward(torch.tensor([seq])).data[0, -1].argmax()))
            assert _cut(seq[len(ids) :], tok.eot_id) == w
    for prompt, w in zip(PROMPTS, want):
        capsys.readouterr()
        rc = main(["sample", str(run_dir), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", str(NEW)])
        assert rc == 0
        assert capsys.readouterr().out == prompt + tok.decode(w) + "\n"

    svc = load_service(run_dir, "cpu")
    url, stop = serve_in_thread(svc)
    try:
        # the engine: all prompts submitted at once, so they are prefilled and decoded in one batch of rows at
        # different positions
        got = [[] for _ in prompts]
        done = [threading.Event() for _ in prompts]

        def listener(i):
            def on_event(t, lp, fin):
                if t is not None:
                    got[i].append(t)
                if fin is not None:
                    done[i].set()

            return on_event

        reqs = [(ids, NEW, Sampling(temperature=0), tok.eot_id, listener(i)) for i, ids in enumerate(prompts)]
        svc.batcher.submit(reqs)
        assert all(d.wait(60) for d in done)
        assert svc.batcher.max_batch == len(prompts)  # they shared decode steps
        assert got == want

        # over HTTP, streamed, all requests in flight together
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        texts, errors = [None] * len(PROMPTS), []
        start = threading.Barrier(len(PROMPTS))

        def go(i):
            try:
                start.wait(10)
                stream = client.completions.create(
                    model=svc.name, prompt=PROMPTS[i], max_tokens=NEW, temperature=0, stream=True
                )
                texts[i] = "".join(c.choices[0].text for c in stream if c.choices)
            except Exception as e:  # reported by the main thread
                errors.append(e)

        ths = [threading.Thread(target=go, args=(i,)) for i in range(len(PROMPTS))]
        for t in ths:
            t.start()
        for t in ths:
            t.join(60)
        assert not errors, errors
        assert texts == [tok.decode(w) for w in want]
        # and one request at a time, not streamed
        for prompt, w in zip(PROMPTS, want):
            r = client.completions.create(model=svc.name, prompt=prompt, max_tokens=NEW, temperature=0)
            assert r.choices[0].text == tok.decode(w) and r.usage.completion_tokens == len(w)
    finally:
        stop()


def test_a_run_trained_in_bf16_serves_in_fp32_on_the_cpu(run_dir, tmp_path, capsys):
    """A run trained in bf16 (on a GPU) loaded on the CPU for ``sample``/``serve`` computes in float32 from its fp32
    masters (said on stderr): its logits are the fp32 run's, which is what the fp32 export gives transformers."""
    from xtrain.train.sample_cli import load_run

    bf16 = tmp_path / "bf16"
    shutil.copytree(run_dir, bf16)
    cfg = json.loads((bf16 / "config.json").read_text())
    cfg["model"]["compute_dtype"] = "bfloat16"
    (bf16 / "config.json").write_text(json.dumps(cfg))
    (m32, _), (m16, _) = load_run(run_dir, "cpu", "t"), load_run(bf16, "cpu", "t")
    assert "computing in float32 on the CPU (the run trained in bfloat16)" in capsys.readouterr().err
    ids = torch.arange(20)[None] % m32.config.vocab_size
    with no_grad():
        assert m16.compute_dtype == torch.float32 and torch.equal(m16.forward(ids).data, m32.forward(ids).data)
