"""Rollout flags: batch shape, sampling, rewards, plug-ins, engines, and `--sglang-*` pass-through.

`--sglang-<x>` flags are meant for the SGLang servers lichen launches and are passed to them verbatim, except the
ones lichen reads itself (SGLANG_CONSUMED_FLAGS). Unknown `--sglang-*` arguments are therefore collected into
`args.sglang_passthrough` (a flat token list, e.g. ["--sglang-mem-fraction-static", "0.8"]) instead of failing;
they need `--rollout-engine-backend sglang --rollout-num-engines K`, and one that sets what lichen sets itself
(model path, host, port, tp size, ...: lichen.engines.clients.sglang_launcher.LICHEN_SETS) is an error.
"""

from __future__ import annotations

import argparse
import difflib
import re

from lichen.config import sglang_config, vllm_config
from lichen.config.checks import check_dotted_path, check_float, check_int_at_least
from lichen.errors import ConfigError, NotAvailableYet
from lichen.models.config import model_config_value

SGLANG_PREFIX = "--sglang-"
PASSTHROUGH_PREFIXES = (SGLANG_PREFIX, vllm_config.VLLM_PREFIX)  # --vllm-<flag>: lichen.config.vllm_config
SGLANG_CONSUMED_FLAGS = ("--sglang-server-concurrency", "--sglang-router-ip", "--sglang-router-port", "--sglang-config")

_ROUTER_LATER = "lichen routes requests over its engines itself; an external SGLang router comes later"


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "rollout",
        description=f"Other {SGLANG_PREFIX}<flag> arguments are passed verbatim to the SGLang servers that lichen "
        f"launches; lichen itself reads only {', '.join(SGLANG_CONSUMED_FLAGS)}.",
    )
    g.add_argument(
        "--rollout-batch-size",
        type=int,
        default=None,
        help="(required) prompts per rollout step; each yields --n-samples-per-prompt samples",
    )
    g.add_argument("--n-samples-per-prompt", type=int, default=1, help="samples generated per prompt (group size)")
    g.add_argument("--rollout-max-response-len", type=int, default=1024, help="most tokens generated per sample")
    g.add_argument("--rollout-temperature", type=float, default=1.0, help="sampling temperature, > 0")
    g.add_argument("--rollout-top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--rollout-top-k", type=int, default=-1, help="sample among the k likeliest tokens; -1: all")
    g.add_argument(
        "--rollout-stop-token-ids",
        type=int,
        nargs="*",
        metavar="ID",
        default=None,
        help="token ids that end a response besides EOS (default: EOS only)",
    )
    g.add_argument(
        "--rm-type",
        metavar="NAME",
        default=None,
        help="built-in rule reward, e.g. math (the last \\boxed{} answer, as slime), math_lenient (also an unboxed "
        "last number) or exact; docs/rewards.md lists them; this or --custom-rm-path is required (default: none)",
    )
    g.add_argument(
        "--custom-rm-path",
        metavar="MODULE.FUNCTION",
        default=None,
        help="your reward function as module.function; this or --rm-type is required (default: none)",
    )
    g.add_argument(
        "--reward-key",
        metavar="KEY",
        default=None,
        help="when the reward is a dict, the key whose value is the scalar reward (default: the reward is a float)",
    )
    g.add_argument(
        "--rollout-function-path",
        metavar="MODULE.FUNCTION",
        default=None,
        help="replace the whole rollout step with module.function: fn(args, rollout_id, data_source, "
        "evaluation=False) -> RolloutFnTrainOutput (lichen.rollout.base_types; default: lichen's own rollout)",
    )
    g.add_argument(
        "--eval-function-path",
        metavar="MODULE.FUNCTION",
        default=None,
        help="replace the eval pass with module.function, called as the rollout function with evaluation=True "
        "and returning RolloutFnEvalOutput (default: lichen's own eval)",
    )
    g.add_argument(
        "--custom-generate-function-path",
        metavar="MODULE.FUNCTION",
        default=None,
        help="replace per-sample generation with module.function (default: one engine call per sample)",
    )
    g.add_argument(
        "--rollout-num-engines",
        type=int,
        default=None,
        help="launch this many engine servers (`lichen serve`, or SGLang with --rollout-engine-backend sglang) on "
        "free loopback ports and stop them at exit; weights reach them by --update-weight-transport (default: the "
        "in-process engine)",
    )
    g.add_argument(
        "--rollout-external-engine-addrs",
        nargs="+",
        metavar="HOST:PORT",
        default=None,
        help="use these running SGLang-protocol servers (lichen serve or SGLang) instead of the in-process engine "
        "(needs --update-weight-transport disk for now, with a directory the servers can read; default: none)",
    )
    g.add_argument(
        "--rollout-external-engine-api-key-file",
        metavar="FILE",
        default=None,
        help="file holding the API key of the --rollout-external-engine-addrs servers (chmod 600), sent as "
        "'Authorization: Bearer KEY' (default: $LICHEN_ENGINE_API_KEY, else none); engines lichen launches get a "
        "fresh random key per run",
    )
    g.add_argument(
        "--rollout-external-engine-admin-api-key-file",
        metavar="FILE",
        default=None,
        help="file holding those servers' admin key (their --admin-api-key), sent on the control endpoints "
        "(default: $LICHEN_ENGINE_ADMIN_API_KEY, else the API key)",
    )
    g.add_argument(
        "--sglang-server-concurrency",
        type=int,
        default=512,
        help="most requests in flight per engine server",
    )
    g.add_argument(
        "--sglang-router-ip",
        metavar="IP",
        default=None,
        help="address of a running SGLang router (not available yet; default: none)",
    )
    g.add_argument(
        "--sglang-router-port",
        metavar="PORT",
        type=int,
        default=None,
        help="port of a running SGLang router (not available yet; default: none)",
    )
    sglang_config.add_args(g)
    g.add_argument(
        "--rollout-engine-backend",
        choices=("lichen", "sglang", "vllm"),
        default="lichen",
        help="server launched by --rollout-num-engines: lichen (`lichen serve`, any device), sglang "
        "(`python -m sglang.launch_server`, GPU; takes the --sglang-<flag> pass-through) or vllm (vLLM's OpenAI "
        "server from its own environment, CPU or GPU; takes --vllm-<flag>; also the protocol of "
        "--rollout-external-engine-addrs: docs/engines.md) (default: lichen)",
    )
    vllm_config.add_args(g)
    g.add_argument(
        "--rollout-num-gpus-per-engine",
        type=int,
        default=1,
        help="GPUs per launched SGLang engine (its --tp-size); engine i uses GPUs i*N .. i*N+N-1 (default: 1)",
    )
    g.add_argument(
        "--use-fault-tolerance",
        action="store_true",
        help="watch server engines with /health_generate; a dead or hung engine leaves rotation, its requests "
        "go to the others, a launched one is restarted and re-joins at the next weight sync (default: off)",
    )
    g.add_argument(
        "--rollout-health-check-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds between health checks of an engine (with --use-fault-tolerance; default: 10)",
    )
    g.add_argument(
        "--rollout-health-check-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds an engine has to answer /health_generate (with --use-fault-tolerance; default: 5)",
    )
    g.add_argument(
        "--rollout-health-check-first-wait",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds before the first health check, for engines that compile on first use (with "
        "--use-fault-tolerance; default: 300)",
    )
    g.add_argument(
        "--rollout-max-failed-restarts",
        type=int,
        default=None,
        metavar="N",
        help="restarts of a launched engine that may fail in a row before it is retired and the run continues "
        "on the others (with --use-fault-tolerance; default: 3)",
    )
    g.add_argument(
        "--min-healthy-engines",
        type=int,
        default=None,
        metavar="N",
        help="the run stops (one line) when fewer engines than N are left that are not retired (with "
        "--use-fault-tolerance; default: 1)",
    )
    g.add_argument(
        "--rollout-max-batch-size",
        type=int,
        default=None,
        help="most sequences the in-process engine decodes at once (default: all of a rollout step)",
    )


def collect_sglang_passthrough(extras: list[str], known_flags: list[str]) -> list[str]:
    """Keep `--sglang-*` arguments (and the values after them) that argparse did not know; anything else is an
    unrecognized argument, reported with the closest known flag."""
    passthrough: list[str] = []
    in_sglang = False
    for token in extras:
        if token == "--":
            raise ConfigError("unrecognized argument '--': lichen train takes no positional arguments")
        if token.startswith("-") and not _is_number(token):
            in_sglang = token.startswith(PASSTHROUGH_PREFIXES)
            if not in_sglang:
                name = token.split("=", 1)[0]
                close = difflib.get_close_matches(name, known_flags, n=1)
                hint = f"; did you mean {close[0]}?" if close else "; see lichen train --help"
                raise ConfigError(f"unrecognized argument {name}{hint}")
            passthrough.append(token)
        elif in_sglang:
            passthrough.append(token)
        else:
            raise ConfigError(f"unrecognized argument {token!r}: lichen train takes no positional arguments")
    return passthrough


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def check(args: argparse.Namespace) -> None:
    sglang_config.check(args)  # may set --rollout-num-engines from the file's policy model
    _check_server_engines(args)
    for dest, flag in (("sglang_router_ip", "--sglang-router-ip"), ("sglang_router_port", "--sglang-router-port")):
        if getattr(args, dest) is not None:
            raise NotAvailableYet(f"{flag} is not available yet: {_ROUTER_LATER}")
    _check_sglang_launch(args)
    vllm_config.check(args)
    _check_fault_tolerance(args)
    if args.rollout_batch_size is None:
        raise ConfigError("--rollout-batch-size is required: the number of prompts per rollout step")
    check_int_at_least(args, "rollout_batch_size", 1)
    check_int_at_least(args, "n_samples_per_prompt", 1)
    check_int_at_least(args, "rollout_max_response_len", 1)
    check_float(args, "rollout_temperature", low=0.0, low_open=True)
    check_float(args, "rollout_top_p", low=0.0, high=1.0, low_open=True)
    if args.rollout_top_k != -1 and args.rollout_top_k < 1:
        raise ConfigError(f"--rollout-top-k {args.rollout_top_k}: must be -1 (no top-k) or >= 1")
    vocab = model_config_value(args.hf_checkpoint, "vocab_size") if args.hf_checkpoint else None
    for token_id in args.rollout_stop_token_ids or []:
        if token_id < 0 or (vocab is not None and token_id >= vocab):
            where = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise ConfigError(
                f"--rollout-stop-token-ids: {token_id} is not a token id of the model (must be in "
                f"{where}); the model could never generate it, so it would never stop a response"
            )
    check_int_at_least(args, "sglang_server_concurrency", 1)
    check_int_at_least(args, "rollout_max_batch_size", 1)
    if args.rollout_external_engine_addrs is not None and args.rollout_max_batch_size is not None:
        raise ConfigError(
            "--rollout-max-batch-size sets the batch of the in-process engine and of launched servers; external "
            "servers keep their own (lichen serve --max-batch-size, SGLang --max-running-requests): drop it"
        )
    _resolve_slime_paths(args)
    if args.rm_type is not None and args.custom_rm_path is not None:
        raise ConfigError("--rm-type and --custom-rm-path exclude each other: give exactly one reward")
    replay = args.debug_train_only or args.load_forge_rollout_data is not None  # dumped samples carry rewards
    if args.rm_type is None and args.custom_rm_path is None and not replay and not is_sft(args):
        raise ConfigError(
            "a reward is required: give --rm-type (a built-in rule such as math) or --custom-rm-path module.function"
        )
    for dest in ("custom_rm_path", "rollout_function_path", "eval_function_path", "custom_generate_function_path"):
        check_dotted_path(args, dest)
    if args.custom_generate_function_path is not None:
        import inspect

        from lichen.plugins import load_function

        if not inspect.iscoroutinefunction(
            load_function(args.custom_generate_function_path, "--custom-generate-function-path")
        ):
            raise ConfigError(
                f"--custom-generate-function-path {args.custom_generate_function_path!r}: must be an async function "
                "`async def fn(args, sample, sampling_params) -> Sample | list[Sample]`"
            )


_ADDR = re.compile(r"^(https?://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})/?$")


def _check_server_engines(args: argparse.Namespace) -> None:
    """--rollout-num-engines / --rollout-external-engine-addrs / their key files."""
    num, addrs = args.rollout_num_engines, args.rollout_external_engine_addrs
    if num is not None and addrs is not None:
        raise ConfigError(
            "--rollout-num-engines and --rollout-external-engine-addrs exclude each other: launch servers or use "
            "running ones, not both"
        )
    check_int_at_least(args, "rollout_num_engines", 1)
    for addr in addrs or []:
        m = _ADDR.match(addr)
        if m is None or not 0 < int(m.group(3)) < 65536:
            raise ConfigError(
                f"--rollout-external-engine-addrs {addr!r}: expected HOST:PORT (e.g. 127.0.0.1:30000 or "
                "http://host:30000)"
            )
    if addrs is not None and len(set(addrs)) != len(addrs):
        raise ConfigError("--rollout-external-engine-addrs: an address is given twice; list each server once")
    if addrs is not None and not addrs:
        raise ConfigError("--rollout-external-engine-addrs needs at least one HOST:PORT")
    for dest in ("rollout_external_engine_api_key_file", "rollout_external_engine_admin_api_key_file"):
        if getattr(args, dest, None) is not None and addrs is None:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(
                f"{flag} is only used with --rollout-external-engine-addrs (launched servers get a fresh random "
                "key per run); add the addresses or drop the key file"
            )


def _check_sglang_launch(args: argparse.Namespace) -> None:
    """--rollout-engine-backend / --rollout-num-gpus-per-engine / the --sglang-* pass-through."""
    from lichen.engines.clients.sglang_launcher import check_passthrough

    backend = getattr(args, "rollout_engine_backend", "lichen")
    check_int_at_least(args, "rollout_num_gpus_per_engine", 1)
    if backend == "sglang" and not args.rollout_num_engines:
        raise ConfigError(
            "--rollout-engine-backend sglang chooses the server --rollout-num-engines launches; add "
            "--rollout-num-engines K (running SGLang servers are used with --rollout-external-engine-addrs)"
        )
    if backend == "lichen" and args.rollout_num_gpus_per_engine != 1:
        raise NotAvailableYet(
            f"--rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine} is not available yet with lichen "
            "serve engines (one device each); use --rollout-engine-backend sglang for tensor-parallel engines"
        )
    sglang_tokens = [t for t in args.sglang_passthrough if t.startswith(SGLANG_PREFIX)]
    if sglang_tokens and backend != "vllm":  # vllm: lichen.config.vllm_config names the mix-up
        if backend != "sglang" or not args.rollout_num_engines:
            # kept a NotAvailableYet (exit 2) as before SGLang launches existed; the text says what to do now
            raise NotAvailableYet(
                f"{sglang_tokens[0]}: --sglang-... flags apply to SGLang servers that lichen launches, "
                "which this run does not configure: add --rollout-engine-backend sglang --rollout-num-engines K, "
                "or drop them"
            )
        check_passthrough(sglang_tokens, args.rollout_max_batch_size)


def _check_fault_tolerance(args: argparse.Namespace) -> None:
    """--use-fault-tolerance and the --rollout-health-check-* flags (resolved to their defaults here)."""
    # slime's defaults (lichen.engines.clients.health has the same): first check after 300 s, then every 10 s, 5 s to answer
    health = (
        ("rollout_health_check_interval", 10.0, True),
        ("rollout_health_check_timeout", 5.0, True),
        ("rollout_health_check_first_wait", 300.0, False),
    )
    pool = (("rollout_max_failed_restarts", 3), ("min_healthy_engines", 1))
    if not getattr(args, "use_fault_tolerance", False):
        for dest in [d for d, _, _ in health] + [d for d, _ in pool]:
            if getattr(args, dest, None) is not None:
                flag = "--" + dest.replace("_", "-")
                raise ConfigError(f"{flag} only applies with --use-fault-tolerance; add it or drop {flag}")
        return
    if not (args.rollout_num_engines or args.rollout_external_engine_addrs):
        raise ConfigError(
            "--use-fault-tolerance watches and restarts engine servers; use it with --rollout-num-engines K or "
            "--rollout-external-engine-addrs (the in-process engine fails with the run)"
        )
    for dest, default, positive in health:
        if getattr(args, dest) is None:
            setattr(args, dest, default)
        check_float(args, dest, low=0.0, low_open=positive)
    for dest, count in pool:
        if getattr(args, dest) is None:
            setattr(args, dest, count)
        if getattr(args, dest) < 1:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"{flag} must be >= 1, got {getattr(args, dest)}")
    engines = args.rollout_num_engines or len(args.rollout_external_engine_addrs or ())
    if args.min_healthy_engines > engines:
        raise ConfigError(
            f"--min-healthy-engines {args.min_healthy_engines} is more than the run's {engines} engine(s); "
            "lower it or configure more engines"
        )


SFT_ROLLOUT = "lichen.rollout.sft.generate_rollout"


def is_sft(args: argparse.Namespace) -> bool:
    """Supervised training: the SFT rollout (its responses come from the data, nothing is scored) or the SFT loss
    (rewards are not used), so no reward is needed."""
    return args.rollout_function_path == SFT_ROLLOUT or getattr(args, "loss_type", None) == "sft_loss"


def _resolve_slime_paths(args: argparse.Namespace) -> None:
    """slime's own dotted paths (lichen.plugins.SLIME_ALIASES) become lichen's; one that names what lichen does
    without a plug-in (its reward hub's entry points, its default generate) is dropped."""
    from lichen.plugins import resolve_path, slime_alias

    for dest in ("custom_rm_path", "rollout_function_path", "eval_function_path", "custom_generate_function_path"):
        value = getattr(args, dest)
        alias = slime_alias(value) if value is not None else None
        if alias is not None and alias.target is None:
            setattr(args, dest, None)
            if dest == "custom_rm_path":
                args.group_rm = False  # batched_async_rm scores each sample of the group with the hub
        elif value is not None:
            setattr(args, dest, resolve_path(value))
