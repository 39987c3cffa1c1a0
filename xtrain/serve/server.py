"""``xtrain serve RUN``: an HTTP server for a trained run — text in, text out.

The server owns the tokenizer; the engine (``xtrain.serve.engine``) sees token ids only. Requests are
served one at a time on one model (a lock around the engine), from a thread per connection.

    GET  /health          {"status": "ok", "run": ..., "params": ..., "vocab_size": ..., "max_seq_len": ...}
    POST /v1/completions  {"prompt": "def ", "max_tokens": 64, "temperature": 0.8, "top_k": 50,
                           "top_p": 0.95, "seed": 0}
                       -> {"text": ..., "prompt_tokens": n, "completion_tokens": m,
                           "finish_reason": "stop" | "length", "seconds": s}

Bad requests get a 4xx status and {"error": "..."}: malformed JSON, unknown or ill-typed fields, a
prompt that does not fit the context, bodies over 1 MiB. The prompt is preceded by the end-of-text token,
as every training document is; generation stops at the next end-of-text token ("stop") or at max_tokens
("length"). Binds to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

MAX_BODY = 1 << 20
FIELDS = {
    "prompt": str,
    "max_tokens": int,
    "temperature": (int, float),
    "top_k": int,
    "top_p": (int, float),
    "seed": int,
}
DEFAULTS = {"max_tokens": 64, "temperature": 0.8, "top_k": 50, "top_p": 0.95, "seed": 0}


class BadRequest(ValueError):
    pass


class Service:
    """Tokenizer + engine: what one request needs, shared by all handler threads."""

    def __init__(self, model, tokenizer, name: str = "model"):
        from xtrain.serve.engine import Engine

        self.engine = Engine(model)
        self.tok = tokenizer
        self.name = name
        self.model = model
        self.lock = threading.Lock()

    def health(self) -> dict:
        c = self.model.config
        return {
            "status": "ok",
            "run": self.name,
            "params": self.model.num_params(),
            "vocab_size": c.vocab_size,
            "max_seq_len": c.max_seq_len,
        }

    def complete(self, req: dict) -> dict:
        if not isinstance(req, dict):
            raise BadRequest("the body must be a JSON object")
        unknown = sorted(set(req) - set(FIELDS))
        if unknown:
            raise BadRequest(f"unknown fields {unknown}; known: {sorted(FIELDS)}")
        if "prompt" not in req:
            raise BadRequest("missing field 'prompt'")
        for k, v in req.items():
            if not isinstance(v, FIELDS[k]) or isinstance(v, bool):
                raise BadRequest(f"field {k!r} must be {getattr(FIELDS[k], '__name__', 'a number')}, got {v!r}")
        r = {**DEFAULTS, **req}
        if r["max_tokens"] < 0 or r["temperature"] < 0 or not 0 < r["top_p"] <= 1 or r["top_k"] < 0:
            raise BadRequest("need max_tokens >= 0, temperature >= 0, 0 < top_p <= 1, top_k >= 0")
        ids = [self.tok.eot_id] + self.tok.encode(r["prompt"])
        room = self.model.config.max_seq_len - len(ids)
        if room < 0:
            raise BadRequest(f"the prompt is {len(ids)} tokens; the context holds {self.model.config.max_seq_len}")
        n = min(r["max_tokens"], room)
        t0 = time.perf_counter()
        with self.lock:
            out = self.engine.generate(
                torch.tensor([ids]),
                n,
                temperature=float(r["temperature"]),
                top_k=r["top_k"] or None,
                top_p=float(r["top_p"]),
                seed=r["seed"],
                eos_id=self.tok.eot_id,
            )
        new = out[0, len(ids) :].tolist()
        finish = "length"
        if self.tok.eot_id in new:
            new, finish = new[: new.index(self.tok.eot_id)], "stop"
        return {
            "text": self.tok.decode(new),
            "prompt_tokens": len(ids),
            "completion_tokens": len(new),
            "finish_reason": finish,
            "seconds": round(time.perf_counter() - t0, 4),
        }


def make_handler(service: Service):
    class Handler(BaseHTTPRequestHandler):
        server_version = "xtrain"

        def _send(self, status: int, obj: dict) -> None:
            body = (json.dumps(obj) + "\n").encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802 (the http.server naming)
            if self.path == "/health":
                self._send(200, service.health())
            else:
                self._send(404, {"error": f"no such path {self.path!r}; try GET /health or POST /v1/completions"})

        def do_POST(self):  # noqa: N802
            if self.path != "/v1/completions":
                self._send(404, {"error": f"no such path {self.path!r}; try POST /v1/completions"})
                return
            try:
                size = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                size = -1
            if size < 0 or size > MAX_BODY:
                self._send(413 if size > MAX_BODY else 400, {"error": f"body must be 0..{MAX_BODY} bytes"})
                return
            try:
                req = json.loads(self.rfile.read(size) or b"null")
                self._send(200, service.complete(req))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                self._send(400, {"error": f"body is not JSON: {e}"})
            except BadRequest as e:
                self._send(400, {"error": str(e)})

        def log_message(self, fmt, *args):  # one line per request on stderr
            sys.stderr.write(f"xtrain serve: {self.address_string()} {fmt % args}\n")

    return Handler


def make_server(service: Service, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    return ThreadingHTTPServer((host, port), make_handler(service))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a trained run over HTTP (KV-cache engine)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run", help="run directory (written by xtrain train)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.set_defaults(func=run)


def load_service(run_dir: str | Path, device: str | None = None) -> Service:
    from xtrain.model import Model
    from xtrain.train import checkpoint as ckpt_io
    from xtrain.train.sample_cli import load_run_tokenizer

    run_dir = Path(run_dir)
    ck = ckpt_io.read_checkpoint(run_dir, with_optimizer=False)
    model = Model(ck.model_config, device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ckpt_io.restore(ck, model)
    return Service(model.eval(), load_run_tokenizer(run_dir), name=str(run_dir))


def run(args) -> int:
    try:
        service = load_service(args.run, args.device)
    except (ValueError, FileNotFoundError) as e:
        print(f"xtrain serve: {e}", file=sys.stderr)
        return 2
    server = make_server(service, args.host, args.port)
    host, port = server.server_address[:2]
    print(f"xtrain serve: {args.run} on http://{host}:{port} (POST /v1/completions, GET /health); Ctrl-C stops")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
