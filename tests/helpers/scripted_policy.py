"""An in-process Engine.generate replacement for training-step tests of multi-turn rollouts: the reply is
scripted from the input text, its log-probs are the model's true ones (log_softmax(logits / T) of one full
forward), so the trainer's recomputed log-probs must match them."""

from __future__ import annotations

from typing import Callable

import torch

from lichen.engines.core.engine import GenResult


def scripted_generate(tok, reply_for: Callable[[str], str], returned: list) -> Callable:
    """`Engine.generate` answering each request with `reply_for(decoded input)` + <|im_end|>; appends
    (input_ids, output_ids) to `returned`."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def generate(self, requests):
        out = []
        for r in requests:
            ids = list(tok.encode(reply_for(tok.decode(r.input_ids)), add_special_tokens=False)) + [im_end]
            full = list(r.input_ids) + ids
            with torch.no_grad():
                h = self.model(torch.tensor([full]), torch.arange(len(full))[None])
                lp = torch.log_softmax(self.model.logits(h)[0].double() / r.temperature, -1)
            lps = [lp[len(r.input_ids) + k - 1, t].item() for k, t in enumerate(ids)]
            returned.append((list(r.input_ids), ids))
            out.append(GenResult(ids, lps, "stop", len(r.input_ids), self.weight_version))
        return out

    return generate
