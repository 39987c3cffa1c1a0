"""Test helpers for the Gluon one-pass backward, run on the CPU: a replay of the kernel (gluon_onepass.py) in
fp64 torch (``replay_math``: its programs, steps, masks and dQ accumulation) and of its four partitions' barrier
protocol under random interleavings (``replay_protocol_dqwg``; ``drop`` leaves one wait out, which the replay must
catch).
"""

from __future__ import annotations

import random

import torch

from xtrain.kernels._consts import LOG2E
from xtrain.kernels.attention import gluon_onepass as OP

KH = OP.HALF_M  # keys per dK/dV warpgroup (resident tile = 2 x KH = 128 keys)
BLOCK_M = OP.BLOCK_M  # queries per step


def replay_math(D=64, T=384, B=2, H=4, Hkv=2, seed=0):
    """The kernel's loops in torch fp64 on the CPU: programs, steps, masks, which warpgroup writes which dSᵀ
    half, the dQ warpgroup's dQ_step = [dS_lo | dS_hi] · [K_lo; K_hi] added into the fp32 accumulator at row
    (b·H + h)·T + start_m, the final · scale. Returns rel errors of dq, dk, dv vs the reference."""
    from xtrain.kernels.attention.reference import flash_attention_bwd_ref, flash_attention_fwd_ref

    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    o, lse = flash_attention_fwd_ref(q, k, v, True)
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
            mt0 = start_n // BLOCK_M
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
                    if start_m < k_lo + KH:
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
    ref = flash_attention_bwd_ref(do, q, k, v, o, lse, True)
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
