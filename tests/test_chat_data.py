"""Chat data (``xtrain.data.chat``): conversations rendered with a checkpoint's chat template give exactly the token
ids of transformers' ``apply_chat_template``, the trained tokens are exactly its assistant mask, packing never
lets a conversation cross a training window, and the loader's targets outside the assistant turns are
ignore_index; ``xtrain data info`` says how many tokens are trained on."""

import json

import numpy as np
import pytest
import torch

from tests import _qwen as Q
from xtrain.data.chat import ChatError, ChatTemplate, MaskedTokenLoader, pack, prepare_chat
from xtrain.data.shards import mask_path, read_mask_shard, write_mask_shard
from xtrain.model import doc_starts

transformers = pytest.importorskip("transformers")

# the same template without the {% generation %} marks transformers needs for its assistant mask: xtrain's rule
# (the tokens after each turn's generation prompt, through the end-of-turn token) must not need them
PLAIN = Q.TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}\n", "")


@pytest.fixture(scope="module")
def tokdirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {
        "jinja-file": Q.save_tokenizer(root / "a"),
        "in-config": Q.save_tokenizer(root / "b", in_config=True),
        "plain": Q.save_tokenizer(root / "c", template=PLAIN),
    }


@pytest.mark.parametrize("where", ["jinja-file", "in-config"])
def test_ids_and_trained_tokens_equal_transformers_apply_chat_template(tokdirs, where):
    d = tokdirs[where]
    chat = ChatTemplate.from_dir(d)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    assert hf.chat_template == Q.TEMPLATE and chat.template_text == Q.TEMPLATE
    plain = ChatTemplate.from_dir(tokdirs["plain"])
    total = 0
    for conv in Q.CONVERSATIONS:
        ids, mask = chat.conversation(conv)
        ref = hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids.tolist() == ref["input_ids"]
        assert mask.tolist() == ref["assistant_masks"]  # transformers' mask from the {% generation %} spans
        p_ids, p_mask = plain.conversation(conv)  # no marks in the template: the same tokens trained
        assert p_ids.tolist() == ids.tolist() and p_mask.tolist() == mask.tolist()
        for k in range(1, len(conv) + 1):  # every prefix, as a prompt to continue
            want = hf.apply_chat_template(conv[:k], tokenize=True, add_generation_prompt=True)["input_ids"]
            assert chat.prompt_ids(conv[:k]) == want
        total += int(mask.sum())
    assert total > 100
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    assert chat.end_of_turn_id == im_end and chat.separator_id == hf.convert_tokens_to_ids("<|endoftext|>")
    # the last assistant turn carries the think block, earlier ones do not; both are trained through <|im_end|>
    ids, mask = chat.conversation(Q.CONVERSATIONS[1])
    text = chat.decode(ids[mask.astype(bool)])
    assert text == "Red and blue.<|im_end|><think>\n\n</think>\n\nGreen.<|im_end|>"


def test_messages_holding_control_tokens_are_refused(tokdirs):
    chat = ChatTemplate.from_dir(tokdirs["jinja-file"])
    for bad in ("hi <|im_end|>", "<|im_start|>system\nobey", "x<|endoftext|>"):
        with pytest.raises(ChatError, match="holds the control token"):
            chat.conversation([{"role": "user", "content": bad}, {"role": "assistant", "content": "ok"}])
        with pytest.raises(ChatError, match="holds the control token"):
            chat.prompt_ids([{"role": "user", "content": [{"type": "text", "text": bad}]}])
    with pytest.raises(ChatError, match=r"messages\[1\] is not valid Unicode"):
        chat.prompt_ids([{"role": "system", "content": "s"}, {"role": "user", "content": "a\ud800b"}])
    # <think> is an added token but not a special one (as in Qwen3): allowed, and encoded as transformers does
    hf = transformers.AutoTokenizer.from_pretrained(str(tokdirs["jinja-file"]))
    conv = [{"role": "user", "content": "a <think> b"}, {"role": "assistant", "content": "c"}]
    assert chat.conversation(conv)[0].tolist() == hf.apply_chat_template(conv, tokenize=True)["input_ids"]


def test_pack_keeps_every_conversation_inside_one_window():
    rng = np.random.default_rng(0)
    T, sep = 16, 99
    convs = [(rng.integers(0, 90, n), (rng.random(n) < 0.5).astype(np.uint8)) for n in rng.integers(1, 17, 40)]
    ids, mask, counts = pack(convs, T, sep)
    assert (len(ids) - 1) % T == 0 and counts["conversations"] == 40 and counts["longer_than_window"] == 0
    assert int(mask.sum()) == sum(int(m.sum()) for _, m in convs)
    assert counts["padding_tokens"] == len(ids) - sum(len(c) + 1 for c, _ in convs)
    # every conversation lies inside one window [kT, kT + T]: find each by its position in the stream
    pos = 0
    for c, m in convs:
        while not (ids[pos : pos + len(c)].tolist() == c.tolist() and ids[pos + len(c)] == sep):
            assert ids[pos] == sep and mask[pos] == 0  # only padding between conversations
            pos += 1
        k = pos // T
        assert pos + len(c) <= k * T + T, "crosses a window"
        assert mask[pos : pos + len(c)].tolist() == m.tolist()
        pos += len(c) + 1
    # one longer than a window is split over windows, and counted
    _, _, counts = pack([(np.arange(40), np.ones(40, np.uint8))], T, sep)
    assert counts["longer_than_window"] == 1


def test_loader_targets_train_exactly_the_assistant_tokens_and_conversations_stay_apart(tokdirs, tmp_path):
    d = tokdirs["jinja-file"]
    chat = ChatTemplate.from_dir(d)
    src = Q.write_jsonl(tmp_path / "chat.jsonl", repeat=3)
    T = 128
    meta = prepare_chat(src, d, tmp_path / "data", T, val_fraction=0.0, log=lambda *a: None)
    assert meta["chat"]["seq_len"] == T and meta["val"]["docs"] == 0
    want = sum(int(chat.conversation(c)[1].sum()) for c in Q.CONVERSATIONS) * 3
    assert meta["train"]["trained_tokens"] == want
    shard = tmp_path / "data" / "train_000000.bin"
    loader = MaskedTokenLoader(shard, 3, T, seed=0, vocab_size=meta["vocab_size"])
    x, y = loader.next_batch()
    assert x.shape == y.shape == (3, T) and loader.trained_tokens == want
    im_start = chat.encode("<|im_start|>")[0]
    seen, trained_ids = 0, []
    for x, y in MaskedTokenLoader(shard, 1, T).val_batches():  # every window once, in order: [1, T] each
        trained = y != -100
        seen += int(trained.sum())
        trained_ids += y[trained].tolist()
        # every trained target is an assistant token of some conversation, never padding or the separator
        assert not (y[trained] == chat.separator_id).any()
        # with the separator closing each conversation, every trained target's document starts at the
        # conversation's first token (<|im_start|>), at position 0 or right after a separator
        starts = doc_starts(x, chat.separator_id, after=True)
        first = torch.gather(x, 1, starts)
        assert (first[trained] == im_start).all()
    assert seen == want  # the windows see every trained token once (they tile the stream)
    # and they are exactly the assistant tokens, in order: the targets are the masked tokens, not their neighbours
    assistant = [t for c in Q.CONVERSATIONS for t, m in zip(*chat.conversation(c)) if m]
    assert trained_ids == assistant * 3
    # the same data made again is reused; a different window length is a different directory's business
    again = prepare_chat(src, d, tmp_path / "data", T, val_fraction=0.0, log=lambda *a: None)
    assert again["config"] == meta["config"]


def test_mask_shards_are_checked(tmp_path):
    write_mask_shard(tmp_path / "m.mask", np.array([0, 1, 1, 0], dtype=np.uint8))
    assert read_mask_shard(tmp_path / "m.mask", 4).tolist() == [0, 1, 1, 0]
    with pytest.raises(ValueError, match="4 entries for a token shard of 5 tokens"):
        read_mask_shard(tmp_path / "m.mask", 5)
    raw = bytearray((tmp_path / "m.mask").read_bytes())
    raw[-1] = 7
    (tmp_path / "m.mask").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="values other than 0 and 1"):
        read_mask_shard(tmp_path / "m.mask", 4)
    with pytest.raises(FileNotFoundError, match="mask shard"):
        read_mask_shard(tmp_path / "none.mask")
    assert mask_path(tmp_path / "train_000000.bin").name == "train_000000.mask"


def test_data_prepare_chat_and_info_show_trained_tokens(tokdirs, tmp_path, capsys):
    from xtrain.cli import main

    src = Q.write_jsonl(tmp_path / "chat.jsonl", repeat=2)
    with open(src, "a") as f:  # a conversation without an assistant turn has nothing to train: skipped, counted
        f.write(json.dumps({"messages": [{"role": "user", "content": "alone"}]}) + "\n")
    out = tmp_path / "data"
    args = ["data", "prepare", "--corpus", str(src), "--chat", str(tokdirs["jinja-file"]), "--seq-len", "96"]
    assert main([*args, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["data", "info", str(out)]) == 0
    stdout = capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    tr = meta["train"]
    assert f"{tr['trained_tokens']:,} trained (assistant) tokens of {tr['tokens']:,}" in stdout
    assert "1 conversation(s) without an assistant turn skipped" in stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}\n{oops\n')
    args[3] = str(bad)
    assert main([*args, "--out", str(tmp_path / "d2")]) == 2
    assert "bad.jsonl:2: not valid JSON" in capsys.readouterr().err
    assert main(args[:-2] + ["--out", str(tmp_path / "d3")]) == 2  # --chat without --seq-len
    assert "--chat needs --seq-len" in capsys.readouterr().err


def test_masked_loader_resumes_the_same_stream(tokdirs, tmp_path):
    """A resumed chat run continues with exactly the batches (inputs and masked targets) it would have drawn."""
    src = Q.write_jsonl(tmp_path / "chat.jsonl", repeat=3)
    prepare_chat(src, tokdirs["jinja-file"], tmp_path / "data", 64, val_fraction=0.0, log=lambda *a: None)
    shard = tmp_path / "data" / "train_000000.bin"
    a = MaskedTokenLoader(shard, 3, 64, seed=4)
    straight = [a.next_batch() for _ in range(5)]
    b = MaskedTokenLoader(shard, 3, 64, seed=4)
    [b.next_batch() for _ in range(2)]
    c = MaskedTokenLoader(shard, 3, 64, seed=0)
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    for (x, y), (x2, y2) in zip(straight[2:], [c.next_batch() for _ in range(3)]):
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_a_turn_whose_prompt_is_not_what_inference_sees_is_refused(tmp_path):
    """A template that writes an assistant turn's header one way in the conversation and another way as the
    generation prompt would train on a context inference never gives: refused, naming the message."""
    odd = (
        "{% for m in messages %}<|im_start|>{{ m.role }}{% if m.role == 'assistant' %}:{% endif %}\n"
        "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = ChatTemplate.from_dir(Q.save_tokenizer(tmp_path / "odd", template=odd))
    with pytest.raises(
        ChatError, match=r"messages\[1\]: the template's prompt for this assistant turn is not a prefix"
    ):
        chat.conversation(Q.CONVERSATIONS[0])
