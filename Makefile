# Two commands: `make run` and `make test`. All set-up logic lives in packaging/bootstrap.py.
PYTHON ?= python3
VENV := .venv
ARGS ?=

.PHONY: setup run test clean

setup:
	@$(PYTHON) packaging/bootstrap.py

run: setup
	$(VENV)/bin/ebb $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
