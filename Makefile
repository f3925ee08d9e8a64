# The two commands the README opens with. Both set up .venv first (once; again when pyproject.toml changes).
#   make demo   raw demo images -> prepare -> caption -> latents, offline, on a CPU
#   make test   the test suite (what CI runs)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup demo test lint clean-results
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

demo: setup
	sdpipe demo --out data/raw
	snakemake

test: setup
	pytest -q

lint: setup
	snakemake --lint

clean-results:
	rm -rf results logs .snakemake benchmarks/*.tsv
