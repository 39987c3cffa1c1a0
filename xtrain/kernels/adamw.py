"""AdamW (Loshchilov & Hutter, decoupled weight decay) over lists of tensors, updating in place.

Per parameter p with gradient g (all fp32 master tensors), at step t >= 1:
    p   <- p * (1 - lr * wd)                      decoupled weight decay
    m   <- m + (1 - b1) * (g - m)                 (torch's lerp)
    v   <- v * b2 + (1 - b2) * g * g
    p   <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
The reference performs exactly torch.optim.AdamW's single-tensor (foreach=False) operations in the same
order, so on CPU in fp32 it matches torch bit for bit (a test checks this).

Contract: adamw_step(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decays,
          copies=None) -> None. ``weight_decays`` is one float per parameter. ``copies`` (optional) is a list
          of low-precision compute copies (e.g. bf16) to refresh from the updated masters in the same pass.
"""

from __future__ import annotations


def adamw_step_ref(params, grads, exp_avgs, exp_avg_sqs, *, step: int, lr: float, beta1: float,
                   beta2: float, eps: float, weight_decays, copies=None) -> None:
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        wd = weight_decays[i]
        if wd != 0:
            p.mul_(1 - lr * wd)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)
        if copies is not None and copies[i] is not None:
            copies[i].copy_(p)


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, **kw) -> None:
    adamw_step_ref(params, grads, exp_avgs, exp_avg_sqs, **kw)
