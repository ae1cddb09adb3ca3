# Two commands: `make run` and `make test`. All set-up logic lives in packaging/bootstrap.py.
PYTHON ?= python3
VENV := .venv
ARGS ?=

.PHONY: setup run test test-slow clean

setup:
	@$(PYTHON) packaging/bootstrap.py

run: setup
	$(VENV)/bin/ebb $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest -m "not slow" $(ARGS)

# the long measurements (exhaustive autotune sweep, calibration, swap benchmark, a slow link):
# CI runs them after `make test`
test-slow: setup
	$(VENV)/bin/python -m pytest -m slow $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
