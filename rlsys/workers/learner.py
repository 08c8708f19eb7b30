"""The learner: turns batches of trajectories into PPO updates and publishes each new policy version."""

import copy
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlsys import protocol
from rlsys.algorithms.advantages import grpo_advantages, reinforce_advantages
from rlsys.algorithms.batch import TrainingBatch, build_batch
from rlsys.algorithms.schedule import lr_multiplier
from rlsys.algorithms.ppo import AdaptiveKLController, FixedKLController, gather_logprobs, kl_penalty, masked_mean, \
    next_token_logits, ppo_clip_loss, token_entropy
from rlsys.api import Trajectory
from rlsys.checkpoint import OPTIMIZER_STATE, read_trainer_state, save_checkpoint
from rlsys.engine.weights import write_weight_update
from rlsys.metrics import MetricsLogger

KEEP_WEIGHT_VERSIONS = 3  # an inference worker may still be reading a slightly older version


class Learner:
    def __init__(self, config, bus, run_dir: Path):
        self.config, self.bus, self.run_dir = config, bus, Path(run_dir)
        self.ppo = config.ppo
        torch.manual_seed(config.seed)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32).to(self.device)
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        self.reference = self._frozen_copy() if self.ppo.init_kl_coef > 0 else None
        self.kl_controller = (AdaptiveKLController(self.ppo.init_kl_coef, self.ppo.target_kl, self.ppo.kl_horizon)
                              if self.ppo.target_kl else FixedKLController(self.ppo.init_kl_coef))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.ppo.lr, weight_decay=self.ppo.weight_decay)
        optimizer_steps = config.max_steps * self.ppo.ppo_epochs * self.ppo.num_mini_batches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_multiplier(
            step, self.ppo.warmup_steps, optimizer_steps, self.ppo.lr_scheduler_type))
        self.step = self.version = 0
        self.filtered_groups = 0
        self.consumed_prompts: list[str] = []  # group ids trained or filtered: the dataset position on resume
        if config.resume_from_checkpoint:
            self._resume(Path(config.resume_from_checkpoint))
        self.metrics = MetricsLogger(Path(config.logging_dir), "learner")

    def _frozen_copy(self):
        reference = copy.deepcopy(self.model).eval()
        reference.requires_grad_(False)
        return reference

    def _resume(self, checkpoint: Path) -> None:
        trainer = read_trainer_state(checkpoint)
        self.step, self.version = trainer["step"], trainer["version"]
        self.consumed_prompts = trainer["consumed_prompts"]
        state = torch.load(checkpoint / OPTIMIZER_STATE, map_location=self.device, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
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
            stats = self.train_step([t for group in groups for t in group])
            self.consumed_prompts += [group[0].group_id for group in groups]
            computed = time.monotonic() - started - waited
            self.step += 1
            self.version += 1
            self.publish_weights()
            published = time.monotonic() - started - waited - computed
            self.metrics.log(self.step, {**stats, "groups/filtered": self.filtered_groups, "time/wait_data": waited, "time/compute": computed,
                                         "time/publish": published, "version": self.version})
            if self.config.save_steps and self.step % self.config.save_steps == 0:
                self.save()
        self.save()
        self.bus.set(protocol.LEARNER_DONE, self.version)
        self.metrics.close()

    def wait_for_batch(self) -> list[list[Trajectory]] | None:
        """Blocks until `batch_size` groups arrived; None if the run is being stopped."""
        groups: list[list[Trajectory]] = []
        while len(groups) < self.ppo.batch_size:
            if self.bus.get(protocol.STOP):
                return None
            for message in self.bus.get_many(protocol.TRAJECTORIES, self.ppo.batch_size - len(groups), timeout=0.5):
                group = [Trajectory.from_dict(t) for t in message["trajectories"]]
                if self.ppo.filter_uniform_groups and len({t.reward for t in group}) == 1:
                    self.filter_group(message["group_id"])
                else:
                    groups.append(group)
        return groups

    def filter_group(self, group_id: str) -> None:
        """A dropped group will never be trained, so its prompt gives its staleness-gate slot back;
        otherwise the gate, which expects `batch_size` admitted prompts per step, would stall."""
        self.filtered_groups += 1
        self.consumed_prompts.append(group_id)
        self.bus.incr(protocol.ADMITTED, -1)

    def advantages(self, trajectories: list[Trajectory]) -> torch.Tensor:
        rewards = [t.reward for t in trajectories]
        if self.ppo.adv_estimator == "reinforce":
            return reinforce_advantages(rewards, whiten=self.ppo.whiten_advantages)
        return grpo_advantages(rewards, [t.group_id for t in trajectories], scale_by_std=self.ppo.grpo_scale_by_std)

    def train_step(self, trajectories: list[Trajectory]) -> dict[str, float]:
        rewards = [t.reward for t in trajectories]
        batch = build_batch(trajectories, self.advantages(trajectories), self.tokenizer.pad_token_id).to(self.device)
        ref_logp = self._logprobs(self.reference, batch) if self.reference is not None else None
        # Decoupled objective: PPO's trust region is around the policy as it is now (proximal), and the
        # behaviour policy that sampled the tokens, possibly versions older, enters as an importance weight.
        proximal = self._logprobs(self.model, batch) if self.ppo.decoupled_loss else None
        stats: dict[str, float] = {}
        for _ in range(self.ppo.ppo_epochs):
            order = torch.randperm(len(trajectories))
            for rows in order.chunk(self.ppo.num_mini_batches):
                stats = self._update(batch.select(rows), _rows(ref_logp, rows), _rows(proximal, rows))
        if ref_logp is not None:
            stats["kl_coef"] = self.kl_controller.value
            self.kl_controller.update(stats["kl"], n_steps=len(trajectories))
        generated = batch.loss_mask.sum().item()
        newest = batch.versions.max().item()
        stats.update({
            "reward": sum(rewards) / len(rewards),
            "advantage_abs_mean": masked_mean(batch.advantages.abs(), batch.loss_mask).item(),
            "response_length": generated / len(trajectories),
            "tokens": batch.num_tokens,
            "staleness_max": float(self.version - batch.versions[batch.loss_mask > 0].min().item()),
            "staleness_mean": float(self.version - masked_mean(batch.versions.float(), batch.loss_mask).item()),
            "newest_version": float(newest),
        })
        stats.update(_mean_metrics(trajectories))
        return stats

    def _logprobs(self, model, batch: TrainingBatch) -> torch.Tensor:
        with torch.no_grad():
            logits = next_token_logits(model, batch.input_ids, batch.attention_mask, self.temperature)
            return gather_logprobs(logits, batch.input_ids)

    @property
    def temperature(self) -> float:
        return self.config.gen.temperature or 1.0  # greedy (0) rollouts are scored at temperature 1

    def _update(self, batch: TrainingBatch, ref_logp: torch.Tensor | None,
                proximal: torch.Tensor | None) -> dict[str, float]:
        logits = next_token_logits(self.model, batch.input_ids, batch.attention_mask, self.temperature)
        logp = gather_logprobs(logits, batch.input_ids)
        decoupled = dict(behaviour_logprobs=batch.behaviour_logprobs,
                         imp_weight_cap=self.ppo.behaviour_imp_weight_cap or None) if proximal is not None else {}
        loss, stats = ppo_clip_loss(
            logp, proximal if proximal is not None else batch.behaviour_logprobs, batch.advantages, batch.loss_mask,
            self.ppo.pg_clip, dual_clip=self.ppo.dual_clip or None, agg=self.ppo.loss_agg_mode, **decoupled)
        entropy = masked_mean(token_entropy(logits), batch.loss_mask)
        if self.ppo.entropy_loss_coef:
            loss = loss - self.ppo.entropy_loss_coef * entropy
        if ref_logp is not None:
            kl = kl_penalty(logp, ref_logp, batch.loss_mask)
            loss = loss + self.kl_controller.value * kl
            stats["kl"] = kl.item()
        self.optimizer.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.ppo.max_grad_norm)
        self.optimizer.step()
        stats["lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return {**stats, "loss": loss.item(), "entropy": entropy.item(), "grad_norm": grad_norm.item()}

    def publish_weights(self) -> None:
        weights_dir = self.run_dir / "weights"
        path = write_weight_update(self.model, weights_dir / f"v{self.version}")
        self.bus.set(protocol.WEIGHTS, {"version": self.version, "path": str(path)})
        shutil.rmtree(weights_dir / f"v{self.version - KEEP_WEIGHT_VERSIONS}", ignore_errors=True)

    def save(self) -> Path:
        optimizer_state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                           "rng": torch.get_rng_state()}
        trainer_state = {"step": self.step, "version": self.version, "consumed_prompts": self.consumed_prompts}
        return save_checkpoint(self.run_dir / "checkpoints" / f"step_{self.step}", self.model, self.tokenizer,
                               optimizer_state, trainer_state)


def _mean_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Averages of the agents' own per-trajectory metrics, prefixed so they never shadow learner stats."""
    sums: dict[str, float] = {}
    for t in trajectories:
        for key, value in t.metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    return {f"agent/{key}": total / len(trajectories) for key, total in sums.items()}


def _rows(tensor: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if tensor is None else tensor[rows]
