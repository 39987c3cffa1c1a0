"""Launch plans of the Gluon attention paths (attention._FWD_PLANS / _BWD_PLANS, _dispatch.CachedLaunch).

The first call of an input signature takes the full path and leaves a plan; a later call with the same
signature launches the compiled kernels directly. GPU (``-m gpu``, sm_90): a planned call gives the same bits
as the full path on new data (dq of the one-pass backward within ``runs_agree``: fp32 reduce-adds), writes
every output (NaN-poisoned allocations), and is served by the plan (the cache's hit count); the key changes
with the backend, the scale, causality and the deterministic mode (what picks the kernel beyond the tensors),
and is None for a misaligned tensor; under the reference backend no plan serves a call; a cached launch
refuses a wrong set of per-call arguments. CPU (in CI): each plan, fed recording stand-ins for its cached
launches, passes every launch exactly its per-call arguments, with every descriptor re-based on the right new
tensor (a swapped argument fails it); the plan key holds the backend; the cache counts the calls it serves
(hits) and the lookups it had no plan for (misses).
"""

from __future__ import annotations

import pytest
import torch
from _gluon_bwd_cases import LAYOUTS, in_layout, inputs  # tests/_gluon_bwd_cases.py

from xtrain.kernels import attention as FA
from xtrain.kernels.attention import gluon_bwd as GB
from xtrain.kernels.attention import gluon_common as GC
from xtrain.kernels.attention import gluon_fwd as G
from xtrain.kernels.attention import gluon_onepass as OP
from xtrain.testing import poisoned

SHIPPED = FA.shipped_configs()  # {"fwd": [(D, config), ...], "bwd": ..., "onepass": ...}


def _layout(ts, layout):
    tr = LAYOUTS[layout]
    return [in_layout(x, name in tr) for name, x in zip("q k v do o".split(), ts)]


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("layout", ["contiguous", "bthd"])
def test_gpu_forward_plan_equals_full_path(D, layout):
    T = FA.GLUON_FWD_MIN_T
    first = _layout(inputs(2, 4, 2, T, D, torch.bfloat16, True, seed=1)[:3], layout)
    FA.flash_attention_fwd(*first, True)  # full path: leaves the plan
    assert len(FA._FWD_PLANS) == 1
    q, k, v = _layout(inputs(2, 4, 2, T, D, torch.bfloat16, True, seed=2)[:3], layout)
    o_full = torch.full_like(q, float("nan"))  # a caller's buffer: the full path, no plan
    lse_full = torch.full(q.shape[:3], float("nan"), device=q.device)
    cfg = FA.choose((9, 0), q.dtype, T, D, True, False).fwd[0]
    G.flash_attention_fwd_gluon(q, k, v, True, config=cfg, o=o_full, lse=lse_full)
    hits = FA._FWD_PLANS.hits
    with poisoned():
        o, lse = FA.flash_attention_fwd(q, k, v, True)
    assert FA._FWD_PLANS.hits == hits + 1  # the plan ran, not the full path
    assert o.stride() == o_full.stride()
    assert torch.equal(o, o_full) and torch.equal(lse, lse_full)


@pytest.mark.gpu
@pytest.mark.parametrize("D,route", [(64, "onepass"), (128, "gluon")])
@pytest.mark.parametrize("layout", ["contiguous", "model"])
def test_gpu_backward_plan_equals_full_path(D, route, layout):
    T = FA.ONEPASS_MIN_T if D == 64 else FA.GLUON_BWD_MIN_T[D]
    ins = inputs(1, 4, 2, T, D, torch.bfloat16, True, seed=3)
    q, k, v, do, o = _layout(ins[:5], layout)
    name, cfg = FA.bwd_route(do, q, k, v, o, ins[5], True)
    assert name == route
    FA.flash_attention_bwd(do, q, k, v, o, ins[5], True)  # full path: leaves the plan
    assert len(FA._BWD_PLANS) == 1
    q, k, v, do, o, lse = inputs(1, 4, 2, T, D, torch.bfloat16, True, seed=4)
    q, k, v, do, o = _layout((q, k, v, do, o), layout)
    bufs = {n: torch.full_like(x, float("nan")) for n, x in (("dq", q), ("dk", k), ("dv", v))}
    fn = OP.flash_attention_bwd_gluon_onepass if route == "onepass" else GB.flash_attention_bwd_gluon
    full = fn(do, q, k, v, o, lse, True, config=cfg, **bufs)  # buffers given: no plan
    hits = FA._BWD_PLANS.hits
    with poisoned():
        got = FA.flash_attention_bwd(do, q, k, v, o, lse, True)
    assert FA._BWD_PLANS.hits == hits + 1  # the plan ran, not the full path
    assert all(torch.isfinite(a).all() for a in got)
    assert torch.equal(got[1], full[1]) and torch.equal(got[2], full[2])
    if route == "onepass":
        assert OP.runs_agree(got[0], full[0])
    else:
        assert torch.equal(got[0], full[0])


@pytest.mark.gpu
def test_gpu_plan_key_follows_the_choice_inputs():
    q, k, v, do, o, lse = inputs(1, 4, 2, 1024, 64, torch.bfloat16, True, seed=6)
    fwd = FA._plan_key("fwd", (q, k, v), None, True)
    bwd = FA._plan_key("bwd", (do, q, k, v, o, lse), None, True)
    assert fwd == FA._plan_key("fwd", (q.clone(), k.clone(), v.clone()), None, True)  # data does not matter
    assert fwd != FA._plan_key("fwd", (q, k, v), 0.1, True)
    assert fwd != FA._plan_key("fwd", (q, k, v), None, False)
    det = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert bwd != FA._plan_key("bwd", (do, q, k, v, o, lse), None, True)
    finally:
        torch.use_deterministic_algorithms(det)
    flat = torch.empty(q.numel() + 8, dtype=q.dtype, device=q.device)
    q_off = flat[1 : 1 + q.numel()].view(q.shape)  # 2 bytes past an aligned base
    assert FA._plan_key("fwd", (q_off, k, v), None, True) is None


@pytest.mark.gpu
def test_gpu_backend_switch_for_the_same_shapes_takes_effect():
    """After a Gluon call has left its plans, the same shapes under ``backend("reference")`` run the tiled
    references (the plans are neither looked up nor used), and back under "auto" the plans serve again."""
    from xtrain.kernels import backend

    q, k, v, do, o, lse = inputs(1, 4, 2, 1024, 64, torch.bfloat16, True, seed=8)
    o, lse = FA.flash_attention_fwd(q, k, v, True)  # leaves the forward's plan
    FA.flash_attention_bwd(do, q, k, v, o, lse, True)  # and the backward's
    assert FA._FWD_PLANS and FA._BWD_PLANS
    hits = (FA._FWD_PLANS.hits, FA._BWD_PLANS.hits)
    with backend("reference"):
        o_ref, lse_ref = FA.flash_attention_fwd(q, k, v, True)
        grads_ref = FA.flash_attention_bwd(do, q, k, v, o, lse, True)
    want = FA.flash_attention_fwd_ref(q, k, v, True)
    assert torch.equal(o_ref, want[0]) and torch.equal(lse_ref, want[1])
    for got, w in zip(grads_ref, FA.flash_attention_bwd_ref(do, q, k, v, o, lse, True)):
        assert torch.equal(got, w)
    assert (FA._FWD_PLANS.hits, FA._BWD_PLANS.hits) == hits  # no plan served the reference calls
    o2, _ = FA.flash_attention_fwd(q, k, v, True)  # "auto" again: the plan
    assert torch.equal(o2, o) and FA._FWD_PLANS.hits == hits[0] + 1


def test_plan_cache_counts_the_calls_it_serves():
    """``hits`` counts the lookups a plan served, ``misses`` those of a key without a plan (the full path ran
    where a plan was possible); a None key (no plan possible) counts in neither."""
    from xtrain.kernels._dispatch import PlanCache

    c = PlanCache(limit=2)
    assert c.lookup(None) is None and (c.hits, c.misses) == (0, 0)
    assert c.lookup("a") is None and (c.hits, c.misses) == (0, 1)
    c.put("a", "plan a")
    assert c.lookup("a") == "plan a" and (c.hits, c.misses) == (1, 1)
    c.put("b", 1)
    c.put("c", 2)  # past the limit: dropped wholesale, then c kept
    assert c.lookup("a") is None and c.lookup("c") == 2 and (c.hits, c.misses) == (2, 2)
    assert c.lookup(None) is None and (c.hits, c.misses) == (2, 2)


def test_plan_signature_holds_the_backend():
    """The plan key holds everything that picks the kernel, the calling thread's backend included: the same
    shapes under two backends are two keys."""
    from xtrain.kernels import backend

    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    auto = FA.plan_signature("fwd", (q, k, v), None, True)
    with backend("triton"):
        forced = FA.plan_signature("fwd", (q, k, v), None, True)
    with backend("reference"):
        ref = FA.plan_signature("fwd", (q, k, v), None, True)
    assert len({auto, forced, ref}) == 3
    assert auto == FA.plan_signature("fwd", (q.clone(), k, v), None, True)


@pytest.mark.gpu
def test_gpu_cached_launch_takes_exactly_the_per_call_arguments():
    acc = torch.randn(1, 2, 128, 64, device="cuda")
    dq = torch.empty(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    launch = OP.dq_convert(acc, dq, 0.5, cached=True)
    assert launch.per_call == {"ACC", "DQ"}
    with pytest.raises(ValueError, match="per-call"):
        launch(ACC=acc)
    with pytest.raises(ValueError, match="per-call"):
        launch(ACC=acc, DQ=dq, scale=1.0)
    acc2 = torch.randn_like(acc)
    out = torch.full_like(dq, float("nan"))
    launch(ACC=acc2, DQ=out)
    assert torch.equal(out, OP.dq_convert(acc2, torch.empty_like(dq), 0.5))


# ---------------------------------------------------------------------------------------------------------
# CPU: the plans' bookkeeping, with recording stand-ins for the cached launches
# ---------------------------------------------------------------------------------------------------------
class _Recorder:
    """Stands in for a ``CachedLaunch`` of a launch with arguments ``args``: takes exactly the per-call
    arguments, as the real one does, and records them."""

    def __init__(self, args: dict):
        from xtrain.kernels._dispatch import is_per_call

        self.per_call = {n for n, val in args.items() if is_per_call(val)}
        self.calls = []

    def __call__(self, **kw):
        assert kw.keys() == self.per_call, (sorted(kw), sorted(self.per_call))
        self.calls.append(kw)


def _base_is(desc, t) -> bool:
    return desc.base.data_ptr() == t.data_ptr() and desc.base.dtype == t.dtype


# the preprocess's tensors (GB._prologue)
_PRE = dict.fromkeys(("O", "DO", "DELTA", "LSE", "LSE2", "LSEC", "DELTAC"), torch.empty(0))
needs_gluon = pytest.mark.skipif(not GC.HAVE_GLUON, reason="this Triton has no Gluon")


@needs_gluon
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("D,config", SHIPPED["fwd"])
def test_forward_plan_rebases_every_descriptor_cpu(transposed, D, config):
    q, k = GC.stand_ins(D, 256, 4, 2, transposed)
    lse = torch.empty(1, 4, 256)
    _, _, args, _ = G._launch(q, k, k, q, lse, 0.125, config, 132)
    rec = _Recorder(args)
    plan = G._FwdPlan(rec, args, q)
    assert all(t.base is None for t in plan.descs.values())  # the templates hold no tensor
    q2, k2 = GC.stand_ins(D, 256, 4, 2, transposed)
    v2 = k2.clone() if not transposed else k2.transpose(1, 2).contiguous().transpose(1, 2)
    o, lse2 = plan(q2, k2, v2)
    (kw,) = rec.calls
    assert o.shape == q2.shape and o.stride() == q2.stride() and lse2.shape == (1, 4, 256)
    assert kw["lse_ptr"] is lse2
    for name, t in (("q_desc", q2), ("k_desc", k2), ("v_desc", v2), ("o_desc", o)):
        assert _base_is(kw[name], t), name


@needs_gluon
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("D,config", SHIPPED["bwd"])
def test_backward_plans_rebase_every_descriptor_cpu(transposed, D, config):
    q, k = GC.stand_ins(D, 256, 4, 2, transposed)
    dq = torch.empty(1, 4, 256, D, dtype=torch.bfloat16)
    lse = torch.empty(1, 4, 256)
    cols = dcols = config.lse_mma
    (_, _, a1, _), (_, _, a2, _) = GB._launches(q, k, k, dq, k, k, q, lse, lse, 0.125, config, GC.new_columns(q, cols))
    pre, r1, r2 = _Recorder(_PRE), _Recorder(a1), _Recorder(a2)
    split = GB._SplitPlan(pre, r1, r2, a1, a2, columns=cols)
    do, q2 = GC.stand_ins(D, 256, 4, 2, transposed)[0], GC.stand_ins(D, 256, 4, 2, transposed)[0]
    k2, v2 = (GC.stand_ins(D, 256, 4, 2, transposed)[1] for _ in range(2))
    o2, lse2 = torch.empty_like(q2), torch.empty(1, 4, 256)
    gdq, gdk, gdv = split(do, q2, k2, v2, o2, lse2)
    assert (gdq.shape, gdk.shape, gdv.shape) == (q2.shape, k2.shape, v2.shape)
    (p,), (c1,), (c2,) = pre.calls, r1.calls, r2.calls
    assert p["O"] is o2 and p["DO"] is do
    assert p["DELTA"] is c2["delta_ptr"] and p["LSE"] is lse2
    assert p["LSE2"] is c2["lse_ptr"] and p["LSE2"] is not lse2  # lse·log2(e), a new buffer
    assert "lse_ptr" not in c1 and "delta_ptr" not in c1  # the dK/dV kernel reads them by TMA (descriptors below)
    if cols:  # the dK/dV kernel's lse and delta come from the column buffers the preprocess fills in this call
        assert p["LSEC"].shape == p["DELTAC"].shape == (1, 4, 256, GC.LSE_COLS) and p["LSEC"].dtype == q2.dtype
        assert p["LSEC"] is not p["DELTAC"]
    else:  # stand-ins the preprocess does not touch
        assert p["LSEC"] is p["DELTAC"] is p["DELTA"]
    for name, t in (
        ("q_desc", q2),
        ("do_desc", do),
        ("k_desc", k2),
        ("v_desc", v2),
        ("dk_desc", gdk),
        ("dv_desc", gdv),
        ("lse_desc", p["LSEC"] if cols else p["LSE2"]),
        ("delta_desc", p["DELTAC"] if dcols else p["DELTA"]),
    ):
        assert _base_is(c1[name], t), name
    for name, t in (("q_desc", q2), ("do_desc", do), ("k_desc", k2), ("v_desc", v2), ("dq_desc", gdq)):
        assert _base_is(c2[name], t), name

    q, k = GC.stand_ins(64, 256, 4, 2, transposed)
    acc = torch.empty(1, 4, 256, 64)
    _, _, args, _ = OP._launch(q, k, k, q, k, k, acc, lse, lse, 0.125, OP.OnepassConfig())
    pre, main = _Recorder(_PRE), _Recorder(args)
    conv = _Recorder({"ACC": acc, "DQ": acc})
    onepass = OP._OnepassPlan(pre, main, conv, args)
    do, q2 = GC.stand_ins(64, 256, 4, 2, transposed)[0], GC.stand_ins(64, 256, 4, 2, transposed)[0]
    k2, v2 = (GC.stand_ins(64, 256, 4, 2, transposed)[1] for _ in range(2))
    gdq, gdk, gdv = onepass(do, q2, k2, v2, torch.empty_like(q2), lse2)
    (p,), (m,), (c,) = pre.calls, main.calls, conv.calls
    assert m["delta_ptr"] is p["DELTA"] and m["lse_ptr"] is lse2
    assert p["LSE"] is p["LSE2"] is p["DELTA"]  # the one-pass kernel reads the natural-log lse: no base-2 copy
    assert c["DQ"] is gdq and _base_is(m["dq_desc"], c["ACC"]) and c["ACC"].dtype == torch.float32
    assert not c["ACC"].any()  # the accumulator starts at zero
    for name, t in (
        ("q_desc", q2),
        ("do_desc", do),
        ("k_desc", k2),
        ("v_desc", v2),
        ("dk_desc", gdk),
        ("dv_desc", gdv),
    ):
        assert _base_is(m[name], t), name
