"""RMSNorm over the last dim: y = x * inv_rms * w, inv_rms = 1 / sqrt(mean(x^2) + eps).

Contract (shared by the reference and the Triton kernels):
    rms_norm_fwd(x[..., C], w[C], eps) -> (y[..., C] in x.dtype, inv_rms[N] fp32), N = x.numel() // C
    rms_norm_bwd(dy[..., C], x, w, inv_rms) -> (dx in x.dtype, dw[C] in w.dtype)
Statistics are computed in fp32 whatever the input dtype; inv_rms is saved so backward skips the
reduction. With g = dy * w and n = C:
    dx = inv_rms * g - x * inv_rms^3 / n * sum_c(g * x)
    dw = sum_rows(dy * x * inv_rms)
"""

from __future__ import annotations

import torch


def rms_norm_fwd_ref(x: torch.Tensor, w: torch.Tensor, eps: float):
    C = x.shape[-1]
    xf = x.reshape(-1, C).float() if x.dtype != torch.float64 else x.reshape(-1, C)
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1) + eps)  # [N]
    y = (xf * inv_rms[:, None]) * w.to(xf.dtype)
    return y.to(x.dtype).reshape(x.shape), inv_rms


def rms_norm_bwd_ref(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, inv_rms: torch.Tensor):
    C = x.shape[-1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.reshape(-1, C).to(acc)
    dyf = dy.reshape(-1, C).to(acc)
    r = inv_rms.to(acc)[:, None]  # [N, 1]
    g = dyf * w.to(acc)
    dx = r * g - xf * (r**3 / C) * (g * xf).sum(dim=-1, keepdim=True)
    dw = (dyf * xf * r).sum(dim=0)
    return dx.to(x.dtype).reshape(x.shape), dw.to(w.dtype)


def rms_norm_fwd(x: torch.Tensor, w: torch.Tensor, eps: float):
    return rms_norm_fwd_ref(x, w, eps)


def rms_norm_bwd(dy, x, w, inv_rms):
    return rms_norm_bwd_ref(dy, x, w, inv_rms)
