# The two commands of the README. Each sets up what it needs (apt pocl, .venv, the package).
VENV ?= .venv
PY := $(VENV)/bin/python
# pocl by name: with another ICD installed (Mesa's rusticl, Clover) the first platform may be
# another one, or one without devices. Set PYOPENCL_CTX to choose another device.
PYOPENCL_CTX ?= portable
export PYOPENCL_CTX

.PHONY: demo test bench lint

demo:
	@scripts/setup.sh
	$(PY) examples/simulation.py

test:
	@scripts/setup.sh test,mpi,plot
	$(PY) -m pytest -q

bench:
	@scripts/setup.sh bench
	$(PY) -m asyncclcache bench

lint:
	@scripts/setup.sh dev
	$(VENV)/bin/ruff check src tests examples benchmarks
