# Two entry points (README "Quick start"): `make quickstart` and `make test`. Both set up .venv first.
.PHONY: setup setup-test quickstart test test-avx2 bench-quickstart

setup:
	scripts/setup.sh

setup-test:
	scripts/setup.sh test

quickstart: setup
	.venv/bin/python examples/quickstart.py

test: setup-test
	.venv/bin/python -m pytest -n 2 -q -rs tests

# The numeric tests again on the AVX2 kernels (float results differ from AVX-512 in the last bits): CI runs both
# families on every machine.
NUMERIC_TESTS = tests/test_trainer.py tests/test_perf_trainer.py tests/test_algo_*.py tests/test_loop_invariants.py \
	tests/test_estimators_loop.py
test-avx2: setup-test
	ATEN_CPU_CAPABILITY=avx2 .venv/bin/python -m pytest -n 2 -q -rs $(NUMERIC_TESTS)

bench-quickstart: setup
	.venv/bin/python benchmarks/quickstart_seeds.py
