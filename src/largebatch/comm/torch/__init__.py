"""AdaComp for PyTorch: a DDP communication hook (:class:`AdaCompState`, :func:`adacomp_hook`),
the same exchange simulated in one process (:class:`SimulatedWorkers`), and per-process
clipping (:func:`local_clip_hook`). Usage: docs/communication.md."""

from largebatch.comm.costs import DEFAULT_LINK as DEFAULT_LINK
from largebatch.comm.costs import choose_form as choose_form

# Importable from here too: the kinds of layer the byte counts are kept by, the hook's
# default network for form="auto" and its choice of form, and the reference's and the
# scaling model's settings and helpers the modules above use.
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
    chunk_bounds as chunk_bounds,
)
from largebatch.comm.reference import (
    fit_bin as fit_bin,
)
from largebatch.comm.torch._clip import LocalClipState, local_clip_hook
from largebatch.comm.torch._codec import KINDS as KINDS
from largebatch.comm.torch._compress import Compressed, compress
from largebatch.comm.torch._hook import DEFAULT_NETWORK as DEFAULT_NETWORK
from largebatch.comm.torch._hook import AdaCompState, adacomp_hook
from largebatch.comm.torch._hook import choose_model_form as choose_model_form
from largebatch.comm.torch._simulation import SimulatedWorkers, simulate_step

__all__ = [
    "FORMS",
    "AdaCompState",
    "Compressed",
    "LocalClipState",
    "SimulatedWorkers",
    "adacomp_hook",
    "compress",
    "local_clip_hook",
    "simulate_step",
]
