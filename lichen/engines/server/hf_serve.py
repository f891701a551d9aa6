"""What `lichen serve` does on the generic HF path (--model-impl hf, or auto with a type lichen does not implement).

Every endpoint of the native and OpenAI protocols runs as on lichen's own path (the scheduler, sampling, log-probs
and weight updates are shared; docs/models.md#serve lists them with their tests), except those below, which need a
weight transport the HF path has not been tested with: they answer 400 naming the feature instead.
"""

from __future__ import annotations

from aiohttp import web

REFUSED = {
    "/pull_weights": "pulling weight versions and delta chains (--update-weight-transport disk with deltas)",
}


@web.middleware
async def refuse_untested(request: web.Request, handler):
    feature = REFUSED.get(request.path)
    if feature is not None:
        return web.json_response(
            {
                "success": False,
                "message": f"{request.path}: {feature} is not supported on "
                "the generic HF model path (--model-impl hf); see docs/models.md#serve",
            },
            status=400,
        )
    return await handler(request)
