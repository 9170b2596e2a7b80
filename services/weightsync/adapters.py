"""Multi-LoRA: adapter versions from the trainer onto every engine, without a pause.

Consumes AdapterPublished (WEIGHTS `weights.adapters`, durable `weight-sync-adapters`). A version
newer than its adapter's live one is loaded on every engine under its engine name
(`adapter_engine_name`: the adapter, its registration and the version) with /load_lora_adapter;
then it is recorded live (KV `adapter_live.<name>`, an AdapterLive), and only then is the version
before it unloaded from every engine (the engine lets that version's requests in flight finish
first). Producers read the live version and ask for it by that name, so a request always names a
version every engine serves, and the base model never pauses for an adapter.

A version at or below the live one of the same registration is skipped (a redelivery, or one
superseded); a new registration of the same name replaces the old one's live version. The
directory must be the run's own (`<run_dir>/adapters/<name>/...`) and complete (its `.complete`
marker); with --update-weight-transfer-mode object-store the version is in the run's weights
bucket instead (`nats-object://<bucket>/adapters/<name>/<registration>/v<N>`, complete), and the
engines fetch it (built-in engines only, as for the model's weights). `converge()` loads the live versions on an engine that lacks them (restarted, or started
after them).

A registration the registry holds COMPLETED frees its engine slots: its live version is unloaded
from every engine (`release_completed`, before a new registration's first version loads and at
every converge), and a late message for it is skipped (one missing from a registry read is not
taken as completed: a read may lag). Otherwise its last version would hold one of the engines'
`--max-loras-per-batch` slots for good, and the next adapter's versions would stop loading. A
load waits for the unloads under way of its adapter and of completed registrations: the engines
hold two slots per adapter (2N), its live version and the next.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from asyncrl_proto import AdapterLive, AdapterPublished, AdapterRegistryState, encode
from asyncrl_proto.messages import AdapterState, adapter_engine_name
from asyncrl_proto.subjects import ADAPTER_LIVE_KV_PREFIX, ADAPTERS_KV_KEY
from services.common import crash
from services.common.config import adapter_name_problem
from services.common.sglang_client import EngineError, SGLangClient
from services.common.snapshot import is_complete, resolved
from services.weights.store import WeightStore, adapter_uri

log = logging.getLogger(__name__)


UNLOAD_WAIT_S = 60.0
"""The longest a load waits for the unloads under way (each waits for its version's requests)."""


def live_key(name: str) -> str:
    return f"{ADAPTER_LIVE_KV_PREFIX}.{name}"


class AdapterSync:
    def __init__(self, bus, client: SGLangClient, run_dir: str,
                 spawn: Callable[[Awaitable, str], object] | None = None, store: WeightStore | None = None):  # fmt: skip
        """spawn(coro, what): runs an unload in the background, returns its task (the service's `background`);
        store: the run's weights bucket (object-store mode), where adapter versions are."""
        self.bus = bus
        self.store = store
        self.client = client
        self.root = resolved(str(Path(run_dir) / "adapters"))
        self.live: dict[str, AdapterLive] = {}
        self._unloads: dict[str, asyncio.Future] = {}
        """Unloads under way, by engine name."""
        self.done: set[str] = set()
        """Registrations found COMPLETED: never loaded again."""
        self._spawn = spawn or (lambda coro, what: asyncio.ensure_future(coro))
        self.num_loaded = 0
        self.num_skipped = 0

    async def problem(self, pub: AdapterPublished) -> str | None:
        """Why a published adapter version must not reach an engine, or None."""
        if (why := adapter_name_problem(pub.name)) is not None:
            return why
        if pub.version < 0 or not pub.registration_id.isalnum():
            return f"adapter {pub.name}: version {pub.version} / registration {pub.registration_id!r:.40} is not one"
        if self.store is not None:
            want = adapter_uri(self.store.bucket, pub.name, pub.registration_id, pub.version)
            if pub.uri != want:
                return f"adapter {pub.name} v{pub.version}: {pub.uri!r:.200} is not the run's {want}"
            if await self.store.adapter_manifest(pub.name, pub.registration_id, pub.version) is None:
                return f"adapter {pub.name} v{pub.version}: the object store has no complete version of it"
            return None
        path = resolved(pub.uri)
        if path is None or self.root is None or not path.is_relative_to(self.root / pub.name):
            return f"adapter {pub.name} v{pub.version}: {pub.uri!r:.200} is not under the run's adapters/{pub.name}/"
        if not is_complete(path):
            return f"adapter {pub.name} v{pub.version}: {path} is not a complete adapter directory"
        return None

    async def live_of(self, name: str) -> AdapterLive | None:
        """The adapter's live version, unless its registration is done (then None: nothing of
        that name is live)."""
        if name not in self.live:
            live = await self.bus.kv_get(live_key(name), AdapterLive)
            if live is not None and live.registration_id not in self.done:
                self.live[name] = live
        return self.live.get(name)

    async def recover(self) -> None:
        """After a restart: the live versions of every adapter the registry knows (so that
        `converge` can give them back to an engine that lost them), less the completed ones."""
        reg = await self.bus.kv_get(ADAPTERS_KV_KEY, AdapterRegistryState)
        if reg is None:
            return
        for name in sorted({run.name for run in reg.runs}):
            await self.live_of(name)
        await self.release_completed(reg)

    async def release_completed(self, reg: AdapterRegistryState | None = None) -> None:
        """Note the registrations the registry holds COMPLETED; unload from every engine the live
        version of each (in the background: each engine lets its requests finish first), and
        forget it."""
        reg = reg or await self.bus.kv_get(ADAPTERS_KV_KEY, AdapterRegistryState)
        if reg is None:
            return
        self.done |= {r.registration_id for r in reg.runs if r.state is AdapterState.COMPLETED}
        for name, live in list(self.live.items()):
            if live.registration_id in self.done:
                del self.live[name]
                log.info("adapter %s is completed: unloading its version %d from the engines", name, live.version)
                self._unload_later(live.engine_name)

    async def apply(self, pub: AdapterPublished) -> bool:
        """Make `pub` the adapter's live version on every engine; False when it is not newer (of the
        same registration), or comes from an older registration of the name (a late message)."""
        if pub.registration_id in self.done:  # a late message of a completed registration
            self.num_skipped += 1
            return False
        old = await self.live_of(pub.name)
        if old is None or old.registration_id != pub.registration_id:  # a new registration: a slot was freed
            await self.release_completed()
            if pub.registration_id in self.done:
                self.num_skipped += 1
                return False
            old = await self.live_of(pub.name)
        if old is not None and (
            (old.registration_id == pub.registration_id and pub.version <= old.version)
            or (old.registration_id != pub.registration_id and pub.created_at < old.created_at)
        ):
            self.num_skipped += 1
            return False
        engine_name = adapter_engine_name(pub.name, pub.registration_id, pub.version)
        await self._unloads_done(pub.name, new_registration=old is None or old.registration_id != pub.registration_id)
        for url in self.client.urls:
            await self._load(url, engine_name, pub.uri)
        crash.point("weight-sync", "adapter_loaded_before_live")
        new = AdapterLive(name=pub.name, registration_id=pub.registration_id, version=pub.version,
                          engine_name=engine_name, uri=pub.uri, engines=list(self.client.urls),
                          created_at=pub.created_at, updated_at=time.time())  # fmt: skip
        await self.bus.kv_put(live_key(pub.name), encode(new))
        self.live[pub.name] = new
        self.num_loaded += 1
        log.info("adapter %s v%d is live on %d engine(s) from %s", pub.name, pub.version, len(self.client.urls),
                 pub.uri)  # fmt: skip
        if old is not None and old.engine_name != engine_name:
            self._unload_later(old.engine_name)
        return True

    async def _load(self, url: str, engine_name: str, path: str) -> None:
        try:
            await self.client.load_lora_adapter(url, engine_name, path)
        except EngineError as e:  # "already loaded": a redelivery after a crash between load and record
            if "already loaded" not in str(e) or engine_name not in await self.client.loaded_adapters(url):
                raise

    def _unload_later(self, engine_name: str) -> None:
        """Unload in the background (each engine lets the version's requests finish first); a
        name already being unloaded is not asked twice."""
        if (task := self._unloads.get(engine_name)) is None or task.done():
            what = f"unloading adapter {engine_name}"
            self._unloads[engine_name] = self._spawn(self._unload_everywhere(engine_name), what)

    async def _unloads_done(self, name: str, new_registration: bool) -> None:
        """The unloads under way of this adapter's versions (and, for a new registration's first
        version, of completed registrations': the slot it takes), finished (at most
        UNLOAD_WAIT_S): the engines hold 2 slots per adapter (--max-loras-per-batch 2N), its live
        version and the next, so a version loaded while its predecessor's predecessor still
        drains would find no slot. Other adapters' drains hold no load up."""
        self._unloads = {n: task for n, task in self._unloads.items() if not task.done()}
        done = {rid[:12] for rid in self.done} if new_registration else set()
        mine = [t for n, t in self._unloads.items() if n.startswith(f"{name}@") or _registration_of(n) in done]
        if mine:
            await asyncio.wait(mine, timeout=UNLOAD_WAIT_S)

    async def _unload_everywhere(self, engine_name: str) -> None:
        async def unload(url: str) -> None:
            try:
                await self.client.unload_lora_adapter(url, engine_name)
            except EngineError as e:  # gone with a restart, or unloaded before: nothing to free
                log.info("unloading adapter %s from %s: %s", engine_name, url, e)

        await asyncio.gather(*(unload(url) for url in self.client.urls))

    async def converge(self) -> None:
        """Every engine serves every live adapter version (an engine restarted lost them), and no
        other version of those adapters (an unload that failed, or a registration replaced), nor any
        version of a completed registration, so the engines' slots never fill with versions nobody
        asks for."""
        await self.release_completed()
        done = {rid[:12] for rid in self.done}
        for url in self.client.urls:
            try:
                loaded = await self.client.loaded_adapters(url)
            except EngineError as e:
                log.info("engine %s did not list its adapters now (%s)", url, e)
                continue
            for name in sorted(n for n in loaded if _registration_of(n) in done):
                self._unload_later(name)
            for live in list(self.live.values()):
                for name in sorted({n for n in loaded if n.startswith(f"{live.name}@") and n != live.engine_name}):
                    self._unload_later(name)
                if live.engine_name not in loaded:
                    log.warning("engine %s lacks adapter %s: loading it", url, live.engine_name)
                    try:
                        await self._load(url, live.engine_name, live.uri)
                    except EngineError as e:
                        log.info("engine %s did not take adapter %s now (%s)", url, live.engine_name, e)


def _registration_of(engine_name: str) -> str:
    """The registration prefix in an engine name (`adapter_engine_name`: `<name>@<registration[:12]>.v<k>`)."""
    return engine_name.partition("@")[2].rsplit(".v", 1)[0]
