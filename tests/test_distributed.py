"""Data parallel training on CPU (gloo, launched by torchrun): N ranks with B/N sequences each take the same
steps as one process with B sequences, also when ranks count different numbers of targets; and the
`xtrain train` command runs under torchrun, with rank 0 writing the run directory."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

WORKER = textwrap.dedent("""
    import sys
    import torch
    from safetensors.torch import save_file
    from xtrain.config import ModelConfig, TrainConfig
    from xtrain.model import Model
    from xtrain.train import distributed as D
    from xtrain.train.trainer import Trainer

    device, dtype = (sys.argv[2], sys.argv[3]) if len(sys.argv) > 3 else ("cpu", "float64")
    dropout, accum = (float(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (0.0, 1)
    graph = sys.argv[6] if len(sys.argv) > 6 else "default"  # "replay": the CPU stand-in for a CUDA graph
    info = D.init(device)
    B, T, V = 6, 12, 61
    fused = "auto" if device == "cuda" else "composed"  # on CUDA: flash attention, Triton kernels
    cfg = ModelConfig(vocab_size=V, n_layer=2, n_embd=128, n_head=4, n_kv_head=2, head_dim=32, ffn_dim=64,
                      max_seq_len=16, compute_dtype=dtype, attention=fused, loss=fused, dropout=dropout)
    tc = TrainConfig(steps=4, batch_size=B // info.world_size, seq_len=T, lr=1e-2, min_lr=1e-3, warmup_steps=1,
                     grad_accum=accum)
    step = [0]

    def source():
        # global batch i is a pure function of i; rank r takes rows r, r + N, ...; ignored targets are
        # spread unevenly, so ranks count different numbers of tokens
        g = torch.Generator().manual_seed(step[0])
        step[0] += 1
        ids = torch.randint(0, V, (B, T + 1), generator=g)
        x, y = ids[:, :-1].clone(), ids[:, 1:].clone()
        y[0, :7] = -100
        y[3, 2:4] = -100
        return x[info.rank::info.world_size], y[info.rank::info.world_size]

    m = Model(cfg, device=info.device, seed=3)
    kw = {}
    if graph == "replay":
        from xtrain.testing import replay_capture
        kw = dict(cuda_graph=True, graph_capture=replay_capture)
    tr = Trainer(m, tc, source, all_reduce=D.all_reduce_sum if info.world_size > 1 else None,
                 rank=info.rank, world_size=info.world_size, **kw)
    if graph == "replay":
        tr.graphed.warmup = 1
        tr.graphed.say = lambda msg: sys.exit("graph message: " + msg)
    hist = tr.fit()
    if graph == "replay":
        assert tr.graphed.enabled and tr.graphed.captures == 1
    if info.rank == 0:
        save_file({k: p.data.contiguous().cpu() for k, p in m.params.items()}, sys.argv[1])
        print("losses", [round(h["loss"], 12) for h in hist if h["kind"] == "train"])
    D.shutdown()
""")


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return env


def _torchrun(n, *args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=cwd,
    )


def _worker(tmp_path, name, ranks, *args):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / f"{name}.safetensors"
    if ranks == 1:
        cmd = [sys.executable, str(script), str(out), *args]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    else:
        run = _torchrun(ranks, str(script), str(out), *args)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(v) for v in run.stdout.split("losses")[1].strip().strip("[]").split(",")]
    return load_file(str(out)), losses


def _assert_same_training(one, two):
    (a, la), (b, lb) = one, two
    assert a.keys() == b.keys()
    # fp64: the only difference is the order of the sums across ranks or micro-batches (a few ulps), which
    # four AdamW steps cannot amplify beyond ~1e-12 of a weight
    for k in a:
        assert float((a[k] - b[k]).abs().max()) <= 1e-10 * max(float(a[k].abs().max()), 1e-3), k
    assert [round(v, 9) for v in la] == [round(v, 9) for v in lb]


@pytest.mark.slow
def test_two_ranks_equal_one_process_fp64(tmp_path):
    _assert_same_training(_worker(tmp_path, "one", 1), _worker(tmp_path, "two", 2))


@pytest.mark.slow
def test_dropout_same_masks_for_one_process_accumulation_and_ranks_fp64(tmp_path):
    # A dropout mask is keyed by the token's row in the global batch, so the split does not change training:
    # one process with B = 6, two micro-batches of 3 and two ranks of 3 take the same steps.
    one = _worker(tmp_path, "one", 1, "cpu", "float64", "0.3", "1")
    _assert_same_training(one, _worker(tmp_path, "accum", 1, "cpu", "float64", "0.3", "2"))
    _assert_same_training(one, _worker(tmp_path, "ranks", 2, "cpu", "float64", "0.3", "1"))
    # and dropout is live under torchrun: p > 0 trains differently from p = 0
    plain = _worker(tmp_path, "plain", 2, "cpu", "float64", "0.0", "1")
    assert plain[1][0] != one[1][0]
    assert any(float((plain[0][k] - one[0][k]).abs().max()) > 1e-6 for k in plain[0])


@pytest.mark.slow
def test_data_parallel_step_replayed_as_a_graph_fp64(tmp_path):
    # The all-reduce is part of the captured step: two gloo ranks whose step is replayed by the CPU stand-in for
    # a CUDA graph (one eager warm-up step, then replays of the recorded aten calls, collectives included) train
    # bit for bit as the same step run eagerly, with dropout.
    args = ("cpu", "float64", "0.3", "1")
    eager = _worker(tmp_path, "eager", 2, *args)
    replayed = _worker(tmp_path, "replayed", 2, *args, "replay")
    assert eager[1] == replayed[1]
    assert all(torch.equal(eager[0][k], replayed[0][k]) for k in eager[0])
    # and as one process
    _assert_same_training(_worker(tmp_path, "one", 1, *args), replayed)


@pytest.mark.slow
def test_train_command_under_torchrun(tmp_path, corpus):
    env_cache = tmp_path / "cache"
    os.environ["XTRAIN_CACHE"] = str(env_cache)
    try:
        out = _torchrun(
            2,
            "-m",
            "xtrain.cli",
            "train",
            "--data",
            str(corpus),
            "--vocab-size",
            "300",
            "--steps",
            "3",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--eval-every",
            "3",
            "--eval-batches",
            "1",
            "--no-progress",
            "--sample-tokens",
            "0",
            "--out",
            str(tmp_path / "run"),
        )
    finally:
        del os.environ["XTRAIN_CACHE"]
    assert out.returncode == 0, out.stderr[-3000:]
    assert "data parallel over 2 ranks" in out.stdout
    # the eval line and the summary are printed once, by rank 0 only
    assert out.stdout.count("step 3: val loss") == 1 and out.stdout.count("vs  unigram baseline") == 1
    for name in ("config.json", "model.safetensors", "trainer_state.json", "metrics.jsonl"):
        assert (tmp_path / "run" / name).is_file()
    assert torch.isfinite(load_file(str(tmp_path / "run" / "model.safetensors"))["model.norm.weight"]).all()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_nccl_equal_one_gpu_fp32(tmp_path):
    """The same data-parallel check over NCCL on two GPUs (flash attention and the Triton kernels on), in
    fp32: the ranks' gradient sum differs from one process's only in summation order (~1e-7 relative), and
    four AdamW steps keep the weights within 1e-4 relative of each other."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    one = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "one.safetensors"), "cuda", "float32"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = _torchrun(2, str(script), str(tmp_path / "two.safetensors"), "cuda", "float32")
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = load_file(str(tmp_path / "one.safetensors")), load_file(str(tmp_path / "two.safetensors"))
    worst = max(float((a[k] - b[k]).norm() / a[k].norm()) for k in a)
    print(f"\nNCCL vs one GPU: worst relative weight difference {worst:.2e}")
    assert worst < 1e-4
