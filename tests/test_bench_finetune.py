"""``xtrain bench finetune`` runs on the CPU at its tiny shape (a smoke test: the GPU measurement is the point of
it): both sides build from one config, start from the same weights (the same first loss) and print the table and
the goal lines."""

import re

import pytest

from xtrain.bench.cli import BENCH_DIR

pytestmark = pytest.mark.skipif(not (BENCH_DIR / "finetune.py").is_file(), reason="bench/ is not part of this checkout")


@pytest.mark.slow
def test_bench_finetune_cpu_smoke(capsys):
    pytest.importorskip("transformers")
    from bench import finetune

    c = finetune.model_config("qwen3-0.6b", 2048, "bfloat16")
    assert c.num_params() == pytest.approx(596e6, rel=0.01)  # Qwen3-0.6B's size (tied)
    h = finetune.hf_config(c)
    assert (h.head_dim, h.num_key_value_heads, h.vocab_size, h.tie_word_embeddings) == (128, 8, 151936, True)
    assert (
        finetune.main(
            [
                "--device",
                "cpu",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--max-batch",
                "--max-batch-limit",
                "4",
                "--compile-modes",
                "eager",
                "eager/layers",
            ]
        )  # fmt: skip
        == 0
    )
    out = capsys.readouterr().out
    rows = {  # label -> [step ms, tokens/s, peak, held, first loss]
        r[0]: r[1:] for r in (ln.rsplit(maxsplit=5) for ln in out.splitlines()) if len(r) == 6 and r[-1][-1].isdigit()
    }
    fits = dict(re.findall(r"^  (.+): largest batch that fits (\d+)", out, re.M))
    sides = {"xtrain trainer", "xtrain trainer, recompute", "transformers eager", "transformers eager/layers"}
    assert set(rows) == set(fits) == sides  # eager/layers: each decoder layer and the head through torch.compile
    # both sides start from xtrain's initial weights: the same first loss (fp32 on the CPU)
    losses = [float(r[-1]) for r in rows.values()]
    assert max(losses) - min(losses) < 1e-3 and fits["xtrain trainer"] == "4"  # CPU: the limit fits
    assert "xtrain trainer / transformers' fastest mode: tokens/s" in out


def test_largest_batch_is_found_by_doubling_then_bisection():
    """``--max-batch``'s search: the largest batch that fits (to within 1/16, or exactly), for every place the limit
    can fall (none, at the start, between doublings, past the search's limit), in a handful of tries."""
    from bench.finetune import largest

    for cap in (0, 3, 4, 5, 7, 8, 9, 37, 100, 256, 1000):
        tried = []
        got = largest(lambda b, cap=cap, tried=tried: tried.append(b) or b <= cap, 4, 256)
        want = 0 if cap < 4 else min(cap, 256)
        assert want - want // 16 <= got <= want, (cap, got, tried)  # fits, within 1/16 of the largest
        assert len(tried) <= 12
        assert largest(lambda b, cap=cap: b <= cap, 4, 256, within=10**9) == want  # to the batch
