"""Triton kernels vs their plain-torch references (the house rule: same file, same contract).

CPU: every kernel through the Triton interpreter (TRITON_INTERPRET=1, set by conftest.py) in fp32 at
small and odd shapes. Tolerance: max abs error <= 1e-5 on O(1) data (fp32: the same maths, reduction
orders differ by a few ulp); dropout masks and embedding sums bit for bit.

GPU (@pytest.mark.gpu): realistic shapes in fp32 and bf16 against a float64 oracle (the reference run on
upcast inputs), by relative norm error ||out - oracle|| / ||oracle||, after poisoning every output
allocation with NaN (a missed write then fails). Tolerances: fp32 outputs 1e-5 (fp32 rounding of
O(C)-term reductions, approximate exp/rsqrt of a few ulp); bf16 outputs 1e-2 (rounding the output
to bf16 alone gives ~3e-3 relative RMS; 1e-2 is the usual bf16 ceiling). The dropout mask and AdamW
in fp32 are compared bit for bit.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():  # conftest.py does this too; Triton must not be imported before it
    os.environ.setdefault("TRITON_INTERPRET", "1")

from xtrain.kernels._dispatch import HAVE_TRITON  # noqa: E402
from xtrain.testing import poisoned  # noqa: E402

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")

if HAVE_TRITON:
    from xtrain.kernels import adamw as K_adam
    from xtrain.kernels import cross_entropy as K_ce
    from xtrain.kernels import dropout as K_drop
    from xtrain.kernels import embedding as K_emb
    from xtrain.kernels import linear_cross_entropy as K_lce
    from xtrain.kernels import qk_norm_rope as K_qk
    from xtrain.kernels import rms_norm as K_rms
    from xtrain.kernels import rope as K_rope
    from xtrain.kernels import rows_linear as K_rows
    from xtrain.kernels import swiglu as K_sw
    from xtrain.kernels.attention import decode as K_dec

    # the embedding backward's shipped forms, and two small configs that reach their rarer paths in a few hundred
    # tokens: tiers with K2 = 8 and tier B segments of 8 tokens; the chain with chunks of 1 token (long merges)
    _EMB_SMALL_TIERS = K_emb.EmbeddingBwdConfig(
        "tiers", k2=8, mt=4, a_block_c=16, ht=4, b_block_c=16, b_warps=4, b_per_sm=2, scan=64, seg=8
    )
    # small-tiers in the slow tier: its tier B segments are checked quick by test_embedding_bwd_tier_b_segments_cpu,
    # its multi-tile tier A by the tiers form at C = 21
    _EMB_CONFIGS = [
        *K_emb.SHIPPED,
        pytest.param(_EMB_SMALL_TIERS, marks=pytest.mark.slow),
        pytest.param(dataclasses.replace(K_emb.SIDE, chunk=1, chain_block_c=16), marks=pytest.mark.slow),
    ]
else:
    _EMB_SMALL_TIERS, _EMB_CONFIGS = None, []

CPU_TOL = 1e-5


gpu = pytest.mark.gpu
needs_cpu_interp = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") != "1", reason="CPU tests run Triton through the interpreter"
)


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _scaled_err(a, b):
    """The largest error relative to the reference's largest magnitude (tolerances scale with the values)."""
    return _max_err(a, b) / max(b.double().abs().max().item(), 1e-30)


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ============================================================================ CPU, through the interpreter


@needs_cpu_interp
@pytest.mark.parametrize("shape", [(5, 123), (3, 7, 64), (1, 1)])
def test_rms_norm_cpu(shape):
    x, dy = torch.randn(shape), torch.randn(shape)
    w = torch.randn(shape[-1])
    y, r = K_rms.rms_norm_fwd_triton(x, w, 1e-6)
    y0, r0 = K_rms.rms_norm_fwd_ref(x, w, 1e-6)
    assert _max_err(y, y0) <= CPU_TOL and _max_err(r, r0) <= CPU_TOL
    dx, dw = K_rms.rms_norm_bwd_triton(dy, x, w, r0)
    dx0, dw0 = K_rms.rms_norm_bwd_ref(dy, x, w, r0)
    assert _max_err(dx, dx0) <= CPU_TOL and _max_err(dw, dw0) <= CPU_TOL * 10  # dw sums up to 21 rows
    # the output in another dtype (fp16: the interpreter's bf16 is wrong), and a gradient arriving in it
    y16, _ = K_rms.rms_norm_fwd_triton(x, w, 1e-6, torch.float16)
    assert y16.dtype == torch.float16 and _max_err(y16, y0.half()) <= 1e-3 * y0.abs().max().item()
    dx16, _ = K_rms.rms_norm_bwd_triton(dy.half(), x, w, r0)
    assert dx16.dtype == torch.float32
    assert _max_err(dx16, K_rms.rms_norm_bwd_ref(dy.half(), x, w, r0)[0]) <= CPU_TOL
    # a gradient x already holds (the residual's) added in the kernel: the reference adds it in fp32
    dres = torch.randn(shape) * 3
    dxr, dwr = K_rms.rms_norm_bwd_triton(dy, x, w, r0, dres)
    assert _max_err(dxr, K_rms.rms_norm_bwd_ref(dy, x, w, r0, dres)[0]) <= CPU_TOL
    assert _max_err(dxr, dx0 + dres) <= CPU_TOL and torch.equal(dwr, dw)
    # the residual add fused before the norm (add_rms_norm): the sum exactly torch.add's (one fp32 rounding of an
    # fp32 + fp16 pair), the norm of that sum; and dx written also in a low dtype, exactly dx.to(low)
    res = torch.randn(shape).half()
    s, ys, rs = K_rms.rms_norm_fwd_triton(x, w, 1e-6, torch.float16, res=res)
    s0, ys0, rs0 = K_rms.add_rms_norm_fwd_ref(x, res, w, 1e-6, torch.float16)
    assert torch.equal(s, s0) and s.dtype == torch.float32 and _max_err(rs, rs0) <= CPU_TOL
    assert ys.dtype == torch.float16 and _max_err(ys, ys0) <= 1e-3 * ys0.float().abs().max().item()
    dxl, dwl, lo = K_rms.rms_norm_bwd_triton(dy, x, w, r0, dres, low=torch.float16)
    assert torch.equal(dxl, dxr) and torch.equal(dwl, dw) and lo.dtype == torch.float16 and torch.equal(lo, dxl.half())
    assert [t.dtype for t in K_rms.rms_norm_bwd_ref(dy, x, w, r0, dres, torch.float16)] == [x.dtype, x.dtype, lo.dtype]


def _qk_case(B, T, G, D, batched, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B * T, G * D, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(device, dtype)
    pos = torch.randint(0, 4 * T, (B, T) if batched else (T,), generator=g).to(device)
    table = K_qk.rope_table(pos, D, 10000.0, torch.float32 if dtype != torch.float64 else dtype)
    return x, w, pos, table


@needs_cpu_interp
@pytest.mark.parametrize("B,T,G,D", [(2, 5, 3, 8), (1, 7, 2, 16), (3, 4, 4, 64)])
@pytest.mark.parametrize("batched", [False, True])
def test_qk_norm_rope_cpu(B, T, G, D, batched):
    # one fused kernel each way against the reference (rms_norm then rope, and back); the forward's output is a
    # [B, G, T, D] view of [B, T, G, D] memory; the backward reads dy in either layout. Errors are measured
    # relative to the reference's largest value (_scaled_err): dw sums B*T rows of values near 20, where an
    # absolute 1e-4 bound is a few fp32 ulps of the result and fails on some random draws
    x, w, pos, table = _qk_case(B, T, G, D, batched, torch.float32)
    y, r = K_qk.qk_norm_rope_fwd_triton(x, w, G, 1e-6, pos, table)
    y0, r0 = K_qk.qk_norm_rope_fwd_ref(x, w, G, 1e-6, pos, 10000.0, table)
    assert y.shape == (B, G, T, D) and y.transpose(1, 2).is_contiguous()
    assert _scaled_err(y, y0) <= CPU_TOL and _scaled_err(r, r0) <= CPU_TOL
    dy = torch.randn(B, G, T, D, generator=torch.Generator().manual_seed(B * 1000 + T * 100 + G * 10 + D))
    dx0, dw0 = K_qk.qk_norm_rope_bwd_ref(dy, x, w, G, r0, pos, 10000.0, table)
    for d in (dy, dy.transpose(1, 2).contiguous().transpose(1, 2)):
        dx, dw = K_qk.qk_norm_rope_bwd_triton(d, x, w, G, r0, pos, table)
        assert dx.shape == x.shape and _scaled_err(dx, dx0) <= CPU_TOL and _scaled_err(dw, dw0) <= CPU_TOL
    # x a column slice of wider rows (the stacked q/k/v product) and dx written into a slice of a wider gradient:
    # the same bits as contiguous x and dx, and nothing outside the slices touched
    wide, dwide = torch.randn(B * T, G * D + 24), torch.full((B * T, G * D + 40), float("nan"))
    wide[:, 8 : 8 + G * D] = x
    xs, outs = wide[:, 8 : 8 + G * D], dwide[:, 16 : 16 + G * D]
    ys, rs = K_qk.qk_norm_rope_fwd_triton(xs, w, G, 1e-6, pos, table)
    assert torch.equal(ys, y) and torch.equal(rs, r)
    dxs, dws = K_qk.qk_norm_rope_bwd_triton(dy, xs, w, G, r0, pos, table, out=outs)
    assert dxs.data_ptr() == outs.data_ptr() and torch.equal(
        dws, K_qk.qk_norm_rope_bwd_triton(dy, x, w, G, r0, pos, table)[1]
    )
    assert torch.equal(outs, K_qk.qk_norm_rope_bwd_triton(dy, x, w, G, r0, pos, table)[0])
    assert dwide[:, :16].isnan().all() and dwide[:, 16 + G * D :].isnan().all()
    # fp16 storage (the interpreter's bf16 is wrong): the norm's output rounded before the rotation, as the
    # reference does; a bound of 4 fp16 ulps (2^-11 each) of the largest value
    y16, _ = K_qk.qk_norm_rope_fwd_triton(x.half(), w.half(), G, 1e-6, pos, table)
    y16r, _ = K_qk.qk_norm_rope_fwd_ref(x.half(), w.half(), G, 1e-6, pos, 10000.0, table)
    assert y16.dtype == torch.float16 and _scaled_err(y16, y16r) <= 2e-3
    # an fp32 master weight with fp16 activations (the model's case): read in fp32, dw back in fp32
    y16w, r16 = K_qk.qk_norm_rope_fwd_triton(x.half(), w, G, 1e-6, pos, table)
    y16wr, r16r = K_qk.qk_norm_rope_fwd_ref(x.half(), w, G, 1e-6, pos, 10000.0, table)
    assert _scaled_err(y16w, y16wr) <= 2e-3
    dx16, dw16 = K_qk.qk_norm_rope_bwd_triton(dy.half(), x.half(), w, G, r16r, pos, table)
    dx16r, dw16r = K_qk.qk_norm_rope_bwd_ref(dy.half(), x.half(), w, G, r16r, pos, 10000.0, table)
    assert dw16.dtype == torch.float32 and _scaled_err(dw16, dw16r) <= CPU_TOL
    assert _scaled_err(dx16, dx16r) <= 2e-3


@needs_cpu_interp
@pytest.mark.parametrize("tile", [None, 64, 4096])
@pytest.mark.parametrize("xshape,pshape", [((3, 7, 64), (7,)), ((2, 3, 5, 6), (2, 5)), ((2, 5, 9, 10), (9,))])
def test_rope_cpu(xshape, pshape, tile):
    """The shipped tiling (None) and tiles of fewer / more positions than it (64: one position per tile at D = 64)."""
    cfg = None if tile is None else K_rope.RopeConfig(tile=tile)
    x = torch.randn(xshape)
    pos = torch.randint(0, 17000, pshape)
    y = K_rope.rope_fwd_triton(x, pos, 10000.0, cfg)
    dx = K_rope.rope_bwd_triton(x, pos, 10000.0, cfg)
    assert _max_err(y, K_rope.rope_fwd_ref(x, pos)) <= CPU_TOL
    assert _max_err(dx, K_rope.rope_bwd_ref(x, pos)) <= CPU_TOL
    # the backward is the inverse rotation
    assert _max_err(K_rope.rope_bwd_triton(y, pos, 10000.0, cfg), x) <= CPU_TOL


@needs_cpu_interp
@pytest.mark.parametrize("shape", [(5, 123), (3, 7, 64)])
def test_swiglu_cpu(shape):
    g, u, dy = torch.randn(shape) * 4, torch.randn(shape), torch.randn(shape)
    assert _max_err(K_sw.swiglu_fwd_triton(g, u), K_sw.swiglu_fwd_ref(g, u)) <= CPU_TOL
    for a, b in zip(K_sw.swiglu_bwd_triton(dy, g, u), K_sw.swiglu_bwd_ref(dy, g, u)):
        assert _max_err(a, b) <= CPU_TOL


@needs_cpu_interp
def test_swiglu_on_the_halves_of_one_product_cpu():
    """g, u the two column halves of one [R, 2F] product and the gradients written into the halves of one
    [R, 2F] buffer (``swiglu_linear``'s merged gate/up), F not a multiple of the kernels' block."""
    R, F = 5, 1100
    gu, dy, dgu = torch.randn(R, 2 * F) * 4, torch.randn(R, F), torch.full((R, 2 * F), float("nan"))
    g, u = gu[:, :F], gu[:, F:]
    assert _max_err(K_sw.swiglu_fwd_triton(g, u), K_sw.swiglu_fwd_ref(g, u)) <= CPU_TOL
    out = K_sw.swiglu_bwd_triton(dy, g, u, out=(dgu[:, :F], dgu[:, F:]))
    assert out[0].data_ptr() == dgu.data_ptr() and not dgu.isnan().any()
    for a, b in zip((dgu[:, :F], dgu[:, F:]), K_sw.swiglu_bwd_ref(dy.double(), g.double(), u.double())):
        assert _scaled_err(a, b) <= CPU_TOL  # against fp64: the values reach 16, where fp32 steps are 2e-6
    with pytest.raises(ValueError, match="swiglu_bwd"):
        K_sw.swiglu_bwd_triton(dy, g, u, out=(dgu[:, :F], torch.empty(R, F)))


@needs_cpu_interp
def test_stacked_ops_through_the_kernels_cpu(monkeypatch):
    """``ops.qkv_norm_rope_linear`` and ``ops.swiglu_linear`` over stacked weights with their Triton kernels (the
    route CUDA takes: q/k normed and roped from column slices of one product, dq/dk and dg/du written into the
    slices of one gradient), through the interpreter, against the same ops on the references: outputs and every
    gradient to fp32 rounding."""
    import xtrain.ops as ops
    from xtrain import Var

    g = torch.Generator().manual_seed(11)
    N, C, H, Hkv, D, F, T = 8, 16, 2, 1, 16, 24, 4
    x0 = torch.randn(N, C, generator=g)
    wqkv, wgu = torch.randn((H + 2 * Hkv) * D, C, generator=g) * 0.3, torch.randn(2 * F, C, generator=g) * 0.3
    norms0 = (torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5)
    pos = torch.arange(T)
    table = K_qk.rope_table(pos, D, 10000.0, torch.float32)
    cots = [torch.randn(N // T, H, T, D, generator=g), torch.randn(N // T, Hkv, T, D, generator=g),
            torch.randn(N, Hkv * D, generator=g), torch.randn(N, F, generator=g)]  # fmt: skip

    def run():
        x, norms = Var(x0.clone(), True), [Var(n.clone(), True) for n in norms0]
        ws = [Var(w, True) for w in (wqkv[: H * D], wqkv[H * D : (H + Hkv) * D], wqkv[(H + Hkv) * D :])]
        wg, wu = Var(wgu[:F], True), Var(wgu[F:], True)
        h = ops.reshape(x, (N, C))
        outs = [*ops.qkv_norm_rope_linear(h, tuple(ws), tuple(norms), H, Hkv, (pos, table), 1e-6)]
        outs.append(ops.swiglu_linear(h, wg, wu))
        loss = ops.sum(ops.mul(outs[0], Var(cots[0])))
        for o, c in zip(outs[1:], cots[1:]):
            loss = ops.add(loss, ops.sum(ops.mul(o, Var(c))))
        loss.backward()
        return [o.data for o in outs] + [v.grad for v in (x, *ws, *norms, wg, wu)]

    ref = run()
    for K in (K_qk, K_sw):
        monkeypatch.setattr(K, "use_triton", lambda *ts: True)  # CPU tensors through the kernels
    got = run()
    for a, b in zip(got, ref):
        assert _scaled_err(a, b) <= CPU_TOL


@needs_cpu_interp
@pytest.mark.parametrize("p,seed", [(0.1, 0), (0.5, 1), (0.3, 2**64 - 1), (0.25, 0xDEADBEEF), (0.9, 2**40 + 7)])
def test_dropout_cpu_bit_exact(p, seed):
    for shape in ((3, 7, 64), (5, 123), (1,)):  # odd element counts: a last pair with one element
        x = torch.randn(shape)
        assert torch.equal(K_drop.dropout_fwd_triton(x, p, seed), K_drop.dropout_fwd_ref(x, p, seed))
        assert torch.equal(K_drop.dropout_bwd_triton(x, p, seed), K_drop.dropout_bwd_ref(x, p, seed))


@needs_cpu_interp
@pytest.mark.parametrize("N,V", [(5, 123), (7, 1000), (3, 20000)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_cpu(N, V, reduction):
    logits = torch.randn(N, V) * 3
    t = torch.randint(0, V, (N,))
    t[1] = -100
    loss, lse, denom = K_ce.cross_entropy_fwd_triton(logits, t, -100, reduction)
    loss0, lse0, denom0 = K_ce.cross_entropy_fwd_ref(logits, t, -100, reduction)
    # denom: a 0-dim fp32 tensor on the logits' device (no host read in the forward)
    assert denom.shape == () and denom.dtype == torch.float32 and denom.device == logits.device
    assert denom.item() == denom0.item() == (N - 1 if reduction == "mean" else 1)
    assert _max_err(loss, loss0) <= CPU_TOL * 10 and _max_err(lse, lse0) <= CPU_TOL * 10
    dloss = torch.tensor(1.7)
    g = K_ce.cross_entropy_bwd_triton(dloss, logits, t, lse0, -100, denom0)
    g0 = K_ce.cross_entropy_bwd_ref(dloss, logits, t, lse0, -100, denom0)
    assert _max_err(g, g0) <= CPU_TOL
    # denom as a Python number (the older contract) gives the same gradient on both paths
    assert torch.equal(K_ce.cross_entropy_bwd_triton(dloss, logits, t, lse0, -100, denom0.item()), g)
    assert torch.equal(K_ce.cross_entropy_bwd_ref(dloss, logits, t, lse0, -100, denom0.item()), g0)
    a, b = logits.clone(), logits.clone()
    nll, lse1 = K_ce.cross_entropy_fwd_bwd_triton(a, t, -100, 0.25)
    nll0, _ = K_ce.cross_entropy_fwd_bwd_ref(b, t, -100, 0.25)
    assert _max_err(nll, nll0) <= CPU_TOL * 10 and _max_err(a, b) <= CPU_TOL


@needs_cpu_interp
@pytest.mark.parametrize("group", [None, 8, 64])
def test_cross_entropy_fwd_group_cpu(group):
    """The forward at the shipped tiling (None: one 4096-column step or less, so groups with no column at all when V
    is below it) and at 256-column steps in groups of 8 or one group of 64 (several steps per row, the next step
    loaded ahead); a large max in the middle of a row (the running rescale), an ignored row; both reductions."""
    for N, V in ((5, 123), (7, 1000), (3, 2500), (9, 256)):
        logits = torch.randn(N, V) * 3
        logits[0, 7] = 40.0
        t = torch.randint(0, V, (N,))
        t[1] = -100
        cfg = None if group is None else dataclasses.replace(K_ce.cross_entropy_config(V, N), block_v=256, group=group)
        lse, nll = K_ce.cross_entropy_fwd_lse_triton(logits, t, -100, cfg)
        _, lse0, _ = K_ce.cross_entropy_fwd_ref(logits, t)
        assert _max_err(lse, lse0) <= CPU_TOL * 10 and nll[1] == 0
        for reduction in ("mean", "sum"):
            loss, _, denom = K_ce.cross_entropy_fwd_triton(logits, t, -100, reduction)
            loss0, _, denom0 = K_ce.cross_entropy_fwd_ref(logits, t, -100, reduction)
            assert denom == denom0 and _max_err(loss, loss0) <= CPU_TOL * 10


@needs_cpu_interp
def test_cross_entropy_all_ignored_cpu():
    logits = torch.randn(4, 50)
    t = torch.full((4,), -100)
    loss, lse, denom = K_ce.cross_entropy_fwd_triton(logits, t)
    assert loss.item() == 0.0 and denom.item() == 1.0
    loss, _, denom = K_ce.cross_entropy_fwd_triton(logits, t, -100, "sum")
    assert loss.item() == 0.0 and denom.item() == 1.0
    assert torch.equal(K_ce.cross_entropy_bwd_triton(torch.tensor(1.0), logits, t, lse), torch.zeros(4, 50))


@needs_cpu_interp
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [None, 8, 5])
def test_linear_cross_entropy_cpu(reduction, chunk):
    N, C, V = 37, 24, 301
    x = torch.randn(N, C, dtype=torch.float64)
    w = torch.randn(V, C, dtype=torch.float64) * 0.3
    t = torch.randint(0, V, (N,))
    t[3] = t[10] = -100
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(xa @ wa.T, t, ignore_index=-100, reduction=reduction)
    ref.backward()
    for fn in (K_lce.linear_cross_entropy_fwd_ref, K_lce.linear_cross_entropy_fwd_triton):
        loss, dx, dw = fn(x.float(), w.float(), t, -100, reduction, chunk_size=chunk)
        assert abs(loss.item() - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))
        assert _rel(dx, xa.grad) <= 1e-5 and _rel(dw, wa.grad) <= 1e-5
    loss64, dx64, dw64 = K_lce.linear_cross_entropy_fwd_ref(x, w, t, -100, reduction, chunk_size=chunk)
    assert abs(loss64.item() - ref.item()) <= 1e-12 * max(1.0, abs(ref.item()))
    assert _rel(dx64, xa.grad) <= 1e-12 and _rel(dw64, wa.grad) <= 1e-12


def test_linear_cross_entropy_op():
    from xtrain.autograd import Var, no_grad
    from xtrain.ops.fused import linear_cross_entropy

    x = Var(torch.randn(9, 8, dtype=torch.float64), requires_grad=True)
    w = Var(torch.randn(11, 8, dtype=torch.float64), requires_grad=True)
    t = torch.randint(0, 11, (9,))
    t[0] = -100
    loss = linear_cross_entropy(x, w, t)
    (loss * 3.0).backward()
    xa, wa = x.data.clone().requires_grad_(), w.data.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(xa @ wa.T, t) * 3
    ref.backward()
    assert abs(loss.item() * 3 - ref.item()) < 1e-12
    assert _rel(x.grad, xa.grad) < 1e-12 and _rel(w.grad, wa.grad) < 1e-12
    with no_grad():
        assert abs(linear_cross_entropy(x, w, t).item() - loss.item()) < 1e-12
    with pytest.raises(ValueError, match="linear_cross_entropy"):
        linear_cross_entropy(x, Var(torch.randn(11, 7, dtype=torch.float64)), t)
    with pytest.raises(ValueError, match="linear_cross_entropy"):
        linear_cross_entropy(x, w, t[:5])
    with pytest.raises(ValueError, match="linear_cross_entropy"):
        linear_cross_entropy(x, w, torch.full((9,), 11))


def _adam_state(shapes, copy_dtype=torch.float32, gen=None):
    ps = [torch.randn(s, generator=gen) for s in shapes]
    gs = [torch.randn(s, generator=gen) for s in shapes]
    ms = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
    vs = [torch.rand(s, generator=gen) * 0.01 for s in shapes]
    cs = [torch.empty(s, dtype=copy_dtype) for s in shapes]
    return ps, gs, ms, vs, cs


def _adam_cpu_run(lr_scale=1.0, kernel="host"):
    """Three AdamW steps by a Triton kernel (interpreter; ``kernel`` "host": ``adamw_step_triton`` with host
    scalars, "device": ``adamw_step_triton_device`` with the step count, lr and go-ahead as tensors) and the fp32
    reference on the same random state. Returns (triton state, reference state, scales): scales[k][i] is, per
    element, the magnitude of the operands the update adds — |x_0| + the sum over steps of |x_s - x_(s-1)| (from
    an fp64 run) — for the parameters (k = 0) and first moments (k = 2), which can cancel to near zero."""
    shapes = [(5, 123), (3, 7, 64), (1,), (4097,), (33,)]
    a = _adam_state(shapes, gen=torch.Generator().manual_seed(0))
    a[4][2] = None  # a parameter without a compute copy
    b = [[None if t is None else t.clone() for t in lst] for lst in a]
    d = [[t.double() for t in lst] for lst in a[:4]]
    scales = {k: [t.abs() for t in d[k]] for k in (0, 2)}
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decays=[0.1, 0.0, 0.1, 0.0, 0.1])
    step_t = torch.zeros(())
    for step in (1, 2, 3):
        if kernel == "host":
            K_adam.adamw_step_triton(*a[:4], step=step, copies=a[4], **{**kw, "lr": kw["lr"] * lr_scale})
        else:
            lr_t = torch.tensor(kw["lr"] * lr_scale, dtype=torch.float64)
            rest = {k: v for k, v in kw.items() if k != "lr"}
            K_adam.adamw_step_triton_device(*a[:4], step=step_t, lr=lr_t, ok=torch.tensor(True), copies=a[4], **rest)
        K_adam.adamw_step_ref(*b[:4], step=step, copies=b[4], **kw)
        before = {k: [t.clone() for t in d[k]] for k in (0, 2)}
        K_adam.adamw_step_ref(*d, step=step, **kw)
        for k in (0, 2):
            scales[k] = [sc + (x - x0).abs() for sc, x, x0 in zip(scales[k], d[k], before[k])]
    return a, b, scales


@needs_cpu_interp
@pytest.mark.parametrize("kernel", ["host", "device"])
def test_adamw_cpu(kernel):
    """Both Triton kernels against ``adamw_step_ref`` (itself checked against torch.optim.AdamW in
    tests/test_train.py). CPU torch rounds differently from the CUDA-order kernel (see the module docstring): a
    few ulp of the operands. The tolerance is relative to those operands, not to the result: a parameter (or
    moment) that an update brings near zero keeps the absolute rounding error of the larger terms that cancelled
    (seen as 2e-9 on a parameter of 3e-4 after updates of ~6e-3, 10 ulp of the result but 5 of the update: that
    was a flaky failure with tolerances relative to the result)."""
    a, b, scales = _adam_cpu_run(kernel=kernel)
    for k, (lst_a, lst_b) in enumerate(zip(a, b)):
        for i, (ta, tb) in enumerate(zip(lst_a, lst_b)):
            if ta is None:
                continue
            scale = scales[0 if k == 4 else k][i].float() if k in (0, 2, 4) else tb.abs()
            assert ((ta - tb).abs() <= 1e-6 * scale + 1e-12).all(), (k, i)
    assert all(torch.equal(c, p) for c, p in zip(a[4], a[0]) if c is not None)


@needs_cpu_interp
@pytest.mark.parametrize("kernel", ["host", "device"])
def test_adamw_cpu_tolerance_catches_a_wrong_step(kernel):
    """The operand-relative tolerance above still fails a kernel whose step size is off by 1e-4."""
    a, b, scales = _adam_cpu_run(lr_scale=1 + 1e-4, kernel=kernel)
    assert not all(((ta - tb).abs() <= 1e-6 * sc.float() + 1e-12).all() for ta, tb, sc in zip(a[0], b[0], scales[0]))


@needs_cpu_interp
def test_adamw_cpu_views_of_one_buffer_and_mixed_copies():
    flat = torch.randn(1000)
    params = [flat[3:100], flat[100:777].view(677)]  # unaligned views: the table still finds them
    grads = [torch.randn(97), torch.randn(677)]
    ms, vs = [torch.zeros(97), torch.zeros(677)], [torch.zeros(97), torch.zeros(677)]
    copies = [torch.empty(97, dtype=torch.float64), torch.empty(677)]  # two dtypes: second via copy_
    ref = [[t.clone() for t in lst] for lst in (params, grads, ms, vs)]
    kw = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decays=[0.0, 0.01])
    K_adam.adamw_step_triton(params, grads, ms, vs, copies=copies, **kw)
    K_adam.adamw_step_ref(*ref, **kw)
    for p, r, c in zip(params, ref[0], copies):
        assert torch.allclose(p, r, rtol=1e-6, atol=1e-9) and torch.equal(c.float(), p)
    assert flat[:3].isfinite().all()


def _emb_cases(g):
    """(ids, V): counts of exactly K = 4, K + 1, 8, 9, 16, 17, 64 and 65 (the rows grid's, tier A's and tier B's
    bounds; the merge's block of 16 chunks), every token one id, every token its own id, a Zipf-like draw."""
    reps = torch.cat([torch.full((n,), i) for i, n in enumerate((4, 5, 8, 9, 16, 17, 64, 65, 1))])
    return [
        (reps[torch.randperm(reps.numel(), generator=g)], 12),
        (torch.full((23,), 3), 5),
        (torch.randperm(11, generator=g), 11),
        ((torch.rand(120, generator=g) ** 3 * 40).long().view(3, 40), 43),
    ]


@needs_cpu_interp
@pytest.mark.parametrize(
    "config", _EMB_CONFIGS, ids=["side", "tiers", "rows", "small-tiers", "chunk1"][: len(_EMB_CONFIGS)]
)
def test_embedding_bwd_cpu(config):
    """Every form against the reference into poisoned outputs (a row left unwritten fails), bit for bit repeatable
    (the slots and list places are taken by atomics), at table widths above and below K2 (the slots capped at it)."""
    g = torch.Generator().manual_seed(0)
    for ids, V in _emb_cases(g):
        for C in (21, 6) if config.form == "tiers" else (21,):  # (6: K2 capped below the table's width)
            d = torch.randn(*ids.shape, C, generator=g)
            with poisoned():
                a = K_emb.embedding_bwd_triton(d, ids, V, config=config)
            assert _max_err(a, K_emb.embedding_bwd_ref(d, ids, V)) <= CPU_TOL, (config.form, V, C)
            assert torch.equal(a, K_emb.embedding_bwd_triton(d, ids, V, config=config))


@needs_cpu_interp
@pytest.mark.parametrize(
    "config",
    [K_emb.SIDE, K_emb.TIERS, pytest.param(K_emb.ROWS, marks=pytest.mark.slow)] if HAVE_TRITON else [],
    ids=["side", "tiers", "rows"] if HAVE_TRITON else [],
)
def test_embedding_bwd_into_a_held_gradient_cpu(config, monkeypatch):
    """``ops.embedding``'s backward into a gradient the table holds (each distinct id summed as its rank among the
    distinct ids, then added into its row) is, in each form, acc + that form's backward over the whole table, bit
    for bit: a row's sum does not depend on which row it is."""
    from xtrain import Var, ops

    bwd = K_emb.embedding_bwd_triton
    monkeypatch.setattr(K_emb, "embedding_bwd", lambda d, ids, V, plan=None: bwd(d, ids, V, config=config))
    g = torch.Generator().manual_seed(0)
    for ids, V in _emb_cases(g):
        ids, V = ids * 3 + 1, 3 * V + ids.numel()  # ids spread over more rows than tokens
        d = torch.randn(*ids.shape, 21, generator=g)
        acc = torch.randn(V, 21, generator=g)
        v = Var(torch.randn(V, 21, generator=g), requires_grad=True)
        v.grad = acc.clone()
        ops.embedding(ids, v).backward(d)
        assert torch.equal(v.grad, acc + bwd(d, ids, V, config=config)), (config.form, V)


@needs_cpu_interp
def test_embedding_bwd_config_choice_cpu():
    """16-bit gradients take the side form, fp32 the tiers form up to TIERS_MAX_N tokens and the rows form above; the
    two fp32 forms sum rows of at most K tokens alike (the same bits) and differ elsewhere (a tile by a tree); the
    default backward is the chosen form's."""
    n = K_emb.TIERS_MAX_N
    assert K_emb.embedding_bwd_config(torch.bfloat16, 10) is K_emb.embedding_bwd_config(torch.float16, 10**6)
    assert K_emb.embedding_bwd_config(torch.bfloat16, 10).form == "side"
    assert [K_emb.embedding_bwd_config(torch.float32, m).form for m in (1, n, n + 1)] == ["tiers", "tiers", "rows"]
    g = torch.Generator().manual_seed(1)
    light = torch.cat([torch.arange(30), torch.arange(30), torch.arange(0, 30, 3)])
    heavy = (torch.rand(120, generator=g) ** 3 * 30).long()
    for ids, same in ((light, True), (heavy, False)):
        d = torch.randn(ids.numel(), 9, generator=g)
        tiers = K_emb.embedding_bwd_triton(d, ids, 30)
        assert torch.equal(tiers, K_emb.embedding_bwd_triton(d, ids, 30, config=K_emb.TIERS))
        assert torch.equal(tiers, K_emb.embedding_bwd_triton(d, ids, 30, config=K_emb.ROWS)) == same


@needs_cpu_interp
def test_embedding_bwd_int16_keys_cpu():
    """int16 sort keys are ids - 32768: ids on both sides of 32767 / 32768 and at the ends of a table of 65536 rows,
    whose keys include -1 (the kernels' "no id" sentinel is applied after the bias); the rows form's sentinel key (the
    dtype's largest) must name no row, so int16 keys there only up to V = 65535."""
    V, C = 65536, 6
    ids = torch.tensor([32767, 0, 32768, 65535, 32767, 32766, 32768, 1, 65535, 32767, 65534, 32768, 0])
    d = torch.randn(ids.numel(), C)
    a = K_emb.embedding_bwd_triton(d, ids, V, config=K_emb.SIDE)
    assert _max_err(a, K_emb.embedding_bwd_ref(d, ids, V)) <= CPU_TOL
    keys, bias, _ = K_emb._sort_keys(ids, V, False)
    assert keys.dtype == torch.int16 and bias == 2**15
    assert K_emb._sort_keys(ids, V + 1, False)[0].dtype == torch.int32  # ids past int16: int32 keys
    counts = torch.zeros(65535, dtype=torch.int32)
    keys, _, _ = K_emb._sort_keys(ids.clamp_max(65534), 65535, False, counts, 1)
    assert keys.dtype == torch.int16 and (keys == 32767).all()  # no id seen more than once in these counts
    assert K_emb._sort_keys(ids, 65536, False, torch.zeros(65536, dtype=torch.int32), 1)[0].dtype == torch.int32


@needs_cpu_interp
def test_embedding_bwd_tier_b_segments_cpu():
    """Heavy ids (more than K2 = 8 tokens) summed in segments of 8 tokens, those longer than one segment as fp32
    partial rows added in order by the merge kernel: counts of 8, 9, 29 and most of the batch (150), in several heavy
    ids so their partial rows' places add up; against the reference, repeatable, and where no heavy id is longer than
    a segment the bits of the unsegmented sum."""
    g = torch.Generator().manual_seed(5)
    ids = torch.cat([torch.full((n,), i) for i, n in ((1, 8), (2, 9), (4, 29), (6, 150))])
    ids = torch.cat([ids, torch.randint(0, 30, (40,), generator=g)])
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    d = torch.randn(ids.numel(), 21, generator=g)
    V = 33
    whole = K_emb.embedding_bwd_triton(d, ids, V, config=dataclasses.replace(_EMB_SMALL_TIERS, seg=256))
    with poisoned():
        a = K_emb.embedding_bwd_triton(d, ids, V, config=_EMB_SMALL_TIERS)
    assert _max_err(a, K_emb.embedding_bwd_ref(d, ids, V)) <= CPU_TOL
    assert torch.equal(a, K_emb.embedding_bwd_triton(d, ids, V, config=_EMB_SMALL_TIERS))
    assert not torch.equal(a, whole)  # ids 2, 4 and 6 summed in segments: another order of the same sums
    with pytest.raises(ValueError, match="seg a multiple of ht"):
        dataclasses.replace(_EMB_SMALL_TIERS, seg=2)
    for bad in (dict(form="fused"), dict(mt=3), dict(k2=4)):
        with pytest.raises(ValueError, match="EmbeddingBwdConfig"):
            dataclasses.replace(K_emb.TIERS, **bad)


@needs_cpu_interp
@pytest.mark.parametrize(  # small-tiers slow: a plan's heavy lists and its checks are the tiers case's too
    "small", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["tiers", "small-tiers"]
)
def test_embedding_bwd_plan_same_bits_cpu(small):
    """The backward given the ids-only part made ahead (``embedding_bwd_plan_triton``) writes every row and gives the
    same bits as the backward that makes it itself, with heavy ids (the heavy lists are the plan's); the plan is only
    read, so a second backward with it gives the same bits again, also for ids that are not contiguous; a plan for
    other ids (another tensor, or the same memory with other strides), sizes or config raises, as does a plan that is
    not one; forms that take no plan (the side form, the rows form) get None."""
    config = _EMB_SMALL_TIERS if small else K_emb.TIERS
    g = torch.Generator().manual_seed(5)
    ids = torch.cat([(torch.rand(150, generator=g) ** 3 * 60).long(), torch.full((72,), 7), torch.tensor([63, 64, 69])])
    ids = ids[torch.randperm(ids.numel(), generator=g)].view(3, -1)
    d = torch.randn(*ids.shape, 37, generator=g)
    V = 70
    ref = K_emb.embedding_bwd_triton(d, ids, V, config=config)
    assert _max_err(ref, K_emb.embedding_bwd_ref(d, ids, V)) <= CPU_TOL
    plan = K_emb.embedding_bwd_plan_triton(ids, V, 37, torch.float32, config)
    assert isinstance(plan, K_emb.EmbeddingBwdPlan)
    for _ in range(2):
        with poisoned():
            assert torch.equal(K_emb.embedding_bwd_triton(d, ids, V, plan, config), ref)
    ids_t, d_t = ids.t(), d.transpose(0, 1)  # ids not contiguous: the plan keeps its contiguous copy
    plan_t = K_emb.embedding_bwd_plan_triton(ids_t, V, 37, torch.float32, config)
    expect = K_emb.embedding_bwd_triton(d_t, ids_t, V, config=config)
    assert torch.equal(K_emb.embedding_bwd_triton(d_t, ids_t, V, plan_t, config), expect)
    with pytest.raises(ValueError, match="plan was made for"):  # the same memory, other strides
        K_emb.embedding_bwd_triton(d, ids, V, plan_t, config)
    other = _EMB_SMALL_TIERS if config is K_emb.TIERS else K_emb.TIERS
    for bad in ((d, ids.clone(), V, plan, config), (d, ids, V + 1, plan, config), (d[..., :36], ids, V, plan, config)):
        with pytest.raises(ValueError, match="plan was made for"):
            K_emb.embedding_bwd_triton(*bad)
    for bad in ((d.half(), ids, V, plan, config), (d, ids, V, plan, other)):
        with pytest.raises(ValueError, match="plan was made for"):
            K_emb.embedding_bwd_triton(*bad)
    with pytest.raises(ValueError, match="must be an EmbeddingBwdPlan"):
        K_emb.embedding_bwd_triton(d, ids, V, plan="plan")
    with pytest.raises(ValueError, match="positive integers"):
        K_emb.embedding_bwd_plan_triton(ids, 0, 37, torch.float32)
    assert K_emb.embedding_bwd_plan_triton(ids, V, 37, torch.bfloat16) is None  # bf16: the side form
    assert K_emb.embedding_bwd_plan_triton(ids, V, 37, torch.float32, K_emb.ROWS) is None
    assert K_emb.embedding_bwd_plan(ids, V, 37, torch.float32) is None  # CPU tensors: the reference, no plan


@needs_cpu_interp
def test_embedding_zero_fill_kernel_cpu():
    """The tiers form's counts fill (sm_90+): exactly the first n of a poisoned buffer zeroed."""
    x = torch.full((50,), 7, dtype=torch.int32)
    K_emb._zero_i32_kernel[(3,)](x, 37, BLOCK=16, PDL=False)
    assert (x[:37] == 0).all() and (x[37:] == 7).all()


@needs_cpu_interp
def test_rms_norm_bwd_tilings_cpu():
    """Both shipped backward tilings (short rows: several rows a tile; long rows, C >= 2048: one or more tiles of a
    row), rows not a multiple of the tile, programs taking several interleaved tiles; poisoned outputs."""
    for shape in ((37, 40), (9, 130), (3, 7, 64), (5, 2100), (3, 4096)):
        x, dy, w = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
        _, r = K_rms.rms_norm_fwd_ref(x, w, 1e-6)
        with poisoned():
            dx, dw = K_rms.rms_norm_bwd_triton(dy, x, w, r)
        dx0, dw0 = K_rms.rms_norm_bwd_ref(dy, x, w, r)
        assert _max_err(dx, dx0) <= CPU_TOL and _max_err(dw, dw0) <= CPU_TOL * 10


def test_dispatch_cpu_and_fp64_use_reference():
    x = torch.randn(3, 8, dtype=torch.float64)
    w = torch.randn(8, dtype=torch.float64)
    assert torch.equal(K_rms.rms_norm_fwd(x, w, 1e-6)[0], K_rms.rms_norm_fwd_ref(x, w, 1e-6)[0])
    xf = x.float()
    assert torch.equal(K_sw.silu_fwd(xf), K_sw.silu_fwd_ref(xf))  # CPU tensors: the reference


def test_bad_inputs():
    with pytest.raises(ValueError, match="cross_entropy_fwd"):
        K_ce.cross_entropy_fwd(torch.randn(4, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="rope_fwd"):
        K_rope.rope_fwd_triton(torch.randn(2, 5, 8), torch.arange(4))
    with pytest.raises(ValueError, match="swiglu_fwd"):
        K_sw.swiglu_fwd_triton(torch.randn(2, 5), torch.randn(2, 4))


# ================================================================================== GPU, realistic shapes


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-2


DTYPES = [torch.float32, torch.bfloat16]


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batched", [False, True])
def test_qk_norm_rope_gpu(dtype, batched):
    """The fused per-head norm + RoPE at the model's shapes (q: 12 heads, k: 4 heads of 64; 8 x 1024 tokens)
    against the fp64 reference; dy in the two layouts the flash backward returns."""
    for G in (12, 4):
        x, w, pos, table = _qk_case(8, 1024, G, 64, batched, dtype, "cuda")
        with poisoned():
            y, r = K_qk.qk_norm_rope_fwd_triton(x, w, G, 1e-6, pos, table)
        t64 = tuple(t.double() for t in table)
        y64, r64 = K_qk.qk_norm_rope_fwd_ref(x.double(), w.double(), G, 1e-6, pos, 10000.0, t64)
        assert _rel(y, y64) < _tol(dtype) and _rel(r, r64) < 1e-5
        dy = torch.randn(8, G, 1024, 64, device="cuda").to(dtype)
        dx64, dw64 = K_qk.qk_norm_rope_bwd_ref(dy.double(), x.double(), w.double(), G, r64, pos, 10000.0, t64)
        for d in (dy, dy.transpose(1, 2).contiguous().transpose(1, 2)):
            with poisoned():
                dx, dw = K_qk.qk_norm_rope_bwd_triton(d, x, w, G, r, pos, table)
            assert _rel(dx, dx64) < _tol(dtype) and _rel(dw, dw64) < _tol(dtype)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_bwd_tilings_gpu(dtype):
    """Both shipped tilings (rows of 768 and 1536: short; 4096: long) at row counts not a multiple of a tile."""
    for N, C in ((4099, 768), (1000, 1536), (333, 4096)):
        x = torch.randn(N, C, device="cuda").to(dtype)
        w = (1 + 0.1 * torch.randn(C, device="cuda")).to(dtype)
        dy = torch.randn(N, C, device="cuda").to(dtype)
        _, r = K_rms.rms_norm_fwd_triton(x, w, 1e-6)
        with poisoned():
            dx, dw = K_rms.rms_norm_bwd_triton(dy, x, w, r)
        _, r64 = K_rms.rms_norm_fwd_ref(x.double(), w.double(), 1e-6)
        dx64, dw64 = K_rms.rms_norm_bwd_ref(dy.double(), x.double(), w.double(), r64)
        assert _rel(dx, dx64) < _tol(dtype) and _rel(dw, dw64) < _tol(dtype)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,C", [(4096, 768), (2048, 4096), (512, 8192)])
def test_rms_norm_gpu(N, C, dtype):
    x = torch.randn(N, C, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn(C, device="cuda")).to(dtype)
    dy = torch.randn(N, C, device="cuda").to(dtype)
    with poisoned():
        y, r = K_rms.rms_norm_fwd_triton(x, w, 1e-6)
        dx, dw = K_rms.rms_norm_bwd_triton(dy, x, w, r)
    y64, r64 = K_rms.rms_norm_fwd_ref(x.double(), w.double(), 1e-6)
    dx64, dw64 = K_rms.rms_norm_bwd_ref(dy.double(), x.double(), w.double(), r64)
    assert _rel(y, y64) < _tol(dtype) and _rel(r, r64) < 1e-5
    assert _rel(dx, dx64) < _tol(dtype) and _rel(dw, dw64) < _tol(dtype)


@gpu
@pytest.mark.parametrize("N,C", [(4096, 768), (333, 4096)])
def test_add_rms_norm_is_the_two_kernels_bit_for_bit_gpu(N, C):
    """The fused residual add + norm (the model's add_rms_norm) on the GPU: the sum torch.add's bits, the norm the
    plain norm kernel's bits on that sum, and the backward's bf16 copy of dx exactly dx.to(bf16)."""
    x, w = torch.randn(N, C, device="cuda"), 1 + 0.1 * torch.randn(C, device="cuda")
    res, dy = torch.randn(N, C, device="cuda").bfloat16(), torch.randn(N, C, device="cuda").bfloat16()
    dres = torch.randn(N, C, device="cuda")
    with poisoned():
        s, y, r = K_rms.rms_norm_fwd_triton(x, w, 1e-6, torch.bfloat16, res=res)
        dx, dw, lo = K_rms.rms_norm_bwd_triton(dy, s, w, r, dres, low=torch.bfloat16)
    s0 = torch.add(x, res)
    y0, r0 = K_rms.rms_norm_fwd_triton(s0, w, 1e-6, torch.bfloat16)
    dx0, dw0 = K_rms.rms_norm_bwd_triton(dy, s0, w, r0, dres)
    assert torch.equal(s, s0) and torch.equal(y, y0) and torch.equal(r, r0)
    assert torch.equal(dx, dx0) and torch.equal(dw, dw0) and torch.equal(lo, dx0.bfloat16())


@gpu
@pytest.mark.parametrize("N,C", [(65536, 768), (333, 4096), (8192, 8192)])
def test_rms_norm_bwd_pdl_gpu(N, C):
    """The dw pass as a programmatic dependent launch (sm_90+) reads the partial rows only once the backward kernel's
    writes are visible: dx and dw bit-identical over repeated calls into poisoned outputs (a missing wait would read
    stale or poisoned partial rows now and then)."""
    x = torch.randn(N, C, device="cuda").to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(C, device="cuda")).to(torch.bfloat16)
    dy = torch.randn(N, C, device="cuda").to(torch.bfloat16)
    _, r = K_rms.rms_norm_fwd_triton(x, w, 1e-6)
    dx0, dw0 = K_rms.rms_norm_bwd_triton(dy, x, w, r)
    for _ in range(20):
        with poisoned():
            dx, dw = K_rms.rms_norm_bwd_triton(dy, x, w, r)
        assert torch.equal(dx, dx0) and torch.equal(dw, dw0)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("xshape,batched", [((1, 8, 16384, 128), False), ((2, 4, 4096, 64), True)])
def test_rope_gpu(xshape, batched, dtype):
    x = torch.randn(xshape, device="cuda").to(dtype)
    T = xshape[-2]
    pos = torch.randint(0, 16384, (xshape[0], T), device="cuda") if batched else torch.arange(T, device="cuda")
    with poisoned():
        y = K_rope.rope_fwd_triton(x, pos, 1e6)
        dx = K_rope.rope_bwd_triton(x, pos, 1e6)
    # oracle: the fp32 reference itself (its angles are fp32 by contract), on fp32-exact inputs
    assert _rel(y, K_rope.rope_fwd_ref(x.float(), pos, 1e6)) < _tol(dtype)
    assert _rel(dx, K_rope.rope_bwd_ref(x.float(), pos, 1e6)) < _tol(dtype)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_gpu(dtype):
    shape = (4096, 14336)
    g, u, dy = (torch.randn(shape, device="cuda").to(dtype) for _ in range(3))
    with poisoned():
        y = K_sw.swiglu_fwd_triton(g, u)
        dg, du = K_sw.swiglu_bwd_triton(dy, g, u)
    g64, u64, dy64 = g.double(), u.double(), dy.double()
    dg64, du64 = K_sw.swiglu_bwd_ref(dy64, g64, u64)
    assert _rel(y, K_sw.swiglu_fwd_ref(g64, u64)) < _tol(dtype)
    assert _rel(dg, dg64) < _tol(dtype) and _rel(du, du64) < _tol(dtype)
    # the halves of one [N, 2F] product and gradient (swiglu_linear's stacked gate/up): the same bits
    F, gu = shape[1], torch.cat([g, u], 1)
    dgu = torch.empty_like(gu)
    with poisoned():
        yh = K_sw.swiglu_fwd_triton(gu[:, :F], gu[:, F:])
        K_sw.swiglu_bwd_triton(dy, gu[:, :F], gu[:, F:], out=(dgu[:, :F], dgu[:, F:]))
    assert torch.equal(yh, y) and torch.equal(dgu[:, :F], dg) and torch.equal(dgu[:, F:], du)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [1, 1234, 2**31 + 5, 2**63 + 2**40 + 3])
def test_dropout_gpu_bit_exact(dtype, seed):
    x = torch.randn(8192, 4096 + 3, device="cuda").to(dtype)
    with poisoned():
        y = K_drop.dropout_fwd_triton(x, 0.1, seed)
        dx = K_drop.dropout_bwd_triton(x, 0.1, seed)
    y0 = K_drop.dropout_fwd_ref(x, 0.1, seed)
    assert torch.equal(y != 0, y0 != 0)  # the mask, bit for bit
    assert torch.equal(y, y0) and torch.equal(dx, y0)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,V", [(2048, 32768), (1024, 131072), (333, 50257)])
def test_cross_entropy_gpu(N, V, dtype):
    logits = (3 * torch.randn(N, V, device="cuda")).to(dtype)
    t = torch.randint(0, V, (N,), device="cuda")
    t[::7] = -100
    with poisoned():
        loss, lse, denom = K_ce.cross_entropy_fwd_triton(logits, t)
        g = K_ce.cross_entropy_bwd_triton(torch.tensor(2.0, device="cuda"), logits, t, lse, -100, denom)
    loss64, lse64, denom64 = K_ce.cross_entropy_fwd_ref(logits.double(), t)
    g64 = K_ce.cross_entropy_bwd_ref(torch.tensor(2.0, device="cuda"), logits.double(), t, lse64, -100, denom64)
    assert denom.is_cuda and denom.item() == denom64.item()
    assert abs(loss.item() - loss64.item()) / loss64.item() < 1e-5 and _rel(lse, lse64) < 1e-6
    assert _rel(g, g64) < _tol(dtype)
    buf = logits.clone()
    with poisoned():
        nll, _ = K_ce.cross_entropy_fwd_bwd_triton(buf, t, -100, 2.0 / denom)  # scale as a device tensor
    assert abs(nll.sum().item() / denom.item() - loss64.item()) / loss64.item() < 1e-5
    assert _rel(buf, g64) < _tol(dtype)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [32768, 131072])
def test_linear_cross_entropy_gpu(V, dtype):
    N, C = 2048, 1024
    x = torch.randn(N, C, device="cuda").to(dtype)
    w = (torch.randn(V, C, device="cuda") / C**0.5).to(dtype)
    t = torch.randint(0, V, (N,), device="cuda")
    t[::5] = -100
    with poisoned():
        loss, dx, dw = K_lce.linear_cross_entropy_fwd_triton(x, w, t, chunk_size=512)
    x64, w64 = x.double(), w.double()
    logits = x64 @ w64.T
    loss64, lse64, denom = K_ce.cross_entropy_fwd_ref(logits, t)
    dlog = K_ce.cross_entropy_bwd_ref(torch.tensor(1.0, device="cuda"), logits, t, lse64, -100, denom)
    assert abs(loss.item() - loss64.item()) / loss64.item() < (1e-5 if dtype == torch.float32 else 1e-3)
    # bf16: dw is accumulated in bf16 over 4 chunks (module docstring): 2e-2
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _rel(dx, dlog @ w64) < tol and _rel(dw, dlog.T @ x64) < tol


def _adam_device_vs_host(device, recip_div=None):
    """Three steps (one skipped) of the device-scalar kernel (lr, step, go-ahead and clip coefficient as
    tensors) and of the host-scalar kernel on gradients clipped beforehand: bit for bit the same state, and
    the skipped step writes nothing (its gradients are NaN). Returns the device step count."""
    torch.manual_seed(1)
    shapes = [(5, 123), (3, 7, 64), (1,), (4097,), (33,)]
    a = [[None if t is None else t.to(device) for t in lst] for lst in _adam_state(shapes)]
    a[4][2] = None
    b = [[None if t is None else t.clone() for t in lst] for lst in a]
    wds = [0.1, 0.0, 0.1, 0.0, 0.1]
    kw = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decays=wds)
    step_t = torch.zeros((), device=device)
    host_step = 0
    for lr, coef, ok in ((1e-3, 0.37, True), (2e-3, 1.0, False), (3e-4, 0.81, True)):
        grads = [torch.randn(s, device=device) for s in shapes]
        if not ok:
            grads[1][0, 0, 0] = float("nan")
        before = [[None if t is None else t.clone() for t in lst] for lst in a]
        for g, x, y in zip(grads, a[1], b[1]):
            x.copy_(g)
            y.copy_(g)
        lr_t, ok_t = torch.tensor(lr, dtype=torch.float64, device=device), torch.tensor(ok, device=device)
        K_adam.adamw_step_triton_device(
            *a[:4], step=step_t, lr=lr_t, ok=ok_t, grad_scale=torch.tensor(coef, device=device), copies=a[4],
            recip_div=recip_div, **kw,
        )  # fmt: skip
        if not ok:
            for k in (0, 2, 3, 4):
                assert all(x is None or torch.equal(x, y) for x, y in zip(a[k], before[k])), k
            continue
        host_step += 1
        torch._foreach_mul_(b[1], torch.tensor(coef, device=device))  # clip_grads_' product, then the host step
        K_adam.adamw_step_triton(*b[:4], step=host_step, lr=lr, copies=b[4], recip_div=recip_div, **kw)
        for k in (0, 2, 3, 4):
            assert all(x is None or torch.equal(x, y) for x, y in zip(a[k], b[k])), k
    return float(step_t)


@needs_cpu_interp
def test_adamw_device_scalars_cpu():
    assert _adam_device_vs_host("cpu") == 2.0
    assert _adam_device_vs_host("cpu", recip_div=True) == 2.0  # the CUDA rounding order


@gpu
def test_adamw_device_scalars_gpu():
    assert _adam_device_vs_host("cuda") == 2.0


@gpu
def test_adamw_gpu_bit_exact():
    shapes = [(4096, 4096), (11008, 4096), (4096,), (1,), (50257, 768), (3, 333)]
    a = [[t.cuda() for t in lst] for lst in _adam_state(shapes, torch.bfloat16)]
    b = [[t.clone() for t in lst] for lst in a]
    wds = [0.1, 0.1, 0.0, 0.0, 0.1, 0.1]
    for step in (1, 2, 10):
        for gi in range(len(shapes)):
            g = torch.randn(shapes[gi], device="cuda")
            a[1][gi].copy_(g)
            b[1][gi].copy_(g)
        kw = dict(step=step, lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decays=wds)
        K_adam.adamw_step_triton(*a[:4], copies=a[4], **kw)
        K_adam.adamw_step_ref(*b[:4], copies=b[4], **kw)
    report = []
    for name, la, lb in zip(("param", "grad", "exp_avg", "exp_avg_sq", "copy"), a, b):
        for ta, tb in zip(la, lb):
            if not torch.equal(ta, tb):
                ulps = (ta.float().view(torch.int32) - tb.float().view(torch.int32)).abs().max().item()
                report.append((name, tuple(ta.shape), (ta != tb).sum().item(), ulps))
    print("adamw mismatches (state, shape, count, max ulp):", report)
    assert not report


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [None, *K_emb.SHIPPED] if HAVE_TRITON else [None], ids=lambda c: c and c.form)
def test_embedding_bwd_gpu(dtype, config):
    """NaN-poisoned output buffers, fp64 oracle, bit for bit deterministic, each form in either dtype (None: the one
    chosen); "side" runs its sort, walks and merge on a second stream beside the zero fill, "rows" the chain for
    frequent ids beside the rows kernel, "tiers" its medium rows and its heavy lists and sums on two streams beside the
    rows kernel (a missing order between them would leave NaN rows or zeros where sums belong; the slots are taken by
    atomics in a new order each run)."""
    V, C, N = 32000, 1024, 16384
    # a Zipf-like draw: many repeated ids, as in text
    ids = (torch.rand(N, device="cuda") ** 3 * V).long().clamp_max(V - 1).reshape(4, N // 4)
    d = torch.randn(4, N // 4, C, device="cuda").to(dtype)
    with poisoned():
        a = K_emb.embedding_bwd_triton(d, ids, V, config=config)
    b64 = K_emb.embedding_bwd_ref(d.double(), ids, V)
    assert _rel(a, b64) < _tol(dtype)
    assert torch.equal(a, K_emb.embedding_bwd_triton(d, ids, V, config=config))  # deterministic


@gpu
@pytest.mark.parametrize("N", [8192, 40000])  # the tiers and the rows form
def test_embedding_bwd_into_a_held_gradient_gpu(N):
    """On the GPU, with the forward's plan made on its side stream: ``ops.embedding``'s backward into a gradient the
    table holds (a tied head's) is acc + the backward over the whole table bit for bit, in the held tensor."""
    from xtrain import Var, ops

    V, C = 151936, 256
    ids = (torch.rand(N, device="cuda") ** 3 * V).long().clamp_max(V - 1).reshape(4, N // 4)
    d, acc = torch.randn(4, N // 4, C, device="cuda"), torch.randn(V, C, device="cuda")
    v = Var(torch.randn(V, C, device="cuda"), requires_grad=True)
    v.grad = held = acc.clone()
    ops.embedding(ids, v).backward(d)
    assert v.grad is held and torch.equal(v.grad, acc + K_emb.embedding_bwd_triton(d, ids, V))


@gpu
def test_embedding_bwd_tiers_plan_gpu():
    """The tiers form's cached launch plan: a second and third call of the same shapes with new ids and dout (and
    ids of another dtype, a new plan) each give their own sums, into poisoned outputs; another config (K2 = 16: many
    heavy ids, so many lists and offsets) is a new plan, not a stale one."""
    K_emb._TIER_PLANS.clear()
    small = dataclasses.replace(K_emb.TIERS, k2=16, a_block_c=1024, ht=64, b_warps=4, b_per_sm=1, scan=1024)
    V, C, N = 5000, 384, 3000
    for step in range(4):
        g = torch.Generator(device="cuda").manual_seed(step)
        ids = (torch.rand(N, device="cuda", generator=g) ** 3 * V).long().clamp_max(V - 1)
        if step == 2:
            ids = ids.int()
        d = torch.randn(N, C, device="cuda", generator=g)
        with poisoned():
            a = K_emb.embedding_bwd_triton(d, ids, V, config=small if step == 3 else None)
        assert _rel(a, K_emb.embedding_bwd_ref(d.double(), ids, V)) < _tol(torch.float32), step
    assert len(K_emb._TIER_PLANS) == 3  # int64 ids, int32 ids, the other config


@gpu
def test_embedding_fwd_planned_gpu():
    """The fp32 backward given the plan the forward launched on a side stream beside its gather
    (``embedding_fwd_planned``; the backward, called at once, must wait for it): the forward's rows are table[ids],
    the backward's bits are those of the backward that makes the plan itself (poisoned output, the plan read twice,
    with a heavy id of 3000 tokens in segments), across calls of new ids and dout with the launch plans cached; the op
    (``ops.embedding``) uses it and its gradient matches the fp64 reference; bf16 gets no plan."""
    from xtrain import ops
    from xtrain.autograd import Var

    V, C, N = 32000, 1024, 16384
    for step in range(3):
        g = torch.Generator(device="cuda").manual_seed(10 + step)
        ids = (torch.rand(N, device="cuda", generator=g) ** 3 * V).long().clamp_max(V - 1)
        ids[torch.randperm(N, device="cuda", generator=g)[:3000]] = 11  # a heavy id (tier B)
        ids = ids.reshape(4, N // 4)
        table = torch.randn(V, C, device="cuda", generator=g)
        d = torch.randn(4, N // 4, C, device="cuda", generator=g)
        out, plan = K_emb.embedding_fwd_planned(ids, table)
        assert plan is not None and plan.ready is not None and torch.equal(out, table[ids])
        with poisoned():
            ref = K_emb.embedding_bwd_triton(d, ids, V)
        for _ in range(2):
            with poisoned():
                assert torch.equal(K_emb.embedding_bwd_triton(d, ids, V, plan), ref), step
    assert _rel(ref, K_emb.embedding_bwd_ref(d.double(), ids, V)) < _tol(torch.float32)
    w = Var(table, requires_grad=True)
    y = ops.embedding(ids, w)
    y.backward(d)
    assert torch.equal(w.grad, ref)
    assert K_emb.embedding_fwd_planned(ids, table.bfloat16())[1] is None  # bf16: the "side" form


def _decode_case(B, H, Hkv, D, R, Tmax, dtype, device, seed):
    """q, caches, slots (distinct, shuffled), lengths (the first 1, the last Tmax: both ends of the key loop)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g)
    ck, cv = (torch.randn(R, Hkv, Tmax, D, generator=g) for _ in range(2))
    slots, n = torch.randperm(R, generator=g)[:B], torch.randint(1, Tmax + 1, (B,), generator=g)
    n[0] = 1
    if B > 1:
        n[-1] = Tmax
    return [t.to(device, dtype) for t in (q, ck, cv)] + [slots.to(device), n.to(device)]


@needs_cpu_interp
@pytest.mark.parametrize("B,H,Hkv,D,R,Tmax", [(3, 12, 4, 16, 5, 70), (2, 6, 6, 32, 3, 40), (1, 4, 2, 8, 1, 1)])
def test_decode_attention_cpu(B, H, Hkv, D, R, Tmax):
    """The decode kernel (each row's keys read in place, online softmax) against the gathering reference in
    fp64: GQA with G = 3 (padded to 4), MHA, one key; lengths 1 and Tmax; rows in shuffled cache slots."""
    q, ck, cv, slots, n = _decode_case(B, H, Hkv, D, R, Tmax, torch.float32, "cpu", B * 100 + H)
    scale = D**-0.5
    with poisoned():
        got = K_dec.decode_attention_triton(q, ck, cv, slots, n, scale, block_s=16)
    want = K_dec.decode_attention_ref(q.double(), ck.double(), cv.double(), slots, n, scale)
    assert got.shape == (B, H * D) and _rel(got, want) < CPU_TOL
    assert _rel(K_dec.decode_attention_ref(q, ck, cv, slots, n, scale), want) < CPU_TOL


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,Hkv,D", [(1, 12, 4, 64), (4, 16, 8, 128)])
def test_decode_attention_gpu(B, H, Hkv, D, dtype):
    q, ck, cv, slots, n = _decode_case(B, H, Hkv, D, 6, 520, dtype, "cuda", 7)
    with poisoned():
        got = K_dec.decode_attention_triton(q, ck, cv, slots, n, D**-0.5)
    want = K_dec.decode_attention_ref(q.double(), ck.double(), cv.double(), slots, n, D**-0.5)
    assert _rel(got, want) < _tol(dtype)


def _rows_case(M, K, N, pre, res, dtype, device, seed):
    """x, w (a [K, N] view of [N, K] memory, as the decode path holds it), g, res for ``rows_linear``; the residual
    and the normed x in fp32 (the master dtype), the rest in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, 2 * K if pre == "glu" else K, generator=g)
    w = torch.randn(N, K, generator=g) / K**0.5
    gw = 1 + 0.1 * torch.randn(K, generator=g)
    r = torch.randn(M, N, generator=g) if res else None
    x = x.to(device, torch.float32 if pre == "norm" else dtype)
    return x, w.to(device, dtype).t(), gw.to(device), None if r is None else r.to(device)


@needs_cpu_interp
@pytest.mark.parametrize("pre", [None, "norm", "glu"])
@pytest.mark.parametrize("res", [False, True])
@pytest.mark.parametrize("M,K,N,config", [(1, 40, 37, (4, 16)), (3, 24, 8, (8, 32))])
def test_rows_linear_cpu(pre, res, M, K, N, config):
    """The decode projections' kernel against its composed reference in fp64: the norm, the SwiGLU and the
    residual add in the product's pass; K and N not multiples of the tile (masked tails, several K steps)."""
    x, w, gw, r = _rows_case(M, K, N, pre, res, torch.float32, "cpu", M * 7 + K)
    with poisoned():
        got = K_rows.rows_linear_triton(x, w, pre, gw, 1e-6, r, config=config)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    want = K_rows.rows_linear_ref(x.double(), w.double(), pre, gw.double(), 1e-6, d(r))
    assert got.shape == (M, N) and got.dtype == torch.float32 and _rel(got, want) < CPU_TOL
    assert _rel(K_rows.rows_linear_ref(x, w, pre, gw, 1e-6, r), want) < CPU_TOL


def _store_case(B, H, Hkv, D, dtype, device, seed, R=7, Tmax=9, pad=3):
    """A decode step's inputs: qkv rows as a column slice of wider rows (their stride is not their width; pad 16
    on the GPU keeps the rows 16-element aligned, as the model's contiguous rows are), w
    [H + Hkv, D] (a weight per head), stale caches, slots not adjacent at different positions (both ends of the
    cache), positions and table as a ``Cached`` mask gives them (a lone row: [1] and [1, D/2], else [B, 1] and
    [B, 1, 1, D/2])."""
    g = torch.Generator().manual_seed(seed)
    F = (H + 2 * Hkv) * D
    qkv = torch.randn(B, F + 2 * pad, generator=g).to(device, dtype)[:, pad : pad + F]
    w = (1 + 0.1 * torch.randn(H + Hkv, D, generator=g)).to(device)
    ck, cv = (torch.randn(R, Hkv, Tmax, D, generator=g).to(device, dtype) for _ in range(2))
    slots, start = torch.tensor([5, 0, 3, 1][:B], device=device), torch.tensor([Tmax - 1, 0, 4, 6][:B], device=device)
    c, s = K_qk.rope_table(torch.arange(Tmax, device=device), D, 10000.0, torch.float32)
    if B == 1:
        pos, table = start, (c[Tmax - 1 :], s[Tmax - 1 :])
    else:
        pos, table = start[:, None], (c[start][:, None, None], s[start][:, None, None])
    return qkv, w, ck, cv, slots, start, pos, table


@needs_cpu_interp
@pytest.mark.parametrize("B,H,Hkv,D", [(3, 6, 2, 64), (1, 4, 4, 128), (2, 24, 8, 128)])
def test_qkv_norm_rope_store_cpu(B, H, Hkv, D):
    """The decode step's kernel (q out; k normed and roped, v as it is, into the cache rows) against its reference:
    GQA and MHA, head dims 64 and 128, more heads than one tile (40 rows of 32 at D = 128), a lone row; every cache
    position but the new ones keeps its stale value."""
    qkv, w, ck, cv, slots, start, _, table = _store_case(B, H, Hkv, D, torch.float32, "cpu", B * 10 + H)
    ckr, cvr, ck0, cv0 = ck.clone(), cv.clone(), ck.clone(), cv.clone()
    with poisoned():
        q = K_qk.qkv_norm_rope_store_triton(qkv, w, H, Hkv, 1e-6, table, ck, cv, slots, start)
    qr = K_qk.qkv_norm_rope_store_ref(qkv, w, H, Hkv, 1e-6, table, ckr, cvr, slots, start)
    assert q.shape == (B, H, 1, D) and _scaled_err(q, qr) <= CPU_TOL
    new = torch.zeros(ck.shape[0], ck.shape[2], dtype=torch.bool)
    new[slots, start] = True  # [R, Tmax]: the positions written
    (k, kr, k0), (v, vr, v0) = ([c.transpose(1, 2) for c in t] for t in ((ck, ckr, ck0), (cv, cvr, cv0)))
    assert torch.equal(k[~new], k0[~new]) and torch.equal(v[~new], v0[~new])
    assert _scaled_err(k[new], kr[new]) <= CPU_TOL and torch.equal(v[new], vr[new])
    # fp16 storage (the interpreter's bf16 is wrong): the norm's output is rounded before the rotation, as the
    # reference rounds it. Without that rounding 8-15% of the values of q and of the new keys change by an ulp, which
    # no tolerance on the values tells from noise; with it they match bit for bit but for a rare tie the two orders
    # of the sum of squares round apart (hence 99%, not all)
    qkv, w, ck, cv, slots, start, _, table = _store_case(B, H, Hkv, D, torch.float16, "cpu", B * 10 + H)
    ckr = ck.clone()
    q = K_qk.qkv_norm_rope_store_triton(qkv, w, H, Hkv, 1e-6, table, ck, cv.clone(), slots, start)
    qr = K_qk.qkv_norm_rope_store_ref(qkv, w, H, Hkv, 1e-6, table, ckr, cv.clone(), slots, start)
    k, kr = ck[slots, :, start], ckr[slots, :, start]  # [B, Hkv, D] the new keys
    assert (q == qr).double().mean() >= 0.99 and (k == kr).double().mean() >= 0.99


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pre,res,M,K,N", [("norm", False, 1, 768, 1280), (None, True, 1, 768, 768),
                                           ("glu", True, 4, 3072, 768), ("norm", False, 2, 1024, 151936)])  # fmt: skip
def test_rows_linear_gpu(pre, res, M, K, N, dtype):
    x, w, gw, r = _rows_case(M, K, N, pre, res, dtype, "cuda", 3)
    with poisoned():
        got = K_rows.rows_linear_triton(x, w, pre, gw, 1e-6, r)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    want = K_rows.rows_linear_ref(x.double(), w.double(), pre, gw.double(), 1e-6, d(r))
    assert got.dtype == (torch.float32 if res else dtype) and _rel(got, want) < _tol(dtype)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,Hkv,D", [(1, 12, 4, 64), (3, 16, 8, 128), (4, 32, 8, 128)])
def test_qkv_norm_rope_store_gpu(B, H, Hkv, D, dtype):
    """Bit for bit what a decode step computed before the kernel: two ``qk_norm_rope_fwd_triton`` launches (q, then
    k, each on its columns with its norm's weight) and the cache writes; the op (``ops.qkv_norm_rope`` with the
    ``Cached`` mask's own table) gives the same."""
    from xtrain import ops
    from xtrain.autograd import no_grad
    from xtrain.mask import Cached

    qkv, w, ck, cv, slots, start, pos, table = _store_case(B, H, Hkv, D, dtype, "cuda", 7, R=6, Tmax=520, pad=16)
    w[1:H], w[H + 1 :] = w[0], w[H]  # q_norm's weight on every q head, k_norm's on every k head (the model's)
    want_k, want_v, op_k, op_v = ck.clone(), cv.clone(), ck.clone(), cv.clone()
    with poisoned():
        q = K_qk.qkv_norm_rope_store_triton(qkv, w, H, Hkv, 1e-6, table, ck, cv, slots, start)
        qr = K_qk.qk_norm_rope_fwd_triton(qkv[:, : H * D], w[0], H, 1e-6, pos, table)[0]
        kr = K_qk.qk_norm_rope_fwd_triton(qkv[:, H * D : (H + Hkv) * D], w[H], Hkv, 1e-6, pos, table)[0]
    want_k[slots, :, start] = kr[:, :, 0]
    want_v[slots, :, start] = qkv[:, (H + Hkv) * D :].reshape(B, Hkv, D)
    assert torch.equal(q, qr) and torch.equal(ck, want_k) and torch.equal(cv, want_v)
    mask = Cached(slots, start, 1, 520, (5, 519) if B == 1 else None)
    with no_grad():
        qo = ops.qkv_norm_rope(qkv, w, H, Hkv, mask, mask.rope(K_qk.rope_table(torch.arange(520, device="cuda"), D,
                               10000.0, torch.float32), 1)[1], 1e-6, (op_k, op_v))  # fmt: skip
    assert torch.equal(qo.data, qr) and torch.equal(op_k, want_k) and torch.equal(op_v, want_v)
