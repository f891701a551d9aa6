"""`lichen serve`: the SGLang-protocol HTTP server around the embedded engine (comes with the Rollout servers
issue). Until then the command exits with code 2 and says so, instead of failing obscurely."""

from __future__ import annotations

from lichen.errors import NotAvailableYet


def main(argv: list[str]) -> int:
    raise NotAvailableYet(
        "`lichen serve` is not available yet: the SGLang-protocol server lands with the rollout-servers work; "
        "`lichen train` uses the in-process engine meanwhile"
    )
