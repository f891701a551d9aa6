"""Running `lichen train` in process from tests: the common flags, the run itself, the weights it saved."""

from __future__ import annotations

from lichen.cli import main
from lichen.observe.metrics import read_metrics
from lichen.torch_files import load_plain
from lichen.weights.hf_io import load_hf_state_dict

THREADS = ["--num-threads", "1"]  # for launched servers: 2 loaded cores, more threads per process only oversubscribe


def base_args(ckpt, data, out, *extra):
    return [
        "train",
        "--hf-checkpoint",
        ckpt,
        "--prompt-data",
        data,
        "--custom-rm-path",
        "loop_plugins.digit_fraction",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--rollout-max-response-len",
        "8",
        "--lr",
        "1e-3",
        "--output-dir",
        str(out),
        "--no-progress",
        *extra,
    ]


def ray_args(ranks: int = 2, engine_gpus: int = 1) -> list[str]:
    """`--runtime ray` on this CPU: `ranks` trainer ranks and engines on `engine_gpus` of the test Ray instance's
    fake GPUs (tests/helpers/ray_local.py), one torch thread per process."""
    return ["--device", "cpu", *THREADS, "--runtime", "ray", "--actor-num-gpus-per-node", str(ranks),
            "--rollout-num-gpus", str(engine_gpus)]  # fmt: skip


def run(argv) -> list[dict]:
    assert main(argv) == 0
    out = argv[argv.index("--output-dir") + 1]
    return read_metrics(out)


def final_weights(save_dir) -> dict:
    last = int(open(f"{save_dir}/latest_checkpointed_iteration.txt").read())
    return load_hf_state_dict(f"{save_dir}/iter_{last:07d}/hf")


def run_stopped_after_sync(argv, stop_at: int) -> None:
    """Run `lichen train argv` and stop it right after the sync of weight version `stop_at` (as a crash would:
    the checkpoint of that step is complete, nothing after it runs)."""
    import pytest

    from lichen import sync

    class Stop(Exception):
        pass

    orig_push = sync.push

    def push_then_stop(trainer, rollout, version, cfg=None):
        out = orig_push(trainer, rollout, version, cfg)
        if version == stop_at:
            raise Stop
        return out

    sync.push = push_then_stop  # the drivers call sync.push through the module, so both see this one
    try:
        with pytest.raises(Stop):
            main(argv)
    finally:
        sync.push = orig_push


def read_dump(path) -> dict:
    """A --save-debug-rollout-data dump, read as lichen reads it: tensors and plain data only (weights_only)."""
    return load_plain(str(path), "rollout dump")


def dumped_samples(path) -> list[dict]:
    """Every sample of a dump, groups flattened in order."""
    return [s for g in read_dump(path)["samples"] for s in g]


def pop_engines(sample: dict) -> list[str]:
    """Remove and return the engine URL(s) a dumped sample names (one per call for multi-call samples; none from
    the in-process engine): which server answered is routing, not data, so runs compare samples without it."""
    served = sample["metadata"].pop("engine", [])
    return served if isinstance(served, list) else [served]
