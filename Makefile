# Two entry points (README "Quick start"): `make quickstart` and `make test`. Both set up .venv first.
.PHONY: setup setup-test quickstart test bench-quickstart

setup:
	scripts/setup.sh

setup-test:
	scripts/setup.sh test

quickstart: setup
	.venv/bin/python examples/quickstart.py

test: setup-test
	.venv/bin/python -m pytest -n 2 -q -rs tests

bench-quickstart: setup
	.venv/bin/python benchmarks/quickstart_seeds.py
