"""The OpenAI-compatible HTTP API (FastAPI on uvicorn): text in, text out over the token-id engine.

    GET /health, /v1/models, /v1/models/{MODEL}; POST /v1/completions, /v1/chat/completions

``docs/serve.md`` is the reference: request fields, responses, the chat templates, error statuses. A request's
way through this module:

    read_body        the body, within ``ServerConfig``'s size and time limits (413, 400; 503 once draining)
    parse_body       strict JSON: one object, unique keys, no NaN, bounded nesting (400)
    Service.prepare  the fields (``parse_params``), the model, the prompts' token ids, the token budget
    Service.start    a ``Job``: one engine sequence per choice, their events on one asyncio queue
    _handle          the whole response, or server-sent events whose status line waits for the first token

A string prompt is preceded by the end-of-text token, as every training document is (so the tokens match
``xtrain sample``); a token-id prompt is used as given. Errors are ``APIError``s in OpenAI's shape. A client
that goes away at any point ends its request at once and frees its slot or its place in the queue (``Job``),
with one debug-level log line (logger ``xtrain.serve``) and no traceback.
"""

import asyncio
import json
import logging
import math
import secrets
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import accumulate

from xtrain.serve.engine import Batcher, Engine, EngineConfig, QueueFull, Sampling

log = logging.getLogger("xtrain.serve")
DRAIN_SEND_S = 2.0  # while draining, a stream whose client has not taken a chunk in this time is given up
MAX_DEPTH = 32  # JSON nesting a request may have (messages[i].content[j].text is 5 deep)
ABORT = "abort"  # the finish_reason of a choice a shutdown ended before it finished (as vLLM's)

CHAT_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
CHAT_STOPS = ("\n\nUser:", "\n\nSystem:")
COMMON_FIELDS = set(
    "model max_tokens temperature top_p top_k seed stop n stream stream_options user ignore_eos".split()
)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}

# OpenAI fields clients send by default (LangChain's OpenAI sends presence_penalty 0, frequency_penalty 0 and
# logit_bias {}): accepted when null or when their value changes nothing, a 400 naming the field otherwise.
# field -> (is the value a no-op?, the values accepted, for the message)
NO_OP_FIELDS = {
    "presence_penalty": (lambda v: _isnum(v) and v == 0, "0"),
    "frequency_penalty": (lambda v: _isnum(v) and v == 0, "0"),
    "repetition_penalty": (lambda v: _isnum(v) and v == 1, "1"),
    "logit_bias": (lambda v: v == {}, "{}"),
    "response_format": (lambda v: v == {"type": "text"}, '{"type": "text"}'),
    "tools": (lambda v: v == [], "[]"),
    "functions": (lambda v: v == [], "[]"),
    "tool_choice": (lambda v: v == "none", '"none"'),
    "function_call": (lambda v: v == "none", '"none"'),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "true or false (there are no tools)"),
    "service_tier": (lambda v: v in ("auto", "default"), '"auto" or "default"'),
    "store": (lambda v: v is False, "false"),
    "metadata": (lambda v: isinstance(v, dict), "an object (kept nowhere)"),
}
COMPLETION_NO_OP = {
    "suffix": (lambda v: v == "", '""'),
    "echo": (lambda v: v is False, "false"),
    "best_of": (lambda v: v == 1, "1"),
}
CHAT_NO_OP = {
    "logprobs": (lambda v: v is False, "false"),
    "top_logprobs": (lambda v: v == 0, "0"),
}


def _isnum(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class ServerConfig:
    """Limits of the HTTP layer (the engine's own are ``EngineConfig``)."""

    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 10.0  # a body that does not arrive in full by then is a 400
    max_choices: int = 16  # n x prompts in one request
    default_max_tokens: int = 16  # completions (chat defaults to the rest of the context)
    # the Host header values requests may carry (lower case, without the port); None accepts any. ``xtrain
    # serve`` sets the bind address and the loopback names, so a web page the user visits cannot reach the
    # server through a DNS name that points at it (DNS rebinding)
    allowed_hosts: tuple[str, ...] | None = None


ERROR_TYPES = {404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}  # else invalid_request


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, kind=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        e = {"message": _utf8(self.message), "type": self.kind, "param": _utf8(self.param), "code": self.code}
        return {"error": e}


def _utf8(text: str | None) -> str | None:
    """Text that encodes as UTF-8: a lone surrogate from the request (a field name) becomes ``\\udXXX``."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def unavailable(message: str = "the server is shutting down; retry later") -> APIError:
    return APIError(503, message, None, "shutting_down")


# -- parsing and validation ---------------------------------------------------------------------------------
JSON_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):  # parsers disagree on which of two values wins: refuse rather than guess
        dup = next(k for k, count in Counter(k for k, _ in pairs).items() if count > 1)
        raise ValueError(f"duplicate key {_clip(dup)}")
    return d


def _too_deep(v, limit: int) -> bool:
    """Whether v nests lists/objects deeper than ``limit`` (iterative: no recursion on a hostile body)."""
    stack = [(v, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (list, dict)):
            if d > limit:
                return True
            stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return False


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400: empty, not UTF-8, not JSON (NaN and Infinity included),
    duplicate keys, nested deeper than MAX_DEPTH, or not an object."""
    if not raw.strip():
        raise bad("the body is empty; send a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the body is not UTF-8 ({e.reason} at byte {e.start})", code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise bad(f"the body nests deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError is a ValueError; so are the two hooks' refusals
        raise bad(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the body must be a JSON object, got {JSON_KINDS.get(type(body), 'a number')}", code="invalid_json")
    if _too_deep(body, MAX_DEPTH):
        raise bad(f"the body nests deeper than {MAX_DEPTH} levels", code="invalid_json")
    return body


def _clip(v, n: int = 40) -> str:
    """A short JSON rendering of a request value for an error message."""
    text = json.dumps(v)  # the body's depth is bounded (parse_body), so this cannot recurse deeply
    return text if len(text) <= n else text[: n - 3] + "..."


def _text(v, param: str) -> str:
    if not isinstance(v, str):
        raise bad(f"{param} must be a string, got {type(v).__name__}", param)
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"{param} is not valid Unicode (a lone surrogate?)", param, "invalid_unicode") from None
    return v


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false"}


def _field(body: dict, key: str, default, kind: type = int, lo: int = 0, hi: int = 1 << 31):
    """body[key] (``default`` when absent or null) as ``kind``: an int in [lo, hi], a finite float or a bool;
    a 400 naming the field otherwise (a bool is not a number here, as JSON's true is not 1)."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) != (kind is bool) or not isinstance(v, (int, float) if kind is float else kind):
        raise bad(f"{key} must be {_TYPE_NAMES[kind]}, got {_clip(v)}", key, "invalid_type")
    if kind is int and not lo <= v <= hi:
        raise bad(f"{key} must lie in [{lo}, {hi}], got {_clip(v)}", key, "invalid_value")
    if kind is float:
        try:
            v = float(v)  # an integer past the float range (10**400) overflows here
        except OverflowError:
            v = math.inf
        if not math.isfinite(v):
            raise bad(f"{key} must be finite, got {_clip(body[key])}", key, "invalid_value")
    return v


@dataclass
class Params:
    """A request's settings apart from its prompts."""

    sampling: Sampling  # the first choice's: choice j of n uses seed + j
    max_tokens: int | None
    stop: list[str]
    n: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    eos_id: int | None = None  # the token that ends a reply (None: the tokenizer's end-of-text)


def parse_params(body: dict, chat: bool, max_choices: int) -> Params:
    """The fields of a chat (or completions) request other than its prompts, checked -> Params, or a 400."""
    no_op = {**NO_OP_FIELDS, **(CHAT_NO_OP if chat else COMPLETION_NO_OP)}
    unknown = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS) - set(no_op))
    if unknown:
        names = ", ".join(k[:40] for k in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        raise bad(f"Unrecognized request argument supplied: {names}", unknown[0][:40], "unknown_field")
    for key in sorted(set(body) & set(no_op)):
        is_no_op, accepted = no_op[key]
        if body[key] is not None and not is_no_op(body[key]):
            msg = f"{key} {_clip(body[key], 60)} is not supported by this server; it accepts only {accepted} "
            raise bad(msg + "(or leaving the field out), which changes nothing", key, "unsupported_value")
    temperature = _field(body, "temperature", 1.0, float)
    if temperature < 0:
        raise bad(f"temperature must be >= 0, got {temperature}", "temperature", "invalid_value")
    top_p = _field(body, "top_p", 1.0, float)
    if not 0 < top_p <= 1:
        raise bad(f"top_p must lie in (0, 1], got {top_p}", "top_p", "invalid_value")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop must be a non-empty string or a list of up to 4 of them", "stop", "invalid_value")
    stop = [_text(s, "stop") for s in stop]
    opts = {} if body.get("stream_options") is None else body["stream_options"]
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise bad('stream_options must be {"include_usage": bool}', "stream_options", "invalid_value")
    seed = _field(body, "seed", None, int, -(1 << 63), (1 << 64) - 1)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad(f"user must be a string, got {_clip(body['user'])}", "user", "invalid_type")
    max_tokens = _field(body, "max_tokens", None, int, 1)
    if chat and max_tokens is None:  # the newer name of the same field
        max_tokens = _field(body, "max_completion_tokens", None, int, 1)
    sampling = Sampling(
        temperature=temperature,
        top_k=_field(body, "top_k", 0, int, 0),
        top_p=top_p,
        seed=secrets.randbits(63) if seed is None else seed % (1 << 64),
        logprobs=0 if chat else _field(body, "logprobs", 0, int, 0, 5),
    )
    n = _field(body, "n", 1, int, 1, max_choices)
    stream, include_usage = _field(body, "stream", False, bool), _field(opts, "include_usage", False, bool)
    return Params(sampling, max_tokens, stop, n, stream, include_usage, _field(body, "ignore_eos", False, bool))


def chat_prompt(messages) -> str:
    """The plain-text chat template of our base models (``docs/serve.md``) -> the prompt text (end-of-text is
    added later)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages", "invalid_value")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in CHAT_ROLES:
            raise bad(f"messages[{i}] needs a role in {sorted(CHAT_ROLES)}", "messages", "invalid_value")
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in c):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages", "invalid_value")
            c = "".join(_text(p.get("text"), "messages") for p in c)
        parts.append(f"{CHAT_ROLES[m['role']]}: {_text(c, 'messages')}\n\n")
    return "".join(parts) + "Assistant:"


# -- one choice: tokens -> text, stop strings, what to stream ----------------------------------------------
@dataclass
class Choice:
    index: int
    stops: list[str]
    ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    text: str = ""  # the final text when finished, else what may be sent so far
    sent: int = 0  # characters already streamed
    lp_sent: int = 0  # logprobs already streamed
    ended: bool = False  # the final chunk streamed
    finish: str | None = None
    seq: object = None


def _stop_hold(text: str, stops: list[str]) -> int:
    """How many trailing characters might still become a stop string (so must not be sent yet): the longest end
    of ``text`` that a stop string begins with, shorter than that stop string."""
    ends = (k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if s.startswith(text[-k:]))
    return max(ends, default=0)


class Service:
    """Tokenizer + template + engine: the server's state. The engine's batcher thread starts here."""

    def __init__(
        self,
        model,
        tokenizer,
        name: str = "xtrain",
        engine_config: EngineConfig = EngineConfig(),
        config: ServerConfig = ServerConfig(),
        chat_template=None,
    ):
        self.model, self.tok, self.name, self.config = model, tokenizer, name, config
        self.chat_template = chat_template  # a checkpoint's ChatTemplate, or None: the plain-text template
        self.engine = Engine(model)
        self.batcher = Batcher(self.engine, engine_config).start()
        self.created = int(time.time())
        self.jobs: set[Job] = set()  # requests in flight (a shutdown ends them)
        self.draining = False  # ``shutdown`` has begun: new requests get a 503
        self.drained = asyncio.Event()  # set with ``draining``: bodies still arriving stop being waited for
        self.hurry = False  # end the running requests now, without waiting out the grace period
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's event loop, once it runs

    def close(self) -> None:
        self.batcher.close()

    def health(self) -> dict:
        c = self.model.config
        return {
            "status": "draining" if self.draining else "ok",
            "model": self.name,
            "params": self.model.num_params(),
            "vocab_size": c.vocab_size,
            "max_seq_len": c.max_seq_len,
            **self.batcher.load(),
        }

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "xtrain"}

    # -- requests -> token ids ---------------------------------------------------------------------------
    def check_model(self, body: dict) -> None:
        m = body.get("model")
        if m is not None and not isinstance(m, str):
            raise bad(f"model must be a string, got {_clip(m)}", "model", "invalid_type")
        if m is not None and m != self.name:
            msg = f"The model {m[:100]!r} does not exist; this server serves {self.name!r}"
            raise APIError(404, msg, "model", "model_not_found")

    def _check_bytes(self, texts: list[str], per_token: int, extra: int, param: str) -> None:
        """A 400 for texts whose UTF-8 bytes alone show they cannot fit the context (each token stands for at
        most ``per_token`` bytes; ``extra`` tokens are added): tokenizing a megabyte takes seconds that every
        other stream would wait for."""
        n = sum(len(t.encode("utf-8", errors="surrogatepass")) for t in texts)
        at_least, ctx = -(-n // per_token) + extra, self.batcher.max_len  # ceil(n / per_token) + extra tokens
        if at_least >= ctx:
            msg = f"the {param}: {n} bytes, at least {at_least} tokens; the context holds {ctx} (prompt + max_tokens)"
            raise bad(msg, param, "context_length_exceeded")

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        """[eot] + the text's tokens (refused first when its bytes alone cannot fit: ``_check_bytes``)."""
        if getattr(self.tok, "max_token_bytes", None):
            self._check_bytes([text], self.tok.max_token_bytes, 1, param)
        return [self.tok.eot_id] + self.tok.encode(text)

    def template_prompt(self, messages) -> list[int]:
        """The run's own chat template's prompt ids; refused before rendering when the texts alone cannot fit."""
        from xtrain.data.chat import ChatError

        texts = [m.get("content") for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
        self._check_bytes([t for t in texts if isinstance(t, str)], self.chat_template.max_token_bytes, 0, "messages")
        try:
            return self.chat_template.prompt_ids(messages)
        except ChatError as e:
            raise bad(str(e), "messages", "invalid_value") from None

    def completion_prompts(self, body: dict) -> list[list[int]]:
        p, V = body.get("prompt"), self.model.config.vocab_size
        is_ids = lambda x: isinstance(x, list) and x and all(isinstance(i, int) and not isinstance(i, bool) for i in x)
        p = [p] if isinstance(p, str) or is_ids(p) else p  # one prompt, or a list of them
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            return [self.encode(_text(x, "prompt")) for x in p]
        if isinstance(p, list) and p and all(is_ids(x) for x in p):
            if any(not 0 <= i < V for x in p for i in x):
                raise bad(f"prompt token ids must lie in [0, {V})", "prompt", "invalid_value")
            return p
        raise bad("prompt must be a non-empty string, a list of strings, or token ids", "prompt", "invalid_type")

    def prepare(self, body: dict, chat: bool):
        """-> (prompts, params, max_new_tokens) or APIError."""
        params = parse_params(body, chat, self.config.max_choices)
        self.check_model(body)
        if chat and self.chat_template is not None:
            prompts = [self.template_prompt(body.get("messages"))]
            params.eos_id = self.chat_template.end_of_turn_id
        elif chat:
            prompts = [self.encode(chat_prompt(body.get("messages")), "messages")]
            params.stop = params.stop + [s for s in CHAT_STOPS if s not in params.stop]
        elif "prompt" not in body:
            raise bad("missing field 'prompt'", "prompt", "missing_field")
        else:
            prompts = self.completion_prompts(body)
        if len(prompts) * params.n > self.config.max_choices:
            raise bad(f"n x prompts must be at most {self.config.max_choices}", "n", "invalid_value")
        # the token budget: the prompt and max_tokens within the context
        ctx, longest, max_tokens = self.batcher.max_len, max(len(p) for p in prompts), params.max_tokens
        if longest >= ctx:
            msg = f"the prompt is {longest} tokens; the context holds {ctx} (prompt + max_tokens)"
            raise bad(msg, "prompt", "context_length_exceeded")
        if max_tokens is None:
            return prompts, params, min(ctx if chat else self.config.default_max_tokens, ctx - longest)
        if longest + max_tokens > ctx:
            msg = f"max_tokens {max_tokens} + the prompt's {longest} tokens exceed the context of {ctx}"
            raise bad(msg, "max_tokens", "context_length_exceeded")
        return prompts, params, max_tokens

    # -- running -----------------------------------------------------------------------------------------
    def start(self, prompts, params: Params, max_new: int, receive=None) -> "Job":
        """Submit every (prompt, choice) -> a ``Job`` whose queue gets (index, token, logprobs, finish) events.
        ``receive`` (the ASGI receive of the request, its body read) is watched for the client going away."""
        if self.draining:
            raise unavailable()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        eos = None if params.ignore_eos else self.tok.eot_id if params.eos_id is None else params.eos_id
        reqs = []
        for i, (ids, j) in enumerate((ids, j) for ids in prompts for j in range(params.n)):
            smp = replace(params.sampling, seed=(params.sampling.seed + j) % (1 << 64))
            cb = lambda t, lp, f, i=i: loop.call_soon_threadsafe(queue.put_nowait, (i, t, lp, f))
            reqs.append((ids, max_new, smp, eos, cb))
        try:
            seqs = self.batcher.submit(reqs)
        except QueueFull as e:
            if self.batcher.stopping or self.batcher.draining:
                raise unavailable(str(e)) from None
            raise APIError(429, str(e), None, "server_busy") from None
        except ValueError as e:
            raise bad(str(e), "prompt", "invalid_value") from None
        return Job(self, [Choice(i, params.stop, seq=s) for i, s in enumerate(seqs)], queue, receive)

    async def shutdown(self, grace: float, flush: float = 2.0) -> int:
        """Drain (a graceful shutdown): new requests get a 503, the queued ones a 503 now, the running ones
        run to their end for up to ``grace`` seconds (less once ``hurry`` is set), then end with finish_reason
        "abort" and whatever they have. Returns once every request is answered, or ``flush`` seconds later (a
        client that stopped reading) -> how many requests the grace period's end cut short."""
        loop = asyncio.get_running_loop()
        self.draining = True
        self.drained.set()
        self.batcher.drain()  # the queued requests' sequences end "cancelled": their handlers answer 503
        end = loop.time() + grace
        while self.jobs and loop.time() < end and not self.hurry:
            await asyncio.sleep(0.02)
        cut = list(self.jobs)
        for job in cut:
            job.abort()
        end = loop.time() + flush
        while self.jobs and loop.time() < end:
            await asyncio.sleep(0.02)
        return len(cut)

    def update(self, c: Choice, tok, lp, finish) -> None:
        """Fold one engine event into the choice: new text (held back while it may still become a stop
        string or ends inside a UTF-8 character), a stop string found (cancel the sequence), the end."""
        if tok is not None and c.finish is None:
            c.ids.append(tok)
            if lp is not None:
                c.logprobs.append((tok, lp))
            text = self.tok.decode(c.ids)
            for s in c.stops:
                k = text.find(s)
                if k >= 0:
                    text = text[:k]
                    c.finish = "stop"
                    c.seq.cancel()
            if c.finish is None:  # U+FFFD at the end: a character whose bytes have not all come yet
                text = text[: len(text) - _stop_hold(text, c.stops)].rstrip("\ufffd")
            c.text = text
        if finish is not None and c.finish is None:
            if finish.startswith("error"):
                raise APIError(500, f"the engine failed: {finish}", None, "engine_error", "server_error")
            # "cancelled" that we did not ask for (a stop string or a client gone set c.finish first) is the
            # engine dropping the sequence at a shutdown, as "abort" is the shutdown's grace running out
            c.finish = finish if finish in ("stop", "length") else ABORT
            c.text = self.tok.decode(c.ids)

    def completion_logprobs(self, c: Choice, start: int = 0) -> dict | None:
        """OpenAI's completions ``logprobs`` of choice c's tokens from ``start`` on (None when there are none)."""
        lps, d = c.logprobs[start:], self.tok.decode
        if not lps:
            return None
        toks = [d([t]) for t, _ in lps]
        return {
            "tokens": toks,
            "token_logprobs": [lp[0] for _, lp in lps],
            "top_logprobs": [{d([i]): v for i, v in lp[1]} for _, lp in lps],
            "text_offset": list(accumulate(map(len, toks[:-1]), initial=0)),
        }


# -- requests in flight -------------------------------------------------------------------------------------
GONE = object()  # put on a job's queue when its client disconnects


class ClientGone(Exception):
    """The client closed its connection: nothing more can be sent; the request ends quietly."""


async def _watch_disconnect(receive, queue: asyncio.Queue) -> None:
    """Wait for the ASGI ``http.disconnect`` of a request whose body has been read (the server reports it when
    the connection closes), then tell the request's handler through its queue."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception as e:  # a server whose receive fails once the connection is gone: the same news
        log.debug("xtrain serve: receive failed (%s: %s); taking the client as gone", type(e).__name__, e)
    queue.put_nowait(GONE)


class Job:
    """One request in flight: its choices, the queue on which their engine events arrive, and a task that
    watches the client's connection (its disconnect puts GONE on the queue, so a handler waiting for tokens
    hears of it at once, streamed or not). Registered with the service until ``close``, so a shutdown can end
    it."""

    def __init__(self, service: Service, choices: list[Choice], queue: asyncio.Queue, receive=None):
        self.service, self.choices, self.queue = service, choices, queue
        self.watch = asyncio.ensure_future(_watch_disconnect(receive, queue)) if receive is not None else None
        service.jobs.add(self)

    async def step(self) -> Choice:
        """Fold the next engine event (index, token, logprobs, finish) into its choice -> that choice;
        ClientGone when the client left first."""
        ev = await self.queue.get()
        if ev is GONE:
            raise ClientGone
        i, tok, lp, fin = ev
        self.service.update(self.choices[i], tok, lp, fin)
        return self.choices[i]

    def abort(self) -> None:
        """End every unfinished choice now (finish_reason "abort"): the shutdown's grace is over."""
        for c in self.choices:
            if c.finish is None:
                self.queue.put_nowait((c.index, None, None, ABORT))
        self.service.batcher.withdraw([c.seq for c in self.choices])

    def close(self) -> None:
        """The response is complete or the client gone: free the slots (and queue places) still held."""
        self.service.batcher.withdraw([c.seq for c in self.choices if not c.seq.done])
        if self.watch is not None:
            self.watch.cancel()
        self.service.jobs.discard(self)


# -- the app -------------------------------------------------------------------------------------------------
async def read_body(request, config: ServerConfig, drained: asyncio.Event) -> bytes:
    """The body, at most max_body_bytes (413 past it), in full within body_timeout_s (400 otherwise);
    ClientGone when the client disconnects before it is in; a 503 when ``drained`` is set first (a shutdown
    does not wait for a body still on its way)."""
    from starlette.requests import ClientDisconnect

    cl = request.headers.get("content-length")
    if cl is not None:
        if not (cl.isascii() and cl.isdigit()):
            raise bad(f"bad Content-Length {cl[:40]!r}", code="invalid_request")
        if len(cl) > 18 or int(cl) > config.max_body_bytes:
            msg = f"the body is {cl[:40]} bytes; the limit is {config.max_body_bytes}"
            raise APIError(413, msg, None, "body_too_large")
    body = bytearray()

    async def read():
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > config.max_body_bytes:
                raise APIError(413, f"the body exceeds {config.max_body_bytes} bytes", None, "body_too_large")

    reader = asyncio.ensure_future(read())
    waits = {reader, asyncio.ensure_future(drained.wait())}
    try:
        await asyncio.wait(waits, timeout=config.body_timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()  # a no-op on the one that finished
    if reader.done() and not reader.cancelled():
        try:
            reader.result()
        except ClientDisconnect:
            raise ClientGone from None
        return bytes(body)
    if drained.is_set():
        raise unavailable()
    raise bad(f"the body did not arrive in full within {config.body_timeout_s} s", code="body_timeout")


def create_app(service: Service):
    """The FastAPI application over a ``Service`` (closing the app's lifespan closes the service)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    @asynccontextmanager
    async def lifespan(app):
        service.loop = asyncio.get_running_loop()  # a shutdown signal schedules ``service.shutdown`` on it
        yield
        service.close()

    app = FastAPI(title="xtrain", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def err(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return err(e)

    @app.exception_handler(ClientGone)
    async def _client_gone(request, e: ClientGone):
        client = request.client
        log.debug("xtrain serve: %s %s: the client went away", f"{client.host}:{client.port}" if client else "?",
                  request.url.path)  # fmt: skip
        return Response(status_code=400)  # the server drops it: the connection is closed

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        what = "no such path" if e.status_code == 404 else str(e.detail)
        return err(APIError(e.status_code, f"{what}: {request.method} {request.url.path}", None, None))

    @app.exception_handler(Exception)
    async def _any_error(request, e: Exception):
        return err(APIError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error", "server_error"))

    allowed = service.config.allowed_hosts

    class HostCheck:
        """A plain ASGI middleware (Starlette's BaseHTTPMiddleware would pipe every response, streams
        included, through a task of its own): a Host header outside ``allowed`` gets a 403."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http" and allowed is not None:
                host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
                if host is not None and host_name(host) not in allowed:
                    msg = f"Host {host[:100]!r} is not an address of this server ({', '.join(allowed)}); "
                    msg += f"start xtrain serve with --allow-host {host_name(host)[:100]} to accept it"
                    e = APIError(403, msg, None, "host_not_allowed", "permission_error")
                    return await err(e)(scope, receive, send)
            await self.app(scope, receive, send)

    app.add_middleware(HostCheck)

    class EventStream(StreamingResponse):
        """Server-sent events from an async iterator of str. Unlike StreamingResponse it does not read
        ``receive`` itself: the request's ``Job`` watches the connection and ends the iterator when the
        client goes away. While the server drains, a client that stops reading is given up after a time."""

        async def __call__(self, scope, receive, send):
            async def put(message):  # wait_for with timeout None waits as long as it takes
                await asyncio.wait_for(send(message), DRAIN_SEND_S if service.draining else None)

            try:
                await put({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in self.body_iterator:
                    await put({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
                await put({"type": "http.response.body", "body": b"", "more_body": False})
            except (OSError, asyncio.TimeoutError):  # the connection is gone or stuck: nobody to tell
                log.debug("xtrain serve: a stream's client went away or stopped reading")
            finally:
                await self.body_iterator.aclose()

    @app.get("/health")
    async def health():
        return JSONResponse(service.health(), status_code=503 if service.draining else 200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [service.model_card()]}

    @app.get("/v1/models/{model_id:path}")  # ids may hold "/" (org/name)
    async def model(model_id: str):
        service.check_model({"model": model_id})
        return service.model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _handle(request, chat=True)

    async def _handle(request, chat: bool):
        ctype = request.headers.get("content-type", "")
        if ctype.split(";")[0].strip().lower() != "application/json":
            # a form or text/plain post is what a web page can send without asking the browser first (CORS)
            msg = f"Content-Type must be application/json, got {ctype[:60]!r}"
            raise APIError(415, msg, None, "unsupported_media_type")
        body = parse_body(await read_body(request, service.config, service.drained))
        prompts, params, max_new = service.prepare(body, chat)
        job = service.start(prompts, params, max_new, request.receive)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = ("chat.completion.chunk" if params.stream else "chat.completion") if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": int(time.time()), "model": service.name}
        prompt_tokens = sum(len(p) for p in prompts)
        streaming = False
        try:
            # the status line waits for the end, or for a stream's first token: a request that a shutdown ends
            # while it is queued gets its 503 rather than a 200 with nothing in it
            started = lambda: any(c.ids or c.finish not in (None, ABORT) for c in job.choices)
            while not all(c.finish for c in job.choices) and not (params.stream and started()):
                await job.step()
            if all(c.finish == ABORT and not c.ids for c in job.choices):  # each ended by the drain, still queued
                raise unavailable("the server shut down before this request ran; retry later")
            if params.stream:
                gen = _stream(job, head, chat, params, prompt_tokens)
                streaming = True  # the stream closes the job
                return EventStream(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        finally:
            if not streaming:
                job.close()
        if chat:
            out = [_choice(c, "message", {"role": "assistant", "content": c.text}, None, c.finish) for c in job.choices]
        else:
            out = [_choice(c, "text", c.text, service.completion_logprobs(c), c.finish) for c in job.choices]
        return {**head, "choices": out, "usage": _usage(job.choices, prompt_tokens)}

    async def _stream(job: Job, head, chat, params, prompt_tokens):
        key, choices = "delta" if chat else "text", job.choices

        def event(choice_list, usage=None):
            d = {**head, "choices": choice_list}
            if params.include_usage:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        def news(c: Choice):
            """The events for what choice c has and the client has not: new text, then its end."""
            if len(c.text) > c.sent:
                new, lps = c.text[c.sent :], service.completion_logprobs(c, c.lp_sent)  # chats have no logprobs
                c.sent, c.lp_sent = len(c.text), len(c.logprobs)
                yield event([_choice(c, key, {"content": new} if chat else new, lps)])
            if c.finish is not None and not c.ended:
                c.ended = True
                yield event([_choice(c, key, {} if chat else "", None, c.finish)])

        try:
            if chat:  # the role comes first, as OpenAI sends it
                yield event([_choice(c, key, {"role": "assistant", "content": ""}) for c in choices])
            for c in choices:  # what came before the status line was sent
                for e in news(c):
                    yield e
            while any(c.finish is None for c in choices):
                try:
                    c = await job.step()
                except APIError as e:  # the engine failed this request
                    yield f"data: {json.dumps(e.body())}\n\n"
                    break
                for e in news(c):
                    yield e
            if params.include_usage:
                yield event([], _usage(choices, prompt_tokens))
            yield "data: [DONE]\n\n"
        except ClientGone:
            log.debug("xtrain serve: a stream's client went away")
        finally:  # also when the client goes away: the engine frees the slots at its next step
            job.close()

    return app


def _choice(c: Choice, key: str, value, logprobs=None, finish: str | None = None) -> dict:
    """One entry of a response's ``choices``: key "text" (completions), "message" (chat) or "delta" (chat chunks)."""
    return {"index": c.index, key: value, "logprobs": logprobs, "finish_reason": finish}


def host_name(host: str) -> str:
    """The name in a Host header, lower case, without the port (``[::1]:8000`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _usage(choices: list[Choice], prompt_tokens: int) -> dict:
    completion = sum(len(c.ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
