"""The weight-sync flag group's combination rules (lichen/config/sync.py `check`), on a namespace of the group's
flags alone: which transport/mode/engine combinations pass, and that the in-process rule reads only the flags the
user gave. The rules reached through the whole parser: tests/test_config_rules.py."""

from __future__ import annotations

import argparse

import pytest

from lichen.config import sync as sync_group
from lichen.errors import ConfigError


def _sync_ns(**over) -> argparse.Namespace:
    ns = argparse.Namespace(
        update_weight_mode="full",
        update_weight_transport="nccl",
        update_weight_disk_dir=None,
        update_weight_local_checkpoint_dir=None,
        update_weight_buffer_size=1,
        update_weight_full_interval=None,
        colocate=False,
        rollout_num_engines=2,
        rollout_external_engine_addrs=None,
        # the --async / --fully-async flags live in the sync group
        async_train=False,
        update_weights_interval=1,
        fully_async=False,
        max_staleness=None,
        max_staleness_action="drop",
        _explicit={"update_weight_mode", "update_weight_transport"},
    )
    for key, value in over.items():
        setattr(ns, key, value)
    return ns


@pytest.mark.parametrize(
    "over",
    [
        {"update_weight_transport": "disk", "update_weight_disk_dir": "w"},
        {
            "rollout_num_engines": None,
            "rollout_external_engine_addrs": ["h:1"],
            "update_weight_transport": "disk",
            "update_weight_disk_dir": "w",
        },
    ],
)
def test_sync_valid_combinations_pass_with_server_engines(over):
    sync_group.check(_sync_ns(**over))


@pytest.mark.parametrize(
    "over",
    [
        {},
        {
            "update_weight_mode": "delta",
            "update_weight_transport": "disk",
            "update_weight_disk_dir": "w",
            "update_weight_local_checkpoint_dir": "l",
            "update_weight_full_interval": 5,
        },
    ],
)
def test_sync_server_transports_nccl_and_delta_pass(over):
    sync_group.check(_sync_ns(**over))  # nccl (the default) and delta disk sync both work with server engines


def test_sync_in_process_rule_reads_only_explicit_flags():
    sync_group.check(_sync_ns(rollout_num_engines=None, _explicit=set()))  # defaults: fine
    with pytest.raises(ConfigError, match="--update-weight-mode applies to server engines"):
        sync_group.check(_sync_ns(rollout_num_engines=None, _explicit={"update_weight_mode"}))
