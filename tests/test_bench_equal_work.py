"""Equal work for `lichen bench rl` (issue 19): the trainer flag that turns the zero-advantage skip off, and the
harness pieces that make both frameworks do the same forward + backward on every sample."""

from __future__ import annotations

from lichen.types import Status

from helpers.trainer import make_actor, ragged_samples


def test_disable_zero_advantage_skip_runs_every_backward(tiny_ckpt, addition_data, tmp_path):
    """All rewards equal -> every GRPO advantage is 0: by default every backward is skipped; with the flag none."""
    def step(*extra):
        actor = make_actor(tiny_ckpt, addition_data, tmp_path, "--micro-batch-size", "4", *extra)
        samples = ragged_samples(actor.model.cfg.vocab_size, seed=3)  # every reward 0.0
        assert all(s.status == Status.COMPLETED for s in samples)
        return actor.train(0, [samples])

    assert step()["train/skipped_samples"] == 12
    assert step("--disable-zero-advantage-skip")["train/skipped_samples"] == 0
