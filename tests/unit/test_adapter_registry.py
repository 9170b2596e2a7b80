"""The multi-LoRA adapter registry as a pure state machine (services/adapters/registry.py): the
lifecycle, every refusal with its message, slots reused lowest first, slot versions that never
reset, spec validation; and the --multi-lora-* flags (services/common/config.py)."""

from __future__ import annotations

import argparse
import itertools

import pytest

from asyncrl_proto import AdapterControl, AdapterRegistryState, AdapterSpec, AdapterState, decode, encode
from services.adapters import registry as regmod
from services.adapters.registry import AdapterRegistry, RegistryError, SpecError, parse_spec
from services.common.config import ConfigError, RunConfig, adapter_pairs
from services.common.config_load import add_config_arguments, resolve_config

PENDING, ACTIVE, RETIRING, CLEANUP, COMPLETED = (AdapterState.PENDING, AdapterState.ACTIVE, AdapterState.RETIRING,
                                                 AdapterState.CLEANUP, AdapterState.COMPLETED)  # fmt: skip


def spec(save: str = "out/a", **kw) -> AdapterSpec:
    fields = dict(data="prompts.jsonl", rank=8, alpha=16.0, rollout_batch_size=4, n_samples_per_prompt=2, save=save,
                  rm_type="reverse-digits", num_step=10)  # fmt: skip
    return AdapterSpec(**{**fields, **kw})


def registry(num_slots: int = 2) -> AdapterRegistry:
    ticks = itertools.count(1)
    return AdapterRegistry(num_slots, clock=lambda: float(next(ticks)))


def refused(fn, *args, status: int = 409) -> str:
    with pytest.raises(RegistryError) as e:
        fn(*args)
    assert e.value.status == status, str(e.value)
    return str(e.value)


# ---- the lifecycle -----------------------------------------------------------------------------


def test_an_adapter_goes_pending_active_retiring_cleanup_completed_and_frees_its_slot():
    r = registry()
    run = r.register("a", spec())
    assert (run.state, run.slot, run.step, run.slot_version) == (PENDING, 0, 0, 0)
    assert r.free_slots() == [1] and r.revision == 1
    assert r.activate("a").state is ACTIVE
    assert r.stepped("a", 1).step == 1
    assert r.retire("a", "budget").state is RETIRING and r.get("a").message == "retired: budget"
    assert r.stepped("a", 2).step == 2  # a step in flight when it was retired still counts
    assert r.cleanup("a").state is CLEANUP
    assert r.free_slots() == [1]  # the final save still holds the slot
    assert r.complete("a").state is COMPLETED
    assert r.free_slots() == [0, 1]
    assert r.revision == 7 and r.state.slot_versions == [2, 0]
    assert r.counts() == {"pending": 0, "active": 0, "retiring": 0, "cleanup": 0, "completed": 1}


def test_a_pending_adapter_retired_goes_straight_to_cleanup():
    r = registry()
    r.register("a", spec())
    assert r.retire("a").state is CLEANUP
    assert r.complete("a").state is COMPLETED


def test_slots_are_reused_lowest_first():
    r = registry(3)
    assert [r.register(n, spec(f"out/{n}")).slot for n in "abc"] == [0, 1, 2]
    for name in ("b", "a"):
        r.retire(name)
        r.complete(name)
    assert r.free_slots() == [0, 1]
    assert r.register("d", spec("out/d")).slot == 0
    assert r.register("e", spec("out/e")).slot == 1


def test_slot_versions_never_reset_and_each_registration_has_its_own_id():
    r = registry(1)
    first = r.register("a", spec())
    r.activate("a")
    r.stepped("a", 3)
    assert r.state.slot_versions == [3] and r.get("a").slot_version == 3
    r.retire("a")
    r.cleanup("a")
    r.complete("a")
    again = r.register("a", spec())  # the name is free again; history is kept
    assert again.registration_id != first.registration_id and len(again.registration_id) == 32
    assert (again.slot, again.step, again.slot_version) == (0, 0, 3)
    r.activate("a")
    assert r.stepped("a", 1).slot_version == 4
    assert [x.state for x in r.state.runs] == [COMPLETED, ACTIVE]
    assert r.get("a") is again  # a name means its newest registration
    two = registry(2)
    assert two.register("x", spec("out/x")).registration_id != two.register("y", spec("out/y")).registration_id


def test_a_step_report_raises_the_slot_version_by_the_steps_taken_once():
    r = registry()
    r.register("a", spec())
    r.activate("a")
    r.stepped("a", 2)
    rev = r.revision
    assert r.stepped("a", 2).slot_version == 2 and r.revision == rev  # a retried report: nothing changes
    assert r.stepped("a", 1).step == 2 and r.revision == rev  # an old one neither
    assert r.stepped("a", 5).slot_version == 5  # reports 3 and 4 were lost: the slot still moved 3 steps
    assert "a step is >= 1" in refused(r.stepped, "a", 0, status=400)


def test_repeating_the_transition_just_made_changes_nothing():
    r = registry()
    r.register("a", spec())
    r.activate("a")
    rev = r.revision
    assert r.activate("a").state is ACTIVE and r.revision == rev
    r.retire("a")
    rev = r.revision
    assert r.retire("a").state is RETIRING and r.revision == rev
    r.cleanup("a")
    rev = r.revision
    assert r.cleanup("a").state is CLEANUP and r.revision == rev
    r.complete("a")
    rev = r.revision
    assert r.complete("a").state is COMPLETED and r.revision == rev


def test_the_trainers_requests_are_applied_by_op():
    r = registry()
    run = r.register("a", spec())
    rid = run.registration_id
    for op, state in (("activate", ACTIVE), ("stepped", ACTIVE), ("retire", RETIRING), ("cleanup", CLEANUP),
                      ("complete", COMPLETED)):  # fmt: skip
        assert r.apply(AdapterControl(op=op, name="a", registration_id=rid, step=1)).state is state
    assert r.get("a").message == "completed" and r.get("a").step == 1
    assert "unknown op 'explode'" in refused(r.apply, AdapterControl(op="explode", name="a"), status=400)


# ---- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", ".", "..", "a b", "a/b", "../x", "é", "x" * 97, "a\n", "foo.", ".foo"])
def test_an_invalid_name_is_refused(name):
    msg = refused(registry().register, name, spec(), status=400)
    assert "is invalid: use 1-96 characters from letters, digits, '.', '_' and '-', not starting or ending" in msg


def test_a_long_dotted_name_is_fine_and_state_is_reserved():
    r = registry()
    assert r.register("x" * 96, spec()).slot == 0
    assert r.register("my-adapter_v1.2", spec("out/b")).slot == 1
    assert "is reserved" in refused(registry().register, "state", spec(), status=400)


@pytest.mark.parametrize("steps", [(), ("activate",), ("activate", "retire")])
def test_a_live_name_cannot_be_registered_again(steps):
    r = registry(3)
    r.register("a", spec())
    for step in steps:
        getattr(r, step)("a")
    msg = refused(r.register, "a", spec("out/other"))
    assert f"adapter 'a' is already registered ({r.get('a').state.value}, slot 0)" in msg
    assert "retire it (DELETE /adapter_runs/a)" in msg


def test_a_name_still_cleaning_up_cannot_be_registered_again():
    r = registry(3)
    r.register("a", spec())
    r.retire("a")
    msg = refused(r.register, "a", spec("out/other"))
    assert "adapter 'a' is still cleaning up (its final save is running)" in msg


def test_a_save_directory_belongs_to_one_name(tmp_path):
    """Another name may never use it (it would resume from those saves and overwrite them), however
    the path is spelled; the same name's next registration resumes from it."""
    r = registry(3)
    a = str(tmp_path / "a")
    r.register("a", spec(a))
    msg = refused(r.register, "b", spec(f"{tmp_path}/./a/"))
    assert f"save directory '{tmp_path}/./a/' is used by adapter 'a' (pending)" in msg
    assert "is used by adapter 'a'" in refused(r.register, "b", spec("/" + a))  # //tmp/...: the same directory
    (tmp_path / "a").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert "is used by adapter 'a'" in refused(r.register, "b", spec(str(tmp_path / "link")))
    r.retire("a")  # cleaning up: its final save writes there
    assert "is used by adapter 'a' (cleanup)" in refused(r.register, "b", spec(a))
    r.complete("a")
    assert "is used by adapter 'a' (completed)" in refused(r.register, "b", spec(a))
    assert r.register("a", spec(a)).slot == 0


def test_no_free_slot_is_refused_with_what_to_do():
    r = registry(2)
    r.register("a", spec("out/a"))
    r.register("b", spec("out/b"))
    msg = refused(r.register, "c", spec("out/c"))
    assert msg.startswith("No free adapter slots: all 2 are taken (a (pending), b (pending))")
    assert "retire one (DELETE /adapter_runs/NAME) or wait for one to complete" in msg
    assert registry(0).free_slots() == []


def test_an_invalid_spec_is_refused_by_register_too():
    assert "rank must be an integer >= 1 (got 0)" in refused(registry().register, "a", spec(rank=0), status=400)


@pytest.mark.parametrize(
    ("state_steps", "op", "message"),
    [
        ((), "cleanup", "cannot start the cleanup of adapter 'a' in state pending (retire it first"),
        ((), "complete", "cannot complete adapter 'a' in state pending"),
        ((), "stepped", "cannot record a step of adapter 'a' in state pending"),
        (("activate",), "cleanup", "cannot start the cleanup of adapter 'a' in state active"),
        (("activate",), "complete", "cannot complete adapter 'a' in state active"),
        (("activate", "retire"), "activate", "cannot activate adapter 'a' in state retiring"),
        (("activate", "retire"), "complete", "cannot complete adapter 'a' in state retiring"),
        (("retire",), "activate", "cannot activate adapter 'a' in state cleanup"),
        (("retire",), "retire", "cannot retire adapter 'a' in state cleanup"),
        (("retire",), "stepped", "cannot record a step of adapter 'a' in state cleanup"),
        (("retire", "complete"), "activate", "cannot activate adapter 'a' in state completed"),
        (("retire", "complete"), "retire", "cannot retire adapter 'a' in state completed"),
        (("retire", "complete"), "cleanup", "cannot start the cleanup of adapter 'a' in state completed"),
        (("retire", "complete"), "stepped", "cannot record a step of adapter 'a' in state completed"),
    ],
)
def test_illegal_transitions_are_refused(state_steps, op, message):
    r = registry()
    r.register("a", spec())
    for step in state_steps:
        getattr(r, step)("a")
    before = encode(r.state)
    msg = refused(r.apply, AdapterControl(op=op, name="a", step=1))
    assert message in msg
    assert encode(r.state) == before  # a refusal changes nothing


def test_an_unknown_adapter_or_a_stale_registration_is_refused():
    r = registry()
    assert "no adapter named 'zz'" in refused(r.activate, "zz", status=404)
    old = r.register("a", spec())
    r.retire("a")
    r.complete("a")
    r.register("a", spec())
    msg = refused(r.activate, "a", old.registration_id)
    assert f"registration '{old.registration_id}' is not its current one" in msg


# ---- state ---------------------------------------------------------------------------------------


def test_a_registry_resumes_from_its_stored_state():
    r = registry(2)
    r.register("a", spec())
    r.activate("a")
    r.stepped("a", 4)
    r.register("b", spec("out/b"))
    stored = decode(encode(r.state), AdapterRegistryState)
    back = AdapterRegistry(2, stored)
    assert back.state == r.state and back.free_slots() == []
    assert back.stepped("a", 5).slot_version == 5
    smaller = AdapterRegistry(1, decode(encode(r.state), AdapterRegistryState))
    assert smaller.state.slot_versions == [4, 0]  # fewer slots after a restart: no version is forgotten
    assert smaller.free_slots() == []
    assert AdapterRegistry(3, decode(encode(r.state), AdapterRegistryState)).state.slot_versions == [4, 0, 0]


def test_a_copy_is_independent():
    r = registry()
    r.register("a", spec())
    trial = r.copy()
    trial.activate("a")
    assert r.get("a").state is PENDING and trial.get("a").state is ACTIVE


def test_history_keeps_the_newest_completed_registrations(monkeypatch):
    monkeypatch.setattr(regmod, "MAX_HISTORY", 2)
    r = registry(1)
    for i in range(4):
        r.register(f"a{i}", spec(f"out/a{i}"))
        r.retire(f"a{i}")
        r.complete(f"a{i}")
    assert [x.name for x in r.state.runs] == ["a2", "a3"]


def test_history_fits_a_default_nats_message():
    """500 completed registrations of 4 KB specs would be 2 MB, above a NATS server's default
    max_payload of 1 MiB: the oldest go first, the live ones always stay."""
    r = registry(2)
    big = {"tenant": "x" * 3500}
    r.register("live", spec("out/live", metadata=big))
    for i in range(300):
        r.register(f"a{i}", spec(f"out/a{i}", metadata=big))
        r.retire(f"a{i}")
        r.complete(f"a{i}")
        assert len(encode(r.state)) <= regmod.MAX_STATE_BYTES
    names = [x.name for x in r.state.runs]
    assert names[0] == "live" and names[-1] == "a299" and 150 < len(names) < 300


# ---- specs ----------------------------------------------------------------------------------------


def raw_spec(tmp_path, **kw) -> dict:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "12=", "label": "21"}\n')
    fields = dict(data=str(data), rank=8, alpha=16, rollout_batch_size=4, n_samples_per_prompt=2,
                  save=str(tmp_path / "save"), rm_type="reverse-digits", num_step=10)  # fmt: skip
    fields.update(kw)
    return {k: v for k, v in fields.items() if v is not None}


def bad_spec(raw) -> str:
    with pytest.raises(SpecError) as e:
        parse_spec(raw)
    assert e.value.status == 400
    return str(e.value)


def test_a_good_spec_parses_with_the_attention_projections_by_default(tmp_path):
    s = parse_spec(raw_spec(tmp_path, metadata={"tenant": "t1"}))
    assert s.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"] and s.alpha == 16.0
    assert s.metadata == {"tenant": "t1"} and s.num_epoch is None
    s = parse_spec(raw_spec(tmp_path, target_modules=["gate_proj", "down_proj"], num_step=None, num_epoch=2,
                            rm_type=None, custom_rm_path="my.rewards.score"))  # fmt: skip
    assert s.target_modules == ["gate_proj", "down_proj"] and s.custom_rm_path == "my.rewards.score"


def test_an_unknown_field_is_named(tmp_path):
    msg = bad_spec(raw_spec(tmp_path, learning_rate=1e-4))
    assert "unknown field(s) in the adapter spec: learning_rate" in msg and "the fields are data, rank" in msg


def test_both_rewards_or_neither_are_refused(tmp_path):
    both = bad_spec(raw_spec(tmp_path, custom_rm_path="my.rewards.score"))
    assert "give exactly one reward: rm_type (a built-in reward) or custom_rm_path (module.fn), not both" in both
    neither = bad_spec(raw_spec(tmp_path, rm_type=None))
    assert "give exactly one reward" in neither and "not both" not in neither


def test_both_budgets_or_neither_are_refused(tmp_path):
    assert "give exactly one budget: num_step" in bad_spec(raw_spec(tmp_path, num_epoch=1))
    assert "give exactly one budget" in bad_spec(raw_spec(tmp_path, num_step=None))
    assert "num_epoch must be an integer >= 1 (got 0)" in bad_spec(raw_spec(tmp_path, num_step=None, num_epoch=0))


def test_a_missing_data_file_is_refused(tmp_path):
    msg = bad_spec(raw_spec(tmp_path, data=str(tmp_path / "nope.jsonl")))
    assert f"data: the prompt file '{tmp_path / 'nope.jsonl'}' does not exist" in msg


def test_a_bad_target_module_is_refused(tmp_path):
    msg = bad_spec(raw_spec(tmp_path, target_modules=["q_proj", "lm_head"]))
    assert (
        "target_modules: 'lm_head' is not one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in msg
    )
    assert "target_modules is empty" in bad_spec(raw_spec(tmp_path, target_modules=[]))
    assert "names a module twice" in bad_spec(raw_spec(tmp_path, target_modules=["q_proj", "q_proj"]))


def test_bad_numbers_and_types_are_refused(tmp_path):
    assert "rank must be an integer >= 1 (got 0)" in bad_spec(raw_spec(tmp_path, rank=0))
    assert "Expected `int`, got `str` - at `$.rank`" in bad_spec(raw_spec(tmp_path, rank="eight"))
    assert "alpha must be a number > 0 (got 0.0)" in bad_spec(raw_spec(tmp_path, alpha=0))
    assert "rollout_batch_size must be an integer >= 1" in bad_spec(raw_spec(tmp_path, rollout_batch_size=0))
    assert "n_samples_per_prompt must be an integer >= 1" in bad_spec(raw_spec(tmp_path, n_samples_per_prompt=-1))
    missing = raw_spec(tmp_path)
    del missing["save"]
    assert "missing required field `save`" in bad_spec(missing)
    assert "not an import path" in bad_spec(raw_spec(tmp_path, rm_type=None, custom_rm_path="score"))
    assert "is a mapping of fields" in bad_spec(["data", "x"])


# ---- the flags -------------------------------------------------------------------------------------


def test_multi_lora_adapter_takes_name_yaml_pairs_repeatably():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = vars(parser.parse_args(["--multi-lora-n-adapters", "2", "--multi-lora-adapter", "a", "a.yaml",
                                   "--multi-lora-adapter", "b=b.yaml", "--rollout-stop-token-ids", "1",
                                   "--rollout-stop-token-ids", "2"]))  # fmt: skip
    assert args["multi_lora_adapter"] == ["a", "a.yaml", "b=b.yaml"]
    assert args["rollout_stop_token_ids"] == [2]  # other list flags are not repeatable: the last one wins
    c = resolve_config(args, environ={})
    assert c.multi_lora.adapter_pairs == [("a", "a.yaml"), ("b", "b.yaml")]
    assert (c.multi_lora.max_coalesce_wait_s, c.multi_lora.max_empty_wait_s, c.multi_lora.idle_poll_s) == (0, 30, 2)
    assert not c.multi_lora.service_mode and RunConfig().multi_lora.n_adapters == 0
    env = resolve_config({"multi_lora_n_adapters": 1}, environ={"ASYNCRL_MULTI_LORA_ADAPTER": "a a.yaml"})
    assert env.multi_lora.adapter_pairs == [("a", "a.yaml")]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"multi_lora_n_adapters": 2, "eval_interval": 5},
            "does not support in-loop evaluation: unset --eval-interval",
        ),
        ({"multi_lora_adapter": ["a", "a.yaml"]}, "set --multi-lora-n-adapters to the number of adapter slots"),
        ({"multi_lora_n_adapters": 1, "multi_lora_adapter": ["a"]}, "--multi-lora-adapter 'a' has no YAML file"),
        ({"multi_lora_n_adapters": 1, "multi_lora_adapter": ["a/b=x.yaml"]}, "adapter name 'a/b' is invalid"),
        ({"multi_lora_n_adapters": 1, "multi_lora_adapter": ["a=x", "a=y"]}, "names 'a' twice"),
        ({"multi_lora_n_adapters": -1}, "--multi-lora-n-adapters must be >= 0"),
        ({"multi_lora_idle_poll_s": 0}, "--multi-lora-idle-poll-s must be > 0"),
    ],
)
def test_multi_lora_flag_rules(fields, message):
    with pytest.raises(ConfigError) as e:
        resolve_config(fields, environ={})
    assert message in str(e.value)


def test_adapter_pairs_mix_both_forms():
    assert adapter_pairs(["a", "x=1.yaml", "b=y.yaml"]) == ([("a", "x=1.yaml"), ("b", "y.yaml")], [])


# ---- identity ----------------------------------------------------------------------------------------


def test_the_registry_has_its_own_least_privilege_identity():
    from services.common.entry import SERVICES
    from services.common.natsauth import ROLES, role_permissions

    assert SERVICES["adapters"] == "services.adapters.service:AdapterService"
    perms = role_permissions("r", "adapters")
    pub, sub = perms["publish"]["allow"], perms["subscribe"]["allow"]
    assert "$KV.ASYNCRL_r.adapters" in pub and "$JS.API.DIRECT.GET.KV_ASYNCRL_r.$KV.ASYNCRL_r.adapters" in pub
    assert [p for p in pub if p.startswith("$KV.")] == ["$KV.ASYNCRL_r.adapters"]  # no other key
    assert "asyncrl.r.heartbeat.adapters" in pub and "asyncrl.r.adapters.control" not in pub
    assert sub == ["_INBOX.r.adapters.>", "asyncrl.r.adapters.control"]
    assert perms["allow_responses"] == {"max": 1, "expires": "1m"}
    for role in ROLES[1:]:
        allowed = role_permissions("r", role)
        asks = "asyncrl.r.adapters.control" in allowed["publish"]["allow"]
        answers = "asyncrl.r.adapters.control" in allowed["subscribe"]["allow"]
        assert (asks, answers) == (role == "trainer", role == "adapters"), role
        writes = "$KV.ASYNCRL_r.adapters" in allowed["publish"]["allow"]
        assert writes == (role == "adapters"), role


def test_a_spec_too_large_for_the_registry_is_refused():
    from services.adapters.registry import MAX_SPEC_BYTES, spec_problems

    big = spec(metadata={"notes": "x" * MAX_SPEC_BYTES})
    assert any(f"at most {MAX_SPEC_BYTES}" in p for p in spec_problems(big))
    assert spec_problems(spec(metadata={"team": "a"})) == []


def test_the_audit_covers_registrations_the_registry_pruned(tmp_path):
    """A service-mode run's registry prunes its oldest completed registrations; their partitions
    are still on the ledger, and the trainer's directory names them: the audit balances them too."""
    from services.common.run_store import registrations

    r = registry()
    live = r.register("a", spec())
    pruned = "0123456789abcdef0123456789abcdef"
    for d in (f"a/{live.registration_id}", f"old/{pruned}", "old/not-an-id", "x/../etc"):
        (tmp_path / "adapters" / d).mkdir(parents=True, exist_ok=True)
    assert registrations(r.state, tmp_path) == [
        ("a", live.registration_id, "pending"), ("old", pruned, "completed (pruned from the registry)")]


def test_multi_lora_with_several_trainer_ranks_needs_the_torch_backend():
    assert resolve_config({"multi_lora_n_adapters": 2, "trainer_num_ranks": 2}, environ={}).trainer.num_ranks == 2
    with pytest.raises(ConfigError, match="--train-backend torch for data parallelism"):
        resolve_config({"multi_lora_n_adapters": 2, "trainer_num_ranks": 2, "train_backend": "megatron"}, environ={})


@pytest.mark.parametrize(("flags", "mode"), [
    ({}, "disk"),
    ({"update_weight_transfer_mode": "object-store"}, "object-store"),
    ({"update_weight_transfer_mode": "distributed"}, "object-store"),  # built-in engines fetch from the bucket
    ({"update_weight_transfer_mode": "distributed", "engine": "sglang"}, "disk"),
    ({"update_weight_transfer_mode": "distributed", "rollout_external_engine_addrs": ["http://10.0.0.9:30000"]}, "disk"),
])  # fmt: skip
def test_how_adapter_versions_reach_the_engines(flags, mode):
    c = resolve_config({"multi_lora_n_adapters": 2, **flags}, environ={})
    assert c.adapter_transfer_mode == mode
    assert c.engines_read_bucket == (mode == "object-store")


def test_multi_lora_on_ray_refuses_adapters_by_disk():
    with pytest.raises(ConfigError, match="Ray's nodes do not share"):
        resolve_config({"multi_lora_n_adapters": 2, "use_ray": True, "engine": "sglang",
                        "update_weight_transfer_mode": "distributed"}, environ={})  # fmt: skip


@pytest.mark.parametrize(("flags", "says"), [
    ({"num_steps_per_rollout": 2}, "--num-steps-per-rollout"),
    ({"keep_old_actor": True}, "--keep-old-actor"),
    ({"save": "/tmp/x", "save_interval": 5}, "--save-interval"),
    ({"save_hf": "/tmp/hf"}, "--save-hf"),
    ({"save": "/tmp/x", "save_trigger_sentinel": "/tmp/now"}, "--save-trigger-sentinel"),
    ({"load": "/tmp/ckpt"}, "--load"),
    ({"custom_rollout_log_function_path": "m.f"}, "--custom-rollout-log-function-path"),
    ({"update_weights_interval": 2}, "--update-weights-interval"),
])  # fmt: skip
def test_multi_lora_refuses_the_flags_it_would_ignore(flags, says):
    with pytest.raises(ConfigError, match=f"Multi-LoRA async .*drop {says}"):
        resolve_config({"multi_lora_n_adapters": 2, **flags}, environ={})
    resolve_config(flags, environ={})  # the single-model run takes them


def test_a_scale_that_would_overflow_the_model_is_refused():
    assert "alpha / rank is 1e+300, above 1000" in refused(registry().register, "a", spec(rank=1, alpha=1e300),
                                                           status=400)  # fmt: skip
    from services.model.lora import LoraError, LoraSpec

    with pytest.raises(LoraError, match="above 1000"):  # a saved adapter_config.json is held to it too
        LoraSpec(rank=1, alpha=2000.0)


def test_what_the_run_can_serve(tmp_path):
    """The registry service's checks past the spec's own: the run's batch, a bounded prompt file,
    and over HTTP only the custom rewards the operator allows."""
    from types import SimpleNamespace

    from services.adapters.service import AdapterService

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "12=", "label": "21"}\n' * 100)
    cfg = RunConfig(rollout_batch_size=8, n_samples_per_prompt=2, multi_lora_n_adapters=2,
                    multi_lora_max_data_mb=0.001, multi_lora_custom_rm_paths=["pkg.rewards.ok"])  # fmt: skip
    svc = SimpleNamespace(config=cfg)

    def fits(over_http=False, **kw):
        return AdapterService._fits(svc, spec(data=str(data), **kw), over_http=over_http)

    with pytest.raises(SpecError, match="rollout_batch_size 9 is above the run's --rollout-batch-size 8"):
        fits(rollout_batch_size=9)
    with pytest.raises(SpecError, match="above the run's --multi-lora-max-data-mb 0.001"):
        fits()
    svc.config = cfg.model_copy(update={"multi_lora_max_data_mb": 1.0})
    assert fits().rollout_batch_size == 4
    with pytest.raises(SpecError, match="'os.system' is not one the run allows over HTTP"):
        fits(over_http=True, rm_type=None, custom_rm_path="os.system")
    assert fits(over_http=True, rm_type=None, custom_rm_path="pkg.rewards.ok").custom_rm_path == "pkg.rewards.ok"
    assert fits(rm_type=None, custom_rm_path="os.system")  # an operator's YAML at start may name any


def test_prompt_files_that_do_not_parse_are_data_errors(tmp_path):
    from services.data.source import DataError, load_rows

    for name, content in (("latin1", b'{"prompt": "caf\xe9"}\n'), ("longint", b'{"prompt": 1' + b"1" * 5000 + b"}\n"),
                          ("deep", b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}\n")):  # fmt: skip
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(content)
        with pytest.raises(DataError, match=f"{path}:1: "):
            load_rows(path, "prompt", None, None)


def test_an_import_that_exits_is_an_error_not_the_end_of_the_process():
    from services.common.plugins import load_object

    with pytest.raises(ValueError, match="exited"):
        load_object("unittest.__main__.x", "custom_rm_path")
