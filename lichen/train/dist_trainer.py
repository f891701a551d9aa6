"""DistTrainer: one rank of a multi-rank trainer (FSDP2 over torch.distributed; gloo on CPU, nccl on CUDA).

The same code runs in a torch.multiprocessing child (tests/test_dist_trainer.py) or in a Ray actor (the ray
runtime). Every rank receives the SAME global batch and computes the same things from it, so no decision is ever
sent between ranks, only tensors:
  - the step's schedule (lichen.train.step_schedule.schedule_steps: micro-batches, skip decisions, global loss
    denominators) is the single-rank trainer's, computed identically on every rank;
  - its micro-batches are dealt to ranks balanced by padded tokens (split_across_ranks); a rank with fewer pads
    with empty micro-batches (a forward, and a zero backward when training) so the collectives stay matched;
  - no-grad passes (old / reference / teacher log-probs) fill disjoint rows of the [n, R] result on each rank and
    are summed across ranks, so advantages and metrics are identical on every rank;
  - gradients are summed across ranks (lichen.train.fsdp), giving the global batch's gradient.
So 2 ranks compute the single-rank TrainActor's update up to floating-point summation order.

Checkpoints: `save` writes the sharded state with torch.distributed.checkpoint (DCP), which reshards on load, so
a checkpoint loads on any number of ranks; the ranks also export the weights as an HF checkpoint (hf/), each
writing its share of the files (lichen.weights.rank_hf). Each rank
then hashes its share of those files and rank 0 returns every entry (a SavedTrainer): the driver's
lichen.train.checkpoint.save_checkpoint writes meta.json, checksums.json (with these entries, never re-hashed)
and `latest`, after rollout_state.json; ranks write none of them. Layout:
DIR/iter_{rollout_id:07d}/{dist/, hf/, rollout_state.json, meta.json, checksums.json}. `load` verifies the
manifest before DCP reads anything, so a damaged shard stops the load with one error naming the file; each rank
verifies its share of the files.

The PPO critic (--advantage-estimator ppo) is sharded and split the same way (lichen.train.dist_critic).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from lichen.config.train_config import TrainerConfig
from lichen.devices import resolve_device
from lichen.errors import ConfigError
from lichen.models.sharded_load import sharded_loading
from lichen.train import fsdp, memory_saver
from lichen.train.actor import TrainActor
from lichen.train.checkpoint import (
    DIST_DIR,
    LATEST,
    LORA_DIR,
    SavedTrainer,
    iter_dir,
    warn_fresh_optimizer,
)
from lichen.train.ckpt_integrity import CheckpointDamaged, checkpoint_files, file_entries, read_inside, verify
from lichen.train.log_probs import LogProbs
from lichen.train.loss import StepTerms
from lichen.train.micro_batches import Plan, StepBatch
from lichen.train.optim import make_adamw
from lichen.train.step_schedule import OptimizerStepPlan, split_across_ranks
from lichen.train.train_batch import TrainBatch
from lichen.train.trainer_protocol import TokenValues, rows_of
from lichen.types import Sample
from lichen.weights.hf_io import plan_shards
from lichen.weights.rank_hf import RankHfPlan, owned_only, plan_rank_hf, write_rank_hf
from lichen.weights.rank_send import SENDER_OPS, RankSender, tensor_meta


class RankLogProbs(LogProbs):
    """No-grad log-prob passes split across ranks: each rank computes its share of the micro-batches, the [n, R]
    results (disjoint rows, zeros elsewhere) are summed across ranks."""

    def __init__(
        self, device: torch.device, temperature: float, bf16: bool, chunk_size: int, *, rank: int, world_size: int
    ):
        super().__init__(device, temperature, bf16, chunk_size)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "world_size", world_size)

    @torch.no_grad()
    def of_batch(self, model, batch: StepBatch, plans: list[Plan], width: int) -> torch.Tensor:
        mine = split_across_ranks(plans, batch.input_lengths, self.world_size, batch.sharing)[self.rank]
        out = super().of_batch(model, batch, [p for p in mine if p is not None], width)
        for _ in range(mine.count(None)):  # empty micro-batches: the same collectives, nothing kept
            self.forward(model, batch.micro([[0]], self.device))
        fsdp.reshard(model)
        return fsdp.all_reduce_sum(out)


def _inject_adapters_once(cfg: TrainerConfig) -> Callable[[torch.nn.Module], None]:
    """ShardedLoad.prepare for --use-lora: peft's adapters injected into the first model loaded (the policy; a
    teacher loaded after it gets none)."""
    pending = [True]
    lora_cfg = cfg.lora
    assert lora_cfg is not None

    def prepare(model: torch.nn.Module) -> None:
        if pending:
            pending.clear()
            from lichen.train import lora  # peft: the lora extra

            lora.apply_lora(model, lora_cfg)

    return prepare


def _adapter_source() -> Callable[[str], str | None]:
    from lichen.train import lora

    return lora.adapter_source


class _RankActor(TrainActor):
    """TrainActor whose models are FSDP2-sharded and whose micro-batches are this rank's share."""

    def __init__(
        self,
        cfg: TrainerConfig,
        plugin_args: Any,
        *,
        rank: int,
        world_size: int,
        memory: memory_saver.TaggedMemory | None = None,
    ):
        self.rank, self.world_size = rank, world_size
        self.memory = memory or memory_saver.TaggedMemory()
        # The models are built on meta and sharded before any weight is read: each rank reads its own slices
        # (lichen.models.sharded_load). LoRA injects its adapters into the policy on meta (the first model loaded);
        # with --lora-load the policy loads whole as before (peft loads the saved adapters into whole tensors).
        offload = fsdp.offloads_to_cpu(cfg.optimizer_state.optimizer_cpu_offload, resolve_device(cfg.models.device))
        weights = fsdp.sharded_load(
            bf16=cfg.models.bf16, region=lambda: self.memory.region(memory_saver.WEIGHTS), cpu_offload=offload
        )
        if cfg.lora is not None:
            weights = dataclasses.replace(weights, prepare=_inject_adapters_once(cfg), source=_adapter_source())
        with sharded_loading(weights) if cfg.lora is None or not cfg.lora.load else contextlib.nullcontext():
            super().__init__(cfg, plugin_args)
        # (a LoRA reference is the policy's module: sharded once; models built sharded at load are done)
        loaded_full = [
            m
            for m in (self.model, self.ref_model, self.teacher_model)
            if isinstance(m, torch.nn.Module) and not isinstance(m, fsdp.FSDPModule)
        ]
        if loaded_full:
            with self.memory.region(memory_saver.WEIGHTS):  # the shards are allocated here: torch_memory_saver tag
                for model in loaded_full:
                    fsdp.shard(model, layers=fsdp.decoder_layers(model), bf16=cfg.models.bf16, cpu_offload=offload)
        opt = cfg.optimizer  # over this rank's shards (the parent's optimizer held the unsharded parameters)
        self.optimizer = make_adamw(
            [p for p in self.model.parameters() if p.requires_grad],  # LoRA: adapters only
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        self.memory.tag_optimizer(self.optimizer)  # its state, created at the first step
        self.log_probs = RankLogProbs(
            self.device,
            cfg.models.temperature,
            cfg.models.bf16,
            cfg.batching.log_probs_chunk_size,
            rank=rank,
            world_size=world_size,
        )

    def _apply_lora(self) -> None:
        model: torch.nn.Module = self.model
        if isinstance(model, fsdp.FSDPModule):  # the adapters were injected on meta (the load's prepare)
            from lichen.train import lora

            lora.init_adapters(model, self.cfg.models.seed)
        else:  # loaded whole (--lora-load, or a checkpoint only from_pretrained reads): as one rank, sharded after
            super()._apply_lora()

    def _make_critic(self):
        from lichen.train.dist_critic import RankCritic

        with sharded_loading(fsdp.sharded_load(bf16=False)):  # the critic runs in fp32, in the default region
            return RankCritic(self.cfg, self.device, rank=self.rank, world_size=self.world_size)

    def _run_micro_batches(
        self, tb: TrainBatch, plan: OptimizerStepPlan, loss_of: Callable[[Plan], torch.Tensor]
    ) -> None:
        """This rank's share of the step's micro-batches, padded with empty ones to every rank's count."""
        lengths = tb.host.input_lengths
        coeff = self.flops_coeff  # --balance-by-flops: ranks balanced by estimated FLOPs, as slime
        for mb_plan in split_across_ranks(plan.trained, lengths, self.world_size, tb.host.sharing, coeff)[self.rank]:
            (loss_of(mb_plan) if mb_plan is not None else self._empty_micro_batch(tb, plan)).backward()
        with torch.no_grad():
            for mb_plan in split_across_ranks(plan.observed, lengths, self.world_size, tb.host.sharing)[self.rank]:
                loss_of(mb_plan) if mb_plan is not None else self._empty_micro_batch(tb, plan)
        fsdp.reshard(self.model)  # parameters() are the sharded ones again, with their gradients

    def _empty_micro_batch(self, tb: TrainBatch, plan: OptimizerStepPlan) -> torch.Tensor:
        """A forward whose loss is 0: it only keeps the collectives matched (its backward adds zero gradients)."""
        logp, _ = self.log_probs.forward(self.model, tb.host.micro([[plan.indices[0]]], self.device))
        return logp.sum() * 0.0

    def _step_totals(self, terms: StepTerms, trainer_lp: torch.Tensor | None) -> dict[str, float]:
        keys = list(terms.sums)
        summed = fsdp.all_reduce_sum(torch.stack([terms.sums[k] for k in keys])) if keys else None
        if trainer_lp is not None:
            fsdp.all_reduce_sum(trainer_lp)
        return {k: float(summed[i]) for i, k in enumerate(keys)}


class DistTrainer:
    """One trainer rank; every rank gets the same global batch and returns the same metrics."""

    def __init__(
        self,
        cfg: TrainerConfig,
        plugin_args: Any,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        backend: str | None = None,
    ):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        device = resolve_device(cfg.models.device)
        backend = backend or fsdp.default_backend(
            device, cpu_offload=fsdp.offloads_to_cpu(cfg.optimizer_state.optimizer_cpu_offload, device)
        )
        fsdp.init_process_group(
            rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port, backend=backend
        )
        self.memory = memory_saver.for_this_process()  # tagged torch_memory_saver regions when its hook is here
        self.actor = _RankActor(cfg, plugin_args, rank=rank, world_size=world_size, memory=self.memory)

    @property
    def model(self) -> torch.nn.Module:
        return self.actor.model

    def train(self, rollout_id: int, batch: list[list[Sample]]) -> dict:
        return self.actor.train(rollout_id, batch)

    def offload(self) -> None:
        """Release this rank's GPU memory: through torch_memory_saver by region tag when the rank was started with
        its hook (lichen.train.memory_saver), else TrainActor.offload's copies of this rank's shards; a no-op on
        CPU. (On CUDA not yet measured with FSDP2.)"""
        if self.memory.active:
            self.memory.offload()
        else:
            self.actor.offload()

    def onload(self) -> None:
        if self.memory.active:
            self.memory.onload()
        else:
            self.actor.onload()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Rank 0: the full parameters under their HF names, on CPU, for the weight sync (a tied LM head once, as
        the engines serve it); other ranks: None. Every rank must call it: it gathers the shards (brought back
        first if they are paused: the sync runs after the loop's offload)."""
        with self.memory.weights_resident():
            weights = fsdp.full_weights(self.actor.model, parameters_only=True)
        if weights is not None and self.cfg.lora is not None:  # the engines serve W + alpha/r B A (docs/lora.md)
            from lichen.train import lora  # peft: the lora extra

            weights = lora.merge_state(self.actor.model, weights)
        return weights

    def sends_weights(self) -> bool:
        """Whether the ranks send the weights themselves (sync_weights): always (with LoRA the merged weights,
        built bucket by bucket from the gathered base weights and adapters)."""
        return True

    def sync_weights(self, op: str, *args: Any) -> Any:
        """One op of this rank's weight sender (lichen.weights.rank_send.RankSender), called by the driver's half
        of the transport (lichen.sync) on every rank at once (the gathers) or on rank 0 (the broadcast group);
        answers with metadata and checksums, never the model. The shards are brought back first if paused."""
        if op not in SENDER_OPS:
            raise ValueError(f"unknown weight sender op {op!r}")
        sender = getattr(self, "_weight_sender", None)
        if sender is None:
            sender = self._make_sender()
            self._weight_sender = sender
        with self.memory.weights_resident():
            return getattr(sender, op)(*args)

    def _make_sender(self) -> RankSender:
        """This rank's weight sender over the policy's parameters, one full tensor at a time; with LoRA over the
        merged policy the engines serve (names without adapters, each adapted weight merged as it is gathered:
        lichen.train.lora.gather_merged), so a rank never holds more than a bucket of it."""
        model = self.actor.model

        def full(names: list[str], dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
            return fsdp.full_tensors(model, names, dtype)

        def owned(
            names: list[str],
            dtype: torch.dtype | None,
            owner: dict[str, int],
            into: Callable[[str], torch.Tensor | None] | None = None,
        ) -> Iterator[tuple[str, torch.Tensor | None]]:
            return fsdp.owned_tensors(model, names, owner, dtype, into=into)

        def meta() -> list[list]:
            return [tensor_meta(n, p) for n, p in model.named_parameters()]

        if self.cfg.lora is None:  # with LoRA every rank gathers (the merge needs the base and the adapters)
            return RankSender(
                self.rank, full, meta, gather_owned=owned, write_rows=lambda n, v: fsdp.write_local_rows(model, n, v)
            )
        from lichen.train import lora  # peft: the lora extra

        sources = lora.merged_sources(model)
        params = dict(model.named_parameters())

        def merged(names: list[str], dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
            return lora.gather_merged(full, sources, names)  # gathered and merged in the trainer's dtype, then cast

        return RankSender(self.rank, merged, lambda: [tensor_meta(n, params[base]) for n, (base, _) in sources.items()])

    def _sharded_state(self, *, optimizer: bool = True) -> dict:
        """What DCP saves and loads; without the optimizers' states for --no-save-optim checkpoints."""
        a = self.actor
        state: dict[str, Any] = {
            "model": get_model_state_dict(a.model),
            "opt_step": torch.tensor(a.opt_step, dtype=torch.int64),
        }
        if optimizer:
            state["optimizer"] = get_optimizer_state_dict(a.model, a.optimizer)
        if a.critic is not None:
            c = a.critic
            critic: dict[str, Any] = {"model": get_model_state_dict(c.model)}
            if optimizer:
                critic["optimizer"] = get_optimizer_state_dict(c.model, c.optimizer)
            state["critic"] = critic
        return state

    def token_values(self, rows: Sequence[int]) -> TokenValues:
        """The last step's per-token values of batch rows `rows` (the same on every rank: they are summed)."""
        return rows_of(getattr(self.actor, "last_token_values", {}), rows)

    def save(self, ckpt_dir: str, rollout_id: int) -> SavedTrainer:
        """Write this rank's part of checkpoint `rollout_id` under `ckpt_dir` (every rank calls it): the sharded
        state, rank 0's HF export; then each rank hashes its share of the files. Rank 0 returns every file's
        manifest entry (the other ranks an empty SavedTrainer); the caller (lichen.train.checkpoint) writes the
        manifest, meta.json and `latest`."""
        d = iter_dir(ckpt_dir, rollout_id)
        dcp.save(
            self._sharded_state(optimizer=not self.cfg.checkpoint.no_save_optim),
            checkpoint_id=os.path.join(d, DIST_DIR),
        )
        with self.memory.weights_resident():
            if self.cfg.lora is not None:  # lora/ (and --save-lora) the adapters, gathered: they are small
                self._save_adapters(d, rollout_id)
            self._export_hf(d, rollout_id)  # with LoRA the merged policy, merged as it streams
            if self.cfg.lora is not None and self.cfg.lora.save_merged_hf:
                self._stream_hf(self.cfg.lora.save_merged_hf.format(rollout_id=rollout_id))
        dist.barrier()  # every rank's shards are written before they are hashed
        return SavedTrainer(self._hash_files(d), world_size=self.world_size)

    def _export_hf(
        self,
        d: str,
        rollout_id: int,
        staged: tuple[RankHfPlan, dict[str, torch.Tensor]] | None = None,
        group: Any = None,
        error: str | None = None,
    ) -> None:
        """hf/ of checkpoint `d` and --save-hf's copy (_stream_hf; from `staged`, --async-save's (plan, this rank's
        gathered tensors), on the exchanges of `group`, if given)."""
        self._stream_hf(os.path.join(d, "hf"), staged, group, error)
        if self.cfg.checkpoint.save_hf:
            from lichen.config.train_config import save_hf_dir

            self._stream_hf(save_hf_dir(self.cfg.checkpoint.save_hf, rollout_id), staged, group, error)

    def _hf_plan(self) -> tuple[dict[str, torch.Tensor], Any, RankHfPlan]:
        """(the live state dict, LoRA's merged sources or None, the export's plan): the files write_hf_exports
        writes (its state dict's names, buffers and both names of a tied weight, save_hf_checkpoint's split into
        files), each written by one rank (lichen.weights.rank_hf)."""
        state = self.actor.model.state_dict()  # DTensors report their global shapes
        sources = None
        if self.cfg.lora is not None:  # the merged policy, as lora.merge_state exports it
            from lichen.train import lora

            sources = lora.merged_sources(self.actor.model, list(state))
        shapes = state if sources is None else {n: state[base] for n, (base, _) in sources.items()}
        layout = {n: (list(t.shape), t.dtype) for n, t in shapes.items()}
        return state, sources, plan_rank_hf(plan_shards(shapes), layout, self.world_size)

    def _stream_hf(
        self,
        out: str,
        staged: tuple[RankHfPlan, dict[str, torch.Tensor]] | None = None,
        group: Any = None,
        error: str | None = None,
    ) -> None:
        """The policy as an HF checkpoint at `out`, as write_hf_exports writes it, written by every rank at once
        (lichen.weights.rank_hf): each tensor's shards go to the rank that writes its file only (fsdp.owned_of;
        LoRA's merged weights: every rank gathers each base weight and its adapters, lora.gather_merged) and that
        rank appends it to its file, so no rank holds more than one full tensor (plus two exchanges' received
        shards). `staged`: --async-save's plan and this rank's tensors, gathered on the training path."""
        if staged is not None:
            plan, mine = staged
            owned: Iterator[tuple[str, torch.Tensor | None]] = ((n, mine.get(n)) for n in plan.order)
        else:
            state, sources, plan = self._hf_plan()
            if sources is not None:
                from lichen.train import lora

                def gathered(names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
                    for name in names:
                        t = state[name].detach()
                        yield name, (t.full_tensor() if isinstance(t, DTensor) else t)

                owned = owned_only(self.rank, plan, lora.gather_merged(gathered, sources, list(plan.order)))
            else:
                owned = fsdp.owned_of(state, list(plan.order), plan.owner())
        with open(os.path.join(self.cfg.models.hf_checkpoint, "config.json")) as f:
            config = json.load(f)
        write_rank_hf(
            self.rank,
            out,
            plan,
            owned,
            config=config,
            copy_files_from=self.cfg.models.hf_checkpoint,
            group=group,
            error=error,
        )

    def _save_adapters(self, d: str, rollout_id: int) -> None:
        """LoRA: the adapters (every rank gathers them; a few MB) as peft's adapter directory in checkpoint `d`'s
        lora/ and at --save-lora, written by rank 0 (lichen.train.lora.save_adapter, as a single-rank save)."""
        from lichen.train import lora

        model, lcfg = self.actor.model, self.cfg.lora
        assert lcfg is not None
        adapters = dict(fsdp.full_tensors(model, [n for n, _ in model.named_parameters() if ".lora_" in n]))
        if self.rank == 0:
            lora.save_adapter(model, lcfg, os.path.join(d, LORA_DIR), self.cfg.models.hf_checkpoint, adapters)
            if lcfg.save_lora:
                lora.save_adapter(
                    model, lcfg, lcfg.save_lora.format(rollout_id=rollout_id), self.cfg.models.hf_checkpoint, adapters
                )

    def save_async(self, ckpt_dir: str, rollout_id: int) -> bool:
        """--async-save: `save`'s files, staged here and written in the background (lichen.train.rank_ckpt_async);
        `save_done` gives their entries. False with --use-lora (the adapters export from the live model: `save`)."""
        if self.cfg.lora is not None:
            return False
        d = iter_dir(ckpt_dir, rollout_id)
        with self.memory.weights_resident():  # CPU copies of the tensors of this rank's files of the export
            state, _, plan = self._hf_plan()
            mine = {
                name: whole.to("cpu", copy=True)
                for name, whole in fsdp.owned_of(state, list(plan.order), plan.owner())
                if whole is not None
            }

        def hf(group: Any, error: str | None) -> None:  # in the write's thread, after DCP's (every rank)
            self._export_hf(d, rollout_id, (plan, mine), group, error)

        if not hasattr(self, "_async_save"):
            from lichen.train.rank_ckpt_async import RankAsyncSave

            self._async_save = RankAsyncSave(self.rank, self.world_size)
        self._async_save.start(
            self._sharded_state(optimizer=not self.cfg.checkpoint.no_save_optim), d, os.path.join(d, DIST_DIR), hf
        )
        return True

    def save_done(self) -> SavedTrainer:
        """The entries this rank hashed for its write in flight (save_async), once it is complete."""
        saver = getattr(self, "_async_save", None)
        return SavedTrainer(saver.result() if saver is not None else {}, world_size=self.world_size)

    def _from_rank0(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _hash_files(self, d: str) -> dict[str, dict]:
        """Each rank hashes its share of the files this save wrote (dist/ and hf/, plus lora/: rank 0's listing);
        rank 0 gets every entry, the other ranks {}."""
        tops = {DIST_DIR, "hf", LORA_DIR}
        rels = self._from_rank0(
            [r for r in checkpoint_files(d) if r.split("/", 1)[0] in tops] if self.rank == 0 else None
        )
        parts: list[dict] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(parts, file_entries(d, rels[self.rank :: self.world_size]))
        return {rel: e for part in parts for rel, e in part.items()} if self.rank == 0 else {}

    def _verify(self, d: str) -> None:
        """Every rank checks its share of the files against checksums.json, and every rank raises the same error
        if any share failed (one rank raising alone would leave the others waiting in DCP's collectives)."""
        try:
            verify(d, part=(self.rank, self.world_size))
            problem = None
        except CheckpointDamaged as e:
            problem = str(e)
        problems: list[str | None] = [None] * self.world_size
        dist.all_gather_object(problems, problem)
        first = next((p for p in problems if p), None)
        if first:
            raise ConfigError(f"{d}/{first}; restore that file, or resume from an older checkpoint")

    def load(self, ckpt_dir: str, rollout_id: int | None = None) -> int:
        """Restore checkpoint `rollout_id` in `ckpt_dir` (default: the one `latest` names), saved on any number of
        ranks, after verifying its checksums; returns its rollout id."""
        if rollout_id is None:
            latest = os.path.join(ckpt_dir, LATEST)
            try:  # a regular file inside ckpt_dir, a few bytes: never a FIFO or /dev/zero (ckpt_integrity)
                rollout_id = int(read_inside(ckpt_dir, LATEST, 64).decode("utf-8").strip())
            except (OSError, ValueError, CheckpointDamaged) as e:
                raise ConfigError(
                    f"{latest}: no readable checkpoint id ({e}); point --load at a directory that "
                    "a distributed run saved into"
                ) from None
        d = os.path.join(iter_dir(ckpt_dir, rollout_id), DIST_DIR)
        if not os.path.isdir(d):
            raise ConfigError(f"{d}: missing; this checkpoint was not saved by a multi-rank trainer")
        self._verify(iter_dir(ckpt_dir, rollout_id))
        # saved with --no-save-optim: no optimizer entries, so this run's optimizers start fresh
        with_optimizer = any(
            key.startswith("optimizer.") for key in dcp.FileSystemReader(d).read_metadata().state_dict_metadata
        )
        if not with_optimizer and self.rank == 0:
            warn_fresh_optimizer(iter_dir(ckpt_dir, rollout_id))
        state = self._sharded_state(optimizer=with_optimizer)
        dcp.load(state, checkpoint_id=d)
        a = self.actor
        set_model_state_dict(a.model, state["model"])
        if with_optimizer:
            set_optimizer_state_dict(a.model, a.optimizer, state["optimizer"])
        a.opt_step = int(state["opt_step"])
        if a.critic is not None:
            set_model_state_dict(a.critic.model, state["critic"]["model"])
            if with_optimizer:
                set_optimizer_state_dict(a.critic.model, a.critic.optimizer, state["critic"]["optimizer"])
        return rollout_id

    def close(self) -> None:
        """Barrier, then leave the process group (without the barrier, a rank that exits first can abort another
        still finishing a collective).

        FSDP2's sharded parameters keep the gloo group alive after `destroy_process_group` (measured on torch
        2.13: its worker threads outlive it, even after the model is freed), so a rank process should end without
        interpreter teardown once this returns: Ray kills its actors; tests end ranks with `os._exit`.
        """
        if getattr(self, "_async_save", None) is not None:
            self._async_save.close()  # a write in flight finishes first (its DCP collectives need the group)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
