"""The engine's weight API: staging a snapshot beside the running weights, loading one (from
disk, a staged copy, or tensors received from the trainer), naming the version, and flushing the
prefix cache. It sits on the scheduler's thread hand-off (`call`, `call_chunked`) and its locks:
the torch work runs on the scheduler thread, between decode steps, never under the lock a step
takes (services.engine.scheduler)."""

from __future__ import annotations

import threading
import time

from services.common.snapshot import COMPLETE_MARKER, resolved
from services.model.hf_io import iter_stage_weights, load_weights_into, swap_in


class WeightAPI:
    """The Scheduler's weight methods (a base class of it: these read and write the scheduler's
    model, its version, its prefix-cache epoch and its work condition)."""

    _stage_lock: threading.Lock
    _model_lock: threading.Lock
    _work: threading.Condition

    @staticmethod
    def _snapshot_key(model_path: str, weight_version) -> tuple:
        """What names one snapshot exactly: its resolved path, the version, and its marker's
        content (a snapshot rewritten under the same name has another digest)."""
        path = resolved(model_path)
        try:
            marker = (path / COMPLETE_MARKER).read_text() if path is not None else None
        except OSError:
            marker = None
        return (str(path), None if weight_version is None else str(weight_version), marker)

    def stage_weights(self, model_path: str, weight_version) -> float:
        """Load a snapshot beside the running weights while generation goes on (no lock the
        forward pass takes); the next update_weights_from_disk of the same snapshot then only
        swaps it in. Returns the seconds it took. One staged version at a time (the newest)."""
        with self._stage_lock:
            t0 = time.perf_counter()
            key = self._snapshot_key(model_path, weight_version)
            tensors = self.call_chunked(iter_stage_weights, self.model, model_path)
            with self._work:
                self._staged = (key, tensors)
            self.stats.weight_stage_duration_s = time.perf_counter() - t0
            return self.stats.weight_stage_duration_s

    def update_weights_from_disk(self, model_path: str, weight_version: str | None, timeout_s: float = 600) -> dict:
        """Load a snapshot in place: a staged one (stage_weights) is swapped in, anything else is
        read now. Paused: at once (after the step in flight). Not paused: after in-flight requests
        finish, as SGLang's writer lock does."""
        with self._work:
            self._wait_quiet(timeout_s)
            staged, self._staged = self._staged, None
        if staged is not None and staged[0] != self._snapshot_key(model_path, weight_version):
            staged = None  # staged something else: read this one
        if staged is not None:
            self.stats.num_staged_swaps_total += 1
            return self.call(self._load, lambda: swap_in(self.model, staged[1]), weight_version) | {"staged": True}
        return self.call(self._load, lambda: load_weights_into(self.model, model_path), weight_version) | {
            "staged": False
        }

    def update_weights_from_tensors(self, tensors: dict, weight_version: str | None, timeout_s: float = 600) -> dict:
        """Swap in a whole set of weights received from the trainer (distributed mode): new
        tensors matching the model's parameters; waits for in-flight work as update_weights_from_disk."""
        with self._work:
            self._wait_quiet(timeout_s)
        return self.call(self._load, lambda: swap_in(self.model, tensors), weight_version)

    def _wait_quiet(self, timeout_s: float) -> None:
        """Under `_work`: return once paused, or once no request is in flight (SGLang's writer lock)."""
        deadline = time.monotonic() + timeout_s
        while not self.paused_mode and (self.running or self.waiting or self._inbox):
            if not self._work.wait(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError("in-flight requests did not finish; pause generation first")

    def _load(self, load, weight_version) -> dict:
        with self._model_lock:
            t0 = time.perf_counter()
            load()
            self.stats.weight_load_duration_s = time.perf_counter() - t0
            with self._work:
                self.kv_epoch += 1  # every cached prefix was computed with the old weights
                if weight_version is not None:
                    self.weight_version = str(weight_version)
                return {"num_paused_requests": len(self.running) + len(self.waiting)}

    def set_weight_version(self, version: str) -> None:
        with self._model_lock, self._work:
            self.weight_version = str(version)

    def flush_cache(self) -> bool:
        """Drop the prefix cache. Like SGLang, refuses while requests are running or waiting."""
        with self._work:
            if self.running or (self.waiting and not self.paused_mode):
                return False
            self.kv_epoch += 1
            self.slot_prompt.clear()
            return True
