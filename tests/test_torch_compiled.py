"""The compiled CPU path (torch.compile of the per-tensor update) against the float64 spec.

Each structural variant (dtype, flags, master or not) compiles once, so the table is kept
small: it covers every branch of the two bodies without paying for every combination.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from cases import CASES, SHAPES, make_problem, run_torch

from largebatch.lars.spec import LARS_SPEC
from largebatch.lars.torch import COMPILE_MIN_NUMEL, _compiled
from largebatch.lars.torch._group import GroupStep
from largebatch.torch import LAMB, LARS


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.id in ("lars-nesterov", "lamb-max-grad-norm")], ids=lambda c: c.id
)
def test_compiled_path_takes_every_tensor_of_two_or_more_elements(case, compiled_calls):
    """The compiled body runs for each such tensor and step (its match with the spec is
    test_reference_paths.py's compiled rows), the size-0 and size-1 ones go through the eager body."""
    params, grads = make_problem(np.float32)
    run_torch(case, params, grads, dtype=torch.float32, compiled=True)
    n_compiled = sum(1 for s in SHAPES if np.prod(s) >= 2)
    assert compiled_calls == [f"_{case.optimizer}_one"] * (n_compiled * len(grads))


@pytest.fixture(autouse=True)
def compiled_calls(monkeypatch):
    """Send every tensor of 2+ elements to the compiled body (by default only tensors of
    COMPILE_MIN_TENSOR+ elements go there, the rest through foreach), and count the
    calls of the compiled bodies."""
    monkeypatch.setattr(_compiled, "COMPILE_MIN_TENSOR", 2)
    calls = []
    real = _compiled.compiled_body

    def counting(body, *flags):
        compiled = real(body, *flags)

        def call(*args, **kwargs):
            calls.append(body.__name__)
            return compiled(*args, **kwargs)

        return call

    monkeypatch.setattr(_compiled, "compiled_body", counting)
    return calls


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_compiled_fp16_masters_with_grad_scaler_equal_foreach(cls, compiled_calls):
    torch.manual_seed(0)
    models = [
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).half()
        for _ in range(2)
    ]
    models[1].load_state_dict(models[0].state_dict())
    opts = [
        cls(m.parameters(), lr=0.1, master_weights=True, compiled=c) for m, c in zip(models, (False, True))
    ]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8) for _ in range(2)]
    x, y = torch.randn(64, 16).half(), torch.randint(0, 4, (64,))
    for step in range(3):
        for model, opt, scaler in zip(models, opts, scalers):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            if step == 1:
                model[0].weight.grad[0, 0] = float("inf")  # an overflow step: skipped by both
            scaler.step(opt)
            scaler.update()
    assert opts[0].num_steps == opts[1].num_steps == 2
    assert len(compiled_calls) == 4 * 2  # 4 tensors, 2 applied steps (the skipped one makes none)
    for a, b in zip(*(o.state_dict()["state"].values() for o in opts)):
        torch.testing.assert_close(a["master_param"], b["master_param"], rtol=1e-5, atol=1e-6)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-3)


def test_split_sends_small_and_strided_tensors_to_foreach(monkeypatch):
    monkeypatch.setattr(_compiled, "COMPILE_MIN_TENSOR", 100)
    ps = [torch.zeros(100), torch.zeros(99), torch.zeros(10, 20).t(), torch.zeros(300)]
    group = GroupStep(
        params=ps,
        grads=list(range(4)),
        state={},
        masters=[None] * 4,
        steps=[None] * 4,
        lr=0.1,
        hyper=LARS_SPEC.make({}),
    )
    large, small = _compiled.split_for_compile(group)
    assert large.grads == [0, 3] and small.grads == [1, 2]


def test_compiled_is_the_default_for_large_cpu_models_only():
    small = [torch.nn.Parameter(torch.zeros(10))]
    large = [torch.nn.Parameter(torch.zeros(COMPILE_MIN_NUMEL))]
    assert LARS(small, lr=0.1).param_groups[0]["compiled"] is False
    assert LARS(large, lr=0.1).param_groups[0]["compiled"] is True
    assert LAMB(large, lr=0.1, compiled=False).param_groups[0]["compiled"] is False
    with pytest.raises(ValueError, match="compiled=True and fused=True"):
        LARS(small, lr=0.1, compiled=True, fused=True)


CROSS_PROCESS = """
import json, sys, torch
from largebatch.torch import LAMB, LARS

errors = []
for cls, kwargs in zip((LARS, LAMB), json.loads(sys.argv[1])):
    out = []
    for compiled in (True, False):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(256, 256))
        opt = cls([w], lr=0.1, compiled=compiled, foreach=None if compiled else True, **kwargs)
        for _ in range(2):
            w.grad = torch.randn(256, 256) * 0.01
            opt.step()
        out.append(w.detach().clone())
    errors.append(float(((out[0] - out[1]).abs().max() / out[1].abs().max())))
print(json.dumps(errors))
"""


@pytest.mark.slow
def test_a_second_process_with_other_hyperparameters_gets_its_own_numbers(tmp_path):
    """Two processes share one Inductor cache: the second, with other hyperparameter
    values, must compute with its own values, not the first one's (compiled against
    foreach in each process; LARS, then LAMB)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    first = [dict(weight_decay=0.1), dict(weight_decay=0.01)]
    second = [
        dict(weight_decay=0.01, momentum=0.5, trust_coefficient=0.02),
        dict(weight_decay=0.01, betas=[0.5, 0.9]),
    ]
    for kwargs in (first, second):
        run = subprocess.run(
            [sys.executable, "-c", CROSS_PROCESS, json.dumps(kwargs)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        errors = json.loads(run.stdout.splitlines()[-1])
        assert max(errors) < 1e-5, (kwargs, errors)
        # Compiling for the CPU says nothing about CUDA (torch's cpp_extension logs "No
        # CUDA runtime is found" where a CUDA toolkit lies beside no GPU, as here).
        assert "No CUDA runtime" not in run.stderr, run.stderr[-3000:]


@pytest.mark.slow  # ten compilations
def test_more_sets_of_flags_than_dynamos_recompile_limit_in_one_process(compiled_calls):
    """Dynamo keeps 8 graphs per code object and raises beyond (the bodies are compiled
    with fullgraph=True): each set of flags has a code object of its own, so five sets,
    each with an fp32 and an fp16-master group (ten graphs), run in one process."""
    import itertools

    sets = list(itertools.product([False, True], repeat=4))[:5]
    for nesterov, trust_clip, lr_in_momentum, zero_norm_skip in sets:
        full, half = torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(torch.ones(8).half())
        opt = LARS(
            [{"params": [full]}, {"params": [half]}],
            lr=0.1,
            weight_decay=1e-2,
            nesterov=nesterov,
            trust_clip=trust_clip,
            lr_in_momentum=lr_in_momentum,
            zero_norm_skip=zero_norm_skip,
            master_weights=True,
            compiled=True,
        )
        full.grad, half.grad = torch.full((8,), 0.5), torch.full((8,), 0.5).half()
        opt.step()
    assert len(compiled_calls) == 2 * len(sets)
