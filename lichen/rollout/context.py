"""`lichen.rollout.context.current()`: what a rollout function reaches of lichen besides its arguments.

While the rollout worker runs a rollout or eval function (`--rollout-function-path`, `--eval-function-path`, or
lichen's own), `current()` returns the worker's `RolloutContext`:

    ctx = current()
    ctx.engine             # generate(list[GenRequest]) -> list[GenResult]; over engine servers also agenerate
    ctx.tokenizer          # the policy's Hugging Face tokenizer
    ctx.reward_fn          # the training reward, fn(args, sample); score with lichen.rewards.score_samples
    ctx.encode(i, record)  # the prompt ids of data-source record i (chat template applied as configured)
    ctx.eval_sets          # eval data set name -> (resolved config, records)
    ctx.eval_reward_fns    # eval data set name -> reward function
    ctx.config             # lichen's RolloutConfig (lichen.config.rollout_config)

Outside such a call it raises RuntimeError.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING, Any, Iterator

from lichen.models.tokenizer import encode_prompt

if TYPE_CHECKING:  # rollout does not import lichen.config at run time (docs/architecture.md#import-directions)
    from lichen.config.rollout_config import RolloutConfig


class RolloutContext:
    """The engine, tokenizer, rewards and eval sets of one rollout worker (see the module docstring)."""

    def __init__(
        self,
        *,
        args: Any,
        config: "RolloutConfig",
        engine: Any,
        tokenizer: Any,
        reward_fn: Any = None,
        eval_sets: dict | None = None,
        eval_reward_fns: dict | None = None,
    ) -> None:
        self.args = args  # opaque here: only handed on to user plug-ins
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.eval_sets = eval_sets or {}
        self.eval_reward_fns = eval_reward_fns or {}
        self.metrics: dict = {}  # what a rollout called the old way leaves for the step's metrics
        self.rollout_id: int | None = None  # the step lichen's rollout is generating (sample hooks are told it)
        self._encoded: dict[tuple[str, int], list[int]] = {}

    def encode(self, data_index: int, record: Any, dataset: str | None = None) -> list[int]:
        """The prompt ids of `record` (cached per data set and index); `dataset` names an eval set (None: the
        training prompts); eval sets use their own chat setting."""
        key = (dataset, data_index)
        if key not in self._encoded:
            self._encoded[key] = self.encode_record(record, dataset)
        return self._encoded[key]

    def encode_record(self, record: Any, dataset: str | None = None, max_chars: int | None = None) -> list[int]:
        """The prompt ids of `record`; over `max_chars` characters of text raises PromptTooLong untokenized."""
        chat = (
            self.config.data.apply_chat_template
            if dataset is None
            else self.eval_sets[dataset][0]["apply_chat_template"]
        )
        return encode_prompt(self.tokenizer, record.prompt, chat, record.tools, max_chars=max_chars)


_CURRENT: contextvars.ContextVar[RolloutContext] = contextvars.ContextVar("lichen_rollout_context")


def current() -> RolloutContext:
    """The context of the rollout or eval function running now (see the module docstring)."""
    try:
        return _CURRENT.get()
    except LookupError:
        raise RuntimeError(
            "lichen.rollout.context.current() is only available inside a rollout or eval function "
            "called by lichen's rollout worker"
        ) from None


@contextlib.contextmanager
def active(ctx: RolloutContext) -> Iterator[RolloutContext]:
    """Make `ctx` the one `current()` returns for the duration of the block."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
