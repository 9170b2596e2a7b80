"""`asyncrl eval-adapter` on the bundled tiny model: an adapter that adds nothing scores exactly
what the base scores (the same samples), a trained-looking one changes them, greedy answers are
the built-in engine's, failed rewards are counted, the JSON output, and every error a one-line
exit 2 that says what to do."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

from services.cli import main as cli_main
from services.eval.adapter_eval import evaluate, generate, parser
from services.model.hf_io import load_model
from services.model.llama import CausalLM, ModelConfig
from services.model.lora import LoraSpec, MultiLora, load_adapter, save_adapter
from services.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Three PEFT directories: B zero (adds nothing), B random (changes answers), and one of a
    model of another shape (does not fit the tiny model)."""
    root = tmp_path_factory.mktemp("adapters")
    lora = MultiLora(load_model(tiny_model_dir), n_slots=2, max_rank=4)
    lora.init_slot(0, LoraSpec(rank=4, alpha=8.0), seed=1)
    lora.init_slot(1, LoraSpec(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj", "up_proj")), seed=2)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in lora.B.values():
            p[1].copy_(torch.randn(p.shape[1:], generator=g) * 0.3)
    cfg = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
    other = MultiLora(CausalLM(cfg), n_slots=1, max_rank=4)
    other.init_slot(0, LoraSpec(rank=4, alpha=8.0), seed=4)
    return {
        "zero": str(save_adapter(lora, 0, root / "zero")),
        "random": str(save_adapter(lora, 1, root / "random")),
        "misfit": str(save_adapter(other, 0, root / "misfit")),
    }


def _args(tiny_model_dir, task_data, *extra) -> list[str]:
    return ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(task_data[1]), "--rm-type",
            "reverse-digits", "--max-prompts", "12", "--n-samples-per-prompt", "2", *extra]  # fmt: skip


def test_an_adapter_that_adds_nothing_gives_the_base_models_very_samples(tiny_model_dir, task_data, adapters):
    base, zero, rand = evaluate(parser().parse_args(_args(
        tiny_model_dir, task_data, "--base", "--adapter", adapters["zero"], "--adapter", adapters["random"])))  # fmt: skip
    assert (base.adapter, zero.adapter, rand.adapter) == (None, adapters["zero"], adapters["random"])
    assert base.samples == zero.samples == rand.samples == 24 and base.prompts == 12
    assert [s.tokens for s in zero.sample_list] == [s.tokens for s in base.sample_list]
    assert [s.reward for s in zero.sample_list] == [s.reward for s in base.sample_list]
    assert zero.mean_reward == base.mean_reward and 0 < base.mean_reward < 1
    changed = sum(a.tokens != b.tokens for a, b in zip(rand.sample_list, base.sample_list, strict=True))
    assert changed >= 12, f"a non-zero adapter must change the answers ({changed} of 24 changed)"
    assert len({tuple(s.tokens) for s in base.sample_list}) > 12, "temperature 1 draws differ per sample"
    prompt_ids = Tokenizer(tiny_model_dir).prompt_ids(base.sample_list[0].prompt, False)
    first = base.sample_list[0]
    assert first.tokens[: len(prompt_ids)] == prompt_ids and first.prompt_length == len(prompt_ids)
    assert all(len(s.rollout_log_probs) == s.response_length >= 1 for s in base.sample_list)


def test_the_same_seed_gives_the_same_samples_and_another_seed_others(tiny_model_dir, task_data):
    runs = [evaluate(parser().parse_args(_args(tiny_model_dir, task_data, "--base", "--seed", str(seed))))[0]
            for seed in (5, 5, 6)]  # fmt: skip
    tokens = [[s.tokens for s in r.sample_list] for r in runs]
    assert tokens[0] == tokens[1] and tokens[0] != tokens[2]


def test_greedy_answers_are_the_built_in_engines_with_and_without_the_adapter(tiny_model_dir, task_data, adapters):
    from services.engine.loras import EngineLoras
    from services.engine.scheduler import Request, SamplingParams, Scheduler

    tok = Tokenizer(tiny_model_dir)
    prompts = [tok.prompt_ids(json.loads(line)["prompt"], False) for line in task_data[1].read_text().splitlines()[:8]]
    engine_model = load_model(tiny_model_dir)
    scheduler = Scheduler(engine_model, max_running_requests=16)
    loras = EngineLoras(scheduler, max_loras=1, max_rank=4)
    loras.load({"lora_name": "a", "lora_path": adapters["random"]})
    scheduler.start()
    try:
        want = {}
        for slot in (-1, 0):
            done = threading.Semaphore(0)
            reqs = [Request(rid=f"{slot}-{i}", input_ids=p, params=SamplingParams(max_new_tokens=8, temperature=0.0),
                            on_done=lambda _r, done=done: done.release(), lora_slot=slot, lora_uid=max(slot + 1, 0))
                    for i, p in enumerate(prompts)]  # fmt: skip
            for r in reqs:
                scheduler.add_request(r)
            for _ in reqs:
                assert done.acquire(timeout=30), "the engine did not answer"
            want[slot] = [r.output_ids for r in reqs]
    finally:
        scheduler.shutdown()
    model = load_model(tiny_model_dir).eval()
    lora = MultiLora(model, n_slots=1, max_rank=4)
    lora.set_slot(0, *load_adapter(adapters["random"]))
    for slot in (-1, 0):
        got = generate(model, lora, slot, prompts, list(range(len(prompts))), max_new_tokens=8, temperature=0.0,
                       eos_ids=set(model.cfg.eos_ids), context_length=model.cfg.max_position_embeddings)  # fmt: skip
        assert [g.output_ids for g in got] == want[slot], f"slot {slot}"
    assert want[-1] != want[0]


def broken_reward(config, sample):
    raise RuntimeError("this reward function always fails")


def test_json_output_and_failed_samples(tiny_model_dir, task_data, adapters, tmp_path, capsys):
    out = tmp_path / "scores.json"
    rc = cli_main(["eval-adapter", *_args(tiny_model_dir, task_data, "--base", "--adapter", adapters["zero"],
                                          "--rollout-temperature", "0", "--json", str(out))])  # fmt: skip
    assert rc == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["adapter", "prompts", "samples", "mean", "reward", "failed"]
    assert table[1].startswith("(base model)") and table[2].startswith(adapters["zero"])
    doc = json.loads(out.read_text())
    assert doc["reward"] == "reverse-digits" and doc["n_samples_per_prompt"] == 2 and doc["seed"] == 0
    assert doc["rollout_temperature"] == 0.0 and doc["rollout_max_response_len"] == 16
    base, zero = doc["results"]
    assert set(base) == {"adapter", "prompts", "samples", "mean_reward", "failed", "truncated"}
    assert (base["adapter"], zero["adapter"]) == (None, adapters["zero"])
    assert base["prompts"] == 12 and base["samples"] == 24 and base["failed"] == 0
    assert base["mean_reward"] == zero["mean_reward"]
    assert f"{base['mean_reward']:.4f}" in table[1]

    rc = cli_main(["eval-adapter", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(task_data[1]),
                   "--custom-rm-path", f"{__name__}.broken_reward", "--max-prompts", "3", "--base",
                   "--json", str(out)])  # fmt: skip
    assert rc == 0
    (row,) = json.loads(out.read_text())["results"]
    assert (row["samples"], row["failed"], row["mean_reward"]) == (3, 3, 0.0)


def test_copy_digits_prompts_score_with_their_own_reward(tiny_model_dir, tmp_path, capsys):
    from services.tasks import copy_digits

    _, held_out = copy_digits.write_datasets(tmp_path, seed=0)
    rc = cli_main(["eval-adapter", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(held_out),
                   "--rm-type", "copy-digits", "--max-prompts", "8", "--base", "--json", str(tmp_path / "o.json")])  # fmt: skip
    assert rc == 0
    (row,) = json.loads((tmp_path / "o.json").read_text())["results"]
    assert row["samples"] == 8 and row["failed"] == 0 and 0 <= row["mean_reward"] <= 1


def test_a_rows_own_rm_type_picks_its_reward(tiny_model_dir, tmp_path):
    """As in training: a row's metadata.rm_type overrides --rm-type (one set may mix tasks)."""
    from services.eval.adapter_eval import evaluate, parser
    from services.tasks import copy_digits

    rows = [dict(r, metadata={"rm_type": "random"} if i % 2 else {}) for i, r in enumerate(copy_digits.make_rows(8, 3))]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (score,) = evaluate(parser().parse_args(["--hf-checkpoint", str(tiny_model_dir), "--prompt-data",
                                             str(tmp_path / "mixed.jsonl"), "--rm-type", "copy-digits", "--base"]))  # fmt: skip
    routed = [s for s in score.sample_list if s.metadata.get("rm_type") == "random"]
    assert routed and all(s.reward in (0.0, 1.0) for s in routed)
    assert len(routed) == len(score.sample_list) // 2


def test_rows_with_different_rm_types_are_scored_by_their_own_graders(tiny_model_dir, task_data, tmp_path):
    """No --rm-type: every row names its reward, and each sample gets exactly what its own grader
    gives (a reward hub grader, f1, in a worker process; a task's, reverse-digits, in this one),
    where the other would have given something else."""
    from services.rewards.graders import f1_compare
    from services.tasks.reverse_digits import score

    lines = task_data[1].read_text().splitlines()[:8]
    rows = [dict(json.loads(line), metadata={"rm_type": "f1" if i % 2 else "reverse-digits"})
            for i, line in enumerate(lines)]  # fmt: skip
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o.json"
    args = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(tmp_path / "mixed.jsonl"), "--base",
            "--rollout-temperature", "0"]  # fmt: skip
    assert cli_main(["eval-adapter", *args, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["reward"] == "metadata.rm_type"
    (result,) = evaluate(parser().parse_args(args))
    graders = {"reverse-digits": lambda s: score(s.response, s.label),
               "f1": lambda s: f1_compare(s.response, s.label, {})}  # fmt: skip
    disagree = 0
    for s in result.sample_list:
        own = s.metadata["rm_type"]
        other = "f1" if own == "reverse-digits" else "reverse-digits"
        assert s.reward == pytest.approx(graders[own](s)), (own, s.response, s.label)
        disagree += graders[own](s) != graders[other](s)
    assert result.failed == 0 and disagree >= 2, "the two graders must score these answers differently"


@pytest.fixture(scope="module")
def template_model_dir(tmp_path_factory):
    """An untrained character model whose chat template renders the offered tools' names."""
    from services.model.hf_io import save_model
    from services.tasks import char_model as cm
    from tests.conftest import TOOL_TEMPLATE

    d = tmp_path_factory.mktemp("model") / "template"
    cm.build_char_tokenizer(d, 256, chat_template=TOOL_TEMPLATE)
    cfg = ModelConfig(vocab_size=len(cm.SPECIAL) + len(cm.ALPHABET), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      bos_token_id=cm.BOS_ID, eos_token_id=cm.EOS_ID, pad_token_id=cm.PAD_ID)  # fmt: skip
    model = CausalLM(cfg)
    model.init_weights(0)
    save_model(model, d)
    return d


def test_a_rows_tools_reach_the_chat_template(template_model_dir, tmp_path):
    """With --tool-key (and --apply-chat-template) a row's tools are rendered into its prompt, as
    the producer renders them, and kept in metadata.tools; a row without tools has none."""
    tools = [{"type": "function", "function": {"name": "calc_add", "parameters": {"type": "object"}}}]
    chat = [{"role": "user", "content": "1+2"}]
    rows = [{"prompt": chat, "label": "3", "tools": tools, "metadata": {"rm_type": "reverse-digits"}},
            {"prompt": chat, "label": "3", "metadata": {"rm_type": "reverse-digits"}}]  # fmt: skip
    (tmp_path / "tools.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--hf-checkpoint", str(template_model_dir), "--prompt-data", str(tmp_path / "tools.jsonl"), "--base",
            "--apply-chat-template", "--rollout-max-response-len", "2"]  # fmt: skip
    tok = Tokenizer(template_model_dir)
    with_tools = tok.encode(tok.render_chat(chat, tools=tools), add_special_tokens=False)
    without = tok.encode(tok.render_chat(chat), add_special_tokens=False)
    assert tok.decode(with_tools).startswith("[calc_add]") and with_tools != without
    (result,) = evaluate(parser().parse_args([*args, "--tool-key", "tools"]))
    offered, plain = result.sample_list
    assert offered.tokens[: offered.prompt_length] == with_tools and offered.metadata["tools"] == tools
    assert plain.tokens[: plain.prompt_length] == without and "tools" not in plain.metadata
    (result,) = evaluate(parser().parse_args(args))  # without --tool-key the row's tools stay in the file
    assert all(s.tokens[: s.prompt_length] == without for s in result.sample_list)


def _error(capsys, argv: list[str]) -> str:
    rc = cli_main(["eval-adapter", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("asyncrl eval-adapter: error: ") and "\n" not in err, err
    return err


def test_errors_say_what_to_do(tiny_model_dir, task_data, adapters, tmp_path, capsys):
    args = _args(tiny_model_dir, task_data)
    err = _error(capsys, [*args, "--adapter", str(tmp_path / "nowhere")])
    assert "nowhere: no such directory" in err and "PEFT LoRA directory" in err
    (tmp_path / "empty").mkdir()
    err = _error(capsys, [*args, "--adapter", str(tmp_path / "empty")])
    assert "not a LoRA adapter directory" in err and "adapter_config.json" in err
    err = _error(capsys, [*args, "--adapter", adapters["misfit"]])
    assert "does not fit the base model" in err and "has shape" in err and "--hf-checkpoint" in err
    err = _error(capsys, [*args[:5], "no-such-task", *args[6:], "--base"])
    assert "--rm-type 'no-such-task' is unknown" in err and "copy-digits" in err and "--custom-rm-path" in err
    (tmp_path / "blank.jsonl").write_text("\n")
    err = _error(capsys, [*args[:2], "--prompt-data", str(tmp_path / "blank.jsonl"), *args[4:], "--base"])
    assert "no prompts" in err
    for flag, value, words in (("--n-samples-per-prompt", "0", "positive count"), ("--max-prompts", "-1", "positive count"),
                               ("--rollout-max-response-len", "0", "positive count"),
                               ("--rollout-temperature", "-0.5", ">= 0"), ("--rollout-temperature", "nan", ">= 0")):  # fmt: skip
        assert words in _error(capsys, [*args, "--base", flag, value]), flag
    assert "--adapter DIR" in _error(capsys, args)  # nothing to score
    assert "directory does not exist" in _error(capsys, [*args, "--base", "--json", str(tmp_path / "no" / "o.json")])
    (tmp_path / "notamodel").mkdir()
    err = _error(capsys, ["--hf-checkpoint", str(tmp_path / "notamodel"), *args[2:], "--base"])
    assert "cannot load the model" in err and "tokenizer.json" in err
    assert "no such directory" in _error(capsys, ["--hf-checkpoint", str(tmp_path / "nomodel"), *args[2:], "--base"])
    rows = [{"prompt": "12", "label": "21", "metadata": {"rm_type": "reverse-digits"}}, {"prompt": "34", "label": "43"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    no_rm = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(tmp_path / "rows.jsonl"), "--base"]
    err = _error(capsys, no_rm)  # no --rm-type, and a row that names no reward
    assert "prompt 2 names no metadata.rm_type" in err and "--rm-type" in err
    for rm_type, words in (("nope", "prompt 2: metadata.rm_type 'nope' is unknown"),
                           ("remote_rm", "prompt 2: metadata.rm_type 'remote_rm' needs --rm-url")):  # fmt: skip
        rows[1]["metadata"] = {"rm_type": rm_type}
        (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert words in _error(capsys, no_rm), rm_type


def test_help_stays_light():
    code = ("import sys\nfrom services.cli import main\ntry:\n    main(['eval-adapter', '--help'])\n"
            "except SystemExit as e:\n    assert e.code == 0\nprint('torch' in sys.modules)")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--adapter DIR" in r.stdout and r.stdout.strip().endswith("False")
