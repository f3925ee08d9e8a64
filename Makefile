# The two commands the README opens with. Both set up .venv first (once; again when pyproject.toml changes).
#   make demo   raw demo images -> prepare -> caption -> latents, offline, on a CPU
#   make test   the test suite (what CI runs)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup demo test lint clean-results constraints services
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements/constraints.txt requirements/no-deps.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]' -c requirements/constraints.txt
	$(BIN)/pip install -q --no-deps -r requirements/no-deps.txt
	touch $@

# Pin today's versions of everything but torch/torchvision/CUDA wheels (CI and the Docker image install with them).
constraints: setup
	{ sed -n '1,2p' requirements/constraints.txt; $(BIN)/pip list --format=freeze --exclude-editable \
	  | grep -v -i -E '^(torch|torchvision|triton)==|^(nvidia-|cuda-)'; } > requirements/constraints.txt.new
	mv requirements/constraints.txt.new requirements/constraints.txt

demo: setup
	sdpipe demo --out data/raw
	snakemake

# Two workers, whole files each: on a 2-core machine the many subprocess-bound tests leave a core idle otherwise,
# and a file's multi-process tests never share their ports with another file's.
test: setup
	pytest -q -n 2 --dist loadfile

# Debian's packages for the services the cluster tests start and stop themselves (tests/services.py): a
# single-node Slurm with munge. Needs root; without them those tests skip (CI sets SDPIPE_REQUIRE_SERVICES=1, so
# there they fail instead). The loopback S3 server (moto) comes with the dev extra.
services:
	command -v slurmctld >/dev/null && command -v munged >/dev/null || { \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge \
	  || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge; }; }

# Python lint and format (ruff), the Snakemake files' format (snakefmt) and lint, and the typed core (mypy; which
# files: pyproject.toml's [tool.mypy]). CI runs it before the tests.
lint: setup
	ruff check sdpipe tests scripts benchmarks
	ruff format --check sdpipe tests scripts benchmarks
	snakefmt --check Snakefile workflow
	snakemake --lint
	mypy

clean-results:
	rm -rf results logs .snakemake benchmarks/*.tsv
