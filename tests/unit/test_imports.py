"""The rooms of the house, as imports: a service imports only the message contract
(`asyncrl_proto`), the shared library packages and its own modules; the libraries import nothing
of a service; only the bus imports nats-py; and no module imports itself back through others
(imports inside functions count).

Read from the source (ast), so a lazy import cannot hide a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("adapters", "buffer", "engine", "eval", "rollout", "trainer", "weightsync")
ALLOWED = {
    # package: the packages of `services` it may import besides itself
    "common": set(),
    "data": {"common"},
    "rewards": {"common"},
    "weights": {"common"},
    "model": {"common"},
    "envs": {"common", "rewards"},
    "tasks": {"common", "model", "envs", "data", "rewards"},
    **{s: {"common", "model", "envs", "data", "rewards", "weights"} for s in SERVICES},
    "dashboard": {"common", "buffer"},  # a run read: its files, and its ledger through the buffer's fold
}
"""The top-level modules (launcher, cli, audit, prepare, supervisor, api) compose the services."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "services").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    for path in sorted((ROOT / "proto").glob("*.py")):
        name = "asyncrl_proto" if path.stem == "__init__" else f"asyncrl_proto.{path.stem}"
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The first-party modules `name` imports, anywhere in its body."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod when there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _package(module: str) -> str | None:
    """The package of `services` a module belongs to; None for the top-level ones and the proto."""
    parts = module.split(".")
    if parts[0] != "services" or len(parts) < 2 or parts[1] not in ALLOWED:
        return None
    return parts[1]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_contract_the_libraries_and_itself(package):
    wrong = []
    for module, targets in GRAPH.items():
        if _package(module) != package:
            continue
        for target in targets:
            if target.startswith("asyncrl_proto"):
                continue
            owner = _package(target)
            if owner != package and owner not in ALLOWED[package]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_contract_imports_nothing_of_the_services():
    wrong = [f"{m} imports {t}" for m, ts in GRAPH.items() if m.startswith("asyncrl_proto") for t in ts
             if t.startswith("services")]  # fmt: skip
    assert not wrong, wrong


def test_only_the_bus_touches_nats_py():
    """The bus package (services/common/bus/) is the one door to NATS: publish, consume, request,
    KV, stream reads."""
    users = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n == "nats" or n.startswith("nats.") for n in names):
                users.append(module)
    outside = sorted({m for m in users if not m.startswith("services.common.bus.")})
    assert users and not outside, outside


def test_no_import_circles():
    circles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(GRAPH[module]):
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(circles)


def test_the_guard_sees_what_it_guards():
    """The graph is read right: known edges are there (or every test above could pass on nothing)."""
    assert "services.common.plugins" in GRAPH["services.rewards"]
    assert "services.trainer.setup" in GRAPH["services.trainer.worker"]  # an import inside a function
    assert "asyncrl_proto" in GRAPH["services.buffer.service"]
    assert {_package(m) for m in GRAPH} >= set(ALLOWED)


LAUNCH_STEPS = ("services.launcher", "services.prepare", "services.raycluster", "services.supervisor", "services.audit")
"""Start-up, top to bottom: the launcher runs the steps (prepare the run, start NATS and the
services, place them on Ray nodes, supervise them, audit the ledger for the report); a step imports
only the steps below it, never one above."""


def test_start_up_imports_only_downward():
    wrong = []
    for i, module in enumerate(LAUNCH_STEPS):
        above = set(LAUNCH_STEPS[: i + 1]) - {module}
        wrong += [f"{module} imports {t}, a step above it" for t in GRAPH[module] & above]
        # and nothing above the steps: the CLI and the audit use the launcher, never the reverse
        wrong += [f"{module} imports {t}" for t in GRAPH[module] if t in ("services.cli", "services.console")]
    assert not wrong, "\n".join(wrong)
    assert {"services.prepare", "services.supervisor", "services.raycluster", "services.audit"} <= GRAPH[
        "services.launcher"
    ]
