"""Weight-sync flags: how new weights reach server engines (full or delta, NCCL/gloo broadcast, disk or tensor handles).

The in-process engine (no --rollout-num-engines, no --rollout-external-engine-addrs) gets a direct tensor copy,
so these flags only matter for server engines. The combination rules are checked first, so a wrong combination
is reported as such; then an explicitly given transport or mode is refused for the in-process engine.
With server engines every transport works: nccl broadcast (the default), full disk and delta disk (lichen.sync);
tensor handles only with engines lichen launches (on its host; with --runtime ray, checked at the first sync).
"""

from __future__ import annotations

import argparse

from lichen.config import async_mode
from lichen.config.checks import check_int_at_least, given
from lichen.errors import ConfigError

DEFAULT_BUFFER_SIZE = 512 * 1024**2


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("weight sync (server engines)")
    g.add_argument(
        "--update-weight-mode",
        choices=["full", "delta"],
        default="full",
        help="full: send every weight; delta: send only what changed since the last sync (needs --update-weight-"
        "transport disk)",
    )
    g.add_argument(
        "--update-weight-transport",
        choices=["nccl", "disk", "tensor"],
        default="nccl",
        help="nccl: torch.distributed broadcast (NCCL on GPU, gloo on CPU); disk: files in --update-weight-disk-dir; "
        "tensor: handles to the trainer's memory posted to /update_weights_from_tensor (CUDA IPC on GPU, shared "
        "memory on CPU), for engines on the trainer's host (what slime uses with --colocate)",
    )
    g.add_argument(
        "--update-weight-disk-dir",
        metavar="DIR",
        default=None,
        help="directory the disk transport writes to; required with --update-weight-transport disk. Every engine "
        "reads it under the same path; under --runtime ray every trainer rank writes its share of each version "
        "into it, so it must be shared by their nodes too (default: none)",
    )
    g.add_argument(
        "--update-weight-local-checkpoint-dir",
        metavar="DIR",
        default=None,
        help="engine-side copy of the full weights that deltas apply to; required with --update-weight-mode delta "
        "(default: none)",
    )
    g.add_argument(
        "--update-weight-buffer-size",
        type=int,
        default=DEFAULT_BUFFER_SIZE,
        help="bytes of weights sent per bucket",
    )
    g.add_argument(
        "--update-weight-disk-keep-files",
        action="store_true",
        help="keep the files of each disk sync instead of deleting them once applied (default: off)",
    )
    g.add_argument(
        "--update-weight-full-interval",
        type=int,
        default=None,
        help="in delta mode, send a full sync every N syncs to bound drift (default: only the first sync is full)",
    )
    g.add_argument(
        "--update-weight-delta-encoding",
        choices=["xor", "overwrite"],
        default="xor",
        help="delta encoding: xor of the old and new bits, or the changed values themselves",
    )
    g.add_argument(
        "--update-weight-delta-checksum",
        choices=["xxh3-128", "blake3", "adler32"],
        default="xxh3-128",
        help="checksum that verifies a delta was applied to the right base",
    )
    g.add_argument(
        "--check-weight-update-equal",
        action="store_true",
        help="after every sync compare every tensor the engines serve with the trainer's, bit for bit (lichen serve "
        "is always checked on every tensor by checksum; other servers are then read back in full instead of a sample)",
    )
    g.add_argument(
        "--custom-update-weight-post-write-path",
        metavar="MODULE.FN",
        default=None,
        help="disk transport: fn(version_dir) runs after each version's files are written (e.g. to flush a shared "
        "file system) and before the engines read them (default: none)",
    )
    async_mode.add_args(parser)  # when the syncs happen: after every step, or overlapped with generation (--async)


def _uses_server_engines(args: argparse.Namespace) -> bool:
    return args.rollout_num_engines is not None or args.rollout_external_engine_addrs is not None


def check(args: argparse.Namespace) -> None:
    check_int_at_least(args, "update_weight_buffer_size", 1)
    check_int_at_least(args, "update_weight_full_interval", 1)
    if args.update_weight_mode == "delta":
        if args.update_weight_transport != "disk":
            raise ConfigError(
                f"--update-weight-mode delta needs --update-weight-transport disk (got "
                f"{args.update_weight_transport}): deltas are files the engines apply"
            )
        for dest, flag in (
            ("update_weight_disk_dir", "--update-weight-disk-dir"),
            ("update_weight_local_checkpoint_dir", "--update-weight-local-checkpoint-dir"),
        ):
            if getattr(args, dest) is None:
                raise ConfigError(f"--update-weight-mode delta needs {flag} DIR")
        if args.colocate:
            raise ConfigError(
                "--update-weight-mode delta is refused with --colocate: colocated engines share the trainer's "
                "devices and get full weights; use --update-weight-mode full"
            )
    else:
        for dest, flag in (
            ("update_weight_local_checkpoint_dir", "--update-weight-local-checkpoint-dir"),
            ("update_weight_full_interval", "--update-weight-full-interval"),
        ):
            if getattr(args, dest) is not None:
                raise ConfigError(f"{flag} is only used with --update-weight-mode delta; add it or drop {flag}")
    if args.update_weight_transport != "disk" and getattr(args, "custom_update_weight_post_write_path", None):
        raise ConfigError(
            "--custom-update-weight-post-write-path is only used with --update-weight-transport disk; "
            "add it or drop the hook"
        )
    if args.update_weight_transport == "tensor" and args.rollout_external_engine_addrs is not None:
        raise ConfigError(
            "--update-weight-transport tensor needs engines lichen launches on this host (it sends "
            "handles to this process's memory); external servers (--rollout-external-engine-addrs) "
            "cannot map it: use --update-weight-transport nccl or disk"
        )
    if args.update_weight_transport == "disk":
        if args.update_weight_disk_dir is None:
            raise ConfigError("--update-weight-transport disk needs --update-weight-disk-dir DIR")
    elif args.update_weight_disk_dir is not None:
        raise ConfigError(
            "--update-weight-disk-dir is only used with --update-weight-transport disk; add it or drop the directory"
        )
    if not _uses_server_engines(args):
        for dest, flag in (
            ("update_weight_transport", "--update-weight-transport"),
            ("update_weight_mode", "--update-weight-mode"),
        ):
            if given(args, dest):
                raise ConfigError(
                    f"{flag} applies to server engines (--rollout-num-engines / --rollout-external-engine-addrs); "
                    "the in-process engine gets a direct tensor copy of the weights; drop this flag"
                )
    async_mode.check(args)
