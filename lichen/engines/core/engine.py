"""The embedded generation engine: batched sampling over a KV cache.

`lichen serve` wraps this class; `--runtime local` uses it in process. It knows nothing about training: it takes
token ids and sampling parameters and returns token ids, log-probs and a finish reason, tagged with the weight
version it served.

Batching (lichen/engines/core/decode_batch.py): sequences decode together in one batch; a finished one leaves it and a
waiting one joins at the next step, so long, ragged answers do not hold back the short ones.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from lichen.engines.core.decode_batch import DecodeBatch, Seq, context_error, stop_ids
from lichen.models import CausalLM, ModelConfig, load_model


@dataclass
class GenRequest:
    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0  # <= 0: greedy
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0
    ignore_eos: bool = False
    # return the kept token set per position when top-p / top-k truncate; the log-probs are then over that set
    return_sampling_mask: bool = False


STOPPED = "the streaming caller stopped reading"  # the abort message of a request on_step stopped


@dataclass
class GenResult:
    output_ids: list[int]
    output_logprobs: list[float]
    # "stop" (EOS / stop token, which is included in output_ids) or "length"; None in the partial results of a
    # stream (BatchingEngine / RemoteEngines.agenerate_stream) before the final one
    finish_reason: str | None
    prompt_tokens: int
    weight_version: str
    engine: str = ""  # the server that generated it (its URL; "" in process), for the sample log
    # per output token the sorted ids top-p / top-k kept (return_sampling_mask and truncation), else None
    sampling_mask: list[list[int]] | None = None


class Engine:
    """Generates for many requests at once with one model copy.

    `max_batch_size` caps how many sequences decode together (None: all requests of a call at once).
    """

    def __init__(
        self,
        model: CausalLM,
        *,
        eos_token_ids: Iterable[int],
        pad_token_id: int = 0,
        max_batch_size: int | None = None,
        weight_version: str = "0",
    ):
        self.model = model.eval()
        self.eos_token_ids = sorted(set(int(t) for t in eos_token_ids))
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._shared = False  # serving a caller's tensors (share_weights), not its own copy

    @classmethod
    def from_pretrained(
        cls, model_dir: str, *, device="cpu", dtype=torch.float32, model_options: dict | None = None, **kwargs
    ) -> "Engine":
        """`model_options`: load_model's impl / trust_remote_code / gdn_backend (--model-impl and friends)."""
        from lichen.models.tokenizer import eos_token_ids, load_tokenizer

        options = model_options or {}
        tok = load_tokenizer(model_dir, trust_remote_code=bool(options.get("trust_remote_code")))
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        model = load_model(model_dir, device=device, dtype=dtype, **options)
        return cls(model, eos_token_ids=eos_token_ids(tok, model_dir), pad_token_id=pad, **kwargs)

    # ---- weights ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        """Copy weights in place (the in-process transport: a direct tensor copy, cast to the engine dtype)."""
        self._own_weights()
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"engine has no parameter {name!r}")
            params[name].copy_(tensor)
        self.weight_version = str(version)

    @torch.no_grad()
    def share_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> bool:
        """Serve the given tensors themselves, without a copy, when they fit the model exactly (every parameter
        by name, with its shape, dtype and device, none requiring grad); else copy them (`update_weights_from_tensors`).
        Returns whether they are shared.

        For a caller that changes the tensors only between two calls of this method: `sync.push`'s in-process
        engine, which the synchronous loop (the only one an in-process engine runs in) pushes after every train
        step, so the trainer's optimizer steps never overlap a generation. The engine then holds no copy of the
        weights (one model less in memory) and a sync copies nothing. Tied parameters stay tied."""
        named = dict(named_tensors)
        params = dict(self.model.named_parameters())
        fits = named.keys() == params.keys() and all(
            t.shape == params[n].shape
            and t.dtype == params[n].dtype
            and t.device == params[n].device
            and not t.requires_grad
            for n, t in named.items()
        )
        if not fits:
            self.update_weights_from_tensors(named.items(), version)
            return False
        self._replace_params(lambda name, _: named[name])
        self._shared = True
        self.weight_version = str(version)
        return True

    def _own_weights(self) -> None:
        """Give the engine its own parameters again after `share_weights`, so that copying into them never writes
        into the tensors it shared (the caller's)."""
        if self._shared:
            self._replace_params(lambda _, p: torch.empty_like(p))
            self._shared = False

    def _replace_params(self, make: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
        """Each parameter becomes `make(name, old)` (as a Parameter that needs no grad), in every module that
        holds it: a parameter tied to two modules (embeddings and LM head) is replaced by one new one."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        new: dict[int, torch.nn.Parameter] = {}
        for module in self.model.modules():
            for leaf, p in list(module._parameters.items()):
                if p is None:
                    continue
                if id(p) not in new:
                    new[id(p)] = torch.nn.Parameter(make(names[id(p)], p.detach()), requires_grad=False)
                module._parameters[leaf] = new[id(p)]

    def read_checkpoint(self, model_dir: str) -> dict[str, torch.Tensor]:
        """Read `model_dir`'s weights and check them against the served model without touching it.

        Raises ValueError naming the problem: missing directory or weights, a different config, or missing /
        extra / mis-shaped tensors. Separate from `apply_state` so a server can read while it still generates.
        """
        from lichen.errors import UserError
        from lichen.weights.hf_io import load_hf_state_dict

        if getattr(self.model, "is_hf", False):  # the generic HF path reads through from_pretrained
            try:
                return self.model.read_state(model_dir, self.dtype)
            except (OSError, UserError, ValueError, KeyError) as e:
                raise ValueError(f"cannot load {model_dir!r}: {e}") from e
        try:
            cfg = ModelConfig.from_pretrained(model_dir)
            state = load_hf_state_dict(model_dir, device="cpu", dtype=self.dtype)
        except (OSError, UserError, ValueError, KeyError) as e:
            raise ValueError(f"cannot load {model_dir!r}: {e}") from e
        mine = self.model.cfg
        diff = [
            f"{k}: {getattr(cfg, k)!r} (serving {getattr(mine, k)!r})"
            for k in vars(mine)
            if k != "max_position_embeddings" and getattr(cfg, k) != getattr(mine, k)
        ]
        if diff:
            raise ValueError(f"{model_dir!r} has a different model config: {'; '.join(diff)}")
        if mine.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        params = dict(self.model.named_parameters())
        problems = [f"missing {n}" for n in params if n not in state]
        problems += [f"unexpected {n}" for n in state if n not in params]
        problems += [
            f"{n}: shape {tuple(state[n].shape)} != {tuple(p.shape)}"
            for n, p in params.items()
            if n in state and state[n].shape != p.shape
        ]
        if problems:
            raise ValueError(f"{model_dir!r} does not match the served model: {', '.join(problems[:5])}")
        return state

    @torch.no_grad()
    def apply_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a checked state dict (from `read_checkpoint`) into the parameters."""
        self._own_weights()
        for name, p in self.model.named_parameters():
            p.copy_(state[name])

    def offload(self, tags: list[str] | None = None) -> None:
        """Release device memory. On CPU there is nothing to release (docs/architecture.md#offload); on an
        accelerator the
        `weights` tag moves the parameters to host memory (the KV cache only lives during generation)."""
        if self.device.type == "cpu":
            return
        if tags is None or "weights" in tags:
            self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self, tags: list[str] | None = None) -> None:
        if self.device.type == "cpu":
            return
        if tags is None or "weights" in tags:
            self.model.to(self.device)

    # ---- generation ---------------------------------------------------------------------------------------
    def make_seq(self, r: GenRequest) -> Seq:
        return Seq(
            input_ids=list(r.input_ids),
            max_new_tokens=max(0, r.max_new_tokens),
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            seed=r.seed,
            stop_ids=stop_ids(r.ignore_eos, self.eos_token_ids, r.stop_token_ids),
            return_sampling_mask=r.return_sampling_mask,
        )

    def new_batch(self, stop_text=None) -> DecodeBatch:
        if getattr(self.model, "is_hf", False):
            from lichen.engines.core.hf_decode import HFDecodeBatch

            return HFDecodeBatch(self.model, pad_token_id=self.pad_token_id, stop_text=stop_text)
        return DecodeBatch(self.model, pad_token_id=self.pad_token_id, stop_text=stop_text)

    def generate(
        self, requests: list[GenRequest], on_step: Callable[[list[Seq]], Iterable[int] | None] | None = None
    ) -> list[GenResult]:
        """Results are returned in request order. At most `max_batch_size` sequences decode at once; when rows
        finish, the next requests (in order) take their place. `on_step(seqs)` (one Seq per request, in order) is
        called after every decode step, for streaming; it must not change them. It may return the indices of
        requests to stop (their reader went away): those finish with ("abort", ...) and their partial output, a
        waiting one before it starts; the other rows go on."""
        if not requests:
            return []
        if any(not r.input_ids for r in requests):
            raise ValueError("input_ids cannot be empty.")
        ctx = self.model.cfg.max_position_embeddings
        for r in requests:  # the rule lichen serve and SGLang apply: nothing generated past the model's positions
            problem = context_error(len(r.input_ids), max(0, r.max_new_tokens), ctx)
            if problem is not None:
                raise ValueError(problem)
        seqs = [self.make_seq(r) for r in requests]
        limit = self.max_batch_size or len(seqs)
        batch = self.new_batch()
        pending = deque(seqs)
        while pending or len(batch):
            free = limit - len(batch)
            # Refill once an eighth of the slots are free: each join rebuilds the cache (about one step's cost).
            if pending and free > 0 and (not len(batch) or free * 8 >= limit):
                batch.add([pending.popleft() for _ in range(min(free, len(pending)))], self.weight_version)
            batch.step(self.weight_version)
            stop = on_step(seqs) if on_step is not None else None
            if stop:
                gone = {id(seqs[k]) for k in stop}
                for s in pending:
                    if id(s) in gone:
                        s.finish, s.finish_version = ("abort", STOPPED), self.weight_version
                pending = deque(s for s in pending if id(s) not in gone)
                batch.abort([s for s in batch.live() if id(s) in gone], STOPPED, self.weight_version)
        return [
            GenResult(
                s.output_ids,
                s.output_logprobs,
                s.finish[0],
                len(s.input_ids),
                s.finish_version or self.weight_version,
                sampling_mask=list(s.output_kept) if s.truncates_sampling else None,
            )
            for s in seqs
        ]
