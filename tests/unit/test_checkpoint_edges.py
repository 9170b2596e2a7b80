"""A trainer resumes whatever the files it finds: a --load or --save that names a file holds no
checkpoint, and a metrics line that is JSON but no record is dropped with the steps trained again."""

from __future__ import annotations

import json

from services.trainer.checkpoint import latest_checkpoint
from services.trainer.steps import Records


def test_a_save_directory_that_is_a_file_holds_no_checkpoint(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_text("not a directory")
    assert latest_checkpoint(path) is None


def test_records_after_the_resumed_step_go_and_a_line_that_is_no_record_with_them(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "x": 1}, 3, None, [], {"step": 1}, {"step": 2}]
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 3, "torn')
    (tmp_path / "trained.jsonl").write_text("".join(json.dumps({"step": s, "groups": [s]}) + "\n" for s in range(3)))
    Records(metrics, sinks=None, bus=None).drop_after(tmp_path, last_step=1)
    assert [json.loads(x) for x in metrics.read_text().splitlines()] == [{"step": 0, "x": 1}, {"step": 1}]
    assert [json.loads(x)["step"] for x in (tmp_path / "trained.jsonl").read_text().splitlines()] == [0, 1]
