"""``xtrain bench finetune`` runs on the CPU at its tiny shape (a smoke test: the GPU measurement is the point of
it): both sides build from one config, start from the same loss level and print the table and the goal lines."""

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
        finetune.main(["--device", "cpu", "--steps", "1", "--warmup", "0", "--max-batch", "--max-batch-limit", "4"])
        == 0
    )
    out = capsys.readouterr().out
    rows = {
        ln.split()[0] + " " + ln.split()[1]: ln.split()
        for ln in out.splitlines()
        if ln.startswith(("xtrain t", "transformers e"))
    }
    assert set(rows) == {"xtrain trainer", "transformers eager"}
    ours, theirs = float(rows["xtrain trainer"][-1]), float(rows["transformers eager"][-1])
    assert abs(ours - theirs) < 0.5 and rows["xtrain trainer"][-2] == "4"  # same init scale; CPU: the limit fits
    assert "tokens/s, xtrain / transformers' fastest mode" in out
