"""The loop's offload call order (docs/architecture.md#offload), run against recording no-op trainer and rollout
objects, so it is checked on CPU the way it runs on GPUs (the Ray runtime's RayTrainGroup and the engines take the
same calls): colocated, --offload-train only, --offload-rollout only, --debug-rollout-only."""

from __future__ import annotations

import pytest

from lichen import loop
from lichen.config import parse_train_args


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []


class FakeTrainer:
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def train(self, rollout_id, batch) -> dict:
        self.rec.calls.append("train")
        return {}

    def offload(self) -> None:
        self.rec.calls.append("trainer.offload")

    def onload(self) -> None:
        self.rec.calls.append("trainer.onload")


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


def _calls(monkeypatch, tiny_ckpt, addition_data, tmp_path, *flags) -> list[str]:
    args = parse_train_args(["--hf-checkpoint", tiny_ckpt, "--prompt-data", addition_data, "--rm-type", "math",
                             "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                             "--output-dir", str(tmp_path), "--no-progress", *flags])
    rec = Recorder()
    trainer = loop.NullTrainer() if args.debug_rollout_only else FakeTrainer(rec)
    monkeypatch.setattr(loop.sync, "push", lambda t, r, version, cfg=None: rec.calls.append(f"sync{version}") or {})
    loop.train_loop(args, trainer, FakeRollout(rec), Logger())
    return rec.calls


STEP_BOTH = ["generate", "rollout.release(weights,kv_cache)", "trainer.onload", "train", "trainer.offload",
             "rollout.resume(weights)", "sync{v}", "rollout.resume(kv_cache)"]


def _steps(template: list[str]) -> list[str]:
    return [c.format(v=v) for v in (1, 2) for c in template]


@pytest.mark.parametrize("flags,expected", [
    # colocated (both offloads): the trainer leaves the devices before the first rollout, then every step the
    # engines release everything for training, take their weights back for the sync, then their KV cache
    (["--colocate"], ["sync0", "trainer.offload"] + _steps(STEP_BOTH)),
    (["--offload-train"], ["sync0", "trainer.offload"] +
     _steps(["generate", "trainer.onload", "train", "trainer.offload", "sync{v}"])),
    (["--offload-rollout"], ["sync0"] +
     _steps(["generate", "rollout.release(weights,kv_cache)", "train", "rollout.resume(weights)", "sync{v}",
             "rollout.resume(kv_cache)"])),
    # no trainer: nothing to make room for, so no offload call at all (placement forces both offloads off)
    (["--debug-rollout-only", "--colocate"], ["sync0"] + _steps(["generate", "sync{v}"])),
])
def test_offload_call_order(monkeypatch, tiny_ckpt, addition_data, tmp_path, flags, expected):
    assert _calls(monkeypatch, tiny_ckpt, addition_data, tmp_path, *flags) == expected
