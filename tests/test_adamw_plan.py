"""The one-launch AdamW's launch plan, as the captured training step needs it (interpreter, CPU).

The gradients are new tensors every step (and, under CUDA graph capture, come from the graph's own memory
pool), while params, moments and compute copies live across steps. The block table must therefore depend only on
the latter, be built once, and survive new gradients; the gradients enter through a per-tensor offset table. If
the table were keyed by the gradients' addresses (as it once was), every capture would rebuild it with a host to
device copy inside the captured step, which CUDA graph capture refuses: the trainer's graph never captured."""

import torch

from xtrain.kernels import adamw as A

SHAPES = [(70, 90), (5000,), (33,), (64, 64)]  # one tensor over a block of 4096, others under, odd sizes
WDS = [0.1, 0.0, 0.1, 0.0]


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    p = [torch.randn(s, generator=g) for s in SHAPES]
    m = [torch.randn(s, generator=g) * 0.1 for s in SHAPES]
    v = [torch.rand(s, generator=g) * 0.01 for s in SHAPES]
    return p, m, v


def _grads(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def test_plan_survives_new_gradients_and_the_step_reads_them():
    p, m, v = _state(0)
    pr, mr, vr = ([t.clone() for t in ts] for ts in (p, m, v))
    step_t, lr_t = torch.zeros((), dtype=torch.float64), torch.tensor(3e-3, dtype=torch.float64)
    kw = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decays=WDS)
    tables = []
    for step in (1, 2, 3):
        grads = _grads(step)  # fresh tensors each step, as the engine hands them over
        _ = [torch.empty(17) for _ in range(step)]  # and at other addresses than the previous step's
        A.adamw_step_triton_device(p, grads, m, v, step=step_t, lr=lr_t, ok=torch.tensor(True), **kw)
        tables.append(A._plan(p, grads, m, v, WDS, None)[0])
        A.adamw_step_ref(pr, [g.clone() for g in grads], mr, vr, step=step, lr=3e-3, **kw)
    assert tables[0] is tables[1] is tables[2]  # built once, never rebuilt for new gradients
    # each step read its own gradients. The interpreter rounds as CUDA does, the CPU reference otherwise (module
    # docstring of xtrain.kernels.adamw): a few ulp of the tensor's magnitude; a step that read another step's
    # gradients moves the weights by about lr = 3e-3, thousands of ulp
    ulp = torch.finfo(torch.float32).eps
    for a, b in zip(p + m + v, pr + mr + vr):
        assert float((a - b).abs().max()) <= 8 * ulp * float(b.abs().max())


def test_gradient_offsets_follow_the_gradients():
    grads = _grads(0)
    offs, _ = A._grad_offsets(grads)
    es = grads[0].element_size()
    assert offs.tolist() == [(g.data_ptr() - grads[0].data_ptr()) // es for g in grads]
