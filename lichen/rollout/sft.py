"""SFT "rollout": the data set's labels become the responses, no generation.

Use with `--loss-type sft_loss --rollout-function-path lichen.rollout.sft.generate_rollout` for warm-ups: the
trainer then minimizes -log p(label tokens | prompt) through the same loop, checkpoints and evaluation as RL.
The response is the label's text followed by the tokenizer's EOS token (so the model learns to stop).
"""

from __future__ import annotations

from lichen.errors import DataError
from lichen.types import Sample, Status


def generate_rollout(args, rollout_id: int, prompts, manager) -> list[list[Sample]]:
    tok = manager.tokenizer
    eos = tok.eos_token_id
    groups = []
    for pos, (data_index, record) in enumerate(prompts):
        if record.label is None:
            raise DataError(f"--loss-type sft_loss: prompt {data_index} of --prompt-data has no {args.label_key!r}")
        ids = manager.encode(data_index, record)
        resp = tok.encode(str(record.label), add_special_tokens=False) + ([eos] if eos is not None else [])
        group = []
        for j in range(args.n_samples_per_prompt):
            group.append(
                Sample(
                    prompt=record.prompt,
                    tokens=list(ids) + resp,
                    response=str(record.label),
                    response_length=len(resp),
                    label=record.label,
                    reward=None,  # supervised: nothing is scored (no reward metrics)
                    loss_mask=[1] * len(resp),
                    status=Status.COMPLETED,
                    weight_versions=[manager.engine.weight_version],
                    metadata={**(record.metadata or {}), "prompt_index": data_index},
                    group_index=pos,
                    index=pos * args.n_samples_per_prompt + j,
                )
            )
        groups.append(group)
    return groups
