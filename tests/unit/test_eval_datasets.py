"""--eval-config: Miles's per-dataset eval settings and how they resolve."""

from __future__ import annotations

import base64

import pytest

from services.common.config import RunConfig
from services.eval.datasets import eval_dataset_configs


def test_a_setting_is_the_datasets_else_the_defaults_else_the_flags():
    doc = """eval:
  defaults: {temperature: 0.6}
  datasets:
    - {name: a, path: a.jsonl, temperature: 0.2, max_response_len: 5}
    - {name: b, path: b.jsonl, rm_type: reverse-digits}
"""
    spec = "base64:" + base64.b64encode(doc.encode()).decode()
    a, b = eval_dataset_configs(RunConfig(eval_config=spec, n_samples_per_eval_prompt=3, rollout_max_response_len=9,
                                          eval_top_p=0.9))  # fmt: skip
    assert (a.name, a.temperature, a.max_response_len, a.n_samples_per_eval_prompt, a.top_p) == ("a", 0.2, 5, 3, 0.9)
    assert (b.temperature, b.max_response_len, b.rm_type) == (0.6, 9, "reverse-digits")
    assert b.sampling_params()["max_new_tokens"] == 9
    # without --eval-config: the --eval-prompt-data pairs with the flags' settings
    (x,) = eval_dataset_configs(RunConfig(eval_prompt_data=["x", "x.jsonl"], eval_temperature=0.5))
    assert (x.name, x.path, x.temperature) == ("x", "x.jsonl", 0.5)


@pytest.mark.parametrize(("doc", "message"), [
    ("datasets: [{path: a.jsonl}]", "must include a `name` field"),
    ("eval: {datasets: {}}", "does not define any datasets"),
    ("datasets: {a: {path: a.jsonl, tool_key: t}}", "unsupported dataset settings ['tool_key']"),
    ("datasets: {a: {temperature: 1}}", "dataset 'a' has no `path`"),
    ("[1, 2]", "must contain a mapping at the root"),
])  # fmt: skip
def test_a_bad_eval_config_says_what_is_wrong(tmp_path, doc, message):
    path = tmp_path / "eval.yaml"
    path.write_text(doc)
    with pytest.raises(ValueError) as e:
        eval_dataset_configs(RunConfig(eval_config=str(path)))
    assert message in str(e.value)


def test_the_launcher_inlines_the_eval_config_with_absolute_paths(tmp_path, monkeypatch):
    from services.prepare import inline_eval_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "eval.yaml").write_text("datasets: {aime: {path: data/aime.jsonl, temperature: 0.3}}")
    updates = inline_eval_config(RunConfig(eval_config="eval.yaml"))
    assert updates["eval_prompt_data"] == ["aime", str(tmp_path / "data" / "aime.jsonl")]
    (ds,) = eval_dataset_configs(RunConfig(eval_config=updates["eval_config"]))  # readable anywhere: no file
    assert (ds.path, ds.temperature) == (str(tmp_path / "data" / "aime.jsonl"), 0.3)
