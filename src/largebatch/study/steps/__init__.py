"""The steps-to-target study (``largebatch steps``; docs/study.md): how many steps each
optimizer needs to reach a validation target at each batch size, each point tuned by a
quasi-random search, the critical batch of each optimizer, and final accuracy at a fixed
epoch budget with paired intervals.

Modules: ``plan`` (what to run; pure), ``trial`` (one run), ``fits`` (the statistics),
``report`` (the tables and the plot), ``run`` (the study and its folder), ``quick`` (the
quick version, ``make demo``). The flags are ``largebatch.cli.steps``.
"""

from largebatch.study.steps.fits import (
    CriticalBatch,
    Interval,
    critical_batch,
    critical_ratio,
    fit_steps,
    paired_interval,
    steps_ratio,
)
from largebatch.study.steps.plan import (
    BATCHES,
    OPTIMIZERS,
    SPACES,
    Dimension,
    StepsConfig,
    TrialSpec,
    check_config,
    plan,
    target,
)
from largebatch.study.steps.report import compare, headline, markdown, readings, summarize
from largebatch.study.steps.run import compare_steps, estimate, load_trials, recorded_config, run_steps_study

__all__ = [
    "BATCHES",
    "OPTIMIZERS",
    "SPACES",
    "CriticalBatch",
    "Dimension",
    "Interval",
    "StepsConfig",
    "TrialSpec",
    "check_config",
    "compare",
    "compare_steps",
    "critical_batch",
    "critical_ratio",
    "estimate",
    "fit_steps",
    "headline",
    "load_trials",
    "markdown",
    "paired_interval",
    "plan",
    "readings",
    "recorded_config",
    "run_steps_study",
    "steps_ratio",
    "summarize",
    "target",
]
