"""--use-opd --opd-type sglang: the teacher's log-probs come from its engine servers (a frozen model of
--sglang-config), are stored per sample, and make the trainer's distillation term.

A real run: the policy's `lichen serve` engine and a frozen teacher engine of ANOTHER tiny checkpoint (other seed).
Checked against independent references: each dumped sample's teacher_log_probs equal the teacher checkpoint's own
log-probs computed here with transformers, and the step's train/opd_reverse_kl equals the mean over trained tokens of
(engine log-prob - teacher log-prob) computed from the dump."""

from __future__ import annotations

import pytest
import torch
from helpers.runs import THREADS, base_args, dumped_samples, run

from lichen.config import parse_train_args
from lichen.errors import ConfigError

POLICY = "  - name: actor\n    server_groups:\n      - worker_type: regular\n        num_gpus: 1\n"


def _config(tmp_path, teacher: str | None, name: str = "teacher") -> str:
    text = POLICY
    if teacher is not None:
        text += (
            f"  - name: {name}\n    model_path: {teacher}\n    update_weights: false\n"
            "    server_groups:\n      - worker_type: regular\n        num_gpus: 1\n"
        )
    path = tmp_path / "sglang.yaml"
    path.write_text("sglang:\n" + text)
    return str(path)


@pytest.fixture(scope="module")
def teacher_ckpt(tmp_path_factory) -> str:
    from lichen.models.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("teacher")), seed=7)


def _log_probs(ckpt: str, s: dict) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([s["tokens"]])
        lp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
        return lp.gather(1, ids[0, 1:, None])[:, 0][-s["response_length"] :].tolist()


@pytest.mark.slow
def test_served_teacher_log_probs_make_the_distillation_term(tiny_ckpt, teacher_ckpt, addition_data, tmp_path):
    dump = str(tmp_path / "d" / "r_{rollout_id}.pt")
    argv = base_args(tiny_ckpt, addition_data, tmp_path / "o", "--num-rollout", "1", *THREADS)
    disk = ["--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "w")]
    opd = ["--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "0.5"]
    rows = run(
        [*argv, "--sglang-config", _config(tmp_path, teacher_ckpt), *disk, *opd, "--save-debug-rollout-data", dump]
    )
    samples = dumped_samples(dump.format(rollout_id=0))
    worst = 0.0
    for s in samples[:4]:  # transformers' forward per sample is the slow part: one group is enough
        expected = _log_probs(teacher_ckpt, s)
        assert len(s["teacher_log_probs"]) == s["response_length"] == len(expected)
        worst = max(worst, max(abs(a - b) for a, b in zip(s["teacher_log_probs"], expected)))
    assert worst <= 1e-4, worst
    num = den = 0.0
    for s in samples:
        for lp, tlp, m in zip(s["rollout_log_probs"], s["teacher_log_probs"], s["loss_mask"]):
            num, den = num + m * (lp - tlp), den + m
    assert rows[0]["train/opd_reverse_kl"] == pytest.approx(num / den, abs=1e-5)
    assert abs(num / den) > 1e-2  # another model: the term is not trivially zero
    assert rows[0]["time/opd_teacher"] > 0


def _parse(tiny_ckpt, addition_data, tmp_path, *extra):
    return parse_train_args(base_args(tiny_ckpt, addition_data, tmp_path / "o", "--num-rollout", "1", *extra)[1:])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--opd-type", "sglang"], "--opd-type sglang is only used with --use-opd"),
        (["--use-opd", "--opd-type", "sglang"], "no frozen model is described"),
        (["--use-opd", "--opd-type", "sglang", "--opd-teacher-load", "."], "--opd-teacher-load is not used"),
        (["--use-opd"], "--use-opd needs a teacher"),
    ],
)
def test_opd_type_rules(tiny_ckpt, addition_data, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        _parse(tiny_ckpt, addition_data, tmp_path, "--rollout-num-engines", "1", *extra)


def test_two_frozen_models_need_one_named_teacher(tiny_ckpt, teacher_ckpt, addition_data, tmp_path):
    text = POLICY + "".join(
        f"  - name: {n}\n    model_path: {teacher_ckpt}\n    update_weights: false\n"
        "    server_groups:\n      - worker_type: regular\n        num_gpus: 1\n"
        for n in ("judge", "coach")
    )
    path = tmp_path / "sglang.yaml"
    path.write_text("sglang:\n" + text)
    with pytest.raises(ConfigError, match="its frozen models are judge, coach"):
        _parse(tiny_ckpt, addition_data, tmp_path, "--sglang-config", str(path), "--use-opd", "--opd-type", "sglang")
    args = _parse(
        tiny_ckpt,
        addition_data,
        tmp_path,
        "--sglang-config",
        _config(tmp_path, teacher_ckpt, name="coach"),
        "--use-opd",
        "--opd-type",
        "sglang",
    )
    assert args.opd_type == "sglang"
