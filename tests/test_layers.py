"""The package's import graph: no circles, and imports go downwards only.

Every module of ``src/largebatch`` is parsed (``ast``; imports at module level and inside
functions, relative ones resolved) into a graph of modules. The layers are read from
docs/design.md §1, the one place they are stated: a module imports only from its own
layer or the layers below it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DESIGN = ROOT / "docs" / "design.md"
PACKAGE = "largebatch"


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    found = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def owner(name: str, modules: set[str]) -> str | None:
    """The module ``name`` denotes: itself, or the closest enclosing module that exists
    (``largebatch.lars.torch.LARS`` -> ``largebatch.lars.torch``); None outside the package."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``name`` (at ``path``) imports, anywhere in its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name``, mod
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        for target in targets:
            module = owner(target, modules)
            if module is not None and module != name:
                found.add(module)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def design_layers() -> list[list[str]]:
    """docs/design.md §1's table of layers, top first: the code block whose lines each name
    modules (relative to ``largebatch``, comma-separated) before their description."""
    section = DESIGN.read_text().split("\n## 1. Layers\n", 1)[1].split("\n## ", 1)[0]
    for block in re.findall(r"```[a-z]*\n(.*?)```", section, flags=re.S):
        lines = [line for line in block.splitlines() if line.strip()]
        if lines and lines[0].split()[0].rstrip(",") == "cli":
            return [
                [name.strip() for name in re.split(r"\s{2,}", line.strip())[0].split(",")] for line in lines
            ]
    raise AssertionError("docs/design.md §1 has no table of layers (a code block starting with cli)")


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """The index (0: top) of the layer holding ``module`` or a package above it."""
    best, best_len = None, -1
    for i, layer in enumerate(layers):
        for entry in layer:
            full = f"{PACKAGE}.{entry}"
            if (module == full or module.startswith(full + ".")) and len(full) > best_len:
                best, best_len = i, len(full)
    return best


def upward_imports(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    """Each import of a module from a layer above its own, as ``importer -> imported``."""
    return [
        f"{a} (layer {layer_of(a, layers)}) -> {b} (layer {layer_of(b, layers)})"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        if b != PACKAGE and layer_of(b, layers) < layer_of(a, layers)
    ]


# --------------------------------------------------------------------------- the checks


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "import circles between modules: " + "; ".join(" <-> ".join(c) for c in found)


def test_every_module_has_a_layer():
    layers = design_layers()
    missing = [m for m in module_files() if m != PACKAGE and layer_of(m, layers) is None]
    assert not missing, f"modules in no layer of docs/design.md §1: {missing}"


def test_imports_go_downwards_only():
    wrong = upward_imports(import_graph(), design_layers())
    assert not wrong, "imports from a higher layer (docs/design.md §1):\n" + "\n".join(wrong)


def test_the_cli_is_the_top_and_nothing_imports_it():
    layers = design_layers()
    assert layers[0] == ["cli", "__main__"]
    importers = [
        a
        for a, targets in import_graph().items()
        if layer_of(a, layers) != 0 and any(layer_of(b, layers) == 0 for b in targets)
    ]
    assert not importers


def test_the_package_root_imports_nothing():
    assert import_graph()[PACKAGE] == set()


def test_the_design_tree_names_every_top_level_room():
    """§1's tree and its table of layers name the same top-level modules and packages."""
    section = DESIGN.read_text().split("\n## 1. Layers\n", 1)[1].split("\n## ", 1)[0]
    tree = re.search(r"```\nlargebatch/\n(.*?)```", section, flags=re.S).group(1)
    named = {
        n.strip().removesuffix(".py").rstrip("/")
        for line in tree.splitlines()
        if re.match(r"  \S", line)
        for n in re.split(r"\s{2,}", line.strip())[0].split(",")
    }
    tabled = {entry for layer in design_layers() for entry in layer}
    assert named == tabled
    top = {
        p.stem if p.suffix else p.name
        for p in (SRC / PACKAGE).iterdir()
        if p.name != "__init__.py" and p.name != "__pycache__" and (p.suffix == ".py" or p.is_dir())
    }
    assert top == tabled


@pytest.mark.parametrize("module", ["largebatch", "largebatch.cli"])
def test_importing_loads_no_framework(module):
    code = f"import sys, {module}; print([m for m in ('torch', 'jax') if m in sys.modules])"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]", f"import {module} loads {run.stdout.strip()}"


# --------------------------------------------------------------------------- the checker


def test_the_checker_sees_an_upward_import_and_a_circle(tmp_path):
    """The checks above can fail: an import of the study from lars, and a circle."""
    layers = design_layers()
    graph = {"largebatch.lars.spec": {"largebatch.study.plan"}, "largebatch.study.plan": set()}
    wrong = upward_imports(graph, layers)
    assert len(wrong) == 1 and wrong[0].startswith("largebatch.lars.spec (layer")
    assert upward_imports({"largebatch.study.plan": {"largebatch.lars.spec"}}, layers) == []
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from ..study import plan\n    import largebatch.cli\n")
    names = {"largebatch.lars.spec", "largebatch.study", "largebatch.study.plan", "largebatch.cli"}
    assert imports_of("largebatch.lars.spec", bad, names) == {"largebatch.study.plan", "largebatch.cli"}
