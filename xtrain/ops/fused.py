"""Fused ops: several ops' work in one node, to save memory or passes.

linear_cross_entropy(x, w, targets) = cross_entropy(x @ w^T, targets) without ever holding the [N, V]
logits: the kernel (``xtrain.kernels.linear_cross_entropy``, after Liger-Kernel's fused linear
cross-entropy) walks the tokens in chunks and computes dx and dw during the forward, while each chunk's
logits exist. The loss is a scalar, so backward only scales the saved gradients by dloss.

qk_norm_rope(x, w, heads, positions) = rope(rms_norm(x per head)) in [B, H, T, D], one node each way, with
the cos/sin table computed once per model call (``rope_table``) instead of once per layer, op and direction.
qkv_norm_rope: the same for the q and k columns of the decode path's stacked q/k/v rows (inference), which also
writes k and v into the KV cache (on CUDA one kernel a decode step).
rows_linear: the decode path's projections of a few rows, with the norm or the SwiGLU before and the residual add
after in the same kernel (inference).

swiglu_linear(x, w_gate, w_up) = swiglu(x w_gate^T, x w_up^T): the MLP's input half as one node.

add_rms_norm(x, y, w) = (s, rms_norm(s, w)) with s = add_cast(x, y): the residual add and the norm after it in one
pass each way (two nodes, one kernel each way).
"""

from __future__ import annotations

import torch

from xtrain.autograd import Var, adds_into, is_grad_enabled
from xtrain.kernels import linear_cross_entropy as K
from xtrain.kernels import qk_norm_rope as K_qk
from xtrain.kernels import rms_norm as K_rms
from xtrain.kernels import rows_linear as K_rows
from xtrain.kernels import swiglu as K_swiglu
from xtrain.kernels._dispatch import prefer_fused, use_triton
from xtrain.ops.basic import _FLOAT, _check_compute, _check_same, _mm_to, cast_as, check, check_values, linear
from xtrain.ops.nn import cross_entropy

_INT = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def linear_cross_entropy(
    x: Var,
    w: Var,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
    *,
    w_compute: torch.Tensor | None = None,
) -> Var:
    """Scalar cross-entropy of logits = x @ w^T: x [N, C] (e.g. the final hidden states), w [V, C] (the
    lm-head weight, Hugging Face layout), targets [N] integer; rows whose target is ``ignore_index``
    count for nothing and "mean" divides by the number of counted rows. ``w_compute``: w's values in x's dtype
    (as ``linear``'s), used in w's place; w's gradient is then its gradient in x's dtype cast to w's, the values of
    ``cast_as(w, w_compute)`` bit for bit, but delivered by this node, the loss, which backward runs first (a tied
    embedding's backward then finds the head's gradient already on the table).

    Memory: dx [N, C] and dw [V, C] are kept from forward to backward instead of the logits."""
    op = "linear_cross_entropy"
    if w_compute is None:
        _check_same(op, x, w)
    else:
        _check_compute(op, w, w_compute, x)
    check(x.ndim == 2 and w.ndim == 2 and x.shape[1] == w.shape[1], op, "expected x [N, C] and w [V, C]", x, w)
    check(
        isinstance(targets, torch.Tensor) and targets.dtype in _INT,
        op,
        "targets must be an integer torch tensor",
        x,
        w,
        targets,
    )
    check(targets.shape == (x.shape[0],), op, "targets must be [N]", x, w, targets)
    check(targets.device == x.device, op, f"targets on {targets.device}, x on {x.device}", x, targets)
    check(reduction in ("mean", "sum"), op, f"reduction must be mean or sum, got {reduction!r}", x)
    V = w.shape[0]
    valid = targets[targets != ignore_index] if check_values(targets) else targets[:0]
    if valid.numel():
        lo, hi = int(valid.min()), int(valid.max())
        check(
            lo >= 0 and hi < V,
            op,
            f"targets must lie in [0, {V}) or equal ignore_index {ignore_index}, got range [{lo}, {hi}]",
            x,
            w,
            targets,
        )

    need_dx = is_grad_enabled() and x.requires_grad
    need_dw = is_grad_enabled() and w.requires_grad
    wd = w.data if w_compute is None else w_compute
    loss, dx, dw = K.linear_cross_entropy_fwd(
        x.data, wd, targets, ignore_index, reduction, need_dx=need_dx, need_dw=need_dw, chunk_size=chunk_size
    )

    def backward(dloss):
        gx, gw = K.linear_cross_entropy_bwd(dloss, dx, dw)
        return gx, (None if gw is None else gw.to(w.dtype))

    return Var.from_op(loss, (x, w), backward, op)


def rope_table(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32):
    """The half-width cos/sin table ``qk_norm_rope`` reads (compute it once per model call and share it
    across layers). ``dtype``: fp32, or fp64 for fp64 activations."""
    check(isinstance(positions, torch.Tensor) and positions.dtype in _INT, "rope_table",
          "positions must be an integer torch tensor", positions)  # fmt: skip
    check(positions.ndim in (1, 2), "rope_table", "positions must be [T] or [B, T]", positions)
    check(head_dim > 0 and head_dim % 2 == 0, "rope_table", f"head_dim must be even, got {head_dim}", positions)
    check(theta > 0, "rope_table", f"theta must be > 0, got {theta}", positions)
    return K_qk.rope_table(positions, head_dim, theta, dtype)


def _check_qk_norm_rope(op: str, x: Var, w: Var, heads: int, positions, theta: float, eps: float) -> None:
    """qk_norm_rope's input checks, each naming what is wrong (raises ValueError)."""
    if not (x.dtype in (torch.bfloat16, torch.float16) and w.dtype == torch.float32 and x.device == w.device):
        _check_same(op, x, w)  # else: an fp32 master weight for 16-bit activations, read in fp32 by the kernel
    check(x.ndim in (2, 3) and heads > 0 and x.shape[-1] % heads == 0, op,
          f"x must be [B, T, heads*D] or [B*T, heads*D], heads={heads}", x)  # fmt: skip
    check(isinstance(positions, torch.Tensor) and positions.ndim in (1, 2), op, "positions must be [T] or [B, T]", x,
          positions)  # fmt: skip
    T, F = positions.shape[-1], x.shape[-1]
    N = x.shape[0] if x.ndim == 2 else x.shape[0] * x.shape[1]
    check(T > 0 and N % T == 0 and (x.ndim == 2 or x.shape[1] == T), op, f"x's rows must be B x T with T={T}", x,
          positions)  # fmt: skip
    B = N // T
    D = F // heads
    check(w.ndim == 1 and w.shape[0] == D and D % 2 == 0, op, f"w must be [D] with D={D} even", x, w)
    check(isinstance(positions, torch.Tensor) and positions.dtype in _INT and positions.device == x.device, op,
          "positions must be an integer tensor on x's device", x, positions)  # fmt: skip
    check(positions.shape in ((T,), (B, T)), op, "positions must be [T] or [B, T]", x, positions)
    check(eps > 0 and theta > 0, op, f"eps and theta must be > 0, got {eps}, {theta}", x)
    raise AssertionError("unreachable: qk_norm_rope's fast check refused inputs that every check accepts")


def qk_norm_rope(
    x: Var, w: Var, heads: int, positions: torch.Tensor, theta: float = 10000.0, eps: float = 1e-6, table=None
) -> Var:
    """rope(rms_norm(x viewed as [B, T, heads, D], w [D]) transposed to [B, heads, T, D]) as one node: the
    same values as ``ops.rope(ops.transpose(ops.rms_norm(ops.reshape(x, ...), w, eps), 1, 2), ...)``, bit
    for bit on the reference path (one fused kernel each way on CUDA, the same roundings; its output a
    [B, heads, T, D] view of token-row memory). x [B, T, heads*D] (a q or k projection); positions [T] or
    [B, T]; ``table`` from ``rope_table`` (computed here when None). w: in x's dtype, or the fp32 master for
    bf16/fp16 x (no cast node either way; its gradient comes back in w's dtype)."""
    op = "qk_norm_rope"
    xd, wd = x.data, w.data
    acc = torch.float64 if xd.dtype == torch.float64 else torch.float32
    # the common case decided in one expression (a decode step calls this op 2L times); else the checks below name
    # what is wrong
    ok = False
    if isinstance(positions, torch.Tensor) and positions.dim() in (1, 2) and xd.dim() in (2, 3) and heads > 0:
        T, F = positions.shape[-1], xd.shape[-1]
        N = xd.shape[0] if xd.dim() == 2 else xd.shape[0] * xd.shape[1]
        D = F // heads
        ok = (
            (xd.dtype is wd.dtype or (xd.dtype in (torch.bfloat16, torch.float16) and wd.dtype is torch.float32))
            and xd.dtype in _FLOAT and xd.device == wd.device == positions.device and F % heads == 0
            and T > 0 and N % T == 0 and (xd.dim() == 2 or xd.shape[1] == T) and wd.dim() == 1
            and wd.shape[0] == D and D % 2 == 0 and positions.dtype in _INT
            and positions.shape in ((T,), (N // T, T)) and eps > 0 and theta > 0
        )  # fmt: skip
    if not ok:
        _check_qk_norm_rope(op, x, w, heads, positions, theta, eps)
    if table is None:
        table = K_qk.rope_table(positions, D, theta, acc)
    else:
        c = table[0]
        if not (c.dtype == acc and c.shape[-1] == D // 2 and c.shape[-2] == T and c.device == xd.device):
            check(False, op, f"table must be rope_table(positions, {D}, theta, {acc})", x, c)
    y, inv_rms = K_qk.qk_norm_rope_fwd(xd, wd, heads, eps, positions, theta, table)

    def backward(dy):
        return K_qk.qk_norm_rope_bwd(dy, xd, wd, heads, inv_rms, positions, theta, table)

    return Var.from_op(y, (x, w), backward, op)


def qkv_norm_rope(qkv: torch.Tensor, w: torch.Tensor, H: int, Hkv: int, mask, table, eps: float,
                  cache_kv: tuple) -> Var:  # fmt: skip
    """Inference (the decode path: no tape): the rows of the stacked q/k/v projection qkv [B*Tn, (H + 2 Hkv) D] of
    the Tn new tokens of a ``Cached`` mask's B rows -> q [B, H, Tn, D] as ``qk_norm_rope`` gives it, with k (normed
    and roped as q) and v written into the layer's cache ``cache_kv = (ck, cv)``, each [R, Hkv, Tmax, D], at the
    mask's rows and positions, where ``cached_attention`` reads them. ``w`` [H + Hkv, D]: q_norm's weight in H rows,
    then k_norm's (``Model._decode_weights`` stacks them); ``table`` the cos/sin of the mask's positions
    (``mask.rope``). A decode step on CUDA (Tn = 1) is one kernel (``qkv_norm_rope_store_triton``); another step on
    CUDA two ``qk_norm_rope`` calls and the writes; elsewhere the reference's operations once over the H + Hkv
    heads (a batch-1 decode step on the CPU is bound by the number of ops, not by their size) and the writes, as
    narrowed views for a lone row known on the host (``mask.row``), else indexed writes. Every path gives q and the
    caches the values of two ``qk_norm_rope`` calls and the writes, bit for bit."""
    op = "qkv_norm_rope"
    N, G = qkv.shape[0] if qkv.dim() == 2 else 0, H + Hkv
    D = w.shape[-1] if w.dim() == 2 else 0
    ck, cv = cache_kv if isinstance(cache_kv, tuple) and len(cache_kv) == 2 else (None, None)
    B, Tn = (mask.slots.shape[0], mask.new) if getattr(mask, "kind", None) == "cached" else (0, 0)
    if not (
        qkv.dim() == 2 and w.dim() == 2 and H > 0 and Hkv > 0 and tuple(w.shape) == (G, D) and D % 2 == 0
        and N == B * Tn and N > 0 and qkv.shape[1] == (G + Hkv) * D and qkv.dtype in _FLOAT
        and qkv.device == w.device == mask.slots.device and isinstance(ck, torch.Tensor)
        and isinstance(cv, torch.Tensor) and ck.dim() == 4 and ck.shape == cv.shape and ck.shape[1] == Hkv
        and ck.shape[3] == D and ck.dtype is cv.dtype is qkv.dtype and ck.device == cv.device == qkv.device
        and mask.keys <= ck.shape[2] and table[0].shape[-2] == Tn and not is_grad_enabled()
    ):  # fmt: skip
        check(False, op, f"need qkv [B*Tn, (H+2Hkv)*D], w [H+Hkv, D], a Cached mask of B rows of Tn new tokens, its "
              f"table, caches [R, Hkv, Tmax >= keys, D] of qkv's dtype, one device, under no_grad; H={H}, Hkv={Hkv}, "
              f"mask {mask!r}", Var(qkv), Var(w), *(t for t in (ck, cv) if isinstance(t, torch.Tensor)))  # fmt: skip
    # a decode step: one kernel (its tiles need D a power of 2; fp64 runs the reference, as qk_norm_rope's)
    if Tn == 1 and not D & (D - 1) and qkv.dtype is not torch.float64 and use_triton(qkv, w, ck):
        q = K_qk.qkv_norm_rope_store_triton(qkv, w, H, Hkv, eps, table, ck, cv, mask.slots, mask.start)
        return Var(q)
    positions = mask.positions(Tn, qkv.device)  # theta (0.0 below) is unused where a table is given
    if use_triton(qkv, w):
        q, k, v = qkv.split((H * D, Hkv * D, Hkv * D), dim=1)  # column slices
        q = K_qk.qk_norm_rope_fwd(q, w[0], H, eps, positions, 0.0, table)[0]
        k = K_qk.qk_norm_rope_fwd(k, w[H], Hkv, eps, positions, 0.0, table)[0]
    else:
        qk, v = qkv.split((G * D, Hkv * D), dim=1)  # [N, G*D] (a column slice), [N, Hkv*D]
        q, k = K_qk.qk_norm_rope_fwd_ref(qk, w, G, eps, positions, 0.0, table)[0].split((H, Hkv), dim=1)
    if mask.row is not None:  # one row known on the host: narrowed views (no gather, no indexing parse)
        s, p = mask.row
        ck.narrow(0, s, 1).narrow(2, p, Tn).copy_(k)
        cv.narrow(0, s, 1).narrow(2, p, Tn).copy_(v.view(1, Tn, Hkv, D).transpose(1, 2))
    else:
        rows = mask.slots[:, None]  # [B, 1] with positions [B, Tn]
        ck[rows, :, positions] = k.transpose(1, 2)  # the advanced indices first: the target is [B, Tn, Hkv, D]
        cv[rows, :, positions] = v.reshape(B, Tn, Hkv, D)
    return Var(q)


def rows_linear(x: torch.Tensor, w: torch.Tensor, pre: str | None = None, g: torch.Tensor | None = None,
                eps: float = 0.0, res: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Inference (the decode path: no tape): a few rows x times w [K, N] with the norm ("norm": x [M, K] normed by
    g [K] into w's dtype) or the SwiGLU ("glu": x [M, 2K], gate then up) before, and the residual res [M, N]
    (master dtype) added after (``kernels.rows_linear``). On CUDA with at most ``ROWS_MAX`` rows, one kernel;
    else the composed ops (cuBLAS on CUDA, ``addmm`` for the residual on the CPU)."""
    op = "rows_linear"
    M, Kx = x.shape if x.dim() == 2 else (0, 0)
    K, N = w.shape if w.dim() == 2 else (0, 0)
    if not (
        x.dim() == 2 and w.dim() == 2 and pre in K_rows._PRE and Kx == (2 * K if pre == "glu" else K) and K > 0
        and x.device == w.device and w.dtype in _FLOAT and (x.dtype is w.dtype or pre == "norm")
        and x.stride(-1) == 1 and (pre != "norm" or (g is not None and tuple(g.shape) == (K,)))
        and (res is None or (tuple(res.shape) == (M, N) and res.dtype in _FLOAT and res.stride(-1) == 1))
        and not is_grad_enabled()
    ):  # fmt: skip
        check(False, op, f"need x [M, K] ([M, 2K] for glu; in w's dtype unless normed, unit stride), w [K, N], g [K] "
              f"for norm, res [M, N], one device, under no_grad; pre={pre!r}", x, w, g, res)  # fmt: skip
    if use_triton(x, w) and M <= K_rows.ROWS_MAX:
        return K_rows.rows_linear_triton(x, w, pre, g, eps, res)
    return K_rows.rows_linear_ref(x, w, pre, g, eps, res, fast=x.is_cuda)


def rows_linear_weight(w: torch.Tensor) -> torch.Tensor:
    """A weight w [K, N] (any layout) as ``rows_linear`` reads it fastest: on CUDA as it is (the decode path's
    stacked weights are views of [N, K] memory, which its kernel reads along K), else contiguous [K, N] (x @ W on the
    CPU reads the rows it needs in order)."""
    return w if use_triton(w) else w.contiguous()


def lm_head_loss(x: Var, w: Var, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean", *,
                 w_compute: torch.Tensor | None = None) -> Var:  # fmt: skip
    """cross_entropy(x @ w^T, targets) in the form the device rule picks (``kernels._dispatch.prefer_fused``):
    ``linear_cross_entropy`` (no [N, V] logits) on CUDA, the composed linear + cross_entropy elsewhere (over
    ``cast_as(w, w_compute)`` when ``w_compute`` is given: the same values as the fused form's)."""
    if prefer_fused(x.data):
        return linear_cross_entropy(x, w, targets, ignore_index=ignore_index, reduction=reduction, w_compute=w_compute)
    w = w if w_compute is None else cast_as(w, w_compute)
    return cross_entropy(linear(x, w), targets, ignore_index=ignore_index, reduction=reduction)


def stacked(*ts: torch.Tensor) -> torch.Tensor | None:
    """The 2-D tensors ts as one [sum of rows, C] view when each starts where the one before ends in one contiguous
    storage, else None. The model hands gate/up and q/k/v so (``Model._compute_stack``: the optimizer's compute
    copies, which lie so when aligned, or casts into one buffer)."""
    a = ts[0]
    at, ptr = a.storage_offset(), a.untyped_storage().data_ptr()
    for b in ts:
        if not (b.dim() == 2 and b.is_contiguous() and b.shape[1:] == a.shape[1:] and b.dtype is a.dtype
                and b.untyped_storage().data_ptr() == ptr and b.storage_offset() == at):  # fmt: skip
            return None
        at += b.numel()
    return a.as_strided((sum(b.shape[0] for b in ts), a.shape[1]), a.stride())


def qkv_norm_rope_linear(x: Var, ws: tuple[Var, Var, Var], norms: tuple[Var, Var], H: int, Hkv: int, rope: tuple,
                         eps: float, *, w_compute: tuple | None = None) -> tuple[Var, Var, Var]:  # fmt: skip
    """The attention's input half in training: (q, k, v) = (qk_norm_rope(x wqᵀ, q_norm), qk_norm_rope(x wkᵀ,
    k_norm), x wvᵀ): q [B, H, T, D], k [B, Hkv, T, D], v [B*T, Hkv*D] rows. ``ws`` = (wq, wk, wv), ``norms`` =
    (q_norm, k_norm) weights, ``rope`` = (positions, table) as ``qk_norm_rope`` takes them; ``w_compute``: the
    three weights in x's dtype (``linear``'s).

    When the three weights lie one after the other in memory (``stacked``) this is ONE product x [wq; wk; wv]ᵀ ->
    [N, (H + 2 Hkv) D] each way: q and k are normed and roped from their column slices in place, v is its slice;
    in backward the q/k kernels and v's gradient write into the slices of one [N, (H + 2 Hkv) D] gradient
    (allocated by the first of them to run, each handing it on as the product's gradient so far), and x's
    gradient is one product over it (three weight gradients, each a plain leaf tensor). Else the five ops apart
    (three ``linear``, two ``qk_norm_rope``): the same values bit for bit as the model computed them before."""
    positions, table = rope
    wc = (None, None, None) if w_compute is None else w_compute
    w_all = stacked(*(tuple(w.data for w in ws) if w_compute is None else w_compute))
    if w_all is None or not (x.ndim == 2 and w_all.shape[1] == x.shape[1] and w_all.dtype is x.dtype):
        q, k, v = (linear(x, w, w_compute=c) for w, c in zip(ws, wc))
        q = qk_norm_rope(q, norms[0], H, positions, eps=eps, table=table)
        return q, qk_norm_rope(k, norms[1], Hkv, positions, eps=eps, table=table), v
    op = "qkv_norm_rope_linear"
    for w, c in zip(ws, wc):
        if c is not None:
            _check_compute(op, w, c, x)
        else:
            _check_same(op, x, w)
    xd, (Dq, Dk), D = x.data, (ws[0].shape[0], ws[1].shape[0]), norms[0].shape[-1]
    T = positions.shape[-1] if isinstance(positions, torch.Tensor) and positions.dim() in (1, 2) else 0
    check(norms[0].shape == norms[1].shape == (D,) and Dq == H * D and Dk == Hkv * D and ws[2].shape[0] == Dk
          and D % 2 == 0 and T > 0 and xd.shape[0] % T == 0, op,
          f"expected wq [H*D, C], wk and wv [Hkv*D, C], norms [D] (H={H}, Hkv={Hkv}) and positions [T] or [B, T]",
          x, *ws, *norms)  # fmt: skip
    cols = ((0, Dq), (Dq, Dq + Dk), (Dq + Dk, Dq + 2 * Dk))
    qkv = torch.mm(xd, w_all.t())  # [N, Dq + 2 Dk]
    written: list[int] = []  # which slices of the gradient the three consumers wrote this backward

    def into(acc, i: int):  # the stacked gradient (the first writer allocates it) and slice i of it
        buf = torch.empty_like(qkv) if acc is None else acc
        written.append(i)
        return buf, buf[:, cols[i][0] : cols[i][1]]

    @adds_into
    def backward(d, acc=(None, None, None, None)):
        for i in {0, 1, 2} - set(written):  # a slice no consumer's gradient reached counts as zero
            d[:, cols[i][0] : cols[i][1]] = 0
        written.clear()
        dx = None
        if x.requires_grad:
            dx = torch.mm(d, w_all) if acc[0] is None else torch.addmm(acc[0], d, w_all)
        dws = (_mm_to(d[:, a:b].t(), xd, w.dtype) if w.requires_grad else None for (a, b), w in zip(cols, ws))
        return (dx, *dws)

    J = Var.from_op(qkv, (x, *ws), backward, "qkv_linear")
    outs = []
    for i, (G, nw) in enumerate(((H, norms[0]), (Hkv, norms[1]))):
        xs = qkv[:, cols[i][0] : cols[i][1]]
        y, inv = K_qk.qk_norm_rope_fwd(xs, nw.data, G, eps, positions, 0.0, table)

        @adds_into
        def slice_backward(dy, acc=(None, None), i=i, G=G, nw=nw, xs=xs, inv=inv):
            buf, out = into(acc[0], i)
            return buf, K_qk.qk_norm_rope_bwd(dy, xs, nw.data, G, inv, positions, 0.0, table, out=out)[1]

        outs.append(Var.from_op(y, (J, nw), slice_backward, "qk_norm_rope"))

    @adds_into
    def v_backward(dv, acc=(None,)):
        buf, out = into(acc[0], 2)
        out.copy_(dv)
        return (buf,)

    return outs[0], outs[1], Var.from_op(qkv[:, cols[2][0] :], (J,), v_backward, "qkv_v")


def swiglu_linear(x: Var, w_gate: Var, w_up: Var, *, w_compute: tuple[torch.Tensor, torch.Tensor] | None = None) -> Var:
    """swiglu(x @ w_gate^T, x @ w_up^T) as one node (the MLP's input half): x [N, C], w_gate and w_up [F, C]
    -> [N, F]. Forward: the products and the swiglu kernel; backward: the swiglu kernel's (dg, du), then
    dx = dg w_gate + du w_up and the two weight gradients. ``w_compute``: (gate, up) in x's dtype, as ``linear``'s
    (weight gradients in the weights' dtype).

    When the two weights (or their compute copies) lie one after the other in memory (``stacked``), each of the
    forward product and dx is ONE matmul over the stacked [2F, C] weight: g and u are the two column halves of
    one [N, 2F] product, dg and du are written into the halves of one [N, 2F] gradient and dx = [dg du] [wg; wu]
    sums over 2F in one pass; the weight gradients stay two products (each a plain leaf tensor). Else two
    products each way, dx's second added in its matmul's epilogue (as the engine sums two linears' gradients):
    the same values as the three unfused ops bit for bit."""
    op = "swiglu_linear"
    if w_compute is None:
        _check_same(op, x, w_gate)
        _check_same(op, x, w_up)
        wg, wu = w_gate.data, w_up.data
    else:
        _check_compute(op, w_gate, w_compute[0], x)
        _check_compute(op, w_up, w_compute[1], x)
        wg, wu = w_compute
    check(x.ndim == 2 and w_gate.ndim == 2 and w_gate.shape == w_up.shape and w_gate.shape[1] == x.shape[1], op,
          "expected x [N, C] and w_gate, w_up [F, C]", x, w_gate, w_up)  # fmt: skip
    xd, F = x.data, wg.shape[0]
    wgu = stacked(wg, wu)
    if wgu is not None:
        gu = torch.mm(xd, wgu.t())  # [N, 2F]
        g, u = gu[:, :F], gu[:, F:]
    else:
        g = torch.mm(xd, wg.t())  # [N, F]
        u = torch.mm(xd, wu.t())  # [N, F]

    @adds_into
    def backward(dy, acc=(None, None, None)):
        if wgu is not None:
            dgu = torch.empty_like(gu)
            dg, du = K_swiglu.swiglu_bwd(dy, g, u, out=(dgu[:, :F], dgu[:, F:]))
        else:
            dg, du = K_swiglu.swiglu_bwd(dy, g, u)
        dx = None
        if x.requires_grad and wgu is not None:
            dx = torch.mm(dgu, wgu) if acc[0] is None else torch.addmm(acc[0], dgu, wgu)
        elif x.requires_grad:  # (x's gradient so far +) dg w_gate + du w_up: the sums in the matmuls' epilogues
            dx = torch.mm(dg, wg) if acc[0] is None else torch.addmm(acc[0], dg, wg)
            dx.addmm_(du, wu)
        return (
            dx,
            _mm_to(dg.t(), xd, w_gate.dtype) if w_gate.requires_grad else None,
            _mm_to(du.t(), xd, w_up.dtype) if w_up.requires_grad else None,
        )

    return Var.from_op(K_swiglu.swiglu_fwd(g, u), (x, w_gate, w_up), backward, op)


def add_rms_norm(x: Var, y: Var, weight: Var, eps: float = 1e-6, dtype: torch.dtype | None = None) -> tuple[Var, Var]:
    """(s, h) = (add_cast(x, y), rms_norm(s, weight, eps, dtype)), the same two nodes and values bit for bit (the
    backward on every device: both norms run one compiled kernel, DESIGN.md), with one kernel each way instead of two:

    * forward: the add and the norm in one pass (s is written and normed from the same registers, not read back);
    * backward: the norm's kernel writes its gradient of s (the residual's gradient so far plus its own, as
      ``rms_norm``'s) also in y's dtype, and the add's backward hands that to y instead of casting: when the
      gradient the add is handed is that very tensor (s read by nothing else after the norm; else it casts)."""
    op = "add_rms_norm"
    check(isinstance(x, Var) and isinstance(y, Var) and isinstance(weight, Var), op, "x, y, weight must be Vars", x, y)
    xd, yd, wd = x.data, y.data, weight.data
    if not (  # the common case in one expression (a decode step calls this op 2L times); else the checks below
        xd.dtype is wd.dtype and xd.dtype in _FLOAT and xd.device == yd.device == wd.device and xd.shape == yd.shape
        and (yd.dtype is xd.dtype or (yd.dtype in _FLOAT and torch.promote_types(xd.dtype, yd.dtype) == xd.dtype))
        and wd.dim() == 1 and xd.dim() >= 1 and xd.shape[-1] == wd.shape[0] and eps > 0
        and (dtype is None or dtype.is_floating_point)
    ):  # fmt: skip
        check(
            xd.dtype in _FLOAT and yd.dtype in _FLOAT and xd.device == yd.device and xd.shape == yd.shape
            and torch.promote_types(xd.dtype, yd.dtype) == xd.dtype,
            op, "x and y must be float tensors of one shape on one device, y's dtype promoting to x's", x, y,
        )  # fmt: skip
        _check_same(op, x, weight)
        check(wd.dim() == 1 and xd.dim() >= 1 and xd.shape[-1] == wd.shape[0], op, "weight must be [x's last dim]", x,
              weight)  # fmt: skip
        check(eps > 0 and (dtype is None or dtype.is_floating_point), op, f"eps > 0, float dtype; got {eps}, {dtype}",
              x)  # fmt: skip
    sd, hd, inv_rms = K_rms.add_rms_norm_fwd(
        xd, yd, wd, eps, dtype if dtype is not None and dtype != xd.dtype else None
    )
    low = yd.dtype if yd.dtype is not xd.dtype else None
    handed = []  # the norm's (gradient of s, the same in y's dtype), for the add's backward

    def add_backward(d):
        d_low = handed[0][1] if handed and handed[0][0] is d else d.to(yd.dtype)
        handed.clear()
        return d, d_low

    s = Var.from_op(sd, (x, y), add_backward, "add_cast")

    @adds_into
    def norm_backward(d, acc=(None, None)):  # acc[0]: s's gradient so far (the residual's), added in the kernel
        out = K_rms.rms_norm_bwd(d, sd, wd, inv_rms, acc[0], low)
        if low is not None:
            handed[:] = [(out[0], out[2])]
        return out[0], out[1]

    return s, Var.from_op(hd, (s, weight), norm_backward, "rms_norm")
