"""Per-head RMSNorm followed by RoPE, one fused step each way (Qwen3's q_norm/k_norm + rotary embedding).

    x [B, T, G*D] or [B*T, G*D] (a q or k projection, G heads of D) -> view [B, T, G, D]
    n = rms_norm over D with weight w [D]             (statistics in fp32, inv_rms [B*T*G] saved)
    y = rope(n transposed to [B, G, T, D])            (HF rotate_half convention, see kernels/rope.py)

Contract: qk_norm_rope_fwd(x, w, G, eps, positions, theta, table) -> (y [B, G, T, D] in x.dtype, inv_rms);
          qk_norm_rope_bwd(dy, x, w, G, inv_rms, positions, theta, table) -> (dx [B, T, G*D], dw [D]).
``table`` is ``rope_table(positions, D, theta, acc)``: the half-width cos/sin [T, D/2] (or [B, 1, T, D/2]
for positions [B, T]), computed once per model call and shared by every layer's q and k, each way. The reference
forward also takes w [G, D], one weight per head (the decode path's q and k heads together, inference only).
A decode step (inference, one token a row): qkv_norm_rope_store(qkv [B, (H + 2 Hkv) D], w [H + Hkv, D], H, Hkv,
eps, table, ck, cv, slots, start) -> q [B, H, 1, D], the k heads normed and roped and the v heads as they are
written into the KV caches ck, cv [R, Hkv, Tmax, D] at row slots[b], position start[b].

The reference performs exactly the operations of ``rms_norm_fwd_ref`` then ``rope_fwd_ref`` (and their
backwards in reverse), with the cos/sin taken from the table instead of recomputed per call, so the model
is bit-identical to the unfused composition in every dtype.

Triton kernels (CUDA; CPU through the interpreter for tests), over the R = B*T*G rows of D (one head of one
token; D a power of two, else the reference runs):
    _qk_norm_rope_fwd_kernel   BLOCK_R rows a program, read once as the halves x1, x2: the norm (statistics in
                               fp32, its output rounded to x's dtype as the reference rounds it), the rotation
                               with the table's cos/sin, y written at the row's own offset: y is a [B, G, T, D]
                               view of [B, T, G, D] memory, the layout the flash kernels read in place (their
                               output then comes back in token rows, so attention needs no transposing copy).
    _qk_norm_rope_bwd_kernel   a persistent grid: dy read through its strides (contiguous or token-row layout,
                               as the flash backward gives dq and dk), the inverse rotation (rounded to dy's
                               dtype, as the reference rounds it) and the norm's backward in registers, dx
                               written in x's layout; dw's share of each program in one partial row, the rows
                               summed in a fixed order (deterministic).
    _qkv_norm_rope_store_kernel  a decode step's heads of a row (the forward's tile and ``_norm_rope``: q and k
                               its bits), k and v stored into their cache rows: one launch a layer for four.
One pass each way instead of three (rms_norm, a layout copy, rope) forward and four backward.
"""

from __future__ import annotations

import torch

from xtrain.kernels import rope as K_rope
from xtrain.kernels._dispatch import jit as _jit
from xtrain.kernels._dispatch import sm_count, tl, triton, use_triton


def rope_table(positions: torch.Tensor, D: int, theta: float, dtype: torch.dtype):
    """Half-width (cos, sin) [.., T, D/2] in ``dtype``, broadcastable over [B, G, T, D/2]: the values
    ``kernels.rope`` computes for these positions (same maths, bit for bit)."""
    cos, sin = K_rope.rope_cos_sin(positions, D, theta, dtype)
    h = D // 2
    c, s = cos[..., :h], sin[..., :h]
    if c.dim() == 3:  # positions [B, T] -> [B, 1, T, D/2]
        c, s = c[:, None], s[:, None]
    return c, s


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, sign: float, acc: torch.dtype, y=None) -> torch.Tensor:
    """kernels.rope._rotate with the table given: y1 = x1 c - sign x2 s, y2 = x2 c + sign x1 s. ``y``: where to
    write (shaped like x, in acc; any layout), e.g. a transposed view of the layout the next step reads."""
    h = x.shape[-1] // 2
    xf = x if x.dtype == acc else x.to(acc)
    x1, x2 = xf.split(h, dim=-1)  # the halves (views; one call for both)
    if y is None:
        y = torch.empty(xf.shape, dtype=acc, device=x.device)
    y1, y2 = y.split(h, dim=-1)
    torch.mul(x1, c, out=y1)
    y1.addcmul_(x2, s, value=-sign)
    torch.mul(x2, c, out=y2)
    y2.addcmul_(x1, s, value=sign)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _bt(x: torch.Tensor, positions: torch.Tensor) -> tuple[int, int, int]:
    """(B, T, F) of x [B, T, F] or [B*T, F]; T is the positions' last dim."""
    T, F = positions.shape[-1], x.shape[-1]
    return x.numel() // (T * F), T, F


def qk_norm_rope_fwd_ref(x, w, G: int, eps: float, positions, theta: float, table):
    """``w``: [D], or [G, D] (a weight per head: the decode path's q and k heads normed together, forward only).
    x may be a column slice of wider rows (the q/k part of the stacked q/k/v projection): its rows are read in
    place."""
    B, T, F = _bt(x, positions)
    D = F // G
    acc = _acc(x)
    xf = x.reshape(-1, G, D)  # [B*T, G, D]
    if xf.dtype != acc:
        xf = xf.to(acc)
    inv_rms = (xf * xf).mean(dim=-1).add_(eps).rsqrt_()  # [B*T, G]
    n = torch.mul(xf, inv_rms[..., None]).mul_(w if w.dtype == acc else w.to(acc))
    if n.dtype != x.dtype:
        n = n.to(x.dtype)  # the unfused path rounds the norm's output to x's dtype before rope
    n = n.view(B, T, G, D).transpose(1, 2)  # [B, G, T, D]
    return _rotate(n, table[0], table[1], 1.0, acc), inv_rms.view(-1)  # inv_rms [B*T*G]


def qk_norm_rope_bwd_ref(dy, x, w, G: int, inv_rms, positions, theta: float, table):
    B, T, F = _bt(x, positions)
    D = F // G
    acc = _acc(x)
    # written straight into [B, T, G, D] memory (through its [B, G, T, D] view), so the rows below need no copy
    buf = torch.empty((B, T, G, D), dtype=acc, device=dy.device)
    dn = _rotate(dy, table[0], table[1], -1.0, acc, y=buf.transpose(1, 2)).transpose(1, 2)  # [B, T, G, D]
    # rms_norm_bwd_ref's operations, in its order: dx = r (g - xhat * mean(g * xhat)), g = dn * w
    xf = x.reshape(-1, D)  # [B*T*G, D]
    dyf = dn.reshape(-1, D)  # a view
    if xf.dtype != acc:
        xf, dyf = xf.to(acc), dyf.to(acc)
    r = (inv_rms if inv_rms.dtype == acc else inv_rms.to(acc))[:, None]  # [B*T*G, 1]
    xhat = xf * r
    dw = (dyf * xhat).sum(dim=0)  # [D]
    g = dyf * (w if w.dtype == acc else w.to(acc))
    dot = (g * xhat).mean(dim=-1, keepdim=True)
    dx = g.sub_(xhat.mul_(dot)).mul_(r)
    if dx.dtype != x.dtype:
        dx = dx.to(x.dtype)
    return dx.reshape(x.shape), (dw if dw.dtype == w.dtype else dw.to(w.dtype))


# ------------------------------------------------------------------------------------------------ Triton


@_jit
def _norm_rope(x1, x2, w1, w2, c, s, eps, HALF: tl.constexpr):
    """Rows of halves x1, x2 [ROWS, HALF] (storage dtype) -> the rotated halves (fp32) and inv_rms [ROWS]: the norm
    with statistics in fp32, its output rounded to x's dtype (as the unfused path rounds it), then the rotation by
    c, s (fp32, broadcast over the rows). Both forward kernels inline it: the same operations, bit for bit."""
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    r = 1.0 / tl.sqrt((tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)) / (2 * HALF) + eps)
    n1 = (a1 * r[:, None] * w1).to(x1.dtype).to(tl.float32)
    n2 = (a2 * r[:, None] * w2).to(x1.dtype).to(tl.float32)
    return n1 * c - n2 * s, n2 * c + n1 * s, r


@_jit
def _qk_norm_rope_fwd_kernel(
    X, W, C, S, Y, INV_RMS, R, G, T, x_rs, c_sb, c_st, eps, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Rows r of BLOCK_R (r = (b T + t) G + g: one head of one token, D = 2 HALF wide; x's token rows x_rs apart),
    read once as the two halves, normed and rotated in registers (``_norm_rope``); y written at the row's own
    offset, which is the [B, T, G, D] memory the caller views as [B, G, T, D]."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    h = tl.arange(0, HALF)
    rm, bt = rows < R, rows // G
    m = rm[:, None]
    o1 = rows[:, None] * (2 * HALF) + h[None, :]
    ox = (bt * x_rs + (rows % G) * (2 * HALF))[:, None] + h[None, :]
    x1 = tl.load(X + ox, mask=m, other=0.0)
    x2 = tl.load(X + ox + HALF, mask=m, other=0.0)
    w1 = tl.load(W + h).to(tl.float32)[None, :]
    w2 = tl.load(W + HALF + h).to(tl.float32)[None, :]
    oc = ((bt // T) * c_sb + (bt % T) * c_st)[:, None] + h[None, :]  # the table row of (b, t)
    c = tl.load(C + oc, mask=m, other=0.0)
    s = tl.load(S + oc, mask=m, other=0.0)
    y1, y2, r = _norm_rope(x1, x2, w1, w2, c, s, eps, HALF)
    tl.store(INV_RMS + rows, r, mask=rm)
    tl.store(Y + o1, y1.to(Y.dtype.element_ty), mask=m)
    tl.store(Y + o1 + HALF, y2.to(Y.dtype.element_ty), mask=m)


@_jit
def _qkv_norm_rope_store_kernel(
    QKV, W, C, S, Q, CK, CV, SLOTS, START, s_qkv, c_sb, s_row, s_head, s_pos, eps, H: tl.constexpr,
    HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Program (b, tile j): heads g = j BLOCK_R .. of token b's q/k/v row, as rows of the forward kernel's tile
    shape (the same layout, so the norm's sums run in the same order: q and k bit for bit as that kernel gives
    them). q heads (g < H) -> Q [B, H, D]; k heads -> CK[slots[b], g - H, start[b]]; v heads (no norm, no
    rotation) -> CV[slots[b], g - H - HKV, start[b]]."""
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.arange(0, HALF)
    is_q, is_k = (g < H)[:, None], ((g >= H) & (g < H + HKV))[:, None]
    is_v = ((g >= H + HKV) & (g < H + 2 * HKV))[:, None]
    o1 = b * s_qkv + g[:, None] * (2 * HALF) + h[None, :]
    x1 = tl.load(QKV + o1, mask=is_q | is_k | is_v, other=0.0)
    x2 = tl.load(QKV + o1 + HALF, mask=is_q | is_k | is_v, other=0.0)
    ow = g[:, None] * (2 * HALF) + h[None, :]  # w's row g (q_norm's or k_norm's); none for v
    w1 = tl.load(W + ow, mask=is_q | is_k, other=0.0).to(tl.float32)
    w2 = tl.load(W + ow + HALF, mask=is_q | is_k, other=0.0).to(tl.float32)
    c = tl.load(C + b * c_sb + h)[None, :]  # the table row of position start[b]
    s = tl.load(S + b * c_sb + h)[None, :]
    y1, y2, r = _norm_rope(x1, x2, w1, w2, c, s, eps, HALF)
    oq = (b * H + g)[:, None] * (2 * HALF) + h[None, :]
    tl.store(Q + oq, y1.to(Q.dtype.element_ty), mask=is_q)
    tl.store(Q + oq + HALF, y2.to(Q.dtype.element_ty), mask=is_q)
    at = tl.load(SLOTS + b) * s_row + tl.load(START + b) * s_pos  # the row's new position in the cache
    ok = at + (g - H).to(tl.int64)[:, None] * s_head + h[None, :]
    tl.store(CK + ok, y1.to(CK.dtype.element_ty), mask=is_k)
    tl.store(CK + ok + HALF, y2.to(CK.dtype.element_ty), mask=is_k)
    ov = ok - HKV * s_head
    tl.store(CV + ov, x1, mask=is_v)
    tl.store(CV + ov + HALF, x2, mask=is_v)


@_jit
def _qk_norm_rope_bwd_kernel(
    DY, X, W, C, S, INV_RMS, DX, DW_PARTIAL, R, G, T, dy_sb, dy_sg, dy_st, x_rs, dx_rs, c_sb, c_st,
    HALF: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Program p: row tiles p, p + P, ...; dy read through its strides (any [B, G, T, D] layout), rotated back
    (dn, rounded to dy's dtype), then the norm's backward: dx = r (g - xhat mean(g xhat)), g = dn w, written at
    the row's offset in dx's layout (token rows dx_rs apart; x's x_rs); dw's share summed in registers into
    partial row p (a fixed order: deterministic)."""
    pid = tl.program_id(0)
    h = tl.arange(0, HALF)
    w1 = tl.load(W + h).to(tl.float32)
    w2 = tl.load(W + HALF + h).to(tl.float32)
    dw1 = tl.zeros([BLOCK_R, HALF], dtype=tl.float32)
    dw2 = tl.zeros([BLOCK_R, HALF], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(R, BLOCK_R), tl.num_programs(0)):
        rows = (tile * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        rm = rows < R
        m = rm[:, None]
        g, bt = rows % G, rows // G
        b, t = bt // T, bt % T
        od = (b * dy_sb + g * dy_sg + t * dy_st)[:, None] + h[None, :]
        dy1 = tl.load(DY + od, mask=m, other=0.0).to(tl.float32)
        dy2 = tl.load(DY + od + HALF, mask=m, other=0.0).to(tl.float32)
        oc = (b * c_sb + t * c_st)[:, None] + h[None, :]
        c = tl.load(C + oc, mask=m, other=0.0)
        s = tl.load(S + oc, mask=m, other=0.0)
        # the inverse rotation, rounded to dy's dtype as the reference (and the unfused rope backward) rounds it
        dn1 = (dy1 * c + dy2 * s).to(DY.dtype.element_ty).to(tl.float32)
        dn2 = (dy2 * c - dy1 * s).to(DY.dtype.element_ty).to(tl.float32)
        o1 = (bt * x_rs + g * (2 * HALF))[:, None] + h[None, :]
        r = tl.load(INV_RMS + rows, mask=rm, other=0.0)[:, None]
        xh1 = tl.load(X + o1, mask=m, other=0.0).to(tl.float32) * r
        xh2 = tl.load(X + o1 + HALF, mask=m, other=0.0).to(tl.float32) * r
        o1 += (bt * (dx_rs - x_rs))[:, None]  # dx's row
        g1 = dn1 * w1[None, :]
        g2 = dn2 * w2[None, :]
        dot = (tl.sum(g1 * xh1, axis=1) + tl.sum(g2 * xh2, axis=1))[:, None] / (2 * HALF)
        tl.store(DX + o1, ((g1 - xh1 * dot) * r).to(DX.dtype.element_ty), mask=m)
        tl.store(DX + o1 + HALF, ((g2 - xh2 * dot) * r).to(DX.dtype.element_ty), mask=m)
        dw1 += dn1 * xh1
        dw2 += dn2 * xh2
    tl.store(DW_PARTIAL + pid.to(tl.int64) * (2 * HALF) + h, tl.sum(dw1, axis=0))
    tl.store(DW_PARTIAL + pid.to(tl.int64) * (2 * HALF) + HALF + h, tl.sum(dw2, axis=0))


def _table_strides(table, positions) -> tuple[int, int]:
    """(batch, position) strides of the half-width cos/sin table ([T, D/2] or [B, 1, T, D/2] views)."""
    c, s = table
    if c.stride() != s.stride() or c.stride(-1) != 1 or c.dtype != torch.float32:
        raise ValueError(
            f"qk_norm_rope: table must be fp32 cos/sin of one layout, got strides {c.stride()}, {s.stride()}"
        )
    return (c.stride(0) if positions.dim() == 2 else 0), c.stride(-2)


def _block_rows(HALF: int) -> int:
    return max(1, 2048 // HALF)  # 4096 elements a tile: 64 rows of D = 64


def qk_norm_rope_fwd_triton(x, w, G: int, eps: float, positions, table):
    """One kernel: y [B, G, T, D] as a view of [B, T, G, D] memory (the layout the flash kernels read without a
    copy; the attention output then comes back in token rows), inv_rms [B*T*G] fp32."""
    B, T, F = _bt(x, positions)
    D = F // G
    if D % 2 or D & (D - 1):
        raise ValueError(f"qk_norm_rope: the Triton kernel needs a power-of-two head dim, got D={D}")
    R = B * T * G
    x2 = _token_rows(x, F)
    y = torch.empty((B, T, G, D), dtype=x.dtype, device=x.device)
    inv_rms = torch.empty(R, dtype=torch.float32, device=x.device)
    if R:
        c_sb, c_st = _table_strides(table, positions)
        BLOCK_R = _block_rows(D // 2)
        _qk_norm_rope_fwd_kernel[(triton.cdiv(R, BLOCK_R),)](
            x2, w.contiguous(), table[0], table[1], y, inv_rms, R, G, T, x2.stride(0), c_sb, c_st, eps, HALF=D // 2,
            BLOCK_R=BLOCK_R, num_warps=4,
        )  # fmt: skip
    return y.transpose(1, 2), inv_rms


def qkv_norm_rope_store_ref(qkv, w, H: int, Hkv: int, eps: float, table, ck, cv, slots, start):
    """A decode step's contract in plain torch: ``qk_norm_rope_fwd_ref`` over the H + Hkv q and k heads of each
    row of qkv, then indexed writes of k and v at (slots[b], start[b]) of the caches -> q [B, H, 1, D]."""
    B, (G, D) = qkv.shape[0], w.shape
    qk, v = qkv.split((G * D, Hkv * D), dim=1)  # [B, G*D] (a column slice), [B, Hkv*D]
    q, k = qk_norm_rope_fwd_ref(qk, w, G, eps, start[:, None], 0.0, table)[0].split((H, Hkv), dim=1)  # [B, *, 1, D]
    ck[slots, :, start] = k[:, :, 0]  # the advanced indices first: the target is [B, Hkv, D]
    cv[slots, :, start] = v.reshape(B, Hkv, D)
    return q


def qkv_norm_rope_store_triton(qkv, w, H: int, Hkv: int, eps: float, table, ck, cv, slots, start):
    """One kernel for a decode step (one token a row): qkv [B, (H + 2 Hkv) D] (rows read through their stride),
    w [H + Hkv, D], table the (cos, sin) of the rows' positions ([1, D/2] for a lone row, or [B, 1, 1, D/2]),
    ck, cv [R, Hkv, Tmax, D], slots and start int64 [B] on the device -> q [B, H, 1, D]; k and v written into
    the caches at (slots[b], start[b])."""
    B, (G, D) = qkv.shape[0], w.shape
    c, s = table
    if not (qkv.stride(-1) == 1 and ck.stride() == cv.stride() and ck.stride(-1) == 1 and D >= 2 and not D & (D - 1)
            and c.stride() == s.stride() and c.stride(-1) == 1 and c.dtype == torch.float32 and c.shape[-2] == 1
            and c.dim() in (2, 4) and c.numel() == (B if c.dim() == 4 else 1) * (D // 2)):  # fmt: skip
        raise ValueError(f"qkv_norm_rope_store: needs unit last strides, caches of one layout, D a power of 2 and an "
                         f"fp32 table of one position a row; got qkv {tuple(qkv.shape)} strides {qkv.stride()}, "
                         f"ck {tuple(ck.shape)}, table {tuple(c.shape)} {c.dtype}")  # fmt: skip
    q = torch.empty((B, H, 1, D), dtype=qkv.dtype, device=qkv.device)
    BLOCK_R = _block_rows(D // 2)  # the forward kernel's tile: see _qkv_norm_rope_store_kernel
    _qkv_norm_rope_store_kernel[(B, triton.cdiv(G + Hkv, BLOCK_R))](
        qkv, w.contiguous(), c, s, q, ck, cv, slots, start, qkv.stride(0), c.stride(0) if c.dim() == 4 else 0,
        ck.stride(0), ck.stride(1), ck.stride(2), eps, H=H, HKV=Hkv, HALF=D // 2, BLOCK_R=BLOCK_R, num_warps=4,
    )  # fmt: skip
    return q


def _desc(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} strides {t.stride()}"


def _token_rows(x: torch.Tensor, F: int) -> torch.Tensor:
    """x as [B*T, F] token rows, read in place when the columns are (a column slice of the stacked q/k/v product)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, F)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def qk_norm_rope_bwd_triton(dy, x, w, G: int, inv_rms, positions, table, out=None):
    """One row kernel on a persistent grid (dy read through its strides: no copy whatever its layout) and one
    sum of the dw partial rows. dx in x's shape and dtype (written into ``out``, [B*T, F] token rows with a unit
    column stride, when given), dw [D] in w's dtype."""
    B, T, F = _bt(x, positions)
    D = F // G
    R = B * T * G
    if dy.shape != (B, G, T, D) or dy.stride(-1) != 1:
        raise ValueError(f"qk_norm_rope_bwd: dy must be [B, G, T, D] = {(B, G, T, D)}, unit last stride: {_desc(dy)}")
    x2 = _token_rows(x, F)
    if out is not None and (out.shape != (B * T, F) or out.stride(1) != 1 or out.dtype != x.dtype):
        raise ValueError(f"qk_norm_rope_bwd: out must be {(B * T, F)} rows of {x.dtype}, got {_desc(out)}")
    dx = torch.empty((B * T, F), dtype=x.dtype, device=x.device) if out is None else out
    if R == 0:
        return (dx if out is not None else dx.view(x.shape)), torch.zeros_like(w)
    c_sb, c_st = _table_strides(table, positions)
    BLOCK_R = _block_rows(D // 2)
    tiles = triton.cdiv(R, BLOCK_R)
    P = min(tiles, 4 * sm_count(x.device) if x.is_cuda else 4)
    P = triton.cdiv(tiles, triton.cdiv(tiles, P))  # no program without a tile
    partial = torch.empty(P, D, dtype=torch.float32, device=x.device)
    _qk_norm_rope_bwd_kernel[(P,)](
        dy, x2, w.contiguous(), table[0], table[1], inv_rms, dx, partial, R, G, T, dy.stride(0), dy.stride(1),
        dy.stride(2), x2.stride(0), dx.stride(0), c_sb, c_st, HALF=D // 2, BLOCK_R=BLOCK_R, num_warps=4,
    )  # fmt: skip
    return (dx if out is not None else dx.view(x.shape)), partial.sum(dim=0).to(w.dtype)


def _fused_ok(x: torch.Tensor, G: int) -> bool:
    D = x.shape[-1] // G
    return x.dtype != torch.float64 and D >= 2 and D & (D - 1) == 0  # the kernels' tl.arange needs 2^k halves


def qk_norm_rope_fwd(x, w, G: int, eps: float, positions, theta: float, table):
    if _fused_ok(x, G) and use_triton(x, w):
        return qk_norm_rope_fwd_triton(x, w, G, eps, positions, table)
    return qk_norm_rope_fwd_ref(x, w, G, eps, positions, theta, table)


def qk_norm_rope_bwd(dy, x, w, G: int, inv_rms, positions, theta: float, table, out=None):
    """-> (dx, dw); dx written into ``out`` ([B*T, F] token rows: a column slice of the stacked q/k/v's) if given."""
    if _fused_ok(x, G) and use_triton(dy, x, w):
        return qk_norm_rope_bwd_triton(dy, x, w, G, inv_rms, positions, table, out)
    dx, dw = qk_norm_rope_bwd_ref(dy, x, w, G, inv_rms, positions, theta, table)
    return (dx if out is None else out.copy_(dx.view(out.shape))), dw
