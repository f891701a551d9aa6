"""A scratch `$BASE_DIR` in which a slime launch script dry-runs without the real model or data.

`lichen port-slime --dry-run` reads only the `--hf-checkpoint` config.json and tokenizer, looks at the shape of the
`--ref-load` / `--load` directories and at the data files. This module writes exactly those: a config.json whose
dimensions come from the script's own `MODEL_ARGS` (as lichen's bash evaluator computes them), mapped to
config.json fields through the checked-flag table (lichen.config.slime.megatron_model), a tokenizer copied from a
given directory, torch_dist-shaped checkpoint directories and one-prompt data files. Used by
`scripts/slime_scripts_table.py` (every launch script of a slime checkout) and tests/test_slime_port.py.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

from lichen.config.slime.megatron_model import _FLAG_VALUE, SHAPE_FIELDS, WARN_FIELDS, check_flag
from lichen.port_slime import _number_or_text
from lichen.port_slime import bash_syntax as syn
from lichen.port_slime.bash_builtins import Finished, ScriptExit
from lichen.port_slime.bash_eval import Shell
from lichen.port_slime.bash_values import Assumptions, Unknowable

# model_type of the released model each slime model file (scripts/models/<stem>.sh) describes: facts about the
# published checkpoints' config.json, which the model files do not state
MODEL_TYPES = {
    "deepseek-v3": "deepseek_v3",
    "deepseek-v3-5layer": "deepseek_v3",
    "deepseek-v3-20layer": "deepseek_v3",
    "moonlight": "deepseek_v3",
    "glm4-9B": "glm4",
    "glm4-32B": "glm4",
    "glm4.5-106B-A12B": "glm4_moe",
    "glm4.5-355B-A32B": "glm4_moe",
    "glm4.7-30B-A3B": "glm4_moe_lite",
    "glm5-744B-A40B": "glm_moe_dsa",
    "glm5.2-744B-A40B": "glm_moe_dsa",
    "gpt-oss-20B": "gpt_oss",
    "kimi-k2": "kimi_k2",
    "kimi-k2-thinking": "kimi_k2",
    "llama3.1-8B-Instruct": "llama",
    "llama3.2-3B-Instruct": "llama",
    "llama3.2-3B-Instruct-amd": "llama",
    "mimo-7B-rl": "mimo",
    "minimax-m2": "minimax_m2",
    "qwen2.5-0.5B": "qwen2",
    "qwen2.5-1.5B": "qwen2",
    "qwen2.5-3B": "qwen2",
    "qwen2.5-7B": "qwen2",
    "qwen2.5-32B": "qwen2",
    "qwen3-0.6B": "qwen3",
    "qwen3-1.7B": "qwen3",
    "qwen3-4B": "qwen3",
    "qwen3-4B-Instruct-2507": "qwen3",
    "qwen3-8B": "qwen3",
    "qwen3-14B": "qwen3",
    "qwen3-32B": "qwen3",
    "qwen3-30B-A3B": "qwen3_moe",
    "qwen3-235B-A22B": "qwen3_moe",
    "qwen3-next-80B-A3B": "qwen3_next",
    "qwen3.5-0.8B": "qwen3_5",
    "qwen3.5-4B": "qwen3_5",
    "qwen3.5-9B": "qwen3_5",
    "qwen3.5-27B": "qwen3_5",
    "qwen3.5-35B-A3B": "qwen3_5_moe",
    "qwen3.5-35B-A3B-vl": "qwen3_5_moe",
}
# config.json fields the checked table computes from others (its tuple fields): the field that holds the value
_COMPUTED_FIELDS = {
    "shared expert size": "shared_expert_intermediate_size",
    "rope_scaling (a scaled rope type)": "rope_scaling.rope_type",
    "not tie_word_embeddings": "tie_word_embeddings",
}
_UNTIE = "--untie-embeddings-and-output-weights"


@dataclass
class ScriptInputs:
    """What a launch script's dry run reads: its train.py argv, its MODEL_ARGS, the model files it sources."""

    argv: list[str]
    model_args: list[str]
    model_files: list[str] = field(default_factory=list)
    written: dict[str, str] = field(default_factory=dict)  # `cat > FILE <<EOF` of the script: FILE -> its text

    def value(self, flag: str) -> str | None:
        """The (last) value of `flag` in argv, or None."""
        found = None
        for i, token in enumerate(self.argv):
            if token == flag and i + 1 < len(self.argv) and not self.argv[i + 1].startswith("--"):
                found = self.argv[i + 1]
            elif token.startswith(flag + "="):
                found = token.split("=", 1)[1]
        return found

    @property
    def model_type(self) -> str | None:
        """The released model's model_type, from the last model file sourced that MODEL_TYPES knows."""
        for path in reversed(self.model_files):
            stem = os.path.splitext(os.path.basename(path))[0]
            if stem in MODEL_TYPES:
                return MODEL_TYPES[stem]
        return None


class _Recorder(Shell):
    """lichen's bash evaluator, recording the files the script sources, the here-documents it writes to files and
    MODEL_ARGS at its train.py command."""

    def __init__(self, environ: dict[str, str], assume: Assumptions) -> None:
        super().__init__(environ, assume, self._at_command)
        self.read: list[str] = []
        self.model_args: list[str] = []
        self.argv: list[str] = []
        self.written: dict[str, str] = {}

    def run_file(self, path: str) -> None:
        self.read.append(path)
        super().run_file(path)

    def _b_cat(self, args: list[syn.Word], node: syn.Simple) -> None:
        docs = [r for r in node.redirects if r.op in ("<<", "<<-")]
        outs = [r for r in node.redirects if r.op in (">", ">|") and r.fd in ("", "1")]
        if not args and docs and outs and self.shadow is None:
            try:
                doc = docs[-1]
                text = self.one(doc.body or "", heredoc=True) if doc.expand else doc.body or ""
                self.written[self.one(outs[-1].target)] = text
            except Unknowable:
                pass  # a file port-slime cannot name or fill: the dry run then says what is missing
        super()._b_cat(args, node)

    def _at_command(self, words: list, where: str, shadow: object) -> None:
        texts = [w if isinstance(w, str) else "" for w in words]
        entry = next((i for i, w in enumerate(texts) if os.path.basename(w) in ("train.py", "train_async.py")), None)
        if entry is None or not entry or not os.path.basename(texts[entry - 1]).startswith("python"):
            return
        args = self.state.vars.get("MODEL_ARGS")
        self.model_args = list(args) if isinstance(args, list) else []
        self.argv = texts[entry + 1 :]
        raise Finished()


def read_inputs(script: str, assume: Assumptions, environ: dict[str, str] | None = None) -> ScriptInputs:
    """Evaluate `script` (never run it) for `environ` + `assume`: its train.py argv, MODEL_ARGS, model files.
    What the evaluator cannot compute stays out (port-slime itself reports it)."""
    shell = _Recorder(dict(os.environ if environ is None else environ), assume)
    try:
        shell.run_file(script)
    except (Finished, ScriptExit):
        pass
    models = [p for p in shell.read[1:] if os.path.basename(os.path.dirname(p)) == "models"]
    return ScriptInputs(shell.argv, shell.model_args, models, shell.written)


def _flags(tokens: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current = None
    for token in tokens:
        if token.startswith("--"):
            current, eq, inline = token.partition("=")
            out[current] = [inline] if eq else []
        elif current is not None:
            out[current].append(token)
    return out


def config_from_model_args(model_args: list[str], model_type: str | None) -> dict:
    """A config.json of the dimensions MODEL_ARGS states: each flag of the checked table sets the field it is
    compared with (for `model_type`); a flag outside the table sets nothing. Megatron ties the embeddings unless
    told `--untie-embeddings-and-output-weights`."""
    flags = _flags(model_args)
    config: dict = {"model_type": model_type} if model_type else {}
    config["tie_word_embeddings"] = _UNTIE not in flags
    for flag, values in flags.items():
        spec = None
        for table in (SHAPE_FIELDS, WARN_FIELDS):
            if flag in table:
                default, per_type = table[flag]
                spec = per_type.get(model_type or "", default)
        if spec is None or flag == _UNTIE:
            continue
        key = spec if isinstance(spec, str) else _COMPUTED_FIELDS.get(spec[0], spec[0])
        raw = _FLAG_VALUE[flag](values[0]) if values and flag in _FLAG_VALUE else (values[0] if values else None)
        value = _number_or_text(raw) if raw is not None else "yarn"  # an on/off flag: a scaled rope type
        if "." in key:
            outer, inner = key.split(".", 1)
            config.setdefault(outer, {})[inner] = value
        else:
            config[key] = value
    return config


def mismatches(model_args: list[str], config: dict) -> list[str]:
    """The checked comparisons of MODEL_ARGS against `config` that do not match (empty for a config built by
    config_from_model_args: the table's fields round-trip)."""
    out = []
    for flag, values in _flags(model_args).items():
        if flag in SHAPE_FIELDS or flag in WARN_FIELDS:
            note, _stops = check_flag(flag, values, config, "")
            if not note.startswith("matches"):
                out.append(note)
    return out


def write_model_dir(path: str, config: dict, tokenizer_dir: str) -> None:
    """`path`/config.json and the tokenizer files of `tokenizer_dir`: what a dry run reads of an HF checkpoint."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    copy_tokenizer(tokenizer_dir, path)


def copy_tokenizer(tokenizer_dir: str, path: str) -> None:
    """The files of `tokenizer_dir` into `path` (made if missing)."""
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(path, name))


def write_torch_dist(path: str) -> None:
    """A directory shaped like a Megatron torch_dist checkpoint (iteration 1, a `.metadata` shard file)."""
    os.makedirs(os.path.join(path, "iter_0000001"), exist_ok=True)
    with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w", encoding="utf-8") as f:
        f.write("1")
    open(os.path.join(path, "iter_0000001", ".metadata"), "wb").close()


def write_data_file(path: str, input_key: str = "prompt", label_key: str = "label") -> None:
    """One prompt row under the script's --input-key / --label-key, as .jsonl (or .parquet by its name)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    prompt: object = "1+1?"
    if input_key == "messages":  # slime's SFT data: a chat
        prompt = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    row = {input_key: prompt, label_key: "2"}
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([row]), path)
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


_DATA_EXTS = (".jsonl", ".json", ".parquet")


def populate(inputs: ScriptInputs, base: str, tokenizer_dir: str) -> dict | None:
    """Write under `base` what the script's dry run reads: the --hf-checkpoint directory (config.json from
    MODEL_ARGS, the tokenizer), torch_dist-shaped --ref-load / --load directories (not the --hf-checkpoint
    itself, nor a --load that is the --save directory: a first run's is empty), every data file the argv names
    under `base` and the files the script writes there with `cat > FILE <<EOF`. The config written, or None when
    the script names no --hf-checkpoint under `base`."""
    root = os.path.abspath(base) + os.sep

    def under(path: str | None) -> bool:  # only what the script names inside the scratch dir is written
        return path is not None and os.path.abspath(path).startswith(root)

    hf = inputs.value("--hf-checkpoint")
    config = None
    if hf is not None and under(hf):
        config = config_from_model_args(inputs.model_args, inputs.model_type)
        write_model_dir(hf, config, tokenizer_dir)
    # slime's --load is its --save directory: empty on the first run (slime then starts from --ref-load), so only
    # a --load elsewhere is a checkpoint to resume from
    own = {os.path.abspath(p) for p in (hf, inputs.value("--save")) if p is not None}
    for flag in ("--ref-load", "--load"):
        path = inputs.value(flag)
        if path is not None and under(path) and os.path.abspath(path) not in own:
            write_torch_dist(path)
    keys = (inputs.value("--input-key") or "prompt", inputs.value("--label-key") or "label")
    for token in inputs.argv:
        if under(token) and token.endswith(_DATA_EXTS):
            write_data_file(token, *keys)
    for path, text in inputs.written.items():
        if under(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
    return config
