"""A short fully async run scraped while it trains: every service's and the engine's /metrics
parse as Prometheus text with the right types (no `_total` gauge, histograms with buckets), the
labels run/service/instance on every sample, process_* metrics, one meaning per name across
services, every name documented in docs/metrics.md, and every name the Grafana dashboard reads."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.metricsdoc import dashboard_families, documented_type

HISTOGRAMS = {
    "buffer": {"asyncrl_buffer_get_wait_seconds"},
    "trainer": {"asyncrl_trainer_step_seconds", "asyncrl_trainer_rollout_wait_seconds"},
    "weight-sync": {"asyncrl_weight_sync_pause_seconds", "asyncrl_weight_sync_update_seconds"},
    "engine": {"sglang:time_to_first_token_seconds", "sglang:e2e_request_latency_seconds", "sglang:queue_time_seconds"},
}
"""The histograms each service must export, each observed at least once a few steps in."""
SHARED = ("process_",)
"""Name prefixes every process exports with one meaning (the process it labels)."""
DEADLINE_S = 120.0


def service_of(label: str) -> str:
    """The launcher's label of a child (rollout-0, engine-1) -> its service (rollout, engine)."""
    return label.rsplit("-", 1)[0] if label.rsplit("-", 1)[-1].isdigit() else label


def scrape(http: httpx.Client, services: dict[str, str]) -> dict[str, dict]:
    return {label: {f.name: f for f in text_string_to_metric_families(http.get(url + "/metrics").text)}
            for label, url in services.items()}  # fmt: skip


def observed(fams: dict, name: str) -> bool:
    fam = fams.get(name)
    return fam is not None and any(s.name == name + "_count" and s.value > 0 for s in fam.samples)


def scrape_mid_run(run_dir: Path, proc: subprocess.Popen) -> tuple[str, dict[str, str], dict[str, dict]]:
    """Poll every /metrics until each service's histograms have observations (a few steps in)."""
    deadline = time.monotonic() + DEADLINE_S
    while not (run_dir / "services.json").exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "services never came up"
        time.sleep(0.1)
    services = json.loads((run_dir / "services.json").read_text())
    services.pop("dashboard", None)  # the run's dashboard shows these metrics; it exports none of its own
    run_id = json.loads((run_dir / "config.json").read_text())["run_id"]
    with httpx.Client(timeout=5) as http:
        while True:
            assert proc.poll() is None, "the run ended before every histogram was observed:\n" + proc.stdout.read()
            scrapes = scrape(http, services)
            missing = {(label, name) for label, fams in scrapes.items()
                       for name in HISTOGRAMS.get(service_of(label), ()) if not observed(fams, name)}  # fmt: skip
            if not missing:
                return run_id, services, scrapes
            assert time.monotonic() < deadline, f"never observed: {sorted(missing)}"
            time.sleep(0.5)


def test_every_service_exports_typed_labelled_documented_metrics(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "train-async", "--fully-async", "--rollout-batch-size", "4",
         "--n-samples-per-prompt", "4", "--num-rollout", "200", "--eval-interval", "2", "--run-dir", str(run_dir)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        run_id, services, scrapes = scrape_mid_run(run_dir, proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # stops the run the way Ctrl-C does
        proc.communicate(timeout=60)

    assert {"buffer", "trainer", "weight-sync", "eval", "rollout", "engine"} == {service_of(x) for x in services}
    meanings: dict[str, dict[str, str]] = {}  # name -> {service: HELP text}
    for label, fams in scrapes.items():
        service = service_of(label)
        assert {"process_cpu_seconds", "process_resident_memory_bytes", "process_start_time_seconds"} <= set(fams)
        for name, fam in fams.items():
            assert not (fam.type == "gauge" and name.endswith("_total")), f"{label}: {name} is a counter typed gauge"
            assert documented_type(name) == fam.type, f"{label}: {name} ({fam.type}) is not in docs/metrics.md as such"
            for s in fam.samples:
                assert (s.labels.get("run"), s.labels.get("service"), s.labels.get("instance")) == (
                    run_id, service, label), f"{label}: {s.name} {s.labels}"  # fmt: skip
            if fam.type == "histogram":
                assert any(s.name == name + "_bucket" and s.labels["le"] == "+Inf" for s in fam.samples), name
            if not name.startswith(SHARED):
                meanings.setdefault(name, {})[service] = fam.documentation
    shared = {name: by for name, by in meanings.items() if len(by) > 1}
    assert not shared, f"names exported by more than one service: {shared}"
    exported = {name for fams in scrapes.values() for name in fams}
    assert dashboard_families() <= exported, (
        f"the dashboard reads what nothing exports: {dashboard_families() - exported}"
    )
