# Two commands: `make run` and `make test`. All set-up logic lives in packaging/bootstrap.py.
PYTHON ?= python3
VENV := .venv
ARGS ?=

.PHONY: setup run test test-loaded test-slow test-numerics dist test-dist clean

setup:
	@$(PYTHON) packaging/bootstrap.py

run: setup
	$(VENV)/bin/ebb $(ARGS)

# --durations: the slowest tests are named at the end of every run
test: setup
	@$(PYTHON) packaging/bootstrap.py --test-tools
	$(VENV)/bin/python -m pytest -m "not slow and not dist" --durations=20 $(ARGS)

# `make test` with two busy processes beside it (a loaded CI runner): it must stay green
test-loaded: setup
	$(VENV)/bin/python packaging/loaded.py --hogs 2 -- -m "not slow and not dist" $(ARGS)

# the long measurements (exhaustive autotune sweep, calibration, swap benchmark, a slow link):
# CI runs them after `make test`
test-slow: setup
	$(VENV)/bin/python -m pytest -m "slow and not dist" $(ARGS)

# the tests that compare model outputs, again at other thread counts, another batch size and
# every CPU variant of the portable build this machine runs (packaging/numerics.py; CI runs it)
test-numerics: setup
	@$(PYTHON) packaging/numerics.py $(ARGS)

# the desktop bundle: dist/Ebb/ (launchers Ebb and ebb-engine) and dist/Ebb-<version>-*.tar.gz,
# with a portable llama.cpp build (cached beside the developer build). See packaging/dist.py.
dist:
	@$(PYTHON) packaging/dist.py

# builds the bundle, unpacks the tarball elsewhere and runs it like a user (CI runs it too)
test-dist: setup dist
	@$(PYTHON) packaging/dist.py --test-tools
	$(VENV)/bin/python -m pytest -m dist -s $(ARGS)

clean:
	rm -rf $(VENV) .venv-dist build dist *.egg-info
