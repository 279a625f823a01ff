"""The hooks into timm, Hugging Face's Trainer and PyTorch Lightning
(``largebatch.integrations``), their examples (examples/hf_trainer.py,
examples/lightning_module.py) and the blocks of docs/migrating.md that need transformers
or lightning. Each library's tests run where it is installed."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch
from test_docs_examples import blocks
from torch import nn

from largebatch.integrations import make_optimizer, named_trust_ratios, optimizer_and_scheduler
from largebatch.schedules import make_schedule
from largebatch.torch import LAMB, LARS, param_groups, trust_ratios

ROOT = Path(__file__).resolve().parents[1]
PAGE = "docs/migrating.md"


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def page_blocks(library: str) -> list[str]:
    """The blocks of docs/migrating.md that this file runs, for ``library``."""
    found = [code for code, where in blocks(PAGE) if where and "tests/test_integrations.py" in where]
    return [code for code in found if f"import {library}" in code or f"from {library}" in code]


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)
    )


def settings(opt: torch.optim.Optimizer) -> dict[int, tuple[float, bool]]:
    """Each param's (weight decay, trust ratio) by its id."""
    return {id(p): (g["weight_decay"], g["trust_ratio"]) for g in opt.param_groups for p in g["params"]}


# --------------------------------------------------------------------------- any framework


def test_named_trust_ratios_name_what_trust_ratios_gives():
    model = small_model()
    groups = param_groups(model, 0.01)
    groups[0]["params"].append(groups[1]["params"].pop())  # the Linear bias adapted too
    cases = [
        LARS(groups, lr=1.0, weight_decay=0.01),
        LAMB(param_groups(model, 0.0), lr=1e-3, adapt_without_decay=False),  # no group adapts
        torch.optim.SGD(model.parameters(), lr=0.1),
    ]
    nn.functional.cross_entropy(model(torch.randn(2, 3, 8, 8)), torch.tensor([0, 3])).backward()
    model[0].weight.grad = None  # a param without a grad is left out
    expected = [["4.weight", "4.bias"], [], ["4.weight"]]
    for opt, names in zip(cases, expected):
        named = named_trust_ratios(opt, model)
        assert list(named) == names, type(opt).__name__
        assert list(named.values()) == trust_ratios(opt)
    with pytest.raises(
        ValueError, match=r"param 1 of param group 0 \(shape \(5, 144\)\) has no name in the Linear"
    ):
        named_trust_ratios(cases[0], nn.Linear(1, 1))  # names from a module that lacks them


def test_optimizer_and_scheduler_groups_and_schedule():
    model = small_model()
    schedule = make_schedule("poly", peak_lr=2.0, total_steps=4, warmup_steps=2)
    opt, sched = optimizer_and_scheduler(model, "lamb", schedule, weight_decay=0.01, eps=1e-8)
    assert isinstance(opt, LAMB) and opt.defaults["eps"] == 1e-8
    assert settings(opt) == settings(LAMB(param_groups(model, 0.01), weight_decay=0.01))
    lrs = []
    for applied in (True, False, True, True):  # a step skipped (AMP) leaves the rate
        lrs.append(opt.param_groups[0]["lr"])
        if applied:
            model(torch.randn(2, 3, 8, 8)).sum().backward()
            opt.step()
        sched.step()
    assert lrs == [schedule(0), schedule(1), schedule(1), schedule(2)]
    with pytest.raises(ValueError, match="Unknown optimizer 'sgd'"):
        make_optimizer(model, "sgd", lr=0.1)


# --------------------------------------------------------------------------- timm


@pytest.fixture(scope="module")
def timm_names():
    pytest.importorskip("timm")
    from largebatch.integrations.timm import register

    return register()


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_timm_factory_builds_ours_with_the_package_groups(timm_names, kind):
    import timm
    from timm.optim import create_optimizer_v2

    cls, name = {"lars": (LARS, timm_names[0]), "lamb": (LAMB, timm_names[1])}[kind]
    model = timm.create_model("test_resnet", num_classes=10)
    twin = timm.create_model("test_resnet", num_classes=10)
    twin.load_state_dict(model.state_dict())
    lr = {"lars": 1.0, "lamb": 1e-3}[kind]
    opt = create_optimizer_v2(model, opt=name, lr=lr, weight_decay=0.01)
    assert type(opt) is cls
    reference = cls(param_groups(twin, 0.01), lr=lr, weight_decay=0.01)
    mapped = dict(zip(map(id, twin.parameters()), map(id, model.parameters())))
    assert settings(opt) == {mapped[k]: v for k, v in settings(reference).items()}
    torch.manual_seed(1)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 7])
    for m, o in ((model, opt), (twin, reference)):
        nn.functional.cross_entropy(m(x), y).backward()
        o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_timm_no_weight_decay_params_keep_the_trust_ratio(timm_names):
    """A ViT's ``no_weight_decay()`` tensors (pos_embed, cls_token: 3-d) get timm's
    weight decay of 0 and keep the trust ratio; its biases and norms lose both."""
    import timm
    from timm.optim import create_optimizer_v2

    model = timm.create_model("test_vit", num_classes=10)
    opt = create_optimizer_v2(model, opt="lookahead_" + timm_names[0], lr=1.0, weight_decay=0.01)
    assert type(opt._base_optimizer) is LARS
    got = {name: settings(opt)[id(p)] for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        if name in ("pos_embed", "cls_token"):
            assert got[name] == (0.0, True), name
        else:
            assert got[name] == ((0.0, False) if p.ndim <= 1 else (0.01, True)), name


def test_timm_registration_names(timm_names):
    from timm.optim import OptimizerRegistry, list_optimizers

    from largebatch.integrations.timm import register, split_groups

    assert set(timm_names) <= set(list_optimizers())
    assert register() == timm_names  # again: nothing changes
    for bad, registry in (("lb_lars", OptimizerRegistry()), ("LBLARS", OptimizerRegistry()), ("lars", None)):
        with pytest.raises(ValueError, match=repr(bad)):
            register(lars=bad, lamb="lbnew", registry=registry)
    assert "lbnew" not in list_optimizers()  # nothing registered by the call refused
    w, b = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(2))
    assert split_groups([w, b]) == [
        {"params": [w]},
        {"params": [b], "weight_decay": 0.0, "trust_ratio": False},
    ]
    kept = {"params": [b], "trust_ratio": True}
    assert split_groups([kept]) == [kept]


# --------------------------------------------------------------------------- Hugging Face


@pytest.fixture(scope="module")
def transformers():
    pytest.importorskip("accelerate")
    return pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("linear", {}),
        ("cosine", {}),
        ("polynomial", {"power": 2.0, "lr_end": 1e-3}),
        ("constant_with_warmup", {}),
        ("constant", {}),
    ],
)
def test_schedule_from_args_follows_hugging_face(transformers, tmp_path, kind, options):
    from largebatch.integrations.huggingface import schedule_from_args

    args = transformers.TrainingArguments(
        tmp_path, learning_rate=0.1, warmup_steps=2, max_steps=10, lr_scheduler_type=kind,
        lr_scheduler_kwargs=options, use_cpu=True, report_to="none",
    )  # fmt: skip
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    theirs = transformers.get_scheduler(
        kind, opt, args.get_warmup_steps(10), 10, scheduler_specific_kwargs=options
    )
    schedule = schedule_from_args(args)
    for step in range(11):
        assert math.isclose(schedule(step), theirs.get_last_lr()[0], rel_tol=1e-6, abs_tol=1e-12), step
        opt.step()
        theirs.step()


def test_schedule_from_args_refuses(transformers, tmp_path):
    from largebatch.integrations.huggingface import schedule_from_args

    args = transformers.TrainingArguments(tmp_path, use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="give total_steps"):
        schedule_from_args(args)
    assert schedule_from_args(args, total_steps=7).total_steps == 7
    args = transformers.TrainingArguments(
        tmp_path, lr_scheduler_type="inverse_sqrt", use_cpu=True, report_to="none"
    )
    with pytest.raises(ValueError, match="'inverse_sqrt' has no counterpart"):
        schedule_from_args(args, 10)


def test_hf_trainer_example_steps_our_optimizer(transformers, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    trainer = example("hf_trainer").main(["--max-steps", "3", "--examples", "48", "--batch-size", "16"])
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    assert type(opt) is LAMB and opt.num_steps == 3
    assert [g["trust_ratio"] for g in opt.param_groups] == [True, False]
    schedule = trainer.lr_scheduler.schedules[0]
    logged = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    assert logged == pytest.approx([schedule(0), schedule(1), schedule(2)], rel=1e-6)  # each step's rate
    assert "last training loss" in capsys.readouterr().out


def test_hf_page_example(transformers, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = example("hf_trainer")
    config = transformers.BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8
    )
    namespace = {
        "model": transformers.BertForSequenceClassification(config),
        "train_dataset": hf.made_up_data(8),
    }
    (code,) = page_blocks("transformers")
    exec(compile(code, f"{PAGE} (Hugging Face)", "exec"), namespace)  # noqa: S102
    assert type(namespace["trainer"].optimizer) is LAMB


# --------------------------------------------------------------------------- Lightning


@pytest.fixture(scope="module")
def lightning():
    return pytest.importorskip("lightning")


# Lightning's own use of a torch API that newer torch deprecates.
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")
def test_lightning_example_logs_named_trust_ratios(lightning, capsys, monkeypatch):
    from largebatch.integrations import lightning as hooks

    steps = []
    count = hooks.named_trust_ratios

    def counted(opt, module):
        steps.append(opt.num_steps)
        return count(opt, module)

    monkeypatch.setattr(hooks, "named_trust_ratios", counted)
    trainer = example("lightning_module").main(["--max-steps", "3", "--log-every", "2", "--batch-size", "64"])
    assert steps == [0, 2]  # before the steps 0 and 2
    (opt,) = trainer.optimizers
    assert type(opt) is LARS and opt.num_steps == 3
    (config,) = trainer.lr_scheduler_configs
    assert config.interval == "step" and config.scheduler.last_epoch == 3
    logged = {k for k in trainer.callback_metrics if k.startswith("trust_ratio/")}
    assert logged == {"trust_ratio/net.0.weight", "trust_ratio/net.3.weight"}  # no bias, no BatchNorm
    (callback,) = [c for c in trainer.callbacks if type(c).__name__ == "TrustRatioCallback"]
    # logged at steps 0 and 2: the metrics hold the latest
    assert {k: float(v) for k, v in trainer.callback_metrics.items() if k in logged} == pytest.approx(
        {"trust_ratio/" + k: v for k, v in callback.latest.items()}
    )
    assert "trust ratio of net.0.weight" in capsys.readouterr().out


def test_lightning_page_example(lightning):
    from largebatch.integrations.lightning import TrustRatioCallback

    namespace: dict = {}
    (code,) = page_blocks("lightning")
    exec(compile(code, f"{PAGE} (Lightning)", "exec"), namespace)  # noqa: S102
    config = namespace["model"].configure_optimizers()
    assert type(config["optimizer"]) is LARS and config["lr_scheduler"]["interval"] == "step"
    assert any(isinstance(c, TrustRatioCallback) for c in namespace["trainer"].callbacks)
    with pytest.raises(ValueError, match="every_n_steps"):
        TrustRatioCallback(every_n_steps=0)
