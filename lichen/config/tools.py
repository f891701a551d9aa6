"""Tool-use flags: the built-in multi-turn tool rollout (lichen/rollout/tool_rollout.py, docs/agentic.md)."""

from __future__ import annotations

import argparse
import math

from lichen.errors import ConfigError

TOOL_ROLLOUT = "lichen.rollout.tool_rollout.generate"
AGENT_ROLLOUT = "lichen.rollout.agent_rollout.generate"


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tool use")
    g.add_argument(
        "--tool-paths",
        nargs="+",
        metavar="MODULE.FUNCTION",
        default=None,
        help="the tools the policy may call, as Python callables (plain or async; their JSON schema is the "
        "callable's `schema` attribute or is read from its signature and docstring); selects the built-in "
        f"multi-turn tool rollout {TOOL_ROLLOUT} unless --custom-generate-function-path names another "
        "(default: none)",
    )
    g.add_argument(
        "--agent-function-path",
        metavar="MODULE.FUNCTION",
        default=None,
        help="an external agent as the generate function: `async def fn(base_url, sample, api_key)` drives the "
        "policy through an OpenAI-compatible base URL of its own (the agent proxy; pass api_key to the client, "
        f"requests without it are refused) and each of its sessions becomes training samples; selects "
        f"{AGENT_ROLLOUT} (default: none)",
    )
    g.add_argument(
        "--max-turns", type=int, default=8, help="most assistant turns per trajectory in the tool rollout (default 8)"
    )
    g.add_argument(
        "--tool-timeout",
        type=float,
        default=30.0,
        help="seconds one tool call may take; past it the policy gets 'error: timed out' (default 30)",
    )
    g.add_argument(
        "--tool-call-parser",
        metavar="NAME|PATH",
        default="hermes",
        help="how the tool rollout reads calls from the policy's text: hermes (= qwen, qwen25, qwen3: "
        "<tool_call>{json}</tool_call>) or a dotted path to a parser factory (default hermes)",
    )
    g.add_argument(
        "--check-token-fidelity",
        action="store_true",
        help="compare each turn of a tool-rollout trajectory (and each sample of an --agent-function-path session) "
        "with apply_chat_template of its conversation; the first mismatching token goes to the sample's "
        "metadata['token_fidelity'] and the log (default: off)",
    )


def check(args: argparse.Namespace) -> None:
    if args.max_turns < 1:
        raise ConfigError(f"--max-turns must be at least 1, got {args.max_turns}")
    if not (math.isfinite(args.tool_timeout) and args.tool_timeout > 0):
        raise ConfigError(f"--tool-timeout must be a positive number of seconds, got {args.tool_timeout:g}")
    from lichen.engines.api.tool_parsers import load_parser
    from lichen.plugins import load_function

    parser = load_parser(args.tool_call_parser, "--tool-call-parser")
    if parser is None and (args.tool_paths or args.agent_function_path):
        raise ConfigError(
            "--tool-call-parser none: the tool rollout and the agent proxy read tool calls; give "
            "hermes or a parser's dotted path"
        )
    if args.agent_function_path is not None:
        _check_agent(args)
    if not args.tool_paths:
        return
    for path in args.tool_paths:
        load_function(path, "--tool-paths")
    if not args.apply_chat_template:
        raise ConfigError(
            "--tool-paths: tools are shown to the policy by the chat template; pass --apply-chat-template"
        )
    if args.custom_generate_function_path is None:
        args.custom_generate_function_path = TOOL_ROLLOUT


def _check_agent(args: argparse.Namespace) -> None:
    import inspect

    from lichen.plugins import load_function

    if args.tool_paths:
        raise ConfigError(
            "--agent-function-path and --tool-paths exclude each other: an external agent runs its "
            "own tools; give one of them"
        )
    fn = load_function(args.agent_function_path, "--agent-function-path")
    shape = "`async def fn(base_url: str, sample, api_key: str) -> None`"
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"--agent-function-path {args.agent_function_path!r}: must be an async function {shape}")
    try:  # called as fn(base_url, sample, api_key=KEY): the proxy refuses requests without its key
        inspect.signature(fn).bind("", None, api_key="")
    except TypeError:
        raise ConfigError(
            f"--agent-function-path {args.agent_function_path!r}: must take the agent proxy's key, {shape}, and "
            "pass it to the client: openai.AsyncOpenAI(base_url=base_url, api_key=api_key) (the proxy refuses "
            "requests without it)"
        ) from None
    if not args.apply_chat_template:
        raise ConfigError(
            "--agent-function-path: the agent's messages are rendered by the chat template; pass --apply-chat-template"
        )
    if args.custom_generate_function_path is None:
        args.custom_generate_function_path = AGENT_ROLLOUT
