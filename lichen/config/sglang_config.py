"""--sglang-config: slime's YAML of the models served for a run, the subset lichen launches.

slime's format (slime/backends/sglang_utils/sglang_config.py)::

    sglang:
      - name: actor                      # the policy: update_weights true (inferred when model_path is
        server_groups:                   # --hf-checkpoint's)
          - worker_type: regular
            num_gpus: 2
      - name: teacher
        model_path: /models/teacher
        update_weights: false            # frozen: weight sync never reaches it
        num_gpus_per_engine: 1
        server_groups:                   # (engine_groups: slime's older name)
          - worker_type: regular
            num_gpus: 1

What lichen takes: per model `name`, `model_path`, `update_weights`, `num_gpus_per_engine`, `server_groups` /
`engine_groups`; per group `worker_type` regular (and placeholder, which launches nothing, as in slime),
`num_gpus`, `num_gpus_per_engine`. A group's engines are num_gpus / num_gpus_per_engine. The updatable model is
the policy: its engines are --rollout-num-engines (set from the file, or checked against it). Each frozen model is
launched beside it (lichen.engines.clients.frozen_models). Not taken, each a usage error naming the key: prefill / decode /
encoder workers (PD and EPD disaggregation), per-group `overrides`, more than one updatable model, and any key
slime does not define.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from lichen.config.engine_config import FrozenModelSpec
from lichen.errors import ConfigError

FLAG = "--sglang-config"
_MODEL_KEYS = {"name", "model_path", "update_weights", "num_gpus_per_engine", "server_groups", "engine_groups"}
_GROUP_KEYS = {"worker_type", "num_gpus", "num_gpus_per_engine", "overrides"}
_NOT_TAKEN = {
    "prefill": "prefill/decode disaggregation",
    "decode": "prefill/decode disaggregation",
    "encoder": "encoder/prefill/decode disaggregation",
}


def add_args(g: Any) -> None:
    g.add_argument(
        FLAG,
        metavar="YAML",
        default=None,
        help="slime's YAML of served models: the policy's engines and frozen reference / reward / teacher models "
        "launched beside them, which weight sync never updates (docs/slime-compat.md; default: none)",
    )


def check(args: argparse.Namespace) -> None:
    """Read --sglang-config: set args.sglang_frozen_models and the policy's --rollout-num-engines."""
    args.sglang_frozen_models = ()
    path = getattr(args, "sglang_config", None)
    if path is None:
        return
    if args.rollout_external_engine_addrs:
        raise ConfigError(f"{FLAG} and --rollout-external-engine-addrs exclude each other (as in slime); drop one")
    policy, frozen = read_sglang_config(path, args.hf_checkpoint, args.rollout_engine_backend)
    if policy is not None:
        if args.rollout_num_engines and args.rollout_num_engines != policy:
            raise ConfigError(
                f"{FLAG} {path}: the updatable model has {policy} engine(s) but --rollout-num-engines is "
                f"{args.rollout_num_engines}; give one of them"
            )
        args.rollout_num_engines = policy
    args.sglang_frozen_models = tuple(frozen)


def read_sglang_config(path: str, hf_checkpoint: str, backend: str) -> tuple[int | None, list[FrozenModelSpec]]:
    """(the policy's engine count or None when the file has no updatable model, the frozen models)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{FLAG} {path}: cannot read it: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{FLAG} {path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict) or set(data) != {"sglang"} or not isinstance(data["sglang"], list):
        raise ConfigError(f"{FLAG} {path}: expected one top-level key 'sglang' holding a list of models")
    policy: int | None = None
    frozen: list[FrozenModelSpec] = []
    names: set[str] = set()
    for i, model in enumerate(data["sglang"]):
        where = f"{FLAG} {path}: sglang[{i}]"
        if not isinstance(model, dict):
            raise ConfigError(f"{where}: expected a mapping of model fields")
        _known_keys(model, _MODEL_KEYS, where)
        name = model.get("name")
        if not isinstance(name, str) or not name or name in names:
            raise ConfigError(f"{where}.name: give each model a unique name (got {name!r})")
        names.add(name)
        where = f"{FLAG} {path}: model {name!r}"
        model_path = model.get("model_path", hf_checkpoint)
        if not isinstance(model_path, str) or not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ConfigError(f"{where}: model_path {model_path!r} is not an HF checkpoint directory (no config.json)")
        update = model.get("update_weights")
        if update is None:  # slime's inference: the policy is the model of --hf-checkpoint
            update = os.path.realpath(model_path) == os.path.realpath(hf_checkpoint)
        if not isinstance(update, bool):
            raise ConfigError(f"{where}: update_weights must be true or false, got {update!r}")
        default_gpe = _positive(model, "num_gpus_per_engine", where, default=1)
        engines, gpe = _engines(model, where, default_gpe, backend)
        if update:
            if policy is not None:
                raise ConfigError(f"{where}: a second model with update_weights true; lichen trains one policy")
            if os.path.realpath(model_path) != os.path.realpath(hf_checkpoint):
                raise ConfigError(f"{where}: the updatable model must be --hf-checkpoint's (got {model_path!r})")
            policy = engines
        elif engines:
            frozen.append(FrozenModelSpec(name, model_path, engines, gpe))
    return policy, frozen


def _known_keys(entry: dict, known: set[str], where: str) -> None:
    for key in entry:
        if key not in known:
            raise ConfigError(f"{where}: key {key!r} is not part of slime's format (known: {', '.join(sorted(known))})")


def _positive(entry: dict, key: str, where: str, *, default: int) -> int:
    value = entry.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _engines(model: dict, where: str, default_gpe: int, backend: str) -> tuple[int, int]:
    """(engines of the model's regular groups, GPUs per engine)."""
    if "server_groups" in model and "engine_groups" in model:
        raise ConfigError(f"{where}: give server_groups or engine_groups (its older name), not both")
    groups = model.get("server_groups", model.get("engine_groups"))
    if not isinstance(groups, list) or not groups:
        raise ConfigError(f"{where}: server_groups must be a non-empty list of groups")
    engines, per_engine = 0, set()
    for j, group in enumerate(groups):
        at = f"{where}, server_groups[{j}]"
        if not isinstance(group, dict):
            raise ConfigError(f"{at}: expected a mapping of group fields")
        _known_keys(group, _GROUP_KEYS, at)
        if "overrides" in group:
            raise ConfigError(
                f"{at}: key 'overrides' (per-group SGLang ServerArgs) is not taken by lichen; give the settings as "
                "--sglang-<flag> for all engines, or drop it"
            )
        kind = group.get("worker_type")
        if kind in _NOT_TAKEN:
            raise ConfigError(f"{at}: worker_type {kind!r} ({_NOT_TAKEN[kind]}) is not available in lichen yet")
        if kind not in ("regular", "placeholder"):
            raise ConfigError(f"{at}: worker_type must be regular or placeholder, got {kind!r}")
        gpus = _positive(group, "num_gpus", at, default=0)
        if kind == "placeholder":  # reserves GPUs in slime, launches nothing in either
            continue
        gpe = _positive(group, "num_gpus_per_engine", at, default=default_gpe)
        if gpus % gpe:
            raise ConfigError(f"{at}: num_gpus {gpus} is not a multiple of num_gpus_per_engine {gpe}")
        if backend == "lichen" and gpe != 1:
            raise ConfigError(
                f"{at}: num_gpus_per_engine {gpe} needs --rollout-engine-backend sglang (lichen serve: one device each)"
            )
        engines += gpus // gpe
        per_engine.add(gpe)
    if len(per_engine) > 1:
        raise ConfigError(f"{where}: its groups differ in num_gpus_per_engine; lichen launches one size per model")
    return engines, per_engine.pop() if per_engine else default_gpe
