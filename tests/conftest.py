"""Shared fixtures: a tiny checkpoint and an addition data set, built once per session."""

import json
import os
import random

import pytest


def pytest_configure(config):
    # The suite runs two pytest workers on two cores: one torch thread each (also in the servers and runs the tests
    # start, which inherit OMP_NUM_THREADS) avoids oversubscription, which slows tiny models down many times.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
    from lichen.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model(str(out), arch="llama", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                    seed=0, init_std=0.1)
    return str(out)


def write_addition(path, n: int, seed: int = 0, hi: int = 20) -> str:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(0, hi), rng.randint(0, hi)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def addition_data(tmp_path_factory) -> str:
    return write_addition(tmp_path_factory.mktemp("data") / "add.jsonl", 64)
