"""Placement flags: colocated training and rollout, and which side releases its memory between phases.

Resolution (after the debug flags):
- `--debug-rollout-only` forces colocate and both offloads off (there is no training phase to make room for);
- `--offload` turns both on, an explicit --no-offload-train / --no-offload-rollout included (slime's rule);
- otherwise each of offload_train / offload_rollout is its explicit --x / --no-x value when given, else on with
  `--colocate`, else off.

With `--runtime ray` (docs/runtimes.md): the trainer is --actor-num-nodes x --actor-num-gpus-per-node ranks and
the engines take --rollout-num-gpus devices, --rollout-num-gpus-per-engine each; --rollout-num-gpus defaults to
--rollout-num-engines x per engine, else (colocated) to the trainer's devices; the engine count it gives becomes
--rollout-num-engines. Ray must be importable (`pip install 'lichen[ray]'`).
"""

from __future__ import annotations

import argparse

from lichen.errors import ConfigError

_RAY_ONLY = ("ray_address", "actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus", "max_trainer_restarts")


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("placement and offload")
    g.add_argument(
        "--colocate",
        action="store_true",
        help="trainer and engines share the same devices, taking turns; turns on --offload-train and "
        "--offload-rollout unless they are given explicitly",
    )
    g.add_argument(
        "--offload",
        action="store_true",
        help="--offload-train --offload-rollout, both on even when --no-offload-train / --no-offload-rollout is "
        "given (as slime)",
    )
    g.add_argument(
        "--offload-train",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the trainer releases its device memory while engines generate (default: on with --colocate or "
        "--offload, else off)",
    )
    g.add_argument(
        "--offload-rollout",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="engines release weights and KV cache while the trainer trains (default: on with --colocate or "
        "--offload, else off)",
    )
    r = parser.add_argument_group("Ray runtime (--runtime ray)")
    r.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="Ray cluster to join (default: $RAY_ADDRESS, else start a local Ray instance)",
    )
    r.add_argument("--actor-num-nodes", type=int, default=None, metavar="N", help="nodes of trainer ranks (default: 1)")
    r.add_argument(
        "--actor-num-gpus-per-node",
        type=int,
        default=None,
        metavar="G",
        help="trainer ranks per node, one device each (default: 1)",
    )
    r.add_argument(
        "--rollout-num-gpus",
        type=int,
        default=None,
        metavar="R",
        help="devices for the engines (default: --rollout-num-engines x --rollout-num-gpus-per-engine, "
        "else with --colocate the trainer's devices)",
    )
    r.add_argument(
        "--max-trainer-restarts",
        type=int,
        default=None,
        metavar="N",
        help="when a trainer rank dies (killed, OOM, a collective timing out), restart the ranks on the same "
        "bundles, rewind to the newest intact checkpoint (--save-interval bounds the steps replayed; before the "
        "first one, to step 0), re-sync the engines and go on, up to N times per run; 0: the run ends with one "
        "line. slime's --use-fault-tolerance (here too) covers the engines only; this is the trainer's "
        "counterpart (docs/fault-tolerance.md; default: 0)",
    )


def check(args: argparse.Namespace) -> None:
    _check_ray(args)
    if args.debug_rollout_only:
        args.colocate = False
        args.offload_train = False
        args.offload_rollout = False
        return
    if args.offload:
        args.offload_train = args.offload_rollout = True
    if args.offload_train is None:
        args.offload_train = bool(args.colocate)
    if args.offload_rollout is None:
        args.offload_rollout = bool(args.colocate)


def _check_ray(args: argparse.Namespace) -> None:
    if args.runtime != "ray":
        for dest in _RAY_ONLY:
            if getattr(args, dest, None) is not None:
                flag = "--" + dest.replace("_", "-")
                raise ConfigError(f"{flag} places Ray actors; add --runtime ray or drop {flag}")
        return
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError("--runtime ray needs Ray, which is not installed: pip install 'lichen[ray]'") from None
    args.max_trainer_restarts = args.max_trainer_restarts or 0
    if args.max_trainer_restarts < 0:
        raise ConfigError(f"--max-trainer-restarts {args.max_trainer_restarts}: give a whole number >= 0")
    if args.max_trainer_restarts and args.fully_async:
        raise ConfigError(
            "--max-trainer-restarts does not work with --fully-async yet (its worker's requests in flight are not "
            "rewound); use --async or the synchronous driver, or drop the flag"
        )
    for dest in ("actor_num_nodes", "actor_num_gpus_per_node"):
        if getattr(args, dest) is None:
            setattr(args, dest, 1)
        elif getattr(args, dest) < 1:
            raise ConfigError(f"--{dest.replace('_', '-')} {getattr(args, dest)}: give a whole number >= 1")
    if args.rollout_external_engine_addrs is not None or args.debug_train_only:
        return
    per_engine = args.rollout_num_gpus_per_engine or 1
    if args.rollout_num_gpus is None:
        if args.rollout_num_engines:
            args.rollout_num_gpus = args.rollout_num_engines * per_engine
        elif args.colocate:
            args.rollout_num_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
        else:
            raise ConfigError(
                "--runtime ray: give --rollout-num-gpus R (devices for the engines) or --rollout-num-engines K"
            )
    if args.rollout_num_gpus < 1 or args.rollout_num_gpus % per_engine:
        raise ConfigError(
            f"--rollout-num-gpus {args.rollout_num_gpus}: give a positive multiple of "
            f"--rollout-num-gpus-per-engine {per_engine}"
        )
    engines = args.rollout_num_gpus // per_engine
    if args.rollout_num_engines not in (None, engines):
        raise ConfigError(
            f"--rollout-num-engines {args.rollout_num_engines} disagrees with --rollout-num-gpus "
            f"{args.rollout_num_gpus} / --rollout-num-gpus-per-engine {per_engine} = {engines}; "
            "give one of them"
        )
    args.rollout_num_engines = engines  # Ray actors launch the engine servers (lichen.cluster.engine_actors)
