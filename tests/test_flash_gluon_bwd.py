"""The Gluon flash-attention backward (xtrain/kernels/attention/gluon_bwd.py) against the fp64 reference.

GPU (``-m gpu``, an sm_90 GPU): dq, dk, dv against ``flash_attention_bwd_ref`` in fp64, with o and lse from
the fp64 forward reference cast to the input dtype (so the kernel and the oracle see the same rounded
inputs); bf16 and fp16, D 64 and 128, causal (the kernels' only form), MHA/GQA/MQA, T = 128 to 16k, the input
layouts the descriptors take; outputs NaN-poisoned (an unwritten element shows), repeated runs bit-identical (no
atomics). Tolerance: relative norm 1e-2, the bf16 gradient bound of tests/test_flash_attention.py (P and
dS are rounded to the input dtype before their products, as in every flash backward; fp16 rounds at
2^-11, so the same bound holds with room).
CPU: both kernels of every shipped config compile for sm_90 (no GPU needed) on the installed Triton and use what
they are built on; the launcher rejects what it cannot take with a ValueError naming the op.
"""

from __future__ import annotations

import math

import pytest
import torch
from _gluon_bwd_cases import LAYOUTS, in_layout, inputs, rel  # tests/_gluon_bwd_cases.py

from xtrain.kernels import attention as FA
from xtrain.kernels.attention import GluonBwdConfig
from xtrain.kernels.attention import gluon_bwd as GB
from xtrain.kernels.attention import gluon_common as GC
from xtrain.kernels.attention import triton as TR

SHIPPED = FA.shipped_configs()["bwd"]  # (D, GluonBwdConfig) of every split backward the routing runs


def shipped(D: int, dtype: torch.dtype) -> GluonBwdConfig:
    """The split config the routing runs for (D, dtype) (deterministic mode: hd64 too)."""
    return FA.choose((9, 0), dtype, 4096, D, True, True).bwd[0]


def _check(B, H, Hkv, T, D, dtype, causal, layout, seed, config=None):
    config = config or shipped(D, dtype)
    q, k, v, do, o, lse = inputs(B, H, Hkv, T, D, dtype, causal, seed)
    tr = LAYOUTS[layout]
    q, k, v, do, o = (in_layout(x, name in tr) for name, x in zip("q k v do o".split(), (q, k, v, do, o)))
    assert GB.supported_bwd(do, q, k, v, o, lse)
    bufs = {
        name: in_layout(torch.full_like(x, float("nan")), name in tr) for name, x in (("dq", q), ("dk", k), ("dv", v))
    }
    got = GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, causal, config=config, **bufs)
    assert all(a is bufs[n] for a, n in zip(got, ("dq", "dk", "dv")))
    want = FA.flash_attention_bwd_ref(do.double(), q.double(), k.double(), v.double(), o.double(), lse.double(), causal)
    errs = {}
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), f"{name}: unwritten (NaN) elements"
        errs[name] = rel(a, b)
    assert max(errs.values()) < 1e-2, errs
    again = GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, causal, config=config)
    for name, a, b in zip(("dq", "dk", "dv"), got, again):
        assert torch.equal(a, b), f"{name}: repeated runs differ (race?)"
    print(
        f"\nGPUERR gluon-bwd {layout} {str(dtype)[6:]} D={D} causal={causal} B={B} H={H} Hkv={Hkv} T={T} "
        f"config={config} " + " ".join(f"{n}={e:.2e}" for n, e in errs.items())
    )


SHAPES = [  # B, H, Hkv, T: MHA with one tile, GQA, MQA over several tiles and batches
    (2, 4, 4, 128),
    (1, 4, 2, 1024),
    (2, 6, 1, 2048),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [True])
@pytest.mark.parametrize("B,H,Hkv,T", SHAPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpu_gluon_bwd_matches_reference(layout, B, H, Hkv, T, D, causal, dtype):
    _check(B, H, Hkv, T, D, dtype, causal, layout, seed=T + D)


@pytest.mark.gpu
def test_gpu_gluon_bwd_long_16k():
    _check(1, 2, 1, 16384, 128, torch.bfloat16, True, "model", seed=7)


@pytest.mark.gpu
def test_gpu_gluon_bwd_tail_order():
    """The programs' start order (``_tail_order``) changes no bit: 24 heads of 16 tiles, so with the shipped two
    waves the last 17 heads start tile-major and the first 7 head by head; against every head in turn (0 waves),
    one wave and all heads tile-major, and against the fp64 reference."""
    from dataclasses import replace

    cfg = shipped(128, torch.bfloat16)
    for causal in (True,):
        q, k, v, do, o, lse = inputs(2, 12, 12, 2048, 128, torch.bfloat16, causal, seed=11)
        assert 0 < GC.tail_heads(16, 24, TR.grid_sms(q.device)) < 24
        base = GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, causal, config=cfg)
        ins64 = (x.double() for x in (do, q, k, v, o, lse))
        want = FA.flash_attention_bwd_ref(*ins64, causal)
        assert max(rel(a, b) for a, b in zip(base, want)) < 1e-2
        for waves in (0, 1, 100):
            got = GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, causal, config=replace(cfg, tail_waves=waves))
            assert all(torch.equal(a, b) for a, b in zip(got, base)), waves


def test_gluon_bwd_tail_order_is_a_permutation():
    """The mirror of the kernels' program order: every (tile, head) once; the head-major part first, then the
    last ``tail`` heads tile by tile (tile 0, the heaviest, of each of them first), for tails of 0, some and all
    heads."""
    for nb, heads in ((1, 5), (16, 24), (8, 3), (128, 16)):
        for tail in sorted({0, 1, min(3, heads), heads, GC.tail_heads(nb, heads, 132)}):
            order = [GC.tail_order(p, nb, heads, tail) for p in range(nb * heads)]
            assert sorted(order) == [(t, h) for t in range(nb) for h in range(heads)]
            first = (heads - tail) * nb
            assert order[:first] == [(p % nb, p // nb) for p in range(first)]
            tiles = [t for t, _ in order[first:]]
            assert tiles == sorted(tiles) and {h for _, h in order[first:]} == set(range(heads - tail, heads))
    assert GC.tail_heads(16, 1000, 132) == 17 and GC.tail_heads(128, 16, 132) == 3 and GC.tail_heads(8, 2, 132) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [True])
def test_gpu_gluon_bwd_doreg_is_bit_identical(D, causal):
    """``doreg`` (the dQ kernel's dO half as dP's A operand from registers; shipped at hd128, not at hd64) reads
    the same bf16 values as the shared-memory operand it replaces, so every bit stays, GQA."""
    q, k, v, do, o, lse = inputs(2, 4, 2, 1024, D, torch.bfloat16, causal, seed=D + 11)
    ref = GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, causal, config=GluonBwdConfig(doreg=False))
    got = GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, causal, config=GluonBwdConfig(doreg=True))
    for name, a, b in zip(("dq", "dk", "dv"), got, ref):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())


@pytest.mark.gpu
def test_gpu_gluon_bwd_rejects():
    q, k, v, do, o, lse = inputs(1, 4, 2, 256, 128, torch.bfloat16, True, seed=3)
    cfg = shipped(128, torch.bfloat16)
    dq, dk, dv = GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, config=cfg)
    tri = FA.choose(None, q.dtype, 256, 128, True, False).bwd[-1]
    ref = FA.flash_attention_bwd_triton(do, q, k, v, o, lse, config=tri)
    assert all(rel(a, b) < 1e-2 for a, b in zip((dq, dk, dv), ref))
    op = "flash_attention_bwd_gluon"
    sub = lambda x, t, d: x[..., :t, :d].contiguous()  # noqa: E731
    bad = [  # (do, q, k, v, o, lse): ragged T, fp32, head dim 32, a layout the descriptors do not take
        tuple(sub(x, 200, 128) for x in (do, q, k, v, o)) + (lse[..., :200].contiguous(),),
        (do.float(), q.float(), k.float(), v.float(), o.float(), lse),
        tuple(sub(x, 256, 32) for x in (do, q, k, v, o)) + (lse,),
        (do, q.transpose(2, 3).contiguous().transpose(2, 3), k, v, o, lse),
    ]
    for args in bad:
        assert not GB.supported_bwd(*args)
        with pytest.raises(ValueError, match=op):
            GB.flash_attention_bwd_gluon(*args, config=cfg)
    with pytest.raises(ValueError, match=op):  # mismatched shapes
        GB.flash_attention_bwd_gluon(do, q, k[:, :, :128], v, o, lse, config=cfg)
    bad_dq = torch.empty(1, 4, 256, 256, device="cuda", dtype=q.dtype)[..., :128]  # not a descriptor layout
    assert GB.supported_bwd(do, q, k, v, o, lse) and not GB.supported_bwd(do, q, k, v, o, lse, dq=bad_dq)
    with pytest.raises(ValueError, match=op):
        GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, dq=bad_dq, config=cfg)
    with pytest.raises(ValueError, match=op):
        GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, scale=-1.0, config=cfg)
    with pytest.raises(ValueError, match="lse_mma takes bf16"):
        GB.flash_attention_bwd_gluon(do.half(), q.half(), k.half(), v.half(), o.half(), lse, config=cfg)


def test_gluon_bwd_rejects_on_cpu():
    """No GPU needed: CPU tensors (and malformed inputs) never reach a kernel."""
    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 128)
    assert not GB.supported_bwd(q, q, q, q, q, lse)
    with pytest.raises(ValueError, match="flash_attention_bwd_gluon"):
        GB.flash_attention_bwd_gluon(q, q, q, q, q, lse, config=GluonBwdConfig())
    with pytest.raises(ValueError, match="flash_attention_bwd_gluon"):
        GB.flash_attention_bwd_gluon(q, q, q[:, :, :64], q, q, lse, config=GluonBwdConfig())
    with pytest.raises(ValueError, match="flash_attention_bwd_gluon: causal attention only"):
        GB.flash_attention_bwd_gluon(q, q, q, q, q, lse, False, config=GluonBwdConfig())


@pytest.mark.slow
def test_gluon_bwd_compiles_for_sm90():
    """No GPU needed: both kernels of every shipped config compile for sm_90 with the installed Triton (GQA;
    hd128 on the transposed layout; the MHA builds, where GROUP = 1 is a constant; in a child
    process without the Triton interpreter, tests/_child.py) and use what they are built on: wgmma, TMA bulk
    copies, setmaxnreg of the warp specialisation, mbarrier waits; and no atomics (the backward is
    deterministic). And that ptxas did not serialise the wgmmas (a wait after every HGMMA in the SASS: what a wgmma
    left in flight across a loop's back edge, or too few registers, make it do), read with the cuobjdump Triton's
    NVIDIA backend ships; its absence fails the test."""
    from _child import run_without_interpreter

    if not GC.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon Hopper module")
    instrs = ["wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg", "mbarrier.try_wait", "atom.global", "red.global"]
    got = run_without_interpreter(f"""
import sys
sys.path.insert(0, "tests")
from _child import sass_report
from xtrain.kernels.attention import gluon_bwd as GB, shipped_configs
out = []
for i, (D, cfg) in enumerate(shipped_configs()["bwd"]):
    for transposed, mha in ((False, False), (False, True), (True, False)):
        if transposed and D != 128:
            continue
        for name, ck in GB.compile_sm90(D, cfg, transposed=transposed, mha=mha).items():
            out.append([D, i, name, {{x: x in ck.asm["ptx"] for x in {instrs!r}}}, sass_report(ck)])
""")
    assert len(got) == 2 * (2 * len(SHIPPED) + sum(D == 128 for D, _ in SHIPPED))
    for D, i, name, has, sass in got:
        for instr in instrs[:4]:
            assert has[instr], (D, SHIPPED[i], name, instr)
        assert not has["atom.global"] and not has["red.global"], (D, name)
        assert "not serialized" in sass, (D, SHIPPED[i], name, sass)


def test_gluon_bwd_shipped_configs():
    """The split backward ships three builds: hd64 plain, hd128 with the dO half in registers, and for bf16 also
    lse and delta through the tensor cores (fp16's range cannot hold every -delta as a column)."""
    assert SHIPPED == sorted(
        [(64, GluonBwdConfig()), (128, GluonBwdConfig(doreg=True)), (128, GluonBwdConfig(lse_mma=True, doreg=True))],
        key=repr,
    )
    assert math.isclose(GC.LOG2E, 1.0 / math.log(2.0))


@pytest.mark.gpu
def test_gpu_dispatch_sends_hd128_backward_to_gluon():
    """flash_attention_bwd runs the Gluon backward for causal 16-bit hd128 at T >= 1024 (its route, and the bits
    of calling it directly, which the Triton kernels' do not give); the Triton kernels compute the same
    gradients; T < 1024 stays on Triton."""
    q, k, v, do, o, lse = inputs(1, 4, 2, 1024, 128, torch.bfloat16, True, seed=5)
    assert FA.bwd_route(do, q, k, v, o, lse, True)[0] == "gluon"
    got = FA.flash_attention_bwd(do, q, k, v, o, lse, True)
    direct = GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, True, config=shipped(128, torch.bfloat16))
    assert all(torch.equal(a, b) for a, b in zip(got, direct))
    tri_cfg = FA.choose(None, q.dtype, 1024, 128, True, False).bwd[-1]
    tri = FA.flash_attention_bwd_triton(do, q, k, v, o, lse, True, config=tri_cfg)
    assert all(rel(a, b.double()) < 1e-2 for a, b in zip(tri, got))
    assert not all(torch.equal(a, b) for a, b in zip(tri, got))  # so the equality above names the kernel
    short = (*(x[..., :512, :] for x in (do, q, k, v, o)), lse[..., :512].contiguous())
    assert FA.bwd_route(*short, True)[0] == "triton"  # T < GLUON_BWD_MIN_T


def test_row_view_takes_token_rows_wider_than_the_heads():
    """v as a column slice of the stacked q/k/v product ([B*T, S] rows, S > Hkv*D) is a layout the descriptors take
    (the 2-D view is the slice itself, no copy); a layout with neither form is None."""
    B, T, H, D, S = 2, 5, 3, 8, 7 * 8
    rows = torch.randn(B * T, S)
    v = rows[:, 4 * D : 4 * D + H * D].view(B, T, H, D).transpose(1, 2)
    view, rb, rh, ch = GC._row_view(v)
    assert view.data_ptr() == v.data_ptr() and view.stride() == (S, 1) and (rb, rh, ch) == (T, 0, D)
    assert torch.equal(view, rows[:, 4 * D : 4 * D + H * D])
    assert GC._row_view(torch.randn(B, T, D, H).permute(0, 3, 1, 2)) is None
    # its gradient buffer: dense token rows seen through the same transpose (dv back to rows without a transpose)
    dv = GC.fresh_grad(v)
    assert dv.shape == v.shape and dv.stride() == (T * H * D, D, H * D, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_v_as_a_column_slice_gives_the_bits_of_v_apart_gpu():
    """Attention at the routes the model takes on an H100/H200 (T = 1024, hd64: the Gluon forward and one-pass
    backward) with v a column slice of the stacked q/k/v product: o, dk and dv bit for bit those of the same v
    contiguous (dq sums by atomics: ``runs_agree``)."""
    from xtrain.kernels.attention import gluon_onepass as OP

    B, T, H, Hkv, D = 2, 1024, 4, 2, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()  # noqa: E731
    q, k, do = r(B, H, T, D), r(B, Hkv, T, D), r(B, H, T, D)
    wide = r(B * T, (H + 2 * Hkv) * D)
    v_slice = wide[:, (H + Hkv) * D :].view(B, T, Hkv, D).transpose(1, 2)
    v_rows = v_slice.transpose(1, 2).contiguous().transpose(1, 2)  # the same values as token rows of their own
    outs = []
    for v in (v_slice, v_rows):
        o, lse = FA.flash_attention_fwd(q, k, v, True)
        outs.append((o, *FA.flash_attention_bwd(do, q, k, v, o, lse, True)))
    (o1, dq1, dk1, dv1), (o2, dq2, dk2, dv2) = outs
    assert torch.equal(o1, o2) and torch.equal(dk1, dk2) and torch.equal(dv1, dv2)
    assert OP.runs_agree(dq1, dq2)
