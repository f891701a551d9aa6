"""`lichen eval`: evaluate a checkpoint on the eval data sets alone, without training.

Takes the `lichen train` flags that matter for evaluation: `--hf-checkpoint`, `--eval-prompt-data NAME PATH …`
and/or `--eval-config FILE.yaml`, a reward (`--rm-type`, `--eval-rm-type` or `--custom-rm-path`), the eval
sampling flags, `--output-dir`, `--device`, … Training-only flags that `lichen train` requires get neutral values
here (one rollout step of one prompt, never run). Metrics go to `<output-dir>/metrics.jsonl` (step 0) and a table
on stdout, one line per data set.
"""

from __future__ import annotations

import argparse
import sys

from lichen.errors import ConfigError
from lichen.train_cli import hide_secrets

# flags `lichen train` requires that mean nothing for an eval-only run, with the values used when absent
_NEUTRAL = (("--num-rollout", "1"), ("--rollout-batch-size", "1"), ("--n-samples-per-prompt", "1"))


def parse_eval_args(argv: list[str]) -> argparse.Namespace:
    from lichen.config import parse_train_args

    argv = list(argv)
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        parse_train_args(["--help"])
    if "--eval-prompt-data" not in given and "--eval-config" not in given:
        raise ConfigError(
            "lichen eval needs the data sets to evaluate: --eval-prompt-data NAME PATH [NAME PATH …] "
            "or --eval-config FILE.yaml"
        )
    for flag, value in _NEUTRAL:
        if flag not in given:
            argv += [flag, value]
    if "--num-epoch" in given:
        raise ConfigError("lichen eval runs no training: drop --num-epoch")
    extra = ["--disable-rewards-normalization"] if "--disable-rewards-normalization" not in given else []
    if "--rm-type" not in given and "--custom-rm-path" not in given and "--eval-rm-type" in given:
        value = argv[argv.index("--eval-rm-type") + 1]
        extra += ["--rm-type", value]
    # the train parser wants prompt data; the eval data sets are read instead, so point it at one of them
    probe = parse_train_args(argv + extra + ([] if "--prompt-data" in given else ["--prompt-data", _any_path(argv)]))
    probe.eval_interval = None
    return probe


def _any_path(argv: list[str]) -> str:
    if "--eval-prompt-data" in argv:
        i = argv.index("--eval-prompt-data")
        if i + 2 < len(argv) and not argv[i + 2].startswith("--"):
            return argv[i + 2]
    if "--eval-config" in argv:
        from lichen.config.eval import load_eval_config

        _, entries = load_eval_config(argv[argv.index("--eval-config") + 1])
        return entries[0]["path"]
    raise ConfigError("--eval-prompt-data takes NAME PATH pairs, e.g. --eval-prompt-data gsm8k test.jsonl")


def format_table(metrics: dict) -> str:
    names = sorted({k.split("/")[1] for k in metrics if k.startswith("eval/") and k.count("/") == 2})
    lines = []
    for name in names:
        m = {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if k.startswith(f"eval/{name}/")}
        passes = " ".join(
            f"{k} {m[k]:.3f}" for k in sorted((k for k in m if k.startswith("pass@")), key=lambda k: int(k[5:]))
        )
        lines.append(
            f"{name}: reward {m['reward_mean']:.4f} | {passes} | truncated {m['truncated_ratio']:.3f} | "
            f"{int(m['num_prompts'])} prompts x {int(m['num_samples']) // max(int(m['num_prompts']), 1)} "
            f"samples | failed {int(m['num_failed'])}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_eval_args(argv)
    hide_secrets(args)
    import os

    from lichen.config.engine_config import EngineConfig
    from lichen.config.rollout_config import RolloutConfig
    from lichen.observe.metrics import MetricsLogger
    from lichen.rollout.manager import RolloutManager

    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    os.makedirs(args.output_dir, exist_ok=True)
    manager = RolloutManager(RolloutConfig.from_args(args), args, engine_cfg=EngineConfig.from_args(args))
    metrics = manager.eval(version=0)
    logger = MetricsLogger.for_run(args)
    logger.log(0, metrics)
    logger.close()
    sys.stdout.write(format_table(metrics) + "\n")
    return 0
