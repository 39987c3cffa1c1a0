"""Hugging Face export: the checkpoint loads in transformers' Qwen3ForCausalLM (an implementation written
independently of ours) and gives the same logits; import brings it back bit for bit; bad shapes fail."""

import dataclasses
import inspect
import json as json_mod

import pytest
import torch

from xtrain.autograd import no_grad
from xtrain.config import ModelConfig
from xtrain.export import export_hf, hf_config, import_hf
from xtrain.model import Model


def cfg(tie):
    return ModelConfig(
        vocab_size=97,
        n_layer=2,
        n_embd=48,
        n_head=6,
        n_kv_head=2,
        head_dim=16,
        ffn_dim=80,
        max_seq_len=32,
        init_std=0.2,
        tie_embeddings=tie,
        attention="composed",
        loss="composed",
    )


def _perturbed(c):
    m = Model(c, seed=5)
    with no_grad():  # norms at init are all ones: perturb them so a swapped norm would show
        g = torch.Generator().manual_seed(1)
        for k, p in m.params.items():
            if k.endswith("norm.weight"):
                p.data += 0.3 * torch.randn(p.shape, generator=g)
    return m


@pytest.mark.parametrize("tie", [False, True])
def test_transformers_qwen3_gives_our_logits(tmp_path, tie):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3ForCausalLM"):
        pytest.skip("this transformers has no Qwen3")
    c = cfg(tie)
    m = _perturbed(c)
    export_hf(c, m.state_dict(), tmp_path / "hf", dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).float().eval()
    ids = torch.randint(0, 97, (3, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    with no_grad():
        ours = m.forward(ids).data
    # two fp32 implementations of the same network: a few ulps of rounding through two layers (7.7e-7
    # measured with transformers 5.24)
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_import_round_trip_and_bf16(tmp_path):
    c = cfg(False)
    m = _perturbed(c)
    export_hf(c, m.state_dict(), tmp_path / "f32", dtype="float32")
    c2, state = import_hf(tmp_path / "f32")
    assert c2.n_layer == c.n_layer and c2.head_dim == c.head_dim and not c2.tie_embeddings
    assert all(torch.equal(state[k], v) for k, v in m.state_dict().items())
    export_hf(c, m.state_dict(), tmp_path / "bf16", dtype="bfloat16")
    _, s16 = import_hf(tmp_path / "bf16")
    assert all(torch.equal(s16[k], v.to(torch.bfloat16).float()) for k, v in m.state_dict().items())
    assert hf_config(c, "float32")["model_type"] == "qwen3"


def test_bad_shapes_and_names_rejected(tmp_path):
    c = cfg(False)
    sd = Model(c, seed=0).state_dict()
    bad = dict(sd)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 48)
    with pytest.raises(ValueError, match="k_proj.weight has shape"):
        export_hf(c, bad, tmp_path / "x")
    extra = dict(sd, **{"model.layers.0.mlp.bias": torch.zeros(3)})
    with pytest.raises(ValueError, match="no Hugging Face name"):
        export_hf(c, extra, tmp_path / "y")
    missing = {k: v for k, v in sd.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="missing"):
        export_hf(c, missing, tmp_path / "z")
    assert not (tmp_path / "x" / "model.safetensors").exists()


def test_export_command(tmp_path):
    from xtrain.cli import main
    from xtrain.train import checkpoint as ck
    from xtrain.train.optim import AdamW

    c = cfg(True)
    m = Model(c, seed=0)
    ck.save_checkpoint(tmp_path / "run", model=m, optimizer=AdamW(m.params, lr=1e-3), trainer_state={"step": 0})
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    c2, state = import_hf(tmp_path / "hf")
    assert c2.tie_embeddings and "lm_head.weight" not in state
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "hf2")]) == 2


def test_exported_tokenizer_starts_every_encoding_with_endoftext(tmp_path):
    """What training saw: every document starts with <|endoftext|>. The exported tokenizer.json must put it in
    front of tokenizer(prompt) (its post-processor), else transformers users continue a different sequence."""
    transformers = pytest.importorskip("transformers")
    import inspect
    import json as json_mod

    from xtrain.cli import main
    from xtrain.data.tokenizer import Tokenizer
    from xtrain.train import checkpoint as ck
    from xtrain.train.optim import AdamW

    texts = [inspect.getsource(json_mod)[i * 800 : (i + 1) * 800] for i in range(12)]
    tok = Tokenizer.train(texts, vocab_size=300)
    c = dataclasses.replace(cfg(True), vocab_size=tok.vocab_size)
    m = Model(c, seed=0)
    ck.save_checkpoint(tmp_path / "run", model=m, optimizer=AdamW(m.params, lr=1e-3), trainer_state={"step": 0})
    tok.save(tmp_path / "run" / "tokenizer.json")
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    for prompt in ["def ", "", "import os\n", "  \u00e9t\u00e9 = {'a': 1}"]:
        ids = [tok.eot_id] + tok.encode(prompt)
        assert hf_tok(prompt)["input_ids"] == ids, prompt
        assert hf_tok.decode(ids, skip_special_tokens=True) == prompt
    assert hf_tok.eos_token_id == tok.eot_id
    # a literal "<|endoftext|>" in prompt text is text to both tokenizers, never the control token
    prompt = "x = 1 <|endoftext|> y"
    assert hf_tok(prompt)["input_ids"] == [tok.eot_id] + tok.encode(prompt)
    assert hf_tok(prompt)["input_ids"].count(tok.eot_id) == 1


def test_exported_tokenizer_and_greedy_generate_match_xtrain_sample(tmp_path, capsys):
    """transformers users call tokenizer(prompt) + generate: the export's post-processor puts <|endoftext|>
    in front as training did, so greedy generation gives xtrain sample's tokens, for any prompt. The run's
    weights are drawn at std 0.3 (not trained for a few steps, which gives one token repeated for every prompt):
    its continuations differ between prompts, also between prompts that end alike, so a wrong position, cache
    or prefix shows."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3ForCausalLM"):
        pytest.skip("this transformers has no Qwen3")
    from xtrain.cli import main
    from xtrain.data.tokenizer import Tokenizer
    from xtrain.train import checkpoint as ck
    from xtrain.train.optim import AdamW

    run, hf_dir = tmp_path / "run", tmp_path / "hf"
    tok = Tokenizer.train([inspect.getsource(json_mod)[i * 2000 : (i + 1) * 2000] for i in range(12)], 300)
    c = dataclasses.replace(cfg(False), vocab_size=tok.vocab_size, max_seq_len=64, init_std=0.3)
    m = Model(c, seed=1)
    ck.save_checkpoint(run, model=m, optimizer=AdamW(m.params, lr=1e-3), trainer_state={"step": 0})
    tok.save(run / "tokenizer.json")
    assert main(["export", str(run), "--out", str(hf_dir), "--dtype", "float32"]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).float().eval()
    n, seen = 12, []
    for prompt in [
        "def ",
        "",
        "import os\n    return ",
        "class Path(object):\n    return ",
        "  \u00e9t\u00e9 = {'a': 1}",
    ]:
        enc = hf_tok(prompt, return_tensors="pt")
        ids = [tok.eot_id] + tok.encode(prompt)
        assert enc["input_ids"][0].tolist() == ids, prompt
        with torch.no_grad():
            out = hf.generate(
                **enc, do_sample=False, max_new_tokens=n, eos_token_id=tok.eot_id, pad_token_id=tok.eot_id
            )
        theirs = out[0, len(ids) :].tolist()
        assert len(theirs) == n and tok.eot_id not in theirs, prompt  # a real continuation
        seen.append(tuple(theirs))
        capsys.readouterr()
        args = ["sample", str(run), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", str(n)]
        assert main(args) == 0
        assert capsys.readouterr().out == prompt + hf_tok.decode(theirs) + "\n", prompt
    assert len(set(seen)) == len(seen), seen  # the continuation depends on the prompt, not only its end
