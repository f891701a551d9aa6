"""Child process of `lichen bench rl`: runs Hugging Face TRL's GRPOTrainer on a workload and writes what it saw.

    python -m lichen_bench.run_trl RESULT.json --workload w1 --checkpoint DIR --prompts FILE.jsonl \
        --steps N --seed S --threads 2 --output-dir DIR

Settings mirror lichen's run (see `trl_config_kwargs`); every one that matters is set explicitly, so a change
of TRL's defaults does not silently change the comparison. Instrumentation only observes:
  - a TrainerCallback stamps each optimizer step's begin and end: step time = time between consecutive step
    ends (the first from train begin), so data loading, logging and callbacks are inside it; train = the
    begin..end window minus generate (forward/backward, grad clip, optimizer step);
  - `_generate_and_score_completions` is timed as "generate" (HF generate + decode + rewards + advantages),
    `_generate_single_turn` as "engine" (HF generate alone), and records (prompt, completion) lengths;
  - the model's `forward` counts token positions run (rows x sequence length), split into generate /
    train-with-grad / train-no-grad.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from lichen_bench.counting import positions, record_forward

STATE: dict = {"phase": "train", "steps": [], "missing": []}


def _new_step() -> dict:
    return {
        "engine_tokens": 0,
        "train_grad_tokens": 0,
        "train_nograd_tokens": 0,
        "engine_time": 0.0,
        "generate_time": 0.0,
        "engine_forwards": 0,
        "lengths": [],
        "rewards": [],
    }


def _current() -> dict:
    if not STATE["steps"] or STATE["steps"][-1].get("closed"):
        STATE["steps"].append(_new_step())
    return STATE["steps"][-1]


def trl_config_kwargs(wl, *, steps: int, seed: int, output_dir: str, grad_accum: int = 1) -> dict:
    """GRPOConfig arguments for workload `wl`: the workload's settings, each named explicitly.

    `grad_accum` > 1: each step's samples run as `grad_accum` accumulated micro-batches (the same math, lower
    memory); one generation still covers the whole step (steps_per_generation = grad_accum)."""
    if wl.samples_per_step % grad_accum:
        raise ValueError(f"grad_accum {grad_accum} does not divide the {wl.samples_per_step} samples of a step")
    return dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        lr_scheduler_type="constant",
        warmup_steps=0,
        learning_rate=wl.lr,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,  # no KL, so no reference model is loaded
        num_iterations=1,
        epsilon=0.2,
        epsilon_high=0.2,
        loss_type="grpo",  # per-sequence token mean, then mean over sequences
        scale_rewards="group",  # (r - group mean) / group std
        num_generations=wl.group_size,
        per_device_train_batch_size=wl.samples_per_step // grad_accum,
        gradient_accumulation_steps=grad_accum,
        steps_per_generation=grad_accum,
        max_completion_length=wl.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,  # 0 = no top-k truncation
        min_p=None,
        repetition_penalty=1.0,
        mask_truncated_completions=False,
        shuffle_dataset=False,  # file order, as lichen without --rollout-shuffle
        max_steps=steps,
        seed=seed,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        torch_compile=False,
        use_liger_kernel=False,
    )


def _instrument(trainer, model) -> None:
    def wrap_method(obj, name, make):
        original = getattr(obj, name, None)
        if original is None:
            STATE["missing"].append(f"{type(obj).__name__}.{name}")
            return
        setattr(obj, name, make(original))

    def timed_generate_and_score(original):
        def inner(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                _current()["generate_time"] += time.perf_counter() - t0

        return inner

    def timed_single_turn(original):
        def inner(prompt_ids, *args, **kwargs):
            prev, STATE["phase"] = STATE["phase"], "engine"
            t0 = time.perf_counter()
            try:
                out = original(prompt_ids, *args, **kwargs)
            finally:
                STATE["phase"] = prev
                _current()["engine_time"] += time.perf_counter() - t0
            completions = out[0]
            _current()["lengths"] += [[len(p), len(c)] for p, c in zip(prompt_ids, completions)]
            return out

        return inner

    def counting_forward(original):
        def inner(*args, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            record_forward(_current(), STATE["phase"], positions(ids))
            return original(*args, **kwargs)

        return inner

    wrap_method(trainer, "_generate_and_score_completions", timed_generate_and_score)
    wrap_method(trainer, "_generate_single_turn", timed_single_turn)
    wrap_method(model, "forward", counting_forward)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m lichen_bench.run_trl")
    p.add_argument("result")
    p.add_argument("--workload", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--grad-accum", type=int, default=1, help="accumulated micro-batches per step (default: 1)")
    a = p.parse_args(argv)
    t_start = time.perf_counter()

    import torch

    torch.set_num_threads(a.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lichen_bench.workloads import WORKLOADS, trl_reward_fn

    wl = WORKLOADS[a.workload]
    with open(a.prompts, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(a.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(a.checkpoint, dtype=torch.float32)
    base_reward = trl_reward_fn(wl.reward)

    def reward(prompts, completions, **kwargs):
        out = base_reward(prompts, completions, **kwargs)
        _current()["rewards"] = list(out)
        return out

    reward.__name__ = base_reward.__name__
    config = GRPOConfig(
        **trl_config_kwargs(wl, steps=a.steps, seed=a.seed, output_dir=a.output_dir, grad_accum=a.grad_accum)
    )

    class StepClock(TrainerCallback):
        last = None

        def on_train_begin(self, args, state, control, **kwargs):
            StepClock.last = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            _current()["step_begin"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            rec = _current()
            rec["step_time"] = now - StepClock.last
            rec["window_time"] = now - rec.pop("step_begin", StepClock.last)
            rec["closed"] = True
            StepClock.last = now

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    _instrument(trainer, trainer.model)
    t_train = time.perf_counter()
    trainer.train()
    train_wall = time.perf_counter() - t_train
    steps = [s for s in STATE["steps"] if s.get("closed")]
    for s in steps:
        s.pop("closed", None)
        # on_step_begin .. on_step_end holds generate + forward/backward + clip + optimizer step
        s["train_time"] = max(s.pop("window_time") - s["generate_time"], 0.0)
        s["reward_mean"] = sum(s["rewards"]) / len(s["rewards"]) if s["rewards"] else None
        s.pop("rewards")
    with open(a.result, "w", encoding="utf-8") as f:
        json.dump(
            {
                "rc": 0,
                "wall_s": time.perf_counter() - t_start,
                "train_wall_s": train_wall,
                "steps": steps,
                "instrumentation_missing": STATE["missing"],
                "self_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                "torch_threads": torch.get_num_threads(),
                "versions": _versions(),
                "config": {
                    k: v
                    for k, v in trl_config_kwargs(
                        wl, steps=a.steps, seed=a.seed, output_dir=a.output_dir, grad_accum=a.grad_accum
                    ).items()
                    if k != "output_dir"
                },
                "optim": str(config.optim),
                "eos_token_ids": list(getattr(trainer, "eos_token_ids", []) or []),
            },
            f,
            default=str,
        )
    return 0


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("trl", "transformers", "accelerate", "torch"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
