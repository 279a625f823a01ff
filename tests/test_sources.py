"""Every published source against every path: ``largebatch.lars.sources``' keywords make
LARS and LAMB take the source's own update (``source_ports.py``) step for step.

The problem is a small network's params: a conv weight, a zero-initialised weight, a
weight whose gradient is zero at every step, batch-norm scale and shift, a classifier
weight and bias; 20 steps in float64 while the rate warms up and decays. Each source
splits the params its own way (``SPLITS``). The ports run against the float64 spec and
the torch loop, foreach and fused (Triton's interpreter) paths and JAX; the compiled
path shares the loop's per-tensor body and is held to the spec for the same keywords
by ``tests/cases.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import source_ports as ports
import torch
from cases import drive, run_spec, torch_paths

from largebatch.lars.sources import SOURCES, source_keywords

SHAPES = {
    "conv": (3, 2, 3, 3),
    "zero": (5, 4),
    "still": (2, 3),
    "bn.weight": (3,),
    "bn.bias": (3,),
    "fc.weight": (4, 6),
    "fc.bias": (4,),
}
ZERO_INIT, ZERO_GRAD = "zero", "still"
STEPS = 20
# Warmup to a peak above 1 (where LARC's clip of a fallback ratio would show), then poly 2.
LRS = [2.5 * (t + 1) / 5 for t in range(5)] + [2.5 * (1 - (t - 4) / 16) ** 2 + 1e-3 for t in range(5, STEPS)]
WD = {"lars": 5e-3, "lamb": 0.05}
MOMENTUM = 0.9

# (adapted, decayed) per param kind: weights, batch norm, the classifier's bias.
WEIGHTS_ONLY = {"weight": (True, True), "bn": (False, False), "fc_bias": (False, False)}
SPLITS = {
    "mlperf-tf": WEIGHTS_ONLY,
    "nvidia-mxnet": {"weight": (True, True), "bn": (False, False), "fc_bias": (False, True)},
    "apex-larc": {"weight": (True, True), "bn": (True, True), "fc_bias": (True, True)},
    "timm": WEIGHTS_ONLY,
    "optax": WEIGHTS_ONLY,
    "lamb-authors": {"weight": (True, True), "bn": (False, False), "fc_bias": (True, True)},
    # Groups by weight decay alone: the trust ratio follows it (adapt_without_decay=False).
    "apex-fusedlamb": {"weight": (True, True), "bn": (True, False), "fc_bias": (True, False)},
    "timm-lamb": {"weight": (True, True), "bn": (True, False), "fc_bias": (True, False)},
    "tfa": WEIGHTS_ONLY,
}
PORTS = {
    "mlperf-tf": lambda *a, **k: ports.mlperf_tf_lars(*a, **k, momentum=MOMENTUM),
    "nvidia-mxnet": lambda *a, **k: ports.nvidia_mxnet_lars(*a, **k, momentum=MOMENTUM),
    "apex-larc": lambda *a, **k: ports.apex_larc_sgd(*a, **k, momentum=MOMENTUM),
    "timm": lambda *a, **k: ports.timm_lars(*a, **k, momentum=MOMENTUM),
    "optax": lambda *a, **k: ports.optax_lars(*a, **k, momentum=MOMENTUM),
    "lamb-authors": ports.lamb_authors,
    "apex-fusedlamb": ports.apex_fused_lamb,
    "timm-lamb": ports.apex_fused_lamb,  # the same steps at timm's defaults (its docstring)
    "tfa": ports.tfa_lamb,
}
PORTED = list(PORTS)
TORCH_PATHS = torch_paths("single_tensor", "foreach", "fused")
# Each element against the largest of its tensor, before or after (a step may cancel a
# tensor to rounding noise, as cases.assert_matches allows): float64; the fused kernels take
# float32 (cases.TOLERANCE's), from the same float32-rounded inputs as the port.
RTOL = {torch.float64: 1e-9, torch.float32: 2e-5}
# The fused rows (Triton's interpreter) take the warmup past its peak of 2.5 and three
# steps of the decay: the kernels read the rate and the step count as data, so the later
# steps run the same code, which the loop and foreach rows run for all STEPS.
FUSED_STEPS = 8


def kind(name: str) -> str:
    return "bn" if name.startswith("bn.") else "fc_bias" if name == "fc.bias" else "weight"


def problem(seed: int = 0) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s) * 0.5 for s in SHAPES.values()]
    params[list(SHAPES).index("bn.weight")] = np.ones(3)
    params[list(SHAPES).index(ZERO_INIT)] = np.zeros(SHAPES[ZERO_INIT])
    grads = [[rng.standard_normal(s) * 0.05 for s in SHAPES.values()] for _ in range(STEPS)]
    for g in grads:
        g[list(SHAPES).index(ZERO_GRAD)] = np.zeros(SHAPES[ZERO_GRAD])
    return params, grads


def flags(source: str) -> tuple[list[bool], list[bool]]:
    split = SPLITS[source]
    return [split[kind(n)][0] for n in SHAPES], [split[kind(n)][1] for n in SHAPES]


def port(source: str, params, grads) -> list[np.ndarray]:
    adapt, decay = flags(source)
    return PORTS[source](params, grads, LRS, adapt=adapt, decay=decay, wd=WD[SOURCES[source].optimizer])


def hypers(source: str) -> list[dict]:
    """Each param's hyperparameters in the spec's names: the source's keywords, its split."""
    optimizer = SOURCES[source].optimizer
    keywords = source_keywords(source)
    keywords.pop("max_grad_norm", None)
    if optimizer == "lars":
        keywords["momentum"] = MOMENTUM
    adapt, decay = flags(source)
    return [
        {**keywords, "trust_ratio": a, "weight_decay": WD[optimizer] if d else 0.0}
        for a, d in zip(adapt, decay)
    ]


def assert_close(
    actual: list[np.ndarray], expected: list[np.ndarray], start: list[np.ndarray], dtype=torch.float64
) -> None:
    rtol = RTOL[dtype]
    for name, a, e, s in zip(SHAPES, actual, expected, start):
        scale = max(np.max(np.abs(e)), np.max(np.abs(s)))
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale, err_msg=name)


def run_torch(source: str, params, grads, dtype=torch.float64, **paths) -> list[np.ndarray]:
    from largebatch.torch import LAMB, LARS

    optimizer = SOURCES[source].optimizer
    ts = [torch.tensor(p, dtype=dtype, requires_grad=True) for p in params]
    groups: dict[tuple, dict] = {}
    for t, h in zip(ts, hypers(source)):
        key = (h["trust_ratio"], h["weight_decay"])
        group = groups.setdefault(key, {"params": [], "trust_ratio": key[0], "weight_decay": key[1]})
        group["params"].append(t)
    keywords = source_keywords(source)
    if optimizer == "lars":
        keywords["momentum"] = MOMENTUM
    opt = (LARS if optimizer == "lars" else LAMB)(list(groups.values()), lr=LRS[0], **keywords, **paths)
    drive(opt, ts, grads, LRS)
    return [t.detach().double().numpy() for t in ts]


def run_jax(source: str, params, grads) -> list[np.ndarray]:
    import jax
    import jax.numpy as jnp
    import optax

    from largebatch.jax import lamb, lars

    optimizer = SOURCES[source].optimizer
    adapt, decay = flags(source)
    keywords = source_keywords(source, framework="jax")
    if optimizer == "lars":
        keywords["momentum"] = MOMENTUM
    schedule = optax.piecewise_constant_schedule(LRS[0], {t: LRS[t] / LRS[t - 1] for t in range(1, STEPS)})
    make = lars if optimizer == "lars" else lamb
    opt = make(
        schedule, weight_decay=WD[optimizer], trust_ratio_mask=adapt, weight_decay_mask=decay, **keywords
    )
    with jax.enable_x64(True):
        ws = [jnp.asarray(p, jnp.float64) for p in params]
        state = opt.init(ws)
        for gs in grads:
            updates, state = opt.update([jnp.asarray(g, jnp.float64) for g in gs], state, ws)
            ws = optax.apply_updates(ws, updates)
        return [np.asarray(w, np.float64) for w in ws]


@pytest.fixture(scope="module")
def data() -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    return problem()


@pytest.mark.parametrize("source", PORTED)
def test_the_spec_takes_the_sources_update(data, source):
    params, grads = data
    optimizer = SOURCES[source].optimizer
    max_grad_norm = source_keywords(source).get("max_grad_norm")
    expected = port(source, params, grads)
    got = run_spec(optimizer, params, grads, hypers(source), LRS, max_grad_norm)
    assert_close(got.params, expected, params)


@pytest.mark.parametrize("path", list(TORCH_PATHS))
@pytest.mark.parametrize("source", PORTED)
def test_torch_takes_the_sources_update(data, source, path):
    params, grads = data
    dtype = torch.float32 if path == "fused" else torch.float64
    if path == "fused":
        grads = grads[:FUSED_STEPS]
    if dtype != torch.float64:  # the port starts from the same rounded inputs
        params = [p.astype(np.float32).astype(np.float64) for p in params]
        grads = [[g.astype(np.float32).astype(np.float64) for g in gs] for gs in grads]
    actual = run_torch(source, params, grads, dtype=dtype, **TORCH_PATHS[path])
    assert_close(actual, port(source, params, grads), params, dtype)


@pytest.mark.parametrize("source", PORTED)
def test_jax_takes_the_sources_update(data, source):
    params, grads = data
    assert_close(run_jax(source, params, grads), port(source, params, grads), params)


@pytest.mark.parametrize(
    "source, default",
    [
        ("nvidia-mxnet", {"lr_in_momentum": True}),  # the rate inside the buffer: MLPerf TF's
        ("apex-larc", {"zero_norm_skip": False}),  # the clipped fallback ratio, decay at zero norms
        ("optax", {"decayed_norm": False}),  # ||g|| + wd * ||w|| in place of ||g + wd * w||
        ("lamb-authors", {"bias_correction": True}),
        ("apex-fusedlamb", {"adapt_without_decay": True}),
    ],
)
def test_without_the_sources_keyword_the_update_differs(data, source, default):
    """The keywords matter: the package's default in their place leaves the source's
    numbers (each of these is a difference the ports found)."""
    params, grads = data
    optimizer = SOURCES[source].optimizer
    changed = [{**h, **default} for h in hypers(source)]
    got = run_spec(optimizer, params, grads, changed, LRS, source_keywords(source).get("max_grad_norm"))
    expected = port(source, params, grads)
    worst = max(np.max(np.abs(g - e)) / max(np.max(np.abs(e)), 1e-300) for g, e in zip(got.params, expected))
    assert worst > 1e-3


def test_mlperf_tf_keywords_reproduce_the_tf1_copy_and_eps_1e7_its_tf2_variant(data):
    """The row's keywords (eps=0) take the steps of the TF1 reference, which uses eps as
    given; its TF2 copy replaces a zero eps by Keras's 1e-7, whose steps eps=1e-7 takes."""
    params, grads = data
    adapt, decay = flags("mlperf-tf")

    def tf(eps: float) -> list[np.ndarray]:
        return ports.mlperf_tf_lars(
            params, grads, LRS, adapt=adapt, decay=decay, wd=WD["lars"], momentum=MOMENTUM, eps=eps
        )

    def ours(eps: float) -> list[np.ndarray]:
        return run_spec(
            "lars", params, grads, [{**h, "eps": eps} for h in hypers("mlperf-tf")], LRS, None
        ).params

    assert "tensorflow/official/resnet/mlperf_lars_optimizer.py" in SOURCES["mlperf-tf"].where
    assert source_keywords("mlperf-tf")["eps"] == 0.0
    assert_close(ours(0.0), tf(0.0), params)
    assert_close(ours(1e-7), tf(1e-7), params)
    with pytest.raises(AssertionError):  # the two copies are told apart at this tolerance
        assert_close(ours(0.0), tf(1e-7), params)


def _nvidia_model() -> torch.nn.Module:
    """Conv, BN, conv, BN, then a classifier with a bias: MXNet's fp16 list (the convs and
    the classifier) and fp32 list (the batch norms) interleave in this order."""
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, bias=False),
        nn.BatchNorm2d(3),
        nn.Conv2d(3, 2, 1, bias=False),
        nn.BatchNorm2d(2),
        nn.Flatten(),
        nn.Linear(2, 4),
    )


@pytest.mark.parametrize("aggregate_num", [2, 3, 54])
@pytest.mark.parametrize("path", ["single_tensor", "foreach"])
def test_the_nvidia_groups_take_mxnets_first_call_momentum_correction(aggregate_num, path):
    """The NVIDIA recipes' groups (``decay_exclude="nvidia"``) take the steps of NVIDIA's
    MXNet LARS called as MXNet's Updater calls it, ``aggregate_num`` params a call: the
    momentum correction only in the first call of each step. 2 leaves a conv weight and
    the classifier's weight out of it, 3 the classifier's bias, 54 (NVIDIA's) none of the
    fp16 params; the batch norms are never in it."""
    from largebatch.recipes.build import decay_groups, mxnet_first_update
    from largebatch.torch import LARS

    model = _nvidia_model().double()
    named = list(model.named_parameters())
    rng = np.random.default_rng(1)
    start = [rng.standard_normal(p.shape) * 0.5 for _, p in named]
    grads = [[rng.standard_normal(p.shape) * 0.05 for _, p in named] for _ in range(STEPS)]
    with torch.no_grad():
        for (_, p), value in zip(named, start):
            p.copy_(torch.from_numpy(value))
    is_bn = [name[0] in "13" for name, _ in named]
    is_fc_bias = [name == "5.bias" for name, _ in named]
    expected = ports.nvidia_mxnet_lars_chunked(
        start,
        grads,
        LRS,
        adapt=[not (b or f) for b, f in zip(is_bn, is_fc_bias)],
        decay=[not b for b in is_bn],
        dtypes=["float32" if b else "float16" for b in is_bn],
        aggregate_num=aggregate_num,
        wd=WD["lars"],
        momentum=MOMENTUM,
    )
    first = {id(p) for p in mxnet_first_update(model, aggregate_num)}
    assert [id(p) in first for _, p in named] == {
        2: [True, False, False, True, False, False, False, False],
        3: [True, False, False, True, False, False, True, False],
        54: [True, False, False, True, False, False, True, True],
    }[aggregate_num]
    groups = decay_groups(model, WD["lars"], "nvidia", aggregate_num=aggregate_num)
    keywords = {**source_keywords("nvidia-mxnet"), "momentum": MOMENTUM}
    opt = LARS(groups, lr=LRS[0], **keywords, **TORCH_PATHS[path])
    params = [p for _, p in named]
    drive(opt, params, grads, LRS)
    got = [p.detach().numpy() for p in params]
    assert_close(got, expected, start)
    # Every group corrected (the source's keywords alone) is another run.
    uniform = [{**g, "lr_in_momentum": False} for g in groups]
    with torch.no_grad():
        for p, value in zip(params, start):
            p.copy_(torch.from_numpy(value))
    drive(LARS(uniform, lr=LRS[0], **keywords, **TORCH_PATHS[path]), params, grads, LRS)
    with pytest.raises(AssertionError):
        assert_close([p.detach().numpy() for p in params], expected, start)


def test_resnet50s_first_mxnet_call_is_the_54_params_lars_adapts():
    """With NVIDIA's aggregation of 54, ResNet-50's first update call holds its 53 conv
    weights and the fc weight, which the recipes' first group adapts and corrects; the
    batch norms and the fc bias take lr_in_momentum=True."""
    from largebatch.recipes.build import build_model, decay_groups, mxnet_first_update

    model = build_model("resnet50", 1000)
    first = mxnet_first_update(model)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight") and p.ndim > 1]
    assert len(first) == 54 and [id(p) for p in first] == [id(p) for p in weights]
    groups = decay_groups(model, 2.5e-5, "nvidia")
    assert [
        (len(g["params"]), g.get("trust_ratio", True), g["weight_decay"], g.get("lr_in_momentum"))
        for g in groups
    ] == [(54, True, 2.5e-5, None), (106, False, 0.0, True), (1, False, 2.5e-5, True)]


def test_every_source_is_ported_or_says_why_not():
    # optax's own lamb is run against ours in test_jax_conventions.
    assert set(SOURCES) - set(PORTS) == {"optax-lamb"}


def test_an_unknown_source_names_the_known_ones():
    with pytest.raises(ValueError, match="Unknown source 'larc'; known: mlperf-tf"):
        source_keywords("larc")
    with pytest.raises(ValueError, match="Invalid framework: 'flax'"):
        source_keywords("timm", framework="flax")


def test_the_docs_table_states_every_sources_keywords():
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "sources.md").read_text()
    for name, source in SOURCES.items():
        row = next(line for line in page.splitlines() if line.startswith(f"| `{name}` |"))
        for key, value in source.keywords.items():
            assert f"{key}={value}" in row if isinstance(value, bool) else f"{key}=" in row, (name, key)


@pytest.mark.parametrize("runner", ["spec", "single_tensor", "foreach", "fused", "jax"])
def test_apex_fused_lamb_options(data, runner, monkeypatch):
    """FusedLAMB's L2 mode without gradient averaging, with use_nvlamb (the trust ratio on
    the groups without decay too): adam_w_mode=False, grad_averaging=False,
    adapt_without_decay=True."""
    params, grads = data
    options = {"adam_w_mode": False, "grad_averaging": False, "adapt_without_decay": True}
    monkeypatch.setitem(
        PORTS,
        "apex-fusedlamb",
        lambda *a, **k: ports.apex_fused_lamb(
            *a, **k, adam_w_mode=False, grad_averaging=False, use_nvlamb=True
        ),
    )
    keywords = source_keywords
    monkeypatch.setattr(
        "test_sources.source_keywords",
        lambda name, framework="torch": {**keywords(name, framework), **options},
    )
    if runner == "spec":
        got = run_spec("lamb", params, grads, hypers("apex-fusedlamb"), LRS, 1.0).params
        dtype = torch.float64
    elif runner == "jax":
        got, dtype = run_jax("apex-fusedlamb", params, grads), torch.float64
    else:
        dtype = torch.float32 if runner == "fused" else torch.float64
        if runner == "fused":
            grads = grads[:FUSED_STEPS]
        if dtype != torch.float64:
            params = [p.astype(np.float32).astype(np.float64) for p in params]
            grads = [[g.astype(np.float32).astype(np.float64) for g in gs] for gs in grads]
        got = run_torch("apex-fusedlamb", params, grads, dtype=dtype, **TORCH_PATHS[runner])
    assert_close(got, port("apex-fusedlamb", params, grads), params, dtype)


@pytest.mark.parametrize("runner", ["spec", "foreach"])
def test_apex_larc_options(data, runner, monkeypatch):
    """LARC(clip=False) around SGD(nesterov=True): trust_clip=False, nesterov=True
    (docs/migrating.md's mapping of LARC's arguments)."""
    params, grads = data
    options = {"trust_clip": False, "nesterov": True}
    monkeypatch.setitem(
        PORTS,
        "apex-larc",
        lambda *a, **k: ports.apex_larc_sgd(*a, **k, momentum=MOMENTUM, clip=False, nesterov=True),
    )
    keywords = source_keywords
    monkeypatch.setattr(
        "test_sources.source_keywords",
        lambda name, framework="torch": {**keywords(name, framework), **options},
    )
    if runner == "spec":
        got = run_spec("lars", params, grads, hypers("apex-larc"), LRS, None).params
    else:
        got = run_torch("apex-larc", params, grads, **TORCH_PATHS[runner])
    assert_close(got, port("apex-larc", params, grads), params)


def test_the_sgd_recipes_take_goyal_et_als_corrected_momentum(data):
    """The SGD recipes (resnet50-goyal-8k, fmnist-sgd-*) step with torch.optim.SGD, whose
    buffer keeps the rate outside (Goyal et al.'s eq. (9)): the same steps as eq. (10)
    with the momentum correction, while the rate warms up and decays."""
    params, grads = data
    ts = [torch.tensor(p, requires_grad=True) for p in params]
    opt = torch.optim.SGD(ts, lr=LRS[0], momentum=MOMENTUM, weight_decay=WD["lars"])
    drive(opt, ts, grads, LRS)
    expected = ports.goyal_corrected_momentum(params, grads, LRS, wd=WD["lars"], momentum=MOMENTUM)
    assert_close([t.detach().numpy() for t in ts], expected, params)
