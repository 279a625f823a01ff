"""The documentation's math as MathML, written into the pages when the site is built.

``pymdownx.arithmatex`` (generic output) wraps each ``$$...$$`` block and each ``$...$``
span of a page in an element of class ``arithmatex`` holding its TeX. This mkdocs hook
turns those into MathML with ``latex2mathml``, which every current browser draws
natively: the site shows its equations without a script and without the network.
mkdocs loads it through ``hooks:`` in mkdocs.yml.
"""

from __future__ import annotations

import html
import re
from typing import Any

from latex2mathml.converter import convert

__all__ = ["math_to_mathml", "on_page_content"]

# arithmatex's generic output: a block is <div class="arithmatex">\[ TeX \]</div>, an inline
# span <span class="arithmatex">\( TeX \)</span>; the TeX inside is HTML-escaped.
_MATH = re.compile(
    r'<(?P<tag>div|span) class="arithmatex">\s*\\(?P<open>[\[(])(?P<tex>.*?)\\[\])]\s*</(?P=tag)>',
    re.DOTALL,
)


def _mathml(match: re.Match[str]) -> str:
    display = "block" if match["open"] == "[" else "inline"
    return convert(html.unescape(match["tex"]).strip(), display=display)


def math_to_mathml(page_html: str) -> str:
    """``page_html`` with every arithmatex element replaced by its MathML."""
    return _MATH.sub(_mathml, page_html)


def on_page_content(html: str, **kwargs: Any) -> str:
    """The mkdocs event: a page's HTML after its Markdown is rendered."""
    return math_to_mathml(html)
