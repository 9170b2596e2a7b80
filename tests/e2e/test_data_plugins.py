"""Miles's data-side plugins through a whole synchronous CLI run: a custom data source, over-
sampling with a dynamic filter, and the all-samples hook; the audited ledger must balance."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.e2e.test_cli_run import SMALL, _ledger, records

PLUGINS = """
import json, os
from services.api import DataSource, DynamicFilterOutput, Sample
from services.tasks.reverse_digits import make_rows

class Digits(DataSource):
    def __init__(self, config):
        super().__init__(config)
        self.rows, self.i = make_rows(500, seed=7), 0

    def get_samples(self, num_samples):
        out = []
        for _ in range(num_samples):
            row = self.rows[self.i]
            self.i += 1
            out.append([Sample(prompt=row["prompt"], label=row["label"], metadata={"source": "digits"})])
        return out

def every_third(config, group):
    return DynamicFilterOutput(keep=group[0].group_index % 3 != 0, reason="third")

def everything(config, all_samples, data_source):
    with open(os.environ["ALL_SAMPLES"], "a") as f:
        f.write(json.dumps([g[0].group_index for g in all_samples]) + "\\n")
"""


def test_a_custom_data_source_over_sampling_and_the_all_samples_hook(tmp_path):
    (tmp_path / "myplugins.py").write_text(PLUGINS)
    calls = tmp_path / "all.jsonl"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "ALL_SAMPLES": str(calls)}
    run_dir = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "train", *SMALL, "--num-rollout", "3",
         "--data-source-path", "myplugins.Digits", "--over-sampling-batch-size", "6",
         "--dynamic-sampling-filter-path", "myplugins.every_third",
         "--rollout-all-samples-process-path", "myplugins.everything", "--run-dir", str(run_dir)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [x["step"] for x in records(run_dir)] == [0, 1, 2]
    events = _ledger(run_dir)
    released = [e for e in events if e.kind == "released"]
    from services.tasks.reverse_digits import make_rows

    rows = make_rows(500, seed=7)
    # the custom source's prompts, in its order, one group index each
    assert [e.prompt.prompt for e in released] == [row["prompt"] for row in rows[: len(released)]]
    assert all(e.prompt.metadata == {"source": "digits"} for e in released)
    # over-sampling: the first step's prompts are released 6 at a time, not the 4 it needs
    first_lease = next(i for i, e in enumerate(events) if e.kind == "leased")
    assert sum(e.kind == "released" for e in events[:first_lease]) % 6 == 0
    filtered = {e.group_index for e in events if e.kind == "put" and e.outcome == "filtered"}
    assert filtered and all(g % 3 == 0 for g in filtered)
    # the hook saw each step's groups, the filtered ones included, in index order
    seen = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(seen) == 3 and all(s == sorted(s) and len(s) >= 4 for s in seen)
    assert filtered <= {g for s in seen for g in s}
    assert json.loads((run_dir / "audit.json").read_text())["balanced"]
