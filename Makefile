PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-slow test-all lint proto sdk dashboard bench clean llama-server

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

## make run: start the local stack (tollgate up) and run a short demo; Ctrl-C stops it.
run: $(STAMP)
	$(PY) -m services.stack.demo

## make test: the suite against a real PostgreSQL and Kafka-protocol broker, but for the
## cases marked slow (make test-slow; CI runs both).
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m 'not slow'

## make test-slow: the cases marked slow: real processes killed, restarted, fuzzed, chaos.
test-slow: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m slow

## make test-all: both.
test-all: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

## make lint: what CI checks besides the tests (ruff, ruff format, mypy).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy engine services tollgate tools bench

## make llama-server: build llama.cpp's server from source once (about ten minutes on two
## cores), cached under the user's cache directory; the tests and benchmarks that put
## Tollgate in front of it use it.
llama-server: $(STAMP)
	$(PY) -m tools.llama_server

## make proto: regenerate tollgate/v1/*_pb2*.py from protos/.
proto: $(STAMP)
	$(PY) -m tools.protogen

## make sdk: regenerate the synchronous client (tollgate/client.py, stream.py) from the asyncio one.
sdk: $(STAMP)
	$(PY) -m tools.sdkgen

## make dashboard: regenerate deploy/grafana/dashboards/tollgate.json from tools/dashboard.py.
dashboard: $(STAMP)
	$(PY) -m tools.dashboard

clean:
	rm -rf $(VENV) .tollgate
