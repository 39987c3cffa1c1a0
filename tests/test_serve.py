"""The KV-cache engine computes the model's logits and greedy tokens (the model's forward with a slot cache equals
its full-window forward); batched decoding over cache slots (sequences of different lengths in one batch) gives
each sequence the tokens it gets alone; a sample may outgrow the context; the batcher's queue is bounded; sampling
runs on the logits' device with the same tokens for the same seed. The HTTP API is tested in test_serve_api.py,
the train -> export -> serve loop in test_serve_loop.py."""

import math
import threading

import pytest
import torch

from xtrain.autograd import no_grad
from xtrain.config import ModelConfig
from xtrain.mask import Cached
from xtrain.model import Model
from xtrain.serve.engine import Batcher, Engine, EngineConfig, QueueFull, Sampling, SlotCache, sample_rows


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models: intra-op threads only add wake-up latency, which on a loaded 2-core machine turned a
    one-second test into twenty-five."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def small(**kw):
    base = dict(
        vocab_size=257,
        n_layer=2,
        n_embd=48,
        n_head=6,
        n_kv_head=2,
        head_dim=16,
        ffn_dim=80,
        max_seq_len=48,
        init_std=0.2,
    )
    base.update(kw)
    return Model(ModelConfig(**base), seed=5)


def greedy_full_window(m: Model, ids: list[int], n: int) -> list[int]:
    """The oracle: n greedy tokens, each from the model's full-window forward (no cache)."""
    seq = list(ids)
    with no_grad():
        for _ in range(n):
            seq.append(int(m.forward(torch.tensor([seq])).data[0, -1].argmax()))
    return seq[len(ids) :]


@pytest.mark.parametrize("tie", [False, True])
def test_cached_logits_equal_full_window_logits(tie):
    """Three rows prefilled together (one forward, B = 3, a Cached mask), then decoded one position at a time
    through the forward's decode path: every position's logits equal the full window's."""
    m = small(tie_embeddings=tie)
    ids = torch.randint(0, 257, (3, 20), generator=torch.Generator().manual_seed(0))
    cache = SlotCache(m, 3, 20)
    rows = torch.arange(3)
    with no_grad():
        ref = m.forward(ids).data  # [B, T, V], every position from the full window
        got = [m.forward(ids[:, :7], mask=cache.mask(rows, 7), cache=cache).data]  # [3, 7, V]
        cache.lengths[:] = 7
        for t in range(7, 20):
            got.append(m.forward(ids[:, t : t + 1], mask=cache.mask(rows, 1), cache=cache, last=True).data)
            cache.lengths += 1
    got = torch.cat(got, dim=1)  # [B, 20, V]
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_greedy_tokens_equal_the_full_window_and_generate_is_seeded():
    m = small()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 257, (n,), generator=g).tolist() for n in (9, 4)]
    e = Engine(m)
    assert e.generate(prompts, 15, Sampling(temperature=0)) == [greedy_full_window(m, p, 15) for p in prompts]
    a = e.generate(prompts, 10, Sampling(temperature=0.9, top_k=20, seed=4))
    assert a == Engine(m).generate(prompts, 10, Sampling(temperature=0.9, top_k=20, seed=4))
    assert a[0] == e.generate(prompts[:1], 10, Sampling(temperature=0.9, top_k=20, seed=4))[0]  # alone: the same


def test_a_slide_sample_outgrows_the_context():
    """``slide``: a row that fills the context goes on from its last max_len // 2 tokens, re-read from position 0
    (one prefill), so the tokens after the refill are those of the full window over that half."""
    m = small()
    p = torch.randint(0, 257, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    e = Engine(m)
    with pytest.raises(ValueError, match="exceeds the context"):
        e.generate([p], 40, Sampling(temperature=0))
    out = e.generate([p], 40, Sampling(temperature=0), slide=True)[0]
    assert len(out) == 40
    assert out[:19] == greedy_full_window(m, p, 19)  # the row holds 30 + 18 = 48 positions after 19 tokens
    assert out[19:] == greedy_full_window(m, (p + out)[49 - 24 : 49], 21)  # then the last 24 of the 49 so far


@pytest.mark.parametrize(
    "starts,new,keys,row",
    [
        ([3], 1, 4, True),
        ([3], 1, 9, True),
        ([3], 4, 7, True),
        ([3], 1, 9, False),
        ([5, 0, 2], 1, 8, False),
        ([2, 4], 3, 7, False),
    ],
)
def test_cached_mask_hides_exactly_the_keys_past_each_query(starts, new, keys, row):
    """Query t of row b sees keys 0 .. starts[b] + t: ``hidden`` is that set's complement over the keys read (None
    only when it is empty), the RoPE positions are starts[b] + t, for the lone-row form and the many-row form."""
    B = len(starts)
    st = torch.tensor(starts)
    m = Cached(torch.arange(B), st, new, keys, (0, starts[0]) if row else None)
    pos = st[:, None] + torch.arange(new)  # [B, Tn]
    want = torch.arange(keys)[None, None, :] > pos[:, :, None]  # [B, Tn, S]
    got = torch.zeros(B, new, keys, dtype=torch.bool) if m.hidden is None else m.hidden.expand(B, 1, 1, new, keys)
    assert torch.equal(got.reshape(B, new, keys), want)
    assert torch.equal(m.positions(new, "cpu").expand(B, new), pos)


def test_engine_rejects_bad_input():
    e = Engine(small())
    with pytest.raises(ValueError, match="exceeds the context of 48"):
        e.generate([[0] * 40], 20)
    with pytest.raises(ValueError, match="token ids must lie"):
        e.generate([[999] * 3], 2)
    with pytest.raises(ValueError, match="non-empty prompt"):
        e.generate([[]], 2)
    with pytest.raises(ValueError, match="Sampling: need"):
        e.generate([[1, 2]], 2, Sampling(temperature=-1))
    m = small()
    cache = SlotCache(m, 2, 8)
    with no_grad():
        with pytest.raises(ValueError, match="Cached exactly when a cache is given"):
            m.forward(torch.zeros(2, 3, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="the cache mask holds 2 rows of 3"):
            m.forward(torch.zeros(2, 4, dtype=torch.long), mask=cache.mask(torch.arange(2), 3), cache=cache)
        with pytest.raises(ValueError, match="do not fit 8 positions"):
            cache.mask(torch.arange(2), 9)
    with pytest.raises(ValueError, match="inference"):  # the cache path records no tape
        m.forward(torch.zeros(2, 3, dtype=torch.long), mask=cache.mask(torch.arange(2), 3), cache=cache)
    with pytest.raises(ValueError, match="Cached: need"):
        Cached(torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long), 1, 4)


def test_slot_decode_equals_full_window_logits():
    """Three sequences of different lengths in three non-adjacent slots of one cache, decoded together at
    their own positions: every step's logits equal the model's full-window logits of that sequence."""
    m = small()
    e = Engine(m)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 257, (n,), generator=g) for n in (19, 21, 16)]
    starts, slots = (5, 9, 2), torch.tensor([4, 0, 2])
    cache = SlotCache(m, 5, 24)
    cache.kv[0][0].normal_(generator=g)  # stale rows must stay hidden by the mask
    for s, slot, t0 in zip(seqs, slots.tolist(), starts):
        e.prefill(cache, slot, s[:t0])
    with no_grad():
        refs = [m.forward(s[None]).data[0] for s in seqs]  # [T, V]
    for step in range(10):
        toks = torch.stack([s[t0 + step] for s, t0 in zip(seqs, starts)])
        got = e.decode(cache, slots, toks)  # [3, V]
        for b, (ref, t0) in enumerate(zip(refs, starts)):
            want = ref[t0 + step]
            assert (got[b] - want).abs().max() <= 1e-5 * want.abs().max(), (step, b)
    assert cache.lengths[slots].tolist() == [t0 + 10 for t0 in starts]


def _run_together(b: Batcher, jobs):
    """Submit every (ids, n, sampling) from its own thread at once -> [(tokens, finish)]."""
    out = [None] * len(jobs)

    def go(i):
        out[i] = b.generate(*jobs[i])

    ths = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    return out


def test_batched_greedy_equals_alone_and_sampling_is_per_sequence():
    m = small()
    e = Engine(m)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 17, 5, 11, 2)]
    alone = [e.generate([p], 20, Sampling(temperature=0))[0] for p in prompts]
    b = Batcher(e, EngineConfig(slots=4, max_queue=8)).start()
    try:
        jobs = [(p, 20, Sampling(temperature=0)) for p in prompts]
        got = _run_together(b, jobs)
        assert [t for t, _ in got] == alone
        assert all(f == "length" for _, f in got)
        assert b.max_batch > 1 and b.steps < 6 * 19  # requests shared decode steps
        # a seeded sampled request gets the same tokens alone and beside others with other settings
        smp = Sampling(temperature=0.9, top_k=40, top_p=0.9, seed=7)
        solo = b.generate(prompts[1], 15, smp)
        mixed = _run_together(b, [(prompts[1], 15, smp), (prompts[0], 15, Sampling(temperature=1.3, seed=1))] * 2)
        assert mixed[0] == solo and mixed[2] == solo
        assert b.generate(prompts[1], 15, Sampling(temperature=0.9, top_k=40, top_p=0.9, seed=8)) != solo
    finally:
        b.close()


def test_eos_stops_and_logprobs():
    m = small()
    b = Batcher(Engine(m), EngineConfig(slots=2)).start()
    try:
        toks, fin = b.generate([1, 2, 3], 10, Sampling(temperature=0))
        assert fin == "length" and len(toks) == 10
        toks2, fin2 = b.generate([1, 2, 3], 10, Sampling(temperature=0), eos_id=toks[4])
        assert fin2 == "stop" and toks2 == toks[: toks.index(toks[4])]  # eos itself is not reported
        seen = []
        done = threading.Event()
        b.submit(
            [
                (
                    [1, 2, 3],
                    3,
                    Sampling(temperature=0, logprobs=3),
                    None,
                    lambda t, lp, f: (seen.append((t, lp)), f and done.set()),
                )
            ]
        )
        done.wait(30)
        tok, (lp, top) = seen[0]
        assert tok == toks[0] and len(top) == 3 and top[0][0] == tok and abs(top[0][1] - lp) < 1e-6 and lp <= 0
    finally:
        b.close()


def test_queue_is_bounded_and_cancel_frees_the_slot():
    m = small()
    b = Batcher(Engine(m), EngineConfig(slots=1, max_queue=1))  # not started: nothing leaves the queue
    ev = []
    cb = lambda t, lp, f: ev.append(f)
    seqs = b.submit([([1, 2], 30, Sampling(temperature=0), None, cb)] * 2)  # one for the slot, one waiting
    with pytest.raises(QueueFull, match="capacity"):
        b.submit([([1, 2], 30, Sampling(), None, cb)])
    with pytest.raises(ValueError, match="exceeds the context of 48"):
        b.submit([([1] * 40, 9, Sampling(), None, cb)])
    for s in seqs:
        s.cancel()
    b.start()
    try:
        toks, fin = b.generate([1, 2], 5, Sampling(temperature=0))  # the cancelled two freed the slot
        assert fin == "length" and len(toks) == 5 and ev.count("cancelled") == 2
        assert b.load() == {"running": 0, "waiting": 0, "slots": 1}
    finally:
        b.close()


def _filtered_probs(logits: list[float], temperature, top_k, top_p) -> torch.Tensor:
    """The sampling distribution from its definition, in float64 Python: p = softmax(logits / T); keep the top_k
    most likely tokens; of those (renormalised), keep each token while the mass ranked above it is below top_p
    (so the most likely one always stays); renormalise what is kept."""
    p = [math.exp(x / temperature) for x in logits]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    kept = order[: top_k or len(p)]
    if top_p is not None:
        total, above, nucleus = sum(p[i] for i in kept), 0.0, []
        for i in kept:
            if above >= top_p:
                break
            nucleus.append(i)
            above += p[i] / total
        kept = nucleus
    z = sum(p[i] for i in kept)
    return torch.tensor([p[i] / z if i in kept else 0.0 for i in range(len(p))], dtype=torch.float64)


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, None, None), (0.7, 3, None), (1.3, None, 0.6), (1.0, 4, 0.8)]
)
def test_sample_rows_draws_from_the_filtered_distribution(temperature, top_k, top_p):
    """4000 rows of the same logits, each with its own generator: the token frequencies match the filtered
    distribution (``_filtered_probs``, written here from the definition) within 5 standard deviations, and
    nothing outside the filter is drawn."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 7, generator=g) * 1.5
    want = _filtered_probs(logits[0].tolist(), temperature, top_k, top_p)
    assert 0 < int((want > 0).sum()) < 7 or (top_k is None and top_p is None)  # the filter cuts something
    N = 4000
    smp = [Sampling(temperature=temperature, top_k=top_k, top_p=top_p)] * N
    gens = [torch.Generator().manual_seed(100 + i) for i in range(N)]
    toks = sample_rows(logits.expand(N, 7), smp, gens)
    freq = torch.bincount(toks, minlength=7).double() / N
    sigma = (want.double() * (1 - want.double()) / N).sqrt()
    assert ((freq - want.double()).abs() <= 5 * sigma + 1e-12).all(), (freq, want)
    assert (freq[want == 0] == 0).all()
    # greedy rows beside sampled ones take the argmax; the same generator state gives the same token
    mixed = sample_rows(
        logits.expand(2, 7), [Sampling(temperature=0), smp[0]], [None, torch.Generator().manual_seed(100)]
    )
    assert mixed[0] == logits.argmax() and mixed[1] == toks[0]


def test_sample_rows_gives_the_tokens_of_the_host_sampler():
    """Sampling moved to the logits' device with the same semantics: six rows (greedy, temperature, top-k, top-p,
    both, ties) over six steps draw exactly the tokens the host sampler of 3319483 (``sample_rows`` on CPU
    logits, one uniform per sampled row from its own generator) drew for the same seeds (recorded there)."""
    g = torch.Generator().manual_seed(58)
    logits = torch.randn(6, 40, generator=g)
    logits[5] = logits[5].round()  # ties
    sets = [Sampling(temperature=0), Sampling(temperature=0.7, seed=1), Sampling(temperature=1.3, top_k=5, seed=2),
            Sampling(temperature=1.0, top_p=0.6, seed=3), Sampling(temperature=0.9, top_k=12, top_p=0.8, seed=4),
            Sampling(temperature=1.1, top_p=0.95, seed=5)]  # fmt: skip
    gens = [torch.Generator().manual_seed(s.seed) for s in sets]
    got = [sample_rows(logits, sets, gens).tolist() for _ in range(6)]
    assert got == [[4, 31, 0, 24, 0, 4], [4, 31, 13, 8, 10, 9], [4, 31, 33, 10, 0, 21], [4, 31, 24, 24, 14, 17],
                   [4, 39, 0, 10, 14, 9], [4, 31, 24, 37, 38, 37]]  # fmt: skip


def test_greedy_rows_take_the_first_argmax_and_a_non_finite_row_gives_minus_one():
    """All-greedy rows (``sample_rows``' greedy path, ``greedy_ids``): the first of equal maxima; -1 for a row
    whose best is nan, +inf or -inf (every entry -inf), whatever the neighbouring rows hold."""
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [0.0, nan, 1.0, 0.0], [0.0, inf, 1.0, 0.0], [-inf] * 4,
                           [-inf, -inf, 3.0, -inf]])  # fmt: skip
    greedy = [Sampling(temperature=0)] * 5
    assert sample_rows(logits, greedy, [None] * 5).tolist() == [1, -1, -1, -1, 2]
    assert sample_rows(logits.bfloat16(), greedy, [None] * 5).tolist() == [1, -1, -1, -1, 2]


def test_training_beside_the_batcher_records_its_tape_and_both_work():
    """Grad mode, value checks and the kernel backend are per thread: a trainer stepping in one thread while the
    batcher (under ``no_grad`` for its whole life) serves in another trains exactly as it does alone, the served
    tokens are those of the engine alone, and the batcher's exit leaves the other threads' grad mode as it was."""
    from xtrain.autograd import is_grad_enabled
    from xtrain.config import TrainConfig
    from xtrain.train.trainer import Trainer

    tc = TrainConfig(steps=4, batch_size=2, seq_len=12, lr=1e-2, warmup_steps=0, schedule="constant")

    def batches():
        g = torch.Generator().manual_seed(9)
        return lambda: torch.randint(0, 257, (2, 13), generator=g)

    alone = Trainer(small(), tc, batches())
    alone_losses = [m["loss"] for m in alone.fit()]
    m = small()
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
    want = Engine(m).generate(prompts, 12, Sampling(temperature=0))
    b = Batcher(Engine(m), EngineConfig(slots=2)).start()
    try:
        assert b.generate(prompts[0], 12, Sampling(temperature=0))[0] == want[0]  # the batcher holds no_grad now
        beside = Trainer(small(), tc, batches())
        out: dict = {}

        def train():
            try:
                out["losses"] = [r["loss"] for r in beside.fit()]
            except BaseException as e:  # reported below, in the test's thread
                out["error"] = e

        th = threading.Thread(target=train)
        th.start()
        served = _run_together(b, [(p, 12, Sampling(temperature=0)) for p in prompts])
        th.join(120)
        assert not th.is_alive()
        assert "error" not in out, out.get("error")
        assert out["losses"] == alone_losses  # every step recorded its tape and trained as it does alone
        for k, v in alone.model.state_dict().items():
            assert torch.equal(beside.model.state_dict()[k], v), k
        assert [t for t, _ in served] == want
    finally:
        b.close()
    assert is_grad_enabled()


def _batch_run(e: Engine, jobs, ahead: bool, slots: int = 3):
    """Run (ids, n, sampling, eos) jobs through a batcher on this thread -> ([(tokens, finish)], steps reported,
    steps launched)."""
    from xtrain.serve.engine import Collect

    b = Batcher(e, EngineConfig(slots=slots, max_queue=8, run_ahead=ahead))
    outs, launched, step = [Collect() for _ in jobs], [0], e.step

    def counted(*a):
        launched[0] += 1
        return step(*a)

    b.submit([(ids, n, smp, eos, c) for (ids, n, smp, eos), c in zip(jobs, outs)])
    e.step = counted
    try:
        b.run()
        again = [Collect() for _ in jobs]  # the same batcher once more: nothing of the first run is left in it
        b.submit([(ids, n, smp, eos, c) for (ids, n, smp, eos), c in zip(jobs, again)])
        b.run()
    finally:
        del e.step
    assert [(c.tokens, c.finish) for c in again] == [(c.tokens, c.finish) for c in outs]
    return [(c.tokens, c.finish) for c in outs], b.steps // 2, launched[0] // 2


def test_steps_launched_ahead_give_the_tokens_of_steps_launched_after():
    """Greedy steps launched one ahead (the next step's tokens read where the last step left them, before the host
    reports it): the same tokens and finishes as without, through rows that end early at eos or their budget while
    others go on, a queue that refills a freed slot, and a sampled row beside (which turns it off for its steps)."""
    m = small()
    e = Engine(m)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (4, 9, 6, 3)]
    full = greedy_full_window(m, prompts[0], 12)
    eos = full[4]  # the first row stops at its fifth token
    greedy = Sampling(temperature=0)
    jobs = [(prompts[0], 12, greedy, eos), (prompts[1], 15, greedy, None), (prompts[2], 3, greedy, None),
            (prompts[3], 10, greedy, None), (prompts[1], 8, Sampling(temperature=0.8, seed=3), None)]  # fmt: skip
    want, steps, launched = _batch_run(e, jobs, False)
    got, steps_ahead, launched_ahead = _batch_run(e, jobs, True)
    assert got == want and steps_ahead == steps == launched
    assert launched_ahead > steps  # steps did run ahead: some for rows that had ended
    assert _batch_run(e, jobs[:4], True)[0] == want[:4]  # greedy to the end: the last step ahead is for no one
    assert want[0] == (full[: full.index(eos)], "stop") and want[1][0] == greedy_full_window(m, prompts[1], 15)
    assert [f for _, f in want] == ["stop", "length", "length", "length", "length"]
