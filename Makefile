# The two commands of the README: `make demo` (a real example run, locally) and `make test`.
# `make check` is the fast lane for the edit loop: lint, types and every test not marked slow.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LINTED := src tests examples benchmarks scripts

.PHONY: demo test check certify install lint clean

$(STAMP): pyproject.toml constraints/test.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints/test.txt -e '.[torch,tensorflow,lightning,huggingface,test,dev]'
	# tf-keras without its dependencies: they would pull the full tensorflow package over tensorflow-cpu.
	$(BIN)/pip install -q --no-deps -c constraints/test.txt tf-keras
	# The BigQuery emulator (REST + gRPC Storage Read) in its own venv: its wheel's pytest plugin crashes
	# pytest in any venv it is installed in. tests/bqemulator_launcher.py starts it offline.
	$(PYTHON) -m venv $(VENV)/bqemu
	$(VENV)/bqemu/bin/pip install -q -c constraints/test.txt bqemulator numpy
	touch $(STAMP)

install: $(STAMP)

# A 2-replica job of the torch example, preempted (SIGTERM) at step 20 and restarted: it resumes from the
# checkpoint of step 20, trains to the end, reports the final metric and exports the model.
demo: install
	$(BIN)/python examples/quickstart.py
	$(BIN)/vertexrt local-run --workers 2 --preempt-after 20 -- \
		$(BIN)/python examples/torch_classifier.py --hold-at-step 20

lint: install
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy src
	# A user's script importing the public API must pass mypy --strict (explicit exports).
	$(BIN)/mypy --strict tests/typing/consumer.py

test: lint
	$(BIN)/pytest -q -p no:cacheprovider

# The seeded fault certificate (`local-run --chaos`) over every certified example, with more seeds and
# runs than `make test` (12 runs cover every fault kind).
certify: install
	VERTEXRT_CERTIFY_SEEDS=1,2,3 VERTEXRT_CERTIFY_RUNS=12 $(BIN)/pytest -q -p no:cacheprovider tests/test_certify.py

check: lint
	$(BIN)/pytest -q -p no:cacheprovider -m "not slow"

clean:
	rm -rf $(VENV) vertexrt_output
