"""`lichen make-tiny-model` and the tokenizer helpers, checked against transformers itself."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from lichen.cli import main as cli_main
from lichen.errors import ConfigError, DataError
from lichen.models.tiny import _parser, make_tiny_model
from lichen.models.tokenizer import encode_prompt, eos_token_ids, load_tokenizer

ARCHS = ["llama", "qwen2", "qwen3"]
SMALL = dict(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48, max_position_embeddings=128
)
TEXT = (
    "Hello , World ! isn 't do n't .\n\n\tx = 1 + 22;  y = [a-b] * {c} / 'd' \"e\" ~`@#$%^&()_|\\<>?.\n\n  trailing  "
)
SPECIAL = {"<|pad|>": 0, "<|endoftext|>": 1, "<|im_start|>": 2, "<|im_end|>": 3, "<|unk|>": 4}
# Independent statement of the vocabulary layout: specials, then printable ASCII in code order, then \n, \t.
CHAR_ID = {**{chr(c): 5 + c - 32 for c in range(32, 127)}, "\n": 100, "\t": 101}


def char_ids(text: str) -> list[int]:
    return [CHAR_ID[c] for c in text]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    out = {arch: make_tiny_model(str(root / arch), arch=arch, **SMALL) for arch in ARCHS}
    out["llama-untied"] = make_tiny_model(str(root / "untied"), arch="llama", tie_word_embeddings=False, **SMALL)
    return out


def expected_names(arch: str, num_layers: int, tied: bool) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if arch == "qwen2":
            names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
        if arch == "qwen3":
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    if not tied:
        names.add("lm_head.weight")
    return names


@pytest.mark.parametrize("key", [*ARCHS, "llama-untied"])
def test_transformers_loads_checkpoint_exactly(models, key):
    from transformers import AutoModelForCausalLM

    arch = key.split("-")[0]
    tied = key != "llama-untied"
    path = models[key]
    stored = load_file(os.path.join(path, "model.safetensors"))
    assert set(stored) == expected_names(arch, SMALL["num_layers"], tied)

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"]
    cls = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert type(model).__name__ == cls
    # Nothing was re-initialised: every loaded tensor equals the stored one bit for bit.
    state = model.state_dict()
    for name, tensor in stored.items():
        assert torch.equal(state[name], tensor), name
    if tied:
        assert torch.equal(state["lm_head.weight"], stored["model.embed_tokens.weight"])
    else:
        assert not torch.equal(stored["lm_head.weight"], stored["model.embed_tokens.weight"])

    ids = torch.tensor([char_ids("abc de\n"), char_ids("xyz 12\t")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 7, 102) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all() and logits.abs().max() > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_config_round_trips_and_shapes_match_hf(models, arch):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = models[arch]
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == arch
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (32, 2, 4, 2)
    assert (cfg.intermediate_size, cfg.max_position_embeddings, cfg.head_dim, cfg.vocab_size) == (48, 128, 8, 102)
    assert cfg.tie_word_embeddings is True and cfg.rms_norm_eps == 1e-6
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    assert rope["rope_theta"] == 10000.0
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 1, 0)
    assert cfg.dtype == torch.float32
    raw = json.load(open(os.path.join(path, "config.json")))
    assert raw["torch_dtype"] == "float32" and raw["attention_bias"] is (arch == "qwen2")

    # Shapes as transformers' own model class builds them from the config (independent of our writer).
    reference = AutoModelForCausalLM.from_config(cfg).state_dict()
    stored = load_file(os.path.join(path, "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in stored.items()} == {
        k: tuple(v.shape) for k, v in reference.items() if k != "lm_head.weight"
    }
    assert all(v.dtype == torch.float32 for v in stored.values())


def test_weight_init_values(tmp_path):
    path = make_tiny_model(
        str(tmp_path / "m"),
        arch="qwen2",
        hidden_size=64,
        num_heads=4,
        intermediate_size=128,
        num_layers=1,
        init_std=0.05,
        seed=3,
    )
    w = load_file(os.path.join(path, "model.safetensors"))
    emb = w["model.embed_tokens.weight"].double()
    # 102*64 samples of N(0, 0.05^2): sample std within ~3 % and mean within ~4 standard errors.
    assert abs(emb.std().item() - 0.05) < 0.0025 and abs(emb.mean().item()) < 4 * 0.05 / emb.numel() ** 0.5
    assert abs(w["model.layers.0.mlp.up_proj.weight"].double().std().item() - 0.05) < 0.0025
    assert torch.equal(w["model.layers.0.self_attn.q_proj.bias"], torch.zeros(64))
    assert torch.equal(w["model.layers.0.input_layernorm.weight"], torch.ones(64))
    assert torch.equal(w["model.norm.weight"], torch.ones(64))
    # Different matrices come from different draws.
    assert not torch.equal(w["model.layers.0.self_attn.q_proj.weight"], w["model.layers.0.self_attn.o_proj.weight"])


def test_same_arguments_give_byte_identical_directories(tmp_path):
    kwargs = dict(arch="qwen3", **SMALL)
    a = make_tiny_model(str(tmp_path / "a"), seed=7, **kwargs)
    b = make_tiny_model(str(tmp_path / "b"), seed=7, **kwargs)
    c = make_tiny_model(str(tmp_path / "c"), seed=8, **kwargs)
    files = sorted(os.listdir(a))
    assert (
        files
        == sorted(os.listdir(b))
        == sorted(os.listdir(c))
        == sorted(
            [
                "config.json",
                "model.safetensors",
                "tokenizer.json",
                "tokenizer_config.json",
                "special_tokens_map.json",
                "generation_config.json",
            ]
        )
    )
    read = lambda d, f: open(os.path.join(d, f), "rb").read()  # noqa: E731
    for f in files:
        assert read(a, f) == read(b, f), f
        if f != "model.safetensors":
            assert read(a, f) == read(c, f), f
    assert read(a, "model.safetensors") != read(c, "model.safetensors")
    for f in files:
        if f.endswith(".json") and f != "tokenizer.json":
            text = read(a, f).decode()
            assert text == json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips_through_autotokenizer(models, arch):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models[arch])
    assert tok.is_fast and len(tok) == 102
    ids = tok(TEXT)["input_ids"]  # default add_special_tokens=True must add nothing
    assert ids == char_ids(TEXT)
    assert tok.decode(ids) == TEXT
    every = "".join(CHAR_ID)
    assert tok.encode(every, add_special_tokens=False) == list(range(5, 102))
    assert tok.decode(list(range(5, 102))) == every
    # Any id sequence decodes to text that encodes back to the same ids (exact retokenization).
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(5, 102, (300,), generator=g).tolist()
    assert tok.encode(tok.decode(rand), add_special_tokens=False) == rand
    for text, i in SPECIAL.items():
        assert tok.convert_tokens_to_ids(text) == i
        assert tok.encode(text, add_special_tokens=False) == [i]
    assert (tok.eos_token, tok.pad_token, tok.unk_token, tok.bos_token) == ("<|endoftext|>", "<|pad|>", "<|unk|>", None)
    mixed = "<|im_start|>user\nhi<|im_end|>"
    assert tok.encode(mixed, add_special_tokens=False) == [2, *char_ids("user\nhi"), 3]
    assert tok.decode([2, *char_ids("a b"), 3], skip_special_tokens=True) == "a b"
    # Unknown characters never crash; the generic tokenizer maps them to <|unk|>.
    unk_ids = tok.encode("aé", add_special_tokens=False)
    assert unk_ids[0] == CHAR_ID["a"] and set(unk_ids[1:]) <= {4}


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_and_encode_prompt(models, arch):
    tok = load_tokenizer(models[arch])
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1 =\t?"}]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1 + 1 =\t?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == expected
    assert tok.apply_chat_template(msgs, tokenize=False) == expected[: -len("<|im_start|>assistant\n")]

    def manual(text: str) -> list[int]:  # split on the two chat markers, characters otherwise
        out, i = [], 0
        while i < len(text):
            for marker in ("<|im_start|>", "<|im_end|>"):
                if text.startswith(marker, i):
                    out.append(SPECIAL[marker])
                    i += len(marker)
                    break
            else:
                out.append(CHAR_ID[text[i]])
                i += 1
        return out

    assert encode_prompt(tok, msgs, apply_chat_template=True) == manual(expected)
    single = "<|im_start|>user\nWhat is 2?<|im_end|>\n<|im_start|>assistant\n"
    assert encode_prompt(tok, "What is 2?", apply_chat_template=True) == manual(single)
    assert encode_prompt(tok, "What is 2?\n", apply_chat_template=False) == char_ids("What is 2?\n")
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    with_tools = tok.decode(encode_prompt(tok, msgs[1:], apply_chat_template=True, tools=tools))
    assert with_tools.startswith("<|im_start|>system\n# Tools\n{") and '"calc"' in with_tools
    assert with_tools.endswith(expected[expected.index("<|im_start|>user") :])

    with pytest.raises(ConfigError, match="--apply-chat-template"):
        encode_prompt(tok, msgs, apply_chat_template=False)
    with pytest.raises(ConfigError, match="--apply-chat-template"):
        encode_prompt(tok, "hi", apply_chat_template=False, tools=tools)
    with pytest.raises(DataError, match="message 0"):
        encode_prompt(tok, ["hi"], apply_chat_template=True)


def test_eos_token_ids_and_generation_config(models, tmp_path):
    path = models["qwen3"]
    tok = load_tokenizer(path)
    assert eos_token_ids(tok, path) == [1, 3]
    assert eos_token_ids(tok, None) == [1]
    assert eos_token_ids(tok, str(tmp_path)) == [1]  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids(tok, str(tmp_path)) == [1, 7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 9, 9]}))
    assert eos_token_ids(tok, str(tmp_path)) == [1, 9]
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="generation_config.json"):
        eos_token_ids(tok, str(tmp_path))

    from transformers import GenerationConfig

    gen = GenerationConfig.from_pretrained(path)
    assert list(gen.eos_token_id) == [1, 3] and gen.pad_token_id == 0


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ConfigError, match="--hf-checkpoint.*no such directory"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="--hf-checkpoint.*no tokenizer"):
        load_tokenizer(str(tmp_path))


def test_cli_writes_model_and_reports_parameter_count(tmp_path, capsys):
    out = tmp_path / "cli-model"
    rc = cli_main(
        [
            "make-tiny-model",
            str(out),
            "--arch",
            "qwen2",
            "--hidden-size",
            "16",
            "--num-heads",
            "2",
            "--num-kv-heads",
            "1",
            "--num-layers",
            "1",
            "--intermediate-size",
            "24",
            "--no-tie-word-embeddings",
            "--seed",
            "5",
            "--init-std",
            "0.1",
        ]
    )
    assert rc == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and str(out) in line
    stored = load_file(str(out / "model.safetensors"))
    # By hand: embed 102*16 + lm_head 102*16 + final norm 16 + one layer:
    # 2 norms 2*16, q 16*16 + 16, k 8*16 + 8, v 8*16 + 8, o 16*16, mlp 3*16*24.
    by_hand = 2 * 102 * 16 + 16 + 2 * 16 + (256 + 16) + 2 * (128 + 8) + 256 + 3 * 16 * 24
    assert sum(t.numel() for t in stored.values()) == by_hand
    assert f"{by_hand:,}" in line
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_key_value_heads"], cfg["tie_word_embeddings"], cfg["initializer_range"]) == (1, False, 0.1)


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--hidden-size", "0"], "--hidden-size"),
        (["--num-layers", "-1"], "--num-layers"),
        (["--intermediate-size", "0"], "--intermediate-size"),
        (["--max-position-embeddings", "0"], "--max-position-embeddings"),
        (["--hidden-size", "66", "--num-heads", "4"], "--num-heads"),
        (["--hidden-size", "12", "--num-heads", "4"], "--hidden-size"),  # head dim 3 is odd
        (["--num-heads", "4", "--num-kv-heads", "3"], "--num-kv-heads"),
        (["--num-kv-heads", "0"], "--num-kv-heads"),
        (["--init-std", "-0.1"], "--init-std"),
        (["--seed", "-1"], "--seed"),
    ],
)
def test_cli_rejects_bad_values(tmp_path, capsys, args, flag):
    out = tmp_path / "bad"
    assert cli_main(["make-tiny-model", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert flag in err and err.startswith("lichen make-tiny-model: error:")
    assert not out.exists()


def test_cli_argparse_errors_and_help(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["make-tiny-model", str(tmp_path / "x"), "--arch", "gpt2"])
    assert exc.value.code == 2 and "--arch" in capsys.readouterr().err
    for action in _parser()._actions:
        assert action.help, action.dest
    with pytest.raises(ConfigError, match="not a directory"):
        (tmp_path / "file").write_text("x")
        make_tiny_model(str(tmp_path / "file"))
