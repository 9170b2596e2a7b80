"""deploy/grafana/asyncrl.json reads only names asyncrl exports (docs/metrics.md, which the scrape
test holds to what the services export), selects one run, and has the panels an operator needs."""

from __future__ import annotations

import re

from tests.metricsdoc import DOC, dashboard, dashboard_exprs, dashboard_families, documented, documented_type


def test_every_name_the_dashboard_reads_is_documented():
    families = dashboard_families()
    assert families, "no metric names found in the dashboard's queries"
    undocumented = {name for name in families if documented_type(name) is None}
    assert not undocumented, f"the dashboard reads names docs/metrics.md does not list: {undocumented}"


def test_histogram_quantiles_read_histograms_and_rates_read_counters():
    for expr in dashboard_exprs():
        for name in re.findall(r"histogram_quantile\([^,]+,\s*sum by \(le\) \(rate\(([a-z_:]+)_bucket", expr):
            assert documented_type(name) == "histogram", expr
        for name in re.findall(r"\brate\(([a-z_:]+)\{", expr):
            if not name.endswith("_bucket"):
                assert name.endswith("_total") and documented_type(name.removesuffix("_total")) == "counter", expr


def test_every_query_selects_the_run_variable():
    dash = dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert "run" in variables and "label_values(" in variables["run"]["definition"]
    for expr in dashboard_exprs():
        names = re.findall(r"\b(?:asyncrl_|sglang:|process_)[a-z0-9_:]*\{([^}]*)\}", expr)
        assert names and all('run=~"$run"' in selector for selector in names), expr


def test_the_panels_an_operator_needs():
    titles = " | ".join(p["title"].lower() for p in dashboard()["panels"])
    for word in ("reward", "staleness", "queue", "throughput", "latency", "pause"):
        assert word in titles, word
    families = dashboard_families()
    assert {"sglang:time_to_first_token_seconds", "sglang:e2e_request_latency_seconds",
            "asyncrl_weight_sync_pause_seconds", "asyncrl_rollout_fully_async_queue_size"} <= families  # fmt: skip


def test_the_doc_lists_names_once_with_one_type():
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| `")]
    names = [row.split("`")[1] for row in rows]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    assert all(name.endswith("_total") == (kind == "counter") for name, kind in documented().items())
