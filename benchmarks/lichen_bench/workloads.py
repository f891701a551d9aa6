"""The benchmark workloads: model shape, prompts, reward and rollout sizes, identical for every framework.

W1 (toy): 4.2M-parameter llama, addition prompts "12+35=", reward 1.0 iff the completion's leading digits are
the sum; 4 prompts x 8 samples, 8 new tokens, lr 1e-4, 20 steps. `lichen bench rl` starts it from an SFT warm
start, where rewards are mixed (from random init every reward is 0 and every advantage 0).
W2 (long, ragged answers): 20M-parameter llama, random init; 8 prompts x 8 samples, up to 256 new tokens.
With a near-uniform next-token distribution over the ~100-symbol vocabulary and 2 stop tokens, a response
stops after a geometric number of tokens (mean ~ 50), so lengths in one batch range from a few to 256 --
the shape of real reasoning rollouts. Reward: the fraction of the response's characters that are digits, so
it differs between samples and advantages are non-zero.

Reward functions come in the two signatures the frameworks call:
  lichen (--custom-rm-path):  fn(args, sample) -> float
  TRL (reward_funcs):         fn(prompts, completions, label, **kwargs) -> list[float]
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import asdict, dataclass

from lichen.errors import ConfigError


@dataclass(frozen=True)
class Workload:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    prompts_per_step: int  # --rollout-batch-size
    group_size: int  # --n-samples-per-prompt / num_generations
    max_new_tokens: int
    lr: float
    steps: int
    reward: str  # name of a scorer in SCORERS
    model_seed: int = 0
    warm_start: bool = False  # `lichen bench rl` starts it from an SFT warm start (lichen_bench.warm_start)
    skip_variant: bool = False  # `lichen bench rl` also runs lichen with its zero-advantage skip on

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def to_dict(self) -> dict:
        return asdict(self)


WORKLOADS = {
    "w1": Workload(
        "w1",
        hidden_size=256,
        intermediate_size=1024,
        num_layers=4,
        num_heads=4,
        prompts_per_step=4,
        group_size=8,
        max_new_tokens=8,
        lr=1e-4,
        steps=20,
        reward="addition",
        warm_start=True,
        skip_variant=True,
    ),
    "w2": Workload(
        "w2",
        hidden_size=512,
        intermediate_size=1536,
        num_layers=6,
        num_heads=8,
        prompts_per_step=8,
        group_size=8,
        max_new_tokens=256,
        lr=1e-6,
        steps=8,
        reward="digit_fraction",
    ),
    # seconds-long check of the harness plumbing (tests, first try on a new machine); not a benchmark
    "smoke": Workload(
        "smoke",
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=4,
        lr=1e-4,
        steps=1,
        reward="addition",
        skip_variant=True,
    ),
}


# ---- rewards ------------------------------------------------------------------------------------------------
def score_addition(response: str, label: str) -> float:
    """1.0 iff the response's leading digits (after optional spaces) spell `label`, else 0.0."""
    text = response.lstrip(" ")
    digits = ""
    for ch in text:
        if not ch.isdigit():
            break
        digits += ch
    return 1.0 if digits and digits == str(label) else 0.0


def score_digit_fraction(response: str, label: str) -> float:
    """Fraction of the response's characters that are ASCII digits (0.0 for an empty response)."""
    if not response:
        return 0.0
    return sum("0" <= ch <= "9" for ch in response) / len(response)


SCORERS = {"addition": score_addition, "digit_fraction": score_digit_fraction}


def _sample_label(sample) -> str:
    return "" if sample.label is None else str(sample.label)


def lichen_addition_reward(args, sample) -> float:
    return score_addition(sample.response, _sample_label(sample))


def lichen_digit_fraction_reward(args, sample) -> float:
    return score_digit_fraction(sample.response, _sample_label(sample))


LICHEN_REWARD_PATHS = {
    "addition": "lichen_bench.workloads.lichen_addition_reward",
    "digit_fraction": "lichen_bench.workloads.lichen_digit_fraction_reward",
}


def trl_reward_fn(name: str):
    """A TRL reward function for scorer `name`; the dataset's `label` column arrives as a keyword."""
    scorer = SCORERS[name]

    def reward(prompts, completions, label=None, **kwargs) -> list[float]:
        labels = label if label is not None else [""] * len(completions)
        return [scorer(c if isinstance(c, str) else str(c), str(lab)) for c, lab in zip(completions, labels)]

    reward.__name__ = f"{name}_reward"
    return reward


# ---- prompts ------------------------------------------------------------------------------------------------
def make_prompts(wl: Workload, steps: int, seed: int = 0) -> list[dict]:
    """`steps * prompts_per_step` rows {"prompt", "label"}: row k * prompts_per_step + j is prompt j of step k.

    Both frameworks read them in file order (no shuffling), so every step sees the same prompts in both.
    """
    rng = random.Random(1000 + seed)
    rows = []
    for _ in range(steps * wl.prompts_per_step):
        if wl.reward == "addition":
            a, b = rng.randint(10, 49), rng.randint(10, 49)
            rows.append({"prompt": f"{a}+{b}=", "label": str(a + b)})
        else:
            # Varying prompt lengths (6..30 characters) so prompt padding shows up too.
            n = rng.randint(6, 30)
            body = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))
            rows.append({"prompt": f"{body}:", "label": ""})
    return rows


def write_prompts(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


# ---- checkpoints --------------------------------------------------------------------------------------------
def ensure_checkpoint(wl: Workload, directory: str) -> str:
    """Write the workload's random-init checkpoint with `lichen make-tiny-model` (in a subprocess) if missing."""
    marker = os.path.join(directory, "model.safetensors")
    if os.path.isfile(marker):
        return directory
    cmd = [
        sys.executable,
        "-m",
        "lichen.cli",
        "make-tiny-model",
        directory,
        "--arch",
        "llama",
        "--hidden-size",
        str(wl.hidden_size),
        "--intermediate-size",
        str(wl.intermediate_size),
        "--num-layers",
        str(wl.num_layers),
        "--num-heads",
        str(wl.num_heads),
        "--seed",
        str(wl.model_seed),
        "--max-position-embeddings",
        str(max(512, 64 + wl.max_new_tokens)),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ConfigError(f"lichen make-tiny-model failed for workload {wl.name}: {proc.stderr.strip()[-400:]}")
    return directory


def model_shape(checkpoint: str) -> dict:
    """The numbers the FLOP model needs, read from the checkpoint's config.json."""
    with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return {
        "hidden": cfg["hidden_size"],
        "intermediate": cfg["intermediate_size"],
        "layers": cfg["num_hidden_layers"],
        "q_dim": heads * head_dim,
        "kv_dim": cfg.get("num_key_value_heads", heads) * head_dim,
        "vocab": cfg["vocab_size"],
    }
