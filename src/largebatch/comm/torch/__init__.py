"""AdaComp for PyTorch: a DDP communication hook, and the same exchange simulated in one process.

The compression is :mod:`largebatch.comm.reference`'s (Chen et al. 2018, arXiv 1712.02679,
Algorithm 1), on float32 (or float64) tensors::

    from largebatch.comm.torch import AdaCompState, adacomp_hook
    model = DistributedDataParallel(net)
    state = AdaCompState(model, warmup_steps=100)
    model.register_comm_hook(state, adacomp_hook)
    ...
    torch.save({"model": ..., "adacomp": state.state_dict()}, f"ckpt-rank{rank}.pt")

:func:`local_clip_hook` (:class:`LocalClipState`) is the other hook here: each process
clips its own gradients, and the all-reduce sums them, as the LAMB authors' TPU code does.

What the AdaComp hook does with each gradient bucket DDP hands it (``bucket.parameters()`` gives
the layers; the tensor fusion is DDP's own buckets, ``bucket_cap_mb``):

- **Warm-up.** The first ``warmup_steps`` iterations are DDP's default all-reduce, and
  no residual is touched.
- **Which layers.** Weights of rank 3 or more (convolutions) are compressed with bins of
  ``conv_bin`` elements, rank 2 (fully connected) with ``fc_bin``; biases and normalization
  parameters (rank 0 or 1) are all-reduced uncompressed, as DDP's default hook does it
  (divided by the world size, then summed).
- **Residuals** are kept per parameter (by name), so DDP's rebuilding of its buckets after
  the first iteration moves nothing; :meth:`AdaCompState.state_dict` holds them for the
  checkpoint and :meth:`~AdaCompState.load_state_dict` refuses a different world size,
  rank, form or setting.
- **Exchange.** ``form="allgather"``: every rank all-gathers every rank's compressed
  message (indices with one sign bit, packed into as few bytes as the layer size needs,
  and one scale per layer), decodes them in rank order and divides by the world size;
  each rank receives ``world - 1`` messages, so it stops paying off at large worlds.
  ``form="two_phase"``: each layer is cut into one chunk of whole bins per rank; an
  all-to-all sends each rank its chunk of everyone's message, the owner averages it and
  compresses the average again with a residual of its own, and an all-gather of the
  re-compressed chunks finishes the exchange: each rank's traffic stays about twice its
  compressed message whatever the world size. ``form="auto"`` picks the cheaper of the
  two for the model's size and the world size, once, at construction.
- **Non-finite gradients** (an fp16 overflow that a ``GradScaler`` will skip): if any rank
  has one in the bucket, every rank all-reduces the bucket uncompressed so the scaler sees
  the inf, and no residual changes.
- **Bytes.** :attr:`AdaCompState.stats` counts, per kind of layer, the elements, the
  selected elements, and the bytes this rank put into the collectives, against the bytes
  of the uncompressed all-reduce's input.

The hook runs its collectives synchronously and returns a completed future: simple and
exact, at the cost of not overlapping the compressed buckets' exchange with the rest of
the backward pass.

:class:`SimulatedWorkers` runs the same exchange for ``n`` workers inside one process (one
residual per worker, the same encoding, the same rank-order sums): a two-process gloo run
with the hook and the simulation give the same parameters bit for bit (tested), which is
what lets the batch-size study measure AdaComp's accuracy on one machine.
"""

from largebatch.comm.reference import FORMS
from largebatch.comm.torch._clip import LocalClipState, local_clip_hook
from largebatch.comm.torch._compress import Compressed, compress
from largebatch.comm.torch._hook import AdaCompState, adacomp_hook
from largebatch.comm.torch._simulation import SimulatedWorkers, simulate_step

# Importable from here too: the kinds of layer the byte counts are kept by, the hook's
# default network for form="auto" and its choice of form, and the reference's and the
# scaling model's settings and helpers the modules above use.
from largebatch.comm.reference import (
    CONV_BIN as CONV_BIN, FC_BIN as FC_BIN, bin_length as bin_length,
    check_options as check_options, chunk_bounds as chunk_bounds, fit_bin as fit_bin,
)
from largebatch.comm.costs import DEFAULT_LINK as DEFAULT_LINK, choose_form as choose_form
from largebatch.comm.torch._codec import KINDS as KINDS
from largebatch.comm.torch._hook import DEFAULT_NETWORK as DEFAULT_NETWORK, _choose_form as _choose_form

__all__ = ["FORMS", "AdaCompState", "Compressed", "LocalClipState", "SimulatedWorkers",
           "adacomp_hook", "compress", "local_clip_hook", "simulate_step"]
