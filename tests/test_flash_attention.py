"""Flash attention: tiled reference vs composed attention (fp64), finite differences, Triton vs reference.

Ladder (DESIGN.md): 1. the op's backward against float64 central differences; 2. the tiled reference
against an independent composed formula with torch.autograd as the oracle, and against xtrain's composed
``ops.attention``; 3. the Triton kernels against the reference — on CPU through the interpreter in fp32 at
tiny shapes, on the GPU (``-m gpu``) in fp32 and bf16 up to T = 16k.

GPU tolerances, as relative norm error ‖out − ref‖ / ‖ref‖ against the fp64 reference computed from the
same (already rounded) inputs:
  * fp32: 2e-5. The kernels use exact fp32 dots (no TF32); what is left is fp32 rounding of sums over up to
    16k terms (~1e-7 · sqrt(T) relative) and exp2 vs exp: measured at most 3.8e-6 (H200, 2026-11-29).
  * bf16: 1e-2 (forward and gradients). o is rounded to bf16 (2^-9 ≈ 2e-3 relative per element) and P is
    rounded to bf16 before P·V as in every flash implementation; in the backward dS = P∘(dP − D) is rounded
    to bf16 too. METHOD.md's band for bf16 operands is 1e-3..1e-2; measured on an H200 (2026-11-29): at most
    2.1e-3 forward and 2.6e-3 gradients over every GPU case here, T up to 16k.
"""

from __future__ import annotations

import math

import pytest
import torch

from xtrain.kernels import attention as FA
from xtrain.kernels._dispatch import HAVE_TRITON
from xtrain.kernels.attention import Tiles, TritonBwdConfig, TritonFwdConfig
from xtrain.kernels.attention import triton as TR

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")


def composed(q, k, v, causal=True, scale=None):
    """Independent oracle: materialise the scores, softmax, matmul (GQA by repeating k/v heads)."""
    B, H, T, D = q.shape
    g = H // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(D) if scale is None else scale)  # [B, H, T, T]
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def rand_qkv(B, H, Hkv, T, D, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda h: torch.randn(B, h, T, D, generator=g, device=device, dtype=torch.float32).to(dtype)
    return mk(H), mk(Hkv), mk(Hkv), mk(H)  # q, k, v, do


def rel(a, b) -> float:
    """‖a − b‖ / ‖b‖; where the exact result is zero (T = 1: one key, P = 1, so dS = 0 and dq = dk = 0) the
    kernels return the rounding of dP − D ≈ 0, so the error is reported as the max absolute error instead."""
    a, b = a.double(), b.double()
    if b.norm() <= 1e-9 * math.sqrt(b.numel()):
        return float((a - b).abs().max())
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------------------------------------------------
# 1-2. the tiled reference
# ---------------------------------------------------------------------------------------------------------
REF_SHAPES = [  # B, H, Hkv, T, D, tile
    (2, 4, 4, 40, 8, 16),  # MHA, T not a multiple of the tile
    (2, 4, 2, 37, 16, 8),  # GQA, group 2
    (1, 6, 1, 33, 8, 32),  # MQA, ragged
    (1, 2, 1, 1, 8, 16),  # T = 1
    (1, 2, 2, 64, 8, 16),  # T a multiple of the tile
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("B,H,Hkv,T,D,tile", REF_SHAPES)
def test_reference_matches_composed_fp64(B, H, Hkv, T, D, tile, causal):
    q, k, v, do = rand_qkv(B, H, Hkv, T, D)
    scale = 0.3 if T == 37 else None
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    o_ref = composed(qq, kk, vv, causal, scale)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(o_ref, (qq, kk, vv), do)
    o, lse = FA.flash_attention_fwd_ref(q, k, v, causal, scale, tile=tile)
    assert o.dtype == torch.float64 and lse.shape == (B, H, T)
    assert (o - o_ref).abs().max() < 1e-10
    s = 1.0 / math.sqrt(D) if scale is None else scale
    g = H // Hkv
    sc = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * s
    if causal:
        sc = sc.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    assert (lse - torch.logsumexp(sc, dim=-1)).abs().max() < 1e-10  # natural log
    dq, dk, dv = FA.flash_attention_bwd_ref(do, q, k, v, o, lse, causal, scale, tile=tile)
    assert dk.shape == k.shape and dv.shape == v.shape
    for got, want in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert (got - want).abs().max() < 1e-10


def test_reference_matches_xtrain_composed_attention():
    ops = pytest.importorskip("xtrain.ops")
    if not hasattr(ops, "attention"):
        pytest.skip("xtrain.ops.attention not there yet")
    from xtrain.autograd import Var
    from xtrain.ops.flash import flash_attention

    for causal in (True, False):
        q, k, v, do = rand_qkv(2, 4, 2, 19, 8, seed=3)
        outs = []
        for fn in (ops.attention, flash_attention):
            vs = [Var(t.clone(), requires_grad=True) for t in (q, k, v)]
            out = fn(*vs, mask=causal)
            out.backward(do)
            outs.append([out.data] + [x.grad for x in vs])
        for a, b in zip(*outs):
            assert (a - b).abs().max() < 1e-10


def test_gradcheck_finite_differences():
    from xtrain.gradcheck import TOL_SMOOTH, gradcheck
    from xtrain.ops.flash import flash_attention

    q, k, v, _ = rand_qkv(1, 4, 2, 6, 4, seed=5)
    for causal in (True, False):
        errs = gradcheck(lambda a, b, c, causal=causal: flash_attention(a, b, c, causal, scale=0.7), [q, k, v])
        assert max(errs) < TOL_SMOOTH, errs


def test_reference_memory_is_not_quadratic():
    """The reference's largest temporary is [B, H, T, tile], never [B, H, T, T]: run T = 8192 on CPU,
    where a T×T fp32 score matrix per head would be 256 MiB; a [T, tile] one is 4 MiB."""
    q, k, v, do = rand_qkv(1, 1, 1, 8192, 8, dtype=torch.float32)
    o, lse = FA.flash_attention_fwd_ref(q, k, v, True)
    dq, dk, dv = FA.flash_attention_bwd_ref(do, q, k, v, o, lse, True)
    assert torch.isfinite(o).all() and torch.isfinite(dq).all() and torch.isfinite(dk).all()
    # spot check the last row against a direct softmax over its 8192 keys
    s = (q[0, 0, -1] @ k[0, 0].T) / math.sqrt(8)
    assert torch.allclose(o[0, 0, -1], torch.softmax(s, -1) @ v[0, 0], atol=1e-5)


def test_validation_errors():
    q, k, v, do = rand_qkv(1, 4, 2, 8, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="flash_attention_fwd"):
        FA.flash_attention_fwd(q[0], k, v)  # rank
    with pytest.raises(ValueError, match="must divide"):
        FA.flash_attention_fwd(q, k[:, :1].expand(1, 3, 8, 8), v[:, :1].expand(1, 3, 8, 8))
    with pytest.raises(ValueError, match="dtype"):
        FA.flash_attention_fwd(q, k.double(), v)
    with pytest.raises(ValueError, match="scale"):
        FA.flash_attention_fwd(q, k, v, scale=-1.0)
    with pytest.raises(ValueError, match=r"\(1, 4, 8, 8\)"):
        FA.flash_attention_fwd(q, k[:, :, :5], v)
    o, lse = FA.flash_attention_fwd(q, k, v)
    with pytest.raises(ValueError, match="flash_attention_bwd"):
        FA.flash_attention_bwd(do, q, k, v, o, lse[..., :3])
    if HAVE_TRITON:
        q2, k2, v2, _ = rand_qkv(1, 2, 2, 8, 48, dtype=torch.float32)
        with pytest.raises(ValueError, match="head dim D=48"):
            FA.flash_attention_fwd_triton(q2, k2, v2, config=TritonFwdConfig(Tiles(32, 16, 4, 1)))


# ---------------------------------------------------------------------------------------------------------
# 3. Triton kernels vs the reference (CPU: interpreter, fp32, tiny; with CUDA the same cases on the GPU)
# ---------------------------------------------------------------------------------------------------------
def cfgs(f, b1, b2, **kw):
    """Triton configs from (block_m, block_n, warps, stages, tma) tuples."""
    return TritonFwdConfig(Tiles(*f), **kw), TritonBwdConfig(Tiles(*b1), Tiles(*b2), **kw)


TINY = [  # B, H, Hkv, T, D, (fwd config, bwd config) (small blocks: several tiles, ragged tails)
    (1, 2, 1, 1, 32, cfgs((32, 16, 4, 1), (16, 32, 4, 1), (32, 16, 4, 1))),
    (2, 4, 2, 17, 32, cfgs((16, 16, 4, 1), (16, 16, 4, 1), (16, 16, 4, 1))),
    (1, 4, 1, 40, 32, cfgs((32, 16, 4, 1), (16, 32, 4, 1), (32, 16, 4, 1))),
    (2, 2, 2, 40, 64, cfgs((32, 16, 4, 1), (16, 32, 4, 1), (32, 16, 4, 1))),
    # tensor-descriptor (TMA) loads: T a multiple of every tile, GQA and MHA
    (2, 4, 2, 64, 32, cfgs((32, 16, 4, 1, True), (16, 32, 4, 1, True), (32, 16, 4, 1, True))),
    (1, 2, 2, 32, 64, cfgs((32, 32, 4, 1, True), (32, 32, 4, 1, True), (32, 32, 4, 1, True))),
    (1, 2, 1, 32, 64, None),  # the configs the routing ships for these inputs
]


def shipped_triton(q, causal):
    """The Triton (fwd, bwd) configs ``choose`` gives these inputs (the last of each list)."""
    c = FA.choose(None, q.dtype, q.shape[2], q.shape[3], causal, False)
    return c.fwd[-1], c.bwd[-1]


def _poisoned(*shape_dtype_dev):
    return [torch.full(s, float("nan"), dtype=d, device=dev) for s, d, dev in shape_dtype_dev]


def _run_triton(q, k, v, do, causal, scale, fcfg, bcfg):
    B, H, T, D = q.shape
    if fcfg is None:
        fcfg, bcfg = shipped_triton(q, causal)
    o, lse = _poisoned(((B, H, T, D), q.dtype, q.device), ((B, H, T), torch.float32, q.device))
    FA.flash_attention_fwd_triton(q, k, v, causal, scale, o=o, lse=lse, config=fcfg)
    dq, dk, dv = _poisoned((q.shape, q.dtype, q.device), (k.shape, k.dtype, q.device), (v.shape, v.dtype, q.device))
    FA.flash_attention_bwd_triton(do, q, k, v, o, lse, causal, scale, dq=dq, dk=dk, dv=dv, config=bcfg)
    return o, lse, dq, dk, dv


@needs_triton
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("B,H,Hkv,T,D,configs", TINY)
def test_triton_matches_reference_fp32_tiny(B, H, Hkv, T, D, configs, causal):
    q, k, v, do = rand_qkv(B, H, Hkv, T, D, dtype=torch.float32, device=DEV, seed=T + D)
    scale = 0.2 if T == 17 else None
    got = _run_triton(q, k, v, do, causal, scale, *(configs or (None, None)))
    qd, kd, vd, dod = (t.double() for t in (q, k, v, do))
    o_ref, lse_ref = FA.flash_attention_fwd_ref(qd, kd, vd, causal, scale)
    want = (o_ref, lse_ref, *FA.flash_attention_bwd_ref(dod, qd, kd, vd, o_ref, lse_ref, causal, scale))
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), f"{name}: unwritten (NaN) elements"
        assert rel(a, b) < 1e-5, (name, rel(a, b))


@needs_triton
@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])  # causal: tail order + flip
def test_triton_program_order_keeps_the_bits(causal):
    """The Triton kernels' program order (``_tail_order``, the configs' ``tail_waves``) only decides which program
    runs when: head by head (0 waves), the last 1 or 3 heads tile-major (``plan_sms`` = 2 stands in for the
    device's SM count, so the tail is part of the grid), or every head tile-major give the same bits in all five
    outputs. The last differs from the first in every program's (tile, head), so a kernel that mapped ids wrongly would
    leave NaN or wrong rows."""
    q, k, v, do = rand_qkv(2, 4, 2, 40, 32, dtype=torch.float32, device=DEV, seed=3)
    runs = []
    for waves, n_sm in ((0, 132), (1, 2), (3, 2), (100, 132)):
        fcfg, bcfg = cfgs((32, 16, 4, 1), (16, 32, 4, 1), (32, 16, 4, 1), tail_waves=waves, plan_sms=n_sm)
        runs.append(_run_triton(q, k, v, do, causal, None, fcfg, bcfg))
    assert TR.tail_heads(2, 8, 2, 1) == 1 and TR.tail_heads(2, 8, 2, 3) == 3 and TR.tail_heads(2, 8, 132, 100) == 8
    for got in runs[1:]:
        for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, runs[0]):
            assert torch.isfinite(a).all(), f"{name}: unwritten (NaN) elements"
            assert torch.equal(a, b), name
    qd, kd, vd, dod = (t.double() for t in (q, k, v, do))
    o_ref, _ = FA.flash_attention_fwd_ref(qd, kd, vd, causal)
    assert rel(runs[0][0], o_ref) < 1e-5


@needs_triton
def test_public_dispatch_runs_the_reference_on_cpu():
    if HAS_CUDA:
        pytest.skip("on CUDA the public functions run Triton (covered by the GPU tests)")
    q, k, v, do = rand_qkv(1, 2, 1, 9, 32, dtype=torch.float32)
    o, lse = FA.flash_attention_fwd(q, k, v)
    o2, lse2 = FA.flash_attention_fwd_ref(q, k, v)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


# ---------------------------------------------------------------------------------------------------------
# GPU: fp32 and bf16, head dims 32/64/128, T from 1 to 16k, causal and not, GQA
# ---------------------------------------------------------------------------------------------------------
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1e-2, 1e-2)}  # (forward, gradients)
GPU_SHAPES = [  # B, H, Hkv, T
    (2, 4, 4, 1),
    (2, 4, 2, 77),
    (1, 4, 1, 1000),
    (1, 2, 2, 2048),
    (1, 4, 2, 4099),
]


def _run_routed(q, k, v, do, causal):
    """The public entry points: the kernels ``choose`` routes these inputs to (Gluon on sm_90 where it ships)."""
    o, lse = FA.flash_attention_fwd(q, k, v, causal)
    return (o, lse, *FA.flash_attention_bwd(do, q, k, v, o, lse, causal))


def _check_gpu(B, H, Hkv, T, D, dtype, causal, seed=0, fcfg=None, bcfg=None):
    """fcfg / bcfg: Triton configs run with NaN-poisoned outputs; None: the routed public entry points."""
    q, k, v, do = rand_qkv(B, H, Hkv, T, D, dtype=dtype, device="cuda", seed=seed)
    run = (
        (lambda: _run_routed(q, k, v, do, causal))
        if fcfg is None
        else (lambda: _run_triton(q, k, v, do, causal, None, fcfg, bcfg))
    )
    got = run()
    qd, kd, vd, dod = (t.double() for t in (q, k, v, do))
    o_ref, lse_ref = FA.flash_attention_fwd_ref(qd, kd, vd, causal)
    want = (o_ref, lse_ref, *FA.flash_attention_bwd_ref(dod, qd, kd, vd, o_ref, lse_ref, causal))
    tol_f, tol_b = TOL[dtype]
    errs = {}
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), f"{name}: unwritten (NaN) elements"
        errs[name] = rel(a, b)
        assert errs[name] < (tol_f if name in ("o", "lse") else tol_b), (name, errs)
    again = run()
    # the one-pass backward sums dq with fp32 reduce-adds in arrival order: the last bits may move
    onepass = fcfg is None and FA.bwd_route(do, q, k, v, got[0], got[1], causal)[0] == "onepass"
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, again):
        if name == "dq" and onepass:
            from xtrain.kernels.attention.gluon_onepass import runs_agree

            assert runs_agree(a, b), "dq: repeated one-pass runs differ by more than the summation order can"
        else:
            assert torch.equal(a, b), f"{name}: repeated runs differ (race?)"
    return errs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("B,H,Hkv,T", GPU_SHAPES)
def test_gpu_matches_reference(B, H, Hkv, T, D, dtype, causal):
    errs = _check_gpu(B, H, Hkv, T, D, dtype, causal, seed=T)
    print(
        f"\nGPUERR {str(dtype)[6:]} D={D} causal={causal} B={B} H={H} Hkv={Hkv} T={T} "
        + " ".join(f"{n}={e:.2e}" for n, e in errs.items())
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_long_16k(D, dtype, causal):
    errs = _check_gpu(1, 2, 1, 16384, D, dtype, causal, seed=7)
    print(
        f"\nGPUERR {str(dtype)[6:]} D={D} causal={causal} B=1 H=2 Hkv=1 T=16384 "
        + " ".join(f"{n}={e:.2e}" for n, e in errs.items())
    )


TMA_CONFIGS = {  # both load paths ship (by head dim and T), so both must stay correct
    torch.bfloat16: cfgs((128, 64, 4, 3, True), (64, 64, 4, 2, True), (64, 64, 4, 2, True)),
    torch.float32: cfgs((64, 32, 4, 2, True), (32, 64, 4, 2, True), (64, 32, 4, 2, True)),
}
PTR_CONFIGS = {
    torch.bfloat16: cfgs((128, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 2)),
    torch.float32: cfgs((64, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("path", ["tma", "pointer"])
def test_gpu_load_paths(path, causal, D, dtype):
    fcfg, bcfg = (TMA_CONFIGS if path == "tma" else PTR_CONFIGS)[dtype]
    errs = _check_gpu(2, 4, 2, 1024, D, dtype, causal, seed=D, fcfg=fcfg, bcfg=bcfg)
    print(
        f"\nGPUERR {path} {str(dtype)[6:]} D={D} causal={causal} B=2 H=4 Hkv=2 T=1024 "
        + " ".join(f"{n}={e:.2e}" for n, e in errs.items())
    )


GLUON_CASES = [  # B, H, Hkv, T, layout, dtype: MHA, GQA, MQA; one and several query tiles; an odd item count
    (2, 4, 4, 128, "contiguous", torch.bfloat16),  # (B·H·T/128 = 9 below: the persistent kernel's last pair is a
    (1, 3, 1, 384, "contiguous", torch.float16),  # single item); 16k: the longest the bench runs
    (1, 4, 2, 1024, "kv_bthd", torch.bfloat16),
    (2, 6, 1, 2048, "bthd", torch.float16),
    (1, 2, 1, 16384, "kv_bthd", torch.bfloat16),
]
GLUON_FWD = FA.shipped_configs()["fwd"]  # (D, GluonFwdConfig) for every forward config the routing ships


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True])  # the Gluon forward is causal only (non-causal calls run Triton)
@pytest.mark.parametrize("B,H,Hkv,T,layout,dtype", GLUON_CASES)
@pytest.mark.parametrize("D,cfg", GLUON_FWD, ids=repr)
def test_gpu_gluon_forward(D, cfg, B, H, Hkv, T, layout, dtype, causal):
    """Each shipped Gluon forward config against the fp64 reference: outputs NaN-poisoned (unwritten elements
    show), both input layouts its descriptors take (kv_bthd: k, v as [B, T, Hkv, D] seen through a transpose, as
    the model passes v; bthd: q too, and o follows q), repeated runs bit-identical, also on 5- and 7-program
    persistent grids (each program then walks several items, the mbarrier phases running on across them; an
    item's numbers do not depend on which program computes it). The two-warpgroup configs' half-width diagonal
    step on and off: the keys it skips add exact zeros, so the same bits. Tolerance: the bf16 forward's 1e-2
    (module docstring); fp16 rounds P and o at 2^-11, so the same bound holds with room."""
    from dataclasses import replace

    from xtrain.kernels.attention import gluon_fwd as G

    q, k, v, _ = rand_qkv(B, H, Hkv, T, D, dtype=dtype, device="cuda", seed=T + D)
    if layout == "bthd":  # [B, T, H, D] memory seen as [B, H, T, D]
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    if layout != "contiguous":
        k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    assert G.supported(q, k, v)
    o = torch.full_like(q, float("nan"))  # keeps q's strides (torch.preserve_format), as the launcher wants
    lse = torch.full((B, H, T), float("nan"), device="cuda")
    G.flash_attention_fwd_gluon(q, k, v, causal, o=o, lse=lse, config=cfg)
    o_ref, lse_ref = FA.flash_attention_fwd_ref(q.double(), k.double(), v.double(), causal)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    eo, el = rel(o, o_ref), rel(lse, lse_ref)
    assert eo < 1e-2 and el < 1e-5, (eo, el)
    for programs in (None, 5, 7):
        o2, lse2 = G.flash_attention_fwd_gluon(q, k, v, causal, config=cfg, programs=programs)
        assert o2.stride() == q.stride() and torch.equal(o, o2) and torch.equal(lse, lse2), programs
    if cfg.warpgroups == 2:
        o2, lse2 = G.flash_attention_fwd_gluon(q, k, v, causal, config=replace(cfg, half_diag=not cfg.half_diag))
        assert torch.equal(o, o2) and torch.equal(lse, lse2), "half_diag"
    print(
        f"\nGPUERR gluon {cfg} {layout} {str(dtype)[6:]} D={D} causal={causal} B={B} H={H} Hkv={Hkv} "
        f"T={T} o={eo:.2e} lse={el:.2e}"
    )


@pytest.mark.gpu
def test_gpu_gluon_dispatch_and_rejects():
    """flash_attention_fwd sends causal 16-bit hd128 T >= 1024 to the Gluon kernel (the same bits as calling it
    with the config ``choose`` gives), the Triton kernel computes the same attention with other bits, and the
    Gluon launcher rejects what it cannot take."""
    from xtrain.kernels.attention import gluon_fwd as G

    q, k, v, _ = rand_qkv(1, 4, 2, 1024, 128, dtype=torch.bfloat16, device="cuda", seed=3)
    choice = FA.choose((9, 0), q.dtype, 1024, 128, True, False)
    o, lse = FA.flash_attention_fwd(q, k, v, True)
    o_g, lse_g = G.flash_attention_fwd_gluon(q, k, v, True, config=choice.fwd[0])
    assert torch.equal(o, o_g) and torch.equal(lse, lse_g)
    o_t, _ = FA.flash_attention_fwd_triton(q, k, v, True, config=choice.fwd[-1])
    assert not torch.equal(o, o_t) and rel(o_t, o.double()) < 1e-2  # another kernel, the same attention
    for bad in (q[..., :1000, :], q.float(), q[..., :32]):  # ragged T, fp32, head dim 32
        with pytest.raises(ValueError, match="flash_attention_fwd_gluon"):
            kk = k[..., : bad.shape[2], : bad.shape[3]].to(bad.dtype).contiguous()
            G.flash_attention_fwd_gluon(bad.contiguous(), kk, kk, config=choice.fwd[0])


def test_choose_routes_as_documented():
    """No GPU needed: the one routing function. Off sm_90, fp32, non-causal or short T: Triton only; the Gluon
    forward from T = 1024 (hd128: one Q buffer and the half-width diagonal step up to 1024, two Q buffers above,
    ping-pong both; hd64: two warpgroups up to 2048, three above); the backward: the one-pass kernel for hd64 from
    1024 unless deterministic, the split for hd128 from 1024 (lse through the tensor cores for bf16 only) and
    for hd64 from 4096; the Triton kernel last in every list."""
    from xtrain.kernels.attention import GluonBwdConfig, GluonFwdConfig, OnepassConfig

    bf, fp16 = torch.bfloat16, torch.float16

    def kinds(c):
        return [type(x).__name__ for x in c.fwd], [type(x).__name__ for x in c.bwd]

    tri = (["TritonFwdConfig"], ["TritonBwdConfig"])
    for args in (((8, 0), bf, 4096, 128, True, False), (None, bf, 4096, 128, True, False)):
        assert kinds(FA.choose(*args)) == tri
    assert kinds(FA.choose((9, 0), torch.float32, 4096, 128, True, False)) == tri
    assert kinds(FA.choose((9, 0), bf, 4096, 128, False, False)) == tri
    assert kinds(FA.choose((9, 0), bf, 896, 64, True, False)) == tri
    assert FA.choose((9, 0), torch.float64, 1024, 64, True, False) == FA.Choice((), ())
    assert FA.choose(None, bf, 1024, 48, True, False) == FA.Choice((), ())
    fwd = {(D, T): FA.choose((9, 0), bf, T, D, True, False).fwd[0] for D in (64, 128) for T in (1024, 2048, 2176)}
    assert fwd[128, 1024] == GluonFwdConfig(1, True, 2, 2, True)
    assert fwd[128, 2048] == fwd[128, 2176] == GluonFwdConfig(2, True, 2, 2, False)
    assert fwd[64, 1024] == fwd[64, 2048] == GluonFwdConfig(2, False, 2, 3, True)
    assert fwd[64, 2176] == GluonFwdConfig(2, False, 3, 3, False)
    c = FA.choose((9, 0), bf, 1024, 64, True, False)
    assert c.bwd[0] == OnepassConfig() and kinds(c)[1] == ["OnepassConfig", "TritonBwdConfig"]
    assert kinds(FA.choose((9, 0), bf, 1024, 64, True, True))[1] == ["TritonBwdConfig"]
    assert kinds(FA.choose((9, 0), bf, 4096, 64, True, True))[1] == ["GluonBwdConfig", "TritonBwdConfig"]
    assert kinds(FA.choose((9, 0), bf, 4096, 64, True, False))[1] == [
        "OnepassConfig",
        "GluonBwdConfig",
        "TritonBwdConfig",
    ]
    assert FA.choose((9, 0), bf, 1024, 128, True, True).bwd[0] == GluonBwdConfig(lse_mma=True, doreg=True)
    assert FA.choose((9, 0), fp16, 1024, 128, True, False).bwd[0] == GluonBwdConfig(lse_mma=False, doreg=True)
    assert FA.choose((9, 0), bf, 4096, 64, True, True).bwd[0] == GluonBwdConfig()
    assert kinds(FA.choose((9, 0), bf, 896, 128, True, False))[1] == ["TritonBwdConfig"]


def _pair_rule(BH: int, n_m: int, G: int) -> list:
    """The persistent kernel's pair order, written out independently: heads one after another, each head's
    query tiles heaviest / lightest alternately (n_m - 1, 0, n_m - 2, 1, ...), cut into pairs of consecutive
    items, pair k to program k mod G; per program its codes bh * n_m + pid_m in order."""
    flat = [
        bh * n_m + m
        for bh in range(BH)
        for m in [x for i in range(n_m) for x in ((n_m - 1 - i // 2) if i % 2 == 0 else i // 2,)]
    ]
    per = [[] for _ in range(G)]
    for k in range(0, len(flat), 2):
        per[(k // 2) % G] += flat[k : k + 2]
    return per


def test_gluon_forward_schedule_tables():
    """No GPU needed: the persistent forward's schedule table. Every item exactly once; the pairs of all rounds
    but the last TAIL_ROUNDS full ones and the partial one, untouched; no program with more work than the
    plain pair rule gives it, and at the bench's shapes (B·H = 512: up to 4096 items of 1-8 tiles on 132
    programs) the most loaded program has less."""
    G = pytest.importorskip("xtrain.kernels.attention.gluon_fwd")
    for BH, T, NW, n_prog in (
        (512, 1024, 2, 132),
        (512, 2048, 2, 132),
        (512, 4096, 3, 132),
        (3, 384, 2, 5),
        (1, 128, 2, 1),
        (7, 1152, 3, 4),
        (2, 640, 2, 132),
    ):
        n_m = -(-T // (NW * 64))
        U = BH * n_m
        Gp = max(1, min(n_prog, (U + 1) // 2))  # the launcher's grid
        off, codes = G.schedule(BH, n_m, T, NW, Gp)
        assert len(off) == Gp + 1 and off[0] == 0 and off[-1] == U and sorted(codes) == list(range(U))
        per = [codes[off[p] : off[p + 1]] for p in range(Gp)]
        pairs = _pair_rule(BH, n_m, Gp)
        kept = max(0, (U + 1) // 2 // Gp - G.TAIL_ROUNDS)
        assert all(p[: 2 * kept] == r[: 2 * kept] for p, r in zip(per, pairs))

        def load(progs, n_m=n_m, T=T, NW=NW):
            return max(sum(G.item_tiles(c % n_m, n_m, T, NW) + G.ITEM_COST for c in p) for p in progs)

        assert load(per) <= load(pairs), (BH, T)
        if (BH, n_prog) == (512, 132):
            assert load(per) < load(pairs), (T, load(per), load(pairs))
    assert [G.item_tiles(m, 8, 1024, 2) for m in range(8)] == list(range(1, 9))
    assert [G.item_tiles(m, 6, 1024, 3) for m in (0, 1, 5)] == [1, 2, 8]  # 192-row items, shifted grid


def test_gluon_forward_refuses_non_causal_cpu():
    """No GPU needed: the Gluon forward is causal only (the routing sends non-causal calls to the Triton kernel),
    and says so before looking at anything else."""
    G = pytest.importorskip("xtrain.kernels.attention.gluon_fwd")
    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="flash_attention_fwd_gluon: causal attention only"):
        G.flash_attention_fwd_gluon(q, q, q, False, config=GLUON_FWD[0][1])


_FWD_INSTRS = ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg", "mbarrier.try_wait")


@pytest.fixture(scope="module")
def fwd_compiled():
    """Each shipped Gluon forward config compiled for sm_90 in ONE child process without the Triton interpreter
    (tests/_child.py says why). Returns {repr([i, bthd]): {instr: present, "sass": the SASS report}}."""
    from _child import run_without_interpreter

    G = pytest.importorskip("xtrain.kernels.attention.gluon_fwd")
    if not G.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon Hopper module")
    keys = [[i, bthd] for i in range(len(GLUON_FWD)) for bthd in (False, True)]
    return run_without_interpreter(f"""
import sys
sys.path.insert(0, "tests")
from _child import sass_report
from xtrain.kernels.attention import gluon_fwd as G, shipped_configs
shipped = shipped_configs()["fwd"]
out = {{}}
for key in {keys!r}:
    i, bthd = key
    D, cfg = shipped[i]
    ck = G.compile_sm90(D, cfg, transposed_kv=bthd)
    out[repr(key)] = {{x: x in ck.asm["ptx"] for x in {list(_FWD_INSTRS)!r}}}
    out[repr(key)]["sass"] = sass_report(ck)
""")


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(GLUON_FWD)), ids=[repr(c) for c in GLUON_FWD])
def test_gluon_forward_compiles_for_sm90(i, fwd_compiled):
    """No GPU needed: each shipped Gluon forward config compiles for sm_90 with the installed Triton (both K/V
    layouts) and uses what it is built on: wgmma, TMA bulk copies, setmaxnreg of the warp
    specialisation, mbarrier waits. And that ptxas did not serialise the wgmmas (the SASS, read with the cuobjdump
    Triton ships; its absence fails)."""
    for bthd in (False, True):
        got = dict(fwd_compiled[repr([i, bthd])])
        sass = got.pop("sass")
        assert all(got.values()), (GLUON_FWD[i], got)
        assert "not serialized" in sass, (GLUON_FWD[i], bthd, sass)


@pytest.mark.gpu
def test_gpu_public_op_and_dispatch():
    from xtrain.autograd import Var
    from xtrain.ops.flash import flash_attention

    q, k, v, do = rand_qkv(2, 4, 2, 300, 64, dtype=torch.bfloat16, device="cuda", seed=11)
    vs = [Var(t.clone(), requires_grad=True) for t in (q, k, v)]
    out = flash_attention(*vs)
    out.backward(do)
    qd, kd, vd, dod = (t.double() for t in (q, k, v, do))
    o_ref, lse_ref = FA.flash_attention_fwd_ref(qd, kd, vd, True)
    grads = FA.flash_attention_bwd_ref(dod, qd, kd, vd, o_ref, lse_ref, True)
    assert rel(out.data, o_ref) < 1e-2
    for x, g in zip(vs, grads):
        assert x.grad.dtype == torch.bfloat16 and rel(x.grad, g) < 1e-2


@needs_triton
@pytest.mark.parametrize("T", [1, 40, 130])
def test_bwd_preprocess_delta_and_base2_lse(T):
    """The backward's preprocess: delta = rowsum(dO ∘ O) always, and with SCALE_LSE also lse·log2(e) (the Gluon
    split's base-2 row statistic), the same fp32 product as torch's. The ragged last block writes
    nothing past the end (NaN sentinels after each buffer); without SCALE_LSE the lse2 buffer is not touched. COLS:
    the Gluon split's lse and delta columns (lse_mma), three bf16 parts that sum to the fp32 value."""
    B, H, D = 2, 3, 32
    g = torch.Generator().manual_seed(T)
    o, do = (torch.randn(B, H, T, D, generator=g).to(DEV) for _ in range(2))
    lse = (torch.randn(B, H, T, generator=g) * 5).to(DEV)
    args = dict(
        stride_ob=o.stride(0),
        stride_oh=o.stride(1),
        stride_ot=o.stride(2),
        stride_dob=do.stride(0),
        stride_doh=do.stride(1),
        stride_dot=do.stride(2),
        H=H,
        T=T,
        HEAD_DIM=D,
        BLOCK_M=64,
    )
    grid = ((T + 63) // 64, B * H)
    n = B * H * T
    for scale in (True, False):
        dbuf, lbuf = (torch.full((n + 64,), float("nan"), device=DEV) for _ in range(2))
        delta, lse2 = dbuf[:n].view(B, H, T), lbuf[:n].view(B, H, T)
        TR._flash_bwd_preprocess_kernel[grid](o, do, delta, lse, lse2, delta, delta, 1.0, **args, SCALE_LSE=scale)
        assert torch.isfinite(delta).all() and rel(delta, (o.double() * do.double()).sum(-1)) < 1e-6
        assert torch.isnan(dbuf[n:]).all() and torch.isnan(lbuf[n:]).all()
        if scale:
            assert torch.equal(lse2, lse * TR.LOG2E)
        else:
            assert torch.isnan(lse2).all()
    # COLS: -lse / scale and -delta as three bf16 parts (columns 0-2) summing to the fp32 value, zeros after
    C, inv = 16, 1 / 0.125
    cbufs = [torch.full((n * C + 64,), float("nan"), dtype=torch.bfloat16, device=DEV) for _ in range(2)]
    lsec, deltac = (b[: n * C].view(B, H, T, C) for b in cbufs)
    TR._flash_bwd_preprocess_kernel[grid](o, do, delta, lse, lse2, lsec, deltac, inv, **args, SCALE_LSE=True, COLS=C)
    for got, want in ((lsec, -lse.double() * inv), (deltac, -delta.double())):
        assert torch.isfinite(got).all() and not got[..., 3:].any()
        assert ((got[..., :3].double().sum(-1) - want).abs() <= 2.0**-20 * want.abs()).all()
        assert (got[..., 1].double().abs() <= 2.0**-7 * got[..., 0].double().abs()).all()  # within hi's ulp
    assert all(torch.isnan(b[n * C :].float()).all() for b in cbufs)
