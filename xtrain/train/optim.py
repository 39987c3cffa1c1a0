"""AdamW over the model's master weights, the global gradient norm, and norm clipping.

Which parameters decay (``decays``): every 2-D weight matrix of a linear map (q/k/v/o, gate/up/down and an
untied lm_head) decays; 1-D RMSNorm weights and the token embedding do not (decaying a norm gain pulls it
to 0, not to the identity; decaying embeddings shrinks rare tokens' rows that get almost no gradient).
A tied embedding is the embedding, so it does not decay either.

The update is ``xtrain.kernels.adamw.adamw_step`` on CUDA (the Triton kernel, one launch) and torch's fused
CPU AdamW kernel elsewhere (``xtrain.kernels.adamw_foreach.adamw_step_fused_cpu``: decoupled weight decay, one
call per decay group), so in fp32 on the CPU it matches ``torch.optim.AdamW(fused=True)`` with the same two
groups bit for bit (tests/test_train.py); the single-tensor reference order (``adamw_step_ref``) rounds
differently by about an ulp per step. Moments are kept in the master dtype (fp32). Every parameter is updated
on every step; a parameter that received no gradient is updated with a zero gradient (its moments decay,
weight decay applies), so the step count is one per optimizer, not per parameter.

The trainer's step (``step_device``) takes the lr, the go-ahead and the clip coefficient as device tensors;
on CUDA the same kernel then scales each gradient as it reads it (the clip costs no pass of its own); on the CPU
it is the same fused kernel as ``step``, which skips itself where the go-ahead is false.

``grad_norm`` / ``clip_grads_`` compute exactly what ``torch.nn.utils.clip_grad_norm_`` computes
(norm of the per-tensor 2-norms; coefficient max_norm / (norm + 1e-6), clamped to 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from xtrain.autograd import Var
from xtrain.kernels._dispatch import use_triton
from xtrain.kernels.adamw import adamw_step, adamw_step_triton_device
from xtrain.kernels.adamw_foreach import adamw_step_device, adamw_step_fused_cpu


def decays(name: str, shape) -> bool:
    """The weight-decay rule: 2-D matrices decay except the token embedding; norms (1-D) never do."""
    return len(shape) == 2 and name != "model.embed_tokens.weight"


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Global 2-norm of a list of gradients (a 0-dim tensor in the grads' dtype, as torch computes it)."""
    if not grads:
        return torch.zeros(())
    # one multi-tensor op (one launch on CUDA); on the CPU it loops over the same per-tensor norms as
    # torch's foreach=False path, so the result is the same bit for bit
    norms = torch._foreach_norm(grads, 2.0)
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def clip_coef(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """The clip coefficient torch computes: max_norm / (norm + 1e-6), clamped to 1 (a 0-dim tensor)."""
    return torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)


def clip_grads_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """Scale grads in place so their global norm is at most max_norm; returns the coefficient used (a 0-dim
    tensor on the grads' device). The coefficient is computed as torch does, as a tensor in the norm's dtype
    (a Python-float coefficient could differ from torch's in the last bit), and never read back to the host:
    the grads are always multiplied by it (by exactly 1.0 when the norm is below max_norm, which changes
    nothing), so a step stays free of host-device synchronisation."""
    coef = clip_coef(max_norm, total_norm)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return coef


class AdamW:
    """AdamW on named leaf Vars (``model.params``). ``step(lr)`` reads each ``.grad`` and updates
    ``.data`` in place (never through the tape). State: ``step`` and two moment tensors per parameter."""

    def __init__(
        self,
        params: Mapping[str, Var],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        decay_rule=decays,
        compute_copies: torch.dtype | None = None,
    ):
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"AdamW: lr must be a finite number > 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamW: betas must lie in [0, 1), got {betas}")
        if not (eps > 0 and weight_decay >= 0):
            raise ValueError(f"AdamW: need eps > 0 and weight_decay >= 0, got eps={eps}, wd={weight_decay}")
        self.names = list(params.keys())
        self.params = [params[n] for n in self.names]
        self.lr, self.betas, self.eps, self.weight_decay = float(lr), tuple(betas), float(eps), float(weight_decay)
        self.weight_decays = [
            self.weight_decay if decay_rule(n, p.shape) else 0.0 for n, p in zip(self.names, self.params)
        ]
        self.exp_avgs = [torch.zeros_like(p.data) for p in self.params]
        self.exp_avg_sqs = [torch.zeros_like(p.data) for p in self.params]
        self.step_count = 0
        self.step_tensor: torch.Tensor | None = None  # the device step count of step_device
        self._init_copies(compute_copies)

    @classmethod
    def for_model(cls, model, *, copies: bool = True, **kw) -> AdamW:
        """AdamW over ``model.params`` set up as the trainer uses it: when the model computes in a lower dtype
        than its masters (and ``copies``), the update pass also writes compute copies of the weight
        matrices, and the model's forward reads them (``model.weight_copy``) instead of casting every weight
        in every forward."""
        low = model.compute_dtype if copies and model.compute_dtype != model.master_dtype else None
        opt = cls(model.params, compute_copies=low, **kw)
        model.weight_copy = opt.copy_for if low is not None else None
        return opt

    # -- compute copies ------------------------------------------------------------------------------
    def _init_copies(self, dtype: torch.dtype | None) -> None:
        """With ``compute_copies=torch.bfloat16``: keep a bf16 copy of every 2-D master weight (the
        matrices the model casts in every forward), written by the update pass itself, so the forward
        reads the copy (``copy_for``) instead of launching one cast per weight per forward (and per
        recompute). The copies live in one buffer, each 512-byte aligned; they are derived state (never
        saved) and are rebuilt from the masters whenever a master changed outside ``step``."""
        self.copies: list[torch.Tensor | None] = [None] * len(self.params)
        self._copy_of: list[tuple | None] = [None] * len(self.params)  # (master tensor, its _version)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        if dtype is None:
            return
        want = [i for i, p in enumerate(self.params) if p.data.ndim == 2 and p.data.dtype != dtype]
        if not want:
            return
        # each copy starts 512-byte aligned, as torch's allocator aligns a tensor: cuBLAS picks its kernels by
        # pointer alignment, and the AdamW kernel's vectorised path needs block offsets that are multiples of 16
        pad = lambda n: -(-n // 256) * 256
        total = sum(pad(self.params[i].data.numel()) for i in want)
        buf = torch.empty(total, dtype=dtype, device=self.params[want[0]].data.device)
        off = 0
        for i in want:
            d = self.params[i].data
            self.copies[i] = buf[off : off + d.numel()].view(d.shape)
            off += pad(d.numel())
        self._refresh_copies()

    def _refresh_copies(self) -> None:
        for i, c in enumerate(self.copies):
            if c is not None:
                c.copy_(self.params[i].data)
                self._record_copy(i)

    def _record_copy(self, i: int) -> None:
        """Note which master tensor, at which version, copy i now mirrors."""
        d = self.params[i].data
        self._copy_of[i] = (d, d._version)

    def _copy_valid(self, i: int) -> bool:
        src = self._copy_of[i]
        d = self.params[i].data
        return src is not None and src[0] is d and src[1] == d._version

    def copy_for(self, p: Var) -> torch.Tensor | None:
        """The compute copy of parameter ``p`` if it is current, else None (the caller casts). A master
        changed in place outside ``step`` (a checkpoint restore, a user's edit) bumps its tensor's version
        counter, and a replaced ``p.data`` is another tensor: either makes the copy stale, never wrong."""
        i = self._index.get(id(p))
        if i is None or self.copies[i] is None or not self._copy_valid(i):
            return None
        return self.copies[i]

    def grads(self) -> list[torch.Tensor]:
        """The parameters' gradients; a parameter that received none gets a zero gradient attached, so
        in-place work on the returned list (all-reduce, clipping) reaches what ``step`` uses."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p.data)
        return [p.grad for p in self.params]

    def step(self, lr: float | None = None) -> None:
        lr = self.lr if lr is None else float(lr)
        grads = self.grads()
        self.step_count += 1
        if self.step_tensor is not None:
            self.step_tensor.fill_(float(self.step_count))
        have_copies = any(c is not None for c in self.copies)
        datas = [p.data for p in self.params]
        # the Triton kernel on CUDA (one launch); on the CPU torch's fused kernel (one pass per tensor)
        update = adamw_step if use_triton(datas[0]) or datas[0].is_cuda else adamw_step_fused_cpu
        update(
            datas,
            grads,
            self.exp_avgs,
            self.exp_avg_sqs,
            step=self.step_count,
            lr=lr,
            beta1=self.betas[0],
            beta2=self.betas[1],
            eps=self.eps,
            weight_decays=self.weight_decays,
            copies=self.copies if have_copies else None,
        )
        if have_copies:  # the update wrote every copy from its new master
            for i, c in enumerate(self.copies):
                if c is not None:
                    self._record_copy(i)

    def step_device(self, lr: torch.Tensor, ok: torch.Tensor, grad_scale: torch.Tensor | None = None) -> None:
        """The update with the learning rate, the go-ahead and the gradient scale as device tensors (0-dim
        ``lr``, 0-dim bool ``ok``, 0-dim ``grad_scale``: the clip coefficient, None for 1): nothing is read back
        to the host, so it can be captured in a CUDA graph. Where ``ok`` is false nothing changes (weights,
        moments, step). The step count lives on the device (``step_tensor``); ``sync_step_count()`` copies it
        into ``step_count`` (a host read: call it outside the step). On CUDA this is the one-launch Triton
        kernel with the clip folded into its read of the gradients (the grads are left unscaled); on the CPU the
        grads are scaled in place first and the update is ``step``'s fused kernel, so with ``grad_scale`` the
        clip coefficient the result is bit for bit ``clip_grads_`` + ``step``."""
        grads = self.grads()
        datas = [p.data for p in self.params]
        if self.step_tensor is None:
            self.step_tensor = torch.tensor(float(self.step_count), device=datas[0].device)
        have_copies = any(c is not None for c in self.copies)
        kw = dict(
            step=self.step_tensor,
            lr=lr,
            ok=ok,
            beta1=self.betas[0],
            beta2=self.betas[1],
            eps=self.eps,
            weight_decays=self.weight_decays,
            copies=self.copies if have_copies else None,
        )
        if use_triton(datas[0]) and datas[0].is_cuda:
            adamw_step_triton_device(datas, grads, self.exp_avgs, self.exp_avg_sqs, grad_scale=grad_scale, **kw)
        else:
            if grad_scale is not None and grads:  # as clip_grads_ (and torch's clip_grad_norm_) scale them
                torch._foreach_mul_(grads, grad_scale.to(grads[0].dtype))
            # the CPU: torch's fused kernel, as ``step`` runs it (bit for bit torch.optim.AdamW(fused=True));
            # CUDA tensors under the reference backend: the multi-tensor form
            update = adamw_step_device if datas[0].is_cuda else adamw_step_fused_cpu
            update(datas, grads, self.exp_avgs, self.exp_avg_sqs, **kw)
        if have_copies:
            for i, c in enumerate(self.copies):
                if c is not None:
                    self._record_copy(i)

    def sync_step_count(self) -> int:
        """Read the device step count into ``step_count`` (after ``step_device``; a host read)."""
        if self.step_tensor is not None:
            self.step_count = int(self.step_tensor)
        return self.step_count

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    # -- state (saved as safetensors + JSON by xtrain.train.checkpoint) -----------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for n, m, v in zip(self.names, self.exp_avgs, self.exp_avg_sqs):
            out[f"exp_avg.{n}"] = m
            out[f"exp_avg_sq.{n}"] = v
        return out

    def state_meta(self) -> dict:
        return {
            "step": self.step_count,
            "lr": self.lr,
            "betas": list(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "no_decay": [n for n, wd in zip(self.names, self.weight_decays) if wd == 0.0],
        }

    def check_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping, source: str = "optimizer state"):
        """Raise ValueError naming ``source`` if the state does not fit these parameters."""
        want = set(self.state_tensors())
        have = set(tensors)
        if want != have:
            missing, extra = sorted(want - have)[:5], sorted(have - want)[:5]
            raise ValueError(
                f"{source}: tensor names do not match the model's parameters (missing {missing}, unexpected {extra})"
            )
        for n, p in zip(self.names, self.params):
            for k in (f"exp_avg.{n}", f"exp_avg_sq.{n}"):
                if tuple(tensors[k].shape) != tuple(p.shape):
                    raise ValueError(
                        f"{source}: {k} has shape {tuple(tensors[k].shape)}, parameter has {tuple(p.shape)}"
                    )
        step = meta.get("step")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"{source}: 'step' must be an integer >= 0, got {step!r}")

    def load_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping, source: str = "optimizer state"):
        self.check_state(tensors, meta, source)
        for n, m, v in zip(self.names, self.exp_avgs, self.exp_avg_sqs):
            m.copy_(tensors[f"exp_avg.{n}"])
            v.copy_(tensors[f"exp_avg_sq.{n}"])
        self.step_count = int(meta["step"])
        if self.step_tensor is not None:
            self.step_tensor.fill_(float(self.step_count))
