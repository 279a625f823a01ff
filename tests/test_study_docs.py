"""``make study-report`` (tools/study_docs.py): the committed reports and every quote of
them in docs/study.md and the README regenerate from the committed runs."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import study_docs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PAGES = ("docs/study.md", "README.md")


def _stale(text: str) -> str:
    """``text`` with every quoted block emptied to one line and the families table's
    marker naming only its first folder."""
    for end in (study_docs.END_HEADLINE, study_docs.END_COMPARE, study_docs.END_READINGS):
        opening = end.replace("<!-- /", "<!-- ").replace(" -->", ": ")
        text = re.sub(
            f"({re.escape(opening)}[^\\n]*\\n)(.*?)({re.escape(end)})", r"\1stale\n\3", text, flags=re.S
        )
    return re.sub(r"(<!-- steps-compare: \S+)[^>]*-->", r"\1 -->", text)


def _copy(root: Path, files: tuple[str, ...]) -> None:
    """The pages, made stale, and ``files`` of each committed study, under ``root``."""
    for name in study_docs.folders():
        (root / name).mkdir(parents=True)
        for file in files:
            shutil.copy(ROOT / name / file, root / name / file)
    for page in PAGES:
        (root / page).parent.mkdir(parents=True, exist_ok=True)
        stale = _stale((ROOT / page).read_text())
        assert stale != (ROOT / page).read_text(), page
        (root / page).write_text(stale)


def test_the_committed_pages_quote_every_committed_study_as_it_stands():
    """docs/study.md quotes each committed study's brief and tables every one of them side
    by side; the README's readings are the pair lines of the study it names: the pages are
    what the tool writes from the committed steps.json."""
    summaries = study_docs.load_summaries()
    assert "docs/study/steps-fmnist-cnn" in summaries
    for page, rewrite in (("docs/study.md", study_docs.study_page), ("README.md", study_docs.readme)):
        text = (ROOT / page).read_text()
        assert rewrite(text, summaries) == text, f"{page} is stale: make study-report"


def test_one_command_regenerates_every_committed_number(tmp_path):
    """From the committed runs and settings alone, with every quote in the pages stale:
    each folder's steps.json and steps.md come back as committed, and so do the pages."""
    _copy(tmp_path, ("runs.jsonl", "settings.json"))
    assert study_docs.main([], root=tmp_path) == 0
    for name in study_docs.folders():
        ours, committed = (json.loads((r / name / "steps.json").read_text()) for r in (tmp_path, ROOT))
        _assert_same(ours, committed, name)
        assert (tmp_path / name / "steps.md").read_text() == (ROOT / name / "steps.md").read_text(), name
        # the plot where the committed report has one (a study without steps to a target yet has none)
        plot = tmp_path / name / "steps.png"
        assert plot.exists() == (ROOT / name / "steps.png").exists(), name
        assert not plot.exists() or plot.stat().st_size > 0
    for page in PAGES:
        assert (tmp_path / page).read_text() == (ROOT / page).read_text(), page


def test_check_names_the_stale_pages_and_writes_nothing(tmp_path, capsys):
    _copy(tmp_path, ("steps.json",))
    before = {page: (tmp_path / page).read_text() for page in PAGES}
    assert study_docs.main(["--check"], root=tmp_path) == 1
    assert (
        capsys.readouterr().err
        == "tools/study_docs.py: docs/study.md, README.md quote(s) the studies otherwise\n"
    )
    assert {page: (tmp_path / page).read_text() for page in PAGES} == before
    assert study_docs.main(["--quotes-only"], root=tmp_path) == 0
    assert study_docs.main(["--check"], root=tmp_path) == 0
    for page in PAGES:
        assert (tmp_path / page).read_text() == (ROOT / page).read_text(), page


def test_a_study_the_page_does_not_quote_is_named(tmp_path, capsys):
    """A committed study without its block in docs/study.md is one line naming it, exit 2,
    and no page is written."""
    _copy(tmp_path, ("steps.json",))
    name = study_docs.folders()[-1]
    page = tmp_path / "docs" / "study.md"
    page.write_text(page.read_text().replace(f"<!-- steps-headline: {name} -->", ""))
    before = page.read_text()
    assert study_docs.main(["--quotes-only"], root=tmp_path) == 2
    assert (
        capsys.readouterr().err
        == f"tools/study_docs.py: docs/study.md has no '<!-- steps-headline: {name} -->'\n"
    )
    assert page.read_text() == before


def test_a_folder_the_families_table_names_must_hold_a_study(tmp_path):
    summaries = study_docs.load_summaries()
    text = (
        (ROOT / "docs" / "study.md")
        .read_text()
        .replace("<!-- steps-compare: ", "<!-- steps-compare: docs/study/steps-x ")
    )
    with pytest.raises(ValueError, match="names docs/study/steps-x, which holds no study"):
        study_docs.study_page(text, summaries)


def test_running_prints_the_studies_not_complete_and_writes_nothing(tmp_path, capsys):
    """``--running`` (which study ``make gpu-check`` continues) names each folder with a
    point not finished, in the folders' order, and only those."""
    complete = json.loads((ROOT / "docs/study/steps-fmnist-cnn/steps.json").read_text())
    assert all(p["finished"] for p in complete["points"])
    unfinished = json.loads(json.dumps(complete))
    unfinished["points"][-1]["finished"] = False
    for name, summary in (("a", complete), ("b", unfinished), ("c", complete), ("d", unfinished)):
        (tmp_path / f"docs/study/steps-{name}").mkdir(parents=True)
        (tmp_path / f"docs/study/steps-{name}/steps.json").write_text(json.dumps(summary))
    assert study_docs.main(["--running"], root=tmp_path) == 0
    assert capsys.readouterr().out == "docs/study/steps-b\ndocs/study/steps-d\n"
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["steps.json"] * 4


def _assert_same(a, b, where="summary"):
    """``a == b``, floats to 1e-12 relative: NumPy's vector exp and log may round the last
    bit differently on another CPU, and the fits and their bootstrap use them (the fit's
    bisection on the slope keeps that to a few units in the last place)."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-12), where
    else:
        assert a == b, where
