from __future__ import annotations

import re

from pydantic import Field

from services.common.config.base import Section

ADAPTER_NAME = re.compile(r"[A-Za-z0-9_-]([A-Za-z0-9._-]{0,94}[A-Za-z0-9_-])?")
"""An adapter's name: 1-96 letters, digits, '.', '_' and '-', neither starting nor ending with '.' (it
names files and KV keys, and the engines serve its versions as `<name>@<registration>.v<k>`)."""


def adapter_name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter, or None."""
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        return (f"adapter name {name!r:.140} is invalid: use 1-96 characters from letters, digits, '.', '_' "
                "and '-', not starting or ending with '.'")  # fmt: skip
    return None


def adapter_pairs(entries: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """--multi-lora-adapter's values as (name, yaml path) pairs, and what is wrong with them. Each
    adapter is NAME YAML (two values) or NAME=YAML (one)."""
    pairs, errs, rest = [], [], iter(entries)
    for entry in rest:
        if "=" in entry:
            name, _, path = entry.partition("=")
        elif (path := next(rest, None)) is not None:
            name = entry
        else:
            errs.append(f"--multi-lora-adapter {entry!r} has no YAML file: give NAME YAML (or NAME=YAML)")
            break
        if (problem := adapter_name_problem(name)) is not None:
            errs.append(f"--multi-lora-adapter: {problem}")
        elif not path:
            errs.append(f"--multi-lora-adapter {name!r} has no YAML file: give NAME YAML (or NAME=YAML)")
        elif name in dict(pairs):
            errs.append(f"--multi-lora-adapter names {name!r} twice: give each adapter once")
        else:
            pairs.append((name, path))
    return pairs, errs


class MultiLoraSection(Section):
    """Multi-LoRA async (Miles's train_multi_lora_async.py): tenants register LoRA adapters on the
    one base model, each trained in a slot of the trainer until its own budget, saved, and its slot
    freed for the next (launcher, adapters service; services/adapters)."""

    n_adapters: int = Field(
        0,
        ge=0,
        le=64,
        description="Multi-LoRA async: the trainer's adapter slots, i.e. the most adapters trained at once "
        "(0: multi-LoRA off). With it the launcher starts the adapter registry (`asyncrl service adapters`).",
    )
    adapter: list[str] = Field(
        default_factory=list,
        json_schema_extra={"repeatable": True},
        description="Multi-LoRA: an adapter registered at start, as NAME YAML (repeat the flag for more: "
        "--multi-lora-adapter a a.yaml --multi-lora-adapter b b.yaml) or NAME=YAML; the YAML holds its spec "
        "(data, rank, alpha, target_modules, rollout_batch_size, n_samples_per_prompt, save, rm_type or "
        "custom_rm_path, num_step or num_epoch, metadata). Registered once: a restarted registry skips a name it has.",
    )
    max_rank: int = Field(
        16,
        ge=1,
        le=1024,
        description="Multi-LoRA: the largest adapter rank the engines can load (SGLang's --max-lora-rank; the built-in "
        "engines are started with it).",
    )
    max_coalesce_wait_s: float = Field(
        0.0,
        ge=0,
        description="Multi-LoRA: once one adapter's batch (a step's rollout_batch_size groups) is ready, keep "
        "collecting other adapters' batches into the same training batch while each arrives within this many "
        "seconds of the last, up to --global-batch-size samples (default: --rollout-batch-size x "
        "--n-samples-per-prompt); only the adapters in the batch step, and a registry change (a DELETE, a new "
        "adapter) waits for the batch to ship. 0: train what is ready at once (the trainer runs each adapter's "
        "forward on its own rows, so waiting buys no speed, only Miles's batch shape).",
    )
    max_empty_wait_s: float = Field(
        30.0,
        gt=0,
        description="Multi-LoRA: with adapters active but no batch ready for this long, warn (naming the step "
        "each adapter waits for) and keep waiting.",
    )
    idle_poll_s: float = Field(
        2.0, gt=0, description="Multi-LoRA: while no adapter is training, look for new ones this often."
    )
    service_mode: bool = Field(
        False,
        description="Multi-LoRA: run as a service: when no adapter is left, wait for new registrations "
        "indefinitely instead of ending the run.",
    )
    custom_rm_paths: list[str] = Field(
        default_factory=list,
        json_schema_extra={"repeatable": True},
        description="Multi-LoRA: the reward functions (module.fn) an adapter registered over HTTP may name as "
        "custom_rm_path; any other is refused (importing it would run a tenant's choice of code in the producers). "
        "Adapters from --multi-lora-adapter YAML files may name any.",
    )
    max_data_mb: float = Field(
        256.0,
        gt=0,
        description="Multi-LoRA: the largest prompt file an adapter may name (its rows are held by the buffer and "
        "read by the trainer and producers).",
    )

    @property
    def adapter_pairs(self) -> list[tuple[str, str]]:
        """--multi-lora-adapter as (name, yaml path) pairs."""
        return adapter_pairs(self.adapter)[0]

    def problems(self) -> list[str]:
        errs = adapter_pairs(self.adapter)[1]
        if self.adapter and self.n_adapters == 0:
            errs.append("--multi-lora-adapter registers adapters for multi-LoRA, which is off: set "
                        "--multi-lora-n-adapters to the number of adapter slots")  # fmt: skip
        return errs


MULTI_LORA_IGNORES = {
    "num_steps_per_rollout": "takes one optimizer step per adapter batch (--global-batch-size sets how many "
    "samples a batch coalesces)",
    "keep_old_actor": "trains adapters on a frozen base, with no old actor to keep",
    "save_interval": "saves each adapter in its own `save` directory (its YAML) when it retires; the base never "
    "changes",
    "save_hf": "saves adapters as PEFT directories in their `save` directories",
    "save_trigger_sentinel": "saves each adapter when it retires (DELETE /adapter_runs/{name} retires one now)",
    "load": "resumes each adapter from the newest save in its `save` directory",
    "custom_rollout_log_function_path": "records each adapter's steps on its own axis and does not call a rollout "
    "log function",
}
"""Flags of the single-model run (TrainerSection fields) that multi-LoRA would silently ignore, and why: each
is refused (drop it)."""
