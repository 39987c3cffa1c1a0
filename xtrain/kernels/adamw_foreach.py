"""AdamW as multi-tensor (``torch._foreach_*``) operations: one dispatch per step of the update for all parameters,
instead of one per parameter per step.

The update, per element, in torch's single-tensor AdamW order (``xtrain.kernels.adamw.adamw_step_ref``):

    p <- p * (1 - lr * wd)            only the parameters with wd != 0
    m <- lerp(m, g, 1 - b1)
    v <- v * b2 + (1 - b2) * g * g
    p <- p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)

``adamw_step_device`` is the same update with lr and the step count as 0-dim device tensors and a device flag ``ok`` (a
0-dim bool): nothing in it reads a value back to the host, so it can run inside a captured CUDA graph. Where ``ok`` is
false the update leaves parameters, moments and the step count exactly as they were (the non-finite gradient is replaced
by zeros before the arithmetic, and the result is selected by a lerp of weight 0 or 1, which is exact). Its bias
corrections are computed in fp32 on the device, so its rounding differs from the float64-scalar path by at most an ulp
of the step size. The trainer's step runs it only for CUDA tensors under the reference kernel backend.

``adamw_step_fused_cpu``: the update on the CPU, through torch's fused kernel (the trainer's step and ``AdamW.step``
alike), with host or device scalars; bit for bit ``torch.optim.AdamW(fused=True)``.
"""

from __future__ import annotations

import torch


def adamw_step_device(
    params, grads, exp_avgs, exp_avg_sqs, *, step: torch.Tensor, lr: torch.Tensor, ok: torch.Tensor,
    beta1: float, beta2: float, eps: float, weight_decays, copies=None,
) -> None:  # fmt: skip
    """The update with ``lr`` (0-dim fp32), ``step`` (0-dim fp32, the count of updates done; incremented here
    where ``ok``) and ``ok`` (0-dim bool) on the parameters' device; no host reads."""
    lr = lr.to(params[0].dtype)
    okf = ok.to(params[0].dtype)
    step.add_(okf)
    t = torch.clamp(step, min=1.0)  # a skipped first step keeps step 0; the result is discarded anyway
    bc1 = 1 - torch.pow(beta1, t)
    bc2_sqrt = torch.sqrt(1 - torch.pow(beta2, t))
    zero = torch.zeros((), dtype=params[0].dtype, device=params[0].device)
    g = [torch.where(ok, gi, zero) for gi in grads]  # a non-finite gradient must not reach the arithmetic
    new_p = torch._foreach_mul(params, 1.0)  # fresh copies; selected back below
    new_m = torch._foreach_lerp(exp_avgs, g, 1 - beta1)
    new_v = torch._foreach_mul(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(new_v, g, g, value=1 - beta2)
    for wd in sorted({wd for wd in weight_decays if wd != 0}):
        idx = [i for i, w in enumerate(weight_decays) if w == wd]
        torch._foreach_mul_([new_p[i] for i in idx], 1 - lr * wd)
    denom = torch._foreach_sqrt(new_v)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    upd = torch._foreach_div(new_m, denom)
    torch._foreach_mul_(upd, -lr / bc1)
    torch._foreach_add_(new_p, upd)
    # lerp with weight exactly 0 or 1 returns self or end exactly (both finite here)
    # (a list of weight tensors: a single 0-dim tensor would be read to the host as a Python scalar)
    w = [okf] * len(params)
    torch._foreach_lerp_(params, new_p, w)
    torch._foreach_lerp_(exp_avgs, new_m, w)
    torch._foreach_lerp_(exp_avg_sqs, new_v, w)
    if copies is not None:
        pairs = [(c, p) for c, p in zip(copies, params) if c is not None]
        if pairs:
            torch._foreach_copy_([c for c, _ in pairs], [p for _, p in pairs])


def adamw_step_fused_cpu(
    params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1: float, beta2: float, eps: float,
    weight_decays, copies=None, ok: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """The same update through torch's fused CPU AdamW kernel (``torch._fused_adamw_``: one vectorised pass
    per tensor instead of eight multi-tensor passes), one call per distinct weight decay, as
    ``torch.optim.AdamW(fused=True)`` calls it per parameter group: bit for bit what that optimizer computes.
    Its rounding differs from the single-tensor reference (``adamw_step_ref``) by about
    an ulp per step (the kernel folds the bias corrections differently).

    ``step``: the count of updates including this one (an int), or a 0-dim fp32 tensor of the updates done,
    incremented here where ``ok``. ``lr``: a float or a 0-dim float64 tensor (the kernel reads it as the same
    double). ``ok`` (a 0-dim bool tensor, or None for True): where false, the kernel returns before touching
    anything (torch's ``found_inf``), so weights, moments and the step count stay exactly as they were. With
    tensors for all three no value is read back by a Python-level op (the kernel reads its scalar tensors in
    C++), which keeps the step capture-ready."""
    if isinstance(step, torch.Tensor):
        step.add_(1.0 if ok is None else ok.to(step.dtype))
        step_t = step
    else:
        step_t = torch.tensor(float(step))  # the kernel reads the step count from a tensor per parameter
    found_inf = None if ok is None else torch.logical_not(ok).to(torch.float32)  # the kernel reads a float
    for wd in sorted(set(weight_decays)):
        idx = [i for i, w in enumerate(weight_decays) if w == wd]
        ts = [[xs[i] for i in idx] for xs in (params, grads, exp_avgs, exp_avg_sqs)]
        hyper = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
        torch._fused_adamw_(*ts, [], [step_t] * len(idx), **hyper, found_inf=found_inf)
    if copies is not None:
        pairs = [(c, p) for c, p in zip(copies, params) if c is not None]
        if pairs:
            torch._foreach_copy_([c for c, _ in pairs], [p for _, p in pairs])
