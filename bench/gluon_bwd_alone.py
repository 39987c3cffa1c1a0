"""Each kernel of the hd128 Gluon two-kernel backward timed alone, against both together and cuDNN's backward.

    PYTHONPATH=. python3 bench/gluon_bwd_alone.py [--seqs 2048,8192,16384] [--head-dims 128] [--configs split]
        [--group 4]   # GQA: 4 query heads per K/V head (the model's layout; cuDNN gets the K/V heads repeated)

Causal (or, with --noncausal, not) bf16, B·T = 16k, H·D = 2048 (the bench shapes). Per kernel: GPU time
(``bench/_gpu.py``, host kept ahead, median) and its real tensor work in TFLOP/s — the dK/dV kernel does 4
products of 2·B·H·T²·D FLOPs each (halved when causal: Sᵀ, dPᵀ, dV, dK), the dQ kernel 3 (S, dP, dQ) — so
the two can be compared per product; the whole backward (two streams, as the library runs it, and one) as
nominal TFLOP/s (2.5 x the forward's FLOPs, as ``xtrain bench attention``) and as a ratio to cuDNN's. Tells
which of the two kernels is further from the tensor cores' peak.
"""

from __future__ import annotations

import argparse

_REPORTED: set = set()


def config_arg(text: str | None):
    """A command line's Gluon backward config: a name in ``flash_attention_gluon_bwd.CONFIGS`` as it is, or a tuple
    written with colons (64:2:64:4:510 = (BLOCK_M1, STAGES1, BLOCK_N2, STAGES2, OPTS)); None stays None."""
    return tuple(int(x) for x in text.split(":")) if text and ":" in text else text


def split_kernels(q, k, v, do, o, lse, causal: bool = True, config=None) -> tuple:
    """(dK/dV launch, dQ launch): the Gluon split's two kernels as calls, each launching one kernel alone (the
    delta preprocess and the output buffers done once here); a call returns the compiled kernel."""
    from xtrain.kernels import flash_attention_gluon_bwd as GB

    cfg = GB.for_dtype(GB._config("probe", config, q.shape[-1]), q.dtype)
    cols = GB.new_columns(q, cfg[4])  # the preprocess fills them, as the library's does
    dob, lse32, dq, dk, dv, delta, s, _ = GB._prologue(
        "probe", GB.supported_bwd, GB.HEAD_DIMS, do, q, k, v, o, lse, None, None, None, None, base2=True, cols=cols
    )
    (k1, g1, a1, c1), (k2, g2, a2, c2) = GB._launches(q, k, v, dq, dk, dv, dob, lse32, delta, s, causal, cfg, cols)
    return lambda: k1[g1](**a1, **c1, num_warps=4), lambda: k2[g2](**a2, **c2, num_warps=4)


def measure(D: int, T: int, config: str, causal: bool = True, group: int = 1) -> tuple:
    """(config, D, T, dK/dV ms, its TFLOP/s, dQ ms, its TFLOP/s, both ms, nominal TFLOP/s, cuDNN ms, its nominal)."""
    from bench import isolated
    from bench._gpu import gpu_time
    from xtrain.kernels import flash_attention as FA
    from xtrain.kernels import flash_attention_gluon_bwd as GB

    B, H = 16384 // T, 2048 // D
    q, k, v, do = isolated.bench_inputs(D, T)
    k_mha, v_mha = k, v
    if group > 1:  # GQA: the first H / group K/V heads, each read by `group` query heads (cuDNN: the same repeated)
        k, v = k[:, : H // group].contiguous(), v[:, : H // group].contiguous()
        k_mha, v_mha = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    o, lse = FA.flash_attention_fwd_triton(q, k, v, causal=causal)
    dkdv, dq = split_kernels(q, k, v, do, o, lse, causal, config)
    ck = dkdv()
    if (config, D) not in _REPORTED:  # spills and wgmma serialisation of the dK/dV kernel, from its SASS
        from bench.gluon_flash_bwd_onepass import ptxas_report

        _REPORTED.add((config, D))
        print(f"# dK/dV kernel {config} D={D} causal={causal}: {ptxas_report(ck)}", flush=True)
    t_kv = gpu_time(dkdv)["ms"]
    t_dq = gpu_time(dq)["ms"]
    t_all = gpu_time(lambda: GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, causal=causal, config=config))["ms"]
    FA.BWD_TWO_STREAMS, two = False, FA.BWD_TWO_STREAMS
    try:  # the same on one stream: the dK/dV kernel, then the dQ kernel
        t_one = gpu_time(lambda: GB.flash_attention_bwd_gluon(do, q, k, v, o, lse, causal=causal, config=config))["ms"]
    finally:
        FA.BWD_TWO_STREAMS = two
    t_cu = gpu_time(isolated.cudnn_bwd(q, k_mha, v_mha, do, causal))["ms"]
    prod = B * H * T * T * D * (1 if causal else 2)  # one product: 2·B·H·T²·D FLOPs, halved when causal
    fwd = 2 * prod
    return (
        config,
        D,
        T,
        t_kv,
        4 * prod / t_kv / 1e9,
        t_dq,
        3 * prod / t_dq / 1e9,
        t_all,
        2.5 * fwd / t_all / 1e9,
        t_one,
        2.5 * fwd / t_one / 1e9,
        t_cu,
        2.5 * fwd / t_cu / 1e9,
    )


def main() -> int:
    from bench._gpu import warm_up

    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="2048,8192,16384")
    ap.add_argument("--head-dims", default="128")
    ap.add_argument("--noncausal", action="store_true", help="non-causal attention (default causal)")
    ap.add_argument(
        "--configs",
        default="split",
        help="names in flash_attention_gluon_bwd.CONFIGS, or tuples "
        "written with colons (64:3:64:4:14 = (BLOCK_M1, STAGES1, BLOCK_N2, STAGES2, OPTS))",
    )
    ap.add_argument(
        "--group", type=int, default=1, help="query heads per K/V head (GQA; cuDNN runs the K/V heads repeated)"
    )
    ap.add_argument("--tail-waves", default="2", help="values of flash_attention_gluon_bwd.TAIL_WAVES to compare")
    ap.add_argument(
        "--consumer-regs",
        type=int,
        default=None,
        help="setmaxnreg of the second consumer warpgroup of both kernels (the library's: "
        "flash_attention_gluon.CONSUMER_REGS); set before anything compiles",
    )
    a = ap.parse_args()
    if a.consumer_regs is not None:
        from xtrain.kernels import flash_attention_gluon as G
        from xtrain.kernels import flash_attention_gluon_bwd as GB

        GB._CONSUMER_REGS = G.gl.constexpr(a.consumer_regs)  # the kernels read the module global at compile time
    warm_up()
    from xtrain.kernels import flash_attention_gluon_bwd as GB

    rows = []
    for D in a.head_dims.split(","):
        for T in a.seqs.split(","):
            for c in a.configs.split(","):
                for w in a.tail_waves.split(","):
                    GB.TAIL_WAVES = int(w)  # a launch argument: no recompilation
                    cfg = config_arg(c)
                    r = measure(int(D), int(T), cfg, not a.noncausal, a.group)
                    rows.append((f"{c}/t{w}",) + r[1:])
    print(
        f"{'config':>12} {'D':>4} {'T':>6} | {'dK/dV ms':>8} {'TF/s':>5} | {'dQ ms':>7} {'TF/s':>5} | "
        f"{'2 streams':>9} {'nominal':>7} | {'1 stream':>8} {'nominal':>7} | {'cuDNN ms':>8} {'nominal':>7} | "
        "ratio 2 / 1 stream"
    )
    for c, D, T, tk, fk, tq, fq, ta, fa, t1, f1, tc, fc in rows:
        print(
            f"{c:>12} {D:>4} {T:>6} | {tk:8.3f} {fk:5.0f} | {tq:7.3f} {fq:5.0f} | {ta:9.3f} {fa:7.0f} | {t1:8.3f} "
            f"{f1:7.0f} | {tc:8.3f} {fc:7.0f} | {fa / fc:.2f} / {f1 / fc:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
