"""Every Triton kernel the library launches compiles for sm_90 on a machine with no GPU (xtrain.kernels.compile_check),
and the check does report a kernel that does not compile."""

from __future__ import annotations

import pytest
from _child import run_without_interpreter

from xtrain.kernels import _dispatch

pytestmark = pytest.mark.skipif(not _dispatch.HAVE_TRITON, reason="needs Triton")


@pytest.mark.slow
def test_every_triton_kernel_compiles_for_sm90():
    rows = run_without_interpreter("from xtrain.kernels.compile_check import run\nout = run(90)")
    bad = [(r["name"], r["error"]) for r in rows if not r["ok"]]
    assert not bad, bad
    compiled = {k for r in rows for k in r["kernels"]}
    # one kernel of every module, and every kernel of the embedding backward's three shipped forms
    want = {
        "_rms_norm_fwd_kernel",
        "_rms_norm_bwd_kernel",
        "_rope_kernel",
        "_qkv_norm_rope_store_kernel",
        "_swiglu_bwd_kernel",
        "_dropout_kernel",
        "_cross_entropy_fwd_bwd_kernel",
        "_ce_fwd_group_kernel",
        "_embedding_tier_b_kernel",
        "_embedding_tier_b_merge_kernel",
        "_embedding_bwd_chunk_kernel",
        "_embedding_bwd_merge_kernel",
        "_embedding_zero_absent_kernel",
        "_embedding_keys_kernel",
        "_embedding_slots_kernel",
        "_embedding_tier_slots_kernel",
        "_embedding_tier_a_kernel",
        "_embedding_bwd_rows_kernel",
        "_rms_norm_dw_kernel",
        "_flash_fwd_kernel",
        "_flash_bwd_dkdv_kernel",
        "_flash_bwd_dq_kernel",
        "_adamw_kernel",
        "_zero_i32_kernel",
    }  # launched only as a programmatic dependent (pdl_ok answered as on sm_90)
    assert want <= compiled, want - compiled


def test_compile_check_reports_a_kernel_that_does_not_compile(tmp_path):
    """A negative control: the same compile-only launch of a kernel with a compile error (an arange whose length is
    not a power of two) raises, and a correct one in the same module compiles."""
    mod = tmp_path / "broken_kernels.py"
    mod.write_text(
        "import triton\nimport triton.language as tl\n\n"
        "@triton.jit\ndef good(X, N: tl.constexpr):\n    tl.store(X + tl.arange(0, N), 1.0)\n\n"
        "@triton.jit\ndef bad(X, N: tl.constexpr):\n    tl.store(X + tl.arange(0, N - 1), 1.0)\n"
    )
    out = run_without_interpreter(f"""
import sys, torch
sys.path.insert(0, {str(tmp_path)!r})
import broken_kernels as m
from xtrain.kernels.compile_check import compile_only
x = torch.empty(16)
out = {{}}
with compile_only(90) as names:
    m.good[(1,)](x, N=16)
    try:
        m.bad[(1,)](x, N=16)
        out["bad"] = "compiled"
    except Exception as e:
        out["bad"] = type(e).__name__
out["names"] = names
""")
    assert out["names"] == ["good"]
    assert out["bad"] != "compiled"


def test_check_kernels_cli_refuses_clearly(monkeypatch, capsys):
    """`xtrain check --kernels ARCH` exits 2 with a message, not a traceback, where it cannot compile."""
    from xtrain.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["check", "--kernels", "90"]) == 2
    assert "unset TRITON_INTERPRET" in capsys.readouterr().err
    monkeypatch.delenv("TRITON_INTERPRET")
    assert main(["check", "--kernels", "0"]) == 2
    assert "compute capability" in capsys.readouterr().err
