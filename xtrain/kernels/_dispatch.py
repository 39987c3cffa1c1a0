"""One rule decides whether a kernel call runs Triton or the plain-torch reference.

Triton runs when every tensor is on CUDA, Triton is loaded, and the backend is not forced to "reference"
(``XTRAIN_KERNELS=reference`` in the environment, or ``with backend("reference")``). Everything else —
CPU tensors, no Triton, the reference forced — runs the reference, which is the oracle for the Triton path.
The backend is per thread: every thread starts with ``XTRAIN_KERNELS`` (default "auto"), and ``backend`` /
``set_backend`` change the calling thread's only. Triton is loaded only where a kernel can run (``_triton_can_run``):
a CPU-only torch leaves it unimported unless the interpreter or ``XTRAIN_KERNELS=triton`` asks for it.

Tests call the private ``*_triton`` launchers directly to check a kernel on CPU through the Triton
interpreter (``TRITON_INTERPRET=1`` must be set before Triton is imported; ``tests/conftest.py`` does it).
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

_BACKENDS = ("auto", "triton", "reference")
_ENV_BACKEND = os.environ.get("XTRAIN_KERNELS", "auto")
if _ENV_BACKEND not in _BACKENDS:
    raise ValueError(f"XTRAIN_KERNELS must be one of {_BACKENDS}, got {_ENV_BACKEND!r}")


class _Backend(threading.local):
    name = _ENV_BACKEND  # each thread starts here


_backend = _Backend()


def _triton_can_run() -> bool:
    """Whether a Triton kernel can run in this process: torch built for CUDA or ROCm, or the CPU interpreter
    (TRITON_INTERPRET=1), or Triton asked for by name (XTRAIN_KERNELS=triton: compiling the kernels for a GPU
    target on a CPU-only torch, ``compile_check``). A CPU-only torch otherwise runs the references alone, and
    does not pay for importing Triton and jitting every kernel module (about half a second of each command's
    start-up, e.g. ``xtrain sample`` on the CPU)."""
    gpu_torch = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
    return gpu_torch or os.environ.get("TRITON_INTERPRET", "0") == "1" or _ENV_BACKEND == "triton"


try:  # Triton is optional: CPU-only installs run the references.
    if not _triton_can_run():
        raise ImportError("no Triton kernel can run in this process")
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


try:  # grid dependency control (programmatic dependent launch): triton >= 3.4, sm_90+
    if not HAVE_TRITON:
        raise ImportError("no Triton")
    from triton.language.extra.cuda.gdc import gdc_launch_dependents, gdc_wait
except Exception:  # pragma: no cover - no Triton or an older one: programmatic dependent launch stays off
    gdc_launch_dependents = gdc_wait = None

_DEVICE_FACTS: dict = {}  # CUDA device index -> (compute capability, SM count), asked once per device


def _device_facts(device) -> tuple:
    device = torch.device(device)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _DEVICE_FACTS:
        props = torch.cuda.get_device_properties(idx)
        _DEVICE_FACTS[idx] = ((props.major, props.minor), props.multi_processor_count)
    return _DEVICE_FACTS[idx]


def capability(device) -> tuple:
    """The CUDA device's compute capability (major, minor), looked up once per device (a host call per launch
    otherwise)."""
    return _device_facts(device)[0]


def sm_count(device) -> int:
    """The CUDA device's number of SMs (persistent grids), looked up once per device."""
    return _device_facts(device)[1]


def pdl_ok(t: torch.Tensor) -> bool:
    """Whether a kernel on ``t``'s device can be launched as a programmatic dependent (``launch_pdl=True``,
    with ``gdc_wait`` in the kernel): a CUDA tensor on an sm_90+ device and a Triton with grid dependency
    control."""
    return gdc_wait is not None and t.is_cuda and capability(t.device)[0] >= 9


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype references compute in: fp64 for fp64 inputs (exact tests), fp32 for everything else."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def get_backend() -> str:
    """The calling thread's kernel backend."""
    return _backend.name


def set_backend(name: str) -> None:
    """Force "reference" or "triton" kernels in the calling thread, or let "auto" pick Triton on CUDA."""
    if name not in _BACKENDS:
        raise ValueError(f"kernel backend must be one of {_BACKENDS}, got {name!r}")
    _backend.name = name


@contextlib.contextmanager
def backend(name: str):
    """Context manager form of set_backend: ``with backend("reference"): ...`` (the calling thread only)."""
    old = _backend.name
    set_backend(name)
    try:
        yield
    finally:
        set_backend(old)


def use_triton(*tensors: torch.Tensor) -> bool:
    """The dispatch rule: Triton on CUDA tensors unless the reference is forced."""
    if _backend.name == "reference" or not HAVE_TRITON:
        return False
    return all(t.is_cuda for t in tensors if isinstance(t, torch.Tensor))


def prefer_fused(t: torch.Tensor) -> bool:
    """The device rule for ops with a fused and a composed form (attention, the LM head + loss): the fused
    form on CUDA tensors (whatever the kernel backend: the fused ops have references of their own), the
    composed form elsewhere. Ops decide with it, so the model has no device branch."""
    return t.is_cuda


_SIDE_STREAMS: dict = {}


def side_stream(device, high_priority: bool = False, which: int = 0) -> torch.cuda.Stream:
    """One extra CUDA stream per device, for a kernel that can overlap another (created on first use).
    The caller makes the side stream wait for the main one before launching on it, and the main stream
    wait for the side one before returning, so everything after (and the caching allocator's reuse of the
    memory both touched) is ordered after both. ``high_priority``: a second side stream, of the highest
    priority CUDA offers: when programs of several kernels wait for a free SM, the hardware starts this
    stream's first, so a chain of small latency-bound kernels on it is not held back by a large bandwidth-
    bound grid running beside it (which, on a stream of equal priority, fills every SM first). ``which``: another
    side stream of that priority (the embedding backward's "tiers" form runs two chains beside its grid)."""
    key = torch.device(device).index
    if key is None:
        key = torch.cuda.current_device()
    key = (key, high_priority, which)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=key[0], priority=-100 if high_priority else 0)
    return _SIDE_STREAMS[key]


def run_side_by_side(
    device, main_launch, side_launch, high_priority: bool = False, main_first: bool = False, join: bool = True
) -> torch.cuda.Event | None:
    """Launch ``side_launch`` on the side stream and ``main_launch`` on the current one, concurrently: the
    side stream first waits for the current one (inputs and buffers ready), and the current one waits for
    the side stream before this returns, so later work on it (and the caching allocator's reuse of the
    memory both read) is ordered after both launches. ``high_priority``: the side stream of the highest
    priority (see ``side_stream``). ``main_first``: the current stream's launch is issued first (the side stream
    still waits only for the work before both). ``join=False``: the current stream does not wait; the side
    launches' end is returned as an event for a later consumer to wait on (the caller keeps the memory they use
    from reuse, e.g. by ``record_stream``)."""
    main = torch.cuda.current_stream(device)
    side = side_stream(device, high_priority=high_priority)
    side.wait_stream(main)
    if main_first:
        main_launch()
    with torch.cuda.stream(side):
        side_launch()
    if not main_first:
        main_launch()
    if join:
        main.wait_stream(side)
        return None
    done = torch.cuda.Event()
    done.record(side)
    return done


def is_per_call(value) -> bool:
    """Whether a launch argument is per-call data for ``CachedLaunch``: a tensor or a tensor descriptor."""
    return isinstance(value, torch.Tensor) or hasattr(value, "block_shape")


class CachedLaunch:
    """One kernel launch that can be repeated without the JIT's per-call work.

    ``kernel[grid](**args)`` binds every argument, specialises it (integer values, pointer alignment), looks
    the compiled kernel up in its cache and only then launches: tens of microseconds of host time per launch
    (38 us for the Gluon forward on the H200, 19 us of it the launch itself). Built by
    ``launch_cached`` from an ordinary launch, this object keeps the compiled kernel, the grid and the
    argument list in the kernel's order, minus the tensors and tensor descriptors: those are per-call data
    (and keeping them would keep their memory alive), so every call must pass each of them again by name,
    and nothing else; the list goes straight to the compiled kernel's launcher on the current stream. It is
    only correct for arguments the kernel was not specialised on differently: the callers key their cached
    launches on everything that decides the specialisation (shapes, strides, dtypes, device, 16-byte
    alignment, constexprs) and pass tensors and descriptors of the same layout."""

    __slots__ = ("ck", "grid", "argv", "slot", "per_call")

    def __init__(self, ck, grid, kernel, args: dict):
        ck._init_handles()
        self.ck = ck
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.argv = [args[p.name] if p.name in args else p.default for p in kernel.params]
        self.slot = {p.name: i for i, p in enumerate(kernel.params)}
        self.per_call = frozenset(n for n, i in self.slot.items() if is_per_call(self.argv[i]))
        for n in self.per_call:
            self.argv[self.slot[n]] = None

    def __call__(self, **per_call) -> None:
        from triton import knobs
        from triton.runtime import driver

        if per_call.keys() != self.per_call:
            raise ValueError(
                f"CachedLaunch: pass exactly the per-call arguments {sorted(self.per_call)}, got {sorted(per_call)}"
            )
        argv = self.argv.copy()
        for name, value in per_call.items():
            argv[self.slot[name]] = value
        ck, grid = self.ck, self.grid
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        ck.run(
            grid[0],
            grid[1],
            grid[2],
            stream,
            ck.function,
            ck.packed_metadata,
            ck.launch_metadata(grid, stream, *argv),
            knobs.runtime.launch_enter_hook,
            knobs.runtime.launch_exit_hook,
            *argv,
        )


def launch_cached(kernel, grid, args: dict, **options) -> CachedLaunch:
    """Launch ``kernel[grid](**args, **options)`` the ordinary way and return its ``CachedLaunch``."""
    ck = kernel[grid](**args, **options)
    return CachedLaunch(ck, grid, kernel, args)


def rebased(desc, base):
    """A copy of the tensor descriptor ``desc`` over ``base`` (same shape, strides, block and layout): the
    constructor's checks were passed by ``desc``, and ``base`` is a tensor of the same layout (or None: a
    template that holds no tensor)."""
    d = object.__new__(type(desc))
    d.__dict__.update(desc.__dict__)
    d.base = base
    return d


class PlanCache(dict):
    """Cached launch plans by key, dropped wholesale past ``limit`` entries (a new shape per call would
    otherwise grow it without bound). ``lookup`` counts the calls it served (``hits``) and the keys it had no
    plan for (``misses``: the calls that took the full path where a plan was possible), so a test or a bench
    sees whether a plan ran instead of patching the full path."""

    def __init__(self, limit: int = 64):
        super().__init__()
        self.limit = limit
        self.hits = 0
        self.misses = 0

    def lookup(self, key):
        """The plan of ``key`` (counted in ``hits``), or None (counted in ``misses``); a None key (no plan
        possible) is None and counts in neither."""
        if key is None:
            return None
        plan = self.get(key)
        if plan is None:
            self.misses += 1
        else:
            self.hits += 1
        return plan

    def put(self, key, plan) -> None:
        if len(self) >= self.limit:
            self.clear()
        self[key] = plan
