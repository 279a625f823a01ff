"""Trust-ratio telemetry: by parameter name, gathered on the device and read on the host
once whatever the number of tensors, on every path; the JAX ratios under jit; and the
training command's logs (metrics.jsonl, TensorBoard)."""

from __future__ import annotations

import pytest
import torch
from cases import TORCH_PATHS
from devices import HostSyncs

from largebatch.torch import LAMB, LARS, named_trust_ratios, param_groups, trust_ratios


def _model(n_tensors: int) -> torch.nn.Module:
    """Linear layers (a weight and a bias each) holding ``n_tensors`` params, with grads."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(n_tensors // 2)])
    model(torch.randn(5, 3)).square().sum().backward()
    return model


def _regrad(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("n_tensors", [4, 40])
@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_named_trust_ratios_read_the_host_once(cls, n_tensors):
    """4 tensors or 40, LAMB's global clipping and a GradScaler's scale included: one read
    of a device value on the host (an SGD's diagnostic ratios too)."""
    model = _model(n_tensors)
    extra = {"max_grad_norm": 1.0} if cls is LAMB else {}
    opt = cls(param_groups(model, 1e-2), lr=0.1, **extra)
    opt.step()  # state and step counts that the ratios read
    with HostSyncs() as syncs:
        named = opt.named_trust_ratios(model, grad_scale=8.0)
    assert len(syncs.record) == 1, syncs.record
    assert list(named) == [n for n, p in model.named_parameters() if p.ndim > 1]  # adapted only
    with HostSyncs() as syncs:
        listed = opt.trust_ratios(grad_scale=8.0)
    assert len(syncs.record) == 1, syncs.record
    assert listed == list(named.values())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with HostSyncs() as syncs:
        diagnostic = named_trust_ratios(sgd, model)
    assert len(syncs.record) == 1, syncs.record
    assert list(diagnostic.values()) == trust_ratios(sgd) and len(diagnostic) == n_tensors // 2


def test_named_trust_ratios_are_the_ratios_each_param_takes():
    """Each name maps to the ratio its own param's step applies (momentum 0: the step is
    ``lr * ratio * (g + wd * w)``); the excluded group has none."""
    model = _model(6)
    lr, wd = 0.5, 1e-2
    opt = LARS(param_groups(model, wd), lr=lr, momentum=0.0, trust_coefficient=0.02)
    for scale in (1.0, 3.0):  # the layers' grads at different scales: different ratios
        for k, layer in enumerate(model):
            layer.weight.grad = scale * (k + 1) * torch.randn_like(layer.weight)
    named = opt.named_trust_ratios(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    params = dict(model.named_parameters())
    assert sorted(named) == ["0.weight", "1.weight", "2.weight"]
    assert len(set(named.values())) == 3
    for name, ratio in named.items():
        w, p = before[name], params[name]
        applied = float((w - p.detach()).norm() / (lr * (p.grad + wd * w).norm()))
        assert ratio == pytest.approx(applied, rel=1e-5), name


def test_lamb_named_trust_ratios_past_freeze_step_are_the_frozen_steps():
    """A frozen v (past ``freeze_step``) is settled on the device: the ratio reported is the
    one the frozen step applies (``w -= lr * ratio * u``, v as it was)."""
    model = _model(4)
    lr, wd, (b1, b2), eps = 0.1, 1e-2, (0.9, 0.999), 1e-6
    opt = LAMB(model.named_parameters(), lr=lr, weight_decay=wd, freeze_step=1)
    for step in range(1, 4):
        _regrad(model, step)
        with HostSyncs() as syncs:
            named = opt.named_trust_ratios()  # names from the groups (torch.optim's param_names)
        assert len(syncs.record) == 1, syncs.record
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    for name, p in model.named_parameters():
        state, w = opt.state[p], before[name]
        u = (state["exp_avg"] / (1 - b1**3)) / ((state["exp_avg_sq"] / (1 - b2)).sqrt() + eps) + wd * w
        torch.testing.assert_close(w - p.detach(), lr * named[name] * u, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("path", ["foreach", "compiled", "fused"])
@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_named_trust_ratios_on_every_path(cls, path):
    """Each path's state (the fused one counts steps on the device) gives the same ratios,
    with one host read; the state comes from a foreach run (no compile, no kernels)."""
    if path == "fused":
        pytest.importorskip("triton")
    model = _model(4)
    extra = {"freeze_step": 1} if cls is LAMB else {}
    ref = cls(model.named_parameters(), lr=0.1, weight_decay=1e-2, **extra, **TORCH_PATHS["foreach"])
    for seed in (1, 2):
        _regrad(model, seed)
        ref.step()
    _regrad(model, 3)
    opt = cls(model.named_parameters(), lr=0.1, weight_decay=1e-2, **extra, **TORCH_PATHS[path])
    opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0][path] is True
    with HostSyncs() as syncs:
        named = opt.named_trust_ratios()
    assert len(syncs.record) == 1, syncs.record
    assert named == ref.named_trust_ratios()
    assert list(named) == [n for n, _ in model.named_parameters()]


def test_named_params_take_the_path_and_names_of_plain_params():
    """``LARS(model.named_parameters())`` resolves the path that the same tensors given
    plainly resolve (a large CPU model: compiled), and a param without a name is named
    in the error."""
    big = torch.nn.Linear(1024, 1025)  # past COMPILE_MIN_NUMEL
    named, plain = LARS(big.named_parameters(), lr=0.1), LARS(big.parameters(), lr=0.1)
    assert named.param_groups[0]["compiled"] is plain.param_groups[0]["compiled"] is True
    assert named.param_groups[0]["param_names"] == ["weight", "bias"]
    model = _model(2)
    opt = LARS(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"param 0 of param group 0 \(shape \(3, 3\)\) has no name"):
        opt.named_trust_ratios()
    assert list(opt.named_trust_ratios(dict(model.named_parameters()))) == ["0.weight", "0.bias"]


# --------------------------------------------------------------------------- JAX

_JAX_SHAPES = {"w": (4, 3), "v": (3, 3, 2), "b": (3,)}  # b: excluded (ndim 1)


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_jax_trust_ratios_under_jit_are_torchs(name):
    """The ratio of each leaf, under jit (traced once for two steps), equals what torch's
    optimizer reports for the same param at the same state; the excluded leaf reads 1.
    LAMB without bias correction: optax takes ``1 - b^t`` in float32 (``1 - b2`` off by
    1.3e-5), torch in float64."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import optax

    from largebatch.jax import exclusion_mask, lamb, lars
    from largebatch.jax import trust_ratios as jax_trust_ratios

    gen = torch.Generator().manual_seed(0)
    weights = {k: torch.randn(s, generator=gen) for k, s in _JAX_SHAPES.items()}
    model = torch.nn.ParameterDict({k: torch.nn.Parameter(w.clone()) for k, w in weights.items()})
    lr, wd = 0.5, 1e-2
    if name == "lars":
        opt = LARS(param_groups(model, wd), lr=lr, momentum=0.9, trust_coefficient=0.02, eps=1e-8)
        jopt = lars(
            lr,
            momentum=0.9,
            weight_decay=wd,
            trust_coefficient=0.02,
            eps=1e-8,
            trust_ratio_mask=exclusion_mask,
        )
    else:
        opt = LAMB(param_groups(model, wd), lr=lr, bias_correction=False)
        jopt = lamb(lr, weight_decay=wd, bias_correction=False, trust_ratio_mask=exclusion_mask)
    params = {k: jnp.asarray(w.numpy()) for k, w in weights.items()}
    state = jopt.init(params)
    traces = []

    def ratios_of(grads, state, params):
        traces.append(1)
        return jax_trust_ratios(jopt, grads, state, params)

    ratios_of = jax.jit(ratios_of)
    for step in range(2):
        for p in model.values():
            p.grad = torch.randn(p.shape, generator=gen) * (step + 1)
        grads = {k: jnp.asarray(p.grad.numpy()) for k, p in model.items()}
        got = ratios_of(grads, state, params)
        want = opt.named_trust_ratios(model)
        assert sorted(want) == ["v", "w"] and float(got["b"]) == 1.0
        for k in want:
            assert float(got[k]) == pytest.approx(want[k], rel=2e-6), (step, k)
        opt.step()
        updates, state = jopt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    assert len(traces) == 1


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_jax_trust_ratios_of_the_fused_path_and_of_masked_chains(name):
    """The ratios are those the first update applies (against the same update with no
    trust ratio: ``lr * ratio * d`` against ``lr * d``); the fused path hands over the same;
    with both masks (the chain then holds two trust-ratio transformations, each on its own
    leaves) too; an optimizer with no trust ratio is a ValueError."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import optax

    from largebatch.jax import exclusion_mask, lamb, lars
    from largebatch.jax import trust_ratios as jax_trust_ratios

    make = lars if name == "lars" else lamb
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * len(_JAX_SHAPES))
    params = {k: jax.random.normal(keys[i], s) for i, (k, s) in enumerate(_JAX_SHAPES.items())}
    grads = {k: jax.random.normal(keys[i + 3], s) for i, (k, s) in enumerate(_JAX_SHAPES.items())}
    masks = dict(trust_ratio_mask=exclusion_mask)
    chain = make(0.1, weight_decay=1e-2, **masks)
    want = jax_trust_ratios(chain, grads, chain.init(params), params)
    plain = make(0.1, weight_decay=1e-2, trust_ratio_mask=lambda p: jax.tree.map(lambda _: False, p),
                 weight_decay_mask=exclusion_mask)  # fmt: skip
    applied, _ = chain.update(grads, chain.init(params), params)
    unscaled, _ = plain.update(grads, plain.init(params), params)
    for k in ("w", "v"):
        ratio = jnp.linalg.norm(applied[k]) / jnp.linalg.norm(unscaled[k])
        assert float(want[k]) == pytest.approx(float(ratio), rel=1e-6), k
    fused = make(0.1, weight_decay=1e-2, fused=True, **masks)
    got = jax_trust_ratios(fused, grads, fused.init(params), params)
    both = make(
        0.1, weight_decay=1e-2, weight_decay_mask=lambda p: {"w": True, "v": False, "b": False}, **masks
    )
    split = jax_trust_ratios(both, grads, both.init(params), params)
    for k in _JAX_SHAPES:
        assert float(got[k]) == pytest.approx(float(want[k]), rel=1e-6), k
    assert float(want["b"]) == float(split["b"]) == 1.0 and float(split["w"]) == float(want["w"])
    assert float(split["v"]) != float(want["v"])  # adapted without its decay
    with pytest.raises(ValueError, match="no trust-ratio transformation"):
        jax_trust_ratios(optax.sgd(0.1), grads, optax.sgd(0.1).init(params), params)
    assert jnp.ndim(want["w"]) == 0


# --------------------------------------------------------------------------- largebatch train


class _FakeWandb:
    """What ``--wandb`` calls of the ``wandb`` package, recorded (wandb is not a dependency)."""

    def __init__(self) -> None:
        import importlib.machinery

        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.logged: list[tuple[dict, int]] = []
        self.init_kwargs: dict = {}
        self.finished = False

    def init(self, **kwargs):
        self.init_kwargs = kwargs
        return self

    def log(self, values, step):
        self.logged.append((values, step))

    def finish(self):
        self.finished = True


def test_train_samples_named_trust_ratios_every_n_steps_and_logs_them(tmp_path, monkeypatch):
    """``--trust-ratio-every 1`` on a 2-step epoch: two samples by name in
    trust_ratios.jsonl (the epoch row's min/median/max from the last), the same numbers
    as TensorBoard events and W&B logs at the run's step, and metrics.jsonl as before."""
    import json
    import statistics

    from largebatch.cli import main as cli

    wandb = _FakeWandb()
    monkeypatch.setitem(__import__("sys").modules, "wandb", wandb)
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        EventAccumulator = None
    board = [] if EventAccumulator is None else ["--tensorboard", str(tmp_path / "tb")]
    out = tmp_path / "run"
    args = ["train", "--recipe", "fmnist-sgd-128", "--subset", "256", "--epochs", "1", "--out", str(out)]
    assert cli([*args, "--trust-ratio-every", "1", "--wandb", "proj", *board]) == 0
    samples = [json.loads(line) for line in (out / "trust_ratios.jsonl").read_text().splitlines()]
    assert [(s["step"], s["epoch"]) for s in samples] == [(1, 0.5), (2, 1.0)]
    assert list(samples[0]["ratios"]) == ["0.weight", "3.weight", "7.weight", "11.weight", "14.weight"]
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "trust_ratios" not in row
    last = list(samples[-1]["ratios"].values())
    assert row["trust_ratio_median"] == statistics.median(last) and row["trust_ratio_max"] == max(last)
    logged = dict((step, values) for values, step in wandb.logged if "trust_ratio/median" in values)
    assert logged[1]["trust_ratio_by_param/3.weight"] == samples[0]["ratios"]["3.weight"]
    assert logged[2]["trust_ratio/min"] == row["trust_ratio_min"]
    assert wandb.init_kwargs["project"] == "proj" and wandb.finished
    assert [values for values, step in wandb.logged if step == 2 and "test_accuracy" in values]
    if EventAccumulator is not None:
        events = EventAccumulator(str(tmp_path / "tb"))
        events.Reload()
        median = events.Scalars("trust_ratio/median")
        assert [e.step for e in median] == [1, 2]
        assert median[-1].value == pytest.approx(row["trust_ratio_median"], rel=1e-6)
        (accuracy,) = events.Scalars("test_accuracy")
        assert (accuracy.step, accuracy.value) == (2, pytest.approx(row["test_accuracy"], rel=1e-6))
        assert "trust_ratio_by_param/0.weight" in events.Tags()["scalars"]


def test_train_refuses_a_logger_that_is_not_installed(tmp_path, monkeypatch, capsys):
    from largebatch.cli import main as cli

    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # an import of it fails
    args = ["train", "--recipe", "fmnist-sgd-128", "--subset", "256", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as err:
        cli([*args, "--wandb", "proj"])
    assert err.value.code == 2
    assert "--wandb writes with wandb, not installed: pip install wandb" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli([*args, "--trust-ratio-every", "0"])
    assert "invalid --trust-ratio-every 0 (must be >= 1)" in capsys.readouterr().err
