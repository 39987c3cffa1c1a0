"""Probe (GPU): where the fused add + RMSNorm backward (with the bf16 dx copy) differs from the plain norm backward,
element counts and sizes per output; how many kernels the two calls compiled, and where there are two, their
arithmetic-op counts. Writes the PTX files to $OUT."""

import os
import re
from collections import Counter

import torch
from triton.runtime.jit import JITFunction

from xtrain.kernels import rms_norm as K

out = os.environ.get("OUT", "/tmp")
ptx: dict = {}
run = JITFunction.run


def cap(self, *a, **k):
    kern = run(self, *a, **k)
    if self.__name__ == "_rms_norm_bwd_kernel" and hasattr(kern, "asm"):
        ptx[id(kern)] = kern.asm["ptx"]
    return kern


JITFunction.run = cap


def diff(a, b):
    d = a.float() != b.float()
    return f"{int(d.sum())}/{d.numel()} differ, max |d| {float((a.float() - b.float()).abs().max()):.3g}"


for N, C in [(4096, 768), (333, 4096)]:
    torch.manual_seed(0)
    x, w = torch.randn(N, C, device="cuda"), 1 + 0.1 * torch.randn(C, device="cuda")
    res, dy = torch.randn(N, C, device="cuda").bfloat16(), torch.randn(N, C, device="cuda").bfloat16()
    dres = torch.randn(N, C, device="cuda")
    s, y, r = K.rms_norm_fwd_triton(x, w, 1e-6, torch.bfloat16, res=res)
    dx, dw, lo = K.rms_norm_bwd_triton(dy, s, w, r, dres, low=torch.bfloat16)
    dx0, dw0 = K.rms_norm_bwd_triton(dy, s, w, r, dres)
    dx1, dw1 = K.rms_norm_bwd_triton(dy, s, w, r, dres)
    print(f"N={N} C={C}: dx {diff(dx, dx0)}; dw {diff(dw, dw0)}; lo vs dx0.bf16 {diff(lo, dx0.bfloat16())}; "
          f"lo vs dx.bf16 {diff(lo, dx.bfloat16())}; plain twice: dx {diff(dx0, dx1)} dw {diff(dw0, dw1)}")  # fmt: skip
    print(f"  compiled backward kernels for the two calls: {len(ptx)}")
    for i, p in enumerate(ptx.values()):
        open(f"{out}/rms_bwd_{i}_{C}.ptx", "w").write(p)
    if len(ptx) == 2:
        ops = {k: Counter(m.group(1) for m in re.finditer(r"^\s*((?:fma|mul|add|sub|neg|cvt)\.[\w.]+)", p, re.M))
               for k, p in ptx.items()}  # fmt: skip
        a, b = ops.values()
        print("  ops only in the first:", dict(a - b), "only in the second:", dict(b - a))
    ptx.clear()
