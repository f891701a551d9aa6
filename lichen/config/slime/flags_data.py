"""The classes of lichen's slime/Megatron flag table and the row type: shared by the table's modules
(slime_flags, slime_parser_flags)."""

from __future__ import annotations

from dataclasses import dataclass

SAME = "same"
DIFFERS_CLASS = "differs"
MAPPED = "mapped"
CHECKED = "checked"
NA_SHARDING = "not applicable (FSDP2 sharding)"
NA_NO_EFFECT = "not applicable (no effect on results)"
NOT_YET = "not available yet"
REMOVED = "removed"
UNKNOWN = "unknown"
# The classes in the order the table prints them; the last three stop the run (exit code 2). "differs": lichen's
# flag of slime's name whose default or meaning is not slime's (the note says how; DIFFERS / VALUE_DIFFERS).
CLASSES = (SAME, DIFFERS_CLASS, MAPPED, CHECKED, NA_SHARDING, NA_NO_EFFECT, NOT_YET, REMOVED, UNKNOWN)
BLOCKING = (NOT_YET, REMOVED, UNKNOWN)


@dataclass(frozen=True)
class FlagRule:
    """One slime/Megatron flag: its class, what lichen does instead, and why."""

    cls: str
    lichen: str
    reason: str


def rules(cls: str, lichen: str, reason: str, *flags: str) -> dict[str, FlagRule]:
    """One row per flag, all with the same class, lichen equivalent and reason."""
    return {flag: FlagRule(cls, lichen, reason) for flag in flags}
