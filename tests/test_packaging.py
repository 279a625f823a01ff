"""The package as a user gets it: ``python -m build`` makes an sdist and a wheel that
``twine check`` passes; the wheel holds the LICENSE and ``py.typed`` and no tests, states
its version once, and caps no framework; installed on its own (no editable install, no
source tree on the path) it imports both facades.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("build", reason="the dev extra is not installed: pip install -e '.[dev]' (build)")
pytest.importorskip("twine", reason="the dev extra is not installed: pip install -e '.[dev]' (twine)")
from packaging.requirements import Requirement  # build depends on packaging

ROOT = Path(__file__).resolve().parents[1]
# What the build reads: the package and the files pyproject.toml and MANIFEST.in name.
SOURCES = ("pyproject.toml", "MANIFEST.in", "README.md", "LICENSE", "CHANGELOG.md", "src")


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{' '.join(map(str, args))} failed:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def _version() -> str:
    """``__version__`` as src/largebatch/__init__.py writes it (the one source)."""
    for line in (ROOT / "src" / "largebatch" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    raise AssertionError("src/largebatch/__init__.py sets no __version__")


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist and the wheel, built (without build isolation: offline, from the
    environment's setuptools) from a copy of the sources, so the tree gets no build files."""
    tmp = tmp_path_factory.mktemp("packaging")
    source = tmp / "source"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    out = tmp / "dist"
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, source, cwd=tmp)
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist, "tmp": tmp}


@pytest.mark.slow
def test_twine_check_passes_both(dists: dict[str, Path]) -> None:
    output = _run(
        sys.executable, "-m", "twine", "check", "--strict", dists["sdist"], dists["wheel"], cwd=dists["tmp"]
    )
    assert output.count("PASSED") == 2, output


@pytest.mark.slow
def test_wheel_contents_and_metadata(dists: dict[str, Path]) -> None:
    version = _version()
    assert dists["wheel"].name == f"largebatch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(dists["wheel"]) as wheel:
        names = wheel.namelist()
        info = f"largebatch-{version}.dist-info"
        metadata = email.parser.Parser().parsestr(wheel.read(f"{info}/METADATA").decode())
        license_text = wheel.read(f"{info}/licenses/LICENSE").decode()
    assert "largebatch/py.typed" in names
    assert "largebatch/torch.py" in names and "largebatch/jax.py" in names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "docs/"))], names
    assert not [n for n in names if "/test_" in n or n.endswith("conftest.py")], names
    assert license_text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert metadata["Version"] == version
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    urls = dict(u.split(", ", 1) for u in metadata.get_all("Project-URL"))
    assert {"Homepage", "Documentation", "Source", "Issues", "Changelog"} <= set(urls), urls
    # The README as an index shows it: its links lead to the repository, none is relative.
    readme = metadata.get_payload()
    assert "](docs/" not in readme and "](https://github.com/largebatch/largebatch/blob/main/docs/" in readme
    # A floor for each framework, no ceiling: a newer torch is never downgraded.
    requires = [Requirement(r) for r in metadata.get_all("Requires-Dist")]
    frameworks = [r for r in requires if r.name in ("torch", "torchvision", "jax", "triton")]
    assert len(frameworks) >= 5, requires  # torch in two extras, torchvision, jax, triton
    for requirement in frameworks:
        operators = {spec.operator for spec in requirement.specifier}
        assert operators == {">="}, requirement
    with tarfile.open(dists["sdist"]) as sdist:
        members = sdist.getnames()
    top = f"largebatch-{version}"
    for name in ("LICENSE", "CHANGELOG.md", "README.md", "src/largebatch/py.typed"):
        assert f"{top}/{name}" in members, name
    assert not [m for m in members if m.startswith(f"{top}/tests")], members


@pytest.mark.slow
def test_wheel_installs_alone_and_imports_both_facades(dists: dict[str, Path]) -> None:
    """The wheel installed into a folder of its own (no dependencies: torch and jax come
    from this environment) and imported from there, not from the source tree."""
    target = dists["tmp"] / "site"
    _run(
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "--no-compile",
        "--disable-pip-version-check",
        "--quiet",
        "--target",
        target,
        dists["wheel"],
        cwd=dists["tmp"],
    )
    probe = (
        "import importlib.metadata, largebatch, largebatch.torch, largebatch.jax\n"
        "print(largebatch.__file__)\n"
        "print(largebatch.torch.__file__)\n"
        "print(largebatch.jax.__file__)\n"
        "print(largebatch.__version__)\n"
        "print(importlib.metadata.version('largebatch'))\n"
        "print(largebatch.torch.LARS.__name__, largebatch.jax.lamb.__name__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)  # before site-packages, where an editable install points
    out = _run(sys.executable, "-c", probe, cwd=dists["tmp"], env=env).splitlines()
    for module in out[:3]:
        assert Path(module).resolve().is_relative_to(target.resolve()), (module, target)
    assert out[3] == out[4] == _version()
    assert out[5] == "LARS lamb"
    assert (target / "largebatch" / "py.typed").is_file()
