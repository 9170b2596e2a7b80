"""The consuming side of the bus: taking messages from a pull consumer or a push subscription
as they come, keeping a long-held JetStream message ours, and settling it."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging

import nats.errors
import nats.js.errors

log = logging.getLogger(__name__)


async def fetch_some(psub, batch: int, timeout_s: float) -> list:
    """Up to `batch` messages, returned as soon as at least one is there.

    nats-py's fetch(batch) waits, once the stream is drained, until `batch` messages arrived or
    the timeout passed: under a trickle that adds up to `timeout_s` of latency to every message.
    So: wait for one message, then take whatever else is ready with a no-wait fetch. Returns []
    on a timeout, and while the connection is down (the consumer lives on the server and resumes
    after the reconnect)."""
    try:
        msgs = await psub.fetch(1, timeout=timeout_s)
    except (TimeoutError, nats.errors.TimeoutError):
        return []
    except nats.errors.ConnectionClosedError:
        raise  # closed by us (nats-py also turns a cancellation into this): stop, never loop
    except (nats.errors.Error, nats.js.errors.Error, OSError) as e:
        log.warning("fetch failed (%s); retrying after the reconnect", type(e).__name__)
        await asyncio.sleep(0.5)
        return []
    if batch > 1:
        try:
            msgs += await psub.fetch(batch - 1, timeout=0.002)
        except nats.errors.ConnectionClosedError:
            raise
        except (TimeoutError, nats.errors.Error, nats.js.errors.Error, OSError):
            pass  # nothing else ready (a late delivery is picked up by the next fetch), or the connection is down
    return msgs


async def next_batch(sub, batch: int, timeout_s: float) -> list:
    """From a push subscription: wait for one message, then take what is already queued."""
    try:
        msgs = [await sub.next_msg(timeout=timeout_s)]
    except (TimeoutError, nats.errors.TimeoutError):
        return []
    while len(msgs) < batch and sub.pending_msgs > 0:
        try:
            msgs.append(await sub.next_msg(timeout=0.01))
        except (TimeoutError, nats.errors.TimeoutError):
            break
    return msgs


@contextlib.asynccontextmanager
async def keep_alive(msg, every_s: float = 3.0):
    """in_progress() on a JetStream message every `every_s` while the body runs: work longer than
    the consumer's ack wait (a weight load) keeps the message, and a short ack wait still returns
    the message of a process that died quickly."""

    async def tick() -> None:
        while True:
            await asyncio.sleep(every_s)
            await settle(msg, Settle.IN_PROGRESS)

    task = asyncio.ensure_future(tick())
    try:
        yield
    finally:
        task.cancel()


class Settle(str, enum.Enum):
    """How a consumed JetStream message is settled (each value names the message's method)."""

    ACK = "ack"  # done: never redelivered
    NAK = "nak"  # redeliver (after `delay`)
    TERM = "term"  # refused: never redelivered
    IN_PROGRESS = "in_progress"  # still ours: its ack wait starts again


async def settle(msg, how: Settle = Settle.ACK, **kw) -> None:
    """Settle a message in a way that never fails the caller: a lost acknowledgement only means
    a redelivery, which every consumer recognises."""
    try:
        await getattr(msg, how.value)(**kw)
    except (TimeoutError, nats.errors.Error, nats.js.errors.Error, OSError) as e:
        log.warning("%s failed (%s); the message will be redelivered", how.value, type(e).__name__)
