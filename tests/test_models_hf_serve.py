"""`lichen serve` on the generic HF path, against a tiny qwen3_moe checkpoint (a type only the HF path runs): one
test per supported feature listed in docs/models.md#serve, with the transformers module loaded here as the
reference; the features the HF path refuses answer 400 naming the feature."""

from __future__ import annotations

import pytest
import torch
from helpers.serve_checks import full_forward, gen, in_thread, server_and_reference, wait_running
from helpers.serve_process import call, stream

from lichen.engines.core.engine import Engine, GenRequest
from lichen.models import load_model
from lichen.models.tiny import make_tiny_model

T = 0.7
LONG = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 300, "ignore_eos": True, "sampling_seed": 9}}


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> str:
    """The shapes of conftest's tiny llama, as qwen3_moe (the tests compare against this module's reference)."""
    out = tmp_path_factory.mktemp("tiny_qwen3_moe")
    return make_tiny_model(
        str(out),
        arch="qwen3_moe",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        seed=0,
        init_std=0.1,
    )


@pytest.fixture(scope="module")
def served(tiny_ckpt, tmp_path_factory):
    """(the server process, the transformers module loaded here as the reference)."""
    yield from server_and_reference(tiny_ckpt, tmp_path_factory)


@pytest.fixture
def server(served):
    return served[0]


@pytest.mark.parametrize("path", ["/pull_weights"])
@pytest.mark.slow
def test_untested_weight_transports_are_refused_naming_the_feature(server, path):
    st, body = call(server.url + path, {})
    assert st == 400 and "not supported on the generic HF model path" in body["message"]


def test_info_endpoints_name_the_hf_type(served, tiny_ckpt):
    server, model = served
    assert getattr(model, "is_hf", False)  # --model-impl auto picked the generic path for qwen3_moe
    st, info = call(server.url + "/model_info")
    assert st == 200 and info["model_type"] == "qwen3_moe" and info["architectures"] == ["Qwen3MoeForCausalLM"]
    st, info = call(server.url + "/server_info")
    assert st == 200 and info["model_path"] == tiny_ckpt
    load = call(server.url + "/v1/loads?include=core")[1]["loads"][0]
    assert load["num_running_reqs"] == 0
    assert call(server.url + "/get_load")[0] == 200 and call(server.url + "/health")[0] == 200


def test_stop_strings_and_stop_token_ids(server):
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    base = gen(server, {"input_ids": [40, 41], "sampling_params": sp})[1]
    text, ids = base["text"], base["output_ids"]
    stop = next(text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2] not in text[: i + 1])
    cut = gen(server, {"input_ids": [40, 41], "sampling_params": {**sp, "stop": [stop, "never"]}})[1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[: text.find(stop)]
    by_id = gen(
        server, {"input_ids": [40, 41], "sampling_params": {**sp, "ignore_eos": False, "stop_token_ids": [ids[3]]}}
    )[1]
    first = next(i for i, t in enumerate(ids) if t == ids[3] or t in (1, 3))  # the tiny tokenizer's eos ids
    assert by_id["output_ids"] == ids[: first + 1]


def test_update_weights_from_disk_hub_and_trainer_layouts(server, tiny_ckpt, tmp_path):
    """A checkpoint in the hub layout (per-expert tensors, as make-tiny-model writes) and one in the module layout
    (fused experts, as lichen's trainer exports) both load; a different config is refused and changes nothing."""
    from lichen.weights.hf_io import save_hf_checkpoint

    other = make_tiny_model(
        str(tmp_path / "other"),
        arch="qwen3_moe",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        seed=1,
        init_std=0.1,
    )
    wrong = make_tiny_model(
        str(tmp_path / "wrong"),
        arch="qwen3_moe",
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        seed=0,
        init_std=0.1,
    )
    probe = {"input_ids": [70, 71, 72], "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    before = gen(server, probe)[1]["output_ids"]
    url = server.url + "/update_weights_from_disk"
    st, body = call(url, {"model_path": wrong, "weight_version": "9"})
    assert st == 400 and "different model config" in body["message"]
    assert gen(server, probe)[1]["output_ids"] == before
    reference = load_model(other)
    st, body = call(url, {"model_path": other, "weight_version": "5"})
    assert st == 200 and body["success"] is True
    name = "model.layers.0.mlp.experts.gate_up_proj"  # the module's fused tensor, not a hub name
    st, got = call(server.url + "/get_weights_by_name", {"name": name, "truncate_size": 4})
    want = dict(reference.named_parameters())[name].flatten()[:4].tolist()
    assert st == 200 and torch.tensor(got).flatten()[:4].tolist() == pytest.approx(want)
    fused = tmp_path / "fused"
    save_hf_checkpoint(
        {n: p.detach() for n, p in load_model(tiny_ckpt).named_parameters()}, str(fused), copy_files_from=tiny_ckpt
    )
    st, body = call(url, {"model_path": str(fused), "weight_version": "0"})
    assert st == 200 and body["success"] is True
    assert gen(server, probe)[1]["output_ids"] == before


def test_generate_batched_logprobs_equal_a_full_forward(served):
    """Requests of different lengths decode together (joins rebuild the HF cache) and return log_softmax(logits/T)
    of their tokens, equal to the trainer-side full forward of the same module within 1e-5."""
    server, model = served
    prompts = [[10, 11, 12], [13] * 9, [14, 15], [16, 17, 18, 19, 20, 21]]
    bodies = [
        {
            "input_ids": p,
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": 10 + 3 * i,
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
        th.join(120)
        st, out = res["r"]
        assert st == 200 and out["meta_info"]["completion_tokens"] == b["sampling_params"]["max_new_tokens"]
        got = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
        diffs += [abs(a - r) for a, r in zip(got, full_forward(model, p + out["output_ids"], T)[len(p) - 1 :])]
    assert max(diffs) <= 1e-5, max(diffs)


def test_prompt_scoring(served):
    server, model = served
    ids = [20, 21, 22, 23, 24, 25, 26, 27]
    st, out = gen(
        server,
        {
            "input_ids": ids,
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 0},
        },
    )
    lps = out["meta_info"]["input_token_logprobs"]
    assert st == 200 and out["output_ids"] == [] and [x[1] for x in lps] == ids and lps[0][0] is None
    assert max(abs(a[0] - b) for a, b in zip(lps[1:], full_forward(model, ids, 1.0))) <= 1e-5
    assert all(len(t) == 2 for t in out["meta_info"]["input_top_logprobs"][1:])


def test_seeded_samples_match_the_in_process_engine(served):
    server, model = served
    engine = Engine(model, eos_token_ids=[])
    st, one = gen(
        server,
        {
            "input_ids": [30, 31, 32],
            "sampling_params": {
                "max_new_tokens": 12,
                "temperature": T,
                "top_p": 0.8,
                "ignore_eos": True,
                "sampling_seed": 1234,
            },
        },
    )
    ref = engine.generate([GenRequest([30, 31, 32], 12, temperature=T, top_p=0.8, seed=1234)])[0]
    assert st == 200 and one["output_ids"] == ref.output_ids


def test_streaming_matches_non_streaming(server):
    body = {"input_ids": [50, 51], "sampling_params": {"max_new_tokens": 8, "sampling_seed": 5, "ignore_eos": True}}
    events = list(stream(server.url + "/generate", {**body, "stream": True}))
    assert events[-1] == "[DONE]" and len(events) >= 3
    for a, b in zip(events[:-2], events[1:-1]):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert events[-2]["output_ids"] == gen(server, body)[1]["output_ids"]


def test_abort_and_pause_modes(server):
    th, res = in_thread(gen, server, {**LONG, "rid": "long-1"})
    wait_running(server, timeout=30.0)
    assert call(server.url + "/abort_request", {"rid": "long-1"}) == (200, None)
    th.join(30)
    assert res["r"][1]["meta_info"]["finish_reason"]["type"] == "abort"
    th, res = in_thread(gen, server, LONG)
    wait_running(server, timeout=30.0)
    call(server.url + "/pause_generation", {"mode": "retract"})
    load = call(server.url + "/v1/loads")[1]["loads"][0]
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 1)
    call(server.url + "/continue_generation", {})
    th.join(120)
    meta = res["r"][1]["meta_info"]
    assert meta["completion_tokens"] == 300 and meta["num_retractions"] == 1
    th, res = in_thread(gen, server, LONG)
    wait_running(server, timeout=30.0)
    assert call(server.url + "/pause_generation", {})[0] == 200  # mode abort
    th.join(30)
    assert res["r"][1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert call(server.url + "/continue_generation", {})[0] == 200


def test_release_and_resume_memory(server):
    assert call(server.url + "/release_memory_occupation", {}) == (200, None)
    assert call(server.url + "/resume_memory_occupation", {}) == (200, None)
    assert gen(server, {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})[0] == 200


def test_openai_chat_and_completions(server):
    st, comp = call(
        server.url + "/v1/completions",
        {"model": "m", "prompt": [40, 41], "max_tokens": 6, "temperature": T, "seed": 7, "ignore_eos": True},
    )
    native = gen(
        server,
        {
            "input_ids": [40, 41],
            "sampling_params": {"max_new_tokens": 6, "temperature": T, "sampling_seed": 7, "ignore_eos": True},
        },
    )[1]
    assert st == 200 and comp["choices"][0]["text"] == native["text"]
    st, chat = call(
        server.url + "/v1/chat/completions",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "2+2="}],
            "max_tokens": 5,
            "logprobs": True,
            "n": 2,
            "seed": 3,
        },
    )
    assert st == 200 and len(chat["choices"]) == 2
    assert all(c["message"]["role"] == "assistant" for c in chat["choices"])
