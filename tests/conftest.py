"""Test set-up shared by every test file.

Without CUDA, Triton kernels are checked through the Triton interpreter (fp32 only: the interpreter's
bf16 is not trustworthy). TRITON_INTERPRET must be set before Triton is first imported, so it is set
here, before any test module imports xtrain. Subprocesses get this checkout first on PYTHONPATH.
"""

import os

import pytest


def _threads_per_worker() -> int | None:
    """Under pytest-xdist, the cores this process may use divided among the workers (at least 1); None otherwise.
    Each worker's torch would otherwise start one intra-op thread per core, and so would every process its tests
    start: 2 workers on 2 cores run 4 or more spinning threads, and a test then takes several times longer."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // workers)


# Set before torch is first imported (it reads OMP_NUM_THREADS then); processes the tests start inherit it. A value
# the user set is kept.
_THREADS = _threads_per_worker()
if _THREADS is not None:
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


HAS_CUDA = _has_cuda()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Processes the tests start (data-parallel workers, the CLI, run from a temporary directory) import the xtrain of
# this checkout, not whichever xtrain is installed: a script's own directory or the cwd comes first on sys.path,
# and an editable install may point at another checkout.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _own_seed(request):
    """Every test's unseeded draws (torch.randn without a generator, random.random) come from generators seeded
    from the test's own id: the same inputs whatever ran before it, or whether -k or xdist picked it (a failure
    is reproducible). crc32, not hash(): str hashes change from one process to the next."""
    import random
    import zlib

    import torch

    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)


@pytest.fixture
def corpus(tmp_path):
    """A small real-text corpus: the source of a few stdlib modules, cut into 60 documents (fewer than 100, so
    its validation part is the tail of the text: see xtrain/data/corpus.py)."""
    import inspect
    import json
    import pathlib

    d = tmp_path / "corpus"
    d.mkdir()
    src = "".join(inspect.getsource(m)[:40_000] for m in (json, pathlib, inspect))
    for i in range(60):
        (d / f"doc{i:02d}.py").write_text(src[i * 2000 : (i + 1) * 2000])
    return d


@pytest.fixture(scope="session")
def cli_base(tmp_path_factory):
    """A prepared corpus and a finished 2-step tiny run, built once per test process and shared by the
    command-line fault tests (tests/test_cli_faults.py, test_preemption.py, test_disk_faults.py):
    {"dir": workdir, "data": prepared data dir, "run": the run} (tests/_cli.py make_base). A test copies what it
    changes; the tests that only read it check that it did not change."""
    from tests._cli import make_base

    return make_base(tmp_path_factory.mktemp("cli_base"))


@pytest.fixture(autouse=True)
def _fresh_attention_plans():
    """Each test starts with no cached attention launch plans (attention._FWD_PLANS / _BWD_PLANS): a
    test that watches which function the dispatcher calls would otherwise get an earlier test's plan, which
    launches the kernels without calling it. tests/test_flash_plans.py checks the plans themselves."""
    import sys

    fa = sys.modules.get("xtrain.kernels.attention")
    if fa is not None:
        fa._FWD_PLANS.clear()
        fa._BWD_PLANS.clear()
    yield


@pytest.fixture
def default_sigint():
    """SIGINT raises KeyboardInterrupt for the test's duration (``signal.default_int_handler``), whatever this
    process inherited: a background job, ``nohup`` or some CI runners start it with SIGINT ignored, and Python
    then installs no handler. The inherited disposition is put back after the test."""
    import signal

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
