"""`lichen make-tiny-model`: a small random-init Hugging Face checkpoint with a character tokenizer.

The checkpoint is a real HF directory (config.json, model.safetensors, tokenizer files, generation_config.json)
that `transformers.AutoModelForCausalLM` / `AutoTokenizer`, SGLang and lichen's own model code all load, so the
whole RL loop can run on a laptop CPU. The same arguments always give a byte-identical directory.

Tokenizer. One token per character: the special tokens first (`<|pad|>`=0, `<|endoftext|>`=1 (eos),
`<|im_start|>`=2, `<|im_end|>`=3, `<|unk|>`=4), then printable ASCII (space … `~`), `\\n` and `\\t`.
It is stored as a byte-level BPE with no merges, i.e. the vocabulary is written in GPT-2's byte-to-unicode
alphabet (space is `Ġ`, newline `Ċ`, tab `ĉ`). Why: transformers 5.x loads qwen2 checkpoints with its own
`Qwen2Tokenizer`, which ignores tokenizer.json's pipeline and rebuilds a byte-level one from the vocabulary;
a plain character vocabulary then loses spaces and newlines. With the byte-level alphabet, that rebuilt
tokenizer and the generic fast tokenizer (llama, qwen3, transformers 4.x) produce the same ids, and any
sequence of character ids decodes to text that encodes back to the same ids. A character outside the
vocabulary becomes `<|unk|>` (one per UTF-8 byte) under the generic tokenizer; transformers 5.x's
`Qwen2Tokenizer` drops it instead (it builds its BPE without an unk token).
"""

from __future__ import annotations

import argparse
import json
import os

from lichen.errors import ConfigError
from lichen.models.hf_archs import HF_ARCHS

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, UNK_TOKEN)
# Printable ASCII, then the two whitespace controls a prompt commonly holds.
CHARACTERS = tuple(chr(c) for c in range(0x20, 0x7F)) + ("\n", "\t")

# arch -> (model_type, architectures[0])
ARCHS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

# ChatML. Newlines come from jinja string literals so that no whitespace control can eat them.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def all_archs() -> list[str]:
    """Every --arch: lichen's own implementations first, then those built through transformers."""
    return [*ARCHS, *HF_ARCHS]


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode table used by byte-level BPE.

    Bytes that are already printable and not whitespace (`!`..`~`, `¡`..`¬`, `®`..`ÿ`) map to themselves; the
    remaining 68 bytes map, in byte order, to code points 256, 257, … (so space 0x20 -> `Ġ` U+0120).
    """
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def token_strings() -> list[str]:
    """The tokenizer's tokens in id order, as text (special tokens, then the characters)."""
    return [*SPECIAL_TOKENS, *CHARACTERS]


def build_tokenizer():
    """The character tokenizer as a `tokenizers.Tokenizer` (see the module docstring for the layout)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    table = _byte_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[table[ord(ch)]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN, fuse_unk=False))
    # use_regex=False: no word splitting is needed when there are no merges.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def _validate(
    arch: str,
    sizes: dict[str, int],
    num_heads: int,
    num_kv_heads: int,
    hidden_size: int,
    rope_theta: float,
    rms_norm_eps: float,
    init_std: float,
) -> None:
    if arch not in ARCHS and arch not in HF_ARCHS:
        raise ConfigError(f"--arch {arch!r} is not supported; choose one of {', '.join(all_archs())}")
    for flag, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{flag} must be a positive integer, got {value!r}")
    if hidden_size % num_heads:
        raise ConfigError(
            f"--hidden-size {hidden_size} is not divisible by --num-heads {num_heads}; "
            "pick sizes where hidden_size = num_heads * head_dim"
        )
    if (hidden_size // num_heads) % 2:
        raise ConfigError(
            f"--hidden-size {hidden_size} / --num-heads {num_heads} gives an odd head dim "
            f"{hidden_size // num_heads}; rotary embeddings need an even head dim"
        )
    if num_heads % num_kv_heads:
        raise ConfigError(
            f"--num-heads {num_heads} is not divisible by --num-kv-heads {num_kv_heads}; "
            "each key/value head must serve a whole number of query heads"
        )
    for flag, value in (("--rope-theta", rope_theta), ("--rms-norm-eps", rms_norm_eps), ("--init-std", init_std)):
        if not value > 0 or value == float("inf"):
            raise ConfigError(f"{flag} must be a positive finite number, got {value!r}")


def _config(
    arch: str,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    rope_theta: float,
    rms_norm_eps: float,
    init_std: float,
) -> dict:
    model_type, architecture = ARCHS[arch]
    ids = {tok: i for i, tok in enumerate(token_strings())}
    # Written in the classic (transformers 4.x) layout that hub checkpoints and SGLang use; 5.x reads it too.
    cfg = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": len(ids),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": init_std,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        # qwen2 always has q/k/v biases (its modeling code hard-wires them); the flag documents it.
        "attention_bias": arch == "qwen2",
        "attention_dropout": 0.0,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": ids[EOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch == "llama":
        cfg.update(mlp_bias=False, pretraining_tp=1)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    return cfg


def parameter_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF parameter name, shape, init kind) in checkpoint order; kind is "normal", "ones" or "zeros"."""
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = cfg["head_dim"]
    q_dim = cfg["num_attention_heads"] * head_dim
    kv_dim = cfg["num_key_value_heads"] * head_dim
    qwen2, qwen3 = cfg["model_type"] == "qwen2", cfg["model_type"] == "qwen3"
    shapes: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (vocab, hidden), "normal")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,), "ones"),
            (p + "self_attn.q_proj.weight", (q_dim, hidden), "normal"),
            (p + "self_attn.k_proj.weight", (kv_dim, hidden), "normal"),
            (p + "self_attn.v_proj.weight", (kv_dim, hidden), "normal"),
        ]
        if qwen2:
            shapes += [
                (p + "self_attn.q_proj.bias", (q_dim,), "zeros"),
                (p + "self_attn.k_proj.bias", (kv_dim,), "zeros"),
                (p + "self_attn.v_proj.bias", (kv_dim,), "zeros"),
            ]
        if qwen3:
            shapes += [
                (p + "self_attn.q_norm.weight", (head_dim,), "ones"),
                (p + "self_attn.k_norm.weight", (head_dim,), "ones"),
            ]
        shapes += [
            (p + "self_attn.o_proj.weight", (hidden, q_dim), "normal"),
            (p + "post_attention_layernorm.weight", (hidden,), "ones"),
            (p + "mlp.gate_proj.weight", (inter, hidden), "normal"),
            (p + "mlp.up_proj.weight", (inter, hidden), "normal"),
            (p + "mlp.down_proj.weight", (hidden, inter), "normal"),
        ]
    shapes.append(("model.norm.weight", (hidden,), "ones"))
    if not cfg["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (vocab, hidden), "normal"))
    return shapes


def _init_weights(cfg: dict, seed: int, init_std: float) -> dict:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    tensors = {}
    # Draws happen in checkpoint order, so a tensor's values depend only on (seed, the shapes before it).
    for name, shape, kind in parameter_shapes(cfg):
        if kind == "normal":
            t = torch.empty(shape, dtype=torch.float32).normal_(0.0, init_std, generator=gen)
        elif kind == "ones":
            t = torch.ones(shape, dtype=torch.float32)
        else:
            t = torch.zeros(shape, dtype=torch.float32)
        tensors[name] = t
    return tensors


def _tokenizer_config(model_max_length: int) -> dict:
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    return {
        # "PreTrainedTokenizerFast" exists in transformers 4.x and is an alias of TokenizersBackend in 5.x;
        # 5.x still swaps in Qwen2Tokenizer for qwen2, which the byte-level vocabulary makes equivalent.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        # Decoding must give back the characters exactly: no space clean-up, no stripping.
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def make_tiny_model(
    out_dir: str,
    *,
    arch: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    seed: int = 0,
    init_std: float = 0.02,
) -> str:
    """Write a random-init HF checkpoint directory to `out_dir` and return its path.

    Matrices ~ N(0, init_std²) drawn from `torch.Generator().manual_seed(seed)` in checkpoint order, norm
    weights = 1, biases = 0. Same arguments -> byte-identical files.
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    sizes = {
        "--hidden-size": hidden_size,
        "--num-layers": num_layers,
        "--num-heads": num_heads,
        "--num-kv-heads": num_kv_heads,
        "--intermediate-size": intermediate_size,
        "--max-position-embeddings": max_position_embeddings,
    }
    _validate(arch, sizes, num_heads, num_kv_heads, hidden_size, rope_theta, rms_norm_eps, init_std)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ConfigError(f"--seed must be an integer in [0, 2**63), got {seed!r}")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"output path {out_dir!r} exists and is not a directory; pass a directory path")

    dims = dict(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(rms_norm_eps),
        init_std=float(init_std),
    )
    if arch in HF_ARCHS:
        _write_hf_arch(out_dir, arch, dims, seed)
    else:
        cfg = _config(arch, **dims)
        tensors = _init_weights(cfg, seed, float(init_std))

        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        _write_json(os.path.join(out_dir, "config.json"), cfg)
        weights_path = os.path.join(out_dir, "model.safetensors")
        save_file(tensors, weights_path, metadata={"format": "pt"})
        os.chmod(weights_path, 0o644)  # safetensors writes 0600; other users' engine processes must read it too
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8", newline="\n") as f:
        f.write(build_tokenizer().to_str(pretty=True) + "\n")
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), _tokenizer_config(max_position_embeddings))
    _write_json(
        os.path.join(out_dir, "special_tokens_map.json"),
        {
            "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "unk_token": UNK_TOKEN,
        },
    )
    ids = {tok: i for i, tok in enumerate(token_strings())}
    _write_json(
        os.path.join(out_dir, "generation_config.json"),
        {
            "bos_token_id": ids[EOS_TOKEN],
            # Chat turns end with <|im_end|>; plain completions with <|endoftext|>.
            "eos_token_id": [ids[EOS_TOKEN], ids[IM_END_TOKEN]],
            "pad_token_id": ids[PAD_TOKEN],
        },
    )
    return out_dir


def _write_hf_arch(out_dir: str, arch: str, dims: dict, seed: int) -> None:
    """config.json + weights of an architecture built through transformers (lichen.models.hf_archs)."""
    from lichen.models.hf_archs import hf_config, write_hf_weights

    ids = {tok: i for i, tok in enumerate(token_strings())}
    config = hf_config(arch, **dims, vocab_size=len(ids), pad_id=ids[PAD_TOKEN], eos_id=ids[EOS_TOKEN])
    write_hf_weights(config, out_dir, seed)


def count_parameters(cfg: dict) -> int:
    """Number of stored parameters (tied embeddings counted once)."""
    total = 0
    for _, shape, _ in parameter_shapes(cfg):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lichen make-tiny-model",
        description="Write a small random-init Hugging Face checkpoint (config, safetensors weights, a character "
        "tokenizer with a ChatML chat template) to OUT. The same arguments give byte-identical files.",
    )
    p.add_argument("out", metavar="OUT", help="output directory (created if missing; files in it are overwritten)")
    p.add_argument(
        "--arch",
        choices=all_archs(),
        default="llama",
        help="architecture: llama, qwen2 (q/k/v biases) or qwen3 (q/k RMSNorm), implemented by lichen; "
        "qwen3_moe, glm4, glm4_moe, gpt_oss, qwen3_next, deepseek_v3 built through transformers (run "
        "with the generic HF path, docs/models.md) (default: llama)",
    )
    p.add_argument("--hidden-size", type=int, default=64, help="model width (default: 64)")
    p.add_argument("--num-layers", type=int, default=2, help="number of decoder layers (default: 2)")
    p.add_argument(
        "--num-heads",
        type=int,
        default=4,
        help="attention heads; must divide --hidden-size into an even head dim (default: 4)",
    )
    p.add_argument(
        "--num-kv-heads",
        type=int,
        default=None,
        help="key/value heads for grouped-query attention; must divide --num-heads (default: same as --num-heads)",
    )
    p.add_argument("--intermediate-size", type=int, default=256, help="MLP inner width (default: 256)")
    p.add_argument(
        "--max-position-embeddings", type=int, default=512, help="longest sequence the config declares (default: 512)"
    )
    p.add_argument(
        "--no-tie-word-embeddings",
        dest="tie_word_embeddings",
        action="store_false",
        help="write a separate lm_head.weight instead of reusing the input embedding",
    )
    p.add_argument("--rope-theta", type=float, default=10000.0, help="rotary embedding base (default: 10000)")
    p.add_argument("--rms-norm-eps", type=float, default=1e-6, help="RMSNorm epsilon (default: 1e-6)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weight initialisation (default: 0)")
    p.add_argument(
        "--init-std",
        type=float,
        default=0.02,
        help="standard deviation of the normal init of weight matrices (default: 0.02)",
    )
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    out = make_tiny_model(
        args.out,
        arch=args.arch,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=args.tie_word_embeddings,
        rope_theta=args.rope_theta,
        rms_norm_eps=args.rms_norm_eps,
        seed=args.seed,
        init_std=args.init_std,
    )
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    if args.arch in HF_ARCHS:
        from transformers import AutoConfig

        from lichen.models.hf_archs import count_hf_parameters

        n_params = count_hf_parameters(AutoConfig.from_pretrained(out))
    else:
        n_params = count_parameters(cfg)
    print(f"wrote {args.arch} checkpoint to {out} ({n_params:,} parameters)")
    return 0
