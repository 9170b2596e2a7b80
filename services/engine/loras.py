"""LoRA adapters on the built-in engine, as SGLang serves them (--enable-lora; SGLang's flags and
routes, docs/engine.md "LoRA adapters"): /generate's `lora_path` and the OpenAI routes' `model` name them.

Every resident adapter holds one slot of the model's MultiLora (services/model/lora.py), so one
batch serves rows of several adapters. Its tensors are placed on the scheduler's thread. Unload
refuses new requests for that name at once and frees the slot when its last request has finished
(SGLang's semantics: requests in flight keep their adapter). A request names an adapter by name;
the prefix cache keys a prompt by the adapter's load (`uid`), so a prompt's cached keys and values
are reused only under the same adapter weights.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from services.engine.protocol import BadRequest, typed
from services.model.lora import TARGETS, LoraError, MultiLora, load_adapter

NAME = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9._:@-]{1,128}$")
UNLOAD_TIMEOUT_S = 600.0


@dataclass
class Resident:
    name: str
    path: str
    slot: int
    uid: int
    unloading: bool = False


class EngineLoras:
    def __init__(self, scheduler, max_loras: int = 8, max_rank: int = 16, targets=TARGETS):
        self.scheduler = scheduler
        self.lora = MultiLora(scheduler.model, n_slots=max_loras, max_rank=max_rank, targets=targets)
        scheduler.lora = self.lora
        self.lock = threading.RLock()
        """Held to resolve names and queue their requests, and to mark an adapter unloading: an unload
        never misses a request that resolved its adapter before it (reentrant: queueing resolves under it)."""
        self.adapters: dict[str, Resident] = {}
        self._uids = itertools.count(1)

    # ---- requests ------------------------------------------------------------------------------
    def resolve(self, name: str | None) -> tuple[int, int]:
        """(slot, uid) of a resident adapter for a request; (-1, 0) for the base model. Under `lock`."""
        if name is None:
            return -1, 0
        res = self.adapters.get(name)
        if res is None or res.unloading:
            known = ", ".join(sorted(n for n, r in self.adapters.items() if not r.unloading)) or "none"
            raise BadRequest(f"lora_path: no LoRA adapter {name!r:.140} is loaded (loaded: {known}); "
                             "load it with /load_lora_adapter first")  # fmt: skip
        return res.slot, res.uid

    def loaded(self) -> dict[str, str]:
        """{name: path} of the adapters requests may use (takes the lock)."""
        with self.lock:
            return {n: r.path for n, r in self.adapters.items() if not r.unloading}

    # ---- load / unload (blocking: run them in a worker thread) ---------------------------------
    def load(self, body: dict) -> dict:
        name = typed(body, "lora_name", str, required=True)
        path = typed(body, "lora_path", str, required=True)
        typed(body, "pinned", bool)  # accepted, and changes nothing
        typed(body, "lora_id", str)
        if not NAME.match(name):
            raise BadRequest("lora_name must be 1-128 characters of letters, digits and . _ - : @ (not . or ..)")
        with self.lock:
            if name in self.adapters:
                raise BadRequest(f"a LoRA adapter named {name!r} is already loaded: unload it first")
            used = {r.slot for r in self.adapters.values()}
            slot = next((s for s in range(self.lora.n_slots) if s not in used), None)
            if slot is None:
                raise BadRequest(f"all {self.lora.n_slots} LoRA slots are in use (--max-loras-per-batch): "
                                 "unload an adapter first")  # fmt: skip
            res = Resident(name, path, slot, next(self._uids), unloading=True)  # reserved, not usable yet
            self.adapters[name] = res
        try:
            spec, tensors = load_adapter(Path(path))
            self.scheduler.call(self.lora.set_slot, slot, spec, tensors)  # placed on the model's thread
        except BaseException as e:  # whatever failed, the reservation goes: the name and slot are free again
            with self.lock:
                del self.adapters[name]
            if isinstance(e, LoraError):
                raise BadRequest(f"Failed to load LoRA adapter {name}: {e}") from None
            raise
        with self.lock:
            res.unloading = False
        return self._answer()

    def unload(self, body: dict) -> dict:
        name = typed(body, "lora_name", str, required=True)
        with self.lock:
            res = self.adapters.get(name)
            if res is None or res.unloading:
                raise BadRequest(f"no LoRA adapter {name!r:.140} is loaded")
            res.unloading = True  # from here no request resolves it
        try:
            self.scheduler.wait_lora_idle(res.slot, UNLOAD_TIMEOUT_S)  # its requests in flight finish first
        except TimeoutError:
            with self.lock:
                res.unloading = False  # still loaded and usable: the caller may abort its requests and retry
            raise
        self.scheduler.call(self.lora.clear_slot, res.slot)
        with self.lock:
            del self.adapters[name]
        return self._answer()

    def _answer(self) -> dict:
        return {"success": True, "error_message": "", "loaded_adapters": self.loaded()}

    def info(self) -> dict:
        return {"enable_lora": True, "max_loras_per_batch": self.lora.n_slots, "max_lora_rank": self.lora.max_rank,
                "lora_target_modules": list(self.lora.targets)}  # fmt: skip


def parse_lora_paths(items: list[str]) -> list[dict]:
    """--lora-paths entries as /load_lora_adapter bodies: NAME=PATH, PATH (named after its
    folder), or the JSON object {"lora_name", "lora_path", "pinned"}."""
    bodies = []
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                body = json.loads(item)
            except ValueError as e:
                raise ValueError(f"--lora-paths: {item!r:.80} is not valid JSON ({e})") from None
            if not isinstance(body, dict):
                raise ValueError(f"--lora-paths: {item!r:.80} is not a JSON object")
        elif "=" in item:
            name, path = item.split("=", 1)
            body = {"lora_name": name, "lora_path": path}
        else:
            body = {"lora_name": Path(item).name, "lora_path": item}
        bodies.append(body)
    return bodies


def parse_target_modules(items: list[str] | None) -> tuple[str, ...]:
    if not items or items == ["all"]:
        return TARGETS
    unknown = sorted(set(items) - set(TARGETS))
    if unknown:
        raise ValueError(f"--lora-target-modules: {unknown} are not LoRA targets of this engine; use any of "
                         f"{', '.join(TARGETS)}, or all")  # fmt: skip
    return tuple(items)
