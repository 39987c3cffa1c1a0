"""The Gluon flash-attention backward (xtrain/kernels/flash_attention_gluon_bwd.py) against the fp64 reference.

GPU (``-m gpu``, an sm_90 GPU): dq, dk, dv against ``flash_attention_bwd_ref`` in fp64, with o and lse from
the fp64 forward reference cast to the input dtype (so the kernel and the oracle see the same rounded
inputs); bf16 and fp16, D 64 and 128, causal and not, MHA/GQA/MQA, T = 128 to 16k, the input layouts the
descriptors take; outputs NaN-poisoned (an unwritten element shows), repeated runs bit-identical (no
atomics). Tolerance: relative norm 1e-2, the bf16 gradient bound of tests/test_flash_attention.py (P and
dS are rounded to the input dtype before their products, as in every flash backward; fp16 rounds at
2^-11, so the same bound holds with room).
CPU: both kernels compile for sm_90 (no GPU needed) on the installed Triton and use what they are built
on; the launcher rejects what it cannot take with a ValueError naming the op.
"""

from __future__ import annotations

import math

import pytest
import torch
from _gluon_bwd_cases import LAYOUTS, in_layout, inputs, rel  # tests/_gluon_bwd_cases.py

from xtrain.kernels import flash_attention as FA

GB = pytest.importorskip("xtrain.kernels.flash_attention_gluon_bwd")


def _check(B, H, Hkv, T, D, dtype, causal, layout, seed, config=None):
    q, k, v, do, o, lse = inputs(B, H, Hkv, T, D, dtype, causal, seed)
    tr = LAYOUTS[layout]
    q, k, v, do, o = (in_layout(x, name in tr) for name, x in zip("q k v do o".split(), (q, k, v, do, o)))
    assert GB.supported_bwd(do, q, k, v, o, lse)
    bufs = {
        name: in_layout(torch.full_like(x, float("nan")), name in tr) for name, x in (("dq", q), ("dk", k), ("dv", v))
    }
    got = GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, causal, config=config, **bufs)
    assert all(a is bufs[n] for a, n in zip(got, ("dq", "dk", "dv")))
    want = GB.reference(do.double(), q.double(), k.double(), v.double(), o.double(), lse.double(), causal)
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
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("B,H,Hkv,T", SHAPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpu_gluon_bwd_matches_reference(layout, B, H, Hkv, T, D, causal, dtype):
    _check(B, H, Hkv, T, D, dtype, causal, layout, seed=T + D)


@pytest.mark.gpu
def test_gpu_gluon_bwd_long_16k():
    _check(1, 2, 1, 16384, 128, torch.bfloat16, True, "model", seed=7)


@pytest.mark.gpu
def test_gpu_gluon_bwd_tail_order(monkeypatch):
    """The programs' start order (``_tail_order``) changes no bit: 24 heads of 16 tiles, so with the default two
    waves the last 17 heads start tile-major and the first 7 head by head; against every head in turn (0 waves),
    one wave and all heads tile-major, causal and not, and against the fp64 reference."""
    for causal in (True, False):
        q, k, v, do, o, lse = inputs(2, 12, 12, 2048, 128, torch.bfloat16, causal, seed=11)
        assert 0 < GB.tail_heads(16, 24, FA.grid_sms(q.device)) < 24
        base = GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, causal)
        want = GB.reference(do.double(), q.double(), k.double(), v.double(), o.double(), lse.double(), causal)
        assert max(rel(a, b) for a, b in zip(base, want)) < 1e-2
        for waves in (0, 1, 100):
            monkeypatch.setattr(GB, "TAIL_WAVES", waves)
            got = GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, causal)
            assert all(torch.equal(a, b) for a, b in zip(got, base)), waves
        monkeypatch.undo()


def test_gluon_bwd_tail_order_is_a_permutation():
    """The mirror of the kernels' program order: every (tile, head) once; the head-major part first, then the
    last ``tail`` heads tile by tile (tile 0, the heaviest, of each of them first), for tails of 0, some and all
    heads."""
    for nb, heads in ((1, 5), (16, 24), (8, 3), (128, 16)):
        for tail in sorted({0, 1, min(3, heads), heads, GB.tail_heads(nb, heads, 132)}):
            order = [GB.tail_order(p, nb, heads, tail) for p in range(nb * heads)]
            assert sorted(order) == [(t, h) for t in range(nb) for h in range(heads)]
            first = (heads - tail) * nb
            assert order[:first] == [(p % nb, p // nb) for p in range(first)]
            tiles = [t for t, _ in order[first:]]
            assert tiles == sorted(tiles) and {h for _, h in order[first:]} == set(range(heads - tail, heads))
    assert GB.tail_heads(16, 1000, 132) == 17 and GB.tail_heads(128, 16, 132) == 3 and GB.tail_heads(8, 2, 132) == 2


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [
        "split3",
        "split_wide",
        "split_s9",
        "split_s10",
        "split_s14",
        "split_peel",
        "split_dqskip",
        "split_s26",
        "split_lse",
        "split_lsed",
        "split_s27",
        "split_doreg",
        (64, 2, 64, 3, 1),
        (64, 2, 64, 3, 2),
        (64, 2, 64, 3, 7),
        (64, 3, 64, 2, 12),
    ],
)
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_gluon_bwd_configs(config, D):
    """The bench's other configs stay correct (GQA, causal and not)."""
    for causal in (True, False):
        _check(2, 4, 2, 1024, D, torch.bfloat16, causal, "model", seed=D + 1, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_gluon_bwd_skip_is_bit_identical(D):
    """Skipping the causal steps whose keys all follow their queries (P = 0) changes no bit: those steps add
    exact zeros. OPT_PEEL (the dK/dV walk's diagonal steps in a loop of their own), OPT_DQSKIP and both (the
    default from session 15 to 26, and still at hd64) against session 13's default, GQA, T not a power of two."""
    q, k, v, do, o, lse = inputs(2, 4, 2, 1408, D, torch.bfloat16, True, seed=D + 7)
    ref = GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, config="split_s14")
    for config in ("split_peel", "split_dqskip", "split_s26"):
        got = GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, config=config)
        for name, a, b in zip(("dq", "dk", "dv"), got, ref):
            assert torch.equal(a, b), (config, name, (a.float() - b.float()).abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_gluon_bwd_doreg_is_bit_identical(D, causal):
    """OPT_DOREG (the dQ kernel's dO half as dP's A operand from registers) reads the same bf16 values as the
    shared-memory operand it replaces, so every bit stays: against the config without it, GQA."""
    q, k, v, do, o, lse = inputs(2, 4, 2, 1024, D, torch.bfloat16, causal, seed=D + 11)
    ref = GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, causal, config="split_s27")
    got = GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, causal, config="split_doreg")
    assert GB._config("t", "split_doreg", D)[4] == GB._config("t", "split_s27", D)[4] | GB.OPT_DOREG
    for name, a, b in zip(("dq", "dk", "dv"), got, ref):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())


@pytest.mark.gpu
def test_gpu_gluon_bwd_rejects():
    q, k, v, do, o, lse = inputs(1, 4, 2, 256, 128, torch.bfloat16, True, seed=3)
    dq, dk, dv = GB.flash_attention_bwd_gluon(do, q, k, v, o, lse)
    ref = FA.flash_attention_bwd_triton(do, q, k, v, o, lse)
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
            GB.flash_attention_bwd_gluon(*args)
    with pytest.raises(ValueError, match=op):  # mismatched shapes
        GB.flash_attention_bwd_gluon(do, q, k[:, :, :128], v, o, lse)
    bad_dq = torch.empty(1, 4, 256, 256, device="cuda", dtype=q.dtype)[..., :128]  # not a descriptor layout
    assert GB.supported_bwd(do, q, k, v, o, lse) and not GB.supported_bwd(do, q, k, v, o, lse, dq=bad_dq)
    with pytest.raises(ValueError, match=op):
        GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, dq=bad_dq)
    with pytest.raises(ValueError, match=op):
        GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, config=(96, 2, 64, 2))
    with pytest.raises(ValueError, match=op):
        GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, scale=-1.0)
    with pytest.raises(ValueError, match=op):  # a removed persistent config
        GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, config="pers")


def test_gluon_bwd_rejects_on_cpu():
    """No GPU needed: CPU tensors (and malformed inputs) never reach a kernel."""
    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 128)
    assert not GB.supported_bwd(q, q, q, q, q, lse)
    with pytest.raises(ValueError, match="flash_attention_bwd_gluon"):
        GB.flash_attention_bwd_gluon(q, q, q, q, q, lse)
    with pytest.raises(ValueError, match="flash_attention_bwd_gluon"):
        GB.flash_attention_bwd_gluon(q, q, q[:, :, :64], q, q, lse)


def test_gluon_bwd_compiles_for_sm90():
    """No GPU needed: both kernels of the default config compile for sm_90 with the installed Triton (hd64
    causal, hd128 non-causal on the transposed layout, and the bench's causal MHA builds at both head dims, where
    GROUP = 1 is a constant: 8 compiles, in a child process without the Triton interpreter, tests/_child.py; the
    other configs: bench/gluon_flash_bwd.py --compile-only) and use what
    they are built on: wgmma, TMA bulk copies, setmaxnreg of the warp specialisation, mbarrier waits; and no
    atomics (the backward is deterministic). Where cuobjdump is at hand (Triton's NVIDIA backend ships it), also
    that ptxas did not serialise the wgmmas (a wait after every HGMMA in the SASS: what a wgmma left in flight
    across a loop's back edge, or too few registers, make it do; session 10 met both, and session 15 a peeled walk
    whose hd64 MHA build alone was serialised)."""
    from _child import run_without_interpreter

    if not GB.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon Hopper module")
    instrs = ["wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg", "mbarrier.try_wait", "atom.global", "red.global"]
    got = run_without_interpreter(f"""
from bench.gluon_flash_bwd_onepass import ptxas_report
from xtrain.kernels import flash_attention_gluon_bwd as GB
out = []
for D, causal, transposed, mha in ((64, True, False, False), (128, False, True, False), (64, True, False, True),
                                  (128, True, False, True)):
    for name, ck in GB.compile_sm90(D, causal, GB.DEFAULT, transposed=transposed, mha=mha).items():
        out.append([D, name, {{i: i in ck.asm["ptx"] for i in {instrs!r}}}, ptxas_report(ck)])
""")
    assert len(got) == 8
    for D, name, has, sass in got:
        for instr in instrs[:4]:
            assert has[instr], (D, name, instr)
        assert not has["atom.global"] and not has["red.global"], (D, name)
        if not sass.startswith("SASS n/a"):
            assert "not serialized" in sass, (D, name, sass)


def test_gluon_bwd_module_contract():
    assert GB.reference is FA.flash_attention_bwd_ref
    assert set(GB.CONFIGS) == {
        "split",
        "split_s14",
        "split_s10",
        "split_s9",
        "split3",
        "split_wide",
        "split_peel",
        "split_dqskip",
        "split_s26",
        "split_lse",
        "split_lsed",
        "split_s27",
        "split_doreg",
    }
    assert GB.DEFAULT == "split"
    s26 = GB.OPT_DQP | GB.OPT_LEAN | GB.OPT_SMEM | GB.OPT_PEEL | GB.OPT_DQSKIP
    assert GB._config("t", None, 64) == GB._config("t", "split_s26", 128) == (64, 2, 64, 4, s26)
    s27 = s26 | GB.OPT_LSEMMA | GB.OPT_DMMA
    assert GB._config("t", "split_s27", 128) == (64, 2, 64, 4, s27)
    assert GB._config("t", None, 128) == (64, 2, 64, 4, s27 | GB.OPT_DOREG)
    # the column options run for bf16 only (fp16's range cannot hold every -delta); the rest of a config stays
    assert GB.for_dtype(GB._config("t", None, 128), torch.bfloat16) == GB._config("t", None, 128)
    assert GB.for_dtype(GB._config("t", None, 128), torch.float16) == (64, 2, 64, 4, s26 | GB.OPT_DOREG)
    assert GB.for_dtype(GB._config("t", "split_s10", 128), torch.float16) == GB._config("t", "split_s10", 128)
    assert GB._config("t", "split_s14", 128) == (64, 2, 64, 4, GB.OPT_DQP | GB.OPT_LEAN | GB.OPT_SMEM)
    assert GB._config("t", "split_s10", 128) == (64, 2, 64, 4, GB.OPT_PF | GB.OPT_DQP)
    assert GB._config("t", (64, 2, 64, 2), 128) == (64, 2, 64, 2, 0)  # options may be left out
    # LEAN needs PF or SMEM; SMEM needs LEAN and excludes PF; PEEL (16) needs SMEM and BLOCK_M1 64; LSEMMA (64)
    # needs PEEL, DMMA (128) LSEMMA; 512 is no option
    for bad in (
        (64, 2, 64, 2, 4),
        (64, 2, 64, 2, 8),
        (64, 2, 64, 2, 13),
        (64, 2, 64, 2, 16),
        (64, 2, 64, 2, 64),
        (64, 2, 64, 2, 23),
        (128, 2, 64, 2, 30),
        (64, 2, 64, 2, -1),
        (64, 2, 64, 4, 62 | 128),
        (64, 2, 64, 4, 14 | 64),
        (64, 2, 64, 4, 512),
        (64, 2, 64, 2, 0, 0),
        (64, 2, 64),
        "nope",
    ):
        with pytest.raises(ValueError, match="t: "):
            GB._config("t", bad, 128)
    assert math.isclose(GB.LOG2E, 1.0 / math.log(2.0))


@pytest.mark.gpu
def test_gpu_dispatch_sends_hd128_backward_to_gluon(monkeypatch):
    """flash_attention_bwd_triton runs the Gluon backward for causal 16-bit hd128 at T >= 1024 (and not with
    BWD_GLUON off), with the same result as calling it. (The Triton kernels' gradients came out bit-identical
    to the Gluon kernels' on the H200 — same tile order, same wgmma reductions — so the call is counted.)"""
    calls = []
    real = GB.flash_attention_bwd_gluon

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(GB, "flash_attention_bwd_gluon", counted)
    q, k, v, do, o, lse = inputs(1, 4, 2, 1024, 128, torch.bfloat16, True, seed=5)
    got = FA.flash_attention_bwd_triton(do, q, k, v, o, lse, True)
    assert len(calls) == 1
    direct = real(do, q, k, v, o, lse, True)
    assert all(torch.equal(a, b) for a, b in zip(got, direct))
    monkeypatch.setattr(FA, "BWD_GLUON", False)
    tri = FA.flash_attention_bwd_triton(do, q, k, v, o, lse, True)
    assert len(calls) == 1
    assert all(rel(a, b.double()) < 1e-2 for a, b in zip(tri, got))
    monkeypatch.setattr(FA, "BWD_GLUON", True)
    FA.flash_attention_bwd_triton(
        do[..., :512, :],
        q[..., :512, :],
        k[..., :512, :],
        v[..., :512, :],
        o[..., :512, :],
        lse[..., :512].contiguous(),
        True,
    )
    assert len(calls) == 1  # T < GLUON_BWD_MIN_T: Triton
