"""User-facing messages the rollout raises and the flag validation (lichen.config) raises too, earlier.

A leaf module, cheap to import: validation runs before torch loads.
"""

PARTIAL_NEEDS_SERVERS = (
    "--partial-rollout needs engine servers that can abort requests (--rollout-num-engines K or "
    "--rollout-external-engine-addrs HOST:PORT ...): the in-process engine generates a round in one call, so "
    "nothing is cut off to continue; add one of those flags or drop --partial-rollout"
)
PARTIAL_WITH_CUSTOM_GENERATE = (
    "--partial-rollout with --custom-generate-function-path: a custom generate function makes its own engine "
    "calls, which lichen cannot abort and continue; drop one of the two"
)
