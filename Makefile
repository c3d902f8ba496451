# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint format clean

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Trains the tiny preset on the Python standard library's own source (found at run time, no
# download), on the GPU if there is one, saves a checkpoint and prints a generated sample.
demo: $(STAMP)
	$(VENV)/bin/fitgpt train --preset tiny --data stdlib --out runs/demo --overwrite
	$(VENV)/bin/fitgpt generate --ckpt runs/demo --prompt "def " --max-new-tokens 200 --seed 0
	@echo "fitgpt is installed in $(VENV), not on PATH: run '. $(VENV)/bin/activate' in your shell"

# Two pytest workers: the multi-process tests spend much of their time waiting (a --dist-timeout
# waited out, torchrun's rendezvous, a killed node noticed: the five slowest files used 186 s of
# CPU in 438 s), and on CI's 2 cores the other worker's tests run meanwhile. worksteal: an idle
# worker takes queued tests from the busy one, so a long multi-process test that lands late does
# not leave a core idle. Each test still runs whole in one worker (its own tmp_path, free ports,
# forkserver).
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -n 2 --dist worksteal --durations=15

# Day-to-day: lint, then the tests not marked slow (no multi-process or long runs), stopping at
# the first failure. `make test` (what CI runs) runs every test.
test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -m "not slow" -x

lint: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
