"""Multi-LoRA producers: what a prompt of an adapter's partition is generated with.

A prompt on `prompts.<registration>` names an adapter registration. The producer generates it
with that adapter's live version on the engines (KV `adapter_live.<name>`, written by
weight-sync: `lora_path` is its engine name) and scores it with that adapter's reward (its spec's
`rm_type` or `custom_rm_path`, from the registry's KV `adapters`). Every sample is stamped with
the adapter version it was generated under (its `weight_versions`), the clock its partition
judges staleness by.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from asyncrl_proto import AdapterLive, AdapterRegistryState, decode
from asyncrl_proto.codec import MalformedMessage
from asyncrl_proto.messages import AdapterRun, AdapterState
from asyncrl_proto.subjects import ADAPTER_LIVE_KV_PREFIX, ADAPTERS_KV_KEY
from services.common.rewards import resolve_reward

REREAD_S = 0.5
"""A registration not known yet is read again at most this often."""


class NotYet(Exception):
    """The adapter has no version on the engines yet (its trainer is setting it up): try later."""


class Closed(Exception):
    """The registration is not open (retired, or never registered)."""


class AdapterRoutes:
    def __init__(self, bus, config):
        self.bus = bus
        self.config = config
        self.runs: dict[str, AdapterRun] = {}
        self._read_at = 0.0
        self._rewards: dict[str, Callable] = {}

    async def _read_registry(self) -> None:
        if time.monotonic() - self._read_at < REREAD_S:
            return
        self._read_at = time.monotonic()
        raw = await self.bus.kv_get(ADAPTERS_KV_KEY)
        with contextlib.suppress(MalformedMessage):
            if raw is not None:
                self.runs = {r.registration_id: r for r in decode(raw, AdapterRegistryState).runs}

    async def run(self, rid: str) -> AdapterRun:
        if rid not in self.runs or self.runs[rid].state is not AdapterState.ACTIVE:
            await self._read_registry()
        run = self.runs.get(rid)
        if run is None:  # the buffer releases prompts of registrations the registry holds: read it again soon
            raise NotYet(f"adapter registration {rid[:64]!r} is not in the registry read here yet")
        if run.state is AdapterState.COMPLETED:
            raise Closed(f"adapter registration {rid[:64]!r} is completed")
        return run

    async def live(self, run: AdapterRun) -> AdapterLive:
        """The adapter version every engine serves now (read for every group: weight-sync
        unloads a version soon after the next is live)."""
        raw = await self.bus.kv_get(f"{ADAPTER_LIVE_KV_PREFIX}.{run.name}")
        live = None
        with contextlib.suppress(MalformedMessage):
            live = decode(raw, AdapterLive) if raw is not None else None
        if live is None or live.registration_id != run.registration_id:
            raise NotYet(f"adapter {run.name!r} has no version on the engines yet")
        return live

    def reward(self, run: AdapterRun) -> Callable:
        rid = run.registration_id
        if rid not in self._rewards:
            cfg = self.config.model_copy(update={"rm_type": run.spec.rm_type, "custom_rm_path": run.spec.custom_rm_path,
                                                 "group_rm": False})  # fmt: skip
            self._rewards[rid] = resolve_reward(cfg)
        return self._rewards[rid]
