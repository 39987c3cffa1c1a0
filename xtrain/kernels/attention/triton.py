"""Flash attention in portable Triton: the forward and the two-kernel backward on any CUDA GPU.

Contract (that of ``reference.flash_attention_fwd_ref`` / ``flash_attention_bwd_ref``, the oracles):
    flash_attention_fwd_triton(q [B,H,T,D], k, v [B,Hkv,T,D], causal, scale, *, config) -> (o, lse [B,H,T] fp32)
    flash_attention_bwd_triton(do, q, k, v, o, lse, causal, scale, *, config) -> (dq, dk, dv)
fp32/bf16/fp16, D in (32, 64, 128), any T; ``config`` (``TritonFwdConfig`` / ``TritonBwdConfig``) is chosen
by ``xtrain.kernels.attention.choose`` and passed in. fp32 uses exact fp32 dots (``input_precision="ieee"``);
16-bit inputs feed the tensor cores and accumulate in fp32 (P and dS rounded to the input dtype, as in
FlashAttention).

Algorithm: FlashAttention-2's work split (Dao 2023), in the base-2 domain (log2 e folded into the scale, exp2
throughout). Forward: one program per (query tile, head); causal tiles left of the diagonal run a loop with no mask
code, only the diagonal band pays for the mask. Backward: a dK/dV kernel whose program keeps a K/V tile resident and
walks the query tiles of every head of its GQA group (no atomics), and a dQ kernel whose program keeps a Q tile
resident; both deterministic, run concurrently on two CUDA streams. Grids are 1-D, head by head (programs running
together share a head's K/V in L2, heaviest causal tile first), except the last ``tail_waves`` waves of heads, which
start tile-major so the grid ends on light programs. Tensor descriptors (TMA) load the streamed tiles where the config
asks and T is a multiple of the tiles. On an H200 (bf16, causal) these kernels run at 0.8-1.0x cuDNN; on Hopper the
routing sends the shapes where the Gluon kernels are faster to them.

Document masks (``doc_starts`` int64 [B, T], packed documents: query t sees key s iff ds[t] <= s <= t; the idea of
skipping whole blocks is that of FlexAttention's block masks). A query-tile program (forward, dQ) reads its rows' starts
and splits the keys left of its diagonal in three: tiles before the earliest start are skipped, tiles up to the latest
start run masked, the rest run the unmasked hot loop; the diagonal band is masked by both rules. A dK/dV program reads
two per-tile bounds computed on the device (``doc_query_bounds``): query rows after the band that see the whole key tile
run unmasked, later rows masked up to the last row that sees any key of the tile, and no row after it is visited. So for
documents shorter than T the work falls with the mean document length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xtrain.kernels._consts import LN2, LOG2E
from xtrain.kernels._dispatch import HAVE_TRITON, run_side_by_side, sm_count
from xtrain.kernels.attention.reference import _check_bwd, _check_qkv, _scale, _shapes, check_doc_starts

SUPPORTED_HEAD_DIMS = (32, 64, 128)
PRE_M = 64  # rows of o / dO per program of the delta preprocess
_HAVE_DESC = False  # set below when Triton's host-side tensor descriptors import


@dataclass(frozen=True)
class Tiles:
    """One Triton kernel's launch: ``block_m`` x ``block_n`` tiles, warps, pipeline stages, TMA loads."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    tma: bool = False

    def launch(self) -> dict:
        """The launch's tile constexprs and options."""
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, num_warps=self.warps, num_stages=self.stages)


@dataclass(frozen=True)
class TritonFwdConfig:
    """The forward kernel's tiles (block_m a multiple of block_n: the causal split) and program order
    (``plan_sms``: the SM count the order plans for; None: the device's, ``grid_sms``)."""

    tiles: Tiles
    tail_waves: int = 2
    plan_sms: int | None = None


@dataclass(frozen=True)
class TritonBwdConfig:
    """The dK/dV kernel's tiles (block_n keys resident, block_m queries a step; block_n % block_m == 0), the dQ
    kernel's (block_m queries resident, block_n keys a step; block_m % block_n == 0) and the program order
    (``plan_sms`` as in ``TritonFwdConfig``). On CUDA the two kernels run concurrently on two streams."""

    dkdv: Tiles
    dq: Tiles
    tail_waves: int = 2
    plan_sms: int | None = None


if HAVE_TRITON:
    import triton
    import triton.language as tl

    try:  # host-side tensor descriptors (Triton >= 3.4); without them the kernels use pointer loads
        from triton.tools.tensor_descriptor import TensorDescriptor

        _HAVE_DESC = True
    except ImportError:  # pragma: no cover
        _HAVE_DESC = False
    _LOG2E = tl.constexpr(LOG2E)
    _LN2 = tl.constexpr(LN2)

    @triton.jit
    def _tail_order(pid, nb, n_heads, TAIL):
        """(tile, head) of linear program id ``pid`` of a 1-D grid of nb tiles x n_heads: head by head (so the
        programs running together share one head's streamed tiles in L2), except the last TAIL heads, whose
        tiles go tile-major (tile 0 of each, then tile 1, ...). The hardware starts programs in id order and the
        callers make tile 0 the heaviest causal tile, so the grid ends on light programs, not on the last head's
        heaviest one."""
        first = (n_heads - TAIL) * nb
        tile = pid % nb
        head = pid // nb
        if pid >= first:
            tile = (pid - first) // TAIL
            head = n_heads - TAIL + (pid - first) % TAIL
        return tile, head

    @triton.jit
    def _doc_key_tiles(DS, off_b, offs_m, T, mid, BLOCK_N: tl.constexpr):
        """A query tile's document starts (int32 [BLOCK_M], from DS [B, T]) and its key range [lo, full) of masked
        tiles: those before ``lo`` (the tile holding the rows' earliest start) are skipped, those from ``full`` (the
        first tile at or after the latest start) up to ``mid`` need no document mask."""
        starts = tl.load(DS + off_b.to(tl.int64) * T + offs_m, mask=offs_m < T, other=0).to(tl.int32)
        full = tl.minimum(tl.cdiv(tl.max(starts), BLOCK_N) * BLOCK_N, mid)
        lo = tl.minimum((tl.min(tl.where(offs_m < T, starts, T)) // BLOCK_N) * BLOCK_N, full)
        return starts, lo, full

    @triton.jit
    def _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, desc_k, desc_v, kv_row0, offs_m, starts, T, qk_scale,
        lo, hi, MASK: tl.constexpr, CAUSAL: tl.constexpr, EVEN_T: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, DOC: tl.constexpr = False,
    ):  # fmt: skip
        """Online-softmax update of (acc, l_i, m_i) over the K/V tiles starting at lo, lo+BLOCK_N, .. < hi.
        m_i is kept in the log2 domain (scores times qk_scale = scale·log2 e). MASK=False is the hot loop:
        no mask arithmetic, every key valid. DOC (with MASK): also drop keys before each row's document start
        ``starts`` [BLOCK_M]; a row may then have seen no key yet (m_i = -inf), so the exponent subtracts 0 there."""
        offs_d = tl.arange(0, HEAD_DIM)
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k_ptrs = k_base + offs_n[:, None] * stride_kt + offs_d[None, :]
            v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]
            if USE_TMA:  # bulk tensor copy (Hopper TMA); only used when T is a multiple of the tiles
                k = desc_k.load([kv_row0 + start_n, 0])
            elif MASK and not EVEN_T:
                k = tl.load(k_ptrs, mask=offs_n[:, None] < T, other=0.0)
            else:
                k = tl.load(k_ptrs)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32, unscaled
            if MASK:
                if CAUSAL:
                    keep = offs_m[:, None] >= offs_n[None, :]  # also drops keys >= T: every query row < T
                else:
                    keep = (offs_n < T)[None, :]
                if DOC:
                    keep = keep & (offs_n[None, :] >= starts[:, None])
                s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            if DOC:
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_use = m_new
            p = tl.exp2(s * qk_scale - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)  # 0 on the first tile (m_i = -inf)
            l_i = l_i * alpha + tl.sum(p, 1)
            if USE_TMA:
                v = desc_v.load([kv_row0 + start_n, 0])
            elif MASK and not EVEN_T:
                v = tl.load(v_ptrs, mask=offs_n[:, None] < T, other=0.0)
            else:
                v = tl.load(v_ptrs)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _flash_fwd_kernel(
        Q, K, V, O, LSE, DS, desc_k, desc_v, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
        stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot, H, T, GROUP, qk_scale, TAIL,
        CAUSAL: tl.constexpr, EVEN_T: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, DOC: tl.constexpr = False,
    ):  # fmt: skip
        """One program: BLOCK_M query rows of one (batch, head); a 1-D grid of cdiv(T, BLOCK_M)·B·H programs
        in ``_tail_order``. With USE_TMA, K/V tiles come through host-built tensor descriptors over the
        [B*Hkv*T, D] rows. DOC: packed documents, DS the contiguous int64 [B, T] document starts (module
        docstring, "Document masks")."""
        nb = tl.cdiv(T, BLOCK_M)
        pid_m, off_bh = _tail_order(tl.program_id(0), nb, tl.num_programs(0) // nb, TAIL)
        if CAUSAL:  # heaviest query tiles first: the short ones fill the tail of the grid
            pid_m = nb - 1 - pid_m
        off_b = off_bh // H
        off_h = off_bh % H
        off_kvh = off_h // GROUP
        start_m = pid_m * BLOCK_M
        kv_row0 = (off_b * (H // GROUP) + off_kvh) * T  # first row of this K/V head in [B*Hkv*T, D]
        q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        k_base = K + off_b.to(tl.int64) * stride_kb + off_kvh.to(tl.int64) * stride_kh
        v_base = V + off_b.to(tl.int64) * stride_vb + off_kvh.to(tl.int64) * stride_vh
        o_base = O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        q_ptrs = q_base + offs_m[:, None] * stride_qt + offs_d[None, :]
        if EVEN_T:
            q = tl.load(q_ptrs)
        else:
            q = tl.load(q_ptrs, mask=offs_m[:, None] < T, other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if CAUSAL:
            mid = start_m  # keys strictly left of this query tile: never masked
        else:
            mid = (T // BLOCK_N) * BLOCK_N  # every full K/V tile
        lo = 0
        starts = offs_m  # unused without DOC
        if DOC:  # key tiles before the rows' earliest start: skipped; up to the latest start: masked
            starts, lo, full = _doc_key_tiles(DS, off_b, offs_m, T, mid, BLOCK_N)
            acc, l_i, m_i = _fwd_tiles(
                acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, desc_k, desc_v, kv_row0, offs_m, starts, T,
                qk_scale, lo=lo, hi=full, MASK=True, CAUSAL=CAUSAL, EVEN_T=EVEN_T, BLOCK_N=BLOCK_N,
                HEAD_DIM=HEAD_DIM, DOT_PRECISION=DOT_PRECISION, USE_TMA=USE_TMA, DOC=True,
            )  # fmt: skip
            lo = full
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, desc_k, desc_v, kv_row0, offs_m, starts, T,
            qk_scale, lo=lo, hi=mid, MASK=False, CAUSAL=CAUSAL, EVEN_T=EVEN_T, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
            DOT_PRECISION=DOT_PRECISION, USE_TMA=USE_TMA,
        )  # fmt: skip
        if CAUSAL or not EVEN_T:  # the diagonal band (causal mask) or the ragged last K/V tile (keys >= T masked)
            if CAUSAL:
                end = tl.minimum(start_m + BLOCK_M, T)
            else:
                end = T
            acc, l_i, m_i = _fwd_tiles(
                acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, desc_k, desc_v, kv_row0, offs_m, starts, T,
                qk_scale, lo=mid, hi=end, MASK=True, CAUSAL=CAUSAL, EVEN_T=EVEN_T, BLOCK_N=BLOCK_N,
                HEAD_DIM=HEAD_DIM, DOT_PRECISION=DOT_PRECISION, USE_TMA=USE_TMA, DOC=DOC,
            )  # fmt: skip
        acc = acc / l_i[:, None]
        lse = (m_i + tl.log2(l_i)) * _LN2  # log2 domain -> natural log
        o_ptrs = o_base + offs_m[:, None] * stride_ot + offs_d[None, :]
        lse_ptrs = LSE + off_bh.to(tl.int64) * T + offs_m
        if EVEN_T:
            tl.store(o_ptrs, acc.to(O.dtype.element_ty))
            tl.store(lse_ptrs, lse)
        else:
            tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=offs_m[:, None] < T)
            tl.store(lse_ptrs, lse, mask=offs_m < T)

    @triton.jit
    def _flash_bwd_preprocess_kernel(
        O, DO, DELTA, LSE, LSE2, LSEC, DELTAC, INV_SCALE, stride_ob, stride_oh, stride_ot, stride_dob, stride_doh,
        stride_dot, H, T, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, SCALE_LSE: tl.constexpr = False,
        COLS: tl.constexpr = 0,
    ):  # fmt: skip
        """DELTA[b, h, i] = sum_d dO[b, h, i, d] · O[b, h, i, d] in fp32; SCALE_LSE: also LSE2 = LSE · log2(e)
        (the Gluon split backward's base-2 row statistic; LSE, LSE2 contiguous fp32 [B, H, T]). COLS (> 0, with
        SCALE_LSE): also LSEC and DELTAC, contiguous [B, H, T, COLS] in O's dtype, row i holding -LSE[i] · INV_SCALE
        (INV_SCALE = 1 / softmax scale) and -DELTA[i] each as three parts in that dtype (columns 0-2, the parts
        summing to the fp32 value to ~24 bits; zeros after): the Gluon split's ``lse_mma`` columns. LSE and LSE2
        are not touched without SCALE_LSE, LSEC and DELTAC not without COLS (``preprocess_buffers``)."""
        pid_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = off_bh // H
        off_h = off_bh % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m[:, None] < T
        o = tl.load(
            O
            + off_b.to(tl.int64) * stride_ob
            + off_h.to(tl.int64) * stride_oh
            + offs_m[:, None] * stride_ot
            + offs_d[None, :],
            mask=row_ok,
            other=0.0,
        )
        do = tl.load(
            DO
            + off_b.to(tl.int64) * stride_dob
            + off_h.to(tl.int64) * stride_doh
            + offs_m[:, None] * stride_dot
            + offs_d[None, :],
            mask=row_ok,
            other=0.0,
        )
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
        tl.store(DELTA + off_bh.to(tl.int64) * T + offs_m, delta, mask=offs_m < T)
        if SCALE_LSE:
            lse = tl.load(LSE + off_bh.to(tl.int64) * T + offs_m, mask=offs_m < T)
            tl.store(LSE2 + off_bh.to(tl.int64) * T + offs_m, lse * _LOG2E, mask=offs_m < T)
            if COLS > 0:
                cols = tl.arange(0, COLS)
                at = (off_bh.to(tl.int64) * T + offs_m)[:, None] * COLS + cols[None, :]
                tl.store(LSEC + at, _three_parts(-lse * INV_SCALE, cols, LSEC.dtype.element_ty), mask=row_ok)
                tl.store(DELTAC + at, _three_parts(-delta, cols, DELTAC.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _three_parts(x, cols, dtype: tl.constexpr):
        """[BLOCK_M, COLS] in dtype: row i = (hi, mid, lo, 0, ...) with hi + mid + lo = x[i] to ~24 bits (each part
        the dtype rounding of what the ones before it leave)."""
        hi = x.to(dtype)
        r = x - hi.to(tl.float32)
        mid = r.to(dtype)
        lo = (r - mid.to(tl.float32)).to(dtype)
        c = cols[None, :]
        zero = tl.zeros_like(hi)[:, None]
        return tl.where(c == 0, hi[:, None], tl.where(c == 1, mid[:, None], tl.where(c == 2, lo[:, None], zero)))

    @triton.jit
    def _bwd_dkdv_tiles(
        dk, dv, k, v, q_base, do_base, lse_base, delta_base, ds_base, stride_qt, stride_dot, desc_q, desc_do, q_row0,
        offs_n, T, qk_scale, lo, hi, MASK: tl.constexpr, EVEN_T: tl.constexpr, BLOCK_M: tl.constexpr,
        HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, DOC: tl.constexpr = False,
    ):  # fmt: skip
        """Accumulate dK, dV of one resident K/V tile over the query tiles lo, lo+BLOCK_M, .. < hi, working
        transposed ([keys, queries]) so the products with q and dO need no transposes of the results.
        Query rows >= T load as zeros (q, dO, lse, delta) and so contribute exactly zero. MASK: the causal mask;
        DOC (with MASK): also drop keys before each query row's document start (read from ``ds_base``)."""
        offs_d = tl.arange(0, HEAD_DIM)
        for start_m in range(lo, hi, BLOCK_M):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_ptrs = q_base + offs_m[:, None] * stride_qt + offs_d[None, :]
            do_ptrs = do_base + offs_m[:, None] * stride_dot + offs_d[None, :]
            if USE_TMA:
                q = desc_q.load([q_row0 + start_m, 0])
                lse = tl.load(lse_base + offs_m)
            elif EVEN_T:
                q = tl.load(q_ptrs)
                lse = tl.load(lse_base + offs_m)
            else:
                q = tl.load(q_ptrs, mask=offs_m[:, None] < T, other=0.0)
                lse = tl.load(lse_base + offs_m, mask=offs_m < T, other=0.0)
            s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
            p_t = tl.exp2(s_t * qk_scale - (lse * _LOG2E)[None, :])  # lse to log2 domain
            if MASK:
                keep = offs_m[None, :] >= offs_n[:, None]
                if DOC:
                    starts = tl.load(ds_base + offs_m, mask=offs_m < T, other=0).to(tl.int32)
                    keep = keep & (offs_n[:, None] >= starts[None, :])
                p_t = tl.where(keep, p_t, 0.0)
            if USE_TMA:
                do = desc_do.load([q_row0 + start_m, 0])
                delta = tl.load(delta_base + offs_m)
            elif EVEN_T:
                do = tl.load(do_ptrs)
                delta = tl.load(delta_base + offs_m)
            else:
                do = tl.load(do_ptrs, mask=offs_m[:, None] < T, other=0.0)
                delta = tl.load(delta_base + offs_m, mask=offs_m < T, other=0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        return dk, dv

    @triton.jit
    def _flash_bwd_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV, DS, QB, desc_q, desc_do, stride_qb, stride_qh, stride_qt, stride_kb,
        stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot, stride_dkb,
        stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt, H, Hkv, T, GROUP, qk_scale, sm_scale, TAIL,
        CAUSAL: tl.constexpr, EVEN_T: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, DOC: tl.constexpr = False,
    ):  # fmt: skip
        """One program: BLOCK_N keys of one (batch, K/V head), over all query heads of its group; a 1-D grid
        of cdiv(T, BLOCK_N)·B·Hkv programs in ``_tail_order``. Causal programs at small pid_n have the most
        work and start first. DOC: packed documents; DS the int64 [B, T] document starts, QB the int32
        [B, cdiv(T, BLOCK_N), 2] query-row bounds of each key tile (``doc_query_bounds``)."""
        nb = tl.cdiv(T, BLOCK_N)
        pid_n, off_bkv = _tail_order(tl.program_id(0), nb, tl.num_programs(0) // nb, TAIL)
        off_b = off_bkv // Hkv
        off_kvh = off_bkv % Hkv
        start_n = pid_n * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        k_ptrs = (
            K
            + off_b.to(tl.int64) * stride_kb
            + off_kvh.to(tl.int64) * stride_kh
            + offs_n[:, None] * stride_kt
            + offs_d[None, :]
        )
        v_ptrs = (
            V
            + off_b.to(tl.int64) * stride_vb
            + off_kvh.to(tl.int64) * stride_vh
            + offs_n[:, None] * stride_vt
            + offs_d[None, :]
        )
        if EVEN_T:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=offs_n[:, None] < T, other=0.0)
            v = tl.load(v_ptrs, mask=offs_n[:, None] < T, other=0.0)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        ds_base = DS
        full_end = T
        rows_end = T
        if DOC:  # query rows [band end, full_end) see the whole key tile; [full_end, rows_end) part of it
            ds_base = DS + off_b.to(tl.int64) * T
            bounds = QB + (off_b * nb + pid_n).to(tl.int64) * 2
            rows_end = tl.load(bounds + 1)
            full_end = tl.maximum((tl.load(bounds) // BLOCK_M) * BLOCK_M, start_n + BLOCK_N)
        for g in range(GROUP):
            off_h = off_kvh * GROUP + g
            q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
            do_base = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
            lse_base = LSE + (off_b * H + off_h).to(tl.int64) * T
            delta_base = DELTA + (off_b * H + off_h).to(tl.int64) * T
            q_row0 = (off_b * H + off_h) * T  # first row of this head in [B*H*T, D] (TMA coordinates)
            if CAUSAL:  # query rows in this key tile's diagonal band see only part of it: masked
                dk, dv = _bwd_dkdv_tiles(
                    dk, dv, k, v, q_base, do_base, lse_base, delta_base, ds_base, stride_qt, stride_dot, desc_q,
                    desc_do, q_row0, offs_n, T, qk_scale, lo=start_n, hi=tl.minimum(start_n + BLOCK_N, T), MASK=True,
                    EVEN_T=EVEN_T, BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM, DOT_PRECISION=DOT_PRECISION, USE_TMA=USE_TMA,
                    DOC=DOC,
                )  # fmt: skip
                below = start_n + BLOCK_N  # query rows below the band see all of it
            else:
                below = 0
            dk, dv = _bwd_dkdv_tiles(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, ds_base, stride_qt, stride_dot, desc_q, desc_do,
                q_row0, offs_n, T, qk_scale, lo=below, hi=full_end, MASK=False, EVEN_T=EVEN_T, BLOCK_M=BLOCK_M,
                HEAD_DIM=HEAD_DIM, DOT_PRECISION=DOT_PRECISION, USE_TMA=USE_TMA,
            )  # fmt: skip
            if DOC:  # rows of later documents up to the last row that sees a key of this tile
                dk, dv = _bwd_dkdv_tiles(
                    dk, dv, k, v, q_base, do_base, lse_base, delta_base, ds_base, stride_qt, stride_dot, desc_q,
                    desc_do, q_row0, offs_n, T, qk_scale, lo=full_end, hi=rows_end, MASK=True, EVEN_T=EVEN_T,
                    BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM, DOT_PRECISION=DOT_PRECISION, USE_TMA=USE_TMA, DOC=True,
                )  # fmt: skip
        dk = dk * sm_scale
        dk_ptrs = (
            DK
            + off_b.to(tl.int64) * stride_dkb
            + off_kvh.to(tl.int64) * stride_dkh
            + offs_n[:, None] * stride_dkt
            + offs_d[None, :]
        )
        dv_ptrs = (
            DV
            + off_b.to(tl.int64) * stride_dvb
            + off_kvh.to(tl.int64) * stride_dvh
            + offs_n[:, None] * stride_dvt
            + offs_d[None, :]
        )
        if EVEN_T:
            tl.store(dk_ptrs, dk.to(DK.dtype.element_ty))
            tl.store(dv_ptrs, dv.to(DV.dtype.element_ty))
        else:
            tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=offs_n[:, None] < T)
            tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < T)

    @triton.jit
    def _bwd_dq_tiles(
        dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, desc_k, desc_v, kv_row0, offs_m, starts, T,
        qk_scale, lo, hi, MASK: tl.constexpr, EVEN_T: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
        DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, DOC: tl.constexpr = False,
    ):  # fmt: skip
        """Accumulate dQ of one resident query tile over the K/V tiles lo, lo+BLOCK_N, .. < hi.
        Keys >= T load as zero rows of K, so their dS (whatever it is) times k adds exactly zero. DOC (with
        MASK): also drop keys before each row's document start ``starts`` [BLOCK_M]."""
        offs_d = tl.arange(0, HEAD_DIM)
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k_ptrs = k_base + offs_n[:, None] * stride_kt + offs_d[None, :]
            v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]
            if USE_TMA:
                k = desc_k.load([kv_row0 + start_n, 0])
                v = desc_v.load([kv_row0 + start_n, 0])
            elif EVEN_T:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
            else:
                k = tl.load(k_ptrs, mask=offs_n[:, None] < T, other=0.0)
                v = tl.load(v_ptrs, mask=offs_n[:, None] < T, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
            p = tl.exp2(s * qk_scale - lse2[:, None])
            if MASK:
                keep = offs_m[:, None] >= offs_n[None, :]
                if DOC:
                    keep = keep & (offs_n[None, :] >= starts[:, None])
                p = tl.where(keep, p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        return dq

    @triton.jit
    def _flash_bwd_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, DS, desc_k, desc_v, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh,
        stride_kt, stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh,
        stride_dqt, H, T, GROUP, qk_scale, sm_scale, TAIL, CAUSAL: tl.constexpr, EVEN_T: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
        USE_TMA: tl.constexpr, DOC: tl.constexpr = False,
    ):  # fmt: skip
        """One program: BLOCK_M query rows of one (batch, head); a 1-D grid of cdiv(T, BLOCK_M)·B·H programs in
        ``_tail_order``, heaviest causal tiles first. DOC: as the forward kernel (the same key tiles)."""
        nb = tl.cdiv(T, BLOCK_M)
        pid_m, off_bh = _tail_order(tl.program_id(0), nb, tl.num_programs(0) // nb, TAIL)
        if CAUSAL:
            pid_m = nb - 1 - pid_m
        off_b = off_bh // H
        off_h = off_bh % H
        off_kvh = off_h // GROUP
        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        q_ptrs = (
            Q
            + off_b.to(tl.int64) * stride_qb
            + off_h.to(tl.int64) * stride_qh
            + offs_m[:, None] * stride_qt
            + offs_d[None, :]
        )
        do_ptrs = (
            DO
            + off_b.to(tl.int64) * stride_dob
            + off_h.to(tl.int64) * stride_doh
            + offs_m[:, None] * stride_dot
            + offs_d[None, :]
        )
        row = off_bh.to(tl.int64) * T + offs_m
        if EVEN_T:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(LSE + row)
            delta = tl.load(DELTA + row)
        else:
            q = tl.load(q_ptrs, mask=offs_m[:, None] < T, other=0.0)
            do = tl.load(do_ptrs, mask=offs_m[:, None] < T, other=0.0)
            lse = tl.load(LSE + row, mask=offs_m < T, other=0.0)
            delta = tl.load(DELTA + row, mask=offs_m < T, other=0.0)
        lse2 = lse * _LOG2E  # natural log -> log2 domain
        k_base = K + off_b.to(tl.int64) * stride_kb + off_kvh.to(tl.int64) * stride_kh
        v_base = V + off_b.to(tl.int64) * stride_vb + off_kvh.to(tl.int64) * stride_vh
        kv_row0 = (off_b * (H // GROUP) + off_kvh) * T
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if CAUSAL:
            mid = start_m  # keys strictly left of this query tile: never masked
        else:
            mid = T
        lo = 0
        starts = offs_m  # unused without DOC
        if DOC:  # as in the forward: skipped, then masked, key tiles before the rows' latest document start
            starts, lo, full = _doc_key_tiles(DS, off_b, offs_m, T, mid, BLOCK_N)
            dq = _bwd_dq_tiles(
                dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, desc_k, desc_v, kv_row0, offs_m, starts,
                T, qk_scale, lo=lo, hi=full, MASK=True, EVEN_T=EVEN_T, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
                DOT_PRECISION=DOT_PRECISION, USE_TMA=USE_TMA, DOC=True,
            )  # fmt: skip
            lo = full
        dq = _bwd_dq_tiles(
            dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, desc_k, desc_v, kv_row0, offs_m, starts, T,
            qk_scale, lo=lo, hi=mid, MASK=False, EVEN_T=EVEN_T, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
            DOT_PRECISION=DOT_PRECISION, USE_TMA=USE_TMA,
        )  # fmt: skip
        if CAUSAL:  # the diagonal band: causal mask
            dq = _bwd_dq_tiles(
                dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, desc_k, desc_v, kv_row0, offs_m, starts,
                T, qk_scale, lo=start_m, hi=tl.minimum(start_m + BLOCK_M, T), MASK=True, EVEN_T=EVEN_T, BLOCK_N=BLOCK_N,
                HEAD_DIM=HEAD_DIM, DOT_PRECISION=DOT_PRECISION, USE_TMA=USE_TMA, DOC=DOC,
            )  # fmt: skip
        dq = dq * sm_scale
        dq_ptrs = (
            DQ
            + off_b.to(tl.int64) * stride_dqb
            + off_h.to(tl.int64) * stride_dqh
            + offs_m[:, None] * stride_dqt
            + offs_d[None, :]
        )
        if EVEN_T:
            tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty))
        else:
            tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=offs_m[:, None] < T)


def _check_triton(op: str, *ts) -> None:
    if not HAVE_TRITON:
        raise RuntimeError(f"{op}: triton is not importable")
    q = ts[0]
    D = q.shape[-1]
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"{op}: head dim D={D} not supported by the Triton kernels (only "
            f"{SUPPORTED_HEAD_DIMS}), got q {tuple(q.shape)}"
        )
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{op}: dtype must be float32, bfloat16 or float16, got {_shapes(*ts)}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """The kernels index [B, H, T] by strides but need unit stride along D (16-byte vector loads)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _out(buf, shape, dtype, device, name, op):
    """A caller-given output buffer (tests pass NaN-poisoned ones) or a fresh one."""
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(buf.shape) != tuple(shape) or buf.dtype != dtype or buf.device != device or buf.stride(-1) != 1:
        raise ValueError(
            f"{op}: {name} buffer must be {tuple(shape)} {dtype} on {device} with unit last stride, got {_shapes(buf)}"
        )
    return buf


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # "tf32" is ignored for 16-bit operands


def _descriptor(x: torch.Tensor, block_rows: int):
    """Tensor descriptor over x [B, h, T, D] seen as its [B*h*T, D] rows, one tile = block_rows rows."""
    D = x.shape[-1]
    return TensorDescriptor(x.view(-1, D), [x.numel() // D, D], [D, 1], [block_rows, D])


def _tma_ok(tma: bool, even: bool, *ts) -> bool:
    return bool(tma) and _HAVE_DESC and even and all(t.is_contiguous() for t in ts)


def _strides(**xs: torch.Tensor) -> dict:
    """The kernels' stride arguments of each x [B, Hx, T, D] (unit last stride) given as name=x: stride_{name}b,
    stride_{name}h, stride_{name}t."""
    return {f"stride_{n}{a}": x.stride(i) for n, x in xs.items() for i, a in enumerate("bht")}


def preprocess_buffers(o, do, delta, lse=None, lse2=None, cols=None) -> dict:
    """The tensor arguments of ``_flash_bwd_preprocess_kernel``: delta = rowsum(dO ∘ O) from o and do [B, H, T, D]
    into delta [B, H, T]; with ``lse`` also lse·log2(e) into ``lse2`` (both [B, H, T] fp32); with ``cols`` also
    the (lse, delta) column buffers of the Gluon split's ``lse_mma``. A buffer its form does not touch is given
    as delta (the kernel neither reads nor writes it)."""
    lsec, deltac = cols if cols is not None else (delta, delta)
    lse, lse2 = (delta, delta) if lse is None else (lse, lse2)
    return dict(O=o, DO=do, DELTA=delta, LSE=lse, LSE2=lse2, LSEC=lsec, DELTAC=deltac)


def preprocess_launch(o, do, delta, lse=None, lse2=None, cols=None, inv_scale: float = 1.0) -> tuple:
    """(grid, arguments) of the delta preprocess in the form ``preprocess_buffers`` describes; ``inv_scale`` (with
    ``cols``): 1 / the softmax scale."""
    B, H, T, D = o.shape
    args = dict(preprocess_buffers(o, do, delta, lse, lse2, cols), INV_SCALE=inv_scale, **_strides(o=o, do=do), H=H)
    args.update(T=T, HEAD_DIM=D, BLOCK_M=PRE_M, SCALE_LSE=lse is not None)
    args["COLS"] = cols[0].shape[-1] if cols is not None else 0
    return (triton.cdiv(T, PRE_M), B * H), args


def doc_query_bounds(doc_starts: torch.Tensor, block_n: int) -> torch.Tensor:
    """int32 [B, cdiv(T, block_n), 2]: for key tile j (keys n0 = j·block_n .. n1 - 1) of row b, (F, R): every
    query row t in [n1, F) sees the whole tile (its document starts at or before n0), and no row t >= R sees
    any of it (its document starts after n1 - 1). F = #{t : max(ds[..t]) <= n0} (prefix maxima are sorted),
    R = #{t : min(ds[t..]) <= n1 - 1} (suffix minima are sorted): exact for any starts, not only the sorted ones
    that ``xtrain.model.doc_starts`` gives. Device ops only (no host read: fine under a CUDA graph capture)."""
    B, T = doc_starts.shape
    n0 = torch.arange(0, T, block_n, device=doc_starts.device)
    n1 = torch.clamp(n0 + block_n, max=T)
    pre_max = torch.cummax(doc_starts, dim=1).values
    suf_min = torch.cummin(doc_starts.flip(1), dim=1).values.flip(1).contiguous()
    full = torch.searchsorted(pre_max, n0.expand(B, -1).contiguous(), right=True)
    rows = torch.searchsorted(suf_min, (n1 - 1).expand(B, -1).contiguous(), right=True)
    return torch.stack((full, rows), dim=-1).to(torch.int32).contiguous()


def flash_attention_fwd_triton(
    q, k, v, causal: bool = True, scale: float | None = None, *, config, o=None, lse=None, doc_starts=None
):
    """Launch the forward kernel with ``config`` (a ``TritonFwdConfig``). ``o``/``lse``: optional output buffers
    (tests pass NaN-poisoned ones). ``doc_starts``: int64 [B, T] packed-document starts (the reference's
    contract: query t sees key s iff doc_starts[b, t] <= s <= t)."""
    op = "flash_attention_fwd_triton"
    _check_qkv(op, q, k, v)
    _check_triton(op, q, k, v)
    check_doc_starts(op, doc_starts, q, causal)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    s = _scale(op, scale, D)
    q, k, v = _rows(q), _rows(k), _rows(v)
    t = config.tiles
    BLOCK_M, BLOCK_N = t.block_m, t.block_n
    if BLOCK_M % BLOCK_N:
        raise ValueError(f"{op}: BLOCK_M={BLOCK_M} must be a multiple of BLOCK_N={BLOCK_N}")
    o = _out(o, (B, H, T, D), q.dtype, q.device, "o", op)
    lse = _out(lse, (B, H, T), torch.float32, q.device, "lse", op)
    if not lse.is_contiguous():
        raise ValueError(f"{op}: lse buffer must be contiguous")
    even = T % BLOCK_M == 0 and T % BLOCK_N == 0
    use_tma = _tma_ok(t.tma, even, k, v)
    desc_k, desc_v = (_descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N)) if use_tma else (None, None)
    nb = triton.cdiv(T, BLOCK_M)
    ds = None if doc_starts is None else doc_starts.contiguous()
    tail = tail_heads(nb, B * H, config.plan_sms or grid_sms(q.device), config.tail_waves)
    args = dict(Q=q, K=k, V=v, O=o, LSE=lse, DS=ds, desc_k=desc_k, desc_v=desc_v, **_strides(q=q, k=k, v=v, o=o))
    args.update(H=H, T=T, GROUP=H // Hkv, qk_scale=s * LOG2E, TAIL=tail, CAUSAL=bool(causal), EVEN_T=even, HEAD_DIM=D)
    args.update(DOT_PRECISION=_precision(q.dtype), USE_TMA=use_tma, DOC=doc_starts is not None, **t.launch())
    _flash_fwd_kernel[(nb * B * H,)](**args)
    return o, lse


def flash_attention_bwd_triton(
    do,
    q,
    k,
    v,
    o,
    lse,
    causal: bool = True,
    scale: float | None = None,
    *,
    config,
    dq=None,
    dk=None,
    dv=None,
    doc_starts=None,
):
    """Launch the delta preprocess, the dK/dV and the dQ kernels with ``config`` (a ``TritonBwdConfig``). No
    atomics: bit-identical run to run. ``dq``/``dk``/``dv``: optional output buffers. ``doc_starts``: as the
    forward."""
    op = "flash_attention_bwd_triton"
    _check_bwd(op, do, q, k, v, o, lse)
    _check_triton(op, q, k, v)
    check_doc_starts(op, doc_starts, q, causal)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    s = _scale(op, scale, D)
    do = do.to(q.dtype)
    do, q, k, v, o = _rows(do), _rows(q), _rows(k), _rows(v), _rows(o)
    lse = lse.to(torch.float32).contiguous()
    c1, c2 = config.dkdv, config.dq
    BM1, BN1, BM2, BN2 = c1.block_m, c1.block_n, c2.block_m, c2.block_n
    if BN1 % BM1 or BM2 % BN2:
        raise ValueError(f"{op}: need BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0, got {config}")
    dq = _out(dq, (B, H, T, D), q.dtype, q.device, "dq", op)
    dk = _out(dk, (B, Hkv, T, D), k.dtype, q.device, "dk", op)
    dv = _out(dv, (B, Hkv, T, D), v.dtype, q.device, "dv", op)
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    pre_grid, pre_args = preprocess_launch(o, do, delta)
    _flash_bwd_preprocess_kernel[pre_grid](**pre_args)
    prec = _precision(q.dtype)
    common = dict(H=H, T=T, GROUP=H // Hkv, qk_scale=s * LOG2E, sm_scale=s, CAUSAL=bool(causal), HEAD_DIM=D)
    doc = doc_starts is not None
    if doc:
        doc_starts = doc_starts.contiguous()
        common.update(DS=doc_starts, DOC=True)
        bounds = doc_query_bounds(doc_starts, BN1)
    else:
        common.update(DS=None, DOC=False)
        bounds = None
    even1 = T % BM1 == 0 and T % BN1 == 0
    use_tma1 = _tma_ok(c1.tma, even1, q, do)
    desc_q, desc_do = (_descriptor(q, BM1), _descriptor(do, BM1)) if use_tma1 else (None, None)

    def launch_dkdv():
        nb = triton.cdiv(T, BN1)
        tail = tail_heads(nb, B * Hkv, config.plan_sms or grid_sms(q.device), config.tail_waves)
        args = dict(Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, DK=dk, DV=dv, QB=bounds, desc_q=desc_q, desc_do=desc_do)
        args.update(_strides(q=q, k=k, v=v, do=do, dk=dk, dv=dv), Hkv=Hkv, TAIL=tail, EVEN_T=even1, DOT_PRECISION=prec)
        _flash_bwd_dkdv_kernel[(nb * B * Hkv,)](**args, USE_TMA=use_tma1, **common, **c1.launch())

    even2 = T % BM2 == 0 and T % BN2 == 0
    use_tma2 = _tma_ok(c2.tma, even2, k, v)
    desc_k, desc_v = (_descriptor(k, BN2), _descriptor(v, BN2)) if use_tma2 else (None, None)

    def launch_dq():
        nb = triton.cdiv(T, BM2)
        tail = tail_heads(nb, B * H, config.plan_sms or grid_sms(q.device), config.tail_waves)
        args = dict(Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, DQ=dq, desc_k=desc_k, desc_v=desc_v)
        args.update(_strides(q=q, k=k, v=v, do=do, dq=dq), TAIL=tail, EVEN_T=even2, DOT_PRECISION=prec)
        _flash_bwd_dq_kernel[(nb * B * H,)](**args, USE_TMA=use_tma2, **common, **c2.launch())

    if q.is_cuda:
        # the dK/dV and dQ kernels are independent once delta exists: the dQ kernel runs on a side stream so
        # the two overlap (each one's tail of short causal programs fills with the other's work)
        run_side_by_side(q.device, launch_dkdv, launch_dq)
    else:
        launch_dkdv()
        launch_dq()
    return dq, dk, dv


def grid_sms(device) -> int:
    """The SM count the program orders plan for: that of a CUDA ``device``, else an H200's 132 (the
    interpreter, and the CPU stand-ins of the offline compiles: only a launch argument, the code does not
    depend on it)."""
    return sm_count(device) if device.type == "cuda" else 132


def tail_heads(nb: int, heads: int, n_sm: int, waves: int) -> int:
    """How many of the last heads of a grid of nb tiles x heads start tile-major (``_tail_order``): enough for
    ``waves`` waves of one program per SM (``n_sm`` SMs, ``grid_sms``), at most all of them."""
    return min(heads, -(-waves * n_sm // nb))
