"""Reward execution flags: concurrency and timeouts of verifiers, group reward models, the remote RM and the code
sandbox. (`--rm-type`, `--custom-rm-path` and `--reward-key` live with the rollout flags.)"""

from __future__ import annotations

import argparse

from lichen.config.checks import check_float, check_int_at_least
from lichen.errors import ConfigError
from lichen.plugins import load_function


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rewards")
    g.add_argument(
        "--rollout-sample-hook-path",
        action="append",
        default=[],
        metavar="MODULE.FUNCTION",
        help="a hook run on each generated sample before its reward, as slime's: hook(args, sample, *, "
        "rollout_id=None, evaluation=False) -> Sample | None, sync or async; may be repeated (run in order)",
    )
    g.add_argument("--reward-concurrency", type=int, default=16, help="verifier calls in flight at once per batch")
    g.add_argument(
        "--reward-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a verifier call running longer marks its sample failed (zero weight); per group with --group-rm",
    )
    g.add_argument(
        "--max-consecutive-failed-steps",
        type=int,
        default=3,
        metavar="N",
        help="stop the run with an error (exit code 1) after N consecutive rollout steps in which every sample's "
        "reward failed; 0: never stop",
    )
    g.add_argument(
        "--group-rm",
        action="store_true",
        help="call --custom-rm-path once per prompt group as fn(args, samples) -> list of rewards (default: once "
        "per sample)",
    )
    g.add_argument(
        "--rm-url",
        metavar="URL",
        default=None,
        help="endpoint of --rm-type remote_rm: each sample is POSTed as {prompt, response, label} (default: none)",
    )
    g.add_argument(
        "--rm-api-key-file",
        metavar="PATH",
        default=None,
        help="remote_rm: file holding the key sent as `Authorization: Bearer KEY` (chmod 600; default: the "
        "LICHEN_RM_API_KEY environment variable, else no key)",
    )
    g.add_argument("--rm-max-retries", type=int, default=3, help="remote_rm: retries after an error, 429 or 5xx")
    g.add_argument(
        "--rm-retry-backoff",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="remote_rm: the first retry waits this long (with jitter), each next one twice as long",
    )
    g.add_argument(
        "--code-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="code: wall-clock limit of one test case in the sandbox",
    )
    g.add_argument("--code-memory-mb", type=int, default=1024, help="code: address-space limit of the sandbox")
    g.add_argument(
        "--code-max-procs", type=int, default=32, help="code: processes and threads the sandboxed program may have"
    )
    g.add_argument("--code-max-file-mb", type=int, default=16, help="code: largest file the program may write")
    g.add_argument(
        "--code-sandbox-python",
        metavar="PATH",
        default=None,
        help="code: interpreter that runs the programs; must be executable by every user (default: this Python "
        "if it is, else /usr/bin/python3)",
    )
    g.add_argument(
        "--code-sandbox-uid-base",
        type=int,
        default=2_100_000_000,
        help="code, trainer running as root: sandboxed programs run as uid/gid BASE + slot (one per concurrent "
        "run); falls back to 65534 where that range is not mapped",
    )


def check(args: argparse.Namespace) -> None:
    check_int_at_least(args, "reward_concurrency", 1)
    for path in args.rollout_sample_hook_path or ():  # loaded now: a typo fails before any model loads
        load_function(path, "--rollout-sample-hook-path")
    check_float(args, "reward_timeout", low=0.0, low_open=True)
    check_int_at_least(args, "max_consecutive_failed_steps", 0)
    check_int_at_least(args, "rm_max_retries", 0)
    check_float(args, "rm_retry_backoff", low=0.0)
    check_float(args, "code_timeout", low=0.0, low_open=True)
    check_int_at_least(args, "code_memory_mb", 64)
    check_int_at_least(args, "code_max_procs", 1)
    check_int_at_least(args, "code_max_file_mb", 1)
    check_int_at_least(args, "code_sandbox_uid_base", 1)
    if args.code_sandbox_uid_base > 2**31 - 1 - 256:
        raise ConfigError(f"--code-sandbox-uid-base {args.code_sandbox_uid_base}: must be at most {2**31 - 257}")
    if args.group_rm and not args.custom_rm_path:
        raise ConfigError("--group-rm scores whole groups with your function: give --custom-rm-path module.function")
    if args.rm_type is not None:
        from lichen.rewards.hub import check_rm_type

        check_rm_type(args.rm_type)
    if args.rm_type == "remote_rm" and not args.rm_url:
        raise ConfigError("--rm-type remote_rm needs --rm-url http(s)://host:port/path, the reward endpoint")
    if args.rm_url is not None and not args.rm_url.startswith(("http://", "https://")):
        raise ConfigError(f"--rm-url {args.rm_url!r}: give the endpoint as http(s)://host:port/path")
