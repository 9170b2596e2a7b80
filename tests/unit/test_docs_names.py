"""The docs name code that exists: every file path, module, `Class.member`, private name and
`function()` written in backticks in docs/*.md must be found in the source (read with ast, no
import). A rename or a deletion that leaves a page describing what is gone fails here, as
tests/unit/test_imports.py does for the import rules."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
SOURCE_DIRS = ("services", "proto", "bench", "tests")
PATH_ROOTS = (ROOT, ROOT / "services", ROOT / "docs", ROOT / "deploy")

_PATH = re.compile(r"^[\w.-]+(/[\w.<>*-]+)*\.(py|yaml|yml|json|toml|md|conf|jsonl)$")
_MEMBER = re.compile(r"^([A-Z][A-Za-z0-9]+)\.([A-Za-z_][A-Za-z0-9_]*)(\(\))?$")
_PRIVATE = re.compile(r"^(_[a-z][a-z0-9_]*)(\(\))?$")
_CALL = re.compile(r"^([a-z][a-z0-9_]*)\(\)$")
_MODULE = re.compile(r"^((?:services|asyncrl_proto)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(\(\))?$")


class Index:
    """Every module, class (with its members and bases) and function name of the source."""

    def __init__(self):
        self.modules: dict[str, dict[str, set[str]]] = {}  # dotted -> {"names": top-level names}
        self.classes: dict[str, set[str]] = defaultdict(set)
        self.bases: dict[str, set[str]] = defaultdict(set)
        self.functions: set[str] = set()
        self.attributes: set[str] = set()
        for top in SOURCE_DIRS:
            for path in (ROOT / top).rglob("*.py"):
                self._read(path)

    def _read(self, path: Path) -> None:
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[0] == "proto":
            parts[0] = "asyncrl_proto"
        if parts[-1] == "__init__":
            parts = parts[:-1]
        tree = ast.parse(path.read_text(), str(path))
        top = set()
        for node in tree.body:
            for name in _defined(node):
                top.add(name)
        self.modules[".".join(parts)] = {"names": top}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.add(node.name)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    self.classes[node.name].update(_defined(item))
                self.classes[node.name].add("__init__")
                self.bases[node.name].update(b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                self.attributes.add(node.attr)
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    pass

    def members(self, cls: str, seen: frozenset = frozenset()) -> set[str]:
        out = set(self.classes.get(cls, ()))
        for base in self.bases.get(cls, ()):
            if base and base not in seen:
                out |= self.members(base, seen | {cls})
        return out

    def has_member(self, cls: str, name: str) -> bool:
        # instance attributes set in methods (self.x = ...) count as members of some class
        return name in self.members(cls) or name in self.attributes

    def resolve(self, dotted: str) -> bool:
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            mod = ".".join(parts[:cut])
            if mod in self.modules:
                rest = parts[cut:]
                if not rest:
                    return True
                if rest[0] not in self.modules[mod]["names"]:
                    return False
                return len(rest) == 1 or (rest[0] in self.classes and self.has_member(rest[0], rest[1]))
        return False


def _defined(node) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    return []


def inline_code(text: str) -> list[tuple[int, str]]:
    """(line number, span) of every inline code span outside fenced blocks."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out += [(i, m.group(1).strip()) for m in re.finditer(r"`([^`]+)`", line)]
    return out


OTHER_SYSTEMS = {
    "_total", "_count", "rate()", "increase()",  # Prometheus: metric suffixes and PromQL
    "_truncated_ratio", "_none_reward_ratio", "_weight_version_mixed_version_ratio",  # Miles's metric suffixes
    "drain()",  # nats-py
    "update_weights()",  # Miles's trainer
    "python/sglang/srt/metrics/collector.py",  # SGLang's source
}
"""Names of other systems that the docs quote in backticks (not ours to exist)."""


def problem(index: Index, span: str) -> str | None:
    if span in OTHER_SYSTEMS:
        return None
    if _PATH.match(span) and "/" in span and "<" not in span and "*" not in span:
        if not any((base / span).exists() for base in PATH_ROOTS):
            return "no such file"
    elif m := _MODULE.match(span):
        if not index.resolve(m.group(1)):
            return "no such module or name"
    elif m := _MEMBER.match(span):
        cls, name = m.group(1), m.group(2)
        if cls in index.classes and not index.has_member(cls, name):
            return f"{cls} has no {name}"
    elif m := _PRIVATE.match(span):
        if m.group(1) not in index.functions | index.attributes | index.all_names():
            return "no such name"
    elif m := _CALL.match(span):
        if m.group(1) not in index.functions:
            return "no such function"
    return None


def _all_names(self) -> set[str]:
    names = set()
    for mod in self.modules.values():
        names |= mod["names"]
    for members in self.classes.values():
        names |= members
    return names


Index.all_names = _all_names


def test_every_name_in_the_docs_exists():
    index = Index()
    missing = []
    for doc in DOCS:
        for line, span in inline_code(doc.read_text()):
            if (why := problem(index, span)) is not None:
                missing.append(f"docs/{doc.name}:{line}: `{span}`: {why}")
    assert not missing, "names in the docs that the code no longer has:\n" + "\n".join(missing)


def test_the_guard_catches_a_stale_name():
    """The four names docs/architecture.md once held after they were gone."""
    index = Index()
    for stale in ("BufferService._release_prompts", "_consume_rollouts", "services/buffer/gone.py",
                  "services.buffer.machine.nothing_here", "vanished_function()"):  # fmt: skip
        assert problem(index, stale) is not None, stale
    for real in ("BufferMachine.plan_release", "services/buffer/machine.py", "buffer/machine.py",
                 "services.buffer.policy.release_allowance", "_put_one", "release_allowance()"):  # fmt: skip
        assert problem(index, real) is None, real
