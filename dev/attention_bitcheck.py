"""Bit-identity check of the attention kernels (xtrain/kernels/attention/) between two trees, on a CPU machine.

Two modes; run each once per tree (the tree is whatever ``xtrain`` PYTHONPATH gives) and diff the outputs:

    git archive BASE | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base python dev/attention_bitcheck.py interp > old_interp.txt
    PYTHONPATH=$PWD      python dev/attention_bitcheck.py interp > new_interp.txt
    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=/tmp/base python dev/attention_bitcheck.py ptx > old_ptx.txt
    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=$PWD      python dev/attention_bitcheck.py ptx > new_ptx.txt

``interp``: hashes of the Triton kernels' outputs (triton.py: forward, delta preprocess in each of its forms,
dK/dV and dQ; the one-pass backward's dq convert) through the Triton interpreter on fixed seeded fp32 inputs,
for every tile config the routing ships and for ragged and even T, causal and not, GQA.

``ptx``: hashes of the sm_90 PTX of every shipped instantiation (no GPU; ``compile_check.compile_only``): the
Triton attention kernels with every config ``choose`` gives (D 32/64/128; fp32, bf16, fp16; ragged and even
T; causal and not), and every Gluon config of ``attention.shipped_configs()`` through the Gluon entry points
(causal: bf16 and fp16, contiguous and transposed layouts; bf16 non-causal where the tree has it), with the
Triton kernels they launch (delta preprocess in its three forms, the one-pass dq convert), and the MHA builds of
``compile_sm90``. The
PTX is hashed without its debug lines (``.loc``, ``.file``, the DWARF sections), which name source lines; every
instruction is kept. Run with an empty TRITON_CACHE_DIR, outside the interpreter. Nothing in xtrain/ or tests/
imports this file.
"""

import hashlib
import inspect
import os
import re
import sys

MODE = sys.argv[1] if len(sys.argv) > 1 else "interp"
ONLY = sys.argv[2] if len(sys.argv) > 2 else ""  # ptx: only the families named (any of triton, fwd, bwd, onepass)
if MODE == "interp":
    os.environ["TRITON_INTERPRET"] = "1"
import torch  # noqa: E402


def h(*ts):
    m = hashlib.sha1()
    for t in ts:
        m.update(t.detach().contiguous().float().numpy().tobytes())
    return m.hexdigest()[:16]


def interp():
    from xtrain.kernels import attention as A
    from xtrain.kernels.attention import gluon_onepass as OP
    from xtrain.kernels.attention import triton as TR

    cfgs = set()
    for D in (32, 64, 128):
        for dt in (torch.float32, torch.bfloat16):
            for T in (128, 1024, 8192):
                c = A.choose(None, dt, T, D, True, False)
                cfgs.add((D, c.fwd[-1], c.bwd[-1]))
    for D, fcfg, bcfg in sorted(cfgs, key=repr):
        for T, causal, (H, Hkv) in ((37, True, (4, 2)), (128, True, (2, 1)), (96, False, (4, 2)), (128, False, (2, 2))):
            g = torch.Generator().manual_seed(D * 1000 + T)
            q = torch.randn(1, H, T, D, generator=g)
            k, v = (torch.randn(1, Hkv, T, D, generator=g) for _ in range(2))
            do = torch.randn(1, H, T, D, generator=g)
            o, lse = TR.flash_attention_fwd_triton(q, k, v, causal, None, config=fcfg)
            grads = TR.flash_attention_bwd_triton(do, q, k, v, o, lse, causal, None, config=bcfg)
            print("triton", D, repr(fcfg), repr(bcfg), T, causal, H, Hkv, h(o, lse), h(*grads), flush=True)
    B, H, D = 2, 3, 32
    for T in (40, 130):
        g = torch.Generator().manual_seed(T)
        o, do = (torch.randn(B, H, T, D, generator=g) for _ in range(2))
        lse = torch.randn(B, H, T, generator=g) * 5
        args = dict(
            stride_ob=o.stride(0),
            stride_oh=o.stride(1),
            stride_ot=o.stride(2),
            stride_dob=do.stride(0),
            stride_doh=do.stride(1),
            stride_dot=do.stride(2),
            H=H,
            T=T,
            HEAD_DIM=D,
            BLOCK_M=64,
        )
        grid = ((T + 63) // 64, B * H)
        delta, lse2 = torch.empty(B, H, T), torch.empty(B, H, T)
        TR._flash_bwd_preprocess_kernel[grid](o, do, delta, delta, delta, delta, delta, 1.0, **args)
        print("preprocess", T, h(delta), flush=True)
        TR._flash_bwd_preprocess_kernel[grid](o, do, delta, lse, lse2, delta, delta, 1.0, **args, SCALE_LSE=True)
        print("preprocess base2", T, h(delta, lse2), flush=True)
        lsec, deltac = (torch.empty(B, H, T, 16, dtype=torch.bfloat16) for _ in range(2))
        TR._flash_bwd_preprocess_kernel[grid](
            o, do, delta, lse, lse2, lsec, deltac, 8.0, **args, SCALE_LSE=True, COLS=16
        )
        print("preprocess cols", T, h(delta, lse2, lsec, deltac), flush=True)
        acc = torch.randn(B, H, T, D, generator=g)
        print("dq_convert", T, h(OP.dq_convert(acc, torch.empty(B, H, T, D), 0.125)), flush=True)


_DEBUG = re.compile(r"^\s*(\.loc\b|\.file\b|\$L__tmp\d+:)")


def _ptx_hash(label: str, ptx: str) -> str:
    """sha1 of the PTX without its debug information (.loc, .file, the $L__tmp labels that mark inlined scopes for
    the line table, and the DWARF sections at the end); with BITCHECK_DUMP set, the stripped text is also
    written there, for a diff."""
    cut = ptx.find("\t.section\t.debug")  # the DWARF sections (they name the source files and their paths)
    text = "\n".join(ln for ln in (ptx if cut < 0 else ptx[:cut]).splitlines() if not _DEBUG.match(ln))
    dump = os.environ.get("BITCHECK_DUMP")
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, re.sub(r"[^A-Za-z0-9_.=-]+", "_", label) + ".ptx"), "w") as f:
            f.write(text)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def ptx():
    from dataclasses import replace

    from triton.runtime.jit import JITFunction

    from xtrain.kernels import attention as A
    from xtrain.kernels import compile_check
    from xtrain.kernels.attention import gluon_bwd, gluon_common, gluon_fwd, gluon_onepass

    out = []

    def report(prefix, n0):
        for i, (kname, ptx_text) in enumerate(out[n0:]):
            label = f"{prefix} #{i} {kname}"
            print(label, _ptx_hash(label, ptx_text), flush=True)

    shipped = A.shipped_configs()
    with compile_check.compile_only(90):
        inner = JITFunction.run

        def record(self, *args, grid, warmup, **kwargs):
            kernel = inner(self, *args, grid=grid, warmup=warmup, **kwargs)
            out.append((self.__name__, kernel.asm["ptx"]))
            return kernel

        JITFunction.run = record
        try:
            # the Triton attention kernels with every config the routing gives them, T ragged (no TMA, masked
            # loads) and even, causal and not, GQA, in the three dtypes
            if not ONLY or "triton" in ONLY:
                g = torch.Generator().manual_seed(0)
                for D in (32, 64, 128):
                    for dt in (torch.float32, torch.bfloat16, torch.float16):
                        for T in (200, 1024, 8192):
                            for causal in (True, False):
                                c = A.choose(None, dt, T, D, causal, False)
                                q = torch.randn(1, 4, T, D, generator=g).to(dt)
                                k = torch.randn(1, 2, T, D, generator=g).to(dt)
                                n0 = len(out)
                                o, lse = A.flash_attention_fwd_triton(q, k, k, causal, config=c.fwd[-1])
                                A.flash_attention_bwd_triton(q, q, k, k, o, lse, causal, config=c.bwd[-1])
                                report(f"triton hd{D} {dt} T={T} causal={causal}", n0)
            # the Gluon entry points on CPU stand-ins (every launch compiles and returns): the shipped configs
            # (causal; bf16 and fp16 where the routing sends both; contiguous and transposed layouts), and
            # bf16 non-causal; the backwards launch their Triton preprocess and dq convert too
            T, H, Hkv = 256, 4, 2
            cases = []
            # (a tree whose Gluon kernels are causal only has no compile_sm90(D, causal, ...))
            both = "causal" in inspect.signature(gluon_bwd.compile_sm90).parameters
            for causal in (True, False) if both else (True,):
                for dt in (torch.bfloat16, torch.float16):
                    for tr in (False, True):
                        if causal or (dt == torch.bfloat16 and not tr):
                            cases.append((causal, dt, tr))
            for causal, dt, tr in cases:
                for fam in [f for f in ("fwd", "bwd", "onepass") if not ONLY or f in ONLY]:
                    for D, cfg in shipped[fam]:
                        if fam == "bwd" and cfg.lse_mma and dt != torch.bfloat16:
                            continue
                        q, k = gluon_common.stand_ins(D, T, H, Hkv, tr)
                        q, k = q.to(dt), k.to(dt)
                        o = torch.empty_like(q) if tr else torch.empty(q.shape, dtype=dt)
                        lse = torch.empty(1, H, T)
                        n0 = len(out)
                        if fam == "fwd":
                            gluon_fwd.flash_attention_fwd_gluon(q, k, k, causal, config=cfg, checked=True, programs=132)
                        elif fam == "bwd":
                            # (trees whose GluonBwdConfig still has two_streams: off, streams are not compiled code)
                            c = replace(cfg, two_streams=False) if hasattr(cfg, "two_streams") else cfg
                            gluon_bwd.flash_attention_bwd_gluon(q, q, k, k, o, lse, causal, config=c, checked=True)
                        else:
                            gluon_onepass.flash_attention_bwd_gluon_onepass(
                                q, q, k, k, o, lse, causal, config=cfg, checked=True
                            )
                        report(f"gluon {fam} hd{D} {cfg} causal={causal} {dt} transposed={tr}", n0)
        finally:
            JITFunction.run = inner
    # and the modules' own offline compiles (compile_check's): GQA and MHA (GROUP = 1 compiled in)
    for D, cfg in shipped["bwd"] if not ONLY or "bwd" in ONLY else ():
        causal = (True,) if "causal" in inspect.signature(gluon_bwd.compile_sm90).parameters else ()
        for name, ck in gluon_bwd.compile_sm90(D, *causal, cfg, mha=True).items():
            label = f"gluon bwd compile_sm90 hd{D} {cfg} mha {name}"
            print(label, _ptx_hash(label, ck.asm["ptx"]), flush=True)


if __name__ == "__main__":
    print("# kernels from", os.path.dirname(__import__("xtrain").__file__), file=sys.stderr)
    interp() if MODE == "interp" else ptx()
