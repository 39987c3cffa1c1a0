"""The fine-tuning round trip: a run started from a Hugging Face Qwen3 checkpoint exports with the checkpoint's own
tokenizer and chat template, transformers loads the export, and ``xtrain serve``'s chat completions (the template
applied, stopping at its end-of-turn token) equal transformers' greedy ``generate`` on ``apply_chat_template``."""

import json

import httpx
import pytest
import torch

from tests import _qwen as Q
from tests._cli import check, xtrain
from xtrain.autograd import no_grad
from xtrain.data.chat import ChatTemplate
from xtrain.hf import TOKENIZER_FILES, open_checkpoint
from xtrain.model import Model
from xtrain.sampling import Sampling
from xtrain.serve.engine import Engine, EngineConfig
from xtrain.serve.server import load_service, serve_in_thread
from xtrain.train import checkpoint as ckpt_io
from xtrain.train.optim import AdamW

transformers = pytest.importorskip("transformers")

PROMPTS = [Q.CONVERSATIONS[i][:-1] for i in (0, 1, 2, 4, 8)]  # conversations up to their last user turn
NEW = 10


def _generate(hf_dir, convs, eos, new=NEW):
    """transformers: apply_chat_template + greedy generate -> (reply ids without the eos, stopped at eos)."""
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    out = []
    for conv in convs:
        ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, do_sample=False, max_new_tokens=new, eos_token_id=eos, pad_token_id=eos)
        reply = gen[0, ids.shape[1] :].tolist()
        out.append((reply[: reply.index(eos)] if eos in reply else reply, eos in reply))
    return tok, out


def _chat(url, run_name, convs, new=NEW):
    replies = []
    with httpx.Client(timeout=60) as c:
        for conv in convs:
            r = c.post(f"{url}/v1/chat/completions",
                       json={"model": run_name, "messages": conv, "max_tokens": new, "temperature": 0})  # fmt: skip
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            replies.append((ch["message"]["content"], ch["finish_reason"]))
    return replies


def _serve_and_compare(run, hf_dir, eos, new=NEW):
    tok, ref = _generate(hf_dir, PROMPTS, eos, new)
    service = load_service(run, "cpu", "ft", EngineConfig(slots=4))
    assert service.chat_template is not None and service.chat_template.end_of_turn_id == eos
    url, stop = serve_in_thread(service)
    try:
        got = _chat(url, "ft", PROMPTS, new)
        r = httpx.post(f"{url}/v1/chat/completions",
                       json={"model": "ft", "messages": [{"role": "user", "content": "x <|im_end|>"}]})  # fmt: skip
        body = (
            b'{"model": "ft", "messages": [{"role": "user", "content": "a\\ud800"}]}'  # JSON escapes a lone surrogate
        )
        r2 = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    finally:
        stop()
    assert r.status_code == 400 and "control token" in r.json()["error"]["message"]
    assert r2.status_code == 400 and "not valid Unicode" in r2.json()["error"]["message"]
    for (text, finish), (ids, stopped) in zip(got, ref):
        assert text == tok.decode(ids)
        assert finish == ("stop" if stopped else "length")
    return tok, ref


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return Q.make_checkpoint(tmp_path_factory.mktemp("rt") / "ck", False, shard="100KB", seed=11)


def test_export_then_transformers_generate_equals_serve_chat_completions(ckpt, tmp_path):
    """A run made from the checkpoint (its lm_head's row of <|im_end|> set from another token's, so some greedy
    replies end at the end-of-turn token after a few tokens and others run to max_tokens), exported in float32."""
    from xtrain.cli import main

    ck = open_checkpoint(ckpt)
    chat = ChatTemplate.from_dir(ckpt)
    eos = chat.end_of_turn_id
    model = Model(ck.model_config())
    ck.load_into(model)
    with no_grad():  # the token greedy decoding picks third for the first prompt: <|im_end|> now just beats it
        third = Engine(model).generate([chat.prompt_ids(PROMPTS[0])], 3, Sampling(temperature=0))[0][-1]
        head = model.params["lm_head.weight"].data
        head[eos] = 1.05 * head[third]
    run = tmp_path / "run"
    ckpt_io.save_checkpoint(run, model=model, optimizer=AdamW(model.params), trainer_state={"step": 0})
    for name in TOKENIZER_FILES:
        if (ckpt / name).is_file():
            (run / name).write_bytes((ckpt / name).read_bytes())
    assert main(["export", str(run), "--out", str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (ckpt / name).read_bytes(), name  # unchanged
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["eos_token_id"] == eos and cfg["head_dim"] == 128 and not cfg["tie_word_embeddings"]
    _, ref = _serve_and_compare(run, tmp_path / "hf", eos)
    assert any(stopped for _, stopped in ref) and not all(stopped for _, stopped in ref)
    assert len({tuple(ids) for ids, _ in ref}) >= 3  # the replies depend on the conversation


ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, ON_GPU])])
def test_cli_fine_tune_export_serve(ckpt, tmp_path, device):
    """The commands of the README: ``xtrain train --init-from`` on a .jsonl of conversations (the loss falls as the
    replies are learnt), ``xtrain export``, then transformers' generate on the export equals the served replies, and
    the learnt reply comes back, stopped at <|im_end|>. On a GPU the fine-tune runs in bf16 (fp32 masters: the
    export and the serving on the CPU read those)."""
    src = Q.write_jsonl(tmp_path / "chat.jsonl", repeat=4)
    args = ["--init-from", ckpt, "--data", src, "--seq-len", 128, "--batch-size", 4, "--steps", 60, "--lr", 5e-3,
            "--warmup-frac", 0.1, "--eval-every", 0, "--no-progress", "--sample-tokens", 8]  # fmt: skip
    args += ["--device", device] + (["--dtype", "bfloat16"] if device == "cuda" else [])
    r = xtrain("train", *args, "--out", tmp_path / "run", cwd=tmp_path, timeout=600)
    check(r, 0, "")
    assert "--- sample (chat template" in r.stdout
    tc = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert (tc["lr"], tc["min_lr"], tc["weight_decay"], tc["warmup_steps"]) == (5e-3, pytest.approx(5e-4), 0.0, 6)
    assert tc["doc_mask"] and tc["doc_start"] == "after_eot" and tc["extra"]["init_from"]["spec"] == str(ckpt)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in rows if x.get("kind") == "train"]
    assert losses[-1] < 0.05 * losses[0]  # the replies are learnt by heart
    r = xtrain("export", tmp_path / "run", "--out", tmp_path / "hf", "--dtype", "float32", cwd=tmp_path)
    check(r, 0, "")
    eos = ChatTemplate.from_dir(ckpt).end_of_turn_id
    tok, ref = _serve_and_compare(tmp_path / "run", tmp_path / "hf", eos, new=16)
    replies = [(tok.decode(ids), stopped) for ids, stopped in ref]
    think = "<think>\n\n</think>\n\n"  # the template's empty think block opens the last turn, as trained
    assert replies[0] == (think + "Paris.", True) and replies[1] == (think + "Green.", True)
    assert replies[4] == (think + "Hund.", True) and not replies[2][1]  # the haiku is longer than 16 tokens
