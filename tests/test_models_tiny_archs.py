"""`lichen make-tiny-model --arch NAME` for the architectures built through transformers (lichen.models.hf_archs)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lichen.cli import main as cli_main
from lichen.errors import ConfigError
from lichen.models.hf_archs import HF_ARCHS, MAX_TINY_PARAMETERS
from lichen.models.tiny import make_tiny_model

TEXT = "Hello , World !\n\tx = 1 + 22;  y ~`@#$%^&()_|\\<>?.\n trailing  "
SMALL = dict(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48, max_position_embeddings=128
)
# The tokenizer class transformers 5.x picks for lichen's tokenizer files, per type (qwen2 alone gets its own).
TOKENIZER_CLASS = {
    "qwen3_moe": "TokenizersBackend",
    "glm4": "TokenizersBackend",
    "glm4_moe": "TokenizersBackend",
    "gpt_oss": "TokenizersBackend",
    "qwen3_next": "TokenizersBackend",
    "deepseek_v3": "TokenizersBackend",
}
MODULE_CLASS = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


@pytest.mark.parametrize("arch", list(HF_ARCHS))
def test_hf_arch_checkpoint_loads_and_tokenizer_round_trips(tmp_path, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_model(str(tmp_path / arch), arch=arch, **SMALL)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert type(model).__name__ == MODULE_CLASS[arch]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert sum(p.numel() for p in model.parameters()) < MAX_TINY_PARAMETERS
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert torch.isfinite(logits).all() and logits.shape == (1, 4, 102)

    tok = AutoTokenizer.from_pretrained(path)
    assert type(tok).__name__ == TOKENIZER_CLASS[arch]
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) == len(TEXT) and tok.decode(ids) == TEXT
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # lichen's ChatML, not the real one


def test_hf_arch_is_byte_identical_for_the_same_seed(tmp_path):
    a = make_tiny_model(str(tmp_path / "a"), arch="qwen3_moe", seed=3, **SMALL)
    b = make_tiny_model(str(tmp_path / "b"), arch="qwen3_moe", seed=3, **SMALL)
    c = make_tiny_model(str(tmp_path / "c"), arch="qwen3_moe", seed=4, **SMALL)
    read = lambda d: open(os.path.join(d, "model.safetensors"), "rb").read()  # noqa: E731
    assert read(a) == read(b) != read(c)


def test_hf_arch_too_large_is_refused_before_any_allocation(tmp_path, monkeypatch):
    """The parameter count comes from a meta-device module: the real one is never built for a large config."""
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_config
    devices = []

    def spy(config, **kw):
        devices.append(torch.empty(0).device.type)  # the default device the module would be built on
        return real(config, **kw)

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", spy)
    with pytest.raises(ConfigError, match=r"--arch qwen3_moe: these sizes give [\d,]+ parameters"):
        make_tiny_model(
            str(tmp_path / "big"), arch="qwen3_moe", hidden_size=1024, num_layers=8, num_heads=8, intermediate_size=4096
        )
    assert devices == ["meta"]
    assert not os.path.exists(tmp_path / "big" / "model.safetensors")


def test_unknown_arch_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["make-tiny-model", str(tmp_path / "x"), "--arch", "bert"])
    assert e.value.code == 2
    assert "invalid choice: 'bert'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--arch 'bert' is not supported"):
        make_tiny_model(str(tmp_path / "x"), arch="bert")


def test_cli_prints_parameter_count(tmp_path, capsys):
    assert (
        cli_main(
            [
                "make-tiny-model",
                str(tmp_path / "m"),
                "--arch",
                "deepseek_v3",
                "--hidden-size",
                "32",
                "--intermediate-size",
                "48",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "wrote deepseek_v3 checkpoint" in out
    cfg = json.load(open(tmp_path / "m" / "config.json"))
    assert cfg["model_type"] == "deepseek_v3" and cfg["vocab_size"] == 102
