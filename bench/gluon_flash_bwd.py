"""Gluon (Hopper, sm_90) flash-attention BACKWARD, timed against cuDNN and xtrain's Triton backward.

    PYTHONPATH=. python3 bench/gluon_flash_bwd.py [--seqs 1024,4096] [--head-dims 64,128] [--variants split,pers_pp]
    PYTHONPATH=. python3 bench/gluon_flash_bwd.py --compile-only  # no GPU needed: compiles every variant for sm_90
    PYTHONPATH=. python3 bench/gluon_flash_bwd.py --replay        # no GPU needed: CPU replay (math + barriers)

The kernels are the library's (xtrain/kernels/flash_attention_gluon_bwd.py: design, credits, H200 numbers
and the variants that lost); this file is the harness. A variant is a named config of that module
(``CONFIGS``: split, split3, split_wide and the persistent pers, pers_pp, pers_wide, pers_wide_pp), launched
through ``flash_attention_bwd_gluon(..., config=name, programs=--programs)``. The default timing set is
``DEFAULT_BENCH`` (split, split_wide and the four persistent ones; cuDNN and the Triton kernel always).

--replay (no GPU): (1) fp64 math of every config in the order its programs run the items (persistent: a
5-program grid; coverage asserted for grids of 1, 2, 3, 5, 7, 132); (2) for the persistent configs, Python
generators mirroring the producer and both consumers line by line (``replay_protocol``), interleaved at
random with random TMA/store latencies: every wait hands over the expected tile, no TMA lands in a buffer
still read, no output buffer is rewritten under an in-flight store, ping-pong alternates, no deadlock;
six deliberately broken protocols must be caught (negative controls).
The one-pass variants (fused: dQ by TMA reduce-add, fused_atom: by fp32 atomics) and split_pipe (the dK/dV
consumer software-pipelined across query tiles) measured slower on the H200 and are gone from here; their
code is this file at commit 921bd50.

Offline build facts (``--compile-only`` prints them, triton 3.6 and 3.9; the GPU box runs 3.6, so check
compiles with ``PYTHONPATH=/tmp/t36:.``): registers per thread, local memory (spills), setmaxnreg values,
shared memory and the PTX instructions the kernels are built on.

main() first checks every variant in a child process (a deadlocked mbarrier wait would hang the run; a
CUDA fault would poison the context): a variant with no result within 120 s is killed and reported HANG.
Gate: relative-norm error ||x − ref|| / ||ref|| < 1e-2 for each of dq, dk, dv against
``flash_attention_bwd_ref`` in fp64 (B=1, H=4, Hkv=2, T=1024 and 2048, D=64 and 128, causal, outputs
NaN-poisoned; o and lse from ``flash_attention_fwd_ref`` in fp64 then cast). Timing: do_bench median of
each backward alone; cuDNN's backward alone via ``torch.autograd.grad`` on a saved SDPA graph
(retain_graph), TFLOP/s = 2.5 × 4·B·H·T²·D/2.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import triton

from xtrain.kernels import flash_attention_gluon_bwd as GB

LOG2E = GB.LOG2E
HALF_ROWS = GB.HALF_M  # rows of the resident tile owned by one consumer warpgroup
RESIDENT = GB.RESIDENT  # keys per dK/dV program, query rows per dQ program
VARIANTS = GB.CONFIGS  # name -> {head_dim: (BLOCK_M1, STAGES1, BLOCK_N2, STAGES2)}
DEFAULT_VARIANT = GB.DEFAULT


# the default timing set (split3 lost everywhere; --variants names any config)
DEFAULT_BENCH = ["split", "split_wide", "pers", "pers_pp", "pers_wide", "pers_wide_pp"]
PROGRAMS = None  # --programs: cap on the persistent grids (default: the SM count)


def gluon_flash_bwd(do, q, k, v, o, lse, causal=True, scale=None, variant=DEFAULT_VARIANT, *,
                    dq=None, dk=None, dv=None):
    """The library backward with the config named ``variant``. Returns (dq, dk, dv)."""
    return GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, causal, scale, dq=dq, dk=dk, dv=dv, config=variant,
                                        programs=PROGRAMS)


# ---------------------------------------------------------------------------------------------------------
# CPU replay of the kernels' tile schedule and math (no GPU): --replay
# ---------------------------------------------------------------------------------------------------------
def py_n_local(pid, n_prog, U):
    """Line-for-line copy of the forward's ``_n_local`` (the backward's persistent kernels import it)."""
    n_pairs = (U + 1) // 2
    m_count = (n_pairs - pid + n_prog - 1) // n_prog
    last = pid + (m_count - 1) * n_prog
    return 2 * m_count - (U % 2) * int(last == n_pairs - 1)


def py_item(idx, pid, n_prog, n_m):
    """Line-for-line copy of the forward's ``_item``: (head index, tile r-th of n_m-1, 0, n_m-2, 1, ...)."""
    u = 2 * (pid + (idx // 2) * n_prog) + idx % 2
    r = u % n_m
    odd = r % 2
    return u // n_m, odd * (r // 2) + (1 - odd) * (n_m - 1 - r // 2)


def py_dkdv_item(idx, pid, n_prog, n_n, Hkv, T, bm, causal):
    """Copy of ``_pdkdv_item``: (off_b, off_kvh, start_n, mt0, n_m)."""
    bkv, r = py_item(idx, pid, n_prog, n_n)
    start_n = (n_n - 1 - r) * RESIDENT
    mt0 = start_n // bm if causal else 0
    return bkv // Hkv, bkv % Hkv, start_n, mt0, T // bm - mt0


def py_dq_item(idx, pid, n_prog, n_m, H, T, bn, causal):
    """Copy of ``_pdq_item``: (bh, off_b, off_h, start_m, n_tiles)."""
    bh, pid_m = py_item(idx, pid, n_prog, n_m)
    start_m = pid_m * RESIDENT
    n_tiles = (start_m + RESIDENT) // bn if causal else T // bn
    return bh, bh // H, bh % H, start_m, n_tiles


def _grid(n_prog, U):
    return max(1, min(n_prog, (U + 1) // 2))


def item_orders(variant, D, B, H, Hkv, T, causal, programs):
    """The (pid_n, off_bkv) items of the dK/dV kernel and (pid_m, off_bh) items of the dQ kernel in the
    order the programs run them: the one-program-per-tile grid, or (persistent configs) program after
    program through py_n_local / py_*_item, asserting every item comes exactly once."""
    cfg = tuple(VARIANTS[variant][D]) + (0, 0)
    bm, bn, pers = cfg[0], cfg[2], cfg[4]
    n_t = T // RESIDENT
    if not pers:
        return ([(p, b) for p in range(n_t) for b in range(B * Hkv)],
                [(n_t - 1 - p if causal else p, b) for p in range(n_t) for b in range(B * H)])
    out = []
    for U, n_h, dkdv in ((B * Hkv * n_t, Hkv, True), (B * H * n_t, H, False)):
        G, items = _grid(programs, U), []
        for pid in range(G):
            for idx in range(py_n_local(pid, G, U)):
                if dkdv:
                    off_b, off_kvh, start_n, _, _ = py_dkdv_item(idx, pid, G, n_t, Hkv, T, bm, causal)
                    items.append((start_n // RESIDENT, off_b * Hkv + off_kvh))
                else:
                    bh, off_b, off_h, start_m, _ = py_dq_item(idx, pid, G, n_t, H, T, bn, causal)
                    assert bh == off_b * H + off_h
                    items.append((start_m // RESIDENT, bh))
        assert len(items) == U and set(items) == {(p, b) for p in range(n_t) for b in range(B * n_h)}, \
            f"{variant}: persistent schedule misses or repeats items"
        out.append(items)
    return out


def replay(variant, D=64, T=384, B=2, H=4, Hkv=2, causal=True, transposed=False, seed=0, programs=5):
    """Replays, in torch fp64 on the CPU, exactly the loops the kernels run (which tiles, in which order,
    which are masked, which warpgroup half owns which rows, the transposed dK/dV formulation) with the
    kernels' descriptor coordinates (row b·rb + h·rh + t, column h·ch of each tensor's 2-D row view;
    ``transposed``: q, k, v, do and the outputs as [B, T, Hx, D] seen through a transpose) and returns the
    relative errors of dq, dk, dv against flash_attention_bwd_ref. Persistent configs run their items in
    the persistent order of a ``programs``-program grid (``item_orders``). Catches schedule, mask and
    indexing mistakes; the barrier protocol is ``replay_protocol``'s."""
    from xtrain.kernels.flash_attention import flash_attention_bwd_ref, flash_attention_fwd_ref
    from xtrain.kernels.flash_attention_gluon import _row_view

    BM1, _, BN2, _ = VARIANTS[variant][D][:4]
    dkdv_items, dq_items = item_orders(variant, D, B, H, Hkv, T, causal, programs)
    g = torch.Generator().manual_seed(seed)

    def mk(h, data=True):
        x = torch.randn(B, T, h, D, generator=g, dtype=torch.float64) if data else torch.zeros(B, T, h, D,
                                                                                              dtype=torch.float64)
        return x.transpose(1, 2) if transposed else x.transpose(1, 2).contiguous()

    q, k, v, do = mk(H), mk(Hkv), mk(Hkv), mk(H)
    dq, dk, dv = mk(H, False), mk(Hkv, False), mk(Hkv, False)
    o, lse = flash_attention_fwd_ref(q, k, v, causal)
    s = 1.0 / math.sqrt(D)
    qk = s * LOG2E
    GROUP = H // Hkv
    lse_f = lse.reshape(-1)
    delta = (do * o).sum(-1).reshape(-1)
    (q2, *qc), (k2, *kc), (v2, *vc), (do2, *doc) = (_row_view(x) for x in (q, k, v, do))
    (dq2, *dqc), (dk2, *dkc), (dv2, *dvc) = (_row_view(x) for x in (dq, dk, dv))

    def tile(x2, c, b, h, t, n):  # rows [t, t + n) of head h of batch b, through the 2-D view
        row, col = b * c[0] + h * c[1] + t, h * c[2]
        return x2[row:row + n, col:col + D]

    for pid_n, off_bkv in dkdv_items:  # dK/dV kernel items
        off_b, off_kvh = off_bkv // Hkv, off_bkv % Hkv
        start_n = pid_n * RESIDENT
        h0 = off_kvh * GROUP
        mt0 = start_n // BM1 if causal else 0
        n_m = T // BM1 - mt0
        for half in range(2):
            k_lo = start_n + half * HALF_ROWS
            kh, vh = tile(k2, kc, off_b, off_kvh, k_lo, HALF_ROWS), tile(v2, vc, off_b, off_kvh, k_lo, HALF_ROWS)
            dkh, dvh = torch.zeros_like(kh), torch.zeros_like(vh)
            for it in range(GROUP * n_m):
                h, start_m = h0 + it // n_m, (mt0 + it % n_m) * BM1
                row = (off_b * H + h) * T + start_m  # lse / delta
                qt, dot = tile(q2, qc, off_b, h, start_m, BM1), tile(do2, doc, off_b, h, start_m, BM1)
                pt = torch.exp2((kh @ qt.T) * qk - (lse_f[row:row + BM1] * LOG2E)[None, :])
                if causal and start_m < k_lo + HALF_ROWS:
                    keep = (start_m + torch.arange(BM1))[None, :] >= (k_lo + torch.arange(HALF_ROWS))[:, None]
                    pt = torch.where(keep, pt, 0.0)
                dvh += pt @ dot
                dkh += (pt * (vh @ dot.T - delta[row:row + BM1][None, :])) @ qt
            tile(dk2, dkc, off_b, off_kvh, k_lo, HALF_ROWS)[:] = dkh * s
            tile(dv2, dvc, off_b, off_kvh, k_lo, HALF_ROWS)[:] = dvh
    for pid_m, off_bh in dq_items:  # dQ kernel items (causal: heaviest first)
        off_b, off_h = off_bh // H, off_bh % H
        off_hk = off_h // GROUP
        start_m = pid_m * RESIDENT
        n_tiles = (start_m + RESIDENT) // BN2 if causal else T // BN2
        for half in range(2):
            q_lo = start_m + half * HALF_ROWS
            row0 = off_bh * T + q_lo
            qh, doh = tile(q2, qc, off_b, off_h, q_lo, HALF_ROWS), tile(do2, doc, off_b, off_h, q_lo, HALF_ROWS)
            lse2 = lse_f[row0:row0 + HALF_ROWS] * LOG2E
            dqh = torch.zeros_like(qh)
            for j in range(n_tiles):
                sn = j * BN2
                kt, vt = tile(k2, kc, off_b, off_hk, sn, BN2), tile(v2, vc, off_b, off_hk, sn, BN2)
                p = torch.exp2((qh @ kt.T) * qk - lse2[:, None])
                if causal and sn + BN2 > q_lo + 1:
                    keep = (q_lo + torch.arange(HALF_ROWS))[:, None] >= (sn + torch.arange(BN2))[None, :]
                    p = torch.where(keep, p, 0.0)
                dqh += (p * (doh @ vt.T - delta[row0:row0 + HALF_ROWS][:, None])) @ kt
            tile(dq2, dqc, off_b, off_h, q_lo, HALF_ROWS)[:] = dqh * s
    ref = flash_attention_bwd_ref(do, q, k, v, o, lse, causal)
    return [((x - r).norm() / r.norm()).item() for x, r in zip((dq, dk, dv), ref)]


class _Bar:
    """An mbarrier: arrivals complete a phase at ``count``; wait(parity) passes iff the phase of that parity
    has completed, i.e. the current phase's parity differs (a fresh barrier passes parity 1)."""

    def __init__(self, count, name):
        self.count, self.pending, self.phases, self.name = count, 0, 0, name

    def arrive(self):
        self.pending += 1
        if self.pending == self.count:
            self.pending, self.phases = 0, self.phases + 1

    def passes(self, parity):
        return (self.phases & 1) != parity


def replay_protocol(kind, pid, G, B, H, Hkv, T, block, stages, pingpong, causal, rng, bug=None):
    """One program of the persistent ``kind`` kernel ("dkdv": ``_pdkdv_producer``/``_pdkdv_consumer``;
    "dq": ``_pdq_producer``/``_pdq_consumer``) as three Python generators that mirror the partitions line by
    line, interleaved at random, with TMA copies and stores completing after random delays. Buffers: the
    resident one (dK/dV: the K/V halves; dQ: the Q/dO halves) with full/empty barriers, the two-tensor ring
    (dK/dV: Q, dO; dQ: K, V) with a running counter, the output buffers (dK/dV or dQ) written one store-wait
    after their last TMA store. Asserts every wait hands over the tile its consumer expects, no copy lands
    in a buffer still read, no output buffer is rewritten under an in-flight store, the ping-pong steps
    alternate and nothing deadlocks; returns the number of scheduler steps. ``bug``: a deliberately broken
    protocol (negative control)."""
    n_t = T // RESIDENT
    GROUP = H // Hkv
    U = B * (Hkv if kind == "dkdv" else H) * n_t
    items = []  # (item tag, ring steps)
    for idx in range(py_n_local(pid, G, U)):
        if kind == "dkdv":
            off_b, off_kvh, start_n, _, n_m = py_dkdv_item(idx, pid, G, n_t, Hkv, T, block, causal)
            items.append(((off_b, off_kvh, start_n), GROUP * n_m))
        else:
            bh, _, _, start_m, n_tiles = py_dq_item(idx, pid, G, n_t, H, T, block, causal)
            items.append(((bh, start_m), n_tiles))
    A, Bn = ("q", "do") if kind == "dkdv" else ("k", "v")  # the ring's two tensors
    bar = {"res_full": _Bar(1, "res_full"), "res_empty": _Bar(2, "res_empty"),
           "sched0": _Bar(1, "sched0"), "sched1": _Bar(1, "sched1")}
    for i in range(stages):
        for nm, c in ((f"{A}_full", 1), (f"{Bn}_full", 1), (f"{A}_empty", 2), (f"{Bn}_empty", 2)):
            bar[nm, i] = _Bar(c, f"{nm}{i}")
    content, readers, inflight, out_store, pp_log = {}, {}, [], [False, False], []

    def tma(buf, tag, b):
        assert not readers.get(buf), f"TMA into {buf} while {readers[buf]} read it"

        def land():
            content[buf] = tag
            b.arrive()
        inflight.append([rng.randint(1, 6), land])

    def use(buf, tag, who):
        assert content.get(buf) == tag, f"{who} read {buf} = {content.get(buf)}, want {tag}"
        readers.setdefault(buf, set()).add(who)

    def release(buf, who, b):
        readers[buf].discard(who)
        b.arrive()

    def producer():
        t = 0
        for idx, (tag, n) in enumerate(items):
            for it in range(n):
                slot, phase = t % stages, ((t // stages) & 1) ^ 1
                yield bar[f"{A}_empty", slot], phase
                tma((A, slot), (tag, it), bar[f"{A}_full", slot])
                yield bar[f"{Bn}_empty", slot], phase
                tma((Bn, slot), (tag, it), bar[f"{Bn}_full", slot])
                t += 1
                if it == 0:
                    yield bar["res_empty"], ((idx & 1) ^ 1) if bug != "res_parity" else (idx & 1)
                    tma(("res", ), tag, bar["res_full"])

    def consumer(half):
        who = f"wg{half}"

        def pp_enter(step):
            if pingpong:
                yield bar[f"sched{half}"], (step & 1) ^ (1 - half) ^ int(bug == "pp_parity" and half == 1)
                pp_log.append(half)

        def pp_leave():
            if pingpong:
                bar[f"sched{1 - half}"].arrive()

        t = sc = 0
        for idx, (tag, n) in enumerate(items):
            yield bar["res_full"], idx & 1
            use(("res", ), tag, who)
            for it in range(n):
                tt = t + it
                slot, phase = tt % stages, (tt // stages) & 1
                yield from pp_enter(sc + it)
                use(("res", ), tag, who)  # every tile's first two wgmmas read the resident tiles
                yield bar[f"{A}_full", slot], phase
                use((A, slot), (tag, it), who)
                yield bar[f"{Bn}_full", slot], phase
                use((Bn, slot), (tag, it), who)
                pp_leave()
                if kind == "dkdv":  # wait(0) on dV, dK: both ring tiles free
                    release((A, slot), who, bar[f"{A}_empty", slot])
                    release((Bn, slot), who, bar[f"{Bn}_empty", slot])
                else:  # dP retired: V free; last tile: Q/dO free; dQ wgmma retired: K free
                    release((Bn, slot), who, bar[f"{Bn}_empty", slot])
                    if it == n - 1 and bug != "res_release_early":
                        release(("res", ), who, bar["res_empty"])
                    release((A, slot), who, bar[f"{A}_empty", slot])
                if kind == "dq" and bug == "res_release_early" and it == 0:
                    release(("res", ), who, bar["res_empty"])
            if kind == "dkdv":
                release(("res", ), who, bar["res_empty"])
            t = 0 if bug == "ring_per_item" else t + n
            sc += n
            if bug != "no_store_wait":
                yield "store", half  # tma.store_wait(0) before the output buffer is written again
            assert not out_store[half], f"{who} rewrites its output buffer under an in-flight store"
            out_store[half] = True

            def done(h=half):
                out_store[h] = False
            inflight.append([rng.randint(1, 12), done])
        yield "store", half

    agents = {"prod": producer(), "wg0": consumer(0), "wg1": consumer(1)}
    waiting = {name: (None, None) for name in agents}

    def ready(b, p):
        if b is None:
            return True
        if b == "store":
            return not out_store[p]
        return b.passes(p)

    steps = 0
    while agents:
        steps += 1
        runnable = [n for n, (b, p) in waiting.items() if ready(b, p)]
        if inflight and (not runnable or rng.random() < 0.3):
            ev = rng.randrange(len(inflight))
            inflight[ev][0] -= 1
            if inflight[ev][0] <= 0:
                inflight.pop(ev)[1]()
            continue
        if not runnable:
            raise AssertionError(f"DEADLOCK {kind} pid {pid}: " + ", ".join(
                f"{n} on {b if isinstance(b, str) else b.name} parity {p}" for n, (b, p) in waiting.items()))
        name = rng.choice(runnable)
        try:
            waiting[name] = next(agents[name])
        except StopIteration:
            del agents[name], waiting[name]
    assert not any(readers.values()), f"readers left: {readers}"
    if pingpong:
        assert pp_log == [0, 1] * (len(pp_log) // 2), f"ping-pong order broken: {pp_log[:40]}"
    return steps


def replay_protocols(variants, head_dims, seed=0):
    """Schedule balance at the bench shapes, then ``replay_protocol`` over every persistent variant at small
    shapes (odd item counts, grids of 1-5 programs so phases cross many items), then negative controls."""
    import random

    rng = random.Random(seed)
    pers = [v for v in variants if len(VARIANTS[v][64]) == 6 and VARIANTS[v][64][4]]
    if not pers:
        return True
    print("persistent schedule at the bench shapes (132 programs): work per program max/mean")
    for D in head_dims:
        for T in (1024, 2048, 4096, 8192, 16384):
            B, H = 16384 // T, 2048 // D
            n_t = T // RESIDENT
            for kind, U in (("dkdv", B * H * n_t), ("dq", B * H * n_t)):
                G = _grid(132, U)
                loads = []
                for pid in range(G):
                    n = 0
                    for idx in range(py_n_local(pid, G, U)):
                        if kind == "dkdv":
                            n += py_dkdv_item(idx, pid, G, n_t, H, T, 64, True)[4]
                        else:
                            n += py_dq_item(idx, pid, G, n_t, H, T, 64, True)[4]
                    loads.append(n)
                bal = sum(loads) / len(loads) / max(loads)
                print(f"  D={D:3d} T={T:5d} {kind:4s}: {G} programs, balance (mean / max) {bal:.3f}")
    n = 0
    for name in pers:
        for D in head_dims:
            bm1, st1, bn2, st2, _, pp = VARIANTS[name][D]
            for kind, block, stages in (("dkdv", bm1, st1), ("dq", bn2, st2)):
                for B, H, Hkv, T, G in ((1, 2, 2, 128, 1), (1, 4, 2, 384, 2), (2, 3, 1, 384, 5), (1, 4, 1, 1024, 3),
                                        (2, 2, 2, 256, 4)):
                    for causal in (True, False):
                        for pid in range(min(G, 2)):
                            replay_protocol(kind, pid, G, B, H, Hkv, T, block, stages, bool(pp), causal, rng)
                            n += 1
    print(f"  {n} program replays over {', '.join(pers)}: no deadlock, no hazard, ping-pong alternates")
    for kind, bug in (("dkdv", "ring_per_item"), ("dq", "ring_per_item"), ("dkdv", "res_parity"),
                      ("dq", "res_release_early"), ("dkdv", "pp_parity"), ("dq", "no_store_wait")):
        try:
            for pid in range(3):
                for _ in range(8):
                    replay_protocol(kind, pid, 2, 1, 2, 2, 384, 64, 2, bug == "pp_parity", True, rng, bug=bug)
            print(f"  negative control {kind} {bug}: NOT caught")
            return False
        except AssertionError as e:
            print(f"  negative control {kind} {bug}: caught ({str(e)[:80]})")
    return True


# ---------------------------------------------------------------------------------------------------------
# offline compilation (no GPU): --compile-only
# ---------------------------------------------------------------------------------------------------------
def compile_variant(name, D, causal=True):
    """{kernel name: CompiledKernel} of variant ``name`` at head dim D, compiled for sm_90 without a GPU."""
    return GB.compile_sm90(D, causal, name)


def _res_usage(cubin):
    """Registers / local memory (spills) per thread of a cubin, from the cuobjdump that ships with triton
    (best effort)."""
    import os
    import re
    import subprocess
    import tempfile

    try:
        import triton.backends.nvidia as nv

        tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            txt = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, timeout=60).stdout
        m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", txt)
        return f"{m.group(1)} regs, {m.group(2)} B local" if m else "res-usage n/a"
    except Exception as e:  # noqa: BLE001
        return f"res-usage n/a ({type(e).__name__})"


def _ptx_summary(ck):
    import re

    ptx = ck.asm.get("ptx", "")
    keys = ["wgmma.mma_async", "cp.async.bulk.tensor", "red.global", "atom.global", "mbarrier.try_wait",
            "setmaxnreg", "ld.local", "st.local"]
    counts = ", ".join(f"{key} x{ptx.count(key)}" for key in keys if ptx.count(key))
    regs = sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)))
    return (f"smem {getattr(ck.metadata, 'shared', '?')} B; {_res_usage(ck.asm.get('cubin', b''))}; "
            f"setmaxnreg {regs}; PTX: {counts}")


def compile_only(variants, head_dims, dump=None):
    print(f"triton {triton.__version__}: compiling Gluon backward variants for sm_90 (no GPU)")
    ok = True
    for name in variants:
        for D in head_dims:
            t0 = time.time()
            try:
                cks = compile_variant(name, D)
                for kname, ck in cks.items():
                    print(f"  {name:10s} D={D:3d} {kname:4s}: OK {time.time() - t0:5.1f}s  {_ptx_summary(ck)}")
                    if dump:
                        import os
                        os.makedirs(dump, exist_ok=True)
                        for ext in ("ttgir", "ptx"):
                            with open(f"{dump}/{name}_{kname}_d{D}.{ext}", "w") as f:
                                f.write(ck.asm.get(ext, ""))
            except Exception as e:  # noqa: BLE001
                ok = False
                print(f"  {name:10s} D={D:3d}: FAIL {type(e).__name__}: {str(e)[:3000]}")
    return ok


# ---------------------------------------------------------------------------------------------------------
# GPU check + benchmark
# ---------------------------------------------------------------------------------------------------------
def _rel_norm(x, ref):
    x = x.double()
    ref = ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_variant(name, head_dims):
    """Worst relative-norm error of dq, dk, dv against the fp64 reference (causal, T = 1024 and 2048)."""
    from xtrain.kernels.flash_attention import flash_attention_bwd_ref, flash_attention_fwd_ref

    worst = 0.0
    for D in head_dims:
        for T in (1024, 2048):
            B, H, Hkv = 1, 4, 2
            g = torch.Generator(device="cuda").manual_seed(T + D)
            q, k, v, do = (torch.randn(B, h, T, D, generator=g, device="cuda", dtype=torch.bfloat16)
                           for h in (H, Hkv, Hkv, H))
            o64, lse64 = flash_attention_fwd_ref(q.double(), k.double(), v.double(), True)
            o, lse = o64.to(torch.bfloat16), lse64.float()
            dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
            gluon_flash_bwd(do, q, k, v, o, lse, True, None, name, dq=dq, dk=dk, dv=dv)
            torch.cuda.synchronize()
            ref = flash_attention_bwd_ref(do.double(), q.double(), k.double(), v.double(), o.double(),
                                          lse.double(), True)
            errs = [_rel_norm(x, r) for x, r in zip((dq, dk, dv), ref)]
            print(f"    {name} D={D} T={T} causal: rel-norm err dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e}")
            worst = max(worst, *errs)
    return worst


def _check_one(name, head_dims):
    """Check one variant in this process; prints the @@ markers that run_checks parses."""
    print(f"@@START {name}")
    print(f"[{name}] checking vs fp64 reference (B=1, H=4, Hkv=2, T=1024/2048, causal, NaN-filled outputs)")
    sys.stdout.flush()
    t0 = time.time()
    try:
        err = check_variant(name, head_dims)
        verdict = "PASS" if err < 1e-2 else "FAIL"
        print(f"[{name}] {verdict}: worst rel-norm err {err:.2e} ({time.time() - t0:.1f}s incl. compile)")
    except Exception as e:  # noqa: BLE001
        verdict = "ERROR"
        print(f"[{name}] ERROR {type(e).__name__}: {str(e)[:500]}")
        root = e
        while root.__cause__ is not None:
            root = root.__cause__
        if root is not e:
            print(f"[{name}]   caused by {type(root).__name__}: {str(root)[:500]}")
    print(f"@@RESULT {name} {verdict}")
    sys.stdout.flush()
    return verdict


def run_checks(variants, head_dims, startup_s=180.0, per_variant_s=120.0):
    """Correctness checks in child processes (see bench/gluon_flash_fwd.py): a child stops at its first
    exception and a new child takes the remaining variants; a variant silent for per_variant_s is killed
    and reported HANG. Returns the passing variants."""
    import queue
    import subprocess
    import threading

    passing, todo = [], list(variants)
    while todo:
        cmd = [sys.executable, __file__, "--check-only", "--variants", ",".join(todo),
               "--head-dims", ",".join(map(str, head_dims))] + (["--programs", str(PROGRAMS)] if PROGRAMS else [])
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        lines: queue.Queue = queue.Queue()

        def pump(stream=child.stdout, sink=lines):
            for ln in stream:
                sink.put(ln)
            sink.put(None)

        threading.Thread(target=pump, daemon=True).start()
        current, progressed, deadline = None, False, time.time() + startup_s
        while True:
            try:
                ln = lines.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                child.kill()  # the child this function started, by its handle
                child.wait()
                victim = current or todo[0]
                print(f"[{victim}] ERROR HANG: no result within {per_variant_s if current else startup_s:.0f}s, "
                      f"child killed")
                todo.remove(victim)
                break
            if ln is None:
                child.wait()
                if current is not None:
                    print(f"[{current}] ERROR the check process died (exit code {child.returncode})")
                    todo.remove(current)
                elif not progressed and todo:
                    print(f"check process exited with code {child.returncode} before checking {todo}")
                    todo = []
                break
            if ln.startswith("@@START "):
                current = ln.split()[1]
                deadline = time.time() + per_variant_s
            elif ln.startswith("@@RESULT "):
                _, name, verdict = ln.split()
                if verdict == "PASS":
                    passing.append(name)
                todo.remove(name)
                current, progressed, deadline = None, True, time.time() + per_variant_s
            else:
                print(ln, end="")
            sys.stdout.flush()
    return [v for v in variants if v in passing]


def _bench_ms(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_row(D, T, variants):
    """Backward TFLOP/s of cuDNN, xtrain's Triton backward and each variant at causal bf16, B = 16k / T,
    H = Hkv = 2048 / D. FLOPs = 2.5 x forward FLOPs (4·B·H·T²·D/2)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from xtrain.kernels.flash_attention import flash_attention_bwd_triton, flash_attention_fwd_triton

    B, H = 16384 // T, 2048 // D
    g = torch.Generator(device="cuda").manual_seed(T * 7 + D)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    flops = 2.5 * 4.0 * B * H * T * T * D / 2
    row = {"D": D, "T": T}

    def timed(col, fn):
        try:
            row[col] = flops / _bench_ms(fn) * 1e-9
        except Exception as e:  # noqa: BLE001
            print(f"  {col} D={D} T={T}: {type(e).__name__}: {str(e)[:300]}")

    try:  # cuDNN backward alone: autograd.grad on a saved graph
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        timed("cudnn", lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True))
        out = qg = kg = vg = None  # free the graph before the other timings
    except Exception as e:  # noqa: BLE001
        print(f"  cudnn D={D} T={T}: {type(e).__name__}: {str(e)[:300]}")
    o, lse = flash_attention_fwd_triton(q, k, v, True)
    timed("triton", lambda: flash_attention_bwd_triton(do, q, k, v, o, lse, True))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for name in variants:
        timed(name, lambda name=name: gluon_flash_bwd(do, q, k, v, o, lse, True, None, name, dq=dq, dk=dk, dv=dv))
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--variants", default=None, help=f"any of {','.join(VARIANTS)} (default: the timing set "
                    f"{','.join(DEFAULT_BENCH)}; every config with --compile-only / --replay)")
    ap.add_argument("--programs", type=int, default=None, help="cap on the persistent grids (default: SMs)")
    ap.add_argument("--compile-only", action="store_true", help="compile every variant for sm_90 (no GPU)")
    ap.add_argument("--replay", action="store_true", help="CPU replay of the tile schedule (no GPU)")
    ap.add_argument("--dump", default=None, help="with --compile-only: write ttgir/ptx into this folder")
    ap.add_argument("--no-isolate", action="store_true", help="run the correctness checks in this process")
    ap.add_argument("--check-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    global PROGRAMS
    PROGRAMS = args.programs
    seqs = [int(x) for x in args.seqs.split(",") if x]
    head_dims = [int(x) for x in args.head_dims.split(",") if x]
    if args.variants is None:
        args.variants = ",".join(VARIANTS if (args.compile_only or args.replay) else DEFAULT_BENCH)
    variants = [x for x in args.variants.split(",") if x]
    for name in variants:
        if name not in VARIANTS:
            ap.error(f"unknown variant {name!r}; have {','.join(VARIANTS)}")
    if args.compile_only:
        return 0 if compile_only(variants, head_dims, args.dump) else 1
    if args.replay:
        ok = replay_protocols(variants, head_dims)
        for name in variants:
            for D in head_dims:
                for causal in (True, False):
                    for transposed in (False, True):
                        errs = replay(name, D, causal=causal, transposed=transposed)
                        for G in (1, 2, 3, 7, 132):  # persistent: coverage of other grids (asserted)
                            item_orders(name, D, 2, 4, 2, 384, causal, G)
                        good = max(errs) < 1e-10
                        ok &= good
                        print(f"  replay {name:10s} D={D:3d} causal={causal!s:5s} "
                              f"{'bthd' if transposed else 'bhtd'}: rel-norm err dq {errs[0]:.1e} "
                              f"dk {errs[1]:.1e} dv {errs[2]:.1e} {'OK' if good else 'MISMATCH'}")
        return 0 if ok else 1

    t_start = time.time()
    print(f"torch {torch.__version__}  triton {triton.__version__}  device {torch.cuda.get_device_name()}")
    sys.stdout.flush()
    if args.check_only:
        for name in variants:
            if _check_one(name, head_dims) == "ERROR":
                return 3
        return 0
    if args.no_isolate:
        passing = [name for name in variants if _check_one(name, head_dims) == "PASS"]
    else:
        passing = run_checks(variants, head_dims)
    print(f"passing variants: {passing}  ({time.time() - t_start:.0f}s)")
    sys.stdout.flush()

    rows = []
    for D in head_dims:
        for T in seqs:
            row = bench_row(D, T, passing)
            rows.append(row)
            print("  " + "  ".join(f"{c}={x:.0f}" if isinstance(x, float) else f"{c}={x}" for c, x in row.items()))
            sys.stdout.flush()

    cols = ["cudnn", "triton"] + passing
    print("\ncausal bf16 BACKWARD, TFLOP/s (x cuDNN); B = 16384 / T, H = 2048 / D; backward alone "
          "(cuDNN: autograd.grad on a saved SDPA graph)")
    print(f"{'D':>4} {'T':>6} " + " ".join(f"{c:>15}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            if c not in r:
                cells.append(f"{'-':>15}")
            elif c == "cudnn" or "cudnn" not in r:
                cells.append(f"{r[c]:>15.0f}")
            else:
                cells.append(f"{r[c]:>7.0f} ({r[c] / r['cudnn']:.2f}x)")
        print(f"{r['D']:>4} {r['T']:>6} " + " ".join(cells))
    print(f"\ntotal {time.time() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
