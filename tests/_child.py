"""Run a snippet in a child Python without the Triton interpreter (helper for the sm_90 compile tests).

conftest.py turns TRITON_INTERPRET on when there is no CUDA, and in such a process compiling a kernel for
sm_90 is not reliable: Triton's own jit functions (the combine functions of gl.max / gl.sum) are interpreted
ones there and cannot be compiled, and a compile after interpreted kernels ran can fail inside the frontend.
These tests passed only on a warm Triton cache (a cache hit skips the frontend) before they moved here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_without_interpreter(snippet: str, timeout: float = 1800.0):
    """Execute ``snippet`` (which must bind ``out`` to something JSON can hold) in a fresh Python with
    TRITON_INTERPRET unset, Triton loaded and the repository on the path; returns ``out``. Fails with the child's
    stderr."""
    code = snippet + "\nimport json as _json\nprint('@@' + _json.dumps(out))\n"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["XTRAIN_KERNELS"] = "triton"  # a CPU-only torch loads Triton only when asked (xtrain.kernels._dispatch)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("@@")]
    assert r.returncode == 0 and lines, f"child failed (exit {r.returncode}):\n{r.stderr[-4000:]}"
    return json.loads(lines[-1][2:])


def sass_report(ck) -> str:
    """From a compiled kernel's SASS (cuobjdump of the cubin Triton built): HGMMA count, WARPGROUP.DEPBAR (wgmma
    wait) count and STL (spill store) count; ptxas serialised the wgmmas when DEPBAR >= HGMMA. Fails loudly when
    cuobjdump (which Triton's NVIDIA backend ships) is missing or cannot read the cubin: a check that skips
    itself when its tool is absent is a claim without evidence. Call it in the child (``sys.path.insert(0,
    "tests")`` first)."""
    import re
    import tempfile

    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    if not os.access(tool, os.X_OK):
        raise FileNotFoundError(f"SASS check: no cuobjdump at {tool} (Triton's NVIDIA backend ships it)")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(ck.asm["cubin"])
        r = subprocess.run([tool, "-sass", path], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 or "Function" not in r.stdout:
        raise RuntimeError(f"SASS check: cuobjdump -sass failed (exit {r.returncode}): {r.stderr[-2000:]}")
    sass = r.stdout
    n_mma, n_dep = len(re.findall(r"\bHGMMA\b", sass)), sass.count("WARPGROUP.DEPBAR")
    n_stl = len(re.findall(r"\bSTL\b", sass))
    ser = "wgmma SERIALIZED" if n_mma and n_dep >= n_mma else "not serialized"
    return f"SASS: HGMMA {n_mma}, DEPBAR {n_dep} ({ser}), STL {n_stl}"
