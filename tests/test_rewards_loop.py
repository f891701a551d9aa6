"""Rewards and eval inside the real loop on the quick-start task (tiny model, addition prompts):
a verifier that raises on 10% of samples does not stop the run, the failures are reported and carry zero loss
weight; eval with --eval-config logs per-data-set pass@k."""

from __future__ import annotations

import json
import textwrap

from helpers.runs import base_args, read_dump, run


def raise_on_tenth(args, sample):
    """Fails exactly the samples whose index ends in 3 (2 of every 20), else the digit-fraction reward."""
    if sample.index % 10 == 3:
        raise ValueError(f"cannot grade sample {sample.index}")
    text = sample.response
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def always_fails(args, sample):
    raise KeyError("answer")


def test_run_whose_every_sample_fails_stops_with_an_error(tiny_ckpt, addition_data, tmp_path, capfd):
    from lichen.cli import main
    from lichen.observe import read_metrics

    out = tmp_path / "r"
    argv = base_args(tiny_ckpt, addition_data, out, "--num-rollout", "6", "--max-consecutive-failed-steps", "2")
    argv[argv.index("loop_plugins.digit_fraction")] = "test_rewards_loop.always_fails"
    assert main(argv) == 1
    err = capfd.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        "lichen train: error: every sample failed in 2 consecutive rollout step(s) (steps 1-2; "
        "16 samples in the last, e.g. sample 0: KeyError: 'answer')"
    ), last
    assert "Traceback" not in err
    assert [m["step"] for m in read_metrics(str(out))] == [1]  # stopped at step 2, before training on it

    # 0 turns the check off: the run goes to its end
    argv[argv.index("--max-consecutive-failed-steps") + 1] = "0"
    argv[argv.index("--num-rollout") + 1] = "3"
    argv[argv.index("--output-dir") + 1] = str(tmp_path / "r0")
    assert main(argv) == 0


def test_failing_verifier_samples_get_zero_weight(tiny_ckpt, addition_data, tmp_path, capfd):
    dump = str(tmp_path / "train_{rollout_id}.pt")
    argv = base_args(
        tiny_ckpt,
        addition_data,
        tmp_path / "r",
        "--num-rollout",
        "1",
        "--rollout-batch-size",
        "5",
        "--save-debug-train-data",
        dump,
    )
    argv[argv.index("loop_plugins.digit_fraction")] = "test_rewards_loop.raise_on_tenth"
    rows = run(argv)
    assert len(rows) == 1  # the run completed
    err = capfd.readouterr().err
    assert "reward failed for 2 of 20 samples" in err
    assert "sample 3: ValueError: cannot grade sample 3" in err and "sample 13: ValueError" in err
    for step, m in enumerate(rows):
        assert m["rollout/num_failed"] == 2 and m["train/num_failed_samples"] == 2
        assert 0.0 < m["time/reward"] < m["time/generate"] < m["time/step"]  # reward time is part of generate's
        d = read_dump(dump.format(rollout_id=step))
        failed = [i for i, s in enumerate(d["samples"]) if s["status"] == "failed"]
        assert [d["samples"][i]["index"] for i in failed] == [3, 13]
        for i, s in enumerate(d["samples"]):
            if i in failed:
                assert s["metadata"]["reward_error"].startswith("ValueError: cannot grade")
                assert d["mask"][i].abs().sum() == 0  # zero loss weight
                assert d["advantages"][i].abs().sum() == 0
            else:
                assert d["mask"][i].sum() == s["response_length"] > 0


def test_eval_config_on_the_quickstart_model_logs_pass_at_k(tiny_ckpt, addition_data, tmp_path):
    labels = tmp_path / "sums.jsonl"
    with open(addition_data) as src, open(labels, "w") as dst:
        for line in list(src)[:3]:  # another key layout, to exercise per-data-set keys
            row = json.loads(line)
            dst.write(json.dumps({"question": row["prompt"], "answer": row["label"]}) + "\n")
    cfg = tmp_path / "eval.yaml"
    cfg.write_text(
        textwrap.dedent(f"""\
        defaults:
          n_samples_per_eval_prompt: 2
          max_response_len: 4
        datasets:
          - name: add
            path: {addition_data}@[:4]
            rm_type: leading_number
            n_samples_per_eval_prompt: 4
            temperature: 1.0
          - name: sums
            path: {labels}
            input_key: question
            label_key: answer
            rm_type: boxed_exact
            temperature: 0.0
        """)
    )
    rows = run(
        base_args(
            tiny_ckpt,
            addition_data,
            tmp_path / "r",
            "--num-rollout",
            "1",
            "--eval-interval",
            "1",
            "--eval-config",
            str(cfg),
        )
    )
    evals = [m for m in rows if "eval/add/reward_mean" in m]
    assert [m["step"] for m in evals] == [0, 1]  # before training and after the last step
    for m in evals:
        assert m["eval/add/num_samples"] == 16 and m["eval/add/num_prompts"] == 4
        assert m["eval/sums/num_samples"] == 6 and m["eval/sums/num_prompts"] == 3
        assert 0.0 <= m["eval/add/pass@1"] <= m["eval/add/pass@2"] <= m["eval/add/pass@4"] <= 1.0
        assert "eval/add/pass@8" not in m and "eval/sums/pass@4" not in m
        assert m["eval/sums/pass@1"] == m["eval/sums/pass@2"] == 0.0  # the random model never boxes an answer
        # a fraction of the 16 samples, each cut at the eval's response length or not
        assert m["eval/add/truncated_ratio"] * 16 in range(17)
        assert 0.0 < m["time/eval"] and (m["step"] == 0 or m["time/eval"] < m["time/step"])
