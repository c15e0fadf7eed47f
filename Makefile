# The README's two commands: `make demo` and `make test`. Each installs into .venv/ first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# CPU machines: torch 2.13.0 is a CPU build here; an unpinned torch pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

.PHONY: install demo test test-faults benchmark clean
install: $(VENV)/.installed

demo: $(VENV)/.installed  ## tiny Qwen2.5 on the stdlib corpus, 2 workers, TP=2, local Ray
	# A fresh run each time: the previous run's final checkpoint would make it resume, finished.
	rm -rf outputs/demo/ray_train outputs/demo/metrics.jsonl outputs/demo/tensorboard
	$(PY) entrypoints/pretrain.py

test: $(VENV)/.installed  ## the CPU test suite (real Ray, real Megatron-Core)
	$(PY) -m pytest -q

test-faults: $(VENV)/.installed  ## node loss, elastic shrink/grow, kill during a save, drain, full disk (about 15 minutes)
	$(PY) -m pytest -q -m faults

benchmark: $(VENV)/.installed  ## Ray Train vs torchrun overhead
	$(PY) entrypoints/benchmark.py overhead

clean:
	rm -rf outputs
