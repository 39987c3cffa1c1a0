"""Chat data for fine-tuning: conversations rendered with a checkpoint's chat template, the loss on the
assistant's tokens only, packed into windows that keep conversations apart.

Input: a ``.jsonl`` file, one conversation per line, OpenAI-style::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}

**Rendering** (``ChatTemplate``): the checkpoint's Jinja chat template (``chat_template.jinja``, or the
``chat_template`` of ``tokenizer_config.json``) is rendered the way transformers' ``apply_chat_template`` renders
it: a sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, loop controls, a ``tojson`` that
does not escape HTML, ``raise_exception`` and ``strftime_now``, the special tokens of tokenizer_config.json
(``bos_token``, ``eos_token``, ...) as variables, and keys whose value is null dropped from each message. The
text is then encoded by the checkpoint's ``tokenizer.json`` with its control tokens recognised (what
``apply_chat_template(..., tokenize=True)`` returns; tested for equality). A content given as a list of
``{"type": "text", "text": ...}`` parts is joined into one string first. A message whose text holds a special
token's string (``<|im_end|>``, ...) is refused: it would be read as the control token and could end a turn
or start one that the data never meant.

**Which tokens are trained.** For each assistant message i, the prompt the model sees at inference is
``render(messages[:i], add_generation_prompt=True)``; its tokens must be a prefix of the whole conversation's
tokens (else the conversation is refused, naming the message). The trained targets are the tokens after that
prompt up to and including the template's end-of-turn token (the first special token the template writes after
an assistant's content, ``<|im_end|>`` for Qwen): exactly what the model must generate for that turn, and where
it must stop. Every other target (system, user, the template's headers, the separator) is ``ignore_index``.

**Packing** (``pack``): conversations are laid out in one token stream, each followed by the separator (the
tokenizer's ``<|endoftext|>``, a special token no conversation contains), so that none crosses a training window:
the loader's windows are T+1 tokens starting every T tokens, and a conversation that does not fit in what is
left of the current window starts at the next window's first token, the gap filled with separators (untrained).
A conversation longer than a window is split over windows (counted in meta.json). The trainer keeps the
conversations of a window apart with its document mask, a document starting right after each separator
(``TrainConfig.doc_start = "after_eot"``): attention stays inside the conversation and RoPE positions count from
its first token, so training sees exactly the prompt that inference sees (no separator in front).

**On disk**: a data directory as ``xtrain data prepare`` writes one (``meta.json``, ``train_000000.bin``,
``val_000000.bin``: plain llm.c token shards), plus a loss-mask shard beside each token shard
(``train_000000.mask``: ``xtrain.data.shards.write_mask_shard``, one byte per token, 1 where that token is a trained
target) and the checkpoint's tokenizer files, copied unchanged. ``meta.json`` holds a ``chat`` entry (the trained
token counts, padding, the end-of-turn and separator ids, the window length T it was packed for).
``MaskedTokenLoader`` reads it: batches of ``(inputs [B, T], targets [B, T])`` whose untrained targets are -100.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from xtrain.data.loader import TokenLoader
from xtrain.data.shards import mask_path, read_mask_shard, token_dtype, write_mask_shard, write_shard
from xtrain.fileio import atomic_write_text

IGNORE_INDEX = -100
SEPARATOR = "<|endoftext|>"
CHAT_FORMAT = "xtrain-chat"
_PROBE = "xtrain probe reply 7f3a"  # an assistant content no template rewrites, to find the end-of-turn token
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatError(ValueError):
    """A conversation or a chat template that cannot be used; the message says which and why."""


# -- the Jinja environment (as transformers' chat_template_utils builds it) ---------------------------------
def _jinja_env():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (templates that mark assistant text for transformers'
        assistant masks) renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters (<, >, &, '): transformers replaces it with plain json.dumps
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _strings(obj):
    """Every string inside a message (its values, nested lists and objects)."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _strings(v)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _text_part(p) -> bool:
    return isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)


def _token_string(v) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, or an AddedToken object with "content"."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


class ChatTemplate:
    """A checkpoint's chat template and tokenizer: messages -> text -> token ids (and trained-token masks).

    >>> chat = ChatTemplate.from_dir("Qwen3-0.6B/")
    >>> ids = chat.prompt_ids([{"role": "user", "content": "Hi"}])     # what generate() continues
    >>> ids, mask = chat.conversation(messages)                        # mask[i] = 1: token i is trained
    """

    def __init__(self, tokenizer, template: str, special: dict[str, str], source: str = "<memory>"):
        self.tok, self.template_text, self.special, self.source = tokenizer, template, special, source
        if getattr(self.tok, "encode_special_tokens", False):
            self.tok.encode_special_tokens = False  # the template's control tokens are control tokens
        try:
            self.template = _jinja_env().from_string(template)
        except Exception as e:  # jinja2.TemplateSyntaxError and friends
            raise ChatError(f"{source}: the chat template does not compile ({type(e).__name__}: {e})") from None
        added = self.tok.get_added_tokens_decoder()  # id -> AddedToken
        self.control = {t.content: i for i, t in added.items() if t.special}  # special token string -> id
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.max_token_bytes = max(len(t.encode("utf-8")) for t in self.tok.get_vocab(with_added_tokens=True))
        self.end_of_turn_id = self._find_end_of_turn()
        self.separator_id = self.control.get(SEPARATOR)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> ChatTemplate:
        """From a checkpoint (or tokenizer) directory: tokenizer.json, tokenizer_config.json and, when present,
        chat_template.jinja (which wins over the config's ``chat_template``, as in transformers)."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tj, tc, jinja = path / "tokenizer.json", path / "tokenizer_config.json", path / "chat_template.jinja"
        if not tj.is_file():
            raise ChatError(f"{tj}: missing (a chat model needs its tokenizer)")
        try:
            tok = HFTokenizer.from_file(str(tj))
        except Exception as e:
            raise ChatError(f"{tj}: not a valid tokenizer.json ({e})") from None
        cfg = {}
        if tc.is_file():
            try:
                cfg = json.loads(tc.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ChatError(f"{tc}: not valid JSON ({e})") from None
        if cfg.get("split_special_tokens"):
            raise ChatError(f"{tc}: split_special_tokens is true, so the chat template's control tokens would be text")
        if jinja.is_file():
            template, source = jinja.read_text(encoding="utf-8"), str(jinja)
        else:
            template, source = cfg.get("chat_template"), str(tc)
            if isinstance(template, list):  # several named templates: the default one
                template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str) or not template:
            raise ChatError(f"{path}: no chat template (neither chat_template.jinja nor tokenizer_config.json has one)")
        special = {k: s for k in SPECIAL_KEYS if (s := _token_string(cfg.get(k))) is not None}
        return cls(tok, template, special, source)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.template_text.encode("utf-8")).hexdigest()[:16]

    # -- messages -> text -----------------------------------------------------------------------------------
    def check_messages(self, messages) -> list[dict]:
        """The messages as the template sees them: a list of objects with a string ``role``; null values dropped
        (as transformers drops them), text parts joined; ChatError for a control token inside any text."""
        if not isinstance(messages, list) or not messages:
            raise ChatError("messages must be a non-empty list")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ChatError(f"messages[{i}] must be an object with a string role")
            m = {k: v for k, v in m.items() if v is not None}
            c = m.get("content")
            if isinstance(c, list):
                if not all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c
                ):
                    raise ChatError(f"messages[{i}].content: only text parts are supported")
                m["content"] = "".join(p["text"] for p in c)
            texts = list(_strings(m))
            if not all(_encodable(t) for t in texts):
                raise ChatError(f"messages[{i}] is not valid Unicode (a lone surrogate?)")
            bad = next((t for s in texts for t in self.control if t in s), None)
            if bad is not None:
                raise ChatError(f"messages[{i}] holds the control token {bad!r} as text")
            out.append(m)
        return out

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for already-checked messages (``check_messages``)."""
        try:
            return self.template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special,
            )
        except Exception as e:  # the template's raise_exception, or an error inside it
            raise ChatError(f"the chat template failed: {type(e).__name__}: {e}") from None

    def encode(self, text: str) -> list[int]:
        """Text -> ids, the control tokens of the text recognised (no post-processor: no BOS is added)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def prompt_ids(self, messages) -> list[int]:
        """The ids a reply continues: the conversation rendered with the template's generation prompt."""
        return self.encode(self.render(self.check_messages(messages), add_generation_prompt=True))

    def _find_end_of_turn(self) -> int:
        """The template's end-of-turn token: the first special token it writes after an assistant's content; or
        the eos_token of tokenizer_config.json when the probe finds none."""
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
        try:
            text = self.render(probe)
        except ChatError:
            text = ""
        k = text.rfind(_PROBE)
        if k >= 0:
            for t in self.encode(text[k + len(_PROBE) :]):
                if t in self.control.values():
                    return t
        eos = self.special.get("eos_token")
        if eos in self.control:
            return self.control[eos]
        raise ChatError(f"{self.source}: cannot tell the template's end-of-turn token (no special token after a reply)")

    # -- one conversation -> ids and trained mask -----------------------------------------------------------
    def conversation(self, messages) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64 (N,), mask uint8 (N,)): the whole conversation's tokens and, per token, 1 where it is a
        trained target (the module docstring's rule: each assistant turn's tokens after its prompt, through the
        end-of-turn token)."""
        msgs = self.check_messages(messages)
        ids = self.encode(self.render(msgs))
        mask = np.zeros(len(ids), dtype=np.uint8)
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            prompt = self.encode(self.render(msgs[:i], add_generation_prompt=True))
            k = len(prompt)
            if ids[:k] != prompt:
                raise ChatError(
                    f"messages[{i}]: the template's prompt for this assistant turn is not a prefix of the whole "
                    "conversation's tokens, so what training sees would differ from what inference sees"
                )
            end = next((j for j in range(k, len(ids)) if ids[j] == self.end_of_turn_id), None)
            if end is None:
                raise ChatError(f"messages[{i}]: no end-of-turn token {self.decode([self.end_of_turn_id])!r} after it")
            mask[k : end + 1] = 1
        return np.asarray(ids, dtype=np.int64), mask


def load_chat_template(directory: str | os.PathLike) -> ChatTemplate | None:
    """The chat template a run (or checkpoint) directory keeps: chat_template.jinja, or a tokenizer_config.json
    with a ``chat_template``, beside its tokenizer.json; None for xtrain's own base models (no such files)."""
    d = Path(directory)
    if not (d / "tokenizer.json").is_file():
        return None
    has = (d / "chat_template.jinja").is_file()
    if not has and (d / "tokenizer_config.json").is_file():
        try:
            has = "chat_template" in json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ChatError(f"{d / 'tokenizer_config.json'}: not valid JSON ({e})") from None
    return ChatTemplate.from_dir(d) if has else None


# -- packing ------------------------------------------------------------------------------------------------
def pack(convs: Iterable[tuple[np.ndarray, np.ndarray]], seq_len: int, sep: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """Lay conversations out so none crosses a window of the loader (T+1 tokens starting every T = seq_len):
    each conversation followed by ``sep``; one that does not fit in the current window starts the next (the gap
    filled with ``sep``, untrained); the stream ends on a window's last token. -> (ids, mask, counts)."""
    T = seq_len
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    n, pad, long_, count = 0, 0, 0, 0

    def fill(k: int) -> None:
        nonlocal n, pad
        if k > 0:
            ids.append(np.full(k, sep, dtype=np.int64))
            masks.append(np.zeros(k, dtype=np.uint8))
            n += k
            pad += k

    for cids, cmask in convs:
        if sep in cids:
            raise ChatError(f"a conversation holds the separator token {sep}")
        need = len(cids) + 1  # + its separator
        window_end = (n // T) * T + T + 1  # one past the last token of the window position n is in
        if n % T != 0 and n + need > window_end:
            fill((n // T + 1) * T - n)  # start at the next window's first token
        long_ += need > T + 1
        ids += [cids, np.array([sep], dtype=np.int64)]
        masks += [cmask.astype(np.uint8), np.zeros(1, dtype=np.uint8)]
        n += need
        count += 1
    if n:  # complete the last window (T+1 tokens from a multiple of T)
        last = max(0, (n - 2) // T) * T  # the window holding the stream's last token
        fill(last + T + 1 - n)
    out_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    out_mask = np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8)
    return out_ids, out_mask, {"conversations": count, "padding_tokens": pad, "longer_than_window": long_}


# -- a chat data directory ----------------------------------------------------------------------------------
def read_conversations(path: Path, val_fraction: float) -> tuple[dict[str, list], dict[str, int], int]:
    """The jsonl's conversations split by a hash of each line: ({"train": [(line_no, messages)], "val": ...},
    {"train": bytes, "val": bytes}, skipped (conversations without an assistant message)). A malformed line is a
    ChatError naming it."""
    splits: dict[str, list] = {"train": [], "val": []}
    nbytes = {"train": 0, "val": 0}
    skipped = 0
    with open(path, "rb") as f:
        for no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ChatError(f"{path}:{no}: not valid JSON ({e})") from None
            msgs = obj.get("messages") if isinstance(obj, dict) else None
            if not isinstance(msgs, list) or not msgs:
                raise ChatError(f'{path}:{no}: expected an object with a non-empty "messages" list')
            if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in msgs):
                skipped += 1
                continue
            h = int.from_bytes(hashlib.sha256(raw.strip()).digest()[:8], "big") / 2**64
            split = "val" if h < val_fraction else "train"
            splits[split].append((no, msgs))
            nbytes[split] += len(raw)
    return splits, nbytes, skipped


def default_chat_dir(source: Path, chat: ChatTemplate, tok_dir: Path, seq_len: int) -> Path:
    cache = Path(os.environ.get("XTRAIN_CACHE") or Path.home() / ".cache" / "xtrain")
    src = source.expanduser().resolve()
    stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in src.stem)[:40] or "chat"
    key = hashlib.sha256(f"{src}|{_tokenizer_sha(tok_dir)}|{chat.sha256}".encode()).hexdigest()[:8]
    return cache / "data" / f"{stem}-chat-{key}-T{seq_len}"


def _tokenizer_sha(tok_dir: Path) -> str:
    return hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()[:16]


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def prepare_chat(
    source: str | os.PathLike,
    tok_dir: str | os.PathLike,
    out_dir: str | os.PathLike | None,
    seq_len: int,
    *,
    val_fraction: float = 0.02,
    force: bool = False,
    log=print,
) -> dict:
    """Render, mask and pack the conversations of ``source`` (.jsonl) with the chat template and tokenizer of
    ``tok_dir`` (a checkpoint directory) for windows of ``seq_len`` tokens into ``out_dir`` (default: the cache);
    -> its meta (also in meta.json, plus ``meta["dir"]``). Reused when complete and built from the same inputs."""
    from xtrain.data.prepare import META_FORMAT, META_VERSION, load_meta, unigram_loss
    from xtrain.hf import TOKENIZER_FILES

    t0 = time.perf_counter()
    source, tok_dir = Path(source), Path(tok_dir)
    if not source.is_file():
        raise FileNotFoundError(f"chat data {source} not found")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"chat data: seq_len must be an integer >= 2, got {seq_len!r}")
    chat = ChatTemplate.from_dir(tok_dir)
    if chat.separator_id is None:
        raise ChatError(f"{tok_dir}: the tokenizer has no special {SEPARATOR} token to separate packed conversations")
    out = Path(out_dir) if out_dir is not None else default_chat_dir(source, chat, tok_dir, seq_len)
    config = {
        "corpus": {"kind": "chat-jsonl", "path": str(source.resolve()), "sha256": _file_sha(source)},
        "tokenizer_source": {"path": str(tok_dir.resolve()), "sha256": _tokenizer_sha(tok_dir)},
        "chat_template_sha256": chat.sha256,
        "seq_len": seq_len,
        "val_fraction": val_fraction,
        "format": CHAT_FORMAT,
    }
    if not force and (out / "meta.json").is_file():
        try:
            meta = load_meta(out)
        except (ValueError, FileNotFoundError):
            meta = None
        if meta is not None and meta.get("config") == config:
            log(f"data: reusing {out} ({meta['chat']['trained_tokens']['train']:,} trained train tokens)")
            return {**meta, "dir": str(out)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)  # from here on the directory is incomplete
    log(f"data: rendering {source} with the chat template of {tok_dir} ...")
    splits, nbytes, skipped = read_conversations(source, val_fraction)
    stats, counts = {}, {}
    for split, convs in splits.items():

        def encoded(convs=convs):
            for no, msgs in convs:
                try:
                    yield chat.conversation(msgs)
                except ChatError as e:
                    raise ChatError(f"{source}:{no}: {e}") from None

        ids, mask, c = pack(encoded(), seq_len, chat.separator_id)
        name = f"{split}_000000.bin"
        write_shard(out / name, ids, chat.vocab_size)
        write_mask_shard(mask_path(out / name), mask)
        trained = ids[mask.astype(bool)]
        counts[split] = np.bincount(trained, minlength=chat.vocab_size)
        stats[split] = {
            "files": [[name, int(ids.size)]],
            "tokens": int(ids.size),
            "docs": c["conversations"],
            "bytes": nbytes[split],
            "bytes_per_token": round(nbytes[split] / max(int(ids.size), 1), 4),
            "trained_tokens": int(mask.sum()),
            "padding_tokens": c["padding_tokens"],
            "longer_than_window": c["longer_than_window"],
        }
    if stats["train"]["trained_tokens"] == 0:
        raise ChatError(f"{source}: no trained (assistant) tokens in the train split")
    for name in TOKENIZER_FILES:  # the checkpoint's own files, unchanged, so the run and its export carry them
        if (tok_dir / name).is_file():
            shutil.copyfile(tok_dir / name, out / name)
    unigram = unigram_loss(counts["train"], counts["val"])
    meta = {
        "format": META_FORMAT,
        "version": META_VERSION,
        "config": config,
        "vocab_size": chat.vocab_size,
        "eot_id": chat.separator_id,
        "tokenizer": "tokenizer.json",
        "tokenizer_kind": "bpe",
        "token_dtype": token_dtype(chat.vocab_size).name,
        "train": stats["train"],
        "val": stats["val"],
        "unigram_val_loss": round(unigram, 6) if math.isfinite(unigram) else None,
        "uniform_loss": round(math.log(chat.vocab_size), 6),
        "chat": {
            "seq_len": seq_len,
            "end_of_turn_id": chat.end_of_turn_id,
            "separator_id": chat.separator_id,
            "skipped_without_assistant": skipped,
            "trained_tokens": {s: stats[s]["trained_tokens"] for s in stats},
        },
        "seconds": {"total": round(time.perf_counter() - t0, 3)},
    }
    atomic_write_text(out / "meta.json", json.dumps(meta, indent=2) + "\n")
    tr = stats["train"]
    log(
        f"data: wrote {out}: {tr['docs']:,} train / {stats['val']['docs']:,} val conversations, "
        f"{tr['tokens']:,} train tokens of which {tr['trained_tokens']:,} trained (assistant) and "
        f"{tr['padding_tokens']:,} padding; windows of {seq_len}"
        + (f"; skipped {skipped} without an assistant turn" if skipped else "")
        + (f"; {tr['longer_than_window']} longer than a window (split)" if tr["longer_than_window"] else "")
    )
    return {**meta, "dir": str(out)}


def info_lines(meta: dict) -> list[str]:
    """What ``xtrain data info`` adds for a chat data directory: the tokens trained on."""
    c = meta["chat"]
    lines = [
        f"chat       windows of {c['seq_len']} tokens, end of turn id {c['end_of_turn_id']}, separator id "
        f"{c['separator_id']}; {c['skipped_without_assistant']} conversation(s) without an assistant turn skipped"
    ]
    for split in ("train", "val"):
        s = meta[split]
        share = s["trained_tokens"] / max(s["tokens"], 1)
        lines.append(
            f"{split:<10} {s['trained_tokens']:,} trained (assistant) tokens of {s['tokens']:,} ({share:.1%}), "
            f"{s['padding_tokens']:,} padding, {s['docs']:,} conversations, "
            f"{s['longer_than_window']} longer than a window"
        )
    return lines


# -- loading --------------------------------------------------------------------------------------------------
class MaskedTokenLoader(TokenLoader):
    """``TokenLoader`` over token shards with a mask shard beside each (``mask_path``): the same windows, order,
    data parallel slices and resume state, but each batch is ``(inputs [B, T], targets [B, T])`` with the
    targets that are not trained (mask 0) set to ``ignore_index``."""

    def __init__(self, pattern_or_files, batch_size: int, seq_len: int, *, ignore_index: int = IGNORE_INDEX, **kw):
        super().__init__(pattern_or_files, batch_size, seq_len, **kw)
        self.ignore_index = ignore_index
        self.masks = [read_mask_shard(mask_path(f), len(s)) for f, s in zip(self.files, self.shards)]
        self.trained_tokens = sum(int(m.sum()) for m in self.masks)

    def _mask_window(self, g: int) -> np.ndarray:
        s = int(np.searchsorted(self._first_window, g, side="right")) - 1
        start = (g - int(self._first_window[s])) * self.T
        return self.masks[s][start : start + self.T + 1]

    def _gather(self, windows: np.ndarray):
        ids = super()._gather(windows)  # [B, T+1]
        m = torch.from_numpy(np.stack([self._mask_window(int(g)) for g in windows]).astype(np.bool_))  # [B, T+1]
        targets = torch.where(m[:, 1:], ids[:, 1:], self.ignore_index)  # [B, T]
        return ids[:, :-1], targets
