"""``largebatch train`` and ``largebatch recipes``: outputs, resume, torchrun, errors, the table."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import subprocess
import sys

import pytest
import torch

from largebatch.cli import main as cli
from largebatch.recipes.build import build_model, build_optimizer
from largebatch.recipes.registry import (
    FASHION_SETTINGS,
    RECIPES,
    Recipe,
    get_recipe,
    imagenet_equivalent,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# Small Fashion-MNIST runs: 2,048 images, batch 128 (16 steps an epoch), no warmup.
TINY = ["train", "--recipe", "fmnist-sgd-128", "--subset", "2048"]
# 256 images, 2 steps an epoch: for the checks that do not depend on how far it trains.
SHORT = ["train", "--recipe", "fmnist-sgd-128", "--subset", "256"]


def _params(out) -> dict[str, torch.Tensor]:
    return torch.load(out / "checkpoint.pt", weights_only=False)["model"]


def test_one_epoch_writes_every_output_and_beats_chance(tmp_path, capsys):
    assert cli([*TINY, "--epochs", "1", "--out", str(tmp_path)]) == 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1, metrics
    row = metrics[0]
    for key in (
        "train_loss",
        "test_accuracy",
        "lr",
        "images_per_second",
        "trust_ratio_min",
        "trust_ratio_median",
        "trust_ratio_max",
    ):
        assert row[key] is not None, (key, row)
    assert 0 < row["trust_ratio_min"] <= row["trust_ratio_median"] <= row["trust_ratio_max"], row
    summary = json.loads((tmp_path / "summary.json").read_text())
    # 10 classes: chance is 10% +- 0.66 points on 2,048 test images; 16 SGD steps of the
    # 6K-param CNN reach about 18%.
    assert summary["test_accuracy"] > 0.14, summary
    assert summary["test_accuracy"] == row["test_accuracy"]
    assert summary["imagenet_equivalent_batch"] == imagenet_equivalent(128, 60_000)
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert ckpt["epoch"] == 1 and ckpt["optimizer"]["state"] and "last_epoch" in ckpt["scheduler"]


def test_resume_gives_the_params_of_an_uninterrupted_run(tmp_path, capsys):
    # LARS with warmup and poly decay: the optimizer, schedule and data order all matter.
    args = ["train", "--subset", "1024", "--batch-size", "256", "--epochs", "2"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    cli([*args, "--out", str(straight)])
    # The header rounds what the batch and epochs compute: lr 16 * 256 / 1536 and a
    # 2-epoch warmup of 30 scaled to 2 show 4 significant digits.
    header = capsys.readouterr().out.splitlines()[0]
    assert "peak lr 2.667, " in header and "schedule 0.1333-epoch warmup, poly 2 (" in header, header
    cli([*args, "--out", str(split), "--stop-after", "1"])
    first = _params(split)
    cli([*args, "--out", str(split), "--resume"])
    a, b = _params(straight), _params(split)
    assert any(not torch.equal(first[k], b[k]) for k in b), "the resumed epoch changed nothing"
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"
    lines = (split / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2]


def test_an_augmented_ghost_batch_run_resumes_bit_for_bit(tmp_path):
    """--augment draws each epoch's crops from the seed and the epoch, and ghost batch
    norm's running statistics are in the checkpoint: a resumed run is the straight one."""
    args = [
        "train",
        "--subset",
        "1024",
        "--batch-size",
        "256",
        "--epochs",
        "2",
        "--augment",
        "--ghost-batch",
        "64",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    cli([*args, "--out", str(straight)])
    cli([*args, "--out", str(split), "--stop-after", "1"])
    cli([*args, "--out", str(split), "--resume"])
    a, b = _params(straight), _params(split)  # the model's state: params and running statistics
    assert any("running_mean" in name for name in a)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"


@pytest.mark.slow
def test_torchrun_two_processes_end_with_identical_params_and_buffers(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "largebatch",
        "train",
        "--subset",
        "1024",
        "--batch-size",
        "256",
        "--micro-batch",
        "64",
        "--epochs",
        "1",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The ranks share one stdout: a line of one may end inside a line of the other.
    digests = dict(re.findall(r"rank (\d)/2: params sha256 ([0-9a-f]{64})", proc.stdout))
    assert set(digests) == {"0", "1"}, proc.stdout
    assert digests["0"] == digests["1"], digests
    assert "= 2 x 2 x 64" in proc.stdout, proc.stdout  # 2 processes x 2 micro-batches of 64
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["params_sha256"] == digests["0"]
    # Batch-norm running statistics: one set for both ranks (their average), and the
    # checkpoint holds that set, so the reported accuracy is that of the saved model.
    buffers = dict(re.findall(r"rank (\d)/2: buffers sha256 ([0-9a-f]{64})", proc.stdout))
    assert set(buffers) == {"0", "1"} and buffers["0"] == buffers["1"], proc.stdout
    from largebatch.fashion_mnist import fashion_mnist_tensors, load_fashion_mnist
    from largebatch.training.distributed import buffers_sha256

    model = build_model(get_recipe("fmnist-lars-1536").model, 10)
    model.load_state_dict(_params(tmp_path))
    assert buffers_sha256(model) == buffers["0"] == summary["buffers_sha256"]
    x, y = fashion_mnist_tensors(*load_fashion_mnist("test"), 1024)
    with torch.no_grad():
        accuracy = float((model.eval()(x).argmax(1) == y).float().mean())
    assert abs(accuracy - summary["test_accuracy"]) <= 1 / 1024, (accuracy, summary)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--recipe", "resnet50-nope"], "Unknown recipe 'resnet50-nope'; known recipes: "),
        ([*TINY, "--data", "/no/such/dir"], "data directory not found: /no/such/dir"),
        (
            ["train", "--recipe", "resnet50-goyal-8k", "--data", "/no/such/imagenet"],
            "data directory not found: /no/such/imagenet/train",
        ),
        ([*TINY, "--micro-batch", "48"], "micro-batch 48 must divide the per-process batch 128"),
        ([*TINY, "--precision", "fp16"], "precision 'fp16' needs fp32 master weights"),
    ],
)
def test_clear_errors(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=re.escape(message)):
        cli([*argv, "--out", str(tmp_path)])


def test_batch_not_divisible_by_world_size(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit, match="batch size 128 is not divisible by the world size 3"):
        cli([*TINY, "--out", str(tmp_path)])


def test_fsdp_needs_torchrun_and_refuses_fp16(monkeypatch, tmp_path):
    with pytest.raises(SystemExit, match="--fsdp shards the model over processes: run it under torchrun"):
        cli([*TINY, "--fsdp", "--out", str(tmp_path)])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="--fsdp runs fp32 or bf16"):
        cli([*TINY, "--fsdp", "--precision", "fp16", "--out", str(tmp_path)])


def _torchrun_train(out, *args: str) -> str:
    """``largebatch train`` on two gloo processes (fmnist-lars-1536 at batch 256, 2 x 2
    micro-batches of 64); returns stdout after checking both ranks end with one model."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "largebatch",
        "train",
        "--batch-size",
        "256",
        "--micro-batch",
        "64",
        "--out",
        str(out),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    digests = dict(re.findall(r"rank (\d)/2: params sha256 ([0-9a-f]{64})", proc.stdout))
    assert set(digests) == {"0", "1"} and digests["0"] == digests["1"], proc.stdout
    return digests["0"]


@pytest.mark.slow
def test_torchrun_fsdp_step_equals_ddp_step(tmp_path):
    # One step (256 images): FSDP2's reduce-scatter and sharded LARS against DDP's
    # all-reduce and whole-param LARS, to float32 tolerance.
    one_step = ["--subset", "256", "--epochs", "1"]
    _torchrun_train(tmp_path / "fsdp", *one_step, "--fsdp")
    _torchrun_train(tmp_path / "ddp", *one_step)
    fsdp, ddp = _params(tmp_path / "fsdp"), _params(tmp_path / "ddp")
    assert fsdp.keys() == ddp.keys()
    for key in ddp:
        torch.testing.assert_close(fsdp[key], ddp[key], msg=key)
    saved = torch.load(tmp_path / "fsdp" / "checkpoint.pt", weights_only=False)
    assert saved["settings"]["fsdp"] is True
    # The optimizer state is saved whole: the unsharded model's optimizer loads it.
    model = build_model(get_recipe("fmnist-lars-1536").model, 10)
    optimizer = build_optimizer(get_recipe("fmnist-lars-1536"), model, 1.0, "fp32")
    optimizer.load_state_dict(saved["optimizer"])
    assert optimizer.num_steps == 1


@pytest.mark.parametrize("argv, status", [(["recipes"], 0), (["train", "--epochs", "0"], 2)])
def test_a_process_that_joined_a_group_exits_through_exit_process(monkeypatch, capsys, argv, status):
    # Under torchrun the command ends without Python's finalization, which gloo's worker
    # threads can abort (largebatch.training.distributed.exit_process says why): on
    # success and on a user error alike, with the command's status.
    from largebatch.training import distributed

    ended = []

    def exit_process(code: int) -> None:
        ended.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(distributed, "joined", lambda: True)
    monkeypatch.setattr(distributed, "exit_process", exit_process)
    with pytest.raises(SystemExit):
        cli(argv)
    assert ended == [status]


@pytest.mark.slow
def test_torchrun_fsdp_with_an_sgd_recipe_records_its_diagnostic_trust_ratios(tmp_path):
    # The trust-ratio telemetry of SGD takes each whole param's norm from its shards.
    _torchrun_train(
        tmp_path / "fsdp", "--recipe", "fmnist-sgd-1536", "--subset", "512", "--epochs", "1", "--fsdp"
    )
    _torchrun_train(tmp_path / "ddp", "--recipe", "fmnist-sgd-1536", "--subset", "512", "--epochs", "1")
    fsdp, ddp = (
        json.loads((tmp_path / k / "metrics.jsonl").read_text().splitlines()[0]) for k in ("fsdp", "ddp")
    )
    assert fsdp["trust_ratio_median"] == pytest.approx(ddp["trust_ratio_median"], rel=1e-4)


@pytest.mark.slow
def test_torchrun_fsdp_in_bf16_keeps_batch_norm_in_fp32(tmp_path):
    # FSDP2's bf16 policy casts params, not batch norm's running statistics: the norm
    # layers are units of their own computing in fp32, as to_half keeps them.
    _torchrun_train(tmp_path, "--subset", "512", "--epochs", "1", "--fsdp", "--precision", "bf16")
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert saved["settings"]["precision"] == "bf16"
    norms = [k for k in saved["model"] if k.endswith("running_var")]
    assert norms, list(saved["model"])
    for key in norms:
        var = saved["model"][key]
        assert var.dtype == torch.float32 and torch.isfinite(var).all(), key
        assert not torch.equal(var, torch.ones_like(var)), f"{key} never updated"
    assert all(v.dtype == torch.float32 for v in saved["model"].values() if v.is_floating_point())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["precision"] == "bf16" and summary["test_accuracy"] > 0


@pytest.mark.slow
def test_torchrun_fsdp_resume_is_bit_exact(tmp_path):
    two_epochs = ["--subset", "512", "--epochs", "2"]
    whole_run = _torchrun_train(tmp_path / "a", *two_epochs, "--fsdp")
    _torchrun_train(tmp_path / "b", *two_epochs, "--fsdp", "--stop-after", "1")
    assert _torchrun_train(tmp_path / "b", *two_epochs, "--fsdp", "--resume") == whole_run


@pytest.mark.slow
def test_torchrun_adacomp_resume_is_bit_exact_and_saves_every_ranks_residuals(tmp_path, capsys):
    # AdaComp from the first step (no warm-up), 2 x 2 micro-batches of 64 (the hook runs
    # at the last one): a run cut after epoch 1 and resumed ends as the whole run does.
    args = ["--subset", "512", "--epochs", "2", "--compression", "adacomp", "--compression-warmup", "0"]
    whole_run = _torchrun_train(tmp_path / "a", *args)
    _torchrun_train(tmp_path / "b", *args, "--stop-after", "1")
    saved = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    ranks = saved["adacomp"]
    assert [r["config"]["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["step"] == 2 and saved["settings"]["compression"] == "adacomp"  # 512 / 256
    for r in ranks:  # compressed steps ran: residuals hold what was not sent
        assert any(bool(v.any()) for v in r["residuals"].values())
    assert not all(
        torch.equal(ranks[0]["residuals"][k], ranks[1]["residuals"][k]) for k in ranks[0]["residuals"]
    )
    assert _torchrun_train(tmp_path / "b", *args, "--resume") == whole_run
    rates = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[-1])
    assert rates["compression_rates"]["fc"] > 1 and rates["compression_rates"]["dense"] == 1
    # Nor on another number of processes: one line on each rank, exit status 2.
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=4",
        "-m",
        "largebatch",
        "train",
        "--batch-size",
        "256",
        "--micro-batch",
        "64",
        "--out",
        str(tmp_path / "b"),
        *args,
        "--resume",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    line = (
        "largebatch train: --resume: {} holds the AdaComp residuals of 2 processes, not 4: resume it on 2"
    ).format(tmp_path / "b" / "checkpoint.pt")
    assert proc.returncode != 0 and proc.stderr.count(line) == 4, proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr and 'training/train.py", line' not in proc.stderr  # no traceback
    # A compressed run is not resumed as a plain one.
    with pytest.raises(SystemExit):
        cli(
            [
                "train",
                "--batch-size",
                "256",
                "--subset",
                "512",
                "--epochs",
                "2",
                "--out",
                str(tmp_path / "b"),
                "--resume",
            ]
        )
    assert "is a run with --compression adacomp, not none" in capsys.readouterr().err


def test_compression_needs_torchrun_without_fsdp(monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit, match="--compression adacomp compresses DDP's all-reduce"):
        cli([*TINY, "--compression", "adacomp", "--out", str(tmp_path)])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="without --fsdp"):
        cli([*TINY, "--compression", "adacomp", "--fsdp", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=re.escape("invalid --compression-warmup -1 (must be >= 0)")):
        cli([*TINY, "--compression", "adacomp", "--compression-warmup", "-1", "--out", str(tmp_path)])


def test_a_recipe_that_clips_per_process_refuses_another_hook(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    lamb = ["train", "--recipe", "resnet50-lamb-32k", "--data", str(tmp_path), "--out", str(tmp_path / "out")]
    for flag in (["--fsdp"], ["--compression", "adacomp"]):
        with pytest.raises(SystemExit, match="has each process clip its gradients before DDP"):
            cli([*lamb, *flag])


@pytest.mark.parametrize(("saved_world", "world"), [(2, 1), (1, 2)])
def test_a_resume_on_another_process_count_clips_as_its_own_set_up_does(saved_world, world):
    """A ``clip_per_process`` recipe's LAMB clips on one process and leaves the clip to the
    per-process hook on several: a checkpoint written on ``saved_world`` processes and
    resumed on ``world`` keeps the clip of the run that resumes it (2 -> 1 would otherwise
    train unclipped, 1 -> 2 clip twice)."""
    from types import SimpleNamespace

    from largebatch.training.run import restore

    recipe = dataclasses.replace(get_recipe("fmnist-lamb-1536"), clip_per_process=1.0)

    def optimizer(processes: int) -> torch.optim.Optimizer:
        torch.manual_seed(0)
        return build_optimizer(recipe, build_model(recipe.model, 10), 0.01, world=processes)

    saved = optimizer(saved_world)
    assert saved.max_grad_norm == (1.0 if saved_world == 1 else None)
    state = {
        "model": {},
        "optimizer": saved.state_dict(),
        "scheduler": {},
        "epoch": 1,
        "history": [],
        "rng": [(torch.get_rng_state(), None)],
    }
    resumed = optimizer(world)
    run = SimpleNamespace(
        fsdp=True,
        optimizer=resumed,
        recipe=recipe,
        world=world,
        rank=0,
        scaler=None,
        device=torch.device("cpu"),
        scheduler=SimpleNamespace(load_state_dict=lambda s: None),
    )
    assert restore(run, state) == (1, [])
    assert resumed.max_grad_norm == (1.0 if world == 1 else None)
    assert resumed.state_dict()["max_grad_norm"] == resumed.max_grad_norm


def test_recipes_table_lists_every_recipe(capsys):
    assert cli(["recipes"]) == 0
    out = capsys.readouterr().out
    lines = out.split("\n\n")[0].splitlines()  # the table; the sources follow it
    assert len(lines) == len(RECIPES) + 1
    for name, recipe in RECIPES.items():
        line = next((ln for ln in lines if ln.startswith(name + " ")), None)
        assert line is not None, f"{name} missing:\n{out}"
        assert f"{recipe.imagenet_batch:,}" in line and recipe.paper in line, line


def test_registry_rows():
    assert get_recipe("resnet50-goyal-8k").peak_lr == pytest.approx(3.2)  # 0.1 * 8192 / 256
    lr, warmup, smoothing, power = FASHION_SETTINGS["lars", 1536]
    lars = get_recipe("fmnist-lars-1536")
    assert (lars.peak_lr, lars.warmup_epochs, lars.lr_for(768)) == (lr, warmup, lr / 2)
    assert (lars.label_smoothing, lars.power) == (smoothing, power)
    assert get_recipe("fmnist-lars-1536").imagenet_batch == 32_798
    with pytest.raises(ValueError, match="known recipes: resnet50-goyal-8k"):
        get_recipe("nope")
    with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
        Recipe("x", "small_cnn", "fashion-mnist", "adam", 128, 1, lr=0.1)
    with pytest.raises(ValueError, match="exactly one of lr and base_lr"):
        Recipe("x", "small_cnn", "fashion-mnist", "sgd", 128, 1)


def test_lars_trust_ratios_are_the_ratios_the_optimizer_applies():
    from largebatch.torch import LARS, trust_ratios

    torch.manual_seed(0)
    params = [torch.randn(8, 4, requires_grad=True), torch.randn(3, 5, 5, requires_grad=True)]
    for p in params:
        p.grad = 8.0 * torch.randn_like(p)  # as if scaled by a GradScaler at scale 8
    lr, wd = 0.5, 1e-2
    opt = LARS(params, lr=lr, momentum=0.0, weight_decay=wd, trust_coefficient=0.02)
    ratios = trust_ratios(opt, grad_scale=8.0)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad /= 8.0
    opt.step()
    for ratio, w, p in zip(ratios, before, params):
        d = p.grad + wd * w  # with momentum 0: w_new = w - lr * ratio * d
        applied = float((w - p.detach()).norm() / (lr * d.norm()))
        assert ratio == pytest.approx(applied, rel=1e-5), (ratio, applied)


def test_imagefolder_tree_and_alexnet_bn(tmp_path):
    from PIL import Image

    from largebatch.models import alexnet_bn
    from largebatch.training.data import load_data

    rng = torch.Generator().manual_seed(0)
    for split, n in (("train", 3), ("val", 2)):
        for cls in ("cat", "dog"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(n):
                pixels = torch.randint(0, 256, (40, 48, 3), dtype=torch.uint8, generator=rng)
                Image.fromarray(pixels.numpy()).save(tmp_path / split / cls / f"{i}.png")
    data = load_data(get_recipe("alexnet-bn-lars-8k"), str(tmp_path), subset=None)
    assert (data.num_classes, data.n_train, len(data.test)) == (2, 6, 4)
    x, y = data.train[0]
    assert x.shape == (3, 224, 224) and y == 0

    model = alexnet_bn(num_classes=2)
    layers = list(model)
    convs = [i for i, m in enumerate(layers) if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 5 and all(isinstance(layers[i + 1], torch.nn.BatchNorm2d) for i in convs)
    assert sum(isinstance(m, torch.nn.BatchNorm1d) for m in layers) == 2
    assert model(torch.stack([x, data.test[0][0]])).shape == (2, 2)


def test_lamb_trust_ratios_are_the_ratios_the_optimizer_applies():
    from largebatch.torch import LAMB, trust_ratios

    torch.manual_seed(0)
    params = [torch.randn(8, 4, requires_grad=True), torch.randn(3, 5, 5, requires_grad=True)]
    lr, wd, (b1, b2) = 0.1, 0.01, (0.9, 0.999)
    opt = LAMB(params, lr=lr, weight_decay=wd)
    for _ in range(2):  # the second step starts from non-zero moments
        for p in params:
            p.grad = torch.randn_like(p)
        ratios = trust_ratios(opt)
        before = [p.detach().clone() for p in params]
        opt.step()
    for ratio, w, p in zip(ratios, before, params):
        state = opt.state[p]
        m = state["exp_avg"] / (1 - b1**2)
        v = state["exp_avg_sq"] / (1 - b2**2)
        u = m / (v.sqrt() + 1e-6) + wd * w  # w_new = w - lr * ratio * u
        torch.testing.assert_close(w - p.detach(), lr * ratio * u, rtol=1e-4, atol=1e-7)


def _image_tree(root, classes: dict[str, dict[str, int]]) -> None:
    """``root/split/class/i.png``: ``classes[split][class]`` small random images each."""
    from PIL import Image

    rng = torch.Generator().manual_seed(0)
    for split, counts in classes.items():
        for cls, n in counts.items():
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                pixels = torch.randint(0, 256, (8, 8, 3), dtype=torch.uint8, generator=rng)
                Image.fromarray(pixels.numpy()).save(root / split / cls / f"{i}.png")


@pytest.mark.parametrize(
    ("classes", "message"),
    [
        # val without class b: its folder c would be label 1, which is b in train
        (
            {"train": {"a": 1, "b": 1, "c": 1}, "val": {"a": 1, "c": 1}},
            "classes of {root}/val differ from those of {root}/train, so its labels would not match: "
            "missing in val: b",
        ),
        ({"train": {"a": 1, "b": 1}, "val": {"a": 1, "b": 1, "z": 1}}, "not in train: z"),
        (
            {"train": {"a": 2}, "val": {"a": 1}},
            "ImageFolder tree {root}/train has 1 class (a); a classifier needs at least 2",
        ),
    ],
)
def test_imagefolder_class_lists_must_match(tmp_path, capsys, classes, message):
    root = tmp_path / "tree"
    _image_tree(root, classes)
    with pytest.raises(SystemExit, match=re.escape(message.format(root=root))) as err:
        cli(["train", "--recipe", "alexnet-bn-lars-8k", "--data", str(root), "--out", str(tmp_path / "out")])
    assert err.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


_SLOW_SAVE = """
import io, sys, time
import torch

real_save = torch.save
calls = 0


def slow_save(obj, f, *args, **kwargs):  # the second checkpoint stalls halfway through
    global calls
    calls += 1
    if calls == 1:
        return real_save(obj, f, *args, **kwargs)
    buffer = io.BytesIO()
    real_save(obj, buffer, *args, **kwargs)
    data = buffer.getvalue()
    own = not hasattr(f, "write")
    handle = open(f, "wb") if own else f
    handle.write(data[: len(data) // 2])
    handle.flush()
    print("halfway", flush=True)
    time.sleep(120)


torch.save = slow_save
from largebatch.cli import main

main(sys.argv[1:])
"""


@pytest.mark.slow
def test_checkpoint_survives_a_kill_in_the_middle_of_its_rewrite(tmp_path):
    import signal

    args = [*SHORT, "--epochs", "2", "--out", str(tmp_path)]
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_SAVE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        for line in proc.stdout:
            if line.strip() == "halfway":
                break
        else:
            pytest.fail(f"the run ended before its second checkpoint: {proc.stderr.read()}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The epoch-1 checkpoint is whole and resumes; the killed write's leftover goes away.
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert state["epoch"] == 1
    assert [json.loads(line)["epoch"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        1
    ]
    assert cli([*args, "--resume"]) == 0
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["epoch"] == 2
    assert not list(tmp_path.glob(".*.tmp")), list(tmp_path.iterdir())


def test_atomic_write_keeps_the_old_file_when_the_writer_fails(tmp_path):
    from largebatch.outputs import atomic_write

    path = tmp_path / "summary.json"
    atomic_write(path, "old\n")

    def fail_midway(f):
        f.write(b"new, half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, fail_midway)
    assert path.read_text() == "old\n" and sorted(tmp_path.iterdir()) == [path]
    atomic_write(path, b"new\n")
    assert path.read_bytes() == b"new\n" and path.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_resume_refuses_other_settings_and_a_finished_run_says_so(tmp_path, capsys):
    args = [*SHORT, "--epochs", "2", "--out", str(tmp_path)]
    assert cli([*args, "--stop-after", "1"]) == 0
    capsys.readouterr()
    for flags, setting in [
        (["--recipe", "fmnist-sgd-384"], "--recipe fmnist-sgd-128, not fmnist-sgd-384"),
        (["--batch-size", "256"], "--batch-size 128, not 256"),
        (["--epochs", "3"], "--epochs 2, not 3"),
        (["--lr", "0.3"], "--lr 0.2, not 0.3"),
        (["--seed", "1"], "--seed 0, not 1"),
        (["--subset", "1024"], "--subset 256, not 1024"),
        (["--precision", "bf16"], "--precision fp32, not bf16"),
        (["--ghost-batch", "64"], "--ghost-batch unset, not 64"),
        (["--augment"], "--augment False, not True"),
    ]:
        with pytest.raises(SystemExit, match=re.escape(setting)) as err:
            cli([*args, *flags, "--resume"])
        assert err.value.code == 2
        stderr = capsys.readouterr().err
        assert stderr.startswith("largebatch train: --resume: ") and stderr.count("\n") == 1, stderr
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["epoch"] == 1
    assert cli([*args, "--resume"]) == 0
    metrics = (tmp_path / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert cli([*args, "--resume"]) == 0
    out = capsys.readouterr().out
    assert out == f"largebatch train: {tmp_path} already finished: 2 of 2 epochs; nothing to do\n"
    assert (tmp_path / "metrics.jsonl").read_text() == metrics


def test_a_second_run_on_the_same_out_is_refused(tmp_path, capsys):
    import fcntl

    tmp_path.joinpath(".lock").write_text("4242\n")
    with open(tmp_path / ".lock", "r+") as held:  # another run's lock on the folder
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(
            SystemExit, match=re.escape(f"--out {tmp_path} is in use by another run (process 4242)")
        ) as err:
            cli([*TINY, "--epochs", "1", "--out", str(tmp_path)])
    assert err.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "checkpoint.pt").exists()


def test_with_epochs_scales_warmup_and_milestones():
    goyal = get_recipe("resnet50-goyal-8k")
    assert goyal.with_epochs(90) is goyal
    short = goyal.with_epochs(9)
    assert (short.epochs, short.warmup_epochs, short.milestones) == (9, 0.5, (3, 6, 8))
    assert short.schedule_text == "0.5-epoch warmup, x0.1 at 3/6/8"
    assert get_recipe("fmnist-lars-1536").with_epochs(3).warmup_epochs == pytest.approx(0.2)
    # Shown to 4 significant digits where it runs longer; the recipe's own values as given.
    assert get_recipe("fmnist-lars-1536").with_epochs(1).schedule_text == "0.06667-epoch warmup, poly 2"
    assert goyal.with_epochs(10).schedule_text == "0.5556-epoch warmup, x0.1 at 3.333/6.667/8.889"


def test_a_shortened_run_scales_the_schedule_and_decays(tmp_path, capsys, monkeypatch):
    # The default recipe (2 of 30 epochs of warmup) in 3 epochs of 4 steps: the warmup
    # takes 0.2 epochs (1 step) and poly decay fills the rest; the recipe's 2 epochs
    # unscaled would make most of the run warmup.
    from largebatch.recipes import build

    schedules = []

    def spy(*args, **kwargs):
        schedules.append(make_schedule(*args, **kwargs))
        return schedules[-1]

    make_schedule = build.make_schedule
    monkeypatch.setattr(build, "make_schedule", spy)
    assert cli(["train", "--subset", "6144", "--epochs", "3", "--out", str(tmp_path)]) == 0
    (schedule,) = schedules
    lrs = [schedule(step) for step in range(13)]
    peak = get_recipe("fmnist-lars-1536").peak_lr
    assert lrs[1] == pytest.approx(peak) and lrs[2] < peak and lrs[12] == 0.0, lrs
    header = capsys.readouterr().out.splitlines()[0]
    assert header.endswith(
        "schedule 0.2-epoch warmup, poly 2 (the recipe's 2-epoch warmup, poly 2 over 30 epochs, scaled to 3)"
    ), header
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["schedule"] == "0.2-epoch warmup, poly 2"


def test_build_schedule_keeps_the_recipes_milestones_scaled_to_the_epochs():
    from largebatch.recipes.build import build_schedule

    goyal = get_recipe("resnet50-goyal-8k")  # 5-epoch warmup, x0.1 at 30, 60, 80 of 90
    full = build_schedule(goyal, peak_lr=3.2, epochs=90, n_train=100, batch=10)
    assert [full(t) for t in (50, 299, 300, 599, 600, 800, 899)] == pytest.approx(
        [3.2, 3.2, 0.32, 0.32, 0.032, 0.0032, 0.0032]
    )
    # 9 epochs: warmup 0.5 epochs (5 steps), milestones at epochs 3, 6, 8.
    short = build_schedule(goyal, peak_lr=3.2, epochs=9, n_train=100, batch=10)
    # Warmup from the paper's 0.1 (§5.2): 4 of 5 steps in, 0.1 + 0.8 x (3.2 - 0.1).
    assert [short(t) for t in (4, 5, 29, 30, 60, 80)] == pytest.approx(
        [0.1 + 0.8 * 3.1, 3.2, 3.2, 0.32, 0.032, 0.0032]
    )
    # The study's warmup replaces the recipe's, unscaled; the milestones stay.
    tuned = build_schedule(goyal, peak_lr=3.2, epochs=9, n_train=100, batch=10, warmup_epochs=2)
    assert [tuned(t) for t in (10, 20, 29, 30, 60)] == pytest.approx([0.1 + 0.5 * 3.1, 3.2, 3.2, 0.32, 0.032])
    # A milestone that rounds into the warmup is dropped.
    late = build_schedule(goyal, peak_lr=3.2, epochs=9, n_train=100, batch=10, warmup_epochs=4)
    assert [late(t) for t in (40, 59, 60, 80)] == pytest.approx([3.2, 3.2, 0.32, 0.032])


def test_stream_sampler_reads_consecutive_shuffled_passes_split_over_processes():
    from largebatch.training.data import StreamSampler

    n, batch, world, seed = 10, 4, 2, 3
    passes = [torch.randperm(n, generator=torch.Generator().manual_seed(seed + p)) for p in range(3)]
    stream = torch.cat(passes).tolist()

    def read(start, stop, rank):
        return list(StreamSampler(n, batch, rank, world, seed, start, stop))

    for step in range(6):  # step 2 spans passes 0 and 1, step 4 passes 1 and 2
        whole = read(step, step + 1, 0) + read(step, step + 1, 1)
        assert whole == stream[step * batch : (step + 1) * batch], step
    assert read(0, 2, 1) + read(2, 5, 1) == read(0, 5, 1)  # an epoch boundary changes nothing
    assert len(StreamSampler(n, batch, 0, world, seed, 2, 5)) == 6
    with pytest.raises(ValueError, match="batch 5 is not divisible by the world size 2"):
        StreamSampler(n, 5, 0, world, seed, 0, 1)


def _stream_recipe(monkeypatch, epoch_steps):
    recipe = dataclasses.replace(
        get_recipe("fmnist-lars-1536"), name=f"fmnist-lars-{epoch_steps}", epoch_steps=epoch_steps
    )
    monkeypatch.setitem(RECIPES, recipe.name, recipe)
    # 1,000 images at 256: N / B = 3.906 steps an epoch
    return ["train", "--recipe", recipe.name, "--subset", "1000", "--batch-size", "256", "--epochs", "3"]


def _assert_step_arithmetic(out, capsys, epoch_steps: str, steps: int) -> None:
    """The run in ``out`` took ``steps`` steps, and its header says how ``epoch_steps``
    counts them."""
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["optimizer"]["num_steps"] == steps
    assert state["scheduler"]["last_epoch"] == steps
    header = capsys.readouterr().out.splitlines()[0]
    assert {
        "floor": "3 steps an epoch (N // B)",
        "ceil": "4 steps an epoch (ceil(N / B))",
        "exact": "12 steps in all (epoch e ends at step round(e N / B))",
    }[epoch_steps] in header, header


# "exact" (round(3 x 3.906) = 12 steps) is the straight run of the stream resume below.
@pytest.mark.parametrize("epoch_steps, steps", [("floor", 3 * 3), ("ceil", 3 * 4)])
def test_train_runs_the_recipes_step_arithmetic(tmp_path, monkeypatch, capsys, epoch_steps, steps):
    args = _stream_recipe(monkeypatch, epoch_steps)
    assert cli([*args, "--out", str(tmp_path)]) == 0
    _assert_step_arithmetic(tmp_path, capsys, epoch_steps, steps)


def test_a_stream_epoch_resumes_bit_for_bit(tmp_path, monkeypatch, capsys):
    args = _stream_recipe(monkeypatch, "exact")  # epoch 1 ends at step 4, inside pass 2
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert cli([*args, "--out", str(straight)]) == 0
    _assert_step_arithmetic(straight, capsys, "exact", 12)
    assert cli([*args, "--out", str(split), "--stop-after", "1"]) == 0
    assert cli([*args, "--out", str(split), "--resume"]) == 0
    a, b = _params(straight), _params(split)
    assert all(torch.equal(a[k], b[k]) for k in a)


class _Stream(io.StringIO):
    """A text stream that says whether it is a terminal (``tty``)."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [False, True], ids=["pipe", "terminal"])
def test_a_bar_shows_the_runs_progress_on_a_terminal_only(tmp_path, monkeypatch, capsys, tty):
    """One bar for the whole run (4 steps over 2 epochs): the epoch, the steps, the time
    left, the epoch's mean training loss; no bar when stderr is not a terminal."""
    err = _Stream(tty)
    monkeypatch.setattr(sys, "stderr", err)
    assert cli([*SHORT, "--epochs", "2", "--out", str(tmp_path)]) == 0
    out, bar = capsys.readouterr().out, err.getvalue()
    if tty:
        assert "\repoch 2/2:" in bar and "4/4 [" in bar and "loss=" in bar, bar
        assert re.search(r"\[\d\d:\d\d<\d\d:\d\d", bar), bar  # elapsed<left
        assert "epoch   2/2  train loss" in out
    else:
        assert bar == "" and "\r" not in out


@pytest.mark.parametrize(
    "name,world,local,index", [("cuda", "1", "0", 0), ("cuda", "2", "1", 1), ("cuda:1", "1", "0", 1)]
)
def test_join_hands_set_device_a_device_with_an_index(monkeypatch, name, world, local, index):
    """``torch.cuda.set_device`` refuses a bare ``cuda`` (no index): ``--device cuda`` in one
    process must name the GPU, as under torchrun each rank names its ``LOCAL_RANK``."""
    from torch.cuda._utils import _get_device_index

    from largebatch.training import distributed

    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(_get_device_index(d)))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)  # no group joined here
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", local)
    monkeypatch.setenv("LOCAL_RANK", local)
    assert distributed.join(name) == (int(local), int(world), torch.device("cuda", index))
    assert chosen == [index]
