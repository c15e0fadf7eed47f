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

.PHONY: install chromium demo demo-vl test test-faults benchmark clean
install: $(VENV)/.installed

demo: $(VENV)/.installed  ## tiny Qwen2.5 on the stdlib corpus, 2 workers, TP=2, local Ray
	# A fresh run each time: the previous run's final checkpoint would make it resume, finished.
	rm -rf outputs/demo/ray_train outputs/demo/metrics.jsonl outputs/demo/tensorboard
	$(PY) entrypoints/pretrain.py

demo-vl: $(VENV)/.installed  ## tiny-vl learns a shapes corpus: stage 1, stage 2, colour accuracy
	$(PY) entrypoints/demo_vl.py

# tests/test_report.py renders the run report in Debian's headless chromium; as root this
# installs it (quietly) if missing; otherwise, or if apt-get fails, it says why and `make test`
# goes on: that test then fails, naming the install command.
chromium:  ## Debian's chromium for tests/test_report.py (apt-get, as root)
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" != 0 ]; then \
		echo "chromium: /usr/bin/chromium is missing and only root can apt-get it" \
			"(sudo apt-get install chromium); tests/test_report.py will fail without it"; \
	elif ! command -v apt-get >/dev/null; then \
		echo "chromium: /usr/bin/chromium is missing and there is no apt-get here;" \
			"tests/test_report.py will fail without it"; \
	else \
		log=$$(mktemp); \
		if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
				chromium) >"$$log" 2>&1; then \
			echo "chromium: installed $$(/usr/bin/chromium --version 2>/dev/null)"; \
		else \
			echo "chromium: apt-get install chromium failed (tests/test_report.py will fail):"; \
			tail -n 5 "$$log"; \
		fi; \
		rm -f "$$log"; \
	fi

test: $(VENV)/.installed chromium  ## the CPU test suite (real Ray, real Megatron-Core)
	@start=$$(date +%s); $(PY) -m pytest -q; status=$$?; \
		echo "make test: $$(( $$(date +%s) - start )) s in all (pytest's own count above)"; \
		exit $$status

test-faults: $(VENV)/.installed  ## node loss, elastic shrink/grow, kill during a save, drain, full disk (about 11 minutes)
	$(PY) -m pytest -q -m faults

benchmark: $(VENV)/.installed  ## Ray Train vs torchrun overhead
	$(PY) entrypoints/benchmark.py overhead

clean:
	rm -rf outputs
