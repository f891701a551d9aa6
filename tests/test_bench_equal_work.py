"""Equal work for `lichen bench rl` (issue 19): the trainer flag that turns the zero-advantage skip off, and the
harness pieces that make both frameworks do the same forward + backward on every sample."""

from __future__ import annotations

from helpers.trainer import make_actor, ragged_samples

from lichen.types import Status


def test_disable_zero_advantage_skip_runs_every_backward(tiny_ckpt, addition_data, tmp_path):
    """All rewards equal -> every GRPO advantage is 0: by default every backward is skipped; with the flag none."""

    def step(*extra):
        actor = make_actor(tiny_ckpt, addition_data, tmp_path, "--micro-batch-size", "4", *extra)
        samples = ragged_samples(actor.model.cfg.vocab_size, seed=3)  # every reward 0.0
        assert all(s.status == Status.COMPLETED for s in samples)
        return actor.train(0, [samples])

    assert step()["train/skipped_samples"] == 12
    assert step("--disable-zero-advantage-skip")["train/skipped_samples"] == 0


def test_engines_are_timed_on_identical_forced_lengths(tiny_ckpt, tmp_path):
    """run_gen: HF generate and lichen's Engine produce exactly the given per-row lengths on the same prompts,
    whatever each one samples (EOS does not stop a row), so their times are of the same work."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lichen.engines.core.engine import Engine
    from lichen_bench import run_gen
    from lichen_bench.workloads import Workload

    wl = Workload(
        "t",
        hidden_size=0,
        intermediate_size=0,
        num_layers=0,
        num_heads=0,
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=20,
        lr=0.0,
        steps=1,
        reward="addition",
    )
    prompts = ["12+3=", "12+3=", "4+45=", "4+45="]
    lengths = [1, 20, 7, 13]
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    engine = Engine.from_pretrained(tiny_ckpt, device="cpu")
    for seed in (0, 1):
        h = run_gen._hf_generate(hf, tok, prompts, wl, lengths, seed)
        e = run_gen._lichen_generate(engine, tok, prompts, wl, seed, lengths)
        assert [r for _, r in h["lengths"]] == lengths == [r for _, r in e["lengths"]]
        assert [p for p, _ in h["lengths"]] == [p for p, _ in e["lengths"]]
    # HF keeps every row until the longest is done: prefill + one position per row per further token
    width = max(p for p, _ in h["lengths"])
    assert h["computed_tokens"] == len(prompts) * (width + max(lengths) - 1)
