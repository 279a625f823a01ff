"""Communication for data-parallel training: AdaComp gradient compression and a scaling model.

- :mod:`largebatch.comm.reference`: the float64 NumPy statement of AdaComp (the spec).
- :mod:`largebatch.comm.torch`: the DDP communication hook (``AdaCompState``, ``adacomp_hook``).
- :mod:`largebatch.comm.jax`: the same compressor for ``shard_map`` and optax.
- :mod:`largebatch.comm.scaling`: step time and scaling efficiency of the all-reduce forms.
- :mod:`largebatch.comm.published`: the published scaling points the model is set against.

Importing this package loads no framework.
"""
