"""TrainActor: the policy model, its optimizer, and the RL train step in named phases.

One train step (`TrainActor.train`) over the samples of a rollout step:
    1. log-probs    no-grad passes: old, reference, teacher log-probs, critic values   (lichen.train.log_probs)
    2. advantages   estimator / GAE / plug-in, KL penalty, distillation                  (lichen.train.advantage)
    3. schedule     the micro-batches of every optimizer step, skip decisions, up front (lichen.train.step_schedule)
    4. per optimizer step: [critic step], loss + backward per micro-batch (lichen.train.loss), clip + AdamW step
                    (lichen.train.optim) at the learning rate of lichen.train.lr_schedule
    5. metrics      averaged over the optimizer steps, mismatch and first-step checks (lichen.train.step_metrics)
The step's tensors travel in one `TrainBatch` (lichen.train.train_batch).

One optimizer step per global batch: `rollout_batch_size * n_samples_per_prompt` samples are split into
`num_steps_per_rollout` global batches, each into micro-batches whose gradients accumulate. Every loss is
aggregated as "this micro-batch's share of the global-batch loss" (lichen.algo.aggregate_loss), so the update
does not depend on how samples are split into micro-batches.

That freedom is what the fast paths use, each exact up to floating-point rounding: micro-batches are planned over
samples sorted by length and packed several to a model row (lichen.train.micro_batches); samples whose loss share is
exactly zero get no backward (lichen.train.step_schedule.zero_share_rows); old log-probs are not recomputed when
one optimizer step per rollout makes them equal to the training forward's (unless --force-recompute-old-log-probs);
AdamW is torch's fused kernel where the device has one (lichen.train.optim).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Sequence

import torch

from lichen.config.train_config import TrainerConfig
from lichen.devices import resolve_device
from lichen.models import CausalLM, load_model
from lichen.models.tokenizer import load_tokenizer
from lichen.observe.metrics import get_logger
from lichen.train import advantage, checkpoint
from lichen.train.checkpoint import SavedTrainer
from lichen.train.log_probs import LogProbs
from lichen.train.loss import LossPlugins, StepLoss, StepTerms
from lichen.train.lr_schedule import lr_at
from lichen.train.micro_batches import Plan
from lichen.train.optim import clip_and_step, make_adamw, reset_adam_state, set_lr
from lichen.train.param_filter import apply_param_filter
from lichen.train.router_aux import RouterAuxLoss
from lichen.train.step_metrics import check_mismatch, step_metrics
from lichen.train.step_schedule import MicroBatchPlanner, OptimizerStepPlan, schedule_steps
from lichen.train.train_batch import TrainBatch, global_counts
from lichen.train.trainer_protocol import TokenValues, rows_of
from lichen.types import Sample

log = get_logger(__name__)


def _frozen_model(path: str, device: torch.device, options: dict | None = None):
    model = load_model(path, device=device, dtype=torch.float32, **(options or {}))
    return model.eval().requires_grad_(False)


def _plugin(path: str | None, flag: str):
    if not path:
        return None
    from lichen.plugins import load_function

    return load_function(path, flag)


class TrainActor:
    """The trainer. `cfg` is its own configuration; `plugin_args` (the full flag namespace) is handed, unread, to
    user plug-ins only (custom loss, advantage and TIS functions)."""

    def __init__(self, cfg: TrainerConfig, plugin_args: Any = None):
        self.cfg = cfg
        models = cfg.models
        self.device = resolve_device(models.device)
        torch.manual_seed(models.seed)
        tok = load_tokenizer(models.hf_checkpoint)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        # fp32 master weights; --bf16 runs the forward/backward under autocast.
        self.model = load_model(models.hf_checkpoint, device=self.device, dtype=torch.float32, **models.model_options)
        self.model.gradient_checkpointing = models.gradient_checkpointing
        self.model.train()
        if cfg.lora is not None:
            self._apply_lora()
        # --only-train / --freeze-params-name-list: before the optimizer, which takes what still requires a gradient
        self.frozen_params = apply_param_filter(self.model, cfg.param_filter, lora=cfg.lora is not None)
        self.ref_model = self._reference_model() if cfg.needs_ref_model else None
        self.teacher_model = (
            _frozen_model(models.opd_teacher_load, self.device, models.model_options)
            if models.opd_teacher_load is not None
            else None
        )
        opt = cfg.optimizer  # with --use-lora: the adapters' learning rate and weight decay
        self.optimizer = make_adamw(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        self.log_probs = LogProbs(self.device, models.temperature, models.bf16, cfg.batching.log_probs_chunk_size)
        # Exact fast paths (switched off only by tests that compare against the plain computation): micro-batches
        # over length-sorted samples packed several to a row, and no backward for samples whose loss terms are all
        # exactly zero.
        self.sort_by_length = True
        # Packed rows run attention segment by segment (lichen.models.packed_attention): a causal SDPA call per
        # sample, a masked one per shared prompt's response part. Measured on CPU only; on GPUs, where many small
        # kernel launches per row may cost more than the padding they save (a varlen kernel is the tool there),
        # micro-batches stay sorted and one sample per row until that is measured (scripts/gpu_check.sh's
        # packed_attention row: `lichen bench packed --device cuda`).
        self.pack_sequences = self.device.type == "cpu"
        # A group's prompt computed once per packed row (lichen.train.micro_batches.PromptGroups): needs packed rows
        # and lichen's own attention; --model-impl hf unpacks rows into one sequence per sample instead.
        self.share_prompts = not cfg.batching.disable_prompt_sharing and isinstance(self.model, CausalLM)
        self.skip_zero_advantage = not cfg.batching.disable_zero_advantage_skip
        self.opt_step = 0
        self._offloaded = False
        loss = cfg.loss
        self.plugins = LossPlugins(
            custom_loss=_plugin(loss.custom_loss_function_path, "--custom-loss-function-path")
            if loss.loss_type == "custom_loss"
            else None,
            pg_reducer=_plugin(loss.custom_pg_loss_reducer_function_path, "--custom-pg-loss-reducer-function-path"),
            tis_fn=_plugin(loss.custom_tis_function_path, "--custom-tis-function-path") if loss.use_tis else None,
            args=plugin_args,
        )
        self.router_aux = RouterAuxLoss(self.model, loss.moe_aux_loss_coeff)
        self.loss = StepLoss(
            loss, self.plugins, estimator=cfg.advantage.advantage_estimator, router_aux=self.router_aux.active
        )
        self.custom_advantage = _plugin(
            cfg.advantage.custom_advantage_function_path, "--custom-advantage-function-path"
        )
        self.critic = self._make_critic() if cfg.advantage.advantage_estimator == "ppo" else None

    def _apply_lora(self) -> None:
        """--use-lora (docs/lora.md): adapters join the policy and every other weight freezes, so the optimizer
        holds the adapters only; --lora-load starts them from a saved adapter directory."""
        from lichen.train import lora

        lcfg = self.cfg.lora
        assert lcfg is not None  # called with --use-lora only
        lora.apply_lora(self.model, lcfg)
        lora.init_adapters(
            self.model, self.cfg.models.seed
        )  # as the multi-rank trainer's, whose adapters start on meta
        if lcfg.load:
            source = lcfg.load
            lora.load_adapter_state(self.model, lora.read_adapter(source), f"--lora-load {source}")

    def _reference_model(self):
        """A frozen copy of --ref-load (or --hf-checkpoint); with --use-lora the policy module with its adapters
        disabled (the base weights never train, so no second model is needed)."""
        if self.cfg.lora is None:
            models = self.cfg.models
            return _frozen_model(models.ref_load or models.hf_checkpoint, self.device, models.model_options)
        from lichen.train.lora import ReferencePolicy

        return ReferencePolicy(self.model)

    def _make_critic(self):
        from lichen.train.critic import Critic

        return Critic(cfg=self.cfg, device=self.device)

    # ---- weights, state, placement ------------------------------------------------------------------------
    def named_weights(self):
        """(HF name, tensor) pairs of the current policy, read by sync.push (with --use-lora: merged weights)."""
        if self.cfg.lora is not None:
            from lichen.train.lora import merged_named_weights

            yield from merged_named_weights(self.model)
            return
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    def state_dict(self) -> dict:
        """Everything a resume restores, as nested dicts of tensors and plain values (the layout
        torch.distributed.checkpoint saves): policy weights, optimizer state and step count, the critic's state.
        With --use-lora, "model" is the merged policy (the checkpoint's HF export) and "lora" the adapters, which
        are what a resume restores (the base weights are --hf-checkpoint's)."""
        if self.cfg.lora is not None:
            from lichen.train.lora import adapter_state

            model = dict(self.named_weights())
            extra = {"lora": adapter_state(self.model)}
        else:
            model, extra = self.model.state_dict(), {}
        state = {"model": model, "optimizer": self.optimizer.state_dict(), "opt_step": self.opt_step, **extra}
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.cfg.lora is not None:
            from lichen.train.lora import load_adapter_state

            load_adapter_state(self.model, state["lora"], "checkpoint")
        else:
            self.model.load_state_dict(state["model"], strict=True)
        if "optimizer" in state:  # absent: saved with --no-save-optim, this optimizer starts fresh
            self.optimizer.load_state_dict(state["optimizer"])
        self.opt_step = int(state["opt_step"])
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])

    # ---- the rest of the Trainer contract (lichen.train.trainer_protocol) -------------------------------------
    def save(self, save_dir: str, rollout_id: int) -> SavedTrainer:
        """hf/, trainer_state.pt (and critic.pt, lora/) of checkpoint `rollout_id`; lichen.train.checkpoint writes
        the rest of it."""
        return checkpoint.save_trainer(save_dir, rollout_id, self)

    def save_async(self, save_dir: str, rollout_id: int) -> Callable[[], SavedTrainer] | None:
        """--async-save: copy this checkpoint's state to CPU buffers kept for the next save; returns what writes
        the copy as `save` would (lichen.train.checkpoint.snapshot_trainer), None where the save must be `save`."""
        if not hasattr(self, "_snapshot"):
            self._snapshot = checkpoint.Snapshot()
        return checkpoint.snapshot_trainer(save_dir, rollout_id, self, self._snapshot)

    def load(self, load_dir: str, rollout_id: int) -> None:
        checkpoint.load_trainer(load_dir, rollout_id, self)

    def token_values(self, rows: Sequence[int]) -> TokenValues:
        return rows_of(getattr(self, "last_token_values", {}), rows)

    def memory_begin(self) -> None:
        pass  # in the driver's process: the loop's phases measure it

    def memory_end(self, phase: str) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass

    def offload(self) -> None:
        if self.device.type == "cpu":
            return  # docs/architecture.md#offload: a no-op on CPU (logged once by the loop)
        from lichen.train.offload import offload_to_cpu

        offload_to_cpu(self.model, self.optimizer)
        self._offloaded = True

    def onload(self) -> None:
        if not self._offloaded:
            return
        from lichen.train.offload import onload_to_device

        onload_to_device(self.model, self.optimizer, self.device)
        self._offloaded = False

    # ---- the train step -----------------------------------------------------------------------------------
    def planner(self) -> MicroBatchPlanner:
        batching = self.cfg.batching
        return MicroBatchPlanner(
            batching.micro_batch_size,
            batching.max_tokens_per_gpu if batching.use_dynamic_batch_size else None,
            sort=self.sort_by_length,
            pack=self.pack_sequences,
            flops_coeff=self.flops_coeff,
        )

    @property
    def flops_coeff(self) -> float | None:
        """--balance-by-flops: the linear coefficient of a sample's cost coeff*L + L^2, from config.json."""
        if not self.cfg.batching.balance_by_flops:
            return None
        from lichen.models.hf_model import read_config_json
        from lichen.train.flops_balance import flops_coeff

        return flops_coeff(read_config_json(self.cfg.models.hf_checkpoint))

    def train(self, rollout_id: int, batch: list[list[Sample]]) -> dict:
        """One train step on a rollout step's groups of samples; returns its metrics."""
        cfg = self.cfg
        t0 = time.perf_counter()
        if cfg.optimizer_state.reset_optimizer_states:  # slime: before every rollout step's training, the critic's too
            for optimizer in (self.optimizer, getattr(self.critic, "optimizer", None)):
                if optimizer is not None:
                    reset_adam_state(optimizer)
        tb = TrainBatch.from_samples(
            [s for group in batch for s in group],
            self.pad_id,
            self.device,
            share_prompts=self.share_prompts and self.pack_sequences,
        )
        planner = self.planner()
        no_grad_plans = planner.no_grad(list(range(tb.num_samples)), tb.host.input_lengths, tb.host.sharing)
        # 1. log-probs (and critic values)
        recomputed_old = self._log_probs_phase(tb, no_grad_plans)
        # 2. advantages
        tb.advantages, tb.returns, metrics = advantage.step_advantages(
            cfg.advantage, cfg.loss, tb, self.custom_advantage, self.plugins.args
        )
        if cfg.debug.save_debug_train_data:
            self._dump(cfg.debug.save_debug_train_data.format(rollout_id=rollout_id), rollout_id, tb)
        use_tis = cfg.loss.use_tis and tb.rollout_log_probs is not None and cfg.loss.loss_type == "policy_loss"
        # The first step's training forward gives the trainer's log-probs for the mismatch metric, unless
        # separately computed old log-probs serve as those.
        record = tb.rollout_log_probs is not None and (tb.old_log_probs is None or tb.old_is_rollout)
        # 3. the schedule of every optimizer step, before any of them runs
        steps = schedule_steps(
            planner,
            tb.host.input_lengths,
            tb.mask,
            tb.advantages,
            num_steps=cfg.batching.num_steps_per_rollout,
            skip=self.skip_zero_advantage and self.plugins.pg_reducer is None,
            zero_advantage_is_zero_loss=self._zero_advantage_is_zero_loss(),
            # Skipped rows still feed metrics that read their log-probs: ppo_kl and clipfrac against given old
            # log-probs, TIS weights (and the mismatch metric, see `record`). Otherwise their shares are exactly 0.
            needs_log_probs=tb.old_log_probs is not None or use_tis,
            record_first_log_probs=record,
            with_critic=self.critic is not None,
            sharing=tb.host.sharing,
        )
        trainer_lp = torch.zeros_like(tb.mask) if record else None
        critic_only = self.critic is not None and rollout_id < cfg.critic.num_critic_only_steps
        per_step: list[dict] = []
        for plan in steps:  # 4. per optimizer step: the critic's step, then loss/backward per micro-batch + step
            if self.critic is not None:
                for key, value in self.critic.train_step(
                    tb, plan.critic, global_counts(tb.mask[plan.indices], cfg.loss.max_response_len)
                ).items():
                    metrics[key] = metrics.get(key, 0.0) + value / cfg.batching.num_steps_per_rollout
            if critic_only:
                continue
            per_step.append(self._optimizer_step(tb, plan, use_tis, trainer_lp if plan.record_log_probs else None))
        # 5. metrics
        if critic_only:
            per_step = [{"ppo_kl": 0.0}]
        if tb.old_log_probs is not None and not tb.old_is_rollout:
            trainer_lp = tb.old_log_probs  # the mismatch metric reads the recomputed old log-probs
        elif critic_only and record:  # the policy did not move; its log-probs come from one pass
            trainer_lp = self.log_probs.of_batch(self.model, tb.host, no_grad_plans, tb.response_width)
        metrics.update(step_metrics(tb, per_step, trainer_lp, recomputed_old))
        check_mismatch(metrics, cfg.debug.ci_train_rollout_logprob_abs_diff_threshold, rollout_id)
        metrics["time/train"] = time.perf_counter() - t0
        self.last_step_metrics = per_step
        # the step's per-token values, [n, R] in batch order (None: not computed), for the loop's sample log
        self.last_token_values = {"advantages": tb.advantages, "trainer_log_probs": trainer_lp}
        return metrics

    def _log_probs_phase(self, tb: TrainBatch, plans) -> bool:
        """Phase 1: the no-grad passes the advantages and the loss need. Returns whether the old log-probs were
        recomputed (rather than being the engine's, or the training forward's own)."""
        cfg = self.cfg
        lp = lambda model: self.log_probs.of_batch(model, tb.host, plans, tb.response_width)  # noqa: E731
        # Old log-probs: recomputed in a separate no-grad pass whose micro-batches differ from training's, so
        # the first-step ppo_kl == 0 check exercises batch-shape independence rather than reusing one forward.
        loss = cfg.loss
        recompute = loss.loss_type != "sft_loss" and (
            cfg.batching.num_steps_per_rollout > 1 or loss.force_recompute_old_log_probs
        )
        if loss.use_rollout_logprobs and tb.rollout_log_probs is not None:
            tb.old_log_probs = tb.rollout_log_probs
        elif recompute:
            tb.old_log_probs = lp(self.model)
        if self.ref_model is not None:
            tb.ref_log_probs = lp(self.ref_model)
        distill = cfg.advantage.use_opd and loss.loss_type != "sft_loss"
        if distill and self.teacher_model is not None:
            tb.teacher_log_probs = lp(self.teacher_model)
        elif distill:  # --opd-type sglang: the teacher's servers scored the samples in the rollout
            tb.teacher_log_probs = tb.host.teacher_log_probs(self.device)
        # The current policy's log-probs, where no old (or, for distillation, engine) log-probs stand in for them.
        kl_needs = self.ref_model is not None and cfg.advantage.kl_coef != 0
        opd_needs = distill and tb.rollout_log_probs is None
        if tb.old_log_probs is None and (kl_needs or opd_needs):
            tb.policy_log_probs = lp(self.model)
        if self.critic is not None and loss.loss_type != "sft_loss":
            tb.values = self.critic.values(tb.host, plans, tb.response_width)
        return recompute

    def _zero_advantage_is_zero_loss(self) -> bool:
        """Whether a zero-advantage sample adds exactly 0 to the loss: only the built-in policy losses are -A
        times a factor, and no entropy, KL or router load-balancing term reads the sample."""
        loss = self.cfg.loss
        return (
            loss.loss_type == "policy_loss"
            and self.plugins.custom_loss is None
            and loss.entropy_coef == 0
            and not (loss.use_kl_loss and self.ref_model is not None)
            and not self.router_aux.active
        )

    def _optimizer_step(
        self, tb: TrainBatch, plan: OptimizerStepPlan, use_tis: bool, trainer_lp: torch.Tensor | None
    ) -> dict:
        """Phases 3 and 4 for one global batch: each micro-batch's share of the loss and its backward, then clip
        and one AdamW step. `trainer_lp`, when given, receives the training forward's log-probs."""
        cfg = self.cfg
        counts = global_counts(tb.mask[plan.indices], cfg.loss.max_response_len)
        terms = self.loss.begin_step(
            counts, kl_loss=tb.ref_log_probs is not None and cfg.loss.use_kl_loss, use_tis=use_tis, device=self.device
        )

        def loss_of(mb_plan) -> torch.Tensor:
            mb = tb.host.micro(mb_plan, self.device)
            with self.router_aux.recording(self.model):
                logp, entropy = self.log_probs.forward(self.model, mb, need_entropy=cfg.loss.entropy_coef != 0)
            if trainer_lp is not None:
                trainer_lp[mb.indices, : logp.shape[1]] = logp.detach().to(trainer_lp.dtype)
            aux = self.router_aux.share(self.model, mb_plan, tb.host.input_lengths, plan.trained, self.device)
            return self.loss.micro_batch(tb, mb.indices, logp, entropy, terms, router_aux=aux)

        self.optimizer.zero_grad(set_to_none=True)
        self._run_micro_batches(tb, plan, loss_of)
        if not plan.trained:
            # A backward of exactly-zero losses would have left zero gradients: AdamW must see the same.
            for p in self.model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        totals = self._step_totals(terms, trainer_lp)
        opt = cfg.optimizer
        lr = lr_at(
            self.opt_step,
            lr=opt.lr,
            min_lr=opt.min_lr,
            warmup=opt.warmup_iters,
            decay_iters=opt.decay_iters,
            style=opt.decay_style,
        )
        set_lr(self.optimizer, lr)
        grad_norm, stepped = clip_and_step(
            self.optimizer,
            self.model.parameters(),
            clip_grad=opt.clip_grad,
            has_samples=counts["global_num_samples"] > 0,
        )
        if not stepped:
            log.warning(
                "skipping optimizer step %d: %s",
                self.opt_step,
                "no trainable samples" if counts["global_num_samples"] == 0 else f"grad norm {float(grad_norm)}",
            )
        self.opt_step += 1
        totals["grad_norm"] = float(grad_norm)
        totals["lr"] = lr
        totals["skipped_samples"] = float(len(plan.skipped))
        return totals

    def _run_micro_batches(
        self, tb: TrainBatch, plan: OptimizerStepPlan, loss_of: Callable[[Plan], torch.Tensor]
    ) -> None:
        """The backward of every trained micro-batch, then the no-grad forward of every observed one. (A rank of
        the multi-rank trainer, lichen.train.dist_trainer, runs its share of them.)"""
        for mb_plan in plan.trained:
            loss_of(mb_plan).backward()
        with torch.no_grad():
            for mb_plan in plan.observed:
                loss_of(mb_plan)

    def _step_totals(self, terms: StepTerms, trainer_lp: torch.Tensor | None) -> dict[str, float]:
        """The optimizer step's metric sums as numbers. (The multi-rank trainer first sums them, and the rows of
        `trainer_lp` each rank filled, over the ranks.)"""
        return {key: float(value) for key, value in terms.sums.items()}

    def _dump(self, path: str, rollout_id: int, tb: TrainBatch) -> None:
        """--save-debug-train-data: what this step trained on (written to `path`), for checking it against
        reference math."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
        torch.save(
            {
                "rollout_id": rollout_id,
                "samples": [s.to_dict() for s in tb.samples],
                "rewards": advantage.sample_rewards(tb.samples, self.cfg.advantage.reward_key),
                "advantages": cpu(tb.advantages),
                "mask": cpu(tb.mask),
                "old_log_probs": cpu(tb.old_log_probs),
                "ref_log_probs": cpu(tb.ref_log_probs),
                "rollout_log_probs": cpu(tb.rollout_log_probs),
                "values": cpu(tb.values),
            },
            path,
        )
