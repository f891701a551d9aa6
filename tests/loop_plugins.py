"""Plug-ins loaded by dotted path in loop tests."""


def digit_fraction(args, sample) -> float:
    """A reward that varies across samples of a random model: the fraction of digits in the response."""
    text = sample.response
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def constant_rollout(args, rollout_id, prompts, manager):
    """--rollout-function-path contract: (args, rollout_id, [(data_index, PromptRecord)], manager) -> groups."""
    from lichen.types import Sample, Status

    groups = []
    for pos, (idx, rec) in enumerate(prompts):
        ids = manager.encode(idx, rec)
        resp = manager.tokenizer.encode("7", add_special_tokens=False) + [manager.tokenizer.eos_token_id]
        groups.append(
            [
                Sample(
                    prompt=rec.prompt,
                    tokens=ids + resp,
                    response="7",
                    response_length=2,
                    label=rec.label,
                    reward=float(j % 2),
                    loss_mask=[1, 1],
                    status=Status.COMPLETED,
                    group_index=pos,
                    index=pos * args.n_samples_per_prompt + j,
                    weight_versions=[manager.engine.weight_version],
                )
                for j in range(args.n_samples_per_prompt)
            ]
        )
    return groups


def reinforce_loss(args, *, log_probs, old_log_probs, advantages, mask, samples):
    """--custom-loss-function-path contract: per-token loss [b, R]; here plain REINFORCE: -A * log pi."""
    assert log_probs.shape == advantages.shape == mask.shape and len(samples) == log_probs.shape[0]
    return -advantages * log_probs


def zero_tis(args, *, old_log_probs, rollout_log_probs, mask):
    """--custom-tis-function-path contract: per-token weights [b, R]; zeros switch the policy loss off."""
    assert old_log_probs.shape == rollout_log_probs.shape == mask.shape
    return torch.zeros_like(mask)


import torch  # noqa: E402  (kept below the plug-ins so the contract reads first)


def constant_advantage(args, samples, *, rewards, mask, kl):
    """--custom-advantage-function-path contract: per-token advantages [B, R]."""
    assert rewards.shape[0] == len(samples) == mask.shape[0]
    return torch.full_like(mask, 0.25)


def zero_reducer(per_token, mask, *, global_num_samples, global_num_tokens, max_response_len):
    """--custom-pg-loss-reducer-function-path contract: this micro-batch's share of the policy loss."""
    return (per_token * mask).sum() * 0.0
