"""The learner role: takes batches of trajectories from the bus, trains on them (rlsys/training_step.py),
publishes each new policy version, acknowledges and accounts for what it consumed, and checkpoints.

With `cluster.n_learner_ranks` > 1 every rank runs this loop; rank 0 alone talks to the bus and hands the
others each batch, and every rank joins the collective parts (train step, weight gathering, checkpoints).
"""

import logging
import time
import uuid
from pathlib import Path

import torch

from rlsys import evaluations, protocol, run_counters, weight_transport
from rlsys.alarms import LogprobCheck, check_logprob_mismatch
from rlsys.algorithms.estimators import compared_rewards
from rlsys.algorithms.ppo import AdaptiveKLController
from rlsys.api import NOT_GENERATED, Trajectory
from rlsys.api.messages import InvalidMessage, parse_probe_report
from rlsys.checkpoint import (CHECKPOINTS_DIR, SHARDED_STATE, checkpoint_directory, identity, keep_newest,
                              load_rng_state, load_sharded_state, read_trainer_state, remove_leftovers, save_checkpoint)
from rlsys.delivery import Delivery, TrajectoryInbox
from rlsys.distributed import Ranks, full_state_dict
from rlsys.learner_figures import COMPUTE, PROBE_ALARM, PUBLISH, SAVE, WAIT_DATA
from rlsys.metrics import LEARNER_RECORDS, MetricsLogger
from rlsys.model.loading import CRITIC_DIR
from rlsys.prompt_ledger import PromptLedger, as_metrics, filtered
from rlsys.tracing import write_trained
from rlsys.training_step import PolicyTrainer
from rlsys.weight_versions import WEIGHTS_DIR

log = logging.getLogger(__name__)

STOP_POLL_SECONDS = 0.5  # how often a learner done training asks whether the run stopped


def serve_until_stopped(bus, server: weight_transport.WeightServer | None) -> None:
    """Keeps serving the learner's last version until the run stops. An inference worker started after the last step
    (a restart, a lost node) fetches it here: without it, it would serve stale weights to the final evaluation. The
    learner itself need not live on: `server` holds the version."""
    if server is None:
        return
    try:
        while not bus.get(protocol.STOP):
            time.sleep(STOP_POLL_SECONDS)
    finally:
        server.close()


class Learner(PolicyTrainer):
    def __init__(self, config, bus, run_dir: Path, ranks: Ranks | None = None):
        ranks = ranks or Ranks()
        resumed = read_trainer_state(Path(config.resume_from_checkpoint)) if config.resume_from_checkpoint else {}
        super().__init__(config, ranks, resumed.get("initial_model_path", config.model.path))
        self.bus, self.run_dir = bus, Path(run_dir)
        self.step = 0
        self.filtered_groups = 0
        self.consumed_prompts: list[str] = []  # group ids trained or filtered: the dataset position on resume
        # [step, saved_at] of each checkpoint the state descends from (resumed from, saved before): what
        # save_total_limit keeps first (rlsys/checkpoint.py, keep_newest)
        self.lineage: list[list] = []
        # the held-out evaluation before the run's first step; a resumed learner carries its checkpoint's, since the
        # bus's "initial" is then the evaluation at the resumed step (rlsys/run_summary.py, held_out_summary)
        self.resumed, self.initial_eval = bool(resumed), resumed.get("initial_eval")
        if resumed:
            self._resume(Path(config.resume_from_checkpoint), resumed)
        if ranks.main:  # before its first save, so none of this run's is under way
            keep = config.resume_from_checkpoint or None
            for leftover in remove_leftovers(self.run_dir / CHECKPOINTS_DIR, keep=keep):
                log.info("%s deleted: a save or deletion a crash interrupted left it", leftover)
        self.transport = weight_transport.resolve(config.cluster)
        self.weight_server = None
        if ranks.main and self.transport == "stream":
            self.weight_server = weight_transport.WeightServer(weight_transport.serving_host(config.cluster.backend))
        if ranks.main:
            self.ledger = PromptLedger.of(bus, config)
            self.inbox = TrajectoryInbox(bus, self.ledger, f"learner-{uuid.uuid4().hex[:8]}",
                                         int(config.cluster.max_message_mb * 2**20), self.model.config.vocab_size,
                                         consumed=self.consumed_prompts)
            # its counters are the run's, logged every step: a resumed or restarted learner goes on from its
            # checkpoint's (from before they were kept: from 0)
            self.inbox.duplicates = resumed.get("trajectory_duplicates", 0)
            self.inbox.dead_letters = resumed.get("trajectory_dead_letters", 0)
            self.metrics = MetricsLogger(Path(config.logging_dir), LEARNER_RECORDS)

    def _resume(self, checkpoint: Path, trainer: dict) -> None:
        """Onto any number of ranks: the sharded state is resharded as it loads."""
        if not (checkpoint / SHARDED_STATE).exists():
            raise FileNotFoundError(f"{checkpoint} has no {SHARDED_STATE}/ (written by an rlsys from before sharded "
                                    "checkpoints?); start from its weights with model.path instead")
        from torch.distributed.checkpoint.state_dict import set_state_dict

        self.step, self.version = trainer["step"], trainer["version"]
        self.consumed_prompts = trainer["consumed_prompts"]
        self.lineage = [*trainer.get("lineage", []), list(identity(trainer))]
        optimizers = [o for o in (self.optimizer, self.critic_optimizer) if o is not None]
        configured = [[{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
                      for optimizer in optimizers]
        state = self.sharded_state()
        load_sharded_state(checkpoint, state)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        if self.critic is not None:
            set_state_dict(self.critic, self.critic_optimizer, model_state_dict=state["critic"],
                           optim_state_dict=state["critic_optimizer"])
        self.scheduler.load_state_dict(trainer["scheduler"])
        # The optimizers' moments and the schedule's position come from the checkpoint, their settings (ppo.lr,
        # critic_lr, weight_decay, ...) from the config: loaded, the checkpoint's would silently override a changed one.
        for optimizer, groups in zip(optimizers, configured):
            for group, settings in zip(optimizer.param_groups, groups):
                group.update(settings)
        self.scheduler.base_lrs = [group["initial_lr"] for group in self.optimizer.param_groups]
        self.scheduler.last_epoch -= 1
        self.scheduler.step()  # the rate at the schedule's position, from the configured base
        # What a step updates besides the tensors: an adaptive KL coefficient restarting at init_kl_coef would change
        # the loss, and the metrics' counters would restart at 0. Checkpoints from before they were kept lack them.
        # A fixed coefficient is no state but the configured ppo.init_kl_coef, as is an adaptive one's start after a
        # run whose coefficient was fixed (0 without a KL term, which an adaptive controller could never move from).
        if isinstance(self.kl_controller, AdaptiveKLController) and trainer.get("kl_adaptive", True):
            self.kl_controller.value = trainer.get("kl_coef", self.kl_controller.value)
        self.filtered_groups = trainer.get("filtered_groups", 0)
        self.skipped_updates = trainer.get("skipped_updates", 0)
        torch.set_rng_state(load_rng_state(checkpoint))

    def run(self) -> None:
        if self.version > 0:
            self.publish_weights()  # inference starts from the checkpoint's weights but must tag them right
        while self.step < self.config.max_steps:
            started = time.monotonic()
            groups = self.wait_for_batch() if self.ranks.main else []
            trajectories = self.share_batch(groups)
            if trajectories is None:
                break
            waited = time.monotonic() - started
            stats = self.train_step(trajectories)
            computed = time.monotonic() - started - waited
            self.step += 1
            self.version += 1
            self.publish_weights()
            published = time.monotonic() - started - waited - computed
            if self.ranks.main:
                write_trained(self.run_dir, self.step, trajectories, self.last_advantages,
                              self.config.trace.sample_rate)
                stats.update(self.probe_reports())
                check_logprob_mismatch(stats, self.step, self.config.alarms.logprob_diff_warn,
                                       self.config.alarms.stop_on_logprob_diff)
                self.consumed_prompts += [group.group_id for group in groups]
                self.ledger.trained_all([group.group_id for group in groups])
            saving = time.monotonic()
            if self.config.save_steps and self.step % self.config.save_steps == 0:
                self.save()  # after the step's prompts are counted trained: the checkpoint holds them so
            if self.ranks.main:
                self.metrics.log(self.step, {
                    **stats, "groups/filtered": self.filtered_groups, "version": self.version,
                    WAIT_DATA: waited, COMPUTE: computed, PUBLISH: published, SAVE: time.monotonic() - saving,
                    "throughput/tokens_per_second": stats["tokens"] * self.ppo.ppo_epochs / max(computed, 1e-9),
                    **self.delivery_metrics()})
                self.inbox.ack([group.entry_id for group in groups])  # taken into a step: see rlsys/delivery.py
        if self.ranks.main:  # the final checkpoint's books are the run's: the summary counts as it does
            self.ledger.close()
        self.save()
        if self.ranks.main:
            self.bus.set(protocol.LEARNER_DONE, self.version)
            self.metrics.close()

    def share_batch(self, groups: list[Delivery] | None) -> list[Trajectory] | None:
        """Rank 0's batch on every rank (msgpack), None when the run is being stopped."""
        if self.ranks.world == 1:
            return None if groups is None else [t for group in groups for t in group.trajectories]
        payload = None if groups is None else [t.to_dict() for group in groups for t in group.trajectories]
        payload = self.ranks.broadcast(payload if self.ranks.main else None)
        return None if payload is None else [Trajectory.from_dict(d) for d in payload]

    def wait_for_batch(self) -> list[Delivery] | None:
        """Blocks until `batch_size` groups arrived; None if the run is being stopped."""
        groups: list[Delivery] = []
        while len(groups) < self.ppo.batch_size:
            received = self.inbox.receive(self.ppo.batch_size - len(groups), timeout=0.5, unless=protocol.STOP)
            if received is None:
                return None
            for group in received:
                if self.too_stale(group):
                    self.filter_group(group, "too_stale")
                elif self.ppo.filter_uniform_groups and len(set(compared_rewards(group.trajectories,
                                                                                  self.ppo.adv_estimator))) == 1:
                    self.filter_group(group, "uniform_reward")
                else:
                    groups.append(group)
        return groups

    def too_stale(self, group: Delivery) -> bool:
        """The age bound (rlsys/prompt_ledger.py) on the group's generated tokens, against the version being trained."""
        versions = [v for t in group.trajectories for v in t.versions if v != NOT_GENERATED]
        if not self.ledger.too_stale(versions, self.version):
            return False
        # the newest token tells a generation that spanned weight updates from a group that waited once generated;
        # an info line, not a warning: a few such groups are a normal part of an asynchronous run, and the run's
        # summary counts them (filtered: too_stale)
        log.info("group %s refused as too stale: its tokens are of versions %d to %d, the learner trains version %d "
                 "(max_head_offpolicyness=%d)", group.group_id, min(versions), max(versions), self.version,
                 self.config.max_head_offpolicyness)
        return True

    def filter_group(self, group: Delivery, reason: str) -> None:
        """A dropped group will never be trained, so its prompt gives its staleness-gate slot back;
        otherwise the gate, which expects `batch_size` admitted prompts per step, would stall."""
        self.filtered_groups += 1
        self.consumed_prompts.append(group.group_id)
        self.ledger.untrained(group.group_id, filtered(reason))
        self.inbox.ack([group.entry_id])

    def delivery_metrics(self) -> dict[str, int]:
        """Where the run's prompts stand, and what the inbox dropped or set aside."""
        return {**as_metrics(self.ledger.counts()),
                "trajectories/duplicates": self.inbox.duplicates, "trajectories/dead_letters": self.inbox.dead_letters}

    def publish_weights(self) -> None:
        """The new version to the inference workers, in the dtype they hold, with the last step's probe (of the
        version before: rlsys/alarms.py)."""
        state = full_state_dict(self.model, self.ranks)  # every rank takes part in gathering the shards
        probe, self.probe = self.probe, None
        if self.ranks.main:
            extra = {"probe": {"version": probe.version, "token_ids": [probe.token_ids],
                               "logprobs": [probe.logprobs]}} if probe else None
            weight_transport.publish(self.bus, self.model, self.version, self.transport,
                                     self.run_dir / WEIGHTS_DIR, state, self.config.inference.dtype,
                                     self.weight_server, extra=extra)

    def probe_reports(self) -> dict[str, float]:
        """What the inference workers found when they scored the probes that reached them since the last step
        (rlsys/alarms.py), as alarms/probe_* figures."""
        totals = []
        for message in self.bus.get_many(protocol.LOGPROB_PROBES, 1024, 0.0):
            try:
                totals.append(parse_probe_report(message).totals)
            except InvalidMessage as e:
                log.warning("a logprob probe report was set aside: %s", e)
        return LogprobCheck.merged(totals, PROBE_ALARM) if totals else {}

    def sharded_state(self) -> dict:
        """This rank's part of the model and optimizer state (and the critic's), keyed by parameter name."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.model, self.optimizer)
        state = {"model": model, "optimizer": optimizer}
        if self.critic is not None:
            state["critic"], state["critic_optimizer"] = get_state_dict(self.critic, self.critic_optimizer)
        return state

    def export(self, directory: Path) -> None:
        """The HF-format policy (and critic) in `directory`, gathered on rank 0; every rank calls it."""
        for model, subdir in ((self.model, ""), (self.critic, CRITIC_DIR)):
            if model is None:
                continue
            state = full_state_dict(model, self.ranks)
            if self.ranks.main:
                model.save_pretrained(directory / subdir, state_dict=state)
        if self.ranks.main:
            self.tokenizer.save_pretrained(directory)

    def save(self) -> Path:
        trainer_state = {"step": self.step, "version": self.version, "consumed_prompts": self.consumed_prompts,
                         "initial_model_path": self.initial_model_path, "scheduler": self.scheduler.state_dict(),
                         "kl_coef": self.kl_controller.value,
                         "kl_adaptive": isinstance(self.kl_controller, AdaptiveKLController),
                         "filtered_groups": self.filtered_groups,
                         "skipped_updates": self.skipped_updates, "lineage": self.lineage,
                         "trajectory_duplicates": self.inbox.duplicates if self.ranks.main else None,
                         "trajectory_dead_letters": self.inbox.dead_letters if self.ranks.main else None,
                         # rank 0 alone writes the trainer state, so it alone reads the bus for it
                         "dataset": self.bus.get(protocol.DATASET_FINGERPRINT) if self.ranks.main else None,
                         "accounting": self.ledger.snapshot() if self.ranks.main else None,
                         # what the run's counters held, so a resume takes back what the steps after it added
                         **(run_counters.held(self.bus) if self.ranks.main
                            else dict.fromkeys(run_counters.AT_THE_START)),
                         "initial_eval": self.initial_eval if self.resumed or not self.ranks.main
                         else evaluations.result(self.bus, evaluations.INITIAL)}
        saved = save_checkpoint(checkpoint_directory(self.run_dir, self.step), self.ranks, self.sharded_state(),
                                self.export, trainer_state)
        if self.ranks.main:  # which alone wrote the trainer state, and keeps the lineage it holds
            self.lineage = [*self.lineage, list(identity(read_trainer_state(saved)))]
            for deleted in keep_newest(saved.parent, self.config.save_total_limit):
                log.info("checkpoint %s deleted (save_total_limit=%d)", deleted, self.config.save_total_limit)
        return saved
