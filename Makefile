# The two commands of the README: `make demo` (a real example run, locally) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LINTED := src tests examples benchmarks scripts

.PHONY: demo test install lint clean

$(STAMP): pyproject.toml constraints/test.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints/test.txt -e '.[torch,tensorflow,test,dev]'
	# tf-keras without its dependencies: they would pull the full tensorflow package over tensorflow-cpu.
	$(BIN)/pip install -q --no-deps -c constraints/test.txt tf-keras
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

test: lint
	$(BIN)/pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) vertexrt_output
