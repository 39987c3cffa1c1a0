"""The OpenAI-compatible server driven by the official ``openai`` client (and raw HTTP for what the client
cannot send): completions, chat, streaming, n > 1, logprobs, and every bad request getting its 4xx in
OpenAI's error shape while the server keeps serving."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.test_serve import small
from xtrain.data.tokenizer import ByteTokenizer
from xtrain.serve.api import ServerConfig, Service, chat_prompt
from xtrain.serve.engine import EngineConfig, Sampling
from xtrain.serve.server import serve_in_thread

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def server():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: intra-op threads only add wake-up latency on a loaded machine
    svc = Service(
        small().eval(),
        ByteTokenizer(),
        "tiny-test",
        EngineConfig(slots=4, max_queue=8),
        ServerConfig(body_timeout_s=0.5),
    )
    url, stop = serve_in_thread(svc)
    yield url, svc
    stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=30)


def _greedy(svc, text, n):
    toks, _ = svc.batcher.generate([256] + list(text.encode()), n, Sampling(temperature=0), eos_id=256)
    return ByteTokenizer().decode(toks)


def test_completions_chat_models(server, client):
    url, svc = server
    r = client.completions.create(model="tiny-test", prompt="def ", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.model == "tiny-test" and r.id.startswith("cmpl-")
    c = r.choices[0]
    assert c.text == _greedy(svc, "def ", 8) and c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert chat_prompt(msgs) == "System: Be brief.\n\nUser: hi\n\nAssistant:"
    r = client.chat.completions.create(model="tiny-test", messages=msgs, max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == _greedy(svc, chat_prompt(msgs), 6)
    assert r.usage.prompt_tokens == 1 + len(chat_prompt(msgs).encode())

    assert [m.id for m in client.models.list().data] == ["tiny-test"]
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_n_seed_and_lists(client):
    kw = dict(model="tiny-test", prompt=["ab", "cd"], max_tokens=6, temperature=1.0, n=3, seed=11)
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == list(range(6))
    again = client.completions.create(**kw)
    assert [c.text for c in r.choices] == [c.text for c in again.choices]  # same seed, same choices
    assert len({c.text for c in r.choices[:3]}) > 1  # choices of one prompt use seeds seed, seed+1, ...
    r1 = client.completions.create(**{**kw, "prompt": "cd", "n": 1, "seed": 12})
    assert r1.choices[0].text == r.choices[4].text
    ids = client.completions.create(model="tiny-test", prompt=[256, 100, 101], max_tokens=4, temperature=0)
    assert (
        ids.choices[0].text
        == client.completions.create(model="tiny-test", prompt="de", max_tokens=4, temperature=0).choices[0].text
    )
    lp = client.completions.create(
        model="tiny-test", prompt="x", max_tokens=3, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    L = lp.choices[0].logprobs
    assert len(L.tokens) == 3 and all(len(t) == 2 for t in L.top_logprobs)
    assert all(t[tok] == pytest.approx(v) for t, tok, v in zip(L.top_logprobs, L.tokens, L.token_logprobs))


def test_streaming_matches_non_streaming(client):
    kw = dict(model="tiny-test", prompt="import ", max_tokens=12, temperature=0)
    full = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.text
    assert {c.object for c in chunks} == {"text_completion"}  # a completions chunk is named as the whole response
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.finish_reason
    assert chunks[-1].usage.completion_tokens <= 12

    msgs = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model="tiny-test", messages=msgs, max_tokens=10, temperature=0, n=2)
    parts = {0: "", 1: ""}
    for ch in client.chat.completions.create(
        model="tiny-test", messages=msgs, max_tokens=10, temperature=0, n=2, stream=True
    ):
        assert ch.object == "chat.completion.chunk"  # a chat chunk is not a "chat.completion"
        for c in ch.choices:
            parts[c.index] += c.delta.content or ""
    assert parts == {i: whole.choices[i].message.content for i in (0, 1)}


def test_stop_strings(client):
    base = client.completions.create(
        model="tiny-test", prompt="q", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].text
    cut = next(ch for ch in text[3:] if ch != "\ufffd")  # a character that the text contains past its start
    r = client.completions.create(
        model="tiny-test", prompt="q", max_tokens=12, temperature=0, stop=[cut], extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == text[: text.index(cut)] and r.choices[0].finish_reason == "stop"
    s = client.completions.create(
        model="tiny-test",
        prompt="q",
        max_tokens=12,
        temperature=0,
        stop=cut,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in s) == r.choices[0].text


def test_text_is_held_back_inside_a_character_or_a_stop_string(server):
    """What a choice may send (``Service.update``) never ends inside a UTF-8 character ("é" is the byte tokens
    0xC3 0xA9; the first alone decodes to U+FFFD) nor on the start of a stop string; a stop string found ends the
    choice before it and cancels its sequence."""
    from xtrain.serve.api import Choice

    class Seq:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    c = Choice(0, ["xyz"], seq=Seq())
    sent = []
    for ch in [0xC3, 0xA9, "x", "y", 0xC3, 0xA9, "x", "y", "z", "b"]:
        server[1].update(c, ord(ch) if isinstance(ch, str) else ch, None, None)
        sent.append(c.text)
    assert sent == ["", "é", "é", "é", "éxy", "éxyé", "éxyé", "éxyé", "éxyé", "éxyé"]
    assert c.finish == "stop" and c.seq.cancelled


def _raw(url: str, data, headers: dict | None = None):
    r = httpx.post(
        url + "/v1/completions",
        content=data,
        headers={"Content-Type": "application/json", **(headers or {})},
        timeout=30,
    )
    return r.status_code, r.json()


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"prompt": "x", "temperature": NaN}', 400, None),
    (b'{"prompt": "x", "temperature": Infinity}', 400, None),
    (b'{"prompt": "x", "temperature": 1e999}', 400, "temperature"),
    (b'{"prompt": "x", "temperature": -0.5}', 400, "temperature"),
    (b'{"prompt": "x", "temperature": "hot"}', 400, "temperature"),
    (b'{"prompt": "x", "max_tokens": "3"}', 400, "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 2.5}', 400, "max_tokens"),
    (b'{"prompt": "x", "max_tokens": true}', 400, "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "x", "max_tokens": -4}', 400, "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 47}', 400, "max_tokens"),  # 2 prompt tokens + 47 > 48
    (b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
    (b'{"prompt": "x", "top_p": 1.5}', 400, "top_p"),
    (b'{"prompt": "x", "n": 0}', 400, "n"),
    (b'{"prompt": "x", "n": 17}', 400, "n"),
    (b'{"prompt": "x", "stop": 5}', 400, "stop"),
    (b'{"prompt": "x", "logprobs": 9}', 400, "logprobs"),
    (b'{"prompt": "x", "seed": 1180591620717411303424}', 400, "seed"),  # 2**70
    (b'{"prompt": "x", "seed": 18446744073709551616}', 400, "seed"),  # 2**64
    (b'{"prompt": "\\ud800"}', 400, "prompt"),  # a lone surrogate
    (b'{"prompt": "x", "stop": ["\\udfff"]}', 400, "stop"),
    (b'{"prompt": "' + b"y" * 60 + b'"}', 400, "prompt"),  # longer than the context
    (b'{"prompt": [300]}', 400, "prompt"),  # a token id outside the vocab
    (b'{"prompt": 3}', 400, "prompt"),
    (b'{"prompt": []}', 400, "prompt"),
    (b'{"max_tokens": 3}', 400, "prompt"),
    (b'{"prompt": "x", "tokens": 3}', 400, "tokens"),
    (b'{"prompt": "x", "model": "gpt-4"}', 404, "model"),
    (b"\xff\xfe", 400, None),
    (b'{"prompt": "' + b"z" * (1 << 20) + b'"}', 413, None),
]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, client):
    url, _ = server
    for body, status, param in BAD:
        code, err = _raw(url, body)
        assert code == status, (body[:60], code, err)
        e = err["error"]
        assert set(e) == {"message", "type", "param", "code"} and e["message"], body[:60]
        assert e["param"] == param, (body[:60], e)
    assert httpx.post(url + "/v2/nope", content=b"{}").status_code == 404
    # a chunked body (no Content-Length) is counted as it arrives: whole when within the limit, a 413 past it
    parts = [b'{"prompt": "x", ', b'"max_tokens": 2}']
    assert _raw(url, iter(parts))[0] == 200
    code, err = _raw(url, iter([b'{"prompt": "', b"z" * (1 << 20), b'"}']))
    assert code == 413 and err["error"]["code"] == "body_too_large", err
    chat = url + "/v1/chat/completions"
    for msgs in ([], [{"role": "robot", "content": "x"}], [{"role": "user", "content": 5}], "hi"):
        r = httpx.post(chat, json={"messages": msgs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", msgs
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-test", prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    r = client.completions.create(model="tiny-test", prompt="still here", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_short_body_times_out_with_400(server):
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 500\r\n\r\n{}"
        )
        reply = b""
        while b"body_timeout" not in reply and (chunk := s.recv(4096)):
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 400") and "body_timeout" in reply
    assert httpx.get(url + "/health").status_code == 200


def test_full_queue_is_429():
    svc = Service(small().eval(), ByteTokenizer(), "m", EngineConfig(slots=1, max_queue=0))
    url, stop = serve_in_thread(svc)
    try:
        gate, entered = threading.Event(), threading.Event()

        def hold(tok, lp, fin):  # keeps the engine's only slot busy until released
            entered.set()
            gate.wait(30)

        svc.batcher.submit([([1, 2], 5, Sampling(temperature=0), None, hold)])
        entered.wait(30)
        code, err = _raw(url, json.dumps({"prompt": "x", "max_tokens": 2}).encode())
        assert code == 429 and err["error"]["type"] == "rate_limit_error" and "capacity" in err["error"]["message"]
        gate.set()
        for _ in range(600):  # the held request finishes its 5 tokens; then the slot takes the next one
            if svc.batcher.load()["running"] == 0:
                break
            threading.Event().wait(0.05)
        r = httpx.post(url + "/v1/completions", json={"prompt": "y", "max_tokens": 2, "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    finally:
        stop()
    # after shutdown the engine refuses work (the API answers that with 503)
    with pytest.raises(Exception, match="shutting down"):
        svc.batcher.submit([([1], 1, Sampling(), None, lambda *a: None)])


def test_disconnect_frees_the_slot_within_a_bound():
    """A streaming client that leaves after its first chunk: its sequence is cancelled and its slot freed within
    BOUND seconds, although the request (40 tokens at STEP_S a decode step, >= 4 s) would still be running then;
    the next request gets the slot. The engine's decode step is slowed by a sleep (a wrapper on this service's
    engine) so that "still running" does not depend on how fast the machine is."""
    STEP_S, BOUND, N = 0.1, 1.5, 40
    svc = Service(small().eval(), ByteTokenizer(), "m", EngineConfig(slots=1, max_queue=0))
    step = svc.batcher.engine.step

    def slow_step(*args):
        threading.Event().wait(STEP_S)
        return step(*args)

    svc.batcher.engine.step = slow_step
    seqs, submit = [], svc.batcher.submit
    svc.batcher.submit = lambda reqs: seqs.extend(submit(reqs)) or seqs[-len(reqs) :]
    url, stop = serve_in_thread(svc)
    try:
        body = {"prompt": "x", "max_tokens": N, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            next(r.iter_lines())
            assert svc.batcher.load()["running"] == 1
        left = time.monotonic()
        while svc.batcher.load()["running"] and time.monotonic() - left < BOUND:
            threading.Event().wait(0.02)
        freed_after = time.monotonic() - left
        assert svc.batcher.load()["running"] == 0, f"slot still busy {freed_after:.2f} s after the client left"
        (seq,) = seqs
        assert seq.done and seq.cancelled and seq.generated < N // 2, seq.generated
        r = httpx.post(url + "/v1/completions", json={"prompt": "y", "max_tokens": 2, "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    finally:
        stop()

    # after shutdown the engine refuses work (the API answers that with 503)
    with pytest.raises(Exception, match="shutting down"):
        svc.batcher.submit([([1], 1, Sampling(), None, lambda *a: None)])


def test_serve_on_a_busy_port_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        p = subprocess.run(
            [sys.executable, "-m", "xtrain.cli", "serve", str(tmp_path), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[1])},
        )
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "Traceback" not in p.stderr
