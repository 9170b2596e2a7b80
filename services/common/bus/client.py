"""One service's connection to the NATS bus: a thin wrapper over nats-py (services/common/bus/__init__.py)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import logging
import time
from typing import Any, TypeVar
from urllib.parse import urlsplit

import nats
import nats.errors
import nats.js.errors
from nats.js import api

from asyncrl_proto import DeadLetter, decode, encode
from asyncrl_proto.codec import MalformedMessage
from asyncrl_proto.subjects import ROLLOUTS_MAX_MSGS, ConsumerSpec, Subjects, inbox_prefix
from services.common.bus.consume import Settle, settle
from services.common.bus.errors import (
    STORE_FULL_CODES,
    STREAM_EXISTS_DIFFERENTLY,
    BusError,
    SequenceConflict,
    StreamFull,
    StreamSetupError,
    fatal_connect_error,
    raise_if_final,
    through_outage,
)
from services.common.bus.objects import ObjectStore
from services.common.natsauth import SERVICE_ROLES
from services.common.secrets import NatsCredentials, url_credentials

log = logging.getLogger(__name__)
T = TypeVar("T")

DEAD_LETTER_DATA_BYTES = 64 * 1024
"""A dead letter keeps this much of the message (and its size and digest): one near the payload
limit would not fit inside another."""


class Bus:
    """One NATS connection of one service, bound to one run."""

    def __init__(self, nc: nats.NATS, subjects: Subjects, service: str):
        self.nc = nc
        self.js = nc.jetstream(timeout=10.0)
        self.subjects = subjects
        self.service = service
        self._kv = None
        self._kv_bad: set[tuple[str, int]] = set()
        """(key, revision) of the KV values a typed read found undecodable: each logged once."""
        self.closing = False
        self.refused: nats.js.errors.APIError | None = None
        """The last JetStream API error the server answered an async publish with."""
        self._refused = asyncio.Event()  # replaced at each refusal: every batch then waiting wakes
        self.dead_lettered: collections.Counter[str] = collections.Counter()
        """Messages this process dead-lettered, by the subject they came on."""
        self.objects = ObjectStore(self.js)
        """The run's object-store buckets (put, delete, list: services/common/bus/objects.py)."""

    @classmethod
    async def connect(
        cls, url: str, run_id: str, service: str, connect_timeout_s: float = 30.0, creds: NatsCredentials | None = None
    ) -> Bus:
        """Connect as `service`'s role (its NATS identity, by default from the environment; see
        services.common.secrets). A server that is not up yet is waited for up to
        connect_timeout_s; refused credentials or a TLS failure raise BusError at once, naming
        the cause (retrying cannot fix them)."""
        role = service if service in SERVICE_ROLES else "admin"
        url, in_url = url_credentials(url)
        if creds is None:
            creds = NatsCredentials.from_env(role)
            if in_url and not (creds.user or creds.token or creds.creds_file or creds.nkey_file):
                creds = dataclasses.replace(creds, **in_url)
        bus: Bus | None = None  # the callbacks read it once it exists (None: still connecting)

        async def on_error(e: Exception) -> None:
            if bus is None and (fatal := fatal_connect_error(e, url, creds, service)):
                raise fatal  # out of nats.connect(): wrong credentials never succeed on a retry
            if isinstance(e, nats.js.errors.APIError) and bus is not None:
                # nats-py turns an error answer to an async publish into an exception inside its
                # reply handler, which reaches us here while the publish's future never resolves
                bus.refused, refused = e, bus._refused
                bus._refused = asyncio.Event()
                refused.set()
            level = logging.ERROR if "permissions violation" in str(e).lower() else logging.WARNING
            log.log(level, "nats (%s): %s", service, e)

        async def on_disconnect() -> None:
            if bus is None or not bus.closing:
                log.warning("nats (%s): disconnected, reconnecting", service)

        async def on_reconnect() -> None:
            log.info("nats (%s): reconnected", service)

        deadline = time.monotonic() + connect_timeout_s
        tls = {"tls_hostname": urlsplit(url.split(",")[0]).hostname} if creds.uses_tls else {}
        while True:
            try:
                nc = await nats.connect(
                    [u.strip() for u in url.split(",")],  # a cluster: every node's URL
                    name=f"asyncrl-{run_id}-{service}",
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    error_cb=on_error,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                    connect_timeout=2,
                    allow_reconnect=True,
                    inbox_prefix=inbox_prefix(run_id, role),
                    **tls,
                    **creds.connect_kwargs(),
                )
                break
            except (TimeoutError, OSError, nats.errors.NoServersError) as e:  # not up yet
                if (fatal := fatal_connect_error(e, url, creds, service)) is not None:
                    raise fatal from None
                if time.monotonic() > deadline:
                    raise BusError(
                        f"cannot connect to NATS at {url} within {connect_timeout_s:.0f}s: {e}. "
                        "Is the server running (or drop --nats-url to use the embedded one)?"
                    ) from e
                log.info("waiting for NATS at %s (%s)", url, e)
                await asyncio.sleep(0.5)
        bus = cls(nc, Subjects(run_id=run_id), service)
        return bus

    async def close(self) -> None:
        self.closing = True
        if not self.nc.is_closed:
            # flush what we published, then close; no drain: unacknowledged messages are
            # redelivered anyway, and drain waits for pull subscriptions that no one reads
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError, OSError):
                await self.nc.flush(timeout=2)
            with contextlib.suppress(OSError):  # a server gone already (a run that ended): nothing to close
                await self.nc.close()

    # ---- setup -----------------------------------------------------------------------------
    async def ensure_streams(self, replicas: int = 1, partitioned: bool = False,
                             rollouts_max_msgs: int = ROLLOUTS_MAX_MSGS) -> None:  # fmt: skip
        """Create (or update) every stream of the run, its KV bucket and its weights object bucket, each with `replicas`
        copies on a JetStream cluster (--nats-replicas; the run's consumers inherit it).
        Idempotent; needs the admin role (the launcher, `asyncrl init-run`): services only use
        what exists."""
        enums = {"retention": api.RetentionPolicy, "storage": api.StorageType, "discard": api.DiscardPolicy}
        for spec in self.subjects.stream_specs(partitioned, rollouts_max_msgs):
            spec = spec | {key: enum(spec[key]) for key, enum in enums.items()}
            cfg = api.StreamConfig(**spec, num_replicas=replicas)
            await through_outage(lambda cfg=cfg: self._add_or_update_stream(cfg), cfg.name, 120.0, "create")
        bucket = self.subjects.kv_bucket
        try:
            self._kv = await self.js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            # direct gets by key: a role's permissions then name the keys it may read
            cfg = api.KeyValueConfig(bucket=bucket, history=1, storage=api.StorageType.FILE, direct=True,
                                     replicas=replicas)  # fmt: skip
            self._kv = await self.js.create_key_value(config=cfg)
        try:
            await self.js.object_store(self.subjects.weights_bucket)
        except nats.js.errors.BucketNotFoundError:
            cfg = api.ObjectStoreConfig(storage=api.StorageType.FILE, replicas=replicas,
                                        description="weight snapshots (--update-weight-transfer-mode object-store)")  # fmt: skip
            await self.js.create_object_store(self.subjects.weights_bucket, config=cfg)

    async def _add_or_update_stream(self, cfg) -> None:
        """A cluster that is still forming answers with a timeout, 503 or "insufficient
        resources" (no quorum yet): the caller retries those. Any other refusal is final and
        says why (e.g. --nats-replicas 3 on a server that is not a cluster)."""
        try:
            try:
                await self.js.add_stream(cfg)
            except nats.js.errors.BadRequestError as e:
                if e.err_code != STREAM_EXISTS_DIFFERENTLY:
                    raise
                await self.js.update_stream(cfg)
        except nats.js.errors.APIError as e:
            if isinstance(e, nats.js.errors.ServiceUnavailableError) or e.err_code in STORE_FULL_CODES:
                raise  # retried
            raise StreamSetupError(f"NATS refused the stream {cfg.name}: {e.description} (code {e.err_code})") from e

    async def ensure_consumers(self, prompt_ack_wait_s: float, partitioned: bool = False) -> None:
        """Create (or update) the run's durable consumers (asyncrl_proto.subjects.consumers); the
        admin does this, the services only bind to them."""
        for spec in self.subjects.consumers(prompt_ack_wait_s, partitioned).values():
            await self.js.add_consumer(spec.stream, config=_consumer_config(spec))

    async def consume(self, spec: ConsumerSpec):
        """Bind to one of the run's durable consumers: a push subscription when it delivers to an
        inbox, else a pull subscription. (Created here only when missing and this identity may.)"""
        if spec.deliver_subject:
            return await self.js.subscribe(spec.filter_subject, durable=spec.durable, stream=spec.stream,
                                           manual_ack=True, config=_consumer_config(spec),
                                           pending_msgs_limit=spec.max_ack_pending * 2)  # fmt: skip
        return await self.js.pull_subscribe(spec.filter_subject, durable=spec.durable, stream=spec.stream,
                                            config=_consumer_config(spec))  # fmt: skip

    async def kv(self):
        """The run's KV bucket (resolved config, live version, service state); BusError when
        the run was never prepared (`asyncrl init-run` or the launcher creates it)."""
        if self._kv is None:
            try:
                self._kv = await self.js.key_value(self.subjects.kv_bucket)
            except nats.js.errors.BucketNotFoundError:
                raise BusError(
                    f"the run {self.subjects.run_id} has no KV bucket {self.subjects.kv_bucket}: prepare it with "
                    "`asyncrl init-run` (or start it with `asyncrl train-async`)"
                ) from None
        return self._kv

    async def kv_get(self, key: str, kind: type | None = None) -> Any:
        """A key's value; None when it does not exist. With `kind`: the value decoded as one,
        None too when it holds anything else (logged: a corrupt or forged value is not fatal)."""
        raw, revision = await self.kv_entry(key)
        try:
            return decode(raw, kind) if kind is not None and raw is not None else raw
        except MalformedMessage as e:
            if (key, revision) not in self._kv_bad:  # read again every few seconds by some: said once
                self._kv_bad.add((key, revision))
                log.error("KV %s holds no %s, ignored (%s)", key, kind.__name__, e)
            return None

    async def kv_entry(self, key: str) -> tuple[bytes | None, int]:
        """(value, revision) of a key from one read; (None, 0) when it does not exist (or was deleted)."""
        kv = await self.kv()
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:  # a deleted key's tombstone reads as not found too
            return None, 0
        return entry.value, entry.revision

    async def kv_update(self, key: str, value: bytes, last_revision: int) -> int:
        """Compare-and-set: store `value` only if the key is still at `last_revision` (0: it must not
        exist, a deleted key included). The new revision; SequenceConflict when another writer
        got there first."""
        kv = await self.kv()
        try:
            if last_revision == 0:
                return await kv.create(key, value)
            return await kv.update(key, value, last=last_revision)
        except nats.js.errors.KeyWrongLastSequenceError as e:
            raise SequenceConflict(f"KV {key} moved past revision {last_revision}: another writer wrote it") from e
        except nats.js.errors.APIError as e:
            raise_if_final(e, f"KV {key}")
            raise

    async def kv_put(self, key: str, value: bytes) -> None:
        kv = await self.kv()
        try:
            await kv.put(key, value)
        except nats.js.errors.APIError as e:
            raise_if_final(e, f"KV {key}")
            raise

    # ---- messaging -------------------------------------------------------------------------
    async def publish(self, subject: str, msg: Any, msg_id: str | None = None) -> api.PubAck:
        """JetStream publish; `msg_id` dedupes retried publishes within the duplicate window."""
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        try:
            return await self.js.publish(subject, encode(msg), headers=headers)
        except nats.js.errors.APIError as e:
            raise_if_final(e, subject)
            raise

    async def publish_batch(
        self, items: list[tuple[str, Any, str | None]], timeout_s: float = 10.0, expected_last_seq: int | None = None,
        expected_last_subject_seq: int | None = None,
    ) -> list[api.PubAck]:
        """Pipelined JetStream publishes of (subject, msg, msg_id), in order; raises BusError
        unless every one is acknowledged within timeout_s, at once when the server refuses one
        (StoreFull when its store is full). With expected_last_seq, item i is stored only if the
        stream's last sequence is expected_last_seq + i: SequenceConflict when another writer
        got in between (a retried item that was stored already is a duplicate, not a conflict).
        expected_last_subject_seq is the same for one item on its subject (the stream's sequence
        of the subject's last message): a batch of one."""
        if expected_last_subject_seq is not None and len(items) != 1:
            raise ValueError("expected_last_subject_seq holds for a batch of one item")
        refusal = self._refused
        futures = []
        for i, (subject, msg, msg_id) in enumerate(items):
            headers = {"Nats-Msg-Id": msg_id} if msg_id else {}
            if expected_last_seq is not None:
                headers["Nats-Expected-Last-Sequence"] = str(expected_last_seq + i)
            if expected_last_subject_seq is not None:
                headers["Nats-Expected-Last-Subject-Sequence"] = str(expected_last_subject_seq)
            futures.append(await self.js.publish_async(subject, encode(msg), headers=headers or None))
        if not futures:
            return []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pending, refused = set(futures), asyncio.ensure_future(refusal.wait())
        try:
            while pending and not refused.done() and (left := deadline - loop.time()) > 0:
                done, _ = await asyncio.wait(pending | {refused}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                pending -= done
        finally:
            refused.cancel()
        if not pending:
            for f in futures:
                if (e := f.exception()) is not None:
                    raise_if_final(e, items[0][0])
            return [f.result() for f in futures]
        for f in pending:
            f.cancel()
        if refusal.is_set():  # a publish was refused while these waited (maybe one of them: retry them)
            raise_if_final(self.refused, items[0][0])
            raise BusError(f"the server refused a publish on {items[0][0]}: {self.refused}")
        raise BusError(f"{len(pending)} of {len(futures)} publishes were not acknowledged within {timeout_s}s")

    async def publish_durably(self, items: list[tuple[str, Any, str | None]], what: str, deadline_s: float = 180.0,
                              expected_last_seq: int | None = None,
                              expected_last_subject_seq: int | None = None) -> list[api.PubAck]:  # fmt: skip
        """publish_batch, retried through a broker outage (msg ids make retries idempotent); gives
        up loudly after deadline_s."""
        return await through_outage(lambda: self.publish_batch(items, expected_last_seq=expected_last_seq,
                                    expected_last_subject_seq=expected_last_subject_seq), what, deadline_s)  # fmt: skip

    async def publish_core(self, subject: str, msg: Any) -> None:
        await self.nc.publish(subject, encode(msg))

    async def request(self, subject: str, msg: Any, reply_type: type[T], timeout: float) -> T:
        resp = await self.nc.request(subject, encode(msg), timeout=timeout)
        return decode(resp.data, reply_type)

    # ---- the rest of what services need of NATS: nothing outside this module touches nats-py ----
    async def subscribe(self, subject: str, cb) -> None:
        """Core NATS: `cb(msg)` for each message on `subject` (msg.subject, msg.data, msg.reply)."""
        await self.nc.subscribe(subject, cb=cb)

    async def flush(self, timeout: float = 10.0) -> None:
        """Returns once the server has everything sent so far (subscriptions included)."""
        await self.nc.flush(timeout=timeout)

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    async def stream_bounds(self, stream: str) -> tuple[int, int, int] | None:
        """(first sequence, last sequence, messages) of a stream; None when it does not exist."""
        try:
            st = (await self.js.stream_info(stream)).state
        except nats.js.errors.NotFoundError:
            return None
        return st.first_seq, st.last_seq, st.messages

    async def _get(self, stream: str, direct: bool, **kw):
        """A stored message (.subject, .data, .seq), None when there is none. A direct get that
        finds none asks the stream's leader: on a cluster any replica answers a direct get, one
        behind the leader too."""
        for d in (True, False) if direct else (False,):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                return await self.js.get_msg(stream, direct=d, **kw)
        return None

    async def get_msg(self, stream: str, seq: int, *, direct: bool = False):
        """Message `seq` of `stream`; None when deleted, purged or acknowledged on a work queue."""
        return await self._get(stream, direct, seq=seq)

    async def get_last(self, stream: str, subject: str, *, direct: bool = False):
        """The last message of `stream` on `subject`."""
        return await self._get(stream, direct, subject=subject)

    async def get_next(self, stream: str, subject: str, seq: int):
        """The first message of `stream` on `subject` at or after `seq`, by direct get."""
        return await self._get(stream, True, seq=seq, subject=subject, next=True)

    async def read_stream(self, stream: str, subject: str | None = None, deadline_s: float = 60.0,
                          only: str | None = None) -> list[bytes]:  # fmt: skip
        """Every payload still in a stream. With `subject`, read by an ephemeral consumer in large
        batches; without (a work-queue stream admits one consumer per subject), message by message,
        those on subject `only` when given. Read again from the start while the broker is away or
        the stream has no leader yet (a cluster just started), for up to deadline_s."""
        return await through_outage(lambda: self._read_stream(stream, subject, only), stream, deadline_s, "read")

    async def _read_stream(self, stream: str, subject: str | None, only: str | None = None) -> list[bytes]:
        bounds = await self.stream_bounds(stream)
        if bounds is None or not bounds[2]:  # a stream never written to has first and last 0: no message 0
            return []
        if subject is not None:
            msgs = await _pending(self.js, stream, subject, None, deliver_policy=api.DeliverPolicy.ALL)
            return [m.data for m in msgs if m.data]
        return [m.data for seq in range(bounds[0], bounds[1] + 1)
                if (m := await self.get_msg(stream, seq)) and m.data and only in (None, m.subject)]  # fmt: skip

    async def read_since(self, stream: str, subject: str, after: int = 0, limit: int = 100_000) -> list[tuple[int, bytes]]:
        """(stream sequence, payload) of the messages on `subject` after sequence `after`, at most
        `limit` of them, oldest first: an incremental reader's next batch (the dashboard)."""
        bounds = await self.stream_bounds(stream)
        if bounds is None or bounds[1] <= after:
            return []
        policy = api.DeliverPolicy.BY_START_SEQUENCE
        start = max(after + 1, bounds[0])
        msgs = await _pending(self.js, stream, subject, limit, deliver_policy=policy, opt_start_seq=start)
        return [(m.metadata.sequence.stream, m.data) for m in msgs]

    async def consumer_ack_floor(self, stream: str, durable: str) -> int:
        """The stream sequence below which the consumer `durable` has acknowledged everything."""
        return (await self.js.consumer_info(stream, durable)).ack_floor.stream_seq

    async def purge_below(self, stream: str, seq: int) -> None:
        await self.js.purge_stream(stream, seq=seq)

    async def delete_msg(self, stream: str, seq: int) -> None:
        """Delete message `seq` of `stream` (one broker round trip; a purge is cheaper for many)."""
        await self.js.delete_msg(stream, seq)

    async def get_payload(self, stream: str, seq: int) -> bytes:
        raw = await self.get_msg(stream, seq, direct=True)
        if raw is None or raw.data is None:
            raise BusError(f"message {seq} of {stream} is gone or has no payload")
        return raw.data

    async def dead_letter(self, subject: str, data: bytes, reason: str) -> bool:
        """Record a message that failed validation on DEADLETTER (its first DEAD_LETTER_DATA_BYTES,
        its size and digest, the reason), count it, log it. Never fails the caller but for a full
        store (StoreFull, which stops the run): a dead letter that cannot be stored is logged (False)."""
        target = self.subjects.deadletter(subject)
        self.dead_lettered[subject.removeprefix(self.subjects._s(""))] += 1
        log.error("dead-lettered a message from %s to %s: %s", subject, target, reason)
        letter = DeadLetter(original_subject=subject, reason=reason[:2000], data=data[:DEAD_LETTER_DATA_BYTES],
                            service=self.service, ts=time.time(), num_bytes=len(data),
                            sha256=hashlib.sha256(data).hexdigest())  # fmt: skip
        try:
            await self.publish(target, letter)
        except (TimeoutError, StreamFull, nats.errors.Error, nats.js.errors.Error, OSError) as e:
            log.error("the dead letter from %s could not be stored (%s); it is only logged", subject, e)
            return False
        return True

    async def dead_letter_msg(self, msg, reason: str) -> bool:
        """Dead-letter a JetStream message and terminate it (never redelivered); whether the
        letter was stored."""
        stored = await self.dead_letter(msg.subject, msg.data, reason)
        await settle(msg, Settle.TERM)
        return stored

    async def decode_or_dead_letter(self, msg, tp: type[T], *, jetstream: bool = False) -> T | None:
        """`msg` decoded as `tp`, or None once it is dead-lettered as undecodable (a JetStream
        message, `jetstream=True`, is also terminated: never redelivered)."""
        try:
            return decode(msg.data, tp)
        except MalformedMessage as e:
            reason = f"undecodable {tp.__name__}: {e}"
        await (self.dead_letter_msg(msg, reason) if jetstream else self.dead_letter(msg.subject, msg.data, reason))
        return None


async def _pending(js, stream: str, subject: str, limit: int | None, **deliver) -> list:
    """What an ephemeral consumer of `subject` (delivering as `deliver` says) has pending when
    made, fetched in large batches. With `limit`, at most that many, and a fetch that times out
    ends the read; without, every one, or BusError (the caller reads again)."""
    cfg = api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, inactive_threshold=30.0, **deliver)
    sub = await js.pull_subscribe(subject, stream=stream, config=cfg)
    out: list = []
    name = None
    try:
        info = await sub.consumer_info()
        name, expected = info.name, info.num_pending if limit is None else min(limit, info.num_pending)
        while len(out) < expected:
            try:
                out += await sub.fetch(min(1000, expected - len(out)), timeout=2.0)
            except TimeoutError:  # nats-py's is one too; a cluster electing a leader
                if limit is None:
                    raise BusError(f"read {len(out)} of {expected} messages of {stream}, then nothing") from None
                break  # what arrived is enough for this read; the next one continues
    finally:
        await sub.unsubscribe()
        if name is not None:  # gone now, not after its inactivity threshold: no consumer piles up
            with contextlib.suppress(Exception):
                await asyncio.wait_for(js.delete_consumer(stream, name), 1.0)
    return out


def _consumer_config(spec: ConsumerSpec) -> api.ConsumerConfig:
    return api.ConsumerConfig(
        durable_name=spec.durable,
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=spec.ack_wait_s,
        max_ack_pending=spec.max_ack_pending,
        deliver_policy=api.DeliverPolicy.ALL,
        filter_subject=spec.filter_subject,
        deliver_subject=spec.deliver_subject or None,
    )
