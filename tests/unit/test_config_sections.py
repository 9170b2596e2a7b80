"""Configuration sections: every flag belongs to one typed section with a description, and each
service declares the sections it reads (`Service.reads`); this test reads every service
package's code and fails when it reads a flag outside them (directly, or through a derived
property such as `commit_interval`). The runtime reads InfraSection for every service."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from pathlib import Path

import pytest

from services.common import config as cfgmod
from services.common.config import InfraSection, RunConfig, Section

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {
    "buffer": "services.buffer.service:BufferService",
    "eval": "services.eval.service:EvalService",
    "rollout": "services.rollout.service:RolloutService",
    "trainer": "services.trainer.service:TrainerService",
    "weightsync": "services.weightsync.service:WeightSyncService",
}
RECEIVERS = {"config", "cfg", "c", "run_config"}


def section_of(name: str) -> set[type]:
    """The sections a RunConfig attribute reads: a field's own section; a derived property's,
    the sections of the fields its body reads."""
    for cls in RunConfig.__mro__:
        if issubclass(cls, Section) and cls is not RunConfig and name in cls.__dict__.get("__annotations__", {}):
            return {cls}
    prop = RunConfig.__dict__.get(name)
    if isinstance(prop, property):
        body = ast.parse(textwrap.dedent(inspect.getsource(prop.fget)))
        reads = {
            n.attr for n in ast.walk(body) if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "self"
        }
        return set().union(*(section_of(r) for r in reads if r != name))
    return set()


def config_reads(package: str) -> set[str]:
    names = set()
    for f in (ROOT / "services" / package).rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Attribute):
                v = node.value
                receiver = v.attr if isinstance(v, ast.Attribute) else getattr(v, "id", None)
                if receiver in RECEIVERS and (node.attr in RunConfig.model_fields or isinstance(
                        RunConfig.__dict__.get(node.attr), property)):  # fmt: skip
                    names.add(node.attr)
    return names


def test_every_flag_is_in_exactly_one_section_and_described():
    sections = [c for c in RunConfig.__mro__ if issubclass(c, Section) and c not in (Section, RunConfig)]
    owned = [n for c in sections for n in c.__dict__.get("__annotations__", {})]
    assert sorted(owned) == sorted(RunConfig.model_fields)  # no flag outside a section, none twice
    assert all(RunConfig.model_fields[n].description for n in owned)


@pytest.mark.parametrize("package", sorted(SERVICES))
def test_each_service_reads_only_the_sections_it_declares(package):
    module, cls = SERVICES[package].split(":")
    service = getattr(importlib.import_module(module), cls)
    declared = {InfraSection, *service.reads}
    outside = {n: sorted(c.__name__ for c in section_of(n) - declared) for n in config_reads(package)}
    outside = {n: s for n, s in outside.items() if s}
    assert not outside, f"{cls} reads flags of sections it does not declare in `reads`: {outside}"
    unused = {s.__name__ for s in service.reads} - {c.__name__ for n in config_reads(package) for c in section_of(n)}
    assert not unused, f"{cls} declares sections it never reads: {sorted(unused)}"


def test_the_sections_are_public():
    assert {"InfraSection", "DataSection", "RolloutSection", "AsyncSection", "TrainerSection", "EvalSection"} <= set(
        vars(cfgmod)
    )
