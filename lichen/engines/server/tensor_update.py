"""`POST /update_weights_from_tensor` of `lichen serve` (SGLang's body; docs/serve-protocol.md).

Body: `serialized_named_tensors` (one base64 entry per TP rank; lichen serve is one rank and reads entry 0),
`load_format` (null or "direct": the entry is a list of (name, tensor) pairs; "flattened_bucket": SGLang's
FlattenedTensorBucket, what slime sends), `flush_cache`,
`abort_all_requests`, `weight_version`. The entry holds handles to the sender's memory on this host
(lichen.sync.tensor_handles), read by lichen.engines.server.tensor_payload's restricted unpickler: a hostile entry is
answered 400 without anything it names being run. A name the model lacks or a wrong shape answers 400 naming
it and changes nothing; otherwise the tensors are copied into the served parameters between two decode steps
(the same exclusive call as the other weight updates) and the mapped memory is released before answering.
An admin key, when the server has one, is required (lichen.engines.api.auth).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from aiohttp import web

from lichen.engines.api.protocol import expect
from lichen.engines.server.tensor_payload import PayloadError, load_named_tensors
from lichen.engines.server.weight_endpoints import _reply
from lichen.excerpt import excerpt
from lichen.observe.metrics import get_logger

log = get_logger(__name__)

LOAD_FORMATS = (None, "direct", "flattened_bucket")


class TensorUpdate:
    def __init__(self, server: Any):
        self.server = server

    async def handle(self, request: web.Request) -> web.Response:
        server = self.server
        body = await server._object(request)
        entries = expect(
            body.get("serialized_named_tensors"),
            (list,),
            "serialized_named_tensors",
            "a list of base64 strings, one per TP rank",
        )
        if not entries:
            return _reply(False, "serialized_named_tensors is empty; it needs one entry per TP rank")
        fmt = body.get("load_format")
        if fmt not in LOAD_FORMATS:
            return _reply(
                False,
                f"load_format {excerpt(fmt)} is not supported here (null or 'direct': a list of "
                "(name, tensor) pairs; 'flattened_bucket')",
            )
        version = body.get("weight_version")
        if version is not None:
            expect(version, (str,), "weight_version", "a string")
        # checked, then nothing to do: lichen serve keeps no prefix cache between requests (/flush_cache only
        # waits for running requests, and the sender pauses generation around the update)
        expect(body.get("flush_cache", True), (bool,), "flush_cache", "true or false")
        endpoints = server.weight_endpoints  # its lock: one weight transfer at a time
        async with endpoints._lock:
            try:
                named = await asyncio.to_thread(load_named_tensors, entries[0], fmt)
            except PayloadError as e:
                log.warning("refused /update_weights_from_tensor: %s", e)
                return _reply(False, f"Failed to read serialized_named_tensors[0]: {e}. The weights were not changed.")
            names, tensors = [n for n, _ in named], [t for _, t in named]
            problems = endpoints._check_named(names, tensors)
            if problems:
                return _reply(
                    False,
                    f"Failed to update parameter online: {'; '.join(problems[:5])}. The weights were not changed.",
                )
            await server._abort_all_if(body, False)

            def apply(s) -> None:
                params = endpoints._params()
                with torch.no_grad():
                    for n, t in named:
                        if n in params:
                            params[n].copy_(t)
                if version is not None:
                    s.engine.weight_version = version
                endpoints._set_held(None)

            try:
                await server.control(apply, exclusive=True)
            finally:
                named.clear()  # unmap the sender's memory now, not at the next collection
                tensors.clear()
        msg = "Succeeded to update parameter online." + (f" Weight version updated to {version}." if version else "")
        return _reply(True, msg)


def add_routes(app: web.Application, server: Any) -> TensorUpdate:
    """Route /update_weights_from_tensor (after lichen.engines.server.weight_endpoints.add_routes: it shares its lock)."""
    h = TensorUpdate(server)
    app.router.add_post("/update_weights_from_tensor", h.handle)
    return h
