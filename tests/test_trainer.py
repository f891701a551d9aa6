"""Trainer-level properties: micro-batch split invariance, token-budget packing, bf16, checkpointing, epochs."""

import copy
import dataclasses

import pytest
import torch
from helpers.runs import base_args, final_weights, run
from helpers.trainer import grads_of_step, make_actor, ragged_samples, recorded_grads

from lichen.train.micro_batches import split_by_tokens
from lichen.train.optim import clip_and_step
from lichen.weights.hf_io import load_hf_state_dict


def weights_after(tiny_ckpt, data, tmp_path, name, *extra):
    run(base_args(tiny_ckpt, data, tmp_path / name, "--num-rollout", "2", "--save", str(tmp_path / f"c{name}"), *extra))
    return final_weights(tmp_path / f"c{name}")


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def step_grads(actor, samples, **switches) -> tuple[dict, dict]:
    """(gradients, metrics) of one train step on a copy of `actor`; AdamW's division by sqrt(v) + eps can turn a
    1e-11 rounding difference of a gradient into a weight difference of ~lr, so the split property is tested on
    gradients (DEVELOPERS: compare against float64 references, not weights after an optimizer step)."""
    grads, metrics = grads_of_step(actor, samples, **switches)
    return {n: g.double() for n, g in grads.items()}, metrics


def float64_reference(actor, samples, **switches) -> tuple[dict, dict]:
    """The same step in float64, all samples in one micro-batch, sample order, no packing, no skipping."""
    ref = copy.deepcopy(actor)
    ref.model.double()
    batching = dataclasses.replace(ref.cfg.batching, micro_batch_size=len(samples), use_dynamic_batch_size=False)
    ref.cfg = dataclasses.replace(ref.cfg, batching=batching)
    ref.sort_by_length = ref.pack_sequences = ref.skip_zero_advantage = False
    for k, v in switches.items():
        setattr(ref, k, v)
    return step_grads(ref, samples)


def scaled_err(grads, ref) -> float:
    scale = max(g.abs().max().item() for g in ref.values())
    assert scale > 1e-4  # the gradient is not trivially zero, so the comparison can fail
    return max((grads[k] - ref[k]).abs().max().item() for k in ref) / scale


def scored_samples(actor, seed: int) -> list:
    """12 ragged samples (3 groups of 4) with mixed rewards: GRPO advantages are nonzero in every group."""
    samples = ragged_samples(actor.model.cfg.vocab_size, seed=seed)
    for i, s in enumerate(samples):
        s.reward = float((i * 7) % 5) / 4
    return samples


@pytest.mark.parametrize(
    "split",
    [
        ["--micro-batch-size", "1"],
        ["--micro-batch-size", "4"],
        ["--micro-batch-size", "12"],
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "40"],
    ],
)
def test_step_gradient_does_not_depend_on_micro_batch_split(tiny_ckpt, addition_data, tmp_path, split):
    """GRPO through TrainActor.train (advantages from the rewards, loss, gradient accumulation, clipping off):
    every micro-batch split gives the float64 one-batch gradient up to float32 rounding."""
    actor = make_actor(tiny_ckpt, addition_data, tmp_path, *split)
    samples = scored_samples(actor, seed=7)
    ref, ref_metrics = float64_reference(actor, samples)
    grads, metrics = step_grads(actor, samples)
    assert scaled_err(grads, ref) <= 1e-5
    for key in ("train/loss", "train/ppo_kl", "train/pg_clipfrac"):
        assert metrics[key] == pytest.approx(ref_metrics[key], abs=1e-6), key


def test_a_step_leaves_no_gradient_held(tiny_ckpt, addition_data, tmp_path):
    """After TrainActor.train the gradients are freed (rollout and weight sync then run without one more copy of
    the trained parameters); the step did see them."""
    actor = make_actor(tiny_ckpt, addition_data, tmp_path)
    with recorded_grads(actor.model, actor.optimizer) as seen:
        actor.train(0, [scored_samples(actor, seed=7)])
    assert len(seen) == 1 and max(g.abs().max().item() for g in seen[0].values()) > 0
    assert all(p.grad is None for p in actor.model.parameters())


@pytest.mark.parametrize("grad, steps", [(0.5, True), (float("nan"), False)])
def test_clip_and_step_frees_the_gradients_whether_it_stepped_or_not(grad, steps):
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), grad)
    _, stepped = clip_and_step(torch.optim.SGD([p], lr=0.1), [p], clip_grad=1.0, has_samples=True)
    assert stepped == steps and p.grad is None
    assert torch.equal(p.detach(), torch.ones(3)) != steps


def test_split_runs_through_the_loop_train_and_move_the_weights(tiny_ckpt, addition_data, tmp_path):
    """End to end (rollout -> train -> sync, 2 steps) every split trains; the split property itself is the
    gradient test above."""
    w0 = load_hf_state_dict(tiny_ckpt)
    for name, split in [
        ("m1", ["--micro-batch-size", "1"]),
        ("m16", ["--micro-batch-size", "16"]),
        ("dyn", ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "40"]),
    ]:
        assert max_diff(weights_after(tiny_ckpt, addition_data, tmp_path, name, *split), w0) > 1e-5


def odd_groups_without_signal(args, samples, *, rewards, mask, kl):
    """Advantage (reward - 0.05) on even prompt groups, exactly 0 on odd ones."""
    keep = torch.tensor([s.group_index % 2 == 0 for s in samples], dtype=rewards.dtype)
    return ((rewards - 0.05) * keep)[:, None] * mask


def test_sorted_packed_skipping_step_equals_the_plain_one(tiny_ckpt, addition_data, tmp_path):
    """Micro-batches over length-sorted, packed samples with zero-advantage samples skipped give the gradient of
    sample-order, one-row-per-sample micro-batches with every sample trained, and both the float64 one. The
    advantage plug-in is the one the loop loads by dotted path (checked end to end: it does skip)."""
    flags = (
        "--use-dynamic-batch-size",
        "--max-tokens-per-gpu",
        "40",
        "--custom-advantage-function-path",
        "test_trainer.odd_groups_without_signal",
    )
    rows = run(base_args(tiny_ckpt, addition_data, tmp_path / "probe", "--num-rollout", "1", *flags))
    assert rows[0]["train/skipped_samples"] == 8  # 2 of the 4 groups have no signal
    actor = make_actor(tiny_ckpt, addition_data, tmp_path, *flags)
    samples = scored_samples(actor, seed=8)
    fast, m_fast = step_grads(actor, samples)
    plain, _ = step_grads(actor, samples, sort_by_length=False, pack_sequences=False, skip_zero_advantage=False)
    ref, _ = float64_reference(actor, samples)
    assert m_fast["train/skipped_samples"] == 4  # group 1 of 3
    assert scaled_err(fast, ref) <= 1e-5 and scaled_err(plain, ref) <= 1e-5


def test_bf16_and_gradient_checkpointing_run(tiny_ckpt, addition_data, tmp_path):
    ref = weights_after(tiny_ckpt, addition_data, tmp_path, "ref", "--micro-batch-size", "4")
    gc = weights_after(tiny_ckpt, addition_data, tmp_path, "gc", "--micro-batch-size", "4", "--gradient-checkpointing")
    assert max_diff(ref, gc) <= 1e-6  # recomputation changes memory, not math
    bf = weights_after(tiny_ckpt, addition_data, tmp_path, "bf", "--micro-batch-size", "4", "--bf16")
    assert all(v.dtype == torch.float32 for v in bf.values())  # fp32 master weights
    assert 0 < max_diff(ref, bf) < 1e-2  # bf16 compute: close to fp32, not identical


def test_num_epoch_sets_the_number_of_steps_and_the_lr_decay(tiny_ckpt, addition_data, tmp_path):
    """The trainer's config carries the run's optimizer steps, known only once the epoch is resolved against the
    data set: a linear decay reaches --min-lr after exactly that many steps."""
    rows = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "r",
            "--num-epoch",
            "1",
            "--rollout-batch-size",
            "16",
            "--micro-batch-size",
            "16",
            "--lr-decay-style",
            "linear",
            "--min-lr",
            "0",
        )
    )
    assert len(rows) == 64 // 16
    assert [r["train/lr"] for r in rows] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4], rel=1e-9)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: DCP says so, rightly
def test_trainer_state_dict_round_trips_through_torch_distributed_checkpoint(tiny_ckpt, addition_data, tmp_path):
    """state_dict()/load_state_dict() hold everything a resume needs, in a layout torch.distributed.checkpoint
    saves and loads in place: a trainer restored from it takes the same next step as the one that saved it."""
    import torch.distributed.checkpoint as dcp

    a = make_actor(tiny_ckpt, addition_data, tmp_path, "--micro-batch-size", "4")
    b = copy.deepcopy(a)
    first, second = scored_samples(a, seed=11), scored_samples(a, seed=12)
    a.train(0, [first])
    b.train(0, [second])  # other steps: the optimizer state has a's shape, not its values or step count
    b.train(1, [first])
    dcp.save(a.state_dict(), checkpoint_id=str(tmp_path / "dcp"))
    state = b.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    b.load_state_dict(state)
    assert b.opt_step == a.opt_step == 1
    a.train(1, [second])
    b.train(1, [second])  # the same step: the same learning rate, moments and bias correction
    assert max_diff(dict(a.model.named_parameters()), dict(b.model.named_parameters())) == 0.0


def test_split_by_tokens_respects_budget_and_order():
    lengths = [5, 9, 3, 12, 4, 4, 30]
    splits = split_by_tokens(list(range(7)), lengths, 20)
    assert [i for s in splits for i in s] == list(range(7))
    for s in splits:
        assert len(s) == 1 or len(s) * max(lengths[i] for i in s) <= 20


def test_tis_weights_truncate_and_icepop():
    from lichen.train.loss import tis_weights

    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    rollout = torch.log(torch.tensor([[0.1, 0.4, 0.9]]))  # ratios 5, 0.5, 1
    assert torch.allclose(
        tis_weights(old, rollout, mode="truncate", clip_low=0.6, clip=2.0), torch.tensor([[2.0, 0.6, 1.0]])
    )
    assert torch.allclose(
        tis_weights(old, rollout, mode="icepop", clip_low=0.6, clip=2.0), torch.tensor([[0.0, 0.0, 1.0]])
    )


def test_tis_in_the_loop_and_custom_tis_contract(tiny_ckpt, addition_data, tmp_path):
    rows = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "t",
            "--num-rollout",
            "1",
            "--micro-batch-size",
            "4",
            "--use-tis",
            "--force-recompute-old-log-probs",
        )
    )
    assert rows[0]["train/tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # engine and trainer agree on CPU
    rows = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "z",
            "--num-rollout",
            "1",
            "--micro-batch-size",
            "4",
            "--use-tis",
            "--custom-tis-function-path",
            "loop_plugins.zero_tis",
        )
    )
    assert rows[0]["train/grad_norm"] == 0.0  # the plug-in's zero weights really reached the loss


@pytest.mark.parametrize("max_tokens", [None, 30])
def test_step_schedule_places_every_sample_once_per_optimizer_step(max_tokens):
    """The schedule of a whole train step, made before any optimizer step: each global batch's samples are
    either trained (in exactly one micro-batch) or skipped; observed ones are skipped ones given a no-grad forward;
    the critic sees the whole global batch."""
    from lichen.train.step_schedule import MicroBatchPlanner, schedule_steps

    lengths = [5, 9, 3, 12, 4, 4, 30, 7, 8, 2, 6, 11]
    mask = torch.ones(12, 4)
    mask[3] = 0  # masked out: skipped whatever its advantage
    adv = torch.tensor([0.0, 1.0, 0.0, 2.0, -1.0, 0.0, 0.5, 0.0, 0.0, 3.0, 0.0, 1.0])[:, None] * torch.ones(12, 4)
    planner = MicroBatchPlanner(micro_batch_size=2, max_tokens=max_tokens)
    steps = schedule_steps(
        planner,
        lengths,
        mask,
        adv,
        num_steps=3,
        skip=True,
        zero_advantage_is_zero_loss=True,
        needs_log_probs=False,
        record_first_log_probs=True,
        with_critic=True,
    )
    assert [s.indices for s in steps] == [list(range(k * 4, k * 4 + 4)) for k in range(3)]
    for s in steps:
        trained = [i for mb in s.trained for row in mb for i in row]
        observed = [i for mb in s.observed for row in mb for i in row]
        assert sorted(trained + s.skipped) == s.indices and len(set(trained)) == len(trained)
        assert set(observed) <= set(s.skipped) and 3 not in observed
        assert sorted(i for mb in s.critic for row in mb for i in row) == s.indices
    assert steps[0].skipped == [0, 2, 3] and sorted(i for mb in steps[0].observed for row in mb for i in row) == [0, 2]
    assert steps[1].observed == [] and steps[1].skipped == [5, 7]  # the mismatch metric reads the first step only
