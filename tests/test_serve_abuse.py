"""One client cannot hurt another: degenerate but finite sampling settings are safe per request, and a
failure that belongs to one sequence of a batch (its prefill, its decode row, its logits) ends that sequence
alone while the others get exactly the tokens they get alone."""

import math
import threading

import pytest
import torch

from tests.test_serve import small
from xtrain.sampling import GREEDY_BELOW
from xtrain.serve.engine import Batcher, Engine, EngineConfig, Sampling, sample_rows


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


DEGENERATE = [
    Sampling(temperature=1e-40, seed=1),
    Sampling(temperature=1.0, top_p=1e-300, seed=2),
    Sampling(temperature=5e-324, top_p=1e-45, top_k=1, seed=3),
    Sampling(temperature=1e300, top_k=10**9, seed=4),
    Sampling(temperature=GREEDY_BELOW / 2, seed=5),
]


def test_degenerate_settings_sample_sensibly():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(DEGENERATE), 50, generator=g) * 30  # large logits: / 1e-40 overflows fp32
    gens = [torch.Generator().manual_seed(i) for i in range(len(DEGENERATE))]
    toks = sample_rows(logits, DEGENERATE, gens)
    greedy = logits.argmax(-1)
    assert toks[[0, 1, 2, 4]].tolist() == greedy[[0, 1, 2, 4]].tolist()  # tiny temperature / top_p: the argmax
    assert 0 <= int(toks[3]) < 50
    for s in DEGENERATE:  # each row alone draws what it draws in the batch
        assert s.greedy == (s.temperature < GREEDY_BELOW)
    again = [sample_rows(logits[b : b + 1], [s], [torch.Generator().manual_seed(b)]) for b, s in enumerate(DEGENERATE)]
    assert torch.cat(again).tolist() == toks.tolist()
    # rows no token can be drawn from come back as -1, their neighbours untouched
    bad = logits.clone()
    bad[1, 3], bad[2, 0], bad[3] = float("nan"), float("inf"), float("-inf")
    gens = [torch.Generator().manual_seed(i) for i in range(len(DEGENERATE))]
    assert sample_rows(bad, DEGENERATE, gens).tolist() == [toks[0].item(), -1, -1, -1, toks[4].item()]


@pytest.mark.parametrize(
    "bad",
    [
        Sampling(temperature=float("nan")),
        Sampling(temperature=-1.0),
        Sampling(temperature=float("inf")),
        Sampling(top_p=0.0),
        Sampling(top_p=float("nan")),
        Sampling(top_k=-2),
    ],
)
def test_invalid_settings_are_refused_at_submit(bad):
    b = Batcher(Engine(small()), EngineConfig(slots=1))  # not started: nothing would run
    with pytest.raises(ValueError, match="Sampling: need"):
        b.submit([([1, 2], 3, bad, None, lambda *a: None)])
    assert b.load()["waiting"] == 0


POISON = 200  # a prompt starting with this id is the faulty sequence


class FaultyEngine(Engine):
    """An engine whose failures belong to one sequence: the one whose prompt starts with POISON. ``mode``
    picks the failure: "prefill" raises in its prefill, "raise" raises in any decode batch holding its slot
    (and when decoded alone), "nan" puts nan into its row of the decode logits."""

    def __init__(self, model, mode):
        super().__init__(model)
        self.mode, self.poisoned, self.raised = mode, set(), 0

    def prefill(self, cache, slot, ids):
        if int(ids[0]) == POISON:
            self.poisoned.add(slot)
            if self.mode == "prefill":
                raise RuntimeError("planted prefill failure")
        else:
            self.poisoned.discard(slot)
        return super().prefill(cache, slot, ids)

    def step(self, cache, slots, tokens):
        hit = [b for b, s in enumerate(slots.tolist()) if s in self.poisoned]
        if hit and self.mode == "raise":
            self.raised += 1
            raise RuntimeError("planted decode failure")
        logits, greedy = super().step(cache, slots, tokens)
        if hit and self.mode == "nan":
            logits, greedy = logits.clone(), None  # (a graph's greedy ids were picked before the nan)
            logits[hit] = float("nan")
        return logits, greedy


def _together(b: Batcher, jobs):
    """Submit every (ids, n, sampling) at once, in one call, so they share decode steps -> [(tokens, finish)]."""
    out = [([], None) for _ in jobs]
    done = threading.Semaphore(0)

    def cb(i):
        def on_event(tok, lp, fin):
            if tok is not None:
                out[i][0].append(tok)
            if fin is not None:
                out[i] = (out[i][0], fin)
                done.release()

        return on_event

    b.submit([(ids, n, smp, None, cb(i)) for i, (ids, n, smp) in enumerate(jobs)])
    for _ in jobs:
        assert done.acquire(timeout=60)
    return out


@pytest.mark.parametrize("mode", ["prefill", "raise", "nan"])
def test_a_failing_sequence_fails_alone_and_the_others_are_unchanged(mode):
    m = small()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 150, (n,), generator=g).tolist() for n in (4, 9, 6)]
    settings = [Sampling(temperature=0), Sampling(temperature=0.9, top_k=30, top_p=0.9, seed=11), DEGENERATE[0]]
    alone = Batcher(Engine(m), EngineConfig(slots=4)).start()
    try:
        want = [alone.generate(p, 12, s) for p, s in zip(prompts, settings)]
    finally:
        alone.close()
    eng = FaultyEngine(m, mode)
    b = Batcher(eng, EngineConfig(slots=4)).start()
    try:
        jobs = [(prompts[0], 12, settings[0]), ([POISON, 5, 6], 12, settings[1])]
        jobs += [(prompts[1], 12, settings[1]), (prompts[2], 12, settings[2])]
        got = _together(b, jobs)
        assert got[1][1].startswith("error:"), got[1]
        assert [got[0], got[2], got[3]] == want  # bit-identical tokens, every one to its budget
        assert b.max_batch >= 3  # the healthy ones did share decode steps
        if mode == "raise":
            assert eng.raised >= 2  # the batch failed, then the faulty row alone
        assert b.generate(prompts[0], 12, settings[0]) == want[0]  # and the batcher keeps serving
        assert b.load()["running"] == 0
    finally:
        b.close()


def test_degenerate_request_beside_others_in_the_batcher():
    m = small()
    b = Batcher(Engine(m), EngineConfig(slots=6)).start()
    try:
        p = [1, 2, 3, 4]
        solo = b.generate(p, 10, Sampling(temperature=0.8, seed=9))
        jobs = [(p, 10, Sampling(temperature=0.8, seed=9))] + [(p, 10, s) for s in DEGENERATE]
        got = _together(b, jobs)
        assert got[0] == solo
        assert all(fin == "length" and len(t) == 10 for t, fin in got)
        greedy = b.generate(p, 10, Sampling(temperature=0))
        assert got[1] == greedy and got[2] == greedy  # temperature 1e-40, top_p 1e-300
        assert math.isfinite(sum(got[4][0]))
    finally:
        b.close()


# -- over HTTP: what clients send by default, and what a web page could send ---------------------------------

httpx = pytest.importorskip("httpx")

# The bodies LangChain's OpenAI classes send with their defaults (langchain_openai BaseOpenAI._default_params
# and ChatOpenAI's; the openai client sends a None argument as null)
LANGCHAIN_COMPLETION = {
    "model": "tiny-test",
    "prompt": ["def f(x):"],
    "temperature": 0.7,
    "top_p": 1,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "n": 1,
    "logit_bias": {},
    "seed": None,
    "logprobs": None,
    "max_tokens": 8,
}
LANGCHAIN_CHAT = {
    "model": "tiny-test",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": False,
    "n": 1,
    "temperature": 0.7,
    "max_tokens": 8,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": {},
    "logprobs": False,
    "response_format": None,
    "tools": None,
    "parallel_tool_calls": None,
}


class CountingTokenizer:
    """The byte tokenizer, counting the bytes it was asked to encode."""

    def __init__(self):
        from xtrain.data.tokenizer import ByteTokenizer

        self.inner = ByteTokenizer()
        self.eot_id, self.vocab_size, self.max_token_bytes = 256, 257, 1
        self.encoded = 0

    def encode(self, text):
        self.encoded += len(text)
        return self.inner.encode(text)

    def decode(self, ids):
        return self.inner.decode(ids)


@pytest.fixture(scope="module")
def server():
    from xtrain.serve.api import ServerConfig, Service
    from xtrain.serve.server import allowed_hosts, serve_in_thread

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = CountingTokenizer()
    cfg = ServerConfig(allowed_hosts=allowed_hosts("127.0.0.1", ["my.example"]))
    svc = Service(small().eval(), tok, "tiny-test", EngineConfig(slots=4, max_queue=8), cfg)
    url, stop = serve_in_thread(svc)
    yield url, svc, tok
    stop()
    torch.set_num_threads(threads)


def test_langchain_default_payloads_are_served(server):
    url = server[0]
    r = httpx.post(url + "/v1/completions", json=LANGCHAIN_COMPLETION, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    r = httpx.post(url + "/v1/chat/completions", json=LANGCHAIN_CHAT, timeout=60)
    assert r.status_code == 200, r.text
    # the same fields with values that would change the result are refused, naming the field
    for key, value, chat in [
        ("presence_penalty", 0.5, False),
        ("frequency_penalty", -1, True),
        ("logit_bias", {"50": 100}, False),
        ("suffix", "end", False),
        ("best_of", 3, False),
        ("echo", True, False),
        ("logprobs", True, True),
        ("tools", [{"type": "function"}], True),
        ("response_format", {"type": "json_object"}, True),
    ]:
        body = {**(LANGCHAIN_CHAT if chat else LANGCHAIN_COMPLETION), key: value}
        r = httpx.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=60)
        assert r.status_code == 400, (key, r.text)
        assert r.json()["error"]["param"] == key and "not supported" in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/v1/completions", json={**LANGCHAIN_COMPLETION, "suffix": None, "user": "u1"})
    assert r.status_code == 200, r.text


def test_degenerate_settings_over_http_do_not_touch_another_stream(server):
    url = server[0]
    body = {"prompt": "abc", "max_tokens": 20, "temperature": 0.9, "seed": 3, "stream": True, "ignore_eos": True}
    alone = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=60).json()["choices"][0]
    out = {}

    def stream():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            out["lines"] = [ln for ln in r.iter_lines() if ln.startswith("data: ")]

    th = threading.Thread(target=stream)
    th.start()
    for extra in ({"temperature": 1e-40}, {"top_p": 1e-300}, {"temperature": 5e-324, "top_p": 1e-320}):
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 5, **extra}, timeout=60)
        assert r.status_code == 200, (extra, r.text)
    th.join(60)
    assert out["lines"][-1] == "data: [DONE]"
    import json

    chunks = [json.loads(ln[6:]) for ln in out["lines"][:-1]]
    assert not any("error" in c for c in chunks), chunks
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == alone["text"]


def test_posts_need_json_and_a_known_host(server):
    url, _, _ = server
    port = url.rsplit(":", 1)[1]
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {} if ctype is None else {"Content-Type": ctype}
        r = httpx.post(url + "/v1/completions", content=b'{"prompt": "x"}', headers=headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", (ctype, r.text)
    ok = {"Content-Type": "application/json; charset=utf-8"}
    body = b'{"prompt": "x", "max_tokens": 2}'
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "MY.example"):
        r = httpx.post(url + "/v1/completions", content=body, headers={**ok, "Host": host})
        assert r.status_code == 200, (host, r.text)
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
        for method, path in (("POST", "/v1/completions"), ("GET", "/health"), ("GET", "/v1/models")):
            r = httpx.request(method, url + path, content=body, headers={**ok, "Host": host})
            assert r.status_code == 403 and "--allow-host" in r.json()["error"]["message"], (host, path, r.text)


def test_allowed_hosts_of_the_cli():
    from xtrain.serve.server import allowed_hosts

    assert allowed_hosts("127.0.0.1", []) == ("127.0.0.1", "localhost", "::1")
    assert allowed_hosts("0.0.0.0", []) is None  # every interface: its names are not known
    assert allowed_hosts("0.0.0.0", ["box.lan"]) == ("0.0.0.0", "localhost", "127.0.0.1", "::1", "box.lan")
    assert allowed_hosts("127.0.0.1", ["*"]) is None


def test_an_over_long_prompt_is_refused_before_it_is_tokenized(server):
    url, svc, tok = server
    before = tok.encoded
    for body in (
        {"prompt": "y" * 900_000},
        {"prompt": ["ok", "z" * 5000]},
        {"messages": [{"role": "user", "content": "w" * 900_000}]},
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert tok.encoded - before <= 10  # only "ok" was tokenized
    r = httpx.post(url + "/v1/completions", json={"prompt": "y" * 40, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text  # under the context still runs
