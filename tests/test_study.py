"""``largebatch study``: the tuning plan, the report, and tiny end-to-end sweeps."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import user_error

from largebatch import study
from largebatch.cli import main as cli
from largebatch.cli import study as study_cli
from largebatch.recipes.registry import RECIPES, get_recipe, imagenet_equivalent
from largebatch.study import RunSpec, StudyConfig, plan, summarize

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _result(spec: RunSpec, accuracy: float, curve_acc: list[float] | None = None) -> dict:
    curve_acc = curve_acc or [accuracy] * spec.epochs
    return {
        "spec": vars(spec) | {},
        "accuracy": curve_acc[-1],
        "diverged": False,
        "steps_per_epoch": 10,
        "seconds": 0.0,
        "curve": [
            {"epoch": e + 1, "step": 10 * (e + 1), "train_loss": 1.0, "accuracy": a}
            for e, a in enumerate(curve_acc)
        ],
    }


def _finish(specs, score) -> dict:
    return {s.key: _result(s, score(s)) for s in specs}


LARS_3072 = StudyConfig(batches=(3072,), optimizers=("lars",), extend=1, ablate=False)
CENTRE = study.GRID_CENTRES["lars", 3072]


def test_every_study_pair_has_a_recipe_and_a_grid_centre():
    cfg = StudyConfig()
    assert cfg.pairs() == [
        (128, "sgd"),
        (1536, "sgd"),
        (1536, "lars"),
        (1536, "lamb"),
        (3072, "sgd"),
        (3072, "lars"),
        (3072, "lamb"),
    ]
    every = StudyConfig(batches=study.FULL_BATCHES, optimizers=study.STUDY_OPTIMIZERS)
    assert len(every.pairs()) == 1 + 3 * 4
    for batch, optimizer in every.pairs():
        recipe = get_recipe(f"fmnist-{optimizer}-{batch}")
        assert recipe.data == "fashion-mnist" and recipe.batch_size == batch
        assert recipe.model == "fmnist_cnn" and recipe.epochs == 30
        assert study.GRID_CENTRES[optimizer, batch] > 0


def test_first_plan_is_the_lr_grid_times_the_warmups_with_the_techniques_on():
    specs = plan(LARS_3072, {})
    assert {(s.lr, s.warmup_epochs) for s in specs} == {
        (study.round_lr(CENTRE * f), w) for f in (0.5, 1, 2) for w in (2.0, 5.0)
    }
    assert {(s.phase, s.seed, s.epochs) for s in specs} == {("tune", 0, 30)}
    assert {(s.label_smoothing, s.power) for s in specs} == {(0.1, 2.0)}
    # The baseline batch tunes over its own warmups; the switches reach every run.
    base = plan(
        StudyConfig(
            batches=(128,), optimizers=("sgd",), label_smoothing=0.0, power=1.0, small_warmups=(0.0, 1.0)
        ),
        {},
    )
    assert {(s.warmup_epochs, s.label_smoothing, s.power) for s in base} == {(0.0, 0.0, 1.0), (1.0, 0.0, 1.0)}


def test_an_interior_best_goes_straight_to_three_final_seeds():
    centre = study.round_lr(CENTRE)
    grid = plan(LARS_3072, {})
    results = _finish(grid, lambda s: 0.9 if (s.lr, s.warmup_epochs) == (centre, 5.0) else 0.5)
    finals = plan(LARS_3072, results)
    assert [(s.phase, s.lr, s.warmup_epochs, s.seed) for s in finals] == [
        ("final", centre, 5.0, seed) for seed in range(3)
    ]
    results |= _finish(finals, lambda s: 0.9)
    assert plan(LARS_3072, results) == []
    (row,) = summarize(LARS_3072, results)["rows"]
    assert not row["lr_on_grid_edge"] and row["lr"] == centre


def test_time_to_accuracy_runs_again_the_tuning_run_that_reaches_the_target_first():
    """``--time-to-accuracy``: the validation target is the baseline's best validation
    accuracy minus 0.01 (rounded down to 0.001); each pair also re-runs, with every seed,
    its tuning run that first reaches it (ties: the higher final accuracy), which may
    differ from the most accurate one, and the report gets a second table."""
    cfg = StudyConfig(
        batches=(128, 3072), optimizers=("sgd", "lars"), ablate=False, extend=0, time_to_accuracy=True
    )
    centre = study.round_lr(CENTRE)
    fast = (study.round_lr(CENTRE * 2), 2.0)  # reaches 0.9 at epoch 3, ends below the best

    def curve(s):
        if s.batch == 128:  # the baseline: best 0.91 -> validation target 0.9
            return [0.5] * 29 + [0.91 if (s.lr, s.warmup_epochs) == (0.2, 0.0) else 0.8]
        if (s.lr, s.warmup_epochs) == fast:
            return [0.5, 0.6] + [0.9] * 28
        if (s.lr, s.warmup_epochs) == (centre, 5.0):
            return [0.5] * 20 + [0.95] * 10
        return [0.5] * 30

    def finish(specs):
        return {s.key: _result(s, 0, curve(s)) for s in specs}

    results = {}
    while todo := [s for s in plan(cfg, results) if s.phase == "tune"]:
        results |= finish(todo)
    assert study.validation_target(cfg, results) == 0.9
    finals = plan(cfg, results)
    assert len({s.key for s in finals}) == len(finals)  # each run once
    assert {s.key for s in study.runs_left(cfg, results)} == {s.key for s in finals}
    lars = [(s.lr, s.warmup_epochs, s.seed) for s in finals if s.optimizer == "lars"]
    assert sorted(lars) == sorted([(centre, 5.0, k) for k in range(3)] + [(*fast, k) for k in range(3)])
    # The baseline's fastest run is its most accurate one: its finals are shared. No run
    # of B=3072 sgd reaches the target: it has only its accuracy finals.
    assert sum(s.batch == 128 for s in finals) == 3
    assert sum((s.batch, s.optimizer) == (3072, "sgd") for s in finals) == 3
    results |= finish(finals)
    assert plan(cfg, results) == []
    summary = summarize(cfg, results)
    (lars_fast,) = [r for r in summary["fast_rows"] if r["optimizer"] == "lars"]
    assert (lars_fast["lr"], lars_fast["warmup_epochs"]) == fast
    assert "Tuned for time to accuracy" in study.study_markdown(summary)
    # Without the flag, nothing of it is planned or reported.
    plain = dataclasses.replace(cfg, time_to_accuracy=False)
    assert "fast_rows" not in summarize(plain, results)
    assert study.fastest_plan(plain, results, 3072, "lars") == ([], [])
    with pytest.raises(ValueError, match="Invalid time_to_accuracy with quick"):
        study.check_config(dataclasses.replace(cfg, quick=True))


def test_time_to_accuracy_grows_its_own_grid_past_an_edge_holding_the_fastest_run():
    """The fastest run on the grid's lower edge: the time-to-accuracy grid grows below it
    (every warmup, ``extend`` times at most) while the accuracy pick and its finals stay
    those of the accuracy grid."""
    cfg = StudyConfig(
        batches=(128, 3072), optimizers=("sgd", "lars"), ablate=False, extend=1, time_to_accuracy=True
    )
    low = study.round_lr(CENTRE / 2)

    def curve(s):
        if s.batch == 128:  # the baseline: best 0.91 at lr 0.2 -> validation target 0.9
            return [0.5] * 29 + [0.91 if (s.lr, s.warmup_epochs) == (0.2, 0.0) else 0.8]
        if s.optimizer == "sgd":
            return [0.5] * 30
        if s.lr == CENTRE:  # the most accurate, reaching the target late
            return [0.5] * 20 + [0.95] * 10
        # The lower the lr, the sooner at 0.9 (warmup 2: one epoch sooner than warmup 5)
        first = max(1, round(math.log2(s.lr / low)) + 4 + (s.warmup_epochs == 5.0))
        return [0.5] * (first - 1) + [0.9] * (31 - first)

    results, tuned = {}, []
    while todo := [s for s in plan(cfg, results) if s.phase == "tune"]:
        tuned += todo
        results |= {s.key: _result(s, 0, curve(s)) for s in todo}
    lars_lrs = sorted({s.lr for s in tuned if s.optimizer == "lars"})
    # The accuracy grid (1/2, 1, 2 x centre) does not grow: its best is inside. The fast
    # grid grows once below its edge, to 1/4 x centre, and stops there (extend 1), though
    # the fastest is on the edge again.
    assert lars_lrs == [study.round_lr(CENTRE / 4), low, CENTRE, study.round_lr(CENTRE * 2)]
    extra, fast = study.fastest_plan(cfg, results, 3072, "lars")
    assert {(s.lr, s.warmup_epochs) for s in extra} == {
        (study.round_lr(CENTRE / 4), 2.0),
        (study.round_lr(CENTRE / 4), 5.0),
    }
    assert {(s.lr, s.warmup_epochs, s.phase) for s in fast} == {(study.round_lr(CENTRE / 4), 2.0, "final")}
    _, final = study.pair_plan(cfg, results, 3072, "lars")
    assert {(s.lr, s.warmup_epochs) for s in final} == {(CENTRE, 2.0)}
    # The baseline's fastest run, inside its grid, is its most accurate: no growth there.
    assert study.fastest_plan(cfg, results, 128, "sgd")[0] == []
    # The finals run, the report marks the fast row as on the edge.
    results |= {s.key: _result(s, 0, curve(s)) for s in plan(cfg, results)}
    (row,) = [r for r in summarize(cfg, results)["fast_rows"] if r["optimizer"] == "lars"]
    assert row["lr_on_grid_edge"] and row["lr"] == study.round_lr(CENTRE / 4)


@pytest.mark.parametrize(
    "winner, expected",
    [
        (None, (0.1, 2.0)),  # every technique on stays best
        ("no_label_smoothing", (0.0, 2.0)),
        ("power_1", (0.1, 1.0)),
    ],
)
def test_each_technique_is_switched_off_at_the_best_grid_point(winner, expected):
    cfg = dataclasses.replace(LARS_3072, ablate=True)
    centre = study.round_lr(CENTRE)
    grid = plan(cfg, {})

    def score(s):
        if (s.label_smoothing, s.power) == (0.1, 2.0):
            return 0.9 if (s.lr, s.warmup_epochs) == (centre, 2.0) else 0.5
        name = "no_label_smoothing" if s.label_smoothing == 0 else "power_1"
        return 0.95 if name == winner else 0.85

    results = _finish(grid, score)
    off = plan(cfg, results)  # the best grid point, once without each technique
    assert {(s.phase, s.lr, s.warmup_epochs, s.label_smoothing, s.power) for s in off} == {
        ("tune", centre, 2.0, 0.0, 2.0),
        ("tune", centre, 2.0, 0.1, 1.0),
    }
    results |= _finish(off, score)
    finals = plan(cfg, results)
    assert {(s.phase, s.lr, s.warmup_epochs, s.label_smoothing, s.power) for s in finals} == {
        ("final", centre, 2.0, *expected)
    }
    assert [s.seed for s in finals] == [0, 1, 2]
    results |= _finish(finals, lambda s: 0.9)
    summary = summarize(cfg, results)
    (tech,) = summary["techniques"]
    assert (tech["accuracy"], tech["no_label_smoothing"], tech["power_1"]) == (
        0.9,
        *[0.95 if name == winner else 0.85 for name in ("no_label_smoothing", "power_1")],
    )
    assert tech["other_warmup"] == [{"warmup_epochs": 5.0, "accuracy": 0.5}]
    (row,) = summary["rows"]
    assert (row["label_smoothing"], row["power"]) == expected
    text = study.study_markdown(summary)
    assert f"| {expected[0]:g}, poly {expected[1]:g} |" in text
    assert f"| 3,072 | lars | lr {centre:g}, warmup 2 | 90.00 | 50.00 (5 ep.) |" in text
    # The grid table shows only the runs with every technique on.
    assert [len(g["runs"]) for g in summary["grids"]] == [6]


def test_a_best_on_the_edge_grows_the_grid_once_on_that_side():
    grid = plan(LARS_3072, {})
    results = _finish(grid, lambda s: s.lr)  # larger lr, better: the top edge wins
    grown = plan(LARS_3072, results)
    assert {(s.lr, s.warmup_epochs) for s in grown} == {
        (study.round_lr(4 * CENTRE), 2.0),
        (study.round_lr(4 * CENTRE), 5.0),
    }
    results |= _finish(grown, lambda s: s.lr)
    finals = plan(LARS_3072, results)  # still on the edge, but extend=1 is spent
    assert {(s.phase, s.lr) for s in finals} == {("final", study.round_lr(4 * CENTRE))}
    results |= _finish(finals, lambda s: 0.9)
    (row,) = summarize(LARS_3072, results)["rows"]
    assert row["lr_on_grid_edge"] and row["seeds"] == 3
    assert f"| {4 * CENTRE:g} (edge) |" in study.study_markdown(summarize(LARS_3072, results))
    # With extend=0 the first grid is final; with extend=2 it grows again.
    assert {
        s.lr for s in plan(StudyConfig(**{**vars(LARS_3072), "extend": 0}), _finish(grid, lambda s: s.lr))
    } == {study.round_lr(2 * CENTRE)}
    assert {s.lr for s in plan(StudyConfig(**{**vars(LARS_3072), "extend": 2}), results)} == {
        study.round_lr(8 * CENTRE)
    }


def test_a_bottom_edge_best_grows_downwards():
    centre = study.GRID_CENTRES["sgd", 1536]
    cfg = StudyConfig(batches=(1536,), optimizers=("sgd",))
    results = _finish(plan(cfg, {}), lambda s: -s.lr)
    assert {s.lr for s in plan(cfg, results)} == {study.round_lr(centre / 4)}


def test_the_grid_does_not_move_with_the_recipes(monkeypatch):
    """The recipes carry the study's results; the grid that produced them stays put, so a
    finished study still reads as finished after its results went into the recipes."""
    before = plan(LARS_3072, {})
    recipe = get_recipe("fmnist-lars-3072")
    monkeypatch.setitem(RECIPES, recipe.name, dataclasses.replace(recipe, lr=recipe.lr * 3))
    assert plan(LARS_3072, {}) == before


def test_quick_plan_runs_the_recipes_settings_without_tuning():
    cfg = StudyConfig(quick=True, batches=(128, 1536), optimizers=("sgd", "lars"), seeds=1)
    specs = plan(cfg, {})
    expected = [(128, "sgd"), (1536, "sgd"), (1536, "lars")]
    assert [(s.batch, s.optimizer) for s in specs] == expected
    for s in specs:
        recipe = get_recipe(f"fmnist-{s.optimizer}-{s.batch}")
        assert (s.phase, s.lr, s.warmup_epochs, s.epochs, s.label_smoothing, s.power) == (
            "final",
            recipe.peak_lr,
            recipe.warmup_epochs,
            recipe.epochs,
            recipe.label_smoothing,
            recipe.power,
        )


def _args(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    study_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_quick_runs_the_quick_pairs_unless_told_otherwise():
    cfg = study_cli.config(_args("--quick"))
    assert cfg.pairs() == list(study.QUICK_PAIRS) and cfg.seeds == 1
    assert [(s.batch, s.optimizer, s.phase) for s in plan(cfg, {})] == [
        (b, o, "final") for b, o in study.QUICK_PAIRS
    ]
    told = study_cli.config(_args("--quick", "--optimizers", "sgd,lars"))
    assert told.pairs() == [(128, "sgd"), (1536, "sgd"), (1536, "lars"), (3072, "sgd"), (3072, "lars")]
    full = study_cli.config(_args())
    assert full.pairs() == StudyConfig().pairs() and full.seeds == 3 and not full.quick


def test_summary_reports_mean_std_delta_and_steps_to_target():
    cfg = StudyConfig(quick=True, batches=(128, 3072), optimizers=("sgd", "lars"), seeds=2, epochs=3)
    specs = plan(cfg, {})
    curves = {
        (128, "sgd", 0): [0.80, 0.88, 0.90],
        (128, "sgd", 1): [0.81, 0.89, 0.92],
        (3072, "sgd", 0): [0.5, 0.7, 0.85],
        (3072, "sgd", 1): [0.5, 0.7, 0.86],
        (3072, "lars", 0): [0.7, 0.895, 0.905],
        (3072, "lars", 1): [0.7, 0.88, 0.90],
    }
    results = {s.key: _result(s, 0, curves[s.batch, s.optimizer, s.seed]) for s in specs}
    for i, r in enumerate(results.values()):
        r["seconds"] = 600.0 * (i + 1)  # 6 runs: 1 + 2 + ... + 6 = 21 ten-minute units
    summary = summarize(cfg, results)
    assert summary["target"] == pytest.approx(0.90)  # baseline mean 0.91 minus one point
    rows = {(r["batch"], r["optimizer"]): r for r in summary["rows"]}
    assert rows[128, "sgd"]["accuracy_mean"] == pytest.approx(0.91)
    assert rows[128, "sgd"]["accuracy_std"] == pytest.approx(math.sqrt(2) * 0.01)
    assert rows[3072, "lars"]["delta_vs_baseline"] == pytest.approx(-0.0075)
    # The difference's own standard error, from both rows' seeds: not either row's spread.
    se = math.sqrt(statistics.variance([0.905, 0.90]) / 2 + statistics.variance([0.90, 0.92]) / 2)
    assert rows[3072, "lars"]["delta_vs_baseline_se"] == pytest.approx(se)
    assert rows[128, "sgd"]["delta_vs_baseline_se"] is None
    assert rows[128, "sgd"]["steps_to_target"] == [30, 30]
    assert rows[3072, "lars"]["steps_to_target"] == [30, 30]
    assert rows[3072, "sgd"]["steps_to_target"] == [None, None]
    text = study.study_markdown(summary)
    assert "| 3,072 | 65,596 | lars | 3 | 30 |" in text
    assert f"90.25 ± 0.35 (2) | -0.75 ± {100 * se:.2f} | 30 |" in text
    assert "91.00 ± 1.41 (2) | +0.00 | 30 |" in text
    assert "not reached" in text
    assert "Run time: 6 runs, 3.5 h of training" in text


def _row(batch, optimizer, mean, std=0.001, seeds=3, fewer=None):
    return {
        "batch": batch,
        "optimizer": optimizer,
        "accuracy_mean": mean,
        "accuracy_std": std,
        "seeds": seeds,
        "fewer_steps": fewer,
    }


def test_compare_puts_each_model_against_its_own_baseline_and_tuned_sgd():
    cnn = {
        "model": "fmnist_cnn",
        "n_train": 60000,
        "runs": 10,
        "run_seconds": 5400.0,
        "rows": [
            _row(128, "sgd", 0.92, 0.002),
            _row(1536, "sgd", 0.915, 0.003, seeds=2),
            _row(1536, "lars", 0.914),
            _row(1536, "lamb", 0.915, 0.004),
            _row(3072, "lars", 0.9089),
            _row(3072, "sgd", 0.9, seeds=1),
        ],
        "fast_rows": [
            _row(1536, "lars", 0.91, fewer=12.04),
            _row(1536, "lamb", 0.91, fewer=9.0),
            _row(3072, "lars", 0.9, fewer=None),
        ],
    }
    resnet = {
        "model": "small_resnet",
        "n_train": 60000,
        "runs": 2,
        "run_seconds": 360.0,
        "rows": [_row(128, "sgd", 0.93, 0.0)],
    }
    text = study.report.compare_markdown([cnn, resnet])
    lines = text.splitlines()
    # Exactly half a point below the baseline is within the 32K-equivalent tolerance; the
    # difference to SGD carries the standard error of the two means.
    se_lars, se_lamb = (100 * math.sqrt(0.003**2 / 2 + std**2 / 3) for std in (0.001, 0.004))
    se_base = 100 * math.sqrt(0.002**2 / 3 + 0.004**2 / 3)
    assert lines[2] == (
        "| fmnist_cnn | 1,536 (32,798) | 92.00 ± 0.20 | 91.50 ± 0.30 | 91.40 ± 0.10 | "
        f"91.50 ± 0.40 | -0.50 ± {se_base:.2f} (lamb, within 0.5) | -0.10 ± {se_lars:.2f} "
        f"| +0.00 ± {se_lamb:.2f} | 12.0x (lars) |"
    )
    # A missing optimizer is a dash, 1.11 points is beyond the 64K-equivalent's one, and a
    # row of one seed has no spread to give a standard error.
    se_far = 100 * math.sqrt(0.002**2 / 3 + 0.001**2 / 3)
    assert lines[3] == (
        "| fmnist_cnn | 3,072 (65,596) | 92.00 ± 0.20 | 90.00 | 90.89 ± 0.10 | - | "
        f"-1.11 ± {se_far:.2f} (lars, beyond 1.0) | +0.89 | - | - |"
    )
    assert len(lines) == 4 + 1 + 4  # a model with only its baseline has no batch to compare
    assert lines[-2:] == ["| fmnist_cnn | 10 | 1.5 |", "| small_resnet | 2 | 0.1 |"]


def test_compare_on_a_folder_without_a_study_is_one_line(tmp_path, capsys):
    headline = Path(__file__).parents[1] / "docs" / "study" / "headline"
    line = user_error(["study", "--compare", str(headline), str(tmp_path / "none")], capsys)
    assert line == f"largebatch study: --compare: {tmp_path / 'none'} holds no study: no such folder"


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--batches", "128,1000"], "Invalid batch 1000"),
        (["--optimizers", "adam"], "Invalid optimizer 'adam'"),
        (["--subset", "400", "--batches", "384"], "Invalid subset: 400"),
        (["--seeds", "0"], "Invalid seeds: 0"),
        (["--target", "90"], "Invalid target: 90"),
        (["--batches", "384", "--optimizers", "sgd,sgd", "--extend", "-1"], "Invalid extend: -1"),
        (["--batches", "384", "--workers", "5"], "Invalid workers: 5 does not divide the batch 384"),
        (["--workers", "0"], "Invalid workers: 0"),
        (["--compression", "adacomp"], "Invalid compression: adacomp needs --workers 2 or more"),
        (
            ["--workers", "2", "--compression", "adacomp", "--compression-warmup", "-1"],
            "Invalid compression_warmup: -1",
        ),
        (
            ["--batches", "384", "--optimizers", "sgd,lars", "--freeze-variance"],
            "Invalid freeze_variance: only LAMB has a second moment to freeze",
        ),
        (
            ["--workers", "2", "--compression", "adacomp", "--compression-warmup", "0", "--freeze-variance"],
            "Invalid freeze_variance with compression_warmup 0",
        ),
    ],
)
def test_bad_flags_fail_before_any_run(tmp_path, args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "largebatch", "study", "--out", str(tmp_path / "out"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


TINY = [
    "--subset",
    "2400",
    "--epochs",
    "1",
    "--batches",
    "128,384",
    "--optimizers",
    "sgd,lars",
    "--threads",
    "1",
]


@pytest.mark.slow
def test_tiny_study_end_to_end_then_resume_reuses_every_run(tmp_path):
    out = tmp_path / "study"
    cmd = [
        sys.executable,
        "-m",
        "largebatch",
        "study",
        *TINY,
        "--seeds",
        "2",
        "--jobs",
        "2",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = (out / "runs.jsonl").read_text().splitlines()
    # 6 tuning runs per pair (+2 for each grid that grows) and 2 final seeds per pair.
    phases = [json.loads(line)["spec"]["phase"] for line in lines]
    assert phases.count("final") == 3 * 2 and phases.count("tune") >= 3 * 6, phases
    # Pair by pair: the baseline's first final run is done before the last pair starts.
    specs = [json.loads(line)["spec"] for line in lines]
    order = [(sp["batch"], sp["optimizer"], sp["phase"]) for sp in specs]
    assert order.index((128, "sgd", "final")) < order.index((384, "lars", "tune")), order
    summary = json.loads((out / "study.json").read_text())
    assert [(r["batch"], r["optimizer"]) for r in summary["rows"]] == [
        (128, "sgd"),
        (384, "sgd"),
        (384, "lars"),
    ]
    for row in summary["rows"]:
        # Chance is 10% (+-0.6 points on 2,400 test images); 1 epoch is 6 to 18 steps.
        assert row["seeds"] == 2 and row["accuracy_mean"] > 0.15, row
    assert (
        f"| 128 | {imagenet_equivalent(128, 60_000):,} | sgd | 1 | 18 |" in (out / "study.md").read_text()
    )  # the final runs train on all 2,400 images
    assert (out / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Tuning (validation accuracy" in proc.stdout

    # The same command again trains nothing new and prints the same table.
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 0, again.stderr
    assert (out / "runs.jsonl").read_text().splitlines() == lines
    assert f"{len(lines)} reused" in again.stdout
    table = proc.stdout[proc.stdout.index("| batch") : proc.stdout.index("wrote")]
    assert table in again.stdout

    # One more seed, in this process (--jobs 1): only the three new final runs train.
    more = subprocess.run(
        [*cmd[: cmd.index("--seeds")], "--seeds", "3", "--jobs", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert more.returncode == 0, more.stderr
    added = [json.loads(line)["spec"] for line in (out / "runs.jsonl").read_text().splitlines()[len(lines) :]]
    assert [(s["phase"], s["seed"]) for s in added] == [("final", 2)] * 3, added
    assert "1 job(s)" in more.stdout and "(3) |" in more.stdout


@pytest.mark.slow
def test_pool_and_single_process_runs_agree_bit_for_bit(tmp_path):
    """The same run in a spawned worker and in this process: identical accuracy curves."""
    import torch

    recipe = get_recipe("fmnist-lars-384").with_epochs(1)  # the study's run of 1 epoch
    spec = RunSpec(
        "final",
        384,
        "lars",
        study.round_lr(recipe.peak_lr),
        recipe.warmup_epochs,
        seed=1,
        epochs=1,
        subset=1200,
        label_smoothing=recipe.label_smoothing,
        power=recipe.power,
    )
    threads = torch.get_num_threads()
    try:
        study.init_worker(1, None, "cpu")
        here = study.run_one(spec)
    finally:
        study.WORKER.clear()
        torch.set_num_threads(threads)
    cfg = StudyConfig(
        quick=True,
        batches=(384,),
        optimizers=("lars",),
        seeds=2,
        epochs=1,
        subset=1200,
        jobs=2,
        threads=1,
        out=str(tmp_path),
    )
    summary = study.run_study(cfg, print_fn=lambda _: None)
    (row,) = summary["rows"]
    assert row["curves"][1] == here["curve"]
    assert row["accuracies"][1] == here["accuracy"] and math.isfinite(here["curve"][0]["train_loss"])
    # Each run records the thread count it ran on: another count rounds differently.
    recorded = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert here["threads"] == 1 and [r["threads"] for r in recorded] == [1, 1]


def test_a_run_follows_its_recipes_step_schedule_and_milestones(monkeypatch):
    """The study builds a run's schedule from its recipe, as ``largebatch train`` does: a
    ``step`` recipe's milestones (in epochs) decay the lr; only the peak lr and the warmup
    come from the run's spec."""
    import dataclasses

    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    recipe = dataclasses.replace(
        get_recipe("fmnist-sgd-384"), schedule="step", epochs=3, milestones=(1.0, 2.0)
    )
    monkeypatch.setitem(RECIPES, recipe.name, recipe)
    lrs = []  # the lr of every optimizer step, read just before the step
    hook = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: lrs.append(optimizer.param_groups[0]["lr"])
    )
    threads = torch.get_num_threads()
    try:
        study.init_worker(1, None, "cpu")
        # 1,200 images at B=384: 3 steps an epoch; milestones at steps 3 and 6.
        run = study.run_one(RunSpec("final", 384, "sgd", 0.5, 0.0, seed=0, epochs=3, subset=1200))
    finally:
        hook.remove()
        study.WORKER.clear()
        torch.set_num_threads(threads)
    assert run["steps_per_epoch"] == 3 and len(run["curve"]) == 3
    assert lrs == pytest.approx([0.5] * 3 + [0.05] * 3 + [0.005] * 3)


@pytest.mark.slow
def test_report_writes_the_tables_of_a_part_finished_study_and_trains_nothing(tmp_path):
    grid = plan(LARS_3072, {})
    log = tmp_path / "runs.jsonl"
    log.write_text("".join(json.dumps(_result(s, 0.5 + s.lr / 1000)) + "\n" for s in grid))
    before = log.read_bytes()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "largebatch",
            "study",
            "--report",
            "--batches",
            "3072",
            "--optimizers",
            "lars",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "the report of the 6 finished runs" in proc.stdout
    assert "2 runs are planned next" in proc.stdout  # the grid grows past its top edge
    assert log.read_bytes() == before  # nothing trained, nothing appended
    text = (tmp_path / "study.md").read_text()
    assert f"lr {study.round_lr(2 * CENTRE):g} **" in text  # the grid's best, in bold
    assert json.loads((tmp_path / "study.json").read_text())["rows"] == []  # no finals yet
    assert not (tmp_path / "study.png").exists() and "Warning" not in proc.stderr


def test_a_truncated_line_in_runs_jsonl_is_skipped_with_a_warning(tmp_path, capsys):
    specs = plan(StudyConfig(quick=True, batches=(128,), optimizers=("sgd",), seeds=3), {})
    rows = [_result(s, 0.8) for s in specs]
    log = tmp_path / "runs.jsonl"
    whole, cut = json.dumps(rows[0]), json.dumps(rows[1])
    log.write_text(whole + "\n" + cut[: len(cut) // 2])  # killed in the middle of a write
    assert list(study.load_results(log)) == [specs[0].key]
    err = capsys.readouterr().err
    assert err.startswith(f"largebatch study: warning: {log}, line 2: not a complete run record")
    assert err.count("\n") == 1 and "Traceback" not in err
    # The next run appended starts a line of its own; the broken line stays skipped.
    study.append_run(log, rows[2])
    assert list(study.load_results(log)) == [specs[0].key, specs[2].key]
    assert f"{log}, line 2:" in capsys.readouterr().err


def _workers(parent) -> list:
    """The pool's worker processes among ``parent``'s children; a child that has just
    exited (a zombie not yet reaped, or gone) is none of them."""
    import psutil

    workers = []
    for child in parent.children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                workers.append(child)
        except psutil.NoSuchProcess:  # ZombieProcess included
            pass
    return workers


@pytest.mark.slow
def test_sigterm_stops_the_study_and_its_workers(tmp_path):
    import signal
    import time

    import psutil

    # Long runs (10 epochs on 25,000 images): both workers are mid-run when SIGTERM comes.
    cmd = [
        sys.executable,
        "-m",
        "largebatch",
        "study",
        "--subset",
        "30000",
        "--batches",
        "128",
        "--optimizers",
        "sgd",
        "--jobs",
        "2",
        "--threads",
        "1",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    parent, workers = psutil.Process(proc.pid), []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            workers = _workers(parent)
        assert len(workers) == 2, (workers, proc.poll())
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, stderr
        assert "largebatch study: stopped by SIGTERM" in stderr and "Traceback" not in stderr
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers still running after the study ended: {alive}"
    finally:
        for p in [*workers, parent]:
            if p.is_running():
                p.kill()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_a_worker_exits_when_its_parent_is_killed():
    import signal

    import psutil

    child = (
        "import threading, time; from largebatch.study import exit_with_parent; "
        "threading.Thread(target=exit_with_parent, args=(PARENT, 0.05), daemon=True)"
        ".start(); print('watching', flush=True); time.sleep(60)"
    )
    parent_code = (
        "import os, subprocess, sys; "
        f"c = subprocess.Popen([sys.executable, '-c', {child!r}.replace('PARENT', "
        "str(os.getpid()))]); print(c.pid, flush=True); c.wait()"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    watcher = None
    try:
        watcher = psutil.Process(int(proc.stdout.readline()))
        assert proc.stdout.readline().strip() == "watching"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        watcher.wait(timeout=10)  # raises psutil.TimeoutExpired if it outlives its parent
    finally:
        if watcher is not None and watcher.is_running():
            watcher.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_simulated_workers_runs_record_their_compression():
    """``--workers 4 --compression adacomp``: the run splits each batch over 4 simulated
    workers and records the compression per kind of layer; ``none`` is the plain average
    of the same workers (no record), and trains the same model to a different point."""
    common = dict(
        phase="final",
        batch=384,
        optimizer="lars",
        lr=8.0,
        warmup_epochs=0.0,
        seed=0,
        epochs=2,
        subset=2400,
        label_smoothing=0.1,
        power=2.0,
        workers=4,
    )
    ada = study.run_one(study.RunSpec(**common, compression="adacomp"))
    plain = study.run_one(study.RunSpec(**common, compression="none"))
    assert "compression" not in plain and plain["accuracy"] > 0.5
    rates = ada["compression"]["rates"]
    assert rates["dense"] == 1.0 and rates["conv"] > 2 and rates["fc"] > 2
    assert ada["compression"]["warmup_steps"] == ada["steps_per_epoch"]
    assert ada["compression"]["stats"]["compressed_steps"] == ada["steps_per_epoch"]
    assert ada["curve"][0]["accuracy"] == plain["curve"][0]["accuracy"]  # epoch 1: warm-up
    assert ada["curve"][1]["accuracy"] != plain["curve"][1]["accuracy"]
    # No warm-up: every step compressed, from the first epoch on.
    now = study.run_one(study.RunSpec(**common, compression="adacomp", compression_warmup=0))
    assert now["compression"]["warmup_steps"] == 0
    assert now["compression"]["stats"]["compressed_steps"] == 2 * now["steps_per_epoch"]
    assert now["curve"][0]["accuracy"] != plain["curve"][0]["accuracy"]


def test_a_study_of_another_model_trains_that_model_in_every_run():
    """``--model fmnist_alexnet_bn``: every planned run names the model, and a run trains
    it (the recipes' model replaced): same seed and batches, another model, another result."""
    cfg = StudyConfig(quick=True, model="fmnist_alexnet_bn", seeds=1)
    _, finals = study.pair_plan(cfg, {}, 1536, "lars")
    assert finals and {s.model for s in finals} == {"fmnist_alexnet_bn"}
    common = dict(
        phase="final", batch=128, optimizer="sgd", lr=0.2, warmup_epochs=0.0, seed=0, epochs=1, subset=2400
    )
    alexnet = study.run_one(study.RunSpec(**common, model="fmnist_alexnet_bn"))
    cnn = study.run_one(study.RunSpec(**common))
    assert alexnet["spec"]["model"] == "fmnist_alexnet_bn" and alexnet["accuracy"] > 0.2
    assert alexnet["curve"] != cnn["curve"]
    with pytest.raises(ValueError, match="Invalid model"):
        study.check_config(StudyConfig(model="resnet50"))


def test_freeze_variance_freezes_lambs_v_when_the_plain_exchange_ends():
    """``--freeze-variance``: a LAMB run's groups get ``freeze_step`` = the steps of its
    ``compression_warmup`` epochs; the other optimizers are built as without it."""
    from largebatch.recipes.build import build_model
    from largebatch.study import worker

    common = dict(
        phase="final",
        batch=1536,
        lr=0.01,
        warmup_epochs=1.0,
        seed=0,
        epochs=30,
        workers=8,
        compression="adacomp",
        compression_warmup=3,
    )
    for optimizer, frozen in (("lamb", True), ("lamb", False), ("lars", True)):
        spec = study.RunSpec(**common, optimizer=optimizer, freeze_variance=frozen)
        recipe = study.pair_recipe(1536, optimizer)
        opt = worker.run_optimizer(spec, recipe, build_model(recipe.model, 10), steps_per_epoch=39)
        steps = {g.get("freeze_step", "none") for g in opt.param_groups}
        expected = (
            {117} if (optimizer, frozen) == ("lamb", True) else ({None} if optimizer == "lamb" else {"none"})
        )
        assert steps == expected, (optimizer, frozen)
    assert "v frozen after 3" in study.RunSpec(**common, optimizer="lamb", freeze_variance=True).describe()


def test_a_scaled_warmup_is_shown_rounded():
    """A warmup scaled with --epochs (2 of 30 epochs in 7) is 0.4667 in a run's line and
    the report's tables, not 0.466667; 5 significant digits that hold a value stay."""
    from largebatch.outputs import rounded

    assert [rounded(v) for v in (2 * 7 / 30, 16 * 1024 / 1536, 24.699, 0.0625, 2.0, 0.0)] == [
        "0.4667",
        "10.67",
        "24.699",
        "0.0625",
        "2",
        "0",
    ]
    cfg = study.StudyConfig(epochs=7)
    lines = [spec.describe() for spec in study.runs_left(cfg, {})]
    assert any(" warmup=0.4667 " in line for line in lines), lines
    assert not any("0.46666" in line for line in lines), lines


@pytest.mark.parametrize("compression", ["adacomp", "none"])
def test_the_recorded_worker_runs_are_reused_not_rerun(compression):
    """docs/study's 8-worker runs were recorded before the AdaComp warm-up became a flag:
    the command that made them, run again, finds every run done (the default warm-up is the
    one they ran with)."""
    from pathlib import Path

    folder = "adacomp-8" if compression == "adacomp" else "workers-8"
    results = study.load_results(Path(__file__).parents[1] / "docs" / "study" / folder / "runs.jsonl")
    cfg = StudyConfig(
        quick=True, batches=(1536,), optimizers=("lars", "lamb"), seeds=3, workers=8, compression=compression
    )
    for optimizer in ("lars", "lamb"):
        tune, finals = study.pair_plan(cfg, results, 1536, optimizer)
        assert not tune and len(finals) == 3
        assert all(spec.key in results for spec in finals), optimizer


def test_epochs_scales_every_warmup_as_train_does():
    """``--epochs N`` means what it means to ``largebatch train``: each run's schedule is its
    recipe's scaled to N epochs, the warmup included; without it the recipes run as they
    stand."""
    from largebatch.recipes.build import build_schedule

    quick = plan(study_cli.config(_args("--quick", "--epochs", "3")), {})
    assert {(s.batch, s.optimizer): s.warmup_epochs for s in quick} == pytest.approx(
        {(128, "sgd"): 0.0, (1536, "lars"): 0.2, (1536, "lamb"): 0.5}
    )
    for spec in quick:
        recipe = get_recipe(f"fmnist-{spec.optimizer}-{spec.batch}")
        assert spec.warmup_epochs == recipe.with_epochs(3).warmup_epochs
        trains = build_schedule(recipe, peak_lr=spec.lr, epochs=3, n_train=60_000, batch=spec.batch)
        studies = build_schedule(
            recipe,
            peak_lr=spec.lr,
            epochs=3,
            n_train=60_000,
            batch=spec.batch,
            warmup_epochs=spec.warmup_epochs,
        )
        steps = range(recipe.epoch_end(3, 60_000, spec.batch) + 1)
        assert [studies(t) for t in steps] == [trains(t) for t in steps], spec
    # The grid's warmups are epochs of a recipe's 30, scaled the same way.
    grid = plan(study_cli.config(_args("--batches", "128,1536", "--optimizers", "sgd", "--epochs", "15")), {})
    assert {(s.batch, s.warmup_epochs) for s in grid} == {(128, 0.0), (128, 1.0), (1536, 1.0), (1536, 2.5)}
    # The recipes' own epochs: the plan of ``largebatch study --quick``.
    for spec in plan(study_cli.config(_args("--quick")), {}):
        recipe = get_recipe(f"fmnist-{spec.optimizer}-{spec.batch}")
        assert (spec.epochs, spec.warmup_epochs) == (30, recipe.warmup_epochs)


def test_a_subset_keeps_the_imagenet_equivalent_batch_of_the_full_training_set():
    """The batch's ImageNet equivalent is named by the full 60,000 images, as in ``largebatch
    train`` (``Recipe.imagenet_batch``), whatever subset the runs trained on."""
    cfg = StudyConfig(quick=True, batches=(128, 3072), optimizers=("sgd",), seeds=1, epochs=1, subset=4000)
    rows = summarize(cfg, _finish(plan(cfg, {}), lambda s: 0.8))["rows"]
    assert (
        [r["imagenet_batch"] for r in rows]
        == [get_recipe("fmnist-sgd-128").imagenet_batch, get_recipe("fmnist-sgd-3072").imagenet_batch]
        == [2_733, 65_596]
    )
    assert "| 3,072 | 65,596 | sgd |" in study.study_markdown(
        summarize(cfg, _finish(plan(cfg, {}), lambda s: 0.8))
    )


def test_subset_is_checked_against_the_runs_the_study_makes(tmp_path, capsys):
    # --quick tunes nothing: its runs (at most B=1536) train on all of the subset.
    study.check_config(study_cli.config(_args("--quick", "--subset", "3072")))
    with pytest.raises(
        ValueError,
        match=r"^Invalid subset: 1000 \(the runs train on it: it "
        r"must hold one batch of 1536\)$",
    ):
        study.check_config(study_cli.config(_args("--quick", "--subset", "1000")))
    with pytest.raises(
        ValueError,
        match=r"^Invalid subset: 3072 \(its tuning split, five "
        r"sixths, must hold one batch of 3072\)$",
    ):
        study.check_config(study_cli.config(_args("--subset", "3072")))
    line = user_error(["study", "--quick", "--subset", "1000", "--out", str(tmp_path / "out")], capsys)
    assert line == (
        "largebatch study: Invalid subset: 1000 (the runs train on it: it must hold one batch of 1536)"
    )
    assert not (tmp_path / "out").exists()


def _fake_runs(monkeypatch):
    """Runs that train nothing (their accuracy follows the spec), and no plot."""
    monkeypatch.setattr(
        study.run,
        "run_one",
        lambda spec: _result(spec, 0.6 + 0.1 * (spec.batch == 128) + spec.lr / 1000 + spec.seed / 100),
    )
    monkeypatch.setattr(study.run, "plot", lambda summary, path: False)


@pytest.mark.parametrize(
    "flags",
    [
        [
            "--quick",
            "--batches",
            "128,3072",
            "--optimizers",
            "sgd,lars",
            "--epochs",
            "3",
            "--seeds",
            "2",
            "--subset",
            "4000",
            "--target",
            "0.6",
        ],
        [
            "--batches",
            "3072",
            "--optimizers",
            "lars",
            "--epochs",
            "2",
            "--extend",
            "1",
            "--no-ablate",
            "--seeds",
            "2",
            "--large-warmups",
            "1,3",
        ],
    ],
    ids=["quick", "tuned"],
)
def test_report_reads_the_study_settings_from_its_folder(tmp_path, monkeypatch, capsys, flags):
    """``--report --out DIR`` alone, on a copy of a study's folder: the study's tables."""
    import torch

    _fake_runs(monkeypatch)
    threads = ["--jobs", "1", "--threads", str(torch.get_num_threads())]
    assert cli(["study", *flags, *threads, "--out", str(tmp_path / "study")]) == 0
    table = (tmp_path / "study" / "study.md").read_text()
    assert "(2) |" in table, table  # the final rows, two seeds each
    shutil.copytree(tmp_path / "study", tmp_path / "copy")
    for name in ("study.md", "study.json"):
        (tmp_path / "copy" / name).unlink()
    capsys.readouterr()
    assert cli(["study", "--report", "--out", str(tmp_path / "copy")]) == 0
    assert "0 runs are planned next" in capsys.readouterr().out
    assert (tmp_path / "copy" / "study.md").read_text() == table
    assert json.loads((tmp_path / "copy" / "study.json").read_text()) == json.loads(
        (tmp_path / "study" / "study.json").read_text()
    )
    # A flag given with --report replaces the recorded setting.
    assert cli(["study", "--report", "--target", "0.9", "--out", str(tmp_path / "copy")]) == 0
    assert json.loads((tmp_path / "copy" / "study.json").read_text())["target"] == 0.9


_RECORDED = [
    "headline",
    "epochs-15",
    "adacomp-8",
    "adacomp-8-sgd",
    "adacomp-8-warm5",
    "workers-8",
    "workers-8-sgd",
    "adacomp-8-frozen",
    "adacomp-8-warm5-frozen",
    "workers-8-frozen",
]


_SETTLED = sorted(
    p.parent.name
    for p in (Path(__file__).parents[1] / "docs" / "study").glob("*/settings.json")
    if (p.parent / "study.md").exists() and p.parent.name not in _RECORDED
)


@pytest.mark.parametrize(
    ("folder", "with_settings"), [(f, False) for f in _RECORDED] + [(f, True) for f in _SETTLED]
)
def test_a_recorded_study_reports_what_is_committed(tmp_path, monkeypatch, folder, with_settings):
    """``--report --out`` on a copy of a docs/study folder's runs, with its settings.json
    where it has one (the older folders do not; a study still running included), writes
    the committed tables: none is stale."""
    monkeypatch.setattr(study.run, "plot", lambda summary, path: False)
    recorded = Path(__file__).parents[1] / "docs" / "study" / folder
    for name in ("runs.jsonl", study.SETTINGS) if with_settings else ("runs.jsonl",):
        shutil.copy(recorded / name, tmp_path / name)
    assert cli(["study", "--report", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "study.md").read_text() == (recorded / "study.md").read_text()
    assert json.loads((tmp_path / "study.json").read_text()) == json.loads(
        (recorded / "study.json").read_text()
    )
    if not with_settings:
        assert not (tmp_path / study.SETTINGS).exists()


def test_the_docs_state_each_difference_to_the_baseline_with_its_own_standard_error():
    """docs/choosing.md's table and the README's summary give each headline row's
    difference to the baseline as the report has it: the difference of the shown means ±
    the standard error of that difference (not the row's seed spread)."""
    root = Path(__file__).parents[1]
    summary = json.loads((root / "docs" / "study" / "headline" / "study.json").read_text())
    rows = {(r["batch"], r["optimizer"]): r for r in summary["rows"]}

    def stated(batch: int, optimizer: str) -> str:
        row = rows[batch, optimizer]
        return f"{100 * row['delta_vs_baseline']:+.2f} ± {100 * row['delta_vs_baseline_se']:.2f}"

    choosing = (root / "docs" / "choosing.md").read_text()
    for batch, label in ((1536, "32K (B = 1,536)"), (3072, "64K (B = 3,072)")):
        assert (
            f"| {label} | {stated(batch, 'lamb')} | {stated(batch, 'sgd')} | {stated(batch, 'lars')} |"
        ) in choosing
    readme = " ".join((root / "README.md").read_text().split())
    for batch in (1536, 3072):
        for optimizer in ("lamb", "sgd", "lars"):
            assert stated(batch, optimizer) in readme, (batch, optimizer)


def test_the_model_families_table_in_the_docs_is_compare_of_its_folders():
    """docs/study.md's side-by-side table is ``--compare`` of the folders its marker names,
    as their runs stand."""
    root = Path(__file__).parents[1]
    text = (root / "docs" / "study.md").read_text()
    marker = "<!-- study-compare: "
    start = text.index(marker) + len(marker)
    folders = text[start : text.index(" -->", start)].split()
    assert len(folders) >= 2
    table = study.compare_studies([str(root / f) for f in folders])
    assert table in text


class _Stream(io.StringIO):
    """A text stream that keeps apart what was flushed; ``tty``: whether it is a terminal."""

    def __init__(self, tty: bool = False) -> None:
        super().__init__()
        self.tty, self.flushed = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def flush(self) -> None:
        self.flushed = self.getvalue()


class _Started(Exception):
    pass


def test_the_first_line_says_what_runs_and_is_out_before_any_training(tmp_path, monkeypatch):
    """``largebatch study --quick | ...``: the first line is flushed before the first run starts."""
    import torch

    out = _Stream()
    monkeypatch.setattr(sys, "stdout", out)
    at_start = []

    def first_run(spec):
        at_start.append(out.flushed)
        raise _Started

    monkeypatch.setattr(study.run, "run_one", first_run)
    cfg = StudyConfig(
        quick=True,
        batches=(128, 1536),
        optimizers=("sgd", "lars"),
        seeds=1,
        jobs=1,
        threads=torch.get_num_threads(),
        out=str(tmp_path),
    )
    with pytest.raises(_Started):
        study.run_study(cfg)
    (line,) = at_start[0].splitlines()
    steps = 30 * (60_000 // 128 + 2 * (60_000 // 1536))
    assert line.startswith(
        "largebatch study (quick study: the recipes' tuned settings, no "
        "tuning): B=128 sgd, B=1536 sgd, B=1536 lars; 30 epochs, 1 seed; "
        f"3 runs, {steps:,} steps to go; 1 job(s)"
    ), line


def _one_quick_run(tmp_path) -> None:
    """One LARS run of one epoch on 1,200 images (3 steps), in this process."""
    import torch

    cfg = StudyConfig(
        quick=True,
        batches=(384,),
        optimizers=("lars",),
        seeds=1,
        epochs=1,
        subset=1200,
        jobs=1,
        threads=torch.get_num_threads(),
        out=str(tmp_path),
    )
    try:
        study.run_study(cfg)
    finally:
        study.WORKER.clear()


@pytest.mark.parametrize("tty", [False, True], ids=["pipe", "terminal"])
def test_a_bar_shows_the_studys_progress_on_a_terminal_only(tmp_path, monkeypatch, tty):
    out, err = _Stream(), _Stream(tty)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(study.run, "plot", lambda summary, path: False)
    _one_quick_run(tmp_path)
    if tty:  # 3 steps of 384 images, with the time left; the run line above it
        assert "\rstudy:" in err.getvalue() and "1.15k/1.15k [" in err.getvalue()
        assert "runs 1/1, loss " in err.getvalue()
        assert "[  1 " in out.getvalue()
    else:
        assert "\r" not in err.getvalue() + out.getvalue()
        assert err.getvalue() == ""


@pytest.mark.parametrize("tty", [False, True], ids=["file", "terminal"])
def test_off_a_terminal_progress_lines_say_what_the_bar_would(tmp_path, monkeypatch, tty):
    """``largebatch study --quick > log``: with stdout no terminal, progress lines come between the
    first line and the first finished run (here one a message: PROGRESS_EVERY 0); on a
    terminal the bar says it and stdout gets none."""
    out, err = _Stream(tty), _Stream()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(study.run, "plot", lambda summary, path: False)
    monkeypatch.setattr(study.run, "PROGRESS_EVERY", 0.0)
    _one_quick_run(tmp_path)
    lines = out.getvalue().splitlines()
    progress = [line for line in lines if "] study " in line]
    if tty:
        assert progress == [], progress
        return
    finished = next(i for i, line in enumerate(lines) if line.startswith("[  1 "))
    assert progress and all(lines.index(line) < finished for line in progress), lines
    # 3 steps of 384 images; the last message, at the epoch's end, has its loss.
    assert progress[0].startswith("[  0 ") and "runs 0/1 done" in progress[0], progress
    assert "running B=384 lars (final) epoch " in progress[0], progress
    assert "study 100% of its images" in progress[-1] and "epoch 1/1, loss " in progress[-1], progress
    assert "left" in progress[-1], progress


def test_vs_baseline_is_the_difference_of_the_means_as_shown():
    """A reader who subtracts the table's means gets the table's difference: 92.47 and
    92.75 shown give -0.28, though the unrounded means (92.474 and 92.746) differ by 0.272."""
    cfg = StudyConfig(quick=True, batches=(128, 1536), optimizers=("sgd",), seeds=1, epochs=1)
    scores = {128: 0.92746, 1536: 0.92474}
    summary = summarize(cfg, _finish(plan(cfg, {}), lambda s: scores[s.batch]))
    assert [round(100 * r["delta_vs_baseline"], 6) for r in summary["rows"]] == [0.0, -0.28]
    assert "| 92.47 (1) | -0.28 |" in study.study_markdown(summary)
