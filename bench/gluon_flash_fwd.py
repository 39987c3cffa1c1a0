"""Experiments on the Gluon flash-attention FORWARD for Hopper (sm_90): every variant of the library module
``xtrain.kernels.flash_attention_gluon`` checked against the fp64 reference, then timed against cuDNN and
xtrain's Triton forward; plus, without a GPU, sm_90 compilation and a CPU replay of the persistent schedule.

    PYTHONPATH=. python3 bench/gluon_flash_fwd.py                     # checks, then the timing table (H200)
    PYTHONPATH=. python3 bench/gluon_flash_fwd.py --seqs 1024,2048 --variants lib,pers,pp
    PYTHONPATH=. python3 bench/gluon_flash_fwd.py --compile-only      # no GPU: compile every variant, sm_90
    PYTHONPATH=. python3 bench/gluon_flash_fwd.py --replay            # no GPU: CPU replay of the scheduling

The kernels, the variants (``VARIANTS``: lib, the one-program-per-tile kernel; pers, q2, pp, q2pp, the
persistent kernel with one or two Q buffers, with or without the warpgroup ping-pong; w3, q2 with three
consumer warpgroups over 192-row items, hd64 only), the table that picks
one per (head dim, T) (``VARIANT_BY_T``) and the measured numbers live in the library module's docstring;
this file only runs them (``flash_attention_fwd_gluon(..., variant=name)``). ``--grid`` caps the
persistent grid (default: the SM count); ``--stages`` overrides the K/V ring depth.

--replay: Python generators mirror the persistent kernel's three partitions line by line (producer,
consumer warpgroups 0 and 1; ``py_n_local``/``py_item`` copy ``_n_local``/``_item``), interleaved at random
with TMA copies and O stores completing after random delays. It asserts that every (query tile, head) is
done once, that each consumer wait hands over the tile it expects, that no copy lands in a slot still read,
that the O buffer is not rewritten under an in-flight store, that the ping-pong alternates and that nothing
deadlocks; four deliberately broken protocols (negative controls) must be caught. It follows the pair rule
(``SCHEDULE = "pairs"``); the schedule tables (the default since session 8) change only which items a program
takes and in what order, not the protocol per item (tests/test_flash_attention.py checks the tables). It ran before the
persistent kernel's first GPU run. With nw = 3 (w3) the consumers skip the tiles past their own diagonal and
the rows past T as the kernel does, waiting for each skipped tile to land before releasing it (the
"skip_no_wait" control drops that wait).

Triton-version notes (the GPU machine runs triton 3.6; newer Gluon renamed a few builtins): the library uses
aliases ``_tma_load``/``_tma_store``/``_cta_barrier``; ``mbarrier.expect``'s byte count is positional
(``bytes`` in 3.6, ``bytes_per_cta`` later); ``gl.warp_specialize`` gets an explicit ``worker_num_regs``
(required in 3.6); offline compilation goes through ``triton.experimental.gluon._runtime.GluonASTSource`` +
``triton.compile(target=GPUTarget("cuda", 90, 32))`` (``compile_sm90``).

main(): correctness first, in a child process (a deadlocked mbarrier wait hangs the GPU context; a CUDA
fault poisons it): per variant a timeout, NaN-poisoned outputs, fp64 reference; a variant that fails is
left out of the timing. Then the GPU time (bench/_gpu.py ``gpu_time``: median, host kept ahead) of cuDNN,
the Triton kernel (the library's Gluon dispatch switched off), and each variant; the table gives TFLOP/s and
the ratio to cuDNN.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from bench import isolated  # noqa: E402
from bench.isolated import check_one  # noqa: E402
from xtrain.fileio import atomic_write_text  # noqa: E402
from xtrain.kernels import flash_attention_gluon as LIB  # noqa: E402
from xtrain.kernels._dispatch import sm_count  # noqa: E402
from xtrain.kernels.flash_attention_gluon import VARIANTS

GRID = None  # --grid: cap on the persistent programs (default: the GPU's SM count)
STAGES = None  # --stages: K/V ring slots (default: the library's by head dim)


def gluon_flash_fwd(q, k, v, causal=True, scale=None, variant="pp", *, o=None, lse=None):
    """The library forward by ``variant``, with this run's --grid / --stages. Returns (o, lse)."""
    return LIB.flash_attention_fwd_gluon(
        q, k, v, causal, scale, o=o, lse=lse, variant=variant, stages=STAGES, programs=GRID
    )


# =========================================================================================================
# offline compilation (no GPU): --compile-only
# =========================================================================================================
def _summary(ck):
    return isolated.ptx_summary(ck, ["wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait", "setmaxnreg"])


def compile_only(variants, head_dims, dump=None):
    print(f"triton {triton.__version__}: compiling Gluon variants for sm_90 (no GPU)")
    ok = True
    for name in variants:
        for D in (D for D in head_dims if D in LIB.VARIANT_HEAD_DIMS.get(name, LIB.HEAD_DIMS)):
            for causal in (True, False):
                t0 = time.time()
                tag = f"{name:10s} D={D:3d} {'causal' if causal else 'full  '}"
                try:
                    ck = LIB.compile_sm90(D, causal, STAGES, variant=name)
                    print(f"  {tag}: OK   {time.time() - t0:5.1f}s  {_summary(ck)}")
                    if dump:
                        os.makedirs(dump, exist_ok=True)
                        for ext in ("ttgir", "ptx"):
                            atomic_write_text(f"{dump}/{name}_d{D}_{int(causal)}.{ext}", ck.asm.get(ext, ""))
                except Exception as e:  # noqa: BLE001
                    ok = False
                    print(f"  {tag}: FAIL {type(e).__name__}: {str(e)[:2000]}")
                sys.stdout.flush()
    return ok


# =========================================================================================================
# CPU replay of the persistent kernel's scheduling and barrier protocol: --replay
# =========================================================================================================
def py_n_local(pid, n_prog, U):
    n_pairs = (U + 1) // 2
    m_count = (n_pairs - pid + n_prog - 1) // n_prog
    last = pid + (m_count - 1) * n_prog
    return 2 * m_count - (U % 2) * int(last == n_pairs - 1)


def py_item(idx, pid, n_prog, n_m):
    """(pid_m, bh) of the program's idx-th item: a line-for-line copy of ``_item``."""
    u = 2 * (pid + (idx // 2) * n_prog) + idx % 2
    bh, r = u // n_m, u % n_m
    odd = r % 2
    return odd * (r // 2) + (1 - odd) * (n_m - 1 - r // 2), bh


def py_start_m(pid_m, T, nw=2):
    """First query row of item pid_m (``_tile_coords``: nw = 3 offsets the grid so the first item is partial)."""
    rows = nw * LIB.HALF_M
    return pid_m * rows if nw == 2 else pid_m * rows - (-(-T // rows) * rows - T)


def py_n_tiles(pid_m, T, block_n, causal, nw=2):
    """K/V tiles of item pid_m of nw·64 rows (``_tile_coords``)."""
    rows = nw * LIB.HALF_M
    return -(-(py_start_m(pid_m, T, nw) + rows) // block_n) if causal else -(-T // block_n)


def py_n_mine(row0, n_tiles, block_n, causal):
    """Tiles a warpgroup whose rows start at row0 computes (NW = 3: up to its own diagonal)."""
    return min(-(-(row0 + LIB.HALF_M) // block_n), n_tiles) if causal else n_tiles


def replay_schedule(BH, T, n_prog, block_n=128, causal=True, nw=2):
    """Every (pid_m, bh) exactly once; returns per-program K/V tile counts and the schedule."""
    n_m = -(-T // (nw * LIB.HALF_M))
    U = BH * n_m
    G = max(1, min(n_prog, (U + 1) // 2))
    seen, loads, sched = {}, [], []
    for pid in range(G):
        items = [py_item(i, pid, G, n_m) for i in range(py_n_local(pid, G, U))]
        sched.append(items)
        loads.append(sum(py_n_tiles(m, T, block_n, causal, nw) for m, _ in items))
        for it in items:
            assert it not in seen, f"item {it} twice (programs {seen[it]} and {pid})"
            seen[it] = pid
    want = {(m, bh) for m in range(n_m) for bh in range(BH)}
    assert set(seen) == want, f"missing {sorted(want - set(seen))[:5]} extra {sorted(set(seen) - want)[:5]}"
    rows = sorted(
        r
        for m in range(n_m)
        for w in range(nw)
        for r0 in [py_start_m(m, T, nw) + w * LIB.HALF_M]
        if r0 >= 0
        for r in range(r0, r0 + LIB.HALF_M)
    )  # the rows the computing warpgroups own
    assert rows == list(range(T)), f"query rows not covered exactly once (nw={nw}, T={T})"
    return loads, sched, G


class _Bar:
    """An mbarrier: arrivals complete a phase at `count`; wait(parity) passes iff the phase of that parity
    has completed, i.e. the current phase's parity differs (a fresh barrier passes parity 1)."""

    def __init__(self, count, name):
        self.count, self.pending, self.phases, self.name = count, 0, 0, name

    def arrive(self):
        self.pending += 1
        if self.pending == self.count:
            self.pending, self.phases = 0, self.phases + 1

    def passes(self, parity):
        return (self.phases & 1) != parity


def replay_program(pid, G, BH, T, block_n, stages, num_q, pingpong, causal, rng, bug=None, nw=2):
    """Run one program's three partitions as Python generators that mirror _pers_producer/_pers_consumer
    line by line, interleaved at random, with TMA copies and stores completing after random delays.
    Asserts: every consumer wait hands over exactly the tile/Q the consumer expects, no TMA copy lands in a
    slot a consumer may still read, the O buffer is not rewritten under an in-flight store, ping-pong steps
    alternate strictly, and nothing deadlocks. nw = 3: three consumers over 192-row items, each computing the
    tiles up to its own diagonal and only waiting for and releasing the rest, none for rows past T (the
    kernel's ``_skip_tiles``). Returns the number of scheduler steps."""
    n_m = -(-T // (nw * LIB.HALF_M))
    U = BH * n_m
    n_local = py_n_local(pid, G, U)
    bar = {}
    for i in range(num_q):
        bar["q_full", i], bar["q_empty", i] = _Bar(1, f"q_full{i}"), _Bar(nw, f"q_empty{i}")
    for i in range(stages):
        for nm, c in (("k_full", 1), ("v_full", 1), ("k_empty", nw), ("v_empty", nw)):
            bar[nm, i] = _Bar(c, f"{nm}{i}")
    bar["sched", 0], bar["sched", 1] = _Bar(1, "sched0"), _Bar(1, "sched1")
    content = {}  # (buffer, slot) -> what the last completed TMA copy put there
    readers = {}  # (buffer, slot) -> set of consumers that may read it (from full-wait to empty-arrive)
    inflight = []  # pending async events: [delay, fn]
    o_store = [False] * nw  # an O store of warpgroup HALF still reads o_smem[HALF]
    pp_log = []

    def tma(buf, slot, tag, b):
        assert not readers.get((buf, slot)), f"TMA into {buf}[{slot}] while {readers[(buf, slot)]} read it"

        def land():
            content[buf, slot] = tag
            b.arrive()

        inflight.append([rng.randint(1, 6), land])

    def producer():
        t = 0
        for idx in range(n_local):
            pid_m, bh = py_item(idx, pid, G, n_m)
            n_tiles = py_n_tiles(pid_m, T, block_n, causal, nw)
            qs = idx % num_q
            yield bar["q_empty", qs], ((idx // num_q) & 1) ^ 1
            tma("q", qs, ("q", idx), bar["q_full", qs])
            for j in range(n_tiles):
                slot, phase = t % stages, ((t // stages) & 1) ^ 1
                yield bar["k_empty", slot], phase
                tma("k", slot, ("kv", idx, j), bar["k_full", slot])
                yield bar["v_empty", slot], phase
                tma("v", slot, ("kv", idx, j), bar["v_full", slot])
                t += 1

    def use(buf, slot, tag, who):
        assert content.get((buf, slot)) == tag, f"{who} read {buf}[{slot}] = {content.get((buf, slot))}, want {tag}"
        readers.setdefault((buf, slot), set()).add(who)

    def release(buf, slot, who, b):
        readers[buf, slot].discard(who)
        b.arrive()

    def consumer(half):
        who = f"wg{half}"

        def pp_enter(step):
            if pingpong:
                yield bar["sched", half], (step & 1) ^ (1 - half) ^ (bug == "pp_parity" and half == 1)
                pp_log.append(half)

        def pp_leave():
            if pingpong:
                bar["sched", 1 - half].arrive()

        def skip(t0, j0, n_tiles):  # _skip_tiles: wait for each tile to land, release it unread
            for j in range(j0, n_tiles):
                tj = t0 + j
                slot = tj % stages
                if bug != "skip_no_wait":
                    yield bar["k_full", slot], (tj // stages) & 1
                bar["k_empty", slot].arrive()
                yield bar["v_full", slot], (tj // stages) & 1
                bar["v_empty", slot].arrive()

        t = sc = 0
        for idx in range(n_local):
            pid_m, bh = py_item(idx, pid, G, n_m)
            n_tiles = py_n_tiles(pid_m, T, block_n, causal, nw)
            qs = idx % num_q
            yield bar["q_full", qs], (idx // num_q) & 1
            n_mine = n_tiles
            if nw != 2:
                row0 = py_start_m(pid_m, T, nw) + half * LIB.HALF_M
                if row0 < 0:  # rows before the sequence (the first item's offset): skip every tile, no store
                    bar["q_empty", qs].arrive()
                    yield from skip(t, 0, n_tiles)
                    t += n_tiles
                    sc += n_tiles + 1
                    continue
                n_mine = py_n_mine(row0, n_tiles, block_n, causal)
            use("q", qs, ("q", idx), who)
            slot = t % stages
            yield from pp_enter(sc)
            yield bar["k_full", slot], (t // stages) & 1
            use("k", slot, ("kv", idx, 0), who)
            pp_leave()
            release("k", slot, who, bar["k_empty", slot])  # wait(0) on S_0, then arrive
            for j in range(1, n_mine):
                tj = t + j
                slot, prev = tj % stages, (tj - 1) % stages
                yield from pp_enter(sc + j)
                yield bar["k_full", slot], (tj // stages) & 1
                use("k", slot, ("kv", idx, j), who)
                yield bar["v_full", prev], ((tj - 1) // stages) & 1
                use("v", prev, ("kv", idx, j - 1), who)
                pp_leave()
                release("k", slot, who, bar["k_empty", slot])
                release("v", prev, who, bar["v_empty", prev])
            if not (bug == "q_release_late_count" and half == 1):
                release("q", qs, who, bar["q_empty", qs])
            tl_ = t + n_mine - 1
            last = tl_ % stages
            yield from pp_enter(sc + n_tiles)
            yield bar["v_full", last], (tl_ // stages) & 1
            use("v", last, ("kv", idx, n_mine - 1), who)
            pp_leave()
            release("v", last, who, bar["v_empty", last])
            yield from skip(t, n_mine, n_tiles)
            t = 0 if bug == "ring_per_item" else t + n_tiles
            sc += n_tiles + 1
            yield "ostore", half  # tma.store_wait(0) before o_smem is written again
            o_store[half] = True  # o_smem write, fence, TMA store issued (left in flight)

            def done(h=half):
                o_store[h] = False

            inflight.append([rng.randint(1, 12), done])
        yield "ostore", half

    agents = {"prod": producer(), **{f"wg{h}": consumer(h) for h in range(nw)}}
    waiting = {name: (None, None) for name in agents}  # what each agent waits on (None: nothing yet)

    def ready(b, p):
        if b is None:
            return True
        if b == "ostore":
            return not o_store[p]
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
            raise AssertionError(
                f"DEADLOCK pid {pid}: "
                + ", ".join(f"{n} on {b if isinstance(b, str) else b.name} parity {p}" for n, (b, p) in waiting.items())
            )
        name = rng.choice(runnable)
        try:
            waiting[name] = next(agents[name])
        except StopIteration:
            del agents[name], waiting[name]
    assert not any(readers.values()), f"readers left: {readers}"
    if pingpong:
        assert pp_log == [0, 1] * (len(pp_log) // 2), f"ping-pong order broken: {pp_log[:40]}"
    return steps


def replay(seed=0):
    """CPU checks of the persistent schedule (coverage, balance, L2 locality) and of the barrier protocol."""
    rng = random.Random(seed)
    print("schedule (H200: 132 programs): every (query tile, head) once; K/V tiles per program max/mean")
    for D in (64, 128):
        for T in (1024, 2048, 4096, 8192, 16384):
            BH = (16384 // T) * (2048 // D)
            loads, sched, G = replay_schedule(BH, T, 132)
            # heads in flight: the heads of the items the G programs hold at their k-th item, over k
            n_conc = [len({sched[p][k][1] for p in range(G) if k < len(sched[p])}) for k in range(len(sched[0]))]
            print(
                f"  D={D:3d} T={T:5d} B·H={BH:4d}: {len(loads)} programs, max {max(loads)} mean "
                f"{sum(loads) / len(loads):.1f} -> balance {sum(loads) / len(loads) / max(loads):.3f}; "
                f"heads in flight per lap {min(n_conc)}..{max(n_conc)} of {BH}"
            )
    for BH, T, G, bn in ((4, 384, 5, 128), (3, 384, 4, 128), (4, 256, 3, 256), (1, 640, 2, 64), (7, 1024, 9, 128)):
        for nw in (2, 3):
            replay_schedule(BH, T, G, bn, True, nw)
            replay_schedule(BH, T, G, bn, False, nw)
    print("  odd n_m / odd item counts / small grids / BLOCK_N 64, 256: coverage OK")

    print("barrier protocol (random interleavings, random TMA/store latencies):")
    cases = []
    for name, cfg in VARIANTS.items():
        if cfg is None:  # lib: not persistent
            continue
        nq, pp, nw = (cfg + (2,))[:3]
        for D in LIB.HEAD_DIMS if nw == 2 else (64,):
            bn, st = LIB.BLOCK_N, STAGES or LIB.STAGES[D]
            for BH, T, G in ((4, 256, 3), (2, 384, 2), (3, 1024, 5), (1, 640, 1), (2, 128, 1), (3, 2048, 4)):
                for causal in (True, False):
                    cases.append((name, D, BH, T, G, bn, st, nq, pp, causal, nw))
    n = 0
    for _name, _D, BH, T, G, bn, st, nq, pp, causal, nw in cases:
        for pid in range(min(G, 2)):
            for _ in range(3):
                replay_program(pid, G, BH, T, bn, st, nq, pp, causal, rng, nw=nw)
                n += 1
    print(f"  {n} program replays over {len(cases)} cases: no deadlock, no hazard, ping-pong alternates")

    # negative controls: the replay must catch a broken protocol
    for bug in ("ring_per_item", "pp_parity", "q_release_late_count", "skip_no_wait"):
        # skip_no_wait: a 3-deep ring and two Q buffers (w3's), where an early release shows within 20 runs
        nw, st, nq, reps = (3, 3, 2, 20) if bug == "skip_no_wait" else (2, 2, 1, 5)
        try:
            for pid in range(3):
                for _ in range(reps):
                    replay_program(pid, 3, 3, 1024, 128, st, nq, bug == "pp_parity", True, rng, bug=bug, nw=nw)
            print(f"  negative control {bug}: NOT caught")
            return False
        except AssertionError as e:
            print(f"  negative control {bug}: caught ({str(e)[:90]})")
    return True


# =========================================================================================================
# GPU check + benchmark
# =========================================================================================================
# (B, T, causal, transposed k/v) of the correctness cases; H = 4, Hkv = 2 always
CHECK_CASES = (
    (1, 1024, True, False),
    (2, 2048, True, False),
    (2, 256, True, False),
    (1, 384, True, False),
    (2, 1024, False, False),
    (1, 2048, False, False),
    (2, 1024, True, True),
)


def _rel_err(x, ref):
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _randn(B, h, T, D, g, transposed):
    """bf16 [B, h, T, D]; transposed: a [B, T, h, D] tensor seen through a transpose (the model's layout)."""
    if transposed:
        return torch.randn(B, T, h, D, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    return torch.randn(B, h, T, D, generator=g, device="cuda", dtype=torch.bfloat16)


def check_variant(name, head_dims):
    """True iff every case passes: max relative error < 1e-2 on o and < 1e-5 on lse against the fp64
    reference; outputs pre-filled with NaN so an unwritten tile fails."""
    from xtrain.kernels.flash_attention import flash_attention_fwd_ref

    ok = True
    for D in (D for D in head_dims if D in LIB.VARIANT_HEAD_DIMS.get(name, LIB.HEAD_DIMS)):
        for B, T, causal, transposed in CHECK_CASES:
            H, Hkv = 4, 2
            g = torch.Generator(device="cuda").manual_seed(T + D + B)

            q, k, v = (_randn(B, h, T, D, g, transposed) for h in (H, Hkv, Hkv))
            o = torch.full_like(q, float("nan"))
            lse = torch.full((B, H, T), float("nan"), device="cuda", dtype=torch.float32)
            gluon_flash_fwd(q, k, v, causal, None, name, o=o, lse=lse)
            torch.cuda.synchronize()
            o_ref, lse_ref = flash_attention_fwd_ref(q.double(), k.double(), v.double(), causal)
            eo, el = _rel_err(o, o_ref), _rel_err(lse, lse_ref)
            good = eo < 1e-2 and el < 1e-5
            ok &= good
            print(
                f"    {name} D={D} B={B} T={T} {'causal' if causal else 'full'}{' kvT' if transposed else ''}: "
                f"o {eo:.2e} lse {el:.2e} {'ok' if good else 'FAIL'}"
            )
            sys.stdout.flush()
    return ok


def _check_one(name, head_dims):
    """Check one variant in this process (bench/isolated.py's markers around it)."""
    return check_one(name, lambda: (check_variant(name, head_dims), "every case within tolerance"))


def run_checks(variants, head_dims, startup_s=120.0, per_variant_s=90.0):
    """The checks in child processes (bench/isolated.py). Returns the passing variants."""
    extra = ["--head-dims", ",".join(map(str, head_dims))]
    extra += ["--grid", str(GRID)] if GRID else []
    extra += ["--stages", str(STAGES)] if STAGES else []
    return isolated.run_checks(os.path.abspath(__file__), variants, extra, startup_s, per_variant_s)


def bench_row(D, T, variants):
    """TFLOP/s of cuDNN, the Triton kernel, and each variant: causal bf16, B = 16k / T, H = 2048 / D."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import xtrain.kernels.flash_attention as FA
    from bench._gpu import gpu_time

    B, H = 16384 // T, 2048 // D
    g = torch.Generator(device="cuda").manual_seed(T * 7 + D)
    q, k, v = (torch.randn(B, H, T, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4.0 * B * H * T * T * D / 2
    row = {"D": D, "T": T}

    def timed(col, fn):
        try:
            ms = gpu_time(fn)["ms"]
            row[col] = flops / ms * 1e-9
        except Exception as e:  # noqa: BLE001
            print(f"  {col} D={D} T={T}: {type(e).__name__}: {str(e)[:300]}")

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        timed("cudnn", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    saved = FA.FWD_GLUON
    FA.FWD_GLUON = False  # the Triton kernel itself, not the library's Gluon dispatch
    try:
        timed("triton", lambda: FA.flash_attention_fwd_triton(q, k, v, True))
    finally:
        FA.FWD_GLUON = saved
    o = torch.empty_like(q)
    lse = torch.empty((B, H, T), device="cuda", dtype=torch.float32)
    for name in (n for n in variants if D in LIB.VARIANT_HEAD_DIMS.get(n, LIB.HEAD_DIMS)):
        timed(name, lambda name=name: gluon_flash_fwd(q, k, v, True, None, name, o=o, lse=lse))
    return row


def main(argv=None):
    global GRID, STAGES
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    isolated.add_variant_args(
        ap,
        seqs="1024,2048,4096,8192,16384",
        head_dims="64,128",
        variants=",".join(VARIANTS),
        variants_help=f"any of {','.join(VARIANTS)}",
        replay_help="CPU replay of the persistent schedule/barriers",
    )
    ap.add_argument("--grid", type=int, default=None, help="persistent programs (default: the SM count)")
    ap.add_argument("--stages", type=int, default=None, help="K/V ring slots (default: the library's)")
    ap.add_argument("--dump", default=None, help="with --compile-only: write ttgir/ptx into this folder")
    args = ap.parse_args(argv)
    GRID, STAGES = args.grid, args.stages
    seqs, head_dims, variants = isolated.variant_lists(ap, args, VARIANTS)
    if args.replay:
        return 0 if replay() else 1
    if args.compile_only:
        return 0 if compile_only(variants, head_dims, args.dump) else 1

    print(
        f"torch {torch.__version__}  triton {triton.__version__}  device {torch.cuda.get_device_name()}  "
        f"SMs {sm_count('cuda')}  grid {GRID or 'SMs'}"
    )
    sys.stdout.flush()
    return isolated.check_then_time(
        variants,
        head_dims,
        seqs,
        check_only=args.check_only,
        no_isolate=args.no_isolate,
        check_fn=_check_one,
        checks_fn=run_checks,
        bench_row=bench_row,
        title="causal bf16 forward, TFLOP/s (x cuDNN); B = 16384 / T, H = 2048 / D",
    )


if __name__ == "__main__":
    sys.exit(main())
