"""The house rules that CI keeps: the size caps of the code and of the architecture page, and no
citation of a file the project does not ship.

Caps, over every .py file under services/ and proto/ (read with ast, no import):
- a module holds at most MAX_MODULE_LINES lines;
- a class holds at most MAX_CLASS_METHODS methods (def / async def directly in its body);
- a function or method spans at most MAX_FUNCTION_LINES lines (end_lineno - lineno + 1);
and docs/architecture.md holds at most MAX_ARCHITECTURE_LINES lines.

A broken cap is fixed with a seam: the class, module or function split along one of its
responsibilities. There is no exemption list, and this module keeps none."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("services", "proto")
MAX_MODULE_LINES = 600
MAX_CLASS_METHODS = 35
MAX_FUNCTION_LINES = 100
MAX_ARCHITECTURE_LINES = 350
ARCHITECTURE = "docs/architecture.md"

UNSHIPPED = ("SPEC" + ".md", "DESIGN" + ".md")
"""Files the repository does not ship, so no shipped file may cite them (built here from parts, so
that this file does not name them itself)."""

SEAM = (
    "The fix is a seam: split the module, class or function along one of its responsibilities (a "
    "helper class it delegates to, a module of its own, one function per step or per route group), "
    "keeping its behaviour. Not an exemption list: this test keeps none, and none is to be added."
)


def offenders_in(source: str, path: str) -> list[str]:
    """'path: what name, size' for every cap the module `source` breaks."""
    out = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        out.append(f"{path}: module, {lines} lines (cap {MAX_MODULE_LINES})")
    tree = ast.parse(source, path)

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = prefix + child.name
                methods = sum(isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef)) for x in child.body)
                if methods > MAX_CLASS_METHODS:
                    out.append(f"{path}: class {name}, {methods} methods (cap {MAX_CLASS_METHODS})")
                visit(child, name + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                span = child.end_lineno - child.lineno + 1
                if span > MAX_FUNCTION_LINES:
                    out.append(f"{path}: function {name}, {span} lines (cap {MAX_FUNCTION_LINES})")
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def test_the_code_keeps_the_caps():
    found = []
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            found += offenders_in(path.read_text(), path.relative_to(ROOT).as_posix())
    lines = len((ROOT / ARCHITECTURE).read_text().splitlines())
    if lines > MAX_ARCHITECTURE_LINES:
        found.append(f"{ARCHITECTURE}: page, {lines} lines (cap {MAX_ARCHITECTURE_LINES}; move a section to a page "
                     "of its own and link it)")  # fmt: skip
    assert not found, "over the house caps:\n  " + "\n  ".join(found) + "\n" + SEAM


def test_the_guard_catches_each_cap():
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    methods = "\n".join(f"    def m{i}(self):\n        pass" for i in range(MAX_CLASS_METHODS + 1))
    source = f"def long():\n{long_body}\n\n\nclass Wide:\n{methods}\n"
    found = offenders_in(source, "x.py")
    assert f"x.py: function long, {MAX_FUNCTION_LINES + 1} lines (cap {MAX_FUNCTION_LINES})" in found
    assert f"x.py: class Wide, {MAX_CLASS_METHODS + 1} methods (cap {MAX_CLASS_METHODS})" in found
    nested = "class Outer:\n    class Inner:\n" + "\n".join(
        f"        def m{i}(self):\n            pass" for i in range(MAX_CLASS_METHODS + 1)
    )
    assert any("class Outer.Inner," in f for f in offenders_in(nested, "y.py"))
    assert offenders_in("\n" * (MAX_MODULE_LINES + 1), "z.py") == [
        f"z.py: module, {MAX_MODULE_LINES + 1} lines (cap {MAX_MODULE_LINES})"
    ]
    assert offenders_in("def short():\n    return 1\n", "ok.py") == []


def _shipped() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout: the shipped files are what git tracks")
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_no_shipped_file_cites_a_file_that_does_not_ship():
    found = []
    for path in _shipped():
        if not path.is_file():  # deleted in the work tree, or a submodule
            continue
        data = path.read_bytes()
        for name in UNSHIPPED:
            if name.encode() not in data:
                continue
            for i, line in enumerate(data.splitlines(), 1):
                if name.encode() in line:
                    found.append(f"{path.relative_to(ROOT).as_posix()}:{i}: {name}")
    assert not found, (
        "citations of files the project does not ship (cite the page of docs/ that documents the "
        "thing, or the Miles documentation by name, or drop the citation):\n  " + "\n  ".join(found)
    )
