# One command per job; see README.md. Everything lives in .venv.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; override for another build, e.g. make run TORCH="torch==2.13.0 --index-url ..."
TORCH ?= torch==2.13.0

.PHONY: setup run smoke test test-crash test-roles test-cluster test-ray test-tasks test-browser test-docker test-all bench lint clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e .
	touch $@

$(BIN)/.test-installed: $(BIN)/.installed
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

setup: $(BIN)/.installed

# The default job: fully async RL on the bundled task, embedded NATS, built-in engine, tiny model.
run: setup
	$(BIN)/asyncrl train-async --config deploy/configs/quickstart.yaml $(ARGS)

# A short default job (what .ci/run runs in a venv made by `make setup` alone, so a runtime
# dependency that only the test extras bring in fails CI).
smoke: setup
	$(BIN)/asyncrl train-async --config deploy/configs/quickstart.yaml --num-rollout 5 $(ARGS)

# The test suite CI runs (.ci/run calls exactly this).
test: $(BIN)/.test-installed
	$(BIN)/python -m pytest -q

# A short run killed at every named crash point (tests/crash), and whole runs with one process
# of each kind SIGKILLed at a random moment; CI runs it after `make test`.
test-crash: $(BIN)/.test-installed
	$(BIN)/python -m pytest -q -m crash tests/crash tests/integration/test_kill_recovery.py

# One live default job that every role probes with its own credentials, each role's worst case
# asserted (tests/roles; docs/trust.md); CI runs it too.
test-roles: $(BIN)/.test-installed
	$(BIN)/python -m pytest -q -m roles tests/roles

# Whole runs on a 3-node NATS cluster, one node killed, every node restarted in turn; CI runs it too.
test-cluster: $(BIN)/.test-installed
	$(BIN)/python -m pytest -q -m cluster tests/integration/test_nats_cluster.py

# A whole run placed with --use-ray over a 2-node Ray cluster on 127.0.0.2 and 127.0.0.3, and a
# data-parallel trainer placed with --use-ray on a local one; CI runs it too.
test-ray: $(BIN)/.test-installed
	$(BIN)/python -m pytest -q -m ray tests/integration/test_ray_cluster.py tests/e2e/test_cli_run.py

# Whole runs on real tasks' data: a Parquet math set graded with boxed_math, a reasoning-gym task,
# the calculator tool task learning its tool, an OpenEnv environment in the loop, the long-tail job
# (their graders and data readers are in the default suite); CI runs it too.
# The dashboard in headless Chromium (Debian's chromium + chromium-driver; .ci/run installs them).
test-browser: $(BIN)/.test-installed
	$(BIN)/python -m pytest -q -m browser tests/browser

test-tasks: $(BIN)/.test-installed
	$(BIN)/python -m pytest -q -m tasks tests/e2e/test_math_run.py tests/e2e/test_reasoning_gym_run.py tests/e2e/test_tool_use_run.py tests/e2e/test_longtail_run.py tests/e2e/test_diagnosis_runs.py

# docker-compose.yml run for real on loopback (tests/docker): builds the image, runs a short job to
# its end with three producers and audits it; skips, saying why, when no Docker daemon can start.
test-docker: $(BIN)/.test-installed
	$(BIN)/python -m pytest -q -m docker tests/docker

# Everything, including the slow learning checks.
test-all: $(BIN)/.test-installed
	$(BIN)/python -m pytest -q -m "not gpu"

bench: setup
	$(BIN)/python bench/pipeline.py

clean:
	rm -rf $(VENV) runs .pytest_cache
