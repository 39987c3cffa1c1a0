"""What the GPU tests of the two Gluon backwards share (tests/test_flash_gluon_bwd.py,
tests/test_flash_gluon_onepass.py): the relative-norm error, the input layouts, the fp64-consistent inputs."""

from __future__ import annotations

import torch

from xtrain.kernels import attention as FA

# layout: which tensors are [B, T, Hx, D]-transposed. "model": v and do as the model passes them, fresh
# contiguous outputs; "bthd": every input and the output buffers; "contiguous": none.
LAYOUTS = {"contiguous": set(), "model": {"v", "do"}, "bthd": {"q", "k", "v", "do", "o", "dq", "dk", "dv"}}


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def in_layout(x: torch.Tensor, bthd: bool) -> torch.Tensor:
    """x [B, Hx, T, D] as a [B, T, Hx, D] tensor seen through a transpose (bthd), or contiguous."""
    return x.transpose(1, 2).contiguous().transpose(1, 2) if bthd else x.contiguous()


def inputs(B, H, Hkv, T, D, dtype, causal, seed):
    """q, k, v, do in ``dtype`` on CUDA, and o, lse from the fp64 forward reference (o cast to dtype): the
    kernel and the oracle see the same rounded inputs."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(B, h, T, D, generator=g, device="cuda").to(dtype) for h in (H, Hkv, Hkv, H))
    o64, lse64 = FA.flash_attention_fwd_ref(q.double(), k.double(), v.double(), causal)
    return q, k, v, do, o64.to(dtype), lse64.float()
