"""The one-pass Gluon flash-attention backward (xtrain/kernels/flash_attention_gluon_onepass.py): its bench,
its offline compile report and its CPU replays, and the record of the study that led to it.

    PYTHONPATH=. python3 bench/gluon_flash_bwd_onepass.py                  # GPU: check, then time vs cuDNN
    PYTHONPATH=. python3 bench/gluon_flash_bwd_onepass.py --compile-only   # no GPU: sm_90 compile facts
    PYTHONPATH=. python3 bench/gluon_flash_bwd_onepass.py --replay         # no GPU: math + barrier protocol

A variant is a name of ``VARIANTS``: {head dim: config}, a config being a name of the library's ``CONFIGS`` or
its tuple (STAGES, SLOTS, NDS, PF, KV_REGS, DQ_REGS). GPU: each variant is first checked in a child process
(bench/isolated.py: a deadlock costs a timeout, not the run) by ``isolated.bwd_worst_error`` (B=1, H=4, Hkv=2,
T = 1024 and 2048, causal, NaN-poisoned outputs, fp64 reference, pass below 1e-2), then timed by
``isolated.bwd_bench_row`` (causal bf16, B·T = 16k, H·D = 2048, the backward alone, GPU time median) beside
cuDNN and the library default. --compile-only: shared memory, PTX counts, and from the SASS the HGMMA /
WARPGROUP.DEPBAR counts (equal = ptxas serialised every wgmma) and the STL (spill store) count. --replay: the
kernel's loops in fp64 against the reference, and its four partitions' barrier protocol under random
interleavings, with each of its 8 waits left out in turn as a negative control.

THE STUDY (sessions 3-5; H200, causal bf16, B·T = 16k, H·D = 2048, ratio to cuDNN; full tables in
bench/RESULTS.md, "Fourth round" and "Fifth round" under Flash attention). The library's backward was the
two-kernel split (dK/dV with K/V resident, dQ with Q resident; 7 matrix products per tile pair, no atomics):
hd64 Triton 1.05 / 0.96 / 0.92 / 0.91 / 0.89 at T = 1k / 2k / 4k / 8k / 16k, hd128 Gluon split 1.05 / 0.95 /
0.89 / 0.90 / 0.89. The one-pass form (FlashAttention-3: 5 products, dQ partials reduce-added in fp32):
  * fused2, fused3 (FA3's balanced dQ: the two MMA warpgroups exchange dSᵀ halves each step and each computes
    a head-dim half of dQ; a writer warp issues the reduce-adds): hd128 0.66-0.77, hd64 0.81-0.91. Code at
    commit d597ab2 (this file), with the removed rounds named there.
  * Ablations (commit 29eedaf): at hd128 ptxas serialised every wgmma ("insufficient register resources");
    retiring dV, dK before the dQ product fixed it (393 -> 478 TFLOP/s, 0.82). Removing one piece at a time at
    hd128 T = 16k: dK/dV floor (no exchange, no dQ) 799 TFLOP/s, + exchange wait 659, + dQ product 510,
    + staging 497, + reduce 478 (cuDNN 583); hd64 557 / 461 / 416 / 387 / 382 (cuDNN 450). The per-step
    exchange was the largest single cost.
  * Lag-1 dQ, per-warpgroup own-key dQ ("noex", 2x reduce traffic): no gain (0.76 hd128, 0.91-0.97 hd64).
  * dqwg (commit cff10db; session 5 on the GPU): a THIRD consumer warpgroup does all of dQ, so the dK/dV
    warpgroups never wait on each other. hd64 T = 2k / 8k / 16k: dqwg 0.97 / 0.96 / 0.98, dqwg_ds3 (3 dS
    buffers) 0.98 / 0.97 / 0.99, dqwg_pf (lse/delta of the next step prefetched; spills 57 stores) 1.09 /
    1.06 / 1.07, against the Triton default's 1.02 / 0.93 / 0.90. dqwg_pf became the library's hd64 default
    ("pf"; dqwg = "nopf", dqwg_ds3 = "nopf_ds3").
  * hd128 does not fit dqwg: the dK/dV warpgroups need ~224-232 registers each at hd128 (dK + dV alone are
    128 per thread), and of the 512 per thread-slot of four warpgroups the producer warpgroup takes 24, leaving
    the dQ warpgroup < 64. A producer-less form (three warpgroups; the Q/dO loads issued by dK/dV warpgroup 0
    or by the dQ warpgroup; dQ in 32-column pieces so the dQ warpgroup fits in 56 registers; at 40 ptxas
    serialises) compiled without serialisation (STL ~130) and passed the fp64 check, but ran at 0.54-0.62x
    at hd128 and 0.96-1.01x at hd64 (vs 1.04-1.09 with the producer warp): commit a587da2.
  * One dK/dV warpgroup per 64-key program (session 9, commit 528aee6), which fits hd128 (256 / 152 / 24
    registers, no spills), alone or with the dV product moved to the dQ warpgroup: 0.76-0.87x at hd128.
  * Why the two-kernel form cannot reach cuDNN at hd128: it runs 7 products per tile pair where cuDNN's
    backward is counted as 5, so tying cuDNN's 583 TFLOP/s (T = 16k) takes 816 TFLOP/s of real tensor work,
    82 % of the H200's dense bf16 peak; the split runs at ~74 % (0.89x).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from bench import isolated  # noqa: E402
from xtrain.kernels import flash_attention_gluon_onepass as OP  # noqa: E402
from xtrain.kernels.flash_attention_gluon import LOG2E  # noqa: E402

KH = OP.HALF_M  # keys per dK/dV warpgroup (resident tile = 2 x KH = 128 keys)
BLOCK_M = OP.BLOCK_M  # queries per step
VARIANTS = {  # the library's configs; an experiment adds a tuple here
    "pf": {64: "pf"},
    "nopf": {64: "nopf"},
    "nopf_ds3": {64: "nopf_ds3"},
    "pf_t0": {64: "pf"},  # pf with every head's tiles in turn (TAIL_WAVES = 0: the order before session 9)
}
TAIL_WAVES = {"pf_t0": 0}  # variant -> flash_attention_gluon_bwd.TAIL_WAVES while it runs (default: the library's)
DEFAULT_VARIANTS = ["pf", "nopf"]
PTX_KEYS = [
    "wgmma.mma_async",
    "cp.reduce.async.bulk.tensor",
    "cp.async.bulk.tensor",
    "cp.async.bulk.wait_group.read",
    "mbarrier.try_wait",
    "mbarrier.arrive",
    "setmaxnreg",
    "ld.local",
    "st.local",
]


def _cfg(name, D):
    """The config tuple of a variant (a library name resolved)."""
    c = VARIANTS[name][D]
    return OP.CONFIGS[c] if isinstance(c, str) else tuple(c)


# ---------------------------------------------------------------------------------------------------------
# offline compilation (no GPU): --compile-only
# ---------------------------------------------------------------------------------------------------------
def ptxas_report(ck) -> str:
    """From the kernel's SASS (cuobjdump -sass of the cubin Triton built): HGMMA count, WARPGROUP.DEPBAR
    (wgmma wait) count and STL (spill store) count. ptxas SERIALIZES the wgmmas ("C7512 ... insufficient
    register resources": a wait after every HGMMA) when DEPBAR == HGMMA. cuobjdump -res-usage's LOCAL stays 0
    for these warp-specialised kernels even when they spill: the spills live in the STACK frame."""
    import re
    import subprocess
    import tempfile

    try:
        import triton.backends.nvidia as nv

        tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.cubin")
            with open(path, "wb") as f:
                f.write(ck.asm["cubin"])
            sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, timeout=300).stdout
            res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, timeout=60).stdout
        n_mma, n_dep = len(re.findall(r"\bHGMMA\b", sass)), sass.count("WARPGROUP.DEPBAR")
        n_stl = len(re.findall(r"\bSTL\b", sass))
        stack = re.search(r"STACK:(\d+)", res)
        ser = "wgmma SERIALIZED" if n_mma and n_dep >= n_mma else "not serialized"
        return f"SASS: HGMMA {n_mma}, DEPBAR {n_dep} ({ser}), STL {n_stl}, stack {stack.group(1) if stack else '?'} B"
    except Exception as e:  # noqa: BLE001
        return f"SASS n/a ({type(e).__name__})"


def compile_only(variants, head_dims) -> bool:
    import triton

    print(f"triton {triton.__version__}: compiling one-pass backward variants for sm_90 (no GPU)")
    ok = True
    for name in variants:
        for D in (D for D in head_dims if D in VARIANTS[name]):
            for causal in (True, False):
                t0 = time.time()
                try:
                    ck = OP.compile_sm90(causal=causal, config=VARIANTS[name][D], D=D)
                except Exception as e:  # noqa: BLE001
                    print(f"  {name:10s} D={D} causal={causal!s:5s}: FAILED {type(e).__name__}: {str(e)[:2000]}")
                    ok = False
                    continue
                regs = re.findall(r"setmaxnreg\S*\s+(\d+)", ck.asm["ptx"])
                print(
                    f"  {name:10s} D={D} causal={causal!s:5s}: OK {time.time() - t0:5.1f}s  "
                    f"{isolated.ptx_summary(ck, PTX_KEYS)}; {ptxas_report(ck)}; setmaxnreg {regs}"
                )
    return ok


# ---------------------------------------------------------------------------------------------------------
# CPU replay (no GPU): --replay
# ---------------------------------------------------------------------------------------------------------
def replay_math(D=64, T=384, B=2, H=4, Hkv=2, causal=True, seed=0):
    """The kernel's loops in torch fp64 on the CPU: programs, steps, masks, which warpgroup writes which dSᵀ
    half, the dQ warpgroup's dQ_step = [dS_lo | dS_hi] · [K_lo; K_hi] added into the fp32 accumulator at row
    (b·H + h)·T + start_m, the final · scale. Returns rel errors of dq, dk, dv vs the reference."""
    from xtrain.kernels.flash_attention import flash_attention_bwd_ref, flash_attention_fwd_ref

    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    o, lse = flash_attention_fwd_ref(q, k, v, causal)
    s = D**-0.5
    qk = s * LOG2E
    GROUP = H // Hkv
    delta = (do * o).sum(-1).reshape(-1)
    lse_f = lse.reshape(-1)
    q2, do2 = q.reshape(-1, D), do.reshape(-1, D)
    acc = torch.zeros(B * H * T, D, dtype=torch.float64)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for pid_n in range(T // (2 * KH)):
        for off_bkv in range(B * Hkv):
            off_b, off_kvh = off_bkv // Hkv, off_bkv % Hkv
            start_n = pid_n * 2 * KH
            h0 = off_kvh * GROUP
            mt0 = start_n // BLOCK_M if causal else 0
            n_m = T // BLOCK_M - mt0
            khs = [k[off_b, off_kvh, start_n + w * KH : start_n + (w + 1) * KH] for w in range(2)]
            vhs = [v[off_b, off_kvh, start_n + w * KH : start_n + (w + 1) * KH] for w in range(2)]
            dks, dvs = [torch.zeros_like(khs[0]) for _ in range(2)], [torch.zeros_like(khs[0]) for _ in range(2)]
            for it in range(GROUP * n_m):
                gg, start_m = it // n_m, (mt0 + it % n_m) * BLOCK_M
                row = (off_b * H + h0 + gg) * T + start_m
                qt, dot = q2[row : row + BLOCK_M], do2[row : row + BLOCK_M]
                ds_buf = [None, None]
                for w in range(2):
                    k_lo = start_n + w * KH
                    pt = torch.exp2((khs[w] @ qt.T) * qk - (lse_f[row : row + BLOCK_M] * LOG2E)[None, :])
                    if causal and start_m < k_lo + KH:
                        keep = (start_m + torch.arange(BLOCK_M))[None, :] >= (k_lo + torch.arange(KH))[:, None]
                        pt = torch.where(keep, pt, 0.0)
                    dst = pt * (vhs[w] @ dot.T - delta[row : row + BLOCK_M][None, :])
                    dvs[w] += pt @ dot
                    dks[w] += dst @ qt
                    ds_buf[w] = dst
                acc[row : row + BLOCK_M] += ds_buf[0].T @ khs[0] + ds_buf[1].T @ khs[1]
            for w in range(2):
                dk[off_b, off_kvh, start_n + w * KH : start_n + (w + 1) * KH] = dks[w] * s
                dv[off_b, off_kvh, start_n + w * KH : start_n + (w + 1) * KH] = dvs[w]
    dq = (acc * s).view(B, H, T, D)
    ref = flash_attention_bwd_ref(do, q, k, v, o, lse, causal)
    return [((x - r).norm() / r.norm()).item() for x, r in zip((dq, dk, dv), ref)]


_BLOCKED = "blocked"  # what a replay partition yields while it waits


class _Bar:
    """An mbarrier of the protocol replays: ``count`` arrivals complete a phase."""

    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count

    def done(self, parity):  # mbarrier.wait(parity) returns once phase `parity` completed
        return (self.phase & 1) != parity


def _wait(cond, name, drop):
    """A replay partition's wait: yields _BLOCKED until cond(); left out when ``name`` is ``drop`` (negative
    control)."""
    if drop == name:
        return
    while not cond():
        yield _BLOCKED


def _interleave(parts, pending_async, rng, max_events):
    """Runs the partitions (generators) and the pending async completions (callbacks) in a random order until
    all are done: an async completion with probability 0.25 (always once every partition ended), else one step
    of a random live partition. Asserts progress; returns the number of events."""
    alive = list(range(len(parts)))
    events = blocked = 0
    while alive or pending_async:
        events += 1
        assert events < max_events, "no end (livelock?)"
        if pending_async and (not alive or rng.random() < 0.25):
            pending_async.pop(rng.randrange(len(pending_async)))()
            blocked = 0
            continue
        i = rng.choice(alive)
        try:
            r = next(parts[i])
        except StopIteration:
            alive.remove(i)
            r = None
        blocked = blocked + 1 if r == _BLOCKED and not pending_async else 0
        assert blocked < 400, "deadlock: every partition waits and nothing is in flight"
    return events


DQWG_WAITS = ("slot_empty", "ready", "kv_wait", "ds_empty", "ds_full", "dq_wait", "store_wait", "epilogue")


def replay_protocol_dqwg(n_iter, stages, nds, slots, seed, drop=None, max_events=400000):
    """The dqwg kernel's four partitions (producer warp, dK/dV warpgroups 0 and 1, the dQ warpgroup) randomly
    interleaved at the level of their barrier operations, with async completions (TMA loads, wgmmas,
    reduce-add reads of the staging tile) as separate events in random order. dK/dV warpgroup w per step:
    wait ready ("ready"); Sᵀ, dPᵀ, softmax, dV issued; wait ds_empty[b] ("ds_empty"); own dSᵀ half stored into
    buffer b = it % NDS; dK issued (reads it: DKS); ds_full[b] arrived on; warpgroup_mma_wait(0) ("kv_wait":
    dV, dK retired); Q/dO slot released; epilogue: wait ds_empty of the last step ("epilogue"), K half
    overwritten. dQ warpgroup per step: wait ds_full[b] ("ds_full"); two dQ wgmmas reading both halves of b
    and both K halves (async); warpgroup_mma_wait(0) ("dq_wait"); ds_empty[b] arrived on; tma.store_wait
    (SLOTS - 1) ("store_wait": all but its SLOTS - 1 newest reduce-adds have read their tiles); staging tile
    it % SLOTS written; one reduce-add (async read); at the end store_wait(0). ``drop``: one of DQWG_WAITS
    left out. Asserts: no deadlock; no Q/dO slot reloaded while dV/dK read it; no dS half rewritten while a
    dK or dQ wgmma may read it; each dQ product reads both halves of its own step (at issue and at
    completion); nothing staged before its dQ retired; no staging tile rewritten under its reduce-add, each
    reduce-add reads its own step; every step reduced exactly once; K not overwritten (epilogue) while a dQ
    wgmma may read it."""
    rng = random.Random(seed)
    BLOCKED, Bar = _BLOCKED, _Bar

    ready, empty = [Bar(1) for _ in range(stages)], [Bar(2) for _ in range(stages)]
    ds_full, ds_empty = [Bar(2) for _ in range(nds)], [Bar(1) for _ in range(nds)]
    slot_content, slot_users = [None] * stages, [set() for _ in range(stages)]
    ds_content = [[None, None] for _ in range(nds)]
    ds_readers = [[set(), set()] for _ in range(nds)]  # in-flight wgmmas reading half w of buffer b
    k_readers = set()  # in-flight dQ wgmmas (step): read both K halves
    k_dead = [False, False]
    stage_content, stage_readers = [None] * slots, [0] * slots
    reduced, flags, pending_async = [], {}, []

    def wait(cond, name):
        return _wait(cond, name, drop)

    def producer():
        for it in range(n_iter):
            slot = it % stages
            yield from wait(lambda slot=slot, it=it: empty[slot].done(((it // stages) & 1) ^ 1), "slot_empty")

            def land(it=it, slot=slot):
                assert not slot_users[slot], f"Q/dO slot {slot} reloaded while {slot_users[slot]} read it"
                slot_content[slot] = it
                ready[slot].arrive()

            pending_async.append(land)
            yield

    def kv(w):
        for it in range(n_iter):
            slot, b = it % stages, it % nds
            yield from wait(lambda slot=slot, it=it: ready[slot].done((it // stages) & 1), "ready")
            assert slot_content[slot] == it, f"warpgroup {w} step {it} finds slot {slot} = {slot_content[slot]}"
            slot_users[slot].add((w, it))
            yield  # Sᵀ, dPᵀ retired, softmax, dV issued
            yield from wait(lambda b=b, it=it: ds_empty[b].done(((it // nds) & 1) ^ 1), "ds_empty")
            assert not ds_readers[b][w], f"dS half {b},{w} rewritten at step {it} while read by {ds_readers[b][w]}"
            ds_content[b][w] = it
            yield  # fence, partition barrier; dK issued from the stored half
            ds_readers[b][w].add(("dk", it))
            ds_full[b].arrive()
            flags["kv", w, it] = False

            def mma_done(w=w, it=it, slot=slot, b=b):
                ds_readers[b][w].discard(("dk", it))
                slot_users[slot].discard((w, it))
                flags["kv", w, it] = True

            pending_async.append(mma_done)
            yield from wait(lambda w=w, it=it: flags["kv", w, it], "kv_wait")
            empty[slot].arrive()
        last = n_iter - 1
        yield from wait(lambda: ds_empty[last % nds].done((last // nds) & 1), "epilogue")
        assert not k_readers, f"K half {w} overwritten while dQ wgmmas of steps {k_readers} may read it"
        k_dead[w] = True

    def dqwg():
        issued = []  # completion flags of this warpgroup's reduce-adds, in issue order
        for it in range(n_iter):
            b, s = it % nds, it % slots
            yield from wait(lambda b=b, it=it: ds_full[b].done((it // nds) & 1), "ds_full")
            assert ds_content[b] == [it, it], f"dQ product of step {it} reads {ds_content[b]}"
            assert not any(k_dead), "dQ product issued on an overwritten K"
            for w in range(2):
                ds_readers[b][w].add(("dq", it))
            k_readers.add(it)
            flags["dq", it] = False

            def dq_done(it=it, b=b):
                assert ds_content[b] == [it, it], f"dQ product of step {it} read {ds_content[b]} (rewritten)"
                for w in range(2):
                    ds_readers[b][w].discard(("dq", it))
                k_readers.discard(it)
                flags["dq", it] = True

            pending_async.append(dq_done)
            yield from wait(lambda it=it: flags["dq", it], "dq_wait")
            ds_empty[b].arrive()
            older = issued[: max(0, len(issued) - (slots - 1))]
            yield from wait(lambda older=older: all(f[0] for f in older), "store_wait")
            assert stage_readers[s] == 0, f"staging tile {s} rewritten while its reduce-add reads it"
            assert flags["dq", it], f"dQ of step {it} staged before its wgmmas retired"
            stage_content[s] = it
            yield  # fence, partition barrier, reduce-add issued
            stage_readers[s] += 1
            flag = [False]
            issued.append(flag)

            def read_done(s=s, flag=flag, it=it):
                assert stage_content[s] == it, "staging tile rewritten under its reduce-add"
                stage_readers[s] -= 1
                flag[0] = True
                reduced.append(it)

            pending_async.append(read_done)
        while not all(f[0] for f in issued):  # tma.store_wait(0)
            yield BLOCKED

    parts = [producer(), kv(0), kv(1), dqwg()]
    events = _interleave(parts, pending_async, rng, max_events)
    assert sorted(reduced) == list(range(n_iter)), "reduce-adds lost or repeated"
    return events


def replay_dqwg(configs, seeds=60, n_iters=(1, 2, 3, 4, 5, 7, 16)):
    """Positive runs of replay_protocol_dqwg for each (STAGES, NDS, SLOTS), then each wait of DQWG_WAITS
    dropped in turn (must be caught in some run)."""
    ok = True
    for stages, nds, slots in configs:
        n_ev, good = 0, True
        for n_iter in n_iters:
            for seed in range(seeds):
                try:
                    n_ev += replay_protocol_dqwg(n_iter, stages, nds, slots, seed)
                except AssertionError as e:
                    good = False
                    print(
                        f"  replay dqwg STAGES={stages} NDS={nds} SLOTS={slots} n_iter={n_iter} seed={seed}: FAIL {e}"
                    )
                    break
        ok &= good
        print(
            f"  replay dqwg STAGES={stages} NDS={nds} SLOTS={slots}: n_iter {n_iters} x {seeds} interleavings, "
            f"{n_ev} events: {'OK' if good else 'FAIL'}"
        )
        for drop in DQWG_WAITS:
            caught, runs, first = 0, 0, None
            for n_iter in (3, 4, 7, 16):
                for seed in range(seeds):
                    runs += 1
                    try:
                        replay_protocol_dqwg(n_iter, stages, nds, slots, seed, drop=drop)
                    except AssertionError as e:
                        caught += 1
                        first = first or str(e)
            good = caught > 0
            ok &= good
            print(
                f"  negative control dqwg STAGES={stages} NDS={nds} SLOTS={slots} without the {drop:10s} wait: "
                f"caught in {caught:3d}/{runs} runs {'OK' if good else 'NOT CAUGHT'}  ({first})"
            )
    return ok


def replay(head_dims, variants) -> bool:
    ok = True
    for D in head_dims:
        for causal in (True, False):
            errs = replay_math(D, causal=causal)
            good = max(errs) < 1e-10
            ok &= good
            print(
                f"  replay math D={D:3d} causal={causal!s:5s}: rel-norm err dq {errs[0]:.1e} dk {errs[1]:.1e} "
                f"dv {errs[2]:.1e} {'OK' if good else 'MISMATCH'}"
            )
    cfgs = sorted(
        {(c[0], c[2], c[1]) for v in variants for D in head_dims if D in VARIANTS[v] for c in [_cfg(v, D)]}
    )  # (STAGES, NDS, SLOTS)
    return ok & replay_dqwg(cfgs + [(2, 2, 1)])  # + the tightest rings (SLOTS 1: store_wait(0))


# ---------------------------------------------------------------------------------------------------------
# GPU check + benchmark
# ---------------------------------------------------------------------------------------------------------
def _run(cfg, waves=None):
    from xtrain.kernels import flash_attention_gluon_bwd as GB

    def run(do, q, k, v, o, lse, dq, dk, dv):
        old = GB.TAIL_WAVES
        GB.TAIL_WAVES = old if waves is None else waves
        try:
            return OP.flash_attention_bwd_gluon_onepass(do, q, k, v, o, lse, True, dq=dq, dk=dk, dv=dv, config=cfg)
        finally:
            GB.TAIL_WAVES = old

    return run


def check_fn(name, head_dims):
    dims = [D for D in head_dims if D in VARIANTS[name]]

    def check():
        worst = 0.0
        for D in dims:
            worst = max(worst, isolated.bwd_worst_error(name, [D], _run(VARIANTS[name][D], TAIL_WAVES.get(name))))
        return worst < 1e-2, f"worst rel-norm err {worst:.2e}"

    return isolated.check_one(name, check)


def checks_fn(variants, head_dims):
    return isolated.run_checks(
        os.path.abspath(__file__),
        variants,
        ["--head-dims", ",".join(map(str, head_dims))],
        startup_s=120.0,
        per_variant_s=90.0,
    )


def bench_row(D, T, variants):
    runs = [(name, _run(VARIANTS[name][D], TAIL_WAVES.get(name))) for name in variants if D in VARIANTS[name]]
    return isolated.bwd_bench_row(D, T, runs, warmup=5, rep=30)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    isolated.add_variant_args(
        ap,
        seqs="2048,8192,16384",
        head_dims="64",
        variants=",".join(DEFAULT_VARIANTS),
        variants_help=f"any of {','.join(VARIANTS)}",
        replay_help="CPU replay of the math and barrier protocol (no GPU)",
    )
    args = ap.parse_args(argv)
    seqs, head_dims, variants = isolated.variant_lists(ap, args, VARIANTS)
    if args.compile_only:
        return 0 if compile_only(variants, head_dims) else 1
    if args.replay:
        return 0 if replay(head_dims, variants) else 1
    import triton

    print(f"torch {torch.__version__}  triton {triton.__version__}  device {torch.cuda.get_device_name()}")
    sys.stdout.flush()
    return isolated.check_then_time(
        variants,
        head_dims,
        seqs,
        check_only=args.check_only,
        no_isolate=args.no_isolate,
        check_fn=check_fn,
        checks_fn=checks_fn,
        bench_row=bench_row,
        title="causal bf16 BACKWARD, TFLOP/s (x cuDNN); B = 16384 / T, H = 2048 / D; backward alone; "
        "triton = library default",
    )


if __name__ == "__main__":
    sys.exit(main())
