"""Test-wide settings that must exist before torch, triton or jax is imported.

- TRITON_INTERPRET=1: the Triton kernels run on the CPU (the interpreter is chosen when a
  ``@triton.jit`` function is defined, so this must come first).
- The interpreter's listing of Triton's builtins and its NumPy dtypes kept from one launch
  to the next (tests/triton_interpreter.py).
- 8 host CPU devices for the JAX sharding tests, and XLA's CPU code built without its
  costlier LLVM passes (the JAX tests compile many small functions once each).

The CUDA mode, ``LARGEBATCH_CUDA_TESTS=1`` (``make gpu-check``): ``TRITON_INTERPRET`` is
removed, so the kernels are compiled for the GPU, and the tests marked ``gpu`` run; in the
default mode they are skipped. The fused path's CPU tests need the interpreter: in the
CUDA mode run the ``gpu`` tests (``pytest -m gpu``), whose cases put the same checks on
CUDA tensors (tests/devices.py).
"""

import os
import shutil
import tempfile

CUDA_MODE = os.environ.get("LARGEBATCH_CUDA_TESTS") == "1"
if CUDA_MODE:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")
_xla = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _xla:
    _xla += " --xla_force_host_platform_device_count=8"
if not CUDA_MODE and "xla_backend_optimization_level" not in _xla:
    # The CPU code XLA compiles for the tests, built without LLVM's costlier passes: a
    # quarter less time in the JAX tests, which compile many small functions once each.
    # What is computed is the same (every JAX test holds to its reference as before).
    _xla += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = _xla.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if not CUDA_MODE:
    import triton_interpreter

    triton_interpreter.install()  # the interpreter faster (tests/triton_interpreter.py)


def pytest_addoption(parser):
    parser.addoption(
        "--first-cases",
        action="store_true",
        help="the inner loop (make test-fast): each test function with its first "
        "parametrization only; make test runs every case",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gpu: needs a CUDA GPU and the compiled kernels: runs only with "
        "LARGEBATCH_CUDA_TESTS=1 (make gpu-check), skipped otherwise",
    )


_SUBPROCESS_TMP: list[tuple[str, str | None]] = []


def pytest_sessionstart(session):
    """The processes the tests start (torchrun and its workers, pools, commands) write
    their temporary files into a folder of this session's, removed when it ends: torchrun
    leaves a log folder in the temporary folder at each launch. This process's own
    temporary files, pytest's tmp_path among them, stay where they were."""
    tempfile.gettempdir()  # fixed for this process before TMPDIR changes
    folder = tempfile.mkdtemp(prefix="largebatch-tests-")
    _SUBPROCESS_TMP.append((folder, os.environ.get("TMPDIR")))
    os.environ["TMPDIR"] = folder


def pytest_sessionfinish(session):
    while _SUBPROCESS_TMP:
        folder, before = _SUBPROCESS_TMP.pop()
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(folder, ignore_errors=True)


def _gpu_skip():
    """Why the ``gpu`` tests cannot run here, or None."""
    if not CUDA_MODE:
        return "needs a CUDA GPU: set LARGEBATCH_CUDA_TESTS=1 on a GPU machine (make gpu-check)"
    import torch

    if not torch.cuda.is_available():
        return "LARGEBATCH_CUDA_TESTS=1 but torch sees no CUDA GPU"
    return None


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests are skipped outside the CUDA mode. With ``--first-cases``, keep one
    case of each test function: its first that runs neither the Triton interpreter nor
    torch.compile (``fused``/``compiled`` in its id), or its first. Every function still
    runs once; the combinations (paths x cases x dtypes) are left to ``make test``."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    why = _gpu_skip() if gpu else None
    if why is not None:
        import pytest

        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=why))
    if not config.getoption("--first-cases"):
        return
    chosen: dict[str, object] = {}
    for item in items:
        function = item.nodeid.split("[", 1)[0]
        if function not in chosen or (_heavy(chosen[function]) and not _heavy(item)):
            chosen[function] = item
    kept = set(map(id, chosen.values()))
    dropped = [item for item in items if id(item) not in kept]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if id(item) in kept]


def _heavy(item) -> bool:
    """A case on the Triton interpreter or torch.compile: seconds where others take less."""
    case = item.nodeid.partition("[")[2]
    return any(token in ("fused", "compiled") for token in case.rstrip("]").replace("_", "-").split("-"))
