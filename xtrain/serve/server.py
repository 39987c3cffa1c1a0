"""``xtrain serve RUN``: an OpenAI-compatible server for a trained run (FastAPI on uvicorn).

    xtrain serve runs/tiny-... --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tiny-...", "prompt": "def ", "max_tokens": 32, "temperature": 0}'

Endpoints (fields, the chat templates and the error shapes: docs/serve.md):
GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, with ``stream: true`` as
server-sent events. The model is named after the run directory (``--name`` overrides). Requests decode
together (continuous batching, ``--slots`` sequences at once, ``--max-queue`` more waiting; past that a
429). Binds to 127.0.0.1 unless told otherwise, and answers only requests whose Host header names the bind
address or localhost (``--allow-host NAME`` adds a name; a 403 otherwise) and whose POST body is
``Content-Type: application/json`` (a 415 otherwise): a web page the user visits cannot post to it. A port
already in use, or a bad --port / --threads / --slots / --shutdown-grace, is a one-line error, exit code 2.
Each sequence holds at most ``--max-len`` positions (default: the model's context, capped at 8192). A run
fine-tuned from a Hugging Face checkpoint serves chats with that checkpoint's own chat template and stops at
its end-of-turn token.

Shutdown: SIGINT (Ctrl-C) or SIGTERM drains the server. New requests get a 503 (and GET /health a 503 with
"status": "draining"), queued requests a 503 at once, and running requests go on to their end for up to
--shutdown-grace seconds; past it each ends with what it has: a stream gets a final chunk with finish_reason
"abort" and "data: [DONE]", a non-streamed request its JSON body with finish_reason "abort". A second signal
ends the running requests at once, the same way. Then the process exits with code 0 (130 for a Ctrl-C while
the model is still loading).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch

from xtrain.serve.api import ServerConfig, Service, create_app
from xtrain.serve.engine import EngineConfig

DEFAULT_MAX_LEN = 8192  # a fine-tuned Qwen3's context is 40,960: 16 slots of that would not fit most memories
DEFAULT_GRACE_S = 5.0
DRAIN_FLUSH_S = 2.0  # after the grace period: how long the ended requests' last bytes may take to go out


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a trained run over an OpenAI-compatible HTTP API (continuous batching)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from xtrain import argtypes as A

    d = EngineConfig()
    p.add_argument("run", help="run directory (written by xtrain train)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=A.port, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--name", default=None, help="model name clients send (default: the run directory's name)")
    p.add_argument(
        "--slots", type=A.positive_int, default=d.slots, help="sequences decoded together (default %(default)s)"
    )
    p.add_argument("--max-queue", type=A.count, default=d.max_queue, help=f"requests waiting (default {d.max_queue})")
    p.add_argument(
        "--max-len",
        type=A.int_in(2),
        default=None,
        help="positions per sequence (prompt + reply; default: the model's context, at most "
        f"{DEFAULT_MAX_LEN}): the KV cache holds slots x max-len positions per layer",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also accept requests whose Host header names NAME (repeatable; '*' accepts any). By default "
        "only the bind address and localhost are accepted, so a web page cannot reach the server through "
        "a DNS name of its own (binding to 0.0.0.0 or :: accepts any Host unless --allow-host is given)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=A.nonnegative_float,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, how long running requests may go on before they end with finish_reason "
        f"'abort' (default {DEFAULT_GRACE_S:g}: inside docker stop's 10 s before SIGKILL)",
    )
    p.add_argument(
        "--threads",
        type=A.positive_int,
        default=None,
        help="torch intra-op threads (default: torch's; 1 is best for small models on a busy CPU)",
    )
    p.set_defaults(func=run)


def load_service(run_dir, device=None, name=None, engine_config=EngineConfig(), config=ServerConfig()) -> Service:
    from xtrain.data.chat import load_chat_template
    from xtrain.train.sample_cli import load_run

    run_dir = Path(run_dir)
    chat = load_chat_template(run_dir)  # a fine-tuned checkpoint's own template (None: the plain-text one)
    model, tok = load_run(run_dir, device, "xtrain serve")
    return Service(model, tok, name or run_dir.resolve().name, engine_config, config, chat_template=chat)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (OSError when the address is taken). Bound before the model loads, so a busy
    port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on connections whose socket says TCP, and without it
    # a response written in two parts (uvicorn writes the head, then the body) waits for the client's delayed
    # ACK, 40 ms a request on Linux
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket) -> str:
    """http://HOST:PORT of a listening socket, an IPv6 address in brackets (``http://[::1]:8000``)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Drain:
    """A uvicorn server that drains on SIGINT/SIGTERM (``Service.shutdown``) instead of cutting its
    connections. ``on_signal`` is installed as the server's signal handler (uvicorn calls it from the main
    thread; it only schedules work on the event loop). The first signal starts the drain; a later one ends
    the running requests at once. When the drain is done the server exits as uvicorn does (``should_exit``),
    and the signal is not raised again afterwards (uvicorn's own handler would, killing the process)."""

    def __init__(self, service: Service, grace: float, say=None):
        import uvicorn

        self.service, self.grace = service, grace
        self.say = say or (lambda msg: None)
        cfg = uvicorn.Config(
            create_app(service), log_level="warning", access_log=False, timeout_graceful_shutdown=DRAIN_FLUSH_S
        )
        self.server = uvicorn.Server(cfg)
        self.server.handle_exit = self.on_signal
        self.task: asyncio.Task | None = None

    def on_signal(self, sig: int, frame=None) -> None:
        loop = self.service.loop
        if loop is None or loop.is_closed():  # the app has not started (or has stopped): nothing to drain
            self.server.should_exit = True
            return
        loop.call_soon_threadsafe(self._begin, sig)

    def _begin(self, sig: int) -> None:
        if self.task is None:
            load = self.service.batcher.load()
            name = signal.Signals(sig).name if sig else "stop"
            now = f"{load['running']} running, {load['waiting']} queued"
            self.say(f"{name}: draining ({now}; running requests get {self.grace:g} s, a second signal ends them now)")
            self.task = asyncio.get_running_loop().create_task(self._drain())
        else:
            self.service.hurry = True

    async def _drain(self) -> None:
        try:
            cut = await self.service.shutdown(self.grace, flush=DRAIN_FLUSH_S)
            self.say(f"stopped ({cut} running requests ended with finish_reason 'abort')" if cut else "stopped")
        finally:
            self.server.should_exit = True


def serve_in_thread(service: Service, host: str = "127.0.0.1", port: int = 0, grace: float = 0.0):
    """Start a server on a background thread -> (base url, stop()). For tests and benchmarks. ``stop()``
    drains as a signal does, with ``grace`` seconds for the running requests."""
    sock = bind(host, port)
    drain = Drain(service, grace)
    th = threading.Thread(target=drain.server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    while not drain.server.started:
        if not th.is_alive():
            raise RuntimeError("xtrain serve: the server thread died while starting")
        time.sleep(0.01)

    def stop():
        drain.on_signal(0)
        th.join(timeout=grace + 10)
        sock.close()
        service.close()

    return url_of(sock), stop


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def allowed_hosts(bind_host: str, extra: list[str]) -> tuple[str, ...] | None:
    """The Host header names ``xtrain serve`` accepts: the bind address and the loopback names, plus
    ``--allow-host`` names; None (any) for '*', or for a bind to every interface without --allow-host."""
    from xtrain.serve.api import host_name

    extra = [host_name(h) for h in extra]
    if "*" in extra or (bind_host in ("0.0.0.0", "::", "") and not extra):
        return None
    return tuple(dict.fromkeys([host_name(bind_host), *LOOPBACK_NAMES, *extra]))


def run(args) -> int:
    # each value was checked by its argument type (xtrain.argtypes) while the command line was parsed
    max_len = args.max_len if args.max_len is not None else DEFAULT_MAX_LEN
    engine_config = EngineConfig(slots=args.slots, max_queue=args.max_queue, max_len=max_len)
    host = args.host[1:-1] if args.host.startswith("[") and args.host.endswith("]") else args.host  # [::1]
    try:
        sock = bind(host, args.port)
    except OSError as e:
        print(f"xtrain serve: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        config = ServerConfig(allowed_hosts=allowed_hosts(host, args.allow_host))
        service = load_service(args.run, args.device, args.name, engine_config, config)
        drain = Drain(service, args.shutdown_grace, say=lambda msg: print(f"xtrain serve: {msg}", file=sys.stderr))
    except (ValueError, FileNotFoundError) as e:
        sock.close()
        print(f"xtrain serve: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sock.close()
        print("xtrain serve: interrupted while loading the model", file=sys.stderr)
        return 130
    where = f"model {service.name!r} on {url_of(sock)}/v1 (completions, chat/completions, models; GET /health)"
    print(f"xtrain serve: {where}; Ctrl-C or SIGTERM drains and stops", flush=True)
    try:
        drain.server.run(sockets=[sock])
    finally:
        sock.close()
        service.close()
    return 0
