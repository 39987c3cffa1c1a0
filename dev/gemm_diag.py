"""Probe: the training step's GEMMs at gpt2-small's and seed's shapes (N = B*T rows), each as the trainer issues it
today and as it would be with q/k/v and gate/up merged into one product. CUDA events, warm-up, median of 30.
Run: PYTHONPATH=. python3 dev/gemm_diag.py"""

import statistics

import torch


def timed(fn, reps=30, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    return statistics.median(ts)


def shape_rows(name, N, C, HD, KVD, F, rows):
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, dtype=bf, generator=g) * 0.02
    h = r(N, C)
    wq, wk, wv, wqkv = r(HD, C), r(KVD, C), r(KVD, C), r(HD + 2 * KVD, C)
    wg, wu, wgu, wd = r(F, C), r(F, C), r(2 * F, C), r(C, F)
    dq, dk, dv, dqkv = r(N, HD), r(N, KVD), r(N, KVD), r(N, HD + 2 * KVD)
    dg, du, dgu, dy, s = r(N, F), r(N, F), r(N, 2 * F), r(N, C), r(N, F)
    acc = r(N, C)
    f32 = torch.float32

    def fl(*mnk):
        return 2 * mnk[0] * mnk[1] * mnk[2]

    cases = [
        ("fwd qkv: 3 mm", lambda: [torch.mm(h, w.t()) for w in (wq, wk, wv)], fl(N, HD + 2 * KVD, C)),
        ("fwd qkv: 1 mm", lambda: torch.mm(h, wqkv.t()), fl(N, HD + 2 * KVD, C)),
        ("fwd o", lambda: torch.mm(dq, wq), fl(N, C, HD)),
        ("fwd gate/up: 2 mm", lambda: [torch.mm(h, w.t()) for w in (wg, wu)], fl(N, 2 * F, C)),
        ("fwd gate/up: 1 mm", lambda: torch.mm(h, wgu.t()), fl(N, 2 * F, C)),
        ("fwd down", lambda: torch.mm(s, wd.t()), fl(N, C, F)),
        (
            "dgrad qkv: mm+2 addmm",
            lambda: torch.addmm(torch.addmm(torch.addmm(acc, dq, wq), dk, wk), dv, wv),
            fl(N, C, HD + 2 * KVD),
        ),
        ("dgrad qkv: 1 addmm", lambda: torch.addmm(acc, dqkv, wqkv), fl(N, C, HD + 2 * KVD)),
        ("dgrad gate/up: mm+addmm_", lambda: torch.mm(dg, wg).addmm_(du, wu), fl(N, C, 2 * F)),
        ("dgrad gate/up: 1 mm", lambda: torch.mm(dgu, wgu), fl(N, C, 2 * F)),
        ("dgrad down", lambda: torch.mm(dy, wd), fl(N, F, C)),
        ("wgrad q fp32-out", lambda: torch.mm(dq.t(), h, out_dtype=f32), fl(HD, C, N)),
        ("wgrad q bf16 + cast", lambda: torch.mm(dq.t(), h).float(), fl(HD, C, N)),
        ("wgrad q bf16", lambda: torch.mm(dq.t(), h), fl(HD, C, N)),
        (
            "wgrad q,k,v fp32-out x3",
            lambda: [torch.mm(d.t(), h, out_dtype=f32) for d in (dq, dk, dv)],
            fl(HD + 2 * KVD, C, N),
        ),
        ("wgrad qkv fp32-out x1", lambda: torch.mm(dqkv.t(), h, out_dtype=f32), fl(HD + 2 * KVD, C, N)),
        ("wgrad qkv bf16 x1 + cast", lambda: torch.mm(dqkv.t(), h).float(), fl(HD + 2 * KVD, C, N)),
        (
            "wgrad gate,up fp32-out x2",
            lambda: [torch.mm(d.t(), h, out_dtype=f32) for d in (dg, du)],
            fl(2 * F, C, N),
        ),
        ("wgrad gate/up fp32-out x1", lambda: torch.mm(dgu.t(), h, out_dtype=f32), fl(2 * F, C, N)),
        ("wgrad gate/up bf16 x1 + cast", lambda: torch.mm(dgu.t(), h).float(), fl(2 * F, C, N)),
        ("wgrad down fp32-out", lambda: torch.mm(dy.t(), s, out_dtype=f32), fl(C, F, N)),
        ("wgrad down bf16 + cast", lambda: torch.mm(dy.t(), s).float(), fl(C, F, N)),
        ("wgrad o fp32-out", lambda: torch.mm(dy.t(), dq, out_dtype=f32), fl(C, HD, N)),
    ]
    for label, fn, flops in cases:
        try:
            us = timed(fn)
        except (RuntimeError, TypeError) as e:  # an out_dtype this torch lacks
            print(f"{name} {label}: {type(e).__name__} {e}")
            continue
        rows.append((name, label, us, flops / us / 1e6))


def main():
    rows = []
    for shape in (("gpt2-small B16", 16384, 768, 768, 768, 2048), ("seed B8", 8192, 768, 768, 256, 3072)):
        shape_rows(*shape, rows)
    print(f"{'shape':16s} {'GEMM':30s} {'us':>8s} {'TFLOP/s':>8s}")
    for name, label, us, tf in rows:
        print(f"{name:16s} {label:30s} {us:8.1f} {tf:8.0f}")


if __name__ == "__main__":
    main()
