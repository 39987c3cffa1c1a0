"""Kernels: pure functions on torch tensors, each with a plain-torch reference and (where it pays) Triton.

Kernels know nothing of ``Var`` or the tape. See ``_dispatch`` for the rule that picks Triton or the reference.
"""

from xtrain.kernels._dispatch import HAVE_TRITON, backend, get_backend, set_backend, use_triton

__all__ = ["HAVE_TRITON", "backend", "get_backend", "set_backend", "use_triton"]
