"""The OpenAI-compatible HTTP API (FastAPI on uvicorn): text in, text out over the token-id engine.

    GET  /health                  {"status": "ok", "model": ..., "running": r, "waiting": w, "slots": s, ...}
                                  (a 503 with "status": "draining" once a shutdown has begun)
    GET  /v1/models               {"object": "list", "data": [{"id": MODEL, "object": "model", ...}]}
    GET  /v1/models/{MODEL}       the model card (MODEL may hold "/")
    POST /v1/completions          prompt (string, list of strings, token ids or lists of token ids)
    POST /v1/chat/completions     messages [{"role": "system" | "user" | "assistant", "content": ...}]

Request fields (both endpoints): ``model`` (the served name; another gets 404), ``max_tokens`` (>= 1;
completions default 16, chat default: the rest of the context), ``temperature`` (>= 0, default 1; 0 is
greedy), ``top_p`` (0 < p <= 1, default 1), ``top_k`` (0 = off), ``seed`` (0 <= seed < 2**64; choice i of
``n`` uses seed + i; without a seed each request draws one), ``stop`` (a string or up to 4), ``n``,
``stream``, ``stream_options`` ({"include_usage": bool}), ``user`` (a string, ignored), ``ignore_eos`` (as vLLM:
run to max_tokens); completions also take ``logprobs`` (0..5: top log-probabilities of each sampled
token). A temperature below ``xtrain.sampling.GREEDY_BELOW`` samples greedily, and a top_p however small
keeps the most likely token. Fields that clients send by default are accepted where their value changes
nothing (``NO_OP_FIELDS``: ``presence_penalty``/``frequency_penalty`` 0, ``logit_bias`` {}, ``suffix`` "",
``best_of`` 1, ``echo`` false, ``tools`` [], chat ``logprobs`` false, ..., or null) and are a 400 naming
the field otherwise. Responses carry ``id``, ``object``, ``created``, ``model``, ``choices`` (``text`` / ``message``,
or ``delta`` when streaming, with ``finish_reason`` "stop", "length", or "abort" for a request a shutdown
ended, ``Service.shutdown``) and ``usage``. ``stream: true`` answers with server-sent events, ``data: {chunk}``
lines and a final ``data: [DONE]``; the status line waits for the first token, so a request that never ran
gets its error status rather than a 200.

Tokens: a string prompt is preceded by the end-of-text token, as every training document is (so the
tokens match ``xtrain sample``); a token-id prompt is used as given. Generation stops at the next
end-of-text token or a stop string ("stop") or after max_tokens ("length").

Chat template. A run fine-tuned from a Hugging Face checkpoint (``xtrain train --init-from``) keeps the
checkpoint's Jinja chat template: ``messages`` are rendered with it and its generation prompt
(``xtrain.data.chat.ChatTemplate``, as transformers' ``apply_chat_template`` renders them; no end-of-text in
front), a message holding a special token's text (``<|im_end|>``, ...) is a 400, and the reply stops at the
template's end-of-turn token. Our own base models are trained on plain text, so their template is plain text:

    <|endoftext|>System: {system}\\n\\nUser: {user}\\n\\nAssistant: {assistant}\\n\\nUser: {user}\\n\\nAssistant:

each message rendered as ``Role: content`` followed by a blank line, in the order given, and the prompt
ending in ``Assistant:``; the reply is what the model writes next, up to end-of-text, max_tokens, a stop
string of the request, or the template's own stops ``\\n\\nUser:`` and ``\\n\\nSystem:`` (the model
starting the next turn). ``content`` is a string or a list of ``{"type": "text", "text": ...}`` parts.

Errors come in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a body that
is empty, not UTF-8 or not JSON (NaN and Infinity included), has duplicate keys, nests deeper than
``MAX_DEPTH`` or is not an object, for wrong types, out-of-range values, prompts that do not fit the context
and text that is not valid Unicode (a lone surrogate); 404 for an unknown model or path; 413 for a body
over ``ServerConfig.max_body_bytes``; 415 for a POST whose Content-Type is not application/json; 403 for a
Host header outside ``ServerConfig.allowed_hosts``; 429 when every slot is busy and the queue is full; 503
while shutting down (new requests, queued ones, bodies still arriving). A body shorter than its
Content-Length is a 400 after ``body_timeout_s``; a prompt whose bytes alone exceed the context is a 400
before it is tokenized.

Connections: each running request watches its client's connection (``Job``); a client that goes away, at
any point, ends its request at once and frees its slot or its place in the queue, with one debug-level log
line (logger ``xtrain.serve``) and no traceback.
"""

import asyncio
import json
import logging
import math
import secrets
import time
import uuid
from dataclasses import dataclass, field

from xtrain.serve.engine import Batcher, Engine, EngineConfig, QueueFull, Sampling

log = logging.getLogger("xtrain.serve")
DRAIN_SEND_S = 2.0  # while draining, a stream whose client has not taken a chunk in this time is given up

CHAT_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
CHAT_STOPS = ("\n\nUser:", "\n\nSystem:")
COMMON_FIELDS = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "user",
    "ignore_eos",
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}

# OpenAI fields clients send by default (LangChain's OpenAI sends presence_penalty 0, frequency_penalty 0 and
# logit_bias {}): accepted when their value changes nothing, a 400 naming the field otherwise.
# field -> (is the value a no-op?, the values accepted, for the message)
_none = lambda v: v is None
NO_OP_FIELDS = {
    "presence_penalty": (lambda v: _none(v) or (_isnum(v) and v == 0), "0"),
    "frequency_penalty": (lambda v: _none(v) or (_isnum(v) and v == 0), "0"),
    "repetition_penalty": (lambda v: _none(v) or (_isnum(v) and v == 1), "1"),
    "logit_bias": (lambda v: _none(v) or v == {}, "{}"),
    "response_format": (lambda v: _none(v) or v == {"type": "text"}, '{"type": "text"}'),
    "tools": (lambda v: _none(v) or v == [], "[]"),
    "functions": (lambda v: _none(v) or v == [], "[]"),
    "tool_choice": (lambda v: _none(v) or v == "none", '"none"'),
    "function_call": (lambda v: _none(v) or v == "none", '"none"'),
    "parallel_tool_calls": (lambda v: _none(v) or isinstance(v, bool), "true or false (there are no tools)"),
    "service_tier": (lambda v: _none(v) or v in ("auto", "default"), '"auto" or "default"'),
    "store": (lambda v: _none(v) or v is False, "false"),
    "metadata": (lambda v: _none(v) or isinstance(v, dict), "an object (kept nowhere)"),
}
COMPLETION_NO_OP = {
    "suffix": (lambda v: _none(v) or v == "", '""'),
    "echo": (lambda v: _none(v) or v is False, "false"),
    "best_of": (lambda v: _none(v) or v == 1, "1"),
}
CHAT_NO_OP = {
    "logprobs": (lambda v: _none(v) or v is False, "false"),
    "top_logprobs": (lambda v: _none(v) or v == 0, "0"),
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


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, kind=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(
            status, "invalid_request_error"
        )

    def body(self) -> dict:
        return {
            "error": {"message": _utf8(self.message), "type": self.kind, "param": _utf8(self.param), "code": self.code}
        }


def _utf8(text: str | None) -> str | None:
    """Text that encodes as UTF-8: a lone surrogate from the request (a field name) becomes ``\\udXXX``."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


# -- parsing and validation ---------------------------------------------------------------------------------
MAX_DEPTH = 32  # JSON nesting a request may have (messages[i].content[j].text is 5 deep)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):  # parsers disagree on which of two values wins: refuse rather than guess
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {_clip(k)}")
            seen.add(k)
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
        raise bad(f"the body must be a JSON object, got {_kind(body)}", code="invalid_json")
    if _too_deep(body, MAX_DEPTH):
        raise bad(f"the body nests deeper than {MAX_DEPTH} levels", code="invalid_json")
    return body


def _kind(v) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number"
    )


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


def _int(body: dict, key: str, default, lo: int, hi: int):
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad(f"{key} must be an integer, got {_clip(v)}", key, "invalid_type")
    if not lo <= v <= hi:
        raise bad(f"{key} must lie in [{lo}, {hi}], got {_clip(v)}", key, "invalid_value")
    return v


def _num(body: dict, key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise bad(f"{key} must be a number, got {_clip(v)}", key, "invalid_type")
    try:
        f = float(v)  # an integer past the float range (10**400) overflows here
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise bad(f"{key} must be finite, got {_clip(v)}", key, "invalid_value")
    return f


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{key} must be true or false, got {_clip(v)}", key, "invalid_type")
    return v


@dataclass
class Params:
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: list[str]
    n: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    logprobs: int = 0
    eos_id: int | None = None  # the token that ends a reply (None: the tokenizer's end-of-text)


def parse_params(body: dict, allowed: set[str], max_choices: int, no_op: dict | None = None) -> Params:
    no_op = no_op or {}
    unknown = sorted(set(body) - allowed - set(no_op))
    if unknown:
        names = ", ".join(k[:40] for k in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        raise bad(f"Unrecognized request argument supplied: {names}", unknown[0][:40], "unknown_field")
    for key in sorted(set(body) & set(no_op)):
        is_no_op, accepted = no_op[key]
        if not is_no_op(body[key]):
            raise bad(
                f"{key} {_clip(body[key], 60)} is not supported by this server; it accepts only {accepted} "
                "(or leaving the field out), which changes nothing",
                key,
                "unsupported_value",
            )
    temperature = _num(body, "temperature", 1.0)
    if temperature < 0:
        raise bad(f"temperature must be >= 0, got {temperature}", "temperature", "invalid_value")
    top_p = _num(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad(f"top_p must lie in (0, 1], got {top_p}", "top_p", "invalid_value")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop must be a non-empty string or a list of up to 4 of them", "stop", "invalid_value")
    stop = [_text(s, "stop") for s in stop]
    opts = body.get("stream_options")
    opts = {} if opts is None else opts
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise bad('stream_options must be {"include_usage": bool}', "stream_options", "invalid_value")
    seed = _int(body, "seed", None, -(1 << 63), (1 << 64) - 1)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad(f"user must be a string, got {_clip(body['user'])}", "user", "invalid_type")
    return Params(
        max_tokens=_int(body, "max_tokens", None, 1, 1 << 31),
        temperature=temperature,
        top_p=top_p,
        top_k=_int(body, "top_k", 0, 0, 1 << 31),
        seed=secrets.randbits(63) if seed is None else seed % (1 << 64),
        stop=stop,
        n=_int(body, "n", 1, 1, max_choices),
        stream=_bool(body, "stream", False),
        include_usage=_bool(opts, "include_usage", False),
        ignore_eos=_bool(body, "ignore_eos", False),
    )


def chat_prompt(messages) -> str:
    """The documented chat template (module docstring) -> the prompt text (end-of-text is added later)."""
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
    """How many trailing characters might still become a stop string (so must not be sent yet)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if s.startswith(text[-k:]):
                hold = k
                break
    return hold


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

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "xtrain"}

    # -- requests -> token ids ---------------------------------------------------------------------------
    def _check_model(self, body: dict) -> None:
        m = body.get("model")
        if m is not None and not isinstance(m, str):
            raise bad(f"model must be a string, got {_clip(m)}", "model", "invalid_type")
        if m is not None and m != self.name:
            raise APIError(
                404,
                f"The model {m[:100]!r} does not exist; this server serves {self.name!r}",
                "model",
                "model_not_found",
            )

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        """[eot] + the text's tokens. A text whose UTF-8 bytes alone show it cannot fit the context (each token
        stands for at most ``tok.max_token_bytes`` bytes) is refused before it is tokenized: tokenizing a
        megabyte takes seconds that every other stream would wait for."""
        per_token = getattr(self.tok, "max_token_bytes", None)
        ctx = self.batcher.max_len
        if per_token:
            n = len(text.encode("utf-8", errors="surrogatepass"))
            at_least = -(-n // per_token) + 1  # ceil(n / per_token) tokens, plus end-of-text
            if at_least >= ctx:
                raise bad(
                    f"the {param} is {n} bytes, at least {at_least} tokens; the context holds {ctx} "
                    "(prompt + max_tokens)",
                    param,
                    "context_length_exceeded",
                )
        return [self.tok.eot_id] + self.tok.encode(text)

    def template_prompt(self, messages) -> list[int]:
        """The run's own chat template's prompt ids; refused before rendering when the texts alone cannot fit."""
        from xtrain.data.chat import ChatError

        ctx, per_token = self.batcher.max_len, self.chat_template.max_token_bytes
        texts = [m.get("content") for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
        n = sum(len(t.encode("utf-8", errors="surrogatepass")) for t in texts if isinstance(t, str))
        if -(-n // per_token) >= ctx:
            raise bad(
                f"the messages are {n} bytes; the context holds {ctx} tokens", "messages", "context_length_exceeded"
            )
        try:
            return self.chat_template.prompt_ids(messages)
        except ChatError as e:
            raise bad(str(e), "messages", "invalid_value") from None

    def completion_prompts(self, body: dict) -> list[list[int]]:
        p = body.get("prompt")
        V = self.model.config.vocab_size
        if isinstance(p, str):
            return [self.encode(_text(p, "prompt"))]
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            return [self.encode(_text(x, "prompt")) for x in p]
        is_ids = lambda x: isinstance(x, list) and x and all(isinstance(i, int) and not isinstance(i, bool) for i in x)
        if is_ids(p):
            p = [p]
        if isinstance(p, list) and p and all(is_ids(x) for x in p):
            if any(not 0 <= i < V for x in p for i in x):
                raise bad(f"prompt token ids must lie in [0, {V})", "prompt", "invalid_value")
            return p
        raise bad("prompt must be a non-empty string, a list of strings, or token ids", "prompt", "invalid_type")

    def _budget(self, prompts: list[list[int]], max_tokens: int | None, default: int | None) -> int:
        ctx = self.batcher.max_len
        longest = max(len(p) for p in prompts)
        if longest >= ctx:
            raise bad(
                f"the prompt is {longest} tokens; the context holds {ctx} (prompt + max_tokens)",
                "prompt",
                "context_length_exceeded",
            )
        if max_tokens is None:
            return min(default or ctx, ctx - longest)
        if longest + max_tokens > ctx:
            raise bad(
                f"max_tokens {max_tokens} + the prompt's {longest} tokens exceed the context of {ctx}",
                "max_tokens",
                "context_length_exceeded",
            )
        return max_tokens

    def prepare(self, body: dict, chat: bool):
        """-> (prompts, params, max_new_tokens) or APIError."""
        no_op = {**NO_OP_FIELDS, **(CHAT_NO_OP if chat else COMPLETION_NO_OP)}
        params = parse_params(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, self.config.max_choices, no_op)
        self._check_model(body)
        if chat:
            if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
                params.max_tokens = _int(body, "max_completion_tokens", None, 1, 1 << 31)
            if self.chat_template is not None:
                prompts = [self.template_prompt(body.get("messages"))]
                params.eos_id = self.chat_template.end_of_turn_id
            else:
                prompts = [self.encode(chat_prompt(body.get("messages")), "messages")]
                params.stop = params.stop + [s for s in CHAT_STOPS if s not in params.stop]
            default = None
        else:
            if "prompt" not in body:
                raise bad("missing field 'prompt'", "prompt", "missing_field")
            prompts = self.completion_prompts(body)
            params.logprobs = _int(body, "logprobs", 0, 0, 5)
            default = self.config.default_max_tokens
        if len(prompts) * params.n > self.config.max_choices:
            raise bad(f"n x prompts must be at most {self.config.max_choices}", "n", "invalid_value")
        return prompts, params, self._budget(prompts, params.max_tokens, default)

    # -- running -----------------------------------------------------------------------------------------
    def start(self, prompts, params: Params, max_new: int, receive=None) -> "Job":
        """Submit every (prompt, choice) -> a ``Job`` whose queue gets (index, token, logprobs, finish) events.
        ``receive`` (the ASGI receive of the request, its body read) is watched for the client going away."""
        if self.draining:
            raise APIError(503, "the server is shutting down; retry later", None, "shutting_down")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        choices, reqs = [], []
        for pi, ids in enumerate(prompts):
            for j in range(params.n):
                idx = pi * params.n + j
                choices.append(Choice(idx, params.stop))
                smp = Sampling(
                    temperature=params.temperature,
                    top_k=params.top_k or None,
                    top_p=params.top_p,
                    seed=(params.seed + j) % (1 << 64),
                    logprobs=params.logprobs,
                )
                cb = lambda t, lp, f, i=idx: loop.call_soon_threadsafe(queue.put_nowait, (i, t, lp, f))
                eos = self.tok.eot_id if params.eos_id is None else params.eos_id
                reqs.append((ids, max_new, smp, None if params.ignore_eos else eos, cb))
        try:
            seqs = self.batcher.submit(reqs)
        except QueueFull as e:
            busy = self.batcher.stopping or self.batcher.draining
            raise APIError(503 if busy else 429, str(e), None, "shutting_down" if busy else "server_busy") from None
        except ValueError as e:
            raise bad(str(e), "prompt", "invalid_value") from None
        for c, s in zip(choices, seqs):
            c.seq = s
        return Job(self, choices, queue, receive)

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
            if c.finish is None:
                hold = _stop_hold(text, c.stops)
                while len(text) - hold > 0 and text[len(text) - hold - 1] == "\ufffd":
                    hold += 1
                text = text[: len(text) - hold]
            c.text = text
        if finish is not None and c.finish is None:
            if finish.startswith("error"):
                raise APIError(500, f"the engine failed: {finish}", None, "engine_error", "server_error")
            # "cancelled" that we did not ask for (a stop string or a client gone set c.finish first) is the
            # engine dropping the sequence at a shutdown, as "abort" is the shutdown's grace running out
            c.finish = finish if finish in ("stop", "length") else ABORT
            c.text = self.tok.decode(c.ids)

    def completion_logprobs(self, c: Choice, start: int = 0) -> dict | None:
        if not c.logprobs:
            return None
        d = self.tok.decode
        toks = [d([t]) for t, _ in c.logprobs[start:]]
        offsets, o = [], 0
        for t in toks:
            offsets.append(o)
            o += len(t)
        return {
            "tokens": toks,
            "token_logprobs": [lp[0] for _, lp in c.logprobs[start:]],
            "top_logprobs": [{d([i]): v for i, v in lp[1]} for _, lp in c.logprobs[start:]],
            "text_offset": offsets,
        }


# -- requests in flight -------------------------------------------------------------------------------------
ABORT = "abort"  # the finish_reason of a choice a shutdown ended before it finished (as vLLM's)
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

    async def next(self) -> tuple:
        """The next engine event (index, token, logprobs, finish); ClientGone when the client left first."""
        ev = await self.queue.get()
        if ev is GONE:
            raise ClientGone
        return ev

    async def step(self) -> Choice:
        """Fold the next event into its choice -> that choice."""
        i, tok, lp, fin = await self.next()
        self.service.update(self.choices[i], tok, lp, fin)
        return self.choices[i]

    def never_ran(self) -> bool:
        """Every choice ended by a shutdown before it produced a token (it was still queued)."""
        return all(c.finish == ABORT and not c.ids for c in self.choices)

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
async def read_body(request, config: ServerConfig, drained: asyncio.Event | None = None) -> bytes:
    """The body, at most max_body_bytes (413 past it), in full within body_timeout_s (400 otherwise);
    ClientGone when the client disconnects before it is in; a 503 when ``drained`` is set first (a shutdown
    does not wait for a body still on its way)."""
    from starlette.requests import ClientDisconnect

    cl = request.headers.get("content-length")
    if cl is not None:
        if not (cl.isascii() and cl.isdigit()):
            raise bad(f"bad Content-Length {cl[:40]!r}", code="invalid_request")
        if len(cl) > 18 or int(cl) > config.max_body_bytes:
            raise APIError(
                413, f"the body is {cl[:40]} bytes; the limit is {config.max_body_bytes}", None, "body_too_large"
            )
    chunks, size = [], 0

    async def read():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise APIError(413, f"the body exceeds {config.max_body_bytes} bytes", None, "body_too_large")
            chunks.append(chunk)

    reader = asyncio.ensure_future(read())
    waits = {reader} if drained is None else {reader, asyncio.ensure_future(drained.wait())}
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
        return b"".join(chunks)
    if drained is not None and drained.is_set():
        raise APIError(503, "the server is shutting down; retry later", None, "shutting_down")
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
                    e = APIError(
                        403,
                        f"Host {host[:100]!r} is not an address of this server ({', '.join(allowed)}); start "
                        f"xtrain serve with --allow-host {host_name(host)[:100]} to accept it",
                        None,
                        "host_not_allowed",
                        "permission_error",
                    )
                    return await err(e)(scope, receive, send)
            await self.app(scope, receive, send)

    app.add_middleware(HostCheck)

    class EventStream(StreamingResponse):
        """Server-sent events from an async iterator of str. Unlike StreamingResponse it does not read
        ``receive`` itself: the request's ``Job`` watches the connection and ends the iterator when the
        client goes away. While the server drains, a client that stops reading is given up after a time."""

        async def __call__(self, scope, receive, send):
            async def put(message):
                if service.draining:
                    await asyncio.wait_for(send(message), DRAIN_SEND_S)
                else:
                    await send(message)

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
        return service.models()

    @app.get("/v1/models/{model_id:path}")  # ids may hold "/" (org/name)
    async def model(model_id: str):
        service._check_model({"model": model_id})
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
            raise APIError(
                415, f"Content-Type must be application/json, got {ctype[:60]!r}", None, "unsupported_media_type"
            )
        body = parse_body(await read_body(request, service.config, service.drained))
        prompts, params, max_new = service.prepare(body, chat)
        job = service.start(prompts, params, max_new, request.receive)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "created": int(time.time()), "model": service.name}
        prompt_tokens = sum(len(p) for p in prompts)
        streaming = False
        try:
            if params.stream:
                # the status line waits for the first token, so a request a shutdown ends while it is queued gets
                # its 503 rather than a 200 with nothing in it
                choices = job.choices
                while not any(c.ids or c.finish not in (None, ABORT) for c in choices) and not all(
                    c.finish for c in choices
                ):
                    await job.step()
                if job.never_ran():
                    raise APIError(
                        503, "the server shut down before this request ran; retry later", None, "shutting_down"
                    )
                gen = _stream(job, head, chat, params, prompt_tokens)
                streaming = True  # the stream closes the job
                return EventStream(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            while any(c.finish is None for c in job.choices):
                await job.step()
            if job.never_ran():
                raise APIError(503, "the server shut down before this request ran; retry later", None, "shutting_down")
        finally:
            if not streaming:
                job.close()
        choices = job.choices
        usage = _usage(choices, prompt_tokens)
        if chat:
            out = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": None,
                    "finish_reason": c.finish,
                }
                for c in choices
            ]
            return {**head, "object": "chat.completion", "choices": out, "usage": usage}
        out = [
            {"index": c.index, "text": c.text, "logprobs": service.completion_logprobs(c), "finish_reason": c.finish}
            for c in choices
        ]
        return {**head, "object": "text_completion", "choices": out, "usage": usage}

    async def _stream(job: Job, head, chat, params, prompt_tokens):
        obj = "chat.completion.chunk" if chat else "text_completion"
        choices = job.choices

        def event(choice_list, usage=None):
            d = {**head, "object": obj, "choices": choice_list}
            if params.include_usage:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        def news(c: Choice) -> list[str]:
            """The events for what choice c has and the client has not: new text, then its end."""
            out = []
            if len(c.text) > c.sent:
                if chat:
                    p = {
                        "index": c.index,
                        "delta": {"content": c.text[c.sent :]},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                else:
                    lps = service.completion_logprobs(c, c.lp_sent) if len(c.logprobs) > c.lp_sent else None
                    p = {"index": c.index, "text": c.text[c.sent :], "logprobs": lps, "finish_reason": None}
                    c.lp_sent = len(c.logprobs)
                out.append(event([p]))
                c.sent = len(c.text)
            if c.finish is not None and not c.ended:
                c.ended = True
                if chat:
                    p = {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": c.finish}
                else:
                    p = {"index": c.index, "text": "", "logprobs": None, "finish_reason": c.finish}
                out.append(event([p]))
            return out

        try:
            if chat:  # the role comes first, as OpenAI sends it
                yield event(
                    [
                        {"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        for c in choices
                    ]
                )
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
                last = {**head, "object": obj, "choices": [], "usage": _usage(choices, prompt_tokens)}
                yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"
        except ClientGone:
            log.debug("xtrain serve: a stream's client went away")
        finally:  # also when the client goes away: the engine frees the slots at its next step
            job.close()

    return app


def host_name(host: str) -> str:
    """The name in a Host header, lower case, without the port (``[::1]:8000`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _usage(choices: list[Choice], prompt_tokens: int) -> dict:
    completion = sum(len(c.ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
