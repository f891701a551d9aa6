"""Rollout routing vs training routing on the tiny MoE checkpoints of the generic HF path (docs/models.md#moe).

    .venv/bin/python benchmarks/moe_routing.py [--requests 8] [--new-tokens 24] [--workdir runs/moe_routing]

For each MoE architecture, the in-process engine generates (one request at a time: its prefill and decode steps
are recorded in token order), and the trainer-side forward (one uncached pass over prompt + output) is run on the
same module. The expert indices every MoE layer hands its experts are recorded on both sides through a hook on
the experts module, so the comparison is of the routing the model actually used. Printed per architecture: tokens
x MoE layers compared, how many chose a different expert set, and the mean / max |log-prob| difference of the
generated tokens between rollout and training. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import os
import sys

MOE_ARCHS = ("qwen3_moe", "glm4_moe", "gpt_oss", "qwen3_next", "deepseek_v3")


def record_routing(model) -> tuple[list, list]:
    """Hooks on every experts module: appends (layer, sorted expert ids per token) on each call."""
    calls: list = []
    hooks = []
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            layer = int(name.split(".")[2])

            def hook(mod, args, kwargs, layer=layer):
                index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
                calls.append((layer, index.sort(-1).values.tolist()))

            hooks.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return calls, hooks


def per_layer(calls: list) -> dict[int, list]:
    out: dict[int, list] = {}
    for layer, rows in calls:
        out.setdefault(layer, []).extend(rows)
    return out


def measure(ckpt: str, args) -> tuple[int, int, float, float]:
    import torch

    from lichen.engines.core.engine import Engine, GenRequest
    from lichen.models.loading import load_model

    model = load_model(ckpt, impl="hf").eval()
    engine = Engine(model, eos_token_ids=[], max_batch_size=1)
    compared = flips = 0
    diffs = []
    for i in range(args.requests):
        prompt = [5 + (i * 11 + j * 3) % 90 for j in range(6 + i % 5)]
        calls, hooks = record_routing(model)
        (res,) = engine.generate([GenRequest(prompt, args.new_tokens, temperature=1.0, seed=i, ignore_eos=True)])
        rollout = per_layer(calls)
        calls.clear()
        ids = prompt + res.output_ids
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), torch.arange(len(ids))[None])
            logp = torch.log_softmax(model.logits(hidden)[0].float(), -1)
        for h in hooks:
            h.remove()
        train = per_layer(calls)
        for layer, rows in train.items():
            n = min(len(rows), len(rollout[layer]))
            compared += n
            flips += sum(a != b for a, b in zip(rows[:n], rollout[layer][:n]))
        p = len(prompt)
        ref = logp[p - 1 : -1].gather(-1, torch.tensor(res.output_ids)[:, None]).squeeze(-1)
        diffs += (ref - torch.tensor(res.output_logprobs)).abs().tolist()
    return compared, flips, sum(diffs) / len(diffs), max(diffs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/moe_routing")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=24)
    args = p.parse_args(argv)
    import torch

    from lichen.models.tiny import make_tiny_model

    torch.set_num_threads(1)
    print(f"{'arch':14}{'token x layer':>15}{'different experts':>19}{'lp diff mean':>14}{'lp diff max':>13}")
    for arch in MOE_ARCHS:
        ckpt = make_tiny_model(
            os.path.join(args.workdir, arch),
            arch=arch,
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=48,
            max_position_embeddings=256,
        )
        compared, flips, mean, worst = measure(ckpt, args)
        print(f"{arch:14}{compared:>15}{flips:>19}{mean:>14.1e}{worst:>13.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
