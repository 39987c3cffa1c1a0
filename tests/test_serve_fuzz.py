"""Every malformed request is a 4xx in OpenAI's error shape, never a 500: each field of both endpoints with
values of every wrong JSON type (nested junk, huge numbers, NaN/Infinity, a lone surrogate, deep nesting), and
bodies that are not JSON objects at all (empty, not UTF-8, duplicate keys, arrays, nested past any limit). The
server keeps serving afterwards. Also: model ids may hold "/" (the route and the lookup), and a server bound to
::1 answers on the URL it reports."""

import json

import pytest
import torch

from tests._cli import has_ipv6_loopback
from tests.test_serve import small
from xtrain.data.tokenizer import ByteTokenizer
from xtrain.serve.api import (
    CHAT_FIELDS,
    CHAT_NO_OP,
    COMPLETION_FIELDS,
    COMPLETION_NO_OP,
    NO_OP_FIELDS,
    APIError,
    ServerConfig,
    Service,
    parse_body,
)
from xtrain.serve.engine import EngineConfig
from xtrain.serve.server import bind, serve_in_thread, url_of

httpx = pytest.importorskip("httpx")

NAME = "org/tiny-test"  # a served name with "/", as Hugging Face ids have


@pytest.fixture(scope="module")
def server():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    svc = Service(small().eval(), ByteTokenizer(), NAME, EngineConfig(slots=4, max_queue=8), ServerConfig())
    url, stop = serve_in_thread(svc)
    try:
        yield url, svc
    finally:
        stop()
        torch.set_num_threads(threads)


DEEP = "[" * 40 + "]" * 40  # deeper than any request needs, shallower than the recursion limit
# JSON texts of wrong values: every type, nested junk, numbers past every range, the constants JSON lacks
JUNK = [
    "true",
    "-1",
    "2.5",
    "1e999",
    "-1e999",
    "1" + "0" * 400,  # 10**400: an int no float holds
    "NaN",
    "Infinity",
    "-Infinity",
    '""',
    '"x"',
    '"\\ud800"',
    "[]",
    "[1, [2, [3]]]",
    '[{"role": []}]',
    "{}",
    '{"a": {"b": [null, {"c": NaN}]}}',
    '{"include_usage": []}',
    DEEP,
]


def _body(base: dict, field: str, junk: str) -> bytes:
    parts = {**base, field: junk}  # JSON texts, joined by hand: NaN and 10**400 have no Python spelling here
    return ("{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in parts.items()) + "}").encode()


def _check(r, what):
    assert r.status_code < 500, (what, r.status_code, r.text[:300])
    if r.status_code >= 400:
        e = r.json()["error"]
        assert set(e) == {"message", "type", "param", "code"} and e["message"], (what, r.text[:300])


def _cases():
    """(path, chat, body) for every field of each endpoint with every JUNK value, and JUNK inside the messages
    and the prompt."""
    completion = {"prompt": '"x"', "max_tokens": "2"}
    chat = {"messages": '[{"role": "user", "content": "x"}]', "max_tokens": "2"}
    fields = COMPLETION_FIELDS | set(NO_OP_FIELDS) | set(COMPLETION_NO_OP) | {"nope"}
    out = [("/v1/completions", False, _body(completion, f, j)) for f in sorted(fields) for j in JUNK]
    fields = CHAT_FIELDS | set(NO_OP_FIELDS) | set(CHAT_NO_OP)
    out += [("/v1/chat/completions", True, _body(chat, f, j)) for f in sorted(fields) for j in JUNK]
    for j in JUNK:
        for msgs in (f"[{j}]", f'[{{"role": {j}, "content": "x"}}]', f'[{{"role": "user", "content": {j}}}]',
                     f'[{{"role": "user", "content": [{{"type": {j}, "text": "x"}}]}}]',
                     f'[{{"role": "user", "content": [{{"type": "text", "text": {j}}}]}}]'):  # fmt: skip
            out.append(("/v1/chat/completions", True, _body(chat, "messages", msgs)))
        for prompt in (f"[{j}]", f"[[{j}]]", f'["x", {j}]', f"[1, {j}]"):
            out.append(("/v1/completions", False, _body(completion, "prompt", prompt)))
    # nested up to where the parser gives up: at some depth the value parses, but printing it back in the error
    # message (json.dumps, a few frames deeper) would hit the recursion limit
    for d in range(600, 1000):
        out.append(("/v1/completions", False, _body(completion, "temperature", "[" * d + "]" * d)))
    return out


def test_every_field_with_every_wrong_value_is_a_4xx(server):
    """All ~1700 cases through the request path in-process (parse, validate, render the error as the app
    does): only an APIError with a 4xx may come out, anything else would be a 500. Over HTTP: every case the
    server accepts (they reach the engine) and every 7th refused one."""
    from fastapi.responses import JSONResponse

    url, svc = server
    accepted, refused = [], []
    for path, chat, body in _cases():
        try:
            svc.prepare(parse_body(body), chat)
        except APIError as e:
            assert 400 <= e.status < 500, (body[:120], e.status, e.message)
            JSONResponse(e.body(), status_code=e.status)  # renders as UTF-8 (a lone surrogate would not)
            refused.append((path, body))
        else:
            accepted.append((path, body))
    assert len(refused) > 10 * len(accepted) > 0  # the junk is mostly refused; some is valid (user "x", seed -1)
    with httpx.Client(base_url=url, headers={"Content-Type": "application/json"}, timeout=30) as c:
        for path, body in accepted + refused[::7]:
            _check(c.post(path, content=body), body[:120])
        r = c.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text


BAD_BODIES = [
    b"",
    b"   \n",
    b"\xff\xfe{}",  # not UTF-8
    '{"prompt": "x"}'.encode("utf-16"),
    b'\xef\xbb\xbf{"prompt": "x"}',  # a byte-order mark
    b'{"prompt": "x", "prompt": "y"}',  # duplicate keys: parsers disagree on which wins
    b'{"prompt": "x", "max_tokens": 2, "max_tokens": 3}',
    b"[" * 200_000,  # nested past the recursion limit
    b'{"a":' * 100_000,
    b'{"prompt": "x", "stop": ' + DEEP.encode() + b"}",
    b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",  # past Python's int-from-text digit limit
    b'{"prompt": "x"',
    b'{"prompt": "x"} trailing',
    b"null",
    b"42",
    b'"a string"',
    b'[{"prompt": "x"}]',  # an array where the object belongs
    b'{"\\ud800": 1}',  # a field name no UTF-8 encodes
    b'{"prompt": "x\x00y"}',  # a raw control character in a string
]


def test_bodies_that_are_not_a_request_object_are_a_400(server):
    url, _ = server
    with httpx.Client(base_url=url, headers={"Content-Type": "application/json"}, timeout=30) as c:
        for body in BAD_BODIES:
            for path in ("/v1/completions", "/v1/chat/completions"):
                r = c.post(path, content=body)
                _check(r, body[:60])
                assert r.status_code == 400, (body[:60], r.status_code, r.text[:300])
        assert c.get("/health").json()["status"] == "ok"


def test_model_ids_may_hold_a_slash(server):
    url, _ = server
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == NAME
        for path in ("/v1/models/org/tiny-test", "/v1/models/org%2Ftiny-test"):
            r = c.get(path)
            assert r.status_code == 200 and r.json()["id"] == NAME, (path, r.text)
        r = c.get("/v1/models/org/other")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        r = c.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == NAME, r.text
        r = c.post("/v1/completions", json={"model": "org/other", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 404, r.text


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback")
def test_an_ipv6_server_reports_a_usable_url():
    with bind("::1", 0) as s:
        assert url_of(s) == f"http://[::1]:{s.getsockname()[1]}"
    svc = Service(small().eval(), ByteTokenizer(), "m", EngineConfig(slots=1))
    url, stop = serve_in_thread(svc, host="::1")
    try:
        assert url.startswith("http://[::1]:")
        assert httpx.get(url + "/health", timeout=30).json()["status"] == "ok"
    finally:
        stop()
