"""Hugging Face Qwen3 checkpoints in (``xtrain.hf``, ``xtrain train --init-from``): a random small Qwen3 made and
saved by transformers (tied and untied, GQA, head_dim 128, one file or shards, fp32 or bf16) loads into xtrain's
model and gives transformers' logits in float64; every way a checkpoint can be wrong is refused before any step,
naming the tensor or field; a Hub id without the hub extra or without a network is a one-line error."""

import json
import shutil
import sys

import pytest
import torch

from tests import _qwen as Q
from tests._cli import check, tree_hash, xtrain
from xtrain.autograd import no_grad
from xtrain.hf import CheckpointFormatError, open_checkpoint, resolve_checkpoint
from xtrain.model import Model

transformers = pytest.importorskip("transformers")

CASES = {  # name -> (tied, max_shard_size, dtype)
    "tied-sharded-fp32": (True, "60KB", torch.float32),
    "untied-single-fp32": (False, None, torch.float32),
    "untied-sharded-bf16": (False, "100KB", torch.bfloat16),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {k: Q.make_checkpoint(root / k, tie, shard=shard, dtype=dt, seed=i) for i, (k, (tie, shard, dt)) in
            enumerate(CASES.items())}  # fmt: skip


def _ours(path, **kw):
    ck = open_checkpoint(path)
    m = Model(ck.model_config(compute_dtype="float64", attention="composed", loss="composed", **kw))
    ck.load_into(m)
    return ck, m.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_gives_transformers_logits_float64(ckpts, case):
    path = ckpts[case]
    tied, shard, dtype = CASES[case]
    if shard:
        assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("model-*.safetensors"))) > 2
    ck, ours = _ours(path)
    c = ours.config
    assert (c.head_dim, c.n_head, c.n_kv_head, c.tie_embeddings, c.rope_theta) == (128, 4, 2, tied, 1e6)
    assert ck.dtypes() == [{torch.float32: "F32", torch.bfloat16: "BF16"}[dtype]]
    hf = Q.load_hf_float64(path)
    ids = torch.randint(0, c.vocab_size, (3, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    with no_grad():
        got = ours.forward(ids).data
    # the same float64 network computed by two implementations: rounding only (measured ~1e-15 relative)
    assert (got - ref).abs().max() <= 1e-12 * ref.abs().max()
    assert ref.abs().max() > 1.0  # random weights at std 0.2: logits far from zero, a wrong weight would show


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_json(path, **kw):
    d = json.loads(path.read_text())
    d.update(kw)
    path.write_text(json.dumps(d))


def test_config_fields_xtrain_cannot_run_are_refused_by_name(ckpts, tmp_path):
    base = ckpts["untied-single-fp32"]
    for field, value, words in [
        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}, "rope_type 'yarn'"),
        ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_type 'linear'"),
        ("attention_bias", True, "attention_bias"),
        ("use_sliding_window", True, "use_sliding_window"),
        ("hidden_act", "gelu", "hidden_act"),
        ("model_type", "llama", "model_type 'llama'"),
    ]:
        d = _copy(base, tmp_path / field)
        _edit_json(d / "config.json", **{field: value})
        with pytest.raises(CheckpointFormatError, match=words):
            open_checkpoint(d)
    # transformers >= 5 keeps the RoPE base in rope_parameters: it must be read from there (1e6, not 1e4)
    assert "rope_theta" not in json.loads((base / "config.json").read_text())
    assert open_checkpoint(base).model_config().rope_theta == 1e6


def test_tensor_mismatches_name_the_tensor_before_any_weight_is_read(ckpts, tmp_path):
    from safetensors.torch import load_file, save_file

    base = ckpts["untied-sharded-bf16"]
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    key = "model.layers.1.self_attn.k_proj.weight"
    # a wrong shape
    d = _copy(base, tmp_path / "shape")
    f = d / index[key]
    t = load_file(str(f))
    t[key] = t[key][:-1].contiguous()
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(
        CheckpointFormatError, match=r"k_proj.weight has shape \(255, 64\), config.json needs \(256, 64\)"
    ):
        open_checkpoint(d)
    # a missing tensor (the index names a shard that does not hold it)
    d = _copy(base, tmp_path / "missing")
    t = load_file(str(d / index[key]))
    del t[key]
    save_file(t, str(d / index[key]), metadata={"format": "pt"})
    with pytest.raises(CheckpointFormatError, match="k_proj.weight"):
        open_checkpoint(d)
    # an unexpected tensor
    d = _copy(base, tmp_path / "extra")
    t = load_file(str(d / index[key]))
    t["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(512)
    save_file(t, str(d / index[key]), metadata={"format": "pt"})
    with pytest.raises(CheckpointFormatError, match="unexpected tensor model.layers.0.self_attn.q_proj.bias"):
        open_checkpoint(d)
    # a truncated shard and a missing one
    d = _copy(base, tmp_path / "cut")
    data = (d / index[key]).read_bytes()
    (d / index[key]).write_bytes(data[: len(data) - 10])
    with pytest.raises(CheckpointFormatError, match="truncated"):
        open_checkpoint(d)
    (d / index[key]).unlink()
    with pytest.raises(CheckpointFormatError, match="missing"):
        open_checkpoint(d)
    # a dtype xtrain does not read
    d = _copy(ckpts["untied-single-fp32"], tmp_path / "int")
    t = load_file(str(d / "model.safetensors"))
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.int32)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointFormatError, match="model.norm.weight has dtype I32"):
        open_checkpoint(d)


def test_hub_id_needs_the_hub_extra_and_a_network(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed
    with pytest.raises(CheckpointFormatError, match=r"hub extra \(pip install -e '.\[hub\]'\)"):
        resolve_checkpoint("Qwen/Qwen3-0.6B")
    monkeypatch.delitem(sys.modules, "huggingface_hub")
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty cache
    with pytest.raises(CheckpointFormatError, match="could not download it from the Hugging Face Hub"):
        resolve_checkpoint("Qwen/Qwen3-0.6B")
    with pytest.raises(CheckpointFormatError, match="no such directory, and not a Hub id"):
        resolve_checkpoint(str(tmp_path / "nope" / "deeper" / "x"))


@pytest.mark.slow
def test_train_init_from_refuses_with_one_line_and_writes_nothing(ckpts, tmp_path):
    """As real commands: an offline Hub id, a checkpoint with a wrong tensor, and --preset with --init-from each
    stop with exit code 2, one line naming what is wrong, no traceback, and no run directory."""
    from safetensors.torch import load_file, save_file

    Q.write_jsonl(tmp_path / "chat.jsonl")
    bad = _copy(ckpts["untied-single-fp32"], tmp_path / "bad")
    t = load_file(str(bad / "model.safetensors"))
    t["lm_head.weight"] = t["lm_head.weight"][:, :63].contiguous()
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    before = tree_hash(tmp_path)
    args = ["--data", tmp_path / "chat.jsonl", "--out", tmp_path / "run", "--steps", 1, "--no-progress"]
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    r = xtrain("train", "--init-from", "Qwen/Qwen3-0.6B", *args, cwd=tmp_path, env_extra=offline)
    check(r, 2, "could not download it from the Hugging Face Hub")
    r = xtrain("train", "--init-from", bad, *args, cwd=tmp_path)
    check(r, 2, "lm_head.weight has shape (320, 63), config.json needs (320, 64)")
    r = xtrain("train", "--init-from", bad, "--preset", "tiny", *args, cwd=tmp_path)
    check(r, 2, "--preset and --init-from exclude each other")
    assert tree_hash(tmp_path) == before and not (tmp_path / "run").exists()
