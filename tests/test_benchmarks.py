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
from helpers import MIXES, NON_FINITE, assert_float64_norms  # noqa: E402
from jax_norms import one_pass_norms  # noqa: E402
from jax_packed import packed_lars  # noqa: E402

from largebatch import jax as lb  # noqa: E402


@pytest.mark.parametrize("pallas", [False, True], ids=["xla", "pallas"])
def test_packed_lars_is_lars_on_every_leaf(pallas: bool) -> None:
    """Sizes off any block, one over two rows, a zero leaf (ratio 1) and a leaf whose
    gradient is zero; the passes as XLA's fusions and as Pallas kernels (interpreted)."""
    rng = np.random.default_rng(0)
    shapes = {
        "conv": (8, 3, 3, 3),
        "bias": (8,),
        "fc": (10, 33),
        "zero": (5,),
        "still": (7, 2),
        "rows": (4099,),
    }
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    params["zero"][:] = 0
    ours, packed = lb.lars(0.5, momentum=0.9, weight_decay=1e-2), packed_lars(0.5, 0.9, 1e-2, pallas=pallas)
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
    monkeypatch.setattr(
        bench,
        "PROVIDERS",
        [
            bench.Provider("broken", "sgd", broken),
            *[p for p in bench.PROVIDERS if p.name == "foreach SGD-momentum (floor)"],
        ],
    )
    res = bench.run("tiny", "cpu", steps=2, warmup=1, names=None, rounds=2)
    assert res["skipped"] == {"broken": "failed: RuntimeError: no graph here"}
    assert [r["provider"] for r in res["rows"]] == ["foreach SGD-momentum (floor)"]


def test_the_fused_jax_providers_run_on_the_cpu(monkeypatch) -> None:
    """``lars``/``lamb(..., fused=True)`` are timed on any device (the CPU runs the
    kernels' bodies as XLA)."""
    import optimizer_step as bench

    monkeypatch.setattr(bench, "MODELS", {"tiny": lambda: [(3, 4), (5,), (4099,)]})
    res = bench.run("tiny", "cpu", steps=2, warmup=1, names=["(pallas"])
    assert res["skipped"] == {}
    assert [r["provider"] for r in res["rows"]] == [
        "ours lars (pallas)",
        "ours lars, params packed (pallas)",
        "ours lamb (pallas)",
        "ours lamb, params packed (pallas)",
    ]


@pytest.mark.parametrize("python", ["/nonexistent/python3", "no-torch"])
def test_gpu_check_fails_where_its_python_cannot_run_torch(python, tmp_path) -> None:
    """``make gpu-check`` exits 0 without running anything only where torch ran and saw no
    GPU; a ``GPU_PYTHON`` that does not exist or has no torch fails with the reason."""
    import os
    import subprocess

    if python == "no-torch":  # an interpreter without torch: a venv of no packages
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
        python = str(tmp_path / "venv" / "bin" / "python")
    script = Path(__file__).parents[1] / "benchmarks" / "gpu_check.sh"
    env = {**os.environ, "GPU_PYTHON": python, "GPU_REPORT": str(tmp_path / "report")}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert f"{python} cannot run torch" in done.stderr, done.stderr
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize("value", ["x", "-1", "2a"])
def test_gpu_check_refuses_a_from_that_is_not_a_step_number(value, tmp_path) -> None:
    import os
    import subprocess

    script = Path(__file__).parents[1] / "benchmarks" / "gpu_check.sh"
    env = {**os.environ, "GPU_CHECK_FROM": value, "GPU_REPORT": str(tmp_path / "report")}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.strip() == f"make gpu-check: GPU_CHECK_FROM must be a step number, got '{value}'"
    assert not (tmp_path / "report").exists()


def test_gpu_check_without_a_gpu_says_so_and_passes(tmp_path) -> None:
    import os
    import subprocess

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: gpu-check would run its checks")
    script = Path(__file__).parents[1] / "benchmarks" / "gpu_check.sh"
    env = {**os.environ, "GPU_PYTHON": sys.executable, "GPU_REPORT": str(tmp_path / "report")}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert done.stdout == (
        f"make gpu-check: no CUDA GPU here ({sys.executable}: "
        "torch.cuda.is_available() is False); nothing to run\n"
    )


def test_xla_profile_counts_each_programs_kernels_and_conditionals(monkeypatch, tmp_path) -> None:
    """The profile of the JAX programs on small shapes: ours takes each of its 2 norms a
    leaf inside a ``lax.cond`` (2 conditionals a leaf in the compiled entry computation),
    its "(plain norms)" and "(one pass)" variants none; every program's kernels were
    found in the trace."""
    import json

    import optimizer_step as bench
    import xla_profile

    monkeypatch.setattr(bench, "MODELS", {"tiny": lambda: [(256, 256), (300,), (64, 3, 3, 3)]})
    out = tmp_path / "profile.json"
    assert xla_profile.main(["--model", "tiny", "--steps", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["failed"] == {}
    rows = {r["program"]: r for r in res["rows"]}
    assert list(rows) == xla_profile.PROGRAMS
    assert rows["ours lars"]["entry_by_op"]["conditional"] == 2 * 3
    for variant in ("ours lars (plain norms)", "ours lars (one pass)", "ours lamb (one pass)"):
        assert "conditional" not in rows[variant]["entry_by_op"], variant
    assert "conditional" not in rows["optax lars"]["entry_by_op"]
    for r in rows.values():
        assert r["entry_ops"] > 0 and r["kernels_per_step"] > 0, r


@pytest.mark.parametrize("size", [1, 7, 4099])
@pytest.mark.parametrize("mix", MIXES, ids="+".join)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_one_pass_norms_are_float64_norms(size, mix, jit) -> None:
    """The one-pass form holds to float64 on every mix of magnitudes, a leaf of one
    element too (where XLA would fold its two scalings into one constant that underflows
    in float32, were they not hidden from it)."""
    assert_float64_norms(one_pass_norms, size, mix, jit)


@pytest.mark.parametrize("values, expected", NON_FINITE)
def test_one_pass_norms_of_non_finite_elements(values, expected) -> None:
    np.testing.assert_equal(float(one_pass_norms([jax.numpy.asarray(values, np.float32)])[0]), expected)


def test_fused_host_times_both_habits_beside_a_base_revision() -> None:
    """The script's rows: LARS and LAMB, static and moved grads, this tree and the base's;
    the goal stated on the static rows of this tree. (A subprocess: it silences the kernels.)"""
    import re
    import subprocess

    script = Path(__file__).parent.parent / "benchmarks" / "fused_host.py"
    done = subprocess.run(
        [sys.executable, str(script), "--base", "HEAD", "--steps", "2", "--warmup", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(
        r"^(LARS|LAMB) (static|moved) +(this tree|HEAD) +host [0-9.]+ ms/step(.*)$", done.stdout, re.M
    )
    assert [r[:3] for r in rows] == [
        (name, grads, tree)
        for name in ("LARS", "LAMB")
        for grads in ("static", "moved")
        for tree in ("this tree", "HEAD")
    ]
    goals = [r[3] for r in rows if r[1] == "static" and r[2] == "this tree"]
    assert len(goals) == 2 and all(re.search(r"\(goal 0\.1 ms: (met|not met)\)$", g) for g in goals)
    assert not any("goal" in r[3] for r in rows if (r[1], r[2]) != ("static", "this tree"))


def test_the_moved_grads_provider_gives_new_grads_at_every_step() -> None:
    """Its step swaps two sets of grads, so the fused step reuses its groups, never its plan."""
    import optimizer_step as bench

    from largebatch.lars.torch._fused import NEW_GRADS

    provider = next(p for p in bench.PROVIDERS if p.name == "ours LARS moved grads (Triton)")
    step = provider.make([(3, 4), (5,)], "cpu", 0, "fp32")
    opt = step.optimizer
    seen, check = [], opt._replay.check
    opt._replay.check = lambda *args: seen.append(check(*args)) or seen[-1]
    grads = []
    for _ in range(4):
        step()
        grads.append([p.grad for g in opt.param_groups for p in g["params"]])
    assert seen[1:] == [NEW_GRADS] * 3  # the first step builds the plan
    assert all(a is not b for k in range(3) for a, b in zip(grads[k], grads[k + 1]))
    assert opt.num_steps == 4


def test_comm_hook_counts_what_an_iteration_runs() -> None:
    """``comm_hook.py --count``'s table: per bucket, the fused hook launches and reads a
    fixed number (all-gather 6 launches and a read; two-phase 12 and 2, on one rank; and
    one read an iteration), and runs fewer torch operations than the torch-op hook; the
    kernels are back after it."""
    import comm_hook
    import torch.distributed as dist

    from largebatch.comm.torch import _fused, _kernels

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    kernels = {name: getattr(_kernels, name) for name in _fused.KERNELS}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rows = comm_hook.count([(8, 4, 3, 3), (8,)] * 20, 25.0)
    finally:
        dist.destroy_process_group()
    got = {(r["form"], r["path"]): r for r in rows}
    for form, launches, reads in (("allgather", 6, 2), ("two_phase", 12, 3)):
        fused, plain = got[form, "fused"], got[form, "torch"]
        assert fused["buckets"] == plain["buckets"] == 1
        assert (fused["triton_launches"], fused["host_reads"]) == (launches, reads)
        assert plain["triton_launches"] == 0 and fused["torch_ops"] < plain["torch_ops"] / 3
    assert all(getattr(_kernels, name) is k for name, k in kernels.items())


def test_jax_adacomp_times_pmean_and_both_exchanges(monkeypatch, tmp_path) -> None:
    """``jax_adacomp.py`` times ``pmean`` and the exchange leaf by leaf and packed, and
    writes each row's cost a gradient byte."""
    import json

    import jax_adacomp
    import optimizer_step as bench

    monkeypatch.setattr(bench, "MODELS", {"tiny": lambda: [(8, 3, 3, 3), (5,), (40, 30)]})
    out = tmp_path / "adacomp.json"
    args = ["--model", "tiny", "--steps", "1", "--warmup", "0", "--devices", "2", "--only", "pmean,allgather"]
    assert jax_adacomp.main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["kind"] for r in result["rows"]] == ["pmean", "allgather (per-leaf)", "allgather (packed)"]
    assert result["devices"] == 2 and all(r["ms"] > 0 for r in result["rows"])
    assert result["rows"][0]["ns_per_byte"] is None and result["rows"][2]["ns_per_byte"] is not None


def test_study_cpu_times_the_micro_batches_and_the_scoring_chunks(capsys) -> None:
    import study_cpu

    args = ["--models", "fmnist_cnn", "--batch", "256", "--micro", "128,64", "--steps", "1"]
    assert study_cpu.main([*args, "--eval-chunks", "2000,500"]) == 0
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines()]
    training, scoring = (r for r in rows if r[0] == "fmnist_cnn")
    assert len(training) == 4 and all(cell.endswith("x)") for cell in training[2:])
    assert len(scoring) == 3 and scoring[1].endswith("(1.00x)") and scoring[2].endswith("x)")
    with pytest.raises(SystemExit) as stop:
        study_cpu.main(["--batch", "256", "--micro", "100"])
    assert stop.value.code == 2
    assert "every --micro must divide --batch 256, got 100" in capsys.readouterr().err


def _one_gpu_env(tmp_path: Path, run: bool = True) -> dict[str, str]:
    """The environment of a gpu-check on a machine that says it has one GPU: a stand-in
    Python that answers the script's two probes (the real one runs everything else, or
    with ``run=False`` the scripts of tools/ only: each step's command ends at once), a
    data folder, and the report in ``tmp_path / "report"``."""
    import os

    python = tmp_path / "python"
    python.write_text(
        "#!/bin/bash\n"
        'case "$*" in\n'
        '  "-c import torch; print(torch.cuda.is_available())") echo True; exit 0 ;;\n'
        '  "-c import torch; print(torch.cuda.device_count())") echo 1; exit 0 ;;\n'
        "esac\n"
        + ("" if run else 'case "$1" in tools/*) ;; *) echo "ran: $*"; exit 0 ;; esac\n')
        + f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train-images-idx3-ubyte.gz").touch()  # the data the training steps would read
    return {
        **os.environ,
        "GPU_PYTHON": str(python),
        "GPU_REPORT": str(tmp_path / "report"),
        "DATA": str(data),
    }


def test_gpu_check_runs_the_steps_gpu_check_steps_names(tmp_path) -> None:
    """GPU_CHECK_STEPS=1,3-4: steps 1, 3 and 4 run (their commands, by a stand-in Python
    that ends at once), every other is reported as not run, naming the setting."""
    import re
    import subprocess

    script = Path(__file__).parents[1] / "benchmarks" / "gpu_check.sh"
    env = {**_one_gpu_env(tmp_path, run=False), "GPU_CHECK_STEPS": "1,3-4", "GPU_CHECK_BUDGET": "100"}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout, done.stderr)
    ran = re.findall(r"^\[(\d+)\] .*\(at most \d+ s\)$", done.stdout, flags=re.M)
    skipped = re.findall(r"^\[(\d+)\] .*: not run \(not in GPU_CHECK_STEPS=1,3-4\)$", done.stdout, flags=re.M)
    assert ran == ["1", "3", "4"], done.stdout
    assert "2" in skipped and "5" in skipped and "18" in skipped and not set(ran) & set(skipped)
    report = (tmp_path / "report" / "report.md").read_text()
    assert "from step 1, steps 1,3-4;" in report
    assert report.count("ran: ") == 3, report  # the three steps' commands, each once


@pytest.mark.parametrize("value", ["x", "8-", "1,,2", "2-3a", "-1"])
def test_gpu_check_refuses_steps_that_are_not_numbers_and_ranges(value, tmp_path) -> None:
    import os
    import subprocess

    script = Path(__file__).parents[1] / "benchmarks" / "gpu_check.sh"
    env = {**os.environ, "GPU_CHECK_STEPS": value, "GPU_REPORT": str(tmp_path / "report")}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    want = f"make gpu-check: GPU_CHECK_STEPS must be step numbers and ranges such as 8-12,18, got '{value}'"
    assert done.stderr.strip() == want
    assert not (tmp_path / "report").exists()


def test_gpu_check_numbers_its_steps_as_docs_gpu_lists_them_and_continues_the_running_study(
    tmp_path,
) -> None:
    """On a machine that says it has one GPU (a stand-in Python that answers the script's
    two probes), with every step before GPU_CHECK_FROM: the steps' numbers are the rows
    of docs/gpu.md's table, the last is the steps study, and it takes a copy of the study
    that has runs to go (``tools/study_docs.py --running``), the copy's own folder."""
    import re
    import subprocess

    root = Path(__file__).parents[1]
    sys.path.insert(0, str(root / "tools"))
    import study_docs

    report = tmp_path / "report"
    env = {**_one_gpu_env(tmp_path), "GPU_CHECK_FROM": "99"}
    done = subprocess.run(
        ["bash", str(root / "benchmarks" / "gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    steps = dict(re.findall(r"^\[(\d+)\] (.*?): not run", done.stdout, flags=re.M))
    numbers = sorted(map(int, steps))
    assert numbers == list(range(1, len(numbers) + 1)), done.stdout

    listed: dict[int, str] = {}
    for first, last, text in re.findall(
        r"^\| (\d+(?:, \d+)*)(?:-(\d+))? \| ([^|]*)", (root / "docs" / "gpu.md").read_text(), flags=re.M
    ):
        values = [int(v) for v in first.split(", ")]
        values += range(values[-1] + 1, int(last) + 1) if last else []
        listed.update(dict.fromkeys(values, text))
    assert sorted(listed) == numbers
    assert listed[numbers[-1]].startswith("the steps-to-target study")
    assert steps[str(numbers[-1])].startswith("The steps study on the GPU")

    running = study_docs.running(study_docs.load_summaries(root))
    text = (report / "report.md").read_text()
    if running:
        copy = report / Path(running[0]).name
        assert f"--out {copy} --device cuda" in text
        assert (copy / "settings.json").read_text() == (root / running[0] / "settings.json").read_text()
    else:
        assert "no study in docs/study has runs to go" in text
