"""Child process of `lichen bench rl`: the limits measured in the same run.

    python -m lichen_bench.run_gen RESULT.json --workload w1 --checkpoint DIR --prompts FILE.jsonl \
        --threads 2 --repeats 3 --seed S

  - fp32 matmul throughput (a large GEMM, best of 20), the hardware ceiling the FLOP fractions refer to;
  - HF `model.generate` on the rollout batch of step 1 (its prompts, each repeated group-size times; sampling
    at temperature 1 with no truncation): the rollout baseline;
  - lichen's Engine on the same batch, in the same process, alternating with HF so machine noise hits both.
Identical sample sets: a warm-up lichen pass samples the batch's response lengths once (EOS ends a response as
in training); every timed pass of both generators then produces exactly those lengths (EOS ignored, each row
stopped at its length: lichen `ignore_eos` with a per-request `max_new_tokens`, HF a per-row stopping
criterion), so the engines are compared on the same prompts and the same token counts, not on different random
draws. Each generator runs once as warm-up, then `repeats` timed times.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time


def _batch(rows: list[dict], wl) -> list[str]:
    return [r["prompt"] for r in rows[: wl.prompts_per_step] for _ in range(wl.group_size)]


def _hf_generate(model, tokenizer, prompts, wl, lengths: list[int], seed) -> dict:
    """HF generate on `prompts`, row i producing exactly lengths[i] tokens (EOS does not stop a row)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    P = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(ids), P), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), P), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, P - len(x) :] = torch.tensor(x)
        mask[i, P - len(x) :] = 1
    want = torch.tensor(lengths)

    class ForcedLengths(StoppingCriteria):
        def __call__(self, seqs, scores, **kwargs):  # per row: done once it has its forced length
            return (seqs.shape[1] - P) >= want

    counter = {"tokens": 0}
    original = model.forward

    def counting(*args, **kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        counter["tokens"] += int(x.numel()) if x is not None else 0
        return original(*args, **kwargs)

    model.forward = counting
    model.generation_config.eos_token_id = None  # only the forced lengths stop a row
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max(lengths),
            pad_token_id=pad,
            use_cache=True,
            stopping_criteria=StoppingCriteriaList([ForcedLengths()]),
        )
    dt = time.perf_counter() - t0
    model.forward = original
    if out.shape[1] - P != max(lengths):
        raise RuntimeError(f"HF generate made {out.shape[1] - P} tokens, forced {max(lengths)}")
    return {"time": dt, "lengths": [[len(x), r] for x, r in zip(ids, lengths)], "computed_tokens": counter["tokens"]}


def _lichen_generate(engine, tokenizer, prompts, wl, seed, lengths: list[int] | None = None) -> dict:
    """lichen's Engine on `prompts`: natural lengths (EOS stops, at most the workload's), or exactly `lengths`."""
    from lichen.engines.core.engine import GenRequest

    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    reqs = [
        GenRequest(
            input_ids=x,
            max_new_tokens=lengths[i] if lengths else wl.max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
            seed=seed * 100003 + i,
            ignore_eos=bool(lengths),
        )
        for i, x in enumerate(ids)
    ]
    counter = {"tokens": 0}
    model = engine.model
    original = type(model).forward

    def counting(self, input_ids, *args, **kwargs):
        counter["tokens"] += int(input_ids.numel())
        return original(self, input_ids, *args, **kwargs)

    model.forward = counting.__get__(model)
    t0 = time.perf_counter()
    res = engine.generate(reqs)
    dt = time.perf_counter() - t0
    del model.forward
    if lengths and [len(r.output_ids) for r in res] != list(lengths):
        raise RuntimeError("lichen Engine did not produce the forced lengths")
    return {
        "time": dt,
        "lengths": [[len(x), len(r.output_ids)] for x, r in zip(ids, res)],
        "computed_tokens": counter["tokens"],
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m lichen_bench.run_gen")
    p.add_argument("result")
    p.add_argument("--workload", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--matmul-only", action="store_true", help="measure the matmul throughput only")
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from lichen_bench.limits import matmul_throughput

    if a.matmul_only:
        with open(a.result, "w", encoding="utf-8") as f:
            json.dump({"matmul": matmul_throughput(threads=a.threads)}, f)
        return 0
    from lichen_bench.workloads import WORKLOADS

    wl = WORKLOADS[a.workload]
    with open(a.prompts, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prompts = _batch(rows, wl)
    result: dict = {"matmul": matmul_throughput(threads=a.threads), "hf": [], "lichen": [], "errors": []}

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(a.checkpoint)
    hf_model = None
    if not a.skip_hf:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(a.checkpoint, dtype=torch.float32).eval()
    engine = None
    try:
        from lichen.engines.core.engine import Engine

        engine = Engine.from_pretrained(a.checkpoint, device="cpu")
    except Exception as e:  # the engine API changed: report, keep the HF baseline
        result["errors"].append(f"lichen engine: {type(e).__name__}: {e}")
    if engine is None:  # no engine to draw the lengths: HF alone with its own natural lengths is not comparable
        result["errors"].append("no lichen engine: the forced lengths could not be drawn; HF not run")
        hf_model = None
    else:  # the lengths of one natural lichen pass (EOS stops a row), forced on every timed pass of both
        natural = _lichen_generate(engine, tokenizer, prompts, wl, a.seed)
        result["forced_lengths"] = [r for _, r in natural["lengths"]]
    forced = result.get("forced_lengths")
    for rep in range(a.repeats + 1):  # rep 0 is warm-up
        seed = a.seed + rep
        if hf_model is not None:
            r = _hf_generate(hf_model, tokenizer, prompts, wl, forced, seed)
            if rep:
                result["hf"].append(r)
        if engine is not None:
            try:
                r = _lichen_generate(engine, tokenizer, prompts, wl, seed, forced)
                if rep:
                    result["lichen"].append(r)
            except Exception as e:
                result["errors"].append(f"lichen engine: {type(e).__name__}: {e}")
                engine = None
    for key in ("hf", "lichen"):
        runs = result[key]
        if runs:
            result[f"{key}_useful_tokens_per_s_median"] = statistics.median(
                sum(r for _, r in x["lengths"]) / x["time"] for x in runs
            )
    result["self_maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(a.result, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
