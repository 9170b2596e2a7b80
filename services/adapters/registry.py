"""The multi-LoRA adapter registry as a pure state machine: no I/O, unit-tested alone.

An adapter is registered under a name with its spec (AdapterSpec) and takes the lowest free slot
of the trainer's --multi-lora-n-adapters; it then moves PENDING -> ACTIVE -> RETIRING -> CLEANUP
-> COMPLETED, which frees its slot (a PENDING adapter retired goes straight to CLEANUP). Each slot
has a version that grows with every step its adapters take and never resets, so (slot,
slot_version) names one set of adapter weights for the whole run. COMPLETED registrations are
kept as history and do not block registering the name again (a new registration id).

Repeating the transition an adapter has just made (a trainer's request retried after its reply
was lost) changes nothing; every other transition is refused with a RegistryError that says why
and carries the HTTP status for it. `revision` counts the changes: a request that changes
nothing leaves it as it was, and the service then writes nothing.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from asyncrl_proto import AdapterControl, AdapterRegistryState, AdapterRun, AdapterSpec, AdapterState, decode, encode
from asyncrl_proto.messages import LORA_TARGET_MODULES, MAX_LORA_SCALE
from services.common.config import adapter_name_problem

PENDING, ACTIVE, RETIRING, CLEANUP, COMPLETED = (AdapterState.PENDING, AdapterState.ACTIVE, AdapterState.RETIRING,
                                                 AdapterState.CLEANUP, AdapterState.COMPLETED)  # fmt: skip
LIVE = frozenset({PENDING, ACTIVE, RETIRING})
"""States of an adapter that is registered and not yet being finished."""
HOLDING = LIVE | {CLEANUP}
"""States that hold a slot (and a save directory)."""
MAX_SPEC_BYTES = 4096
"""An adapter spec's encoded size at most: with MAX_HISTORY runs kept the registry stays one KV value."""
MAX_HISTORY = 500
"""COMPLETED registrations kept (the oldest go first): the whole state is one KV value."""
MAX_STATE_BYTES = 768 * 1024
"""The most the state may take encoded (older completed registrations go first): the KV value must
fit a message of a NATS server left at its default max_payload of 1 MiB (the embedded one allows 8)."""
SPEC_FIELDS = tuple(AdapterSpec.__struct_fields__)
OPS = ("activate", "stepped", "retire", "cleanup", "complete")
RESERVED_NAMES = frozenset({"state"})
"""Names an adapter cannot take: GET /adapter_runs/state is the whole registry."""


class RegistryError(ValueError):
    """A request the registry refuses. `status`: 400 the request is wrong, 404 no such adapter,
    409 it conflicts with the registry's state, 503 its state could not be written (ask again)."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


class SpecError(RegistryError):
    """An adapter spec that cannot be trained (HTTP 400)."""

    def __init__(self, message: str):
        super().__init__(message, 400)


def parse_spec(raw: Any, *, file_exists: Callable[[str], bool] = os.path.isfile) -> AdapterSpec:
    """A tenant's spec (a YAML file's mapping or a POST body) as an AdapterSpec, or SpecError
    naming what is wrong: an unknown or missing field, a wrong type or bound, a reward or budget
    that is not exactly one, a data file that does not exist (`file_exists`)."""
    if not isinstance(raw, dict):
        raise SpecError(f"an adapter spec is a mapping of fields ({', '.join(SPEC_FIELDS)}), not {type(raw).__name__}")
    if unknown := sorted(str(k) for k in raw if k not in SPEC_FIELDS):
        raise SpecError(f"unknown field(s) in the adapter spec: {', '.join(unknown)}; the fields are "
                        f"{', '.join(SPEC_FIELDS)}")  # fmt: skip
    try:
        spec = msgspec.convert(raw, AdapterSpec)
    except msgspec.ValidationError as e:
        raise SpecError(f"adapter spec: {e}") from None
    if problems := spec_problems(spec):
        raise SpecError("; ".join(problems))
    if not file_exists(spec.data):
        raise SpecError(f"data: the prompt file {spec.data!r} does not exist (the registry must be able to read it)")
    return spec


def spec_problems(spec: AdapterSpec) -> list[str]:
    """What is wrong with a spec besides its types (no I/O)."""
    sizes = {f: getattr(spec, f) for f in ("rank", "rollout_batch_size", "n_samples_per_prompt")}
    errs = [f"{f} must be an integer >= 1 (got {v})" for f, v in sizes.items() if v < 1]
    if not (math.isfinite(spec.alpha) and spec.alpha > 0):
        errs.append(f"alpha must be a number > 0 (got {spec.alpha})")
    elif spec.rank >= 1 and spec.alpha / spec.rank > MAX_LORA_SCALE:
        errs.append(f"alpha / rank is {spec.alpha / spec.rank:g}, above {MAX_LORA_SCALE:g}: the adapter's delta "
                    "would overflow the model")  # fmt: skip
    if not spec.target_modules:
        errs.append(f"target_modules is empty: name modules among {', '.join(LORA_TARGET_MODULES)}")
    errs += [f"target_modules: {m!r} is not one of {', '.join(LORA_TARGET_MODULES)}" for m in spec.target_modules
             if m not in LORA_TARGET_MODULES]  # fmt: skip
    if len(set(spec.target_modules)) != len(spec.target_modules):
        errs.append("target_modules names a module twice")
    if not spec.data:
        errs.append("data is empty: give the path of the adapter's prompt file (JSONL or Parquet)")
    if not spec.save:
        errs.append("save is empty: give the directory of the adapter's saves")
    if (spec.rm_type is None) == (spec.custom_rm_path is None):
        errs.append("give exactly one reward: rm_type (a built-in reward) or custom_rm_path (module.fn)"
                    + (", not both" if spec.rm_type is not None else ""))  # fmt: skip
    elif spec.custom_rm_path is not None and "." not in spec.custom_rm_path.replace(":", "."):
        errs.append(f"custom_rm_path {spec.custom_rm_path!r} is not an import path of the form package.module.fn")
    if (spec.num_step is None) == (spec.num_epoch is None):
        errs.append("give exactly one budget: num_step (optimizer steps) or num_epoch (passes over data)"
                    + (", not both" if spec.num_step is not None else ""))  # fmt: skip
    budgets = {f: v for f in ("num_step", "num_epoch") if (v := getattr(spec, f)) is not None}
    errs += [f"{f} must be an integer >= 1 (got {v})" for f, v in budgets.items() if v < 1]
    size = len(encode(spec))
    if size > MAX_SPEC_BYTES:  # the whole registry is one KV value: one tenant must not fill it
        errs.append(f"the spec takes {size} bytes encoded (metadata and paths included); at most {MAX_SPEC_BYTES}")
    return errs


class AdapterRegistry:
    """The registry's state and every transition of it. `clock` and `new_id` are injected so
    that tests are deterministic."""

    def __init__(
        self,
        num_slots: int,
        state: AdapterRegistryState | None = None,
        *,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ):
        self.num_slots = num_slots
        self.state = state if state is not None else AdapterRegistryState()
        # never shrink: a slot's version never resets, even across a restart with fewer slots
        self.state.slot_versions.extend([0] * (num_slots - len(self.state.slot_versions)))
        self.clock = clock
        self.new_id = new_id

    def copy(self) -> AdapterRegistry:
        """A registry on a deep copy of this state (a trial change that may not be stored)."""
        state = decode(encode(self.state), AdapterRegistryState)
        return AdapterRegistry(self.num_slots, state, clock=self.clock, new_id=self.new_id)

    # ---- reading -------------------------------------------------------------------------------
    @property
    def revision(self) -> int:
        return self.state.revision

    def current(self, name: str) -> AdapterRun | None:
        """The newest registration of `name` (live or not), or None."""
        return next((r for r in reversed(self.state.runs) if r.name == name), None)

    def get(self, name: str) -> AdapterRun:
        if (run := self.current(name)) is None:
            raise RegistryError(f"no adapter named {name!r:.140}: GET /adapter_runs lists them", 404)
        return run

    def holding(self) -> list[AdapterRun]:
        """The registrations that hold a slot, by slot."""
        return sorted((r for r in self.state.runs if r.state in HOLDING), key=lambda r: r.slot)

    def free_slots(self) -> list[int]:
        taken = {r.slot for r in self.holding()}
        return [s for s in range(self.num_slots) if s not in taken]

    def counts(self) -> dict[str, int]:
        """Registrations per state (every state named, 0 included)."""
        return {s.value: sum(r.state is s for r in self.state.runs) for s in AdapterState}

    # ---- transitions ----------------------------------------------------------------------------
    def register(self, name: str, spec: AdapterSpec) -> AdapterRun:
        """A new registration in the lowest free slot, PENDING. Refused: an invalid name (400), a
        name that is live or still cleaning up, a save directory a registered adapter uses, no
        free slot (409). `spec` is one parse_spec accepted."""
        if (problem := adapter_name_problem(name)) is not None:
            raise RegistryError(problem, 400)
        if name in RESERVED_NAMES:
            raise RegistryError(f"adapter name {name!r} is reserved (GET /adapter_runs/{name} is the registry's "
                                "state): pick another name", 400)  # fmt: skip
        if problems := spec_problems(spec):
            raise SpecError("; ".join(problems))
        if (prev := self.current(name)) is not None and prev.state in LIVE:
            raise RegistryError(
                f"adapter {name!r} is already registered ({prev.state.value}, slot {prev.slot}): retire it "
                f"(DELETE /adapter_runs/{name}) and register it again once it is completed, or pick another name"
            )
        if prev is not None and prev.state is CLEANUP:
            raise RegistryError(
                f"adapter {name!r} is still cleaning up (its final save is running): register it again once "
                f"GET /adapter_runs/{name} says completed"
            )
        # a save directory belongs to one name: a registration of another name would resume from its
        # saves and overwrite them (the name's own later registrations resume from it on purpose);
        # the same directory once resolved (`~`, `..`, doubled slashes, symlinks)
        save = os.path.realpath(os.path.expanduser(spec.save))
        for other in [*self.holding(), *(r for r in self.state.runs if r.name != name)]:
            if os.path.realpath(os.path.expanduser(other.spec.save)) == save:
                raise RegistryError(
                    f"save directory {spec.save!r} is used by adapter {other.name!r} ({other.state.value}): give "
                    "each adapter its own save directory"
                )
        if not (free := self.free_slots()):
            names = ", ".join(f"{r.name} ({r.state.value})" for r in self.holding())
            raise RegistryError(
                f"No free adapter slots: all {self.num_slots} are taken ({names}); retire one "
                "(DELETE /adapter_runs/NAME) or wait for one to complete, then register again"
            )
        now = self.clock()
        slot = free[0]
        run = AdapterRun(name=name, registration_id=self.new_id(), slot=slot, state=PENDING, spec=spec,
                         created_at=now, updated_at=now, slot_version=self.state.slot_versions[slot],
                         message="registered")  # fmt: skip
        self.state.runs.append(run)
        self._prune()
        self._changed(now)
        return run

    def activate(self, name: str, registration_id: str = "") -> AdapterRun:
        """PENDING -> ACTIVE: the trainer has set up the adapter's slot."""
        run = self._run(name, registration_id)
        return self._move(run, ACTIVE, "activated", {PENDING}, "activate", "only a pending adapter is activated")

    def stepped(self, name: str, step: int, registration_id: str = "") -> AdapterRun:
        """The adapter has taken optimizer steps up to `step`: records it and raises its slot's
        version by the steps taken since the last report (a report of no new step changes nothing)."""
        run = self._run(name, registration_id)
        self._require(run, "record a step of", {ACTIVE, RETIRING}, "only an active or retiring adapter takes steps")
        if step < 1:
            raise RegistryError(f"adapter {name!r}: a step is >= 1 (got {step})", 400)
        if step <= run.step:
            return run
        self.state.slot_versions[run.slot] += step - run.step
        run.step = step
        run.slot_version = self.state.slot_versions[run.slot]
        run.updated_at = self.clock()
        self._changed(run.updated_at)
        return run

    def retire(self, name: str, reason: str = "", registration_id: str = "") -> AdapterRun:
        """ACTIVE -> RETIRING (DELETE, or the trainer reached the budget); PENDING -> CLEANUP
        (nothing was trained). Repeated on a RETIRING adapter (its move is to RETIRING): nothing changes."""
        run = self._run(name, registration_id)
        why = f"retired: {reason}" if reason else "retired"
        return self._move(run, CLEANUP if run.state is PENDING else RETIRING, why, {PENDING, ACTIVE}, "retire",
                          "only a pending or active adapter is retired; it is already being finished")  # fmt: skip

    def cleanup(self, name: str, registration_id: str = "") -> AdapterRun:
        """RETIRING -> CLEANUP: the adapter's final save is running."""
        run = self._run(name, registration_id)
        return self._move(run, CLEANUP, "final save running", {RETIRING}, "start the cleanup of",
                          "retire it first (DELETE /adapter_runs/NAME)")  # fmt: skip

    def complete(self, name: str, registration_id: str = "") -> AdapterRun:
        """CLEANUP -> COMPLETED: saved; its slot is free for the next registration."""
        run = self._run(name, registration_id)
        return self._move(run, COMPLETED, "completed", {CLEANUP}, "complete",
                          "only an adapter whose final save is running completes")  # fmt: skip

    def apply(self, req: AdapterControl) -> AdapterRun:
        """One trainer request (asyncrl_proto.AdapterControl)."""
        if req.op in ("activate", "cleanup", "complete"):
            return getattr(self, req.op)(req.name, req.registration_id)
        if req.op == "stepped":
            return self.stepped(req.name, req.step, req.registration_id)
        if req.op == "retire":
            return self.retire(req.name, req.reason or "by the trainer", req.registration_id)
        raise RegistryError(f"unknown op {req.op!r:.40}: one of {', '.join(OPS)}", 400)

    # ---- inside ----------------------------------------------------------------------------------
    def _run(self, name: str, registration_id: str) -> AdapterRun:
        run = self.get(name)
        if registration_id and registration_id != run.registration_id:
            raise RegistryError(
                f"adapter {name!r}: registration {registration_id!r:.40} is not its current one "
                f"({run.registration_id}); the name was registered again"
            )
        return run

    @staticmethod
    def _require(run: AdapterRun, verb: str, allowed: set[AdapterState], hint: str) -> None:
        if run.state not in allowed:
            raise RegistryError(f"cannot {verb} adapter {run.name!r} in state {run.state.value} ({hint})")

    def _move(self, run: AdapterRun, to: AdapterState, message: str, allowed: set[AdapterState], verb: str,
              hint: str) -> AdapterRun:  # fmt: skip
        """`run` from a state in `allowed` to `to` (else refused, see _require); one already in `to`
        (the request repeated) is left as it is."""
        if run.state is to:
            return run
        self._require(run, verb, allowed, hint)
        now = self.clock()
        run.state, run.message, run.updated_at = to, message, now
        if to is COMPLETED:
            self._prune()
        self._changed(now)
        return run

    def _prune(self) -> None:
        """The oldest COMPLETED registrations go past MAX_HISTORY of them, or while the state is
        above MAX_STATE_BYTES encoded."""
        done = [r for r in self.state.runs if r.state is COMPLETED]
        drop = {id(r) for r in done[: max(0, len(done) - MAX_HISTORY)]}
        self.state.runs = [r for r in self.state.runs if id(r) not in drop]
        size = len(encode(self.state))
        for r in done[len(drop) :]:
            if size <= MAX_STATE_BYTES:
                break
            drop.add(id(r))
            size -= len(encode(r))
        self.state.runs = [r for r in self.state.runs if id(r) not in drop]

    def _changed(self, now: float) -> None:
        self.state.revision += 1
        self.state.updated_at = now
