# Two commands do all the set-up (see README.md):
#   make demo   - create .venv, install air_magic, run the quickstart notebook on this machine
#   make test   - create .venv, install air_magic with its test tools, lint and type-check, build the docs, run the test suite
#   make docs   - build the documentation site into docs/_build/html (warnings are errors)
#   make check  - the quick tier: lint, types and the tests not marked slow (no kernel, cluster or process started),
#                 the three at once
VENV ?= .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test test-costs check docs bench browser lint types quick

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	@# The CPU build of torch on machines without an NVIDIA driver; the default (CUDA) build elsewhere. uv takes
	@# everything in seconds. The CPU build is the one in the folder where pip finds a machine's own wheels (pip's
	@# find-links), given to uv, which does not read pip's configuration: 11 s here, against 123 s for pip itself.
	@# Without such a folder pip takes torch==2.13.0 (it knows the machine's indexes), never uv's default CUDA build.
	@# --compile-bytecode: uv, unlike pip, writes no .pyc files, and where PYTHONDONTWRITEBYTECODE is set nothing
	@# writes them later, so every process (kernel, rank, MLflow server, Ray worker) compiled mlflow, ray and
	@# ipykernel from source at each import (mlflow: 4.0 s instead of 1.4 s).
	$(PY) -m pip install -q 'uv>=0.9,<1'
	if command -v nvidia-smi >/dev/null 2>&1; then $(UV) pip install -q --compile-bytecode --python $(PY) torch; \
	else links=$$(for d in $${PIP_FIND_LINKS:-} $$($(PY) -m pip config get global.find-links 2>/dev/null); do \
	    ls "$$d"/torch-2.13.0[+-]*.whl >/dev/null 2>&1 && echo "$$d" && break; done); \
	  if [ -n "$$links" ]; then $(UV) pip install -q --compile-bytecode --python $(PY) --find-links "$$links" torch==2.13.0; \
	  else $(PY) -m pip install -q torch==2.13.0; fi; fi
	$(UV) pip install -q --compile-bytecode --python $(PY) -e '.[test,docs]'
	DS_BUILD_OPS=0 $(UV) pip install -q --compile-bytecode --python $(PY) --no-build-isolation 'deepspeed>=0.16'
	@# air_magic itself is installed editable (its source is run in place): compiled here for the same reason.
	$(PY) -m compileall -q air_magic
	@# A build of an op killed midway leaves a lock that later builds wait on forever: removed when no process holds it.
	$(PY) -m air_magic.launch.rank.extension_locks
	touch $@

# Without GPUs, DeepSpeed's first init_distributed compiles its CPU communication op (once per machine): built
# here, not inside the DeepSpeed demo's test, where two busy cores took longer than the cell's time limit. Only the
# suite needs it (make check starts no process).
$(VENV)/.deepspeed-op: $(VENV)/.installed
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -c 'from deepspeed.accelerator import get_accelerator as g; \
	b = g().create_op_builder("ShareMemCommBuilder"); b and b.load()'; fi
	touch $@

browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

demo: $(VENV)/.installed
	$(PY) demo_notebooks/run.py demo_notebooks/quickstart.ipynb

test:
	@# the virtual environment and the browser at once (uv and apt-get each wait mostly on the network and the disk),
	@# then lint, types, the docs and DeepSpeed's CPU op at once (each is one process, mostly waiting on one core:
	@# together 41 s on two cores, against 73 s one after the other), then the suite
	$(MAKE) -j 2 $(VENV)/.installed browser VENV=$(VENV)
	$(MAKE) -j 4 lint types docs $(VENV)/.deepspeed-op VENV=$(VENV)
	@# No reruns: a test that passes only on a second try is a bug. -rs lists every skipped test and why.
	$(PY) -m pytest -n 4 --dist loadfile --no-loadscope-reorder --durations=25 -rs

# The suite as `make test` runs it, writing each module's time to tests/module_costs.json (the order in which its
# workers take the modules next time: costliest first). Commit the file when modules were added or changed much.
test-costs: $(VENV)/.installed $(VENV)/.deepspeed-op browser
	$(PY) -m pytest -n 4 --dist loadfile --no-loadscope-reorder -q --record-costs

check: $(VENV)/.installed
	$(MAKE) -j 3 lint types quick VENV=$(VENV)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check air_magic tests bench
	$(VENV)/bin/ruff check air_magic tests bench

types: $(VENV)/.installed
	$(VENV)/bin/mypy air_magic

quick: $(VENV)/.installed
	$(PY) -m pytest -m "not slow" -q

# -W --keep-going: every warning (a broken link, a name autodoc cannot find) fails the build, all reported at once.
# -E: read every page afresh (the API pages follow __all__, which Sphinx does not track).
# An existing environment is used as it is (make docs VENV=path/to/venv); a missing one is made first.
docs:
	@test -e $(VENV)/.installed || $(MAKE) $(VENV)/.installed VENV=$(VENV)
	$(PY) -m sphinx -E -b html -W --keep-going -q docs docs/_build/html

bench: $(VENV)/.installed
	$(PY) bench/launch.py
