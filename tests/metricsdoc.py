"""docs/metrics.md as data (every name asyncrl exports on /metrics, with its type) and the metric
names a Grafana dashboard's queries use; shared by the dashboard's unit test and the scrape test."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "metrics.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "asyncrl.json"

_ROW = re.compile(r"^\|\s*`([a-z_:<>0-9]+)`\s*\|\s*(counter|gauge|histogram)\s*\|")
_NAME = re.compile(r"\b((?:asyncrl|process)_[a-z0-9_]+|sglang:[a-z0-9_]+)")


def documented() -> dict[str, str]:
    """{name as documented: type}; a name may hold a <placeholder> (one run's dataset, a reason)."""
    out = {}
    for line in DOC.read_text().splitlines():
        if m := _ROW.match(line):
            out[m.group(1)] = m.group(2)
    return out


def family_name(name: str, kind: str) -> str:
    """The family a parser (prometheus_client.parser) reports: a counter's without `_total`."""
    return name.removesuffix("_total") if kind == "counter" else name


def documented_type(family: str) -> str | None:
    """The documented type of a parsed family name, or None: a name listed as it is first, then
    names with placeholders (which match any name part)."""
    names = documented()
    exact = {family_name(name, kind): kind for name, kind in names.items() if "<" not in name}
    if family in exact:
        return exact[family]
    for name, kind in names.items():
        if "<" in name and re.fullmatch(re.sub(r"<[a-z_]+>", "[a-z0-9_]+", family_name(name, kind)), family):
            return kind
    return None


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def dashboard_families() -> set[str]:
    """The families the dashboard's queries read: a histogram's _bucket/_sum/_count and a
    counter's _total name their family."""
    out = set()
    for expr in dashboard_exprs():
        for name in _NAME.findall(expr):
            for suffix in ("_bucket", "_sum", "_count", "_total"):
                if name.endswith(suffix) and documented_type(name.removesuffix(suffix)) is not None:
                    name = name.removesuffix(suffix)
                    break
            out.add(name)
    return out
