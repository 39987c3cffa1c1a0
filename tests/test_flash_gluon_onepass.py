"""The Gluon one-pass flash-attention backward (xtrain/kernels/attention/gluon_onepass.py, hd64).

GPU (``-m gpu``, an sm_90 GPU): dq, dk, dv against ``flash_attention_bwd_ref`` in fp64 (o and lse from the
fp64 forward reference cast to the input dtype), bf16 and fp16, causal (its only form), MHA/GQA/MQA, T = 128 to 16k,
the input layouts the descriptors take, outputs NaN-poisoned. Tolerance: relative norm 1e-2, the bf16
gradient bound of tests/test_flash_attention.py. Repeated runs: dk and dv bit-identical (each is summed inside
one program), dq within ``runs_agree`` (fp32 reduce-adds land in any order). The dispatcher sends causal
16-bit hd64 there from ONEPASS_MIN_T, and not in deterministic mode.
CPU: the kernel compiles for sm_90 and uses what it is built on (including the reduce-add); the dq convert
kernel equals its reference through the interpreter; ``runs_agree`` rejects a perturbed tile; bad input raises
ValueError naming the op.
"""

from __future__ import annotations

import os

import pytest
import torch
from _gluon_bwd_cases import LAYOUTS, in_layout, inputs, rel  # tests/_gluon_bwd_cases.py

from xtrain.kernels import attention as FA
from xtrain.kernels.attention import gluon_onepass as OP
from xtrain.kernels.attention.reference import flash_attention_bwd_ref

HAS_CUDA = torch.cuda.is_available()


def _check(B, H, Hkv, T, dtype, causal, layout, seed, config=OP.OnepassConfig()):
    q, k, v, do, o, lse = inputs(B, H, Hkv, T, 64, dtype, causal, seed)
    tr = LAYOUTS[layout]
    q, k, v, do, o = (in_layout(x, name in tr) for name, x in zip("q k v do o".split(), (q, k, v, do, o)))
    assert OP.supported_bwd(do, q, k, v, o, lse)
    bufs = {
        name: in_layout(torch.full_like(x, float("nan")), name in tr) for name, x in (("dq", q), ("dk", k), ("dv", v))
    }
    got = OP.flash_attention_bwd_gluon_onepass(do, q, k, v, o, lse, causal, config=config, **bufs)
    assert all(a is bufs[n] for a, n in zip(got, ("dq", "dk", "dv")))
    want = flash_attention_bwd_ref(do.double(), q.double(), k.double(), v.double(), o.double(), lse.double(), causal)
    errs = {}
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), f"{name}: unwritten (NaN) elements"
        errs[name] = rel(a, b)
    assert max(errs.values()) < 1e-2, errs
    for _ in range(3):
        again = OP.flash_attention_bwd_gluon_onepass(do, q, k, v, o, lse, causal, config=config)
        assert OP.runs_agree(again[0], got[0]), "dq: repeated runs differ by more than the summation order can"
        assert torch.equal(again[1], got[1]) and torch.equal(again[2], got[2]), "dk/dv: repeated runs differ"
    print(
        f"\nGPUERR gluon-onepass {layout} {str(dtype)[6:]} causal={causal} B={B} H={H} Hkv={Hkv} T={T} "
        f"config={config} " + " ".join(f"{n}={e:.2e}" for n, e in errs.items())
    )


SHAPES = [  # B, H, Hkv, T: one key tile (one step per head), GQA, MQA over several tiles and batches
    (2, 4, 4, 128),
    (1, 4, 2, 1024),
    (2, 6, 1, 2048),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True])
@pytest.mark.parametrize("B,H,Hkv,T", SHAPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpu_onepass_matches_reference(layout, B, H, Hkv, T, causal, dtype):
    _check(B, H, Hkv, T, dtype, causal, layout, seed=T + H)


@pytest.mark.gpu
def test_gpu_onepass_long_16k():
    _check(1, 2, 1, 16384, torch.bfloat16, True, "model", seed=7)


@pytest.mark.gpu
def test_gpu_onepass_rejects():
    q, k, v, do, o, lse = inputs(1, 4, 2, 256, 64, torch.bfloat16, True, seed=3)
    op = "flash_attention_bwd_gluon_onepass"
    sub = lambda x, t, d: x[..., :t, :d].contiguous()  # noqa: E731
    bad = [  # ragged T, fp32, head dim 32, a layout the descriptors do not take
        tuple(sub(x, 200, 64) for x in (do, q, k, v, o)) + (lse[..., :200].contiguous(),),
        (do.float(), q.float(), k.float(), v.float(), o.float(), lse),
        tuple(sub(x, 256, 32) for x in (do, q, k, v, o)) + (lse,),
        (do, q.transpose(2, 3).contiguous().transpose(2, 3), k, v, o, lse),
    ]
    for args in bad:
        assert not OP.supported_bwd(*args)
        with pytest.raises(ValueError, match=op):
            OP.flash_attention_bwd_gluon_onepass(*args)
    q2, k2, v2, do2, o2, lse2 = inputs(1, 2, 2, 256, 128, torch.bfloat16, True, seed=4)  # hd128: not offered
    assert not OP.supported_bwd(do2, q2, k2, v2, o2, lse2)
    with pytest.raises(ValueError, match=op):
        OP.flash_attention_bwd_gluon_onepass(do2, q2, k2, v2, o2, lse2)
    with pytest.raises(ValueError, match=op):  # mismatched shapes
        OP.flash_attention_bwd_gluon_onepass(do, q, k[:, :, :128], v, o, lse)
    with pytest.raises(ValueError, match=op):
        OP.flash_attention_bwd_gluon_onepass(do, q, k, v, o, lse, scale=-1.0)


@pytest.mark.gpu
def test_gpu_dispatch_sends_hd64_backward_to_onepass():
    """flash_attention_bwd runs the one-pass kernel for causal 16-bit hd64 at T >= ONEPASS_MIN_T (its route, the
    launch plan only a Gluon path keeps, and the dK/dV bits of calling it directly; Triton's dK/dV can equal them
    bit for bit, as on an H100), and the kernels without atomics (the same bits run to run) in
    deterministic mode: the Triton kernels, and the Gluon two-kernel backward from GLUON_BWD_MIN_T[64] on;
    Triton below the threshold and non-causal."""
    T = FA.ONEPASS_MIN_T
    q, k, v, do, o, lse = inputs(1, 4, 2, T, 64, torch.bfloat16, True, seed=5)
    name, cfg = FA.bwd_route(do, q, k, v, o, lse, True)
    assert name == "onepass"
    plans = len(FA._BWD_PLANS)
    got = FA.flash_attention_bwd(do, q, k, v, o, lse, True)
    assert len(FA._BWD_PLANS) == plans + 1  # a Gluon kernel ran: only the Gluon routes keep a launch plan
    direct = OP.flash_attention_bwd_gluon_onepass(do, q, k, v, o, lse, True, config=cfg)
    assert torch.equal(got[1], direct[1]) and torch.equal(got[2], direct[2]) and OP.runs_agree(got[0], direct[0])
    want = FA.flash_attention_bwd_ref(do.double(), q.double(), k.double(), v.double(), o.double(), lse.double())
    assert all(rel(a, b) < 1e-2 for a, b in zip(got, want))
    det = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert FA.bwd_route(do, q, k, v, o, lse, True)[0] == "triton"
        tri = FA.flash_attention_bwd(do, q, k, v, o, lse, True)
        again = FA.flash_attention_bwd(do, q, k, v, o, lse, True)
        long = [torch.empty(1, 2, FA.GLUON_BWD_MIN_T[64], 64, device="cuda", dtype=torch.bfloat16) for _ in range(5)]
        lse_long = torch.empty(1, 2, FA.GLUON_BWD_MIN_T[64], device="cuda")
        assert FA.bwd_route(*long[:4], long[4], lse_long, True)[0] == "gluon"
    finally:
        torch.use_deterministic_algorithms(det)
    assert all(rel(a, b) < 1e-2 for a, b in zip(tri, want))
    assert len(FA._BWD_PLANS) == plans + 1  # the deterministic calls ran Triton, which keeps no plan
    assert all(torch.equal(a, b) for a, b in zip(tri, again))
    assert FA.bwd_route(do, q, k, v, o, lse, False)[0] == "triton"
    h = T // 2
    short = [x[..., :h, :] for x in (do, q, k, v, o)]
    assert FA.bwd_route(*short, lse[..., :h].contiguous(), True)[0] == "triton"


# ---------------------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------------------
def test_onepass_rejects_on_cpu():
    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 128)
    assert not OP.supported_bwd(q, q, q, q, q, lse)
    with pytest.raises(ValueError, match="flash_attention_bwd_gluon_onepass"):
        OP.flash_attention_bwd_gluon_onepass(q, q, q, q, q, lse)
    with pytest.raises(ValueError, match="flash_attention_bwd_gluon_onepass"):
        OP.flash_attention_bwd_gluon_onepass(q, q, q[:, :, :64], q, q, lse)
    with pytest.raises(ValueError, match="flash_attention_bwd_gluon_onepass: causal attention only"):
        OP.flash_attention_bwd_gluon_onepass(q, q, q, q, q, lse, False)
    assert FA.bwd_route(q, q, q, q, q, lse, True)[0] == "triton"  # CPU tensors never route to a Gluon kernel


@pytest.mark.slow
def test_onepass_compiles_for_sm90():
    """No GPU needed: the default config compiles for sm_90 with the installed Triton (the contiguous and the
    transposed layout; in a child process without the Triton interpreter,
    tests/_child.py) and uses what it is built on: wgmma, TMA bulk copies and the bulk reduce-add,
    setmaxnreg, mbarrier waits; no per-element atomics."""
    from _child import run_without_interpreter

    if not OP.HAVE_GLUON:
        pytest.skip("this Triton has no Gluon Hopper module")
    instrs = [
        "wgmma.mma_async",
        "cp.async.bulk.tensor",
        "cp.reduce.async.bulk.tensor",
        "setmaxnreg",
        "mbarrier.try_wait",
        "atom.global",
        "red.global",
    ]
    got = run_without_interpreter(f"""
from xtrain.kernels.attention import gluon_onepass as OP
from xtrain.kernels.attention.reference import flash_attention_bwd_ref
out = []
for transposed in (False, True):
    ptx = OP.compile_sm90(OP.OnepassConfig(), transposed=transposed).asm["ptx"]
    out.append([transposed, {{i: i in ptx for i in {instrs!r}}}])
""")
    assert len(got) == 2
    for transposed, has in got:
        for instr in instrs[:5]:
            assert has[instr], (transposed, instr)
        assert not has["atom.global"] and not has["red.global"], transposed


def test_onepass_module_contract():
    assert OP.HEAD_DIMS == (64,)
    cfg = OP.OnepassConfig()
    assert cfg.kv_regs % 8 == 0 and cfg.dq_regs % 8 == 0 and 2 * cfg.kv_regs + cfg.dq_regs <= 488
    assert FA.shipped_configs()["onepass"] == [(64, cfg)]  # the one config that ships


def test_runs_agree_is_tight():
    """The run-to-run check of dq passes for a reordered fp32 sum rounded to bf16, fails for a tile missing
    one of 128 partials, and for a one-ulp change everywhere."""
    g = torch.Generator().manual_seed(0)
    parts = torch.randn(128, 256, 64, generator=g) / 11.3
    a = parts.sum(0).to(torch.bfloat16)
    perm = torch.randperm(128, generator=g)
    b = parts[perm].sum(0).to(torch.bfloat16)
    assert OP.runs_agree(a, b) and OP.runs_agree(b, a)
    missing = a.clone()
    missing[64:128] = (parts.sum(0) - parts[5])[64:128].to(torch.bfloat16)
    assert not OP.runs_agree(missing, a)
    assert not OP.runs_agree(a * (1 + 4 * torch.finfo(torch.bfloat16).eps), a)
    assert not OP.runs_agree(a.float(), a)


needs_interp = pytest.mark.skipif(
    HAS_CUDA or os.environ.get("TRITON_INTERPRET", "0") != "1", reason="CPU check through the Triton interpreter"
)


@needs_interp
@pytest.mark.parametrize("bthd", [False, True])
def test_dq_convert_matches_reference_cpu(bthd):
    """The convert kernel (interpreter, fp32 out: the interpreter's bf16 is not trusted) equals its reference
    on a ragged T (not a multiple of its row block), contiguous and transposed dq, poisoned outputs."""
    B, H, T, D = 2, 3, 77, 64
    acc = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1))
    dq = in_layout(torch.full((B, H, T, D), float("nan")), bthd)
    OP.dq_convert(acc, dq, 0.125)
    want = OP.convert_ref(acc, torch.empty(B, H, T, D), 0.125)
    assert torch.equal(dq, want)
    with pytest.raises(ValueError, match="dq_convert"):
        OP.dq_convert(acc.double(), dq, 0.125)
    with pytest.raises(ValueError, match="dq_convert"):
        OP.dq_convert(acc, dq[..., :48], 0.125)


def test_onepass_protocol_replay():
    """The kernel's loops in fp64 and its four partitions' barrier protocol (tests/_onepass_replay.py):
    the shipped ring sizes and the tightest ones pass, and each of the 8 waits left out in turn is caught (the
    replay can fail)."""
    import _onepass_replay as R

    assert max(R.replay_math(64, T=256)) < 1e-10
    cfg0 = OP.OnepassConfig()
    stages, slots, nds = cfg0.stages, cfg0.slots, cfg0.nds
    for cfg in ((stages, nds, slots), (2, 2, 1)):
        for n_iter in (1, 3, 7):
            for seed in range(12):
                R.replay_protocol_dqwg(n_iter, *cfg, seed)
        for drop in R.DQWG_WAITS:
            caught = 0
            for n_iter in (4, 7, 16):
                for seed in range(30):
                    try:
                        R.replay_protocol_dqwg(n_iter, *cfg, seed, drop=drop)
                    except AssertionError:
                        caught += 1
            assert caught > 0, (cfg, drop)
