# Two entry points (README "Quick start"): `make quickstart` and `make test-all`. Both set up .venv first.
.PHONY: setup setup-test quickstart test-all test test-e2e test-fast test-avx2 test-latest static-checks bench-quickstart

setup:
	scripts/setup.sh

setup-test:
	scripts/setup.sh test
	@# vLLM's own environment for the vLLM tests; where it cannot be installed they fail and say why
	scripts/setup_vllm.sh || echo "setup-test: vLLM's environment could not be installed (tests/test_vllm_*.py will fail)" >&2

quickstart: setup
	.venv/bin/python examples/quickstart.py

# Three tiers (markers in pyproject.toml). test-all: the whole suite, what CI runs (.ci/run).
test-all: setup-test
	.venv/bin/python -m pytest -n 2 -q -rs --durations=30 tests

# Before a commit: everything but the heavy end-to-end runs (marker e2e: vLLM, Ray clusters, multi-rank trainers,
# chaos and kill -9 runs), which test-e2e runs on their own.
test: setup-test
	.venv/bin/python -m pytest -n 2 -q -rs --durations=15 -m "not e2e" tests

test-e2e: setup-test
	.venv/bin/python -m pytest -n 2 -q -rs --durations=15 -m e2e tests

# The inner loop: neither slow nor e2e (no server start-up, no Ray, no multi-rank trainer, no long run).
test-fast: setup-test
	.venv/bin/python -m pytest -n 2 -q -rs -m "not slow and not e2e" tests

# The suite on the newest versions pyproject.toml allows (not the tested set in constraints/tested.txt), in its
# own environment, and vLLM's newest in .venv-vllm-latest (not constraints/vllm-tested.txt). On success it marks .venv-latest green: scripts/freeze_constraints.sh then makes that set the
# tested one. Run it before resolving an issue.
test-latest:
	LICHEN_VENV=.venv-latest LICHEN_LATEST=1 scripts/setup.sh test
	LICHEN_VLLM_VENV=.venv-vllm-latest LICHEN_LATEST=1 scripts/setup_vllm.sh
	LICHEN_VLLM_PYTHON=$(CURDIR)/.venv-vllm-latest/bin/python .venv-latest/bin/python -m pytest -n 2 -q -rs tests
	touch .venv-latest/.suite-green

# Lint, format and type checks (CI runs them first). The type check fails only on errors beyond
# scripts/mypy_baseline.txt, which may only shrink: `scripts/check_types.py --update` after fixing some.
static-checks: setup-test
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python scripts/check_types.py

# The numeric tests again on the AVX2 kernels (float results differ from AVX-512 in the last bits): CI runs both
# families on every machine.
NUMERIC_TESTS = tests/test_trainer.py tests/test_perf_trainer.py tests/test_algo_*.py tests/test_loop_invariants.py \
	tests/test_estimators_loop.py
test-avx2: setup-test
	ATEN_CPU_CAPABILITY=avx2 .venv/bin/python -m pytest -n 2 -q -rs $(NUMERIC_TESTS)

bench-quickstart: setup
	.venv/bin/python benchmarks/quickstart_seeds.py
