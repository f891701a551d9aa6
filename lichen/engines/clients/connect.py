"""The engine servers of a run, ready to use: launched (lichen serve or SGLang), started elsewhere (the Ray runtime's
engine actors) or external, answered, checked for the endpoints the run needs, and watched with
--use-fault-tolerance. `RemoteEngines.from_config` is the entry point."""

from __future__ import annotations

from typing import Any

from lichen.config.engine_config import EngineConfig
from lichen.engines.api.auth import ENGINE_KEY_ENV
from lichen.engines.clients.client import EngineClient, EngineRequestError, EngineUnavailable, normalize_url
from lichen.engines.clients.launch_args import external_keys, launch_server_args
from lichen.engines.clients.remote_engines import RemoteEngines
from lichen.errors import ConfigError
from lichen.observe.metrics import get_logger

log = get_logger(__name__)


def client_class(backend: str) -> type[EngineClient]:
    """The client of a --rollout-engine-backend: vLLM's own protocol, else SGLang's (lichen serve, SGLang)."""
    if backend == "vllm":
        from lichen.engines.clients.vllm_client import VLLMClient

        return VLLMClient
    return EngineClient


def connect(cfg: EngineConfig, launcher: Any = None) -> RemoteEngines:
    """See RemoteEngines.from_config."""

    from lichen.engines.clients.launcher import EngineLauncher

    if launcher is not None:
        urls, api_key, admin_key, flag = launcher.start(), None, None, "--rollout-num-gpus"
    elif cfg.num_engines:
        if cfg.backend == "sglang":
            from lichen.engines.clients.sglang_launcher import SGLangLauncher

            launcher = SGLangLauncher.from_config(cfg)
        elif cfg.backend == "vllm":
            from lichen.engines.clients.vllm_launcher import VLLMLauncher

            launcher = VLLMLauncher.from_config(cfg)
        else:
            launcher = EngineLauncher(
                cfg.model_path, cfg.num_engines, server_args=launch_server_args(cfg), log_dir=cfg.log_dir
            )
        urls, api_key, admin_key, flag = launcher.start(), None, None, "--rollout-num-engines"
    else:
        urls = [normalize_url(a) for a in cfg.addresses]
        api_key, admin_key = external_keys(cfg)
        flag = "--rollout-external-engine-addrs"
    engines = None
    try:
        engines = RemoteEngines(
            urls,
            api_key=api_key,
            admin_api_key=admin_key,
            concurrency=cfg.concurrency,
            launcher=launcher,
            failover=cfg.failover,
            client_cls=client_class(cfg.backend),
        )
        try:
            engines.wait_healthy(timeout=120.0, reachable=True)
            infos = engines.run(engines._each(lambda c: c.model_info(), tolerant=False))
            engines.require_endpoints(dict(cfg.required))  # an engine lost here is one line too, no traceback
        except EngineRequestError as e:
            if e.status in (401, 403):
                raise ConfigError(
                    f"{flag}: {e.url} refused the key ({e.status}); give the server's key with "
                    f"--rollout-external-engine-api-key-file FILE or ${ENGINE_KEY_ENV}"
                ) from None
            raise
        except EngineUnavailable as e:
            raise ConfigError(f"{flag}: cannot reach an engine server: {e}") from None
    except BaseException:
        if engines is not None:
            engines.close()
        elif launcher is not None:
            launcher.stop()
        raise
    for url, info in zip(urls, infos):
        log.info("engine %s: model %s, weight version %s", url, info.get("model_path"), info.get("weight_version"))
    if cfg.failover:
        # --use-fault-tolerance resolves the three (lichen.config.rollout); without it they stay None
        assert None not in (cfg.health_interval, cfg.health_timeout, cfg.health_first_wait)
        pool = {
            "min_healthy": cfg.min_healthy,
            "max_failed_restarts": cfg.max_failed_restarts,
            "control_file": cfg.control_file,
            "add_keys": external_keys(cfg),  # an address added during the run is an external engine
            "required": dict(cfg.required),
        }
        engines.start_health_monitor(
            interval=float(cfg.health_interval or 0),
            timeout=float(cfg.health_timeout or 0),
            first_wait=float(cfg.health_first_wait or 0),
            pool=pool,
        )
    return engines
