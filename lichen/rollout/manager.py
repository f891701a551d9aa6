"""The rollout manager: prompts from the data source -> engine samples -> rewards -> `list[list[Sample]]`.

It owns the engines (the trainer reaches them only through `lichen.sync`), the prompt data source (whose
position is part of every checkpoint), the partial-rollout buffer (--partial-rollout: groups cut off by an abort,
continued first next step; also part of every checkpoint) and the evaluation data sets.
"""

from __future__ import annotations

import os
import time

from lichen.data import PromptSource, load_prompt_dataset, parse_spec
from lichen.data.fit import fit_prompts
from lichen.errors import DataError
from lichen.models.tokenizer import encode_prompt, load_tokenizer
from lichen.observe.metrics import get_logger
from lichen.plugins import load_function
from lichen.rewards import build_reward_fn
from lichen.rollout.eval import build_eval_reward_fns, load_eval_sets, run_eval
from lichen.rollout.abort_surplus import can_abort
from lichen.rollout.generate import generate_rollout, take_prompts
from lichen.rollout.partial import PartialBuffer, require_abortable
from lichen.torch_files import load_plain, save_plain, to_plain
from lichen.types import Sample, Status

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
        log.warning("--save-debug-rollout-data: %d value(s) that are not plain data were stored as strings, e.g. %s",
                    len(converted), ", ".join(converted[:3]))
    save_plain({"rollout_id": rollout_id, "samples": samples}, path)
    return path


class RolloutManager:
    def __init__(self, args, engine=None):
        from lichen.engines.engine import Engine
        from lichen.devices import resolve_device

        self.args = args
        self.tokenizer = load_tokenizer(args.hf_checkpoint)
        keys = dict(input_key=args.input_key, label_key=args.label_key, metadata_key=args.metadata_key,
                    tool_key=args.tool_key)
        skip = getattr(args, "skip_bad_rows", False)
        records = load_prompt_dataset(args.prompt_data, **keys, skip_bad_rows=skip)
        self._encoded: dict[tuple[str, int], list[int]] = {}
        # checked at load, not mid-run: a prompt with no room under the context is never sent (lichen.data.fit)
        max_prompt = getattr(args, "rollout_max_prompt_len", None)
        kept = fit_prompts(records, lambda i, r: self._encode_record(r), path=parse_spec(args.prompt_data)[0],
                           max_prompt_len=max_prompt, skip_bad_rows=skip)
        self.num_filtered_prompts = len(records) - len(kept)
        self.source = PromptSource(kept, batch_size=args.rollout_batch_size, shuffle=args.rollout_shuffle,
                                   seed=args.rollout_seed)
        self.eval_sets = {name: (cfg, self._fit_eval(name, cfg, recs, max_prompt))  # name -> (config, records)
                          for name, (cfg, recs) in load_eval_sets(args).items()}
        servers = getattr(args, "rollout_num_engines", None) or getattr(args, "rollout_external_engine_addrs", None)
        if engine is None and servers:
            from lichen.engines.remote_engines import RemoteEngines

            engine = RemoteEngines.from_args(args)  # launched or external servers; close() stops launched ones
        if engine is None:
            engine = Engine.from_pretrained(args.hf_checkpoint, device=resolve_device(args.device),
                                            max_batch_size=args.rollout_max_batch_size)
        self.engine = engine
        self.reward_fn = build_reward_fn(args.rm_type, args.custom_rm_path, args)
        self.eval_reward_fns = build_eval_reward_fns(args, self.eval_sets, self.reward_fn)
        self.generate_fn = (load_function(args.rollout_function_path, "--rollout-function-path")
                            if args.rollout_function_path else generate_rollout)
        self.last_reward_stats: dict = {}
        self.partial = PartialBuffer()
        try:
            require_abortable(args, can_abort(args, self))
        except BaseException:
            self.close()
            raise

    def _fit_eval(self, name: str, cfg: dict, records: list, max_prompt: int | None) -> list:
        """The eval set's prompts that fit the context, encoded as run_eval encodes them (its own chat setting)."""
        def encode(_: int, r) -> list[int]:
            return encode_prompt(self.tokenizer, r.prompt, cfg["apply_chat_template"], r.tools)

        return fit_prompts(records, encode, path=parse_spec(cfg["path"])[0], max_prompt_len=max_prompt,
                           skip_bad_rows=False, what=f"eval data set {name!r}")

    @property
    def engines(self) -> list:
        return [self.engine]

    def _encode_record(self, record) -> list[int]:
        return encode_prompt(self.tokenizer, record.prompt, self.args.apply_chat_template, record.tools)

    def encode(self, data_index: int, record, dataset: str = "train") -> list[int]:
        key = (dataset, data_index)
        if key not in self._encoded:
            self._encoded[key] = self._encode_record(record)
        return self._encoded[key]

    @property
    def num_rollout_per_epoch(self) -> int:
        return self.source.num_batches_per_epoch

    def generate(self, rollout_id: int) -> tuple[list[list[Sample]], dict]:
        t0 = time.perf_counter()
        reserved = len(self.partial) if getattr(self.args, "partial_rollout", False) else 0
        if reserved:  # buffered groups take their places first: the data position moves by that many fewer
            prompts = take_prompts(self.source, self.args.rollout_batch_size - reserved)
        else:
            prompts = self.source.next_batch()
        self.last_rollout_extra = {}  # filled by the default rollout (dynamic sampling, shaping); plug-ins may not
        groups = self.generate_fn(self.args, rollout_id, prompts, self)
        metrics = rollout_metrics(groups, self.args.reward_key)
        metrics.update(self.last_rollout_extra)
        stats = self.last_reward_stats
        if stats:
            metrics["time/reward"] = stats.get("reward_time_s", 0.0)
        metrics["time/generate"] = time.perf_counter() - t0
        if self.args.save_debug_rollout_data:
            dump_rollout(self.args.save_debug_rollout_data, rollout_id, groups)
        return groups, metrics

    def eval(self, version: int) -> dict:
        return run_eval(self, version)

    def state_dict(self) -> dict:
        return {"source": self.source.state_dict(), "partial_rollout": self.partial.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state["source"])
        self.partial.load_state_dict(state.get("partial_rollout"))  # absent in older checkpoints: empty
        if len(self.partial) and not getattr(self.args, "partial_rollout", False):
            log.warning("the checkpoint holds %d partially generated groups but --partial-rollout is off: they are "
                        "dropped (their prompts stay spent); resume with --partial-rollout to continue them",
                        len(self.partial))
            self.partial.clear()

    def offload(self) -> None:
        for e in self.engines:
            e.offload()

    def onload(self, tags: list[str] | None = None) -> None:
        for e in self.engines:
            e.onload(tags)

    def close(self) -> None:
        """Release the engines: close server connections and stop launched servers (idempotent)."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


class ReplayRollout:
    """--load-debug-rollout-data: replays dumped Samples instead of generating (no engine, no weight sync)."""

    engines: list = []

    def __init__(self, args):
        self.args = args

    def generate(self, rollout_id: int) -> tuple[list[list[Sample]], dict]:
        path = self.args.load_debug_rollout_data.format(rollout_id=rollout_id)
        if not os.path.isfile(path):
            raise DataError(f"--load-debug-rollout-data: no dump for rollout {rollout_id} at {path!r}")
        data = load_plain(path, "--load-debug-rollout-data")
        if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
            raise DataError(f"--load-debug-rollout-data {path}: not a rollout dump (no 'samples' list)")
        groups = [[Sample.from_dict(d) for d in g] for g in data["samples"]]
        return groups, rollout_metrics(groups, self.args.reward_key)

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
