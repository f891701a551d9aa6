"""What the vLLM tests share: vLLM's environment (made by `make setup-test` / scripts/setup_vllm.sh) and a tiny
checkpoint vLLM's CPU attention runs (head size 64: lichen's default tiny model has 16, which it lacks).

Without vLLM's environment the tests FAIL and say how to make it; LICHEN_SKIP_VLLM=1 (never set in CI) skips them.
"""

from __future__ import annotations

import os

import pytest

from lichen.engines.clients.vllm_launcher import resolve_python
from lichen.errors import ConfigError

SKIP_ENV = "LICHEN_SKIP_VLLM"


def vllm_python() -> str:
    """The interpreter of vLLM's environment, checked to import vLLM; pytest.fail (or skip with LICHEN_SKIP_VLLM=1)."""
    import subprocess

    try:
        python = resolve_python(None)
        probe = subprocess.run(
            [python, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if probe.returncode != 0:
            raise ConfigError(f"{python} does not import vLLM: {probe.stderr.strip().splitlines()[-1:]}")
    except ConfigError as e:
        if os.environ.get(SKIP_ENV) == "1":
            pytest.skip(f"vLLM tests skipped ({SKIP_ENV}=1): {e}")
        pytest.fail(f"vLLM's environment is missing: {e} (run scripts/setup_vllm.sh; {SKIP_ENV}=1 skips)")
    return python


def vllm_tiny_model(out: str) -> str:
    """A 2-layer llama with head size 64 (hidden 128, 2 heads), float32, weights peaked enough (init std 0.1) that
    log-probs differ between tokens, and positions for 4096 tokens (a request long enough to be caught running)."""
    from lichen.models.tiny import make_tiny_model

    make_tiny_model(
        out,
        arch="llama",
        hidden_size=128,
        num_layers=2,
        num_heads=2,
        intermediate_size=256,
        max_position_embeddings=4096,
        seed=0,
        init_std=0.1,
    )
    return out
