# Developer entry points. `make example` and `make test` are the README's two set-up commands.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kubeps-installed
PYTEST_ARGS ?=
# the slowest tests, in every run's log: where CI's time goes (docs/testing.md)
DURATIONS := --durations=30
# `make test` runs the suite in this many pytest-xdist workers: the API-server tests beside the training tests (the
# groups in tests/conftest.py); PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2

ACTIONLINT_VERSION := v1.7.12

.PHONY: install example test lint docs docs-build controlplane s3server kueue gang-crds monitoring-crds tools e2e kind-down bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[operator,test,docs]'
	touch $(STAMP)

install: $(STAMP)

# Train the CTR example on a local cluster of 2 parameter servers and 2 workers.
example: $(STAMP)
	$(BIN)/kubeps local --ps 2 --workers 2 examples/ctr/train.py

# Build (cached) the loopback Kubernetes control plane when Go is available, then run the whole suite.
controlplane:
	@if command -v go >/dev/null 2>&1 || [ -x /usr/local/go/bin/go ]; then \
		PATH="$$PATH:/usr/local/go/bin" hack/controlplane.sh build; \
	else \
		echo "go not found: control-plane tests will be skipped (see docs/testing.md)"; \
	fi

# Build (cached under ~/.cache/kubeps/s3server) the S3-compatible server the object-storage tests start on loopback
# (versitygw, from the Go module proxy) when Go is available.
s3server:
	@if command -v go >/dev/null 2>&1 || [ -x /usr/local/go/bin/go ]; then \
		PATH="$$PATH:/usr/local/go/bin" hack/s3server.sh build; \
	else \
		echo "go not found: the object-storage tests will be skipped (see docs/testing.md)"; \
	fi

# Build (cached under ~/.cache/kubeps/kueue) Kueue v0.19.2's manager, CRDs and webhook manifests from the Go module
# proxy, for the Kueue tests (tests/operator/test_kueue.py), when Go is available.
kueue:
	@if command -v go >/dev/null 2>&1 || [ -x /usr/local/go/bin/go ]; then \
		PATH="$$PATH:/usr/local/go/bin" hack/kueue.sh build; \
	else \
		echo "go not found: the Kueue tests will be skipped (see docs/testing.md)"; \
	fi

# Fetch (cached under ~/.cache/kubeps/gang-crds) Volcano's and scheduler-plugins' PodGroup CRDs, which the gang
# scheduling tests install on the control plane (tests/operator/test_gang.py), when Go is available.
gang-crds:
	@if command -v go >/dev/null 2>&1 || [ -x /usr/local/go/bin/go ]; then \
		PATH="$$PATH:/usr/local/go/bin" hack/gang-crds.sh build; \
	else \
		echo "go not found: the Volcano and scheduler-plugins PodGroup tests will be skipped (see docs/testing.md)"; \
	fi

# Generate (cached under ~/.cache/kubeps/monitoring-crds) prometheus-operator's PodMonitor and ServiceMonitor CRDs,
# which the chart tests validate the chart's monitors against and install on the control plane, when Go is available.
monitoring-crds:
	@if command -v go >/dev/null 2>&1 || [ -x /usr/local/go/bin/go ]; then \
		PATH="$$PATH:/usr/local/go/bin" hack/monitoring-crds.sh build; \
	else \
		echo "go not found: the PodMonitor and ServiceMonitor tests will be skipped (see docs/testing.md)"; \
	fi

# Linters the packaging tests run, built from the Go module proxy into the venv (cached by Go).
tools: $(STAMP)
	@if [ -x $(BIN)/actionlint ]; then :; \
	elif command -v go >/dev/null 2>&1 || [ -x /usr/local/go/bin/go ]; then \
		GOBIN="$(CURDIR)/$(BIN)" PATH="$$PATH:/usr/local/go/bin" go install github.com/rhysd/actionlint/cmd/actionlint@$(ACTIONLINT_VERSION); \
	else \
		echo "go not found: the actionlint test will be skipped"; \
	fi

# ruff, the import contracts (.importlinter) and mypy on the runtime (hack/mypy.sh) alone; `make test` runs them
# too (tests/code_checks).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	MYPY=$(abspath $(BIN))/mypy hack/mypy.sh

# The tests marked `alone` (one loads the 2-core machine by itself) run after the others, one at a time; pytest's
# exit 5 (nothing selected: PYTEST_ARGS picked none of a phase) is not a failure. Both phases run; the first failing
# phase's exit code is make's.
test: $(STAMP) controlplane s3server kueue gang-crds monitoring-crds tools
	export PATH="$(CURDIR)/$(BIN):$$PATH"; \
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) -m "not alone" $(DURATIONS) $(PYTEST_ARGS); rc=$$?; \
	$(BIN)/python -m pytest -m alone $(DURATIONS) $(PYTEST_ARGS); rc2=$$?; \
	for code in $$rc $$rc2; do [ $$code -eq 0 ] || [ $$code -eq 5 ] || exit $$code; done

# End-to-end tests with real pods on a kind cluster: hack/kind.sh builds (cached under ~/.cache/kubeps/kind) what
# the cluster needs, starts dockerd if none runs, creates the cluster, builds and loads the images; the tests install
# the operator with Helm; the cluster (and a dockerd we started) is removed at the end. See docs/testing.md.
e2e: $(STAMP)
	PATH="$$PATH:/usr/local/go/bin" hack/kind.sh build
	KUBEPS_E2E=1 PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest tests/e2e $(DURATIONS) $(PYTEST_ARGS)

# Remove the e2e cluster (and stop the dockerd hack/kind.sh started) after KUBEPS_E2E_KEEP=1 or an interrupted run.
kind-down:
	hack/kind.sh down

# Serve the documentation site locally, rebuilt on every change; docs-build writes it to site/ with warnings as
# errors, as tests/docs/test_site.py does in `make test`.
# (NO_MKDOCS_2_WARNING: Material's banner about its end of life in 2027 and its successor, printed on every build)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict

docs-build: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	@for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
