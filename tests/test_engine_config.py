"""EngineConfig, SyncConfig and ObserveConfig: resolved once from `lichen train`'s flags, read by the engines,
sync and the metrics sinks instead of the flag namespace."""

from __future__ import annotations

import dataclasses

from helpers.runs import base_args

from lichen.config import EngineConfig, ObserveConfig, SyncConfig, build_train_parser, parse_train_args
from lichen.engines.clients.launch_args import launch_server_args


def _parse(tiny_ckpt, addition_data, tmp_path, *extra):
    return parse_train_args(base_args(tiny_ckpt, addition_data, tmp_path / "o", "--num-rollout", "1", *extra)[1:])


def test_engine_config_speaks_the_engines_terms(tiny_ckpt, addition_data, tmp_path):
    args = _parse(
        tiny_ckpt,
        addition_data,
        tmp_path,
        "--rollout-num-engines",
        "2",
        "--update-weight-transport",
        "disk",
        "--update-weight-disk-dir",
        str(tmp_path / "w"),
        "--rollout-max-prompt-len",
        "100",
        "--rollout-max-response-len",
        "50",
        "--eval-max-response-len",
        "200",
        "--offload-rollout",
    )
    cfg = EngineConfig.from_args(args)
    assert (cfg.model_path, cfg.num_engines, cfg.addresses) == (tiny_ckpt, 2, ())
    assert cfg.log_dir == str(tmp_path / "o" / "engines")
    assert cfg.max_response_len == 200  # the longest response of the run, training or eval
    assert cfg.required["/update_weights_from_disk"] == "--update-weight-transport disk"
    assert cfg.required["/release_memory_occupation"] == "--offload-rollout"
    flags = launch_server_args(cfg)
    assert flags[flags.index("--max-queued-tokens") + 1] == str(
        int(flags[flags.index("--max-queued-sequences") + 1]) * (100 + 200)
    )
    # a --debug-rollout-only run never syncs: no weight-update endpoints are required of the servers
    args = _parse(
        tiny_ckpt,
        addition_data,
        tmp_path,
        "--rollout-num-engines",
        "2",
        "--update-weight-transport",
        "disk",
        "--update-weight-disk-dir",
        str(tmp_path / "w"),
        "--debug-rollout-only",
    )
    quiet = EngineConfig.from_args(args)
    assert "/update_weights_from_disk" not in quiet.required
    assert quiet.max_response_len == max(args.rollout_max_response_len, args.eval_max_response_len or 0)


def test_engine_config_carries_no_training_flags():
    """Engines know nothing of training: no field of EngineConfig is named after a trainer, algorithm, loop or
    sync flag (the flags it is resolved from are turned into the engines' own terms)."""
    parser = build_train_parser()
    training_groups = {"train", "algo", "checkpoint", "sync", "debug"}
    training_dests = {
        a.dest
        for g in parser._action_groups
        if any(t in (g.title or "").lower() for t in training_groups)
        for a in g._group_actions
    }
    assert training_dests  # the groups exist under these titles
    assert not {f.name for f in dataclasses.fields(EngineConfig)} & training_dests


def test_sync_and_observe_configs_read_the_flags(tiny_ckpt, addition_data, tmp_path):
    args = _parse(
        tiny_ckpt,
        addition_data,
        tmp_path,
        "--rollout-num-engines",
        "1",
        "--update-weight-transport",
        "disk",
        "--update-weight-mode",
        "delta",
        "--update-weight-disk-dir",
        str(tmp_path / "w"),
        "--update-weight-local-checkpoint-dir",
        str(tmp_path / "l"),
        "--check-weight-update-equal",
    )
    sync = SyncConfig.from_args(args)
    assert (sync.transport, sync.mode, sync.disk_dir, sync.local_dir) == (
        "disk",
        "delta",
        str(tmp_path / "w"),
        str(tmp_path / "l"),
    )
    assert sync.full_interval == 0 and sync.check_all_weights and sync.hf_checkpoint == tiny_ckpt
    obs = ObserveConfig.from_args(args)
    assert obs.output_dir == str(tmp_path / "o") and not obs.use_wandb and obs.run_config["seed"] == args.seed
