"""xtrain: a from-scratch LLM training stack you can read end to end.

``Var`` and the tape live in ``xtrain.autograd``; differentiable ops in ``xtrain.ops``; kernels (plain-torch
references and Triton) in ``xtrain.kernels``.
"""

from xtrain.autograd import Var, checkpoint, enable_grad, no_grad

__version__ = "0.1.0"
__all__ = ["Var", "checkpoint", "enable_grad", "no_grad", "__version__"]
