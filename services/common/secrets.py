"""Secrets: the run token (HTTP) and the NATS credentials of each process.

A secret is never printed, never logged, never put on a child's command line, never written to
config.json, the run's KV bucket or `/config`. It reaches a process through its environment (a
process's environment is readable by its own user only, unlike its command line) or through a
file of mode 0600 that the environment names:

  ASYNCRL_RUN_TOKEN / ASYNCRL_RUN_TOKEN_FILE   the run token: `Authorization: Bearer <token>` on
                                               every protected HTTP route (services, engines)
  ASYNCRL_NATS_USER, ASYNCRL_NATS_PASSWORD     NATS user and password
  ASYNCRL_NATS_TOKEN                           NATS token
  ASYNCRL_NATS_CREDS, ASYNCRL_NATS_NKEY        paths: a NATS .creds file (JWT) or an NKey seed file
  ASYNCRL_NATS_TLS_CA, _CERT, _KEY             paths: TLS CA bundle, client certificate and key
  ASYNCRL_NATS_ROLES_FILE                      path: JSON {role: {user, password} | {token} |
                                               {creds} | {nkey}}, each process takes its role's

The launcher makes a run token and, for the embedded nats-server, one NATS identity per role
(services.common.natsauth), kept under <run_dir>/secrets (mode 0700, files 0600).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import ssl
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from services.common.procs import replace_file

RUN_TOKEN_ENV = "ASYNCRL_RUN_TOKEN"
RUN_TOKEN_FILE_ENV = "ASYNCRL_RUN_TOKEN_FILE"
ROLES_FILE_ENV = "ASYNCRL_NATS_ROLES_FILE"
NATS_ENV = {
    f: "ASYNCRL_NATS_" + f.removesuffix("_file").upper()
    for f in ("user", "password", "token", "creds_file", "nkey_file", "tls_ca", "tls_cert", "tls_key")
}
"""NatsCredentials field -> its variable (the module docstring lists them)."""
RM_TOKEN_ENV = "ASYNCRL_RM_TOKEN"
"""remote_rm's bearer token (services/rewards/remote.py): only the producers and the eval
service get it."""
SECRET_ENV = (RUN_TOKEN_ENV, "ASYNCRL_HTTP_TOKEN", NATS_ENV["password"], NATS_ENV["token"], RM_TOKEN_ENV)
REDACTED = "***"


class SecretError(ValueError):
    """A secret that cannot be read; the message names the variable or file, never the value."""


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def write_secret_file(path: str | Path, text: str) -> Path:
    """Write `text` to a file only its owner can read (0600), in a directory only its owner can
    enter (0700), replacing any older file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    return replace_file(path, text, 0o600)


def read_secret_file(path: str | Path, what: str) -> str:
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise SecretError(f"cannot read {what} from {path}: {e.strerror or e}") from None
    if not text:
        raise SecretError(f"{what} file {path} is empty")
    return text


def run_token_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    if token := environ.get(RUN_TOKEN_ENV):
        return token
    if path := environ.get(RUN_TOKEN_FILE_ENV):
        return read_secret_file(path, f"the run token (${RUN_TOKEN_FILE_ENV})")
    return None


@dataclass(frozen=True)
class NatsCredentials:
    """How one process authenticates to NATS. repr() shows no secret."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds_file: str | None = None
    nkey_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def from_env(cls, role: str | None = None, environ: Mapping[str, str] = os.environ) -> NatsCredentials:
        """This process's credentials: its role's entry of $ASYNCRL_NATS_ROLES_FILE if there is
        one, else the ASYNCRL_NATS_* variables; TLS settings always from the variables."""
        values = {name: environ.get(var) or None for name, var in NATS_ENV.items()}
        entry = load_roles_file(environ[ROLES_FILE_ENV]).get(role) if environ.get(ROLES_FILE_ENV) and role else None
        if entry is not None:
            values |= {k: entry.get(k) for k in _ROLE_KEYS.values()}
        return cls(**values)

    def with_tls(self, ca: str | None, cert: str | None, key: str | None) -> NatsCredentials:
        return replace(self, tls_ca=ca, tls_cert=cert, tls_key=key)

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)

    def env(self) -> dict[str, str]:
        """The ASYNCRL_NATS_* variables that give a child process these credentials."""
        return {NATS_ENV[k]: v for k, v in asdict(self).items() if v}

    def describe(self) -> str:
        """What kind of identity this is, for error messages (no secret in it)."""
        kinds = (
            (self.creds_file, f"the credentials file {self.creds_file}"),
            (self.nkey_file, f"the NKey seed file {self.nkey_file}"),
            (self.token, "a token"),
            (self.user, f"user {self.user!r} with a password"),
        )
        what = next((text for given, text in kinds if given), "no credentials")
        return what + (f", TLS CA {self.tls_ca}" if self.tls_ca else "")

    def connect_kwargs(self) -> dict:
        """Keyword arguments of nats.connect() for these credentials."""
        renamed = {"creds_file": "user_credentials", "nkey_file": "nkeys_seed"}
        kw: dict = {renamed.get(f, f): v for f, v in asdict(self).items() if v and not f.startswith("tls_")}
        if not self.uses_tls:
            return kw
        try:
            kw["tls"] = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                kw["tls"].load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as e:
            raise SecretError(
                f"cannot load the NATS TLS files (CA {self.tls_ca}, certificate {self.tls_cert}, key {self.tls_key}): {e}"
            ) from None
        return kw


_ROLE_KEYS = {"user": "user", "password": "password", "token": "token", "creds": "creds_file", "nkey": "nkey_file"}


def load_roles_file(path: str | Path) -> dict[str, dict[str, str]]:
    """{role: {user, password} | {token} | {creds: path} | {nkey: path}}; raises SecretError
    naming the file and what is wrong (never a value)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SecretError(f"cannot read the NATS roles file {path}: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(data, dict):
        raise SecretError(f"the NATS roles file {path} must hold a JSON object of role -> credentials")
    out: dict[str, dict[str, str]] = {}
    for role, entry in data.items():
        if not isinstance(entry, dict) or not entry or not set(entry) <= set(_ROLE_KEYS):
            raise SecretError(
                f"the NATS roles file {path}: role {role!r} needs an object with user/password, token, creds or nkey"
            )
        if not all(isinstance(v, str) and v for v in entry.values()):
            raise SecretError(f"the NATS roles file {path}: the values of role {role!r} must be non-empty strings")
        out[role] = {_ROLE_KEYS[k]: v for k, v in entry.items()}
    return out


def write_roles_file(path: str | Path, passwords: dict[str, str]) -> Path:
    return write_secret_file(path, json.dumps({r: {"user": r, "password": p} for r, p in passwords.items()}, indent=2))


def keep_or_make_passwords(path: str | Path, roles: tuple[str, ...]) -> dict[str, str]:
    """A password per role from the roles file at `path` when it has one for every role (a
    restarted run must keep matching its server), else new ones written there."""
    if Path(path).exists():
        kept = load_roles_file(path)
        if all(kept.get(r, {}).get("password") for r in roles):
            return {r: kept[r]["password"] for r in roles}
    passwords = {r: new_secret() for r in roles}
    write_roles_file(path, passwords)
    return passwords


def keep_or_make_token(path: str | Path, given: str | None = None) -> str:
    """The run token: `given`, else the one kept at `path`, else a new one; written to `path`."""
    token = given or (read_secret_file(path, "the run token") if Path(path).exists() else new_secret())
    write_secret_file(path, token)
    return token


def url_credentials(url: str) -> tuple[str, dict[str, str]]:
    """nats://user:pass@host:4222 -> (nats://host:4222, {"user", "password"}); nats://tok@host ->
    (nats://host, {"token"}) (a lone user part is NATS's token form). Only the first URL of a
    comma-separated list may carry credentials, as nats-py reads them."""
    first, sep, rest = url.partition(",")
    parts = urlsplit(first)
    if not parts.username and not parts.password:
        return url, {}
    parts.port  # noqa: B018 (ValueError on a port that is not one, as nats-py would raise later)
    netloc = parts.netloc.rpartition("@")[2]  # the host and port as written
    clean = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)) + sep + rest
    if parts.password is None:
        return clean, {"token": parts.username}
    return clean, {"user": parts.username, "password": parts.password}


def redact_text(text: str, secret_values: list[str]) -> str:
    for s in secret_values:
        if s and len(s) >= 4:
            text = text.replace(s, REDACTED)
    return text


class RedactingFilter(logging.Filter):
    """Replaces every known secret in a log record's final message: a secret that reaches a log
    line by accident (an exception text quoting a URL, a library's debug output) is still hidden."""

    def __init__(self, secret_values: list[str]):
        super().__init__()
        self.secret_values = [s for s in secret_values if s and len(s) >= 4]

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secret_values:
            msg = record.getMessage()
            if (clean := redact_text(msg, self.secret_values)) != msg:
                record.msg, record.args = clean, None
            if record.exc_info and record.exc_info[1] is not None:
                record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info), self.secret_values)
        return True


def without_identity(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Ours without any credential: no NATS identity, no run token, no HTTP token or keys, no
    reward model token (a child is given its own by whoever starts it)."""
    drop = ("ASYNCRL_NATS_", RUN_TOKEN_ENV, "ASYNCRL_HTTP_", RM_TOKEN_ENV)
    return {k: v for k, v in environ.items() if not k.startswith(drop)}


def install_log_redaction(extra: list[str] | None = None) -> None:
    """Add the redacting filter, for every secret this process holds through its environment and
    `extra`, to every handler of the root logger."""
    known = [os.environ[k] for k in SECRET_ENV if os.environ.get(k)]
    with contextlib.suppress(SecretError):
        if token := run_token_from_env():
            known.append(token)
    flt = RedactingFilter(known + list(extra or []))
    for handler in logging.getLogger().handlers:
        handler.addFilter(flt)
