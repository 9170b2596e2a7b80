"""Configuration sections: every flag belongs to one typed section with a description; each
service declares the sections it reads (`Service.reads`) and reads its flags through them
(`config.rollout.temperature`); this test reads every service package's code and fails when it
reads a section it does not declare (directly, or through a value that joins sections such as
`commit_interval`) or a flag around its section. The runtime reads InfraSection for every
service. Values and rules that join sections name them (`@joins`), and are held to that too."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import math
import pickle
import textwrap
from pathlib import Path

import pytest

from services.buffer.core import DataBuffer, make_buffer
from services.common import config as cfgmod
from services.common.config import FLAGS, SECTION_NAMES, SECTIONS, ConfigView, InfraSection, RunConfig
from services.common.config.view import FlatConfig, for_plugins

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {
    "buffer": "services.buffer.service:BufferService",
    "eval": "services.eval.service:EvalService",
    "rollout": "services.rollout.service:RolloutService",
    "trainer": "services.trainer.service:TrainerService",
    "weightsync": "services.weightsync.service:WeightSyncService",
    "adapters": "services.adapters.service:AdapterService",
}
RECEIVERS = {"config", "c", "run_config"}
BY_NAME = {name: cls for cls, name in SECTION_NAMES.items()}


def joined(name: str) -> set[type] | None:
    """The sections a RunConfig value or rule that joins sections declares (`@joins`), or None."""
    member = RunConfig.__dict__.get(name)
    fn = member.fget if isinstance(member, property) else member
    return set(fn.joins) if hasattr(fn, "joins") else None


def receiver(node: ast.expr) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)


def config_reads(tree: ast.AST, receivers: set[str]) -> tuple[set[type], list[str]]:
    """The sections code reads through `<receiver>.<section>.<field>` and through joined values
    (`<receiver>.buffer_capacity`), and its reads that bypass the sections (`<receiver>.<field>`)."""
    sections, flat = set(), []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or receiver(node.value) not in receivers:
            continue
        if node.attr in BY_NAME:
            sections.add(BY_NAME[node.attr])
        elif (joins := joined(node.attr)) is not None:
            sections |= joins
        elif node.attr in FLAGS or any(isinstance(s.__dict__.get(node.attr), property) for s in SECTIONS):
            flat.append(f"{receiver(node.value)}.{node.attr} (line {node.lineno})")
    return sections, flat


def package_reads(package: str) -> tuple[set[type], list[str]]:
    sections, flat = set(), []
    for f in sorted((ROOT / "services" / package).rglob("*.py")):
        s, bare = config_reads(ast.parse(f.read_text()), RECEIVERS)
        sections |= s
        flat += [f"{f.relative_to(ROOT)}: {b}" for b in bare]
    return sections, flat


def test_every_flag_is_in_exactly_one_section_and_described():
    assert set(RunConfig.model_fields) == set(SECTION_NAMES.values())  # nothing read flat: only the sections
    owned = [(SECTION_NAMES[c], n) for c in SECTIONS for n in c.model_fields]
    assert sorted(owned) == sorted((f.attr, f.field) for f in FLAGS.values())  # every field a flag, none twice
    assert all(f.section.model_fields[f.field].description for f in FLAGS.values())
    # a field drops its section's name; its flag keeps Miles's (--rollout-batch-size, --eval-interval)
    assert not [n for a, n in owned if n.startswith(a.rstrip("_") + "_")]
    assert FLAGS["rollout_batch_size"].field == "batch_size" and FLAGS["eval_interval"].field == "interval"


def test_a_flag_read_flat_says_where_it_lives():
    c = RunConfig(rollout_batch_size=4, eval_interval=2)
    with pytest.raises(AttributeError, match=r"read config\.rollout\.batch_size"):
        c.rollout_batch_size  # noqa: B018
    assert c.flag("rollout_batch_size") == 4 and c.model_dump()["eval_interval"] == 2
    assert RunConfig(**c.model_dump()) == c  # the stored config reads back as it was
    assert c.model_copy(update={"eval_interval": 3}).eval.interval == 3 and c.flags_set >= {"rollout_batch_size"}
    with pytest.raises(TypeError, match="flat by flag name"):
        c.model_dump(exclude={"rollout_batch_size"})  # a field filter would miss the flag names silently
    assert json.loads(c.model_dump_json())["rollout_batch_size"] == 4


def test_a_plugin_reads_flags_and_derived_values_flat_as_before():
    flat = for_plugins(RunConfig(fully_async=True, num_rollout=7, multi_lora_n_adapters=1,
                                 multi_lora_adapter=["a=a.yaml"]))  # fmt: skip
    assert (flat.mode, flat.total_steps, flat.backend) == ("fully_async", 7, "shared")  # a section's own values
    assert flat.multi_lora_adapter_pairs == [("a", "a.yaml")] and flat.multi_lora.adapter_pairs == [("a", "a.yaml")]
    assert flat.rollout_batch_size == flat.rollout.batch_size and flat.buffer_capacity > 0


@pytest.mark.parametrize("package", sorted(SERVICES))
def test_each_service_reads_only_the_sections_it_declares(package):
    module, cls = SERVICES[package].split(":")
    service = getattr(importlib.import_module(module), cls)
    declared = {InfraSection, *service.reads}
    read, flat = package_reads(package)
    assert not flat, f"{cls} reads flags around their sections (read config.<section>.<flag>): {flat}"
    outside = sorted(c.__name__ for c in read - declared)
    assert not outside, f"{cls} reads sections it does not declare in `reads`: {outside}"
    unused = sorted(s.__name__ for s in set(service.reads) - read)
    assert not unused, f"{cls} declares sections it never reads: {unused}"


@pytest.mark.parametrize("name", [n for n, v in vars(RunConfig).items() if joined(n) is not None])
def test_a_value_or_rule_that_joins_sections_reads_only_the_sections_it_names(name):
    member = RunConfig.__dict__[name]
    fn = member.fget if isinstance(member, property) else member
    read, flat = config_reads(ast.parse(textwrap.dedent(inspect.getsource(fn))), {"self"})
    assert not flat, f"RunConfig.{name} reads flags around their sections: {flat}"
    assert read <= joined(name), f"RunConfig.{name} reads {sorted(c.__name__ for c in read - joined(name))} " \
        "without naming them in @joins"


def test_every_rule_that_joins_sections_runs():
    """One config that breaks every rule that joins sections: each rule's problem is reported, in
    the order the rules are written."""
    broken = {  # rule: the start of the problem this config gives it
        "_mode_problems": "--over-sampling-batch-size applies to the train and one-step",
        "_capacity_problems": "--async-max-concurrent-samples (1) must be >= --n-samples-per-prompt (2)",
        "_transfer_problems": "--update-weight-transfer-mode object-store needs the built-in engine",
        "_batch_problems": "--num-steps-per-rollout 1000 exceeds the rollout's 32 samples",
        "_snapshot_eval_problems": "Snapshot eval requires --eval-interval.",
        "_multi_lora_problems": "Multi-LoRA async (--multi-lora-n-adapters) pushes every adapter version",
    }
    assert list(broken) == [n for n, v in vars(RunConfig).items() if callable(v) and hasattr(v, "joins")]
    with pytest.raises(ValueError) as e:
        RunConfig(
            fully_async=True,
            over_sampling_batch_size=64,
            async_max_concurrent_samples=1,
            n_samples_per_prompt=2,
            update_weight_transfer_mode="object-store",
            engine="sglang",
            num_steps_per_rollout=1000,
            eval_num_gpus=1,
            multi_lora_n_adapters=2,
            update_weights_interval=2,
        )
    lines = str(e.value).splitlines()
    found = [next((i for i, line in enumerate(lines) if piece in line), None) for piece in broken.values()]
    assert None not in found, str(e.value)
    assert found == sorted(found)


def test_a_section_rule_reads_its_own_section_only():
    """Each section's problems() runs on that section alone: a rule that reaches into another
    section fails here (AttributeError) rather than passing on the whole config."""
    config = RunConfig()
    for section in SECTIONS:
        section.problems(getattr(config, SECTION_NAMES[section]))


def test_the_sections_are_public():
    assert {"InfraSection", "DataSection", "RolloutSection", "AsyncSection", "TrainerSection", "EvalSection"} <= set(
        vars(cfgmod)
    )


def test_a_service_is_built_with_its_own_sections_and_cannot_reach_the_rest():
    """At run time too: a service's `config` is a view of InfraSection and its declared sections;
    another section, or a flag read around its section, is an error that names the fix."""
    from services.weightsync.service import WeightSyncService

    config = RunConfig(rollout_batch_size=4, n_samples_per_prompt=2, eval_interval=5)
    part = ConfigView(config, WeightSyncService.reads, "WeightSyncService")
    assert part.rollout is config.rollout and part.infra is config.infra  # typed sections, the run's own
    assert part.rollout.batch_size == 4
    with pytest.raises(AttributeError, match="EvalSection in its `reads`"):
        _ = part.eval
    with pytest.raises(AttributeError, match=r"read config\.rollout\.batch_size"):
        _ = part.rollout_batch_size
    with pytest.raises(AttributeError, match=r"read config\.rollout\.total_steps"):
        _ = part.total_steps  # a section's own derived value, read around it
    with pytest.raises(AttributeError, match="joins TrainerSection"):
        _ = part.commit_interval  # joins a section weight-sync does not read
    assert part.inflight_groups == config.inflight_groups  # a joined value of its own sections
    flat = for_plugins(part)  # plugins: the flat config, as documented, read-only
    assert isinstance(flat, FlatConfig) and flat.rollout_batch_size == 4 and flat.eval_interval == 5
    assert for_plugins(config).rollout_batch_size == 4 and flat.buffer_capacity == config.buffer_capacity
    with pytest.raises(AttributeError, match="read-only"):
        flat.rollout_batch_size = 2
    with pytest.raises(AttributeError, match="read-only"):
        part.rollout = config.rollout


def test_a_partition_gets_its_own_section_values_not_a_copy_of_the_config():
    from services.buffer.service import BufferService

    config = RunConfig(rollout_batch_size=8, n_samples_per_prompt=4, multi_lora_n_adapters=2)
    part = ConfigView(config, BufferService.reads, "BufferService")
    adapter = part.replace(rollout_batch_size=2, prompt_data="a.jsonl", async_max_concurrent_samples=None)
    assert adapter.rollout.batch_size == 2 and adapter.data.prompt_data == "a.jsonl"
    assert adapter.rollout.n_samples_per_prompt == 4  # the rest of the section is the run's
    assert adapter.trainer is config.trainer and adapter.infra is config.infra  # untouched sections: shared
    assert part.rollout.batch_size == 8  # the service's own view is unchanged
    assert adapter.buffer_capacity == math.floor(config.async_.data_buffer_capacity_factor * 2)
    flat = for_plugins(adapter)  # a plugin of the partition sees its values, flat
    assert flat.rollout_batch_size == 2 and flat.prompt_data == "a.jsonl" and flat.multi_lora_n_adapters == 2
    assert pickle.loads(pickle.dumps(adapter)).rollout.batch_size == 2


def test_a_section_is_read_only():
    config = RunConfig()
    with pytest.raises(ValueError, match="frozen"):
        config.rollout.batch_size = 3


class FlatReadingBuffer(DataBuffer):
    """A --custom-async-data-buffer-path class that reads its config flat, as docs/tasks.md allows."""

    def __init__(self, config, recycle):
        super().__init__(config, recycle)
        self.batch = config.rollout_batch_size


def test_a_custom_buffer_of_a_partition_gets_the_flat_config_with_the_partitions_values():
    from services.buffer.service import BufferService

    config = RunConfig(rollout_batch_size=8, multi_lora_n_adapters=2,
                       custom_async_data_buffer_path=f"{__name__}.FlatReadingBuffer")  # fmt: skip
    adapter = ConfigView(config, BufferService.reads, "BufferService").replace(rollout_batch_size=2)
    buffer = make_buffer(adapter, recycle=None)
    assert isinstance(buffer.config, FlatConfig) and buffer.batch == 2
