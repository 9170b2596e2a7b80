"""Configuration checked up front, and secrets that never leave their process: ranges and
finiteness of every numeric flag, the run id's pattern, credentials taken out of the NATS URL,
secret fields absent from every dump, the redacting log filter, the roles file."""

from __future__ import annotations

import json
import logging
import math

import pytest

from services.common.config import ConfigError, RunConfig
from services.common.config_load import resolve_config
from services.common.secrets import (
    NatsCredentials,
    RedactingFilter,
    SecretError,
    load_roles_file,
    run_token_from_env,
    url_credentials,
    write_roles_file,
    write_secret_file,
)

BAD = [
    ({"rollout_temperature": math.nan}, "--rollout-temperature must be a finite number"),
    ({"lr": math.nan}, "--lr must be a finite number"),
    ({"lr": -1e-3}, "--lr must be > 0"),
    ({"lr": math.inf}, "--lr must be a finite number"),
    ({"rollout_max_response_len": -4}, "--rollout-max-response-len must be >= 1"),
    ({"rollout_max_response_len": 0}, "--rollout-max-response-len must be >= 1"),
    ({"prompt_ack_wait_s": 0}, "--prompt-ack-wait-s must be > 0"),
    ({"buffer_timeout_s": 0}, "--buffer-timeout-s must be > 0"),
    ({"producer_timeout_s": -5}, "--producer-timeout-s must be > 0"),
    ({"rollout_health_check_timeout": 0}, "--rollout-health-check-timeout must be > 0"),
    ({"torch_num_threads": 0}, "--torch-num-threads must be >= 1"),
    ({"engine_max_running_requests": 0}, "--engine-max-running-requests must be >= 1"),
    ({"adam_beta2": 1.0}, "--adam-beta2 must be < 1"),
    ({"eps_clip": 0}, "--eps-clip must be > 0"),
    ({"eval_top_p": 1.5}, "--eval-top-p must be <= 1"),
    ({"max_failed_ratio": 1.5}, "--max-failed-ratio must be <= 1"),
    ({"health_restart_s": -1}, "--health-restart-s must be >= 0"),
    ({"nats_max_file_store": 0}, "--nats-max-file-store must be > 0"),
    ({"rollout_stop_token_ids": [3, -1]}, "--rollout-stop-token-ids must be token ids >= 0"),
    ({"run_id": "a b"}, "--run-id: run id 'a b' is not usable in NATS subjects"),
    ({"run_id": "x" * 65}, "is not usable in NATS subjects"),
    ({"nats_tls_key": "k.pem"}, "--nats-tls-key needs --nats-tls-cert"),
]


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_every_numeric_flag_is_checked_at_the_command_line(fields, message):
    with pytest.raises(ConfigError) as e:
        resolve_config(fields, environ={})
    assert message in str(e.value)


def test_the_command_line_refuses_nan_before_anything_starts(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "services.cli", "train-async", "--rollout-temperature", "nan",
                        "--lr", "nan", "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.returncode == 2
    assert "--rollout-temperature must be a finite number (got nan)" in r.stderr
    assert "--lr must be a finite number (got nan)" in r.stderr
    assert not (tmp_path / "run").exists()  # nothing was prepared


def test_credentials_in_the_nats_url_are_moved_out_and_never_dumped():
    c = resolve_config({"nats_url": "nats://alice:s3cr3t-pw@broker:4222"}, environ={})
    assert c.infra.nats_url == "nats://broker:4222"
    assert c.infra.nats_user == "alice" and c.infra.nats_password.get_secret_value() == "s3cr3t-pw"
    dumped = json.dumps(c.model_dump(mode="json"))
    assert "s3cr3t-pw" not in dumped and "alice" not in dumped and "s3cr3t-pw" not in repr(c)
    token = resolve_config({"nats_url": "tls://tok3n-value@broker"}, environ={})
    assert token.infra.nats_url == "tls://broker" and token.infra.nats_token.get_secret_value() == "tok3n-value"
    assert url_credentials("nats://a:b@h1:1,nats://h2:2") == ("nats://h1:1,nats://h2:2", {"user": "a", "password": "b"})
    assert url_credentials("nats://h:1") == ("nats://h:1", {})


def test_secret_fields_come_from_the_environment_and_never_reach_a_dump():
    env = {"ASYNCRL_RUN_TOKEN": "run-tok-123", "ASYNCRL_NATS_PASSWORD": "pw-456", "ASYNCRL_NATS_TOKEN": "nt-789"}
    c = resolve_config({}, environ=env)
    assert c.infra.run_token.get_secret_value() == "run-tok-123" and c.infra.nats_password.get_secret_value() == "pw-456"
    dumped = json.dumps(c.model_dump(mode="json"))
    for secret in env.values():
        assert secret not in dumped and secret not in repr(c)


def test_the_run_token_comes_from_the_environment_or_its_file(tmp_path):
    assert run_token_from_env({}) is None
    assert run_token_from_env({"ASYNCRL_RUN_TOKEN": "abc"}) == "abc"
    path = write_secret_file(tmp_path / "secrets" / "run-token", "from-file\n")
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert run_token_from_env({"ASYNCRL_RUN_TOKEN_FILE": str(path)}) == "from-file"
    with pytest.raises(SecretError, match="cannot read the run token"):
        run_token_from_env({"ASYNCRL_RUN_TOKEN_FILE": str(tmp_path / "missing")})


def test_the_roles_file_gives_each_role_its_identity(tmp_path):
    path = write_roles_file(tmp_path / "nats.json", {"buffer": "pw-b", "rollout": "pw-r"})
    env = {"ASYNCRL_NATS_ROLES_FILE": str(path), "ASYNCRL_NATS_TLS_CA": "/ca.pem"}
    buf = NatsCredentials.from_env("buffer", env)
    assert (buf.user, buf.password, buf.tls_ca) == ("buffer", "pw-b", "/ca.pem")
    assert "pw-b" not in repr(buf) and "pw-b" not in buf.describe()
    (tmp_path / "bad.json").write_text(json.dumps({"trainer": {"passwd": "x"}}))
    with pytest.raises(SecretError, match="role 'trainer' needs"):
        load_roles_file(tmp_path / "bad.json")


def test_log_lines_never_show_a_secret(caplog):
    logger = logging.getLogger("asyncrl.test.redaction")
    flt = RedactingFilter(["hunter2-secret"])
    logger.addFilter(flt)
    try:
        with caplog.at_level(logging.INFO, logger="asyncrl.test.redaction"):
            logger.info("connecting with %s", "nats://bob:hunter2-secret@host")
    finally:
        logger.removeFilter(flt)
    assert "hunter2-secret" not in caplog.text and "nats://bob:***@host" in caplog.text


def test_runconfig_rejects_nan_from_a_config_file(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("lr: .nan\n")
    with pytest.raises(ConfigError, match="--lr must be a finite number"):
        resolve_config({}, config_file=str(f), environ={})
    assert RunConfig(lr=0.5).trainer.lr == 0.5


def test_a_full_disk_is_fatal_and_names_the_path(tmp_path, monkeypatch):
    """A write that comes out short (safetensors does not report every failed write) or fails
    with ENOSPC is an error naming the file; a service exits on it with the reason (no restart)."""
    import errno

    from services.common.entry import fatal_reason
    from services.model import hf_io
    from services.tasks.reverse_digits import build_model

    build_model(tmp_path / "m", warmup_sft_steps=0, log=lambda *a: None)
    model = hf_io.load_model(tmp_path / "m")
    monkeypatch.setattr(hf_io, "save_file", lambda state, path, metadata=None: open(path, "wb").close())
    with pytest.raises(OSError) as e:
        hf_io.save_model(model, tmp_path / "v1")
    assert e.value.errno == errno.ENOSPC and e.value.filename.endswith("model.safetensors.tmp")
    reason = fatal_reason(RuntimeError("step failed").with_traceback(None))
    assert reason is None  # anything else is a crash, restarted
    wrapped = RuntimeError("push failed")
    wrapped.__cause__ = e.value
    assert "no space left on the device writing" in fatal_reason(wrapped) and "model.safetensors.tmp" in fatal_reason(
        wrapped
    )


def test_http_keys_from_the_environment_are_checked():
    """$ASYNCRL_HTTP_KEYS is what a process checks tokens with: anything but a JSON object of
    role -> hex digest is refused by name (no process starts with keys it cannot read)."""
    from services.common.httpauth import HTTP_KEYS_ENV, Keys, keys_from_env, role_token

    for raw in ("not json", "[1]", '{"admin": 3}'):
        with pytest.raises(ValueError, match=HTTP_KEYS_ENV):
            keys_from_env(None, {HTTP_KEYS_ENV: raw})
    keys = keys_from_env("ignored", Keys.of_run("tok").env())
    assert keys.role_of(role_token("tok", "eval").encode()) == "eval" and keys.role_of(b"tok") == "admin"
    assert keys_from_env(None, {}) is None
