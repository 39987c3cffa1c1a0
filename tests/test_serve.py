"""The KV-cache engine computes the model's logits and greedy tokens; the HTTP server answers on loopback."""

import json
import threading
import urllib.error
import urllib.request

import pytest
import torch

from xtrain.autograd import no_grad
from xtrain.config import ModelConfig
from xtrain.data.tokenizer import ByteTokenizer
from xtrain.model import Model
from xtrain.serve.engine import Engine
from xtrain.serve.server import Service, make_server


def small(**kw):
    base = dict(
        vocab_size=257,
        n_layer=2,
        n_embd=48,
        n_head=6,
        n_kv_head=2,
        head_dim=16,
        ffn_dim=80,
        max_seq_len=48,
        init_std=0.2,
    )
    base.update(kw)
    return Model(ModelConfig(**base), seed=5)


@pytest.mark.parametrize("tie", [False, True])
def test_cached_logits_equal_full_window_logits(tie):
    m = small(tie_embeddings=tie)
    e = Engine(m)
    ids = torch.randint(0, 257, (3, 20), generator=torch.Generator().manual_seed(0))
    with no_grad():
        ref = m.forward(ids).data  # [B, T, V], every position from the full window
    caches = e.new_caches(3, 20)
    got = [e._forward(ids[:, :7], caches, 0)]  # prefill 7, then one position at a time
    got += [e._forward(ids[:, t : t + 1], caches, t) for t in range(7, 20)]
    got = torch.stack(got, dim=1)  # [B, 14, V] for positions 6..19
    assert (got - ref[:, 6:]).abs().max() <= 1e-5 * ref.abs().max()


def test_greedy_tokens_equal_model_generate_and_stream():
    m = small()
    ids = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(1))
    seen = []
    out = Engine(m).generate(ids, 15, temperature=0, stream=lambda i, t: seen.append(t.clone()))
    assert torch.equal(out, m.generate(ids, 15, temperature=0))
    assert torch.equal(torch.stack(seen, 1), out[:, 9:])
    a = Engine(m).generate(ids, 10, temperature=0.9, top_k=20, seed=4)
    assert torch.equal(a, Engine(m).generate(ids, 10, temperature=0.9, top_k=20, seed=4))


def test_engine_rejects_bad_input():
    e = Engine(small())
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len"):
        e.generate(torch.zeros(1, 40, dtype=torch.long), 20)
    with pytest.raises(ValueError, match="token ids must lie"):
        e.generate(torch.full((1, 3), 999), 2)
    with pytest.raises(ValueError, match="integer tensor"):
        e.generate(torch.zeros(1, 3), 2)


@pytest.fixture
def server():
    srv = make_server(Service(small().eval(), ByteTokenizer(), "test"), "127.0.0.1", 0)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _post(url, body: bytes):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_server(server):
    with urllib.request.urlopen(server + "/health", timeout=30) as r:
        h = json.loads(r.read())
    assert h["status"] == "ok" and h["vocab_size"] == 257
    req = json.dumps({"prompt": "def ", "max_tokens": 8, "temperature": 0}).encode()
    s1, r1 = _post(server + "/v1/completions", req)
    s2, r2 = _post(server + "/v1/completions", req)
    assert s1 == s2 == 200 and r1["text"] == r2["text"]
    assert r1["prompt_tokens"] == 5 and r1["finish_reason"] in ("stop", "length")
    assert r1["completion_tokens"] <= 8
    assert _post(server + "/v1/completions", b"{not json")[0] == 400
    code, err = _post(server + "/v1/completions", json.dumps({"prompt": "x", "tokens": 3}).encode())
    assert code == 400 and "unknown fields" in err["error"]
    code, err = _post(server + "/v1/completions", json.dumps({"prompt": "x", "max_tokens": "3"}).encode())
    assert code == 400 and "max_tokens" in err["error"]
    code, err = _post(server + "/v1/completions", json.dumps({"prompt": "x" * 100}).encode())
    assert code == 400 and "context holds 48" in err["error"]
    assert _post(server + "/nope", b"{}")[0] == 404
