"""Deploy files only run real commands with valid flags (docker cannot run here), every shipped
config parses, every package is listed for installation, and proto-plus cannot shadow us."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
import yaml

from services.cli import check_argv
from services.common.config_load import read_config_file, resolve_config

ROOT = pathlib.Path(__file__).resolve().parents[2]


def interpolated(word: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default}: the variable's value when set, else the default."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1), m.group(2)), word)


def compose_commands(env: dict[str, str] | None = None) -> dict[str, list[str]]:
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return {
        name: [interpolated(w, env or {}) for w in svc["command"]]
        for name, svc in spec["services"].items()
        if svc.get("command", [None])[0] == "asyncrl"
    }


def test_compose_runs_every_service():
    cmds = compose_commands()
    assert {"init", "engine", "buffer", "weight-sync", "eval", "rollout", "trainer"} <= set(cmds)
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert "nats" in spec["services"]


@pytest.mark.parametrize("name", sorted(compose_commands()))
def test_compose_commands_are_valid_cli_invocations(name, monkeypatch):
    monkeypatch.chdir(ROOT)  # the image's working directory holds deploy/
    check_argv(compose_commands()[name][1:])


def test_the_compose_nats_cluster_override_points_every_service_at_three_nodes(monkeypatch):
    """deploy/nats-cluster.env + deploy/compose.nats-cluster.yml: three nodes (node 0 keeps the
    name `nats` and answers as nats-0, the name its peers' routes use), every service's command
    valid with the cluster's URL, init creating 3 replicas."""
    env = dict(line.split("=", 1) for line in (ROOT / "deploy" / "nats-cluster.env").read_text().splitlines()
               if line and not line.startswith("#"))  # fmt: skip
    override = yaml.safe_load((ROOT / "deploy" / "compose.nats-cluster.yml").read_text())["services"]
    assert (
        set(override) == {"nats", "nats-1", "nats-2"} and "nats-0" in override["nats"]["networks"]["default"]["aliases"]
    )
    hosts = {u.split("//")[1].split(":")[0] for u in env["ASYNCRL_NATS_URL"].split(",")}
    assert hosts == {"nats-0", "nats-1", "nats-2"}
    cmds = compose_commands(env)
    monkeypatch.chdir(ROOT)
    for name, cmd in cmds.items():
        if "--nats-url" in cmd:
            assert cmd[cmd.index("--nats-url") + 1] == env["ASYNCRL_NATS_URL"], name
        check_argv(cmd[1:])
    assert cmds["init"][cmds["init"].index("--nats-replicas") + 1] == "3"


def k8s_commands() -> dict[str, list[str]]:
    out = {}
    for doc in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "asyncrl.yaml").read_text()):
        spec = (doc.get("spec") or {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []):
            if c.get("command", [None])[0] == "asyncrl":
                out[f"{doc['metadata']['name']}/{c['name']}"] = c["command"]
    return out


def test_k8s_runs_every_service_and_scales_producers_separately():
    names = set(k8s_commands())
    assert {"asyncrl-init/init", "asyncrl-engine/engine", "asyncrl-buffer/buffer", "asyncrl-rollout/rollout",
            "asyncrl-trainer/trainer", "asyncrl-weight-sync/weight-sync", "asyncrl-eval/eval"} <= names  # fmt: skip


@pytest.mark.parametrize("name", sorted(k8s_commands()))
def test_k8s_commands_are_valid_cli_invocations(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    check_argv(k8s_commands()[name][1:])


def test_check_argv_rejects_bad_flags():
    with pytest.raises(SystemExit):
        check_argv(["service", "buffer", "--nats-url", "x", "--run-id", "r", "--no-such-flag"])
    with pytest.raises(SystemExit):
        check_argv(["train-async", "--rollout-batch-size", "many"])
    with pytest.raises(SystemExit):
        check_argv(["service", "nonexistent"])


@pytest.mark.parametrize("path", sorted(p.name for p in (ROOT / "deploy" / "configs").glob("*.yaml")))
def test_every_shipped_config_parses(path):
    """Every key of a shipped config reaches the resolved config with the value it gives (a key
    that a rename left behind, or a value the loader dropped, fails here)."""
    file = ROOT / "deploy" / "configs" / path
    cfg = resolve_config({}, config_file=str(file), environ={})
    given = yaml.safe_load(file.read_text())
    assert given, f"{path} sets nothing"
    for key, value in given.items():
        got = cfg.flag(key.replace("-", "_"))
        got = got.get_secret_value() if hasattr(got, "get_secret_value") else got
        assert got == value or str(got) == str(value), (path, key, value, got)


def test_every_package_is_listed_for_installation():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"asyncrl_proto"} | {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "services").rglob("__init__.py")
    }
    assert found <= listed, f"missing from pyproject packages: {sorted(found - listed)}"


def test_a_foreign_top_level_proto_package_does_not_break_us(tmp_path):
    """proto-plus installs a top-level `proto`; our contract is imported as asyncrl_proto."""
    fake = tmp_path / "proto"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('this is proto-plus, not asyncrl')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    code = "import services.api, services.buffer.service, services.rollout.service; import proto; print(proto.__name__)"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert "this is proto-plus" in r.stderr  # `import proto` finds the foreign package first...
    code = "import services.api, services.buffer.service, services.rollout.service, services.trainer.core; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr  # ...and asyncrl never needs it


def test_read_config_file_formats(tmp_path):
    (tmp_path / "a.toml").write_text("rollout-batch-size = 3\n")
    (tmp_path / "a.json").write_text('{"rollout_batch_size": 5}')
    assert read_config_file(tmp_path / "a.toml") == {"rollout_batch_size": 3}
    assert read_config_file(tmp_path / "a.json") == {"rollout_batch_size": 5}


def k8s_docs() -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "asyncrl.yaml").read_text()) if d]


def test_the_k8s_manifest_and_secrets_are_valid_kubernetes():
    """kubernetes-validate, strict (no unknown fields), on the manifest and on what `asyncrl
    secrets --k8s` prints."""
    kv = pytest.importorskip("kubernetes_validate")
    from services.common.natsauth import k8s_secrets

    docs = k8s_docs() + [d for d in yaml.safe_load_all(k8s_secrets("k8s")) if d]
    for doc in docs:
        kv.validate(doc, kv.latest_version(), strict=True)
    assert {d["kind"] for d in docs} >= {"Secret", "Job", "Deployment", "StatefulSet", "HorizontalPodAutoscaler"}
    import base64

    auth = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "asyncrl-nats-auth")
    routes = base64.b64decode(auth["data"]["routes.conf"]).decode()
    assert all(f"@nats-{i}.nats:6222" in routes for i in range(3)) and "authorization" in routes


def test_the_k8s_manifest_would_run():
    """The trainer is a Job (restarted on failure, not on success); every asyncrl container uses
    a local image if present and has probes; the engine waits for the model; producers scale on
    the buffer's free capacity."""
    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_docs()}
    trainer = docs[("Job", "asyncrl-trainer")]["spec"]["template"]["spec"]
    assert trainer["restartPolicy"] == "OnFailure" and ("Deployment", "asyncrl-trainer") not in docs
    for (kind, name), d in docs.items():
        pod = (d.get("spec") or {}).get("template", {}).get("spec", {})
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            if c["image"].startswith("asyncrl"):
                assert c.get("imagePullPolicy") == "IfNotPresent", f"{name}/{c['name']}"
        if kind in ("Deployment", "StatefulSet") or name == "asyncrl-trainer":
            for c in pod["containers"]:
                assert "livenessProbe" in c and "readinessProbe" in c, f"{name}/{c['name']}"
    nats = docs[("StatefulSet", "nats")]["spec"]
    assert nats["replicas"] == 3 and nats["podManagementPolicy"] == "Parallel"  # quorum before readiness
    assert docs[("Service", "nats")]["spec"]["publishNotReadyAddresses"] is True
    assert 'include "auth/routes.conf"' in docs[("ConfigMap", "asyncrl-nats")]["data"]["nats-server.conf"]
    assert ("NetworkPolicy", "nats-routes") in docs
    init = docs[("Job", "asyncrl-init")]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert init[init.index("--nats-replicas") + 1] == "3"
    engine = docs[("Deployment", "asyncrl-engine")]["spec"]["template"]["spec"]
    assert "/runs/k8s/model/initial/.complete" in " ".join(engine["initContainers"][0]["command"])
    hpa = docs[("HorizontalPodAutoscaler", "asyncrl-rollout")]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "asyncrl-rollout"
    assert hpa["metrics"][0]["external"]["metric"]["name"] == "asyncrl_buffer_free_capacity"


def test_the_docker_build_context_leaves_local_state_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "runs"} <= set(ignored)
