"""`lichen bench <suite>`: benchmarks that measure lichen against a baseline run in the same invocation.

Suites:
  rl        lichen vs Hugging Face TRL's GRPOTrainer on identical CPU RL work (lichen_bench.rl)
  learning  lichen vs TRL learning curves on the W1 task over several seeds (lichen_bench.learning)
  profile   where lichen's engine and trainer time goes on a workload (lichen_bench.torch_profile)
  sync      weight-sync transports and delta encodings on one model (lichen_bench.sync)
  logprobs  the trainer's log-probs at a 151,936-token vocabulary, chunked vs full logits (lichen_bench.log_probs)
  ckpt      step time with a checkpoint every step: no save vs synchronous vs asynchronous (lichen_bench.ckpt_save)
  engines   lichen serve vs vLLM: generation, log-prob mismatch, sync time (lichen_bench.engines)
  compile   the trainer's forward and backward with each decoder layer torch.compile'd vs eager (lichen_bench.compile_layers)
  packed    a train step over packed rows, attention per segment vs one call with the dense mask (lichen_bench.packed_attn)
"""

from __future__ import annotations

import importlib

SUITES = {
    "rl": ("lichen_bench.rl", "lichen vs TRL GRPOTrainer on the same CPU RL work, medians and ratios"),
    "learning": ("lichen_bench.learning", "lichen vs TRL reward curves from one SFT warm start over several seeds"),
    "profile": ("lichen_bench.torch_profile", "torch.profiler tables of lichen's engine and trainer on one step"),
    "sync": ("lichen_bench.sync", "weight sync: full disk vs delta xor/overwrite vs nccl(gloo), bytes and speed"),
    "logprobs": ("lichen_bench.log_probs", "train-step time and peak memory, chunked vs full-vocabulary logits"),
    "ckpt": ("lichen_bench.ckpt_save", "step time with --save-interval 1: no save vs sync vs async checkpoint writes"),
    "engines": ("lichen_bench.engines", "lichen serve vs vLLM: tok/s and latency, log-prob mismatch, sync time"),
    "compile": ("lichen_bench.compile_layers", "train forward + backward, decoder layers compiled vs eager"),
    "packed": ("lichen_bench.packed_attn", "train step over packed rows: attention per segment vs a dense mask"),
}

USAGE = (
    "usage: lichen bench <suite> [options]\n\nsuites:\n"
    + "\n".join(f"  {name:<9} {helptext}" for name, (_, helptext) in SUITES.items())
    + "\n\nRun `lichen bench <suite> --help` for its options."
)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUITES:
        from lichen.errors import ConfigError

        raise ConfigError(f"unknown benchmark suite {name!r}; choose one of: {', '.join(SUITES)}")
    return int(importlib.import_module(SUITES[name][0]).main(rest) or 0)
