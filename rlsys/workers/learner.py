"""The learner: turns batches of trajectories into PPO updates and publishes each new policy version."""

import shutil
import time
import uuid
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoTokenizer

from rlsys import accounting, protocol
from rlsys.alarms import LogprobCheck, check_logprob_mismatch
from rlsys.algorithms.advantages import gae_advantages, gigpo_turn_advantages, grpo_advantages, \
    reinforce_advantages, starpo_advantages, whiten
from rlsys.algorithms.importance import truncated_importance_weights
from rlsys.algorithms.batch import SequenceBatch, per_turn_to_tokens, sequence_batch
from rlsys.algorithms.packing import MicroBatch, micro_batches
from rlsys.algorithms.ppo import AdaptiveKLController, FixedKLController, clipped_value_loss, gather_logprobs, kl_k3, \
    next_token_logits, ppo_clip_loss, token_entropy, token_loss_weights
from rlsys.algorithms.schedule import lr_multiplier
from rlsys.api import Trajectory
from rlsys.checkpoint import OPTIMIZER_STATE, read_trainer_state, save_checkpoint
from rlsys.delivery import Delivery, TrajectoryInbox
from rlsys.engine.weights import write_weight_update
from rlsys.metrics import MetricsLogger
from rlsys.tracing import write_trained
from rlsys.weight_checksum import weights_checksum
from rlsys.model.loading import CRITIC_DIR, load_critic, load_policy

KEEP_WEIGHT_VERSIONS = 3  # an inference worker may still be reading a slightly older version


class Learner:
    def __init__(self, config, bus, run_dir: Path):
        self.config, self.bus, self.run_dir = config, bus, Path(run_dir)
        self.ppo = config.ppo
        torch.manual_seed(config.seed)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        packing = self.ppo.sequence_packing
        self.model = load_policy(config.model.path, packing).to(self.device)
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        resumed = read_trainer_state(Path(config.resume_from_checkpoint)) if config.resume_from_checkpoint else {}
        # The KL reference is the policy the run started from, also after a resume from a later checkpoint.
        self.initial_model_path = resumed.get("initial_model_path", config.model.path)
        self.reference = self._frozen(load_policy(self.initial_model_path, packing)) if self.ppo.init_kl_coef > 0 else None
        self.critic = self.critic_optimizer = None
        if self.ppo.adv_estimator == "gae":
            critic_dir = Path(config.resume_from_checkpoint or "/nonexistent") / CRITIC_DIR
            self.critic = load_critic(str(critic_dir if critic_dir.exists() else config.model.path), packing)
            self.critic = self.critic.to(self.device).train()
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=self.ppo.critic_lr)
        self.kl_controller = (AdaptiveKLController(self.ppo.init_kl_coef, self.ppo.target_kl, self.ppo.kl_horizon)
                              if self.ppo.target_kl else FixedKLController(self.ppo.init_kl_coef))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.ppo.lr, weight_decay=self.ppo.weight_decay)
        optimizer_steps = config.max_steps * self.ppo.ppo_epochs * self.ppo.num_mini_batches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_multiplier(
            step, self.ppo.warmup_steps, optimizer_steps, self.ppo.lr_scheduler_type))
        self.step = self.version = 0
        self.filtered_groups = 0
        self.logprob_check = LogprobCheck(version=-1)  # replaced by each train_step
        self.consumed_prompts: list[str] = []  # group ids trained or filtered: the dataset position on resume
        if resumed:
            self._resume(Path(config.resume_from_checkpoint), resumed)
        self.inbox = TrajectoryInbox(bus, f"learner-{uuid.uuid4().hex[:8]}", int(config.cluster.max_message_mb * 2**20),
                                     self.model.config.vocab_size, consumed=self.consumed_prompts)
        self.metrics = MetricsLogger(Path(config.logging_dir), "learner")

    def _frozen(self, model):
        model = model.to(self.device).eval()
        model.requires_grad_(False)
        return model

    def _resume(self, checkpoint: Path, trainer: dict) -> None:
        self.step, self.version = trainer["step"], trainer["version"]
        self.consumed_prompts = trainer["consumed_prompts"]
        state = torch.load(checkpoint / OPTIMIZER_STATE, map_location=self.device, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.critic is not None and "critic_optimizer" in state:
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        torch.set_rng_state(state["rng"])

    def run(self) -> None:
        if self.version > 0:
            self.publish_weights()  # inference starts from the checkpoint's weights but must tag them right
        while self.step < self.config.max_steps and not self.bus.get(protocol.STOP):
            started = time.monotonic()
            groups = self.wait_for_batch()
            if groups is None:
                break
            waited = time.monotonic() - started
            trajectories = [t for group in groups for t in group.trajectories]
            stats = self.train_step(trajectories)
            write_trained(self.run_dir, self.step + 1, trajectories, self.last_advantages, self.config.trace.sample_rate)
            check_logprob_mismatch(stats, self.step + 1, self.config.alarms.logprob_diff_warn,
                                   self.config.alarms.stop_on_logprob_diff)
            self.consumed_prompts += [group.group_id for group in groups]
            computed = time.monotonic() - started - waited
            self.step += 1
            self.version += 1
            self.publish_weights()
            published = time.monotonic() - started - waited - computed
            for group in groups:
                accounting.settle(self.bus, group.group_id, accounting.TRAINED)
            self.metrics.log(self.step, {
                **stats, "groups/filtered": self.filtered_groups, "version": self.version,
                "time/wait_data": waited, "time/compute": computed, "time/publish": published,
                "throughput/tokens_per_second": stats["tokens"] * self.ppo.ppo_epochs / max(computed, 1e-9),
                **self.delivery_metrics()})
            if self.config.save_steps and self.step % self.config.save_steps == 0:
                self.save()
            self.inbox.ack([group.entry_id for group in groups])  # taken into a step: see rlsys/delivery.py
        self.save()
        self.bus.set(protocol.LEARNER_DONE, self.version)
        self.metrics.close()

    def wait_for_batch(self) -> list[Delivery] | None:
        """Blocks until `batch_size` groups arrived; None if the run is being stopped."""
        groups: list[Delivery] = []
        while len(groups) < self.ppo.batch_size:
            if self.bus.get(protocol.STOP):
                return None
            for group in self.inbox.receive(self.ppo.batch_size - len(groups), timeout=0.5):
                if self.ppo.filter_uniform_groups and len({t.reward for t in group.trajectories}) == 1:
                    self.filter_group(group)
                else:
                    groups.append(group)
        return groups

    def filter_group(self, group: Delivery) -> None:
        """A dropped group will never be trained, so its prompt gives its staleness-gate slot back;
        otherwise the gate, which expects `batch_size` admitted prompts per step, would stall."""
        self.filtered_groups += 1
        self.consumed_prompts.append(group.group_id)
        accounting.settle_untrained(self.bus, group.group_id, accounting.filtered("uniform_reward"))
        self.inbox.ack([group.entry_id])

    def delivery_metrics(self) -> dict[str, int]:
        """Where the run's prompts stand, and what the inbox dropped or set aside."""
        return {**accounting.as_metrics(accounting.counts(self.bus)),
                "trajectories/duplicates": self.inbox.duplicates, "trajectories/dead_letters": self.inbox.dead_letters}

    def train_step(self, trajectories: list[Trajectory]) -> dict[str, float]:
        batch = self.prepare_batch(trajectories)
        stats: dict[str, float] = {}
        # Inference's logprobs against ours on the same tokens, from the first mini-batch's forward passes
        # (before any update): no extra forward pass.
        self.logprob_check = LogprobCheck(self.version)
        for _ in range(self.ppo.ppo_epochs):
            order = torch.randperm(len(batch))
            for rows in order.chunk(self.ppo.num_mini_batches):
                stats = self._update(batch.select(rows.tolist()))
                self.logprob_check.seal()
        stats.update(self.logprob_check.stats())
        self.last_advantages = batch.fields["advantages"]  # for the traces of what this step trained
        if self.reference is not None and "kl" in stats:
            stats["kl_coef"] = self.kl_controller.value
            self.kl_controller.update(stats["kl"], n_steps=len(trajectories))
        stats.update(_batch_stats(trajectories, batch, self.version))
        stats.update(_mean_metrics(trajectories))
        return stats

    def prepare_batch(self, trajectories: list[Trajectory]) -> SequenceBatch:
        """Per-sequence tensors plus what stays fixed during the step: reference, proximal, values, advantages."""
        batch = sequence_batch(trajectories)
        if self.reference is not None:
            batch.fields["ref_logprobs"] = self.per_token(self._policy_logprobs(self.reference), batch)
        if self.ppo.decoupled_loss or self.ppo.tis_cap:
            # Decoupled objective: PPO's trust region is around the policy as it is now (proximal), and the
            # behaviour policy that sampled the tokens, possibly versions older, enters as an importance weight.
            # Truncated IS (tis_cap) also takes the ratio against the learner's own logprobs, as verl does.
            batch.fields["proximal_logprobs"] = self.per_token(self._policy_logprobs(self.model), batch)
        if self.ppo.tis_cap:
            batch.fields["tis_weights"] = [truncated_importance_weights(p, b, m, self.ppo.tis_cap) for p, b, m in zip(
                batch.fields["proximal_logprobs"], batch.fields["behaviour_logprobs"], batch.fields["loss_mask"])]
        if self.critic is not None:
            batch.fields["old_values"] = self.per_token(self._values, batch)
        batch.fields.update(self.advantages(trajectories, batch))
        if self.ppo.mask_void_trajectories:
            # SimpleTIR: out of the loss (and KL, entropy), after their rewards served in their groups' baselines.
            for i, t in enumerate(trajectories):
                if t.void:
                    batch.fields["loss_mask"][i] = torch.zeros_like(batch.fields["loss_mask"][i])
        return batch

    def advantages(self, trajectories: list[Trajectory], batch: SequenceBatch) -> dict[str, list[torch.Tensor]]:
        """Per-token advantages (and the critic's regression targets, for gae)."""
        masks = batch.fields["loss_mask"]
        if self.ppo.adv_estimator == "gae":
            advantages, returns = _per_sequence_gae(batch, self.ppo.gamma, self.ppo.lambd)
            if self.ppo.whiten_advantages:
                advantages = whiten(advantages, masks)
            return {"advantages": advantages, "returns": returns}
        group_ids = [t.group_id for t in trajectories]
        if self.ppo.adv_estimator == "gigpo":
            per_turn = gigpo_turn_advantages([t.turn_rewards for t in trajectories],
                                             [t.turn_obs_keys for t in trajectories], group_ids,
                                             self.ppo.gigpo_step_gamma, self.ppo.gigpo_step_weight,
                                             self.ppo.grpo_scale_by_std)
            return {"advantages": [per_turn_to_tokens(t.turn_ends, a, m)
                                   for t, a, m in zip(trajectories, per_turn, masks)]}
        rewards = [t.reward for t in trajectories]
        if self.ppo.adv_estimator == "reinforce":
            scalars = reinforce_advantages(rewards, whiten=self.ppo.whiten_advantages)
        elif self.ppo.adv_estimator == "starpo":
            scalars = starpo_advantages([t.turn_rewards for t in trajectories], group_ids, self.ppo.grpo_scale_by_std)
        else:
            scalars = grpo_advantages(rewards, group_ids, scale_by_std=self.ppo.grpo_scale_by_std)
        return {"advantages": [a * m for a, m in zip(scalars.tolist(), masks)]}

    def micro_batches(self, batch: SequenceBatch) -> list[MicroBatch]:
        return [mb.to(self.device) for mb in micro_batches(
            batch.token_ids, batch.fields, self.ppo.max_tokens_per_micro_batch, self.ppo.sequence_packing,
            self.tokenizer.pad_token_id)]

    def per_token(self, forward, batch: SequenceBatch) -> list[torch.Tensor]:
        """forward(micro-batch) -> [R, L-1] values, without gradients, back as one [n-1] tensor per sequence."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(batch)
        with torch.no_grad():
            for mb in self.micro_batches(batch):
                for i, values in zip(mb.indices, mb.split(forward(mb))):
                    out[i] = values.cpu()
        return out

    def _policy_logprobs(self, model):
        return lambda mb: gather_logprobs(self._logits(model, mb), mb.input_ids)

    def _logits(self, model, mb: MicroBatch) -> torch.Tensor:
        return next_token_logits(model, mb.input_ids, mb.attention_mask, self.temperature, mb.position_ids)

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        """V of the state before each predicted token: the value head's output at the position predicting it."""
        out = self.critic(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                          use_cache=False)
        return out.logits[:, :-1, 0].float()

    @property
    def temperature(self) -> float:
        return self.config.gen.temperature or 1.0  # greedy (0) rollouts are scored at temperature 1

    def _update(self, mini_batch: SequenceBatch) -> dict[str, float]:
        """One optimizer step on a mini-batch (and one critic step, for gae)."""
        if not any(m.any() for m in mini_batch.fields["loss_mask"]):
            # Every trajectory in it is void: no loss, and a step on zero gradients would still move by Adam's momentum.
            return {"grad_norm": 0.0}
        stats = self.mini_batch_gradients(mini_batch)
        stats["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.ppo.max_grad_norm).item()
        self.optimizer.step()
        stats["lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        if self.critic is not None:
            stats["critic/grad_norm"] = torch.nn.utils.clip_grad_norm_(
                self.critic.parameters(), self.ppo.max_grad_norm).item()
            self.critic_optimizer.step()
        return stats

    def mini_batch_gradients(self, mini_batch: SequenceBatch) -> dict[str, float]:
        """Gradients of a mini-batch's loss, accumulated over its micro-batches.

        Each token's loss weight is fixed over the whole mini-batch first (token_loss_weights), so the
        accumulated gradient equals the mini-batch's, however it is split or packed.
        """
        masks = mini_batch.fields["loss_mask"]
        mini_batch.fields["weights"] = token_loss_weights(masks, self.ppo.loss_agg_mode)
        mini_batch.fields["token_share"] = token_loss_weights(masks, "token-mean")  # for KL, entropy, value loss
        self.optimizer.zero_grad()
        if self.critic is not None:
            self.critic_optimizer.zero_grad()
        totals = StatsAccumulator()
        for mb in self.micro_batches(mini_batch):
            totals.add(self._accumulate_gradients(mb), share=mb.fields["token_share"].sum().item())
        return totals.result()

    def _accumulate_gradients(self, mb: MicroBatch) -> dict[str, float]:
        f = mb.fields
        logits = self._logits(self.model, mb)
        logp = gather_logprobs(logits, mb.input_ids)
        self.logprob_check.observe(logp, f)
        decoupled = dict(behaviour_logprobs=f["behaviour_logprobs"],
                         imp_weight_cap=self.ppo.behaviour_imp_weight_cap or None) if self.ppo.decoupled_loss else {}
        old_logp = f["proximal_logprobs"] if "proximal_logprobs" in f else f["behaviour_logprobs"]
        weights = f["weights"] * f["tis_weights"] if "tis_weights" in f else f["weights"]
        loss, stats = ppo_clip_loss(logp, old_logp, f["advantages"], f["loss_mask"], self.ppo.pg_clip,
                                    dual_clip=self.ppo.dual_clip or None, weights=weights, **decoupled)
        stats["policy_loss"] = loss.item()
        entropy = (token_entropy(logits) * f["token_share"]).sum()
        stats["entropy"] = entropy.item()
        if self.ppo.entropy_loss_coef:
            loss = loss - self.ppo.entropy_loss_coef * entropy
        if self.reference is not None:
            kl = (kl_k3(logp, f["ref_logprobs"]) * f["token_share"]).sum()
            loss = loss + self.kl_controller.value * kl
            stats["kl"] = kl.item()
        stats["loss"] = loss.item()
        loss.backward()
        if self.critic is not None:
            values = self._values(mb)
            value_loss = (clipped_value_loss(values, f["old_values"], f["returns"], self.ppo.value_clip)
                          * f["token_share"]).sum()
            (self.ppo.value_loss_coef * value_loss).backward()
            stats["critic/value_loss"] = value_loss.item()
        return stats

    def publish_weights(self) -> None:
        weights_dir = self.run_dir / "weights"
        path = write_weight_update(self.model, weights_dir / f"v{self.version}")
        # The checksum of the copy inference holds, in its dtype: each worker compares it with what it loaded.
        dtype = self.config.inference.dtype
        self.bus.set(protocol.WEIGHTS, {"version": self.version, "path": str(path), "dtype": dtype,
                                        "checksum": weights_checksum(self.model.state_dict(), dtype)})
        shutil.rmtree(weights_dir / f"v{self.version - KEEP_WEIGHT_VERSIONS}", ignore_errors=True)

    def save(self) -> Path:
        optimizer_state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                           "rng": torch.get_rng_state()}
        if self.critic is not None:
            optimizer_state["critic_optimizer"] = self.critic_optimizer.state_dict()
        trainer_state = {"step": self.step, "version": self.version, "consumed_prompts": self.consumed_prompts,
                         "initial_model_path": self.initial_model_path,
                         "accounting": accounting.settled_snapshot(self.bus)}
        return save_checkpoint(self.run_dir / "checkpoints" / f"step_{self.step}", self.model, self.tokenizer,
                               optimizer_state, trainer_state, extra_models={CRITIC_DIR: self.critic})


def _mean_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Averages of the agents' own per-trajectory metrics, prefixed so they never shadow learner stats."""
    sums: dict[str, float] = {}
    for t in trajectories:
        for key, value in t.metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    return {f"agent/{key}": total / len(trajectories) for key, total in sums.items()}


def _per_sequence_gae(batch: SequenceBatch, gamma: float, lambd: float) -> tuple[list, list]:
    """GAE over each sequence's generated tokens, rewards at turn ends, V from the pre-update critic."""
    lengths = [len(m) for m in batch.fields["loss_mask"]]
    padded = [pad_sequence(batch.fields[name], batch_first=True) for name in ("token_rewards", "old_values", "loss_mask")]
    advantages, returns = gae_advantages(*padded, gamma=gamma, lambd=lambd)
    return ([row[:n] for row, n in zip(advantages, lengths)], [row[:n] for row, n in zip(returns, lengths)])


def _batch_stats(trajectories: list[Trajectory], batch: SequenceBatch, version: int) -> dict[str, float]:
    """Reward, advantage, value and staleness statistics of the batch as consumed."""
    masks = torch.cat(batch.fields["loss_mask"]) > 0
    advantages = torch.cat(batch.fields["advantages"])[masks]
    if advantages.numel() == 0:  # every trajectory kept out of the loss (void)
        advantages = torch.zeros(1)
    versions = torch.cat(batch.fields["versions"])
    generated = versions >= 0  # every token the model produced, trained on or not
    versions = versions[generated].float()
    rewards = torch.tensor([t.reward for t in trajectories])
    stats = {
        "reward": rewards.mean().item(),
        "reward_std": rewards.std(unbiased=False).item(),
        "advantage_mean": advantages.mean().item(),
        "advantage_std": advantages.std(unbiased=False).item(),
        "advantage_abs_mean": advantages.abs().mean().item(),
        "advantage_max": advantages.max().item(),
        "advantage_min": advantages.min().item(),
        "response_length": generated.sum().item() / len(trajectories),
        "void_fraction": sum(t.void for t in trajectories) / len(trajectories),
        "tokens": batch.num_tokens,
        # Versions behind the learner when consumed; AReaL's eta bounds the max.
        "staleness_max": float(version - versions.min().item()),
        "staleness_mean": float(version - versions.mean().item()),
        "newest_version": versions.max().item(),
    }
    if "returns" in batch.fields:
        values, returns = torch.cat(batch.fields["old_values"])[masks], torch.cat(batch.fields["returns"])[masks]
        stats["critic/values_mean"] = values.mean().item()
        # 1 - Var(R - V) / Var(R): 1 is a perfect critic, 0 one no better than a constant.
        stats["critic/explained_variance"] = (1 - (returns - values).var() / returns.var().clamp(min=1e-8)).item()
    return stats


class StatsAccumulator:
    """Combines micro-batch statistics into the mini-batch's.

    Losses, entropy and KL are already weighted sums over the whole mini-batch's tokens, so they add up;
    per-micro-batch means (clip fraction, ratios) are weighted by the micro-batch's share of the tokens;
    maxima stay maxima.
    """

    SUMMED = {"loss", "policy_loss", "entropy", "kl", "critic/value_loss"}

    def __init__(self):
        self.totals: dict[str, float] = {}

    def add(self, stats: dict[str, float], share: float) -> None:
        for key, value in stats.items():
            if key.endswith("_max"):
                self.totals[key] = max(self.totals.get(key, value), value)
            else:
                self.totals[key] = self.totals.get(key, 0.0) + (value if key in self.SUMMED else value * share)

    def result(self) -> dict[str, float]:
        return dict(self.totals)
