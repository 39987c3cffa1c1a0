"""Fine-tuning a Qwen3 checkpoint on chat data (``xtrain train --init-from``): SFT steps of xtrain's trainer equal
transformers' Qwen3ForCausalLM + torch AdamW with the same masked loss, in float64; the targets outside the
assistant turns get exactly zero gradient; the schedule flags are recorded in the run."""

import pytest
import torch

from tests import _qwen as Q
from xtrain.autograd import no_grad
from xtrain.config import TrainConfig
from xtrain.data.chat import MaskedTokenLoader, prepare_chat
from xtrain.hf import open_checkpoint
from xtrain.mask import Documents
from xtrain.model import Model
from xtrain.train.trainer import Trainer

transformers = pytest.importorskip("transformers")

T = 96


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    out = {}
    for tie in (False, True):
        ck = Q.make_checkpoint(root / f"ck-{tie}", tie, shard="150KB", seed=3 + tie)
        src = Q.write_jsonl(root / "chat.jsonl", repeat=2)
        meta = prepare_chat(src, ck, root / f"data-{tie}", T, val_fraction=0.0, log=lambda *a: None)
        out[tie] = (ck, root / f"data-{tie}" / "train_000000.bin", meta)
    return out


def _segments(row: torch.Tensor, sep: int) -> list[tuple[int, int]]:
    """[start, end) of each conversation in a window row: a new one starts right after each separator."""
    starts = [0] + [i + 1 for i in range(len(row) - 1) if int(row[i]) == sep]
    return list(zip(starts, starts[1:] + [len(row)]))


@pytest.mark.parametrize("tie,accum", [(False, 1), pytest.param(True, 2, marks=pytest.mark.slow)])
def test_sft_steps_equal_transformers_and_torch_adamw_float64(setup, tie, accum):
    """Three optimizer steps on packed chat windows (document mask, loss on assistant tokens only, clipping acting,
    weight decay on the matrices but the embedding), against transformers run on each conversation ALONE (so the
    document mask must keep conversations apart and restart RoPE exactly) with torch's clip and fused AdamW."""
    ck_dir, shard, meta = setup[tie]
    sep = meta["chat"]["separator_id"]
    ck = open_checkpoint(ck_dir)
    model = Model(ck.model_config(compute_dtype="float64", attention="math", loss="composed"))
    ck.load_into(model)
    tc = TrainConfig(steps=3, batch_size=2, grad_accum=accum, seq_len=T, lr=3e-3, schedule="constant",
                     warmup_steps=0, weight_decay=0.1, grad_clip=0.5, doc_mask=True, eot_id=sep,
                     doc_start="after_eot")  # fmt: skip
    trainer = Trainer(model, tc, MaskedTokenLoader(shard, 2, T, seed=7))

    hf = Q.load_hf_float64(ck_dir, training=True)
    params = dict(hf.named_parameters())
    assert set(params) == set(model.params)
    decay = [p for n, p in params.items() if p.ndim == 2 and n != "model.embed_tokens.weight"]
    rest = [p for n, p in params.items() if not (p.ndim == 2 and n != "model.embed_tokens.weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)  # fmt: skip
    loader = MaskedTokenLoader(shard, 2, T, seed=7)
    clipped = 0
    for _ in range(3):
        m = trainer.train_step()
        x, y = loader.next_batch()  # [B, T]
        n = int((y != -100).sum())
        total = torch.zeros((), dtype=torch.float64)
        for b in range(x.shape[0]):
            for s, e in _segments(x[b], sep):  # each conversation alone, positions from 0
                if (y[b, s:e] == -100).all():
                    continue  # padding or a conversation's untrained tail: contributes nothing
                logits = hf(x[b, s:e][None]).logits[0]  # [e - s, V]
                total = total + torch.nn.functional.cross_entropy(logits, y[b, s:e], ignore_index=-100, reduction="sum")
        (total / n).backward()
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), 0.5)
        clipped += float(norm) > 0.5
        opt.step()
        opt.zero_grad()
        assert m["tokens"] == n > 0
        assert abs(m["loss"] - total.item() / n) <= 1e-12 * abs(m["loss"])
        assert abs(m["grad_norm"] - float(norm)) <= 1e-10 * float(norm)
    assert clipped >= 1  # the clip acted
    worst = max(float((model.params[k].data - p.detach()).abs().max()) for k, p in params.items())
    moved = min(float((model.params[k].data - ck.read(k).double()).abs().max()) for k in params)
    # two float64 implementations: rounding only, which AdamW's normalised step carries into the weights (measured
    # 1.4e-13 and 3.1e-13 after three steps at lr 3e-3, weights of std 0.2); every tensor moved
    assert worst <= 1e-12 and moved > 1e-4


def test_targets_outside_assistant_turns_get_exactly_zero_gradient(setup):
    """The loss's gradient is exactly zero on every logits row whose target is not an assistant token (and nonzero
    on the trained rows); and every parameter's gradient is unchanged to the last bit when the tokens of a window
    after its last trained target are replaced by random ones (they are only untrained targets and the inputs of
    untrained positions)."""
    from xtrain import ops
    from xtrain.autograd import Var

    ck_dir, shard, meta = setup[False]
    ck = open_checkpoint(ck_dir)
    model = Model(ck.model_config(compute_dtype="float64", attention="math", loss="composed"))
    ck.load_into(model)
    x, y = MaskedTokenLoader(shard, 4, T, seed=1).next_batch()
    sep = meta["chat"]["separator_id"]
    with no_grad():
        logits = model.forward(x, mask=Documents.of(x, sep, after=True)).data  # [B, T, V]
    logits = logits.reshape(-1, logits.shape[-1])
    leaf = Var(logits, True)  # [B*T, V]
    ops.cross_entropy(leaf, y.reshape(-1), reduction="sum").backward()
    ignored = y.reshape(-1) == -100
    assert ignored.any() and (~ignored).any()
    assert (leaf.grad[ignored] == 0).all()  # exactly zero, not small
    assert (leaf.grad[~ignored].abs().sum(-1) > 0).all()

    def grads(x):
        model.zero_grad()
        model.loss(x, y, reduction="sum", mask=Documents.of(x, sep, after=True)).backward()
        return {k: p.grad.clone() for k, p in model.params.items()}

    g = grads(x)
    x2 = x.clone()
    for b in range(x.shape[0]):
        last = int((y[b] != -100).nonzero().max())
        # input t predicts target t: inputs after the last trained target feed only untrained positions
        x2[b, last + 1 :] = torch.randint(0, meta["vocab_size"], (T - last - 1,))
    assert not torch.equal(x, x2)
    g2 = grads(x2)
    assert all(torch.equal(g[k], g2[k]) for k in g)


def test_schedule_flags_and_fine_tune_defaults():
    """--init-from brings fine-tuning defaults (peak 2e-5, min lr/10, no weight decay, 3 % warmup); each flag
    overrides; without --init-from the pretraining defaults stay; conflicting flags are refused."""
    import argparse

    from xtrain.config import ConfigError
    from xtrain.train.init_from import check_args, schedule

    def ns(**kw):
        base = dict(lr=None, min_lr=None, weight_decay=None, warmup=None, warmup_frac=None, init_from=None,
                    preset=None, vocab_size=None)  # fmt: skip
        return argparse.Namespace(**{**base, **kw})

    ft = schedule(ns(), True, 200, 3e-3, 20)
    assert ft == {
        "lr": 2e-5,
        "min_lr": pytest.approx(2e-6),
        "weight_decay": 0.0,
        "warmup_steps": 6,
        "warmup_frac": 0.03,
    }
    got = schedule(ns(lr=1e-4, min_lr=0.0, weight_decay=0.01, warmup_frac=0.25), True, 200, 3e-3, 20)
    assert got == {"lr": 1e-4, "min_lr": 0.0, "weight_decay": 0.01, "warmup_steps": 50, "warmup_frac": 0.25}
    assert schedule(ns(warmup=7), True, 200, 3e-3, 20)["warmup_steps"] == 7
    pre = schedule(ns(), False, 160, 3e-3, 20)
    assert pre == {
        "lr": 3e-3,
        "min_lr": pytest.approx(3e-4),
        "weight_decay": 0.1,
        "warmup_steps": 20,
        "warmup_frac": None,
    }
    assert schedule(ns(warmup_frac=0.5), False, 160, 3e-3, 20)["warmup_steps"] == 80
    for bad, words in [
        (ns(warmup=5, warmup_frac=0.1), "--warmup and --warmup-frac exclude each other"),
        (ns(warmup_frac=1.5), "--warmup-frac 1.5: must lie in"),
        (ns(weight_decay=-1.0), "--weight-decay -1.0"),
        (ns(init_from="x", preset="tiny"), "--preset and --init-from"),
        (ns(init_from="x", vocab_size=300), "--vocab-size and --init-from"),
    ]:
        with pytest.raises(ConfigError, match=words):
            check_args(bad)
