"""--model-impl, --trust-remote-code and --qwen-gdn-backend: what the dry run refuses (exit 2, one line) and what
the loaders pick (docs/models.md)."""

from __future__ import annotations

import inspect
import json
import logging

import pytest
import torch

import lichen.cli
from lichen.errors import ConfigError
from lichen.models.gdn_backend import apply_gdn_backend, resolve_gdn_backend
from lichen.models.loading import load_model
from lichen.models.tiny import make_tiny_model

SMALL = dict(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48, max_position_embeddings=128
)


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hf").mkdir()
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    return tmp_path


def dry_run(run_dir, config: dict | None, *extra: str, capsys, hf: str = "hf"):
    if config is not None:
        (run_dir / "hf" / "config.json").write_text(json.dumps(config))
    rc = lichen.cli.main(
        [
            "train",
            "--hf-checkpoint",
            hf,
            "--prompt-data",
            "prompts.jsonl",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--rm-type",
            "math",
            "--num-rollout",
            "1",
            "--dry-run",
            *extra,
        ]
    )
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    "config, extra, needle",
    [
        ({"model_type": "no_such_model"}, [], "has no causal-LM class for model_type 'no_such_model'"),
        ({"model_type": "vit"}, [], "has no causal-LM class for model_type 'vit'"),  # an image model
        (
            {"model_type": "my_custom", "auto_map": {"AutoModelForCausalLM": "modeling_x.MyLM"}},
            [],
            "pass --trust-remote-code",
        ),
        (
            {"model_type": "gpt_oss"},
            ["--model-impl", "lichen"],
            "--model-impl lichen: model_type 'gpt_oss' has no lichen implementation",
        ),
    ],
)
def test_dry_run_refuses_what_cannot_load(run_dir, capsys, config, extra, needle):
    rc, out, err = dry_run(run_dir, config, *extra, capsys=capsys)
    assert rc == 2 and out == "" and needle in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "config, extra",
    [
        ({"model_type": "my_custom", "auto_map": {"AutoModelForCausalLM": "modeling_x.MyLM"}}, ["--trust-remote-code"]),
        ({"model_type": "gpt_oss"}, []),
        ({"model_type": "llama"}, ["--model-impl", "hf"]),
    ],
)
def test_dry_run_accepts_what_loads(run_dir, capsys, config, extra):
    rc, out, err = dry_run(run_dir, config, *extra, capsys=capsys)
    assert rc == 0, err


def test_gdn_backend_explicit_fla_or_flashqla_without_the_package_exits_2(run_dir, capsys):
    rc, _, err = dry_run(run_dir, {"model_type": "qwen3_next"}, "--qwen-gdn-backend", "fla", capsys=capsys)
    assert rc == 2 and "flash-linear-attention package (import fla) is not installed" in err
    rc, _, err = dry_run(run_dir, None, "--qwen-gdn-backend", "flashqla", capsys=capsys)
    assert rc == 2 and "FlashQLA" in err
    rc, out, err = dry_run(run_dir, None, "--qwen-gdn-backend", "torch", capsys=capsys)
    assert rc == 0 and "qwen_gdn_backend: torch" in out


def test_gdn_backend_unset_resolves_to_torch_here_and_is_logged(run_dir, capsys, caplog):
    assert not torch.cuda.is_available()  # this machine: no CUDA, so the automatic choice is torch
    with caplog.at_level(logging.INFO, logger="lichen.models.gdn_backend"):
        rc, out, _ = dry_run(run_dir, {"model_type": "qwen3_next"}, capsys=capsys)
    assert rc == 0 and "qwen_gdn_backend: torch" in out
    assert "--qwen-gdn-backend unset: using torch" in caplog.text
    with pytest.raises(ConfigError, match="choose one of fla, flashqla, torch"):
        resolve_gdn_backend("triton")


def test_gdn_chunked_matches_recurrent_on_cpu():
    """transformers' reference chunked gated delta rule (prompts) against its recurrent form (decode), the two
    kernels --qwen-gdn-backend torch runs, on random inputs with an initial state."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    apply_gdn_backend("qwen3_next", "torch")
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 2, 37, 3, 8, 6
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, generator=gen)  # log decay <= 0
    beta = torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, K, V, generator=gen)
    kw = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out_c, final_c = m.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=16, **kw)
    out_r, final_r = m.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)
    assert (out_c - out_r).abs().max() < 1e-5 and (final_c - final_r).abs().max() < 1e-5
    # the bound functions are the reference code itself, not transformers' dispatch (which runs fla when present)
    for fn, name in (
        (m.torch_chunk_gated_delta_rule, "torch_chunk_gated_delta_rule"),
        (m.torch_recurrent_gated_delta_rule, "torch_recurrent_gated_delta_rule"),
    ):
        assert inspect.isfunction(fn) and fn.__code__.co_name == name and not hasattr(fn, "__wrapped__")
        assert inspect.getsourcefile(fn) == inspect.getsourcefile(m)


def test_gdn_torch_backend_is_what_a_qwen3_next_layer_runs(tmp_path, monkeypatch):
    """The kernels lichen binds are the ones the model's Gated DeltaNet layers call: a prompt runs the chunked
    kernel, one decode step the recurrent one."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    d = make_tiny_model(str(tmp_path / "next"), arch="qwen3_next", **SMALL)
    model = load_model(d, gdn_backend="torch")
    calls = {"chunk": 0, "recurrent": 0}

    def spy(key, fn):
        def run(*a, **kw):
            calls[key] += 1
            return fn(*a, **kw)

        return run

    monkeypatch.setattr(m, "torch_chunk_gated_delta_rule", spy("chunk", m.torch_chunk_gated_delta_rule))
    monkeypatch.setattr(m, "torch_recurrent_gated_delta_rule", spy("recurrent", m.torch_recurrent_gated_delta_rule))
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        out = model.hf(ids, use_cache=True)
        assert calls["chunk"] >= 1 and calls["recurrent"] == 0
        model.hf(torch.tensor([[13]]), past_key_values=out.past_key_values, use_cache=True)
    assert calls["recurrent"] >= 1


def test_model_impl_auto_picks_and_logs(tmp_path, caplog):
    llama = make_tiny_model(str(tmp_path / "llama"), arch="llama", **SMALL)
    moe = make_tiny_model(str(tmp_path / "moe"), arch="qwen3_moe", **SMALL)
    with caplog.at_level(logging.INFO, logger="lichen.models.loading"):
        own, generic, forced = load_model(llama), load_model(moe), load_model(llama, impl="hf")
    assert not getattr(own, "is_hf", False) and generic.is_hf and forced.is_hf
    # the default (lichen's own code) is quiet at INFO: a user error after loading stays the only stderr line
    assert "-> lichen implementation" not in caplog.text
    assert "model_type llama, --model-impl hf -> hf implementation" in caplog.text
    assert "model_type qwen3_moe, --model-impl auto -> hf implementation" in caplog.text
    ids, pos = torch.tensor([[5, 9, 13, 2]]), torch.arange(4)[None]
    with torch.no_grad():  # the same checkpoint through both implementations
        assert torch.allclose(own.logits(own(ids, pos)), forced.logits(forced(ids, pos)), atol=1e-5)
    with pytest.raises(ConfigError, match="--model-impl lichen: model_type 'qwen3_moe'"):
        load_model(moe, impl="lichen")


def test_slime_table_lists_how_qwen_gdn_backend_differs(run_dir):
    from lichen.config import parse_train_args
    from lichen.config.slime.flags import DIFFERS_CLASS

    (run_dir / "hf" / "config.json").write_text("{}")
    args = parse_train_args(
        [
            "--hf-checkpoint",
            "hf",
            "--prompt-data",
            "prompts.jsonl",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--num-rollout",
            "1",
            "--rm-type",
            "math",
            "--use-mcore-models",
            "--qwen-gdn-backend",
            "torch",
        ],
        show_table=lambda _t: None,
    )
    row = next(r for r in args._slime_rows if r.flag == "--qwen-gdn-backend")
    assert row.cls == DIFFERS_CLASS and "lichen adds torch" in row.note
