"""`lichen serve --model PATH`: an HTTP server that speaks SGLang's native protocol around lichen's engine.

    lichen serve --model DIR [--host 127.0.0.1] [--port 30000] [--api-key-file FILE] [--device auto]
                 [--dtype float32] [--max-batch-size 256] [--weight-version default]
                 [--weight-dir DIR ...] [--local-checkpoint-dir DIR]

It binds 127.0.0.1 unless told otherwise; any other address requires a key (clients send
`Authorization: Bearer KEY` or `x-api-key: KEY`; health endpoints stay open). Keys come from a key file
(chmod 600) or $LICHEN_API_KEY / $LICHEN_ADMIN_API_KEY, so they are not visible in `ps`; --api-key KEY works too
(SGLang's flag) but every local user can read it. Weight requests may only read the --model directory, the
--weight-dir directories and the --local-checkpoint-dir, and /pull_weights only writes the latter (403 for any
other path). Work is bounded: --max-sequences-per-request, --max-queued-sequences, --max-queued-tokens (503 when
the queue is full), --max-request-bytes (413), and --header-timeout / --body-timeout for slow clients.
When it is ready it prints one line `lichen serve: ready at http://HOST:PORT ...` (with the real port when
--port 0 picks a free one). SIGTERM / SIGINT abort what is running (callers get their partial output) and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import signal
import sys

from lichen.config.model_code import add_model_code_args, model_options
from lichen.devices import resolve_device
from lichen.engines.api.auth import SERVE_ADMIN_KEY_ENV, SERVE_KEY_ENV

# the work bounds' defaults (lichen.engines.server.limits enforces them) live in a leaf module: limits.py reads them there
from lichen.engines.api.limit_defaults import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_QUEUED_SEQUENCES,
    DEFAULT_MAX_QUEUED_TOKENS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_REQUEST_SEQUENCES,
)
from lichen.engines.api.tool_parsers import load_parser
from lichen.errors import ConfigError
from lichen.key_files import resolve_key
from lichen.models.hf_support import check_model_flags

DTYPES = ("float32", "bfloat16", "float16")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lichen serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        "--model-path",
        dest="model",
        required=True,
        help="Hugging Face checkpoint directory (llama, qwen2, qwen3) with its tokenizer",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need --api-key)")
    p.add_argument("--port", type=int, default=30000, help="port to bind; 0 picks a free one (default 30000)")
    p.add_argument(
        "--api-key",
        default=None,
        help="key clients must send (Authorization: Bearer KEY or x-api-key); visible to every local user "
        "in `ps`: prefer --api-key-file or $LICHEN_API_KEY",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="read the API key from FILE (one line; must not be readable by group or others)",
    )
    p.add_argument(
        "--admin-api-key",
        default=None,
        help="key for control endpoints (abort, pause, weights, memory); then the API key is not accepted "
        "there; prefer --admin-api-key-file or $LICHEN_ADMIN_API_KEY",
    )
    p.add_argument("--admin-api-key-file", default=None, metavar="FILE", help="read the admin key from FILE")
    p.add_argument(
        "--weight-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory weight requests may read from (/pull_weights source_dir, "
        "/update_weights_from_disk model_path: DIR or below it); repeat for several (default: only "
        "--model)",
    )
    p.add_argument(
        "--local-checkpoint-dir",
        default=None,
        metavar="DIR",
        help="the only directory /pull_weights may write its local copy to (default: none; pulls are refused)",
    )
    for flag, default, what in (
        (
            "--max-sequences-per-request",
            DEFAULT_MAX_REQUEST_SEQUENCES,
            "most sequences (prompts x n) one request may ask for; more is a 400",
        ),
        (
            "--max-queued-sequences",
            DEFAULT_MAX_QUEUED_SEQUENCES,
            "most sequences accepted and not yet answered; a request past it gets 503 with Retry-After",
        ),
        (
            "--max-queued-tokens",
            DEFAULT_MAX_QUEUED_TOKENS,
            "most prompt + max_new_tokens tokens accepted and not yet answered; past it 503",
        ),
    ):
        p.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    p.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT,
        help="seconds a connection has to send a request's headers before it is closed "
        f"(default {DEFAULT_HEADER_TIMEOUT:g})",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body in bytes; a larger one is answered 413 before it is read "
        f"(default {DEFAULT_MAX_REQUEST_BYTES}: 16 MiB)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT,
        help="seconds a request's body may take to arrive after its headers; then 408 and the connection is "
        f"closed (default {DEFAULT_BODY_TIMEOUT:g})",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, ... or auto (cuda when available)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and compute dtype (default float32)")
    p.add_argument(
        "--max-batch-size",
        "--max-running-requests",
        dest="max_batch_size",
        type=int,
        default=256,
        help="most sequences decoding at once; more wait in a queue (default 256)",
    )
    p.add_argument("--weight-version", default="default", help="weight_version reported until an update sets one")
    p.add_argument("--served-model-name", default=None, help="model name in /v1/models (default: the --model path)")
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="longest prompt + output in tokens (default: the config's max_position_embeddings)",
    )
    p.add_argument(
        "--health-check-timeout",
        type=float,
        default=None,
        help="seconds /health_generate waits for a generation before answering 503 "
        "(default: $SGLANG_HEALTH_CHECK_TIMEOUT or 20)",
    )
    p.add_argument(
        "--tool-call-parser",
        default="hermes",
        metavar="NAME|PATH",
        help="how tool calls are read from chat output: hermes (= qwen, qwen25, qwen3: "
        "<tool_call>{json}</tool_call>), none (requests with tools are refused), or a dotted path to "
        "a parser factory (docs/agentic.md; default hermes)",
    )
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add_model_code_args(p)
    return p


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_keys(args: argparse.Namespace) -> None:
    """Fill args.api_key / args.admin_api_key from the flag, the key file or the environment (then removed from
    it, so nothing this server starts inherits it)."""
    args.api_key = resolve_key(
        flag_value=args.api_key,
        file_path=args.api_key_file,
        env=SERVE_KEY_ENV,
        flag="--api-key",
        file_flag="--api-key-file",
        pop_env=True,
    )
    args.admin_api_key = resolve_key(
        flag_value=args.admin_api_key,
        file_path=args.admin_api_key_file,
        env=SERVE_ADMIN_KEY_ENV,
        flag="--admin-api-key",
        file_flag="--admin-api-key-file",
        pop_env=True,
    )


def check_args(args: argparse.Namespace) -> None:
    resolve_keys(args)
    if not is_loopback(args.host) and not args.api_key:
        raise ConfigError(
            f"--host {args.host} exposes the server beyond this machine; give a key with "
            f"--api-key-file FILE or ${SERVE_KEY_ENV} (clients then send 'Authorization: Bearer KEY') "
            "or bind --host 127.0.0.1"
        )
    for flag, value, low in (
        ("--max-sequences-per-request", args.max_sequences_per_request, 1),
        ("--max-queued-sequences", args.max_queued_sequences, 1),
        ("--max-queued-tokens", args.max_queued_tokens, 1),
        ("--max-request-bytes", args.max_request_bytes, 1024),
    ):
        if value < low:
            raise ConfigError(f"{flag} must be at least {low}, got {value}")
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not 0 < value < float("inf"):
            raise ConfigError(f"{flag} must be a positive number of seconds, got {value}")
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_batch_size < 1:
        raise ConfigError(f"--max-batch-size must be at least 1, got {args.max_batch_size}")
    if args.context_length is not None and args.context_length < 2:
        raise ConfigError(f"--context-length must be at least 2, got {args.context_length}")
    if not os.path.isdir(args.model):
        raise ConfigError(
            f"--model {args.model!r}: no such directory; pass a Hugging Face checkpoint directory "
            "(`lichen make-tiny-model DIR` writes a small one)"
        )
    check_model_limits(args)
    check_model_flags(args, args.model, "--model")
    args.tool_parser = load_parser(args.tool_call_parser)


def check_model_limits(args: argparse.Namespace) -> None:
    """--context-length within the model's positions (beyond them the model was never trained and RoPE tables
    end), and a health-check timeout (flag or $SGLANG_HEALTH_CHECK_TIMEOUT) that is a positive number."""
    import math

    from lichen.models.config import model_positions

    positions = model_positions(args.model)
    if args.context_length is not None and args.context_length > positions:
        raise ConfigError(
            f"--context-length {args.context_length} is above the {positions} positions of the model "
            f"({args.model}/config.json max_position_embeddings); use at most {positions}"
        )
    timeout, source = args.health_check_timeout, "--health-check-timeout"
    if timeout is None and os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT") is not None:
        source = "$SGLANG_HEALTH_CHECK_TIMEOUT"
        try:
            timeout = float(os.environ["SGLANG_HEALTH_CHECK_TIMEOUT"])
        except ValueError:
            timeout = float("nan")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        shown = os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT") if source[0] == "$" else timeout
        raise ConfigError(f"{source} {shown}: must be a positive number of seconds")


def load_server(args: argparse.Namespace):
    """Load tokenizer, model and engine; return the (not yet started) LichenServer."""
    import torch

    from lichen.engines.core.engine import Engine
    from lichen.engines.server.http_server import LichenServer
    from lichen.engines.server.limits import Limits
    from lichen.engines.server.weight_paths import WeightDirs
    from lichen.models import load_model
    from lichen.models.tokenizer import eos_token_ids, load_tokenizer

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = resolve_device(args.device)
    tok = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    model = load_model(args.model, device=device, dtype=getattr(torch, args.dtype), **model_options(args))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    engine = Engine(
        model,
        eos_token_ids=eos_token_ids(tok, args.model),
        pad_token_id=pad,
        max_batch_size=args.max_batch_size,
        weight_version=args.weight_version,
    )
    with open(os.path.join(args.model, "config.json")) as f:
        architectures = json.load(f).get("architectures") or []
    timeout = args.health_check_timeout
    if timeout is None:
        timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
    limits = Limits(
        args.max_sequences_per_request,
        args.max_queued_sequences,
        args.max_queued_tokens,
        args.header_timeout,
        args.max_request_bytes,
        args.body_timeout,
    )
    dirs = WeightDirs(args.model, args.weight_dir, args.local_checkpoint_dir)
    return LichenServer(
        engine,
        tok,
        model_path=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        max_running=args.max_batch_size,
        context_length=args.context_length,
        health_timeout=timeout,
        architectures=architectures,
        limits=limits,
        weight_dirs=dirs,
        tool_parser=args.tool_parser,
    )


async def serve(server, host: str, port: int) -> None:
    from aiohttp import web

    from lichen.engines.server.limits import BoundedAppRunner

    await server.start()
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its generation
    runner = BoundedAppRunner(
        server.app(),
        header_timeout=server.limits.header_timeout,
        access_log=None,
        handle_signals=False,
        shutdown_timeout=5.0,
        handler_cancellation=True,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        await server.stop()
        await runner.cleanup()
        raise ConfigError(f"cannot bind {host}:{port} ({e.strerror or e}); pick another --port") from None
    bound = site._server.sockets[0].getsockname()[1] if port == 0 else port
    server.port = bound
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    shown = f"[{host}]" if ":" in host else host
    print(
        f"lichen serve: ready at http://{shown}:{bound} (model {server.model_path}, device {server.engine.device}, "
        f"dtype {str(server.engine.dtype).replace('torch.', '')})",
        flush=True,
    )
    await stop.wait()
    print("lichen serve: shutting down", file=sys.stderr, flush=True)
    await server.stop()  # aborts what runs: callers get their partial output before the sockets close
    await runner.cleanup()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    server = load_server(args)
    asyncio.run(serve(server, args.host, args.port))
    return 0
