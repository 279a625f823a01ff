"""Time one optimizer step on a real model's parameter shapes, provider against provider.

    python benchmarks/optimizer_step.py                      # ResNet-50, CPU (make bench)
    python benchmarks/optimizer_step.py --model bert-large --device cuda --json out.json
    python benchmarks/optimizer_step.py --precision fp16 --providers "ours,timm"

Every provider updates the same tensors (random weights and gradients, fixed seed) in
one process: our LARS and LAMB on each path (per-tensor loop, ``torch._foreach_*``,
the compiled CPU path, and the fused Triton kernels on CUDA), timm's ``Lars``/``Lamb``,
torch-optimizer's ``Lamb``, optax's ``lars``/``lamb`` under ``jax.jit``, on CUDA apex's
``FusedLAMB`` (where apex is built) and torch's fused ``AdamW`` and momentum ``SGD``
(``fused=True``: no trust ratio, the same bytes as LAMB and LARS), and plain foreach
momentum SGD as a floor. Each runs warmup steps, then the median of ``--steps``
timed steps is reported as ms/step and as effective bandwidth: the fewest bytes a step
must move per parameter (each tensor read or written once),

    SGD-momentum, LARS: read w, g, v; write w, v     = 20 B  (fp32)
    LAMB:               read w, g, m, v; write w, m, v = 28 B  (fp32)

(fp16 params with fp32 masters move the same 20 and 28 B: fp16 g and param, fp32
master and state) divided by the time, next to the copy bandwidth measured here
(``dst.copy_(src)`` on a large tensor, bytes read + written). ``launches`` counts what
one step launches (torch profiler): CUDA kernels on a GPU, operator calls on the CPU.
``vs ours`` is ms/step over our default path on the device (compiled on the CPU, fused
on CUDA) of the same family (SGD against LARS); above 1 is slower than ours.

A provider is one row of :data:`PROVIDERS`; adding one is adding a row.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

Shapes = list[tuple[int, ...]]
Step = Callable[[], None]

BYTES_PER_PARAM = {"sgd": 20, "lars": 20, "lamb": 28}
# "vs ours" divides by our default path on the device: compiled on the CPU, fused on CUDA.
BASELINE = {
    "cpu": {"sgd": "ours LARS compiled", "lars": "ours LARS compiled", "lamb": "ours LAMB compiled"},
    "cuda": {"sgd": "ours LARS fused", "lars": "ours LARS fused", "lamb": "ours LAMB fused"},
}
# The same hyperparameters for every provider of a family (weight decay on, so that every
# provider takes its full path; timm's Lars adapts only when weight_decay != 0).
LR, MOMENTUM, LARS_WD, LAMB_WD = 1.0, 0.9, 1e-4, 0.01


# --------------------------------------------------------------------------- shapes


def resnet50_shapes() -> Shapes:
    """The 161 parameter shapes of torchvision's ResNet-50 (25.6M params); timm's, the
    same shapes in the same order, where torchvision is not installed."""
    try:
        import torchvision
    except ImportError:
        import timm

        return [tuple(p.shape) for p in timm.create_model("resnet50").parameters()]
    return [tuple(p.shape) for p in torchvision.models.resnet50().parameters()]


def bert_large_shapes() -> Shapes:
    """BERT-large's encoder (24 layers, hidden 1024, intermediate 4096), embeddings, pooler.

    Vocabulary 30,522, 512 positions, 2 token types: 391 tensors, 335M params.
    """
    hidden, inter, layers = 1024, 4096, 24
    vector = (hidden,)
    embeddings = [(30522, hidden), (512, hidden), (2, hidden), vector, vector]  # + LayerNorm
    layer = (
        [(hidden, hidden), vector] * 4  # query, key, value, attention output: weight, bias
        + [vector, vector]  # attention LayerNorm
        + [(inter, hidden), (inter,), (hidden, inter), vector]  # feed-forward
        + [vector, vector]  # output LayerNorm
    )
    return embeddings + layer * layers + [(hidden, hidden), vector]  # pooler


MODELS: dict[str, Callable[[], Shapes]] = {
    "resnet50": resnet50_shapes,
    "bert-large": bert_large_shapes,
}


# --------------------------------------------------------------------------- providers


# --precision: the dtype of the params (and grads) every provider updates. In fp16 our
# optimizers keep fp32 master weights (master_weights=True); the peers have no such
# option and update the fp16 params directly.
PRECISION = {"fp32": np.float32, "fp16": np.float16}


def _random_arrays(shapes: Shapes, seed: int, precision: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    dtype = PRECISION[precision]
    weights = [(rng.standard_normal(s, dtype=np.float32) * 0.05).astype(dtype) for s in shapes]
    grads = [(rng.standard_normal(s, dtype=np.float32) * 1e-3).astype(dtype) for s in shapes]
    return weights, grads


def torch_optimizer(factory: Callable[..., torch.optim.Optimizer]):
    """A provider's ``make`` for a torch.optim.Optimizer built by ``factory(params, precision)``."""

    def make(shapes: Shapes, device: str, seed: int, precision: str) -> Step:
        weights, grads = _random_arrays(shapes, seed, precision)
        params = []
        for w, g in zip(weights, grads):
            p = torch.nn.Parameter(torch.from_numpy(w).to(device))
            p.grad = torch.from_numpy(g).to(device)
            params.append(p)
        return factory(params, precision).step

    return make


def foreach_sgd_momentum(shapes: Shapes, device: str, seed: int, precision: str) -> Step:
    """The floor: momentum SGD as three ``torch._foreach_*`` calls, no norms."""
    weights, grads = _random_arrays(shapes, seed, precision)
    ws = [torch.from_numpy(w).to(device) for w in weights]
    gs = [torch.from_numpy(g).to(device) for g in grads]
    vs = [torch.zeros_like(w) for w in ws]

    def step() -> None:
        torch._foreach_mul_(vs, MOMENTUM)
        torch._foreach_add_(vs, gs)
        torch._foreach_add_(ws, vs, alpha=-LR)

    return step


def jax_arrays(shapes: Shapes, device: str, seed: int, precision: str) -> tuple[list, list]:
    """The weights and gradients of :func:`_random_arrays` as JAX arrays on ``device``'s
    platform (``cuda``: the first GPU)."""
    import jax

    target = jax.devices("gpu" if device.startswith("cuda") else "cpu")[0]
    weights, grads = _random_arrays(shapes, seed, precision)
    return [jax.device_put(w, target) for w in weights], [jax.device_put(g, target) for g in grads]


def jitted_update(tx):
    """``(params, state, grads) -> (params, state)`` for the optax transformation ``tx``,
    jitted with the params and state donated."""
    import jax
    import optax

    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(update, donate_argnums=(0, 1))


def optax_jit(factory: Callable[[], object], packed: bool = False):
    """A provider's ``make`` for an optax transformation, jitted with donated params and
    state; ``packed``: params and grads held as ``largebatch.jax.PackedParams``."""

    def make(shapes: Shapes, device: str, seed: int, precision: str) -> Step:
        import jax

        params, gs = jax_arrays(shapes, device, seed, precision)
        if packed:
            from largebatch import jax as lb

            params, gs = lb.PackedParams.pack(params), lb.PackedParams.pack(gs)
        tx = factory()
        jitted = jitted_update(tx)
        carry = [params, tx.init(params)]

        def step() -> None:
            carry[0], carry[1] = jitted(carry[0], carry[1], gs)
            jax.block_until_ready(carry[0])

        return step

    return make


def _ours(name: str, **kwargs):
    def factory(params, precision):
        from largebatch import torch as lb

        return getattr(lb, name)(params, master_weights=precision != "fp32", **kwargs)

    return torch_optimizer(factory)


_LOOP = dict(foreach=False, compiled=False, fused=False)
_FOREACH = dict(foreach=True, compiled=False, fused=False)
_COMPILED = dict(compiled=True, fused=False)
_FUSED = dict(fused=True)


def _moved_grads(make_eager):
    """A provider's ``make`` whose grads are new tensors at every step, two sets in turn
    (``zero_grad()``'s default gives grads at new addresses): the step the fused path
    takes when it cannot replay its last one (the grads' swap is timed with it)."""

    def make(shapes: Shapes, device: str, seed: int, precision: str) -> Step:
        factory_step = make_eager(shapes, device, seed, precision)
        opt = factory_step.__self__
        params = [p for g in opt.param_groups for p in g["params"]]
        sets = [[p.grad for p in params], [p.grad.clone() for p in params]]
        turn = [0]

        def step() -> None:
            turn[0] ^= 1
            for p, g in zip(params, sets[turn[0]]):
                p.grad = g
            factory_step()

        step.optimizer = opt  # type: ignore[attr-defined]  # for the tests
        return step

    return make


def _graphed(make_eager):
    """A provider's ``make`` that captures ``make_eager``'s step in a CUDA graph once (after
    warm-up steps on a side stream: state, plan and kernels exist) and times its replay:
    the kernels alone, without the host's share of a step (``benchmarks/fused_host.py``)."""

    def make(shapes: Shapes, device: str, seed: int, precision: str) -> Step:
        eager = make_eager(shapes, device, seed, precision)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                eager()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        return graph.replay

    return make


def _timm(name: str, **kwargs):
    def factory(params, precision):
        import timm.optim

        return getattr(timm.optim, name)(params, **kwargs)

    return torch_optimizer(factory)


def _torch_optimizer_lamb(params, precision):
    import torch_optimizer

    return torch_optimizer.Lamb(params, lr=LR, weight_decay=LAMB_WD)


def _torch_fused(name: str, **kwargs):
    """torch.optim's own fused CUDA kernels (``fused=True``): no trust ratio, the same
    traffic as the family it stands beside (AdamW: LAMB's; SGD-momentum: LARS's)."""

    def factory(params, precision):
        return getattr(torch.optim, name)(params, fused=True, **kwargs)

    return torch_optimizer(factory)


def _apex_lamb(params, precision):
    from apex.optimizers import FusedLAMB

    return FusedLAMB(params, lr=LR, weight_decay=LAMB_WD)


def _optax(name: str, **kwargs):
    def factory():
        import optax

        return getattr(optax, name)(learning_rate=LR, **kwargs)

    return optax_jit(factory)


def _packed_lars(**kwargs):
    def factory():
        from jax_packed import packed_lars

        return packed_lars(LR, **kwargs)

    return optax_jit(factory)


def _packed_rows(pallas: bool):
    """LARS on params and grads kept packed by the caller (benchmarks/jax_packed.py): the
    step without packing or slicing, what a fused JAX path costs at best."""

    def make(shapes: Shapes, device: str, seed: int, precision: str) -> Step:
        import jax
        from jax_packed import pack, packed_rows_step

        weights, grads = jax_arrays(shapes, device, seed, precision)
        (w, owner), (g, _) = pack(weights), pack(grads)

        def update(w, v, g):
            v = packed_rows_step(w, g, v, owner, len(shapes), LR, MOMENTUM, LARS_WD, 0.001, pallas)
            return w - v, v

        jitted = jax.jit(update, donate_argnums=(0, 1))
        carry = [w, jax.numpy.zeros_like(w)]

        def step() -> None:
            carry[0], carry[1] = jitted(carry[0], carry[1], g)
            jax.block_until_ready(carry[0])

        return step

    return make


def _ours_jax(name: str, **kwargs):
    def factory():
        from largebatch import jax as lb

        return getattr(lb, name)(LR, **kwargs)

    return optax_jit(factory)


def _ours_packed(name: str, **kwargs):
    """Ours with ``fused=True`` on params kept packed (``largebatch.jax.PackedParams``):
    the step without packing the grads and params or slicing the updates."""

    def factory():
        from largebatch import jax as lb

        return getattr(lb, name)(LR, fused=True, **kwargs)

    return optax_jit(factory, packed=True)


@dataclasses.dataclass(frozen=True)
class Provider:
    name: str
    family: str  # "sgd", "lars" or "lamb": bytes per param and the baseline of "vs ours"
    make: Callable[[Shapes, str, int, str], Step]  # (shapes, device, seed, precision) -> one step
    needs: str = "torch"  # the module it imports; a provider whose module is missing is skipped
    cuda_only: str = ""  # why it runs on CUDA only (empty: it runs anywhere)


_TRITON = "runs on CUDA only (the CPU runs its kernels only in Triton's interpreter)"
_APEX = "apex's fused kernels are CUDA kernels"
_PALLAS = "Pallas kernels compile on a GPU (the CPU only interprets them)"
_PEER = "timed beside the fused kernels, on CUDA runs only"
_LARS = dict(lr=LR, momentum=MOMENTUM, weight_decay=LARS_WD)
_LAMB = dict(lr=LR, weight_decay=LAMB_WD)
PROVIDERS: list[Provider] = [
    Provider("ours LARS loop", "lars", _ours("LARS", **_LARS, **_LOOP)),
    Provider("ours LARS foreach", "lars", _ours("LARS", **_LARS, **_FOREACH)),
    Provider("ours LARS compiled", "lars", _ours("LARS", **_LARS, **_COMPILED)),
    Provider("ours LARS fused", "lars", _ours("LARS", **_LARS, **_FUSED), needs="triton", cuda_only=_TRITON),
    Provider(
        "ours LARS in a CUDA graph",
        "lars",
        _graphed(_ours("LARS", **_LARS, **_FUSED)),
        needs="triton",
        cuda_only=_TRITON,
    ),
    Provider(
        "ours LARS moved grads (Triton)",
        "lars",
        _moved_grads(_ours("LARS", **_LARS, **_FUSED)),
        needs="triton",
        cuda_only=_TRITON,
    ),
    Provider("timm Lars", "lars", _timm("Lars", **_LARS), needs="timm"),
    Provider(
        "optax lars (jit)", "lars", _optax("lars", weight_decay=LARS_WD, momentum=MOMENTUM), needs="optax"
    ),
    Provider(
        "ours lars (jax, jit)",
        "lars",
        _ours_jax("lars", weight_decay=LARS_WD, momentum=MOMENTUM, fused=False),
        needs="optax",
    ),
    # An experiment: the same LARS on one packed buffer (benchmarks/jax_packed.py).
    Provider(
        "lars packed (jax, jit)", "lars", _packed_lars(weight_decay=LARS_WD, momentum=MOMENTUM), needs="optax"
    ),
    Provider(
        "lars packed (jax, pallas)",
        "lars",
        _packed_lars(weight_decay=LARS_WD, momentum=MOMENTUM, pallas=True),
        needs="optax",
        cuda_only=_PALLAS,
    ),
    Provider("lars on packed rows (jax, jit)", "lars", _packed_rows(pallas=False), needs="optax"),
    Provider(
        "lars on packed rows (jax, pallas)",
        "lars",
        _packed_rows(pallas=True),
        needs="optax",
        cuda_only=_PALLAS,
    ),
    # The fused JAX path (lars(..., fused=True)): Pallas kernels on a GPU; on the CPU their
    # bodies as XLA over all rows.
    Provider(
        "ours lars (pallas)",
        "lars",
        _ours_jax("lars", weight_decay=LARS_WD, momentum=MOMENTUM, fused=True),
        needs="optax",
    ),
    Provider(
        "ours lars, params packed (pallas)",
        "lars",
        _ours_packed("lars", weight_decay=LARS_WD, momentum=MOMENTUM),
        needs="optax",
    ),
    Provider("ours LAMB loop", "lamb", _ours("LAMB", **_LAMB, **_LOOP)),
    Provider("ours LAMB foreach", "lamb", _ours("LAMB", **_LAMB, **_FOREACH)),
    Provider("ours LAMB compiled", "lamb", _ours("LAMB", **_LAMB, **_COMPILED)),
    Provider("ours LAMB fused", "lamb", _ours("LAMB", **_LAMB, **_FUSED), needs="triton", cuda_only=_TRITON),
    Provider(
        "ours LAMB in a CUDA graph",
        "lamb",
        _graphed(_ours("LAMB", **_LAMB, **_FUSED)),
        needs="triton",
        cuda_only=_TRITON,
    ),
    Provider(
        "ours LAMB moved grads (Triton)",
        "lamb",
        _moved_grads(_ours("LAMB", **_LAMB, **_FUSED)),
        needs="triton",
        cuda_only=_TRITON,
    ),
    Provider("timm Lamb", "lamb", _timm("Lamb", **_LAMB, max_grad_norm=None), needs="timm"),
    Provider("torch-optimizer Lamb", "lamb", torch_optimizer(_torch_optimizer_lamb), needs="torch_optimizer"),
    Provider("optax lamb (jit)", "lamb", _optax("lamb", weight_decay=LAMB_WD), needs="optax"),
    Provider(
        "ours lamb (jax, jit)", "lamb", _ours_jax("lamb", weight_decay=LAMB_WD, fused=False), needs="optax"
    ),
    Provider(
        "ours lamb (pallas)", "lamb", _ours_jax("lamb", weight_decay=LAMB_WD, fused=True), needs="optax"
    ),
    Provider(
        "ours lamb, params packed (pallas)", "lamb", _ours_packed("lamb", weight_decay=LAMB_WD), needs="optax"
    ),
    # apex's fused optimizers need its compiled extension (amp_C), not only its Python package.
    Provider("apex FusedLAMB", "lamb", torch_optimizer(_apex_lamb), needs="amp_C", cuda_only=_APEX),
    Provider(
        "torch AdamW fused", "lamb", _torch_fused("AdamW", lr=LR, weight_decay=LAMB_WD), cuda_only=_PEER
    ),
    Provider(
        "torch SGD-momentum fused",
        "sgd",
        _torch_fused("SGD", lr=LR, momentum=MOMENTUM, weight_decay=LARS_WD),
        cuda_only=_PEER,
    ),
    Provider("foreach SGD-momentum (floor)", "sgd", foreach_sgd_momentum),
]


# --------------------------------------------------------------------------- timing


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def time_steps(step: Step, device: str, warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def launches_per_step(step: Step, device: str) -> int | None:
    """Kernels launched by one step (torch profiler): CUDA kernels on a GPU; on the CPU,
    operator calls (top-level ``aten::`` ops and compiled-graph calls)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    events = prof.events()
    if device.startswith("cuda"):
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    ops = [e for e in events if e.name.startswith("aten::") or "Compiled" in e.name]
    inside = {id(c) for e in ops for c in e.cpu_children}
    return sum(1 for e in ops if id(e) not in inside) or None


def copy_bandwidth(device: str, nbytes: int = 256 << 20, repeats: int = 10) -> float:
    """Bytes read + written per second by ``dst.copy_(src)`` on a ``nbytes`` fp32 tensor."""
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = statistics.median(time_steps(lambda: dst.copy_(src), device, warmup=2, steps=repeats))
    return 2 * nbytes / seconds


def _available(module: str) -> str | None:
    try:
        __import__(module)
    except Exception as err:  # noqa: BLE001 - any import failure means "skip this provider"
        return f"{type(err).__name__}: {err}"
    return None


def _jax_has(device: str) -> str | None:
    import jax

    platform_name = "gpu" if device.startswith("cuda") else "cpu"
    try:
        jax.devices(platform_name)
    except RuntimeError:
        return f"jax has no {platform_name} backend"
    return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = (line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
            return next(names)
    except (OSError, StopIteration):
        return platform.processor()


def _versions() -> dict[str, str]:
    found = {}
    for dist in ("torch", "triton", "timm", "torch-optimizer", "apex", "jax", "optax"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def run(
    model: str,
    device: str,
    steps: int,
    warmup: int,
    names: list[str] | None,
    rounds: int = 1,
    seed: int = 0,
    precision: str = "fp32",
) -> dict:
    """Time every selected provider; return the results as a JSON-ready dict.

    With ``rounds > 1`` the whole sweep repeats (each provider rebuilt and warmed up
    again) and each median is over all rounds' steps, so that a burst of load from
    other processes is shared among the providers instead of landing on one.
    """
    shapes = MODELS[model]()
    n_params = sum(int(np.prod(s)) for s in shapes)
    wanted = [n.lower() for n in names or []]
    selected = [p for p in PROVIDERS if not wanted or any(n in p.name.lower() for n in wanted)]
    if not selected:
        known = ", ".join(p.name for p in PROVIDERS)
        raise SystemExit(f"--providers {','.join(names)} matches none of: {known}")
    skipped = {}
    for provider in selected:
        why = _available(provider.needs)
        if why is None and provider.needs == "optax":
            why = _jax_has(device)
        if why is None and provider.cuda_only and not device.startswith("cuda"):
            why = provider.cuda_only
        if why is not None:
            skipped[provider.name] = why
    runnable = [p for p in selected if p.name not in skipped]
    times: dict[str, list[float]] = {p.name: [] for p in runnable}
    launches: dict[str, int | None] = {}
    copy_bws = []
    for r in range(rounds):
        copy_bws.append(copy_bandwidth(device))
        for provider in runnable:
            if provider.name in skipped:  # failed in an earlier round
                continue
            try:
                step = provider.make(shapes, device, seed, precision)
                times[provider.name] += time_steps(step, device, warmup, steps)
            except Exception as error:  # noqa: BLE001 - one provider failing is a row of the report
                skipped[provider.name] = f"failed: {type(error).__name__}: {error}"
                print(f"  {provider.name} failed: {error!r}", file=sys.stderr, flush=True)
                continue
            if r == 0:
                launches[provider.name] = (
                    launches_per_step(step, device) if provider.needs != "optax" else None
                )
            del step
            gc.collect()
            ms = statistics.median(times[provider.name][-steps:]) * 1e3
            print(f"  round {r + 1}/{rounds} {provider.name}: {ms:.2f} ms", file=sys.stderr, flush=True)
    copy_bw = statistics.median(copy_bws)
    rows = []
    for provider in runnable:
        if provider.name in skipped:
            continue
        seconds = statistics.median(times[provider.name])
        gb_s = BYTES_PER_PARAM[provider.family] * n_params / seconds / 1e9
        rows.append(
            dict(
                provider=provider.name,
                family=provider.family,
                ms=seconds * 1e3,
                gb_s=gb_s,
                copy_fraction=gb_s * 1e9 / copy_bw,
                launches=launches.get(provider.name),
            )
        )
    ms = {r["provider"]: r["ms"] for r in rows}
    baseline = BASELINE["cuda" if device.startswith("cuda") else "cpu"]
    for r in rows:
        base = ms.get(baseline[r["family"]])
        r["vs_ours"] = r["ms"] / base if base else None
    return dict(
        model=model,
        tensors=len(shapes),
        params=n_params,
        device=device,
        precision=precision,
        device_name=(torch.cuda.get_device_name(device) if device.startswith("cuda") else _cpu_name()),
        torch_threads=torch.get_num_threads(),
        steps=steps,
        warmup=warmup,
        rounds=rounds,
        copy_gb_s=copy_bw / 1e9,
        versions=_versions(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        rows=rows,
        skipped=skipped,
    )


def format_table(res: dict) -> str:
    """The results as a header line and a Markdown table."""
    lines = [
        f"{res['model']}: {res['tensors']} tensors, {res['params'] / 1e6:.1f}M {res['precision']} params, "
        f"{res['device']} ({res['device_name']}), {res['torch_threads']} torch threads; "
        f"median of {res['rounds']} x {res['steps']} steps (each round after "
        f"{res['warmup']} warmup steps); copy bandwidth {res['copy_gb_s']:.1f} GB/s",
        "",
        f"| {'provider':<30} | {'B/param':>7} | {'ms/step':>8} | {'GB/s':>6} | {'of copy':>7} "
        f"| {'launches':>8} | {'vs ours':>7} |",
        f"|{'-' * 32}|{'-' * 8}:|{'-' * 9}:|{'-' * 7}:|{'-' * 8}:|{'-' * 9}:|{'-' * 8}:|",
    ]
    for r in res["rows"]:
        ratio = f"{r['vs_ours']:.2f}x" if r["vs_ours"] is not None else "-"
        launches = r["launches"] if r["launches"] is not None else "-"
        lines.append(
            f"| {r['provider']:<30} | {BYTES_PER_PARAM[r['family']]:>7} | {r['ms']:>8.2f} | "
            f"{r['gb_s']:>6.2f} | {r['copy_fraction']:>7.0%} | {launches:>8} | {ratio:>7} |"
        )
    for name, why in res["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet50")
    parser.add_argument(
        "--steps", type=int, default=10, help="timed steps per provider (default %(default)s)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the sweep; medians over all rounds (default %(default)s)",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default %(default)s)")
    parser.add_argument(
        "--precision",
        choices=sorted(PRECISION),
        default="fp32",
        help="param dtype; fp16 gives our optimizers fp32 masters (default %(default)s)",
    )
    parser.add_argument(
        "--providers", default=None, help="comma-separated substrings of provider names to run (default: all)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch and XLA (default: torch's default, all cores)",
    )
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the results to OUT")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error(
            f"--steps and --rounds must be >= 1 and --warmup >= 0 "
            f"(got {args.steps}, {args.rounds}, {args.warmup})"
        )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available to torch here")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1 (got {args.threads})")
        torch.set_num_threads(args.threads)
        if args.threads == 1:  # read when jax is first imported, which happens later
            os.environ["XLA_FLAGS"] = (
                os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
            ).strip()
    names = [n for n in args.providers.split(",") if n] if args.providers else None
    result = run(
        args.model, args.device, args.steps, args.warmup, names, rounds=args.rounds, precision=args.precision
    )
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
