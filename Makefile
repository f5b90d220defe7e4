# The two commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# These machines ship a CPU build of torch 2.13.0 on disk; elsewhere pick your own build.
TORCH ?= torch==2.13.0
DEMO_ARGS ?=
PYTEST_ARGS ?=
# Test workers: the suite waits on brokers, fleets and soaks more than it computes, so
# more workers than cores (2 here) finish sooner (the README has the figures).
TEST_JOBS ?= 4
# The live camera tests (marked solo): each keeps a camera line busy but uses a tenth of a
# core (59 s wall, 7 s of CPU), so they run beside each other, and beside the rest of the
# suite only with the rest under nice 19: a camera line must read its frames when they come.
SOLO_JOBS ?= 4
# A suite that runs 12-14 min on 2 cores and is still going after 40 is wedged, not slow:
# each tier is interrupted then (SIGINT: pytest names the tests it was in) and the run fails,
# rather than holding a CI machine until its own limit says nothing.
SUITE_LIMIT ?= 2400
LIMITED := timeout --foreground --signal=INT --kill-after=60 $(SUITE_LIMIT)

.PHONY: demo test test-quick lint bench clean wheel readme-figures

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.demo-deps: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[data,plot,broker,station]'
	touch $@

$(VENV)/.test-deps: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet '$(TORCH)'
	$(PY) -m pip install --quiet -e '.[data,plot,dev,torch,ort,camera,export,broker,deploy,privacy,ray,body,pretrained,station]'
	touch $@

demo: $(VENV)/.demo-deps
	$(VENV)/bin/safl demo $(DEMO_ARGS)

# The README's demo tables, rewritten from 3 demos over the broker and one in process
# (about 11 minutes on 2 cores; tests/test_readme.py holds the README to the format).
readme-figures: $(VENV)/.demo-deps
	$(PY) docs/make_readme_figures.py

# Installs the suite's Debian packages first where it may (root, or sudo without a
# password); elsewhere it ends naming what was skipped and how to install it.
test: $(VENV)/.test-deps
	@deploy/system-packages.sh auto
	@rm -f $(VENV)/.test-result; touch $(VENV)/.test-started; solo_log=$$(mktemp); \
	$(LIMITED) $(PY) -m pytest -n $(SOLO_JOBS) -m solo $(PYTEST_ARGS) > $$solo_log 2>&1 & \
	solo=$$!; \
	nice -n 19 $(LIMITED) $(PY) -m pytest -n $(TEST_JOBS) --dist loadgroup -m "not solo" \
	$(PYTEST_ARGS); rc=$$?; wait $$solo; solo_rc=$$?; \
	for tier_rc in $$rc $$solo_rc; do [ $$tier_rc -ne 124 ] || \
	echo "make test: a tier ran past SUITE_LIMIT=$(SUITE_LIMIT) s and was stopped"; done; \
	[ $$solo_rc -eq 0 ] || rc=1; \
	echo "== the solo tests, run beside the rest at a higher priority =="; cat $$solo_log; \
	rm -f $$solo_log; deploy/system-packages.sh report; echo $$rc > $(VENV)/.test-result; \
	exit $$rc

# The quick tier, for the edit-and-rerun loop: no fleet, broker, camera or doc run.
test-quick: $(VENV)/.test-deps
	@$(PY) -m pytest -n $(TEST_JOBS) -m "not slow" $(PYTEST_ARGS)

# What a board installs: the wheel (and sdist) built from this tree, in a clean venv.
wheel: $(VENV)/.test-deps
	$(PY) -m pip install --quiet build
	rm -rf dist .wheel-venv
	$(PY) -m build --outdir dist . > dist.log 2>&1 || (cat dist.log; exit 1)
	$(PYTHON) -m venv .wheel-venv
	.wheel-venv/bin/pip install --quiet dist/*.whl
	.wheel-venv/bin/safl --version
	.wheel-venv/bin/safl-device --version
	.wheel-venv/bin/python -c "import edge_client.device, aggregator.station; print('wheel ok')"
	$(PY) -c "import sys, zipfile; names = zipfile.ZipFile(sys.argv[1]).namelist(); \
	missing = [p for p in ('edge_client', 'aggregator', 'lab', 'models', 'safl') \
	if p + '/py.typed' not in names]; sys.exit(f'py.typed missing in {missing}' if missing \
	else 0)" dist/*.whl

lint: $(VENV)/.test-deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy  # strict on edge_client, the default elsewhere (pyproject.toml)

bench: $(VENV)/.test-deps
	$(PY) bench/selection.py
	$(PY) bench/device_footprint.py
	$(PY) bench/wire.py
	$(PY) bench/weight_path.py
	$(PY) bench/trust.py

clean:
	rm -rf $(VENV) runs .pytest_cache dist dist.log .wheel-venv
