"""xtrain: a from-scratch LLM training stack you can read end to end.

``Var`` and the tape live in ``xtrain.autograd``; differentiable ops in ``xtrain.ops``; kernels (plain-torch
references and Triton) in ``xtrain.kernels``. The names below are imported on first use, so
``import xtrain.micro`` (the scalar engine) does not pull in torch.
"""

__version__ = "0.1.0"
__all__ = ["Var", "checkpoint", "enable_grad", "no_grad", "__version__"]


def __getattr__(name):
    if name in ("Var", "checkpoint", "enable_grad", "no_grad"):
        from xtrain import autograd

        return getattr(autograd, name)
    raise AttributeError(f"module 'xtrain' has no attribute {name!r}")
