"""One client cannot hurt another: degenerate but finite sampling settings are safe per request, and a
failure that belongs to one sequence of a batch (its prefill, its decode row, its logits) ends that sequence
alone while the others get exactly the tokens they get alone."""

import math
import threading

import pytest
import torch

from tests.test_serve import small
from xtrain.sampling import GREEDY_BELOW, filter_logits, next_token
from xtrain.serve.engine import Batcher, Engine, EngineConfig, Sampling, sample_rows


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


DEGENERATE = [
    Sampling(temperature=1e-40, seed=1),
    Sampling(temperature=1.0, top_p=1e-300, seed=2),
    Sampling(temperature=5e-324, top_p=1e-45, top_k=1, seed=3),
    Sampling(temperature=1e300, top_k=10**9, seed=4),
    Sampling(temperature=GREEDY_BELOW / 2, seed=5),
]


def test_degenerate_settings_sample_sensibly():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(DEGENERATE), 50, generator=g) * 30  # large logits: / 1e-40 overflows fp32
    gens = [torch.Generator().manual_seed(i) for i in range(len(DEGENERATE))]
    toks = sample_rows(logits, DEGENERATE, gens)
    greedy = logits.argmax(-1)
    assert toks[[0, 1, 2, 4]].tolist() == greedy[[0, 1, 2, 4]].tolist()  # tiny temperature / top_p: the argmax
    assert 0 <= int(toks[3]) < 50
    for s in DEGENERATE:  # the sampler of `xtrain sample` agrees
        t = next_token(logits[:1], s.temperature, s.top_k, s.top_p, torch.Generator().manual_seed(0))
        assert 0 <= int(t) < 50
        if s.temperature < GREEDY_BELOW or (s.top_p or 1) < 1e-30:
            assert int(t) == int(greedy[0])
    kept = filter_logits(logits[:1], None, 1e-300)
    assert torch.isfinite(kept).sum() == 1 and torch.isfinite(kept[0, greedy[0]])


@pytest.mark.parametrize(
    "bad",
    [
        Sampling(temperature=float("nan")),
        Sampling(temperature=-1.0),
        Sampling(temperature=float("inf")),
        Sampling(top_p=0.0),
        Sampling(top_p=float("nan")),
        Sampling(top_k=-2),
    ],
)
def test_invalid_settings_are_refused_at_submit(bad):
    b = Batcher(Engine(small()), EngineConfig(slots=1))  # not started: nothing would run
    with pytest.raises(ValueError, match="Sampling: need"):
        b.submit([([1, 2], 3, bad, None, lambda *a: None)])
    assert b.load()["waiting"] == 0
    with pytest.raises(ValueError, match="temperature"):
        next_token(torch.zeros(1, 5), float("nan"), None, None, torch.Generator())


POISON = 200  # a prompt starting with this id is the faulty sequence


class FaultyEngine(Engine):
    """An engine whose failures belong to one sequence: the one whose prompt starts with POISON. ``mode``
    picks the failure: "prefill" raises in its prefill, "raise" raises in any decode batch holding its slot
    (and when decoded alone), "nan" puts nan into its row of the decode logits."""

    def __init__(self, model, mode):
        super().__init__(model)
        self.mode, self.poisoned, self.raised = mode, set(), 0

    def prefill(self, cache, slot, ids):
        if int(ids[0]) == POISON:
            self.poisoned.add(slot)
            if self.mode == "prefill":
                raise RuntimeError("planted prefill failure")
        else:
            self.poisoned.discard(slot)
        return super().prefill(cache, slot, ids)

    def decode(self, cache, slots, tokens):
        hit = [b for b, s in enumerate(slots.tolist()) if s in self.poisoned]
        if hit and self.mode == "raise":
            self.raised += 1
            raise RuntimeError("planted decode failure")
        logits = super().decode(cache, slots, tokens)
        if hit and self.mode == "nan":
            logits[hit] = float("nan")
        return logits


def _together(b: Batcher, jobs):
    """Submit every (ids, n, sampling) at once, in one call, so they share decode steps -> [(tokens, finish)]."""
    out = [([], None) for _ in jobs]
    done = threading.Semaphore(0)

    def cb(i):
        def on_event(tok, lp, fin):
            if tok is not None:
                out[i][0].append(tok)
            if fin is not None:
                out[i] = (out[i][0], fin)
                done.release()

        return on_event

    b.submit([(ids, n, smp, None, cb(i)) for i, (ids, n, smp) in enumerate(jobs)])
    for _ in jobs:
        assert done.acquire(timeout=60)
    return out


@pytest.mark.parametrize("mode", ["prefill", "raise", "nan"])
def test_a_failing_sequence_fails_alone_and_the_others_are_unchanged(mode):
    m = small()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 150, (n,), generator=g).tolist() for n in (4, 9, 6)]
    settings = [Sampling(temperature=0), Sampling(temperature=0.9, top_k=30, top_p=0.9, seed=11), DEGENERATE[0]]
    alone = Batcher(Engine(m), EngineConfig(slots=4)).start()
    try:
        want = [alone.generate(p, 12, s) for p, s in zip(prompts, settings)]
    finally:
        alone.close()
    eng = FaultyEngine(m, mode)
    b = Batcher(eng, EngineConfig(slots=4)).start()
    try:
        jobs = [(prompts[0], 12, settings[0]), ([POISON, 5, 6], 12, settings[1])]
        jobs += [(prompts[1], 12, settings[1]), (prompts[2], 12, settings[2])]
        got = _together(b, jobs)
        assert got[1][1].startswith("error:"), got[1]
        assert [got[0], got[2], got[3]] == want  # bit-identical tokens, every one to its budget
        assert b.max_batch >= 3  # the healthy ones did share decode steps
        if mode == "raise":
            assert eng.raised >= 2  # the batch failed, then the faulty row alone
        assert b.generate(prompts[0], 12, settings[0]) == want[0]  # and the batcher keeps serving
        assert b.load()["running"] == 0
    finally:
        b.close()


def test_degenerate_request_beside_others_in_the_batcher():
    m = small()
    b = Batcher(Engine(m), EngineConfig(slots=6)).start()
    try:
        p = [1, 2, 3, 4]
        solo = b.generate(p, 10, Sampling(temperature=0.8, seed=9))
        jobs = [(p, 10, Sampling(temperature=0.8, seed=9))] + [(p, 10, s) for s in DEGENERATE]
        got = _together(b, jobs)
        assert got[0] == solo
        assert all(fin == "length" and len(t) == 10 for t, fin in got)
        greedy = b.generate(p, 10, Sampling(temperature=0))
        assert got[1] == greedy and got[2] == greedy  # temperature 1e-40, top_p 1e-300
        assert math.isfinite(sum(got[4][0]))
    finally:
        b.close()
