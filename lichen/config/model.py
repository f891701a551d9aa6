"""General and model flags: config file, dry run, seed, runtime, backends, checkpoint to start from, device."""

from __future__ import annotations

import argparse
import json
import os
import time

from lichen.config.checks import check_hf_dir, check_int_at_least
from lichen.config.model_code import add_model_code_args
from lichen.errors import ConfigError, NotAvailableYet

ENV_VARS_EXAMPLE = '{"OMP_NUM_THREADS": "2"}'
SEED_MAX = 2**32 - 1
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("general and model")
    g.add_argument(
        "--config",
        metavar="FILE.yaml",
        default=None,
        help="YAML mapping of flag names (rollout-batch-size or rollout_batch_size) to values, typed as on the "
        "command line; lists for multi-value flags, true/false for on/off flags. The command line wins.",
    )
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve and check every flag, print the resolved configuration as YAML and exit without loading anything",
    )
    g.add_argument("--seed", type=int, default=1234, help="global random seed (sampling seeds derive from it)")
    g.add_argument(
        "--runtime",
        choices=["local", "ray"],
        default="local",
        help="local: trainer and engine in this process; ray: trainer ranks and engines as Ray actors "
        "(docs/runtimes.md)",
    )
    g.add_argument(
        "--train-backend",
        choices=["torch", "megatron"],
        default="torch",
        help="training backend: torch (PyTorch: one process with --runtime local; with --runtime ray every trainer "
        "rank holds an FSDP2 shard; slime's fsdp means this one) or megatron (not available yet)",
    )
    add_model_code_args(g)
    g.add_argument(
        "--train-env-vars",
        metavar="JSON",
        default="{}",
        help=f"environment variables for training, as a JSON object of strings, e.g. '{ENV_VARS_EXAMPLE}' "
        "(default: {}, none)",
    )
    g.add_argument(
        "--hf-checkpoint",
        metavar="PATH",
        default=None,
        help="(required) Hugging Face checkpoint directory (config.json, tokenizer, weights) to start from; "
        "weight version 0",
    )
    g.add_argument(
        "--ref-load",
        metavar="PATH",
        default=None,
        help="HF checkpoint of the reference model for KL terms (default: the --hf-checkpoint weights; version 0)",
    )
    g.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="device for the trainer and the in-process engine; auto picks cuda when available",
    )
    g.add_argument(
        "--bf16",
        action="store_true",
        help="train under bfloat16 autocast (float32 master weights); SGLang servers lichen launches get "
        "--dtype bfloat16, lichen's own engines still generate in float32 (default: off, float32)",
    )
    g.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in the backward pass to save memory (default: off)",
    )
    g.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch CPU threads (torch.set_num_threads; default: torch's own choice)",
    )
    g.add_argument(
        "--output-dir",
        metavar="PATH",
        default=None,
        help="where logs and metrics go (default: runs/<YYYYmmdd-HHMMSS>)",
    )


def _check_cuda() -> None:
    """--device cuda where torch sees no CUDA device fails now, not when the trainer first touches the device."""
    import torch  # only for --device cuda: the dry run of other configurations stays free of torch

    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(f"--device cuda: {why}; use --device cpu (or auto, which picks cuda when there is one)")


def parse_env_vars(text: str | dict) -> dict[str, str]:
    """`--train-env-vars` JSON text -> dict[str, str]; anything but a JSON object of strings is a ConfigError."""
    expected = f"expected a JSON object of string values, e.g. '{ENV_VARS_EXAMPLE}'"
    if isinstance(text, dict):  # already parsed (a YAML mapping, or re-validation)
        value = text
    else:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"--train-env-vars {text!r}: not valid JSON ({e.msg} at char {e.pos}); {expected}"
            ) from None
    if not isinstance(value, dict):
        kind = _JSON_KINDS.get(type(value), type(value).__name__)
        raise ConfigError(f"--train-env-vars {text!r}: a JSON {kind}, not an object; {expected}")
    for key, val in value.items():
        if not isinstance(val, str):
            raise ConfigError(
                f"--train-env-vars: the value of {key!r} is {json.dumps(val)}, not a string; {expected} "
                f'(quote numbers: "2")'
            )
    return dict(value)


def check(args: argparse.Namespace) -> None:
    if args.train_backend == "megatron":
        raise NotAvailableYet(
            "--train-backend megatron is not available yet: lichen has no Megatron backend yet; use --train-backend "
            "torch"
        )
    args.train_env_vars = parse_env_vars(args.train_env_vars)
    if args.hf_checkpoint is None:
        raise ConfigError(
            "--hf-checkpoint is required: the Hugging Face checkpoint directory to start from (lichen "
            "make-tiny-model writes a small one)"
        )
    check_hf_dir(args.hf_checkpoint, "--hf-checkpoint")
    from lichen.models.hf_support import check_model_flags

    check_model_flags(args, args.hf_checkpoint, "--hf-checkpoint")
    if args.ref_load is not None:
        check_hf_dir(args.ref_load, "--ref-load")
    check_int_at_least(args, "num_threads", 1)
    if not 0 <= args.seed <= SEED_MAX:
        raise ConfigError(
            f"--seed {args.seed}: must be in [0, {SEED_MAX}] (2**32 - 1), the range numpy and SGLang's --random-seed "
            "take"
        )
    if args.device == "cuda":
        _check_cuda()
    if args.output_dir is None:
        args.output_dir = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    elif os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise ConfigError(f"--output-dir {args.output_dir!r}: exists and is not a directory; give a directory path")
