"""Loading a checkpoint's tokenizer and turning prompts into token ids.

Works for lichen's tiny checkpoints and for real Hugging Face checkpoints alike: the tokenizer is whatever
`transformers.AutoTokenizer` builds from the directory. These helpers hide the differences between
transformers 4.x and 5.x (e.g. what `apply_chat_template` returns).
"""

from __future__ import annotations

import json
import os
from typing import Any

from lichen.errors import ConfigError, DataError, PromptTooLong

# Any one of these means the directory carries a tokenizer that AutoTokenizer can try to build.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "tekken.json",
)


def load_tokenizer(path: str, *, trust_remote_code: bool = False) -> Any:
    """`AutoTokenizer.from_pretrained(path)`, with a `ConfigError` naming `--hf-checkpoint` when it cannot load."""
    if not os.path.isdir(path):
        raise ConfigError(
            f"--hf-checkpoint {path!r}: no such directory; pass a local Hugging Face checkpoint directory "
            "(`lichen make-tiny-model DIR` writes a small one)"
        )
    if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        raise ConfigError(
            f"--hf-checkpoint {path!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
            "copy the tokenizer files of the model into that directory"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"--hf-checkpoint {path!r}: transformers could not load its tokenizer "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); check the tokenizer files"
        ) from e


def _as_id_list(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{where}: eos_token_id must be an integer or a list of integers, got {value!r}")
    return list(values)


def eos_token_ids(tokenizer: Any, model_dir: str | None) -> list[int]:
    """Ids that end a generation: the tokenizer's eos id, then generation_config.json's `eos_token_id`
    (an int or a list), without duplicates, in that order."""
    ids = _as_id_list(getattr(tokenizer, "eos_token_id", None), "tokenizer")
    if model_dir is not None:
        gen_path = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(gen_path):
            try:
                with open(gen_path, encoding="utf-8") as f:
                    gen = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ConfigError(f"{gen_path}: cannot read it as JSON ({e}); fix or remove the file") from e
            if not isinstance(gen, dict):
                raise ConfigError(f"{gen_path}: expected a JSON object, got {type(gen).__name__}")
            ids += _as_id_list(gen.get("eos_token_id"), gen_path)
    return list(dict.fromkeys(ids))


def _check_messages(prompt: list) -> list[dict]:
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or "role" not in m:
            raise DataError(f"chat prompt message {i} is {m!r}; each message must be a dict with 'role' and 'content'")
    return list(prompt)


def encode_prompt(
    tokenizer: Any,
    prompt: str | list[dict],
    apply_chat_template: bool,
    tools: list | None = None,
    max_chars: int | None = None,
) -> list[int]:
    """Token ids of a prompt, never with tokenizer-added special tokens (BOS/EOS); a prompt whose text is longer
    than `max_chars` raises PromptTooLong before the tokenizer sees it (lichen.data.fit).

    With `apply_chat_template`, `prompt` (a list of chat messages, or a string taken as one user message) is
    rendered by the tokenizer's chat template with the assistant generation prompt appended, then encoded.
    Without it, `prompt` must be a string and is encoded as is.
    """
    if not apply_chat_template:
        if not isinstance(prompt, str):
            raise ConfigError(
                "the prompt is a list of chat messages; pass --apply-chat-template to render it with the "
                "tokenizer's chat template"
            )
        if tools:
            raise ConfigError("tools are rendered by the chat template; pass --apply-chat-template to use them")
        text = prompt
    else:
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list):
            messages = _check_messages(prompt)
        else:
            raise DataError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError(
                f"--apply-chat-template: the tokenizer of {getattr(tokenizer, 'name_or_path', '?')!r} has no "
                "chat template; drop the flag or use a checkpoint that has one"
            )
        kwargs = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        if isinstance(text, list):  # some versions return a batch even for one conversation
            (text,) = text
    if max_chars is not None and len(text) > max_chars:
        raise PromptTooLong(len(text), max_chars)
    return list(tokenizer.encode(text, add_special_tokens=False))
