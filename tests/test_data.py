"""Tests for xtrain.data: corpora, tokenizers, llm.c shards, prepare, TokenLoader, and the `xtrain data` CLI.

Everything runs on small corpora made in tmp_path or a ~300 kB slice of the standard library.
"""

from __future__ import annotations

import json
import math
import socket
import sys

import numpy as np
import pytest
import torch

from xtrain.data import corpus as corpus_mod
from xtrain.data import shards as shards_mod
from xtrain.data.corpus import EOT_TEXT, is_val_key, open_corpus, read_path, stdlib_files
from xtrain.data.loader import TokenLoader
from xtrain.data.prepare import default_data_dir, load_meta, prepare, unigram_loss
from xtrain.data.shards import HEADER_BYTES, ShardWriter, read_header, read_shard, write_shard
from xtrain.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, make_tokenizer

SMALL = 300_000  # bytes of stdlib used by the stdlib tests


def quiet(*_args, **_kw):
    pass


@pytest.fixture(scope="module")
def stdlib_texts():
    """A few real stdlib sources, including non-ASCII ones (the pystdlib slice starts with ASCII files)."""
    root, files = stdlib_files()
    by_name = {f.relative_to(root).as_posix(): f for f in files}
    names = [
        n
        for n in (
            "json/decoder.py",
            "textwrap.py",
            "encodings/cp1252.py",
            "unicodedata.py",
            "html/entities.py",
            "email/_header_value_parser.py",
        )
        if n in by_name
    ]
    return [by_name[n].read_bytes().decode("utf-8", "replace") for n in names]


@pytest.fixture(scope="module")
def bpe(stdlib_texts):
    c = open_corpus("pystdlib", max_bytes=SMALL)
    return Tokenizer.train(c.train_texts(), vocab_size=512)


def rng_tokens(n, vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=n)


# ------------------------------------------------------------------------------------------------------
# corpora


def test_pystdlib_order_split_and_cap():
    cap = 2_000_000  # about 110 files: enough documents to split by name
    c = open_corpus("pystdlib", max_bytes=cap)
    assert c.split()["rule"] == "by-name"
    docs = list(c.documents())
    keys = [d.key for _, d in docs]
    assert keys == sorted(keys, key=lambda k: k.split("/"))
    assert [d.key for _, d in c.documents()] == keys  # same order every time
    assert all(k.endswith(".py") and "site-packages" not in k for k in keys)
    assert not any(part in ("test", "tests", "idle_test") for k in keys for part in k.split("/"))
    total = sum(len(d.text.encode()) for _, d in docs)
    assert cap - 4 < total <= cap  # the last file is cut at the cap (on a character boundary)
    for split, d in docs:  # the split is a pure function of the key
        assert split == ("val" if is_val_key(d.key, c.val_fraction) else "train")
    assert list(c.train_texts()) == [d.text for s, d in docs if s == "train"]
    desc = c.describe()
    assert desc["kind"] == "pystdlib" and desc["python"] == sys.version.split()[0]
    json.dumps(desc)


def test_val_fraction_is_about_right():
    keys = [f"doc{i}.py" for i in range(20_000)]
    frac = sum(is_val_key(k, 0.02) for k in keys) / len(keys)
    assert 0.015 < frac < 0.025
    assert not any(is_val_key(k, 0.0) for k in keys)


def test_txt_reader_splits_on_eot_across_chunks(tmp_path):
    stories = [f"Story {i}: Once upon a time, é{'x' * (i % 7)}." for i in range(50)]
    p = tmp_path / "stories.txt"
    p.write_text(f"\n{EOT_TEXT}\n".join(stories) + f"\n{EOT_TEXT}\n", encoding="utf-8")
    docs = list(corpus_mod.read_text_file(p, chunk_bytes=7))  # separators and UTF-8 characters split by chunks
    assert [d.text for d in docs] == stories
    assert [d.text for d in read_path(p)] == stories  # the default chunk (the whole file in one)
    assert len({d.key for d in docs}) == len(docs)


def test_jsonl_parquet_and_directory(tmp_path):
    rows = [{"text": f"line {i} ünïcode"} for i in range(5)]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    assert [d.text for d in read_path(jl)] == [r["text"] for r in rows]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        list(read_path(bad))

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [r["text"] for r in rows], "id": list(range(5))}), tmp_path / "d.parquet")
    assert [d.text for d in read_path(tmp_path / "d.parquet")] == [r["text"] for r in rows]
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    with pytest.raises(ValueError, match="nocol.parquet.*'text'"):
        list(read_path(tmp_path / "nocol.parquet"))

    d = tmp_path / "dir"
    (d / "b").mkdir(parents=True)
    (d / "b" / "z.md").write_text("zz")
    (d / "a.py").write_text("aa")
    (d / "c.txt").write_text(f"c1{EOT_TEXT}c2")
    (d / "skip.bin").write_bytes(b"\0")
    assert [(x.key, x.text) for x in read_path(d)] == [
        ("a.py", "aa"),
        ("b/z.md", "zz"),
        ("c.txt#0", "c1"),
        ("c.txt#1", "c2"),
    ]


def test_corpus_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="nope"):
        open_corpus(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        open_corpus(str(tmp_path / "empty"))
    # tinystories without huggingface_hub: a clear error that says to pass a local path
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(RuntimeError, match="local path"):
        open_corpus("tinystories")


def test_tinystories_offline_error(monkeypatch):
    pytest.importorskip("huggingface_hub")
    import huggingface_hub

    def offline(*a, **k):
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(RuntimeError, match="TinyStoriesV2-GPT4-train.txt.*local path"):
        open_corpus("tinystories")


def test_separate_val_source_and_cap(tmp_path):
    (tmp_path / "train.txt").write_text(EOT_TEXT.join(f"train doc {i}" for i in range(100)))
    (tmp_path / "val.txt").write_text(EOT_TEXT.join(f"val doc {i}" for i in range(100)))
    c = open_corpus(str(tmp_path / "train.txt"), val_path=tmp_path / "val.txt", max_bytes=500)
    docs = list(c.documents())
    train = [d.text for s, d in docs if s == "train"]
    val = [d.text for s, d in docs if s == "val"]
    assert train[0] == "train doc 0" and all(t.startswith("train") for t in train)
    assert sum(map(len, train)) == 500 and len(train) > 10  # the last document is cut at the cap
    assert val == ["val doc 0", "v"]  # capped at max_bytes * val_fraction = 10 bytes


# ------------------------------------------------------------------------------------------------------
# tokenizers


def test_bpe_round_trip_on_stdlib(bpe, stdlib_texts):
    assert bpe.vocab_size == 512 and bpe.eot_id == 511
    assert len(stdlib_texts) >= 3
    weird = "x = '<|endoftext|>'  # é 😀 \t\r\n  \u00a0 \x00 trailing   "
    for text in [*stdlib_texts, weird, "", " leading space"]:
        ids = bpe.encode(text)
        assert all(0 <= i < bpe.vocab_size for i in ids)
        assert bpe.decode(ids) == text
    assert bpe.eot_id not in bpe.encode(weird)  # the literal text is text, not the special token
    assert bpe.encode_batch(stdlib_texts) == [bpe.encode(t) for t in stdlib_texts]
    assert len(bpe.encode(stdlib_texts[0])) < 0.6 * len(stdlib_texts[0].encode())  # merges learned
    stream = bpe.encode_documents(["a b", "c"])
    assert stream.tolist() == [bpe.eot_id, *bpe.encode("a b"), bpe.eot_id, *bpe.encode("c")]
    assert bpe.decode(stream.tolist()) == f"{EOT_TEXT}a b{EOT_TEXT}c"


def test_bpe_training_is_deterministic(bpe):
    again = Tokenizer.train(open_corpus("pystdlib", max_bytes=SMALL).train_texts(), vocab_size=512)
    assert again._tok.to_str() == bpe._tok.to_str()


def test_tokenizer_save_load(bpe, tmp_path, stdlib_texts):
    path = tmp_path / "sub" / "tokenizer.json"
    bpe.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]  # no temp file left behind
    tok = load_tokenizer(path)
    assert isinstance(tok, Tokenizer) and tok.vocab_size == bpe.vocab_size and tok.eot_id == bpe.eot_id
    assert tok.encode(stdlib_texts[0]) == bpe.encode(stdlib_texts[0])
    assert load_tokenizer(tmp_path / "sub").vocab_size == 512  # a data dir works too

    b = tmp_path / "bytes.json"
    ByteTokenizer().save(b)
    assert isinstance(load_tokenizer(b), ByteTokenizer)

    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load_tokenizer(tmp_path / "bad.json")
    (tmp_path / "bad2.json").write_text('{"model": 3}')
    with pytest.raises(ValueError, match="bad2.json"):
        load_tokenizer(tmp_path / "bad2.json")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_tokenizer(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="out of range"):
        bpe.decode([0, 512])


def test_byte_tokenizer(stdlib_texts):
    tok = make_tokenizer("auto", 256)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 257 and tok.eot_id == 256
    for text in [*stdlib_texts[:2], "é😀<|endoftext|>", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("é") == [0xC3, 0xA9]
    stream = tok.encode_documents(["hé", "x"])
    assert stream.tolist() == [256, 104, 0xC3, 0xA9, 256, 120]
    assert tok.decode(stream.tolist()) == f"{EOT_TEXT}hé{EOT_TEXT}x"
    with pytest.raises(ValueError, match="257"):
        Tokenizer.train(["abc"], vocab_size=257)


# ------------------------------------------------------------------------------------------------------
# shards


@pytest.mark.parametrize(
    "vocab,dtype,magic,version",
    [(50257, np.uint16, 20240520, 1), (65536, np.uint16, 20240520, 1), (128256, np.uint32, 20240801, 7)],
)
def test_shard_round_trip(tmp_path, vocab, dtype, magic, version):
    toks = rng_tokens(12_345, vocab)
    toks[0], toks[1] = 0, vocab - 1  # the extremes survive
    p = write_shard(tmp_path / "s.bin", toks, vocab)
    assert p.stat().st_size == HEADER_BYTES + toks.size * np.dtype(dtype).itemsize
    header = np.fromfile(p, dtype="<i4", count=256)
    assert header[:3].tolist() == [magic, version, toks.size] and not header[3:].any()
    got = read_shard(p, vocab_size=vocab)
    assert isinstance(got, np.memmap) and got.dtype == dtype
    np.testing.assert_array_equal(got, toks)
    assert read_header(p) == {
        "magic": magic,
        "version": version,
        "num_tokens": toks.size,
        "dtype": np.dtype(dtype).name,
    }
    assert [x.name for x in tmp_path.iterdir()] == ["s.bin"]


def test_shard_empty(tmp_path):
    p = write_shard(tmp_path / "e.bin", [], 100)
    assert len(read_shard(p, vocab_size=100)) == 0


def _corrupt(tmp_path, name, header=None, payload=None):
    toks = rng_tokens(100, 1000).astype("<u2")
    h = np.zeros(256, "<i4")
    h[:3] = [20240520, 1, 100]
    if header:
        for i, v in header.items():
            h[i] = v
    p = tmp_path / name
    p.write_bytes(h.tobytes() + (toks.tobytes() if payload is None else payload))
    return p


def test_corrupt_shards(tmp_path):
    with pytest.raises(ValueError, match=r"bad\.bin.*bad magic 12345"):
        read_shard(_corrupt(tmp_path, "bad.bin", header={0: 12345}))
    with pytest.raises(ValueError, match=r"ver\.bin.*version 1.*says 7"):
        read_shard(_corrupt(tmp_path, "ver.bin", header={1: 7}))
    with pytest.raises(ValueError, match=r"short\.bin.*truncated: header says 100 tokens"):
        read_shard(_corrupt(tmp_path, "short.bin", payload=b"\1\0" * 99))
    with pytest.raises(ValueError, match=r"long\.bin.*too long.*trailing 2 bytes"):
        read_shard(_corrupt(tmp_path, "long.bin", payload=b"\1\0" * 101))
    with pytest.raises(ValueError, match=r"neg\.bin.*negative"):
        read_shard(_corrupt(tmp_path, "neg.bin", header={2: -1}))
    (tmp_path / "tiny.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match=r"tiny\.bin.*truncated header"):
        read_shard(tmp_path / "tiny.bin")
    with pytest.raises(FileNotFoundError, match="absent"):
        read_shard(tmp_path / "absent.bin")
    # ids out of range, found by a chunked scan (chunk smaller than the shard)
    toks = np.arange(100) % 50
    toks[93] = 77
    with pytest.raises(ValueError, match=r"scan: token id 77 at position 93.*\[0, 50\)"):
        shards_mod.check_token_range(toks, 50, "scan", chunk_tokens=7)
    shards_mod.check_token_range(toks[:93], 50, "scan", chunk_tokens=7)
    p = write_shard(tmp_path / "range.bin", toks, 100)
    read_shard(p)  # fine without a vocab
    with pytest.raises(ValueError, match=r"range\.bin.*token id 77 at position 93.*\[0, 50\)"):
        read_shard(p, vocab_size=50)
    with pytest.raises(ValueError, match=r"token id 77"):
        write_shard(tmp_path / "w.bin", toks, 50)
    with pytest.raises(ValueError, match=r"token id -1"):
        write_shard(tmp_path / "w.bin", [3, -1], 50)
    assert not (tmp_path / "w.bin").exists()
    assert not list(tmp_path.glob(".*tmp*"))


def test_shard_writer_rolls_over(tmp_path):
    toks = rng_tokens(1000, 300)
    with ShardWriter(tmp_path, "train", 300, shard_tokens=256) as w:
        for chunk in np.array_split(toks, 7):
            w.add(chunk)
    assert w.shards == [(f"train_{i:06d}.bin", n) for i, n in enumerate([256, 256, 256, 232])]
    got = np.concatenate([read_shard(tmp_path / name, 300) for name, _ in w.shards])
    np.testing.assert_array_equal(got, toks)
    np.testing.assert_array_equal(w.counts, np.bincount(toks, minlength=300))


# ------------------------------------------------------------------------------------------------------
# prepare


def _tiny_corpus(tmp_path, n_docs=300):
    d = tmp_path / "corpus"
    d.mkdir()
    rng = np.random.default_rng(0)
    letters = list("abcdefghijklmnopqrstuvwxyzé(): ")
    words = ["".join(rng.choice(letters, size=rng.integers(2, 8))) for _ in range(200)]
    for i in range(n_docs):
        (d / f"doc{i:04d}.txt").write_text(" ".join(rng.choice(words, size=40 + i % 30)) + "\n")
    return d


def test_prepare_tiny_corpus(tmp_path):
    src = _tiny_corpus(tmp_path)
    out = tmp_path / "out"
    meta = prepare(str(src), out, vocab_size=300, shard_tokens=2000, log=quiet)
    assert set(p.name for p in out.iterdir()) >= {"tokenizer.json", "meta.json", "train_000000.bin", "val_000000.bin"}
    assert not list(out.glob(".*tmp*"))
    assert meta == {**load_meta(out), "dir": str(out)}
    assert meta["vocab_size"] == 300 and meta["tokenizer_kind"] == "bpe"
    assert len(meta["train"]["files"]) > 1  # rolled over at 2000 tokens
    assert meta["train"]["docs"] + meta["val"]["docs"] == 300 and meta["val"]["docs"] > 0

    # the token stream is exactly eot doc eot doc ..., in corpus order
    tok = load_tokenizer(out)
    corpus = open_corpus(str(src))
    for split in ("train", "val"):
        stream = np.concatenate([read_shard(out / n, 300) for n, _ in meta[split]["files"]])
        assert len(stream) == meta[split]["tokens"]
        texts = [d.text for s, d in corpus.documents() if s == split]
        assert tok.decode(stream.tolist()) == "".join(EOT_TEXT + t for t in texts)

    # the unigram baseline, computed directly
    tr = np.concatenate([read_shard(out / n) for n, _ in meta["train"]["files"]]).astype(np.int64)
    va = read_shard(out / "val_000000.bin").astype(np.int64)
    counts = np.bincount(tr, minlength=300)
    want = -np.mean(np.log((counts[va] + 1) / (len(tr) + 300)))
    assert meta["unigram_val_loss"] == pytest.approx(want, abs=1e-5)
    assert meta["unigram_val_loss"] < meta["uniform_loss"] == pytest.approx(math.log(300), abs=1e-5)


def test_prepare_is_idempotent_and_rebuilds_on_change(tmp_path):
    src = _tiny_corpus(tmp_path, n_docs=60)
    out = tmp_path / "out"
    logs = []
    m1 = prepare(str(src), out, vocab_size=300, shard_tokens=500, log=logs.append)
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    m2 = prepare(str(src), out, vocab_size=300, shard_tokens=500, log=logs.append)
    assert "reusing" in logs[-1] and m2 == m1
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    # a bigger shard size -> rebuild, and the stale extra shards are removed
    m3 = prepare(str(src), out, vocab_size=300, shard_tokens=10**6, log=logs.append)
    assert "reusing" not in logs[-1]
    assert sorted(p.name for p in out.glob("train_*.bin")) == ["train_000000.bin"]
    assert m3["train"]["tokens"] == m1["train"]["tokens"]
    # a missing shard makes the directory incomplete -> rebuild
    (out / "val_000000.bin").unlink()
    prepare(str(src), out, vocab_size=300, shard_tokens=10**6, log=logs.append)
    assert "reusing" not in logs[-1] and (out / "val_000000.bin").exists()
    # a changed corpus file changes the fingerprint -> rebuild
    (src / "doc0000.txt").write_text("changed text, longer than before " * 5)
    prepare(str(src), out, vocab_size=300, shard_tokens=10**6, log=logs.append)
    assert "reusing" not in logs[-1]


def test_prepare_bytes_and_given_tokenizer(tmp_path):
    src = _tiny_corpus(tmp_path, n_docs=30)
    m = prepare(str(src), tmp_path / "b", vocab_size=256, log=quiet)
    assert m["tokenizer_kind"] == "bytes" and m["vocab_size"] == 257 and m["eot_id"] == 256
    assert m["train"]["bytes_per_token"] < 1.0  # one token per byte plus one eot per document
    m2 = prepare(str(src), tmp_path / "c", tokenizer_path=tmp_path / "b" / "tokenizer.json", log=quiet)
    assert m2["vocab_size"] == 257 and m2["train"]["tokens"] == m["train"]["tokens"]


def test_prepare_pystdlib_offline(tmp_path, monkeypatch):
    """The default corpus needs no network: every socket creation fails during prepare."""

    def no_network(*a, **k):
        raise OSError("network access blocked by the test")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setenv("XTRAIN_CACHE", str(tmp_path / "cache"))
    meta = prepare("pystdlib", None, vocab_size=512, max_bytes=SMALL, log=quiet)
    assert meta["dir"] == str(tmp_path / "cache" / "data" / "pystdlib-v512")
    assert meta["config"]["corpus"]["kind"] == "pystdlib" and meta["vocab_size"] == 512
    assert meta["train"]["tokens"] > 50_000 and meta["val"]["tokens"] > 0
    assert 0 < meta["unigram_val_loss"] < math.log(512)


def test_default_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XTRAIN_CACHE", str(tmp_path))
    assert default_data_dir(4096) == tmp_path / "data" / "pystdlib-v4096"
    p = default_data_dir(256, str(tmp_path / "my stories.txt"))
    assert p.parent == tmp_path / "data" and p.name.startswith("my_stories-") and p.name.endswith("-v256")
    monkeypatch.delenv("XTRAIN_CACHE")
    assert ".cache/xtrain/data/tinystories-v8192" in default_data_dir(8192, "tinystories").as_posix()


def test_unigram_loss_uniform():
    # train and val uniform over V -> the smoothed loss is exactly ln V
    c = np.full(10, 5)
    assert unigram_loss(c, c) == pytest.approx(math.log(10))


# ------------------------------------------------------------------------------------------------------
# loader


@pytest.fixture
def shard_dir(tmp_path):
    # three shards of different lengths; tokens are their global position mod vocab, so windows are checkable
    vocab = 5000
    lengths = [1000, 37, 2501]
    start = 0
    for i, n in enumerate(lengths):
        write_shard(tmp_path / f"train_{i:06d}.bin", (np.arange(start, start + n)) % vocab, vocab)
        start += n
    return tmp_path, vocab, lengths


def test_loader_windows_and_shapes(shard_dir):
    d, vocab, lengths = shard_dir
    T = 16
    loader = TokenLoader(str(d / "train_*.bin"), batch_size=4, seq_len=T, vocab_size=vocab)
    assert loader.num_windows == sum((n - 1) // T for n in lengths)  # the 37-token shard holds 2
    assert loader.num_tokens == sum(lengths)
    seen = set()
    for _ in range(loader.steps_per_epoch):
        ids = loader.next_batch()
        assert ids.shape == (4, T + 1) and ids.dtype == torch.int64
        diffs = ids[:, 1:] - ids[:, :-1]
        assert bool(((diffs == 1) | (diffs == 1 - vocab)).all())  # T+1 consecutive tokens of one shard
        seen.update(ids[:, 0].tolist())
    assert len(seen) == loader.steps_per_epoch * 4  # no window twice in an epoch
    assert loader.epoch == 0
    loader.next_batch()
    assert loader.epoch == 1


def test_loader_deterministic_and_resume(shard_dir):
    d, vocab, _ = shard_dir
    files = sorted(d.glob("train_*.bin"))
    make = lambda: TokenLoader(files, batch_size=3, seq_len=8, seed=1234)
    ref = make()
    stream = [ref.next_batch() for _ in range(200)]  # crosses several epochs
    a = make()
    for k in (0, 5, 91, 150):
        a = make()
        for _ in range(k):
            a.next_batch()
        state = json.loads(json.dumps(a.state_dict()))  # JSON round trip
        b = TokenLoader(files, batch_size=3, seq_len=8, seed=999)  # the seed comes from the state
        b.load_state_dict(state)
        for j in range(k, min(k + 20, 200)):
            assert torch.equal(b.next_batch(), stream[j])
    assert not torch.equal(TokenLoader(files, 3, 8, seed=1).next_batch(), stream[0])
    with pytest.raises(ValueError, match="seq_len"):
        TokenLoader(files, 3, 9).load_state_dict(state)


def test_loader_ranks_are_disjoint_and_match_one_big_batch(shard_dir):
    d, _, _ = shard_dir
    pattern = str(d / "train_*.bin")
    R, B, T = 3, 2, 10
    big = TokenLoader(pattern, batch_size=B * R, seq_len=T, seed=7)
    ranks = [TokenLoader(pattern, batch_size=B, seq_len=T, rank=r, world_size=R, seed=7) for r in range(R)]
    for _ in range(2 * big.steps_per_epoch + 3):
        parts = [r.next_batch() for r in ranks]
        want = big.next_batch()
        starts = [set(p[:, 0].tolist()) for p in parts]
        assert all(not (starts[i] & starts[j]) for i in range(R) for j in range(i + 1, R))
        # rank r holds rows r, r+R, ... of the single-process batch of B*R
        got = torch.empty_like(want)
        for r, p in enumerate(parts):
            got[r::R] = p
        assert torch.equal(got, want)
    # resuming with a different world size continues the same global stream
    state = ranks[0].state_dict()
    one = TokenLoader(pattern, batch_size=B * R, seq_len=T)
    one.load_state_dict(state)
    assert torch.equal(one.next_batch(), big.next_batch())


def test_val_batches(shard_dir):
    d, _, _ = shard_dir
    pattern = str(d / "train_*.bin")
    loader = TokenLoader(pattern, batch_size=4, seq_len=16)
    state = loader.state_dict()
    a = list(loader.val_batches())
    assert len(a) == loader.num_windows // 4 and all(x.shape == (4, 17) for x in a)
    assert a[0][:, 0].tolist() == [0, 16, 32, 48]  # sequential, from the start of the first shard
    assert all(torch.equal(x, y) for x, y in zip(a, loader.val_batches()))
    assert len(list(loader.val_batches(max_batches=3))) == 3
    assert loader.state_dict() == state
    r0 = list(TokenLoader(pattern, 2, 16, rank=0, world_size=2).val_batches(5))
    r1 = list(TokenLoader(pattern, 2, 16, rank=1, world_size=2).val_batches(5))
    for x, y, full in zip(r0, r1, a):
        assert torch.equal(x, full[0::2]) and torch.equal(y, full[1::2])


def test_loader_errors(tmp_path, shard_dir):
    d, vocab, _ = shard_dir
    with pytest.raises(FileNotFoundError, match="nothing_"):
        TokenLoader(str(tmp_path / "nothing_*.bin"), 2, 8)
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        TokenLoader([tmp_path / "missing.bin"], 2, 8)
    with pytest.raises(ValueError, match="token id"):
        TokenLoader(str(d / "train_*.bin"), 2, 8, vocab_size=100)
    write_shard(tmp_path / "small.bin", np.arange(10), 100)
    with pytest.raises(ValueError, match="small.bin.*10 tokens"):
        TokenLoader(tmp_path / "small.bin", 2, 10)
    small = TokenLoader(tmp_path / "small.bin", 2, 4)  # 2 windows
    with pytest.raises(ValueError, match="global batch"):
        TokenLoader(tmp_path / "small.bin", 3, 4).next_batch()
    with pytest.raises(ValueError, match="fewer than one global batch"):
        list(TokenLoader(tmp_path / "small.bin", 3, 4).val_batches())
    assert small.next_batch().shape == (2, 5)
    with pytest.raises(ValueError, match="rank"):
        TokenLoader(tmp_path / "small.bin", 2, 4, rank=2, world_size=2)


def test_loader_on_prepared_data(tmp_path):
    src = _tiny_corpus(tmp_path, n_docs=80)
    meta = prepare(str(src), tmp_path / "out", vocab_size=300, log=quiet)
    loader = TokenLoader(str(tmp_path / "out" / "train_*.bin"), 4, 32, vocab_size=meta["vocab_size"])
    ids = loader.next_batch()
    x, y = ids[:, :-1], ids[:, 1:]
    assert x.shape == y.shape == (4, 32) and int(ids.max()) < meta["vocab_size"]


# ------------------------------------------------------------------------------------------------------
# CLI


def test_cli_prepare_and_info(tmp_path, capsys, monkeypatch):
    from xtrain.cli import main

    monkeypatch.setenv("RAYON_NUM_THREADS", "2")  # --workers sets it if unset; keep other tests' env clean

    src = _tiny_corpus(tmp_path, n_docs=40)
    out = tmp_path / "out"
    rc = main(
        [
            "data",
            "prepare",
            "--corpus",
            str(src),
            "--vocab-size",
            "300",
            "--out",
            str(out),
            "--max-bytes",
            "100k",
            "--workers",
            "2",
            "--no-progress",
        ]
    )
    assert rc == 0 and (out / "meta.json").exists()
    assert capsys.readouterr().out.strip().endswith(str(out))
    assert main(["data", "info", str(out), "--check"]) == 0
    text = capsys.readouterr().out
    assert "unigram val loss" in text and "magic 20240520 version 1" in text
    assert main(["data", "info", str(out / "train_000000.bin")]) == 0
    assert main(["data", "prepare", "--corpus", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "missing" in capsys.readouterr().err
    assert main(["data", "info", str(tmp_path / "missing")]) == 2
    assert (
        main(
            [
                "data",
                "prepare",
                "--corpus",
                str(src),
                "--vocab-size",
                "256",
                "--out",
                str(tmp_path / "b"),
                "--no-progress",
            ]
        )
        == 0
    )
    assert load_meta(tmp_path / "b")["tokenizer_kind"] == "bytes"


def test_binary_files_are_refused_alone_and_skipped_in_a_directory(tmp_path):
    from xtrain.data.corpus import binary_reason, open_corpus

    text = "def f(x):\n    return 'é' * x\n".encode() * 100
    assert binary_reason(text) is None
    assert binary_reason(text[:-1]) is None  # a prefix that cuts the last character is still text
    assert binary_reason(text + b"\xff") is None  # one stray byte in 3 KB is under the 1% allowed
    assert "NUL byte at offset 3" in binary_reason(b"abc\0def")
    assert "not valid UTF-8" in binary_reason(bytes(range(128, 256)) * 10)
    # binary content past the first 64 KB sniffed is caught while streaming
    late = tmp_path / "late.txt"
    late.write_bytes(b"plain text\n" * 7000 + bytes(range(1, 256)) * 100)
    with pytest.raises(ValueError, match="late.txt: binary, not text"):
        list(read_path(late))
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text("hello world\n" * 10)
    (d / "b.txt").write_bytes(b"\0\1\2" * 100)
    c = open_corpus(d)
    assert [s.split(":")[0] for s in c.skipped] == ["b.txt"]
    assert [doc.key for _, doc in c.documents()] == ["a.txt", "a.txt#tail"]  # one file: val is its tail
    with pytest.raises(ValueError, match="b.txt: binary, not text: a NUL byte at offset 0"):
        open_corpus(d / "b.txt")
