"""The closed loop train -> export -> serve: for several prompts, the server's greedy tokens equal
``xtrain sample --temperature 0`` and transformers' ``generate(do_sample=False)`` on ``xtrain export`` of the
same run; two exports are byte-identical; decoding the prompts together gives each the tokens it gets alone."""

import hashlib
import threading

import pytest
import torch

from xtrain.cli import main
from xtrain.serve.engine import Sampling
from xtrain.serve.server import load_service, serve_in_thread

PROMPTS = ["def ", "import os\n", "class Path(", "    return "]
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
    import inspect
    import json
    import pathlib

    tmp = tmp_path_factory.mktemp("loop")
    corpus = tmp / "corpus"
    corpus.mkdir()
    src = "".join(inspect.getsource(m)[:40_000] for m in (json, pathlib, inspect))
    for i in range(60):
        (corpus / f"doc{i:02d}.py").write_text(src[i * 2000 : (i + 1) * 2000])
    mp = pytest.MonkeyPatch()
    mp.setenv("XTRAIN_CACHE", str(tmp / "cache"))
    args = ["--data", str(corpus), "--vocab-size", "300", "--steps", "6", "--batch-size", "4", "--seq-len", "32"]
    args += ["--eval-every", "6", "--eval-batches", "1", "--warmup", "2", "--no-progress", "--sample-tokens", "0"]
    try:
        assert main(["train", *args, "--out", str(tmp / "run")]) == 0
    finally:
        mp.undo()
    return tmp / "run"


def _md5(path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.mark.slow  # trains a run, loads transformers, samples through the CLI: about a minute on a busy 2-core box
def test_server_equals_sample_equals_transformers(run_dir, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    openai = pytest.importorskip("openai")
    from xtrain.train.sample_cli import load_run_tokenizer

    tok = load_run_tokenizer(run_dir)
    for d in ("e1", "e2"):
        assert main(["export", str(run_dir), "--out", str(tmp_path / d), "--dtype", "float32"]) == 0
    assert _md5(tmp_path / "e1" / "model.safetensors") == _md5(tmp_path / "e2" / "model.safetensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "e1")).float().eval()

    svc = load_service(run_dir, "cpu")
    url, stop = serve_in_thread(svc)
    try:
        lengths = []
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt in PROMPTS:
            ids = [tok.eot_id] + tok.encode(prompt)  # the end-of-text prepend done by hand (see export)
            with torch.no_grad():
                out = hf.generate(
                    torch.tensor([ids]),
                    do_sample=False,
                    max_new_tokens=NEW,
                    eos_token_id=tok.eot_id,
                    pad_token_id=tok.eot_id,
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                )
            hf_new = out[0, len(ids) :].tolist()
            if tok.eot_id in hf_new:
                hf_new = hf_new[: hf_new.index(tok.eot_id)]

            engine_new, finish = svc.batcher.generate(ids, NEW, Sampling(temperature=0), eos_id=tok.eot_id)
            assert engine_new == hf_new, prompt
            lengths.append(len(hf_new))
            assert finish == ("stop" if len(hf_new) < NEW else "length")

            r = client.completions.create(model=svc.name, prompt=prompt, max_tokens=NEW, temperature=0)
            assert r.choices[0].text == tok.decode(hf_new) and r.usage.completion_tokens == len(hf_new)

            capsys.readouterr()
            rc = main(["sample", str(run_dir), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", str(NEW)])
            assert rc == 0
            assert capsys.readouterr().out == prompt + tok.decode(hf_new) + "\n"

        assert max(lengths) >= 8, lengths  # the comparison saw real continuations, not an immediate end
        # together: every prompt's greedy tokens as alone
        alone = [svc.batcher.generate([tok.eot_id] + tok.encode(p), NEW, Sampling(temperature=0)) for p in PROMPTS]
        got = [None] * len(PROMPTS)

        def go(i):
            got[i] = svc.batcher.generate([tok.eot_id] + tok.encode(PROMPTS[i]), NEW, Sampling(temperature=0))

        ths = [threading.Thread(target=go, args=(i,)) for i in range(len(PROMPTS))]
        for t in ths:
            t.start()
        for t in ths:
            t.join(60)
        assert got == alone
    finally:
        stop()
