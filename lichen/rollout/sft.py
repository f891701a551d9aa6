"""SFT "rollout": the data set's labels become the responses, no generation.

Use with `--loss-type sft_loss --rollout-function-path lichen.rollout.sft.generate_rollout` for warm-ups: the
trainer then minimizes -log p(label tokens | prompt) through the same loop, checkpoints and evaluation as RL.
The response is the label's text followed by the tokenizer's EOS token (so the model learns to stop).
A rollout function under lichen.rollout.base_types' contract; evaluation is lichen's own.
"""

from __future__ import annotations

from typing import Any

from lichen.errors import DataError
from lichen.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from lichen.rollout.context import current
from lichen.rollout.eval import eval_rollout
from lichen.types import Status


def generate_rollout(
    args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    if evaluation:
        return eval_rollout(args, rollout_id, data_source)
    ctx = current()
    tok = ctx.tokenizer
    eos = tok.eos_token_id
    groups = data_source.get_samples(ctx.config.data.batch_size)
    for group in groups:
        label = group[0].label
        if label is None:
            raise DataError(
                f"--loss-type sft_loss: prompt {group[0].metadata['prompt_index']} of --prompt-data has "
                f"no {args.label_key!r}"
            )
        resp = tok.encode(str(label), add_special_tokens=False) + ([eos] if eos is not None else [])
        for s in group:
            s.tokens = list(s.tokens) + resp
            s.response = str(label)
            s.response_length = len(resp)
            s.reward = None  # supervised: nothing is scored (no reward metrics)
            s.loss_mask = [1] * len(resp)
            s.status = Status.COMPLETED
            s.weight_versions = [ctx.engine.weight_version]
    return RolloutFnTrainOutput(groups)
