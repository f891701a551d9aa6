# Two entry points (README "Quick start"): `make quickstart` and `make test`. Both set up .venv first.
.PHONY: setup setup-test quickstart test test-fast test-avx2 test-latest static-checks bench-quickstart

setup:
	scripts/setup.sh

setup-test:
	scripts/setup.sh test
	@# vLLM's own environment for the vLLM tests; where it cannot be installed they fail and say why
	scripts/setup_vllm.sh || echo "setup-test: vLLM's environment could not be installed (tests/test_vllm_*.py will fail)" >&2

quickstart: setup
	.venv/bin/python examples/quickstart.py

test: setup-test
	.venv/bin/python -m pytest -n 2 -q -rs --durations=30 tests

# The inner loop: every test not marked slow (no Ray, no multi-rank trainer, no long run; see the marker in
# pyproject.toml). CI runs everything (make test).
test-fast: setup-test
	.venv/bin/python -m pytest -n 2 -q -rs -m "not slow" tests

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
