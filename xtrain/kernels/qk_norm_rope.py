"""Per-head RMSNorm followed by RoPE, one fused step each way (Qwen3's q_norm/k_norm + rotary embedding).

    x [B, T, G*D] or [B*T, G*D] (a q or k projection, G heads of D) -> view [B, T, G, D]
    n = rms_norm over D with weight w [D]             (statistics in fp32, inv_rms [B*T*G] saved)
    y = rope(n transposed to [B, G, T, D])            (HF rotate_half convention, see kernels/rope.py)

Contract: qk_norm_rope_fwd(x, w, G, eps, positions, theta, table) -> (y [B, G, T, D] in x.dtype, inv_rms);
          qk_norm_rope_bwd(dy, x, w, G, inv_rms, positions, theta, table) -> (dx [B, T, G*D], dw [D]).
``table`` is ``rope_table(positions, D, theta, acc)``: the half-width cos/sin [T, D/2] (or [B, 1, T, D/2]
for positions [B, T]), computed once per model call and shared by every layer's q and k, each way. The reference
forward also takes w [G, D], one weight per head (the decode path's q and k heads together, inference only).

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
def _qk_norm_rope_fwd_kernel(
    X, W, C, S, Y, INV_RMS, R, G, T, c_sb, c_st, eps, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Rows r of BLOCK_R (r = (b T + t) G + g: one head of one token, D = 2 HALF wide), read once as the two
    halves; the norm's output rounded to X's dtype (as the unfused path does) and rotated in registers; y written
    at the row's own offset, which is the [B, T, G, D] memory the caller views as [B, G, T, D]."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    h = tl.arange(0, HALF)
    rm = rows < R
    m = rm[:, None]
    o1 = rows[:, None] * (2 * HALF) + h[None, :]
    x1 = tl.load(X + o1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(X + o1 + HALF, mask=m, other=0.0).to(tl.float32)
    w1 = tl.load(W + h).to(tl.float32)
    w2 = tl.load(W + HALF + h).to(tl.float32)
    r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
    tl.store(INV_RMS + rows, r, mask=rm)
    n1 = (x1 * r[:, None] * w1[None, :]).to(Y.dtype.element_ty).to(tl.float32)
    n2 = (x2 * r[:, None] * w2[None, :]).to(Y.dtype.element_ty).to(tl.float32)
    bt = rows // G
    oc = ((bt // T) * c_sb + (bt % T) * c_st)[:, None] + h[None, :]  # the table row of (b, t)
    c = tl.load(C + oc, mask=m, other=0.0)
    s = tl.load(S + oc, mask=m, other=0.0)
    tl.store(Y + o1, (n1 * c - n2 * s).to(Y.dtype.element_ty), mask=m)
    tl.store(Y + o1 + HALF, (n2 * c + n1 * s).to(Y.dtype.element_ty), mask=m)


@_jit
def _qk_norm_rope_bwd_kernel(
    DY, X, W, C, S, INV_RMS, DX, DW_PARTIAL, R, G, T, dy_sb, dy_sg, dy_st, c_sb, c_st, HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Program p: row tiles p, p + P, ...; dy read through its strides (any [B, G, T, D] layout), rotated back
    (dn, rounded to dy's dtype), then the norm's backward: dx = r (g - xhat mean(g xhat)), g = dn w, written at
    the row's offset in x's layout; dw's share summed in registers into partial row p (a fixed order:
    deterministic)."""
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
        g = rows % G
        bt = rows // G
        b = bt // T
        t = bt % T
        od = (b * dy_sb + g * dy_sg + t * dy_st)[:, None] + h[None, :]
        dy1 = tl.load(DY + od, mask=m, other=0.0).to(tl.float32)
        dy2 = tl.load(DY + od + HALF, mask=m, other=0.0).to(tl.float32)
        oc = (b * c_sb + t * c_st)[:, None] + h[None, :]
        c = tl.load(C + oc, mask=m, other=0.0)
        s = tl.load(S + oc, mask=m, other=0.0)
        # the inverse rotation, rounded to dy's dtype as the reference (and the unfused rope backward) rounds it
        dn1 = (dy1 * c + dy2 * s).to(DY.dtype.element_ty).to(tl.float32)
        dn2 = (dy2 * c - dy1 * s).to(DY.dtype.element_ty).to(tl.float32)
        o1 = rows[:, None] * (2 * HALF) + h[None, :]
        r = tl.load(INV_RMS + rows, mask=rm, other=0.0)[:, None]
        xh1 = tl.load(X + o1, mask=m, other=0.0).to(tl.float32) * r
        xh2 = tl.load(X + o1 + HALF, mask=m, other=0.0).to(tl.float32) * r
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
    x2 = x.contiguous()
    y = torch.empty((B, T, G, D), dtype=x.dtype, device=x.device)
    inv_rms = torch.empty(R, dtype=torch.float32, device=x.device)
    if R:
        c_sb, c_st = _table_strides(table, positions)
        BLOCK_R = _block_rows(D // 2)
        _qk_norm_rope_fwd_kernel[(triton.cdiv(R, BLOCK_R),)](
            x2, w.contiguous(), table[0], table[1], y, inv_rms, R, G, T, c_sb, c_st, eps, HALF=D // 2, BLOCK_R=BLOCK_R,
            num_warps=4,
        )  # fmt: skip
    return y.transpose(1, 2), inv_rms


def qk_norm_rope_bwd_triton(dy, x, w, G: int, inv_rms, positions, table):
    """One row kernel on a persistent grid (dy read through its strides: no copy whatever its layout) and one
    sum of the dw partial rows. dx in x's shape and dtype, dw [D] in w's dtype."""
    B, T, F = _bt(x, positions)
    D = F // G
    R = B * T * G
    if dy.shape != (B, G, T, D) or dy.stride(-1) != 1:
        raise ValueError(f"qk_norm_rope_bwd: dy must be [B, G, T, D] = {(B, G, T, D)} with unit last stride, got "
                         f"{tuple(dy.shape)} strides {dy.stride()}")  # fmt: skip
    x2 = x.contiguous()
    dx = torch.empty_like(x2)
    if R == 0:
        return dx, torch.zeros_like(w)
    c_sb, c_st = _table_strides(table, positions)
    BLOCK_R = _block_rows(D // 2)
    tiles = triton.cdiv(R, BLOCK_R)
    P = min(tiles, 4 * sm_count(x.device) if x.is_cuda else 4)
    P = triton.cdiv(tiles, triton.cdiv(tiles, P))  # no program without a tile
    partial = torch.empty(P, D, dtype=torch.float32, device=x.device)
    _qk_norm_rope_bwd_kernel[(P,)](
        dy, x2, w.contiguous(), table[0], table[1], inv_rms, dx, partial, R, G, T, dy.stride(0), dy.stride(1),
        dy.stride(2), c_sb, c_st, HALF=D // 2, BLOCK_R=BLOCK_R, num_warps=4,
    )  # fmt: skip
    return dx, partial.sum(dim=0).to(w.dtype)


def _fused_ok(x: torch.Tensor, G: int) -> bool:
    D = x.shape[-1] // G
    return x.dtype != torch.float64 and D >= 2 and D & (D - 1) == 0  # the kernels' tl.arange needs 2^k halves


def qk_norm_rope_fwd(x, w, G: int, eps: float, positions, theta: float, table):
    if _fused_ok(x, G) and use_triton(x, w):
        return qk_norm_rope_fwd_triton(x, w, G, eps, positions, table)
    return qk_norm_rope_fwd_ref(x, w, G, eps, positions, theta, table)


def qk_norm_rope_bwd(dy, x, w, G: int, inv_rms, positions, theta: float, table):
    if _fused_ok(x, G) and use_triton(dy, x, w):
        return qk_norm_rope_bwd_triton(dy, x, w, G, inv_rms, positions, table)
    return qk_norm_rope_bwd_ref(dy, x, w, G, inv_rms, positions, theta, table)
