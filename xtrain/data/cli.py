"""xtrain data: prepare a corpus into token shards, and inspect prepared data.

xtrain data prepare                              # pystdlib, BPE vocab 4096, into the cache dir
xtrain data prepare --corpus tinystories --vocab-size 8192 --max-bytes 200M
xtrain data prepare --corpus my_texts/ --vocab-size 256 --out runs/data   # byte tokenizer
xtrain data info ~/.cache/xtrain/data/pystdlib-v4096       # meta + shard headers
xtrain data info train_000000.bin                          # one shard's header
xtrain data prepare --corpus chats.jsonl --chat Qwen3-0.6B/ --seq-len 1024   # chat data (xtrain.data.chat)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

PREPARE_DESCRIPTION = """Train a tokenizer and write train/val token shards + meta.json into one folder.

Validation split: a corpus with its own val file (tinystories, --val-corpus) uses it. A corpus of at
least 100 documents is split by name: a document is in val when a hash of its name falls in the lowest
--val-fraction. A smaller one (e.g. one input.txt with no <|endoftext|>), or one whose name split leaves a
side empty, gets the last --val-fraction of its text bytes as val, cut at the next line start. The log
says which rule it used.

--out: a new or empty folder, or an xtrain data dir (a meta.json of format xtrain-data) to rebuild; any
other folder is refused. A build is staged beside --out and swapped in when complete: a failed or
interrupted build leaves the previous data as it was.

Exit codes: 0 done; 2 refused input or output folder (one line, nothing changed); 74 a disk refused a
write (full, file too large, read-only; one line naming the path, nothing changed); 130/143 Ctrl-C/SIGTERM
(the output folder holds its previous data, or the new data if it was complete)."""

_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}


def parse_size(text: str) -> int:
    """'300k', '16M', '2G', '12000000' -> bytes (decimal units); '0' means no cap."""
    t = text.strip().lower().removesuffix("b")
    mult = _SUFFIXES.get(t[-1:], 1)
    try:
        value = float(t[:-1] if t[-1:] in _SUFFIXES else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 300k, 16M, 2G, 0)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"size must be >= 0, got {text!r}")
    return int(value * mult)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "data",
        help="prepare corpora into token shards; inspect them",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="data_command", metavar="ACTION")

    pp = sub.add_parser(
        "prepare",
        help="train a tokenizer and write train/val token shards + meta.json",
        description=PREPARE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pp.add_argument(
        "--corpus",
        default="pystdlib",
        help="pystdlib (default: this Python's standard library source), tinystories "
        "(download via huggingface_hub), or a local .txt/.jsonl/.parquet file or directory",
    )
    pp.add_argument(
        "--val-corpus",
        default=None,
        help="explicit val file/dir (default: the corpus's own val file, else a split of the corpus: see above)",
    )
    pp.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="tokenizer vocab incl. <|endoftext|> (default 4096; 256 selects the byte tokenizer)",
    )
    pp.add_argument(
        "--tokenizer",
        choices=["auto", "bpe", "bytes"],
        default="auto",
        help="auto: bytes when --vocab-size is 256/257, else BPE",
    )
    pp.add_argument("--tokenizer-path", default=None, help="use this tokenizer.json instead of training one")
    pp.add_argument(
        "--out",
        default=None,
        help="output dir: a new or empty folder, or an xtrain data dir to rebuild (anything else is refused); "
        "default $XTRAIN_CACHE/data/<corpus>-v<vocab>, XTRAIN_CACHE defaults to ~/.cache/xtrain",
    )
    pp.add_argument(
        "--max-bytes",
        type=parse_size,
        default=None,
        help="cap on corpus text, e.g. 300k, 16M (default: 16M for pystdlib, none otherwise; 0: none)",
    )
    pp.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="val share (default 0.02): by document name (a hash) when the corpus has >= 100 documents and "
        "that leaves neither side empty, else the last val-fraction of the text bytes, from a line start",
    )
    pp.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard (default 100M)")
    pp.add_argument(
        "--workers", type=int, default=None, help="encoding threads (the tokenizers library's pool; default: all cores)"
    )
    pp.add_argument(
        "--chat",
        default=None,
        metavar="CKPT",
        help="--corpus is a .jsonl of {messages: [...]}: render it with this Hugging Face checkpoint's chat template "
        "and tokenizer, train on assistant tokens only, packed for --seq-len windows",
    )
    pp.add_argument("--seq-len", type=int, default=None, help="with --chat: the training window the data is packed for")
    pp.add_argument("--force", action="store_true", help="rebuild even if matching data exists")
    pp.add_argument("--no-progress", action="store_true", help="no progress bar")
    pp.set_defaults(func=run)

    pi = sub.add_parser("info", help="print meta.json and shard headers of a data dir, or one shard's header")
    pi.add_argument("path", help="a prepared data directory, a .bin shard, or a meta.json")
    pi.add_argument("--check", action="store_true", help="also scan every token id against the vocab")
    pi.set_defaults(func=run)
    p.set_defaults(func=run, data_help=p.format_help)


EXIT_REFUSED = 2  # a refused input or output folder: one line, nothing changed
EXIT_IO = 74  # a disk refused a write (full, file too large, read-only): one line, nothing changed (EX_IOERR)


class _Terminated(BaseException):
    """SIGTERM during `data prepare`: unwinds like Ctrl-C, so the staging folder is removed."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def run(args) -> int:
    import signal
    import threading

    # SIGTERM unwinds like Ctrl-C while data prepare runs (only the main thread may set a handler)
    old_term = None
    if args.data_command == "prepare" and threading.current_thread() is threading.main_thread():
        old_term = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if args.data_command == "prepare":
            return _prepare(args)
        if args.data_command == "info":
            return _info(args)
        print(args.data_help(), file=sys.stderr)  # bare `xtrain data`
        return EXIT_REFUSED
    except (FileNotFoundError, ValueError, RuntimeError, ImportError) as e:
        print(f"xtrain data: error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except PermissionError as e:
        print(f"xtrain data: error: {e.filename}: permission denied ({e.strerror})", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as e:  # DataWriteError (a disk refusing a write) is already one line naming path and cause
        print(f"xtrain data: error: {one_line_os_error(e)}", file=sys.stderr)
        return EXIT_IO
    except KeyboardInterrupt:
        print("xtrain data: interrupted (SIGINT); nothing half-built was left in the output folder", file=sys.stderr)
        return 130
    except _Terminated:
        print("xtrain data: stopped (SIGTERM); nothing half-built was left in the output folder", file=sys.stderr)
        return 143
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def one_line_os_error(e: OSError) -> str:
    """``path: cause (ENAME)`` for an OSError, or its own message when it has one line of its own."""
    import errno

    from xtrain.data.prepare import DataWriteError

    if isinstance(e, DataWriteError) or e.errno is None:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    where = f"{e.filename}: " if e.filename is not None else ""
    return f"{where}{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})"


def _prepare(args) -> int:
    if args.chat is not None:  # conversations, rendered and masked (xtrain.data.chat)
        from xtrain.data.chat import prepare_chat

        if args.seq_len is None:
            raise ValueError("--chat needs --seq-len (the training window the conversations are packed for)")
        frac = args.val_fraction if args.val_fraction is not None else 0.02
        print(prepare_chat(args.corpus, args.chat, args.out, args.seq_len, val_fraction=frac, force=args.force)["dir"])
        return 0
    if args.workers is not None:  # must be set before the tokenizers thread pool starts
        os.environ.setdefault("RAYON_NUM_THREADS", str(args.workers))
    from xtrain.data.prepare import DEFAULT_SHARD_TOKENS, DEFAULT_VOCAB_SIZE, prepare

    vocab = args.vocab_size
    if vocab is None:
        vocab = 257 if args.tokenizer == "bytes" else DEFAULT_VOCAB_SIZE
    from xtrain.data.corpus import DEFAULT_VAL_FRACTION, open_corpus

    corpus = open_corpus(
        args.corpus,
        max_bytes=args.max_bytes,
        val_fraction=args.val_fraction if args.val_fraction is not None else DEFAULT_VAL_FRACTION,
        val_path=args.val_corpus,
    )
    meta = prepare(
        corpus,
        args.out,  # None: the default folder under $XTRAIN_CACHE
        vocab,
        tokenizer=args.tokenizer,
        tokenizer_path=args.tokenizer_path,
        shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS,
        workers=args.workers,
        force=args.force,
        progress=not args.no_progress,
    )
    print(meta["dir"])
    return 0


def _info(args) -> int:
    from xtrain.data.prepare import load_meta
    from xtrain.data.shards import read_header, read_shard

    path = Path(args.path)
    if path.name == "meta.json":
        path = path.parent
    if path.is_dir():
        meta = load_meta(path)
        print(f"data dir   {path}")
        print(f"corpus     {json.dumps(meta['config']['corpus'])}")
        print(
            f"tokenizer  {meta['tokenizer_kind']} vocab {meta['vocab_size']} eot {meta['eot_id']} ({meta['tokenizer']})"
        )
        for split in ("train", "val"):
            s = meta[split]
            print(
                f"{split:<10} {s['tokens']:,} tokens, {s['docs']:,} docs, {s['bytes']:,} bytes "
                f"({s['bytes_per_token']} bytes/token), {len(s['files'])} shard(s)"
            )
        print(
            f"baseline   unigram val loss {meta['unigram_val_loss']:.4f} nats/token "
            f"(uniform ln V = {meta['uniform_loss']:.4f})"
        )
        if "chat" in meta:  # the tokens trained on (assistant turns)
            from xtrain.data.chat import info_lines

            print("\n".join(info_lines(meta)))
        shards = [path / name for split in ("train", "val") for name, _ in meta[split]["files"]]
        vocab = meta["vocab_size"]
    elif path.is_file():
        shards, vocab = [path], None
    else:
        raise FileNotFoundError(f"{path} not found")
    for f in shards:
        h = read_header(f)
        line = f"{f.name:<20} magic {h['magic']} version {h['version']} {h['dtype']} {h['num_tokens']:,} tokens"
        if args.check:
            toks = read_shard(f, vocab)  # raises ValueError on an id >= vocab
            line += f", max id {int(toks.max()) if len(toks) else '-'}"
        print(line)
    return 0
