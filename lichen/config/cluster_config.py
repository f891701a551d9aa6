"""The typed config of the Ray runtime (lichen.cluster), resolved once from the flags of lichen.config.placement.

A leaf: imports nothing of lichen but `errors` (docs/architecture.md#import-directions), and no torch or Ray.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class ClusterConfig:
    """Where the trainer ranks and engines of a `--runtime ray` run go, and what the trainer actors get."""

    ray_address: str | None  # None: $RAY_ADDRESS, else a local Ray instance lichen starts
    actor_num_nodes: int
    actor_num_gpus_per_node: int
    rollout_num_gpus: int  # 0: no engines to place (external engines, replayed rollouts)
    rollout_num_gpus_per_engine: int
    colocate: bool
    debug_rollout_only: bool
    debug_train_only: bool
    external_engines: bool
    device: str  # the trainer's --device: cpu, cuda or auto
    train_env_vars: Mapping[str, str] = field(default_factory=dict)  # the trainer actors' runtime_env only
    offload_train: bool = False  # on CUDA: torch_memory_saver's hook in the trainer actors (lichen.cluster.train_env)

    @property
    def world_size(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ClusterConfig":
        return cls(
            ray_address=args.ray_address,
            actor_num_nodes=args.actor_num_nodes or 1,
            actor_num_gpus_per_node=args.actor_num_gpus_per_node or 1,
            rollout_num_gpus=args.rollout_num_gpus or 0,
            rollout_num_gpus_per_engine=args.rollout_num_gpus_per_engine or 1,
            colocate=bool(args.colocate),
            debug_rollout_only=bool(args.debug_rollout_only),
            debug_train_only=bool(args.debug_train_only),
            external_engines=args.rollout_external_engine_addrs is not None,
            device=args.device,
            train_env_vars=dict(args.train_env_vars or {}),
            offload_train=bool(args.offload_train),
        )
