"""``xtrain check``: grad-check every op on fresh random inputs and print a table.

Each case builds float64 inputs, runs ``xtrain.gradcheck.gradcheck`` (central differences against our
backward) and reports the max normwise relative error per input. The command exits non-zero on any
failure: it is what a user runs to trust a fresh install. The same cases run in the test suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import xtrain.ops as ops
from xtrain.gradcheck import TOL_SMOOTH, gradcheck


@dataclass
class Case:
    op: str
    desc: str
    make: Callable[[torch.Generator], tuple[list[torch.Tensor], list]]  # -> (float64 inputs, other args)
    fn: Callable
    which: list[bool] | None = None
    tol: float = TOL_SMOOTH


def _r(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _ids(g, hi, *shape):
    return torch.randint(0, hi, shape, generator=g)


def cases() -> list[Case]:
    def pos(g, *shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64) + 0.5

    return [
        Case("add", "[3,4] + [4] (broadcast)", lambda g: ([_r(g, 3, 4), _r(g, 4)], []), ops.add),
        Case("add_cast", "[3,4] + [3,4]", lambda g: ([_r(g, 3, 4), _r(g, 3, 4)], []), ops.add_cast),
        Case("sub", "[2,1,5] - [3,1]", lambda g: ([_r(g, 2, 1, 5), _r(g, 3, 1)], []), ops.sub),
        Case("mul", "[3,4] * [3,1]", lambda g: ([_r(g, 3, 4), _r(g, 3, 1)], []), ops.mul),
        Case("mul(x,x)", "same Var twice", lambda g: ([_r(g, 5)], []), lambda x: ops.mul(x, x)),
        Case("div", "[3,4] / [4] (positive)", lambda g: ([_r(g, 3, 4), pos(g, 4)], []), ops.div),
        Case("scale", "[3,5] * 0.7", lambda g: ([_r(g, 3, 5)], [0.7]), ops.scale),
        Case("neg", "[7]", lambda g: ([_r(g, 7)], []), ops.neg),
        Case("matmul", "[2,3,4] @ [4,5]", lambda g: ([_r(g, 2, 3, 4), _r(g, 4, 5)], []), ops.matmul),
        Case(
            "matmul",
            "[2,1,3,4] @ [3,4,2] (batch bcast)",
            lambda g: ([_r(g, 2, 1, 3, 4), _r(g, 3, 4, 2)], []),
            ops.matmul,
        ),
        Case("linear", "[2,3,5] x [4,5] + b[4]", lambda g: ([_r(g, 2, 3, 5), _r(g, 4, 5), _r(g, 4)], []), ops.linear),
        Case("add_bias", "[2,3,4] + [4]", lambda g: ([_r(g, 2, 3, 4), _r(g, 4)], []), ops.add_bias),
        Case("sum", "[3,4,5] dim=1", lambda g: ([_r(g, 3, 4, 5)], [1]), ops.sum),
        Case("sum", "[3,4] all", lambda g: ([_r(g, 3, 4)], []), ops.sum),
        Case("mean", "[3,4,5] dim=(0,2) keepdim", lambda g: ([_r(g, 3, 4, 5)], [(0, 2), True]), ops.mean),
        Case("reshape", "[2,6] -> [3,4]", lambda g: ([_r(g, 2, 6)], [(3, 4)]), ops.reshape),
        Case("transpose", "[2,3,4] (1,2)", lambda g: ([_r(g, 2, 3, 4)], [1, 2]), ops.transpose),
        Case(
            "embedding",
            "ids[2,3] into [7,4]",
            lambda g: ([_r(g, 7, 4)], [_ids(g, 7, 2, 3)]),
            lambda t, ids: ops.embedding(ids, t),
        ),
        Case("rms_norm", "[3,5,8] w[8]", lambda g: ([_r(g, 3, 5, 8), _r(g, 8)], [1e-6]), ops.rms_norm),
        Case("silu", "[4,6]", lambda g: ([_r(g, 4, 6)], []), ops.silu),
        Case("swiglu", "[3,7] x2", lambda g: ([_r(g, 3, 7), _r(g, 3, 7)], []), ops.swiglu),
        Case("softmax", "[3,6] dim=-1", lambda g: ([_r(g, 3, 6)], [-1]), ops.softmax),
        Case("softmax", "[4,3,2] dim=1", lambda g: ([_r(g, 4, 3, 2)], [1]), ops.softmax),
        Case(
            "cross_entropy",
            "[6,11], 2 ignored",
            lambda g: ([_r(g, 6, 11)], [torch.tensor([3, -100, 0, 10, -100, 5])]),
            ops.cross_entropy,
        ),
        Case("rope", "[2,3,5,8] pos[5]", lambda g: ([_r(g, 2, 3, 5, 8)], [torch.arange(5)]), ops.rope),
        Case("rope", "[2,3,4,6] pos[2,4]", lambda g: ([_r(g, 2, 3, 4, 6)], [_ids(g, 50, 2, 4)]), ops.rope),
        Case("dropout", "[5,7] p=0.3 seed=1234", lambda g: ([_r(g, 5, 7)], [0.3, 1234]), ops.dropout),
        Case(
            "attention",
            "MHA causal [2,2,5,4]",
            lambda g: ([_r(g, 2, 2, 5, 4), _r(g, 2, 2, 5, 4), _r(g, 2, 2, 5, 4)], [True]),
            ops.attention,
        ),
        Case(
            "attention",
            "GQA H=4 Hkv=2 non-causal",
            lambda g: ([_r(g, 1, 4, 3, 4), _r(g, 1, 2, 3, 4), _r(g, 1, 2, 3, 4)], [False]),
            ops.attention,
        ),
        Case(
            "math_attention",
            "GQA H=4 Hkv=2 causal [2,.,5,4]",
            lambda g: ([_r(g, 2, 4, 5, 4), _r(g, 2, 2, 5, 4), _r(g, 2, 2, 5, 4)], [True]),
            ops.math_attention,
        ),
        Case(
            "math_attention",
            "MHA non-causal [1,2,3,4]",
            lambda g: ([_r(g, 1, 2, 3, 4), _r(g, 1, 2, 3, 4), _r(g, 1, 2, 3, 4)], [False]),
            ops.math_attention,
        ),
        Case(
            "flash_attention",
            "GQA causal [1,4,5,32] (tiled reference)",
            lambda g: ([_r(g, 1, 4, 5, 32), _r(g, 1, 2, 5, 32), _r(g, 1, 2, 5, 32)], [True]),
            lambda q, k, v, causal: ops.flash_attention(q, k, v, causal),
        ),
        Case(
            "qk_norm_rope",
            "x[2,5,3*6] w[6] pos[5] (heads=3)",
            lambda g: ([_r(g, 2, 5, 18), _r(g, 6)], [3, torch.arange(5)]),
            lambda x, w, heads, pos: ops.qk_norm_rope(x, w, heads, pos),
        ),
        Case(
            "qk_norm_rope",
            "x[2,4,2*4] w[4] pos[2,4]",
            lambda g: ([_r(g, 2, 4, 8), _r(g, 4)], [2, _ids(g, 50, 2, 4)]),
            lambda x, w, heads, pos: ops.qk_norm_rope(x, w, heads, pos),
        ),
        Case(
            "swiglu_linear",
            "x[5,4] w_gate,w_up[6,4]",
            lambda g: ([_r(g, 5, 4), _r(g, 6, 4), _r(g, 6, 4)], []),
            lambda x, wg, wu: ops.swiglu_linear(x, wg, wu),
        ),
        Case(
            "linear_cross_entropy",
            "x[7,5] w[11,5], 1 ignored",
            lambda g: ([_r(g, 7, 5), _r(g, 11, 5)], [torch.tensor([1, 0, -100, 10, 3, 3, 7])]),
            lambda x, w, t: ops.linear_cross_entropy(x, w, t),
        ),
    ]


def run_case(c: Case, seed: int) -> list[float | None]:
    g = torch.Generator().manual_seed(seed)
    inputs, others = c.make(g)
    return gradcheck(c.fn, inputs, others, seed=seed, which=c.which)


def run_all(seed: int = 0, verbose: bool = True) -> int:
    t0 = time.perf_counter()
    rows, failures = [], 0
    for i, c in enumerate(cases()):
        errs = run_case(c, seed + i)
        worst = max(e for e in errs if e is not None)
        ok = worst <= c.tol
        failures += not ok
        rows.append((c.op, c.desc, ", ".join(f"{e:.1e}" for e in errs if e is not None), c.tol, ok))
    if verbose:
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        w2 = max(len(r[2]) for r in rows)
        print(f"{'op':<{w0}}  {'inputs':<{w1}}  {'max rel err (per input)':<{w2}}  {'tol':>7}  result")
        for op, desc, errs, tol, ok in rows:
            print(f"{op:<{w0}}  {desc:<{w1}}  {errs:<{w2}}  {tol:>7.0e}  {'pass' if ok else 'FAIL'}")
        print(
            f"{len(rows) - failures} passed, {failures} failed  "
            f"(float64 central differences, h=1e-6; {time.perf_counter() - t0:.1f}s)"
        )
    return failures


def add_parser(subparsers) -> None:
    from xtrain import argtypes as A

    p = subparsers.add_parser(
        "check",
        help="grad-check every op against finite differences",
        description="Grad-check every op (float64 central differences) and print a table; "
        "exits non-zero on any failure.",
    )
    p.add_argument("--seed", type=A.seed, default=0, help="seed for the random inputs (default 0)")
    p.add_argument(
        "--kernels",
        type=A.int_in(1, what="a CUDA compute capability x 10 (90 for sm_90)"),
        default=None,
        metavar="ARCH",
        help="instead: compile every Triton kernel the library launches for CUDA sm_ARCH (e.g. 90) with "
        "no GPU, and report the kernels each op compiled or its error (xtrain.kernels.compile_check)",
    )
    p.set_defaults(func=_run)


def _run(a) -> int:
    if a.kernels is not None:
        from xtrain.kernels import HAVE_TRITON, compile_check

        if HAVE_TRITON:
            return compile_check.main(["--arch", str(a.kernels)])
        # a CPU-only torch does not load Triton unless asked (``kernels._dispatch``): compile in a child that asks
        cmd = [sys.executable, "-m", "xtrain.kernels.compile_check", "--arch", str(a.kernels)]
        return subprocess.run(cmd, env=dict(os.environ, XTRAIN_KERNELS="triton")).returncode
    return 1 if run_all(a.seed) else 0
