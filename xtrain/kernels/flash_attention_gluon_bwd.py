"""Flash-attention backward for Hopper (sm_90) in Gluon: two warp-specialised, TMA-fed, async-wgmma kernels.

Same contract as ``flash_attention.flash_attention_bwd_triton``: do/q/o [B, H, T, D], k/v [B, Hkv, T, D]
(query head h reads K/V head h // (H // Hkv)), lse the forward's natural-log row logsumexp [B, H, T];
returns (dq, dk, dv) in the input dtype with dk/dv summed over each group of query heads. Causal and
non-causal; no atomics: bit-identical run to run. What it takes (``supported_bwd``): bf16/fp16, D in
(64, 128), T a multiple of 128, an sm_90 GPU, and q, k, v, do (and given dq/dk/dv buffers) each either
contiguous [B, Hx, T, D] or a [B, T, Hx, D] tensor seen through a transpose (the model's v); o may have
any layout with unit last stride (only the delta preprocess reads it). The oracle is the plain-torch
tiled reference ``flash_attention_bwd_ref`` (``reference`` below). Checked on the GPU by
tests/test_flash_gluon_bwd.py (``gpu``); on CPU the tests compile both kernels for sm_90 (no GPU needed).

Math (FlashAttention-2 backward by recomputation, Dao 2023; base-2 exponent as in the Triton tutorial):
    delta_i = rowsum(dO_i ∘ O_i)                       (flash_attention's Triton preprocess kernel)
    P_ij = exp2(s_ij · scale · log2e − lse_i · log2e)  s = q kᵀ unscaled; causal: P = 0 above the diagonal
    dP_ij = dO_i · v_j    dS_ij = P_ij (dP_ij − delta_i)
    dV_j = Σ_i P_ij dO_i    dK_j = scale · Σ_i dS_ij q_i    dQ_i = scale · Σ_j dS_ij k_j

Design, after FlashAttention-3 (Shah, Bikshandi, Zhang, Thakkar, Ramani & Dao, 2024) and the Gluon
tutorials of the Triton repository (TMA, wgmma, warp specialisation); the skeleton is the forward's
(flash_attention_gluon.py). Both kernels have three partitions: a producer warp (24 registers) issues
every TMA copy into a STAGES-deep shared-memory ring whose slots are guarded by "ready" (expect-tx) and
"empty" (one arrival per consumer) mbarriers; two consumer warpgroups (4 warps each, the second raised to
232 registers by setmaxnreg) each own 64 rows of the program's resident 128-row tile. Every product is an
async wgmma with fp32 accumulators; P and dS are rounded to 16 bits in registers and fed to the next
wgmma as its register A operand (no shared-memory round trip).
  * dK/dV kernel: one program = 128 keys of one (batch, kv head), K and V resident in shared memory
    (warpgroup w owns keys w·64..+64). It walks the BLOCK_M-row query tiles of every query head of the
    GQA group (causal: only tiles at or below the diagonal; with ``OPT_PEEL``, the default since session 15,
    each head's steps that meet the diagonal are masked in a loop of their own, those wholly above a warpgroup's
    keys skipped, the rest unmasked) working transposed, [keys, queries]:
    Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (A = the K/V half in shared memory, B = the permuted Q/dO tile), Pᵀ and
    dSᵀ in registers, dV += Pᵀ dO and dK += dSᵀ Q. So dK and dV accumulate in registers without
    transposes, and the group sum happens in registers (no atomics). Sᵀ is retired before dPᵀ so the
    exp2 overlaps dPᵀ's wgmma, and the dV wgmma runs while dSᵀ is formed. The row statistics reach the step
    through the tensor cores (``OPT_LSEMMA | OPT_DMMA``, session 27, the hd128 default): the preprocess writes
    x = -lse·log2(e) / qk_scale and -delta per query as three 16-bit parts (hi + mid + lo = x to ~24 bits) in
    the first columns of a [B·H·T, 16] buffer each; each step's [BLOCK_M, 16] tiles of them come by TMA into
    the ring slot beside Q and dO, and Sᵀ's and dPᵀ's wgmma chains take one more k16 slice, a constant
    [64, 16] shared tile of ones (first three columns) against those tiles. So Sᵀ arrives as Sᵀ + x and dPᵀ as
    dPᵀ - delta (fp32 accumulation), P = exp2(Sᵀ·qk_scale) and dS = P·dPᵀ, and no thread loads a statistic.
    Before (``OPT_SMEM``, session 13, as FlashAttention-3 keeps LSE and dPsum; still the hd64 split's form)
    each warpgroup read the 64 lse and delta values from the slot's shared rows right before use: 16 8-byte
    loads per thread per step, 14 % of the kernel's shared-memory wavefronts, that had not returned when the
    step's Sᵀ wgmma had (a guess at why: they queue behind the wgmmas' operand reads); together they cost the
    kernel ~9-10 % wherever they were placed, the lse loads most of it. The step's (head, query tile) is carried from
    step to step, not divided out, and one "empty" barrier frees both of a slot's tiles (``OPT_LEAN``).
    (Session 10's ``OPT_PF`` loaded them from global memory a step ahead instead: 32 registers live across
    the step, hence spills; "split_s10".) dK·scale and dV leave through the dead K/V shared tiles by TMA
    stores.
  * dQ kernel: one program = 128 query rows of one (batch, head), Q and dO resident (warpgroup w owns
    rows w·64..+64), walking the K/V tiles (causal: up to the diagonal, heaviest programs first):
    S = Q Kᵀ, dP = dO Vᵀ, dQ += dS K; dQ·scale leaves through Q's dead shared tile. Tile j - 1's dQ wgmma
    is issued behind tile j's S and dP and retired at the end of step j (``OPT_DQP``, session 10; FA3's
    intra-warpgroup overlap), so it runs under S_j's exponentials; K_{j-1}'s slot frees a step later, hence
    a 4-deep K/V ring. (Left in flight across the loop's back edge instead, the dQ wgmma made ptxas
    serialise every wgmma of the kernel. The same overlap in the dK/dV kernel, dK behind the next step's Sᵀ
    and dPᵀ, does not fit its registers: offline, every wgmma serialised and ~150 spill stores.)
  * The two kernels are independent once delta exists and run concurrently on two CUDA streams (the
    discipline of flash_attention_bwd_triton: the side stream waits for the main one before the dQ launch,
    the main one waits for the side one before returning). 7 matrix products per (query, key) tile pair.
  * Program order (``_tail_order``, session 9): each kernel's grid is 1-D; the hardware starts programs in id
    order, so the id decides who runs last. Head by head (a head's tiles heaviest first, so the programs that
    run together share that head's streamed tiles in L2) but for the last ``TAIL_WAVES`` waves' worth of heads,
    whose tiles start tile-major: every such head's heaviest tile, then the next, so the grid ends on light
    tiles. Before, the last head's heaviest tile started among the last programs and ran on alone: a list
    scheduling replay put that at 6-7 % of each kernel at T = 1k-8k. Measured (bench/gluon_bwd_alone.py
    --tail-waves 0,2): each kernel alone 4-6 % faster at T = 1k-8k (dK/dV 0.510 -> 0.487-0.491 ms at 2k), the
    two-stream backward 1-2 % (the streams had been filling each other's tails), nothing at 16k.
Tensor layouts: as the forward's, every TMA descriptor is a 2-D row view: contiguous [B, Hx, T, D] is
[B·Hx·T, D] (row (b·Hx + h)·T + t, column 0), a transposed [B, T, Hx, D] is [B·T, Hx·D] (row b·T + t,
column h·D); a kernel gets (rb, rh, ch) per tensor and addresses (b, h, t) at row b·rb + h·rh + t, column
h·ch. T being a multiple of 128 keeps every tile inside one head.

Configs (``CONFIGS``): (BLOCK_M1, STAGES1, BLOCK_N2, STAGES2[, OPTS]) = the dK/dV kernel's query step and
ring depth, the dQ kernel's key step and ring depth, and a mask of the ``OPT_*`` flags below; "split" is the
default (hd128: DQP, LEAN, SMEM, PEEL, DQSKIP, LSEMMA, DMMA, DOREG; hd64, where it is the deterministic backward,
the first five, the rest measured only at hd128), "split_s27" and "split_s26" the hd128 defaults before sessions 28
and 27, "split_doreg" DOREG on split_s27 at both head dims, "split_lse" / "split_lsed"
the lse columns alone / with delta's at both head dims (the column options run for bf16 inputs only: ``for_dtype``),
"split_s10" and "split_s9" (the
defaults before sessions 13 and 10), "split3" and "split_wide" stay selectable (``config="split_wide"`` or a
tuple) for bench/gluon_flash_bwd.py and bench/gluon_bwd_alone.py. The split's kernels take lse in base 2: the
delta preprocess writes lse·log2(e) into a new [B, H, T] buffer (``_prologue(base2=True)``).

Session 13, H200 (bench/RESULTS.md; Nsight Compute through bench/ncu_probe.py): the session-10 dK/dV kernel kept
the tensor pipe 73 % busy (the dQ kernel 91 %), and its warpgroups were not waiting on their wgmmas (0.1 % of
their stall samples at the Sᵀ and dPᵀ waits) but on their own instruction stream: spilled descriptor bases
reloaded before a wgmma, two integer divisions per step, 16 64-bit global loads, and a multiply by log2(e) that
the compiler put between dPᵀ's wgmmas. With ``OPT_LEAN | OPT_SMEM`` and the base-2 lse the kernel alone takes
0.797-0.807 ms at T = 4k against 0.826-0.834 and 1.50-1.57 at 8k against 1.58-1.60; xtrain bench attention, hd128
backward x cuDNN at T = 1k-16k: 1.10 / 1.06 / 1.03 / 0.95 / 0.98 (session 11: 1.10 / 1.05 / 1.01 / 0.96 / 0.88).
Measured and slower: the slot released a step later, under dV and dK (commit d7e59ab, 0.84 against 0.80 ms at
4k), and half the exponentials by a degree-3 polynomial on the FMA pipe (FlashAttention-4's idea; commit
97d1d4f, 0.86 against 0.80 ms: the MUFU unit was not the bound, the extra instructions were).

Session 14 (bench/RESULTS.md; code at commit 8f3a1cf), measured and slower: each dK/dV step cut into two halves
of 32 queries so a warpgroup's own wgmmas overlap its own exponentials (bit-identical, 14-24 % slower; a guess,
not measured: an N = 32 wgmma reads its K/V half for half the products), and the dQ kernel's Q and dO as register
A operands (ptxas serialised every wgmma with OPT_DQP; without it 4-7 % slower than the default, and wrong at hd64).
What bounds T = 8k-16k: under sustained load the H200 sits at its 700 W cap, so time follows energy
(bench/clock_probe.py --energy). The two kernels spend 0.98-1.10 pJ per executed FLOP, about a bf16 matmul's 1.06,
but execute 7 products where cuDNN's count is 5; at 16k the backward took 3.9-4.0 J against cuDNN's 3.7, and 5 %
more time. A 5-product form whose registers fit, the head dim split across two product warpgroups fed by one
softmax warpgroup (bench/gluon_bwd_dsplit.py), was correct but ran 0.56-0.62x cuDNN: its softmax warpgroup alone
took longer than this whole backward.

Session 15 (bench/RESULTS.md): the causal mask out of the dK/dV walk's loop. With the mask in a branch of every
step, the values it needed stayed live across the loop and ptxas spilled (18 spill stores in the device's MHA build).
``OPT_PEEL`` walks each group head in three parts: the steps whose queries all precede the warpgroup's keys (only
waited for and released: P = 0), the diagonal steps (the mask a compile-time choice, ``_dkdv_step``), the rest with
no mask code. ``OPT_DQSKIP`` skips the dQ kernel's fully masked tile likewise (warpgroup 0's last). Same bits; the
dK/dV kernel alone 3-9 % faster at T = 1k-8k; xtrain bench attention, hd128 backward x cuDNN 1.16 / 1.10-1.11 / 1.06 /
1.00-1.04 / 0.92-0.94 at T = 1k-16k. Measured and dropped: the dQ walk peeled too (``OPT_DQPEEL``, commit 0dccddb: no
gain); the next step's Sᵀ issued behind dV and dK within a two-step body (``OPT_LOOK``, commit 428f156: at 232
registers every wgmma serialised; at 240 the MHA build spilled and ran 26-36 % slower); 3-stage rings.

Session 16 (bench/RESULTS.md), measured and dropped: each step's dV and dK products as two wgmmas over the halves of
its queries, the first issued once its half of Pᵀ (dSᵀ) exists (``OPT_KSPLIT``, commit 60d87b4: bit-identical, no
spills, the dK/dV kernel 2-5 % slower at every length). At 16k this form is ~1 % ahead of split_s14 (three
alternations), 0.92-0.95x cuDNN: at the 700 W cap time follows energy, and 7 products at ~1.0 pJ per FLOP cost
about 5 % more than cuDNN's 5 at ~1.33.

Session 24 (bench/RESULTS.md), measured and dropped, both bit-identical: the dK product issued a step later, between the
next step's Sᵀ and dPᵀ, from dSᵀ kept in a shared tile (``OPT_DKP``, commits 2bcf023 / ecf1def): 2-14 % faster than
the split on the same 3-deep ring, but any ring deeper than two costs the split 7-21 % (not its shared-memory size: a
padded 2-deep kernel ran as fast), so 3-6 % slower than the library at 1k-8k; FA3's ping-pong of the two warpgroups'
Sᵀ/dPᵀ issue (``OPT_PP``, commit 936de50): 10-15 % slower. In both, ptxas serialised every wgmma of the causal MHA build
until the mask was applied to S (-inf) before the exponential rather than to P after it.

Session 27 (bench/RESULTS.md): ``OPT_LSEMMA`` (lse through the tensor cores) and ``OPT_DMMA`` (delta too). Nsight
Compute had the first FFMA after the lse loads waiting on them in 7-12 % of all stall samples; reading them before
Sᵀ's issue instead (``OPT_EARLY``, commit edbf0e4) changed nothing, and dropping the loads (wrong results, a probe)
took the dK/dV kernel from 0.761-0.764 to 0.684-0.687 ms at T = 4k. With the extra k16 slices (+1/8 of Sᵀ's and
dPᵀ's tensor work) the kernel alone takes 0.725-0.728 ms at 4k (split_s26: 0.761-0.769), 1.384-1.385 at 8k
(1.449), 2.72-2.88 at 16k (3.09-3.15); the fp64 errors are the old ones to three digits (2.36e-3 / 2.37e-3 /
2.35e-3 for dq / dk / dv at 4k). xtrain bench attention, hd128 backward x cuDNN, medians of 3 rounds: 1.18 / 1.12 /
1.08 / 1.06 / 0.99 at T = 1k-16k (session 25: 1.16 / 1.10 / 1.06 / 0.98 / 0.95).

Session 28 (bench/RESULTS.md): ``OPT_DOREG``, the dQ kernel's resident dO half as dP's A operand in registers
(32 per thread, loaded once), so each dP k16 slice reads only V from shared memory. Bit-identical; the dQ kernel
alone 1-1.5 % faster (0.538-0.540 against 0.544-0.545 ms at T = 4k, 1.025-1.029 against 1.042-1.045 at 8k) and
2-3 % less energy at 16k (1556-1561 against 1590-1605 mJ per call). The same for the resident Q half (S's A
operand) compiled clean but changed nothing; both at once serialise every wgmma, and so does any register A
operand in the dK/dV kernel (K or V half: spills and serialisation; even the 4-register ones tile of
``OPT_LSEMMA`` serialised the causal MHA build unless kept out of the diagonal steps, and then gained nothing).

Session 29 (bench/RESULTS.md; Nsight Compute, each kernel alone, bench shapes): at T = 16k both kernels read from DRAM
only what they must (286 / 278 MB: Q, dO, K, V once, plus the statistics; L2 hit rates 96 / 95 %), so the walk order
costs nothing there, and both keep the tensor pipe busy 96.5 % of the time. cuDNN's main kernel keeps it busy 64 %:
it executes 5 products where these two execute 7.25 (with the statistics' slices), and gets about 8 % more work out of
each busy tensor cycle (an estimate from the counters: ~935 against ~860 TFLOP/s of busy pipe). So what is left at 16k
is the product count and (a guess, not confirmed below) the N = 64 wgmmas, not memory.
Measured and dropped: the dQ kernel with 128-key steps (S and dP at N = 128; it then fits neither ``OPT_DQP`` nor
``OPT_DOREG``: offline every wgmma serialised) was 5-6 % slower alone and took 5 % more energy at 16k, with the same
bits; the hd128 default without ``OPT_DMMA`` (delta from shared memory again) changed nothing at 4k-8k, nor the
energy per call at 16k.

Session 30 (bench/RESULTS.md): the resident Q half in registers beside ``OPT_DOREG`` does fit, in both dQ
warpgroups, once both run at 240 registers (setmaxnreg; at the usual 248 / 232 only warpgroup 0's build is clean,
warpgroup 1's serialises every wgmma). Offline clean (no spills, nothing serialised), bit-identical on the GPU, and
no faster: the dQ kernel alone 0.543-0.544 against 0.537-0.538 ms at T = 4k, and at 16k the same energy per call
(1584-1595 against 1563-1578 mJ) and the same whole backward (3694-3841 against 3700-3796 mJ). Commit c84095f,
reverted. Session 28's gain from ``OPT_DOREG`` was the last that register A operands give this kernel. With both,
S and dP read half the shared-memory bytes per k16 slice, and the kernel was no faster. So session 29's guess about
the N = 64 wgmmas does not hold for the dQ kernel: its shared-memory port is not what limits it.

Session 10, H200, hd128 causal, bench shapes, the library's two-stream backward as a ratio to cuDNN at T = 1k /
2k / 4k / 8k / 16k (bench/gluon_bwd_alone.py): split_s9 1.03 / 1.00 / 0.97 / 0.96 / 0.88, split (PF, DQP, 4-deep
ring) 1.10 / 1.05 / 1.00-1.01 / 0.94-0.99 / 0.87-0.91 (xtrain bench attention, two processes: 1.09-1.11 / 1.05 /
1.01 / 0.89-1.00 / 0.91-0.92); each kernel alone 2-7 % faster up to 8k. At 16k the gap is
part clock: under sustained load the SM clock falls to ~1.6 GHz, this backward's 2-4 % below cuDNN's
(bench/clock_probe.py; bench/RESULTS.md). The older numbers below predate the program order and these options.

H200, causal bf16 backward alone, B·T = 16k, H·D = 2048, TFLOP/s as a ratio to cuDNN at T = 1k / 2k / 4k
/ 8k / 16k (bench/gluon_flash_bwd.py):
  hd128  split 1.06 / 0.98 / 0.95 / 0.87 / 0.90     split_wide 1.06 / 0.95 / 0.95 / 0.88 / 0.90
         split3 1.03 / 0.93 / 0.90 / 0.82 / 0.84    Triton kernel 0.92 / 0.85 / 0.83 / 0.76 / 0.78
  hd64   split 0.92 / 0.86 / 0.84 / 0.83 / 0.82     Triton kernel 1.06 / 0.96 / 0.95 / 0.91 / 0.90
So hd128 gains 11-16 % over the Triton kernel at every length and hd64 stayed on Triton. (Session 10: with the
program order and OPT_PF / OPT_DQP the hd64 split runs 0.97-1.01x / 0.93x cuDNN at T = 1k-4k / 8k-16k, 10-17 %
above split_s9, with the Triton kernels' bits; it passed them only at 16k (6.89 against 7.24 ms), so it was the
deterministic hd64 backward from T = 16k. Session 13's split passes them from 4k (1.77 / 3.38 / 6.78 against 1.81-
1.87 / 3.68 / 7.05 ms at 4k / 8k / 16k, the same bits), so from T = 4096 now: bench/deterministic_bwd.py.)
Measured and slower (code in git history: bench/gluon_flash_bwd.py at commit 921bd50):
  * split_pipe, the dK/dV consumer software-pipelined across query tiles (FA3's intra-warpgroup overlap:
    tile i's dV/dK wgmmas in flight while tile i+1's Sᵀ/dPᵀ are issued): hd128 0.95 / 0.87 / 0.86 / 0.78 /
    0.72 — the two free-running warpgroups already interleave each other, and the pipelining costs
    registers.
  * fused, FlashAttention-3's one-pass form (dSᵀ staged in shared memory, dQ partials per key half added
    into an fp32 buffer by TMA reduce-adds, 5 products per tile pair): hd128 0.75 / 0.72 / 0.72 / 0.60 /
    0.72, hd64 0.91 / 0.88 / 0.87 / 0.85 / 0.88; not deterministic either.
  * fused_atom, fused with the dQ partials added by fp32 atomics from registers: 0.51-0.59.
All six passed the fp64 check (B = 1, H = 4, Hkv = 2, T = 1024 / 2048, both head dims, causal).
Persistent round, measured and slower (code in git history, commit 6586ece): pers, pers_pp, pers_wide,
pers_wide_pp — both kernels persistent (grid = SM count, the forward's paired heaviest/lightest static
schedule over the split kernels' 128-row items, ring and resident-tile barriers running across items,
output stores waited for one item later), _pp: FA3's warpgroup ping-pong on the Sᵀ/dPᵀ (S/dP) wgmmas,
_wide: 128-query dK/dV steps (hd64) and 128-key dQ steps. All 119 GPU tests passed (tiny grids of 1 and 5
programs included). Ratio to cuDNN at T = 1k / 2k / 4k / 8k / 16k, same process:
  hd64   Triton kernel 1.04 / 0.96 / 0.93 / 0.89 / 0.88    split 0.81 / 0.86 / 0.86 / 0.83 / 0.81
         pers 1.01 / 0.92 / 0.88 / 0.81 / 0.81             pers_pp 1.02 / 0.94 / 0.89 / 0.83 / 0.79
         pers_wide 0.65 / 0.57 / 0.53 / 0.50 / 0.49        pers_wide_pp 0.65 / 0.57 / 0.55 / 0.51 / 0.50
  hd128  split 0.74 / 0.94 / 0.94 / 0.90 / 0.90 (1.05-1.06 at 1k in two other runs: the 1k numbers swing
         by 0.3 between runs)                              split_wide 0.66 / 0.94 / 0.93 / 0.91 / 0.91
         pers 0.62 / 0.96 / 0.94 / 0.91 / 0.88             pers_pp 1.07 / 1.00 / 0.93 / 0.90 / 0.76
         pers_wide 1.05 / 1.04 / 0.92 / 0.79 / 0.89        pers_wide_pp 0.67 / 0.98 / 0.89 / 0.90 / 0.89
  The two persistent kernels run on two streams with full SM-sized grids each, so they mostly serialise;
  long T lost.
Build facts (sm_90, triton 3.6 and 3.9): 168 registers/thread at launch, setmaxnreg to 248 (default
consumer) / 232 / 24. Spills (SASS STL count, triton 3.6 / 3.9; cuobjdump -res-usage reports 0 B local for
these warp-specialised kernels either way, so count them in the SASS as bench/gluon_flash_bwd_onepass.py's
ptxas_report does): none at hd64 and in the dQ kernels; the hd128 dK/dV kernel 37 / 32 causal, 16 / 8
not. Shared memory hd64 / hd128: 66 / 131 KB per kernel (split), 82 / 164 KB (split3), dQ kernel of
split_wide 99 / 197 KB.
"""

from __future__ import annotations

import torch

from xtrain.kernels import flash_attention as FA
from xtrain.kernels._dispatch import capability, launch_cached, run_side_by_side
from xtrain.kernels.flash_attention import flash_attention_bwd_ref
from xtrain.kernels.flash_attention_gluon import (
    HAVE_GLUON,
    HEAD_DIMS,
    LOG2E,
    _desc,
    _row_view,
    descriptor_templates,
    rebase_all,
)

reference = flash_attention_bwd_ref  # the oracle: the plain-torch tiled reference of the same algorithm

RESIDENT = 128  # keys per dK/dV program, query rows per dQ program (two warpgroups of 64)
HALF_M = 64
# (BLOCK_M1, STAGES1, BLOCK_N2, STAGES2[, OPTS]) by head dim; see the module docstring
CONFIGS = {
    "split": {64: (64, 2, 64, 4, 62), 128: (64, 2, 64, 4, 510)},
    "split_s27": {64: (64, 2, 64, 4, 62), 128: (64, 2, 64, 4, 254)},
    "split_s26": {64: (64, 2, 64, 4, 62), 128: (64, 2, 64, 4, 62)},
    "split_lse": {64: (64, 2, 64, 4, 126), 128: (64, 2, 64, 4, 126)},
    "split_lsed": {64: (64, 2, 64, 4, 254), 128: (64, 2, 64, 4, 254)},
    "split_doreg": {64: (64, 2, 64, 4, 318), 128: (64, 2, 64, 4, 510)},
    "split_s14": {64: (64, 2, 64, 4, 14), 128: (64, 2, 64, 4, 14)},
    "split_peel": {64: (64, 2, 64, 4, 30), 128: (64, 2, 64, 4, 30)},
    "split_dqskip": {64: (64, 2, 64, 4, 46), 128: (64, 2, 64, 4, 46)},
    "split_s10": {64: (64, 2, 64, 4, 3), 128: (64, 2, 64, 4, 3)},
    "split_s9": {64: (64, 2, 64, 2, 0), 128: (64, 2, 64, 2, 0)},
    "split3": {64: (64, 3, 64, 3), 128: (64, 3, 64, 3)},
    "split_wide": {64: (128, 2, 128, 2), 128: (64, 2, 128, 2)},
}
# the optional fifth element of a config, a bit mask: OPT_PF the dK/dV kernel loads each step's lse and delta in
# the step before (once its dK wgmma is issued); OPT_DQP the dQ kernel issues tile j - 1's dQ wgmma behind tile
# j's S and dP (``_dq_loop_pipelined``); OPT_LEAN the dK/dV kernel carries each step's (head, query tile) from
# the step before (no division) and frees a slot's Q and dO tiles with one barrier (with OPT_PF or OPT_SMEM);
# OPT_SMEM its lse and delta come by TMA into shared memory beside Q and dO (with OPT_LEAN, without OPT_PF);
# OPT_PEEL (with OPT_SMEM) the dK/dV walk takes each head's diagonal steps in a loop of their own (the mask a
# compile-time choice) and skips the steps whose queries all precede the warpgroup's keys; OPT_DQSKIP the dQ
# kernel's warpgroup 0 skips its causal tile whose keys all follow its queries (both: the same bits); OPT_LSEMMA
# (with OPT_PEEL) the dK/dV kernel's Sᵀ takes lse through one more k16 slice of its wgmma chain (the preprocess's lse
# columns against a tile of ones), OPT_DMMA (with OPT_LSEMMA) dPᵀ takes delta likewise (module docstring); OPT_DOREG
# the dQ kernel's resident dO half is dP's A operand from registers, loaded once, not read from shared memory per step.
# "split" = DQP | LEAN | SMEM | PEEL | DQSKIP (session 15; "split_s26") and at hd128 also LSEMMA | DMMA (session 27;
# "split_s27") and DOREG (session 28),
# "split_s14" = DQP | LEAN | SMEM (session 13),
# "split_peel" and "split_dqskip" one of the two skips each, "split_s10" = PF | DQP (session 10), "split_s9" =
# neither (session 9).
OPT_PF, OPT_DQP, OPT_LEAN, OPT_SMEM, OPT_PEEL, OPT_DQSKIP, OPT_LSEMMA, OPT_DMMA = 1, 2, 4, 8, 16, 32, 64, 128
OPT_DOREG = 256
LSE_COLS = 16  # OPT_LSEMMA: the lse columns' tile width (one k16 slice of the Sᵀ wgmma), 3 of them used
DEFAULT = "split"
# the last TAIL_WAVES waves of each kernel's programs start lightest-last across heads (``_tail_order``); 0 =
# every head's tiles in turn, heaviest first within the head (the order before session 9)
TAIL_WAVES = 2

if HAVE_GLUON:
    # the Gluon names and Triton-version aliases the forward module already resolved
    from xtrain.kernels.flash_attention_gluon import (
        _CONSUMER_REGS,
        _PRODUCER_REGS,
        _cta_barrier,
        _tma_load,
        _tma_store,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        tma,
        triton,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    _LSE_COLS = gl.constexpr(LSE_COLS)

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
        return FA._tail_order(pid, nb, gl.num_programs(0) // nb, TAIL)  # the Triton kernels' arithmetic

    # -----------------------------------------------------------------------------------------------------
    # dK/dV kernel
    # -----------------------------------------------------------------------------------------------------
    @gluon.jit
    def _next_query_tile(start_m, step, T, m0):
        """(start_m + step, or m0 once that reaches T: the group's next head from its first tile again; 1 if it
        wrapped, else 0): the LEAN dK/dV walk's next query tile, carried instead of divided out of the step."""
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
    def _dkdv_load(desc, row_desc, bar, dst, row_dst, row, col, lt, SMEM: gl.constexpr, COLS: gl.constexpr = False):
        """One Q or dO tile into its ring slot, and (SMEM) row lt of the lse / delta view beside it, on one barrier.
        COLS (``OPT_LSEMMA``): row_desc is the [B·H·T, LSE_COLS] lse-column view, and its [BLOCK_M, LSE_COLS] tile
        of the step's queries comes instead."""
        if SMEM:
            mbarrier.expect(bar, desc.block_type.nbytes + row_desc.block_type.nbytes)
            if COLS:
                _tma_load(row_desc, [lt * desc.block_type.shape[0], 0], bar, row_dst)
            else:
                _tma_load(row_desc, [lt, 0], bar, row_dst)
        else:
            mbarrier.expect(bar, desc.block_type.nbytes)
        _tma_load(desc, [row, col], bar, dst)

    @gluon.jit
    def _dkdv_producer(
        q_desc,
        do_desc,
        k_desc,
        v_desc,
        lse_desc,
        delta_desc,
        q_smem,
        do_smem,
        k_smem,
        v_smem,
        lse_smem,
        delta_smem,
        kv_bar,
        q_bars,
        do_bars,
        q_empty,
        do_empty,
        k_row,
        k_col,
        v_row,
        v_col,
        q_base,
        q_rh,
        q_ch,
        do_base,
        do_rh,
        do_ch,
        h0,
        mt0,
        n_m,
        n_iter,
        T,
        lt0,
        BLOCK_M: gl.constexpr,
        STAGES: gl.constexpr,
        LEAN: gl.constexpr,
        SMEM: gl.constexpr,
        LSEMMA: gl.constexpr = False,
        DMMA: gl.constexpr = False,
    ):
        """The TMA warp: the K and V halves once, then the Q and dO tiles of every (group head, query tile).
        LEAN: the (head, tile) of a step carried from the step before (no division), and one "empty" barrier
        per slot for both tiles (``q_empty``). SMEM (with LEAN): each step's lse and delta rows too (row lt of
        the [B·H·T / BLOCK_M, BLOCK_M] views, from lt0 on), beside Q and dO, on their barriers; with LSEMMA (DMMA)
        the step's [BLOCK_M, LSE_COLS] tile of the lse (delta) columns instead of its row."""
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
            if not LEAN:
                h = h0 + it // n_m
                start_m = (mt0 + it % n_m) * BLOCK_M
            slot = it % STAGES
            phase = ((it // STAGES) & 1) ^ 1  # fresh barriers: the first lap passes
            mbarrier.wait(q_empty.index(slot), phase)
            _dkdv_load(
                q_desc,
                lse_desc,
                q_bars.index(slot),
                q_smem.index(slot),
                lse_smem.index(slot),
                q_base + h * q_rh + start_m,
                h * q_ch,
                lt,
                SMEM,
                LSEMMA,
            )
            if not LEAN:
                mbarrier.wait(do_empty.index(slot), phase)
            _dkdv_load(
                do_desc,
                delta_desc,
                do_bars.index(slot),
                do_smem.index(slot),
                delta_smem.index(slot),
                do_base + h * do_rh + start_m,
                h * do_ch,
                lt,
                SMEM,
                DMMA,
            )
            if LEAN:
                start_m, wrap = _next_query_tile(start_m, BLOCK_M, T, mt0 * BLOCK_M)
                lt += 1
                lt += wrap * mt0
                h += wrap

    @gluon.jit
    def _dkdv_store(
        k_half,
        v_half,
        dk,
        dv,
        sm_scale,
        dk_desc,
        dv_desc,
        dk_row,
        dk_col,
        dv_row,
        dv_col,
        dtype: gl.constexpr,
        HALF: gl.constexpr,
    ):
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

    @gluon.jit
    def _dkdv_lse_delta(lse_ptr, delta_ptr, lse_row0, T, mt0, n_m, it, cols, BLOCK_M: gl.constexpr):
        """lse·log2(e) and delta of step ``it``'s queries (``cols`` in the Sᵀ column layout)."""
        row = lse_row0 + (it // n_m) * T + (mt0 + it % n_m) * BLOCK_M  # int64 row of the [B·H·T] lse / delta
        return _dkdv_lse_delta_at(lse_ptr, delta_ptr, row, cols)

    @gluon.jit
    def _dkdv_lse_delta_at(lse_ptr, delta_ptr, row, cols):
        """lse·log2(e) (the split's lse input is in base 2 already) and delta of the queries from int64 row ``row``
        of the [B·H·T] lse / delta on."""
        return gl.load(lse_ptr + row + cols), gl.load(delta_ptr + row + cols)

    @gluon.jit
    def _dkdv_issue_sdp(
        k_half,
        v_half,
        q_smem,
        do_smem,
        q_bars,
        do_bars,
        s_zero,
        it,
        STAGES: gl.constexpr,
        ones_smem=None,
        lse_smem=None,
        delta_smem=None,
        LSEMMA: gl.constexpr = False,
        DMMA: gl.constexpr = False,
    ):
        """Step ``it``'s Sᵀ = K Qᵀ and dPᵀ = V dOᵀ wgmmas, each once its tile has landed; LSEMMA (DMMA): Sᵀ's (dPᵀ's)
        chain with one more k16 slice, ``ones_smem`` against the slot's lse (delta) columns. Returns the ring slot,
        its Q and dO tiles and the two in-flight products."""
        slot = it % STAGES
        phase = (it // STAGES) & 1
        q_t = q_smem.index(slot)
        do_t = do_smem.index(slot)
        mbarrier.wait(q_bars.index(slot), phase)
        st = warpgroup_mma(k_half, q_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if LSEMMA:
            st = warpgroup_mma(ones_smem, lse_smem.index(slot).permute((1, 0)), st, is_async=True)
        mbarrier.wait(do_bars.index(slot), phase)
        dpt = warpgroup_mma(v_half, do_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if DMMA:
            dpt = warpgroup_mma(ones_smem, delta_smem.index(slot).permute((1, 0)), dpt, is_async=True)
        return slot, q_t, do_t, st, dpt

    @gluon.jit
    def _dkdv_step(
        k_half,
        v_half,
        q_smem,
        do_smem,
        lse_smem,
        delta_smem,
        q_bars,
        do_bars,
        q_empty,
        dk,
        dv,
        s_zero,
        it,
        start_m,
        offs_k,
        cols,
        qk_scale,
        dtype: gl.constexpr,
        s_layout: gl.constexpr,
        op_layout: gl.constexpr,
        STAGES: gl.constexpr,
        MASK: gl.constexpr,
        ones_smem=None,
        LSEMMA: gl.constexpr = False,
        DMMA: gl.constexpr = False,
    ):
        """One step of the PEEL walk (LEAN and SMEM): ``_dkdv_consumer``'s loop body with the causal mask a
        compile-time choice (MASK: the step's query tile starts at start_m) instead of a branch in every step.
        LSEMMA (``OPT_LSEMMA``): Sᵀ's wgmma chain takes one more k16 slice, the shared [64, LSE_COLS] tile
        ``ones_smem`` (1 in its first three columns) against the slot's lse columns (-lse·log2(e) / qk_scale in
        three bf16 parts), so Sᵀ arrives with the lse subtracted and no thread reads lse from shared memory."""
        slot, q_t, do_t, st, dpt = _dkdv_issue_sdp(
            k_half,
            v_half,
            q_smem,
            do_smem,
            q_bars,
            do_bars,
            s_zero,
            it,
            STAGES,
            ones_smem,
            lse_smem,
            delta_smem,
            LSEMMA,
            DMMA,
        )
        if LSEMMA:
            st = warpgroup_mma_wait(1, deps=(st,))
            pt = gl.exp2(st * qk_scale)
        else:
            lse_b = lse_smem.index(slot).load(s_layout)
            st = warpgroup_mma_wait(1, deps=(st,))
            pt = gl.exp2(st * qk_scale - lse_b)
        if MASK:
            keep = gl.expand_dims(start_m + cols, 0) >= gl.expand_dims(offs_k, 1)
            pt = gl.where(keep, pt, 0.0)
        p_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv_tok = warpgroup_mma(p_op, do_t, dv, is_async=True)
        if DMMA:  # dPᵀ arrives with delta subtracted (the ones tile against the slot's delta columns)
            dpt = warpgroup_mma_wait(1, deps=(dpt,))
            dst = pt * dpt
        else:
            delta_b = delta_smem.index(slot).load(s_layout)
            dpt = warpgroup_mma_wait(1, deps=(dpt,))
            dst = pt * (dpt - delta_b)
        ds_op = gl.convert_layout(dst.to(dtype), op_layout)
        dk_tok = warpgroup_mma(ds_op, q_t, dk, is_async=True)
        dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_op))
        mbarrier.arrive(q_empty.index(slot), count=1)
        return dk, dv

    @gluon.jit
    def _dkdv_skip(q_bars, do_bars, q_empty, it, STAGES: gl.constexpr):
        """A PEEL step whose queries all precede this half's keys (P = 0: nothing to add): the slot is only
        waited for and released."""
        slot = it % STAGES
        phase = (it // STAGES) & 1
        mbarrier.wait(q_bars.index(slot), phase)
        mbarrier.wait(do_bars.index(slot), phase)
        mbarrier.arrive(q_empty.index(slot), count=1)

    @gluon.jit
    def _dkdv_consumer(
        q_smem,
        do_smem,
        k_smem,
        v_smem,
        lse_smem,
        delta_smem,
        kv_bar,
        q_bars,
        do_bars,
        q_empty,
        do_empty,
        dk_desc,
        dv_desc,
        lse_ptr,
        delta_ptr,
        lse_row0,
        T,
        dk_row,
        dk_col,
        dv_row,
        dv_col,
        mt0,
        n_m,
        n_iter,
        start_n,
        qk_scale,
        sm_scale,
        dtype: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        BLOCK_M: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        HALF: gl.constexpr,
        PF: gl.constexpr,
        LEAN: gl.constexpr,
        SMEM: gl.constexpr,
        PEEL: gl.constexpr = False,
        ones_smem=None,
        LSEMMA: gl.constexpr = False,
        DMMA: gl.constexpr = False,
    ):
        """One warpgroup: keys [start_n + HALF·64, +64), on [keys, queries] tiles (module docstring). PF: each
        step's lse and delta are loaded in the step before, once its dK wgmma is issued. LEAN (with PF): the
        step's query tile and lse row carried from the step before (no integer division in the loop), and one
        arrival per step on one "empty" barrier for both of the slot's tiles. SMEM (with LEAN, instead of PF):
        lse and delta read from the slot's shared rows (the producer's TMA) just before their use, so no
        register holds them across the step. PEEL (with SMEM; session 15): each group head's walk in three parts,
        the steps wholly above this half's keys skipped (``_dkdv_skip``), the diagonal ones masked, the rest with
        no mask code (``_dkdv_step``), instead of the mask's branch in every step."""
        KH: gl.constexpr = dk_desc.block_type.shape[0]
        s_layout: gl.constexpr = _acc_layout(BLOCK_M)  # [KH, BLOCK_M] Sᵀ, dPᵀ
        a_layout: gl.constexpr = _acc_layout(HEAD_DIM)  # [KH, HEAD_DIM] dK, dV
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
        k_half = k_smem.index(HALF)
        v_half = v_smem.index(HALF)
        k_lo = start_n + HALF * KH
        offs_k = k_lo + gl.arange(0, KH, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([KH, BLOCK_M], gl.float32, s_layout)
        dk = gl.zeros([KH, HEAD_DIM], gl.float32, a_layout)
        dv = gl.zeros([KH, HEAD_DIM], gl.float32, a_layout)
        start_m = mt0 * BLOCK_M
        lrow = lse_row0 + start_m  # LEAN: int64 row of the step's first query in the [B·H·T] lse / delta
        if PF and not SMEM:
            lse2, delta = _dkdv_lse_delta(lse_ptr, delta_ptr, lse_row0, T, mt0, n_m, 0, cols, BLOCK_M)
        mbarrier.wait(kv_bar, 0)
        if PEEL:  # (LEAN and SMEM) per group head: its diagonal steps masked, then the rest with no mask code
            gl.static_assert(SMEM and LEAN and not PF)
            # causal: the first steps of each head's walk (start_m from start_n = mt0·BLOCK_M) hold queries before
            # some key of this half; those entirely before it (the first HALF·KH / BLOCK_M) add nothing
            if CAUSAL:
                n_skip: gl.constexpr = (HALF * KH) // BLOCK_M
                n_diag: gl.constexpr = ((HALF + 1) * KH + BLOCK_M - 1) // BLOCK_M - n_skip
            else:
                n_skip: gl.constexpr = 0
                n_diag: gl.constexpr = 0
            it = 0
            for _g in range(n_iter // n_m):
                for _i in gl.static_range(n_skip):
                    _dkdv_skip(q_bars, do_bars, q_empty, it, STAGES)
                    it += 1
                for i in gl.static_range(n_diag):
                    dk, dv = _dkdv_step(
                        k_half,
                        v_half,
                        q_smem,
                        do_smem,
                        lse_smem,
                        delta_smem,
                        q_bars,
                        do_bars,
                        q_empty,
                        dk,
                        dv,
                        s_zero,
                        it,
                        start_m + (n_skip + i) * BLOCK_M,
                        offs_k,
                        cols,
                        qk_scale,
                        dtype,
                        s_layout,
                        op_layout,
                        STAGES,
                        True,
                        ones_smem,
                        LSEMMA,
                        DMMA,
                    )
                    it += 1
                for _i in range(n_m - n_skip - n_diag):
                    dk, dv = _dkdv_step(
                        k_half,
                        v_half,
                        q_smem,
                        do_smem,
                        lse_smem,
                        delta_smem,
                        q_bars,
                        do_bars,
                        q_empty,
                        dk,
                        dv,
                        s_zero,
                        it,
                        start_m,
                        offs_k,
                        cols,
                        qk_scale,
                        dtype,
                        s_layout,
                        op_layout,
                        STAGES,
                        False,
                        ones_smem,
                        LSEMMA,
                        DMMA,
                    )
                    it += 1
        else:  # the walk with the mask in a branch of every step (session 13 and before)
            for it in range(n_iter):
                if not LEAN:
                    start_m = (mt0 + it % n_m) * BLOCK_M
                if not PF and not SMEM:  # plain loads, issued before the barrier wait
                    lse2, delta = _dkdv_lse_delta(lse_ptr, delta_ptr, lse_row0, T, mt0, n_m, it, cols, BLOCK_M)
                slot, q_t, do_t, st, dpt = _dkdv_issue_sdp(
                    k_half, v_half, q_smem, do_smem, q_bars, do_bars, s_zero, it, STAGES
                )
                if SMEM:
                    lse_b = lse_smem.index(slot).load(s_layout)  # [1, BLOCK_M] lse·log2(e), broadcast over the keys
                else:
                    lse_b = gl.expand_dims(lse2, 0)
                st = warpgroup_mma_wait(1, deps=(st,))  # retires Sᵀ; dPᵀ may still run
                pt = gl.exp2(st * qk_scale - lse_b)
                if CAUSAL:
                    if start_m < k_lo + KH:  # some query of the tile precedes some key of this half: mask
                        keep = gl.expand_dims(start_m + cols, 0) >= gl.expand_dims(offs_k, 1)
                        pt = gl.where(keep, pt, 0.0)
                p_op = gl.convert_layout(pt.to(dtype), op_layout)
                dv_tok = warpgroup_mma(p_op, do_t, dv, is_async=True)
                if SMEM:
                    delta_b = delta_smem.index(slot).load(s_layout)
                else:
                    delta_b = gl.expand_dims(delta, 0)
                dpt = warpgroup_mma_wait(1, deps=(dpt,))  # retires dPᵀ; dV may still run
                dst = pt * (dpt - delta_b)
                ds_op = gl.convert_layout(dst.to(dtype), op_layout)
                dk_tok = warpgroup_mma(ds_op, q_t, dk, is_async=True)
                if SMEM:
                    start_m, _ = _next_query_tile(start_m, BLOCK_M, T, mt0 * BLOCK_M)
                elif LEAN:  # the next step's query tile (the last step keeps its own: nothing is read past the end)
                    more = (it + 1 < n_iter).to(gl.int32)
                    start_m, wrap = _next_query_tile(start_m, more * BLOCK_M, T, mt0 * BLOCK_M)
                    lrow += more * BLOCK_M
                    lrow += wrap * (mt0 * BLOCK_M)
                    lse2, delta = _dkdv_lse_delta_at(lse_ptr, delta_ptr, lrow, cols)
                elif PF:  # the next step's, while dV and dK run: Sᵀ, dPᵀ and their fp32 values are dead here
                    lse2, delta = _dkdv_lse_delta(
                        lse_ptr, delta_ptr, lse_row0, T, mt0, n_m, gl.minimum(it + 1, n_iter - 1), cols, BLOCK_M
                    )
                dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, p_op, ds_op))
                mbarrier.arrive(q_empty.index(slot), count=1)
                if not LEAN:
                    mbarrier.arrive(do_empty.index(slot), count=1)
        _dkdv_store(k_half, v_half, dk, dv, sm_scale, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col, dtype, HALF)

    @gluon.jit
    def _bwd_dkdv_kernel(
        q_desc,
        do_desc,
        k_desc,
        v_desc,
        dk_desc,
        dv_desc,
        lse_desc,
        delta_desc,
        lse_ptr,
        delta_ptr,
        qk_scale,
        sm_scale,
        H,
        GROUP,
        T,
        q_rb,
        q_rh,
        q_ch,
        do_rb,
        do_rh,
        do_ch,
        k_rb,
        k_rh,
        k_ch,
        v_rb,
        v_rh,
        v_ch,
        dk_rb,
        dk_rh,
        dk_ch,
        dv_rb,
        dv_rh,
        dv_ch,
        TAIL,
        HEAD_DIM: gl.constexpr,
        BLOCK_M: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        PF: gl.constexpr = False,
        LEAN: gl.constexpr = False,
        SMEM: gl.constexpr = False,
        PEEL: gl.constexpr = False,
        LSEMMA: gl.constexpr = False,
        DMMA: gl.constexpr = False,
    ):
        """Program (key tile, batch·kv head) of a 1-D grid in ``_tail_order`` (key tile 0, the heaviest causal
        one, first); num_warps = 4 (the default partition is consumer warpgroup 0). K/V/dK/dV descriptors have
        64-row tiles (one warpgroup's half), Q/dO BLOCK_M-row tiles."""
        dtype: gl.constexpr = q_desc.dtype
        KH: gl.constexpr = k_desc.block_type.shape[0]
        gl.static_assert((2 * KH) % BLOCK_M == 0)
        pid_n, off_bkv = _tail_order(gl.program_id(0), T // (2 * KH), TAIL)
        Hkv = H // GROUP
        off_b = off_bkv // Hkv
        off_kvh = off_bkv % Hkv
        start_n = pid_n * (2 * KH)
        h0 = off_kvh * GROUP  # first query head of the group
        lse_row0 = (off_b * H + h0).to(gl.int64) * T
        if CAUSAL:
            mt0 = start_n // BLOCK_M  # query tiles above the key tile see none of it
        else:
            mt0 = 0
        n_m = T // BLOCK_M - mt0
        n_iter = GROUP * n_m

        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2, KH, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, KH, HEAD_DIM], v_desc.layout)
        ones_smem = k_smem  # a stand-in unless LSEMMA
        if LSEMMA:  # the lse (and DMMA: delta) column tiles in the ring, and the constant [KH, LSE_COLS] tile
            gl.static_assert(SMEM and PEEL and KH == BLOCK_M)
            LC: gl.constexpr = _LSE_COLS
            lse_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, LC], lse_desc.layout)  # (DMMA needs LSEMMA)
            ones_smem = gl.allocate_shared_memory(dtype, [KH, LC], lse_desc.layout)
            if DMMA:
                delta_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, LC], delta_desc.layout)
            else:
                delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], delta_desc.layout)
            ones_l: gl.constexpr = gl.BlockedLayout([1, LC], [32, 1], [4, 1], [1, 0])
            c = gl.arange(0, LC, layout=gl.SliceLayout(0, ones_l))
            one_row = gl.expand_dims((c < 3).to(gl.float32), 0)
            ones_smem.store((gl.zeros([KH, LC], gl.float32, ones_l) + one_row).to(dtype))
        elif SMEM:
            lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], lse_desc.layout)
            delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], delta_desc.layout)
        else:  # stand-ins that no partition reads
            lse_smem = q_smem
            delta_smem = q_smem
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        _ring_init(q_bars, q_empty, STAGES)
        _ring_init(do_bars, do_empty, STAGES)
        fence_async_shared()

        k_row, v_row, dk_row, dv_row = _kv_rows(
            off_b, off_kvh, start_n, k_rb, k_rh, v_rb, v_rh, dk_rb, dk_rh, dv_rb, dv_rh
        )
        # (the partitions' argument lists are spelled out: Gluon 3.6 cannot build tuples holding constexprs)
        gl.warp_specialize(
            [
                (
                    _dkdv_consumer,
                    (
                        q_smem,
                        do_smem,
                        k_smem,
                        v_smem,
                        lse_smem,
                        delta_smem,
                        kv_bar,
                        q_bars,
                        do_bars,
                        q_empty,
                        do_empty,
                        dk_desc,
                        dv_desc,
                        lse_ptr,
                        delta_ptr,
                        lse_row0,
                        T,
                        dk_row,
                        off_kvh * dk_ch,
                        dv_row,
                        off_kvh * dv_ch,
                        mt0,
                        n_m,
                        n_iter,
                        start_n,
                        qk_scale,
                        sm_scale,
                        dtype,
                        HEAD_DIM,
                        BLOCK_M,
                        STAGES,
                        CAUSAL,
                        0,
                        PF,
                        LEAN,
                        SMEM,
                        PEEL,
                        ones_smem,
                        LSEMMA,
                        DMMA,
                    ),
                ),
                (
                    _dkdv_consumer,
                    (
                        q_smem,
                        do_smem,
                        k_smem,
                        v_smem,
                        lse_smem,
                        delta_smem,
                        kv_bar,
                        q_bars,
                        do_bars,
                        q_empty,
                        do_empty,
                        dk_desc,
                        dv_desc,
                        lse_ptr,
                        delta_ptr,
                        lse_row0,
                        T,
                        dk_row,
                        off_kvh * dk_ch,
                        dv_row,
                        off_kvh * dv_ch,
                        mt0,
                        n_m,
                        n_iter,
                        start_n,
                        qk_scale,
                        sm_scale,
                        dtype,
                        HEAD_DIM,
                        BLOCK_M,
                        STAGES,
                        CAUSAL,
                        1,
                        PF,
                        LEAN,
                        SMEM,
                        PEEL,
                        ones_smem,
                        LSEMMA,
                        DMMA,
                    ),
                ),
                (
                    _dkdv_producer,
                    (
                        q_desc,
                        do_desc,
                        k_desc,
                        v_desc,
                        lse_desc,
                        delta_desc,
                        q_smem,
                        do_smem,
                        k_smem,
                        v_smem,
                        lse_smem,
                        delta_smem,
                        kv_bar,
                        q_bars,
                        do_bars,
                        q_empty,
                        do_empty,
                        k_row,
                        off_kvh * k_ch,
                        v_row,
                        off_kvh * v_ch,
                        off_b * q_rb,
                        q_rh,
                        q_ch,
                        off_b * do_rb,
                        do_rh,
                        do_ch,
                        h0,
                        mt0,
                        n_m,
                        n_iter,
                        T,
                        (off_b * H + h0) * (T // BLOCK_M) + mt0,
                        BLOCK_M,
                        STAGES,
                        LEAN,
                        SMEM,
                        LSEMMA,
                        DMMA,
                    ),
                ),
            ],
            [4, 1],
            [_CONSUMER_REGS, _PRODUCER_REGS],
        )  # worker_num_regs: required by Gluon 3.6

    # -----------------------------------------------------------------------------------------------------
    # dQ kernel
    # -----------------------------------------------------------------------------------------------------
    @gluon.jit
    def _dq_producer(
        q_desc,
        do_desc,
        k_desc,
        v_desc,
        q_smem,
        do_smem,
        k_smem,
        v_smem,
        q_bar,
        k_bars,
        v_bars,
        k_empty,
        v_empty,
        q_row,
        q_col,
        do_row,
        do_col,
        k_row0,
        k_col,
        v_row0,
        v_col,
        n_tiles,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        """The TMA warp: both halves of Q and dO once, then every K/V tile into the ring."""
        QH: gl.constexpr = q_desc.block_type.shape[0]
        mbarrier.expect(q_bar, 4 * q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row, q_col], q_bar, q_smem.index(0))
        _tma_load(q_desc, [q_row + QH, q_col], q_bar, q_smem.index(1))
        _tma_load(do_desc, [do_row, do_col], q_bar, do_smem.index(0))
        _tma_load(do_desc, [do_row + QH, do_col], q_bar, do_smem.index(1))
        for t in range(n_tiles):
            slot = t % STAGES
            phase = ((t // STAGES) & 1) ^ 1  # fresh barriers: the first lap passes
            mbarrier.wait(k_empty.index(slot), phase)
            mbarrier.expect(k_bars.index(slot), k_desc.block_type.nbytes)
            _tma_load(k_desc, [k_row0 + t * BLOCK_N, k_col], k_bars.index(slot), k_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), phase)
            mbarrier.expect(v_bars.index(slot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [v_row0 + t * BLOCK_N, v_col], v_bars.index(slot), v_smem.index(slot))

    @gluon.jit
    def _dq_issue_sdp(q_half, do_half, k_smem, v_smem, k_bars, v_bars, s_zero, j, STAGES: gl.constexpr):
        """Issue tile j's S = Q Kᵀ and dP = dO Vᵀ wgmmas (each once its tile has landed)."""
        slot = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_bars.index(slot), phase)
        s = warpgroup_mma(q_half, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_bars.index(slot), phase)
        dp = warpgroup_mma(do_half, v_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        return s, dp

    @gluon.jit
    def _dq_p(s, lse2, q_lo, offs_q, cols, start_n, qk_scale, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """P of a retired S tile, causal mask applied."""
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
        if CAUSAL:
            if start_n + BLOCK_N > q_lo + 1:  # some key of the tile follows some query of this half
                keep = gl.expand_dims(q_lo + offs_q, 1) >= gl.expand_dims(start_n + cols, 0)
                p = gl.where(keep, p, 0.0)
        return p

    @gluon.jit
    def _dq_loop_pipelined(
        q_half,
        do_half,
        k_smem,
        v_smem,
        k_bars,
        v_bars,
        k_empty,
        v_empty,
        lse2,
        delta,
        dq,
        s_zero,
        q_lo,
        offs_q,
        cols,
        n_tiles,
        qk_scale,
        dtype: gl.constexpr,
        op_layout: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
    ):
        """The dQ consumer's walk with tile j - 1's dQ wgmma issued behind tile j's S and dP, so it runs while S_j's
        exponentials and dS_j are computed (FlashAttention-3's intra-warpgroup overlap). K_{j-1}'s slot is
        released only when dQ_{j-1} retires, at the end of step j: give the ring at least 3 stages (the default
        has 4: 1-3 % faster than 3 on the H200)."""
        s, dp = _dq_issue_sdp(q_half, do_half, k_smem, v_smem, k_bars, v_bars, s_zero, 0, STAGES)
        s = warpgroup_mma_wait(1, deps=(s,))
        p = _dq_p(s, lse2, q_lo, offs_q, cols, 0, qk_scale, BLOCK_N, CAUSAL)
        dp = warpgroup_mma_wait(0, deps=(dp,))
        mbarrier.arrive(v_empty.index(0), count=1)
        ds_op = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), op_layout)
        for j in range(1, n_tiles):
            s, dp = _dq_issue_sdp(q_half, do_half, k_smem, v_smem, k_bars, v_bars, s_zero, j, STAGES)
            prev = (j - 1) % STAGES
            dq_tok = warpgroup_mma(ds_op, k_smem.index(prev), dq, is_async=True)
            s = warpgroup_mma_wait(2, deps=(s,))  # S_j retired; dP_j and dQ_{j-1} may run
            p = _dq_p(s, lse2, q_lo, offs_q, cols, j * BLOCK_N, qk_scale, BLOCK_N, CAUSAL)
            dp = warpgroup_mma_wait(1, deps=(dp,))
            mbarrier.arrive(v_empty.index(j % STAGES), count=1)
            ds_new = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), op_layout)
            dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
            mbarrier.arrive(k_empty.index(prev), count=1)
            ds_op = ds_new
        last = (n_tiles - 1) % STAGES
        dq_tok = warpgroup_mma(ds_op, k_smem.index(last), dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
        mbarrier.arrive(k_empty.index(last), count=1)
        return dq

    @gluon.jit
    def _dq_consumer(
        q_smem,
        do_smem,
        k_smem,
        v_smem,
        q_bar,
        k_bars,
        v_bars,
        k_empty,
        v_empty,
        dq_desc,
        lse_ptr,
        delta_ptr,
        lse_row,
        dq_row,
        dq_col,
        start_m,
        n_tiles,
        qk_scale,
        sm_scale,
        dtype: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        HALF: gl.constexpr,
        PIPE: gl.constexpr,
        SKIP: gl.constexpr = False,
        DOREG: gl.constexpr = False,
    ):
        """One warpgroup: query rows [start_m + HALF·64, +64), its Q/dO halves resident, walking the K/V ring
        (PIPE: ``_dq_loop_pipelined``). SKIP (causal): the tiles whose keys all follow this half's queries (P = 0)
        are only waited for and released, not computed (with BLOCK_N = 64: warpgroup 0's last tile)."""
        QH: gl.constexpr = dq_desc.block_type.shape[0]
        s_layout: gl.constexpr = _acc_layout(BLOCK_N)  # [QH, BLOCK_N] S, dP
        a_layout: gl.constexpr = _acc_layout(HEAD_DIM)  # [QH, HEAD_DIM] dQ
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
        q_half = q_smem.index(HALF)
        do_half = do_smem.index(HALF)
        q_lo = start_m + HALF * QH
        offs_q = gl.arange(0, QH, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        lse2 = gl.load(lse_ptr + lse_row + HALF * QH + offs_q)  # lse·log2(e)
        delta = gl.load(delta_ptr + lse_row + HALF * QH + offs_q)
        s_zero = gl.zeros([QH, BLOCK_N], gl.float32, s_layout)
        dq = gl.zeros([QH, HEAD_DIM], gl.float32, a_layout)
        mbarrier.wait(q_bar, 0)
        do_a = do_half
        if DOREG:  # the resident dO half as dP's A operand in registers (32 per thread), read from shared memory once
            do_a = do_half.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        n_all = n_tiles
        if SKIP and CAUSAL:
            # tiles starting at or after this half's last query + 1 (q_lo + QH) add nothing
            n_tiles = gl.minimum(n_tiles, (q_lo + QH + BLOCK_N - 1) // BLOCK_N)
        if PIPE:
            dq = _dq_loop_pipelined(
                q_half,
                do_a,
                k_smem,
                v_smem,
                k_bars,
                v_bars,
                k_empty,
                v_empty,
                lse2,
                delta,
                dq,
                s_zero,
                q_lo,
                offs_q,
                cols,
                n_tiles,
                qk_scale,
                dtype,
                op_layout,
                BLOCK_N,
                STAGES,
                CAUSAL,
            )
        else:
            for j in range(n_tiles):
                slot = j % STAGES
                k_t = k_smem.index(slot)
                s, dp = _dq_issue_sdp(q_half, do_a, k_smem, v_smem, k_bars, v_bars, s_zero, j, STAGES)
                s = warpgroup_mma_wait(1, deps=(s,))
                p = _dq_p(s, lse2, q_lo, offs_q, cols, j * BLOCK_N, qk_scale, BLOCK_N, CAUSAL)
                dp = warpgroup_mma_wait(0, deps=(dp,))
                mbarrier.arrive(v_empty.index(slot), count=1)
                ds = p * (dp - gl.expand_dims(delta, 1))
                ds_op = gl.convert_layout(ds.to(dtype), op_layout)
                dq_tok = warpgroup_mma(ds_op, k_t, dq, is_async=True)
                dq, ds_op = warpgroup_mma_wait(0, deps=(dq_tok, ds_op))
                mbarrier.arrive(k_empty.index(slot), count=1)
        for j in range(n_tiles, n_all):  # SKIP: the tiles past this half's queries, released unread
            slot = j % STAGES
            phase = (j // STAGES) & 1
            mbarrier.wait(k_bars.index(slot), phase)
            mbarrier.wait(v_bars.index(slot), phase)
            mbarrier.arrive(v_empty.index(slot), count=1)
            mbarrier.arrive(k_empty.index(slot), count=1)
        q_half.store((dq * sm_scale).to(dtype))  # through Q's dead half and a TMA store
        fence_async_shared()
        _cta_barrier()
        _tma_store(dq_desc, [dq_row + HALF * QH, dq_col], q_half)
        tma.store_wait(0)

    @gluon.jit
    def _bwd_dq_kernel(
        q_desc,
        do_desc,
        k_desc,
        v_desc,
        dq_desc,
        lse_ptr,
        delta_ptr,
        qk_scale,
        sm_scale,
        H,
        GROUP,
        T,
        q_rb,
        q_rh,
        q_ch,
        do_rb,
        do_rh,
        do_ch,
        k_rb,
        k_rh,
        k_ch,
        v_rb,
        v_rh,
        v_ch,
        dq_rb,
        dq_rh,
        dq_ch,
        TAIL,
        HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        PIPE: gl.constexpr = False,
        SKIP: gl.constexpr = False,
        DOREG: gl.constexpr = False,
    ):
        """Program (query tile, batch·head) of a 1-D grid in ``_tail_order``, heaviest causal tiles first;
        num_warps = 4. Q/dO/dQ descriptors have 64-row tiles (one warpgroup's half), K/V BLOCK_N-row tiles."""
        dtype: gl.constexpr = q_desc.dtype
        QH: gl.constexpr = q_desc.block_type.shape[0]
        gl.static_assert((2 * QH) % BLOCK_N == 0)
        pid_m, off_bh = _tail_order(gl.program_id(0), T // (2 * QH), TAIL)
        if CAUSAL:
            pid_m = T // (2 * QH) - 1 - pid_m
        off_b = off_bh // H
        off_h = off_bh % H
        off_hk = off_h // GROUP
        start_m = pid_m * (2 * QH)
        lse_row = off_bh.to(gl.int64) * T + start_m
        if CAUSAL:
            n_tiles = (start_m + 2 * QH) // BLOCK_N
        else:
            n_tiles = T // BLOCK_N

        q_smem = gl.allocate_shared_memory(dtype, [2, QH, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, QH, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        _ring_init(k_bars, k_empty, STAGES)
        _ring_init(v_bars, v_empty, STAGES)
        fence_async_shared()

        q_row = off_b * q_rb + off_h * q_rh + start_m
        do_row = off_b * do_rb + off_h * do_rh + start_m
        dq_row = off_b * dq_rb + off_h * dq_rh + start_m
        gl.warp_specialize(
            [
                (
                    _dq_consumer,
                    (
                        q_smem,
                        do_smem,
                        k_smem,
                        v_smem,
                        q_bar,
                        k_bars,
                        v_bars,
                        k_empty,
                        v_empty,
                        dq_desc,
                        lse_ptr,
                        delta_ptr,
                        lse_row,
                        dq_row,
                        off_h * dq_ch,
                        start_m,
                        n_tiles,
                        qk_scale,
                        sm_scale,
                        dtype,
                        HEAD_DIM,
                        BLOCK_N,
                        STAGES,
                        CAUSAL,
                        0,
                        PIPE,
                        SKIP,
                        DOREG,
                    ),
                ),
                (
                    _dq_consumer,
                    (
                        q_smem,
                        do_smem,
                        k_smem,
                        v_smem,
                        q_bar,
                        k_bars,
                        v_bars,
                        k_empty,
                        v_empty,
                        dq_desc,
                        lse_ptr,
                        delta_ptr,
                        lse_row,
                        dq_row,
                        off_h * dq_ch,
                        start_m,
                        n_tiles,
                        qk_scale,
                        sm_scale,
                        dtype,
                        HEAD_DIM,
                        BLOCK_N,
                        STAGES,
                        CAUSAL,
                        1,
                        PIPE,
                        SKIP,
                        DOREG,
                    ),
                ),
                (
                    _dq_producer,
                    (
                        q_desc,
                        do_desc,
                        k_desc,
                        v_desc,
                        q_smem,
                        do_smem,
                        k_smem,
                        v_smem,
                        q_bar,
                        k_bars,
                        v_bars,
                        k_empty,
                        v_empty,
                        q_row,
                        off_h * q_ch,
                        do_row,
                        off_h * do_ch,
                        off_b * k_rb + off_hk * k_rh,
                        off_hk * k_ch,
                        off_b * v_rb + off_hk * v_rh,
                        off_hk * v_ch,
                        n_tiles,
                        BLOCK_N,
                        STAGES,
                    ),
                ),
            ],
            [4, 1],
            [_CONSUMER_REGS, _PRODUCER_REGS],
        )


# ---------------------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------------------
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


def _config(op: str, config, D: int):
    """(BLOCK_M1, STAGES1, BLOCK_N2, STAGES2, OPTS) of a config name or tuple (OPTS, a mask of ``OPT_PF``,
    ``OPT_DQP``, ``OPT_LEAN``, ``OPT_SMEM``, ``OPT_PEEL`` and ``OPT_DQSKIP``, may be left out: 0)."""
    if config is None:
        config = DEFAULT
    if isinstance(config, str):
        if config not in CONFIGS:
            raise ValueError(f"{op}: unknown config {config!r}, have {sorted(CONFIGS)}")
        config = CONFIGS[config][D]
    try:
        vals = tuple(int(c) for c in config)
        if len(vals) not in (4, 5):
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(
            f"{op}: config must be a name in {sorted(CONFIGS)} or (BLOCK_M1, STAGES1, BLOCK_N2, "
            f"STAGES2[, OPTS]), got {config!r}"
        ) from None
    bm1, st1, bn2, st2, opts = vals + (0,) * (5 - len(vals))
    if (
        bm1 not in (64, 128)
        or bn2 not in (64, 128)
        or not (1 <= st1 <= 4 and 1 <= st2 <= 4)
        or not 0 <= opts <= 511
        or (opts & OPT_LEAN and not opts & (OPT_PF | OPT_SMEM))
        or (opts & OPT_LSEMMA and not opts & OPT_PEEL)
        or (opts & OPT_DMMA and not opts & OPT_LSEMMA)
        or (opts & OPT_SMEM and (opts & OPT_PF or not opts & OPT_LEAN))
        or (opts & OPT_PEEL and (not opts & OPT_SMEM or bm1 != 64))
    ):
        raise ValueError(
            f"{op}: config needs BLOCK_M1, BLOCK_N2 in (64, 128), 1-4 stages and options 0-511 "
            f"(OPT_LEAN with OPT_PF or OPT_SMEM; OPT_SMEM with OPT_LEAN, without OPT_PF; OPT_PEEL "
            f"with OPT_SMEM and BLOCK_M1 64, the only step measured; OPT_LSEMMA with OPT_PEEL; OPT_DMMA "
            f"with OPT_LSEMMA), got {config!r}"
        )
    return bm1, st1, bn2, st2, opts


def for_dtype(cfg: tuple, dtype: torch.dtype) -> tuple:
    """The config tuple as it runs for inputs of ``dtype``: the column options (``OPT_LSEMMA``, ``OPT_DMMA``) only for
    bf16, whose exponent range holds any fp32 lse / scale and delta; fp16's does not (|delta| over 65504 would turn
    the columns to inf where the shared-memory rows keep fp32), and the columns were measured in bf16 only."""
    if dtype == torch.bfloat16:
        return cfg
    return cfg[:4] + (cfg[4] & ~(OPT_LSEMMA | OPT_DMMA),)


def _grad_buf(op: str, name: str, buf, like: torch.Tensor):
    """A caller's output buffer (tests pass NaN-poisoned ones) in a layout the descriptors take, or a fresh
    contiguous one (as flash_attention_bwd_triton returns)."""
    if buf is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if not _buf_ok(buf, like):
        raise ValueError(
            f"{op}: {name} buffer must be {tuple(like.shape)} {like.dtype} on {like.device}, "
            f"contiguous or [B, T, H, D]-transposed, got "
            f"{FA._shapes(buf) + f' strides {buf.stride()}' if torch.is_tensor(buf) else type(buf)}"
        )
    return buf


def _launches(q, k, v, dq, dk, dv, do, lse, delta, s: float, causal: bool, cfg, cols=None):
    """[(kernel, grid, args, constexprs)] of the dK/dV and the dQ kernel of config tuple ``cfg`` (``_config``);
    CUDA tensors, or CPU tensors standing in for shapes and strides (``compile_sm90``). ``cols``: OPT_LSEMMA's
    (lse, delta) column buffers (``new_columns``) as the preprocess wrote them (``_prologue(cols=...)``)."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    bm1, st1, bn2, st2, opts = cfg
    (q2, *q_c), (do2, *do_c), (k2, *k_c), (v2, *v_c) = (_row_view(x) for x in (q, do, k, v))
    (dq2, *dq_c), (dk2, *dk_c), (dv2, *dv_c) = (_row_view(x) for x in (dq, dk, dv))
    common = dict(lse_ptr=lse, delta_ptr=delta, qk_scale=s * LOG2E, sm_scale=s, H=H, GROUP=H // Hkv, T=T)
    coords = {}
    for name, c in (("q", q_c), ("do", do_c), ("k", k_c), ("v", v_c)):
        coords.update({f"{name}_rb": c[0], f"{name}_rh": c[1], f"{name}_ch": c[2]})
    # lse and delta as [B·H·T / BLOCK_M1, BLOCK_M1] rows for the SMEM option's TMA loads (passed in any case)
    (lse2, *_), (delta2, *_) = (_row_view(x.view(B, H, T // bm1, bm1)) for x in (lse, delta))
    if opts & OPT_LSEMMA:  # -lse·log2(e) / qk_scale and -delta as columns of a k16 slice, [B·H·T, LSE_COLS]
        lse_d = _desc(cols[0].view(B * H * T, LSE_COLS), bm1, LSE_COLS)
    else:
        lse_d = _desc(lse2, 1, bm1)
    if opts & OPT_DMMA:
        delta_d = _desc(cols[1].view(B * H * T, LSE_COLS), bm1, LSE_COLS)
    else:
        delta_d = _desc(delta2, 1, bm1)
    dkdv = dict(
        q_desc=_desc(q2, bm1, D),
        do_desc=_desc(do2, bm1, D),
        k_desc=_desc(k2, HALF_M, D),
        lse_desc=lse_d,
        delta_desc=delta_d,
        v_desc=_desc(v2, HALF_M, D),
        dk_desc=_desc(dk2, HALF_M, D),
        dv_desc=_desc(dv2, HALF_M, D),
        **common,
        **coords,
        dk_rb=dk_c[0],
        dk_rh=dk_c[1],
        dk_ch=dk_c[2],
        dv_rb=dv_c[0],
        dv_rh=dv_c[1],
        dv_ch=dv_c[2],
    )
    dqa = dict(
        q_desc=_desc(q2, HALF_M, D),
        do_desc=_desc(do2, HALF_M, D),
        k_desc=_desc(k2, bn2, D),
        v_desc=_desc(v2, bn2, D),
        dq_desc=_desc(dq2, HALF_M, D),
        **common,
        **coords,
        dq_rb=dq_c[0],
        dq_rh=dq_c[1],
        dq_ch=dq_c[2],
    )
    c1 = dict(
        HEAD_DIM=D,
        BLOCK_M=bm1,
        STAGES=st1,
        CAUSAL=bool(causal),
        PF=bool(opts & OPT_PF),
        LEAN=bool(opts & OPT_LEAN),
        SMEM=bool(opts & OPT_SMEM),
        PEEL=bool(opts & OPT_PEEL),
        LSEMMA=bool(opts & OPT_LSEMMA),
        DMMA=bool(opts & OPT_DMMA),
    )
    c2 = dict(
        HEAD_DIM=D,
        BLOCK_N=bn2,
        STAGES=st2,
        CAUSAL=bool(causal),
        PIPE=bool(opts & OPT_DQP),
        SKIP=bool(opts & OPT_DQSKIP),
        DOREG=bool(opts & OPT_DOREG),
    )
    nb = T // RESIDENT
    n_sm = FA.grid_sms(q.device)
    dkdv["TAIL"], dqa["TAIL"] = tail_heads(nb, B * Hkv, n_sm), tail_heads(nb, B * H, n_sm)
    return [(_bwd_dkdv_kernel, (nb * B * Hkv,), dkdv, c1), (_bwd_dq_kernel, (nb * B * H,), dqa, c2)]


def tail_order(pid: int, nb: int, n_heads: int, tail: int) -> tuple:
    """The host-side mirror of the kernels' ``_tail_order`` (tests/test_flash_gluon_bwd.py checks it is a
    permutation that starts the last ``tail`` heads' tiles tile-major): (tile, head) of linear program pid."""
    first = (n_heads - tail) * nb
    if pid < first:
        return pid % nb, pid // nb
    return (pid - first) // tail, n_heads - tail + (pid - first) % tail


def tail_heads(nb: int, heads: int, n_sm: int) -> int:
    """How many of the last heads of a grid of nb tiles x heads start tile-major (``_tail_order``): enough for
    ``TAIL_WAVES`` waves of n_sm programs, at most all of them."""
    return FA.tail_heads(nb, heads, n_sm, TAIL_WAVES)


def check_inputs(op: str, supported, head_dims, do, q, k, v, o, lse) -> None:
    """The backward's input check: the contract (``FA._check_bwd``), then ``supported`` (the Gluon backward's own
    predicate); a ValueError naming ``op`` otherwise."""
    FA._check_bwd(op, do, q, k, v, o, lse)
    if not supported(do, q, k, v, o, lse):
        raise ValueError(
            f"{op}: needs bf16/fp16 q, k, v on an sm_90 GPU with Gluon, D in {head_dims}, T a "
            f"multiple of {RESIDENT}, q/k/v/do contiguous or [B, T, H, D]-transposed (16-byte "
            f"aligned), o with unit last stride; got do/q/k/v/o/lse {FA._shapes(do, q, k, v, o, lse)}, "
            f"strides q {q.stride()} k {k.stride()} v {v.stride()} do {do.stride()} o {o.stride()}"
        )


def _prologue(
    op: str,
    supported,
    head_dims,
    do,
    q,
    k,
    v,
    o,
    lse,
    scale,
    dq,
    dk,
    dv,
    checked: bool = False,
    plan: bool = False,
    base2: bool = False,
    cols=None,
):
    """What both Gluon backwards do before their kernels: check the inputs (``supported``: the backward's own
    predicate; a ValueError naming ``op`` otherwise; skipped when ``checked``: the caller has just run both
    checks, as flash_attention_bwd_triton's route does), the scale, the output buffers (``_grad_buf``), then
    the delta preprocess. Returns (do in q's dtype, lse fp32 contiguous, dq, dk, dv, delta, scale, the
    preprocess as a ``CachedLaunch`` if ``plan``, else None). ``base2`` (the split's kernels): the returned lse
    is a new buffer, lse·log2(e), written by the preprocess beside delta (session 13: the dK/dV kernel's TMA
    rows then need no multiply between their shared-memory load and the exponentials). ``cols`` (with base2): the
    (lse, delta) column buffers of ``OPT_LSEMMA`` ([B, H, T, LSE_COLS] in q's dtype, ``new_columns``) for the
    preprocess to fill as well."""
    if not checked:
        check_inputs(op, supported, head_dims, do, q, k, v, o, lse)
    B, H, T, D = q.shape
    s = FA._scale(op, scale, D)
    do = do.to(q.dtype)  # a dense tensor keeps its strides (its layout was checked above)
    lse = lse.to(torch.float32).contiguous()
    dq = _grad_buf(op, "dq", dq, q)
    dk = _grad_buf(op, "dk", dk, k)
    dv = _grad_buf(op, "dv", dv, v)
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta) if base2 else delta
    PRE_M = 64
    # LSE / LSE2 are read and written only with SCALE_LSE; otherwise delta stands in for both
    lsec, deltac = cols if cols is not None else (delta, delta)  # stand-ins the preprocess does not touch
    pre_args = dict(
        O=o,
        DO=do,
        DELTA=delta,
        LSE=lse if base2 else delta,
        LSE2=lse2,
        LSEC=lsec,
        DELTAC=deltac,
        INV_SCALE=1.0 / s,
        SCALE_LSE=base2,
        COLS=LSE_COLS if cols is not None else 0,
        stride_ob=o.stride(0),
        stride_oh=o.stride(1),
        stride_ot=o.stride(2),
        stride_dob=do.stride(0),
        stride_doh=do.stride(1),
        stride_dot=do.stride(2),
        H=H,
        T=T,
        HEAD_DIM=D,
        BLOCK_M=PRE_M,
    )
    grid = (triton.cdiv(T, PRE_M), B * H)
    out = lse2 if base2 else lse
    if plan:
        return do, out, dq, dk, dv, delta, s, launch_cached(FA._flash_bwd_preprocess_kernel, grid, pre_args)
    FA._flash_bwd_preprocess_kernel[grid](**pre_args)
    return do, out, dq, dk, dv, delta, s, None


def plan_outputs(pre, do, q, k, v, o, lse=None, opts: int = 0):
    """What both backward plans do first: allocate dq, dk, dv (contiguous, as the full path's ``_grad_buf``)
    and delta, and launch the cached delta preprocess ``pre``. Returns (dq, dk, dv, delta, lse2, cols): with ``lse``
    (a plan made with ``_prologue(base2=True)``) lse2 is the lse·log2(e) buffer the preprocess writes from it, else
    None; with ``OPT_LSEMMA`` in ``opts`` (a plan made with ``_prologue(cols=...)``) cols is the (lse, delta) column
    buffers it fills, else None."""
    B, H, T, _ = q.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    if lse is None:  # (as _prologue without base2: LSE, LSE2, LSEC, DELTAC not touched)
        pre(O=o, DO=do, DELTA=delta, LSE=delta, LSE2=delta, LSEC=delta, DELTAC=delta)
        return dq, dk, dv, delta, None, None
    lse2 = torch.empty_like(delta)
    c = new_columns(q, opts)
    lsec, deltac = c or (delta, delta)
    pre(O=o, DO=do, DELTA=delta, LSE=lse.to(torch.float32).contiguous(), LSE2=lse2, LSEC=lsec, DELTAC=deltac)
    return dq, dk, dv, delta, lse2, c


def new_columns(q: torch.Tensor, opts: int) -> tuple | None:
    """Empty (lse, delta) column buffers for q [B, H, T, D], [B, H, T, LSE_COLS] in q's dtype, if the config options
    ``opts`` have ``OPT_LSEMMA``; else None."""
    if not opts & OPT_LSEMMA:
        return None
    B, H, T, _ = q.shape
    return tuple(torch.empty((B, H, T, LSE_COLS), dtype=q.dtype, device=q.device) for _ in range(2))


class _SplitPlan:
    """``flash_attention_bwd_gluon`` for one signature of inputs with its host work done once (see
    ``flash_attention_gluon._FwdPlan``): allocates dq, dk, dv and delta, then launches the compiled delta
    preprocess and the two kernels (on two streams as the full path does) with re-based descriptors."""

    __slots__ = ("pre", "dkdv", "dq", "dkdv_descs", "dq_descs", "two_streams", "bm1", "opts")

    def __init__(self, pre, dkdv, dq, a1: dict, a2: dict, two_streams: bool, opts: int = 0):
        self.pre, self.dkdv, self.dq = pre, dkdv, dq
        self.dkdv_descs, self.dq_descs = descriptor_templates(a1), descriptor_templates(a2)
        self.two_streams = two_streams
        self.opts = opts  # OPT_LSEMMA (OPT_DMMA) puts lse's (delta's) descriptor on a column buffer
        self.bm1 = a1["q_desc"].block_shape[0]  # the dK/dV kernel's query step: lse / delta rows per TMA tile

    def __call__(self, do, q, k, v, o, lse):
        dq, dk, dv, delta, lse, c = plan_outputs(self.pre, do, q, k, v, o, lse, self.opts)  # lse·log2(e)
        B, H, T, _ = q.shape
        ts = {
            "q": q,
            "do": do,
            "k": k,
            "v": v,
            "dq": dq,
            "dk": dk,
            "dv": dv,
            "lse": lse.view(B, H, T // self.bm1, self.bm1),
            "delta": delta.view(B, H, T // self.bm1, self.bm1),
        }
        if self.opts & OPT_LSEMMA:
            ts["lse"] = c[0]
        if self.opts & OPT_DMMA:
            ts["delta"] = c[1]

        def launch_dkdv():
            self.dkdv(lse_ptr=lse, delta_ptr=delta, **rebase_all(self.dkdv_descs, ts))

        def launch_dq():
            self.dq(lse_ptr=lse, delta_ptr=delta, **rebase_all(self.dq_descs, ts))

        if self.two_streams:
            run_side_by_side(q.device, launch_dkdv, launch_dq)
        else:
            launch_dkdv()
            launch_dq()
        return dq, dk, dv


def stand_ins(D: int, T: int, H: int, Hkv: int, transposed: bool):
    """CPU bf16 tensors standing in for q [1, H, T, D] and k [1, Hkv, T, D] (the offline compiles): contiguous,
    or [B, T, Hx, D] memory seen through a transpose."""

    def mk(h):
        if transposed:
            return torch.empty(1, T, h, D, dtype=torch.bfloat16).transpose(1, 2)
        return torch.empty(1, h, T, D, dtype=torch.bfloat16)

    return mk(H), mk(Hkv)


def flash_attention_bwd_gluon(
    do,
    q,
    k,
    v,
    o,
    lse,
    causal: bool = True,
    scale: float | None = None,
    *,
    dq=None,
    dk=None,
    dv=None,
    config=None,
    checked: bool = False,
    plan: bool = False,
):
    """Launch the delta preprocess, then the dK/dV and dQ Gluon kernels on two streams. Returns (dq, dk, dv).
    ``dq``/``dk``/``dv``: optional output buffers (contiguous or [B, T, H, D]-transposed); ``config``: a name
    in ``CONFIGS`` or (BLOCK_M1, STAGES1, BLOCK_N2, STAGES2), overriding the per-head-dim default. ``checked``:
    the caller has just checked the inputs and ``supported_bwd`` (``_prologue``). ``plan``: also return a
    ``_SplitPlan`` that repeats these launches for inputs of the same signature (dq, dk, dv left to this
    function)."""
    op = "flash_attention_bwd_gluon"
    if plan and (dq is not None or dk is not None or dv is not None):
        raise ValueError(f"{op}: plan=True allocates dq, dk, dv itself; got buffers")
    if not checked:
        check_inputs(op, supported_bwd, HEAD_DIMS, do, q, k, v, o, lse)
    cfg = for_dtype(_config(op, config, q.shape[-1]), q.dtype)
    # OPT_LSEMMA: the preprocess also writes the lse / delta columns the dK/dV kernel multiplies
    cols = new_columns(q, cfg[4])
    do, lse, dq, dk, dv, delta, s, pre = _prologue(
        op, supported_bwd, HEAD_DIMS, do, q, k, v, o, lse, scale, dq, dk, dv, True, plan, base2=True, cols=cols
    )
    (k1, g1, a1, c1), (k2, g2, a2, c2) = _launches(q, k, v, dq, dk, dv, do, lse, delta, s, bool(causal), cfg, cols)
    cached = {}

    def launch_dkdv():
        if plan:
            cached["dkdv"] = launch_cached(k1, g1, {**a1, **c1}, num_warps=4)
        else:
            k1[g1](**a1, **c1, num_warps=4)

    def launch_dq():
        if plan:
            cached["dq"] = launch_cached(k2, g2, {**a2, **c2}, num_warps=4)
        else:
            k2[g2](**a2, **c2, num_warps=4)

    two_streams = FA.BWD_TWO_STREAMS  # as flash_attention_bwd_triton: dQ on the side stream, joined before returning
    if two_streams:
        run_side_by_side(q.device, launch_dkdv, launch_dq)
    else:
        launch_dkdv()
        launch_dq()
    if plan:
        return dq, dk, dv, _SplitPlan(pre, cached["dkdv"], cached["dq"], a1, a2, two_streams, cfg[4])
    return dq, dk, dv


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


def compile_sm90(
    D: int = 128, causal: bool = True, config=None, transposed: bool = False, T: int = 256, mha: bool = False
):
    """Compile both kernels for sm_90 without a GPU (CPU tensors stand in for the descriptors' shapes): the CI
    check that a Triton upgrade has not broken them. ``transposed``: q, do, k, v, dk, dv as [B, T, Hx, D]
    seen through a transpose (dq contiguous). GQA (4 query heads on 2 K/V heads) unless ``mha``: then GROUP = 1
    is compiled in as a constant, as Triton's launcher specialises an argument equal to 1 (the bench's build;
    session 15 saw the two differ from clean to every wgmma serialised). Returns {"dkdv": CompiledKernel, "dq":
    CompiledKernel}."""
    cfg = _config("compile_sm90", config, D)
    q, k = stand_ins(D, T, 4, 4 if mha else 2, transposed)
    dq = torch.empty(1, 4, T, D, dtype=torch.bfloat16)
    lse = torch.empty(1, 4, T)
    launches = _launches(q, k, k, dq, k, k, q, lse, lse, 0.125, causal, cfg, new_columns(q, cfg[4]))
    return {
        name: _compile(kern, args, dict(consts, GROUP=1) if mha else consts)
        for name, (kern, _, args, consts) in zip(("dkdv", "dq"), launches)
    }
