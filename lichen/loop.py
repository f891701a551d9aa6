"""The RL driver: with lichen/loop_async.py (`--async`), the only place that orders the phases
(docs/architecture.md#the-loop).

    sync -> [eval] -> for each rollout step: generate -> train -> [save] -> sync -> [eval]

Debug modes are plug-ins, not branches: --debug-rollout-only swaps in a trainer that does nothing, and
--load-debug-rollout-data swaps in a rollout that replays dumps and has no engines to sync.
"""

from __future__ import annotations

import json
import os
import time

from lichen import sync
from lichen.config.engine_config import ObserveConfig, SyncConfig
from lichen.observe.failed_steps import FailedStepGuard
from lichen.observe.metrics import MetricsLogger, format_step_line, get_logger
from lichen.observe.progress import print_line, progress
from lichen.observe.run_observer import RunObserver
from lichen.observe.secrets import redact_config
from lichen.train import checkpoint as ckpt

log = get_logger(__name__)


class NullTrainer:
    """--debug-rollout-only: no model, no optimizer; engines keep their weights. (lichen.train.trainer_protocol)"""

    named_weights = None  # nothing to sync

    def train(self, rollout_id, batch) -> dict:
        return {}

    def offload(self) -> None:
        pass

    def onload(self) -> None:
        pass

    def save(self, save_dir: str, rollout_id: int) -> ckpt.SavedTrainer:
        return ckpt.SavedTrainer()  # a checkpoint of the rollout side only

    def load(self, load_dir: str, rollout_id: int) -> None:
        pass

    def token_values(self, rows) -> dict:
        return {}

    def memory_begin(self) -> None:
        pass

    def memory_end(self, phase: str) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def build_rollout(args, cluster=None):
    from lichen.config.engine_config import EngineConfig
    from lichen.config.rollout_config import RolloutConfig
    from lichen.rollout.manager import ReplayRollout, RolloutManager

    cfg = RolloutConfig.from_args(args)
    if cfg.load_debug_rollout_data:
        return ReplayRollout(cfg)
    engine_cfg, engine = EngineConfig.from_args(args), None
    if cluster is not None and cluster.placement.engines:
        from lichen.cluster.engine_actors import ray_remote_engines

        engine = ray_remote_engines(cluster, engine_cfg)  # servers started by Ray actors on their bundles
    # the full namespace goes along only for the user plug-ins the rollout calls
    return RolloutManager(cfg, args, engine, engine_cfg=engine_cfg)


def build_trainer(args, cluster=None):
    if args.debug_rollout_only:
        return NullTrainer()
    from lichen.config.train_config import TrainerConfig

    if cluster is not None:  # --runtime ray: the ranks of lichen.train.dist_trainer as Ray actors
        from lichen.cluster.actor_group import RayTrainGroup

        return RayTrainGroup(cluster, TrainerConfig.from_args(args), args)
    from lichen.train.actor import TrainActor

    # args.num_rollout is resolved by now (resolve_num_rollout), so the config carries the run's optimizer steps;
    # the full namespace goes along only for the user plug-ins the trainer calls.
    return TrainActor(TrainerConfig.from_args(args), plugin_args=args)


def resolve_num_rollout(args, rollout) -> None:
    if args.num_rollout is None:
        per_epoch = getattr(rollout, "num_rollout_per_epoch", None)
        if per_epoch is None:
            from lichen.errors import ConfigError

            raise ConfigError("--num-epoch needs a prompt data set; give --num-rollout with --load-debug-rollout-data")
        args.num_rollout = args.num_epoch * per_epoch


def resume(args, trainer, rollout) -> int:
    """Restore trainer, optimizer, RNG and data position from --load; returns the first rollout id to run."""
    return resume_from(args.load, trainer, rollout) if args.load else 0


def resume_from(load_dir: str, trainer, rollout) -> int:
    """`resume` from `load_dir` (--load, or --save when a trainer restart rewinds); the first rollout id to run."""
    last = ckpt.find_latest(load_dir)
    if last is None:
        log.info("--load %s holds no checkpoint yet: starting from --hf-checkpoint", load_dir)
        return 0
    trainer.load(load_dir, last)  # the newest intact one, which `latest` may not name
    rollout.load_state_dict(ckpt.load_rollout_state(load_dir, last))
    log.info("resumed from %s at rollout %d (weight version %d)", ckpt.iter_dir(load_dir, last), last, last + 1)
    return last + 1


def trainer_restarts(args, rollout, start: int):
    """The run's --max-trainer-restarts bookkeeping (lichen.cluster.trainer_recovery), from step `start`."""
    from lichen.cluster.trainer_recovery import TrainerRestarts

    n = getattr(args, "max_trainer_restarts", None) or 0
    initial = rollout.state_dict() if n and start == 0 else None  # a rewind before the first checkpoint
    return TrainerRestarts(n, start=start, save_dir=args.save, load_dir=args.load, initial_state=initial)


def recover_trainer(args, trainer, rollout, restarts, error: BaseException, rollout_id: int, sync_cfg) -> None:
    """A step raised `error`: when a trainer rank died and restarts are left, restart the ranks, rewind the run to
    the newest checkpoint (the --load path) and re-sync the engines; else raise it again."""

    def rewind(load_dir: str | None, initial_state: dict | None) -> int:
        if load_dir is None:  # no checkpoint yet: the new ranks hold the initial weights
            rollout.load_state_dict(initial_state)
            return 0
        return resume_from(load_dir, trainer, rollout)

    def resync(version: int) -> None:
        sync.close(rollout)  # the transports' state (a broadcast group) belonged to the dead ranks
        sync.push(trainer, rollout, version=version, cfg=sync_cfg)

    restarts.recover(error, rollout_id, trainer, rewind, resync)


def is_due(interval: int | None, rollout_id: int, num_rollout: int) -> bool:
    return bool(interval) and ((rollout_id + 1) % interval == 0 or rollout_id + 1 == num_rollout)


def save_due(args, rollout_id: int) -> bool:
    """A checkpoint after this step: every --save-interval steps and always after the last one (with --save)."""
    return bool(args.save) and (
        is_due(args.save_interval, rollout_id, args.num_rollout) or rollout_id + 1 == args.num_rollout
    )


def save_checkpoint(args, trainer, rollout, rollout_id: int) -> None:
    """The trainer's files, then the rollout state, meta.json, checksums and `latest` (lichen.train.checkpoint)."""
    asynchronous = getattr(args, "async_save", False)  # --async-save: the files are written off the training path
    ckpt.save_checkpoint(args.save, rollout_id, trainer, rollout.state_dict(), asynchronous=asynchronous)


def prepare_output_dir(args) -> None:
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "config.json"), "w") as f:
        json.dump(
            redact_config({k: v for k, v in vars(args).items() if not k.startswith("_")}), f, indent=1, default=str
        )


def start_cluster(args):
    """--runtime ray: join or start Ray and reserve the run's placement group; None for the local runtime."""
    if args.runtime != "ray":
        return None
    from lichen.cluster.runtime import RayCluster
    from lichen.config.cluster_config import ClusterConfig

    return RayCluster(ClusterConfig.from_args(args))


def run(args, driver=None) -> dict:
    """One run: `driver` orders the phases (train_loop here; --async: lichen.loop_async.train_loop_async)."""
    prepare_output_dir(args)
    cluster = start_cluster(args)
    try:
        return _run(args, cluster, driver or train_loop)
    finally:
        if cluster is not None:
            cluster.close()  # after the rollout and trainer closed: removes the placement group, stops our Ray


def _run(args, cluster, driver) -> dict:
    rollout = build_rollout(args, cluster)
    trainer = None
    try:
        resolve_num_rollout(args, rollout)
        trainer = build_trainer(args, cluster)
        obs_cfg = ObserveConfig.from_args(args)
        with MetricsLogger.from_config(obs_cfg) as logger:
            tokenizer = getattr(getattr(rollout, "context", None), "tokenizer", None)
            observer = RunObserver(
                obs_cfg,
                engines=getattr(rollout, "engines", []),
                decode=tokenizer.decode if tokenizer is not None else None,
                sources=[trainer],
            )  # the trainer's processes give the trace their phases and the metrics their memory
            try:
                last = driver(args, trainer, rollout, logger, observer)
                ckpt.wait_for_saves()  # the last checkpoint's write (--async-save) is committed before the run ends
                return last
            finally:
                observer.close()
    finally:
        ckpt.wait_for_saves(raise_errors=False)  # a failing run still commits a write in flight, before closing
        sync.close(rollout)  # leaves broadcast groups while the engines still answer
        rollout.close()  # stops engine servers lichen launched, also when the run raises
        if trainer is not None:
            trainer.close()  # the Ray runtime's ranks: barrier, then leave the process group


def eval_before_training(args, rollout, logger, obs: RunObserver) -> dict:
    """The eval of version 0 (the checkpoint as loaded), logged as step 0; shared with the async driver."""
    with obs.phase("eval", -1):
        metrics = rollout.eval(version=0)
    obs.step_done(0, None, metrics)
    logger.log(0, metrics)
    print_line(format_step_line(-1, {**metrics, "num_rollout": args.num_rollout}))
    return metrics


def train_loop(args, trainer, rollout, logger, observer: RunObserver | None = None) -> dict:
    obs = observer or RunObserver(ObserveConfig.from_args(args))
    if (args.offload_train or args.offload_rollout) and not _on_accelerator(args):
        log.info("offload requested on CPU: nothing to release, offload is a no-op")
    last: dict = {}
    all_failed = FailedStepGuard(args.max_consecutive_failed_steps)  # stops a run whose verifier fails every sample
    start = resume(args, trainer, rollout)
    sync_cfg = SyncConfig.from_args(args)
    with obs.phase("sync", start - 1):
        sync.push(trainer, rollout, version=start, cfg=sync_cfg)  # engines start from the trainer's weights
    if args.offload_train:
        trainer.offload()  # the first rollout (and eval) needs the devices the trainer would otherwise hold
    if args.eval_interval and start == 0 and not args.skip_eval_before_train:
        last = eval_before_training(args, rollout, logger, obs)

    restarts = trainer_restarts(args, rollout, start)

    def step(rollout_id: int) -> dict:
        return _step(args, trainer, rollout, logger, obs, sync_cfg, all_failed, restarts, rollout_id)

    return run_steps(args, trainer, rollout, restarts, sync_cfg, step, last)


def run_steps(args, trainer, rollout, restarts, sync_cfg, step, last: dict) -> dict:
    """`step(rollout_id)` for every step left (`restarts.steps`); the last step's metrics (`last` if none ran). A
    step that fails because a trainer rank died sends the run back to the newest checkpoint (recover_trainer);
    any other error, or one with no restart left, ends the run."""
    total = args.num_rollout - restarts.next_id
    for rollout_id in progress(restarts.steps(args.num_rollout), total=total, desc="rollout", disable=args.no_progress):
        try:
            last = step(rollout_id)
        except Exception as e:  # raised again unless a trainer rank died and --max-trainer-restarts allows
            recover_trainer(args, trainer, rollout, restarts, e, rollout_id, sync_cfg)
    return last


def _step(args, trainer, rollout, logger, obs: RunObserver, sync_cfg, all_failed, restarts, rollout_id: int) -> dict:
    """One rollout step of the synchronous loop; its metrics (with those of a trainer restart just before it)."""
    t0 = time.perf_counter()
    with obs.phase("generate", rollout_id):
        batch, metrics = rollout.generate(rollout_id)
    metrics.update(restarts.take_metrics())
    all_failed.check(rollout_id, batch)
    if args.offload_rollout:
        rollout.offload()
    if args.offload_train:
        trainer.onload()
    with obs.phase("train", rollout_id):
        metrics.update(trainer.train(rollout_id, batch))
    if save_due(args, rollout_id):
        with obs.phase("save", rollout_id) as rec:
            save_checkpoint(args, trainer, rollout, rollout_id)
        metrics["time/save"] = rec.elapsed()
    if args.offload_train:
        trainer.offload()
    if args.offload_rollout:
        rollout.onload(["weights"])
    with obs.phase("sync", rollout_id):
        metrics.update(sync.push(trainer, rollout, version=rollout_id + 1, cfg=sync_cfg))
    if args.offload_rollout:
        rollout.onload(["kv_cache"])
    if is_due(args.eval_interval, rollout_id, args.num_rollout):
        with obs.phase("eval", rollout_id):
            metrics.update(rollout.eval(version=rollout_id + 1))
    metrics["time/step"] = time.perf_counter() - t0
    # the trainer's per-token advantages and log-probs of this step, for the sample log
    obs.step_done(rollout_id + 1, batch, metrics, trainer.token_values)
    logger.log(rollout_id + 1, metrics)
    print_line(format_step_line(rollout_id, {**metrics, "num_rollout": args.num_rollout}))
    return metrics


def _on_accelerator(args) -> bool:
    import torch

    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
