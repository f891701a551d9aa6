"""The default work bounds of `lichen serve` (its flags' defaults; enforced by lichen.engines.server.limits).

A leaf module: the server (lichen.engines.server.serve), the limits it enforces (lichen.engines.server.limits) and the launcher
of engines for `lichen train` (lichen.engines.clients.launch_args) read the same numbers without importing one another.
"""

from __future__ import annotations

# Sized from what a training step asks of one engine: slime's scripts send up to 2,048 sequences per step.
DEFAULT_MAX_REQUEST_SEQUENCES = 2048
DEFAULT_MAX_QUEUED_SEQUENCES = 4096
DEFAULT_MAX_QUEUED_TOKENS = 4096 * 4096
DEFAULT_HEADER_TIMEOUT = 20.0
# Request bodies: lichen's client sends one prompt's input_ids per request (under 1 MB for a 64k context); 16 MiB
# leaves room for batches and long chat histories while JSON decoding stays well under a second.
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
DEFAULT_BODY_TIMEOUT = 60.0
