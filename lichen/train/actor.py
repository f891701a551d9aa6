"""TrainActor: the policy model, its optimizer, log-prob passes and the RL train step.

One optimizer step per global batch: `rollout_batch_size * n_samples_per_prompt` samples are split into
`num_steps_per_rollout` global batches, each into micro-batches whose gradients accumulate. Every loss is
aggregated as "this micro-batch's share of the global-batch loss" (lichen.algo.aggregate_loss), so the update
does not depend on how samples are split into micro-batches.

That freedom is what the fast paths use, each exact up to floating-point rounding: micro-batches are planned over
samples sorted by length and packed several to a model row (lichen.train.micro_batches); samples whose loss share is
exactly zero get no backward (_skipped_rows); old log-probs are not recomputed when one optimizer step per
rollout makes them equal to the training forward's (unless --force-recompute-old-log-probs); AdamW is torch's
fused kernel where the device has one (lichen.train.optim).
"""

from __future__ import annotations

import contextlib
import time

import torch

from lichen import algo
from lichen.devices import resolve_device
from lichen.models import load_model
from lichen.models.tokenizer import load_tokenizer
from lichen.observe.metrics import get_logger
from lichen.train.advantage import compute_advantages
from lichen.train.micro_batches import MicroBatch, StepBatch, plan_micro_batches
from lichen.train.optim import make_adamw
from lichen.train.schedule import lr_at
from lichen.types import Sample, Status

log = get_logger(__name__)


class TrainActor:
    def __init__(self, args):
        self.args = args
        self.device = resolve_device(args.device)
        torch.manual_seed(args.seed)
        tok = load_tokenizer(args.hf_checkpoint)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        # fp32 master weights; --bf16 runs the forward/backward under autocast.
        self.model = load_model(args.hf_checkpoint, device=self.device, dtype=torch.float32)
        self.model.gradient_checkpointing = bool(args.gradient_checkpointing)
        self.model.train()
        self.ref_model = None
        if args.use_kl_loss or args.kl_coef != 0:
            self.ref_model = load_model(args.ref_load or args.hf_checkpoint, device=self.device, dtype=torch.float32)
            self.ref_model.eval().requires_grad_(False)
        self.optimizer = make_adamw(self.model.parameters(), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                    eps=args.adam_eps, weight_decay=args.weight_decay)
        # Exact fast paths (switched off only by tests that compare against the plain computation): micro-batches
        # over length-sorted samples packed several to a row, and no backward for samples whose loss terms are all
        # exactly zero.
        self.sort_by_length = True
        # Packed rows need a dense [rows, 1, T, T] block mask: cheap for the CPU flash kernel, but on GPUs it
        # would push SDPA off its flash kernels (a varlen kernel is the tool there), so GPUs get sorted,
        # one-sample-per-row micro-batches.
        self.pack_sequences = self.device.type == "cpu"
        self.skip_zero_advantage = True
        self.opt_step = 0
        self._offloaded = False
        self.custom_loss = None
        if args.loss_type == "custom_loss":
            from lichen.plugins import load_function

            self.custom_loss = load_function(args.custom_loss_function_path, "--custom-loss-function-path")
        self.critic = None
        if args.advantage_estimator == "ppo":
            from lichen.train.critic import Critic

            self.critic = Critic(args, self.device, self.pad_id)
        self.teacher_model = None
        if args.use_opd:
            self.teacher_model = load_model(args.opd_teacher_load, device=self.device, dtype=torch.float32)
            self.teacher_model.eval().requires_grad_(False)
        self.pg_reducer = None
        if args.custom_pg_loss_reducer_function_path:
            from lichen.plugins import load_function

            self.pg_reducer = load_function(args.custom_pg_loss_reducer_function_path,
                                            "--custom-pg-loss-reducer-function-path")
        self.tis_fn = None
        if args.use_tis and args.custom_tis_function_path:
            from lichen.plugins import load_function

            self.tis_fn = load_function(args.custom_tis_function_path, "--custom-tis-function-path")

    # ---- weights for sync and checkpoints ----------------------------------------------------------------
    def named_weights(self):
        """(HF name, tensor) pairs of the current policy, read by sync.push."""
        for name, p in self.model.named_parameters():
            yield name, p.detach()

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

    # ---- log-probs --------------------------------------------------------------------------------------
    def _autocast(self):
        if self.args.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_log_probs(self, model, mb: MicroBatch, need_entropy: bool = False):
        """log pi(token) = log_softmax(logits / T)[token] at each response position
        (docs/architecture.md#log-prob-convention)."""
        with self._autocast():
            hidden = model(mb.input_ids, mb.position_ids, attn_mask=mb.attn_mask)
            logits = model.logits(mb.response_hidden(hidden))
        logits = logits.float() / self.args.rollout_temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, mb.resp_tokens[..., None]).squeeze(-1)
        entropy = algo.entropy_from_logits(logits) if need_entropy else None
        return logp, entropy

    @torch.no_grad()
    def _log_prob_pass(self, model, batch: StepBatch, splits, R) -> torch.Tensor:
        out = torch.zeros((len(batch.samples), R), device=self.device)
        for plan in splits:
            mb = batch.micro(plan, self.device)
            lp, _ = self.forward_log_probs(model, mb)
            out[mb.indices, : lp.shape[1]] = lp
        return out

    def _splits(self, indices: list[int], batch: StepBatch, micro_batch_size: int, max_tokens: int | None):
        budget = (max_tokens or self.args.max_tokens_per_gpu) if self.args.use_dynamic_batch_size else None
        return plan_micro_batches(indices, batch.input_lengths, micro_batch_size=micro_batch_size, max_tokens=budget,
                                  sort=self.sort_by_length, pack=self.pack_sequences)

    # ---- the train step ---------------------------------------------------------------------------------
    def train(self, rollout_id: int, batch: list[list[Sample]]) -> dict:
        args = self.args
        t0 = time.perf_counter()
        samples = [s for group in batch for s in group]
        n = len(samples)
        everything = list(range(n))
        sb = StepBatch(samples, self.pad_id)  # padded once, on the host
        mask = sb.resp_mask.to(self.device)
        R = mask.shape[1]
        rollout_lp = sb.rollout_log_probs(self.device)
        has_rollout_lp = rollout_lp is not None

        # Old log-probs: recomputed in a separate no-grad pass whose micro-batches differ from training's, so
        # the first-step ppo_kl == 0 check exercises batch-shape independence rather than reusing one forward.
        recompute = args.loss_type != "sft_loss" and (args.num_steps_per_rollout > 1 or args.force_recompute_old_log_probs)
        lp_mbs = max(2 * args.micro_batch_size, 1)
        lp_tokens = 2 * args.max_tokens_per_gpu if args.max_tokens_per_gpu else None
        lp_splits = self._splits(everything, sb, lp_mbs, lp_tokens)
        old_lp = None
        if args.use_rollout_logprobs and has_rollout_lp:
            old_lp = rollout_lp
        elif recompute:
            old_lp = self._log_prob_pass(self.model, sb, lp_splits, R)
        ref_lp = self._log_prob_pass(self.ref_model, sb, lp_splits, R) if self.ref_model is not None else None

        kl_for_adv = None
        if ref_lp is not None and args.kl_coef != 0:
            base = old_lp if old_lp is not None else self._log_prob_pass(self.model, sb, lp_splits, R)
            kl_for_adv = algo.approx_kl(base, ref_lp, args.kl_loss_type) * mask
        metrics: dict = {}
        returns = values = None
        if args.loss_type == "sft_loss":
            adv = torch.zeros_like(mask)
        elif self.critic is not None:
            from lichen.train.advantage import sample_rewards

            values = self.critic.values(sb, lp_splits, R)
            kl_tok = kl_for_adv if kl_for_adv is not None else torch.zeros_like(mask)
            token_rewards = algo.reinforce_plus_plus_token_rewards(
                sample_rewards(samples, args.reward_key).to(self.device), kl_tok, mask, args.kl_coef)
            adv, returns = algo.gae_advantages(token_rewards, values, mask, args.gamma, args.lambd)
            if args.normalize_advantages:
                adv = algo.whiten(adv, mask)
            metrics["critic/values_mean"] = float((values * mask).sum() / mask.sum().clamp(min=1))
        else:
            adv, adv_metrics = compute_advantages(args, samples, mask, kl_for_adv)
            metrics.update(adv_metrics)

        if self.teacher_model is not None and args.loss_type != "sft_loss":
            # On-policy distillation: A_t -= coef * (log pi(y_t) - log pi_teacher(y_t)), the per-token reverse KL.
            teacher_lp = self._log_prob_pass(self.teacher_model, sb, lp_splits, R)
            policy_lp = old_lp if old_lp is not None else (
                rollout_lp if has_rollout_lp else self._log_prob_pass(self.model, sb, lp_splits, R))
            reverse_kl = (policy_lp - teacher_lp) * mask
            adv = adv - args.opd_kl_coef * reverse_kl
            metrics["train/opd_reverse_kl"] = float(reverse_kl.sum() / mask.sum().clamp(min=1))
        if args.save_debug_train_data:
            self._dump(rollout_id, samples, adv, mask, old_lp, ref_lp, rollout_lp if has_rollout_lp else None, values)

        gbs = n // args.num_steps_per_rollout
        step_metrics: list[dict] = []
        # The first step's training forward gives the trainer's log-probs for the mismatch metric, unless
        # separately computed old log-probs serve as those.
        first_logp = torch.zeros((n, R), device=self.device)
        need_first_logp = has_rollout_lp and (old_lp is None or old_lp is rollout_lp)
        critic_only = self.critic is not None and rollout_id < args.num_critic_only_steps
        for k in range(args.num_steps_per_rollout):
            idx = everything[k * gbs : (k + 1) * gbs]
            if self.critic is not None:
                step_mask = mask[idx]
                counts = dict(global_num_samples=int((step_mask.sum(-1) > 0).sum()), global_num_tokens=int(step_mask.sum()),
                              max_response_len=args.rollout_max_response_len)
                for key, value in self.critic.train_step(sb, self._splits(idx, sb, args.micro_batch_size, None),
                                                         mask, values, returns, counts).items():
                    metrics[key] = metrics.get(key, 0.0) + value / args.num_steps_per_rollout
            if critic_only:
                continue
            first_out = first_logp if (k == 0 and need_first_logp) else None
            step_metrics.append(self._optimizer_step(sb, idx, mask, adv, old_lp, ref_lp, first_out, rollout_lp))

        if critic_only:  # the policy did not move; its log-probs for the mismatch metric come from one pass
            first_logp = self._log_prob_pass(self.model, sb, lp_splits, R)
            step_metrics = [{"ppo_kl": 0.0}]
        # Mismatch between the engine's log-probs and the trainer's for the same tokens and weights.
        if has_rollout_lp:
            trainer_lp = old_lp if (old_lp is not None and old_lp is not rollout_lp) else first_logp
            diff = (trainer_lp - rollout_lp).abs() * mask
            ntok = mask.sum().clamp(min=1)
            metrics["train/train_rollout_logprob_abs_diff"] = float(diff.sum() / ntok)
            metrics["train/train_rollout_logprob_abs_diff_max"] = float(diff.max())
        for key in step_metrics[0]:
            metrics[f"train/{key}"] = sum(m[key] for m in step_metrics) / len(step_metrics)
        if "ppo_kl" in step_metrics[0]:
            metrics["train/ppo_kl_first_step"] = step_metrics[0]["ppo_kl"]
            metrics["train/ppo_kl_last_step"] = step_metrics[-1]["ppo_kl"]
        metrics["train/num_failed_samples"] = sum(s.status == Status.FAILED for s in samples)
        metrics["time/train"] = time.perf_counter() - t0
        if recompute and abs(metrics["train/ppo_kl_first_step"]) > 1e-4:
            log.warning(
                "invariant: first-step ppo_kl = %.3g with recomputed old log-probs (expected ~0): the trainer's "
                "log-probs depend on how samples are batched", metrics["train/ppo_kl_first_step"]
            )
        self.last_step_metrics = step_metrics
        return metrics

    def _policy_terms(self, logp, old, adv, mask):
        args = self.args
        est = args.advantage_estimator
        kw = dict(eps_clip=args.eps_clip, eps_clip_high=args.eps_clip_high)
        if est == "gspo":
            out = algo.gspo_policy_loss(logp, old, adv, mask, **kw)
        elif est == "cispo":
            out = algo.cispo_policy_loss(logp, old, adv, **kw)
        else:
            out = algo.ppo_policy_loss(logp, old, adv, eps_clip_c=args.eps_clip_c, **kw)
        if args.use_opsm:
            adv_seq = algo.masked_mean(adv, mask, dim=-1)
            mask = mask * algo.opsm_mask(logp.detach(), old, adv_seq, mask, args.opsm_delta)
        return out, mask

    def _dump(self, rollout_id, samples, adv, mask, old_lp, ref_lp, rollout_lp, values=None) -> None:
        """--save-debug-train-data: what this step trained on, for checking it against reference math."""
        import os

        from lichen.train.advantage import sample_rewards

        path = self.args.save_debug_train_data.format(rollout_id=rollout_id)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
        torch.save({
            "rollout_id": rollout_id,
            "samples": [s.to_dict() for s in samples],
            "rewards": sample_rewards(samples, self.args.reward_key),
            "advantages": cpu(adv), "mask": cpu(mask), "old_log_probs": cpu(old_lp),
            "ref_log_probs": cpu(ref_lp), "rollout_log_probs": cpu(rollout_lp), "values": cpu(values),
        }, path)

    def _tis_weights(self, old, rollout_lp, m):
        """Importance weight of the trainer's old policy over the engine's: w = exp(old - rollout), per token.

        truncate: clip(w, low, high); icepop: w where low <= w <= high, else 0. Detached: a weight, not a path.
        """
        args = self.args
        if self.tis_fn is not None:
            return self.tis_fn(args, old_log_probs=old, rollout_log_probs=rollout_lp, mask=m).detach()
        w = torch.exp((old - rollout_lp).clamp(-20, 20)).detach()
        if args.tis_mode == "icepop":
            return torch.where((w >= args.tis_clip_low) & (w <= args.tis_clip), w, torch.zeros_like(w))
        return w.clamp(args.tis_clip_low, args.tis_clip)

    def _skipped_rows(self, idx, mask, adv, needs_logp: bool) -> tuple[list[int], list[int]]:
        """Rows of `idx` whose share of the loss is exactly 0 for any log-probs, so they need no backward.

        A row whose loss mask is all 0 adds nothing to any aggregated term. A row whose advantage is 0 on every
        masked token adds exactly 0 to a built-in policy loss (each is -A times a finite, row-local factor), so it
        is skipped unless entropy, a KL loss, an SFT / custom loss or a custom reducer reads it. Denominators come
        from the whole global batch (counts in _optimizer_step), so they still count skipped rows.
        Returns (skipped, observed): `observed` are the skipped rows that still need a no-grad forward because
        their log-probs feed a metric (`needs_logp`); the rest are not computed at all.
        """
        args = self.args
        if not self.skip_zero_advantage or self.pg_reducer is not None:
            return [], []
        live = mask[idx] != 0
        masked_out = ~live.any(dim=-1)
        zero_adv = torch.zeros_like(masked_out)
        if (args.loss_type == "policy_loss" and self.custom_loss is None and args.entropy_coef == 0
                and not (args.use_kl_loss and self.ref_model is not None)):
            zero_adv = ~((adv[idx] != 0) & live).any(dim=-1) & ~masked_out
        skipped = [i for i, m, z in zip(idx, masked_out.tolist(), zero_adv.tolist()) if m or z]
        observed = [i for i, z in zip(idx, zero_adv.tolist()) if z] if needs_logp else []
        return skipped, observed

    def _optimizer_step(self, sb: StepBatch, idx, mask, adv, old_lp, ref_lp, first_logp_out, rollout_lp=None) -> dict:
        """One AdamW step on the global batch `idx`: sum over micro-batches of their share of the loss, backward,
        clip, step. Rows whose loss share is exactly 0 (see _skipped_rows) get no backward."""
        args = self.args
        step_mask = mask[idx]
        counts = dict(
            global_num_samples=int((step_mask.sum(-1) > 0).sum()),
            global_num_tokens=int(step_mask.sum()),
            max_response_len=args.rollout_max_response_len,
        )
        use_tis = args.use_tis and rollout_lp is not None and args.loss_type == "policy_loss"
        # Skipped rows still feed metrics that read their log-probs: the mismatch metric (first_logp_out), ppo_kl
        # and clipfrac against given old log-probs, TIS weights. Otherwise their metric shares are exactly 0.
        needs_logp = first_logp_out is not None or old_lp is not None or use_tis
        skipped, observed = self._skipped_rows(idx, mask, adv, needs_logp)
        skip = set(skipped)
        trained = [i for i in idx if i not in skip]
        totals = {"loss": 0.0, "pg_loss": 0.0}
        if args.loss_type != "sft_loss":  # SFT has no old policy: no ratio, no clipping, no KL to it
            totals["ppo_kl"] = 0.0
            if self.custom_loss is None:
                totals["pg_clipfrac"] = 0.0
        if args.entropy_coef != 0:
            totals["entropy"] = 0.0
        if ref_lp is not None and args.use_kl_loss:
            totals["kl_loss"] = 0.0
        if use_tis:
            totals["tis_weight_mean"] = totals["tis_changed_frac"] = 0.0
        # Metric shares stay tensors until the step ends: one host sync per step, not per micro-batch.
        sums = {k: torch.zeros((), dtype=torch.float64, device=self.device) for k in totals}
        terms = dict(sb=sb, mask=mask, adv=adv, old_lp=old_lp, ref_lp=ref_lp, rollout_lp=rollout_lp, counts=counts,
                     use_tis=use_tis, sums=sums, first_logp_out=first_logp_out)
        self.optimizer.zero_grad(set_to_none=True)
        for plan in self._splits(trained, sb, args.micro_batch_size, None):
            self._micro_batch_loss(plan, **terms).backward()
        if observed:
            lp_tokens = 2 * args.max_tokens_per_gpu if args.max_tokens_per_gpu else None
            with torch.no_grad():
                for plan in self._splits(observed, sb, max(2 * args.micro_batch_size, 1), lp_tokens):
                    self._micro_batch_loss(plan, **terms)
        if not trained:
            # A backward of exactly-zero losses would have left zero gradients: AdamW must see the same.
            for p in self.model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        for key, value in sums.items():
            totals[key] = float(value)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.clip_grad if args.clip_grad > 0 else float("inf"))
        lr = lr_at(
            self.opt_step,
            lr=args.lr,
            min_lr=args.min_lr,
            warmup=args.lr_warmup_iters,
            decay_iters=args.lr_decay_iters or args.total_optimizer_steps,
            style=args.lr_decay_style,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if counts["global_num_samples"] > 0 and torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            log.warning("skipping optimizer step %d: %s", self.opt_step,
                        "no trainable samples" if counts["global_num_samples"] == 0 else f"grad norm {float(grad_norm)}")
        self.opt_step += 1
        totals["grad_norm"] = float(grad_norm)
        totals["lr"] = lr
        totals["skipped_samples"] = float(len(skipped))
        return totals

    def _micro_batch_loss(self, plan, *, sb, mask, adv, old_lp, ref_lp, rollout_lp, counts, use_tis, sums,
                          first_logp_out) -> torch.Tensor:
        """This micro-batch's share of the global-batch loss; adds its metric shares to `sums`."""
        args = self.args
        agg = lambda x, m: algo.aggregate_loss(x, m, args.loss_agg_mode, **counts)  # noqa: E731
        mb = sb.micro(plan, self.device)
        rows = mb.indices
        r = mb.resp_mask.shape[1]
        m = mask[rows, :r]
        logp, entropy = self.forward_log_probs(self.model, mb, need_entropy=args.entropy_coef != 0)
        if first_logp_out is not None:
            first_logp_out[rows, :r] = logp.detach()
        old = old_lp[rows, :r] if old_lp is not None else logp.detach()
        if args.loss_type == "sft_loss":
            per_tok, pg = algo.sft_loss(logp), None
        elif self.custom_loss is not None:
            # Contract: fn(args, log_probs=, old_log_probs=, advantages=, mask=, samples=) -> per-token loss
            # [b, R]; lichen aggregates it with --loss-agg-mode like every built-in loss.
            per_tok, pg = self.custom_loss(args, log_probs=logp, old_log_probs=old, advantages=adv[rows, :r],
                                           mask=m, samples=[sb.samples[i] for i in rows]), None
        else:
            pg, m = self._policy_terms(logp, old, adv[rows, :r], m)
            per_tok = pg["loss"]
            if use_tis:
                w = self._tis_weights(old, rollout_lp[rows, :r], m)
                raw = torch.exp((old - rollout_lp[rows, :r]).clamp(-20, 20))
                per_tok = per_tok * w
                sums["tis_weight_mean"] += agg(w, m).detach()
                sums["tis_changed_frac"] += agg((w != raw).float(), m).detach()
        loss = self.pg_reducer(per_tok, m, **counts) if self.pg_reducer is not None else agg(per_tok, m)
        sums["pg_loss"] += loss.detach()
        if pg is not None:
            sums["pg_clipfrac"] += agg(pg["clipfrac"].detach(), m)
            sums["ppo_kl"] += agg(pg["ppo_kl"].detach(), m)
        elif "ppo_kl" in sums:  # a custom loss: the KL to the old policy is still measured (first-step check)
            sums["ppo_kl"] += agg((old - logp).detach(), m)
        if entropy is not None:
            ent = agg(entropy, m)
            loss = loss - args.entropy_coef * ent
            sums["entropy"] += ent.detach()
        if "kl_loss" in sums:
            imp = (logp - old) if args.use_unbiased_kl else None
            kl = agg(algo.approx_kl(logp, ref_lp[rows, :r], args.kl_loss_type, importance_log_ratio=imp), m)
            loss = loss + args.kl_loss_coef * kl
            sums["kl_loss"] += kl.detach()
        sums["loss"] += loss.detach()
        return loss
