"""Test-wide settings that must exist before torch, triton or jax is imported.

- TRITON_INTERPRET=1: the Triton kernels run on the CPU (the interpreter is chosen when a
  ``@triton.jit`` function is defined, so this must come first).
- 8 host CPU devices for the JAX sharding tests.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
_xla = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _xla:
    os.environ["XLA_FLAGS"] = (_xla + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_addoption(parser):
    parser.addoption(
        "--first-cases", action="store_true",
        help="the inner loop (make test-fast): each test function with its first "
             "parametrization only; make test runs every case",
    )


def pytest_collection_modifyitems(config, items):
    """With ``--first-cases``, keep the first collected case of each test function: every
    function still runs once, the combinations (paths x cases x dtypes) are left to
    ``make test``."""
    if not config.getoption("--first-cases"):
        return
    seen: set[str] = set()
    kept, dropped = [], []
    for item in items:
        function = item.nodeid.split("[", 1)[0]
        (dropped if function in seen else kept).append(item)
        seen.add(function)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
