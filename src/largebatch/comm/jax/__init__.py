"""AdaComp for JAX: the compressor with static shapes, its exchanges inside ``jax.shard_map``,
and an optax transformation to chain before the optimizer (docs/communication.md)."""

from largebatch.checks import AxisName as AxisName
from largebatch.comm.jax._compress import (
    DEFAULT_BIN_CAPACITY,
    AdaCompMessage,
    chunk_length,
    compress,
    decode,
    default_capacity,
)
from largebatch.comm.jax._exchange import allgather_mean, two_phase_mean
from largebatch.comm.jax._transform import (
    AdaCompState,
    adacomp,
    adacomp_init_state,
    adacomp_state_specs,
)

# Importable from here too: the reference's settings and helpers the modules above use.
from largebatch.comm.reference import (
    CONV_BIN as CONV_BIN,
)
from largebatch.comm.reference import (
    FC_BIN as FC_BIN,
)
from largebatch.comm.reference import FORMS
from largebatch.comm.reference import (
    bin_length as bin_length,
)
from largebatch.comm.reference import (
    check_options as check_options,
)
from largebatch.comm.reference import (
    fit_bin as fit_bin,
)

__all__ = [
    "DEFAULT_BIN_CAPACITY",
    "FORMS",
    "AdaCompMessage",
    "AdaCompState",
    "adacomp",
    "adacomp_init_state",
    "adacomp_state_specs",
    "allgather_mean",
    "chunk_length",
    "compress",
    "decode",
    "default_capacity",
    "two_phase_mean",
]
