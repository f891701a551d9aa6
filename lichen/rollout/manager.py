"""The rollout worker: each step runs the rollout function on the data source and returns `list[list[Sample]]`.

`RolloutManager` is long-lived: it owns the engines (the trainer reaches them only through `lichen.sync`), the
tokenizer, the reward functions, the evaluation data sets and the data source (prompt position and the
partial-rollout buffer, both in every checkpoint). Each step it calls the rollout function under the contract of
lichen.rollout.base_types, with lichen.rollout.context.current() set to its RolloutContext; results come back as
the function's return value, never through attributes of the worker. `state_dict()` / `load_state_dict()` /
`close()` are the whole lifecycle, so an asynchronous rollout can sit behind the same interface.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from lichen.data import PromptSource, load_prompt_dataset, parse_spec
from lichen.data.fit import fit_prompts
from lichen.devices import resolve_device
from lichen.engines.clients.frozen_models import FrozenModels, set_active
from lichen.engines.clients.pool import pool_metrics
from lichen.engines.core.engine import Engine
from lichen.errors import DataError
from lichen.models.tokenizer import load_tokenizer
from lichen.observe.metrics import get_logger
from lichen.plugins import load_function
from lichen.rewards import build_reward_fn
from lichen.rollout.abort_surplus import can_abort
from lichen.rollout.agent_proxy import refused_metrics
from lichen.rollout.base_types import RolloutFn
from lichen.rollout.context import RolloutContext, active
from lichen.rollout.data_source import RolloutDataSource
from lichen.rollout.eval import build_eval_reward_fns, eval_output_metrics, load_eval_sets, tool_use_metrics
from lichen.rollout.forge_load import FORGE_FLAG, load_dump
from lichen.rollout.forge_load import generate_rollout as forge_generate_rollout
from lichen.rollout.generate import generate_rollout
from lichen.rollout.opd_teacher import attach_teacher_log_probs
from lichen.rollout.partial import require_abortable
from lichen.torch_files import save_plain, to_plain
from lichen.types import Sample, Status

if TYPE_CHECKING:  # rollout does not import lichen.config at run time (docs/architecture.md#import-directions)
    from lichen.config.engine_config import EngineConfig
    from lichen.config.rollout_config import RolloutConfig

log = get_logger(__name__)


def rollout_metrics(groups: list[list[Sample]], reward_key: str | None) -> dict:
    samples = [s for g in groups for s in g]
    ok = [s for s in samples if s.status != Status.FAILED]
    n = max(len(samples), 1)
    metrics = {
        "rollout/response_length_mean": sum(s.response_length for s in samples) / n,
        "rollout/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / n,
        "rollout/num_failed": len(samples) - len(ok),
        "rollout/num_samples": len(samples),
    }
    metrics.update({f"rollout/{k}": v for k, v in tool_use_metrics(samples).items()})
    metrics.update(refused_metrics(samples))
    scored = [s for s in ok if s.reward is not None]
    if scored or not ok:  # rollouts of supervised data (rollout.sft) carry no reward: no reward metric
        metrics["rollout/reward_mean"] = sum(s.scalar_reward(reward_key) for s in scored) / max(len(scored), 1)
    return metrics


def dump_rollout(path_template: str, rollout_id: int, groups: list[list[Sample]]) -> str:
    """Write the step's Samples as plain dicts (lichen.torch_files: a dump loads with weights_only=True)."""
    path = path_template.format(rollout_id=rollout_id)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    converted: list[str] = []
    samples = to_plain([[s.to_dict() for s in g] for g in groups], converted, "samples")
    if converted:
        log.warning(
            "--save-debug-rollout-data: %d value(s) that are not plain data were stored as strings, e.g. %s",
            len(converted),
            ", ".join(converted[:3]),
        )
    save_plain({"rollout_id": rollout_id, "samples": samples}, path)
    return path


class RolloutManager:
    """The rollout worker (see the module docstring). `cfg` is lichen's RolloutConfig; `args`, the full flag
    namespace, is only handed to user plug-ins; `engine_cfg` (an EngineConfig) launches or connects the engine
    servers when the flags ask for them, unless `engine` is given."""

    def __init__(
        self, cfg: "RolloutConfig", args: Any, engine: Any = None, *, engine_cfg: "EngineConfig | None" = None
    ) -> None:
        self.cfg = cfg
        self.args = args
        ctx = RolloutContext(args=args, config=cfg, engine=None, tokenizer=load_tokenizer(cfg.hf_checkpoint))
        d = cfg.data
        records = load_prompt_dataset(
            d.prompt_data, **d.record_keys, skip_bad_rows=d.skip_bad_rows, max_row_bytes=d.max_row_bytes
        )
        # checked at load, not mid-run: a prompt with no room under the context is never sent, and one far too
        # long is never tokenized (lichen.data.fit)
        kept = fit_prompts(
            records,
            lambda i, r: ctx.encode_record(r, max_chars=d.max_prompt_chars),
            path=parse_spec(d.prompt_data)[0],
            max_prompt_len=d.max_prompt_len,
            skip_bad_rows=d.skip_bad_rows,
            max_prompt_chars=d.max_prompt_chars,
        )
        self.num_filtered_prompts = len(records) - len(kept)
        source = PromptSource(kept, batch_size=d.batch_size, shuffle=d.shuffle, seed=d.seed)
        self.data_source = RolloutDataSource(
            source, n_samples_per_prompt=cfg.sampling.n_samples_per_prompt, encode=ctx.encode
        )
        # name -> (config, records); fitted below
        ctx.eval_sets = load_eval_sets(cfg.eval_datasets, max_row_bytes=d.max_row_bytes)
        ctx.eval_sets = {name: (c, self._fit_eval(ctx, name, c, recs)) for name, (c, recs) in ctx.eval_sets.items()}
        if engine is None and cfg.use_engine_servers:
            from lichen.engines.clients.remote_engines import RemoteEngines

            if engine_cfg is None:
                raise TypeError(
                    "RolloutManager: engine servers are configured but no engine_cfg (EngineConfig) was given"
                )
            engine = RemoteEngines.from_config(engine_cfg)  # launched or external servers; close() stops launched
        if engine is None:
            engine = Engine.from_pretrained(
                cfg.hf_checkpoint,
                device=resolve_device(cfg.device),
                max_batch_size=cfg.engine_max_batch_size,
                model_options=cfg.model_options,
            )
        ctx.engine = engine
        self.frozen_models: FrozenModels | None = (
            None  # --sglang-config's frozen models: never in self.engines, so never synced
        )
        if cfg.frozen_models:
            self.frozen_models = _launch_frozen(cfg.frozen_models, engine_cfg, engine)
        ctx.reward_fn = build_reward_fn(
            cfg.reward.rm_type, cfg.reward.custom_rm_path, cfg.reward, group=cfg.reward.group_rm
        )
        ctx.eval_reward_fns = build_eval_reward_fns(cfg.reward, ctx.eval_sets, ctx.reward_fn)
        self.context = ctx
        self.rollout_fn = _rollout_fn(cfg.rollout_function_path, "--rollout-function-path")
        if cfg.load_forge_rollout_data:  # slime's forge replay: dumped samples, engines and sync stay live
            self.rollout_fn = RolloutFn(forge_generate_rollout, flag=FORGE_FLAG)
        self.eval_fn = _rollout_fn(cfg.eval_function_path, "--eval-function-path")
        try:
            require_abortable(cfg, can_abort(cfg, engine))
        except BaseException:
            self.close()
            raise

    def _fit_eval(self, ctx: RolloutContext, name: str, cfg: dict, records: list) -> list:
        """The eval set's prompts that fit the context, encoded as eval encodes them (its own chat setting)."""
        return fit_prompts(
            records,
            lambda _, r: ctx.encode_record(r, name, max_chars=self.cfg.data.max_prompt_chars),
            path=parse_spec(cfg["path"])[0],
            max_prompt_len=self.cfg.data.max_prompt_len,
            skip_bad_rows=False,
            what=f"eval data set {name!r}",
            max_prompt_chars=self.cfg.data.max_prompt_chars,
        )

    @property
    def engines(self) -> list:
        return [self.context.engine]

    @property
    def num_rollout_per_epoch(self) -> int:
        return self.data_source.num_rollout_per_epoch

    def generate(self, rollout_id: int) -> tuple[list[list[Sample]], dict]:
        t0 = time.perf_counter()
        self.context.metrics = {}
        with active(self.context):
            out = self.rollout_fn.call(
                self.args,
                rollout_id,
                self.data_source,
                evaluation=False,
                legacy_call=lambda: self.rollout_fn.fn(self.args, rollout_id, self._legacy_prompts(), self),
            )
        groups = out.samples
        metrics = rollout_metrics(groups, self.cfg.reward.reward_key)
        if self.cfg.opd_teacher_served and self.frozen_models is not None:
            metrics.update(
                attach_teacher_log_probs(
                    groups,
                    self.frozen_models,
                    temperature=self.cfg.sampling.temperature,
                    concurrency=self.cfg.reward.concurrency,
                )
            )
        metrics.update(self.context.metrics)
        metrics.update(out.metrics or {})
        metrics["time/generate"] = time.perf_counter() - t0
        metrics.update(pool_metrics(self.context.engine))  # engines/healthy, /retired, /added
        if self.cfg.save_debug_rollout_data:
            dump_rollout(self.cfg.save_debug_rollout_data, rollout_id, groups)
        return groups, metrics

    def eval(self, version: int) -> dict:
        """Run the eval function (evaluation=True) and turn its data into `eval/<name>/<metric>` metrics."""
        t0 = time.perf_counter()
        with active(self.context):
            out = self.eval_fn.call(self.args, version, self.data_source, evaluation=True)
        reward_keys = {name: c["reward_key"] for name, (c, _) in self.context.eval_sets.items()}
        metrics = eval_output_metrics(out.data, reward_keys)
        metrics["time/eval"] = time.perf_counter() - t0
        metrics.update(out.metrics or {})
        return metrics

    def state_dict(self) -> dict:
        return self.data_source.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.data_source.load_state_dict(state)
        held = self.data_source.buffer
        if len(held) and not self.cfg.partial_rollout:
            log.warning(
                "the checkpoint holds %d partially generated groups but --partial-rollout is off: they are "
                "dropped (their prompts stay spent); resume with --partial-rollout to continue them",
                len(held),
            )
            held.clear()

    def offload(self) -> None:
        for e in self.engines:
            e.offload()

    def onload(self, tags: list[str] | None = None) -> None:
        for e in self.engines:
            e.onload(tags)

    def close(self) -> None:
        """Release the engines: close server connections and stop launched servers (idempotent)."""
        close = getattr(self.context.engine, "close", None)
        if close is not None:
            close()
        frozen = getattr(self, "frozen_models", None)
        if frozen is not None:
            set_active(None)
            frozen.close()
            self.frozen_models = None

    # What a rollout function with the deprecated signature fn(args, rollout_id, prompts, manager) reads of the
    # manager; new rollout functions use lichen.rollout.context.current() instead.
    def _legacy_prompts(self) -> list:
        reserved = len(self.data_source.buffer) if self.cfg.partial_rollout else 0
        return self.data_source.get_prompts(self.cfg.data.batch_size - reserved)

    @property
    def engine(self) -> Any:
        return self.context.engine

    @property
    def tokenizer(self) -> Any:
        return self.context.tokenizer

    @property
    def reward_fn(self) -> Any:
        return self.context.reward_fn

    @property
    def source(self) -> PromptSource:
        return self.data_source.source

    def encode(self, data_index: int, record: Any) -> list[int]:
        return self.context.encode(data_index, record)


def _launch_frozen(specs: tuple, engine_cfg: "EngineConfig | None", policy: Any) -> FrozenModels:
    """Launch --sglang-config's frozen models and make them the run's (lichen.engines.clients.frozen_models.active)."""
    if engine_cfg is None:
        close = getattr(policy, "close", None)
        if close is not None:
            close()
        raise TypeError("RolloutManager: --sglang-config's frozen models need the engine_cfg (EngineConfig)")
    try:
        models = FrozenModels.launch(specs, engine_cfg)
    except BaseException:
        close = getattr(policy, "close", None)
        if close is not None:
            close()  # the policy's servers started already: stop them with the failed launch
        raise
    set_active(models)
    return models


def _rollout_fn(path: str | None, flag: str) -> RolloutFn:
    """The plug-in at `path` (lichen's generate_rollout when none) under the rollout function contract."""
    return (
        RolloutFn(load_function(path, flag), flag=flag, path=path) if path else RolloutFn(generate_rollout, flag=flag)
    )


class ReplayRollout:
    """--load-debug-rollout-data: replays dumped Samples instead of generating (no engine, no weight sync)."""

    engines: list = []

    def __init__(self, cfg: "RolloutConfig") -> None:
        self.cfg = cfg

    def generate(self, rollout_id: int) -> tuple[list[list[Sample]], dict]:
        path = self.cfg.load_debug_rollout_data.format(rollout_id=rollout_id)
        if not os.path.isfile(path):
            raise DataError(f"--load-debug-rollout-data: no dump for rollout {rollout_id} at {path!r}")
        groups = load_dump(path, "--load-debug-rollout-data")
        return groups, rollout_metrics(groups, self.cfg.reward.reward_key)

    def eval(self, version: int) -> dict:
        return {}

    def close(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def offload(self) -> None:
        pass

    def onload(self, tags=None) -> None:
        pass
