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
