"""Weight-sync service: the only writer of the engines' weight version.

Consumes: WeightsPublished from WEIGHTS (durable pull consumer "weight-sync"). When several
  versions are waiting, only the newest is applied (the others are acknowledged unapplied).
  Only what the trainer published is loaded: a version newer than the live one, pointing at the
  run's own complete snapshot whose digest is the announced one - <run_dir>/weights/v<N>
  (--update-weight-transfer-mode disk) or nats-object://<the run's weights bucket>/v<N>
  (object-store); anything else (a forged version, a snapshot elsewhere or altered) is
  dead-lettered and never loaded. In distributed mode the trainer broadcasts the tensors
  itself (services/weightsync/distributed.py); the announcement must carry their digest.
Produces: WeightsLive on `weights.live` and KV `live_version`: the staleness clock.
Per update, on every engine concurrently: stage_weights(snapshot) while it generates (built-in
  engines: fetch and load beside the running weights) -> pause_generation(--pause-generation-mode)
  -> flush_cache -> update_weights_from_disk(snapshot, weight_version) (a staged engine only swaps)
  -> continue_generation, then the version is read back from /model_info. A failed engine update
  is retried; a persistent failure fails the service loudly (the message is redelivered after restart).
HTTP: /status shows the live version, the engines, the last update's duration and the pauses.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import time
from pathlib import Path

from asyncrl_proto import (
    AdapterPublished,
    EngineSwitch,
    WeightsLive,
    WeightsPublished,
    encode,
)
from services.common import crash
from services.common.bus import TransportError, fetch_some, keep_alive, settle
from services.common.config import AsyncSection, MultiLoraSection, RolloutSection
from services.common.promexport import LATENCY_BUCKETS_S
from services.common.repeats import Repeats
from services.common.runtime import Service
from services.common.sglang_client import EngineError, FlushRefused, SGLangClient
from services.common.snapshot import COMPLETE_MARKER, is_complete, resolved, version_number
from services.common.versions import VersionBound, published_announcement
from services.weights.store import WeightStore, WeightStoreError
from services.weightsync.adapters import AdapterSync
from services.weightsync.distributed import DistributedUpdater, TransferFailed, VersionGone

log = logging.getLogger(__name__)

UPDATE_DEADLINE_S = 120.0
"""An engine that takes a version for this long (a restarting one comes back within it) fails us."""
CONVERGE_EVERY_S = 5.0
"""While idle, every engine is checked this often: on the live version, and generating."""


class WeightSyncService(Service):
    name = "weight-sync"
    reads = (RolloutSection, AsyncSection, MultiLoraSection)
    histograms = {
        "weight_sync/pause_seconds": ("Seconds one engine spent paused for one weight update (pause call to "
                                      "continue answered)", LATENCY_BUCKETS_S),
        "weight_sync/update_seconds": ("Seconds one weight update took on every engine, from taking the "
                                       "published version to the last engine continued", LATENCY_BUCKETS_S),
    }  # fmt: skip

    def __init__(self, config, bus, **kw):
        super().__init__(config, bus, **kw)
        config = self.config  # its own sections from here on (services.common.config.view)
        self.client = SGLangClient(config.infra.rollout_engine_urls, api_key=self.engine_token)
        self.live_version: int | None = None
        self.last_update_s = 0.0
        self.num_updates = 0
        self.num_skipped = 0
        self.published = VersionBound(bus)
        self.repeats = Repeats(log)
        self._psub = None
        self.store = WeightStore(bus) if config.async_.update_weight_transfer_mode == "object-store" else None
        self.pauses: collections.deque[float] = collections.deque(maxlen=1000)
        """Seconds each engine spent paused per update (pause call to continue answered), newest last."""
        self.last_phases: dict[str, dict[str, float]] = {}
        """Per engine: seconds of each phase of its last update (stage, pause, flush, load, continue, verify)."""
        self._windows: dict[str, EngineSwitch] = {}
        """Per engine: its pause in the update in progress (WeightsLive.switched)."""
        self._took: list[str] = []
        """The engines that took the update in progress."""
        self.distributed = (
            DistributedUpdater(bus, self.client, config.infra.run_id, config.async_.update_weight_buffer_size,
                               config.async_.pause_generation_mode, on_pause=self._paused,
                               flush_timeout_s=config.async_.flush_cache_timeout_s)
            if config.async_.update_weight_transfer_mode == "distributed" else None
        )  # fmt: skip
        self.adapters = None
        """Multi-LoRA: adapter versions onto the engines, without a pause (services/weightsync/adapters.py)."""
        if config.multi_lora.n_adapters > 0:
            store = self.store or (WeightStore(bus) if config.adapter_transfer_mode == "object-store" else None)
            self.adapters = AdapterSync(bus, self.client, config.infra.run_dir, self.background, store)
        self._asub = None
        self.live_digest: str | None = None
        """distributed: the tensor digest of the version this process made live (a catch-up load checks it)."""

    async def setup(self) -> None:
        live = await self.bus.kv_get("live_version", WeightsLive)
        if live is not None and not await self.published.allows(live.version):
            # derived state is checked like a message: a live version nobody published (a forged
            # or corrupt KV value) would make every real version look applied already
            log.error("KV live_version names v%d, which the trainer never published (newest v%d): ignored",
                      live.version, self.published.value)  # fmt: skip
            live = None
        if live is not None:
            self.live_version, self.live_digest = live.version, live.tensor_sha256 or None
        else:
            self.live_version = await self._engine_version()
            await self._announce(self.live_version, 0.0)
        consumers = self.bus.subjects.consumers(self.config.async_.prompt_ack_wait_s)
        self._psub = await self.bus.consume(consumers["weight-sync"])
        if self.adapters is not None:
            self._asub = await self.bus.consume(consumers["weight-sync-adapters"])
            await self.adapters.recover()
        await self._catch_up()
        await self._converge()
        log.info("weight-sync ready: engines %s at version %s", self.client.urls, self.live_version)

    async def teardown(self) -> None:
        if self.distributed is not None and self.distributed.join is not None:
            with contextlib.suppress(TransferFailed, EngineError, OSError):
                await self.distributed.leave()
        await self.client.close()

    def _paused(self, seconds: float, url: str) -> None:
        self.pauses.append(seconds)
        self.observe("weight_sync/pause_seconds", seconds)
        now = time.time()  # the engine's pause, for its EngineSwitch when the version goes live
        self._windows[url] = EngineSwitch(engine=url, paused_at=now - seconds, resumed_at=now)

    async def _engine_version(self, timeout_s: float = 120.0) -> int:
        versions = set()
        for url in self.client.urls:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    versions.add(version_number((await self.client.model_info(url)).get("weight_version")))
                    break
                except EngineError as e:
                    if time.monotonic() > deadline:
                        raise EngineError(
                            f"engine {url} did not answer /model_info within {timeout_s:.0f}s: {e}"
                        ) from e
                    log.info("waiting for engine %s (%s)", url, type(e).__name__)
                    await asyncio.sleep(1.0)
        if len(versions) != 1:
            log.warning("engines disagree on their weight version: %s; taking the lowest", versions)
        return min(versions)

    def loops(self):
        adapters = {"apply_adapters": self._apply_adapters} if self.adapters is not None else {}
        return {"apply_updates": self._apply_updates, **adapters}

    async def _apply_adapters(self) -> None:
        """Multi-LoRA: each announced adapter version onto every engine, in stream order; a bad one
        is dead-lettered, one an engine refused is redelivered (the engines' 400 is logged)."""
        next_converge = time.monotonic() + CONVERGE_EVERY_S
        while True:
            for m in await fetch_some(self._asub, 16, 1.0):
                if (pub := await self.bus.decode_or_dead_letter(m, AdapterPublished, jetstream=True)) is None:
                    continue
                if (problem := await self.adapters.problem(pub)) is not None:
                    await self.bus.dead_letter_msg(m, problem)
                    continue
                try:
                    async with keep_alive(m):
                        await self.adapters.apply(pub)
                except EngineError as e:
                    if "Failed to load LoRA adapter" in str(e):  # the adapter itself is refused: it never loads
                        await self.bus.dead_letter_msg(m, f"adapter {pub.name} v{pub.version}: {e}")
                        continue
                    log.warning("adapter %s v%d did not load on every engine (%s): it comes back", pub.name,
                                pub.version, e)  # fmt: skip
                    continue  # not acknowledged: redelivered after the ack wait
                await settle(m)
            if time.monotonic() >= next_converge:
                await self.adapters.converge()
                next_converge = time.monotonic() + CONVERGE_EVERY_S

    async def _catch_up(self) -> None:
        """The newest version the trainer published, when it is newer than the live one, loaded
        from its announcement on WEIGHTS: the engines converge to the newest version whether or not
        this service consumed its message (lost, taken by another consumer, or acknowledged by a
        weight-sync that died before it went live). An announcement that is not the trainer's
        snapshot is refused as a consumed one is."""
        newest = await self.published.refresh()
        if self.live_version is not None and newest <= self.live_version:
            return
        try:
            pub = await published_announcement(self.bus, newest)
        except (TimeoutError, TransportError, OSError) as e:
            log.info("catching up to v%d: WEIGHTS not read now (%s)", newest, type(e).__name__)
            return
        if pub is None:
            return
        if (problem := await self._snapshot_problem(pub)) is not None:
            self.repeats.say("catch-up", f"catching up to v{newest}: {problem}")
            return
        self.repeats.say("catch-up", f"the newest published version v{newest} is not live (live v{self.live_version}) "
                                     "and no message of it came: loading it")  # fmt: skip
        await self._update(pub)
        self.repeats.clear("catch-up")

    async def _converge(self) -> None:
        """Every engine generates, on the live version at least. An engine restarted elsewhere
        comes back with its launch weights; a weight-sync killed between pause and continue left
        engines paused. Loads the live snapshot into an engine behind it, continues the rest
        (idempotent). An engine ahead of the live version runs weights the trainer published
        whose announcement is still due (their message comes back): it is left as it is; one on a
        version nobody published (set through its HTTP API) is brought back to the live one.
        Distributed mode: the engines behind take the live version again by broadcast (every engine
        is in each broadcast), once every engine answers (the catch-up waits for one that does not)."""
        live = self.live_version or 0
        behind, away = [], []
        for url in self.client.urls:
            try:
                got = (await self.client.model_info(url)).get("weight_version")
                if not await self._behind(got, live):
                    await self.client.continue_generation(url)
                elif self.distributed is not None:
                    behind.append((url, got))
                else:
                    path = self._snapshot_uri(live)
                    self.repeats.say(url, f"engine {url} runs weight version {got}, behind the live v{live}: loading {path}")
                    await self._update_engine(url, path, live, self.config.async_.pause_generation_mode)
                    self.repeats.clear(url)
            except EngineError as e:
                away.append(url)
                log.info("engine %s did not converge now (%s); again in %.0fs", url, e, CONVERGE_EVERY_S)
        if behind and not away:
            log.warning("engines %s run versions behind the live v%d: broadcasting it again", behind, live)
            try:
                await self.distributed.update(live, self.live_digest)
            except (TransferFailed, VersionGone, EngineError, OSError) as e:
                log.info("catching up to v%d failed now (%s); again in %.0fs", live, e, CONVERGE_EVERY_S)

    async def _behind(self, got, live: int) -> bool:
        """An engine reporting `got` must take the live version again: it is behind it, on a
        version nobody published, or `loading-<N>` (a distributed broadcast cut off inside the
        pause: an SGLang server may hold part of it)."""
        v = version_number(got)
        return str(got).startswith("loading-") or v < live or not await self.published.allows(v)

    async def _apply_updates(self) -> None:
        next_converge = time.monotonic() + CONVERGE_EVERY_S
        while True:
            msgs = await fetch_some(self._psub, 64, 1.0)
            if not msgs:
                if time.monotonic() >= next_converge:
                    await self._catch_up()
                    await self._converge()
                    next_converge = time.monotonic() + CONVERGE_EVERY_S
                continue
            fresh = []  # (published, msg) newer than live, in stream order
            for m in msgs:
                if (pub := await self.bus.decode_or_dead_letter(m, WeightsPublished, jetstream=True)) is None:
                    continue
                if self.live_version is not None and pub.version <= self.live_version:
                    self.num_skipped += 1  # a redelivery of a version already live (or superseded)
                    await settle(m)
                    continue
                if not 0 <= pub.step < self.config.rollout.total_steps:
                    await self.bus.dead_letter_msg(m, f"weights v{pub.version} name step {pub.step}, outside the run's "
                                          f"{self.config.rollout.total_steps} steps")  # fmt: skip
                    continue
                fresh.append((pub, m))
            fresh.sort(key=lambda pm: pm[0].version)
            # only the newest version whose snapshot is the trainer's is loaded; older ones are
            # superseded (never loaded), and a message whose snapshot is not the trainer's is refused
            while fresh and (problem := await self._snapshot_problem(fresh[-1][0])) is not None:
                await self.bus.dead_letter_msg(fresh.pop()[1], problem)
            if fresh:
                async with keep_alive(fresh[-1][1]):
                    await self._update(fresh[-1][0])
            self.num_skipped += max(0, len(fresh) - 1)
            for _, m in fresh:
                await settle(m)

    def _snapshot_uri(self, version: int) -> str:
        if self.store is not None:
            return self.store.uri(version)
        return str(Path(self.config.infra.run_dir) / "weights" / f"v{version}")

    async def _snapshot_problem(self, pub: WeightsPublished) -> str | None:
        """The snapshot must be the run's own (<run_dir>/weights/v<N>, or v<N> of the run's
        weights bucket), complete, and the one the trainer wrote (the digest in its marker
        equals the announced one). Distributed: the tensors come from the trainer itself, and
        the announcement must carry their digest (the engines check what they receive)."""
        if self.distributed is not None:
            if len(pub.tensor_sha256) != 64 or not all(ch in "0123456789abcdef" for ch in pub.tensor_sha256):
                return f"weights v{pub.version} carry no tensor digest (tensor_sha256), which distributed mode needs"
            return None
        if self.store is not None:
            if pub.uri != self.store.uri(pub.version):
                return f"weights v{pub.version} point at {pub.uri!r:.200}, not the run's {self.store.uri(pub.version)}"
            try:
                manifest = await self.store.manifest(pub.version)
            except WeightStoreError as e:
                return f"weights v{pub.version}: {e}"
            if manifest is None:
                return f"weights v{pub.version}: the object store has no complete snapshot of it"
            digest = manifest.get("sha256")
        else:
            path = resolved(pub.uri)
            expected = (Path(self.config.infra.run_dir) / "weights" / f"v{pub.version}").resolve()
            if path is None or path != expected:
                return f"weights v{pub.version} point at {pub.uri!r:.200}, not the run's {expected}"
            if not is_complete(path):
                return f"weights v{pub.version}: the snapshot {path} is missing or incomplete"
            try:
                digest = json.loads((path / COMPLETE_MARKER).read_text()).get("sha256")
            except (OSError, ValueError):
                digest = None
        if not pub.sha256 or digest != pub.sha256:
            return f"weights v{pub.version}: the snapshot's digest differs from the announced one"
        return None

    async def _update(self, pub: WeightsPublished) -> None:
        """Load `pub` into every engine and announce it; nothing is announced when its snapshot
        was deleted before every engine had it (the trainer keeps its newest snapshots only: a
        newer version replaced it, and that one is applied next)."""
        t0 = time.perf_counter()
        mode = self.config.async_.pause_generation_mode
        self._took, self._windows = [], {}
        loaded = await (self._update_distributed(pub) if self.distributed is not None else self._update_each(pub, mode))
        if not loaded:
            return
        self.last_update_s = time.perf_counter() - t0
        self.num_updates += 1
        self.observe("weight_sync/update_seconds", self.last_update_s)
        pause_s = max(list(self.pauses)[-len(self.client.urls) :], default=0.0)
        crash.point("weight-sync", "continued_before_announce")
        await self._announce(pub.version, self.last_update_s, pause_s)
        log.info("engines now at weight version %d (%.3fs, paused %.3fs, %s)", pub.version, self.last_update_s,
                 pause_s, mode)  # fmt: skip

    async def _update_each(self, pub: WeightsPublished, mode: str) -> bool:
        """Disk and object-store: each engine loads the snapshot on its own; an engine that fails
        loads again (one restarting), until the deadline. An engine that keeps refusing to flush
        its cache is left on its old version (FlushRefused). False when the snapshot is gone, or
        when no engine took it."""
        pending = list(self.client.urls)
        abandoned: set[str] = set()
        deadline, delay = time.monotonic() + UPDATE_DEADLINE_S, 1.0
        while True:
            results = await asyncio.gather(
                *(self._update_engine(url, pub.uri, pub.version, mode) for url in pending), return_exceptions=True
            )
            failed = [(url, r) for url, r in zip(pending, results, strict=True) if isinstance(r, BaseException)]
            if unforeseen := [r for _, r in failed if not isinstance(r, (EngineError, OSError))]:
                raise unforeseen[0]
            for url, r in failed:
                if isinstance(r, FlushRefused):  # abandoned there: it runs its old version, convergence retries
                    log.error("weights v%d abandoned on %s: %s; it resumes on its old version, and is brought to "
                              "the live version by a later update", pub.version, url, r)  # fmt: skip
                    abandoned.add(url)
            failed = [(url, r) for url, r in failed if not isinstance(r, FlushRefused)]
            if not failed:
                return len(abandoned) < len(self.client.urls)  # live only where an engine runs it
            if await self._snapshot_problem(pub) is not None:
                log.warning("weights v%d: the snapshot is gone before %s took it; a newer version is next",
                            pub.version, [url for url, _ in failed])  # fmt: skip
                return False
            if time.monotonic() > deadline:  # an engine that stays away fails the service loudly
                raise failed[0][1]
            pending = [url for url, _ in failed]
            log.warning("weight update to v%d failed on %s (%s), retrying", pub.version, pending, failed[0][1])
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _update_distributed(self, pub: WeightsPublished) -> bool:
        """Every engine to `pub` by broadcast, retried (the group formed again) until the deadline;
        False when the trainer no longer has it (a newer version is next)."""
        deadline, delay = time.monotonic() + UPDATE_DEADLINE_S, 1.0
        while True:
            try:
                if not await self.distributed.update(pub.version, pub.tensor_sha256):
                    return False
                for url in self.client.urls:
                    got = (await self.client.model_info(url)).get("weight_version")
                    if str(got) != str(pub.version):
                        raise EngineError(f"{url} reports weight_version {got!r} after receiving v{pub.version}")
                self.live_digest = pub.tensor_sha256
                self._took = list(self.client.urls)
                return True
            except (TransferFailed, VersionGone, EngineError, OSError) as e:
                if time.monotonic() > deadline:
                    raise
                log.warning("distributed update to v%d failed (%s), forming the group again", pub.version, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _update_engine(self, url: str, uri: str, version: int, mode: str) -> None:
        """Stage the snapshot while the engine generates (built-in engines), then Miles's disk
        sequence: pause; flush the prefix cache unless requests stay resident (in_place), so no
        new request reuses KV computed with the old weights; load with flush_cache false (SGLang
        asserts a flush that finds resident requests) - a staged engine only swaps; continue."""
        laps = [("", time.perf_counter())]  # (phase, when it ended)

        def lap(name: str) -> None:
            laps.append((name, time.perf_counter()))

        await self.client.stage_weights(url, uri, str(version))
        lap("stage")
        t0 = laps[-1][1]
        await self.client.pause(url, mode)
        lap("pause")
        crash.point("weight-sync", "paused")
        try:
            if mode != "in_place":  # in_place keeps requests resident: their cache stays theirs
                await self.client.flush_cache_within(url, self.config.async_.flush_cache_timeout_s)
            lap("flush")
            await self.client.update_weights_from_disk(url, uri, str(version), flush_cache=False)
            lap("load")
            crash.point("weight-sync", "loaded_before_continue")
        finally:
            await self.client.continue_generation(url)
            lap("continue")
            self._paused(time.perf_counter() - t0, url)
        got = (await self.client.model_info(url)).get("weight_version")
        lap("verify")
        self.last_phases[url] = {k: round(b - a, 4) for (_, a), (k, b) in itertools.pairwise(laps)}
        if str(got) != str(version):
            raise EngineError(f"{url} reports weight_version {got!r} after loading v{version}")
        self._took.append(url)

    async def _announce(self, version: int, duration_s: float, pause_s: float = 0.0) -> None:
        self.live_version = version
        took, self._took = self._took, []
        windows, self._windows = self._windows, {}
        live = WeightsLive(
            switched=[windows[u] for u in took if u in windows],  # the engines that took it, with their pauses
            version=version,
            engines=list(self.client.urls),
            updated_at=time.time(),
            pause_mode=self.config.async_.pause_generation_mode,
            duration_s=duration_s,
            pause_s=pause_s,
            tensor_sha256=self.live_digest or "",
        )
        await self.bus.kv_put("live_version", encode(live))
        await self.bus.publish_durably([(self.bus.subjects.weights_live, live, None)], f"live version {version}")

    def status(self) -> dict:
        return {
            "live_version": self.live_version,
            "engines": self.client.urls,
            "pause_mode": self.config.async_.pause_generation_mode,
            "last_update_s": self.last_update_s,
            "transfer_mode": self.config.async_.update_weight_transfer_mode,
            "last_pause_s": self.pauses[-1] if self.pauses else 0.0,
            "last_update_phases_s": self.last_phases,
            "pauses_s": list(self.pauses)[-100:],
            "num_updates": self.num_updates,
            "num_skipped_versions": self.num_skipped,
            "num_rejected": sum(self.bus.dead_lettered.values()),
        } | ({"adapters_live": {n: a.engine_name for n, a in self.adapters.live.items()}}
             if self.adapters is not None else {})  # fmt: skip

    def metric_values(self) -> dict[str, float]:
        return {
            "weight_sync/live_version": self.live_version if self.live_version is not None else -1,
            "weight_sync/last_update_seconds": self.last_update_s,
            "weight_sync/last_pause_seconds": self.pauses[-1] if self.pauses else 0.0,
            "weight_sync/updates_total": self.num_updates,
            "weight_sync/skipped_versions_total": self.num_skipped,
            "weight_sync/rejected_total": sum(self.bus.dead_lettered.values()),
        } | ({"weight_sync/adapters_live": len(self.adapters.live),
              "weight_sync/adapter_versions_loaded_total": self.adapters.num_loaded}
             if self.adapters is not None else {})  # fmt: skip
