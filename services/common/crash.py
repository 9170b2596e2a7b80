"""Named crash points: the places where a crash could tear a service's state.

`ASYNCRL_CRASH_AT=service:point:nth` makes the process of `service` SIGKILL itself the nth time
it passes `point` (nth defaults to 1). Every point a service passes is declared in POINTS (or
MULTI_LORA_POINTS, passed only in multi-LoRA runs), and the crash suite (tests/crash) runs a
short job (a multi-LoRA one for those) killed at each of them: a point added here is covered
there automatically (a unit test checks that the code passes exactly the declared ones).
The launcher gives a restarted child no crash point: the injection fires once per run.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

ENV = "ASYNCRL_CRASH_AT"

POINTS: dict[str, tuple[str, ...]] = {
    "buffer": (
        "decided_before_append",  # decisions made (puts, leases, releases), none on the ledger yet
        "appended_before_ack",  # the ledger has them, the ROLLOUTS messages are not acknowledged
        "lease_decided_before_reply",  # a step's lease is complete and durable, the trainer not told
        "snapshot_write",  # while the KV snapshot is written
    ),
    "trainer": (
        "optimizer_step_before_records",  # the weights are updated, nothing of the step recorded
        "records_before_checkpoint",  # trained.jsonl and metrics have the step, no checkpoint
        "checkpoint_before_commit",  # the checkpoint has the step, the buffer does not know
        "commit_before_next_step",  # committed, before the next step starts
        "weights_export",  # a weight snapshot half written
        "weights_stored",  # object-store: a version in the bucket, not announced
        "mid_broadcast",  # distributed: half of a version's tensors sent to the engines
    ),
    "weight-sync": (
        "paused",  # the engines are paused, nothing loaded
        "loaded_before_continue",  # the new weights are loaded, the engines still paused
        "continued_before_announce",  # the engines run the new version, nobody knows
        "transfer_paused",  # distributed: the engines paused (staged: holding the new version), not swapped
    ),
    "rollout": (
        "generated_before_publish",  # a group is finished, not on ROLLOUTS
        "published_before_ack",  # on ROLLOUTS, its prompt not acknowledged
    ),
    "engine": ("mid_step",),  # between a forward pass and its results
    "eval": ("mid_point",),  # an eval point half evaluated
}
"""The points a single-model run passes."""

MULTI_LORA_POINTS: dict[str, tuple[str, ...]] = {
    "trainer": (
        "adapter_stepped_before_records",  # an adapter's factors stepped, nothing of the step recorded
        "adapter_reported_before_publish",  # the registry has the step (its slot version), no version saved
        "adapter_published_before_commit",  # the version announced, the partition's step not committed
        "adapter_saved_before_complete",  # the final save written, the registry not told
    ),
    "weight-sync": ("adapter_loaded_before_live",),  # a version on every engine, KV adapter_live not written
    "adapters": ("stored_before_reply",),  # the registry stored a trainer's request, not answered
}
"""The points only a multi-LoRA run passes (the crash suite runs those in a multi-LoRA job)."""

log = logging.getLogger(__name__)
_counts: dict[str, int] = {}


def _armed() -> tuple[str, str, int] | None:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    service, _, rest = spec.partition(":")
    point, _, nth = rest.partition(":")
    if point not in POINTS.get(service, ()) + MULTI_LORA_POINTS.get(service, ()):
        raise ValueError(f"${ENV}={spec!r}: no crash point {point!r} in {service!r} (see services.common.crash.POINTS)")
    return service, point, int(nth or 1)


ARMED = _armed()


def point(service: str, name: str) -> None:
    """A place where a crash could tear state: SIGKILL here when $ASYNCRL_CRASH_AT says so."""
    if ARMED is None or ARMED[:2] != (service, name):
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] == ARMED[2]:
        print(f"crash point {service}:{name}:{ARMED[2]} reached: SIGKILL", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
