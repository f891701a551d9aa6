"""SGLang's native `/generate` protocol (docs/architecture.md#generate-requests): parsing, validation and response
objects.

Every field of SGLang's request schema is accepted. Fields that only tune SGLang internals (for example
`spaces_between_special_tokens`, `custom_params` other than slime's `return_top_p_token_ids`, `priority`) are
ignored; fields that would change what is generated or returned but that lichen's engine does not implement
(penalties, grammars, multimodal input, hidden states, ...) are rejected with a 400 naming the field unless they
hold their neutral value, so nothing is ever silently different from what was asked.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from lichen.engines.core.decode_batch import Seq, context_error, stop_ids
from lichen.engines.core.sampler import derive_seed
from lichen.excerpt import clip, json_excerpt

DEFAULT_MAX_NEW_TOKENS = 128
_INT64 = (-(2**63), 2**63 - 1)


class RequestError(Exception):
    """A bad request. shape "error": {"error": {"message"}} (SGLang's /generate and control endpoints);
    shape "object": {"object": "error", ...} (validation errors and the OpenAI endpoints)."""

    def __init__(self, message: str, status: int = 400, shape: str = "error"):
        super().__init__(message)
        self.message, self.status, self.shape = message, status, shape

    def body(self) -> dict:
        return error_body(self.message, self.status, self.shape)


def error_body(message: str, status: int = 400, shape: str = "error") -> dict:
    if shape == "error":
        return {"error": {"message": message}}
    kind = "Bad Request" if status == 400 else str(status)
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


def _bad_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _int64(text: str) -> int:
    v = int(text)
    if not _INT64[0] <= v <= _INT64[1]:
        raise ValueError(f"integer {text} does not fit in 64 bits")
    return v


def loads(raw: bytes, *, empty: Any = None) -> Any:
    """Strict JSON: no NaN / Infinity, integers within 64 bits (as SGLang's orjson). `empty` for no body."""
    if not raw.strip():
        if empty is not None:
            return empty
        raise RequestError("the request body is empty; send a JSON object", shape="object")
    try:
        return json.loads(raw, parse_constant=_bad_constant, parse_int=_int64)
    except (ValueError, RecursionError) as e:
        raise RequestError(f"malformed JSON body: {clip(str(e))}", shape="object") from None


def expect(value: Any, kinds: tuple, where: str, what: str) -> Any:
    """Type check with JSON names; bools are not numbers here."""
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        raise RequestError(f"{where} must be {what}, got {json_excerpt(value, 80)}", shape="object")
    return value


def int_field(d: dict, key: str, default: Any, where: str) -> Any:
    v = d.get(key)
    return default if v is None else expect(v, (int,), f"{where}{key}", "an integer")


def num_field(d: dict, key: str, default: Any, where: str) -> Any:
    v = d.get(key)
    return default if v is None else float(expect(v, (int, float), f"{where}{key}", "a number"))


def bool_field(d: dict, key: str, default: bool, where: str) -> bool:
    v = d.get(key)
    return default if v is None else expect(v, (bool,), f"{where}{key}", "true or false")


def int_list(v: Any, where: str) -> list[int]:
    expect(v, (list,), where, "a list of integers")
    for x in v:
        expect(x, (int,), where, "a list of integers")
    return v


# ---- sampling parameters ----------------------------------------------------------------------------------
# Keys whose effect lichen's engine does not implement: accepted only at their neutral value.
_NEUTRAL = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
}
_UNSUPPORTED_IF_SET = ("regex", "json_schema", "ebnf", "structural_tag", "stop_regex", "logit_bias")
_IGNORED = ("spaces_between_special_tokens", "custom_params", "stream_interval")
_HANDLED = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "n",
    "sampling_seed",
)
SAMPLING_KEYS = frozenset(_HANDLED + _IGNORED + _UNSUPPORTED_IF_SET + tuple(_NEUTRAL))


@dataclass
class Sampling:
    max_new_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    n: int
    seed: int | None
    return_sampling_mask: bool = False  # custom_params.return_top_p_token_ids (slime's sampling-mask replay)


def _return_sampling_mask(sp: dict, w: str) -> bool:
    """slime's request for the kept token sets: sampling_params.custom_params.return_top_p_token_ids (the other
    custom_params keys tune SGLang internals and are ignored)."""
    custom = sp.get("custom_params")
    if not isinstance(custom, dict):
        return False
    return bool_field(custom, "return_top_p_token_ids", False, w + "custom_params.")


def parse_sampling(sp: Any, where: str = "sampling_params") -> Sampling:
    if sp is None:
        sp = {}
    expect(sp, (dict,), where, "a JSON object")
    unknown = sorted(set(sp) - SAMPLING_KEYS)
    if unknown:
        raise RequestError(f"{where}: unknown key(s) {json_excerpt(unknown)}; known keys: {sorted(SAMPLING_KEYS)}")
    w = where + "."
    for key, neutral in _NEUTRAL.items():
        v = sp.get(key)
        if v is not None and expect(v, (int, float), w + key, "a number") != neutral:
            raise RequestError(f"{w}{key}={v} is not supported by lichen serve; leave it out (or {neutral})")
    for key in _UNSUPPORTED_IF_SET:
        if sp.get(key) not in (None, {}, [], ""):
            raise RequestError(f"{w}{key} is not supported by lichen serve; leave it out")
    temperature = num_field(sp, "temperature", 1.0, w)
    if temperature < 0:
        raise RequestError(f"temperature must be non-negative, got {temperature}")
    top_p = num_field(sp, "top_p", 1.0, w)
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    top_k = int_field(sp, "top_k", -1, w)
    if top_k != -1 and top_k < 1:
        raise RequestError(f"top_k must be -1 (disable) or at least 1, got {top_k}")
    max_new = sp.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new is not None:
        expect(max_new, (int,), w + "max_new_tokens", "an integer")
        if max_new < 0:
            raise RequestError(f"max_new_tokens must be at least 0, got {max_new}")
    stop = sp.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    else:
        expect(stop, (list,), w + "stop", "a string or a list of strings")
        for s in stop:
            expect(s, (str,), w + "stop", "a string or a list of strings")
    stop_ids = sp.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else int_list(stop_ids, w + "stop_token_ids")
    n = int_field(sp, "n", 1, w)
    if n < 1:
        raise RequestError(f"n must be at least 1, got {n}")
    seed = int_field(sp, "sampling_seed", None, w)
    for key in _IGNORED[:1]:
        bool_field(sp, key, True, w)
    return Sampling(
        max_new,
        0.0 if temperature < 1e-6 else temperature,
        top_p,
        top_k,
        tuple(s for s in stop if s),
        tuple(stop_ids),
        bool_field(sp, "ignore_eos", False, w),
        bool_field(sp, "skip_special_tokens", True, w),
        bool_field(sp, "no_stop_trim", False, w),
        n,
        seed,
        _return_sampling_mask(sp, w),
    )


# ---- jobs -------------------------------------------------------------------------------------------------
@dataclass
class Facts:
    """What request parsing needs to know about the served model."""

    tokenizer: Any
    vocab_size: int
    context_length: int
    eos_ids: list[int]
    max_request_sequences: int | None = None  # most sequences (prompts x n) one request may ask for
    max_text_chars: int | None = None  # longer texts cannot fit the context (lichen.engines.server.limits)


def check_sequences(count: int, facts: Facts) -> None:
    """Refuse a request of more than --max-sequences-per-request sequences, before anything is tokenized."""
    cap = facts.max_request_sequences
    if cap is not None and count > cap:
        raise RequestError(
            f"the request asks for more than {cap} sequences (prompts x n); this server takes at "
            f"most {cap} per request (lichen serve --max-sequences-per-request); split it"
        )


def check_text(text: str, facts: Facts, where: str) -> None:
    """Refuse a text too long to fit the context without tokenizing it (its token count is at least its length
    divided by the longest token's)."""
    most = facts.max_text_chars
    if most is not None and len(text) > most:
        raise RequestError(
            f"{where} has {len(text)} characters: more than fit in the context of {facts.context_length} tokens "
            f"(at most {most} characters); shorten the prompt",
            shape="object",
        )


@dataclass
class OutputOptions:
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False


@dataclass
class Job:
    """One expanded sub-request (prompt x sample) as the server tracks it; `seq.tag` points back here."""

    rid: str
    index: int
    seq: Seq
    opts: OutputOptions
    stream: bool = False
    submitted: bool = False
    created: float = field(default_factory=time.time)
    done: Any = None  # asyncio.Future, set by the server
    queue: Any = None  # asyncio.Queue of (job, n_tokens | None) for streaming requests


def check_ids(ids: list[int], facts: Facts, max_new: int | None, where: str) -> int:
    """Validate prompt ids against the vocabulary and context; return the resolved max_new_tokens."""
    if not ids:
        raise RequestError("input_ids cannot be empty.")
    bad = [t for t in ids if not 0 <= t < facts.vocab_size]
    if bad:
        raise RequestError(f"{where}: token id(s) {bad[:5]} are outside the vocabulary [0, {facts.vocab_size})")
    n, ctx = len(ids), facts.context_length
    problem = context_error(n, max_new, ctx)
    if problem is not None:
        raise RequestError(problem)
    return ctx - 1 - n if max_new is None else max_new


def make_job(
    rid: str, index: int, ids: list[int], sp: Sampling, sample: int, opts: OutputOptions, facts: Facts, where: str
) -> Job:
    check_sequences(index + 1, facts)  # refused at the first job past the cap, before the rest are built
    max_new = check_ids(ids, facts, sp.max_new_tokens, where)
    if opts.logprob_start_len > len(ids):
        raise RequestError(
            f"logprob_start_len ({opts.logprob_start_len}) is longer than the prompt ({len(ids)} tokens)"
        )
    # The n samples of one request draw from distinct seeds derived from the request's seed.
    if sp.seed is None:
        seed = secrets.randbits(32)
    else:
        seed = sp.seed if sp.n == 1 else derive_seed(sp.seed, sample)
    stop = stop_ids(sp.ignore_eos, facts.eos_ids, sp.stop_token_ids)
    score = opts.return_logprob and opts.logprob_start_len >= 0
    seq = Seq(
        input_ids=list(ids),
        max_new_tokens=max_new,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        seed=seed,
        stop_ids=stop,
        stop_strings=sp.stop,
        input_logprob_start=opts.logprob_start_len if score else -1,
        top_logprobs_num=opts.top_logprobs_num if opts.return_logprob else 0,
        token_ids_logprob=opts.token_ids_logprob if opts.return_logprob else None,
        return_sampling_mask=sp.return_sampling_mask,
    )
    job = Job(rid=rid, index=index, seq=seq, opts=opts)
    seq.tag = job
    return job


def _per_prompt(body: dict, key: str, batch: int, default: Any) -> list:
    v = body.get(key)
    if isinstance(v, list) and key != "token_ids_logprob":
        if len(v) != batch:
            raise RequestError(f"{key} has {len(v)} entries for a batch of {batch} prompts")
        return [default if x is None else x for x in v]
    return [default if v is None else v] * batch


# Top-level fields lichen cannot honour: rejected when set to anything but their neutral value.
_TOP_UNSUPPORTED = {
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "lora_path": None,
    "custom_logit_processor": None,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "return_entropy": False,
}


def parse_generate(body: Any, facts: Facts) -> tuple[list[Job], bool, bool]:
    """A /generate body -> (jobs in prompt-major order, single (answer with one object), stream)."""
    expect(body, (dict,), "the request body", "a JSON object")
    for key, neutral in _TOP_UNSUPPORTED.items():
        if body.get(key) not in (None, neutral, [], {}):
            if key == "input_embeds":
                raise RequestError("input_embeds is not supported by lichen serve; send text or input_ids")
            raise RequestError(f"{key} is not supported by lichen serve; leave it out")
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    if text is not None and input_ids is not None:
        raise RequestError("Only one of text or input_ids should be provided.")
    if text is not None:
        if isinstance(text, str):
            texts, batched = [text], False
        else:
            expect(text, (list,), "text", "a string or a list of strings")
            for t in text:
                expect(t, (str,), "text", "a string or a list of strings")
            texts, batched = text, True
        B = len(texts)
    else:
        expect(input_ids, (list,), "input_ids", "a list of integers or a list of lists of integers")
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        B = len(input_ids) if batched else 1
    if batched and not B:
        raise RequestError("input_ids cannot be empty." if text is None else "text cannot be an empty list.")
    sps = body.get("sampling_params")
    if isinstance(sps, list):
        if len(sps) != B:
            raise RequestError(f"sampling_params has {len(sps)} entries for a batch of {B} prompts")
        samplings = [parse_sampling(s, f"sampling_params[{i}]") for i, s in enumerate(sps)]
    else:
        samplings = [parse_sampling(sps)] * B
    n = samplings[0].n
    if any(s.n != n for s in samplings):
        raise RequestError("every item of a sampling_params list must have the same n")
    # counts and lengths before any tokenizing: a batch over the cap, or a text that cannot fit, costs nothing
    check_sequences(B * n, facts)
    if text is not None:
        for i, t in enumerate(texts):
            check_text(t, facts, f"text[{i}]" if batched else "text")
        prompts = [list(facts.tokenizer.encode(t)) for t in texts]
    elif batched:
        prompts = [int_list(p, f"input_ids[{i}]") for i, p in enumerate(input_ids)]
    else:
        prompts = [int_list(input_ids, "input_ids")]
    return_logprob = _per_prompt(body, "return_logprob", B, False)
    start_len = _per_prompt(body, "logprob_start_len", B, -1)
    top_num = _per_prompt(body, "top_logprobs_num", B, 0)
    ids_lp = body.get("token_ids_logprob")
    if ids_lp is not None and ids_lp and isinstance(ids_lp[0], list):
        if len(ids_lp) != B:
            raise RequestError(f"token_ids_logprob has {len(ids_lp)} lists for a batch of {B} prompts")
        ids_lps = [int_list(x, "token_ids_logprob") for x in ids_lp]
    else:
        ids_lps = [None if ids_lp is None else int_list(ids_lp, "token_ids_logprob")] * B
    text_in_lp = bool_field(body, "return_text_in_logprobs", False, "")
    stream = bool_field(body, "stream", False, "")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        expect(rid, (list,), "rid", "a string or a list of strings")
        if len(rid) != B:
            raise RequestError(f"rid has {len(rid)} entries for a batch of {B} prompts")
        for r in rid:
            expect(r, (str,), "rid", "a string or a list of strings")
    jobs = []
    for i, ids in enumerate(prompts):
        expect(return_logprob[i], (bool,), "return_logprob", "true or false")
        expect(start_len[i], (int,), "logprob_start_len", "an integer")
        expect(top_num[i], (int,), "top_logprobs_num", "an integer")
        if start_len[i] < -1 or top_num[i] < 0:
            raise RequestError("logprob_start_len must be -1 or >= 0 and top_logprobs_num >= 0")
        for t in ids_lps[i] or []:
            if not 0 <= t < facts.vocab_size:
                raise RequestError(f"token_ids_logprob: token id {t} is outside the vocabulary")
        sp = samplings[i]
        opts = OutputOptions(
            return_logprob[i], start_len[i], top_num[i], ids_lps[i], text_in_lp, sp.skip_special_tokens, sp.no_stop_trim
        )
        for j in range(n):
            k = i * n + j
            if isinstance(rid, list):
                r = rid[i] if n == 1 else f"{rid[i]}_{j}"
            elif isinstance(rid, str):
                r = rid if (not batched and n == 1) else f"{rid}_{k}"
            else:
                r = uuid.uuid4().hex
            job = make_job(r, k, ids, sp, j, opts, facts, f"input_ids[{i}]" if batched else "input_ids")
            job.stream = stream
            jobs.append(job)
    rids = [j.rid for j in jobs]
    if len(set(rids)) != len(rids):
        dup = sorted(r for r, k in Counter(rids).items() if k > 1)
        raise RequestError(f"Duplicate request IDs detected within the request: {json_excerpt(dup)}")
    return jobs, (not batched and n == 1), stream


async def stream_error(resp: Any, e: Exception) -> None:
    """An error after the stream started: one error event, then [DONE] (SGLang's shape,
    docs/architecture.md#engine-errors)."""
    err = {
        "error": {
            "message": f"{type(e).__name__}: {clip(str(e))}",
            "type": "invalid_request_error",
            "code": 400,
            "retryable": False,
        }
    }
    try:
        await resp.write(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
    except ConnectionResetError:
        pass
