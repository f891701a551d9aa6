"""--only-train-params-name-list / --freeze-params-name-list (slime's flags): train a subset of the policy's
parameters, chosen by regexes over their names.

As slime (slime/backends/megatron_utils/model_provider.freeze_model_params): a name is selected when
`re.search(pattern, name)` finds any of the patterns; with the only-train list every unselected parameter is frozen,
with the freeze list every selected one. A frozen parameter gets requires_grad=False, so it has no gradient, is
not in the optimizer (TrainActor builds AdamW over the parameters that require a gradient) and keeps its value
bit for bit. Weight sync still sends it: the engines keep serving the same values.

lichen is stricter than slime in one way: a pattern that matches no parameter is a usage error naming the flag (a
typo would otherwise train the whole model, or nothing). With --use-lora the base weights are frozen already, so
the patterns select among the adapters' names (`...q_proj.lora_A.default.weight`).
"""

from __future__ import annotations

from torch import nn

from lichen.config.train_config import ParamFilterConfig, compile_name_patterns
from lichen.errors import ConfigError

ONLY_TRAIN_FLAG = "--only-train-params-name-list"
FREEZE_FLAG = "--freeze-params-name-list"


def apply_param_filter(model: nn.Module, cfg: ParamFilterConfig, *, lora: bool) -> list[str]:
    """Freeze `model`'s parameters as cfg's name lists say, among those that train now (`lora`: the adapters);
    returns the names frozen here (empty without either flag). Raises ConfigError when a pattern matches no such
    parameter or nothing would be left to train."""
    if cfg.only_train_params_name_list:
        flag, patterns, train_selected = ONLY_TRAIN_FLAG, cfg.only_train_params_name_list, True
    elif cfg.freeze_params_name_list:
        flag, patterns, train_selected = FREEZE_FLAG, cfg.freeze_params_name_list, False
    else:
        return []
    compiled = compile_name_patterns(patterns, flag)
    candidates = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    among = "LoRA adapter" if lora else "model"
    for pattern, rx in zip(patterns, compiled):
        if not any(rx.search(name) for name, _ in candidates):
            examples = ", ".join(name for name, _ in candidates[:3])
            raise ConfigError(
                f"{flag}: {pattern!r} matches no {among} parameter name (re.search); names look like {examples}"
                + (" (with --use-lora the patterns select among the adapters)" if lora else "")
            )
    frozen = []
    for name, p in candidates:
        selected = any(rx.search(name) for rx in compiled)
        if selected != train_selected:
            p.requires_grad_(False)
            frozen.append(name)
    if len(frozen) == len(candidates):
        raise ConfigError(f"{flag} {' '.join(patterns)} freezes every {among} parameter: nothing would train")
    return frozen
