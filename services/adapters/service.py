"""Adapter registry service (multi-LoRA async): which tenant adapters train in which trainer slot.

Owns: the registry (services/adapters/registry.py) and its durable state, KV `adapters` of the
  run (an AdapterRegistryState), written compare-and-set on the KV revision it last read: two
  registries never both win, and the loser reads the key again and decides again. A restarted
  registry reads it and resumes every adapter where it was.
At start: registers each --multi-lora-adapter NAME YAML that the state does not name yet (live
  or completed: a restart registers nothing twice). One that finds no free slot waits, and is
  registered when an adapter completes. A spec that cannot be trained is fatal (exit 78).
Listens to: `adapters.control` (core request/reply, AdapterControl -> AdapterControlReply), the
  trainer's transitions: activate, stepped, retire, cleanup, complete. An undecodable request
  is dead-lettered and answered with the error.
HTTP (every route needs the run token): GET /health, GET /adapter_runs (every registration,
  history included), GET /adapter_runs/state (the whole state, slot_versions included),
  GET /adapter_runs/{name} (its newest registration; 404), POST /adapter_runs (register:
  {"name": ..., **spec} or {"name": ..., "spec": {...}}; 201 with the run, 400 a bad request,
  409 a conflict: the message says what to do), DELETE /adapter_runs/{name} (retire; 404 unknown,
  409 not live). 503 when the state could not be stored (the request changed nothing).
No loops of its own: it answers requests; producers, buffer and trainer read the KV key.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from msgspec import to_builtins

from asyncrl_proto import AdapterControl, AdapterControlReply, AdapterRun, AdapterSpec, decode, encode
from asyncrl_proto.codec import MalformedMessage
from asyncrl_proto.messages import AdapterRegistryState
from asyncrl_proto.subjects import ADAPTERS_KV_KEY
from services.adapters.registry import LIVE, AdapterRegistry, RegistryError, SpecError, parse_spec
from services.common import crash
from services.common.bus import BusError, SequenceConflict, TransportError
from services.common.config import ConfigError, DataSection, MultiLoraSection, RolloutSection
from services.common.runtime import Service
from services.data.source import DataError, data_size, load_rows

log = logging.getLogger(__name__)

CAS_ATTEMPTS = 5
"""A change that keeps losing the compare-and-set this many times (another registry writing all
the while) is answered 503."""


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def read_spec_file(path: str) -> Any:
    """The mapping of an adapter's YAML file."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read the adapter spec {path}: {e}") from None


class AdapterService(Service):
    name = "adapters"
    reads = (MultiLoraSection, RolloutSection, DataSection)  # the run's group size, how prompts are read

    def __init__(self, config, bus, **kw):
        if config.multi_lora.n_adapters < 1:
            raise ConfigError("--multi-lora-n-adapters is 0 (multi-LoRA off): the adapter registry has no slot "
                              "to give; set it to the number of adapter slots")  # fmt: skip
        super().__init__(config, bus, **kw)
        config = self.config  # its own sections from here on (services.common.config.view)
        self.adapters = AdapterRegistry(config.multi_lora.n_adapters)
        """The registry (`self.registry` is the runtime's Prometheus registry)."""
        self.kv_revision = 0
        self._lock = asyncio.Lock()
        self._waiting_lock = asyncio.Lock()  # one pass over `waiting` at a time
        self.waiting: list[tuple[str, AdapterSpec]] = []
        """--multi-lora-adapter adapters that found no free slot yet, in the order given."""
        self.num_rejected = 0
        self.num_conflicts = 0

    # ---- start -------------------------------------------------------------------------------
    async def setup(self) -> None:
        await self._load()
        if self.kv_revision == 0:  # the first start: readers see the slots before any adapter
            await self._change(lambda r: None, force=True)
        for name, path in self.config.multi_lora.adapter_pairs:
            if (run := self.adapters.current(name)) is not None:
                log.info("adapter %s from --multi-lora-adapter is already registered (%s)", name, run.state.value)
                continue
            try:
                spec = self._fits(parse_spec(read_spec_file(path)))
            except RegistryError as e:
                raise ConfigError(f"--multi-lora-adapter {name} {path}: {e}") from None
            self.waiting.append((name, spec))
        await self._register_waiting(fatal=True)
        await self.bus.subscribe(self.bus.subjects.adapters_control, self._on_control)
        log.info("adapter registry ready: %d slots, %d free, revision %d (KV revision %d)",
                 self.adapters.num_slots, len(self.adapters.free_slots()), self.adapters.revision,
                 self.kv_revision)  # fmt: skip

    async def _load(self) -> None:
        """The stored state and its KV revision, from one read (so a write expecting that revision
        fails if anyone wrote after it); revision 0, an empty registry, when nothing is stored yet."""
        raw, self.kv_revision = await self.bus.kv_entry(ADAPTERS_KV_KEY)
        try:
            state = decode(raw, AdapterRegistryState) if raw is not None else None
        except MalformedMessage as e:
            raise BusError(f"KV {ADAPTERS_KV_KEY} of bucket {self.bus.subjects.kv_bucket} holds no adapter registry "
                           f"state ({e}); the registry will not overwrite it: inspect it, then delete the key to start "
                           "an empty registry") from None  # fmt: skip
        self.adapters = AdapterRegistry(self.config.multi_lora.n_adapters, state)

    async def _register_waiting(self, fatal: bool = False) -> None:
        """Register the start adapters that wait, while slots are free (in the order given). One
        the registry refuses for another reason than a full house is fatal at start (the flags
        and the stored state disagree), and later dropped with an error in the log."""
        async with self._waiting_lock:
            while self.waiting and self.adapters.free_slots():
                name, spec = self.waiting[0]
                if self.adapters.current(name) is None:
                    try:
                        run = await self._change(lambda r, n=name, s=spec: r.register(n, s))
                        log.info("registered adapter %s from --multi-lora-adapter in slot %d", name, run.slot)
                    except RegistryError as e:
                        if e.status == 409 and not self.adapters.free_slots():
                            return  # the slot went to another registration meanwhile: wait for the next
                        if fatal:
                            raise ConfigError(f"--multi-lora-adapter {name}: {e}") from None
                        log.error("--multi-lora-adapter %s cannot be registered, dropped: %s", name, e)
                self.waiting.pop(0)
            if self.waiting:
                log.info("adapters waiting for a free slot: %s", [n for n, _ in self.waiting])

    # ---- changes ------------------------------------------------------------------------------
    async def _change(self, op: Callable[[AdapterRegistry], AdapterRun | None], force: bool = False):
        """Apply `op` to a copy of the registry, store the copy compare-and-set, and keep it: a
        lost race reads KV again and applies `op` to what is there (which may now refuse it).
        RegistryError when refused; nothing is written when `op` changed nothing (unless `force`)."""
        async with self._lock:
            for _ in range(CAS_ATTEMPTS):
                trial = self.adapters.copy()
                result = op(trial)
                if trial.revision == self.adapters.revision and not force:
                    return result
                try:
                    self.kv_revision = await self.bus.kv_update(ADAPTERS_KV_KEY, encode(trial.state), self.kv_revision)
                except SequenceConflict as e:
                    self.num_conflicts += 1
                    log.warning("%s; reading it again", e)
                    await self._load()
                    force = False  # someone wrote it: the key exists now
                    continue
                self.adapters = trial
                return result
        raise RegistryError(f"KV {ADAPTERS_KV_KEY} changed under every one of {CAS_ATTEMPTS} attempts (another "
                            "registry writes it): try again", 503)  # fmt: skip

    async def control(self, req: AdapterControl) -> AdapterRun:
        run = await self._change(lambda r: r.apply(req))
        if req.op == "complete" and self.waiting:
            self.background(self._register_waiting(), "registering the adapters waiting for a slot")
        return run

    # ---- NATS ---------------------------------------------------------------------------------
    async def _on_control(self, msg) -> None:
        req = await self.bus.decode_or_dead_letter(msg, AdapterControl)
        if req is None:
            reply = AdapterControlReply(ok=False, error="undecodable AdapterControl (dead-lettered)")
        else:
            try:
                run = await self.control(req)
                crash.point("adapters", "stored_before_reply")
                reply = AdapterControlReply(ok=True, run=run, revision=self.adapters.revision)
            except RegistryError as e:  # a refusal, or (503) a state it could not write: asked again
                self.num_rejected += 1
                reply = AdapterControlReply(ok=False, error=str(e), revision=self.adapters.revision,
                                            retry=e.status == 503)  # fmt: skip
            except (BusError, TransportError, TimeoutError, OSError) as e:
                log.warning("adapters.control %s %s: the state could not be stored: %s", req.op, req.name, e)
                reply = AdapterControlReply(ok=False, error=f"the registry could not store its state ({e}); try again",
                                            revision=self.adapters.revision, retry=True)  # fmt: skip
        if msg.reply:
            try:
                await msg.respond(encode(reply))
            except (TransportError, OSError) as e:  # the requester may be gone: it asks again
                log.info("could not answer an adapters.control request: %s", e)

    # ---- HTTP ---------------------------------------------------------------------------------
    def _fits(self, spec: AdapterSpec, over_http: bool = False) -> AdapterSpec:
        """What this run can serve: the engines' largest rank, the producers' largest group, the
        run's batch, a prompt file of a bounded size; over HTTP, only an allowed custom reward."""
        c = self.config
        if over_http and spec.custom_rm_path not in (None, *c.multi_lora.custom_rm_paths):
            allowed = ", ".join(c.multi_lora.custom_rm_paths) or "none"
            raise SpecError(f"custom_rm_path {spec.custom_rm_path!r} is not one the run allows over HTTP (allowed: "
                            f"{allowed}; the operator lists them with --multi-lora-custom-rm-paths): use an rm_type "
                            "or an allowed function")  # fmt: skip
        if spec.rollout_batch_size > c.rollout.batch_size:
            raise SpecError(f"rollout_batch_size {spec.rollout_batch_size} is above the run's --rollout-batch-size "
                            f"{c.rollout.batch_size} (the largest step the run is sized for): "
                            "use at most that")  # fmt: skip
        try:
            size = data_size(spec.data, stop_above=c.multi_lora.max_data_mb * 2**20)
        except (OSError, ValueError) as e:
            raise SpecError(f"data {spec.data}: {e}") from None
        if size > c.multi_lora.max_data_mb * 2**20:
            raise SpecError(f"data {spec.data} is {size / 2**20:.0f} MiB, above the run's --multi-lora-max-data-mb "
                            f"{c.multi_lora.max_data_mb:g}")  # fmt: skip
        if spec.rank > c.multi_lora.max_rank:
            raise SpecError(f"rank {spec.rank} is above the engines' --multi-lora-max-rank {c.multi_lora.max_rank}")
        if spec.n_samples_per_prompt > c.rollout.n_samples_per_prompt:
            raise SpecError(f"n_samples_per_prompt {spec.n_samples_per_prompt} is above the run's "
                            f"--n-samples-per-prompt {c.rollout.n_samples_per_prompt} (the largest group the producers "
                            "hold credits for): start the run with a larger one")  # fmt: skip
        try:  # every prompt readable now: the buffer and the trainer read them later
            rows = load_rows(spec.data, c.data.input_key, c.data.label_key, c.data.metadata_key)
        except (DataError, OSError) as e:
            raise SpecError(f"data {spec.data}: {e}") from None
        if not rows:
            raise SpecError(f"data {spec.data} holds no prompt")
        return spec

    def add_routes(self, app: FastAPI) -> None:
        async def answer(work, status: int = 200) -> JSONResponse:
            try:
                return JSONResponse(to_builtins(await work()), status_code=status)
            except RegistryError as e:
                if e.status != 404:
                    self.num_rejected += 1
                return _error(e.status, str(e))
            except (BusError, TransportError, TimeoutError, OSError) as e:
                return _error(503, f"the registry could not store its state in KV ({e}); try again")

        @app.get("/health")
        async def health() -> JSONResponse:
            return JSONResponse({"ok": self.ready, "revision": self.adapters.revision,
                                 "free_slots": len(self.adapters.free_slots())})  # fmt: skip

        @app.get("/adapter_runs")
        async def list_runs() -> JSONResponse:
            return JSONResponse({"revision": self.adapters.revision, "runs": to_builtins(self.adapters.state.runs)})

        @app.get("/adapter_runs/state")
        async def whole_state() -> JSONResponse:
            return JSONResponse(to_builtins(self.adapters.state))

        @app.get("/adapter_runs/{name}")
        async def get_run(name: str) -> JSONResponse:
            async def work():
                return self.adapters.get(name)

            return await answer(work)

        @app.post("/adapter_runs")
        async def post_run(request: Request) -> JSONResponse:
            try:
                body = await request.json()
            except ValueError:
                return _error(400, 'the body must be JSON: {"name": NAME, **spec} or {"name": NAME, "spec": {...}}')

            async def work():
                name, raw = self._split_body(body)
                spec = await asyncio.to_thread(lambda: self._fits(parse_spec(raw), over_http=True))
                run = await self._change(lambda r: r.register(name, spec))
                log.info("registered adapter %s in slot %d over HTTP", name, run.slot)
                return run

            return await answer(work, 201)

        @app.delete("/adapter_runs/{name}")
        async def delete_run(name: str) -> JSONResponse:
            async def work():
                run = self.adapters.get(name)
                if run.state not in LIVE:
                    raise RegistryError(f"adapter {name!r} is {run.state.value}, not live: nothing to retire "
                                        "(it is being or has been saved)")  # fmt: skip
                return await self._change(lambda r: r.retire(name, "DELETE over HTTP"))

            return await answer(work)

    @staticmethod
    def _split_body(body: Any) -> tuple[str, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise RegistryError('the body must be {"name": NAME, **spec} or {"name": NAME, "spec": {...}}', 400)
        rest = {k: v for k, v in body.items() if k != "name"}
        if "spec" in rest:
            if len(rest) > 1:
                raise RegistryError(f"give the spec either inside \"spec\" or beside \"name\", not both (also got "
                                    f"{sorted(k for k in rest if k != 'spec')})", 400)  # fmt: skip
            return body["name"], rest["spec"]
        return body["name"], rest

    # ---- status -------------------------------------------------------------------------------
    def status(self) -> dict:
        return {
            "num_slots": self.adapters.num_slots,
            "free_slots": self.adapters.free_slots(),
            "revision": self.adapters.revision,
            "kv_revision": self.kv_revision,
            "adapters": self.adapters.counts(),
            "slots": {
                r.slot: {"name": r.name, "state": r.state.value, "step": r.step} for r in self.adapters.holding()
            },
            "waiting": [n for n, _ in self.waiting],
            "num_rejected": self.num_rejected,
            "num_kv_conflicts": self.num_conflicts,
        }

    def heartbeat_info(self) -> dict:
        return {"revision": self.adapters.revision}

    def metric_values(self) -> dict[str, float]:
        return {
            **{f"multi_lora/adapters_{s}": n for s, n in self.adapters.counts().items()},
            "multi_lora/slots": self.adapters.num_slots,
            "multi_lora/free_slots": len(self.adapters.free_slots()),
            "multi_lora/waiting_adapters": len(self.waiting),
            "multi_lora/registry_revision": self.adapters.revision,
            "multi_lora/rejected_total": self.num_rejected,
            "multi_lora/kv_conflicts_total": self.num_conflicts,
        }
