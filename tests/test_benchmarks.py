"""The benchmarks' own transformations hold to the package's (what they time is what the
package computes), and a sweep reports a provider that fails instead of stopping."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from jax_packed import packed_lars  # noqa: E402

from largebatch import jax as lb  # noqa: E402


def test_packed_lars_is_lars_on_every_leaf() -> None:
    """Sizes off any block, one over two rows, a zero leaf (ratio 1) and a leaf whose
    gradient is zero."""
    rng = np.random.default_rng(0)
    shapes = {"conv": (8, 3, 3, 3), "bias": (8,), "fc": (10, 33), "zero": (5,), "still": (7, 2),
              "rows": (4099,)}
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    params["zero"][:] = 0
    ours, packed = lb.lars(0.5, momentum=0.9, weight_decay=1e-2), packed_lars(0.5, 0.9, 1e-2)
    p_ours, p_packed = params, params
    s_ours, s_packed = ours.init(params), packed.init(params)
    for _ in range(4):
        grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        grads["still"][:] = 0
        u_ours, s_ours = ours.update(grads, s_ours, p_ours)
        u_packed, s_packed = jax.jit(packed.update)(grads, s_packed, p_packed)
        p_ours, p_packed = optax.apply_updates(p_ours, u_ours), optax.apply_updates(p_packed, u_packed)
        for k in shapes:
            np.testing.assert_allclose(p_packed[k], p_ours[k], rtol=2e-6, atol=1e-7, err_msg=k)


def test_a_provider_that_fails_is_reported_and_the_others_still_run(monkeypatch) -> None:
    import optimizer_step as bench

    def broken(shapes, device, seed, precision):
        raise RuntimeError("no graph here")

    monkeypatch.setattr(bench, "MODELS", {"tiny": lambda: [(3, 4), (5,)]})
    monkeypatch.setattr(bench, "PROVIDERS", [
        bench.Provider("broken", "sgd", broken),
        *[p for p in bench.PROVIDERS if p.name == "foreach SGD-momentum (floor)"],
    ])
    res = bench.run("tiny", "cpu", steps=2, warmup=1, names=None, rounds=2)
    assert res["skipped"] == {"broken": "failed: RuntimeError: no graph here"}
    assert [r["provider"] for r in res["rows"]] == ["foreach SGD-momentum (floor)"]
