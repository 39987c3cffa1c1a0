"""Bit-identity check of the non-attention kernels against the tree at tag ``pre-lean`` (CPU, Triton interpreter, fp32).

Prints one hash per (kernel, shape); run it once per tree and diff the outputs:

    git worktree add /tmp/prelean-k pre-lean
    PYTHONPATH=/tmp/prelean-k python dev/kernels_bitcheck.py old > old.txt
    PYTHONPATH=$PWD python dev/kernels_bitcheck.py new > new.txt
    diff old.txt new.txt

"old" drives the pre-lean embedding module through its module settings, "new" through the shipped configs.
Nothing in xtrain/ or tests/ imports this file.
"""

import hashlib
import os
import sys
from unittest import mock

os.environ["TRITON_INTERPRET"] = "1"
import torch  # noqa: E402

from xtrain.kernels import adamw as A  # noqa: E402
from xtrain.kernels import cross_entropy as CE  # noqa: E402
from xtrain.kernels import embedding as E  # noqa: E402
from xtrain.kernels import linear_cross_entropy as L  # noqa: E402
from xtrain.kernels import rms_norm as R  # noqa: E402
from xtrain.kernels import rope as RO  # noqa: E402
from xtrain.kernels import swiglu as S  # noqa: E402

OLD = sys.argv[1] == "old"
print("# kernels from", os.path.dirname(E.__file__), file=sys.stderr)


def h(*ts):
    m = hashlib.sha1()
    for t in ts:
        m.update(t.contiguous().numpy().tobytes())
    return m.hexdigest()[:12]


def emb(form, d, ids, V, plan=False):
    if OLD:
        cfgs = {f: (16, 1024 if f == "side" else 512, 4, f, 16, True) for f in ("side", "tiers", "rows")}
        with (
            mock.patch.object(E, "CONFIG", cfgs[form]),
            mock.patch.object(E, "DEFAULTS", {2: cfgs[form], 4: cfgs[form]}),
        ):
            p = E.embedding_bwd_plan_triton(ids, V, d.shape[-1], d.dtype) if plan else None
            return E.embedding_bwd_triton(d, ids, V, p)
    cfg = {"side": E.SIDE, "tiers": E.TIERS, "rows": E.ROWS}[form]
    p = E.embedding_bwd_plan_triton(ids, V, d.shape[-1], d.dtype, cfg) if plan else None
    return E.embedding_bwd_triton(d, ids, V, p, cfg)


def embedding():
    g = torch.Generator().manual_seed(0)
    cases = [(50, 37, torch.randint(0, 50, (3, 41), generator=g))]
    z = torch.distributions.Categorical(probs=1.0 / torch.arange(1, 301).double()).sample((700,))
    cases.append((300, 8, z.reshape(7, 100)))
    one = torch.cat([torch.zeros(1100, dtype=torch.long), torch.randint(0, 64, (200,), generator=g)])
    cases.append((64, 16, one[torch.randperm(1300, generator=g)]))
    cases.append((70000, 4, torch.randint(0, 70000, (40,), generator=g)))  # int32 keys (side only)
    for form in ("side", "tiers", "rows"):
        for i, (V, C, ids) in enumerate(cases):
            if form != "side" and V > 1000:
                continue
            d = torch.randn(*ids.shape, C, generator=g)
            print("embedding", form, i, h(emb(form, d, ids, V)), flush=True)
            if form == "tiers":
                print("embedding", form, i, "plan", h(emb(form, d, ids, V, plan=True)), flush=True)


def others():
    torch.manual_seed(0)
    for N, V in ((5, 123), (7, 1000), (3, 5000), (9, 256)):
        lg = torch.randn(N, V) * 3
        lg[0, 7] = 40.0
        t = torch.randint(0, V, (N,))
        t[1] = -100
        loss, lse, den = CE.cross_entropy_fwd_triton(lg, t)
        d = CE.cross_entropy_bwd_triton(torch.tensor(0.7), lg, t, lse, -100, den)
        a = lg.clone()
        nll, lse2 = CE.cross_entropy_fwd_bwd_triton(a, t, -100, 0.25)
        print("ce", N, V, h(loss, lse, den, d, nll, lse2, a))
    for shape in ((37, 40), (9, 130), (3, 7, 64), (5, 2100), (3, 4096)):
        x, dy, w = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
        y, r = R.rms_norm_fwd_triton(x, w, 1e-6)
        dx, dw = R.rms_norm_bwd_triton(dy, x, w, r)
        print("rms", shape, h(y, r, dx, dw))
    for xs, ps in (((3, 7, 64), (7,)), ((2, 3, 5, 6), (2, 5)), ((2, 5, 9, 10), (9,))):
        x = torch.randn(xs)
        pos = torch.randint(0, 17000, ps)
        print("rope", xs, h(RO.rope_fwd_triton(x, pos), RO.rope_bwd_triton(x, pos, 1e6)))
    for shape in ((5, 123), (3, 7, 64)):
        a, b, dy = torch.randn(shape), torch.randn(shape), torch.randn(shape)
        print(
            "swiglu",
            shape,
            h(
                S.silu_fwd_triton(a),
                S.silu_bwd_triton(dy, a),
                S.swiglu_fwd_triton(a, b),
                *S.swiglu_bwd_triton(dy, a, b),
            ),
        )
    ps = [torch.randn(300), torch.randn(17, 5)]
    gs = [torch.randn(300), torch.randn(17, 5)]
    ms = [torch.zeros(300), torch.zeros(17, 5)]
    vs = [torch.zeros(300), torch.zeros(17, 5)]
    cp = [torch.empty(300, dtype=torch.bfloat16), torch.empty(17, 5, dtype=torch.bfloat16)]
    for step in (1, 2):
        A.adamw_step_triton(
            ps, gs, ms, vs, step=step, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decays=[0.1, 0.0], copies=cp
        )
    print("adamw", h(*ps, *ms, *vs, *[c.float() for c in cp]))
    x, w = torch.randn(37, 24), torch.randn(301, 24)
    t = torch.randint(0, 301, (37,))
    t[3] = -100
    out = L.linear_cross_entropy_fwd_triton(x, w, t)
    print("lce", h(*[o for o in out if isinstance(o, torch.Tensor)]))
    x, w = torch.randn(37, 24), torch.randn(301, 24)
    t = torch.randint(0, 301, (37,))
    t[3] = -100
    out = L.linear_cross_entropy_fwd_triton(x, w, t, reduction="sum", chunk_size=8)
    print("lce sum chunk8", h(*[o for o in out if isinstance(o, torch.Tensor)]))
    ps = [torch.randn(300), torch.randn(17, 5), torch.randn(5000)]
    gs = [torch.randn_like(p) for p in ps]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    cp = [torch.empty(p.shape, dtype=torch.bfloat16) for p in ps]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decays=[0.1, 0.0, 0.1], copies=cp)
    for step in (1, 2, 3):  # CUDA's division (the reciprocal multiply), built on the CPU
        if OLD:
            with mock.patch.object(A, "_recip_div", lambda t: True):
                A.adamw_step_triton(ps, gs, ms, vs, step=step, **kw)
        else:
            A.adamw_step_triton(ps, gs, ms, vs, step=step, recip_div=True, **kw)
    print("adamw recip_div", h(*ps, *ms, *vs, *[c.float() for c in cp]))


if __name__ == "__main__":
    others()
    embedding()
