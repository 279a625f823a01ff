"""The recipes: the Fashion-MNIST models, the techniques each recipe switches, and the
ImageNet rows' values against the sources they cite."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from largebatch import models, study
from largebatch.recipes import build
from largebatch.recipes.registry import RECIPES, Recipe, get_recipe
from largebatch.study import RunSpec

# --------------------------------------------------------------------------- the models


@pytest.mark.parametrize(
    "factory, params",
    [
        (models.fmnist_cnn, 208_194),
        (models.small_cnn, 6_274),
        (lambda: models.small_cnn(width=16, hidden=128), 426_362),
        (models.small_resnet, 77_754),
        (models.fmnist_alexnet_bn, 178_354),
    ],
)
def test_fashion_models_have_their_documented_size_and_shape(factory, params):
    torch.manual_seed(0)
    model = factory()
    assert sum(p.numel() for p in model.parameters()) == params
    assert model(torch.randn(5, 1, 28, 28)).shape == (5, 10)


def test_the_recipes_model_is_fmnist_cnn():
    assert {r.model for r in RECIPES.values() if r.data == "fashion-mnist"} == {"fmnist_cnn"}
    assert isinstance(build.build_model("fmnist_cnn", 10)[-1], nn.Linear)


def test_small_resnet_blocks_start_as_their_shortcut():
    """Goyal et al.'s zero-init: each block's last BN scale is 0, so a block's output at
    initialisation is ReLU(shortcut(x))."""
    torch.manual_seed(0)
    model = models.small_resnet().eval()
    blocks = [m for m in model if isinstance(m, models.BasicBlock)]
    assert len(blocks) == 3
    x = torch.randn(2, 16, 14, 14)
    for block in blocks:
        assert torch.count_nonzero(block.bn2.weight) == 0
        assert torch.equal(block(x), torch.relu(block.shortcut(x)))
        x = block(x)
    # Trained, the scale moves off zero like any other parameter.
    assert blocks[0].bn2.weight.requires_grad


def test_fmnist_alexnet_bn_is_alexnet_bn_scaled_down():
    """Five convs in AlexNet's channel proportions, each followed by batch norm, no
    residual; the fully connected layers hold most of the parameters, as in AlexNet."""
    model = build.build_model("fmnist_alexnet_bn", 10)
    layers = list(model)
    convs = [i for i, m in enumerate(layers) if isinstance(m, nn.Conv2d)]
    assert [layers[i].out_channels for i in convs] == [8, 24, 48, 32, 32]
    assert all(isinstance(layers[i + 1], nn.BatchNorm2d) and layers[i].bias is None for i in convs)
    linears = [m for m in layers if isinstance(m, nn.Linear)]
    assert [m.out_features for m in linears] == [256, 256, 10]
    head = sum(p.numel() for m in linears for p in m.parameters())
    assert head > 0.75 * sum(p.numel() for p in model.parameters())
    assert not any(isinstance(m, models.BasicBlock) for m in model.modules())


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: models.small_cnn(width=0), "Invalid width: 0"),
        (lambda: models.fmnist_alexnet_bn(hidden=0), "Invalid hidden: 0"),
        (lambda: models.small_cnn(hidden=-1), "Invalid hidden: -1"),
        (lambda: models.small_resnet(blocks=0), "Invalid blocks: 0"),
    ],
)
def test_bad_model_sizes_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --------------------------------------------------------------------------- the switches


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 2, 3, bias=False), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)
    )


@pytest.mark.parametrize(
    "exclude, excluded",
    [
        ("bn_bias", {"1.weight", "1.bias", "3.bias"}),
        ("bn", {"1.weight", "1.bias"}),
        ("none", set()),
    ],
)
def test_decay_exclude_names_what_gets_no_decay_or_adaptation(exclude, excluded):
    net = _net()
    names = {id(p): n for n, p in net.named_parameters()}
    decayed, skipped = build.decay_groups(net, 1e-4, exclude)
    assert {names[id(p)] for p in skipped["params"]} == excluded
    assert (decayed["weight_decay"], skipped["weight_decay"], skipped["trust_ratio"]) == (1e-4, 0.0, False)
    with pytest.raises(ValueError, match="Invalid decay_exclude: 'bias'"):
        build.decay_groups(net, 1e-4, "bias")


def test_sgd_recipes_decay_all_but_the_excluded_params():
    """Goyal et al. leave BN's scale and shift undecayed; the SGD recipes use the same
    groups as LARS and LAMB, without the trust-ratio flag torch's SGD does not know."""
    net = _net()
    opt = build.build_optimizer(get_recipe("resnet50-goyal-8k"), net, 3.2)
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["nesterov"]
    assert [g["weight_decay"] for g in opt.param_groups] == [1e-4, 0.0]
    # conv and fc weights and the fc bias (the paper names only BN) | BN scale and shift
    assert [len(g["params"]) for g in opt.param_groups] == [3, 2]
    assert all("trust_ratio" not in g for g in opt.param_groups)


def test_a_run_gets_its_specs_label_smoothing_warmup_and_power(monkeypatch):
    """The study's switches reach the loss and the schedule that train the run."""
    seen = {}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            seen[name] = out = fn(*args, **kwargs)
            return out

        monkeypatch.setattr(build, name, wrapped)

    spy("build_loss", build.build_loss)
    spy("build_schedule", build.build_schedule)
    threads = torch.get_num_threads()
    try:
        study.init_worker(1, None, "cpu")
        # 1,200 images at B=384: 3 steps an epoch, 2 epochs.
        study.run_one(
            RunSpec(
                "final", 384, "lars", 4.0, 1.0, seed=0, epochs=2, subset=1200, label_smoothing=0.2, power=3.0
            )
        )
    finally:
        study.WORKER.clear()
        torch.set_num_threads(threads)
    assert seen["build_loss"].label_smoothing == 0.2
    sched = seen["build_schedule"]
    assert (sched.warmup_steps, sched.total_steps, sched.power, sched.peak_lr) == (3, 6, 3.0, 4.0)


def test_a_recipes_warmup_start_and_decay_end_reach_the_schedule():
    goyal = get_recipe("resnet50-goyal-8k")
    sched = build.build_schedule(goyal, peak_lr=goyal.peak_lr, epochs=90, n_train=100, batch=10)
    assert sched(0) == pytest.approx(0.1) and sched(50) == pytest.approx(3.2)
    assert sched(300) == pytest.approx(0.32) and sched(899) == pytest.approx(0.0032)
    mlperf = get_recipe("resnet50-mlperf-lars-34k")
    sched = build.build_schedule(mlperf, peak_lr=mlperf.peak_lr, epochs=59, n_train=100, batch=10)
    # MXNet's counter starts at 1: the first step runs at peak / W, the peak one step early.
    assert sched(0) == pytest.approx(21.6 / 170) and sched(169) == pytest.approx(21.6)
    assert sched(589) == pytest.approx(1e-4)


def test_a_recipe_at_its_own_batch_keeps_its_stated_lr_exactly():
    stated = [r for r in RECIPES.values() if r.lr is not None]
    assert any(r.lr * r.batch_size / r.batch_size != r.lr for r in stated)  # rounding bites
    for recipe in stated:
        assert recipe.peak_lr == recipe.lr, recipe.name
        assert recipe.lr_for(2 * recipe.batch_size) == 2 * recipe.lr, recipe.name


def test_every_recipe_builds_its_optimizer_and_loss():
    for recipe in RECIPES.values():
        net = _net()
        precision = recipe.precision if recipe.optimizer in ("lars", "lamb") else "fp32"
        opt = build.build_optimizer(recipe, net, recipe.peak_lr, precision)
        assert opt.param_groups[0]["lr"] == recipe.peak_lr, recipe.name
        assert build.build_loss(recipe).label_smoothing == recipe.label_smoothing


# --------------------------------------------------------------------------- the sources

# Each ImageNet recipe's values, restated from the source its ``source`` field cites.
# (name, cited in source, field values)
CITED = [
    (
        "resnet50-goyal-8k",
        ["arXiv:1706.02677", "§5.1", "§2.2", "Table 1"],
        dict(
            optimizer="nesterov",
            batch_size=8192,
            peak_lr=3.2,
            init_lr=0.1,
            warmup_epochs=5,
            schedule="step",
            milestones=(30, 60, 80),
            epochs=90,
            momentum=0.9,
            weight_decay=1e-4,
            decay_exclude="bn",
            label_smoothing=0.0,
            published_top1=76.26,
        ),
    ),  # 100 - 23.74
    (
        "resnet50-lars-32k",
        ["arXiv:1708.03888v3", "Table 4", "§5"],
        dict(
            optimizer="lars",
            batch_size=32768,
            peak_lr=2.9,
            warmup_epochs=5,
            schedule="poly",
            power=2.0,
            epochs=90,
            momentum=0.9,
            weight_decay=1e-4,
            trust_coefficient=0.001,
            eps=0.0,
            published_top1=72.3,
        ),
    ),
    (
        "resnet50-lamb-32k",
        ["fastalgo/imagenet_resnet50_lamb", "run.sh", "optimization.py", "resnet_main.py", "log.out"],
        dict(
            optimizer="lamb",
            batch_size=32768,
            peak_lr=0.04,
            warmup_epochs=20,
            schedule="poly",
            power=1.0,
            epochs=90,
            weight_decay=1.5,
            decay_exclude="bn",
            betas=(0.9, 0.999),
            eps=1e-6,
            max_grad_norm=1.0,
            label_smoothing=0.1,
            precision="bf16",
            published_top1=76.34,
        ),
    ),
    (
        "resnet50-mlperf-lars-34k",
        ["training_results_v0.7", "config_DGXA100_multi_96x8x45.sh", "common/fit.py", "result_0..4.txt"],
        dict(
            optimizer="lars",
            batch_size=96 * 8 * 45,
            peak_lr=21.6,
            warmup_epochs=17,
            schedule="poly",
            power=2.0,
            end_lr=1e-4,
            epochs=59,
            momentum=0.94,
            weight_decay=2.5e-5,
            trust_coefficient=0.001,
            eps=0.0,
            label_smoothing=0.1,
            precision="fp16",
            published_top1=76.07,
        ),
    ),  # mean of 76.068 75.952 76.106 76.084 76.12
    (
        "resnet50-mlperf-lars-64k",
        ["training_results_v0.7", "config_DGXA100_multi_230x8x35.sh", "common/fit.py"],
        dict(
            optimizer="lars",
            batch_size=230 * 8 * 35,
            peak_lr=24.699,
            warmup_epochs=31,
            schedule="poly",
            power=2.0,
            end_lr=1e-4,
            epochs=90,
            momentum=0.951807,
            weight_decay=1e-4,
            trust_coefficient=0.001,
            eps=0.0,
            label_smoothing=0.1,
            precision="fp16",
            published_top1=None,
        ),
    ),
    (
        "alexnet-bn-lars-8k",
        ["arXiv:1708.03888v3", "Table 3(b)", "footnote 6"],
        dict(
            optimizer="lars",
            batch_size=8192,
            peak_lr=14.0,
            warmup_epochs=5,
            schedule="poly",
            power=2.0,
            epochs=100,
            momentum=0.9,
            weight_decay=5e-4,
            trust_coefficient=0.001,
            published_top1=60.1,
        ),
    ),
    (
        "alexnet-bn-lars-32k",
        ["arXiv:1708.03888v3", "Table 3(b)", "footnote 6"],
        dict(
            optimizer="lars",
            batch_size=32768,
            peak_lr=22.0,
            warmup_epochs=5,
            schedule="poly",
            power=2.0,
            epochs=100,
            momentum=0.9,
            weight_decay=5e-4,
            trust_coefficient=0.001,
            published_top1=57.8,
        ),
    ),
]


def _value(recipe: Recipe, field: str):
    if field == "peak_lr":
        return recipe.peak_lr
    if hasattr(recipe, field):
        return getattr(recipe, field)
    return recipe.optimizer_kwargs[field]


@pytest.mark.parametrize("name, cites, values", CITED, ids=[c[0] for c in CITED])
def test_imagenet_recipes_restate_their_cited_values(name, cites, values):
    recipe = get_recipe(name)
    for place in cites:
        assert place in recipe.source, (name, place)
    for field, value in values.items():
        got = _value(recipe, field)
        assert got == (pytest.approx(value) if isinstance(value, float) else value), (name, field, got, value)


def test_every_imagenet_recipe_is_in_the_cited_table_and_nothing_is_provisional():
    imagenet = {r.name for r in RECIPES.values() if r.data == "imagenet"}
    assert imagenet == {c[0] for c in CITED}
    for recipe in RECIPES.values():
        assert recipe.source, recipe.name
        text = " ".join(str(v) for v in dataclasses.asdict(recipe).values()).lower()
        assert "provisional" not in text, recipe.name


def test_largebatch_recipes_prints_every_source(capsys):
    from largebatch.cli import main as cli

    assert cli(["recipes"]) == 0
    out = capsys.readouterr().out
    for recipe in RECIPES.values():
        assert f"{recipe.name}: {recipe.source}" in out
        if recipe.unstated:
            assert f"open: {recipe.unstated}" in out


def test_the_docs_table_is_the_registry():
    """docs/recipes.md shows the recipes as they are (regenerate it with
    ``recipes_markdown()`` when a recipe changes)."""
    from pathlib import Path

    from largebatch.recipes.registry import recipes_markdown

    text = (Path(__file__).resolve().parents[1] / "docs" / "recipes.md").read_text()
    start = text.index("-->\n", text.index("<!-- recipes-table")) + 4
    assert text[start : text.index("<!-- /recipes-table -->")] == recipes_markdown()


def test_the_fashion_recipes_carry_the_studys_choices():
    """Each Fashion-MNIST recipe the 30-epoch study has settled holds what the study chose
    (its committed ``study.json``), and only those are marked tuned."""
    import json
    from pathlib import Path

    from largebatch.recipes.registry import FASHION_TUNED

    summary = json.loads(
        (Path(__file__).resolve().parents[1] / "docs" / "study" / "headline" / "study.json").read_text()
    )
    settled = {(r["optimizer"], r["batch"]): r for r in summary["rows"]}
    assert set(settled) == set(FASHION_TUNED)
    for (optimizer, batch), row in settled.items():
        recipe = get_recipe(f"fmnist-{optimizer}-{batch}")
        assert (
            recipe.peak_lr,
            recipe.warmup_epochs,
            recipe.label_smoothing,
            recipe.power,
            recipe.epochs,
        ) == (row["lr"], row["warmup_epochs"], row["label_smoothing"], row["power"], row["epochs"]), (
            recipe.name
        )
        assert recipe.note.endswith("the 30-epoch study's choice")


def test_nvidia_split_decays_the_fc_bias_without_the_trust_ratio():
    """decay_exclude='nvidia' (NVIDIA's MLPerf LARS, common/fit.py set_wd_mult and
    _get_lars): weights adapted and decayed, batch norm neither, the fc bias decayed only;
    batch norm, outside MXNet's first update call, keeps the rate in its buffer."""

    from largebatch.recipes.build import decay_groups

    model = nn.Sequential(nn.Conv2d(1, 2, 3, bias=False), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(8, 3))
    adapted, excluded, decayed = decay_groups(model, 5e-5, "nvidia")
    conv, bn, fc = model[0], model[1], model[3]
    assert adapted == {"params": [conv.weight, fc.weight], "weight_decay": 5e-5}
    assert excluded == {
        "params": [bn.weight, bn.bias],
        "weight_decay": 0.0,
        "trust_ratio": False,
        "lr_in_momentum": True,
    }
    assert decayed == {"params": [fc.bias], "weight_decay": 5e-5, "trust_ratio": False}


def test_reference_recipes_take_their_sources_optimizer():
    from largebatch.lars.sources import source_keywords

    for name in ("resnet50-mlperf-lars-34k", "resnet50-mlperf-lars-64k"):
        recipe = get_recipe(name)
        assert recipe.decay_exclude == "nvidia"
        assert source_keywords("nvidia-mxnet").items() <= recipe.optimizer_kwargs.items()
        assert recipe.optimizer_kwargs["lr_in_momentum"] is False
    lamb = get_recipe("resnet50-lamb-32k")
    assert lamb.optimizer_kwargs == source_keywords("lamb-authors")
    assert lamb.optimizer_kwargs["bias_correction"] is False


def _nvidia_epoch_size(images: int, gpus: int, batch_per_gpu: int) -> int:
    """NVIDIA's MLPerf v0.7 MXNet epoch, as common/fit.py's _get_lr_scheduler computes it:
    each worker's whole share of the images, in batches rounded up."""
    return math.ceil(images // gpus / batch_per_gpu)


@pytest.mark.parametrize(
    "name, gpus, per_gpu, warmup, epochs",
    [
        ("resnet50-mlperf-lars-34k", 96 * 8, 45, 17, 59),  # config_DGXA100_multi_96x8x45.sh
        ("resnet50-mlperf-lars-64k", 230 * 8, 35, 31, 90),  # config_DGXA100_multi_230x8x35.sh
    ],
)
def test_nvidia_recipes_run_fit_pys_step_counts(name, gpus, per_gpu, warmup, epochs):
    recipe = get_recipe(name)
    size = _nvidia_epoch_size(1_281_167, gpus, per_gpu)
    assert recipe.batch_size == gpus * per_gpu
    assert recipe.steps == (size * warmup, size * epochs)
    assert recipe.epoch_end(1, 1_281_167, recipe.batch_size) == size
    assert recipe.schedule_offset == 1
    schedule = build.build_schedule(
        recipe, peak_lr=recipe.lr, epochs=epochs, n_train=1_281_167, batch=recipe.batch_size
    )
    assert schedule.total_steps == size * epochs
    assert schedule(0) == pytest.approx(recipe.lr / (size * warmup))  # MXNet's first update


def test_lamb_recipe_runs_the_authors_step_flags():
    """fastalgo/imagenet_resnet50_lamb run.sh passes 782 warmup and 3,519 train steps for
    20 and 90 epochs at 32,768: round(epochs x N / B), epochs ending mid-batch."""
    recipe = get_recipe("resnet50-lamb-32k")
    assert recipe.steps == (782, 3519)
    ends = [recipe.epoch_end(e, 1_281_167, 32768) for e in range(91)]
    assert ends[:4] == [0, 39, 78, 117] and ends[-1] == 3519
    assert {b - a for a, b in zip(ends, ends[1:])} == {39, 40}
    schedule = build.build_schedule(recipe, peak_lr=0.04, epochs=90, n_train=1_281_167, batch=32768)
    assert (schedule.total_steps, schedule.warmup_steps) == (3519, 782)


def test_the_lamb_recipe_clips_each_process_as_the_authors_tpu_cores():
    """One process: the optimizer's clip is the process's clip. Several: the optimizer
    does not clip; comm.torch.local_clip_hook clips each process before the sum."""
    recipe = get_recipe("resnet50-lamb-32k")
    assert recipe.clip_per_process == 1.0
    net = nn.Sequential(nn.Linear(4, 3))
    assert build.build_optimizer(recipe, net, 0.04).max_grad_norm == 1.0
    assert build.build_optimizer(recipe, net, 0.04, world=2).max_grad_norm is None
    assert get_recipe("fmnist-lamb-1536").clip_per_process is None


def test_floor_epochs_are_this_packages_own():
    recipe = get_recipe("fmnist-lars-1536")
    assert recipe.epoch_steps == "floor"
    assert recipe.steps == (round(2 * 39), 30 * 39)
    assert recipe.epoch_length(60_000, 1536) == 39 and recipe.epoch_end(3, 60_000, 1536) == 117
    with pytest.raises(ValueError, match="Invalid batch: 0"):
        recipe.epoch_length(60_000, 0)
    with pytest.raises(ValueError, match="unknown epoch_steps 'round'"):
        dataclasses.replace(recipe, epoch_steps="round")


def test_the_table_shows_each_recipes_step_counts():
    from largebatch.recipes.registry import recipes_table

    table = recipes_table()
    assert "steps: 646 warmup, 2,242 in all (epoch_steps 'ceil')" in table
    assert "steps: 782 warmup, 3,519 in all (epoch_steps 'exact')" in table
    assert "step counts" not in table  # no longer open
