"""The typed config of the multi-turn tool rollout (flags in lichen/config/tools.py, docs/agentic.md)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolConfig:
    """What the tool rollout reads."""

    tool_paths: tuple[str, ...]
    max_turns: int
    timeout: float
    parser: str
    check_fidelity: bool
    agent_path: str | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ToolConfig":
        return cls(
            tool_paths=tuple(args.tool_paths or ()),
            max_turns=args.max_turns,
            timeout=args.tool_timeout,
            parser=args.tool_call_parser,
            check_fidelity=bool(args.check_token_fidelity),
            agent_path=args.agent_function_path,
        )
