"""Each advantage estimator runs the loop for 3 steps with recomputed old log-probs; on the dumped last step the
advantages the trainer used must equal an independent float64 loop over that step's rewards and log-probs."""

import math

import pytest
import torch
from helpers.runs import base_args, read_dump, run


def groups_of(samples):
    out = {}
    for i, s in enumerate(samples):
        out.setdefault(s["group_index"], []).append(i)
    return out


def whiten_ref(values, lengths):
    flat = [v for row, n in zip(values, lengths) for v in row[:n]]
    mean = sum(flat) / len(flat)
    var = sum((v - mean) ** 2 for v in flat) / max(len(flat) - 1, 1)  # sample variance, as slime
    return [[(v - mean) / math.sqrt(var + 1e-8) for v in row[:n]] for row, n in zip(values, lengths)]


def reference_advantages(est, d, kl_coef=0.0):
    samples, r = d["samples"], d["rewards"].double().tolist()
    lengths = [s["response_length"] for s in samples]
    seq = [0.0] * len(samples)
    for idx in groups_of(samples).values():
        vals = [r[i] for i in idx]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        for i in idx:
            others = [r[j] for j in idx if j != i]
            if est in ("grpo", "gspo", "cispo"):
                seq[i] = (r[i] - mean) / (std + 1e-6)
            elif est == "rloo":
                seq[i] = r[i] - sum(others) / len(others)
            elif est == "reinforce_plus_plus_baseline":
                seq[i] = r[i] - mean
    if est in ("grpo", "gspo", "cispo", "rloo"):
        return [[seq[i]] * n for i, n in enumerate(lengths)]
    if est == "reinforce_plus_plus_baseline":
        return whiten_ref([[seq[i]] * n for i, n in enumerate(lengths)], lengths)
    old, ref = d["old_log_probs"].double(), d["ref_log_probs"]
    rows = []
    for i, n in enumerate(lengths):
        tok = [-kl_coef * (old[i, t].item() - ref[i, t].item()) for t in range(n)]
        tok[n - 1] += r[i]
        rows.append([sum(tok[t:]) for t in range(n)])  # gamma = 1
    return whiten_ref(rows, lengths)


ESTIMATORS = {
    "grpo": [],
    "gspo": [],
    "cispo": [],
    "rloo": [],
    "reinforce_plus_plus": ["--normalize-advantages", "--kl-coef", "0.1"],
    "reinforce_plus_plus_baseline": ["--normalize-advantages"],
}


@pytest.mark.parametrize("est", list(ESTIMATORS))
def test_estimator_advantages_match_reference(est, tiny_ckpt, addition_data, tmp_path):
    dump = str(tmp_path / "train_{rollout_id}.pt")
    rows = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "r",
            "--num-rollout",
            "3",
            "--advantage-estimator",
            est,
            "--micro-batch-size",
            "4",
            "--force-recompute-old-log-probs",
            "--save-debug-train-data",
            dump,
            *ESTIMATORS[est],
        )
    )
    assert len(rows) == 3 and all(abs(m["train/ppo_kl_first_step"]) <= 1e-6 for m in rows)
    d = read_dump(dump.format(rollout_id=2))
    want = reference_advantages(est, d, kl_coef=0.1 if est == "reinforce_plus_plus" else 0.0)
    got = d["advantages"]
    assert any(abs(v) > 1e-3 for row in want for v in row), "degenerate step: no signal to compare"
    for i, row in enumerate(want):
        assert got[i, : len(row)].tolist() == pytest.approx(row, abs=1e-4)
        assert got[i, len(row) :].abs().sum() == 0


def test_opd_subtracts_teacher_reverse_kl(tiny_ckpt, addition_data, tmp_path):
    from lichen.models.tiny import make_tiny_model

    teacher = str(tmp_path / "teacher")
    make_tiny_model(teacher, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, seed=5, init_std=0.1)
    dump = str(tmp_path / "train_{rollout_id}.pt")
    common = [
        "--num-rollout",
        "1",
        "--micro-batch-size",
        "4",
        "--force-recompute-old-log-probs",
        "--save-debug-train-data",
        dump,
    ]
    run(base_args(tiny_ckpt, addition_data, tmp_path / "a", *common))
    plain = read_dump(dump.format(rollout_id=0))
    rows = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "b",
            *common,
            "--use-opd",
            "--opd-kl-coef",
            "0.5",
            "--opd-teacher-load",
            teacher,
        )
    )
    opd = read_dump(dump.format(rollout_id=0))
    from lichen.models import load_model

    t = load_model(teacher)
    for i, s in enumerate(opd["samples"]):
        toks, n = s["tokens"], s["response_length"]
        with torch.no_grad():
            lp = torch.log_softmax(t.logits(t(torch.tensor([toks]), torch.arange(len(toks))[None]))[0], -1)
        p = len(toks) - n
        teacher_lp = torch.tensor([lp[p - 1 + k, toks[p + k]].item() for k in range(n)])
        want = plain["advantages"][i, :n] - 0.5 * (opd["old_log_probs"][i, :n] - teacher_lp)
        assert torch.allclose(opd["advantages"][i, :n], want, atol=1e-5)
    assert rows[0]["train/opd_reverse_kl"] != 0


def test_custom_advantage_and_reducer_contracts(tiny_ckpt, addition_data, tmp_path):
    dump = str(tmp_path / "train_{rollout_id}.pt")
    run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "a",
            "--num-rollout",
            "1",
            "--micro-batch-size",
            "4",
            "--custom-advantage-function-path",
            "loop_plugins.constant_advantage",
            "--save-debug-train-data",
            dump,
        )
    )
    d = read_dump(dump.format(rollout_id=0))
    assert torch.equal(d["advantages"], 0.25 * d["mask"])
    rows = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "b",
            "--num-rollout",
            "1",
            "--micro-batch-size",
            "4",
            "--custom-pg-loss-reducer-function-path",
            "loop_plugins.zero_reducer",
        )
    )
    assert rows[0]["train/grad_norm"] == 0.0


def test_ppo_critic_gae_matches_reference_and_critic_learns(tiny_ckpt, addition_data, tmp_path):
    dump = str(tmp_path / "train_{rollout_id}.pt")
    gamma, lambd = 0.9, 0.8
    rows = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "r",
            "--num-rollout",
            "3",
            "--advantage-estimator",
            "ppo",
            "--micro-batch-size",
            "4",
            "--force-recompute-old-log-probs",
            "--gamma",
            str(gamma),
            "--lambd",
            str(lambd),
            "--num-critic-only-steps",
            "1",
            "--critic-lr",
            "1e-2",
            "--save-debug-train-data",
            dump,
        )
    )
    assert "train/grad_norm" not in rows[0]  # step 1: critic only, the policy did not step
    assert rows[1]["train/grad_norm"] > 0
    assert all(m["critic/value_loss"] > 0 for m in rows)
    first = read_dump(dump.format(rollout_id=0))
    d = read_dump(dump.format(rollout_id=2))
    assert first["values"].abs().max() == 0  # zero-initialized value head
    assert d["values"].abs().max() > 0  # the critic was trained
    r, V = d["rewards"].double().tolist(), d["values"].double()
    for i, s in enumerate(d["samples"]):
        n = s["response_length"]
        adv, nxt = [0.0] * n, 0.0
        for t in reversed(range(n)):
            v_next = V[i, t + 1].item() if t + 1 < n else 0.0
            delta = (r[i] if t == n - 1 else 0.0) + gamma * v_next - V[i, t].item()
            nxt = delta + gamma * lambd * nxt
            adv[t] = nxt
        assert d["advantages"][i, :n].tolist() == pytest.approx(adv, abs=1e-5)
