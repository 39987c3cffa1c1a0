"""A probe (session 26): what handing each step's dSᵀ to another SM would cost the split's hd128 dK/dV kernel.

    PYTHONPATH=. python3 bench/handoff_probe.py --compile-only     # no GPU: ptxas facts (sm_90)
    PYTHONPATH=. python3 bench/handoff_probe.py [--seqs 4096,16384] [--rounds 2]   # GPU: ms of the kernel alone

Why. The lead that session 26's six-product probe left (bench/RESULTS.md): run the 5-product backward across SMs.
Three CTAs of a group run the split's dK/dV kernel and write each step's dSᵀ tiles to a ring in global memory (L2)
behind a release flag; a fourth CTA turns them into dQ. Its arithmetic ties cuDNN at T = 16k only if that hand-off
costs the dK/dV CTAs under about 15-20 %. This probe prices the producer side alone: the library's dK/dV kernel
(the PEEL | SMEM | LEAN walk of ``flash_attention_gluon_bwd``) with, per step and warpgroup, HANDOFF =
  1: dSᵀ (bf16, [64 keys, 64 queries]) stored into a shared staging tile (two per warpgroup, alternating), fenced,
     and sent to global memory by one TMA store; the staging tile is reused once its store of two steps before
     has read it (``tma.store_wait(1)``);
  2: as 1, and before each new store the previous step's store is waited for to completion (``cp.async.bulk.
     wait_group 0``), then a gpu-scope fence and one release atomic add on the warpgroup's flag: what a
     consumer on another SM needs before it may read the tile;
  3: as 2 without the gpu-scope fence (the completion wait and the release atomic);
  4: as 2, every fourth step only;
  5: lagged: the store of two steps before waited for (``wait_group 1``), ``fence.proxy.async.global``, the release
     atomic, every step, no gpu-scope fence;
  6: as 5 with the gpu-scope fence, every fourth step.
No consumer exists here; each (program, warpgroup) writes its own two ring slots. The outputs dk, dv are the
library's, bit for bit (the probe checks that), so the extra work is all the difference in time.

Not in the library. Measured and recorded in bench/RESULTS.md (session 26).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from xtrain.kernels import flash_attention as FA  # noqa: E402
from xtrain.kernels import flash_attention_gluon_bwd as GB  # noqa: E402
from xtrain.kernels.flash_attention_gluon import HAVE_GLUON, LOG2E, _desc, _row_view  # noqa: E402

KH = 64
BLOCK_M = 64
STAGES = 2

if HAVE_GLUON:
    from xtrain.kernels.flash_attention_gluon import (
        _cta_barrier,
        _tma_store,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from xtrain.kernels.flash_attention_gluon_bwd import (
        _CONSUMER_REGS,
        _PRODUCER_REGS,
        _acc_layout,
        _dkdv_issue_sdp,
        _dkdv_producer,
        _dkdv_skip,
        _dkdv_store,
        _kv_rows,
        _ring_init,
        _tail_order,
    )

    @gluon.jit
    def _publish_lag(flag_ptr, FENCE: gl.constexpr):
        """Variant 5/6: wait only for the store of two steps before (``cp.async.bulk.wait_group 1`` before this step's
        store is issued), order it for the generic proxy (``fence.proxy.async.global``), optionally fence at gpu
        scope, then one release atomic add: the consumer trails by two steps."""
        one = gl.full([1], 0, gl.int32, gl.BlockedLayout([1], [32], [4], [0]))
        if FENCE:
            gl.inline_asm_elementwise("cp.async.bulk.wait_group 1; fence.proxy.async.global; fence.acq_rel.gpu; "
                                      "mov.u32 $0, $1;", "=r,r", [one], dtype=gl.int32, is_pure=False, pack=1)
        else:
            gl.inline_asm_elementwise("cp.async.bulk.wait_group 1; fence.proxy.async.global; mov.u32 $0, $1;", "=r,r",
                                      [one], dtype=gl.int32, is_pure=False, pack=1)
        gl.atomic_add(flag_ptr, 1, sem="release", scope="gpu")

    @gluon.jit
    def _publish(flag_ptr, FENCE: gl.constexpr):
        """Wait for this thread's bulk stores to complete and fence at gpu scope (inline PTX), then add 1 to the flag
        with release semantics (one atomic per warpgroup): what a consumer SM needs before it reads the tiles."""
        one = gl.full([1], 0, gl.int32, gl.BlockedLayout([1], [32], [4], [0]))
        if FENCE:
            gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.acq_rel.gpu; mov.u32 $0, $1;", "=r,r", [one],
                                      dtype=gl.int32, is_pure=False, pack=1)
        else:
            gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.u32 $0, $1;", "=r,r", [one], dtype=gl.int32,
                                      is_pure=False, pack=1)
        gl.atomic_add(flag_ptr, 1, sem="release", scope="gpu")

    @gluon.jit
    def _handoff(dst16, stage_smem, ds_desc, flag_ptr, ring_row, it, HALF: gl.constexpr, HANDOFF: gl.constexpr):
        """Step ``it``'s dSᵀ of warpgroup HALF out to its ring slot it % 2 in global memory (module docstring)."""
        s = it % 2
        if HANDOFF == 2:
            _publish(flag_ptr, True)
        elif HANDOFF == 3:  # no gpu-scope fence: the completion wait and the release atomic only
            _publish(flag_ptr, False)
        elif HANDOFF == 4:  # as 2, every fourth step (a consumer then trails by up to four steps)
            if it % 4 == 0:
                _publish(flag_ptr, True)
        elif HANDOFF == 5:  # lagged by two steps, no gpu-scope fence, every step
            _publish_lag(flag_ptr, False)
        elif HANDOFF == 6:  # lagged, with the gpu-scope fence, every fourth step
            if it % 4 == 0:
                _publish_lag(flag_ptr, True)
        tma.store_wait(1)  # the store of step it - 2 has read staging tile s
        _cta_barrier()
        stage = stage_smem.index(2 * s + HALF)
        stage.store(dst16)
        fence_async_shared()
        _cta_barrier()  # every thread's store is fenced before the one TMA store
        _tma_store(ds_desc, [ring_row + s * 64, 0], stage)

    @gluon.jit
    def _step(k_half, v_half, q_smem, do_smem, lse_smem, delta_smem, q_bars, do_bars, q_empty, dk, dv, s_zero, it,
              start_m, offs_k, cols, qk_scale, stage_smem, ds_desc, flag_ptr, ring_row, dtype: gl.constexpr,
              s_layout: gl.constexpr, op_layout: gl.constexpr, STAGES: gl.constexpr, MASK: gl.constexpr,
              HALF: gl.constexpr, HANDOFF: gl.constexpr, LATE: gl.constexpr):
        """The library's ``_dkdv_step`` with the dSᵀ hand-off after the dK wgmma is issued."""
        slot, q_t, do_t, st, dpt = _dkdv_issue_sdp(k_half, v_half, q_smem, do_smem, q_bars, do_bars, s_zero, it, STAGES)
        lse_b = lse_smem.index(slot).load(s_layout)
        st = warpgroup_mma_wait(1, deps=(st, ))
        if MASK:  # on S, before the exponential (session 24: the same bits, and ptxas does not serialise)
            keep = gl.expand_dims(start_m + cols, 0) >= gl.expand_dims(offs_k, 1)
            st = gl.where(keep, st, float("-inf"))
        pt = gl.exp2(st * qk_scale - lse_b)
        p_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv_tok = warpgroup_mma(p_op, do_t, dv, is_async=True)
        delta_b = delta_smem.index(slot).load(s_layout)
        dpt = warpgroup_mma_wait(1, deps=(dpt, ))
        dst16 = (pt * (dpt - delta_b)).to(dtype)
        ds_op = gl.convert_layout(dst16, op_layout)
        dk_tok = warpgroup_mma(ds_op, q_t, dk, is_async=True)
        if HANDOFF > 0 and not LATE:
            _handoff(dst16, stage_smem, ds_desc, flag_ptr, ring_row, it, HALF, HANDOFF)
        dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_op))
        mbarrier.arrive(q_empty.index(slot), count=1)
        if HANDOFF > 0 and LATE:  # after dV and dK retired: past the register peak
            _handoff(dst16, stage_smem, ds_desc, flag_ptr, ring_row, it, HALF, HANDOFF)
        return dk, dv

    @gluon.jit
    def _consumer(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, stage_smem, kv_bar, q_bars, do_bars, q_empty,
                  dk_desc, dv_desc, ds_desc, flag_ptr, ring_row0, dk_row, dk_col, dv_row, dv_col, mt0, n_m, n_iter,
                  start_n, qk_scale, sm_scale, dtype: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, HALF: gl.constexpr, HANDOFF: gl.constexpr,
                  LATE: gl.constexpr):
        """The library's ``_dkdv_consumer`` PEEL walk (skip, diagonal, rest), with ``_step``."""
        KH: gl.constexpr = dk_desc.block_type.shape[0]
        s_layout: gl.constexpr = _acc_layout(BLOCK_M)
        a_layout: gl.constexpr = _acc_layout(HEAD_DIM)
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
        k_half = k_smem.index(HALF)
        v_half = v_smem.index(HALF)
        offs_k = start_n + HALF * KH + gl.arange(0, KH, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([KH, BLOCK_M], gl.float32, s_layout)
        dk = gl.zeros([KH, HEAD_DIM], gl.float32, a_layout)
        dv = gl.zeros([KH, HEAD_DIM], gl.float32, a_layout)
        start_m = mt0 * BLOCK_M
        ring_row = ring_row0 + HALF * 128
        my_flag = flag_ptr + HALF
        if CAUSAL:
            n_skip: gl.constexpr = (HALF * KH) // BLOCK_M
            n_diag: gl.constexpr = ((HALF + 1) * KH + BLOCK_M - 1) // BLOCK_M - n_skip
        else:
            n_skip: gl.constexpr = 0
            n_diag: gl.constexpr = 0
        mbarrier.wait(kv_bar, 0)
        it = 0
        for _g in range(n_iter // n_m):
            for _i in gl.static_range(n_skip):
                _dkdv_skip(q_bars, do_bars, q_empty, it, STAGES)
                it += 1
            for i in gl.static_range(n_diag):
                dk, dv = _step(k_half, v_half, q_smem, do_smem, lse_smem, delta_smem, q_bars, do_bars, q_empty, dk, dv,
                               s_zero, it, start_m + (n_skip + i) * BLOCK_M, offs_k, cols, qk_scale, stage_smem,
                               ds_desc, my_flag, ring_row, dtype, s_layout, op_layout, STAGES, True, HALF, HANDOFF,
                               LATE)
                it += 1
            for _i in range(n_m - n_skip - n_diag):
                dk, dv = _step(k_half, v_half, q_smem, do_smem, lse_smem, delta_smem, q_bars, do_bars, q_empty, dk, dv,
                               s_zero, it, start_m, offs_k, cols, qk_scale, stage_smem, ds_desc, my_flag, ring_row,
                               dtype, s_layout, op_layout, STAGES, False, HALF, HANDOFF, LATE)
                it += 1
        tma.store_wait(0)
        _dkdv_store(k_half, v_half, dk, dv, sm_scale, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col, dtype, HALF)

    @gluon.jit
    def _kernel(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, lse_desc, delta_desc, ds_desc, flag_ptr, qk_scale,
                sm_scale, H, GROUP, T, q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, k_rb, k_rh, k_ch, v_rb, v_rh, v_ch, dk_rb,
                dk_rh, dk_ch, dv_rb, dv_rh, dv_ch, TAIL, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                STAGES: gl.constexpr, CAUSAL: gl.constexpr, HANDOFF: gl.constexpr, LATE: gl.constexpr):
        """The library's ``_bwd_dkdv_kernel`` (LEAN, SMEM, PEEL) with two dSᵀ staging tiles per warpgroup."""
        dtype: gl.constexpr = q_desc.dtype
        KH: gl.constexpr = k_desc.block_type.shape[0]
        pid = gl.program_id(0)
        pid_n, off_bkv = _tail_order(pid, T // (2 * KH), TAIL)
        Hkv = H // GROUP
        off_b = off_bkv // Hkv
        off_kvh = off_bkv % Hkv
        start_n = pid_n * (2 * KH)
        h0 = off_kvh * GROUP
        if CAUSAL:
            mt0 = start_n // BLOCK_M
        else:
            mt0 = 0
        n_m = T // BLOCK_M - mt0
        n_iter = GROUP * n_m
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2, KH, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, KH, HEAD_DIM], v_desc.layout)
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], lse_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], delta_desc.layout)
        stage_smem = gl.allocate_shared_memory(dtype, [4, KH, BLOCK_M], ds_desc.layout)  # [slot·2 + half]
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        _ring_init(q_bars, q_empty, STAGES)
        _ring_init(do_bars, do_empty, STAGES)
        fence_async_shared()
        k_row, v_row, dk_row, dv_row = _kv_rows(off_b, off_kvh, start_n, k_rb, k_rh, v_rb, v_rh, dk_rb, dk_rh, dv_rb,
                                                dv_rh)
        ring_row0 = pid * 256  # this program's 2 warpgroups x 2 slots x 64 rows
        flags = flag_ptr + pid * 2
        gl.warp_specialize([
            (_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, stage_smem, kv_bar, q_bars, do_bars,
                         q_empty, dk_desc, dv_desc, ds_desc, flags, ring_row0, dk_row, off_kvh * dk_ch, dv_row,
                         off_kvh * dv_ch, mt0, n_m, n_iter, start_n, qk_scale, sm_scale, dtype, HEAD_DIM, BLOCK_M,
                         STAGES, CAUSAL, 0, HANDOFF, LATE)),
            (_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, stage_smem, kv_bar, q_bars, do_bars,
                         q_empty, dk_desc, dv_desc, ds_desc, flags, ring_row0, dk_row, off_kvh * dk_ch, dv_row,
                         off_kvh * dv_ch, mt0, n_m, n_iter, start_n, qk_scale, sm_scale, dtype, HEAD_DIM, BLOCK_M,
                         STAGES, CAUSAL, 1, HANDOFF, LATE)),
            (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, k_smem, v_smem,
                              lse_smem, delta_smem, kv_bar, q_bars, do_bars, q_empty, do_empty, k_row, off_kvh * k_ch,
                              v_row, off_kvh * v_ch, off_b * q_rb, q_rh, q_ch, off_b * do_rb, do_rh, do_ch, h0, mt0,
                              n_m, n_iter, T, (off_b * H + h0) * (T // BLOCK_M) + mt0, BLOCK_M, STAGES, True, True)),
        ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


def _launch(q, k, v, do, dk, dv, lse2, delta, ring, flags, s: float, causal: bool, handoff: str):
    """(kernel, grid, args, constexprs); CUDA tensors or CPU stand-ins."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    views = {n: _row_view(x) for n, x in (("q", q), ("do", do), ("k", k), ("v", v), ("dk", dk), ("dv", dv))}
    args = dict(flag_ptr=flags, qk_scale=s * LOG2E, sm_scale=s, H=H, GROUP=H // Hkv, T=T)
    for n, (_, rb, rh, ch) in views.items():
        args.update({f"{n}_rb": rb, f"{n}_rh": rh, f"{n}_ch": ch})
    lse_v = _row_view(lse2.view(B, H, T // BLOCK_M, BLOCK_M))[0]
    delta_v = _row_view(delta.view(B, H, T // BLOCK_M, BLOCK_M))[0]
    args.update(q_desc=_desc(views["q"][0], BLOCK_M, D), do_desc=_desc(views["do"][0], BLOCK_M, D),
                k_desc=_desc(views["k"][0], KH, D), v_desc=_desc(views["v"][0], KH, D),
                dk_desc=_desc(views["dk"][0], KH, D), dv_desc=_desc(views["dv"][0], KH, D),
                lse_desc=_desc(lse_v, 1, BLOCK_M), delta_desc=_desc(delta_v, 1, BLOCK_M),
                ds_desc=_desc(ring, KH, BLOCK_M))
    nb = T // (2 * KH)
    args["TAIL"] = GB.tail_heads(nb, B * Hkv, FA.grid_sms(q.device))
    consts = dict(HEAD_DIM=D, BLOCK_M=BLOCK_M, STAGES=STAGES, CAUSAL=bool(causal), HANDOFF=int(str(handoff)[0]),
                  LATE=str(handoff).endswith("L"))
    return _kernel, (nb * B * Hkv, ), args, consts


def kernel_call(q, k, v, do, o, lse, handoff: str, causal: bool = True):
    """The probe's dK/dV kernel as a call (the delta preprocess and buffers done once); returns (call, dk, dv)."""
    dob, lse2, _, dk, dv, delta, s, _ = GB._prologue("handoff", GB.supported_bwd, GB.HEAD_DIMS, do, q, k, v, o, lse,
                                                     None, None, None, None, base2=True)
    B, H, T, D = q.shape
    n_prog = (T // (2 * KH)) * B * k.shape[1]
    ring = torch.empty(n_prog * 256, BLOCK_M, dtype=q.dtype, device=q.device)
    flags = torch.zeros(n_prog * 2, dtype=torch.int32, device=q.device)
    kern, grid, args, consts = _launch(q, k, v, dob, dk, dv, lse2, delta, ring, flags, s, causal, handoff)
    return (lambda: kern[grid](**args, **consts, num_warps=4)), dk, dv


def compile_sm90(handoff: str, causal: bool = True, D: int = 128, T: int = 256):
    q, k = GB.stand_ins(D, T, 4, 4, False)
    lse = torch.empty(1, 4, T)
    n_prog = (T // (2 * KH)) * 4
    ring = torch.empty(n_prog * 256, BLOCK_M, dtype=torch.bfloat16)
    flags = torch.empty(n_prog * 2, dtype=torch.int32)
    kern, _, args, consts = _launch(q, k, k, q, k, k, lse, lse, ring, flags, 0.125, causal, handoff)
    return GB._compile(kern, args, dict(consts, GROUP=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--handoffs", default="0,1,2,1L,2L", help="HANDOFF values; a trailing L: the hand-off after dV "
                    "and dK retired (LATE) instead of right after the dK wgmma is issued")
    ap.add_argument("--seqs", default="4096,16384")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    handoffs = a.handoffs.split(",")
    if a.compile_only:
        from bench.gluon_flash_bwd_onepass import ptxas_report

        for h in handoffs:
            for causal in (True, False):
                ck = compile_sm90(h, causal)
                print(f"HANDOFF={h} causal={causal!s:5s} smem {ck.metadata.shared} {ptxas_report(ck)}", flush=True)
        return
    from bench import isolated
    from bench._gpu import gpu_time, warm_up
    from bench.gluon_bwd_alone import split_kernels

    warm_up()
    for T in (int(x) for x in a.seqs.split(",")):
        q, k, v, do = isolated.bench_inputs(128, T)
        o, lse = FA.flash_attention_fwd_triton(q, k, v, causal=True)
        lib, _ = split_kernels(q, k, v, do, o, lse, True)
        calls = {}
        ref = None
        for h in handoffs:
            call, dk, dv = kernel_call(q, k, v, do, o, lse, h)
            call()
            torch.cuda.synchronize()
            if ref is None:
                ref = (dk.clone(), dv.clone())
            same = torch.equal(dk, ref[0]) and torch.equal(dv, ref[1])
            print(f"T={T} HANDOFF={h}: dk, dv bit-identical to HANDOFF={handoffs[0]}: {same}", flush=True)
            calls[h] = call
        for r in range(a.rounds):
            t_lib = gpu_time(lib)["ms"]
            ts = {h: gpu_time(c)["ms"] for h, c in calls.items()}
            print(f"T={T} round {r}: library dK/dV kernel {t_lib:.3f} ms | " + " | ".join(
                f"HANDOFF={h} {t:.3f} ms ({t / t_lib:.3f}x)" for h, t in ts.items()), flush=True)


if __name__ == "__main__":
    main()
