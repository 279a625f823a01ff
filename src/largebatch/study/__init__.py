"""The batch-size study on Fashion-MNIST (``largebatch study``; docs/study.md).

Modules: ``plan`` (what to run; pure), ``worker`` (one run), ``run`` (the sweep, its
folder), ``report`` (the tables and the plot). The flags are ``largebatch.cli.study``.
"""

from largebatch.study.plan import (
    BASELINE, DEFAULT_BATCHES, DEFAULT_OPTIMIZERS, EXCHANGE_FIELDS, FULL_BATCHES, GRID_CENTRES,
    LARGE_BATCHES, QUICK_PAIRS, STUDY_MODELS, STUDY_OPTIMIZERS, VAL_SIZE, RunSpec, StudyConfig,
    check_config, config_from_runs, fastest_plan, pair_plan, pair_recipe, plan, round_lr,
    run_steps, runs_left, steps_to, validation_target,
)
from largebatch.study.report import compare_markdown, plot, study_markdown, summarize
from largebatch.study.run import (
    SETTINGS, Stopped, append_run, compare_studies, load_results, recorded_config, run_study,
)
from largebatch.study.worker import WORKER, exit_with_parent, init_worker, run_one

__all__ = [
    "BASELINE", "DEFAULT_BATCHES", "DEFAULT_OPTIMIZERS", "EXCHANGE_FIELDS", "FULL_BATCHES",
    "GRID_CENTRES", "LARGE_BATCHES", "QUICK_PAIRS", "SETTINGS", "STUDY_MODELS",
    "STUDY_OPTIMIZERS", "VAL_SIZE", "WORKER", "RunSpec", "Stopped", "StudyConfig", "append_run",
    "check_config", "compare_markdown", "compare_studies", "config_from_runs", "exit_with_parent",
    "fastest_plan", "init_worker", "load_results", "pair_plan", "pair_recipe", "plan", "plot",
    "recorded_config", "round_lr", "run_one", "run_steps", "run_study", "runs_left", "steps_to",
    "study_markdown", "summarize", "validation_target",
]
