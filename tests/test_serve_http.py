"""`lichen serve` as a real process on a loopback port: SGLang's native protocol
(docs/architecture.md#engine-protocol), checked against
an in-process full forward of the same checkpoint, plus the OpenAI-compatible endpoints and shutdown."""

import pytest
import torch
from helpers.serve_checks import full_forward, gen, in_thread, server_and_reference, wait_running
from helpers.serve_process import call, stream

from lichen.engines.core.engine import Engine, GenRequest
from lichen.engines.core.sampler import derive_seed
from lichen.models.tiny import make_tiny_model, token_strings
from lichen.models.tokenizer import eos_token_ids, load_tokenizer

T = 0.7


@pytest.fixture(scope="module")
def both(tiny_ckpt, tmp_path_factory):
    """The server process (one for the module) and the same checkpoint loaded here; they load concurrently."""
    yield from server_and_reference(tiny_ckpt, tmp_path_factory)


@pytest.fixture(scope="module")
def server(both):
    return both[0]


@pytest.fixture(scope="module")
def model(both):
    return both[1]


LONG = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "sampling_seed": 9}}


@pytest.mark.slow
def test_generate_response_shapes(server):
    st, out = gen(server, {"text": "hi there", "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert st == 200 and set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    for key in (
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "weight_version",
        "weight_versions",
        "e2e_latency",
    ):
        assert key in meta
    assert meta["prompt_tokens"] == 8 and meta["completion_tokens"] == len(out["output_ids"]) <= 6
    assert meta["weight_version"] == "0" and meta["finish_reason"]["type"] in ("stop", "length")
    if meta["finish_reason"]["type"] == "length":
        assert meta["finish_reason"]["length"] == 6
    assert "output_token_logprobs" not in meta
    st, outs = gen(
        server,
        {
            "input_ids": [[5, 6, 7], [8]],
            "rid": "b",
            "sampling_params": {"max_new_tokens": 3, "n": 2, "ignore_eos": True},
        },
    )
    assert st == 200 and isinstance(outs, list) and len(outs) == 4
    assert [o["meta_info"]["id"] for o in outs] == ["b_0", "b_1", "b_2", "b_3"]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 3, 1, 1]
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 3} for o in outs)
    st, outs = gen(
        server,
        {"input_ids": [[5], [6]], "rid": ["p", "q"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]},
    )
    assert [o["meta_info"]["id"] for o in outs] == ["p", "q"]
    assert [o["meta_info"]["completion_tokens"] for o in outs] <= [1, 2]


def test_concurrent_logprobs_equal_a_full_forward(server, model):
    """Requests that decode together (continuous batching, different lengths) return log_softmax(logits / T)
    of their tokens, equal to the trainer-side full forward within 1e-5 (fp32)."""
    prompts = [[10, 11, 12], [13] * 9, [14, 15], [16, 17, 18, 19, 20, 21]]
    bodies = [
        {
            "input_ids": p,
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": 20 + 4 * i,
                "temperature": T,
                "top_p": 0.9,
                "top_k": 30,
                "ignore_eos": True,
                "sampling_seed": 100 + i,
            },
        }
        for i, p in enumerate(prompts)
    ]
    threads = [in_thread(gen, server, b) for b in bodies]
    diffs = []
    for (th, res), p, b in zip(threads, prompts, bodies):
        th.join(60)
        st, out = res["r"]
        assert st == 200
        triples = out["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in triples] == out["output_ids"] and all(t[2] is None for t in triples)
        assert len(triples) == b["sampling_params"]["max_new_tokens"] == out["meta_info"]["completion_tokens"]
        assert out["meta_info"]["input_token_logprobs"] == []
        ref = full_forward(model, p + out["output_ids"], T)[len(p) - 1 :]
        diffs += [abs(t[0] - r) for t, r in zip(triples, ref)]
    assert max(diffs) <= 1e-5, max(diffs)


def test_scoring_a_given_sequence(server, model):
    ids = [20, 21, 22, 23, 24, 25, 26, 27]
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
    }
    st, out = gen(server, body)
    meta = out["meta_info"]
    assert st == 200 and out["output_ids"] == [] and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    lps = meta["input_token_logprobs"]
    assert [x[1] for x in lps] == ids and lps[0][0] is None
    assert max(abs(a[0] - b) for a, b in zip(lps[1:], full_forward(model, ids, 1.0))) <= 1e-5
    st, out = gen(server, {**body, "logprob_start_len": 3, "top_logprobs_num": 2})
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 3 + len(meta["input_token_logprobs"])
    assert [x[1] for x in meta["input_token_logprobs"]] == ids[3:]
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None  # as SGLang
    assert all(len(t) == 2 and t[0][0] >= t[1][0] for t in meta["input_top_logprobs"][1:])


def test_seeded_samples_match_the_in_process_engine(server, model):
    """Same seed, same settings: the server's sample is the in-process engine's, token for token."""
    engine = Engine(model, eos_token_ids=[])
    sp = {"max_new_tokens": 16, "temperature": T, "top_p": 0.8, "ignore_eos": True}
    st, one = gen(server, {"input_ids": [30, 31, 32], "sampling_params": {**sp, "sampling_seed": 1234}})
    ref = engine.generate([GenRequest([30, 31, 32], 16, temperature=T, top_p=0.8, seed=1234)])[0]
    assert one["output_ids"] == ref.output_ids
    st, two = gen(server, {"input_ids": [30, 31, 32], "sampling_params": {**sp, "sampling_seed": 1234, "n": 2}})
    refs = engine.generate(
        [GenRequest([30, 31, 32], 16, temperature=T, top_p=0.8, seed=derive_seed(1234, j)) for j in range(2)]
    )
    assert [o["output_ids"] for o in two] == [r.output_ids for r in refs]
    assert two[0]["output_ids"] != two[1]["output_ids"]


def test_stop_strings_trim_and_logprob_text(server, tiny_ckpt):
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    base = gen(
        server, {"input_ids": [40, 41], "sampling_params": sp, "return_logprob": True, "return_text_in_logprobs": True}
    )[1]
    text = base["text"]
    assert "".join(t[2] for t in base["meta_info"]["output_token_logprobs"]) == text
    chars = token_strings()
    assert text == "".join(chars[i] for i in base["output_ids"])
    stop = text[5:7]
    cut = gen(server, {"input_ids": [40, 41], "sampling_params": {**sp, "stop": [stop, "never"]}})[1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[: text.find(stop)]
    kept = gen(server, {"input_ids": [40, 41], "sampling_params": {**sp, "stop": stop, "no_stop_trim": True}})[1]
    assert kept["text"] == text[: text.find(stop) + 2]
    tok = base["output_ids"][3]
    # stop_token_ids only act without ignore_eos (SGLang's Req.check_finished); then EOS stops too
    by_id = gen(
        server, {"input_ids": [40, 41], "sampling_params": {**sp, "ignore_eos": False, "stop_token_ids": [tok]}}
    )[1]
    eos = set(eos_token_ids(load_tokenizer(tiny_ckpt), tiny_ckpt))
    first = next(i for i, t in enumerate(base["output_ids"]) if t == tok or t in eos)
    assert by_id["output_ids"] == base["output_ids"][: first + 1]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": base["output_ids"][first]}
    assert by_id["text"] == text[:first]


def test_streaming_is_cumulative_and_matches_non_streaming(server):
    body = {
        "input_ids": [50, 51],
        "sampling_params": {"max_new_tokens": 8, "n": 2, "sampling_seed": 5, "ignore_eos": True},
        "return_logprob": True,
    }
    events = list(stream(server.url + "/generate", {**body, "stream": True}))
    assert events[-1] == "[DONE]"
    last = {}
    for ev in events[:-1]:
        i = ev["index"]
        prev = last.get(i)
        if prev is not None:
            assert prev["meta_info"]["finish_reason"] is None
            assert ev["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert len(ev["meta_info"]["output_token_logprobs"]) == len(ev["output_ids"])
        last[i] = ev
    final = gen(server, body)[1]
    for i in (0, 1):
        assert last[i]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
        assert last[i]["output_ids"] == final[i]["output_ids"] and last[i]["text"] == final[i]["text"]


def test_abort_returns_partial_output(server):
    events = stream(server.url + "/generate", {**LONG, "rid": "long-1", "stream": True})
    got = [next(events), next(events)]
    st, body = call(server.url + "/abort_request", {"rid": "long-1"})
    assert st == 200 and body is None
    got += list(events)
    final = got[-2]
    assert got[-1] == "[DONE]" and final["meta_info"]["finish_reason"]["type"] == "abort"
    assert 2 <= final["meta_info"]["completion_tokens"] < 400
    # Non-streaming, held in place so the abort lands mid-generation for sure.
    th, res = in_thread(gen, server, {**LONG, "rid": "long-2"})
    wait_running(server)
    call(server.url + "/pause_generation", {"mode": "in_place"})
    assert call(server.url + "/abort_request", {"abort_all": True})[0] == 200
    call(server.url + "/continue_generation", {})
    th.join(30)
    st, out = res["r"]
    assert st == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < out["meta_info"]["completion_tokens"] == len(out["output_ids"]) < 400
    assert call(server.url + "/abort_request", {"rid": "nobody"}) == (200, None)
    load = call(server.url + "/v1/loads?include=core")[1]["loads"][0]
    assert load["num_running_reqs"] + load["num_waiting_reqs"] == 0


@pytest.mark.slow
def test_pause_blocks_new_generation_until_continue(server):
    th, res = in_thread(gen, server, LONG)
    wait_running(server)
    st, body = call(server.url + "/pause_generation", {})  # mode abort: returns once the engine is idle
    assert st == 200 and body == {"message": "Generation paused successfully.", "status": "ok"}
    th.join(10)
    assert res["r"][1]["meta_info"]["finish_reason"]["type"] == "abort"
    blocked, out = in_thread(gen, server, {"input_ids": [60], "sampling_params": {"max_new_tokens": 4}})
    try:
        blocked.join(0.4)
        assert blocked.is_alive(), "a request went through while generation was paused"
        assert call(server.url + "/health_generate")[0] == 503  # no generation within --health-check-timeout
    finally:
        st, body = call(server.url + "/continue_generation", {})
    assert st == 200 and body["status"] == "ok"
    blocked.join(30)
    assert out["r"][0] == 200 and out["r"][1]["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    assert call(server.url + "/health_generate")[0] == 200


def test_pause_retract_and_in_place(server):
    th, res = in_thread(gen, server, LONG)
    wait_running(server)
    call(server.url + "/pause_generation", {"mode": "retract"})
    load = call(server.url + "/v1/loads")[1]["loads"][0]
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 1)
    assert call(server.url + "/flush_cache")[0] == 200  # retracted requests hold no cache
    call(server.url + "/continue_generation", {})
    th.join(30)
    meta = res["r"][1]["meta_info"]
    assert meta["completion_tokens"] == 400 and meta["num_retractions"] == 1
    th, res = in_thread(gen, server, LONG)
    wait_running(server)
    call(server.url + "/pause_generation", {"mode": "in_place"})
    try:
        load = call(server.url + "/v1/loads")[1]["loads"][0]
        assert load["num_running_reqs"] == 1
        st, text = call(server.url + "/flush_cache")
        assert st == 400 and "running" in text
    finally:
        call(server.url + "/continue_generation", {})
    th.join(30)
    meta = res["r"][1]["meta_info"]
    assert meta["completion_tokens"] == 400 and meta["num_retractions"] == 0
    assert call(server.url + "/flush_cache")[0] == 200


def test_update_weights_from_disk(server, tiny_ckpt, tmp_path):
    other = make_tiny_model(
        str(tmp_path / "other"), hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=1, init_std=0.1
    )
    wrong = make_tiny_model(
        str(tmp_path / "wrong"), hidden_size=32, num_layers=2, num_heads=4, intermediate_size=128, seed=0, init_std=0.1
    )
    probe = {"input_ids": [70, 71, 72], "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    before = gen(server, probe)[1]["output_ids"]
    url = server.url + "/update_weights_from_disk"
    for path in (str(tmp_path / "missing"), wrong):
        st, body = call(url, {"model_path": path, "weight_version": "9"})
        assert st == 400 and body["success"] is False and path in body["message"]
        info = call(server.url + "/model_info")[1]
        assert info["weight_version"] == "0" and info["model_path"] == tiny_ckpt
        assert gen(server, probe)[1]["output_ids"] == before
    # slime's disk sync: pause -> flush_cache -> update -> continue
    assert call(server.url + "/pause_generation", {})[0] == 200
    assert call(server.url + "/flush_cache")[0] == 200
    st, body = call(url, {"model_path": other, "weight_version": "5"})
    assert call(server.url + "/continue_generation", {})[0] == 200
    assert st == 200 and body["success"] is True and "Weight version updated to 5" in body["message"]
    info = call(server.url + "/model_info")[1]
    assert info["weight_version"] == "5" and info["model_path"] == other
    after = gen(server, probe)[1]
    assert after["output_ids"] != before and after["meta_info"]["weight_version"] == "5"
    from safetensors.torch import load_file

    want = load_file(f"{other}/model.safetensors")["model.layers.0.mlp.up_proj.weight"][:3]
    st, got = call(
        server.url + "/get_weights_by_name", {"name": "model.layers.0.mlp.up_proj.weight", "truncate_size": 3}
    )
    assert st == 200 and torch.equal(torch.tensor(got), want)
    assert call(server.url + "/get_weights_by_name", {"name": "nope"})[0] == 400
    # Not paused: the update waits for the running request, which finishes on the weights it started with.
    th, res = in_thread(gen, server, LONG)
    wait_running(server)
    st, body = call(url, {"model_path": tiny_ckpt, "weight_version": "0"})
    th.join(10)
    assert body["success"]
    assert res["r"][1]["meta_info"]["weight_versions"] == [{"version": "5", "start": 0, "end": 400}]
    assert gen(server, probe)[1]["output_ids"] == before
    st, body = call(server.url + "/update_weight_version", {"new_version": "x1"})
    assert st == 200 and body["new_version"] == "x1" and call(server.url + "/model_info")[1]["weight_version"] == "x1"
    call(server.url + "/update_weight_version", {"new_version": "0"})


def test_release_and_resume_memory(server):
    url = server.url
    assert call(url + "/release_memory_occupation", {}) == (200, None)
    st, body = call(url + "/release_memory_occupation", {"tags": ["weights"]})
    assert st == 400 and "already released" in body["error"]["message"]
    assert call(url + "/resume_memory_occupation", {"tags": ["weights"]}) == (200, None)
    st, body = call(url + "/resume_memory_occupation", {"tags": ["weights"]})
    assert st == 400 and "not currently released" in body["error"]["message"]
    assert call(url + "/resume_memory_occupation", {}) == (200, None)
    assert call(url + "/release_memory_occupation", {"tags": ["disk"]})[0] == 400
    assert gen(server, {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})[0] == 200


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"{bad json", "malformed JSON"),
        (b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}', "NaN"),
        (b'{"input_ids": [1, 123456789012345678901234567890]}', "64 bits"),
        (b"[1, 2]", "JSON object"),
        (b"", "empty"),
        (b'{"sampling_params": {}}', "Either text, input_ids"),
        (b'{"input_ids": []}', "cannot be empty"),
        (b'{"input_ids": [1, 5000]}', "outside the vocabulary"),
        (b'{"input_ids": "12"}', "input_ids must be"),
        (b'{"input_ids": [1], "sampling_params": {"temperature": "hot"}}', "temperature must be a number"),
        (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": true}}', "max_new_tokens must be an integer"),
        (b'{"input_ids": [1], "sampling_params": {"top_p": 0}}', "top_p must be in (0, 1]"),
        (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}', "at least 0"),
        (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 600}}', "maximum context length"),
        (b'{"input_ids": [1], "sampling_params": {"bogus": 1}}', "unknown key"),
        (b'{"input_ids": [1], "sampling_params": {"repetition_penalty": 1.3}}', "not supported"),
        (b'{"input_ids": [1], "input_embeds": [[0.1]]}', "input_embeds"),
        (b'{"input_ids": [[1], [2]], "rid": ["a", "a"]}', "Duplicate request IDs"),
        (b'{"input_ids": [1], "return_logprob": "yes"}', "return_logprob must be"),
    ],
)
def test_bad_requests_get_400_with_a_message(server, raw, words):
    st, body = call(server.url + "/generate", raw=raw)
    assert st == 400, body
    msg = body["message"] if "message" in body else body["error"]["message"]
    assert words in msg


def test_other_errors_and_survival(server):
    assert call(server.url + "/nowhere")[0] == 404
    assert call(server.url + "/pause_generation", {"mode": "sideways"})[0] == 400
    assert call(server.url + "/update_weights_from_disk", {"model_path": 3})[0] == 400
    assert call(server.url + "/abort_request", raw=b"{")[0] == 400
    assert call(server.url + "/v1/loads?include=everything")[0] == 400
    assert call(server.url + "/get_weight_version")[0] == 404
    assert call(server.url + "/health_generate")[0] == 200 and call(server.url + "/health")[0] == 200


def test_info_endpoints(server, tiny_ckpt):
    info = call(server.url + "/model_info")[1]
    assert info["is_generation"] is True and info["model_type"] == "llama"
    assert info["architectures"] == ["LlamaForCausalLM"] and info["tokenizer_path"] == tiny_ckpt
    assert call(server.url + "/get_model_info")[1]["model_path"] == info["model_path"]
    si = call(server.url + "/server_info")[1]
    assert isinstance(si["max_total_num_tokens"], int) and isinstance(si["version"], str)
    assert si["tp_size"] == 1 and si["weight_version"] == "0" and si["context_length"] == 512
    loads = call(server.url + "/v1/loads")[1]
    assert set(loads) >= {"timestamp", "version", "loads"} and loads["loads"][0]["dp_rank"] == 0
    st, text = call(server.url + "/flush_cache")
    assert st == 200 and text.startswith("Cache flushed.")


def test_openai_endpoints(server, tiny_ckpt):
    models = call(server.url + "/v1/models")[1]
    assert models["object"] == "list" and models["data"][0]["id"] == tiny_ckpt
    assert call(server.url + f"/v1/models/{tiny_ckpt}")[0] == 200
    st, body = call(server.url + "/v1/models/nope")
    assert st == 404 and body["error"]["code"] == "model_not_found"
    req = {
        "model": "m",
        "prompt": [40, 41],
        "max_tokens": 6,
        "temperature": T,
        "seed": 7,
        "logprobs": 2,
        "ignore_eos": True,
    }
    st, comp = call(server.url + "/v1/completions", req)
    native = gen(
        server,
        {
            "input_ids": [40, 41],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": T, "sampling_seed": 7, "ignore_eos": True},
        },
    )[1]
    choice = comp["choices"][0]
    assert st == 200 and comp["object"] == "text_completion" and choice["text"] == native["text"]
    assert choice["logprobs"]["token_logprobs"] == [t[0] for t in native["meta_info"]["output_token_logprobs"]]
    assert all(len(t) <= 2 for t in choice["logprobs"]["top_logprobs"]) and choice["finish_reason"] == "length"
    assert comp["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 6,
        "total_tokens": 8,
        "prompt_tokens_details": None,
    }
    assert comp["metadata"]["weight_version"] == "0"
    pieces = list(stream(server.url + "/v1/completions", {**req, "stream": True}))
    assert pieces[-1] == "[DONE]" and "".join(p["choices"][0]["text"] for p in pieces[:-1]) == choice["text"]
    assert [p["choices"][0]["finish_reason"] for p in pieces[:-1]][-1] == "length"
    streamed = [lp for p in pieces[:-1] for lp in p["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == choice["logprobs"]["token_logprobs"]
    chat_req = {
        "model": "m",
        "messages": [{"role": "user", "content": "2+2="}],
        "max_tokens": 5,
        "logprobs": True,
        "top_logprobs": 3,
        "n": 2,
        "seed": 3,
    }
    st, chat = call(server.url + "/v1/chat/completions", chat_req)
    assert st == 200 and chat["object"] == "chat.completion" and len(chat["choices"]) == 2
    for c in chat["choices"]:
        assert c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
        assert all(len(e["top_logprobs"]) == 3 for e in c["logprobs"]["content"])
    chunks = list(
        stream(
            server.url + "/v1/chat/completions", {**chat_req, "stream": True, "stream_options": {"include_usage": True}}
        )
    )
    assert chunks[-1] == "[DONE]" and chunks[-2]["usage"]["completion_tokens"] == chat["usage"]["completion_tokens"]
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-2] if c["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert sum(c["finish_reason"] is not None for c in mine) == 1 and mine[-1]["finish_reason"] is not None
        text = "".join(c["delta"].get("content", "") for c in mine)
        assert text == chat["choices"][i]["message"]["content"]
    st, body = call(server.url + "/v1/chat/completions", raw=b"{}", headers={"Content-Type": "text/plain"})
    assert st == 400 and body["object"] == "error"


def test_sigterm_answers_in_flight_requests_then_exits_0(server):
    """Runs last: it stops the module's server. A running request and one held by a pause both get answers."""
    th, res = in_thread(gen, server, LONG)
    wait_running(server)
    call(server.url + "/pause_generation", {"mode": "in_place"})
    held, held_res = in_thread(gen, server, {"input_ids": [7], "sampling_params": {"max_new_tokens": 3}})
    held.join(0.3)
    # exit code 0: it left on SIGTERM by itself (stop() kills it after `grace`, a -9); no wall-clock bound, which
    # failed under load (9.3 s at load average ~30 against a 5 s bound)
    assert server.stop(grace=60) == 0
    for thread, out in ((th, res), (held, held_res)):
        thread.join(10)
        st, body = out["r"]
        assert st == 200 and body["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < res["r"][1]["meta_info"]["completion_tokens"] < 400
    assert held_res["r"][1]["output_ids"] == []
