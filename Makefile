# Two entry points for a fresh machine: `make train` (the built-in default run) and `make test`.
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# CPU machines pin the local CPU wheel of torch; machines with nvidia-smi keep their CUDA torch.
CONSTRAINT := $(shell command -v nvidia-smi >/dev/null 2>&1 || echo "-c constraints/cpu.txt")
RUN ?= runs/default

.PHONY: setup train test test-slow lint clean

$(STAMP): pyproject.toml constraints/cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(CONSTRAINT) -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/seektrain train --nproc-per-node 2 --set run.dir=$(RUN)
	$(VENV)/bin/seektrain sample --run $(RUN) --prompt "def "

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	VENV=$(VENV) bash .ci/static

test-slow: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m slow

clean:
	rm -rf $(VENV) runs
