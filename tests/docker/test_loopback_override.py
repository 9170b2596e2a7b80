"""tests/docker/compose.loopback.yml changes only addresses: every service of docker-compose.yml is
on the host's network and runs the shipped command with its listen address, port and the
engine's URL moved to 127.0.0.1 (init may append job-size flags), each a valid asyncrl command
line. Checked without docker, so the docker test runs what users run."""

from __future__ import annotations

import re

import pytest
import yaml

from services.cli import check_argv
from tests.docker.harness import ROOT

ADDRESS_FLAGS = {"--host", "--port", "--http-host", "--http-port", "--rollout-engine-urls"}
JOB_SIZE_FLAGS = {"--num-rollout"}
ENV = {"ASYNCRL_TEST_NATS_PORT": "10001", "ASYNCRL_TEST_ENGINE_PORT": "10002", "ASYNCRL_TEST_BUFFER_PORT": "10003",
       "ASYNCRL_TEST_WEIGHT_SYNC_PORT": "10004", "ASYNCRL_TEST_EVAL_PORT": "10005", "ASYNCRL_TEST_TRAINER_PORT": "10006",
       "ASYNCRL_NATS_URL": "nats://127.0.0.1:10001"}  # fmt: skip


def interpolated(word: str) -> str:
    """Compose's ${VAR} and ${VAR:-default}."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: ENV.get(m.group(1), m.group(2) or ""), word)


def services(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())["services"]


SHIPPED = services("docker-compose.yml")
OVERRIDE = services("tests/docker/compose.loopback.yml")


def test_every_service_is_on_the_host_network():
    assert set(OVERRIDE) == set(SHIPPED)
    assert all(svc["network_mode"] == "host" for svc in OVERRIDE.values())


@pytest.mark.parametrize(
    "name", sorted(n for n, s in SHIPPED.items() if s["command"][0] == "asyncrl" and n != "secrets")
)
def test_only_addresses_differ_from_the_shipped_command(name, monkeypatch):
    shipped, loopback = SHIPPED[name]["command"], OVERRIDE[name]["command"]
    extra = loopback[len(shipped) :]
    assert set(extra[::2]) <= JOB_SIZE_FLAGS, extra
    for i, (a, b) in enumerate(zip(shipped, loopback, strict=False)):
        if a != b:
            assert shipped[i - 1] in ADDRESS_FLAGS, f"{name}: {shipped[i - 1]} {a} became {b}"
            host = interpolated(b).split("//")[-1].split(":")[0]
            assert host == "127.0.0.1" or interpolated(b).isdigit(), f"{name}: {b}"
    monkeypatch.chdir(ROOT)
    check_argv([interpolated(w) for w in loopback[1:]])


def test_nats_runs_the_shipped_config_on_loopback():
    shipped, loopback = SHIPPED["nats"]["command"], OVERRIDE["nats"]["command"]
    assert loopback[0] == "nats-server" and loopback[1 : 1 + len(shipped)] == shipped
    rest = loopback[1 + len(shipped) :]
    assert dict(zip(rest[::2], rest[1::2], strict=True)) == {"-a": "127.0.0.1", "-p": "${ASYNCRL_TEST_NATS_PORT}"}
