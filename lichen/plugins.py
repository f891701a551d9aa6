"""Loading user plug-ins by dotted path (`package.module.attr`), as `--custom-rm-path` and friends take them.

slime's launch scripts name slime's own functions by dotted path (`slime.rollout.sft_rollout.generate_rollout`, a
filter of its filter hub, its reward hub's entry point). `SLIME_ALIASES` is the one table that turns each into
lichen's equivalent wherever a dotted path is loaded; docs/slime-compat.md lists it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from lichen.errors import ConfigError


@dataclass(frozen=True)
class PluginAlias:
    """What a slime dotted path becomes: lichen's function (`target`), or None where lichen does it without a
    plug-in (`instead` says how)."""

    target: str | None
    instead: str


# A row without a target names what lichen does without a plug-in (its --rm-type hub for slime's rm hub entry
# points): the config check drops the path (lichen.config.rollout); the others load lichen's function of the same
# contract.
_RM_HUB = "lichen's reward hub of --rm-type (per sample; a sample's metadata rm_type wins), as slime's"
SLIME_ALIASES: dict[str, PluginAlias] = {
    "slime.rollout.sglang_rollout.generate_rollout": PluginAlias(
        "lichen.rollout.generate.generate_rollout", "lichen's default rollout function"
    ),
    "slime.rollout.sft_rollout.generate_rollout": PluginAlias(
        "lichen.rollout.sft.generate_rollout", "lichen's SFT rollout: the data's responses, no generation"
    ),
    "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std": PluginAlias(
        "lichen.rollout.filters.check_reward_nonzero_std", "keeps a group whose rewards are not all equal"
    ),
    "slime.rollout.forge_load.generate_rollout": PluginAlias(
        "lichen.rollout.forge_load.generate_rollout", "replays --load-forge-rollout-data with engines and sync live"
    ),
    "slime.rollout.rm_hub.async_rm": PluginAlias(None, _RM_HUB),
    "slime.rollout.rm_hub.batched_async_rm": PluginAlias(None, _RM_HUB + "; drop --group-rm"),
    "slime.rollout.sglang_rollout.generate": PluginAlias(
        None, "lichen's default generation: leave --custom-generate-function-path out"
    ),
}


def slime_alias(path: str) -> PluginAlias | None:
    """The alias row of one of slime's dotted paths, or None (also for slime paths lichen has no equivalent of)."""
    return SLIME_ALIASES.get(path)


def resolve_path(path: str) -> str:
    """`path` with a slime alias replaced by lichen's function (unchanged when it is not an alias)."""
    alias = SLIME_ALIASES.get(path)
    return alias.target if alias is not None and alias.target is not None else path


def load_function(path: str, flag: str) -> Callable[..., Any]:
    """Import `module.attr` (or the lichen function a slime path aliases) and return the attribute; any failure is
    a ConfigError naming `flag`."""
    alias = SLIME_ALIASES.get(path)
    if alias is not None and alias.target is None:
        raise ConfigError(f"{flag} {path!r}: slime's function is {alias.instead}; no plug-in path is needed")
    if alias is None and path.split(".", 1)[0] == "slime":
        raise ConfigError(
            f"{flag} {path!r}: lichen has no equivalent of this slime function (the ones it maps are listed in "
            "docs/slime-compat.md#slimes-plug-in-paths); give a function of your own"
        )
    path = resolve_path(path)
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{flag} {path!r}: expected a dotted path 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module itself raising at import
        raise ConfigError(f"{flag} {path!r}: cannot import module {module_name!r}: {e}") from e
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{flag} {path!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(fn):
        raise ConfigError(f"{flag} {path!r}: {attr!r} is not callable")
    return fn
