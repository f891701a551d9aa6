"""`lichen serve` where a client written for SGLang would see a difference: each case follows SGLang's own rule
(named per test) rather than answering something the client did not ask for."""

import pytest
from helpers.serve_process import call, launch

CTX = 72


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("serve_fidelity") / "serve.log")
    proc = launch(tiny_ckpt, "--num-threads", "1", "--context-length", str(CTX), log_path=log)
    yield proc
    proc.stop()


def gen(server, body):
    return call(server.url + "/generate", body)


def message(body) -> str:
    return body["message"] if "message" in body else body["error"]["message"]


@pytest.mark.slow
def test_response_format_is_refused_not_ignored(server):
    chat = {"model": "m", "messages": [{"role": "user", "content": "2+2="}], "max_tokens": 2}
    for rf in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}):
        st, body = call(server.url + "/v1/chat/completions", {**chat, "response_format": rf})
        assert st == 400 and "response_format" in message(body), body
    assert call(server.url + "/v1/chat/completions", {**chat, "response_format": {"type": "text"}})[0] == 200


def test_ignore_eos_also_ignores_stop_token_ids(server):
    # SGLang Req.check_finished: stop_token_ids are checked only inside `if not ignore_eos`.
    base = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    st, free = gen(server, base)
    assert st == 200 and len(free["output_ids"]) == 6
    stop_at = free["output_ids"][1]
    sp = {**base["sampling_params"], "stop_token_ids": [stop_at]}
    st, out = gen(server, {**base, "sampling_params": sp})
    assert st == 200 and out["output_ids"] == free["output_ids"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    st, out = gen(server, {**base, "sampling_params": {**sp, "ignore_eos": False}})
    first = free["output_ids"].index(stop_at)
    assert out["output_ids"][-1] == stop_at and len(out["output_ids"]) <= first + 1
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_first_input_logprob_is_null_for_any_start(server):
    ids = [20, 21, 22, 23, 24, 25]
    for start in (0, 2, 5):
        st, out = gen(
            server,
            {
                "input_ids": ids,
                "return_logprob": True,
                "logprob_start_len": start,
                "top_logprobs_num": 2,
                "sampling_params": {"max_new_tokens": 0},
            },
        )
        meta = out["meta_info"]
        lps = meta["input_token_logprobs"]
        assert st == 200 and lps[0][0] is None and meta["input_top_logprobs"][0] is None, (start, lps)
        assert [x[1] for x in lps] == ids[start:] and meta["prompt_tokens"] == start + len(lps)
        assert all(isinstance(x[0], float) for x in lps[1:])


def test_context_length_is_exclusive_as_in_sglang(server):
    # SGLang TokenizerManager._validate_one_request: input >= context_len and input + max_new_tokens >= context_len
    # are refused, so a request always fits strictly below the context length.
    prompt = list(range(20, 30))
    st, body = gen(server, {"input_ids": prompt, "sampling_params": {"max_new_tokens": CTX - len(prompt)}})
    assert st == 400 and "maximum context length" in message(body)
    st, out = gen(
        server, {"input_ids": prompt, "sampling_params": {"max_new_tokens": CTX - 1 - len(prompt), "ignore_eos": True}}
    )
    assert st == 200 and len(out["output_ids"]) == CTX - 1 - len(prompt)
    st, body = gen(server, {"input_ids": list(range(20, 20 + CTX)), "sampling_params": {"max_new_tokens": 0}})
    assert st == 400 and "longer than the model's context length" in message(body)
    st, out = gen(server, {"input_ids": prompt, "sampling_params": {"max_new_tokens": None, "ignore_eos": True}})
    assert st == 200 and len(prompt) + len(out["output_ids"]) == CTX - 1


def test_completions_refuse_max_tokens_zero(server):
    req = {"model": "m", "prompt": [40, 41]}
    for bad in (0, -3):
        st, body = call(server.url + "/v1/completions", {**req, "max_tokens": bad})
        assert st == 400 and "max_tokens" in message(body), body
    assert call(server.url + "/v1/completions", {**req, "max_tokens": 1})[0] == 200
