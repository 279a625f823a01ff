"""The documentation site builds with ``mkdocs build --strict`` (``make docs``).

Strict mode turns every warning into a failure: a broken link or anchor between the
pages, and every griffe warning about a docstring (a parameter documented under a name
that is not in the signature, ...). The API pages must render the facades' re-exported
names.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
pytest.importorskip("mkdocstrings", reason="the docs extra is not installed")
pytest.importorskip("material", reason="the docs extra (mkdocs-material) is not installed")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """Build the site once, strictly, into a temporary directory."""
    site_dir = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # mkdocs-material's banner on stderr
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--clean",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(site_dir),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, site_dir


@pytest.fixture(scope="module")
def site(build: tuple[subprocess.CompletedProcess, Path]) -> Path:
    """The built site; strict mode still writes every page before it aborts on warnings."""
    proc, site_dir = build
    if not (site_dir / "index.html").is_file():
        pytest.fail(f"mkdocs wrote no site (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return site_dir


@pytest.mark.slow
def test_site_builds_strict(build: tuple[subprocess.CompletedProcess, Path]) -> None:
    proc, site_dir = build
    output = proc.stdout + proc.stderr
    warnings = [line for line in output.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert proc.returncode == 0 and not warnings, (
        f"mkdocs build --strict failed (exit {proc.returncode}); its warnings:\n"
        + "\n".join(warnings)
        + f"\n\nfull output:\n{output}"
    )
    for page in (
        "index.html",
        "torch/index.html",
        "jax/index.html",
        "mixed_precision/index.html",
        "recipes/index.html",
        "study/index.html",
        "benchmarks/index.html",
    ):
        assert (site_dir / page).is_file(), page
    # study.md links its data files; they are copied, though not in the nav.
    assert (site_dir / "study" / "headline" / "runs.jsonl").is_file()


@pytest.mark.slow  # reads the site the build fixture makes in a subprocess
def test_math_is_mathml_without_the_network(site: Path) -> None:
    """The pages' equations are MathML in the HTML (tools/mkdocs_math.py), drawn by the
    browser itself: no page loads a script from elsewhere, no TeX is left to render."""
    page = (site / "torch" / "index.html").read_text(encoding="utf-8")
    assert page.count('<math xmlns="http://www.w3.org/1998/Math/MathML" display="block">') == 2
    assert 'class="arithmatex"' not in page and "\\lVert" not in page
    for html_file in site.rglob("*.html"):
        text = html_file.read_text(encoding="utf-8")
        assert '<script src="http' not in text and "cdn.jsdelivr" not in text, html_file


def test_math_hook_converts_arithmatex_output() -> None:
    """Both of arithmatex's generic forms become MathML, the escaped TeX read as TeX."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from mkdocs_math import math_to_mathml
    finally:
        sys.path.remove(str(ROOT / "tools"))
    page = (
        '<p>a <span class="arithmatex">\\(x &lt; y\\)</span> b</p>\n'
        '<div class="arithmatex">\\[\n\\frac{a}{b}\n\\]</div>'
    )
    out = math_to_mathml(page)
    assert out.startswith("<p>a <math") and 'display="inline"' in out
    assert "<mo>&#x0003C;</mo>" in out  # the escaped "<" read as TeX's less-than
    assert '<math xmlns="http://www.w3.org/1998/Math/MathML" display="block"><mrow><mfrac>' in out
    assert "arithmatex" not in out and "\\frac" not in out


@pytest.mark.slow  # reads the site the build fixture makes in a subprocess
@pytest.mark.parametrize(
    ("page", "names"),
    [
        (
            "api/torch",
            [
                "LARS",
                "LAMB",
                "lars",
                "lamb",
                "param_groups",
                "make_schedule",
                "ScheduleLR",
                "linear_scaling",
                "sqrt_scaling",
                "to_half",
                "AdaCompState",
                "adacomp_hook",
            ],
        ),
        (
            "api/jax",
            [
                "lars",
                "lamb",
                "exclusion_mask",
                "make_schedule",
                "as_optax_schedule",
                "DynamicLossScale",
                "AdaCompState",
                "adacomp",
            ],
        ),
        ("api/schedules", ["Schedule", "make_schedule", "linear_scaling", "sqrt_scaling"]),
        ("api/spec", []),
        ("api/comm", []),
        ("api/integrations", []),
    ],
)
def test_api_pages_render_the_names(site: Path, page: str, names: list[str]) -> None:
    html = (site / page / "index.html").read_text(encoding="utf-8")
    module = {
        "api/torch": "largebatch.torch",
        "api/jax": "largebatch.jax",
        "api/schedules": "largebatch.schedules",
    }.get(page)
    for name in names:
        # each name gets its own heading, anchored at its path in the facade
        assert f'id="{module}.{name}"' in html, f"{page}: {name} is not rendered"
    if page == "api/torch":
        assert "trust_coefficient" in html  # a parameter, from LARS's signature/docstring
        # inherited members a user relies on are shown; the internals are not
        for cls in ("LARS", "LAMB"):
            for member in ("num_steps", "load_state_dict", "state_dict"):
                assert f'id="{module}.{cls}.{member}"' in html, (cls, member)
            for member in ("spec", "bodies"):
                assert f'id="{module}.{cls}.{member}"' not in html, (cls, member)
    if page == "api/comm":
        for name in (
            "reference.compress",
            "torch.AdaCompState",
            "torch.adacomp_hook",
            "jax.adacomp",
            "jax.adacomp_init_state",
            "scaling.predict",
            "costs.choose_form",
            "costs.Network",
        ):
            assert f'id="largebatch.comm.{name}"' in html, f"{page}: {name} is not rendered"
        # the cost formulas, which scaling imports, are shown once: under costs
        for name in ("choose_form", "Network", "ring"):
            assert f'id="largebatch.comm.scaling.{name}"' not in html, name
    if page == "api/integrations":
        for name in (
            "make_optimizer",
            "timm.register",
            "huggingface.trainer_optimizers",
            "lightning.TrustRatioCallback",
        ):
            assert f'id="largebatch.integrations.{name}"' in html, f"{page}: {name} is not rendered"
    if page == "api/spec":
        assert 'id="largebatch.lars.spec"' in html
        assert 'id="largebatch.lars.reference"' in html
        assert 'id="largebatch.lars.reference.lars_step"' in html
