"""The Triton flash kernels with a document mask, against the float64 tiled reference (on CPU through the
Triton interpreter in fp32 at small shapes; on the GPU, ``-m gpu``, in fp32 and bf16 at model sizes).

Layouts are drawn so that a wrong bound changes the answer: random document lengths with length-1 documents,
documents straddling tile edges, windows that open mid-document, a single document over the whole window, and
starts that no packing gives (any ds[t] <= t: the kernels' bounds are exact for those too). Small tiles (8/16)
make every case cross many tiles. The skip is tested by poison: NaN in the keys/values (or queries) a block
never needs, which any visit of that block would carry into the result (0 · NaN = NaN).

Tolerances: fp32 interpreter runs against the fp64 reference, max abs error relative to the max of the
reference, 2e-5 (the existing Triton tests' fp32 bound: fp32 sums over <= 64 terms, exp2 vs exp; measured
~1e-6 here). bf16 on the GPU: 1e-2 normwise, the bf16 bound of tests/test_flash_attention.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from xtrain.kernels import attention as FA
from xtrain.kernels._dispatch import HAVE_TRITON
from xtrain.kernels.attention import Tiles, TritonBwdConfig, TritonFwdConfig
from xtrain.kernels.attention import reference as R
from xtrain.kernels.attention import triton as TR

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")
HAS_CUDA = torch.cuda.is_available()
TOL32 = 2e-5

# (forward tiles, dK/dV tiles, dQ tiles): block_m x block_n
TILES = {
    "16x8": (Tiles(16, 8, 4, 1), Tiles(8, 16, 4, 1), Tiles(16, 8, 4, 1)),
    "32x16": (Tiles(32, 16, 4, 1), Tiles(16, 32, 4, 1), Tiles(32, 16, 4, 1)),
}


def configs(name: str):
    f, kv, dq = TILES[name]
    return TritonFwdConfig(f), TritonBwdConfig(kv, dq)


def packed_starts(T: int, B: int, g: torch.Generator, max_len: int = 12) -> torch.Tensor:
    """Row starts of random documents (lengths 1..max_len; every fourth document has length 1); each row opens
    mid-document (its first document starts at 0 of the window)."""
    out = torch.empty(B, T, dtype=torch.int64)
    for b in range(B):
        t, n = 0, 0
        while t < T:
            n += 1
            L = 1 if n % 4 == 0 else int(torch.randint(1, max_len + 1, (1,), generator=g))
            out[b, t : t + L] = t
            t += L
    return out


def edge_starts(T: int, B: int) -> torch.Tensor:
    """Documents starting on the last position of every 8-block (7, 15, 23, ...): a key tile's last key is then a
    document's first, seen by that document's rows only (the edge of the dK/dV rows bound)."""
    t = torch.arange(T)
    return ((t + 1) // 8 * 8 - 1).clamp(min=0).expand(B, T).contiguous()


def any_starts(T: int, B: int, g: torch.Generator) -> torch.Tensor:
    """ds[t] uniform in [0, t]: not a packing (not sorted), still a valid mask."""
    t = torch.arange(T)
    return (torch.rand(B, T, generator=g) * (t + 1)).long().clamp(max=t)


def qkv(B, H, Hkv, T, D, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(B, h, T, D, generator=g)
    return mk(H), mk(Hkv), mk(Hkv), mk(H)


def err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run_both(q, k, v, do, ds, fcfg, bcfg):
    """(kernel o, lse, dq, dk, dv), (reference ...) in fp64."""
    o, lse = TR.flash_attention_fwd_triton(q, k, v, True, None, config=fcfg, doc_starts=ds)
    grads = TR.flash_attention_bwd_triton(do, q, k, v, o, lse, True, None, config=bcfg, doc_starts=ds)
    q64, k64, v64, do64 = (x.double() for x in (q, k, v, do))
    o_r, lse_r = R.flash_attention_fwd_ref(q64, k64, v64, True, None, doc_starts=ds)
    grads_r = R.flash_attention_bwd_ref(do64, q64, k64, v64, o_r, lse_r, True, None, doc_starts=ds)
    return (o, lse, *grads), (o_r, lse_r, *grads_r)


@needs_triton
@pytest.mark.parametrize("tiles", sorted(TILES))
@pytest.mark.parametrize(
    "layout,T",
    [("packed", 45), ("packed", 64), ("long", 61), ("one", 40), ("any", 37), ("edge", 50)],
)
def test_triton_doc_mask_matches_the_reference(layout, T, tiles):
    g = torch.Generator().manual_seed(T)
    B, H, Hkv, D = 2, 4, 2, 32  # GQA: dK/dV sum over a group
    ds = {
        "packed": lambda: packed_starts(T, B, g),
        "long": lambda: packed_starts(T, B, g, max_len=40),  # documents across several tiles
        "one": lambda: torch.zeros(B, T, dtype=torch.int64),  # a single document: plain causal
        "any": lambda: any_starts(T, B, g),
        "edge": lambda: edge_starts(T, B),
    }[layout]()
    q, k, v, do = qkv(B, H, Hkv, T, D, seed=T)
    got, want = run_both(q, k, v, do, ds, *configs(tiles))
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert err(a, b) <= TOL32, (name, err(a, b))


@needs_triton
@pytest.mark.parametrize("D", [64, 128])
def test_shipped_doc_tiles_match_the_reference(D):
    """The tiles ``doc_configs`` ships for 16-bit masked calls, run here in fp32 (the interpreter's bf16 is not
    trustworthy): T = 150 spans three 64-row tiles, ragged."""
    T, B, H, Hkv = 150, 1, 2, 1
    fcfg, bcfg = FA.doc_configs(torch.bfloat16, T, D)
    fcfg = TritonFwdConfig(dataclasses.replace(fcfg.tiles, tma=False))  # TMA needs a GPU
    bcfg = TritonBwdConfig(dataclasses.replace(bcfg.dkdv, tma=False), dataclasses.replace(bcfg.dq, tma=False))
    ds = packed_starts(T, B, torch.Generator().manual_seed(D), max_len=60)
    q, k, v, do = qkv(B, H, Hkv, T, D, seed=D)
    got, want = run_both(q, k, v, do, ds, fcfg, bcfg)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert err(a, b) <= TOL32, (name, err(a, b))


@needs_triton
def test_single_document_is_the_causal_kernel_bit_for_bit():
    """Starts all 0 (no eot in the window) take the masked code paths with every key kept: the same bits as the
    unmasked causal kernels."""
    B, H, Hkv, T, D = 1, 2, 1, 40, 32
    q, k, v, do = qkv(B, H, Hkv, T, D, seed=3)
    fcfg, bcfg = configs("16x8")
    ds = torch.zeros(B, T, dtype=torch.int64)
    o, lse = TR.flash_attention_fwd_triton(q, k, v, True, None, config=fcfg)
    o_d, lse_d = TR.flash_attention_fwd_triton(q, k, v, True, None, config=fcfg, doc_starts=ds)
    assert torch.equal(o, o_d) and torch.equal(lse, lse_d)
    g = TR.flash_attention_bwd_triton(do, q, k, v, o, lse, True, None, config=bcfg)
    g_d = TR.flash_attention_bwd_triton(do, q, k, v, o, lse, True, None, config=bcfg, doc_starts=ds)
    assert all(torch.equal(a, b) for a, b in zip(g, g_d))


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the poisoned rows' own results are NaN, as intended
def test_blocks_outside_the_documents_are_never_visited():
    """Two documents per row, the boundary on a tile edge (32). Poison: NaN in document 0's keys and values
    (forward, dQ) and in document 1's queries and output gradients (dK/dV). A kernel that visits a block it may
    skip picks up NaN even where the mask zeroes the scores (0 · NaN = NaN); the kernels must give finite
    results equal to the clean reference on the other document."""
    B, H, Hkv, T, D, cut = 1, 2, 1, 64, 32, 32
    fcfg, bcfg = configs("16x8")  # dK/dV key tiles of 16: the rows_end bound stops at the boundary
    ds = torch.zeros(B, T, dtype=torch.int64)
    ds[:, cut:] = cut
    q, k, v, do = qkv(B, H, Hkv, T, D, seed=5)
    o_ref, lse_ref = R.flash_attention_fwd_ref(q.double(), k.double(), v.double(), True, None, doc_starts=ds)
    g_ref = R.flash_attention_bwd_ref(do.double(), q.double(), k.double(), v.double(), o_ref, lse_ref, True, None,
                                      doc_starts=ds)  # fmt: skip
    # forward and dQ of document 1 with document 0's keys and values poisoned
    kp, vp = k.clone(), v.clone()
    kp[:, :, :cut] = float("nan")
    vp[:, :, :cut] = float("nan")
    o, lse = TR.flash_attention_fwd_triton(q, kp, vp, True, None, config=fcfg, doc_starts=ds)
    assert err(o[:, :, cut:], o_ref[:, :, cut:]) <= TOL32
    dq, _, _ = TR.flash_attention_bwd_triton(do, q, kp, vp, o, lse, True, None, config=bcfg, doc_starts=ds)
    assert err(dq[:, :, cut:], g_ref[0][:, :, cut:]) <= TOL32
    # dK/dV of document 0 with document 1's queries and output gradients poisoned
    o, lse = TR.flash_attention_fwd_triton(q, k, v, True, None, config=fcfg, doc_starts=ds)
    qp, dop = q.clone(), do.clone()
    qp[:, :, cut:] = float("nan")
    dop[:, :, cut:] = float("nan")
    _, dk, dv = TR.flash_attention_bwd_triton(dop, qp, k, v, o, lse, True, None, config=bcfg, doc_starts=ds)
    assert err(dk[:, :, :cut], g_ref[1][:, :, :cut]) <= TOL32
    assert err(dv[:, :, :cut], g_ref[2][:, :, :cut]) <= TOL32


@needs_triton
def test_changing_one_document_leaves_the_others_bit_identical():
    """New queries, keys, values and output gradients in one document (straddling tile edges): every other
    document's o, lse, dq, dk and dv keep their bits (masked scores are -inf, so the changed values enter
    only as exact zeros)."""
    B, H, Hkv, T, D = 1, 2, 1, 48, 32
    ds = torch.zeros(B, T, dtype=torch.int64)
    ds[:, 13:29] = 13  # document [13, 29) crosses the 16- and 32-tile edges
    ds[:, 29:] = 29
    fcfg, bcfg = configs("16x8")
    q, k, v, do = qkv(B, H, Hkv, T, D, seed=6)
    q2, k2, v2, do2 = (x.clone() for x in (q, k, v, do))
    g = torch.Generator().manual_seed(7)
    for x in (q2, k2, v2, do2):
        x[:, :, 13:29] = torch.randn(x[:, :, 13:29].shape, generator=g)
    outs = []
    for a in ((q, k, v, do), (q2, k2, v2, do2)):
        o, lse = TR.flash_attention_fwd_triton(*a[:3], True, None, config=fcfg, doc_starts=ds)
        outs.append((o, lse, *TR.flash_attention_bwd_triton(a[3], *a[:3], o, lse, True, None, config=bcfg,
                                                             doc_starts=ds)))  # fmt: skip
    rest = torch.cat([torch.arange(13), torch.arange(29, T)])
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), *outs):
        assert torch.equal(a[:, :, rest], b[:, :, rest]), name
        assert not torch.equal(a[:, :, 13:29], b[:, :, 13:29]), name  # the changed document did change


def test_doc_query_bounds_are_exact():
    """(F, R) per key tile against their definitions, by brute force, for packed and arbitrary starts."""
    g = torch.Generator().manual_seed(2)
    for ds in (packed_starts(50, 2, g), any_starts(50, 2, g), edge_starts(50, 2)):
        T, bn = ds.shape[1], 16
        got = TR.doc_query_bounds(ds, bn)
        for b in range(ds.shape[0]):
            for j, n0 in enumerate(range(0, T, bn)):
                n1 = min(n0 + bn, T)
                F = next((t for t in range(T) if int(ds[b, : t + 1].max()) > n0), T)
                sees = [t for t in range(T) if any(int(ds[b, t]) <= s <= t for s in range(n0, n1))]
                R_ = max(sees) + 1 if sees else 0
                assert (int(got[b, j, 0]), int(got[b, j, 1])) == (F, R_), (b, j)


@needs_triton
def test_entry_points_route_masked_calls_to_the_triton_kernels(monkeypatch):
    """Where the device rule says Triton (faked here: the CPU test has no GPU, the interpreter runs the kernels),
    a masked call runs the Triton kernels, not the reference; no Gluon route exists off sm_90, so nothing counts
    as a fallback."""
    B, H, Hkv, T, D = 1, 2, 1, 24, 32
    q, k, v, do = qkv(B, H, Hkv, T, D, seed=9)
    ds = packed_starts(T, B, torch.Generator().manual_seed(9))
    monkeypatch.setattr(FA, "use_triton", lambda *ts: True)
    ran = []
    real_f, real_b = TR.flash_attention_fwd_triton, TR.flash_attention_bwd_triton
    monkeypatch.setattr(FA, "flash_attention_fwd_triton", lambda *a, **kw: ran.append("fwd") or real_f(*a, **kw))
    monkeypatch.setattr(FA, "flash_attention_bwd_triton", lambda *a, **kw: ran.append("bwd") or real_b(*a, **kw))
    before = FA.doc_mask_fallbacks()
    o, lse = FA.flash_attention_fwd(q, k, v, True, None, doc_starts=ds)
    grads = FA.flash_attention_bwd(do, q, k, v, o, lse, True, None, doc_starts=ds)
    assert ran == ["fwd", "bwd"]
    assert FA.doc_mask_fallbacks() == before
    _, want = run_both(q, k, v, do, ds, *configs("16x8"))
    for a, b in zip((o, lse, *grads), want):
        assert err(a, b) <= TOL32


# ---------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("T,mean", [(1000, 37), (2048, 256), (4096, 1000)])
def test_gpu_doc_mask_matches_the_reference(T, mean, D, dtype):
    """The entry points on CUDA (the shipped configs, TMA where the config asks) against the fp64 reference."""
    g = torch.Generator().manual_seed(T + D)
    B, H, Hkv = 2, 4, 2
    ds = packed_starts(T, B, g, max_len=2 * mean).cuda()
    q, k, v, do = (x.cuda().to(dtype) for x in qkv(B, H, Hkv, T, D, seed=T))
    before = FA.doc_mask_fallbacks()
    o, lse = FA.flash_attention_fwd(q, k, v, True, None, doc_starts=ds)
    grads = FA.flash_attention_bwd(do, q, k, v, o, lse, True, None, doc_starts=ds)
    q64, k64, v64, do64 = (x.double() for x in (q, k, v, do))
    o_r, lse_r = R.flash_attention_fwd_ref(q64, k64, v64, True, None, doc_starts=ds)
    want = R.flash_attention_bwd_ref(do64, q64, k64, v64, o_r, lse_r, True, None, doc_starts=ds)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    for name, a, b in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_r, *want)):
        e = float((a.double() - b).norm() / b.norm())
        assert e <= tol, (name, e)
    assert float((lse.double() - lse_r).abs().max()) <= 1e-3
    after = FA.doc_mask_fallbacks()
    route = FA._choice(q, True)
    gluon_fwd = isinstance(route.fwd[0], FA.GluonFwdConfig)
    assert after["fwd"] - before["fwd"] == int(gluon_fwd and FA.gluon_fwd.supported(q, k, v))
