"""``largebatch steps``: the search plan and its target, the statistics, one run, and a tiny
study end to end (resumed, reported, refused with other settings)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import statistics

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import user_error
from scipy import stats

from largebatch.cli.steps import add_arguments, config
from largebatch.recipes.build import build_model
from largebatch.study.steps import (
    SPACES,
    StepsConfig,
    TrialSpec,
    critical_batch,
    critical_ratio,
    estimate,
    fit_steps,
    load_trials,
    paired_interval,
    plan,
    run_steps_study,
    steps_ratio,
    target,
)
from largebatch.study.steps.plan import budget_steps, lr_dimension, point_pick, point_trials, sobol_points
from largebatch.study.steps.run import IMAGES_PER_THREAD_SECOND, batch_speeds, check_resume
from largebatch.study.steps.trial import StepStatistics, micro_batch, run_trial, trial_optimizer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SMALL = StepsConfig(
    batches=(64, 256), optimizers=("nesterov", "lamb"), trials=4, extend=1, seeds=2, max_seeds=3
)


def _row(spec: TrialSpec, accuracies: list[float], every: int = 10) -> dict:
    """A finished run whose validation accuracy is ``accuracies[i]`` at step ``every * (i + 1)``,
    stopped as run_trial stops (at its target, its limit or its budget)."""
    curve = []
    for i, a in enumerate(accuracies):
        curve.append({"step": every * (i + 1), "accuracy": a, "loss": 0.5})
        if spec.target is not None and a >= spec.target:
            break
        if spec.limit is not None and every * (i + 1) >= spec.limit:
            break
    reached = next(
        (c["step"] for c in curve if spec.target is not None and c["accuracy"] >= spec.target), None
    )
    return {
        "spec": dataclasses.asdict(spec),
        "accuracy": curve[-1]["accuracy"],
        "steps_to_target": reached,
        "stopped": "target" if reached else "budget",
        "steps": curve[-1]["step"],
        "curve": curve,
        "seconds": 1.0,
        "threads": 1,
    }


def _finish(results: dict, specs, accuracies) -> None:
    for spec in specs:
        results[spec.key] = _row(spec, accuracies(spec))


def _smallest_done(cfg: StepsConfig = SMALL, best: dict[str, float] | None = None) -> dict:
    """Results with the smallest batch's searches finished: the trial whose lr is the
    median of its point's reaches ``best[optimizer]``, the others less."""
    best = best or {"nesterov": 0.90, "lamb": 0.88}
    results: dict = {}
    for optimizer in cfg.optimizers:
        specs, _ = point_trials(cfg, results, cfg.batches[0], optimizer)
        middle = sorted(s.lr for s in specs)[len(specs) // 2]
        for spec in specs:
            results[spec.key] = _row(spec, [0.5, best[optimizer] - 0.05 * (spec.lr != middle)])
    return results


# --------------------------------------------------------------------------- the space


@pytest.mark.parametrize("optimizer", sorted(SPACES))
def test_each_dimension_maps_the_unit_interval_onto_its_range_and_back(optimizer):
    for d in (lr_dimension(optimizer, 1024), *SPACES[optimizer]):
        assert d.value(0.0) == pytest.approx(d.low) and d.value(1.0) == pytest.approx(d.high)
        for u in (0.1, 0.5, 0.9):
            assert d.low < d.value(u) < d.high
            assert d.position(d.value(u)) == pytest.approx(u)
    momentum = next(d for d in SPACES[optimizer] if d.name in ("momentum", "beta1"))
    # 1 - momentum is log-uniform: the midpoint's distance from 1 is the geometric mean's
    assert 1 - momentum.value(0.5) == pytest.approx(math.sqrt((1 - momentum.low) * (1 - momentum.high)))


def test_the_lr_range_follows_the_square_root_rule_and_its_shifts():
    a, b = lr_dimension("lamb", 256), lr_dimension("lamb", 1024)
    assert b.low == pytest.approx(2 * a.low) and b.high == pytest.approx(2 * a.high)
    up = lr_dimension("lamb", 256, shift=1)
    assert up.low == pytest.approx(a.low * 10) and up.high == pytest.approx(a.high * 10)


def test_the_sobol_points_are_the_same_each_time_and_fill_the_unit_cube():
    points = sobol_points(6, 16, 0)
    assert points == sobol_points.__wrapped__(6, 16, 0)
    assert all(0 <= x < 1 for p in points for x in p) and len(set(points)) == 16
    # one point in each sixteenth of every axis: a Sobol sequence's 1-d projections
    for axis in range(6):
        assert sorted(int(16 * p[axis]) for p in points) == list(range(16))
    assert sobol_points(6, 16, 1) != points


# --------------------------------------------------------------------------- the plan


def test_the_smallest_batch_searches_first_to_its_budget_and_nothing_else_starts():
    todo = plan(SMALL, {})
    assert len(todo) == 8 and {s.point for s in todo} == {(64, "nesterov"), (64, "lamb")}
    assert all(s.kind == "search" and s.target is None and s.limit is None and s.seed == 0 for s in todo)
    assert [s.index for s in todo if s.optimizer == "lamb"] == [0, 1, 2, 3]
    assert target(SMALL, {}) is None


def test_the_target_is_the_weakest_optimizers_best_less_the_margin():
    results = _smallest_done()
    assert target(SMALL, results) == pytest.approx(0.87)  # lamb's 0.88 less 0.01
    assert target(dataclasses.replace(SMALL, margin=0.005), results) == pytest.approx(0.875)


def test_a_larger_batch_runs_its_trials_in_order_each_limited_by_the_fewest_steps_before_it():
    results = _smallest_done()
    goal = target(SMALL, results)
    first = [s for s in plan(SMALL, results) if s.batch == 256]
    assert [(s.optimizer, s.index) for s in first] == [("nesterov", 0), ("lamb", 0)]
    assert all(s.target == goal and s.limit is None for s in first)
    _finish(results, first, lambda s: [0.5, 0.6, 0.95])  # both reach it at step 30
    second = [s for s in plan(SMALL, results) if s.batch == 256]
    assert [(s.index, s.limit) for s in second] == [(1, 30), (1, 30)]
    _finish(results, second, lambda s: [0.95])  # reached at step 10: the next is held to 10
    assert {s.limit for s in plan(SMALL, results) if s.batch == 256} == {10}


def _search_256(results, choose, reached=True):
    """Finish the B=256 searches: the trial whose lr is ``choose(lrs of the first block)``
    reaches the target at the first score, every other at the fourth; with ``reached``
    False, no trial reaches it and the chosen one comes closest."""
    for _ in range(2 * SMALL.trials + 1):
        todo = [s for s in plan(SMALL, results) if s.batch == 256 and s.kind == "search"]
        if not todo:
            return
        for spec in todo:
            points = sobol_points(1 + len(SPACES[spec.optimizer]), SMALL.trials, SMALL.search_seed)
            lrs = [round(lr_dimension(spec.optimizer, 256).value(u[0]), 12) for u in points]
            chosen = spec.shift == 0 and math.isclose(spec.lr, choose(lrs), rel_tol=1e-3)
            if reached:
                results[spec.key] = _row(spec, [0.95] if chosen else [0.5, 0.6, 0.7, 0.95])
            else:
                results[spec.key] = _row(spec, [0.5, 0.6, 0.7, 0.85 if chosen else 0.8])


def test_a_pick_on_the_edge_of_the_lrs_tried_extends_the_search_past_it():
    results = _smallest_done()
    _search_256(results, max)  # the highest lr wins
    specs, done = point_trials(SMALL, results, 256, "lamb")
    assert done and len(specs) == 8
    assert [s.shift for s in specs] == [0] * 4 + [1] * 4
    assert [s.index for s in specs[4:]] == [4, 5, 6, 7]
    assert min(s.lr for s in specs[4:]) > lr_dimension("lamb", 256).low * 10


def test_a_pick_inside_the_lrs_tried_ends_the_search():
    results = _smallest_done()
    _search_256(results, lambda lrs: sorted(lrs)[1])
    specs, done = point_trials(SMALL, results, 256, "nesterov")
    assert done and len(specs) == 4


def test_a_point_no_trial_reached_searches_on_over_the_same_range():
    results = _smallest_done()
    _search_256(results, lambda lrs: sorted(lrs)[1], reached=False)  # the closest lies inside
    specs, done = point_trials(SMALL, results, 256, "nesterov")
    assert done and len(specs) == SMALL.trials * (SMALL.extend + 1)
    assert [s.shift for s in specs] == [0] * 8 and [s.index for s in specs] == list(range(8))
    assert point_pick(SMALL, results, 256, "nesterov") is None
    closest = max(specs, key=lambda s: results[s.key]["accuracy"])
    todo = [s for s in plan(SMALL, results) if s.point == (256, "nesterov")]
    assert [s.kind for s in todo] == ["final"] * SMALL.seeds  # no steps to a target to seed
    assert all(
        dataclasses.replace(s, kind="search", seed=0)
        == dataclasses.replace(closest, steps=s.steps, eval_every=s.eval_every, limit=None, target=None)
        for s in todo
    )


def test_a_point_no_trial_reached_moves_its_range_toward_its_closest_trial():
    results = _smallest_done()
    _search_256(results, min, reached=False)  # the closest has the lowest lr
    specs, done = point_trials(SMALL, results, 256, "lamb")
    assert done and [s.shift for s in specs] == [0] * 4 + [-1] * 4


def test_the_cost_bound_counts_every_search_block_begun():
    results = _smallest_done()
    images, _ = estimate(SMALL, results)
    for spec in [s for s in plan(SMALL, results) if s.batch == 256]:  # no trial of the first block reaches it
        for _ in range(SMALL.trials):
            spec = next(s for s in plan(SMALL, results) if s.point == spec.point)
            results[spec.key] = _row(spec, [0.5, 0.6, 0.7, 0.8 - 0.01 * spec.index])
    begun = [s for s in plan(SMALL, results) if s.batch == 256]
    assert [s.index for s in begun] == [SMALL.trials] * 2  # each point's second block begun
    # the first blocks' trials are done and the second blocks' are to run: the same bound
    assert estimate(SMALL, results)[0] == images


def test_the_cost_bound_runs_at_the_speed_of_the_runs_cpu_time():
    results = _smallest_done()
    images, hours = estimate(SMALL, results)
    for row in results.values():
        row["cpu_seconds"] = row["seconds"] / 2  # half the wall time: the study was paused
    assert estimate(SMALL, results) == (images, pytest.approx(hours / 2))


def test_the_cost_bound_takes_each_batchs_images_at_that_batchs_speed():
    """An image costs more in a large batch: the runs still to go at a batch are timed by
    the runs finished at that batch, or at the nearest batch that has some."""
    results = _smallest_done()  # finished runs at 64 only
    speed_64 = sum(r["steps"] * 64 for r in results.values()) / len(results)  # 1 s each
    assert batch_speeds(SMALL, results) == {64: speed_64, 256: speed_64}
    images, hours = estimate(SMALL, results)
    assert hours == pytest.approx(images / speed_64 / 3600)
    spec = next(s for s in plan(SMALL, results) if s.batch == 256)
    row = _row(spec, [0.5, 0.6]) | {"cpu_seconds": 8.0}
    results[spec.key] = row
    speed_256 = row["steps"] * 256 / 8.0
    assert speed_256 == speed_64 / 2  # twice the time an image
    assert batch_speeds(SMALL, results) == {64: speed_64, 256: speed_256}
    images_64, _ = estimate(dataclasses.replace(SMALL, batches=(64,)), results)
    images, hours = estimate(SMALL, results)
    assert hours == pytest.approx((images_64 / speed_64 + (images - images_64) / speed_256) / 3600)
    # a run from a GPU does not time the CPU's runs
    gpu = next(s for s in plan(SMALL, results) if s.batch == 256)
    results[gpu.key] = _row(gpu, [0.5, 0.6]) | {"cpu_seconds": 0.01, "device": "NVIDIA H200"}
    assert batch_speeds(SMALL, results) == {64: speed_64, 256: speed_256}
    # before any run, the model's stated speed at every batch
    assert set(batch_speeds(SMALL, {}).values()) == {IMAGES_PER_THREAD_SECOND[SMALL.model]}


def test_seeds_and_final_runs_follow_the_pick():
    results = _smallest_done()
    goal = target(SMALL, results)
    todo = plan(SMALL, results)
    seeds = [s for s in todo if s.kind == "steps" and s.point == (64, "nesterov")]
    finals = [s for s in todo if s.kind == "final" and s.point == (64, "nesterov")]
    specs, _ = point_trials(SMALL, results, 64, "nesterov")
    chosen = sorted(specs, key=lambda s: s.lr)[len(specs) // 2]
    assert [s.seed for s in seeds] == [1, 2] and [s.seed for s in finals] == [0, 1]
    assert all(s.lr == chosen.lr and s.target == goal and s.limit is None for s in seeds)
    assert all(
        s.steps == SMALL.final_epochs * (60_000 // 64) and s.eval_every == 60_000 // 64 for s in finals
    )
    assert all(s.target is None and s.power == chosen.power for s in finals)


def _finals(results, cfg, accuracy):
    for _ in range(cfg.max_seeds + 1):
        todo = [s for s in plan(cfg, results) if s.kind == "final"]
        if not todo:
            return
        _finish(results, todo, lambda s: [accuracy(s)])


def test_a_comparison_whose_interval_crosses_its_threshold_takes_more_seeds():
    cfg = dataclasses.replace(SMALL, batches=(64,), optimizers=("nesterov", "lars"))
    best = {"nesterov": 0.90, "lars": 0.88}
    results = _smallest_done(cfg, best)
    clear = {"nesterov": [0.90, 0.91, 0.92], "lars": [0.80, 0.81, 0.82]}
    _finals(results, cfg, lambda s: clear[s.optimizer][s.seed])
    finals = [r["spec"] for r in results.values() if r["spec"]["kind"] == "final"]
    assert sorted(s["seed"] for s in finals if s["optimizer"] == "lars") == [0, 1]  # settled at 2 seeds
    results = _smallest_done(cfg, best)
    noisy = {"nesterov": [0.90, 0.80, 0.85], "lars": [0.85, 0.85, 0.85]}
    _finals(results, cfg, lambda s: noisy[s.optimizer][s.seed])
    finals = [r["spec"] for r in results.values() if r["spec"]["kind"] == "final"]
    assert sorted(s["seed"] for s in finals if s["optimizer"] == "lars") == [0, 1, 2]  # max_seeds


# --------------------------------------------------------------------------- statistics


def test_the_fit_recovers_the_model_it_was_drawn_from():
    batches = [64, 256, 1024, 4096, 16384]
    s_min, b_noise = fit_steps(batches, [50 * (1 + 2000 / b) for b in batches])
    assert s_min == pytest.approx(50, rel=1e-4) and b_noise == pytest.approx(2000, rel=1e-4)


def test_the_bootstrap_interval_holds_the_truth_and_is_reproducible():
    rng = np.random.default_rng(1)
    batches = [64, 256, 1024, 4096, 16384]
    seeds = [[50 * (1 + 2000 / b) * math.exp(rng.normal(0, 0.1)) for _ in range(5)] for b in batches]
    fit = critical_batch(batches, seeds, resamples=300)
    assert fit.b_noise_low < 2000 < fit.b_noise_high and fit.s_min_low < 50 < fit.s_min_high
    assert fit == critical_batch(batches, seeds, resamples=300)
    # a point no seed reached is left out of the fit, not taken as a number
    with_inf = [*seeds[:-1], [math.inf] * 5]
    assert critical_batch(batches, with_inf, resamples=50).b_noise == pytest.approx(
        critical_batch(batches[:-1], seeds[:-1], resamples=50).b_noise
    )


class _LastBits:
    """NumPy with exp, log and log1p moved by up to one unit in the last place at random,
    as another CPU's vector code may round them."""

    def __init__(self, seed: int):
        self._rng = np.random.default_rng(seed)
        for name in ("exp", "log", "log1p"):
            setattr(self, name, self._moved(getattr(np, name)))

    def __getattr__(self, name):
        return getattr(np, name)

    def _moved(self, f):
        def moved(*args, **kwargs):
            y = np.asarray(f(*args, **kwargs))
            step = self._rng.integers(-1, 2, y.shape)
            return np.where(step == 0, y, np.nextafter(y, np.where(step > 0, np.inf, -np.inf)))

        return moved


def test_the_critical_batch_does_not_follow_the_last_bits_of_exp_and_log(monkeypatch):
    """The committed reports regenerate on any CPU: the fit's minimum is found where the
    slope changes sign, which rounding moves by a few units in the last place; a search
    that compares the loss itself lands 1e-8 apart at the flat bottom."""
    from largebatch.study.steps import fits

    rng = np.random.default_rng(3)
    batches = [64, 256, 1024, 4096, 16384]
    seeds = [[50 * (1 + 2000 / b) * math.exp(rng.normal(0, 0.1)) for _ in range(5)] for b in batches]
    exact = critical_batch(batches, seeds, resamples=200)
    for seed in range(3):
        monkeypatch.setattr(fits, "np", _LastBits(seed))
        moved = critical_batch(batches, seeds, resamples=200)
        for a, b in zip(moved, exact):
            assert a == pytest.approx(b, rel=1e-13, abs=0)


def test_the_ratio_of_two_critical_batches_and_its_interval():
    rng = np.random.default_rng(2)
    batches = [64, 256, 1024, 4096, 16384]

    def seeds(noise):
        return [[50 * (1 + noise / b) * math.exp(rng.normal(0, 0.05)) for _ in range(5)] for b in batches]

    wide, narrow = seeds(4000), seeds(1000)
    ratio = critical_ratio(batches, wide, narrow, resamples=300)
    assert ratio.low < 4 < ratio.high and ratio.low > 1  # the first scales further, and it shows
    assert ratio.mean == pytest.approx(
        critical_batch(batches, wide, resamples=10).b_noise
        / critical_batch(batches, narrow, resamples=10).b_noise
    )
    same = critical_ratio(batches, seeds(2000), seeds(2000), resamples=300)
    assert same.crosses(1.0)


def test_the_ratio_of_steps_at_one_batch_and_its_interval():
    a, b = [100.0, 110, 120, 135, 150], [50.0, 52, 60, 61, 80]
    ratio = steps_ratio(a, b, resamples=20_000)
    assert ratio.mean == pytest.approx(120 / 60) and ratio.n == 20_000
    assert ratio == steps_ratio(a, b, resamples=20_000)  # the same draws each time
    # the percentile interval of scipy's bootstrap of the same statistic, seeds drawn apart
    theirs = stats.bootstrap(
        (a, b),
        lambda x, y: np.median(x) / np.median(y),
        paired=False,
        vectorized=False,
        method="percentile",
        n_resamples=20_000,
        random_state=0,
    ).confidence_interval
    assert ratio.low == pytest.approx(theirs.low, rel=0.03) and ratio.high == pytest.approx(
        theirs.high, rel=0.03
    )
    assert ratio.low < 2 < ratio.high
    # seeds that never reached the target: the median and the ratio may be infinite
    assert steps_ratio([math.inf] * 3, b).mean == math.inf
    assert steps_ratio(a, [math.inf] * 3).mean == 0.0
    some = steps_ratio([100.0, 110, math.inf, math.inf, 120], b, resamples=500)
    assert math.isfinite(some.mean) and some.high == math.inf and some.n == 500
    neither = steps_ratio([math.inf] * 2, [math.inf] * 2, resamples=50)
    assert neither.n == 0 and math.isnan(neither.low)
    with pytest.raises(ValueError, match="needs one or more"):
        steps_ratio([], b)


def test_the_paired_interval_is_scipys_paired_t_interval():
    a, b = [0.91, 0.92, 0.905, 0.915, 0.93], [0.90, 0.915, 0.9, 0.91, 0.915]
    ours = paired_interval(a, b)
    theirs = stats.ttest_rel(a, b).confidence_interval(0.95)
    assert (ours.low, ours.high) == pytest.approx((theirs.low, theirs.high))
    assert ours.mean == pytest.approx(np.mean(np.subtract(a, b))) and ours.n == 5
    assert ours.crosses(0.01) and not ours.crosses(0.0)
    with pytest.raises(ValueError, match="1 pair"):
        paired_interval([0.9], [0.8])
    with pytest.raises(ValueError, match="3 values against 2"):
        paired_interval([0.9] * 3, [0.8] * 2)


# --------------------------------------------------------------------------- one run


@pytest.mark.parametrize("micro", [32, 16])  # two ghost batches each; one (the CPU runs')
def test_micro_batches_give_the_step_and_the_running_statistics_of_one_forward(micro):
    torch.manual_seed(0)
    whole = build_model("fmnist_cnn", 10, ghost_batch=16)
    parts, plain = copy.deepcopy(whole), copy.deepcopy(whole)
    statistics = StepStatistics(parts)
    x, y = torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))
    for _ in range(2):
        F.cross_entropy(whole(x), y).backward()
        for model in (parts, plain):
            for xm, ym in zip(x.split(micro), y.split(micro)):
                (F.cross_entropy(model(xm), ym) / (128 // micro)).backward()
        statistics.step()
        for a, b in zip(whole.parameters(), parts.parameters()):
            torch.testing.assert_close(a.grad, b.grad)
        for a, b in zip(whole.buffers(), parts.buffers()):
            torch.testing.assert_close(a, b)
    # without it, each micro-batch is an update of its own
    assert not all(torch.equal(a, b) for a, b in zip(whole.buffers(), plain.buffers()))


def test_a_cpu_run_trains_a_batch_above_the_ghost_batch_one_ghost_batch_at_a_time():
    assert micro_batch(_spec(batch=64, ghost_batch=16), "cpu") == 16
    assert micro_batch(_spec(batch=64, ghost_batch=64), "cpu") is None
    assert micro_batch(_spec(batch=64, ghost_batch=128), "cpu") is None
    assert micro_batch(_spec(batch=16_384), "cuda") is None
    row = run_trial(_spec(batch=64, ghost_batch=16, steps=4))
    assert row["micro_batch"] == 16 and row["steps"] == 4


def _spec(**kw) -> TrialSpec:
    base = dict(
        kind="search",
        model="fmnist_cnn",
        batch=64,
        optimizer="nesterov",
        index=0,
        seed=0,
        lr=0.05,
        warmup=0.1,
        weight_decay=5e-4,
        power=1.0,
        steps=12,
        eval_every=4,
        momentum=0.9,
        subset=1200,
    )
    return TrialSpec(**{**base, **kw})


def test_a_run_is_the_same_twice_and_stops_where_it_should():
    spec = _spec()
    a, b = run_trial(spec), run_trial(spec)
    assert a["curve"] == b["curve"] and a["train_loss"] == b["train_loss"]
    assert [c["step"] for c in a["curve"]] == [4, 8, 12] and a["stopped"] == "budget"
    assert run_trial(dataclasses.replace(spec, seed=1))["curve"] != a["curve"]
    early = run_trial(dataclasses.replace(spec, target=0.0))
    assert (early["stopped"], early["steps"], early["steps_to_target"]) == ("target", 4, 4)
    limited = run_trial(dataclasses.replace(spec, limit=6))
    assert (limited["stopped"], limited["steps"], limited["steps_to_target"]) == ("limit", 6, None)
    assert [c["step"] for c in limited["curve"]] == [4, 6]
    assert limited["curve"][0] == a["curve"][0]  # the same run up to the limit
    assert run_trial(dataclasses.replace(spec, lr=1e12))["stopped"] == "diverged"


@pytest.mark.parametrize(
    ("optimizer", "values", "cls", "expect"),
    [
        ("nesterov", {"momentum": 0.8}, "SGD", {"momentum": 0.8, "nesterov": True}),
        ("adamw", {"beta1": 0.8, "beta2": 0.95}, "AdamW", {"betas": (0.8, 0.95)}),
        ("lars", {"momentum": 0.8, "trust_coefficient": 0.002}, "LARS", {"trust_coefficient": 0.002}),
        ("lamb", {"beta1": 0.8, "beta2": 0.95}, "LAMB", {"betas": (0.8, 0.95)}),
    ],
)
def test_the_optimizer_takes_the_runs_values_and_spares_biases_and_norms_the_decay(
    optimizer, values, cls, expect
):
    spec = _spec(**{"optimizer": optimizer, "momentum": None, "weight_decay": 0.01, **values})
    model = build_model("fmnist_cnn", 10)
    opt = trial_optimizer(spec, model)
    assert type(opt).__name__ == cls
    decayed, spared = opt.param_groups
    assert decayed["weight_decay"] == 0.01 and spared["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in decayed["params"]) and all(p.ndim <= 1 for p in spared["params"])
    assert all(decayed[k] == v for k, v in expect.items()) and decayed["lr"] == spec.lr


# --------------------------------------------------------------------------- the study


TINY = dict(
    batches=(64, 128),
    optimizers=("nesterov", "lamb"),
    trials=2,
    extend=0,
    seeds=2,
    max_seeds=2,
    final_epochs=1,
    budget_epochs=0.5,
    eval_images=256,
    subset=900,
    jobs=1,
)


def test_a_tiny_study_runs_resumes_reports_and_refuses_other_settings(tmp_path, capsys):
    cfg = StepsConfig(out=str(tmp_path / "s"), **TINY)
    summary = run_steps_study(cfg, print_fn=lambda _: None)
    log = tmp_path / "s" / "runs.jsonl"
    runs = load_trials(log)
    assert summary["runs"] == len(runs) and not plan(cfg, runs)
    kinds = [r["spec"]["kind"] for r in runs.values()]
    picked = sum("pick" in p for p in summary["points"])
    assert kinds.count("search") == 8 and picked >= 2  # the smallest batch always has a pick
    assert kinds.count("steps") == 2 * picked
    assert all(0 < r["cpu_seconds"] for r in runs.values())  # the bound's speed
    assert kinds.count("final") == 2 * 4  # every point: its pick, or its most accurate trial
    assert all(("pick" in p) != ("final_pick" in p) for p in summary["points"])
    text = (tmp_path / "s" / "steps.md").read_text()
    assert f"validation accuracy {summary['target']:.3f}" in text
    # again: nothing runs, the same report
    lines = log.read_text()
    assert run_steps_study(cfg, print_fn=lambda _: None) == summary and log.read_text() == lines
    # a line cut short by a kill is skipped, and its run planned again
    with log.open("a") as f:
        f.write('{"spec": {"kind": "sea')
    capsys.readouterr()
    assert load_trials(log) == runs
    assert "not a complete run record" in capsys.readouterr().err
    # the report alone, from the committed runs
    report = run_steps_study(dataclasses.replace(cfg, report_only=True), print_fn=lambda _: None)
    assert report == summary and (tmp_path / "s" / "steps.md").read_text() == text
    # other settings in the same folder: one line, exit status 2, nothing run
    flags = [
        f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
        for k, v in TINY.items()
    ]
    message = user_error(["steps", "--out", cfg.out, *flags, "--trials", "3"], capsys)
    assert "with trials 2, not 3" in message and log.read_text().startswith(lines)
    # --out alone continues the study in it, with its settings; a flag given must agree
    assert "with trials 2, not 3" in user_error(["steps", "--out", cfg.out, "--trials", "3"], capsys)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    resumed = config(parser.parse_args(["--out", cfg.out, "--jobs", "1"]))
    assert resumed.settings() == cfg.settings() and resumed.settings() != StepsConfig().settings()
    check_resume(resumed)
    assert run_steps_study(resumed, print_fn=lambda _: None) == summary


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batches", "256,64"], "Invalid batches [256, 64]: they must increase"),
        (["--batches", "64,200"], "Invalid batch 200: not a multiple of the ghost batch 128"),
        (["--optimizers", "adam"], "Invalid optimizer"),
        (["--trials", "1"], "Invalid trials: 1"),
        (["--max-seeds", "3"], "Invalid max_seeds: 3"),
        (["--margin", "-0.1"], "Invalid margin"),
    ],
)
def test_bad_settings_are_one_line_errors(argv, message, capsys, tmp_path):
    assert message in user_error(["steps", "--out", str(tmp_path / "s"), *argv], capsys)
    assert not (tmp_path / "s").exists()


def test_report_without_a_study_is_a_one_line_error(tmp_path, capsys):
    assert "holds no steps study" in user_error(["steps", "--report", "--out", str(tmp_path)], capsys)


def test_the_settings_file_round_trips(tmp_path):
    cfg = StepsConfig(out=str(tmp_path), **{k: v for k, v in TINY.items() if k != "jobs"})
    (tmp_path / "settings.json").write_text(json.dumps(cfg.settings()))
    from largebatch.study.steps import recorded_config

    assert recorded_config(str(tmp_path)) == cfg


def test_the_report_labels_the_runs_a_gpu_ran_and_pairs_the_seeds():
    from largebatch.study.steps import markdown, summarize

    cfg = dataclasses.replace(SMALL, batches=(64,), optimizers=("nesterov", "lars"))
    results = _smallest_done(cfg, {"nesterov": 0.90, "lars": 0.88})
    accuracy = {"nesterov": [0.90, 0.91, 0.92], "lars": [0.80, 0.815, 0.82]}
    _finals(results, cfg, lambda s: accuracy[s.optimizer][s.seed])
    row = next(
        r for r in results.values() if r["spec"]["kind"] == "final" and r["spec"]["optimizer"] == "lars"
    )
    row["device"] = "NVIDIA H100 80GB HBM3"
    summary = summarize(cfg, results)
    (compared,) = summary["comparisons"]
    assert (compared["point"], compared["reference"]) == ([64, "lars"], [64, "nesterov"])
    assert compared["mean"] == pytest.approx(-0.0975) and compared["n"] == 2
    text = markdown(summary)
    assert "80.75 (n=2)†" in text and "90.50 (n=2) |" in text
    assert "ran on a GPU (NVIDIA H100 80GB HBM3)" in text


def test_the_brief_marks_the_steps_of_a_point_a_gpu_ran():
    """A point with runs from a GPU is marked in the brief's steps table, and the GPU named
    under it; a study that ran on the CPU alone has neither."""
    from largebatch.study.steps import headline, summarize

    results = _whole_study()
    plain = headline(summarize(THREE, results))
    assert "†" not in plain
    for r in results.values():
        if (r["spec"]["kind"], r["spec"]["batch"], r["spec"]["optimizer"]) == ("steps", 256, "lars"):
            r["device"] = "NVIDIA H200"
    text = headline(summarize(THREE, results))
    row = next(line for line in text.splitlines() if line.startswith("| 256 |"))  # the steps table's
    cells = row.split(" | ")
    assert cells[3].endswith("]") and cells[4].endswith("]†"), row  # nesterov, then lars
    note = "† some of the point's runs ran on a GPU (NVIDIA H200); the others on the CPU."
    assert text.split("\n\nCritical batch")[0].endswith(note)
    assert text.replace("]†", "]").replace(f"\n\n{note}", "") == plain


THREE = dataclasses.replace(SMALL, batches=(64, 256, 1024), optimizers=("nesterov", "lars"))
B_NOISE = {"nesterov": 500, "lars": 2000}  # the synthetic study's critical batches


def _whole_study(cfg: StepsConfig = THREE, beyond: tuple = (), fail: tuple = ()) -> dict:
    """The runs of a whole study, planned as the study plans them: a run of batch B needs
    ``5 (1 + B_noise / B)`` scores of 10 steps (more for later trials and seeds) to reach
    the target, and its final accuracy depends on its optimizer, batch and seed. No trial
    of a ``(batch, optimizer)`` in ``beyond`` reaches the target; in ``fail``, its last
    seed does not."""
    results: dict = {}
    for _ in range(100):
        todo = plan(cfg, results)
        if not todo:
            return results
        for spec in todo:
            if spec.kind == "final":
                bonus = 0.004 if spec.optimizer == "lars" else 0.0
                accuracies = [0.9 + bonus - spec.batch / 1e6 + 0.001 * ((spec.seed * 7) % 5)]
            else:
                scores = (
                    round(5 * (1 + B_NOISE[spec.optimizer] / spec.batch)) + spec.index % 3 + spec.seed % 3
                )
                missed = (spec.batch, spec.optimizer) in beyond or (
                    spec.kind == "steps" and spec.seed == cfg.seeds and (spec.batch, spec.optimizer) in fail
                )
                accuracies = [0.5] * (scores - 1) + [0.5 if missed else 0.95]
            results[spec.key] = _row(spec, accuracies)
    raise AssertionError("the plan did not end")


def test_the_brief_gives_each_number_with_its_interval():
    from largebatch.study.steps import headline, summarize

    results = _whole_study()
    summary = summarize(THREE, results)
    text = headline(summary)
    assert text.startswith(f"**fmnist_cnn: complete, {len(results)} runs.**")

    def seeds(kind, batch, optimizer):
        rows = [
            r
            for r in results.values()
            if (r["spec"]["kind"], r["spec"]["batch"], r["spec"]["optimizer"]) == (kind, batch, optimizer)
        ]
        return [
            r["steps_to_target" if kind == "steps" else "accuracy"]
            for r in sorted(rows, key=lambda r: r["spec"]["seed"])
        ]

    fits = {
        o: critical_batch(THREE.batches, [seeds("steps", b, o) for b in THREE.batches])
        for o in THREE.optimizers
    }
    assert fits["lars"].b_noise > 2 * fits["nesterov"].b_noise
    assert (
        f"| B_crit | {fits['nesterov'].b_noise:,.0f} ({fits['nesterov'].b_noise_low:,.0f}-"
        f"{fits['nesterov'].b_noise_high:,.0f}) | {fits['lars'].b_noise:,.0f} ("
    ) in text
    for batch in THREE.batches:
        r = steps_ratio(seeds("steps", batch, "lars"), seeds("steps", batch, "nesterov"))
        scale = sorted(batch / f.b_noise for f in fits.values())
        median = statistics.median(seeds("steps", batch, "nesterov"))
        assert (
            f"| {batch:,} | {round(batch * 1_281_167 / 50_000):,} | "
            f"{scale[0]:.2g}-{scale[1]:.2g} | {median:g} [" in text
        )
        assert f" | {r.mean:.2f} ({r.low:.2f}-{r.high:.2f}) |" in text
        d = paired_interval(seeds("final", batch, "lars"), seeds("final", batch, "nesterov"))
        assert (
            f"| {batch:,} | {100 * d.mean:+.2f} ({100 * d.low:+.2f} to {100 * d.high:+.2f}), n={d.n} |"
            in text
        )
    ratio = critical_ratio(
        THREE.batches, *([seeds("steps", b, o) for b in THREE.batches] for o in ("lars", "nesterov"))
    )
    assert (
        f"LARS's critical batch over Nesterov's: {ratio.mean:.2f} ({ratio.low:.2f}-{ratio.high:.2f})." in text
    )
    # what the intervals settle: LARS's steps (B_noise 2,000 against 500) and accuracy
    low, high = min(64 / f.b_noise for f in fits.values()), max(1024 / f.b_noise for f in fits.values())
    each = [steps_ratio(seeds("steps", b, "lars"), seeds("steps", b, "nesterov")).mean for b in THREE.batches]
    assert (
        "- **LARS against Nesterov.** Steps to the target, LARS's over Nesterov's: "
        f"more at B = 64, 256, 1,024 ({min(each):.2f}x to {max(each):.2f}x; {low:.2g}-{high:.2g} B_crit). "
        f"Critical batch: {ratio.mean:.2f} ({ratio.low:.2f}-{ratio.high:.2f}) times Nesterov's, above 1: "
        "perfect scaling reaches larger batches. "
        "Final accuracy, LARS's less Nesterov's: higher at B = 64, 256, 1,024 (+0.40 points; "
    ) in text
    assert (
        "- **LARS against itself at B = 64**, final accuracy within 0.5 points: "
        "within at B = 256, 1,024 (-0.10 to -0.02 points; "
    ) in text
    # part-way through (a point's second final run to go), the brief says so
    del results[
        next(
            k
            for k, r in results.items()
            if (r["spec"]["kind"], r["spec"]["batch"], r["spec"]["seed"]) == ("final", 1024, 1)
        )
    ]
    assert "running, 47 runs so far; finished at B = 64, 256: " in headline(summarize(THREE, results))
    # a point whose search never reached the target: no steps, no ratio; final runs of
    # its most accurate trial, said so
    results = _whole_study(beyond=((1024, "nesterov"),))
    summary = summarize(THREE, results)
    text = headline(summary)
    assert text.startswith(f"**fmnist_cnn: complete, {len(results)} runs.**")
    kinds = [
        r["spec"]["kind"]
        for r in results.values()
        if (r["spec"]["batch"], r["spec"]["optimizer"]) == (1024, "nesterov")
    ]
    assert "steps" not in kinds and kinds.count("final") == THREE.seeds
    assert "| 1,024 | 26,238 | " in text and " | not reached | " in text
    assert text.count("Nesterov not reached") == 2  # the ratio's cell, and the steps' reading
    assert (
        "**LARS against Nesterov.** Steps to the target, LARS's over Nesterov's: more at B = 64, 256 ("
        in text
    )
    assert "); Nesterov not reached at B = 1,024 (" in text
    d = paired_interval(seeds("final", 1024, "lars"), seeds("final", 1024, "nesterov"))
    assert f"| 1,024 | {100 * d.mean:+.2f} ({100 * d.low:+.2f} to {100 * d.high:+.2f}), n={d.n} |" in text
    assert "No trial reached the target for Nesterov at B = 1,024: the final runs there take " in text


def test_the_brief_names_each_unreached_batch_once():
    from largebatch.study.steps import headline, summarize

    results = _whole_study(beyond=((256, "lars"), (1024, "nesterov"), (1024, "lars")))
    text = headline(summarize(THREE, results))
    assert (
        "No trial reached the target for LARS at B = 256 and for Nesterov and LARS at B = 1,024: "
        "the final runs there take " in text
    )


def test_a_final_comparison_still_running_says_so_where_a_search_missed():
    """A point whose search reached no target still has final runs (of its most accurate
    trial); while the other side's final runs are to come, the final-accuracy cells and
    readings say running, and only the steps say "not reached"."""
    from largebatch.study.steps import headline, summarize

    results = _whole_study(beyond=((1024, "nesterov"),))
    for key in [k for k, r in results.items() if (r["spec"]["kind"], r["spec"]["batch"]) == ("final", 1024)]:
        if results[key]["spec"]["optimizer"] != "nesterov":
            del results[key]
    text = headline(summarize(THREE, results))
    assert text.count("Nesterov not reached") == 2  # the ratio's cell, and the steps' reading
    assert "\n| 1,024 | … |\n" in text  # LARS - Nesterov: LARS's finals to come
    assert "Final accuracy, LARS's less Nesterov's: higher at B = 64, 256 (" in text
    assert "); running at B = 1,024 (" in text


def test_an_optimizer_finished_short_of_three_batches_has_no_fit_and_says_why():
    """Nesterov's search at 1,024 reaches no target, so its median seed reaches it at two
    batches, one short of a fit: the headline, the readings and the side-by-side table say
    "no fit" and why, and say nothing of the kind while one of its points still runs."""
    from largebatch.study.steps import compare, headline, summarize

    results = _whole_study(beyond=((1024, "nesterov"),))
    summary = summarize(THREE, results)
    assert "nesterov" not in summary["critical_batch"] and summary["no_fit"] == {"nesterov": [64, 256]}
    why = "Nesterov's median seed reaches the target at 2 batches (64 and 256), where a fit needs 3"
    text = headline(summary)
    assert f"\nNo fit: {why}.\n" in text
    assert f"Critical batch: no fit; {why}. Final accuracy, LARS's" in text
    cells = compare([summary]).splitlines()[2].split(" | ")
    assert cells[3] == "no fit" and cells[7] == "no fit"  # B_crit Nesterov, LARS / Nesterov
    assert cells[4] == "…"  # AdamW: not in this study
    del results[
        next(
            k
            for k, r in results.items()
            if r["spec"]["kind"] == "final" and r["spec"]["optimizer"] == "nesterov"
        )
    ]
    running = summarize(THREE, results)
    assert running["no_fit"] == {} and "no fit" not in headline(running) + compare([running]).lower()


def test_a_ratio_whose_median_seed_ran_out_its_budget_is_a_bound():
    from largebatch.study.steps import headline, summarize

    results = _whole_study(fail=((1024, "nesterov"),))  # of 2 seeds, one never reaches it
    summary = summarize(THREE, results)
    nesterov = next(p for p in summary["points"] if (p["batch"], p["optimizer"]) == (1024, "nesterov"))
    lars = next(p for p in summary["points"] if (p["batch"], p["optimizer"]) == (1024, "lars"))
    assert nesterov["steps_median"] == math.inf and math.isfinite(lars["steps_median"])
    r = steps_ratio(lars["seed_steps"], nesterov["seed_steps"])
    bound = lars["steps_median"] / budget_steps(THREE, 1024)
    text = headline(summary)
    assert f" | < {bound:.2f} ({r.low:.2f}-{r.high:.2f}) |" in text
    assert f"; not resolved at B = 1,024 (< {bound:.2f}x; " in text
    # steps.json keeps the ratio of the medians, and the bound beside it
    row = next(x for x in summary["steps_ratios"] if x["batch"] == 1024)
    assert row["side"] == "<" and row["mean"] == 0.0


def test_a_seed_that_ran_out_its_budget_tops_the_range_as_a_bound():
    """Steps to target of a point where one seed of five never reached it: the median, the
    range up to "> budget", and how many seeds reached it; where the median itself is
    censored, only the bound and the count."""
    from largebatch.study.steps import headline, summarize

    summary = summarize(THREE, _whole_study())
    point = next(p for p in summary["points"] if (p["batch"], p["optimizer"]) == (1024, "nesterov"))
    budget = budget_steps(THREE, 1024)
    point.update(seed_steps=[130, 140, math.inf, 150, 140], steps_median=140)
    text = headline(summary)
    assert f" | 140 [130 to > {budget}] (4/5) | " in text
    assert '"(k/n)": k of its n seeds reached the target within the budget' in text
    point.update(seed_steps=[130, math.inf, math.inf], steps_median=math.inf)
    assert f" | > {budget} (1/3) | " in headline(summary)


def test_a_bound_that_clears_its_line_never_prints_as_the_line():
    """A paired interval just above 0, a ratio's just above 1, an own-batch difference just
    above -0.5 points: two decimals would print the line, so more are shown; a bound on
    the line, or clear of it at two decimals, keeps two."""
    from largebatch.study.steps import headline, markdown, summarize

    summary = summarize(THREE, _whole_study())
    pair = next(
        c for c in summary["comparisons"] if c["point"] == [256, "lars"] and c["reference"][1] == "nesterov"
    )
    pair.update(mean=0.0018, low=7e-6, high=0.0035)
    own = next(
        c for c in summary["comparisons"] if c["point"] == [1024, "lars"] and c["reference"] == [64, "lars"]
    )
    own.update(mean=-0.004, low=-0.004996, high=-0.003)
    ratio = next(r for r in summary["steps_ratios"] if r["batch"] == 256)
    ratio.update(mean=1.2, low=1.0, high=1.004)
    critical = summary["critical_ratios"][0]
    critical.update(mean=1.5, low=0.9996, high=2.0)
    text = headline(summary)
    assert "| 256 | +0.18 (+0.001 to +0.35), n=" in text
    assert " | -0.40 (-0.4996 to -0.30), n=" in text
    assert " | 1.20 (1.00-1.004) |" in text
    assert "over Nesterov's: 1.50 (0.9996-2.00)." in text
    assert "| 256 lars | 256 nesterov | +0.18 | +0.001 to +0.35 |" in markdown(summary)


def test_compare_sets_the_studies_side_by_side(tmp_path, capsys):
    from largebatch.cli import main as cli
    from largebatch.study.steps import compare, summarize

    results = _whole_study()
    summary = summarize(THREE, results)
    other = copy.deepcopy(summary)
    other["settings"]["model"] = "small_resnet"
    del other["critical_batch"]["lars"]
    other["critical_ratios"] = []
    table = compare([summary, other]).splitlines()
    nesterov = summary["critical_batch"]["nesterov"]
    assert table[0].startswith("| model | target | runs | B_crit Nesterov | B_crit AdamW | B_crit LARS |")
    assert table[2].startswith(
        f"| fmnist_cnn | 94.0% | {len(results)} | {nesterov['b_noise']:,.0f} ({nesterov['b_noise_low']:,.0f}-"
    )
    assert table[3].startswith("| small_resnet | 94.0% |") and table[3].endswith("| … | … | … |")
    # the command: each folder summarized from its runs
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "settings.json").write_text(json.dumps(THREE.settings()))
        (folder / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results.values()))
    capsys.readouterr()
    assert cli(["steps", "--compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert capsys.readouterr().out == compare([summary, summary])
    assert "--compare: " in user_error(["steps", "--compare", str(tmp_path / "a"), str(tmp_path)], capsys)


def test_the_plot_draws_the_steps_the_fit_and_the_images(tmp_path):
    from largebatch.study.steps.report import plot

    batches = [64, 256, 1024]
    points = [
        {
            "batch": b,
            "optimizer": o,
            "seed_steps": [s * 0.9, s, s * 1.1],
            "steps_median": s,
            "devices": ["cpu"],
        }
        for o, noise in (("lars", 2000), ("nesterov", 500))
        for b in batches
        for s in [50 * (1 + noise / b)]
    ]
    points.append(
        {"batch": 4096, "optimizer": "lars", "seed_steps": [math.inf] * 3, "steps_median": math.inf}
    )
    summary = {
        "points": points,
        "target": 0.9,
        "critical_batch": {"lars": {"s_min": 50.0, "b_noise": 2000.0}},
    }
    assert plot(summary, tmp_path / "steps.png")
    assert (tmp_path / "steps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plot({"points": [{"batch": 64, "optimizer": "lars"}]}, tmp_path / "none.png")


# --------------------------------------------------------------------------- --quick


def _finished_study(cfg: StepsConfig) -> dict:
    """A study with every run done, as ``_row`` writes them: each pick's seeds reach the
    target in 20, 30 or 40 steps, its final runs score 0.9."""
    results = _smallest_done(cfg, {o: 0.9 for o in cfg.optimizers})
    for _ in range(50):
        todo = plan(cfg, results)
        if not todo:
            return results
        _finish(
            results,
            todo,
            lambda s: [0.9] if s.kind == "final" else [0.5] * (1 + s.seed % 3) + [0.9],
        )
    raise AssertionError("the study did not end")


QUICK = dataclasses.replace(SMALL, batches=(64, 128), subset=900, seeds=3, max_seeds=3)


def test_quick_runs_seed_one_of_each_pick_longest_first():
    from largebatch.study.steps.plan import seed_runs
    from largebatch.study.steps.quick import quick_runs

    results = _finished_study(QUICK)
    seconds = {(64, "nesterov"): 5.0, (64, "lamb"): 9.0, (128, "nesterov"): 7.0, (128, "lamb"): 1.0}
    for r in results.values():
        r["seconds"] = seconds[r["spec"]["batch"], r["spec"]["optimizer"]]
    specs = quick_runs(QUICK, results)
    assert [s.point for s in specs] == [(64, "lamb"), (128, "nesterov"), (64, "nesterov"), (128, "lamb")]
    for s in specs:
        assert s == seed_runs(QUICK, results, *s.point)[0] and s.kind == "steps" and s.seed == 1
        assert s.key in results and s.target == target(QUICK, results)
    assert [s.point for s in quick_runs(QUICK, results, [128, 128], ["lamb"])] == [(128, "lamb")]
    with pytest.raises(ValueError, match=r"batch 256 is not one of the study's \(64, 128\)"):
        quick_runs(QUICK, results, [256])
    with pytest.raises(ValueError, match="optimizer 'lars' is not one of the study's"):
        quick_runs(QUICK, results, None, ["lars"])
    with pytest.raises(ValueError, match="has no pick"):
        quick_runs(QUICK, _smallest_done(QUICK), [128])


def test_quick_sets_each_run_beside_the_studys_seeds_with_bounds_where_one_ran_out():
    from largebatch.study.steps.quick import quick_markdown, quick_runs, quick_summary

    results = _finished_study(QUICK)  # seeds 1-3 reach the target in 30, 40, 20 steps
    specs = quick_runs(QUICK, results)
    steps = {(64, "nesterov"): 30, (64, "lamb"): 50, (128, "nesterov"): None, (128, "lamb"): 20}
    mine = {}
    for s in specs:
        row = copy.deepcopy(results[s.key])
        row["steps_to_target"] = steps[s.point]
        mine[s.key] = row
    summary = quick_summary(QUICK, results, specs, mine)
    by = {(p["batch"], p["optimizer"]): p for p in summary["points"]}
    assert [(p["batch"], p["optimizer"]) for p in summary["points"]] == QUICK.points()
    assert by[64, "nesterov"]["in_range"] and by[128, "lamb"]["in_range"]
    assert not by[64, "lamb"]["in_range"] and not by[128, "nesterov"]["in_range"]
    assert by[64, "lamb"]["study_median"] == 30 and by[64, "lamb"]["study_range"] == [20, 40]
    budget = budget_steps(QUICK, 128)
    text = quick_markdown(summary)
    assert "| 64 | 30 (30; 20-40) | 50 (30; 20-40) |" in text
    # Nesterov ran out its budget at 128: LARS is absent, LAMB's ratio is its own
    assert f"| 128 | > {budget} (30; 20-40) | 20 (30; 20-40) |" in text
    assert "2 of 4 runs lie within the range of the study's seeds" in text
    by[64, "lamb"]["study_range"] = [20, math.inf]
    assert f"| 50 (30; 20 to > {budget_steps(QUICK, 64)}) |" in quick_markdown(summary)
    assert f"({summary['study_runs']} runs, 95%)" in text and "- **LAMB against itself" in text


def test_quick_ratios_are_bounds_where_one_run_ran_out():
    from largebatch.study.steps.quick import _ratio

    a = {"steps": 40, "budget_steps": 100}
    out = {"steps": math.inf, "budget_steps": 200}
    assert _ratio(a, {"steps": 80, "budget_steps": 100}) == "0.50"
    assert _ratio(a, out) == "< 0.20" and _ratio(out, a) == "> 5.00"
    assert _ratio(out, out) == "…" and _ratio(a, None) == "…"


def test_quick_from_the_command_line_runs_resumes_and_refuses_settings(tmp_path, capsys, monkeypatch):
    from largebatch.cli import main as cli
    from largebatch.study.steps.quick import quick_runs

    study = tmp_path / "study"
    study.mkdir()
    results = _finished_study(QUICK)
    (study / "settings.json").write_text(json.dumps(QUICK.settings()))
    (study / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results.values()))
    out = tmp_path / "quick"
    argv = ["steps", "--quick", "--from", str(study), "--out", str(out), "--batches", "64", "--jobs", "1"]
    assert cli(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"largebatch steps --quick: 2 runs, seed 1 of each pick of {study}")
    assert ", 0 done in " in printed and "; the study's own runs of the 2 to go took " in printed
    assert sum(x.startswith("[") and " seed=1 " in x for x in printed.splitlines()) == 2
    log = out / "runs.jsonl"
    runs = load_trials(log)
    assert set(runs) == {s.key for s in quick_runs(QUICK, results, [64])}
    assert all(r["spec"]["kind"] == "steps" and r["spec"]["seed"] == 1 for r in runs.values())
    report = (out / "quick.md").read_text()
    reached = {r["spec"]["optimizer"]: r["steps_to_target"] for r in runs.values()}
    cells = [f"{reached[o]}" if reached[o] else f"> {budget_steps(QUICK, 64)}" for o in ("nesterov", "lamb")]
    assert report in printed and f"| 64 | {cells[0]} (30; 20-40) | {cells[1]} (30; 20-40) |" in report
    assert json.loads((out / "quick.json").read_text())["study"] == str(study)
    assert (out / "quick.png").is_file()
    # again: nothing runs
    lines = log.read_text()
    assert cli(argv) == 0 and log.read_text() == lines
    again = capsys.readouterr().out
    assert again.splitlines()[0].endswith(", 2 done in " + f"{log}; none to go")
    assert not any(x.startswith("[") for x in again.splitlines())
    for extra, message in [
        (["--trials", "3"], "--quick takes its settings from the study in --from, not --trials"),
        (["--report"], "--quick takes its settings from the study in --from, not --report"),
        (["--batches", "256"], "--quick: batch 256 is not one of the study's (64, 128)"),
    ]:
        assert message in user_error([*argv, *extra], capsys)
    assert "holds no steps study" in user_error(["steps", "--quick", "--from", str(tmp_path)], capsys)
    assert "--from goes with --quick" in user_error(["steps", "--from", str(study)], capsys)
    monkeypatch.chdir(tmp_path)
    assert "(run it in a clone of the repository, or name a study with --from DIR)" in user_error(
        ["steps", "--quick"], capsys
    )
    assert load_trials(log) == runs
