"""Engine servers started by Ray actors on their placement bundles: `lichen serve`, SGLang with
`--rollout-engine-backend sglang`, or vLLM with `--rollout-engine-backend vllm` (lichen.engines.clients.vllm_launcher, one
engine per actor, the run's key in VLLM_API_KEY).

Each `EngineHost` actor sits on its engine's first bundle and runs one server through lichen.engines.clients.launcher or
lichen.engines.clients.sglang_launcher (so the server dies with its actor, logs under <output>/engines/engine_<i>/, gets
its keys through the environment). The server sees the GPUs of all its bundles (`engine_env`:
CUDA_VISIBLE_DEVICES; on a CPU host these are Ray's declared GPUs, which CPU torch ignores), so an SGLang engine
starts at the first of them, `--base-gpu-id 0`, with `--tp-size` its GPU count (`sglang_command`). It binds
127.0.0.1 when it runs on the driver's node, else its node's address. SGLang takes one key on every endpoint, so
its engines get no separate admin key.

`RayEngineSet` is the driver's handle on them with the launcher interface RemoteEngines and the health monitor
use (`start`, `stop`, `restart(i)`, `api_key`, `admin_api_key`, `ready_timeout`): fault tolerance works as with
local launches, and an engine whose actor died is started again in a new actor on the same bundle (its node
lost: wherever Ray reschedules that bundle, waited for up to the ready timeout; docs/fault-tolerance.md).
`add()` (a `launch` line of the engine control file) starts one more engine actor outside the run's placement
group, whose bundles are fixed: it asks Ray for --rollout-num-gpus-per-engine whole GPUs wherever they are free and
learns their ids inside the actor (ray.get_gpu_ids()); its start, placement included, is bounded by the ready
timeout like a restart's, and it is stopped with the others.
"""

from __future__ import annotations

import os
import time
from typing import Any

from lichen.cluster.actor_group import reported_env
from lichen.cluster.runtime import RayCluster
from lichen.engines.api.auth import SERVE_ADMIN_KEY_ENV, SERVE_KEY_ENV, new_key
from lichen.engines.clients.sglang_launcher import build_sglang_command
from lichen.observe.metrics import get_logger

log = get_logger(__name__)

ENGINE_GPU_SHARE = 0.2  # slime's share: fits next to a trainer rank (0.4) on a colocated bundle
READY_TIMEOUT_S = 300.0
SGLANG_READY_TIMEOUT_S = 1800.0  # SGLang's start-up (weights, CUDA graphs) takes minutes on large models
PROBE_READ_BYTES = 256  # the sync directory's probe file holds a 32-character token
PROBE_GPU_SHARE = 0.01
OUTSIDE = "outside the run's placement group"  # where an added engine's actor goes


def engine_env(keys: dict[str, str], gpu_ids: list[int]) -> dict[str, str]:
    """The environment of an engine's server: the run's keys and the GPUs of all the engine's bundles."""
    return {**keys, "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpu_ids)}


def sglang_command(cfg: Any, *, port: int, host: str, python: str | None = None) -> list[str]:
    """The SGLang command an engine's actor runs (`cfg` an EngineConfig): its server sees only its own GPUs
    (engine_env), so every engine starts at GPU 0 of them, whatever its index in the run."""
    return build_sglang_command(cfg, engine_index=0, port=port, host=host, python=python)


def _gpu_id() -> int:
    """The GPU of the bundle this Ray task runs on (RayEngineSet._bundle_gpu_ids)."""
    import ray

    return int(ray.get_gpu_ids()[0])


def _backend(cfg: Any) -> str:
    return getattr(cfg, "backend", "lichen")


class EngineHostImpl:
    """The body of one engine's actor (wrapped by ray.remote in `EngineHost`)."""

    def __init__(self, cfg: Any, index: int, gpu_ids: list[int] | None, driver_ip: str, keys: dict[str, str]):
        self.cfg, self.index, self.gpu_ids, self.driver_ip, self.keys = cfg, index, gpu_ids, driver_ip, keys
        self.launcher: Any = None

    def where(self) -> dict:
        import ray

        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "env": reported_env(),
        }

    def start(self) -> str:
        import ray

        from lichen.engines.clients.launch_args import launch_server_args
        from lichen.engines.clients.launcher import EngineLauncher

        cfg = self.cfg
        if self.gpu_ids is None:  # an added engine, outside the placement group: the GPUs Ray gave this actor
            self.gpu_ids = [int(g) for g in ray.get_gpu_ids()]
        ip = ray.util.get_node_ip_address()
        host = "127.0.0.1" if ip == self.driver_ip else ip
        log_dir = os.path.join(cfg.log_dir, f"engine_{self.index}") if cfg.log_dir else None
        env = engine_env(self.keys, self.gpu_ids)
        if _backend(cfg) == "sglang":
            self.launcher = self._sglang_launcher(host, env, log_dir)
        elif _backend(cfg) == "vllm":
            self.launcher = self._vllm_launcher(host, env, log_dir)
        else:
            self.launcher = EngineLauncher(
                cfg.model_path,
                1,
                host=host,
                server_args=launch_server_args(cfg),
                log_dir=log_dir,
                ready_timeout=READY_TIMEOUT_S,
                env=env,
                keyed=False,
            )
        return self.launcher.start()[0]

    def _sglang_launcher(self, host: str, env: dict[str, str], log_dir: str | None) -> Any:
        import tempfile

        from lichen.engines.clients.sglang_launcher import SGLangLauncher

        cfg = self.cfg
        launcher = SGLangLauncher(
            lambda _i, port: sglang_command(cfg, port=port, host=host),
            1,
            log_dir=log_dir or tempfile.mkdtemp(prefix="lichen-sglang-"),
            host=host,
            ready_timeout=SGLANG_READY_TIMEOUT_S,
            env=env,
            keyed=True,
        )
        # the run's key, the same on every engine (RemoteEngines sends one), instead of one of this launcher's own
        launcher.api_key = launcher.env[SERVE_KEY_ENV] = self.keys[SERVE_KEY_ENV]
        return launcher

    def _vllm_launcher(self, host: str, env: dict[str, str], log_dir: str | None) -> Any:
        """vLLM (lichen.engines.clients.vllm_launcher) for this actor's one engine, with the run's key."""
        from lichen.engines.clients.vllm_launcher import VLLMLauncher

        launcher = VLLMLauncher.from_config(
            self.cfg, num_engines=1, host=host, env=env, log_dir=log_dir, ready_timeout=SGLANG_READY_TIMEOUT_S
        )
        launcher.api_key = launcher.env[launcher.key_env] = self.keys[SERVE_KEY_ENV]
        launcher.env.pop(SERVE_KEY_ENV, None)  # the key travels in vLLM's own variable only
        return launcher

    def restart(self) -> str:
        return self.launcher.restart(0)

    def read_probe(self, path: str) -> dict:
        """What this engine's node sees at `path` (lichen.sync.visibility), and where that is."""
        import ray

        where = f"Ray node {ray.get_runtime_context().get_node_id()[:8]} at {ray.util.get_node_ip_address()}"
        try:
            with open(path, encoding="utf-8") as f:
                return {"content": f.read(PROBE_READ_BYTES), "where": where}
        except (OSError, UnicodeDecodeError) as e:
            return {"error": f"{type(e).__name__}: {e}", "where": where}

    def server_pid(self) -> int:
        return self.launcher.pids[0]

    def stop(self) -> None:
        if self.launcher is not None:
            self.launcher.stop()


class RayEngineSet:
    """The engine actors of a run, with the launcher interface of lichen.engines (see the module doc)."""

    def __init__(self, cluster: RayCluster, cfg: Any):
        import ray

        self.cluster, self.cfg = cluster, cfg
        external = _backend(cfg) in ("sglang", "vllm")  # one key on every path; their start takes minutes
        self.api_key, self.admin_api_key = new_key(), None if external else new_key()
        self.ready_timeout = SGLANG_READY_TIMEOUT_S if external else READY_TIMEOUT_S
        self._host_cls = ray.remote(EngineHostImpl)
        self._stopped = False
        self.actors: list[Any] = [self._make(i) for i in range(len(cluster.placement.engines))]

    def _keys(self) -> dict[str, str]:
        keys = {SERVE_KEY_ENV: self.api_key}
        if self.admin_api_key:
            keys[SERVE_ADMIN_KEY_ENV] = self.admin_api_key
        return keys

    def _make(self, i: int, gpu_ids: list[int] | None = None) -> Any:
        bundles = self.cluster.placement.engines[i]
        # no runtime_env: --train-env-vars are the trainer's only
        return self._host_cls.options(
            num_cpus=0, num_gpus=ENGINE_GPU_SHARE, scheduling_strategy=self.cluster.strategy(bundles[0])
        ).remote(self.cfg, i, gpu_ids or self.cluster.gpu_ids(bundles), self.cluster.driver_ip, self._keys())

    def _make_outside(self, i: int) -> Any:
        """Engine `i`'s actor outside the placement group (an added engine): the bundles' sliver (ENGINE_GPU_SHARE)
        fits because a bundle reserves its GPU; out here a sliver would share a GPU with whatever holds it, so the
        actor takes --rollout-num-gpus-per-engine whole GPUs that no bundle or other actor holds."""
        return self._host_cls.options(
            num_cpus=0, num_gpus=int(self.cfg.gpus_per_engine), scheduling_strategy="DEFAULT"
        ).remote(self.cfg, i, None, self.cluster.driver_ip, self._keys())

    def _not_started(self, index: int, where: str, why: str) -> TimeoutError:
        return TimeoutError(
            f"engine {index}: no new Ray actor {where} started within {self.ready_timeout:g} s ({why}, or its "
            "server did not become ready)"
        )

    def _outside_why(self) -> str:
        return f"no node has {int(self.cfg.gpus_per_engine)} GPU(s) free outside the run's placement group yet"

    def _start_within(self, index: int, deadline: float, where: str, why: str) -> str:
        """Start engine `index`'s (new) actor's server; the wait, Ray's placement of the actor included, ends at
        `deadline`: a restart or an add never blocks forever when no resources come free (the actor is killed,
        so it never starts a server later)."""
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            return ray.get(self.actors[index].start.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except GetTimeoutError:
            ray.kill(self.actors[index])
            raise self._not_started(index, where, why) from None

    def _bundle_gpu_ids(self, i: int, timeout: float) -> list[int]:
        """The GPU ids of engine `i`'s bundles as they are now. When a node is lost, Ray reschedules the
        placement group's bundles that were on it onto a node with free resources, where the GPU ids can differ
        from those probed at the start (RayCluster.order): the server must see the GPUs its bundles now hold."""
        import ray
        from ray.exceptions import GetTimeoutError

        # a sliver of the bundle's one GPU: it fits next to whatever shares the bundle (a colocated trainer rank)
        probe = ray.remote(num_cpus=0, num_gpus=PROBE_GPU_SHARE)(_gpu_id)
        refs = [
            probe.options(scheduling_strategy=self.cluster.strategy(b)).remote()
            for b in self.cluster.placement.engines[i]
        ]
        try:
            return [int(g) for g in ray.get(refs, timeout=timeout)]
        except GetTimeoutError:
            for r in refs:  # not placed yet: drop them, or they would run whenever resources come back
                ray.cancel(r, force=True)
            raise

    def start(self) -> list[str]:
        import ray

        urls = ray.get([a.start.remote() for a in self.actors])
        log.info("started %d lichen serve engine(s) on Ray: %s", len(urls), ", ".join(urls))
        return urls

    def restart(self, index: int) -> str:
        """Restart engine `index`'s server; if its actor is gone, start a new actor on the same bundle."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(self.actors[index].restart.remote())
        except RayActorError:
            log.warning("engine %d: its Ray actor died; starting a new one on the same bundle", index)
        # An actor merely unreachable (ActorUnavailableError) may still run its server: end it before another starts.
        ray.kill(self.actors[index])
        # Its node may be gone (the raylet died): the new actor waits until Ray has rescheduled the bundle on a node
        # with free resources. The whole wait, placement included, is bounded by the ready timeout, so a restart
        # never blocks forever when no node comes back; the health monitor then counts a failed restart, tries again
        # at its next interval, and retires the engine after --rollout-max-failed-restarts (the run goes on with the
        # other engines meanwhile).
        deadline = time.monotonic() + self.ready_timeout
        if index >= len(self.cluster.placement.engines):  # an added engine: a new actor wherever GPUs are free
            self.actors[index] = self._make_outside(index)
            return self._start_within(index, deadline, OUTSIDE, self._outside_why())
        where = "on its placement-group bundle"
        why = "its node was lost and no node with free resources has taken the bundle yet"
        try:
            gpu_ids = self._bundle_gpu_ids(index, self.ready_timeout)
        except GetTimeoutError:
            raise self._not_started(index, where, why) from None
        self.actors[index] = self._make(index, gpu_ids)
        return self._start_within(index, deadline, where, why)

    def add(self) -> str:
        """One more engine actor (a `launch` line of the engine control file; see the module doc); returns its URL
        once its server is ready. A start that fails or times out kills the actor (its server dies with it) and
        leaves the set as it was. Blocking (call it from a worker thread)."""
        import ray

        if self._stopped:
            raise RuntimeError("cannot add an engine: the run's engine actors are stopped")
        index = len(self.actors)
        self.actors.append(self._make_outside(index))
        try:
            url = self._start_within(index, time.monotonic() + self.ready_timeout, OUTSIDE, self._outside_why())
        except BaseException:
            ray.kill(self.actors[index])
            self.actors.pop(index)  # engine i stays the pool's engine i (restart(i))
            raise
        log.info("engine %d added on Ray: %s", index, url)
        return url

    def read_each(self, path: str) -> list[dict]:
        """Each engine's actor reads `path` on its node: the disk transports' visibility check."""
        import ray

        return ray.get([a.read_probe.remote(path) for a in self.actors])

    def call_each(self, method: str) -> list:
        import ray

        return ray.get([getattr(a, method).remote() for a in self.actors])

    def stop(self, grace: float = 10.0) -> None:
        import ray

        self._stopped = True
        for a in self.actors:
            try:
                ray.get(a.stop.remote(), timeout=grace + 20)
            except Exception as e:  # the actor is gone (its server died with it) or hung
                log.warning("stopping an engine actor: %s", e)
            ray.kill(a)


def ray_remote_engines(cluster: RayCluster, cfg: Any) -> Any:
    """The run's engines (`cfg` an EngineConfig) as Ray actors behind one RemoteEngines, which stops them on close."""
    from lichen.engines.clients.remote_engines import RemoteEngines

    return RemoteEngines.from_config(cfg, launcher=RayEngineSet(cluster, cfg))
