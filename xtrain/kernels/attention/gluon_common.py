"""Hopper (sm_90) Gluon helpers shared by the forward, the two-kernel backward and the one-pass backward.

Gluon (``triton.experimental.gluon``, Triton 3.6+) is Triton's lower-level dialect: the kernel states its
register layouts, shared-memory allocations, TMA copies, mbarriers, warpgroup MMAs (wgmma) and warp
specialisation. It has no CPU interpreter: the kernels run on an sm_90 GPU (tests marked ``gpu``) and, on
CPU, compile for sm_90 offline (``compile`` below; ``xtrain check --kernels 90``). ``HAVE_GLUON`` is False on
a Triton without Gluon; the routing then never picks these kernels.

What lives here:
  * the Gluon imports and the aliases of builtins that Gluon renamed after 3.6;
  * tensor layouts: every TMA descriptor is a 2-D row view. Contiguous [B, Hx, T, D] is [B·Hx·T, D] (row
    (b·Hx + h)·T + t, column 0); a [B, T, Hx, D] tensor seen through a transpose (the model's v) is
    [B·T, Hx·D] (row b·T + t, column h·D). A kernel gets (rb, rh, ch) per tensor and addresses (b, h, t) at
    row b·rb + h·rh + t, column h·ch; T a multiple of 128 keeps every tile inside one head (``_row_view``);
  * descriptor templates that launch plans re-base on new tensors (``descriptor_templates``, ``rebase_all``);
  * the backwards' shared parts: the input predicate ``supported_bwd``, the delta preprocess
    (``_prologue``, the Triton preprocess kernel), the dK/dV producer warp and the dK/dV store, and the
    program order ``_tail_order``: 1-D grids, head by head (programs running together share a head's
    streamed tiles in L2) except the last ``tail_waves`` waves of heads, which start tile-major so the grid
    ends on light programs.
"""

from __future__ import annotations

import torch

from xtrain.kernels._consts import LN2, LOG2E
from xtrain.kernels._dispatch import HAVE_TRITON, capability, launch_cached, rebased
from xtrain.kernels.attention import triton as TR
from xtrain.kernels.attention.reference import _check_bwd, _scale, _shapes

try:  # Gluon and its Hopper module (tested: triton 3.6 on the GPU machines, 3.9 here)
    if not HAVE_TRITON:  # not loaded where no kernel can run (``_dispatch``)
        raise ImportError("no Triton")
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401 (re-exported to the kernels)
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = True
except Exception:  # pragma: no cover - depends on the install
    HAVE_GLUON = False

HEAD_DIMS = (64, 128)
HALF_M = 64  # rows of one consumer warpgroup's share of a tile
RESIDENT = 128  # the backwards' resident keys (dK/dV) / query rows (dQ) per program
CONSUMER_REGS = 232  # registers per thread of the second consumer partition (setmaxnreg)
PRODUCER_REGS = 24
LSE_COLS = 16  # the split backward's lse / delta columns: one k16 slice of a wgmma, 3 of them used
TAIL_WAVES = 2  # the Gluon backwards' program order: the last 2 waves of heads start tile-major

if HAVE_GLUON:
    # Gluon renamed a few builtins after 3.6; module-level aliases resolve as globals inside @gluon.jit
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    HALF_ROWS = gl.constexpr(HALF_M)  # globals a @gluon.jit body reads must be constexpr objects
    _CONSUMER_REGS = gl.constexpr(CONSUMER_REGS)
    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)
    _LOG2E = gl.constexpr(LOG2E)
    _LN2 = gl.constexpr(LN2)
    _GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}

    @gluon.constexpr_function
    def _acc_layout(N):
        """wgmma accumulator layout of one warpgroup for a [64·k, N] result."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])

    @gluon.jit
    def _ring_init(ready, empty, STAGES: gl.constexpr):
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup

    @gluon.jit
    def _tail_order(pid, nb, TAIL):
        """(tile, head) of the linear program id ``pid`` of a grid of nb tiles x heads: head-major (a head's nb
        tiles one after the other, so the programs running at once share that head's streamed tiles in L2) but
        for the last TAIL heads, whose tiles go tile-major (tile 0 of each of them, then tile 1, ...). The
        hardware starts programs in id order, and tile 0 is the heaviest (the caller maps it to its heaviest
        causal tile), so the last programs to start are the lightest and the grid ends level."""
        return TR._tail_order(pid, nb, gl.num_programs(0) // nb, TAIL)  # the Triton kernels' arithmetic

    @gluon.jit
    def _next_query_tile(start_m, step, T, m0):
        """(start_m + step, or m0 once that reaches T: the group's next head from its first tile again; 1 if it
        wrapped, else 0): the split's dK/dV walk's next query tile, carried instead of divided out of the step."""
        start_m += step
        wrap = (start_m == T).to(gl.int32)
        return start_m - wrap * (T - m0), wrap

    @gluon.jit
    def _kv_rows(off_b, off_kvh, start_n, k_rb, k_rh, v_rb, v_rh, dk_rb, dk_rh, dv_rb, dv_rh):
        """TMA rows of the first of a program's keys (start_n of batch off_b, kv head off_kvh) in the K, V, dK and dV
        row views (module docstring, "Tensor layouts")."""
        return (
            off_b * k_rb + off_kvh * k_rh + start_n,
            off_b * v_rb + off_kvh * v_rh + start_n,
            off_b * dk_rb + off_kvh * dk_rh + start_n,
            off_b * dv_rb + off_kvh * dv_rh + start_n,
        )

    @gluon.jit
    def _dkdv_load(desc, stat_desc, bar, dst, stat_dst, row, col, lt, STATS: gl.constexpr, COLS: gl.constexpr):
        """One Q or dO tile into its ring slot and, with STATS, its lse (delta) statistic beside it on the same
        barrier: row lt of the [B·H·T / BLOCK_M, BLOCK_M] view, or with COLS (``lse_mma``) the step's [BLOCK_M,
        LSE_COLS] tile of the [B·H·T, LSE_COLS] column view."""
        if STATS:
            mbarrier.expect(bar, desc.block_type.nbytes + stat_desc.block_type.nbytes)
            if COLS:
                _tma_load(stat_desc, [lt * desc.block_type.shape[0], 0], bar, stat_dst)
            else:
                _tma_load(stat_desc, [lt, 0], bar, stat_dst)
        else:
            mbarrier.expect(bar, desc.block_type.nbytes)
        _tma_load(desc, [row, col], bar, dst)

    @gluon.jit
    def _dkdv_producer(args, lt0, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, COLS: gl.constexpr):
        """The TMA warp: the K and V halves once, then the Q and dO tiles of every (group head, query tile).
        SPLIT (the two-kernel backward): each step's (head, tile) carried from the step before (no division),
        one "empty" barrier per slot for both tiles (``q_empty``), and each step's lse and delta statistics
        beside Q and dO (``_dkdv_load``: rows lt0, lt0 + 1, ... of the row views; with COLS the column tiles).
        Otherwise (the one-pass backward): (head, tile) divided out of the step, an "empty" barrier per tile,
        and no statistics (the lse / delta descriptors and buffers are stand-ins)."""
        (
            q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem, lse_smem,
            delta_smem, kv_bar, q_bars, do_bars, q_empty, do_empty, k_row, k_col, v_row, v_col, q_base, q_rh, q_ch,
            do_base, do_rh, do_ch, h0, mt0, n_m, n_iter, T,
        ) = args  # fmt: skip
        KH: gl.constexpr = k_desc.block_type.shape[0]
        mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
        _tma_load(k_desc, [k_row, k_col], kv_bar, k_smem.index(0))
        _tma_load(k_desc, [k_row + KH, k_col], kv_bar, k_smem.index(1))
        _tma_load(v_desc, [v_row, v_col], kv_bar, v_smem.index(0))
        _tma_load(v_desc, [v_row + KH, v_col], kv_bar, v_smem.index(1))
        h = h0
        start_m = mt0 * BLOCK_M
        lt = lt0
        for it in range(n_iter):
            if not SPLIT:
                h = h0 + it // n_m
                start_m = (mt0 + it % n_m) * BLOCK_M
            slot = it % STAGES
            phase = ((it // STAGES) & 1) ^ 1  # fresh barriers: the first lap passes
            mbarrier.wait(q_empty.index(slot), phase)
            _dkdv_load(
                q_desc, lse_desc, q_bars.index(slot), q_smem.index(slot), lse_smem.index(slot),
                q_base + h * q_rh + start_m, h * q_ch, lt, SPLIT, COLS,
            )  # fmt: skip
            if not SPLIT:
                mbarrier.wait(do_empty.index(slot), phase)
            _dkdv_load(
                do_desc, delta_desc, do_bars.index(slot), do_smem.index(slot), delta_smem.index(slot),
                do_base + h * do_rh + start_m, h * do_ch, lt, SPLIT, COLS,
            )  # fmt: skip
            if SPLIT:
                start_m, wrap = _next_query_tile(start_m, BLOCK_M, T, mt0 * BLOCK_M)
                lt += 1
                lt += wrap * mt0
                h += wrap

    @gluon.jit
    def _dkdv_store(
        k_half, v_half, dk, dv, sm_scale, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col, dtype: gl.constexpr,
        HALF: gl.constexpr,
    ):  # fmt: skip
        """Warpgroup HALF's dK·scale and dV out through its dead K and V halves (shared memory) and TMA stores
        at rows dk_row / dv_row + HALF·64, drained before it returns."""
        KH: gl.constexpr = dk_desc.block_type.shape[0]
        k_half.store((dk * sm_scale).to(dtype))
        v_half.store(dv.to(dtype))
        fence_async_shared()
        _cta_barrier()
        _tma_store(dk_desc, [dk_row + HALF * KH, dk_col], k_half)
        _tma_store(dv_desc, [dv_row + HALF * KH, dv_col], v_half)
        tma.store_wait(0)


# ---------------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------------
_LAYOUTS: dict = {}


def _row_view(x: torch.Tensor):
    """(2-D view, rb, rh, ch) of x [B, Hx, T, D] for the TMA descriptor, or None when x has neither layout
    (contiguous, or token rows [B, T, Hx, D] >= Hx D apart seen through a transpose: v sliced from stacked q/k/v)."""
    B, Hx, T, D = x.shape
    if x.is_contiguous():
        return x.view(B * Hx * T, D), Hx * T, T, 0
    if x.stride() == (T * x.stride(2), D, x.stride(2), 1) and x.stride(2) >= Hx * D:
        return x.transpose(1, 2).reshape(B * T, Hx * D), T, 0, D
    return None


def _desc(view: torch.Tensor, rows: int, D: int):
    """A TMA descriptor over the 2-D row view, one tile = rows x D. The shared-memory layout is looked up once
    per (rows, D, dtype): building it took ~5 us of host time per descriptor."""
    key = (rows, D, view.dtype)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for([rows, D], _GL_DTYPES[view.dtype])
    return TensorDescriptor(view, list(view.shape), list(view.stride()), [rows, D], layout)


def row_coords(name: str, x: torch.Tensor) -> tuple:
    """(2-D row view of x for its descriptor, the kernel's coordinate arguments {name_rb, name_rh, name_ch}) of x
    in one of the two layouts (``_row_view``)."""
    view, rb, rh, ch = _row_view(x)
    return view, {f"{name}_rb": rb, f"{name}_rh": rh, f"{name}_ch": ch}


def tma_args(D: int, views: dict, coords: dict, **rows: int) -> dict:
    """For each name=rows: the descriptor ``{name}_desc`` over ``views[name]`` with tiles of rows x D, and name's
    coordinate arguments ``coords[name]`` (``row_coords``)."""
    out = {f"{n}_desc": _desc(views[n], r, D) for n, r in rows.items()}
    for n in rows:
        out.update(coords[n])
    return out


def descriptor_templates(args: dict) -> dict:
    """The tensor descriptors among a launch's arguments, as templates that hold no tensor (``rebased``)."""
    return {name: rebased(val, None) for name, val in args.items() if name.endswith("_desc")}


def rebase_all(descs: dict, ts: dict) -> dict:
    """The descriptors ``descs`` ({"q_desc": template, ...}) re-based on the tensors ``ts`` ({"q": q, ...}; the
    name before "_desc"), through the same 2-D views the templates were made over."""
    return {name: rebased(tmpl, _row_view(ts[name[:-5]])[0]) for name, tmpl in descs.items()}


def _tma_view(x: torch.Tensor):
    """``_row_view(x)`` (2-D view, rb, rh, ch) when a TMA descriptor can take x (one of the two layouts,
    16-byte aligned base), else None."""
    if x.ndim != 4 or x.data_ptr() % 16:
        return None
    return _row_view(x)


def _buf_ok(buf, like: torch.Tensor) -> bool:
    """An output buffer shaped, typed and placed like ``like``, in a layout the descriptors take."""
    return (
        isinstance(buf, torch.Tensor)
        and buf.shape == like.shape
        and buf.dtype == like.dtype
        and buf.device == like.device
        and _tma_view(buf) is not None
    )


def supported_bwd(do, q, k, v, o, lse, *, dq=None, dk=None, dv=None) -> bool:
    """Whether these inputs take the Gluon backward: Gluon present, an sm_90 GPU, bf16/fp16 q/k/v, D in
    (64, 128), T a positive multiple of 128, and q, k, v, do each contiguous or [B, T, Hx, D]-transposed;
    ``dq``/``dk``/``dv``: output buffers a caller will pass, which must be shaped and typed like q/k/v in one
    of those two layouts as well."""
    ts = (do, q, k, v, o, lse)
    if not HAVE_GLUON or not all(isinstance(t, torch.Tensor) and t.is_cuda for t in ts):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or not (q.dtype == k.dtype == v.dtype):
        return False
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or do.shape != q.shape or o.shape != q.shape:
        return False
    B, H, T, D = q.shape
    if D not in HEAD_DIMS or T == 0 or T % RESIDENT or k.shape[0] != B or k.shape[2:] != (T, D):
        return False
    if k.shape[1] == 0 or H % k.shape[1] or not (do.is_floating_point() and o.stride(-1) == 1):
        return False
    if capability(q.device) != (9, 0):
        return False
    if not all(buf is None or _buf_ok(buf, like) for buf, like in ((dq, q), (dk, k), (dv, v))):
        return False
    return all(_tma_view(x) is not None for x in (q, k, v, do))


def fresh_grad(like: torch.Tensor, follow: bool = True) -> torch.Tensor:
    """An empty gradient buffer for ``like`` [B, Hx, T, D]: token rows [B, T, Hx, D] seen through a transpose when
    ``follow`` and like is token rows (k and v as the model's projections give them: dk and dv then go back to the
    projections' rows without a transposing copy), else contiguous."""
    B, Hx, T, D = like.shape
    if follow and not like.is_contiguous() and _row_view(like) is not None:
        return torch.empty((B, T, Hx, D), dtype=like.dtype, device=like.device).transpose(1, 2)
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def _grad_buf(op: str, name: str, buf, like: torch.Tensor):
    """A caller's output buffer (tests pass NaN-poisoned ones) in a layout the descriptors take, or a fresh one:
    dk and dv in k's and v's layout, dq contiguous (``fresh_grad``)."""
    if buf is None:
        return fresh_grad(like, follow=name != "dq")
    if not _buf_ok(buf, like):
        raise ValueError(
            f"{op}: {name} buffer must be {tuple(like.shape)} {like.dtype} on {like.device}, "
            f"contiguous or [B, T, H, D]-transposed, got "
            f"{_shapes(buf) + f' strides {buf.stride()}' if torch.is_tensor(buf) else type(buf)}"
        )
    return buf


def tail_order(pid: int, nb: int, n_heads: int, tail: int) -> tuple:
    """The host-side mirror of the kernels' ``_tail_order`` (tests/test_flash_gluon_bwd.py checks it is a
    permutation that starts the last ``tail`` heads' tiles tile-major): (tile, head) of linear program pid."""
    first = (n_heads - tail) * nb
    if pid < first:
        return pid % nb, pid // nb
    return (pid - first) // tail, n_heads - tail + (pid - first) % tail


def tail_heads(nb: int, heads: int, n_sm: int, waves: int = TAIL_WAVES) -> int:
    """How many of the last heads of a grid of nb tiles x heads start tile-major (``_tail_order``): enough for
    ``waves`` waves of n_sm programs, at most all of them."""
    return TR.tail_heads(nb, heads, n_sm, waves)


def check_inputs(op: str, supported, head_dims, do, q, k, v, o, lse) -> None:
    """The backward's input check: the contract (``_check_bwd``), then ``supported`` (the Gluon backward's own
    predicate); a ValueError naming ``op`` otherwise."""
    _check_bwd(op, do, q, k, v, o, lse)
    if not supported(do, q, k, v, o, lse):
        raise ValueError(
            f"{op}: needs bf16/fp16 q, k, v on an sm_90 GPU with Gluon, D in {head_dims}, T a "
            f"multiple of {RESIDENT}, q/k/v/do contiguous or [B, T, H, D]-transposed (16-byte "
            f"aligned), o with unit last stride; got do/q/k/v/o/lse {_shapes(do, q, k, v, o, lse)}, "
            f"strides q {q.stride()} k {k.stride()} v {v.stride()} do {do.stride()} o {o.stride()}"
        )


def _prologue(op: str, do, q, k, v, o, lse, scale, dq, dk, dv, *, plan: bool = False, base2: bool = False, cols=None):
    """What both Gluon backwards do before their kernels, once the inputs are checked (``check_inputs``): the scale,
    the output buffers (``_grad_buf``), then the delta preprocess. Returns (do in q's dtype, lse fp32 contiguous,
    dq, dk, dv, delta, scale, the preprocess as a ``CachedLaunch`` if ``plan``, else None). ``base2`` (the split's
    kernels): the returned lse is a new buffer, lse·log2(e), written by the preprocess beside delta (the dK/dV
    kernel's TMA rows then need no multiply between their shared-memory load and the exponentials). ``cols`` (with
    base2): the (lse, delta) column buffers of ``lse_mma`` ([B, H, T, LSE_COLS] in q's dtype, ``new_columns``) for
    the preprocess to fill as well."""
    B, H, T, D = q.shape
    s = _scale(op, scale, D)
    do = do.to(q.dtype)  # a dense tensor keeps its strides (its layout was checked before)
    lse = lse.to(torch.float32).contiguous()
    dq = _grad_buf(op, "dq", dq, q)
    dk = _grad_buf(op, "dk", dk, k)
    dv = _grad_buf(op, "dv", dv, v)
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta) if base2 else None
    grid, pre_args = TR.preprocess_launch(o, do, delta, lse if base2 else None, lse2, cols, inv_scale=1.0 / s)
    out = lse2 if base2 else lse
    if plan:
        return do, out, dq, dk, dv, delta, s, launch_cached(TR._flash_bwd_preprocess_kernel, grid, pre_args)
    TR._flash_bwd_preprocess_kernel[grid](**pre_args)
    return do, out, dq, dk, dv, delta, s, None


def plan_outputs(pre, do, q, k, v, o, lse=None, columns: bool = False):
    """What both backward plans do first: allocate dq, dk, dv (as the full path's ``_grad_buf``)
    and delta, and launch the cached delta preprocess ``pre``. Returns (dq, dk, dv, delta, lse2, cols): with ``lse``
    (a plan made with ``_prologue(base2=True)``) lse2 is the lse·log2(e) buffer the preprocess writes from it, else
    None; with ``columns`` (a plan made with ``_prologue(cols=...)``) cols is the (lse, delta) column buffers it
    fills, else None."""
    B, H, T, _ = q.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk, dv = fresh_grad(k), fresh_grad(v)
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    if lse is None:
        pre(**TR.preprocess_buffers(o, do, delta))
        return dq, dk, dv, delta, None, None
    lse2 = torch.empty_like(delta)
    c = new_columns(q, columns)
    pre(**TR.preprocess_buffers(o, do, delta, lse.to(torch.float32).contiguous(), lse2, c))
    return dq, dk, dv, delta, lse2, c


def new_columns(q: torch.Tensor, columns: bool) -> tuple | None:
    """Empty (lse, delta) column buffers for q [B, H, T, D], [B, H, T, LSE_COLS] in q's dtype, if the config options
    ``columns`` (the split backward's ``lse_mma``); else None."""
    if not columns:
        return None
    B, H, T, _ = q.shape
    return tuple(torch.empty((B, H, T, LSE_COLS), dtype=q.dtype, device=q.device) for _ in range(2))


def stand_ins(D: int, T: int, H: int, Hkv: int, transposed: bool):
    """CPU bf16 tensors standing in for q [1, H, T, D] and k [1, Hkv, T, D] (the offline compiles): contiguous,
    or [B, T, Hx, D] memory seen through a transpose."""

    def mk(h):
        if transposed:
            return torch.empty(1, T, h, D, dtype=torch.bfloat16).transpose(1, 2)
        return torch.empty(1, h, T, D, dtype=torch.bfloat16)

    return mk(H), mk(Hkv)


def _compile(kernel, args: dict, consts: dict):
    """triton.compile of a Gluon kernel for sm_90 from example arguments (CPU tensors do) and constexprs."""
    from triton.backends import compiler
    from triton.experimental.gluon import _runtime
    from triton.runtime import jit

    types = {a: ("constexpr" if a in consts else jit.mangle_type(args[a])) for a in kernel.arg_names}
    return triton.compile(
        _runtime.GluonASTSource(kernel, types, consts),
        target=compiler.GPUTarget("cuda", 90, 32),
        options={"num_warps": 4},
    )
