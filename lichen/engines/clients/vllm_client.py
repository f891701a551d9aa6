"""A client of one vLLM server that offers lichen's engine client interface (EngineClient) over vLLM's own API.

RemoteEngines, the router and the health monitor speak SGLang's protocol (lichen.engines.clients.client); `VLLMClient`
translates each call they make into vLLM's endpoints (VLLM_SERVER_DEV_MODE=1, `--enable-scale-out`) and each
answer back, so everything above it is the same for every backend:

| lichen calls (SGLang's)                        | vLLM                                                        |
|------------------------------------------------|-------------------------------------------------------------|
| POST /generate {input_ids, sampling_params}    | POST /inference/v1/generate {token_ids, sampling_params}    |
| POST /pause_generation {mode}                  | POST /pause?mode=abort|keep                                 |
| POST /continue_generation                      | POST /resume                                                |
| POST /abort_request {rid} / {abort_all}        | POST /abort_requests {request_ids: [PREFIX + rid]} / {}     |
| GET /flush_cache                               | POST /reset_prefix_cache                                    |
| GET /model_info                                | GET /v1/models + GET /weight_info                           |
| GET /health_generate                           | POST /inference/v1/generate, one token (vLLM's /health misses a hung engine core) |
| POST /release_memory_occupation                | POST /sleep?level=1 (--offload-rollout; CUDA only)          |
| POST /resume_memory_occupation {tags}          | POST /wake_up?tags=weights&tags=kv_cache                    |
| POST /update_weights_from_disk {model_path, weight_version} | /collective_rpc lichen_load_dir + POST /update_weight_version |
| POST /weights_checker {"action": "checksum"}   | /collective_rpc lichen_checksums (lichen.engines.clients.vllm_worker_ext) |
| GET /server_info                               | GET /server_info + the workers' dtype (lichen_info)          |
| any other path                                 | the same path (vLLM's own, e.g. /update_weight_version)     |

Generation (docs/engines.md#generation): token ids in and out, `logprobs: 0` (the sampled token's log-prob, which
the launcher's `--logprobs-mode processed_logprobs` makes lichen's convention: under the sampling temperature,
docs/architecture.md#log-prob-convention), the per-sample `seed`, `stop_token_ids` and `ignore_eos` (which, as in
lichen and SGLang, turns the stop ids off too), stop tokens
kept in the output (vLLM keeps stop *token ids* in `token_ids`), and the request id lichen chose, so one request
can be aborted. The weight version of a result is the one its last tokens were sampled with (vLLM's per-choice
`weight_versions` spans). A request that asks for its sampling mask is refused (vLLM's CPU runner has none), and so
is one with top-p < 1 or top-k > 0 (vLLM's log-probs are then over the kept tokens, not lichen's full vocabulary).
"""

from __future__ import annotations

import json
from typing import Any, AsyncGenerator
from urllib.parse import urlencode

from lichen.engines.clients.client import EngineClient, EngineError

GENERATE = "/inference/v1/generate"
# vLLM's token endpoint files request `rid` under this id; /abort_requests takes that one ("generate-tokens-" in
# vLLM 0.32's ServingTokens; tests/test_vllm_protocol.py aborts one request through it)
REQUEST_ID_PREFIX = "generate-tokens-"
# SGLang path -> vLLM path, where only the path differs (bodies translated in VLLMClient.request)
SAME_MEANING = {
    "/continue_generation": "/resume",
    "/flush_cache": "/reset_prefix_cache",
}
# GET /health_generate -> one greedy token from token 0: vLLM's /health reports only an engine core that died
# (EngineDeadError), and answers 200 while a hung (e.g. SIGSTOPped) engine core holds every request forever
HEALTH_PROBE = {"token_ids": [0], "sampling_params": {"max_tokens": 1, "temperature": 0.0, "detokenize": False}}
# What has_endpoint probes for an SGLang path vLLM answers through another (or several) of its own.
PROBED_AS = {
    "/generate": GENERATE,
    "/pause_generation": "/pause",
    "/abort_request": "/abort_requests",
    "/model_info": "/weight_info",
    "/update_weights_from_disk": "/collective_rpc",
    "/weights_checker": "/collective_rpc",
    "/health_generate": GENERATE,
    **SAME_MEANING,
}


def vllm_generate_body(payload: dict) -> dict:
    """lichen's `/generate` body (lichen.engines.clients.client.generate_payload) -> vLLM's `/inference/v1/generate` body.
    EngineError for what vLLM cannot do (the sampling mask)."""
    sp = payload.get("sampling_params") or {}
    if sp.get("custom_params", {}).get("return_top_p_token_ids"):
        raise EngineError(
            "vLLM engines cannot return the sampling mask (top-p / top-k kept sets): use top-p 1 and top-k -1"
        )
    if float(sp.get("top_p", 1.0)) < 1.0 or int(sp.get("top_k", -1)) > 0:
        # vLLM's processed_logprobs are taken after its top-p / top-k filter, i.e. renormalised over the kept
        # tokens; lichen's convention is the full vocabulary (docs/architecture.md#log-prob-convention), so such a
        # sample's log-probs would be silently off (an agent behind the agent proxy can ask for top_p < 1)
        raise EngineError(
            f"vLLM engines report a top-p / top-k sample's log-probs renormalised over the kept tokens, not over the "
            f"full vocabulary as lichen trains on them: top_p {sp.get('top_p')}, top_k {sp.get('top_k')} refused; "
            "use top_p 1 and top_k -1"
        )
    out: dict[str, Any] = {
        "max_tokens": int(sp["max_new_tokens"]),
        "temperature": float(sp.get("temperature", 1.0)),
        "top_p": float(sp.get("top_p", 1.0)),
        "top_k": max(0, int(sp.get("top_k", -1))),  # vLLM: 0 disables top-k
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,
        "skip_special_tokens": False,
    }
    if "sampling_seed" in sp:
        out["seed"] = int(sp["sampling_seed"])
    if sp.get("ignore_eos"):
        # lichen's (and SGLang's) ignore_eos turns off the stop ids too (lichen.engines.core.decode_batch.stop_ids);
        # vLLM's only EOS: its stop ids are not sent
        out["ignore_eos"] = True
    elif sp.get("stop_token_ids"):
        out["stop_token_ids"] = [int(t) for t in sp["stop_token_ids"]]
    body: dict[str, Any] = {"token_ids": [int(t) for t in payload["input_ids"]], "sampling_params": out}
    if payload.get("rid") is not None:
        body["request_id"] = str(payload["rid"])
    return body


def sglang_output(out: Any, url: str = "") -> dict:
    """vLLM's `/inference/v1/generate` answer -> the `/generate` output object result_from_output reads."""
    choices = out.get("choices") if isinstance(out, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise EngineError(f"{url}{GENERATE}: expected a JSON object with one choice, got {str(out)[:200]}")
    choice = choices[0]
    tokens = choice.get("token_ids") or []
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(tokens) or not all(isinstance(t, int) for t in tokens):
        raise EngineError(
            f"{url}{GENERATE}: {len(tokens)} token ids but {len(content)} log-probs; vLLM must return the sampled "
            "token's log-prob for each (sampling_params.logprobs = 0)"
        )
    triples = []
    for token, lp in zip(tokens, content):
        if not isinstance(lp, dict) or lp.get("token_id") != token or not isinstance(lp.get("logprob"), (int, float)):
            raise EngineError(f"{url}{GENERATE}: log-prob entry {str(lp)[:100]} does not match token {token}")
        triples.append([float(lp["logprob"]), token, None])
    spans = choice.get("weight_versions") or []
    version = spans[-1].get("version") if spans and isinstance(spans[-1], dict) else None
    usage = out.get("usage") or {}
    meta = {
        "output_token_logprobs": triples,
        "finish_reason": {"type": choice.get("finish_reason") or "length"},
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "weight_version": "" if version is None else str(version),
        "weight_version_spans": spans,
    }
    return {"text": "", "output_ids": list(tokens), "meta_info": meta}


class VLLMClient(EngineClient):
    """EngineClient whose calls reach a vLLM server (see the module docstring for the mapping)."""

    _model_info: dict | None = None

    async def generate(self, payload: dict) -> dict:
        body = vllm_generate_body(payload)
        async with self._generate_slot():
            return sglang_output(await self.call_json("POST", GENERATE, body), self.url)

    async def generate_stream(self, payload: dict) -> AsyncGenerator[dict, None]:
        """The whole output as one event (vLLM streams deltas without log-probs of the tokens so far in the
        shape lichen's stream consumers read; the final result is the same)."""
        yield await self.generate(payload)

    async def has_endpoint(self, path: str) -> bool:
        return await super().has_endpoint(PROBED_AS.get(path, path))

    async def request(
        self, method: str, path: str, body: Any = None, *, params: dict | None = None, **kwargs: Any
    ) -> tuple[int, Any]:
        """EngineClient.request with SGLang's paths and bodies translated to vLLM's (answers translated back)."""
        up = super().request
        if path == "/health_generate":  # the health monitor's probe: SGLang's generates one token
            return await up("POST", GENERATE, HEALTH_PROBE, params=params, **kwargs)
        if path in SAME_MEANING:
            return await up("POST", SAME_MEANING[path], {}, params=params, **kwargs)
        if path == "/pause_generation":
            mode = "keep" if (body or {}).get("mode") in ("in_place", "retract") else "abort"
            return await up("POST", "/pause", None, params={"mode": mode}, **kwargs)
        if path == "/abort_request":
            rid = (body or {}).get("rid")
            ids = (
                {} if (body or {}).get("abort_all") or rid is None else {"request_ids": [REQUEST_ID_PREFIX + str(rid)]}
            )
            return await up("POST", "/abort_requests", ids, **kwargs)
        if path == "/model_info":
            return await self._model_info_of(**kwargs)
        if path == "/update_weights_from_disk":
            return await self._load_from_disk(body or {}, **kwargs)
        if path == "/weights_checker" and (body or {}).get("action") == "checksum":
            return await self._checksums(**kwargs)
        if path == "/server_info":
            return await self._server_info(**kwargs)
        if path == "/release_memory_occupation":  # --offload-rollout: vLLM's sleep mode (level 1 keeps weights on host)
            return await up("POST", "/sleep", None, params={"level": "1"}, **kwargs)
        if path == "/resume_memory_occupation":  # vLLM's tags: weights, kv_cache (SGLang's cuda_graph has none)
            tags = [t for t in (body or {}).get("tags") or ["weights", "kv_cache"] if t in ("weights", "kv_cache")]
            return await up(
                "POST", "/wake_up" + ("?" + urlencode([("tags", t) for t in tags]) if tags else ""), None, **kwargs
            )
        return await up(method, path, body, params=params, **kwargs)

    async def _model_info_of(self, **kwargs: Any) -> tuple[int, Any]:
        """SGLang's /model_info fields lichen reads: model_path, weight_version (and vLLM's max_model_len)."""
        if self._model_info is None:
            status, models = await super().request("GET", "/v1/models", **kwargs)
            if status != 200:
                return status, models
            data = models.get("data") if isinstance(models, dict) else None
            if not isinstance(data, list) or not data or not isinstance(data[0], dict):
                raise EngineError(f"{self.url}/v1/models: expected a list of served models, got {str(models)[:200]}")
            self._model_info = {"model_path": data[0].get("root") or data[0].get("id")}
            self._model_info["max_model_len"] = data[0].get("max_model_len")
        status, info = await super().request("GET", "/weight_info", **kwargs)
        if status != 200 or not isinstance(info, dict):
            return status, info
        return 200, {**self._model_info, "weight_version": info.get("weight_version")}

    async def _rpc(self, method: str, arg: dict | None = None, **kwargs: Any) -> tuple[int, Any]:
        """lichen's receiver in vLLM's workers (lichen.engines.clients.vllm_worker_ext), through /collective_rpc: its one
        JSON-string argument in, {"results": [each worker's answer]} out."""
        body = {"method": method, "args": [] if arg is None else [json.dumps(arg)]}
        return await super().request("POST", "/collective_rpc", body, **kwargs)

    async def _load_from_disk(self, body: dict, **kwargs: Any) -> tuple[int, Any]:
        """Load the HF checkpoint `model_path` in place through lichen's receiver (lichen_load_dir: checksums
        recorded, packed layers re-made), then label the weights `weight_version`. The caller has paused the
        engine."""
        path, version = body.get("model_path"), body.get("weight_version")
        status, out = await self._rpc("lichen_load_dir", {"path": str(path)}, **kwargs)
        if status != 200:
            return status, {"success": False, "message": f"loading {path}: {_message(out)}"}
        if version is not None:
            status, out = await super().request("POST", "/update_weight_version", {"new_version": str(version)})
            if status != 200:
                return status, {"success": False, "message": f"update_weight_version: {_message(out)}"}
        return 200, {"success": True, "message": f"loaded {path}"}

    async def _checksums(self, **kwargs: Any) -> tuple[int, Any]:
        """lichen serve's /weights_checker checksum answer (lichen.sync.verify): each worker's xxh3-128 digests of
        the tensors its last update loaded."""
        status, out = await self._rpc("lichen_checksums", **kwargs)
        results = out.get("results") if isinstance(out, dict) else None
        if status != 200 or not isinstance(results, list) or not results:
            return status if status != 200 else 502, out
        formats = {r.get("checksum_format") for r in results if isinstance(r, dict)}
        return 200, {"checksum_format": formats.pop() if len(formats) == 1 else None, "ranks": results}

    async def _server_info(self, **kwargs: Any) -> tuple[int, Any]:
        """vLLM's /server_info with the dtype the workers serve in (lichen.sync reads it; vLLM's answer has it
        only deep in its config)."""
        status, info = await super().request("GET", "/server_info", **kwargs)
        if status != 200 or not isinstance(info, dict):
            return status, info
        status, out = await self._rpc("lichen_info", **kwargs)
        results = out.get("results") if isinstance(out, dict) else None
        if status == 200 and isinstance(results, list) and results and isinstance(results[0], dict):
            info = {**info, "dtype": str(results[0].get("dtype", "")).removeprefix("torch.")}
        return 200, info


def _message(body: Any) -> str:
    return str(body.get("detail") or body.get("error") or body)[:500] if isinstance(body, dict) else str(body)[:500]
