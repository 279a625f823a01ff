"""Communication for data-parallel training; importing this package loads no framework.
:mod:`~largebatch.comm.reference` states AdaComp in float64 NumPy (the spec);
:mod:`~largebatch.comm.torch` is its DDP communication hook, :mod:`~largebatch.comm.jax` its
optax transformation for ``shard_map``; :mod:`~largebatch.comm.costs` and
:mod:`~largebatch.comm.scaling` model step time and scaling efficiency, set against
:mod:`~largebatch.comm.published` scaling points."""
