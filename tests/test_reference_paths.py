"""Every backend and path against the float64 spec, driven by the one table of tests/cases.py.

torch: the single-tensor loop, foreach, compiled and fused (Triton's interpreter on the
CPU) paths, in float64, float32, bfloat16 and float16, without and with fp32 masters.
JAX: float64, float32 and bfloat16 leaves. Inputs are rounded to the precision first;
results are compared at the precision's tolerance (cases.TOLERANCE).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cases import (
    CASE_IDS,
    CASES,
    TORCH_PATHS,
    Result,
    assert_matches,
    make_problem,
    run_jax,
    run_reference,
    run_torch,
)

PATHS = TORCH_PATHS
# (param dtype, fp32 masters, the tolerance the result is held to)
PRECISIONS = {
    "fp64": (torch.float64, False, "float64"),
    "fp32": (torch.float32, False, "float32"),
    "bf16": (torch.bfloat16, False, "bfloat16"),
    "fp16": (torch.float16, False, "float16"),
    "bf16-masters": (torch.bfloat16, True, "float32"),
    "fp16-masters": (torch.float16, True, "float32"),
}
# Each compiled variant (dtype, flags) costs a compile: the compiled path runs the table
# in fp32 and with fp16 masters; the single-tensor loop and the compiled path share the
# per-tensor body, so the other precisions are covered there.
RUNS = {
    "single_tensor": list(PRECISIONS),
    "foreach": list(PRECISIONS),
    "compiled": ["fp32", "fp16-masters"],
    "fused": ["fp32", "bf16", "bf16-masters", "fp16-masters"],  # the kernels take fp32/16/bf16
}
# The fused kernels take the hyperparameters as data and specialise on the bucket's kind
# (param dtype, masters) alone. With masters the math runs on fp32, as in the fp32 rows,
# whatever the param's dtype: bf16-masters runs the table through that kind, and
# fp16-masters, which differs only in loading fp16 grads and writing fp16 params, runs a
# LARS case with a zero grad's norm (LARC's skip) and a LAMB case with the global grad norm.
ONLY = {("fused", "fp16-masters"): ("lars-larc", "lamb-max-grad-norm")}
TORCH_RUNS = [
    (case, path, precision)
    for case in CASES
    for path, ps in RUNS.items()
    for precision in ps
    if case.id in ONLY.get((path, precision), (case.id,))
]


def _unsupported(case, precision):
    """LAMB with fp16 state: (1 - b2) g^2 underflows fp16 (docs/mixed_precision.md)."""
    return case.optimizer == "lamb" and precision == "fp16"


@pytest.fixture
def compile_every_tensor(monkeypatch):
    """The compiled path's body for every tensor of 2+ elements (by default only tensors of
    COMPILE_MIN_TENSOR+ elements take it, and the table's are smaller)."""
    from largebatch.lars.torch import _compiled

    monkeypatch.setattr(_compiled, "COMPILE_MIN_TENSOR", 2)
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


@pytest.mark.parametrize("case,path,precision", TORCH_RUNS, ids=[f"{c.id}-{p}-{q}" for c, p, q in TORCH_RUNS])
def test_torch_matches_the_spec(case, path, precision, request):
    if path == "compiled":
        request.getfixturevalue("compile_every_tensor")
    if _unsupported(case, precision):
        pytest.skip("LAMB keeps fp16 state only with fp32 masters")
    dtype, masters, tolerance = PRECISIONS[precision]
    params, grads = make_problem(dtype)
    if path == "fused" and case.optimizer == "lamb" and 0.0 in (g["eps"] for g in case.groups()):
        # Compiled for a GPU, fp32 sqrt flushes a denormal v_hat to 0: u = m / 0. Refused,
        # before anything changes.
        with pytest.raises(ValueError, match="the fused LAMB kernels need eps > 0"):
            run_torch(case, params, grads, dtype=dtype, masters=masters, **PATHS[path])
        return
    expected = run_reference(case, params, grads)
    actual = run_torch(case, params, grads, dtype=dtype, masters=masters, **PATHS[path])
    assert_matches(actual, expected, tolerance, start=params)


@pytest.mark.parametrize("precision", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_jax_matches_the_spec(case, precision):
    dtype = {"float64": np.float64, "float32": np.float32, "bfloat16": "bfloat16"}[precision]
    params, grads = make_problem(torch.bfloat16 if dtype == "bfloat16" else dtype)
    expected = run_reference(case, params, grads)
    assert_matches(
        run_jax(case, params, grads, dtype=dtype), Result(expected.params, {}), precision, start=params
    )


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.id in ("lars-trust-clip", "lamb-max-grad-norm")], ids=lambda c: c.id
)
def test_the_table_can_fail(case):
    """The comparison is not vacuous: one hyperparameter off gives a mismatch."""
    params, grads = make_problem(np.float64)
    expected = run_reference(case, params, grads)
    off = type(case)(case.id, case.optimizer, {**case.hyper, "eps": 1e-2}, case.second, case.max_grad_norm)
    with pytest.raises(AssertionError):
        assert_matches(
            run_torch(off, params, grads, dtype=torch.float64, foreach=True),
            expected,
            "float64",
            start=params,
        )


def test_the_cases_bind_the_clips():
    """LARC's clip binds on some tensors and not others; LAMB's clipping binds at 5.0 and
    not at 1e6 (so both branches of each are checked)."""
    from largebatch.lars import reference

    params, grads = make_problem(np.float64)
    clip = next(c for c in CASES if c.id == "lars-trust-clip").groups()[0]
    ratios = []
    for w, g in zip(params[:4], grads[0][:4]):
        wn, gn = np.linalg.norm(w), np.linalg.norm(g)
        if wn and gn:
            ratios.append(clip["trust_coefficient"] * wn / (gn + clip["weight_decay"] * wn) / 0.5)
    assert min(ratios) < 1 < max(ratios)
    assert reference.clip_divisor(grads[0], 5.0) > 1 and reference.clip_divisor(grads[0], 1e6) == 1


MANY = [(int(n),) for n in np.random.default_rng(1).integers(1, 300, size=161)]  # ResNet-50's count


@pytest.mark.parametrize("path", ["foreach", "fused", "jax"])
@pytest.mark.parametrize(
    "case", [c for c in CASES if c.id in ("lars-wd-excluded", "lamb-max-grad-norm")], ids=lambda c: c.id
)
def test_many_tensors_match_the_spec(case, path):
    """161 tensors of mixed sizes in two groups (100 and 61), fp32: the torch paths' lists
    and the fused kernels' tables. JAX's chain is the same per leaf whatever their number,
    and its compile time grows with it: 40 leaves (25 and 15) there."""
    shapes, split = (MANY[:40], 25) if path == "jax" else (MANY, 100)
    params, grads = make_problem(np.float32, shapes=shapes, steps=3, seed=2)
    lrs = [0.1, 0.2, 0.3]
    expected = run_reference(case, params, grads, lrs=lrs, split=split)
    if path == "jax":
        actual, expected = (
            run_jax(case, params, grads, dtype=np.float32, lrs=lrs, split=split),
            Result(expected.params, {}),
        )
    else:
        actual = run_torch(case, params, grads, dtype=torch.float32, lrs=lrs, split=split, **PATHS[path])
    assert_matches(actual, expected, "float32", start=params)


def _signature_defaults(fn) -> dict[str, object]:
    """``fn``'s parameters with defaults, by the spec's names (``learning_rate`` is ``lr``;
    ``b1``, ``b2`` are the two ``betas``)."""
    import inspect

    out = {}
    for name, p in inspect.signature(fn).parameters.items():
        if p.default is not inspect.Parameter.empty:
            out[{"learning_rate": "lr"}.get(name, name)] = p.default
    if "b1" in out:
        out["betas"] = (out.pop("b1"), out.pop("b2"))
    return out


def _public_signatures():
    from largebatch import jax as lb_jax
    from largebatch.lars import reference
    from largebatch.lars.spec import LAMB_SPEC, LARS_SPEC
    from largebatch.lars.torch import lamb as lamb_fn
    from largebatch.lars.torch import lars as lars_fn
    from largebatch.torch import LAMB, LARS

    return [
        (LARS_SPEC, LARS.__init__, 10),
        (LAMB_SPEC, LAMB.__init__, 10),
        (LARS_SPEC, lars_fn, 2),
        (LAMB_SPEC, lamb_fn, 3),
        (LARS_SPEC, reference.lars_step, 9),
        (LAMB_SPEC, reference.lamb_step, 8),
        (LARS_SPEC, lb_jax.lars, 8),
        (LAMB_SPEC, lb_jax.lamb, 8),
        (LARS_SPEC, lb_jax.scale_by_lars_trust_ratio, 4),
        (LAMB_SPEC, lb_jax.scale_by_uncorrected_adam, 2),  # its bias_correction is False
    ]


def _uncorrected():
    from largebatch import jax as lb_jax

    return lb_jax.scale_by_uncorrected_adam


def test_signatures_show_the_specs_defaults_as_literals():
    """The signatures a user reads (help(), the API pages) state each default as a value,
    and that value is the spec's."""
    for spec, fn, least in _public_signatures():
        shown = _signature_defaults(fn)
        own = {"bias_correction"} if fn is _uncorrected() else set()
        checked = {k: v for k, v in shown.items() if k in spec.defaults and k not in own}
        assert len(checked) >= least, (fn.__qualname__, sorted(checked))
        for name, value in checked.items():
            assert value == spec.defaults[name], (fn.__qualname__, name, value, spec.defaults[name])
