"""The trainer's multi-LoRA mode (--multi-lora-n-adapters N): many adapters on one frozen base.

Each adapter registration is a partition of the buffer (services.buffer.service). The loop reads
the registry (KV `adapters`) and, per registration:

- PENDING: sets up its slot (from the adapter's latest save in its `save` directory when the
  name was trained before, else fresh: B = 0, so version 0 is the base), publishes version 0 of
  this registration for weight-sync to load on the engines, and activates it;
- ACTIVE: asks its partition for its next step's lease (`buffer.get.<registration>`, naming the
  adapter's version: staleness is `adapter version - version at submission`), and on a complete
  lease takes one optimizer step of that adapter alone (services.trainer.adapters), reports the
  step to the registry, publishes the new version, records the step (`{name}/step` axis), and
  commits it; at its budget it retires it;
- RETIRING (budget reached, or DELETE /adapter_runs/{name}): saves it a last time in its `save`
  directory (PEFT), clears its slot and optimizer state, and completes it (CLEANUP, COMPLETED):
  its partition closes, and a group that comes back for it afterwards is dropped as foreign.

Gets for every active adapter are in flight at once; whichever lease completes first trains
first, so a slow adapter holds no other up. A restarted trainer resumes each active adapter at
its partition's committed step, from the version it published after that step (its optimizer
moments are lost, as a single-model run without --save). Without --multi-lora-service-mode the
run ends once every registered adapter is COMPLETED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from asyncrl_proto import (
    AdapterControl,
    AdapterControlReply,
    AdapterLive,
    AdapterRegistryState,
    BufferGetReply,
    BufferGetRequest,
)
from asyncrl_proto.messages import NO_PARTITION_ERROR, AdapterRun, AdapterState, flatten_group
from asyncrl_proto.subjects import ADAPTER_LIVE_KV_PREFIX, ADAPTERS_KV_KEY
from services.common import crash, procs
from services.common.snapshot import is_complete, numbered, remove_snapshot, snapshots_to_remove
from services.data.source import DataError, adapter_total_steps, load_rows
from services.model.lora import LoraError, LoraSpec, MultiLora, SlotAdamW, load_adapter, save_adapter
from services.trainer.adapter_push import adapter_dir, announce_adapter, publish_adapter
from services.trainer.adapters import train_adapter_step
from services.trainer.core import assemble_batch, build_step_batches
from services.trainer.loop import Mode, Work
from services.trainer.parallel import max_tokens_of
from services.trainer.rollout_stats import rollout_metrics
from services.trainer.setup import TrainerError
from services.weights.store import WeightStore

log = logging.getLogger(__name__)

LIVE_READ_S = 2.0
"""The longest an adapter's retention waits for the engines' version of it (then it keeps more)."""
GET_WAIT_S = 1.0
"""How long one get waits for a lease before the loop looks at the registry again."""
CONTROL_RETRY_S = 1.0
"""How long the trainer waits before asking the registry again for a request it could not store."""


class MultiLoraError(RuntimeError):
    pass


class Unservable(MultiLoraError):
    """An adapter that cannot be trained here (its buffer partition does not open): retired."""


@dataclass
class Track:
    """One registration the trainer holds in a slot."""

    run: AdapterRun
    total: int
    step: int = 0
    """Its next step (= its version: version k is the adapter after k steps)."""
    base: int = 0
    """The steps of the save it started from (a name registered again): its saves are named
    `step_<base + step>`, so the newest save of a name is always the one with the most steps."""
    get: asyncio.Task | None = None
    asked_at: float = 0.0
    """When the get of its next step was first sent (batch_wait_time)."""
    waited: float = 0.0
    no_partition_since: float = 0.0
    """Since when the buffer has answered that its partition is not open (0: it is)."""

    @property
    def rid(self) -> str:
        return self.run.registration_id


class AdapterTraining(Mode):
    """The trainer's multi-LoRA mode (services.trainer.loop asks it what to train). `svc`: the
    service it runs in (the pieces both modes share; `stopping`, `wait_stopped`, `stop`, `start_ranks`,
    and `dp`: the data-parallel ranks of --trainer-num-ranks, set once they have joined)."""

    def __init__(self, svc) -> None:
        self.svc = svc
        self.config = c = svc.config
        self.bus = svc.bus
        self.model = svc.model
        self.model.requires_grad_(False)
        self.lora = MultiLora(self.model, c.multi_lora.n_adapters, c.multi_lora.max_rank)
        self.optimizer = SlotAdamW(self.lora, lr=c.trainer.lr, betas=(c.trainer.adam_beta1, c.trainer.adam_beta2),
                                   weight_decay=c.trainer.weight_decay)  # fmt: skip
        self.tracks: dict[str, Track] = {}
        self.registry = AdapterRegistryState()
        self.steps_total = svc.records.next_step()
        """The records' own axis (`step`): every adapter step, one after another, across restarts."""
        self.run_dir = Path(c.infra.run_dir)
        samples = c.rollout.batch_size * c.rollout.n_samples_per_prompt
        self.global_batch_size = c.trainer.global_batch_size or samples
        """Samples a batch collects across adapters before it ships (the coalescing target)."""
        self.empty_since = 0.0
        self.store: WeightStore | None = None
        """The run's weights bucket when adapters travel through it (config.adapter_transfer_mode)."""
        if c.adapter_transfer_mode == "object-store":
            self.store = WeightStore(self.bus, chunk_size=c.async_.update_weight_buffer_size)

    # ---- the registry ----------------------------------------------------------------------------
    async def _read_registry(self) -> AdapterRegistryState:
        self.registry = await self.bus.kv_get(ADAPTERS_KV_KEY, AdapterRegistryState) or self.registry
        return self.registry

    async def _control(self, op: str, run: AdapterRun, step: int = 0, reason: str = "") -> AdapterRun:
        """The registry's answer to one request. One it could not store (`retry`) is asked again
        for up to --buffer-timeout-s, then fails the trainer (restarted), never the adapter."""
        req = AdapterControl(op=op, name=run.name, registration_id=run.registration_id, step=step, reason=reason)
        deadline = time.monotonic() + self.config.async_.buffer_timeout_s
        while (reply := await self.svc.link.request(self.bus.subjects.adapters_control, req, AdapterControlReply,
                                                    f"{op} of adapter {run.name}")).retry:  # fmt: skip
            if time.monotonic() > deadline or self.svc.stopping:
                raise TrainerError(f"the registry could not store {op} of adapter {run.name!r} for "
                                   f"{self.config.async_.buffer_timeout_s:.0f}s: {reply.error}")  # fmt: skip
            log.warning("the registry could not store %s of adapter %s (%s); asking again", op, run.name, reply.error)
            await asyncio.sleep(CONTROL_RETRY_S)
        if not reply.ok or reply.run is None:
            raise MultiLoraError(f"the registry refused {op} of adapter {run.name!r}: {reply.error}")
        return reply.run

    # ---- the loop's steps (services.trainer.loop) ----------------------------------------------
    async def setup(self) -> None:
        """Adapters only: the base never changes, so there is nothing of the model to resume."""
        await self.svc.start_ranks(None, None)

    async def next(self) -> list[Work] | None:
        """The registry followed, then the leases that completed together (a batch); None once
        every registered adapter is COMPLETED (without --multi-lora-service-mode)."""
        c = self.config
        reg = await self._read_registry()
        for run in reg.runs:
            await self._follow(run)
        for rid in [rid for rid, t in self.tracks.items() if all(r.registration_id != rid for r in reg.runs)]:
            self.tracks.pop(rid)  # pruned from the registry's history: nothing left to do
        if reg.runs and all(r.state is AdapterState.COMPLETED for r in reg.runs) and not c.multi_lora.service_mode:  # fmt: skip
            return None
        active = [t for t in self.tracks.values() if t.run.state is AdapterState.ACTIVE]
        if not active:
            self.empty_since = 0.0  # idle, not waiting: nothing to warn about
            await self.svc.wait_stopped(c.multi_lora.idle_poll_s)
            return []
        batch = await self._collect(active)
        info = _batch_info(batch)
        work = []
        for t, reply in batch:
            t.waited, t.asked_at = time.monotonic() - t.asked_at, 0.0
            std = bool(c.trainer.grpo_std_normalization and t.run.spec.n_samples_per_prompt > 1)
            work.append(Work(step=t.step, version=t.step, records_dir=self._reg_dir(t.run),
                             axis=f"{t.run.name}/step", std=std, refs={r.group_index: r for r in reply.refs},
                             metrics=reply.metrics, owner=(t, reply, info)))  # fmt: skip
        return work

    def cancel(self) -> None:
        for t in self.tracks.values():
            if t.get is not None:
                t.get.cancel()

    async def _ready(self, tracks: list[Track], timeout: float) -> list[tuple[Track, BufferGetReply]]:
        """The complete leases among `tracks`' gets within `timeout` (returns at the first). An
        adapter whose buffer partition does not open is retired with the reason."""
        tracks = [t for t in tracks if t.run.state is AdapterState.ACTIVE]
        if not tracks:
            return []
        for t in tracks:
            if t.get is None:
                t.asked_at = t.asked_at or time.monotonic()
                t.get = asyncio.ensure_future(self._get(t))
        done, _ = await asyncio.wait([t.get for t in tracks], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        ready = []
        for t in tracks:
            if t.get in done:
                task, t.get = t.get, None
                try:
                    reply = task.result()
                except Unservable as e:
                    log.error("adapter %s cannot be trained: %s; retiring it", t.run.name, e)
                    with contextlib.suppress(MultiLoraError):  # retired meanwhile (DELETE): fine
                        t.run = await self._control("retire", t.run, reason=f"cannot be trained: {str(e)[:300]}")
                    continue
                if reply is not None:
                    ready.append((t, reply))
        return ready

    async def _collect(self, active: list[Track]) -> list[tuple[Track, BufferGetReply]]:
        """One batch (Miles's coalescing): the complete leases of the first adapters ready, then
        of any other adapter whose lease completes within --multi-lora-max-coalesce-wait-s of the
        last one, until the batch holds --global-batch-size samples. A lease is always one whole
        step of its adapter (its rollout_batch_size groups), so no adapter overshoots its budget
        and every adapter in the batch steps. With nothing ready for
        --multi-lora-max-empty-wait-s it warns, naming what each adapter waits for, and goes on."""
        c = self.config
        batch = await self._ready(active, GET_WAIT_S * 2)
        now = time.monotonic()
        if not batch:
            self.empty_since = self.empty_since or now
            if now - self.empty_since >= c.multi_lora.max_empty_wait_s:
                log.warning("no adapter's batch ready for %.0f s; still waiting for %s", now - self.empty_since,
                            ", ".join(f"{t.run.name} step {t.step}" for t in active))  # fmt: skip
                self.empty_since = now
            return batch
        self.empty_since = 0.0
        deadline = now + c.multi_lora.max_coalesce_wait_s
        while not self.svc.stopping and _batch_samples(batch) < self.global_batch_size:
            others = [t for t in active if all(t is not b for b, _ in batch)]
            if not others or (left := deadline - time.monotonic()) <= 0:
                break
            if more := await self._ready(others, min(left, GET_WAIT_S * 2)):
                batch += more
                deadline = time.monotonic() + c.multi_lora.max_coalesce_wait_s  # progress: wait afresh
        return batch

    async def _follow(self, run: AdapterRun) -> None:
        """Bring one registration's slot in line with its state. What cannot be set up (its data
        unreadable, its save not fitting) retires that adapter with the reason, never the run."""
        t = self.tracks.get(run.registration_id)
        if t is not None:
            t.run = run
        try:
            if run.state is AdapterState.PENDING:
                await self._activate(run)
            elif run.state is AdapterState.ACTIVE and t is None:
                await self._resume_adapter(run)
            elif run.state in (AdapterState.RETIRING, AdapterState.CLEANUP):
                await self._retire(run)
        except (TimeoutError, ConnectionError, TrainerError):
            raise  # the broker or the buffer, not the adapter: the trainer fails and is restarted
        except (MultiLoraError, DataError, OSError, ValueError, RuntimeError) as e:  # LoraError: a ValueError
            if run.state not in (AdapterState.PENDING, AdapterState.ACTIVE):
                raise
            log.error("adapter %s cannot be trained: %s; retiring it", run.name, e)
            self.tracks.pop(run.registration_id, None)
            with contextlib.suppress(MultiLoraError):  # retired meanwhile (DELETE): the registry refuses, fine
                await self._control("retire", run, reason=f"cannot be trained: {str(e)[:300]}")
            return
        t = self.tracks.get(run.registration_id)  # an active one may have reached its budget before a restart
        if t is not None and t.run.state is AdapterState.ACTIVE and t.step >= t.total:
            t.run = await self._control("retire", t.run, reason=f"its budget of {t.total} steps is reached")

    def _reg_dir(self, run: AdapterRun) -> Path:
        """The registration's directory: its versions (`v<k>`), trained.jsonl, samples and base_step."""
        return adapter_dir(self.run_dir, run.name, run.registration_id, 0).parent

    def _track(self, run: AdapterRun, step: int, total: int | None = None) -> Track:
        """Its track; `total` (its budget) from its data unless given (one retiring needs none)."""
        if total is None:
            d = self.config.data
            total = adapter_total_steps(run, len(load_rows(run.spec.data, d.input_key, d.label_key, d.metadata_key)))
        t = Track(run=run, total=total, step=step)
        with contextlib.suppress(OSError, ValueError):  # none recorded: 0, as a fresh one
            t.base = int((self._reg_dir(run) / "base_step").read_text())
        self.tracks[run.registration_id] = t
        return t

    async def _activate(self, run: AdapterRun) -> None:
        """Fresh (B = 0) or from the name's latest save; version 0 published, then ACTIVE."""
        spec = LoraSpec(rank=run.spec.rank, alpha=run.spec.alpha, target_modules=tuple(run.spec.target_modules))
        latest = _latest_save(Path(run.spec.save))
        self.optimizer.reset(run.slot)
        if latest is not None:
            try:
                self.lora.set_slot(run.slot, *await asyncio.to_thread(load_adapter, latest))
                log.info("adapter %s resumes from its save %s", run.name, latest)
            except LoraError as e:
                raise MultiLoraError(f"adapter {run.name}: its save {latest} does not fit: {e}") from e
        else:
            self.lora.init_slot(run.slot, spec, seed=self.config.data.seed + run.slot)
        base = self._reg_dir(run) / "base_step"  # before version 0 is out: a restart finds it wherever it resumes
        base.parent.mkdir(parents=True, exist_ok=True)
        procs.replace_file(base, f"{int(latest.name[5:]) if latest is not None else 0}\n")
        t = self._track(run, step=0)
        await self._publish(t)
        t.run = await self._control("activate", run)

    async def _resume_adapter(self, run: AdapterRun, total: int | None = None) -> Track:
        """After a trainer restart: from the version published after the partition's committed
        step; a step trained, reported and published but not committed (killed in between) is
        committed now rather than trained again, so no version number ever names two weights, and
        the records of the steps after it are dropped (trained again, or never if it retires).
        A partition the buffer is still opening answers an error: asked again for up to
        --buffer-timeout-s; then one retiring (`total` 0) keeps its newest version that loads (its
        partition never opened, its data unreadable: nothing was leased)."""
        deadline = time.monotonic() + self.config.async_.buffer_timeout_s
        req = BufferGetRequest(step=0, count=run.spec.rollout_batch_size, wait_s=0.0)
        while (reply := await self._ask(run.registration_id, req, "question where to resume")).error:
            if "already committed" in reply.error:
                break
            if time.monotonic() > deadline:
                if total is None:  # its partition does not open (its data gone or unreadable): retired by _follow
                    raise MultiLoraError(f"adapter {run.name}: the buffer cannot say where to resume: {reply.error}")
                return await self._resume_weights(self._track(run, step=0, total=total))
            await asyncio.sleep(1.0)
        t = self._track(run, reply.committed_step + 1, total)
        if run.step == t.step + 1 and is_complete(adapter_dir(self.run_dir, run.name, t.rid, run.step)):
            t.step += 1  # that version is out: its step's records were written before it
            await self._commit_step(t, t.step - 1)
        while t.step > 0 and not is_complete(adapter_dir(self.run_dir, run.name, t.rid, t.step)):
            t.step -= 1  # never written: from the version before it (the steps after are trained again)
        self.svc.records.drop_after(self._reg_dir(run), t.step - 1, f"{run.name}/step", t.rid)
        self.lora.set_slot(run.slot, *await asyncio.to_thread(load_adapter, self._reg_dir(run) / f"v{t.step}"))
        self.optimizer.reset(run.slot)
        await announce_adapter(self.bus, self.run_dir, run.name, t.rid, t.step, self.store)  # a kill may have cut it
        log.info("adapter %s resumed at its step %d (its optimizer state is lost)", run.name, t.step)
        return t

    async def _retire(self, run: AdapterRun) -> None:
        t = self.tracks.get(run.registration_id)
        if t is None:  # a restart found it retiring: resumed as an active one (its data is not needed)
            t = await self._resume_adapter(run, total=0)
        if t.get is not None:
            t.get.cancel()
            t.get = None
        out = Path(run.spec.save) / f"step_{t.base + t.step}"
        if self.lora.specs[run.slot] is None:  # one retired before it was set up has nothing to save
            out = "nothing (it never trained)"
        else:
            try:
                await asyncio.to_thread(save_adapter, self.lora, run.slot, out, self.config.data.hf_checkpoint)
            except (OSError, LoraError) as e:  # a save directory it cannot write: the slot is freed all the same
                newest = adapter_dir(self.run_dir, run.name, t.rid, t.step)
                log.error("adapter %s: its final save to %s failed (%s); its newest version stays in %s", run.name,
                          out, e, newest)  # fmt: skip
                out = f"nothing (the save failed; its newest version is {newest})"
        crash.point("trainer", "adapter_saved_before_complete")
        if run.state is AdapterState.RETIRING:
            run = await self._control("cleanup", run)
        self.lora.clear_slot(run.slot)
        self.optimizer.reset(run.slot)
        t.run = await self._control("complete", run)
        log.info("adapter %s completed at its step %d: saved to %s, slot %d free", run.name, t.step, out, run.slot)

    async def _resume_weights(self, t: Track) -> Track:
        """The track, at its newest version on disk (`v<k>`) that loads (none: as it was)."""
        for v, p in reversed(numbered(self._reg_dir(t.run).glob("v*"))):
            if is_complete(p):
                try:
                    self.lora.set_slot(t.run.slot, *await asyncio.to_thread(load_adapter, p))
                except LoraError as e:
                    log.error("adapter %s: its version %d does not load (%s); trying the one before", t.run.name, v, e)
                    continue
                t.step = v
                break
        return t

    # ---- one adapter step ------------------------------------------------------------------------
    async def _ask(self, rid: str, req: BufferGetRequest, what: str) -> BufferGetReply:
        return await self.svc.link.request(self.bus.subjects.of(rid).buffer_get, req, BufferGetReply, what)

    async def _get(self, t: Track) -> BufferGetReply | None:
        req = BufferGetRequest(step=t.step, count=t.run.spec.rollout_batch_size, current_version=t.step,
                               wait_s=GET_WAIT_S)  # fmt: skip
        reply = await self._ask(t.rid, req, f"lease of adapter {t.run.name} step {t.step}")
        if reply.error and NO_PARTITION_ERROR in reply.error:  # the buffer is (re)trying to open it: not ready yet
            t.no_partition_since = t.no_partition_since or time.monotonic()
            if time.monotonic() - t.no_partition_since < self.config.async_.buffer_timeout_s:
                await asyncio.sleep(GET_WAIT_S)
                return None
            raise Unservable(f"its buffer partition has not opened for {self.config.async_.buffer_timeout_s:.0f} s: "
                             f"{reply.error}")  # fmt: skip
        if reply.error:
            raise MultiLoraError(f"buffer refused get(step={t.step}) of adapter {t.run.name}: {reply.error}")
        t.no_partition_since = 0.0
        return reply if reply.complete else None

    async def train(self, w: Work) -> None:
        t, reply, _ = w.owner
        w.groups = assemble_batch(
            [await self.svc.link.load_group(ref) for ref in reply.refs], t.run.spec.n_samples_per_prompt
        )
        self.svc.check.exclude_invalid(w.groups, max_version=t.step, n=t.run.spec.n_samples_per_prompt)
        c = self.config
        if (dp := self.svc.dp) is not None:  # --trainer-num-ranks: the samples split over the ranks
            w.stats = await asyncio.to_thread(dp.train_adapter, self.lora, self.optimizer, t.run.slot, w.groups,
                                              self.svc.loss_cfg, w.std)  # fmt: skip
        else:
            (batches,) = build_step_batches(w.groups, w.std, c.rollout.reward_key, self.svc.pad_id, max_tokens_of(c), 1)
            w.stats = await asyncio.to_thread(train_adapter_step, self.model, self.lora, self.optimizer, t.run.slot,
                                              batches, self.svc.loss_cfg, c.trainer.clip_grad)  # fmt: skip
        crash.point("trainer", "adapter_stepped_before_records")
        t.step += 1

    async def after_records(self, w: Work, record: dict) -> None:
        """An adapter's records come first (a restart drops those after its committed step), then
        the registry (the buffer bounds the versions groups and gets may name by it), then the
        version, then the commit."""
        t, _, _ = w.owner
        t.run = await self._control("stepped", t.run, step=t.step)
        crash.point("trainer", "adapter_reported_before_publish")
        await self._publish(t)
        crash.point("trainer", "adapter_published_before_commit")
        await self._commit_step(t, w.step)
        await self._retain(t)
        if t.step >= t.total:
            t.run = await self._control("retire", t.run, reason=f"its budget of {t.total} steps is reached")

    async def _publish(self, t: Track) -> None:
        await publish_adapter(self.bus, self.lora, t.run.slot, self.run_dir, t.run.name, t.rid, t.step,
                              self.config.data.hf_checkpoint, self.store)  # fmt: skip

    async def _retain(self, t: Track) -> None:
        """Its versions on disk, retained as the model's snapshots are (snapshots_to_remove): the
        newest --keep-weight-snapshots, the one behind its committed step (a restart resumes from
        it), and those newer than the engines' live version of it (weight-sync may be loading one)."""
        keep = max(1, self.config.trainer.keep_weight_snapshots)
        versions = [p for _, p in numbered(self._reg_dir(t.run).glob("v*"))]  # oldest first
        if len(versions) <= keep:
            return
        live = -1  # unknown: every version among the newest few stays
        with contextlib.suppress(Exception):  # a broker away, a value that does not decode
            key = f"{ADAPTER_LIVE_KV_PREFIX}.{t.run.name}"
            now = await asyncio.wait_for(self.bus.kv_get(key, AdapterLive), LIVE_READ_S)
            if now is not None and now.registration_id == t.rid:
                live = now.version
        backing = adapter_dir(self.run_dir, t.run.name, t.rid, t.step)
        for old in snapshots_to_remove(versions, keep, backing, live):
            if self.store is not None:  # the bucket's copy first: a kill in between leaves the disk's, retried
                await self.store.retire_adapter(t.run.name, t.rid, int(old.name[1:]))
            await asyncio.to_thread(remove_snapshot, old)

    async def _commit_step(self, t: Track, step: int) -> None:
        await self.svc.link.commit(self.bus.subjects.of(t.rid).buffer_commit, step, t.step,
                                   f"commit of adapter {t.run.name} step {step}", MultiLoraError)  # fmt: skip

    # ---- records ---------------------------------------------------------------------------------
    async def record(self, w: Work) -> dict:
        t, reply, info = w.owner
        n = t.run.name
        samples = [s for g in w.groups for s in flatten_group(g)]
        rollout = rollout_metrics(samples, self.config.rollout.reward_key, w.groups)  # the model's, per adapter
        record = {
            "step": self.steps_total, f"{n}/step": w.step, "adapter": n, "registration": t.rid,
            **{f"{n}/raw_reward_{k}": rollout[f"rollout/reward/{k}"] for k in ("mean", "std", "min", "max")},
            **{f"{n}/response_len_{k.rsplit('/', 1)[1]}": v for k, v in rollout.items()
               if k.startswith("rollout/response_len/")},
            f"{n}/rollout/failed_ratio": rollout["rollout/failed_ratio"],
            f"{n}/rollout/num_samples": rollout["rollout/num_samples"], "time": time.time(),
            f"{n}/perf/step_time_s": time.perf_counter() - w.started,
            **info,
            "perf/fully_async/stale_dropped": reply.metrics.get("rollout/fully_async/stale_groups_filtered", 0.0),
            "perf/fully_async/queue_length": reply.metrics.get("rollout/fully_async/queue_size", 0.0),
            "perf/fully_async/batch_wait_time": t.waited,
        }  # fmt: skip
        for k in ("avg_staleness", "max_staleness"):
            if (v := reply.metrics.get(f"rollout/fully_async/{k}")) is not None:
                record[f"{n}/rollout/fully_async/{k}"] = v
        record.update({f"{n}/{k}": v for k, v in w.stats.items() if isinstance(v, int | float)})
        self.steps_total += 1
        return record

    async def finish(self, error: str | None = None) -> None:
        await self.svc.records.finish(self.steps_total, error=error)
        if error:
            log.error("multi-LoRA training failed after %d adapter steps: %s", self.steps_total, error)
        else:
            log.info("multi-LoRA training finished: every adapter is completed (%d adapter steps)", self.steps_total)
        self.svc.stop()

    def status(self) -> dict:
        return {"adapter_steps": self.steps_total, "mode": self.config.infra.mode,
                "adapters": {t.run.name: {"step": t.step, "total": t.total, "state": t.run.state.name.lower()}
                             for t in self.tracks.values()}}  # fmt: skip

    def metric_values(self) -> dict[str, float]:
        return {"trainer/step": self.steps_total}


def _batch_samples(batch: list[tuple[Track, BufferGetReply]]) -> int:
    return sum(len(reply.refs) * t.run.spec.n_samples_per_prompt for t, reply in batch)


def _batch_info(batch: list[tuple[Track, BufferGetReply]]) -> dict[str, float]:
    """The batch's figures, recorded with each of its adapters' steps: every adapter in it steps
    (its lease is one whole step)."""
    return {"perf/fully_async/batch_n_adapters": len(batch), "perf/fully_async/batch_n_adapters_to_step": len(batch),
            "perf/fully_async/batch_n_groups": sum(len(r.refs) for _, r in batch),
            "perf/fully_async/batch_n_samples": _batch_samples(batch)}  # fmt: skip


def _latest_save(save: Path) -> Path | None:
    """The newest `step_<k>` PEFT directory of an adapter's save directory: the most steps (a
    name registered again continues the count of the save it started from)."""
    steps = [(k, p) for k, p in numbered(save.glob("step_*"), "step_") if is_complete(p)]
    return max(steps)[1] if steps else None
