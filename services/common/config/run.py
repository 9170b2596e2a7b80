"""The run configuration: one typed section per concern (`config.rollout.temperature`), and the
one place where sections meet: the values derived from several sections and the rules that
join them, each naming the sections it joins.

Flags use Miles's names in kebab case on the command line (`--rollout-batch-size`); a field
inside its section drops the section's name (`rollout.batch_size`), and FLAGS is the one table
from flag to field (config_load.py loads them). RunConfig(**flags) builds one from flag names;
`model_dump()` and the stored config are flat, by flag name, so a run directory reads as the
command line did. Plugins get a flat read-only view (`FlatConfig`). Each section's own rules are
its `problems()`. This package imports no torch.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.config.async_ import AsyncSection
from services.common.config.base import ConfigError, Section
from services.common.config.data import DataSection
from services.common.config.eval import EvalSection
from services.common.config.infra import InfraSection
from services.common.config.multi_lora import MULTI_LORA_IGNORES, MultiLoraSection
from services.common.config.rollout import RolloutSection
from services.common.config.trainer import TrainerSection

SECTION_NAMES: dict[type[Section], str] = {
    InfraSection: "infra", DataSection: "data", RolloutSection: "rollout", AsyncSection: "async_",
    TrainerSection: "trainer", EvalSection: "eval", MultiLoraSection: "multi_lora",
}  # fmt: skip
"""Each section's attribute on RunConfig (`config.async_`: `async` is a Python keyword)."""

SECTIONS: tuple[type[Section], ...] = tuple(SECTION_NAMES)
"""The configuration's sections, in the order --help shows them."""

MILES_NAMES: dict[tuple[str, str], str] = {
    **{("rollout", f): "rollout_" + f for f in (
        "batch_size", "max_response_len", "temperature", "top_p", "top_k", "stop_token_ids", "function_path",
        "sample_filter_path", "all_samples_process_path")},
    **{("async_", f): "async_" + f for f in ("data_buffer_capacity_factor", "unused_samples_handler",
                                            "max_concurrent_samples")},
    ("trainer", "num_ranks"): "trainer_num_ranks",
    **{("eval", f): "eval_" + f for f in (
        "interval", "prompt_data", "config", "temperature", "max_response_len", "top_p", "num_gpus",
        "num_gpus_per_engine", "function_path", "hf_dir", "max_in_flight", "overflow_policy", "keep_snapshots",
        "engine_urls", "sglang_args")},
    **{("multi_lora", f): "multi_lora_" + f for f in (
        "n_adapters", "adapter", "max_rank", "max_coalesce_wait_s", "max_empty_wait_s", "idle_poll_s", "service_mode",
        "custom_rm_paths", "max_data_mb")},
}  # fmt: skip
"""The fields whose flag keeps Miles's name with its section's prefix (every other flag is its field's name)."""


class Flag(NamedTuple):
    section: type[Section]
    attr: str  # the section's attribute on RunConfig
    field: str  # the field's name in its section


FLAGS: dict[str, Flag] = {
    MILES_NAMES.get((SECTION_NAMES[cls], field), field): Flag(cls, SECTION_NAMES[cls], field)
    for cls in SECTIONS for field in cls.model_fields
}  # fmt: skip
"""Every flag (its snake_case name) to its section and field, in the order --help shows them."""

FLAG_OF: dict[tuple[str, str], str] = {(f.attr, f.field): name for name, f in FLAGS.items()}


DERIVED: dict[str, str] = {
    name: attr for cls, attr in SECTION_NAMES.items() for name, v in vars(cls).items() if isinstance(v, property)
}
"""Each section's own derived value (`mode`, `total_steps`) to the section's attribute on RunConfig."""


def home_of(name: str) -> str | None:
    """Where a flag, or a section's own derived value, is read (`config.rollout.batch_size`)."""
    if name in FLAGS:
        return f"config.{FLAGS[name].attr}.{FLAGS[name].field}"
    return f"config.{DERIVED[name]}.{name}" if name in DERIVED else None


def joins(*sections: type[Section]):
    """Marks a derived value or a rule as joining these sections (and only these: a test reads its body
    and fails on a section it reads without naming it here); RunConfig._validate runs every rule so marked."""

    def mark(fn):
        fn.joins = sections
        return fn

    return mark


def by_section(flags: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Flag values grouped as {section attribute: {field: value}}; an unknown flag is a ConfigError."""
    out: dict[str, dict[str, Any]] = {}
    for name, value in flags.items():
        if (flag := FLAGS.get(name)) is None:
            raise ConfigError(f"unknown setting {name!r} (see `asyncrl train-async --help` for the flags)")
        out.setdefault(flag.attr, {})[flag.field] = value
    return out


FULLY_ASYNC_REFUSES = {
    "colocate": "--fully-async cannot be combined with --colocate: training and rollout must run on separate devices "
    "so that generation never stops; drop --colocate",
    "partial_rollout": "--fully-async cannot be combined with --partial-rollout: the fully-async producer recycles "
    "aborted groups itself; drop --partial-rollout",
    "rollout_function_path": "--fully-async cannot be combined with a custom rollout function "
    "(--rollout-function-path): the fully-async producer owns the rollout loop; use "
    "--custom-generate-function-path to customise generation instead",
}
NOT_SUPPORTED = {
    "colocate": "--colocate is not supported: training and rollout run as separate processes on separate devices, "
    "with no offload between them; drop --colocate",
    "partial_rollout": "--partial-rollout is not supported: an aborted group is regenerated whole (set "
    "--async-unused-samples-handler retry to retry it); drop --partial-rollout",
    "rollout_function_path": "--rollout-function-path is not supported: the producer owns the rollout loop; "
    "customise generation with --custom-generate-function-path and rewards with --custom-rm-path",
}
"""Miles's flags that asyncrl has no use for (one process per role, on its own devices; the producer
owns the rollout loop), and why each is refused: under --fully-async, and in the other modes."""


class RunConfig(BaseModel):
    """The run's sections; below, the values and rules that join them."""

    model_config = ConfigDict(frozen=True, extra="forbid")  # read-only: model_copy(update=...) makes a changed one

    infra: InfraSection = Field(default_factory=InfraSection)
    data: DataSection = Field(default_factory=DataSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    async_: AsyncSection = Field(default_factory=AsyncSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    multi_lora: MultiLoraSection = Field(default_factory=MultiLoraSection)

    @model_validator(mode="before")
    @classmethod
    def _from_flags(cls, data):
        """Flat flag names (a config file, the command line, the stored config) go to their sections;
        a nats:// URL's credentials come out of it (nats_url nats://host, nats_user, nats_password;
        a lone user part is a token): a secret in the URL would be stored and put on command lines."""
        if not isinstance(data, dict):
            return data
        flat = {k: v for k, v in data.items() if k not in SECTION_NAMES.values()}
        if flat.get("nats_url"):
            from services.common.secrets import url_credentials

            url, found = url_credentials(str(flat["nats_url"]))
            if found:  # the URL's credentials, unless given as flags too
                flat = {f"nats_{key}": value for key, value in found.items()} | flat | {"nats_url": url}
        out = {k: v for k, v in data.items() if k in SECTION_NAMES.values()}
        for attr, fields in by_section(flat).items():
            given = out.get(attr, {})
            given = {k: getattr(given, k) for k in given.model_fields_set} if isinstance(given, Section) else dict(given)
            out[attr] = {**given, **fields}
        return out

    def __getattr__(self, name: str):
        if (home := home_of(name)) is not None:
            raise AttributeError(f"RunConfig has no flat {name!r}: read {home}")
        return super().__getattr__(name)

    def model_dump(self, **kw) -> dict[str, Any]:
        """Flat, by flag name (the stored config, config.json, a child's command line)."""
        if kw.keys() & {"include", "exclude"}:
            raise TypeError("RunConfig.model_dump() is flat by flag name: filter its dict, not its fields")
        sections = {attr: getattr(self, attr).model_dump(**kw) for attr in SECTION_NAMES.values()}
        return {FLAG_OF[(attr, field)]: v for attr, dump in sections.items() for field, v in dump.items()}

    def model_dump_json(self, **kw) -> str:
        """model_dump(mode="json") as JSON text."""
        return json.dumps(self.model_dump(mode="json", **kw))

    def model_copy(self, *, update: dict | None = None, deep: bool = False) -> RunConfig:
        """A copy with flags changed (by flag name), each in its own section."""
        changed = {attr: getattr(self, attr).model_copy(update=fields, deep=deep)
                   for attr, fields in by_section(update or {}).items()}  # fmt: skip
        return super().model_copy(update=changed, deep=deep)

    def flag(self, name: str) -> Any:
        """A flag's value by its name (`config.flag("eval_hf_dir")` is `config.eval.hf_dir`)."""
        f = FLAGS[name]
        return getattr(getattr(self, f.attr), f.field)

    @property
    def flags_set(self) -> set[str]:
        """The flags given explicitly (a file, the environment, the command line, code)."""
        return {FLAG_OF[(attr, f)] for attr in SECTION_NAMES.values() for f in getattr(self, attr).model_fields_set}

    # Values derived from several sections.

    @property
    @joins(AsyncSection, InfraSection)
    def adapter_transfer_mode(self) -> Literal["disk", "object-store"]:
        """How multi-LoRA adapter versions reach the engines: through the run's weights bucket with
        --update-weight-transfer-mode object-store, and with distributed when the launcher starts
        built-in engines (they fetch from the bucket, so no node needs the trainer's disk; the base
        never changes in this mode, and LoRA over a broadcast group is not in upstream SGLang);
        by disk otherwise (SGLang servers and external engines load a path they must see)."""
        mode = self.async_.update_weight_transfer_mode
        if mode == "object-store" or (mode == "distributed" and self.infra.engine == "builtin"
                                      and not self.infra.rollout_external_engine_addrs):  # fmt: skip
            return "object-store"
        return "disk"

    @property
    @joins(AsyncSection, InfraSection, MultiLoraSection)
    def engines_read_bucket(self) -> bool:
        """The built-in engines fetch `nats-object://` weights or adapters (they get the run's NATS
        URL and a read-only identity)."""
        if self.async_.update_weight_transfer_mode == "object-store":
            return True
        return self.multi_lora.n_adapters > 0 and self.adapter_transfer_mode == "object-store"

    @property
    @joins(AsyncSection, RolloutSection)
    def buffer_capacity(self) -> int:
        return math.floor(self.async_.data_buffer_capacity_factor * self.rollout.batch_size)

    @property
    @joins(AsyncSection, RolloutSection)
    def inflight_groups(self) -> int:
        """In-flight cap of one producer, in groups (docs/services.md, "Producers and engines")."""
        if self.async_.max_concurrent_samples is not None:
            return max(1, self.async_.max_concurrent_samples // self.rollout.n_samples_per_prompt)
        return self.rollout.batch_size

    @property
    @joins(AsyncSection, RolloutSection, InfraSection, MultiLoraSection)
    def rollouts_max_msgs(self) -> int:
        """ROLLOUTS' message cap: four times what a run holds there at once (stored, in flight
        on every producer the launcher starts, and two steps' leases), per adapter, plus 1024.
        Past it a producer's publish is refused until the buffer's next purge."""
        producers = max(1, self.infra.rollout_num_producers)
        held = self.buffer_capacity + self.inflight_groups * producers + 2 * self.rollout.batch_size
        return 4 * held * max(1, self.multi_lora.n_adapters) + 1024

    @property
    @joins(AsyncSection, InfraSection)
    def submission_granularity(self) -> Literal["sample", "group"]:
        if self.async_.rollout_submission_granularity is not None:
            return self.async_.rollout_submission_granularity
        return "sample" if self.infra.mode == "fully_async" else "group"

    @property
    @joins(TrainerSection, RolloutSection)
    def optimizer_steps_per_rollout(self) -> int:
        t = self.trainer
        if t.num_steps_per_rollout is not None:
            return t.num_steps_per_rollout
        if t.global_batch_size is not None:
            return max(1, self.rollout.batch_size * self.rollout.n_samples_per_prompt // t.global_batch_size)
        return 1

    @property
    @joins(TrainerSection, AsyncSection, InfraSection)
    def commit_interval(self) -> int:
        """The most steps between two commits (a save at an epoch's end or on the sentinel only
        adds commits): the buffer's window of steps the trainer may ask for."""
        if self.trainer.checkpoints_resume:
            return self.trainer.save_interval
        return 1 if self.infra.mode == "sync" else self.async_.update_weights_interval

    # Rules that join sections; every one runs, and all their problems are reported at once.

    @joins(InfraSection, RolloutSection, AsyncSection)
    def _mode_problems(self) -> list[str]:
        """What each mode cannot run with."""
        i, r, a, errs = self.infra, self.rollout, self.async_, []
        if i.fully_async:
            if r.all_samples_process_path is not None:
                errs.append("--fully-async does not support --rollout-all-samples-process-path")
            if r.over_sampling_batch_size is not None:
                errs.append(
                    "--over-sampling-batch-size applies to the train and one-step train-async drivers: under "
                    "--fully-async the producers keep the buffer full instead; drop it"
                )
            if a.pause_generation_mode == "abort":
                errs.append(
                    "--fully-async cannot use --pause-generation-mode abort: generation is always in "
                    "flight, so every weight update would kill it and force a full regeneration"
                )
        refused = FULLY_ASYNC_REFUSES if i.fully_async else NOT_SUPPORTED
        return errs + [why for flag, why in refused.items() if self.flag(flag)]

    @joins(AsyncSection, RolloutSection)
    def _capacity_problems(self) -> list[str]:
        errs = []
        if (capacity := self.buffer_capacity) < 1:
            errs.append(
                f"buffer capacity floor({self.async_.data_buffer_capacity_factor} * "
                f"{self.rollout.batch_size}) = {capacity} holds no group: raise "
                "--async-data-buffer-capacity-factor or --rollout-batch-size so that it is at least 1"
            )
        cap, n = self.async_.max_concurrent_samples, self.rollout.n_samples_per_prompt
        if cap is not None and cap < n:
            errs.append(
                f"--async-max-concurrent-samples ({cap}) must be >= --n-samples-per-prompt ({n}): whole prompt "
                "groups are submitted, so a smaller cap could never submit one"
            )
        return errs

    @joins(AsyncSection, InfraSection, TrainerSection)
    def _transfer_problems(self) -> list[str]:
        errs, mode = [], self.async_.update_weight_transfer_mode
        if mode == "object-store" and self.infra.engine == "sglang":
            errs.append(
                "--update-weight-transfer-mode object-store needs the built-in engine, which fetches weights from the "
                "bucket itself; an SGLang server loads from disk only: use --update-weight-transfer-mode disk"
            )
        if self.trainer.use_ray and "update_weight_transfer_mode" in self.flags_set and mode == "disk":
            errs.append(
                "--use-ray places engines on nodes that do not see the trainer's disk: use "
                "--update-weight-transfer-mode object-store (the default with --use-ray) or distributed"
            )
        return errs

    @joins(TrainerSection, RolloutSection, MultiLoraSection)
    def _batch_problems(self) -> list[str]:
        """How a rollout's samples split into optimizer steps."""
        t, errs = self.trainer, []
        samples = self.rollout.batch_size * self.rollout.n_samples_per_prompt
        if t.num_steps_per_rollout is not None and t.global_batch_size is not None:
            if t.global_batch_size != samples // t.num_steps_per_rollout:
                errs.append(
                    f"--global-batch-size {t.global_batch_size} is not equal to --rollout-batch-size "
                    f"{self.rollout.batch_size} * --n-samples-per-prompt {self.rollout.n_samples_per_prompt} "
                    f"// --num-steps-per-rollout {t.num_steps_per_rollout}: set one of them"
                )
        elif (
            t.global_batch_size is not None
            and not self.multi_lora.n_adapters  # multi-LoRA: the target of a coalesced batch
            and (samples % t.global_batch_size or t.global_batch_size > samples)
        ):
            errs.append(
                f"--global-batch-size {t.global_batch_size} must divide the rollout's {samples} samples "
                f"(--rollout-batch-size x --n-samples-per-prompt)"
            )
        elif t.num_steps_per_rollout is not None and t.num_steps_per_rollout > samples:
            errs.append(f"--num-steps-per-rollout {t.num_steps_per_rollout} exceeds the rollout's {samples} samples")
        if self.optimizer_steps_per_rollout > 1 and t.num_ranks > 1:
            errs.append(
                "several optimizer steps per rollout (--num-steps-per-rollout, --global-batch-size) run on one "
                "trainer rank in this version: drop --trainer-num-ranks or train one step per rollout"
            )
        return errs

    @joins(EvalSection, TrainerSection)
    def _snapshot_eval_problems(self) -> list[str]:
        """Where snapshot eval (a fleet or an external evaluator) gets its snapshots."""
        e, t, errs = self.eval, self.trainer, []
        if e.backend == "shared":
            return errs
        if e.interval is None:
            errs.append("Snapshot eval requires --eval-interval.")
        if not e.hf_dir and not t.save_hf:
            errs.append(
                "Snapshot eval requires a snapshot source: set --eval-hf-dir (staging exports) or --save-hf "
                "(reuse periodic HF checkpoints)."
            )
        if not e.hf_dir and t.save_hf and e.interval and t.save_interval is None:
            errs.append(
                "Snapshot eval from --save-hf checkpoints needs --save-interval (without it nothing is saved): "
                "set --save-interval, or --eval-hf-dir to export a snapshot per eval point"
            )
        elif not e.hf_dir and t.save_hf and e.interval and e.interval % (every := t.save_interval):
            errs.append(
                f"Snapshot eval from --save-hf checkpoints needs --eval-interval ({e.interval}) to be "
                f"a multiple of --save-interval ({every}): set --eval-interval "
                f"{every * max(1, e.interval // every)} or --eval-hf-dir to export a snapshot per eval point"
            )
        return errs

    @joins(MultiLoraSection, TrainerSection, EvalSection, AsyncSection, InfraSection, RolloutSection)
    def _multi_lora_problems(self) -> list[str]:
        """What multi-LoRA async cannot run with, or would silently ignore."""
        errs = []
        if not self.multi_lora.n_adapters:
            return errs
        if self.trainer.use_ray and self.adapter_transfer_mode == "disk":
            errs.append("Multi-LoRA with --use-ray: adapter versions would reach these engines by disk, which Ray's "
                        "nodes do not share (SGLang servers and external engines load adapters from a path): use the "
                        "built-in engines, which fetch them from the run's object bucket")  # fmt: skip
        if (spec := self.rollout.env_spec) is not None and spec.scheme in ("verifiers", "nemogym"):
            errs.append(f"Multi-LoRA async (--multi-lora-n-adapters) cannot run --env {spec.scheme}: its chat calls "
                        "reach the engine without an adapter (a chat request carries no lora_path); use --env "
                        "openenv or a --custom-generate-function-path")  # fmt: skip
        if self.eval.interval is not None:
            errs.append("Multi-LoRA async (--multi-lora-n-adapters) does not support in-loop evaluation: unset "
                        "--eval-interval (evaluate each adapter from its saves)")  # fmt: skip
        errs += [f"Multi-LoRA async (--multi-lora-n-adapters) {why}: drop --{flag.replace('_', '-')}"
                 for flag, why in MULTI_LORA_IGNORES.items() if getattr(self.trainer, flag)]  # fmt: skip
        if self.async_.update_weights_interval > 1:
            errs.append("Multi-LoRA async (--multi-lora-n-adapters) pushes every adapter version it trains (its "
                        "staleness is counted in its own steps): drop --update-weights-interval")  # fmt: skip
        return errs

    @model_validator(mode="after")
    def _validate(self) -> RunConfig:
        """Every section's own rules, on that section alone, then the rules that join sections;
        all of them reported at once, with what to set instead."""
        errs = [e for attr in SECTION_NAMES.values() for e in getattr(self, attr).problems()]
        errs += [e for fn in vars(RunConfig).values() if callable(fn) and hasattr(fn, "joins") for e in fn(self)]
        if errs:
            raise ConfigError("\n".join(errs))
        return self
