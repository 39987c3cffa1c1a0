"""Packed documents: attention confined to each document, RoPE positions restarting at each document.

The oracle is the definition: a packed window's loss and every gradient equal the sums over its documents run
alone (each from its eot, positions from 0), in float64 to relative error 1e-10 (the two differ only in the
order of fp64 sums, ~1e-15). Document layouts are chosen so that a wrong mask or a wrong tile skip changes the
answer: length-1 documents, a window that opens mid-document, documents straddling the tiled flash
reference's tile edges (REF_TILE = 128 in the model tests, small tiles in the kernel tests).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import xtrain.ops as ops
from xtrain.autograd import Var, no_grad
from xtrain.config import ModelConfig
from xtrain.gradcheck import TOL_SMOOTH, gradcheck
from xtrain.kernels.attention import reference as R
from xtrain.mask import Documents, doc_starts
from xtrain.model import Model

EOT = 0
REL = 1e-10  # fp64: the packed and separate runs differ only in summation order (~1e-15 measured)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def cfg(attention: str, recompute: bool = False, T: int = 512) -> ModelConfig:
    return ModelConfig(
        vocab_size=50,
        n_layer=2,
        n_embd=16,
        n_head=4,
        n_kv_head=2,  # GQA
        head_dim=8,
        ffn_dim=24,
        max_seq_len=T,
        attention=attention,
        loss="composed",
        recompute=recompute,
        compute_dtype="float64",
    )


def random_starts(T: int, g: torch.Generator, first_at_zero: bool) -> list[int]:
    """Document starts in [1, T) (plus 0 when ``first_at_zero``): lengths 1..40, every third a length-1 run."""
    starts, t = ([0] if first_at_zero else []), 0
    while True:
        t += 1 if len(starts) % 3 == 2 else int(torch.randint(1, 41, (1,), generator=g))
        if t >= T:
            return starts
        starts.append(t)


def packed_window(T: int, seed: int = 0):
    """ids, targets [2, T] and the document starts of each row. Row 0 opens mid-document, holds length-1
    documents (at 5, and the last token) and documents straddling the 128 and 256 tile edges; row 1 starts with
    an eot and has random lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (2, T), generator=g)  # no eot except where placed
    tg = torch.randint(0, 50, (2, T), generator=g)
    rows = [[s for s in (5, 6, 100, 200, 201, T - 1) if s < T], random_starts(T, g, True)]
    for b, starts in enumerate(rows):
        ids[b, starts] = EOT
    return ids, tg, rows


def documents(rows, T):
    """(row, start, end) of every document of every row."""
    out = []
    for b, starts in enumerate(rows):
        edges = ([0] if not starts or starts[0] != 0 else []) + starts + [T]
        out += [(b, s, e) for s, e in zip(edges[:-1], edges[1:])]
    return out


# ---------------------------------------------------------------------------------------------------------
# the helper
# ---------------------------------------------------------------------------------------------------------
def test_doc_starts_helper():
    ids = torch.tensor([[5, EOT, 3, 4, EOT, EOT, 7], [EOT, 1, 2, 3, 4, 5, EOT]])
    want = torch.tensor([[0, 1, 1, 1, 4, 5, 5], [0, 0, 0, 0, 0, 0, 6]])
    got = doc_starts(ids, EOT)
    assert got.dtype == torch.int64 and got.device == ids.device and torch.equal(got, want)
    assert torch.equal(doc_starts(ids.to(torch.int32), EOT), want)
    assert torch.equal(doc_starts(torch.tensor([[3, 4, 5]]), EOT), torch.zeros(1, 3, dtype=torch.int64))  # no eot
    assert torch.equal(doc_starts(torch.tensor([[7]]), EOT), torch.zeros(1, 1, dtype=torch.int64))  # T = 1
    assert torch.equal(doc_starts(torch.tensor([[EOT]]), EOT), torch.zeros(1, 1, dtype=torch.int64))
    ids, _, rows = packed_window(300)
    ds = doc_starts(ids, EOT)
    for b, s, e in documents(rows, 300):
        assert bool((ds[b, s:e] == s).all())
    with pytest.raises(ValueError, match="doc_starts"):
        doc_starts(torch.tensor([1, 2, 3]), EOT)


# ---------------------------------------------------------------------------------------------------------
# the model: packed == separate
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "attention,recompute", [("composed", False), ("math", False), ("flash", False), ("math", True), ("flash", True)]
)
def test_packed_equals_separate_documents(attention, recompute):
    T = 300  # three tiles of the flash reference (128): documents straddle 128 and 256
    ids, tg, rows = packed_window(T)
    m = Model(cfg(attention, recompute), seed=1)
    loss = m.loss(ids, tg, reduction="sum", mask=Documents.of(ids, EOT))
    loss.backward()
    packed = {k: p.grad.clone() for k, p in m.params.items()}
    m.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    sep = {k: torch.zeros_like(g) for k, g in packed.items()}
    for b, s, e in documents(rows, T):
        part = m.loss(ids[b : b + 1, s:e], tg[b : b + 1, s:e], reduction="sum")  # alone, positions from 0
        part.backward()
        total += part.data
        for k, p in m.params.items():
            sep[k] += p.grad
            p.grad = None
    assert rel_err(loss.data, total) <= REL
    for k in packed:
        assert rel_err(packed[k], sep[k]) <= REL, k


@pytest.mark.parametrize("attention", ["composed", "math", "flash"])
def test_changing_one_document_leaves_the_others_bit_identical(attention):
    T = 300
    ids, _, rows = packed_window(T, seed=3)
    m = Model(cfg(attention), seed=2)
    docs = documents(rows, T)
    b, s, e = max(docs, key=lambda d: d[2] - d[1] if d[0] == 0 else -1)  # row 0's longest document
    changed = ids.clone()
    changed[b, s + 1 : e] = torch.randint(1, 50, (e - s - 1,))  # its eot stays: the layout is unchanged
    assert not torch.equal(changed, ids)
    with no_grad():
        a = m.forward(ids, mask=Documents.of(ids, EOT)).data
        c = m.forward(changed, mask=Documents.of(changed, EOT)).data
    keep = torch.ones(2, T, dtype=torch.bool)
    keep[b, s:e] = False
    assert torch.equal(a[keep], c[keep])
    assert not torch.equal(a[~keep], c[~keep])  # the change did reach the changed document


@pytest.mark.parametrize("attention", ["composed", "math", "flash"])
def test_no_eot_and_t1_are_plain_causal(attention):
    """Documents with all-zero starts (no eot in the window, or T = 1) give the bits of the causal mask: the same
    mask set, the same RoPE positions (through the [B, T] table), and masked entries contribute exact zeros. One
    exception: flash's tiled reference beyond one tile (T > 128), whose masked backward sums dK, dV (and dQ) one
    query tile at a time where the causal one sums every row in one matmul: the same sums in another order,
    so its gradients agree to rounding (REL), not bit for bit; its loss is bit-identical."""
    m = Model(cfg(attention), seed=4)
    for T in (1, 7, 260):
        ids = torch.randint(1, 50, (2, T))
        tg = torch.randint(0, 50, (2, T))
        ds = doc_starts(ids, EOT)
        assert not bool(ds.any())
        la = m.loss(ids, tg, mask=Documents(ds))
        la.backward()
        ga = {k: p.grad.clone() for k, p in m.params.items()}
        m.zero_grad()
        lb = m.loss(ids, tg)
        lb.backward()
        assert torch.equal(la.data, lb.data), T
        for k, p in m.params.items():
            if attention == "flash" and T > R.REF_TILE:
                assert rel_err(ga[k], p.grad) <= REL, (T, k)
            else:
                assert torch.equal(ga[k], p.grad), (T, k)
        m.zero_grad()
    ids = torch.tensor([[EOT]])  # T = 1 with an eot: one document starting at 0
    with no_grad():
        assert torch.equal(m.forward(ids, mask=Documents.of(ids, EOT)).data, m.forward(ids).data)


def test_rope_positions_restart_per_document(monkeypatch):
    """RoPE is relative, so inside a document a shift of every position changes the scores only by rounding
    (the packed == separate test cannot see it): check the positions themselves, and that each document's
    rotated q and k rows are those of the document run alone (to rounding: the projections' matmuls have
    other row counts, so not bit for bit; rows rotated by other positions would be O(1) apart)."""
    T = 300
    ids, tg, rows = packed_window(T)
    m = Model(cfg("math"), seed=1)
    seen = []
    real = ops.qkv_norm_rope_linear

    def spy(x, ws, norms, H, Hkv, rope, eps, **kw):
        q, k, v = real(x, ws, norms, H, Hkv, rope, eps, **kw)
        seen.extend([(*rope, q.data), (*rope, k.data)])
        return q, k, v

    monkeypatch.setattr(ops, "qkv_norm_rope_linear", spy)
    ds = doc_starts(ids, EOT)
    with no_grad():
        m.forward(ids, mask=Documents(ds))
    packed, seen[:] = list(seen), []
    want = torch.arange(T)[None, :] - ds  # [B, T]
    assert len(packed) == 2 * m.config.n_layer
    for positions, table, _ in packed:
        assert torch.equal(positions, want)
        assert torch.equal(table[0], ops.rope_table(want, 8, m.config.rope_theta, torch.float64)[0])
    for b, s, e in documents(rows, T)[:6]:
        with no_grad():
            m.forward(ids[b : b + 1, s:e])
        for (_, _, yp), (_, _, ya) in zip(packed[:2], seen[:2]):  # layer 0's q and k: same inputs up to RoPE
            assert rel_err(yp[b : b + 1, :, s:e], ya) <= REL, (b, s, e)  # shifted positions: O(1) apart
        seen[:] = []


def node_names(out: Var) -> list[str]:
    names, stack, seen = [], [out], set()
    while stack:
        v = stack.pop()
        if id(v) not in seen:
            seen.add(id(v))
            names.append(v.name)
            stack.extend(v._parents or ())
    return sorted(names)


def test_default_path_builds_the_causal_graph():
    """The default (causal) mask records the plain causal graph; the document mask replaces causal_mask node for
    node."""
    m = Model(cfg("composed"), seed=0)
    ids = torch.randint(1, 50, (1, 16))
    plain = node_names(m.forward(ids))
    masked = node_names(m.forward(ids, mask=Documents.of(ids, EOT)))
    assert "doc_mask" not in plain and plain.count("causal_mask") == 2
    assert masked == sorted(n.replace("causal_mask", "doc_mask") for n in plain)


# ---------------------------------------------------------------------------------------------------------
# the ops and kernels
# ---------------------------------------------------------------------------------------------------------
def qkv(B, H, Hkv, T, D, dtype=torch.float64):
    return (torch.randn(B, H, T, D, dtype=dtype), torch.randn(B, Hkv, T, D, dtype=dtype),
            torch.randn(B, Hkv, T, D, dtype=dtype))  # fmt: skip


def starts_tensor(T: int, B: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ds = torch.zeros(B, T, dtype=torch.int64)
    for b in range(B):
        ids = torch.ones(T, dtype=torch.int64)
        ids[random_starts(T, g, b % 2 == 1)] = EOT
        ds[b] = doc_starts(ids[None], EOT)[0]
    return ds


def dense_oracle(q, k, v, ds):
    """The definition, row by row: query t attends to keys ds[b, t] .. t, with plain torch softmax."""
    B, H, T, D = q.shape
    G = H // k.shape[1]
    kk, vv = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    o = torch.empty_like(q)
    for b in range(B):
        for t in range(T):
            s0 = int(ds[b, t])
            w = torch.softmax(q[b, :, t, None] @ kk[b, :, s0 : t + 1].transpose(-1, -2) / D**0.5, dim=-1)
            o[b, :, t] = (w @ vv[b, :, s0 : t + 1])[:, 0]
    return o


class _RefFlash:
    """The tiled flash reference as a tape op with a chosen tile (the op runs REF_TILE = 128), so small shapes
    straddle many tile edges and skip tiles."""

    def __init__(self, tile):
        self.tile = tile

    def __call__(self, q, k, v, ds):
        o, lse = R.flash_attention_fwd_ref(q.data, k.data, v.data, True, None, self.tile, doc_starts=ds)

        def backward(do):
            return R.flash_attention_bwd_ref(do, q.data, k.data, v.data, o, lse, True, None, self.tile, doc_starts=ds)

        return Var.from_op(o, (q, k, v), backward, "flash_ref")


@pytest.mark.parametrize("tile", [4, 8, 16, 128])
def test_kernels_match_the_definition(tile):
    B, H, Hkv, T, D = 3, 4, 2, 61, 8  # T not a multiple of any tile
    q, k, v = qkv(B, H, Hkv, T, D)
    ds = starts_tensor(T, B, seed=tile)
    want = dense_oracle(q, k, v, ds)
    o_math, _ = R.attention_fwd(q, k, v, True, D**-0.5, ds)
    o_flash, lse = R.flash_attention_fwd_ref(q, k, v, True, None, tile, doc_starts=ds)
    assert rel_err(o_math, want) <= REL
    assert rel_err(o_flash, want) <= REL
    # backward: the flash reference against math attention's hand-written backward
    do = torch.randn_like(q)
    _, p = R.attention_fwd(q, k, v, True, D**-0.5, ds)
    want_g = R.attention_bwd(do, q, k, v, p, True, D**-0.5)
    got_g = R.flash_attention_bwd_ref(do, q, k, v, o_flash, lse, True, None, tile, doc_starts=ds)
    for a, b in zip(got_g, want_g):
        assert rel_err(a, b) <= REL


def test_tile_skip_happens_and_is_exact():
    """With documents shorter than a tile, most key tiles are skipped; the answer is that of every causal tile."""
    T, tile = 64, 8
    ids = torch.ones(1, T, dtype=torch.int64)
    ids[0, ::5] = EOT  # documents of 5 tokens
    ds = doc_starts(ids, EOT)
    first = R._first_tiles(ds, tile)
    assert first == [int(ds[0, i * tile]) // tile for i in range(T // tile)]
    assert sum(i + 1 - f for i, f in enumerate(first)) < sum(range(1, T // tile + 1)) // 2  # < half the tiles
    q, k, v = qkv(1, 2, 1, T, 8)
    o, _ = R.flash_attention_fwd_ref(q, k, v, True, None, tile, doc_starts=ds)
    assert rel_err(o, dense_oracle(q, k, v, ds)) <= REL


@pytest.mark.parametrize("which", ["composed", "math", "flash", "rows"])
def test_ops_match_the_definition_with_gradients(which):
    """Each op with doc_starts against torch.autograd of the dense definition."""
    B, H, Hkv, T, D = 2, 4, 2, 37, 8
    q, k, v = qkv(B, H, Hkv, T, D)
    ds = starts_tensor(T, B, seed=11)
    do = torch.randn(B, H, T, D, dtype=torch.float64)
    qt, kt, vt = (x.clone().requires_grad_(True) for x in (q, k, v))
    dense_oracle(qt, kt, vt, ds).backward(do)
    qv, kv, vv = Var(q.clone(), True), Var(k.clone(), True), Var(v.clone(), True)
    if which == "rows":
        v_rows = Var(v.transpose(1, 2).reshape(B * T, Hkv * D).clone(), True)
        out = ops.attention_rows(qv, kv, v_rows, Documents(ds), impl="math")  # [B*T, H*D]
        out.backward(do.transpose(1, 2).reshape(B * T, H * D))
        got = (out.data.view(B, T, H, D).transpose(1, 2), qv.grad, kv.grad,
               v_rows.grad.view(B, T, Hkv, D).transpose(1, 2))  # fmt: skip
    else:
        fn = {"composed": ops.attention, "math": ops.math_attention, "flash": ops.flash_attention}[which]
        out = fn(qv, kv, vv, Documents(ds))
        out.backward(do)
        got = (out.data, qv.grad, kv.grad, vv.grad)
    with torch.no_grad():
        want = dense_oracle(q, k, v, ds)
    for a, b in zip(got, (want, qt.grad, kt.grad, vt.grad)):
        assert rel_err(a, b) <= REL


@pytest.mark.parametrize("name", ["math", "flash", "flash_tile4"])
def test_gradcheck_with_doc_starts(name):
    B, H, Hkv, T, D = 2, 2, 1, 11, 4
    q, k, v = qkv(B, H, Hkv, T, D)
    ds = doc_starts(
        torch.tensor([[EOT, 1, 1, EOT, EOT, 1, 1, 1, 1, EOT, 1], [1, 1, 1, 1, EOT, 1, EOT, 1, 1, 1, 1]]), EOT
    )
    fn = {
        "math": lambda q, k, v, d: ops.math_attention(q, k, v, Documents(d)),
        "flash": lambda q, k, v, d: ops.flash_attention(q, k, v, Documents(d)),
        "flash_tile4": _RefFlash(4),
    }[name]
    errs = gradcheck(fn, [q, k, v], others=(ds,))
    assert max(errs) <= TOL_SMOOTH, errs


@pytest.mark.parametrize(
    "fn",
    [
        lambda q, k, v, d: ops.attention(q, k, v, Documents(d)),
        lambda q, k, v, d: ops.math_attention(q, k, v, Documents(d)),
        lambda q, k, v, d: ops.flash_attention(q, k, v, Documents(d)),
        lambda q, k, v, d: ops.auto_attention(q, k, v, Documents(d)),
    ],
    ids=["attention", "math_attention", "flash_attention", "auto_attention"],
)
def test_bad_doc_starts_raise(fn):
    q, k, v = (Var(x) for x in qkv(2, 2, 1, 6, 4))
    good = torch.zeros(2, 6, dtype=torch.int64)
    for bad in (good.to(torch.int32), torch.zeros(2, 7, dtype=torch.int64), torch.zeros(1, 6, dtype=torch.int64),
                good[0], [[0] * 6] * 2):  # fmt: skip
        with pytest.raises(ValueError, match=r"Documents: starts must be|attention: the document mask .* \[2, 6\]"):
            fn(q, k, v, bad)


def test_bad_doc_starts_raise_in_rows_and_model():
    q, k, v = (Var(x) for x in qkv(2, 2, 1, 6, 4))
    v_rows = Var(v.data.transpose(1, 2).reshape(12, 4))
    with pytest.raises(ValueError, match="attention_rows"):
        ops.attention_rows(q, k, v_rows, Documents(torch.zeros(2, 5, dtype=torch.int64)))
    m = Model(cfg("math"), seed=0)
    ids = torch.randint(1, 50, (2, 6))
    for bad in (torch.zeros(2, 6, dtype=torch.int32), torch.zeros(2, 5, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"Documents: starts must be|Model: the document mask"):
            m.loss(ids, ids, mask=Documents(bad))


@pytest.mark.parametrize("attention", ["math", "flash"])
def test_recompute_with_dropout_and_doc_starts_is_bit_identical(attention):
    """Recompute replays each block with the same doc_starts (and the same dropout masks): the same bits."""
    ids, tg, _ = packed_window(260, seed=5)
    ds = doc_starts(ids, EOT)
    got = []
    for recompute in (False, True):
        m = Model(dataclasses.replace(cfg(attention, recompute), dropout=0.1), seed=6)
        m.set_dropout_step(9)
        loss = m.loss(ids, tg, mask=Documents(ds))
        loss.backward()
        got.append((loss.data, [p.grad for p in m.parameters()]))
    assert torch.equal(got[0][0], got[1][0])
    assert all(torch.equal(a, b) for a, b in zip(got[0][1], got[1][1]))
