"""Every number of the steps studies in the docs, regenerated from the committed runs.

``python tools/study_docs.py`` (``make study-report``) does, for each study folder
``docs/study/steps-*``, what ``largebatch steps --report --out FOLDER`` does (steps.md,
steps.json and steps.png from its ``runs.jsonl`` and ``settings.json``), then rewrites the
blocks of the docs that quote them:

- docs/study.md, between ``<!-- steps-headline: FOLDER -->`` and
  ``<!-- /steps-headline -->``: the folder's brief (:func:`largebatch.study.steps.headline`);
  every folder must have one, and a folder without one is an error that names it;
- docs/study.md, after ``<!-- steps-compare: FOLDER ... -->``: the families table
  (:func:`largebatch.study.steps.compare`) of the folders the marker names, each study
  folder added to the marker in the order of the folders;
- README.md, after each ``<!-- steps-readings: FOLDER -->``: the lines of
  :func:`largebatch.study.steps.readings` that compare two optimizers.

``--quotes-only`` rewrites the blocks from the steps.json files as they are, without the
reports (a study still running holds its folder's lock, so its report is made from a copy
of its runs). ``--check`` writes nothing and exits 1 naming each block that differs.
``--running`` writes nothing and prints the folders whose study is not complete
(``make gpu-check`` continues the first of them on the GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STUDIES = "docs/study"
END_HEADLINE = "<!-- /steps-headline -->"
COMPARE = "<!-- steps-compare: "
END_COMPARE = "<!-- /steps-compare -->"
READINGS = "<!-- steps-readings: "
END_READINGS = "<!-- /steps-readings -->"


def folders(root: Path = ROOT) -> list[str]:
    """The study folders under ``root``, relative to it, sorted."""
    return sorted(str(f.relative_to(root)) for f in (root / STUDIES).glob("steps-*") if f.is_dir())


def load_summaries(root: Path = ROOT) -> dict[str, dict[str, Any]]:
    """Each study folder's steps.json under ``root``, by folder."""
    return {name: json.loads((root / name / "steps.json").read_text()) for name in folders(root)}


def running(summaries: Mapping[str, dict[str, Any]]) -> list[str]:
    """The folders of ``summaries`` (steps.json by folder) whose study has a point not
    finished, in their order."""
    return [name for name, summary in summaries.items() if not all(p["finished"] for p in summary["points"])]


def _between(text: str, start: str, end: str, block: str, where: str) -> str:
    """``text`` with what lies between the line ``start`` and the next ``end`` replaced by
    ``block``; a ValueError names ``where`` when ``start`` is not there."""
    if start not in text:
        raise ValueError(f"{where} has no {start.strip()!r}")
    i = text.index(start) + len(start)
    j = text.index(end, i)
    return text[:i] + block + text[j:]


def study_page(text: str, summaries: Mapping[str, dict[str, Any]]) -> str:
    """docs/study.md's ``text`` with every block quoting a study rewritten from
    ``summaries`` (steps.json by folder)."""
    from largebatch.study.steps import compare, headline

    for folder, summary in summaries.items():
        start = f"<!-- steps-headline: {folder} -->\n"
        text = _between(text, start, END_HEADLINE, headline(summary), "docs/study.md")
    if COMPARE not in text:
        raise ValueError(f"docs/study.md has no {COMPARE.strip()!r}")
    i = text.index(COMPARE)
    named = text[i + len(COMPARE) : text.index(" -->", i)].split()
    unknown = [f for f in named if f not in summaries]
    if unknown:
        raise ValueError(f"docs/study.md's families table names {', '.join(unknown)}, which holds no study")
    named += [f for f in summaries if f not in named]
    marker = COMPARE + " ".join(named) + " -->\n"
    j = text.index(END_COMPARE, i)
    return text[:i] + marker + compare([summaries[f] for f in named]) + text[j:]


def readme(text: str, summaries: Mapping[str, dict[str, Any]]) -> str:
    """README.md's ``text`` with each readings block rewritten from the summary of the
    folder its marker names."""
    from largebatch.study.steps import readings

    i = text.find(READINGS)
    while i >= 0:
        i += len(READINGS)
        folder = text[i : text.index(" -->", i)]
        if folder not in summaries:
            raise ValueError(f"README.md's readings name {folder}, which holds no study")
        lines = readings(summaries[folder])
        block = "".join(f"- {line}\n" for line in lines if "against itself" not in line)
        text = _between(text, f"{READINGS}{folder} -->\n", END_READINGS, block, "README.md")
        i = text.find(READINGS, i)
    return text


def report(folder: Path) -> None:
    """``largebatch steps --report --out folder``: the report from the folder's runs."""
    from largebatch.study.steps import recorded_config, run_steps_study

    run_steps_study(recorded_config(str(folder), report_only=True), print_fn=lambda _: None)


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    """Regenerate the reports and the docs' quotes of them; the exit status."""
    parser = argparse.ArgumentParser(prog="tools/study_docs.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quotes-only", action="store_true", help="rewrite the quotes only")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a quote differs")
    parser.add_argument(
        "--running", action="store_true", help="write nothing; print the folders whose study is not complete"
    )
    args = parser.parse_args(argv)
    if args.running:
        for name in running(load_summaries(root)):
            print(name)
        return 0
    names = folders(root)
    if not args.quotes_only and not args.check:
        from largebatch.outputs import CommandError

        for name in names:
            try:
                report(root / name)
            except (CommandError, ValueError) as err:
                print(f"tools/study_docs.py: {name}: {err}", file=sys.stderr)
                return 2
    quoted = load_summaries(root)
    pages: dict[str, tuple[str, str]] = {}
    for page, rewrite in (("docs/study.md", study_page), ("README.md", readme)):
        text = (root / page).read_text()
        try:
            pages[page] = (text, rewrite(text, quoted))
        except ValueError as err:
            print(f"tools/study_docs.py: {err}", file=sys.stderr)
            return 2
    stale = [page for page, (text, new) in pages.items() if new != text]
    if not args.check:
        for page in stale:
            (root / page).write_text(pages[page][1])
    if args.check and stale:
        print(f"tools/study_docs.py: {', '.join(stale)} quote(s) the studies otherwise", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
