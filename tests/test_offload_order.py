"""The loop's offload call order (docs/architecture.md#offload), run against recording no-op trainer and rollout
objects, so it is checked on CPU the way it runs on GPUs (the Ray runtime's RayTrainGroup and the engines take the
same calls): colocated, --offload-train only, --offload-rollout only, --debug-rollout-only. Then the same runs with a
trainer whose offload, onload and weight reads go through torch_memory_saver's tagged regions as a Ray rank's do
(lichen.train.memory_saver, its recording backend in place of the library)."""

from __future__ import annotations

import pytest

from lichen import loop
from lichen.config import parse_train_args
from lichen.train.memory_saver import RecordingBackend, TaggedMemory


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []


class FakeTrainer(loop.NullTrainer):  # the rest of the Trainer contract: no-ops
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def train(self, rollout_id, batch) -> dict:
        self.rec.calls.append("train")
        return {}

    def offload(self) -> None:
        self.rec.calls.append("trainer.offload")

    def onload(self) -> None:
        self.rec.calls.append("trainer.onload")


class TaggedTrainer(loop.NullTrainer):
    """FakeTrainer's surface with DistTrainer's memory calls: tagged pause/resume, and weight reads (the sync's
    gather) inside TaggedMemory.weights_resident."""

    def __init__(self, rec: Recorder) -> None:
        self.rec, self.memory = rec, TaggedMemory(RecordingBackend(rec.calls))

    def train(self, rollout_id, batch) -> dict:
        self.rec.calls.append("train")
        return {}

    def offload(self) -> None:
        self.memory.offload()

    def onload(self) -> None:
        self.memory.onload()

    def named_weights(self):
        with self.memory.weights_resident():
            self.rec.calls.append("gather")
        return iter(())


class FakeRollout:
    engines: list = []

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def generate(self, rollout_id):
        self.rec.calls.append("generate")
        return [], {}

    def offload(self) -> None:
        self.rec.calls.append("rollout.release(weights,kv_cache)")

    def onload(self, tags=None) -> None:
        self.rec.calls.append(f"rollout.resume({','.join(tags)})")


class Logger:
    def log(self, step, metrics) -> None:
        pass


def _calls(monkeypatch, tiny_ckpt, addition_data, tmp_path, *flags, trainer_cls=FakeTrainer) -> list[str]:
    args = parse_train_args(
        [
            "--hf-checkpoint",
            tiny_ckpt,
            "--prompt-data",
            addition_data,
            "--rm-type",
            "math",
            "--num-rollout",
            "2",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--output-dir",
            str(tmp_path),
            "--no-progress",
            *flags,
        ]
    )
    rec = Recorder()
    trainer = loop.NullTrainer() if args.debug_rollout_only else trainer_cls(rec)

    def push(t, r, version, cfg=None) -> dict:  # reads the weights as lichen.sync.push does (when it has them)
        named = getattr(t, "named_weights", None)
        if named is not None:
            list(named())
        rec.calls.append(f"sync{version}")
        return {}

    monkeypatch.setattr(loop.sync, "push", push)
    loop.train_loop(args, trainer, FakeRollout(rec), Logger())
    return rec.calls


STEP_BOTH = [
    "generate",
    "rollout.release(weights,kv_cache)",
    "trainer.onload",
    "train",
    "trainer.offload",
    "rollout.resume(weights)",
    "sync{v}",
    "rollout.resume(kv_cache)",
]


def _steps(template: list[str]) -> list[str]:
    return [c.format(v=v) for v in (1, 2) for c in template]


@pytest.mark.parametrize(
    "flags,expected",
    [
        # colocated (both offloads): the trainer leaves the devices before the first rollout, then every step the
        # engines release everything for training, take their weights back for the sync, then their KV cache
        (["--colocate"], ["sync0", "trainer.offload"] + _steps(STEP_BOTH)),
        (
            ["--offload-train"],
            ["sync0", "trainer.offload"]
            + _steps(["generate", "trainer.onload", "train", "trainer.offload", "sync{v}"]),
        ),
        (
            ["--offload-rollout"],
            ["sync0"]
            + _steps(
                [
                    "generate",
                    "rollout.release(weights,kv_cache)",
                    "train",
                    "rollout.resume(weights)",
                    "sync{v}",
                    "rollout.resume(kv_cache)",
                ]
            ),
        ),
        # no trainer: nothing to make room for, so no offload call at all (placement forces both offloads off)
        (["--debug-rollout-only", "--colocate"], ["sync0"] + _steps(["generate", "sync{v}"])),
    ],
)
def test_offload_call_order(monkeypatch, tiny_ckpt, addition_data, tmp_path, flags, expected):
    assert _calls(monkeypatch, tiny_ckpt, addition_data, tmp_path, *flags) == expected


# ---- torch_memory_saver by region tag (a Ray rank started with its hook) ------------------------------------------
PAUSE = ["synchronize", "pause(default)", "pause(optimizer)", "pause(weights)"]
RESUME = ["resume(weights)", "resume(optimizer)", "resume(default)"]
READ_PAUSED = ["resume(weights)", "disable", "gather", "end disable", "synchronize", "pause(weights)"]


@pytest.mark.parametrize(
    "flags,expected",
    [
        # colocated: everything paused for the rollout, all of it back for training; after training the default
        # region (activations, gradients) goes first and the weights last, and the sync (once the engines took their
        # weights back) brings only the weights back while it reads them
        (
            ["--colocate"],
            ["gather", "sync0", *PAUSE]
            + _steps(
                [
                    "generate",
                    "rollout.release(weights,kv_cache)",
                    *RESUME,
                    "train",
                    *PAUSE,
                    "rollout.resume(weights)",
                    *READ_PAUSED,
                    "sync{v}",
                    "rollout.resume(kv_cache)",
                ]
            ),
        ),
        (
            ["--offload-train"],
            ["gather", "sync0", *PAUSE] + _steps(["generate", *RESUME, "train", *PAUSE, *READ_PAUSED, "sync{v}"]),
        ),
        # the trainer is never paused: its weights are read as they are
        (
            ["--offload-rollout"],
            ["gather", "sync0"]
            + _steps(
                [
                    "generate",
                    "rollout.release(weights,kv_cache)",
                    "train",
                    "rollout.resume(weights)",
                    "gather",
                    "sync{v}",
                    "rollout.resume(kv_cache)",
                ]
            ),
        ),
        (["--debug-rollout-only", "--colocate"], ["sync0"] + _steps(["generate", "sync{v}"])),
    ],
)
def test_tagged_memory_saver_order(monkeypatch, tiny_ckpt, addition_data, tmp_path, flags, expected):
    assert _calls(monkeypatch, tiny_ckpt, addition_data, tmp_path, *flags, trainer_cls=TaggedTrainer) == expected
