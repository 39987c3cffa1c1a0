"""``xtrain serve`` as a real process under real signals and real sockets: SIGTERM/SIGINT drain the server
(running streams end with a finish_reason and ``[DONE]``, queued requests get a 503 in OpenAI's error shape, new
ones a 503, the process exits 0 without a traceback); clients that reset or close their connection mid-body or
mid-request leave no traceback and free their slot, or their place in the queue, at once.

The served model is the tiny test model with a 4096-position context: a request for 4000 tokens runs for 10 s or
more, far longer than any bound these tests wait, so "ended early" never depends on the machine's speed."""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from tests._cli import has_ipv6_loopback
from tests.test_serve import small
from xtrain.data.tokenizer import ByteTokenizer
from xtrain.train import checkpoint as ck
from xtrain.train.optim import AdamW

httpx = pytest.importorskip("httpx")

LONG = 4000  # tokens: a request that does not end by itself while a test looks
BOUND = 5.0  # seconds: a slot or queue place held past this after its client left was not freed for it


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("serve") / "run"
    m = small(max_seq_len=4096)
    ck.save_checkpoint(run, model=m, optimizer=AdamW(m.params, lr=1e-3), trainer_state={"step": 0})
    ByteTokenizer().save(run / "tokenizer.json")
    return run


@contextmanager
def serving(run, log_path, *args):
    """``xtrain serve RUN --port 0 ARGS`` -> (process, base url, path of its stderr); killed if still running at
    the end. Its stderr goes to a file: a pipe nobody reads would block a server that logs a lot."""
    with open(log_path, "w") as err:
        p = subprocess.Popen(
            [sys.executable, "-m", "xtrain.cli", "serve", str(run), "--port", "0", "--threads", "1", *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=dict(os.environ),
        )
    try:
        line = p.stdout.readline()
        assert " on http://" in line, (line, log_path.read_text()[-3000:])
        yield p, line.split(" on ")[1].split("/v1 ")[0], log_path
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(30)
        p.stdout.close()


def _health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def _until(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"not within {timeout} s: {what}"
        time.sleep(0.02)


def _post(url: str, body: dict, out: dict, path: str = "/v1/completions"):
    """POST and keep what came back: out["status"], out["lines"] (non-empty lines of the body) or out["error"]."""
    try:
        with httpx.stream("POST", url + path, json=body, timeout=60) as r:
            out["status"] = r.status_code
            out["lines"] = [ln for ln in r.iter_lines() if ln]
    except Exception as e:  # reported by the test's assertions
        out["error"] = repr(e)


def _start(url: str, body: dict, path: str = "/v1/completions") -> tuple[threading.Thread, dict]:
    out: dict = {}
    th = threading.Thread(target=_post, args=(url, body, out, path), daemon=True)
    th.start()
    return th, out


def _long(stream: bool) -> dict:
    return {"prompt": "x", "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": stream}


def _ended_stream(out: dict, reason: str) -> list[dict]:
    """A stream that ended properly: status 200, chunks without errors, a last chunk with ``reason``, [DONE]."""
    assert out.get("status") == 200 and "error" not in out, out
    lines = out["lines"]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    assert not any("error" in c for c in chunks), chunks[-3:]
    assert chunks[-1]["choices"][0]["finish_reason"] == reason, chunks[-1]
    return chunks


def _quiet(stderr: str, words=("Traceback",)):
    """None of ``words`` in a server's stderr. (Not ``assert word not in stderr``: on a failure pytest would diff
    the whole text, minutes for a log of a few hundred tracebacks.)"""
    found = [w for w in words if w in stderr]
    assert not found, f"{found} in the server's stderr; its end:\n{stderr[-3000:]}"


def _refused(out: dict, code: str = "shutting_down"):
    assert out.get("status") == 503, out
    e = json.loads("".join(out["lines"]))["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["code"] == code, e


def test_sigterm_ends_every_stream_and_answers_the_queue(run_dir, tmp_path):
    """Three running streams and a running non-streamed request past a short grace period, one stream and one
    non-streamed request queued, one request whose body is still arriving: SIGTERM ends each running one
    properly (finish_reason "abort", [DONE] for streams, a whole JSON body otherwise), the queued ones and the
    unfinished body get a 503, and the process exits 0, quietly."""
    with serving(run_dir, tmp_path / "err", "--slots", 4, "--max-queue", 4, "--shutdown-grace", 0.5) as (p, url, log):
        running = [_start(url, _long(True)) for _ in range(3)] + [_start(url, _long(False))]
        _until(lambda: _health(url)["running"] == 4, 30, "four requests running")
        queued = [_start(url, _long(True)), _start(url, _long(False))]
        _until(lambda: _health(url)["waiting"] == 2, 30, "two requests queued")
        slow = _connect(url)  # a body still on its way when the signal comes
        req = _request_bytes(_long(False))
        slow.sendall(req[:-10])
        p.send_signal(signal.SIGTERM)
        for th, _ in running + queued:
            th.join(30)
        reply = _read_all(slow)
        rc = p.wait(30)
    stderr = log.read_text()
    assert reply.startswith(b"HTTP/1.1 503") and b"shutting_down" in reply, reply[:300]
    for _, out in running[:3]:
        chunks = _ended_stream(out, "abort")
        assert "".join(c["choices"][0]["text"] for c in chunks), "the streams had tokens before the end"
    out = running[3][1]
    assert out.get("status") == 200, out
    body = json.loads("".join(out["lines"]))
    assert body["choices"][0]["finish_reason"] == "abort" and 0 < body["usage"]["completion_tokens"] < LONG, body
    for _, out in queued:
        _refused(out)
    assert rc == 0, stderr[-3000:]
    _quiet(stderr)
    assert "draining" in stderr, stderr[-3000:]


@pytest.mark.slow
def test_sigint_drain_lets_running_requests_finish_and_a_second_signal_ends_them(run_dir, tmp_path):
    """With a long grace period: after SIGINT the queued request gets its 503 at once, a short running request
    finishes with all its tokens, new requests get a 503 and /health says draining; a second SIGINT ends the
    long stream at once (finish_reason "abort", [DONE]), long before the grace period would; exit code 0."""
    with serving(run_dir, tmp_path / "err", "--slots", 2, "--max-queue", 2, "--shutdown-grace", 60) as (p, url, log):
        long_stream = _start(url, _long(True))
        short = _start(url, {"prompt": "y", "max_tokens": 600, "temperature": 0, "ignore_eos": True})
        _until(lambda: _health(url)["running"] == 2, 30, "two requests running")
        queued = _start(url, _long(True))
        _until(lambda: _health(url)["waiting"] == 1, 30, "a request queued")
        p.send_signal(signal.SIGINT)
        queued[0].join(10)
        _refused(queued[1])  # at once, not at the end of the grace period
        short[0].join(30)
        assert short[1].get("status") == 200, short[1]
        body = json.loads("".join(short[1]["lines"]))
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 600, body
        out: dict = {}
        _post(url, {"prompt": "z", "max_tokens": 2}, out)
        _refused(out)
        r = httpx.get(url + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["status"] == "draining", r.text
        assert long_stream[0].is_alive()  # still streaming: the grace period is 60 s
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        long_stream[0].join(20)
        rc = p.wait(20)
        assert time.monotonic() - t0 < 15
    _ended_stream(long_stream[1], "abort")
    stderr = log.read_text()
    assert rc == 0, stderr[-3000:]
    _quiet(stderr)


@pytest.fixture(scope="module")
def busy_server(run_dir, tmp_path_factory):
    """One server for the client-behaviour tests: one slot, one queue place, on ::1 where the machine has it
    (``--host ::1`` must report ``http://[::1]:PORT``). At the end: SIGTERM, exit code 0, and not one traceback
    in its stderr over all the tests."""
    host = "::1" if has_ipv6_loopback() else "127.0.0.1"
    log = tmp_path_factory.mktemp("busy") / "err"
    with serving(run_dir, log, "--host", host, "--slots", 1, "--max-queue", 1) as (p, url, _):
        if host == "::1":
            assert url.startswith("http://[::1]:"), url
        assert _health(url)["status"] == "ok"
        yield url, log
        p.send_signal(signal.SIGTERM)
        rc = p.wait(30)
    stderr = log.read_text()
    assert rc == 0, stderr[-3000:]
    _quiet(stderr)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host.strip("[]"), int(port)), timeout=30)


def _request_bytes(body: dict, host: str = "localhost") -> bytes:
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    return head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data


def _read_all(s: socket.socket) -> bytes:
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    s.close()
    return got


def _reset(s: socket.socket):
    """Close with a TCP reset (SO_LINGER 0), as a client killed mid-request does."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_clients_resetting_mid_body_or_mid_request_leave_no_traceback(busy_server):
    """40 clients reset with half a body sent, 3 reset while their non-streamed request runs, 3 after the
    first chunk of their stream: the server logs nothing for any of them, frees the slot, and serves the next
    request."""
    url, log = busy_server
    before = len(log.read_text())
    for _ in range(40):
        s = _connect(url)
        req = _request_bytes({"prompt": "x" * 200, "max_tokens": 2})
        s.sendall(req[: len(req) - 100])
        time.sleep(0.005)
        _reset(s)
    for stream in (False, True):
        for _ in range(3):
            s = _connect(url)
            s.sendall(_request_bytes(_long(stream)))
            if stream:
                got = b""
                while b"data: " not in got:
                    got += s.recv(4096)
            else:
                _until(lambda: _health(url)["running"] == 1, 30, "the request running")
            _reset(s)
            _until(lambda: _health(url)["running"] == 0, BOUND, "the slot freed")
    r = httpx.post(url + "/v1/completions", json={"prompt": "y", "max_tokens": 3, "temperature": 0}, timeout=30)
    assert r.status_code == 200, r.text
    time.sleep(0.2)  # anything the server would log about the resets is out by now
    new = log.read_text()[before:]
    _quiet(new, ("Traceback", "ClientDisconnect", "Exception"))


def test_a_client_that_goes_away_frees_its_slot_or_queue_place(busy_server):
    """Non-streamed requests: one running (the only slot), one queued (the only queue place). The queued
    client closes its connection: its place is free at once (another request can queue). The running client
    closes: its slot is free within BOUND seconds, although its request had more than that of tokens left, and
    the request queued behind it runs."""
    url, _ = busy_server
    a = _connect(url)
    a.sendall(_request_bytes(_long(False)))
    _until(lambda: _health(url)["running"] == 1, 30, "the first request running")
    b = _connect(url)
    b.sendall(_request_bytes(_long(False)))
    _until(lambda: _health(url)["waiting"] == 1, 30, "the second request queued")
    b.close()
    _until(lambda: _health(url)["waiting"] == 0, BOUND, "the queue place freed")
    short = _start(url, {"prompt": "y", "max_tokens": 3, "temperature": 0})  # takes the queue place
    _until(lambda: _health(url)["waiting"] == 1, 10, "the third request queued")
    left = time.monotonic()
    a.close()
    short[0].join(30)
    assert time.monotonic() - left < BOUND, "the slot was not freed when its client left"
    assert short[1].get("status") == 200, short[1]
    assert json.loads("".join(short[1]["lines"]))["usage"]["completion_tokens"] <= 3
    assert _health(url)["running"] == 0


def test_a_draining_server_refuses_new_requests_and_a_hurry_ends_the_running_ones():
    """In-process, the drain itself (``Service.shutdown`` on the server's loop, as the signal handler runs
    it) with a long grace period: a new request gets a 503 and /health a 503 "draining" while the running
    stream goes on; ``hurry`` (a second signal) ends that stream at once with "abort" and [DONE]."""
    import asyncio

    import torch

    from xtrain.serve.api import Service
    from xtrain.serve.engine import EngineConfig
    from xtrain.serve.server import serve_in_thread

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    svc = Service(small(max_seq_len=4096).eval(), ByteTokenizer(), "m", EngineConfig(slots=1, max_queue=1))
    url, stop = serve_in_thread(svc)
    try:
        th, out = _start(url, _long(True))
        _until(lambda: svc.batcher.load()["running"] == 1, 30, "the stream running")
        done = asyncio.run_coroutine_threadsafe(svc.shutdown(grace=60), svc.loop)
        _until(lambda: svc.draining, 10, "the drain begun")
        refused: dict = {}
        _post(url, {"prompt": "z", "max_tokens": 2}, refused)
        _refused(refused)
        r = httpx.get(url + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["status"] == "draining", r.text
        assert th.is_alive() and not done.done()  # the running stream has its grace period
        svc.hurry = True
        assert done.result(timeout=10) == 1  # one request cut short
        th.join(10)
        _ended_stream(out, "abort")
    finally:
        stop()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("grace", ["-1", "nan", "inf"])
def test_a_bad_shutdown_grace_is_one_line_and_exit_2(grace, tmp_path, capsys):
    from xtrain.cli import main

    assert main(["serve", str(tmp_path), "--port", "0", "--shutdown-grace", grace]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--shutdown-grace" in err[0], err
