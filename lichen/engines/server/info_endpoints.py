"""What `lichen serve` tells about itself: /model_info, /get_server_info, /v1/loads, /get_load, /ready and /metrics
(SGLang's shapes, docs/serve-protocol.md; /ready and /metrics in docs/serving.md#health-readiness-and-metrics).

These only read the server's state (the scheduler publishes its counts after each pass), so they answer on the
event loop at once, also while requests are parsed or generated.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from functools import partial
from typing import TYPE_CHECKING

from aiohttp import web

from lichen import __version__
from lichen.engines.api.protocol import RequestError, error_body
from lichen.observe.phases import read_peaks, reset_peaks

if TYPE_CHECKING:
    from lichen.engines.server.http_server import LichenServer

LOAD_SECTIONS = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.json_response(obj, status=status)


def _ready_state(server: LichenServer) -> tuple[bool, str]:
    sch = server.scheduler
    if not sch.alive():
        return False, "the scheduler is not running (starting or shutting down)"
    if sch.released:
        return False, f"memory released ({', '.join(sorted(sch.released))}): /resume_memory_occupation first"
    return True, "paused: requests wait for /continue_generation" if server.paused else "ready"


async def ready(server: LichenServer, request: web.Request) -> web.Response:
    """200 when a generation request would be served (a paused server takes requests and holds them), 503 while
    the scheduler is not running or memory is released; the body says which."""
    ok, why = _ready_state(server)
    return json_response({"ready": ok, "status": why, "paused": server.paused}, 200 if ok else 503)


def _label(value: str) -> str:
    """A Prometheus label value (text format 0.0.4): backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(samples: list[tuple[str, str, str, list[tuple[dict, float]]]]) -> str:
    """Prometheus text exposition format 0.0.4 of (name, type, help, [(labels, value)])."""
    out = []
    for name, kind, help_text, values in samples:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for labels, value in values:
            lab = ",".join(f'{k}="{_label(str(v))}"' for k, v in sorted(labels.items()))
            out.append(f"{name}{{{lab}}} {float(value)!r}" if lab else f"{name} {float(value)!r}")
    return "\n".join(out) + "\n"


async def metrics(server: LichenServer, request: web.Request) -> web.Response:
    """The server's state as Prometheus metrics; SGLang's names (sglang:...) where they mean the same."""
    sch = server.scheduler
    total = server.kv_capacity()
    used = sch.cache_tokens
    base = {"model_name": server.served_model_name}
    text = prometheus_text(
        [
            ("sglang:num_running_reqs", "gauge", "Sequences decoding now.", [(base, sch.num_running)]),
            ("sglang:num_queue_reqs", "gauge", "Sequences waiting for a decoding slot.", [(base, sch.num_waiting)]),
            ("sglang:num_used_tokens", "gauge", "Tokens held in the KV cache.", [(base, used)]),
            (
                "sglang:token_usage",
                "gauge",
                "Fraction of the KV cache in use.",
                [(base, used / total if total else 0.0)],
            ),
            (
                "sglang:gen_throughput",
                "gauge",
                "Generated tokens per second (last second).",
                [(base, _throughput(server))],
            ),
            (
                "sglang:generation_tokens_total",
                "counter",
                "Tokens generated since start.",
                [(base, sch.generated_tokens)],
            ),
            (
                "lichen:queued_sequences",
                "gauge",
                "Sequences accepted and not yet answered.",
                [(base, len(server.jobs))],
            ),
            (
                "lichen:queued_tokens",
                "gauge",
                "Prompt + max_new_tokens of the queued sequences.",
                [(base, server.queued_tokens)],
            ),
            ("lichen:paused", "gauge", "1 while generation is paused.", [(base, int(server.paused))]),
            ("lichen:ready", "gauge", "1 when /ready answers 200.", [(base, int(_ready_state(server)[0]))]),
            (
                "lichen:requests_refused_total",
                "counter",
                "Requests answered with an error, by HTTP status.",
                [({**base, "status": st}, k) for st, k in sorted(server.refused.items())],
            ),
            (
                "lichen:weight_version_info",
                "gauge",
                "The weight version served (label).",
                [({**base, "version": server.engine.weight_version}, 1)],
            ),
            (
                "lichen:start_time_seconds",
                "gauge",
                "When the server started (seconds since the epoch).",
                [(base, server.started)],
            ),
        ]
    )
    # the exposition format's media type, which Prometheus negotiates for
    return web.Response(body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def add_routes(app: web.Application, server: LichenServer) -> None:
    r = app.router
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, partial(model_info, server))
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, partial(server_info, server))
    for path in ("/get_weight_version", "/weight_version"):
        r.add_get(path, partial(weight_version_gone, server))
    r.add_get("/v1/loads", partial(loads, server))
    r.add_get("/get_load", partial(get_load, server))
    r.add_get("/ready", partial(ready, server))
    r.add_get("/metrics", partial(metrics, server))
    r.add_post("/reset_peak_memory", partial(reset_peak_memory, server))


async def model_info(server: LichenServer, request: web.Request) -> web.Response:
    cfg = server.engine.model.cfg
    return json_response(
        {
            "model_path": server.model_path,
            "tokenizer_path": server.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": server.engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": cfg.model_type,
            "architectures": server.architectures,
            "served_model_name": server.served_model_name,
            "load_format": "auto",
        }
    )


async def server_info(server: LichenServer, request: web.Request) -> web.Response:
    eng, sch = server.engine, server.scheduler
    ctx = server.facts.context_length
    return json_response(
        {
            "model_path": server.model_path,
            "tokenizer_path": server.tokenizer_path,
            "served_model_name": server.served_model_name,
            "host": server.host,
            "port": server.port,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "ep_size": 1,
            "disaggregation_mode": "null",
            # releasing memory frees device memory only off the CPU (Engine.offload does nothing on CPU)
            "enable_memory_saver": eng.device.type != "cpu",
            "skip_tokenizer_init": False,
            "weight_version": eng.weight_version,
            "dtype": str(eng.dtype).replace("torch.", ""),
            "device": str(eng.device),
            "max_running_requests": sch.max_running,
            "max_total_num_tokens": server.kv_capacity(),
            "max_req_input_len": ctx - 1,
            "context_length": ctx,
            "startup_time": server.started,
            "api_key_required": server.api_key is not None,
            "max_sequences_per_request": server.limits.max_request_sequences,
            "max_queued_sequences": server.limits.max_queued_sequences,
            "max_queued_tokens": server.limits.max_queued_tokens,
            "internal_states": [
                {
                    "paused": server.paused,
                    "released_memory": sorted(sch.released),
                    "num_running_reqs": sch.num_running,
                    "num_waiting_reqs": sch.num_waiting,
                }
            ],
            "version": f"lichen-{__version__}",
            "kv_events": None,
            # lichen's own: this process' peak memory since the last /reset_peak_memory (or its start), read by the
            # trainer as memory/engine{i}/<phase>_* (docs/observability.md#memory-per-phase)
            "memory": read_peaks(server.peaks_reset),
        }
    )


async def reset_peak_memory(server: LichenServer, request: web.Request) -> web.Response:
    """lichen's own: reset this process' peak memory counters (the trainer does at each of its phases' start)."""
    server.peaks_reset = reset_peaks()
    return json_response({"success": True})


async def weight_version_gone(server: LichenServer, request: web.Request) -> web.Response:
    msg = "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use '/model_info' instead."
    return json_response(error_body(msg, 404, "object"), 404)


def _throughput(server: LichenServer) -> float:
    now, tokens = time.monotonic(), server.scheduler.generated_tokens
    then, before, rate = server._rate
    if now - then >= 1.0:
        rate = (tokens - before) / (now - then)
        server._rate = (now, tokens, rate)
    return rate


async def loads(server: LichenServer, request: web.Request) -> web.Response:
    include = set(request.query.get("include", "all").split(","))
    if not include <= LOAD_SECTIONS:
        raise RequestError(
            f"include: unknown section(s) {sorted(include - LOAD_SECTIONS)}; choose from {sorted(LOAD_SECTIONS)}",
            shape="object",
        )
    if request.query.get("format", "json") != "json":
        raise RequestError("format: lichen serve answers json only", shape="object")
    sch = server.scheduler
    used = sch.cache_tokens
    total = server.kv_capacity()
    now = datetime.now(timezone.utc).isoformat()
    load = {
        "timestamp": now,
        "dp_rank": 0,
        "num_running_reqs": sch.num_running,
        "num_waiting_reqs": sch.num_waiting,
        "num_waiting_uncached_tokens": sch.waiting_tokens,
        "num_used_tokens": used,
        "num_total_tokens": total,
        "num_active_tokens": used,
        "max_total_num_tokens": total,
        "max_running_requests": sch.max_running,
        "token_usage": used / total if total else 0.0,
        "gen_throughput": _throughput(server),
        "cache_hit_rate": 0.0,
        "utilization": sch.num_running / sch.max_running,
        "total_prefill_uncached_tokens": 0,
        "total_prefill_busy_us": 0,
        "decode_moments": None,
    }
    dev = server.engine.device
    return json_response(
        {
            "timestamp": now,
            "version": f"lichen-{__version__}",
            "accelerator": None if dev.type == "cpu" else str(dev),
            "num_accelerators": 0 if dev.type == "cpu" else 1,
            "loads": [load],
        }
    )


async def get_load(server: LichenServer, request: web.Request) -> web.Response:
    sch = server.scheduler
    return json_response(
        [
            {
                "dp_rank": 0,
                "num_reqs": sch.num_running + sch.num_waiting,
                "num_waiting_reqs": sch.num_waiting,
                "num_tokens": sch.cache_tokens,
                "num_pending_tokens": 0,
                "ts_tic": time.time(),
            }
        ]
    )
