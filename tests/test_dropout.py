"""Dropout masks keyed by the token's place in the global batch (``xtrain.kernels.dropout``).

A mask is a pure function of (seed, global element index), where row b of the tensor is global row
``row_start + b * row_stride``: the same token draws the same mask in one process, in a micro-batch and on a
data-parallel rank, two different tokens never share a hash input, and the statistics stay those of
independent draws. The trainer-level equivalences (one process == accumulation == ranks) are in
``tests/test_distributed.py``."""

import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from xtrain import ops
from xtrain.autograd import Var
from xtrain.kernels import dropout as K
from xtrain.kernels._dispatch import HAVE_TRITON

needs_cpu_interp = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") != "1" or not HAVE_TRITON,
    reason="CPU tests run Triton through the interpreter",
)
B, T, C = 8, 5, 12  # global batch rows, positions, features


def _mask(shape, p, seed, start=0, stride=1):
    return K.dropout_mask_ref(shape, p, seed, "cpu", start, stride)


def test_flat_default_is_the_global_index():
    # rows (0, 1): the global index is the flat index, whatever the shape
    full = _mask((B * T * C,), 0.3, 77)
    assert torch.equal(_mask((B, T, C), 0.3, 77).reshape(-1), full)
    assert torch.equal(_mask((B, T * C), 0.3, 77).reshape(-1), full)


@pytest.mark.parametrize("ranks,micro", [(1, 2), (2, 1), (2, 2), (4, 1)])
def test_a_rank_micro_batch_draws_its_rows_of_the_global_mask(ranks, micro):
    # rank r holds global rows r, r + R, ... (TokenLoader's layout); micro-batch j the rank's rows j*mb ...
    full = _mask((B, T, C), 0.25, 2**63 + 11)
    mb = B // ranks // micro
    for r in range(ranks):
        mine = full[r::ranks]
        for j in range(micro):
            got = _mask((mb, T, C), 0.25, 2**63 + 11, j * mb * ranks + r, ranks)
            assert torch.equal(got, mine[j * mb : (j + 1) * mb])


def test_two_ranks_never_share_a_mask():
    # the flaw this keying removes: without the row offset every rank drew rank 0's mask for its own rows
    r0 = _mask((4, T, C), 0.5, 5, 0, 2)
    r1 = _mask((4, T, C), 0.5, 5, 1, 2)
    assert not torch.equal(r0, r1)
    assert (r0 != r1).float().mean() > 0.4  # independent draws at p = 0.5 differ at about half the elements


def test_mask_statistics():
    # keep rate within 5 sigma of 1 - p; neighbouring rows and two ranks' rows uncorrelated (|r| < 5/sqrt(n))
    p, rows, n = 0.1, 64, 4096
    m = _mask((rows, n), p, 1234, 3, 2).double()
    keep = 1 - K.keep_threshold(p) / 2**16
    total = rows * n
    assert abs(float(m.mean()) - keep) < 5 * math.sqrt(keep * (1 - keep) / total)

    def corr(a, b):
        a, b = a - a.mean(), b - b.mean()
        return float((a * b).sum() / (a.norm() * b.norm()))

    bound = 5 / math.sqrt((rows - 1) * n)
    assert abs(corr(m[1:].reshape(-1), m[:-1].reshape(-1))) < bound  # row b vs row b + 1
    assert abs(corr(m[:, 1:].reshape(-1), m[:, :-1].reshape(-1))) < 5 / math.sqrt(rows * (n - 1))  # neighbours
    other = _mask((rows, n), p, 1234, 4, 2).double()  # the other rank's rows of the same step
    assert abs(corr(m.reshape(-1), other.reshape(-1))) < 5 / math.sqrt(total)


def test_far_rows_hash_the_high_bits():
    # global indices past 2^33 (pair index past 2^32) still give fresh draws, not the low rows' again
    n = 64
    low = _mask((1, n), 0.5, 9, 0, 1)
    high = _mask((1, n), 0.5, 9, (1 << 33) // n, 1)  # the pair index of its first element is 2^32
    assert not torch.equal(low, high)


def test_op_backward_uses_the_forward_rows():
    x = Var(torch.randn(4, 6, 10, dtype=torch.float64), requires_grad=True)
    y = ops.dropout(x, 0.4, seed=5, row_start=3, row_stride=2)
    y.backward(torch.ones_like(y.data))
    keep = _mask((4, 6, 10), 0.4, 5, 3, 2)
    assert torch.equal(y.data != 0, keep)
    torch.testing.assert_close(x.grad, keep.double() / 0.6)


def test_op_rejects_bad_rows():
    x = Var(torch.randn(2, 3))
    with pytest.raises(ValueError, match="dropout"):
        ops.dropout(x, 0.1, 0, row_start=-1)
    with pytest.raises(ValueError, match="dropout"):
        ops.dropout(x, 0.1, 0, row_stride=0)


@needs_cpu_interp
@pytest.mark.parametrize("shape", [(3, 7, 64), (5, 123), (4, 3, 5), (1,)])  # odd rows: the per-element path
@pytest.mark.parametrize("start,stride", [(0, 1), (5, 3), ((1 << 33) // 21, 1)])
def test_triton_matches_reference_with_rows(shape, start, stride):
    x = torch.randn(shape)
    for p, seed in ((0.1, 0), (0.5, 2**64 - 1)):
        want = K.dropout_fwd_ref(x, p, seed, start, stride)
        assert torch.equal(K.dropout_fwd_triton(x, p, seed, start, stride), want)
        assert torch.equal(K.dropout_bwd_triton(x, p, seed, start, stride), want)


def _doc_mask(shape, p, seed, start=0, stride=1):
    """The keep mask recomputed element by element in plain Python integers from the hash as the module docstring
    of ``xtrain.kernels.dropout`` states it (independent of the kernel file's helpers): element (b, rest) has
    global index g = (start + b * stride) * N + rest; k = g // 2; h = mix(mix(k_lo ^ seed_lo) ^ seed_hi ^ k_hi);
    u = the low 16 bits of h for even g, the high 16 for odd g; kept when u >= round(p * 2^16)."""
    M = 0xFFFFFFFF

    def mix(h):
        h ^= h >> 16
        h = (h * 0x7FEB352D) & M
        h ^= h >> 15
        h = (h * 0x2C1B3C6D) & M
        return h ^ (h >> 16)

    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    s_lo, s_hi = seed & M, seed >> 32
    rows, n = shape[0], math.prod(shape[1:])
    threshold = round(p * 65536)
    keep = []
    for b in range(rows):
        for rest in range(n):
            g = (start + b * stride) * n + rest
            k = g >> 1
            h = mix(mix((k & M) ^ s_lo) ^ s_hi ^ (k >> 32))
            u = h & 0xFFFF if g % 2 == 0 else h >> 16
            keep.append(u >= threshold)
    return torch.tensor(keep).reshape(shape)


def test_masks_are_the_documented_hash():
    # the reference against the plain-Python recomputation, over seeds whose halves matter and far rows
    for seed, start, stride, p in ((0, 0, 1, 0.3), (2**63 + 11, 5, 3, 0.1), (2**64 - 1, (1 << 33) // 60, 1, 0.5)):
        assert torch.equal(_mask((B, T, C), p, seed, start, stride), _doc_mask((B, T, C), p, seed, start, stride))


SEEDS = [0, 1, 12345, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**63 + 11, 2**64 - 1, -1]


@pytest.mark.parametrize("seed", SEEDS)
def test_device_seed_masks_are_the_host_int_masks(seed):
    # the seed as a one-element int64 tensor (two's complement; a view into a buffer, as the model passes it)
    buf = torch.zeros(3, dtype=torch.int64)
    buf[1:2].copy_(K.seed_tensor(seed, "cpu").reshape(1))
    want = _doc_mask((B, T, C), 0.3, seed, 5, 3)
    assert torch.equal(_mask((B, T, C), 0.3, seed, 5, 3), want)  # an int seed goes through the same tensor path
    assert torch.equal(_mask((B, T, C), 0.3, buf[1], 5, 3), want)
    assert int(K.seed_tensor(seed, "cpu")) & (2**64 - 1) == seed & (2**64 - 1)


def test_op_takes_a_device_seed_and_checks_it():
    x = Var(torch.randn(4, 6, 10, dtype=torch.float64), requires_grad=True)
    seeds = torch.tensor([7, 2**40 + 3], dtype=torch.int64)
    y = ops.dropout(x, 0.4, seeds[1], row_start=3, row_stride=2)
    assert torch.equal(y.data, ops.dropout(Var(x.data), 0.4, 2**40 + 3, True, 3, 2).data)
    y.backward(torch.ones_like(y.data))
    torch.testing.assert_close(x.grad, (y.data != 0).double() / 0.6)
    for bad in (seeds.int()[1], seeds, seeds[1].double(), torch.zeros(1, 1, dtype=torch.int64, device="meta")):
        with pytest.raises(ValueError, match="dropout"):
            ops.dropout(x, 0.4, bad)


def test_op_backward_refuses_a_seed_written_after_the_forward():
    # the backward regenerates the mask from the seed tensor: a rewrite in between would give another mask
    seeds = torch.tensor([7, 8], dtype=torch.int64)
    x = Var(torch.randn(3, 8), requires_grad=True)
    y = ops.dropout(x, 0.5, seeds[0])
    seeds.copy_(torch.tensor([9, 10]))
    with pytest.raises(RuntimeError, match="dropout"):
        y.backward(torch.ones_like(y.data))


def test_graph_stand_in_freezes_host_seeds_and_reads_device_seeds():
    """The CUDA-graph stand-in (``xtrain.testing.replay_capture``) re-runs the recorded tensor work, not Python:
    an int seed is frozen at its capture-time value (what a CUDA graph of the old host-int seeding did), a
    seed in a device buffer is read afresh by every replay."""
    from xtrain.testing import replay_capture

    x = Var(torch.randn(4, 64))
    host = {"seed": 1}
    replay, out = replay_capture(lambda: [ops.dropout(x, 0.5, host["seed"]).data])
    host["seed"] = 2
    replay()
    assert torch.equal(out[0], K.dropout_fwd_ref(x.data, 0.5, 1))  # still seed 1's mask: frozen

    buf = torch.tensor([1, 0], dtype=torch.int64)
    replay, out = replay_capture(lambda: [ops.dropout(x, 0.5, buf[0]).data])
    for seed in (2, 3, 2**63 + 5):
        buf[0:1].copy_(K.seed_tensor(seed, "cpu").reshape(1))
        replay()
        assert torch.equal(out[0], K.dropout_fwd_ref(x.data, 0.5, seed))
    assert not torch.equal(K.dropout_fwd_ref(x.data, 0.5, 2), K.dropout_fwd_ref(x.data, 0.5, 3))


@needs_cpu_interp
@pytest.mark.parametrize("seed", [0, 2**63 + 11, 2**64 - 1])
def test_triton_reads_the_device_seed(seed):
    # an entry at an 8-byte (not 16-byte) aligned address, as the model's buffer hands out
    buf = torch.zeros(4, dtype=torch.int64)
    buf[3:4].copy_(K.seed_tensor(seed, "cpu").reshape(1))
    x = torch.randn(3, 5, 64)
    want = K.dropout_fwd_ref(x, 0.1, seed, 2, 3)
    assert torch.equal(want != 0, _doc_mask(x.shape, 0.1, seed, 2, 3))
    assert torch.equal(K.dropout_fwd_triton(x, 0.1, buf[3], 2, 3), want)
    assert torch.equal(K.dropout_bwd_triton(x, 0.1, buf[3], 2, 3), want)


def test_model_loss_takes_the_rows_place_in_the_batch():
    """``model.loss(..., dropout_rows=(start, stride))`` draws the masks of those rows of the global batch: the
    summed loss of the whole batch equals the sum over two halves passed with their rows (fp64: up to the order
    of the sums), and a half passed with the wrong rows draws other masks (a different loss)."""
    from xtrain.config import ModelConfig
    from xtrain.model import Model

    cfg = ModelConfig(vocab_size=50, n_layer=2, n_embd=16, n_head=4, n_kv_head=2, head_dim=4, ffn_dim=32,
                      max_seq_len=8, dropout=0.3, compute_dtype="float64")  # fmt: skip
    m = Model(cfg, seed=1)
    m.set_dropout_step(12345)
    ids = torch.randint(0, 50, (4, 9), generator=torch.Generator().manual_seed(2))
    x, y = ids[:, :-1], ids[:, 1:]
    whole = float(m.loss(x, y, reduction="sum").data)
    even = [float(m.loss(x[i::2], y[i::2], reduction="sum", dropout_rows=(i, 2)).data) for i in (0, 1)]
    assert abs(sum(even) - whole) <= 1e-12 * abs(whole)
    wrong = float(m.loss(x[1::2], y[1::2], reduction="sum").data)  # the odd rows keyed as rows 0, 1
    assert abs(wrong - even[1]) > 1e-6 * abs(whole)


@pytest.mark.slow
def test_cli_one_process_accumulation_and_ranks_agree_fp32(tmp_path, corpus):
    """The real command with dropout 0.1 in fp32: one process with B = 8, --grad-accum 2, and two gloo ranks
    of B = 4 end at the same weights up to fp32 summation order (they drew different masks before)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", XTRAIN_CACHE=str(tmp_path / "cache"))
    env.pop("WORLD_SIZE", None)
    common = ["train", "--data", str(corpus), "--vocab-size", "300", "--steps", "4", "--seq-len", "16"]
    common += ["--dropout", "0.1", "--dtype", "float32", "--seed", "5", "--eval-every", "0", "--no-progress"]
    common += ["--sample-tokens", "0"]

    def run(name, *extra, ranks=1):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
        cmd = (launcher if ranks > 1 else [sys.executable]) + ["-m", "xtrain.cli", *common, *extra]
        out = subprocess.run(cmd + ["--out", str(tmp_path / name)], capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        return load_file(str(tmp_path / name / "model.safetensors"))

    one = run("one", "--batch-size", "8")
    for other in (run("accum", "--batch-size", "8", "--grad-accum", "2"), run("ranks", "--batch-size", "4", ranks=2)):
        worst = max(float((one[k] - other[k]).norm() / one[k].norm()) for k in one)
        assert worst < 1e-5, worst


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,start,stride", [((4, 256, 768), 6, 2), ((3, 5, 7), 0, 1), ((2, 64), 1 << 28, 3)])
def test_gpu_kernel_matches_reference_with_rows(dtype, shape, start, stride):
    x = torch.randn(shape, device="cuda").to(dtype)
    want = K.dropout_fwd_ref(x, 0.1, 2**64 - 3, start, stride)
    assert torch.equal(K.dropout_fwd_triton(x, 0.1, 2**64 - 3, start, stride), want)
    assert torch.equal(K.dropout_bwd_triton(x, 0.1, 2**64 - 3, start, stride), want)
    buf = torch.zeros(2, dtype=torch.int64, device="cuda")  # the seed read on the device, at an 8-byte offset
    buf[1:2].copy_(K.seed_tensor(2**64 - 3, "cuda").reshape(1))
    assert torch.equal(K.dropout_fwd_triton(x, 0.1, buf[1], start, stride), want)
    assert torch.equal(K.dropout_fwd_ref(x, 0.1, buf[1], start, stride), want)


def test_trainer_gives_a_rank_its_global_rows():
    """Fast in-process form of the torchrun equivalence: rank 1 of 2 with two micro-batches holds global rows
    1, 3 (micro-batch 0) and 5, 7 (micro-batch 1) of an 8-row batch, so its loss sum and gradient are those of
    the whole batch with the other rank's rows' targets ignored (same masks for the same tokens). A trainer that
    drops the rank (or the micro-batch offset) from ``dropout_rows`` draws rank 0's masks and differs."""
    from xtrain.config import ModelConfig, TrainConfig
    from xtrain.model import Model, mix_seed
    from xtrain.train.trainer import Trainer

    cfg = ModelConfig(vocab_size=41, n_layer=1, n_embd=16, n_head=2, n_kv_head=1, head_dim=8, ffn_dim=24,
                      max_seq_len=8, dropout=0.3, compute_dtype="float64")  # fmt: skip
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(0, cfg.vocab_size, (8, 7), generator=g)  # the step's global batch [8, T + 1]
    x, y = ids[:, :-1], ids[:, 1:]
    tc = TrainConfig(steps=1, batch_size=4, seq_len=6, grad_accum=2, lr=1e-2, warmup_steps=0, seed=4)
    tr = Trainer(Model(cfg, seed=2), tc, lambda: ids[1::2], rank=1, world_size=2)
    whole = Model(cfg, seed=2).train()
    whole.set_dropout_step(mix_seed(tc.seed, 0))
    y_other_ignored = y.clone()
    y_other_ignored[0::2] = -100
    want = whole.loss(x, y_other_ignored, reduction="sum")
    n = int((y_other_ignored != -100).sum())
    ops.scale(want, 1.0 / n).backward()
    m = tr.train_step()  # the step path's gradient is gone after its update: its norm and loss are kept
    want_norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in whole.params.values()))
    assert m["tokens"] == n and not m["skipped"]
    assert math.isclose(m["loss"], float(want.data) / n, rel_tol=1e-12)
    # the step seeds its backward with 1/N rounded to fp32: a relative 3e-8 in fp64; a wrong mask changes the
    # norm by percents
    assert math.isclose(m["grad_norm"], want_norm, rel_tol=1e-6)
    # dropout is live here: rank 0's rows for the same tokens would give another loss
    other = Model(cfg, seed=2).train()
    other.set_dropout_step(mix_seed(tc.seed, 0))
    assert not math.isclose(float(other.loss(x[1::2], y[1::2], reduction="sum").data), float(want.data), rel_tol=1e-6)
