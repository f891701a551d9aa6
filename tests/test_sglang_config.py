"""--sglang-config: a frozen model served beside the policy, never reached by weight sync, scoring the reward.

Real `lichen serve` processes on loopback: the policy's engine and a frozen "teacher" engine of the same checkpoint.
The reward (lichen.rewards.frozen_lm) is the teacher's mean log-prob of each response, checked against the
checkpoint's own log-probs computed here with transformers.
"""

from __future__ import annotations

import pytest
import torch
from helpers.runs import THREADS, base_args, dumped_samples, run

from lichen import sync
from lichen.cli import main
from lichen.config import parse_train_args
from lichen.errors import ConfigError

POLICY = "  - name: actor\n    server_groups:\n      - worker_type: regular\n        num_gpus: 1\n"


def _teacher(path: str, extra: str = "") -> str:
    return (
        f"  - name: teacher\n    model_path: {path}\n    update_weights: false\n"
        f"    server_groups:\n      - worker_type: regular\n        num_gpus: 1\n{extra}"
    )


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "sglang.yaml"
    path.write_text("sglang:\n" + text)
    return str(path)


def _mean_log_probs(ckpt: str, samples: list[dict]) -> list[float]:
    """The checkpoint's mean log p(response token | prefix), temperature 1, in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s["tokens"]])
            lp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            picked = lp.gather(1, ids[0, 1:, None])[:, 0]
            out.append(picked[-s["response_length"] :].mean().item())
    return out


@pytest.mark.slow
def test_frozen_teacher_is_never_synced_and_scores_the_reward(tiny_ckpt, addition_data, tmp_path, monkeypatch):
    config = _write(tmp_path, POLICY + _teacher(tiny_ckpt))
    seen: list[tuple] = []
    orig_push = sync.push

    def push(trainer, rollout, version, cfg=None):
        out = orig_push(trainer, rollout, version, cfg)
        seen.append((rollout.engines[0].weight_versions(), rollout.frozen_models.weight_versions()))
        return out

    monkeypatch.setattr(sync, "push", push)  # the loop calls sync.push through the module
    dump = str(tmp_path / "d" / "r_{rollout_id}.pt")
    argv = base_args(tiny_ckpt, addition_data, tmp_path / "o", "--num-rollout", "2", *THREADS)
    argv[argv.index("loop_plugins.digit_fraction")] = "lichen.rewards.frozen_lm.reward_func"
    disk = ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "w")]
    rows = run([*argv, "--sglang-config", config, *disk, "--save-debug-rollout-data", dump])
    # the policy's engine (from the file's updatable model) took every version; the teacher kept its first
    assert [policy for policy, _ in seen] == [["0"], ["1"], ["2"]]
    initial = seen[0][1]["teacher"]
    assert len(initial) == 1 and all(frozen == {"teacher": initial} for _, frozen in seen)
    assert rows[1]["sync/weight_version"] == 2
    for step in range(2):
        samples = dumped_samples(dump.format(rollout_id=step))
        expected = _mean_log_probs(tiny_ckpt, samples)  # the untrained checkpoint's values
        assert [s["reward"] for s in samples] == pytest.approx(expected, abs=1e-4)
        for s in samples:
            assert len(s["metadata"]["frozen_log_probs"]) == s["response_length"]
        policy_means = [sum(s["rollout_log_probs"]) / len(s["rollout_log_probs"]) for s in samples]
        gap = max(abs(p - r) for p, r in zip(policy_means, expected))
        if step == 0:  # teacher and policy are the same weights before training ...
            assert gap <= 1e-4
        else:  # ... after a step the policy moved and the teacher did not
            assert gap > 1e-3


def _parse(tiny_ckpt, addition_data, tmp_path, *extra):
    return parse_train_args(base_args(tiny_ckpt, addition_data, tmp_path / "o", "--num-rollout", "1", *extra)[1:])


def test_policy_engines_come_from_the_file(tiny_ckpt, addition_data, tmp_path):
    args = _parse(tiny_ckpt, addition_data, tmp_path, "--sglang-config", _write(tmp_path, POLICY + _teacher(tiny_ckpt)))
    assert args.rollout_num_engines == 1
    (spec,) = args.sglang_frozen_models
    assert (spec.name, spec.model_path, spec.num_engines) == ("teacher", tiny_ckpt, 1)


@pytest.mark.parametrize(
    "text, message",
    [
        (_teacher("{ckpt}", "        overrides: {{mem_fraction_static: 0.5}}\n"), "key 'overrides'"),
        (_teacher("{ckpt}").replace("regular", "prefill"), "worker_type 'prefill'"),
        (_teacher("{ckpt}").replace("update_weights", "refit"), "key 'refit' is not part of slime's format"),
        (_teacher("{ckpt}").replace("num_gpus: 1", "num_gpus: 0"), "num_gpus must be a positive integer"),
        (_teacher("{ckpt}").replace("model_path: {ckpt}", "model_path: /nonexistent"), "not an HF checkpoint"),
        (POLICY + POLICY.replace("actor", "actor2"), "a second model with update_weights true"),
        (_teacher("{ckpt}").replace("num_gpus: 1", "num_gpus: 2\n        num_gpus_per_engine: 2"), "backend sglang"),
    ],
)
def test_unsupported_parts_of_slimes_format_are_usage_errors(tiny_ckpt, addition_data, tmp_path, text, message):
    config = _write(tmp_path, text.format(ckpt=tiny_ckpt))
    with pytest.raises(ConfigError, match=message):
        _parse(tiny_ckpt, addition_data, tmp_path, "--sglang-config", config)


def test_conflicting_engine_flags_are_usage_errors(tiny_ckpt, addition_data, tmp_path, capsys):
    config = _write(tmp_path, POLICY)
    with pytest.raises(ConfigError, match="has 1 engine.* --rollout-num-engines is 2"):
        _parse(tiny_ckpt, addition_data, tmp_path, "--sglang-config", config, "--rollout-num-engines", "2")
    argv = base_args(tiny_ckpt, addition_data, tmp_path / "o", "--sglang-config", config)
    argv += ["--rollout-external-engine-addrs", "127.0.0.1:9", "--update-weight-transport", "disk"]
    assert main(argv + ["--update-weight-disk-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--sglang-config and --rollout-external-engine-addrs exclude each other" in err and "Traceback" not in err
