"""One rule decides whether a kernel call runs Triton or the plain-torch reference.

Triton runs when every tensor is on CUDA, Triton imports, and the backend is not forced to "reference"
(``XTRAIN_KERNELS=reference`` in the environment, or ``set_backend("reference")``). Everything else —
CPU tensors, no Triton, the reference forced — runs the reference, which is the oracle for the Triton path.

Tests call the private ``*_triton`` launchers directly to check a kernel on CPU through the Triton
interpreter (``TRITON_INTERPRET=1`` must be set before Triton is imported; ``tests/conftest.py`` does it).
"""

from __future__ import annotations

import contextlib
import os

import torch

_BACKENDS = ("auto", "triton", "reference")
_backend = os.environ.get("XTRAIN_KERNELS", "auto")
if _backend not in _BACKENDS:
    raise ValueError(f"XTRAIN_KERNELS must be one of {_BACKENDS}, got {_backend!r}")

try:  # Triton is optional: CPU-only installs run the references.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
    jit = triton.jit
except Exception:  # pragma: no cover - depends on the install
    HAVE_TRITON = False
    triton = tl = None

    def jit(fn=None, **kw):
        """Stand-in for triton.jit on installs without Triton: the kernels are defined, never launched."""
        return fn if fn is not None else (lambda f: f)


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype references compute in: fp64 for fp64 inputs (exact tests), fp32 for everything else."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def get_backend() -> str:
    return _backend


def set_backend(name: str) -> None:
    """Force "reference" or "triton" kernels, or let "auto" pick Triton on CUDA."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"kernel backend must be one of {_BACKENDS}, got {name!r}")
    _backend = name


@contextlib.contextmanager
def backend(name: str):
    """Context manager form of set_backend: ``with backend("reference"): ...``."""
    old = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(old)


def use_triton(*tensors: torch.Tensor) -> bool:
    """The dispatch rule: Triton on CUDA tensors unless the reference is forced."""
    if _backend == "reference" or not HAVE_TRITON:
        return False
    return all(t.is_cuda for t in tensors if isinstance(t, torch.Tensor))


_SIDE_STREAMS: dict = {}


def side_stream(device, high_priority: bool = False) -> torch.cuda.Stream:
    """One extra CUDA stream per device, for a kernel that can overlap another (created on first use).
    The caller makes the side stream wait for the main one before launching on it, and the main stream
    wait for the side one before returning, so everything after (and the caching allocator's reuse of the
    memory both touched) is ordered after both. ``high_priority``: a second side stream, of the highest
    priority CUDA offers: when programs of several kernels wait for a free SM, the hardware starts this
    stream's first, so a chain of small latency-bound kernels on it is not held back by a large bandwidth-
    bound grid running beside it (which, on a stream of equal priority, fills every SM first)."""
    key = torch.device(device).index
    if key is None:
        key = torch.cuda.current_device()
    key = (key, high_priority)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=key[0], priority=-100 if high_priority else 0)
    return _SIDE_STREAMS[key]


def run_side_by_side(device, main_launch, side_launch) -> None:
    """Launch ``side_launch`` on the side stream and ``main_launch`` on the current one, concurrently: the
    side stream first waits for the current one (inputs and buffers ready), and the current one waits for
    the side stream before this returns, so later work on it (and the caching allocator's reuse of the
    memory both read) is ordered after both launches."""
    main = torch.cuda.current_stream(device)
    side = side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        side_launch()
    main_launch()
    main.wait_stream(side)
