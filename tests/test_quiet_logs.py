"""Third-party lines a user cannot act on stay out of a run's stderr; lichen's own warnings stay in.

math-verify warns "Timeout is disabled as parsing_timeout is None…" (and the same for timeout_seconds) the first
time it runs without its SIGALRM bound in a process, which lichen's verifiers do off the main thread (the --async
and --fully-async rollout threads). The check runs in a fresh interpreter because math-verify shows each warning
once per process and this test process may already have graded math.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("math_verify")

# a verifier start as an --async rollout does it: `math` scores a batch on a thread other than the main one; the
# first sample needs math-verify (x+1 vs 1+x is symbolic), the second names an unknown rm type and fails
SCRIPT = r"""
import json, threading
from lichen.observe.metrics import get_logger
from lichen.rewards import build_reward_fn, score_samples
from lichen.types import Sample

get_logger("lichen")  # lichen's stderr handler, as `lichen train` sets it up
fn = build_reward_fn("math", None, None)
samples = [
    Sample(prompt="p", response="so \\boxed{x+1}", label="1+x", index=0, metadata={}),
    Sample(prompt="p", response="\\boxed{2}", label="2", index=1, metadata={"rm_type": "bogus"}),
]
stats = {}
worker = threading.Thread(target=lambda: stats.update(score_samples(samples, fn, None)))
worker.start()
worker.join()
print(json.dumps({"rewards": [s.reward for s in samples], "num_failed": stats["num_failed"]}))
"""


def test_math_verify_timeout_warning_is_dropped_and_lichens_warning_is_kept():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # math-verify did run (only its symbolic step finds x+1 = 1+x), and the bad sample failed
    assert result == {"rewards": [1.0, 0.0], "num_failed": 1}
    assert "Timeout is disabled" not in proc.stderr, proc.stderr
    assert "[lichen] WARNING: reward failed for 1 of 2 samples" in proc.stderr, proc.stderr
