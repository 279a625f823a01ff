"""The compile check of the fused kernels (``tools/compile_check.py``).

Launches are recorded here, under the interpreter (tests/conftest.py); compiling needs
the kernels defined without it, so the tests that compile start a subprocess. ``make
check-kernels`` runs the whole check; ``make test`` runs its quick sample.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

TOOLS = Path(__file__).resolve().parents[1] / "tools"  # the check is a script there, not in the package
sys.path.insert(0, str(TOOLS))

import compile_check as cc  # noqa: E402
import compile_launches as cl  # noqa: E402

from largebatch.lars.kernels import plan as kplan  # noqa: E402

TILE_KERNELS = {
    "grad_check_kernel",
    "lars_norms_kernel",
    "lars_apply_kernel",
    "lamb_moments_kernel",
    "lamb_apply_kernel",
}


def compiler_env(tmp_path, *paths):
    """The environment of a subprocess that compiles: no interpreter, its own cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(TOOLS), env.get("PYTHONPATH", "")])
    return env


def test_configurations_cover_every_kind_shape_and_input():
    configs = cl.configurations()
    for optimizer in ("LARS", "LAMB"):
        mine = [c for c in configs if c.optimizer == optimizer]
        assert {(c.kind, c.numel, c.aligned) for c in mine} == {
            (k, n, a) for k in cl.KINDS for n in cl.SIZES for a in (True, False)
        }
        assert {c.amp for c in mine} == set(cl.AMP)
        assert {c.variant for c in mine} == set(cl.VARIANTS[optimizer])
        assert {c.counter for c in mine} == {True, False}
    shapes = {kplan._launch_shape(n) for n in cl.SIZES}
    assert shapes == {(128, 1), (256, 1), (512, 1), (1024, 1), (1024, 2), (1024, 3), (1024, 4)}


def test_launches_are_recorded_as_triton_specializes_them():
    """The quick sample's launches: every kernel, recorded (not run) with its constexprs,
    argument types, 16-divisible arguments and the plan's warps."""
    launches = cl.record(cl.configurations(quick=True))
    assert {x.name for x in launches} == TILE_KERNELS | {"finish_kernel"}
    for x in launches:
        values, signature = dict(x.constexprs), dict(x.signature)
        if x.name in TILE_KERNELS:
            assert signature["chunks"] == "*i64" and "chunks" in x.attrs
            if "parts" in signature:  # a pass that writes each chunk's partial sums
                assert signature["parts"] == "*fp64" and "parts" in x.attrs
            warps = dict(x.options).get("num_warps")
            assert warps == kplan._num_warps(values["BLOCK"], values["ALIGNED"])
            # An absent found_inf is replaced by the fp64 workspace, a pointer never read.
            assert signature["found_inf"] == ("*fp32" if values["HAS_FOUND_INF"] else "*fp64")
    moments = [x for x in launches if x.name == "lamb_moments_kernel"]
    assert {dict(x.constexprs)["ALIGNED"] for x in moments} == {True, False}
    assert {dict(x.constexprs)["CLIP"] for x in moments} == {True, False}
    assert {dict(x.constexprs)["TILES"] for x in moments} == {3, 4}
    assert any(dict(x.constexprs)["P_DTYPE"] == "bf16" for x in moments)
    finish = [x for x in launches if x.name == "finish_kernel"]
    assert {dict(x.signature)["n_steps"] for x in finish} == {"i32"}
    assert {dict(x.constexprs)["HAS_FOUND_INF"] for x in finish} == {True, False}


@pytest.mark.slow
def test_quick_compile_check_passes(tmp_path):
    """``python tools/compile_check.py --quick``: every sampled
    specialization compiles for sm_80 and sm_90 without spills, within 128 registers, with
    no fp64 instruction per element and 16-byte loads where aligned."""
    pytest.importorskip("triton.backends.nvidia")
    run = subprocess.run(
        [sys.executable, str(TOOLS / "compile_check.py"), "--quick", "--jobs", "2"],
        env=compiler_env(tmp_path),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "no violations" in run.stdout
    for arch in cc.ARCHS:
        for name in TILE_KERNELS:
            assert f"| `{name}` | sm_{arch} |" in run.stdout


PROBE = """
import triton
import triton.language as tl


@triton.jit
def _fp64_per_element(x, out, n, BLOCK: tl.constexpr, TILES: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for i in range(TILES):
        offs = tl.program_id(0) * BLOCK * TILES + i * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x + offs, mask=offs < n, other=0.0).to(tl.float64)
        acc += v * v
    tl.atomic_add(out, tl.sum(acc, axis=0))


@triton.jit
def _fp64_per_tile(x, out, n, BLOCK: tl.constexpr, TILES: tl.constexpr):
    acc = tl.full((), 0.0, tl.float64)
    for i in range(TILES):
        offs = tl.program_id(0) * BLOCK * TILES + i * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x + offs, mask=offs < n, other=0.0)
        acc += tl.sum(v * v, axis=0).to(tl.float64)
    tl.atomic_add(out, acc)
"""

SEES = """
import json, sys
import compile_check as cc
import compile_launches as cl

out = {}
moments = cl.Launch.from_json(json.loads(sys.argv[1]))
m = cc.measure(moments, 90, {"maxnreg": 32})
out["squeezed"] = [m.spills, cc.violations(moments, m)]
for name in ("_fp64_per_element", "_fp64_per_tile"):
    probe = cl.Launch(
        f"probe:{name}", (("x", "*fp32"), ("out", "*fp64"), ("n", "i32"), ("BLOCK", "constexpr"),
                          ("TILES", "constexpr")), (("BLOCK", 1024), ("TILES", 4)), ("x", "out"))
    m = cc.measure(probe, 80)
    out[name] = [m.fp64_per_element, m.fp64_other, cc.violations(probe, m)]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_check_sees_spills_and_fp64_per_element(tmp_path):
    """The measures can fail: a recorded lamb_moments_kernel squeezed into 32 registers
    spills; a tile loop that squares in fp64 counts 2 fp64 instructions per element (a
    conversion and a fused multiply-add), one that takes each tile's fp32 sum into fp64
    counts none (its fp64 work is per tile)."""
    pytest.importorskip("triton.backends.nvidia")
    (tmp_path / "probe.py").write_text(PROBE)
    launches = cl.record([c for c in cl.configurations(quick=True) if c.optimizer == "LAMB"][:1])
    moments = next(x for x in launches if x.name == "lamb_moments_kernel")
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SEES), json.dumps(moments.to_json())],
        env=compiler_env(tmp_path, tmp_path),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    spills, problems = out["squeezed"]
    assert spills > 0 and any(p.startswith("spills") for p in problems)
    per_element, _, problems = out["_fp64_per_element"]
    assert per_element == 2 and problems == ["2 fp64 instructions per element"]
    per_element, other, problems = out["_fp64_per_tile"]
    assert per_element == 0 and other > 0 and problems == []
