"""largebatch: train image models with 8K-64K minibatches, in PyTorch and JAX.

Import the framework you use: ``largebatch.torch`` or ``largebatch.jax``; the
schedules live in ``largebatch.schedules``. This module imports neither framework.
"""

__version__ = "0.1.0"
