"""Trainer-level properties: micro-batch split invariance, token-budget packing, bf16, checkpointing, epochs."""

import pytest
import torch

from lichen.train.batch import split_by_tokens

from test_loop_invariants import base_args, final_weights, run


def weights_after(tiny_ckpt, data, tmp_path, name, *extra):
    run(base_args(tiny_ckpt, data, tmp_path / name, "--num-rollout", "2", "--save", str(tmp_path / f"c{name}"),
                  *extra))
    return final_weights(tmp_path / f"c{name}")


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_update_does_not_depend_on_micro_batch_split(tiny_ckpt, addition_data, tmp_path):
    w1 = weights_after(tiny_ckpt, addition_data, tmp_path, "m1", "--micro-batch-size", "1")
    w16 = weights_after(tiny_ckpt, addition_data, tmp_path, "m16", "--micro-batch-size", "16")
    wdyn = weights_after(tiny_ckpt, addition_data, tmp_path, "dyn", "--use-dynamic-batch-size",
                         "--max-tokens-per-gpu", "40")
    assert max_diff(w1, w16) <= 1e-6 and max_diff(w1, wdyn) <= 1e-6
    w0 = final_weights.__globals__["load_hf_state_dict"](tiny_ckpt)
    assert max_diff(w1, w0) > 1e-5  # training did move the weights


def odd_groups_without_signal(args, samples, *, rewards, mask, kl):
    """Advantage (reward - 0.05) on even prompt groups, exactly 0 on odd ones."""
    keep = torch.tensor([s.group_index % 2 == 0 for s in samples], dtype=rewards.dtype)
    return ((rewards - 0.05) * keep)[:, None] * mask


def test_sorted_packed_skipping_run_equals_the_plain_one(tiny_ckpt, addition_data, tmp_path, monkeypatch):
    """Whole loop, 2 rollouts: micro-batches over length-sorted, packed samples with zero-advantage samples
    skipped give the same weights as sample-order, one-row-per-sample micro-batches with every sample trained."""
    from lichen.train.actor import TrainActor

    flags = ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "60",
             "--custom-advantage-function-path", "test_trainer.odd_groups_without_signal")
    rows = run(base_args(tiny_ckpt, addition_data, tmp_path / "probe", "--num-rollout", "1", *flags))
    assert rows[0]["train/skipped_samples"] == 8  # 2 of the 4 groups have no signal
    fast = weights_after(tiny_ckpt, addition_data, tmp_path, "fast", *flags)
    init = TrainActor.__init__

    def plain_init(self, args):
        init(self, args)
        self.sort_by_length = self.pack_sequences = self.skip_zero_advantage = False

    monkeypatch.setattr(TrainActor, "__init__", plain_init)
    plain = weights_after(tiny_ckpt, addition_data, tmp_path, "plain", *flags)
    assert max_diff(fast, plain) <= 1e-6
    w0 = final_weights.__globals__["load_hf_state_dict"](tiny_ckpt)
    assert max_diff(plain, w0) > 1e-5


def test_bf16_and_gradient_checkpointing_run(tiny_ckpt, addition_data, tmp_path):
    ref = weights_after(tiny_ckpt, addition_data, tmp_path, "ref", "--micro-batch-size", "4")
    gc = weights_after(tiny_ckpt, addition_data, tmp_path, "gc", "--micro-batch-size", "4", "--gradient-checkpointing")
    assert max_diff(ref, gc) <= 1e-6  # recomputation changes memory, not math
    bf = weights_after(tiny_ckpt, addition_data, tmp_path, "bf", "--micro-batch-size", "4", "--bf16")
    assert all(v.dtype == torch.float32 for v in bf.values())  # fp32 master weights
    assert 0 < max_diff(ref, bf) < 1e-2  # bf16 compute: close to fp32, not identical


def test_num_epoch_sets_the_number_of_steps(tiny_ckpt, addition_data, tmp_path):
    rows = run(base_args(tiny_ckpt, addition_data, tmp_path / "r", "--num-epoch", "1", "--rollout-batch-size", "16",
                         "--micro-batch-size", "16"))
    assert len(rows) == 64 // 16


def test_split_by_tokens_respects_budget_and_order():
    lengths = [5, 9, 3, 12, 4, 4, 30]
    splits = split_by_tokens(list(range(7)), lengths, 20)
    assert [i for s in splits for i in s] == list(range(7))
    for s in splits:
        assert len(s) == 1 or len(s) * max(lengths[i] for i in s) <= 20


def test_tis_weights_truncate_and_icepop():
    from types import SimpleNamespace

    from lichen.train.actor import TrainActor

    actor = TrainActor.__new__(TrainActor)
    actor.tis_fn = None
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    rollout = torch.log(torch.tensor([[0.1, 0.4, 0.9]]))  # ratios 5, 0.5, 1
    m = torch.ones(1, 3)
    actor.args = SimpleNamespace(tis_mode="truncate", tis_clip=2.0, tis_clip_low=0.6)
    assert torch.allclose(actor._tis_weights(old, rollout, m), torch.tensor([[2.0, 0.6, 1.0]]))
    actor.args.tis_mode = "icepop"
    assert torch.allclose(actor._tis_weights(old, rollout, m), torch.tensor([[0.0, 0.0, 1.0]]))


def test_tis_in_the_loop_and_custom_tis_contract(tiny_ckpt, addition_data, tmp_path):
    rows = run(base_args(tiny_ckpt, addition_data, tmp_path / "t", "--num-rollout", "1", "--micro-batch-size", "4",
                         "--use-tis", "--force-recompute-old-log-probs"))
    assert rows[0]["train/tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # engine and trainer agree on CPU
    rows = run(base_args(tiny_ckpt, addition_data, tmp_path / "z", "--num-rollout", "1", "--micro-batch-size", "4",
                         "--use-tis", "--custom-tis-function-path", "loop_plugins.zero_tis"))
    assert rows[0]["train/grad_norm"] == 0.0  # the plug-in's zero weights really reached the loss
