"""How NATS fails, in the bus's words: the errors services catch (never nats-py's own), the
server's answers that no retry fixes (a full store, another writer's message, refused
credentials), and `through_outage`, which retries the rest while the broker is away."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time

import nats.errors
import nats.js.errors

from services.common.secrets import NatsCredentials

log = logging.getLogger(__name__)


class BusError(RuntimeError):
    pass


TransportError = nats.errors.Error
"""Any failure of a NATS or JetStream call (a timeout, no responders, an API error). Services
catch this name, never nats-py's own: the bus is their only door to NATS."""


class StoreFull(BusError):
    """JetStream refused to store a message: its store is full. Fatal: retrying cannot free it."""


class StreamFull(BusError):
    """A stream refused a message because it holds its message cap (discard "new"): its reader
    is behind. Not fatal: room comes back as the reader catches up (`until_room`)."""


STORE_DIR_ENV = "ASYNCRL_NATS_STORE_DIR"
"""Where the NATS server keeps its store, when we know it (the launcher's embedded server)."""
STORE_FULL_CODES = {10023, 10028, 10047}  # insufficient resources, max bytes / storage exceeded
WRONG_LAST_SEQUENCE_CODE = 10071
STREAM_FULL_CODE = 10077  # maximum messages exceeded


def raise_if_final(e: BaseException, subject: str) -> None:
    """StoreFull, naming the store, when `e` is the server saying it cannot store more;
    StreamFull when the stream holds its message cap; SequenceConflict when another writer's
    message stands where the publish expected the stream to end."""
    if not isinstance(e, nats.js.errors.APIError):
        return
    desc = (e.description or "").lower()
    if e.err_code == WRONG_LAST_SEQUENCE_CODE or "wrong last sequence" in desc:
        raise SequenceConflict(f"{subject}: {e.description}") from e
    if e.err_code == STREAM_FULL_CODE or "maximum messages exceeded" in desc:
        raise StreamFull(f"{subject}: the stream holds its message cap ({e.description}): its reader is behind") from e
    if e.err_code in STORE_FULL_CODES or "insufficient resources" in desc or "bytes exceeded" in desc:
        store = os.environ.get(STORE_DIR_ENV)
        where = f"at {store}" if store else "of the NATS server"
        raise StoreFull(
            f"the JetStream store {where} is full: the server refused to store a message on {subject} "
            f"({e.description}). Free disk space there, or raise its limit (--nats-max-file-store for the "
            "embedded server); `asyncrl audit RUN_DIR` still reads the run"
        ) from e


class StreamSetupError(Exception):
    """The server refused to create or update a stream for a reason no retry fixes."""


STREAM_EXISTS_DIFFERENTLY = 10058  # "stream name already in use with a different configuration"


class SequenceConflict(BusError):
    """A publish that expected the stream to end at a sequence found another writer's message."""


class BusAuthError(BusError):
    """The server refused this process's credentials or TLS: fatal, a restart cannot fix it."""


def fatal_connect_error(e: BaseException, url: str, creds: NatsCredentials, service: str) -> BusAuthError | None:
    """A connection error that retrying cannot fix, as a BusAuthError that names the cause."""
    text = str(e)
    if isinstance(e, nats.errors.AuthorizationError) or "authorization violation" in text.lower():
        return BusAuthError(
            f"NATS at {url} refused the credentials of {service} ({creds.describe()}): Authorization Violation. "
            "Check the user and password, token, creds or NKey file this service is given "
            "(ASYNCRL_NATS_* variables, --nats-roles-file)"
        )
    if "authentication expired" in text.lower() or "user authentication revoked" in text.lower():
        return BusAuthError(f"NATS at {url} refused the credentials of {service}: {text}")
    if isinstance(e, ssl.SSLError):
        hint = (
            "the server's certificate is not signed by a CA this client trusts: pass --nats-tls-ca"
            if isinstance(e, ssl.SSLCertVerificationError)
            else "check --nats-tls-ca, --nats-tls-cert and --nats-tls-key"
        )
        return BusAuthError(f"TLS to NATS at {url} failed for {service}: {e.__class__.__name__}: {e}. {hint}")
    if "tls" in text.lower() and ("required" in text.lower() or "not available" in text.lower()):
        return BusAuthError(
            f"NATS at {url}: {text}. Use a tls:// URL with --nats-tls-ca when the server requires TLS, "
            "or drop the TLS options when it offers none"
        )
    return None


async def until_room(op, on_full, max_delay_s: float = 2.0):
    """`await op()`, waiting and trying again while the stream it publishes to holds its message
    cap (StreamFull): backpressure the publisher sees, nothing dropped. `on_full(error, refusals)`
    is called at each refusal (count it; log the first). Any other error is raised."""
    delay, refusals = 0.05, 0
    while True:
        try:
            return await op()
        except StreamFull as e:
            refusals += 1
            on_full(e, refusals)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay_s)


async def through_outage(op, what: str, deadline_s: float, verb: str = "publish"):
    """`await op()`, retried with backoff while the broker is away (or, on a cluster, while a
    stream elects its leader); a full store or another writer's message is final; gives up
    loudly after deadline_s."""
    end = time.monotonic() + deadline_s
    delay = 0.2
    while True:
        try:
            return await op()
        except (StoreFull, SequenceConflict):
            raise
        except (TimeoutError, BusError, nats.errors.Error, OSError) as e:
            if time.monotonic() > end:
                raise BusError(f"could not {verb} {what} for {deadline_s:.0f}s: {e}") from e
            log.warning("%s %s failed (%s: %.200s); retrying", verb, what, type(e).__name__, e)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
