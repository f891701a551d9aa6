"""--custom-generate-function-path: the contract, the engine API for async functions (in process and over servers),
and the calculator tool-use example, whose tool output tokens must carry loss mask 0.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from types import SimpleNamespace

import pytest
from helpers.fake_sglang import fake_sglang_command, write_fake_sglang
from helpers.runs import base_args, dumped_samples, run

from lichen.config.rollout_config import SamplingConfig
from lichen.data.dataset import PromptRecord
from lichen.engines.clients.remote_engines import RemoteEngines
from lichen.engines.clients.sglang_launcher import SGLangLauncher
from lichen.engines.core.engine import Engine, GenResult
from lichen.engines.core.sampler import derive_seed
from lichen.errors import UserError
from lichen.models.tokenizer import load_tokenizer
from lichen.rollout import custom_generate
from lichen.rollout.context import RolloutContext
from lichen.rollout.custom_generate import CustomGenerateError, build_custom_samples, run_custom_generate
from lichen.rollout.examples.calculator_agent import calculate, find_call
from lichen.rollout.examples.calculator_agent import generate as calculator
from lichen.rollout.samples import build_samples
from lichen.types import Sample, Status


# ---- plug-ins used below ------------------------------------------------------------------------------------------
async def one_call(args, sample, sampling_params):
    """The default rollout's sample, made through the custom-generate API."""
    res = await custom_generate.generate(sample.tokens, sampling_params)
    sample.tokens = sample.tokens + res.output_ids
    sample.response_length = len(res.output_ids)
    sample.rollout_log_probs = res.output_logprobs
    sample.weight_versions = [res.weight_version]
    sample.status = Status.COMPLETED if res.finish_reason == "stop" else Status.TRUNCATED
    return sample


async def two_per_sample(args, sample, sampling_params):
    first = await one_call(args, Sample(**{**sample.__dict__, "metadata": dict(sample.metadata)}), sampling_params)
    second = await one_call(args, sample, {**sampling_params, "sampling_seed": sampling_params["sampling_seed"] + 1})
    return [first, second]


def not_async(args, sample, sampling_params):
    return sample


async def leaves_pending(args, sample, sampling_params):
    return sample


async def bad_mask(args, sample, sampling_params):
    sample = await one_call(args, sample, sampling_params)
    sample.loss_mask = [1]
    return sample


async def unknown_param(args, sample, sampling_params):
    await custom_generate.generate(sample.tokens, {**sampling_params, "stop": ["\n"]})


class Rollout:
    """A RolloutContext over the in-process engine with a stand-in config: what build_samples reads."""

    def __init__(self, ckpt: str, engine):
        self.tokenizer = load_tokenizer(ckpt)
        self.engine = engine

    def context(self, path: str | None) -> RolloutContext:
        return RolloutContext(
            args=_args(path),
            config=SimpleNamespace(custom_generate_function_path=path),
            engine=self.engine,
            tokenizer=self.tokenizer,
        )

    def encode(self, i, record):
        return self.tokenizer.encode(record.prompt, add_special_tokens=False)

    def build(self, path: str | None, prompts=None, custom_only: bool = False) -> list:
        build = build_custom_samples if custom_only else build_samples
        return build(
            self.context(path), PROMPTS if prompts is None else prompts, SAMPLING, seed_key=3, encode=self.encode
        )


def _args(path: str | None, **kw) -> argparse.Namespace:
    return argparse.Namespace(seed=5, rollout_stop_token_ids=None, custom_generate_function_path=path, **kw)


PROMPTS = [(i, PromptRecord(prompt=f"{i}+{i + 2}=", label=str(2 * i + 2))) for i in range(3)]
SAMPLING = SamplingConfig(
    n_samples_per_prompt=2,
    temperature=1.0,
    top_p=0.9,
    top_k=-1,
    max_response_len=6,
    max_context_len=None,
    stop_token_ids=(),
    seed=5,
)


@pytest.fixture(scope="module")
def manager(tiny_ckpt):
    return Rollout(tiny_ckpt, Engine.from_pretrained(tiny_ckpt))


# ---- the contract ---------------------------------------------------------------------------------------------
def test_a_one_call_function_gives_the_default_rollouts_samples(manager):
    default = manager.build(None)
    custom = manager.build("test_custom_generate.one_call")

    def same_up_to_the_mask(s):
        # with top-p 0.9, lichen's own rollout replays the engine's kept token sets (log-probs renormalized over
        # them, docs/architecture.md#log-prob-convention); a custom function's plain engine call gets full-vocabulary
        # log-probs and no sets, which the trainer then scores alike: the same tokens, each side consistent
        return {k: v for k, v in s.to_dict().items() if k not in ("rollout_log_probs", "rollout_sampling_mask")}

    assert [[same_up_to_the_mask(s) for s in g] for g in custom] == [
        [same_up_to_the_mask(s) for s in g] for g in default
    ]
    assert all(s.rollout_sampling_mask is None for g in custom for s in g)
    assert all(s.rollout_sampling_mask is not None for g in default for s in g)
    assert [s.index for g in custom for s in g] == list(range(6)) and custom[2][1].group_index == 2
    assert custom[0][0].loss_mask == [1] * custom[0][0].response_length and custom[0][0].response  # filled in

    pairs = manager.build("test_custom_generate.two_per_sample")
    assert [len(g) for g in pairs] == [4, 4, 4]
    assert [s.index for g in pairs for s in g] == list(range(12))  # a list return renumbers the batch in order
    assert pairs[1][0].tokens == default[1][0].tokens and pairs[1][0].group_index == 1


@pytest.mark.parametrize(
    "fn, text",
    [
        ("not_async", "must be an async function"),
        ("leaves_pending", "still has status pending"),
        ("bad_mask", "1 loss_mask entries for"),
        ("unknown_param", "['stop'] are not supported"),
    ],
)
def test_contract_violations_are_user_errors(manager, fn, text):
    with pytest.raises(CustomGenerateError) as info:
        manager.build(f"test_custom_generate.{fn}", PROMPTS[:1], custom_only=True)
    assert isinstance(info.value, UserError) and "--custom-generate-function-path" in str(info.value)
    assert text in str(info.value)
    with pytest.raises(RuntimeError, match="only available inside a custom generate function"):
        custom_generate.current()


def test_in_process_calls_are_batched(manager):
    engine = custom_generate.BatchingEngine(manager.engine)
    samples = [Sample(tokens=[10 + i, 20], index=i) for i in range(5)]
    params = [{"max_new_tokens": 3, "sampling_seed": i} for i in range(5)]
    out = run_custom_generate(one_call, _args(None), samples, params, engine=engine, tokenizer=manager.tokenizer)
    assert engine.batches == [5]  # all five first calls went to the engine as one batch
    assert [s.response_length for s in out] == [3] * 5


# ---- the calculator example -----------------------------------------------------------------------------------
def test_calculator():
    assert [calculate(e) for e in ("2+3*4", "7/2", "(1+2)**3", "-4//3", "6/3", "2**0.5*0")] == [
        "14",
        "3.5",
        "27",
        "-2",
        "2",
        "0",
    ]
    for expr, why in (
        ("1/0", "division by zero"),
        ("9**99", "exponent too large"),
        ("(1+2", "error:"),
        ("__import__('os')", "only numbers"),
        ("a+1", "only numbers"),
        ("'x'*3", "only numbers"),
    ):
        assert calculate(expr).startswith("error:") and why in calculate(expr), expr


class ScriptedEngine:
    """Stands in for Engine.generate: answers each call with the next scripted text; records the requests."""

    def __init__(self, tokenizer, script: list[str], eos: int):
        self.tok, self.script, self.eos, self.requests = tokenizer, list(script), eos, []

    def generate(self, requests):
        out = []
        for r in requests:
            self.requests.append(r)
            text = self.script.pop(0)
            ids = self.tok.encode(text.replace("<EOS>", ""), add_special_tokens=False)
            ids = (ids + ([self.eos] if text.endswith("<EOS>") else []))[: r.max_new_tokens]
            lps = [-0.1 * (k + 1) for k in range(len(ids))]
            reason = "stop" if ids and ids[-1] == self.eos else "length"
            out.append(GenResult(ids, lps, reason, len(r.input_ids), "7"))
        return out


def test_calculator_agent_masks_tool_output(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    turn1 = "I need <calc>12*(3+4)</calc> and"  # the text after the call is dropped, as a stop string would
    turn2 = " so <calc>1/0</calc>"
    turn3 = " it is 84<EOS>"
    engine = ScriptedEngine(tok, [turn1, turn2, turn3], eos)
    prompt = tok.encode("Q: 12*7?", add_special_tokens=False)
    seed = 99
    sample = Sample(prompt="Q: 12*7?", tokens=list(prompt), index=0)
    params = {
        "max_new_tokens": 200,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "stop_token_ids": [],
        "sampling_seed": seed,
    }
    [out] = run_custom_generate(calculator, _args(None), [sample], [params], engine=engine, tokenizer=tok)

    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    pieces = [
        (enc("I need <calc>12*(3+4)</calc>"), 1),
        (enc("<result>84</result>"), 0),
        (enc(" so <calc>1/0</calc>"), 1),
        (enc("<result>error: division by zero</result>"), 0),
        (enc(" it is 84") + [eos], 1),
    ]
    response = [t for ids, _ in pieces for t in ids]
    assert out.tokens == prompt + response and out.response_length == len(response)
    assert out.loss_mask == [m for ids, m in pieces for _ in ids]
    lps = []
    for ids, m in pieces:  # the policy's tokens keep their log-probs in order; tool tokens get 0.0
        lps += [-0.1 * (k + 1) for k in range(len(ids))] if m else [0.0] * len(ids)
    assert out.rollout_log_probs == pytest.approx(lps)
    assert out.status == Status.COMPLETED and out.metadata["tool_calls"] == 2 and out.weight_versions == ["7"]
    assert (
        out.response == "I need <calc>12*(3+4)</calc><result>84</result> so <calc>1/0</calc>"
        "<result>error: division by zero</result> it is 84"
    )
    # each turn continues the exact token history, with the budget left and its own seed
    r1, r2, r3 = engine.requests
    assert r1.input_ids == prompt and r1.max_new_tokens == 200 and r1.seed == seed
    assert r2.input_ids == prompt + response[: len(pieces[0][0]) + len(pieces[1][0])]
    assert r2.max_new_tokens == 200 - len(pieces[0][0]) - len(pieces[1][0]) and r2.seed == derive_seed(seed, 1)
    assert r3.input_ids == prompt + response[: -len(pieces[4][0])] and r3.seed == derive_seed(seed, 2)
    assert find_call(tok, enc("no call </calc> here")) is None


def test_calculator_agent_truncates_at_the_budget(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    engine = ScriptedEngine(tok, ["<calc>2+2</calc>"], 1)
    sample = Sample(tokens=tok.encode("Q", add_special_tokens=False))
    budget = len("<calc>2+2</calc>") + 5  # the tool output does not fit: cut to the budget
    [out] = run_custom_generate(
        calculator,
        _args(None),
        [sample],
        [{"max_new_tokens": budget, "sampling_seed": 1}],
        engine=engine,
        tokenizer=tok,
    )
    assert out.response_length == budget and out.loss_mask == [1] * 16 + [0] * 5
    assert out.status == Status.TRUNCATED and out.response.endswith("<resu") and len(engine.requests) == 1


# ---- over engine servers and in a training run ------------------------------------------------------------------
def test_over_engine_servers(tiny_ckpt, tmp_path):
    """The same API over RemoteEngines: the functions run on the engines' loop, each call is a /generate."""
    env = write_fake_sglang(tmp_path)

    launcher = SGLangLauncher(fake_sglang_command, 2, log_dir=str(tmp_path / "logs"), env=env, poll=0.05)
    with RemoteEngines(launcher.start(), launcher=launcher) as engines:
        rollout = Rollout(tiny_ckpt, engines)
        groups = build_custom_samples(
            rollout.context("lichen.rollout.examples.calculator_agent.generate"),
            PROMPTS,
            replace(SAMPLING, max_response_len=4),
            seed_key=3,
            encode=rollout.encode,
        )
        for pos, group in enumerate(groups):
            for j, s in enumerate(group):
                prompt = s.tokens[: len(s.tokens) - 4]
                seed = derive_seed(5, 3, pos, j)  # (--seed, seed key, prompt, sample): the default rollout's seed
                assert s.response_tokens == [(seed * 31 + sum(prompt) + 7 * k) % 50 + 5 for k in range(4)]
                assert s.weight_versions == ["default"] and s.status == Status.TRUNCATED
        assert sum(engines.router.routed) == 6 and min(engines.router.routed) > 0


def test_training_run_with_the_calculator_agent(tiny_ckpt, addition_data, tmp_path):
    dump = str(tmp_path / "r_{rollout_id}.pt")
    rows = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "o",
            "--num-rollout",
            "1",
            "--num-threads",
            "1",
            "--custom-generate-function-path",
            "lichen.rollout.examples.calculator_agent.generate",
            "--save-debug-rollout-data",
            dump,
        )
    )
    samples = dumped_samples(dump.format(rollout_id=0))
    assert len(samples) == 16 and all(s["metadata"]["tool_calls"] == 0 for s in samples)
    assert all(len(s["loss_mask"]) == s["response_length"] for s in samples)
    assert rows[0]["train/train_rollout_logprob_abs_diff"] <= 1e-5


def test_flag_is_checked_before_any_model_loads(tiny_ckpt, addition_data, tmp_path):
    from lichen.config import parse_train_args
    from lichen.errors import ConfigError

    def parse(path):
        return parse_train_args(
            base_args(
                tiny_ckpt, addition_data, tmp_path / "o", "--num-rollout", "1", "--custom-generate-function-path", path
            )[1:]
        )

    assert parse("test_custom_generate.one_call").custom_generate_function_path == "test_custom_generate.one_call"
    for path, text in (
        ("test_custom_generate.not_async", "must be an async function"),
        ("test_custom_generate.no_such_fn", "has no attribute 'no_such_fn'"),
    ):
        with pytest.raises(ConfigError, match=text):
            parse(path)
