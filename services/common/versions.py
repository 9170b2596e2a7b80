"""The weight-version protocol over the bus: the trainer publishes a version (KV key
`published_version` first, then its announcement on WEIGHTS), and every reader bounds the
versions it accepts by the newest one published (`VersionBound`): a message, a KV value or a
restart's derived state that names a newer version is refused (docs/trust.md)."""

from __future__ import annotations

import contextlib
import logging

from asyncrl_proto import WeightsPublished, decode
from asyncrl_proto.codec import MalformedMessage
from services.common.bus import Bus, TransportError, through_outage

log = logging.getLogger(__name__)

PUBLISHED_VERSION_KEY = "published_version"
"""KV key: the newest weight version the trainer pushed (it alone may write it)."""


async def publish_weights(bus: Bus, pub: WeightsPublished) -> None:
    """The trainer's push of a weight version: first the KV key `published_version` (so that
    no message can name the version before a reader's bound allows it), then WEIGHTS."""
    value = str(pub.version).encode()
    await through_outage(
        lambda: bus.kv_put(PUBLISHED_VERSION_KEY, value), f"the published version {pub.version}", 180.0
    )
    subject = bus.subjects.weights_published
    await bus.publish_durably([(subject, pub, f"weights-v{pub.version}")], f"weights v{pub.version}")


async def last_published_version(bus: Bus, at_least: int = 0, scan: int = 64) -> int:
    """The newest weight version the trainer published, 0 before the first push: the KV key
    the trainer writes before each push (stray messages on WEIGHTS cannot hide it), or what
    WEIGHTS says if that is newer (a publisher that writes no KV key). On WEIGHTS the last
    message normally says it; when that one does not decode or names less than `at_least`
    (a stray message, dead-lettered by weight-sync), the newest of the last `scan` counts."""
    kv = 0
    with contextlib.suppress(ValueError, TypeError):
        kv = int((await bus.kv_get(PUBLISHED_VERSION_KEY) or b"0").decode())
    if at_least > 0 and kv >= at_least:
        return kv  # what the caller needs to know: one read, not a scan of WEIGHTS at every version
    newest, wanted = max(kv, 0), max(at_least, kv + 1, 1)
    async for pub in announcements(bus, scan):
        newest = max(newest, pub.version)
        if newest >= wanted:
            break
    return newest


async def published_announcement(bus: Bus, version: int, scan: int = 64) -> WeightsPublished | None:
    """The trainer's announcement of `version` on WEIGHTS, looked up from the stream's last
    message back (at most `scan` messages): what a reader that never consumed it (lost, taken by
    another consumer, acknowledged by a predecessor that died) catches up from. None when it is
    not there."""
    async for pub in announcements(bus, scan):
        if pub.version == version:
            return pub
    return None


async def announcements(bus: Bus, scan: int):
    """The announcements that decode among the last `scan` messages of WEIGHTS, newest first."""
    s = bus.subjects
    raw = await bus.get_last(s.weights_stream, s.weights_published)
    seq = raw.seq if raw is not None else 0
    for _ in range(scan):
        if raw is not None and raw.subject == s.weights_published:
            with contextlib.suppress(MalformedMessage):
                yield decode(raw.data or b"", WeightsPublished)
        seq -= 1
        if seq < 1:
            return
        raw = await bus.get_msg(s.weights_stream, seq)


class VersionBound:
    """The newest weight version the trainer has published, as far as this service knows:
    re-read from WEIGHTS when a message names a newer one (its announcement may still be on the
    way). A version is plausible when 0 <= version <= the bound. A broker that does not answer
    leaves the bound where it was (the check then errs on the side of refusing)."""

    def __init__(self, bus: Bus):
        self.bus = bus
        self.value = 0

    async def refresh(self) -> int:
        try:
            self.value = max(self.value, await last_published_version(self.bus, at_least=self.value + 1))
        except (TimeoutError, TransportError, OSError) as e:
            log.warning("could not read the newest published weight version (%s)", type(e).__name__)
        return self.value

    async def allows(self, version: int) -> bool:
        if version > self.value:
            await self.refresh()
        return 0 <= version <= self.value
