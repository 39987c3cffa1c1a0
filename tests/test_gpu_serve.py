"""The decode step as CUDA graphs (``xtrain.serve.engine.DecodeGraphs``), on a CUDA GPU (skipped without one):
a replayed step computes bit for bit what the same step run eagerly computes, batched steps over slots of
different lengths included, and greedy decoding gives the tokens of the engine without graphs."""

import pytest
import torch

from xtrain.autograd import no_grad
from xtrain.config import ModelConfig
from xtrain.mask import Cached
from xtrain.model import Model
from xtrain.serve.engine import Batcher, Engine, EngineConfig, Sampling, SlotCache

pytestmark = pytest.mark.gpu


def _model(dtype="bfloat16"):
    cfg = ModelConfig(
        vocab_size=512, n_layer=2, n_embd=128, n_head=4, n_kv_head=2, head_dim=32, ffn_dim=256, max_seq_len=600,
        init_std=0.2, compute_dtype=dtype,
    )  # fmt: skip
    return Model(cfg, device="cuda", seed=3).eval()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_decode_is_the_eager_step_bit_for_bit(dtype):
    """Three rows at lengths 5, 300 and 17 (two S buckets over the steps) decoded 12 steps through the graphs
    and through ``_decode`` (the model's forward with a Cached mask) on a copy of the cache at the same bucketed
    length: logits and caches equal."""
    m = _model(dtype)
    eng = Engine(m)
    assert eng.graphs is not None
    g = torch.Generator().manual_seed(0)
    with no_grad():
        cache = SlotCache(m, 4, 600)
        for slot, n in ((0, 5), (2, 300), (3, 17)):
            eng.prefill(cache, slot, torch.randint(0, 512, (n,), generator=g))
        twin = SlotCache(m, 4, 600)
        twin.kv = [(k.clone(), v.clone()) for k, v in cache.kv]
        twin.lengths = cache.lengths.clone()
        slots = torch.tensor([0, 2, 3])
        for _ in range(12):
            tokens = torch.randint(0, 512, (3,), generator=g)
            pos = twin.lengths[slots]
            S = eng.graphs.s_bucket(int(pos.max()) + 1, twin.max_len)
            ref = eng._decode(twin, Cached(slots.cuda(), pos.cuda(), 1, S), tokens.cuda())
            twin.lengths[slots] = pos + 1
            got = eng.decode(cache, slots, tokens)
            assert torch.equal(got, ref)
        for (k, v), (k2, v2) in zip(cache.kv, twin.kv):
            assert torch.equal(k, k2) and torch.equal(v, v2)
    assert eng.graphs.captures == 1  # positions 300..311: one bucket, one batch size


def test_greedy_tokens_with_graphs_equal_without():
    """Prompts of different lengths whose greedy continuations differ (checked first): ``generate`` and the
    batcher with graphs give the tokens of the engine without graphs (fp32, so no bf16 near-ties), and a sampled
    sequence (sampling on the device) the same tokens with and without graphs."""
    m = _model("float32")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (3, 40, 11)]
    greedy, sampled = Sampling(temperature=0), Sampling(temperature=0.9, top_k=50, top_p=0.9, seed=5)
    plain = [Engine(m, cuda_graph=False).generate([p], 30, greedy)[0] for p in prompts]
    assert len({tuple(t) for t in plain}) == 3
    eng = Engine(m)
    graphed = [eng.generate([p], 30, greedy)[0] for p in prompts]
    assert graphed == plain and eng.graphs.captures >= 1
    assert eng.generate(prompts, 30, sampled) == Engine(m, cuda_graph=False).generate(prompts, 30, sampled)
    b = Batcher(Engine(m), EngineConfig(slots=4)).start()
    try:
        seqs = [b.generate(p, 30, greedy) for p in prompts]
    finally:
        b.close()
    assert [toks for toks, _ in seqs] == plain
