"""The learner's training step on one page: trajectories in, one PPO-family update of the policy out.

    train_step(trajectories):
        mini_batches = shuffled split, for each of ppo_epochs
        batch = prepare_batch(...)             # per-token tensors; reference and critic passes; advantages; proximal
        for mini_batch in mini_batches:        # one optimizer step each
                weights = token_loss_weights(mini_batch)          # fixed over the whole mini-batch
                for micro_batch in this rank's share, packed:     # gradients accumulate
                    loss = ppo_clip_loss - entropy_coef * entropy + kl_coef * kl  (+ value loss)
                    loss.backward()
                clip gradients; optimizer and scheduler step unless loss or gradients are not finite

Nothing here touches the bus: the role loop (rlsys/workers/learner.py) hands it trajectories. With several
ranks (rlsys/distributed.py) every rank holds the whole batch and computes the same advantages and loss
weights, and runs forward and backward passes only on its token-balanced share of each mini-batch; FSDP sums
the gradients, so one step at N ranks is the single-rank step.
"""

import contextlib
import time

import numpy as np
import torch

from rlsys.alarms import PROBE_TOKENS, LogprobCheck, Probe, largest
from rlsys.algorithms.batch import SequenceBatch, sequence_batch
from rlsys.algorithms.choices import NEEDS_CRITIC
from rlsys.algorithms.estimators import ADVANTAGE_ESTIMATORS
from rlsys.algorithms.finite import clip_and_step
from rlsys.algorithms.importance import truncated_importance_weights
from rlsys.algorithms.packing import MicroBatch, balance_by_tokens, empty_micro_batch, micro_batches, \
    prefix_groups, shared_tokens
from rlsys.algorithms.ppo import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, clipped_value_loss, \
    gather_logprobs, next_token_logits, ppo_clip_loss, taken_logprobs, token_entropy, token_loss_weights
from rlsys.algorithms.schedule import lr_multiplier
from rlsys.api import Trajectory
from rlsys.distributed import Ranks, reshard, shard, sync_gradients
from rlsys.learner_figures import BATCH_REWARD, STALENESS_MAX, STALENESS_MEAN, agent_figure
from rlsys.model.loading import check_full_attention, load_critic, load_policy
from rlsys.model.tokenizer import load_tokenizer
from rlsys.model.varlen_attention import known_segment_starts


# What a training pass reads of the batch's fields (besides the loss weights each mini-batch gets, and `versions`
# for the logprob check): a micro-batch gathers these and no others.
PASS_FIELDS = ("loss_mask", "behaviour_logprobs", "advantages", "proximal_logprobs", "ref_logprobs", "old_values",
               "returns")


class PolicyTrainer:
    """The policy (and for gae the critic), their optimizers, and the step that updates them."""

    def __init__(self, config, ranks: Ranks, initial_model_path: str, critic_path: str = ""):
        self.config, self.ranks, self.ppo, self.settings = config, ranks, config.ppo, config.learner
        self.device = ranks.device
        self.settings.check_device(self.device, ranks.world)
        self.micro_batch_tokens = self.ppo.max_tokens_per_micro_batch or (2048 if self.device == "cpu" else 16384)
        torch.manual_seed(config.seed)
        attention = self.settings.attn_implementation
        packed = packs(self.ppo.sequence_packing, self.device, self.settings.dtype, attention)
        # Where each layout takes one attention call a row (a GPU in half precision) train steps measure which is
        # faster (measured_layout, layout_outdated); rows are packed until the first does.
        self.measures_layout = packed is None and self.ppo.share_prefixes != "true"
        self.layout_timed_on = 0.0  # the mean sequence length of the batch the layout was last timed on; 0: none yet
        self.packed = packed is not False
        self.share_prefixes = shares_prefixes(self.ppo.share_prefixes, self.packed, self.device, attention)
        self.model = self._placed(load_policy(config.model.path, attention)).train()
        if attention == "auto":  # HF's own attention masks a window: rlsys's does not
            longest = config.inference.max_model_len or getattr(self.model.config, "max_position_embeddings", 0)
            check_full_attention(self.model.config, longest, "learner.attn_implementation=auto (rlsys's attention)",
                                 "set learner.attn_implementation=sdpa")
        # The KL reference is the policy the run started from, also after a resume from a later checkpoint.
        self.initial_model_path = initial_model_path
        self.reference = None
        if self.ppo.init_kl_coef > 0:
            self.reference = self._placed(load_policy(initial_model_path, attention).requires_grad_(False))
            self.reference.eval()
        self.critic = self.critic_optimizer = None
        if self.ppo.adv_estimator in NEEDS_CRITIC:
            self.critic = self._placed(load_critic(critic_path or config.model.path, attention)).train()
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=self.ppo.critic_lr,
                                                      fused=self.ranks.world == 1)
        self.kl_controller = (AdaptiveKLController(self.ppo.init_kl_coef, self.ppo.target_kl, self.ppo.kl_horizon)
                              if self.ppo.target_kl else FixedKLController(self.ppo.init_kl_coef))
        # Fused: one kernel for every parameter instead of a few per tensor, on GPUs and CPUs alike (BENCHMARKS.md,
        # "The update itself", bench/update_vs_trl.py). Not over sharded ranks, whose parameters are DTensors.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.ppo.lr, weight_decay=self.ppo.weight_decay,
                                           fused=self.ranks.world == 1)
        optimizer_steps = config.max_steps * self.ppo.ppo_epochs * self.ppo.num_mini_batches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_multiplier(
            step, self.ppo.warmup_steps, optimizer_steps, self.ppo.lr_scheduler_type))
        self.version = 0  # of the policy being trained: staleness is measured against it
        self.skipped_updates = 0  # optimizer steps skipped: their loss or gradients were not finite
        self.updates: list[tuple] = []  # this train step's, whether each was taken (policy, critic), until settled
        self.logprob_check = LogprobCheck(version=-1)  # replaced by each train_step
        self.first_step_fills_proximal = False  # set by prepare_batch: see proximal_logprobs
        self.probe: Probe | None = None  # the last step's (probe_of), until the learner publishes it
        self.last_advantages: list[float] = []  # the last step's, per sequence: mean of its non-zero advantages
        self.tokenizer = load_tokenizer(config.model.path)
        self.pad_id = self.tokenizer.pad_token_id

    def _placed(self, model):
        """On this rank's device, sharded over the ranks if there are several, memory settings applied."""
        if self.settings.gradient_checkpointing and any(p.requires_grad for p in model.parameters()):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = model.to(self.device)
        if self.ranks.world > 1:
            model = shard(model, self.ranks, mixed_precision=self.settings.dtype == "bfloat16")
        return model

    def train_step(self, trajectories: list[Trajectory]) -> dict[str, float]:
        # Rank 0 draws each epoch's order, so every rank takes the same mini-batches.
        orders = [self.ranks.broadcast(torch.randperm(len(trajectories)).tolist() if self.ranks.main else None)
                  for _ in range(self.ppo.ppo_epochs)]
        # As many as asked (one a sequence if there are fewer), their sizes at most one apart: chunk() cuts 6 into 2, 2
        # and 2 when asked for 4, one update short of what the learning-rate schedule counts, and 10 into 3, 3, 3, 1.
        mini_batches = [rows.tolist() for order in orders
                        for rows in torch.tensor(order).tensor_split(self.ppo.num_mini_batches) if len(rows)]
        layout = self.measured_layout(trajectories) if self.layout_outdated(trajectories) else {}
        batch = self.prepare_batch(trajectories, mini_batches)
        stats: dict[str, float] = {}
        # Inference's logprobs against ours on the same tokens, from the first mini-batch's forward passes
        # (before any update): no extra forward pass. Those passes also score the probe (rlsys/alarms.py).
        self.logprob_check = LogprobCheck.of_step(self.version, [t.versions for t in trajectories])
        first_pass = torch.zeros(batch.num_tokens + 1, device=batch.device)
        kl_sum, kl_tokens = 0.0, 0.0  # every update's KL weighted by its trained tokens: the adaptive controller's
        for n, rows in enumerate(mini_batches):
            # In the batch's order, which changes nothing but how the mini-batch's passes are cut: one that holds
            # every sequence is then the batch itself, not a gather of it. The step reports the last update's
            # statistics, so only its passes compute them.
            fills = batch.fields["proximal_logprobs"] if n == 0 and self.first_step_fills_proximal else None
            mini_batch = batch.select(sorted(rows), self.pass_fields())
            stats = self.optimizer_step(mini_batch, n == len(mini_batches) - 1, fills, first_pass if n == 0 else None)
            self.logprob_check.seal()
            if "kl" in stats:  # a mean over the mini-batch's trained tokens (a KL term has every sequence computed)
                tokens = float(mini_batch.token_counts[:, 0].sum())
                kl_sum, kl_tokens = kl_sum + stats["kl"] * tokens, kl_tokens + tokens
        if kl_tokens:  # read back with the step's figures
            stats["kl_step_mean"] = kl_sum / kl_tokens
        stats = self.settle(stats)
        stats.update(LogprobCheck.merged(self.ranks.all_gather(self.logprob_check.totals())))
        advantages = batch.fields["advantages"]
        self.last_advantages = batch.sequence_means(advantages, advantages != 0)  # for the traces of this step
        if "kl_step_mean" in stats:
            stats["kl_coef"] = self.kl_controller.value
            # The step's KL, not its last update's: that one is of the policy furthest from where the step began.
            self.kl_controller.update(stats["kl_step_mean"], n_steps=len(trajectories))
        stats.update(batch_stats(trajectories, batch, self.version))
        stats.update(mean_agent_metrics(trajectories))
        self.probe = self.probe_of(trajectories, batch, mini_batches[0], first_pass)
        return stats | layout

    def layout_outdated(self, trajectories: list[Trajectory]) -> bool:
        """Whether this step times the layouts (measured_layout): where they are measured, on the first step, and on
        any whose mean sequence length is twice or half the one they were last timed on, since what padding costs
        and packing saves moves with the lengths (an agent's episodes grow as it learns). Every rank holds the same
        trajectories, so they agree."""
        if not self.measures_layout:
            return False
        ratio = mean_length(trajectories) / (self.layout_timed_on or np.inf)
        return not 0.5 < ratio < 2

    def measured_layout(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """ppo.sequence_packing=auto where no rule knows the faster layout: on a GPU in half precision a packed row is
        one flash-attention varlen call a layer and padded rows one sdpa call, so packing saves the padding's compute
        and costs a custom operator's host time, and which weighs more depends on the lengths, the model and the GPU.
        A forward and backward pass in each layout, twice in turn, over the step's first sequences up to one
        micro-batch's tokens a rank (a big step's passes are many of that size); the layout of the faster second pass
        is kept (`packed`) until the lengths move (layout_outdated): by its slowest rank's time, the step's, which
        every rank reads the same. Their gradients are dropped; nothing else changes. Returns the second passes'
        seconds, logged with the step's figures."""
        batch = sequence_batch(trajectories).to(self.device)
        batch = batch.select(range(len(batch)), fields=())
        budget = self.micro_batch_tokens * self.ranks.world
        sequences = np.flatnonzero(np.cumsum(batch.lengths) <= budget).tolist() or [0]
        seconds = {}  # by layout (packed or not): its second pass's
        for packed in (True, False, True, False):
            self.packed = packed
            synchronize(self.device)
            started = time.perf_counter()
            passes = self.micro_batches(batch, sequences)
            for n, mb in enumerate(passes):
                sync_gradients((self.model,), n == len(passes) - 1)  # as in a mini-batch's passes
                gather_logprobs(self._logits(self.model, mb), mb.input_ids).sum().backward()
            synchronize(self.device)
            seconds[packed] = time.perf_counter() - started
        slowest = np.max(self.ranks.all_gather([seconds[True], seconds[False]]), axis=0).tolist()
        seconds = dict(zip((True, False), slowest))
        self.optimizer.zero_grad()
        self.packed = seconds[True] <= seconds[False]
        self.layout_timed_on = mean_length(trajectories)
        return {"layout/packed_seconds": seconds[True], "layout/padded_seconds": seconds[False]}

    def settle(self, stats: dict) -> dict[str, float]:
        """The step's figures read back with whether each of its updates was taken, in one copy: on a GPU a read waits
        for every kernel queued before it, and leaves the GPU idle while the host queues the next, so the step reads
        once, not once per update. An update skipped for a non-finite loss or gradient (clip_and_step) is counted,
        and given back to the learning-rate schedule, which stepped for it: an update after it in the same train
        step took the rate of one step later."""
        updates, self.updates = self.updates, []
        values = read_back([*stats.values(), *(taken for pair in updates for taken in pair)])
        stats = dict(zip(stats, values))
        taken = values[len(stats):]
        self.skipped_updates += sum(not (policy and critic) for policy, critic in zip(taken[::2], taken[1::2]))
        if policy_skips := sum(not policy for policy in taken[::2]):
            self.scheduler.last_epoch -= policy_skips + 1
            self.scheduler.step()
        stats["updates/skipped_non_finite"] = self.skipped_updates
        return stats

    def probe_of(self, trajectories: list[Trajectory], batch: SequenceBatch, rows: list[int],
                 first_pass: torch.Tensor) -> Probe | None:
        """The probe of this step (rlsys/alarms.py): the first sequence its first update computed, up to PROBE_TOKENS
        tokens, with the logprobs those passes gave it (`first_pass`); None if that update computed none."""
        rows = sorted(rows)
        computed = computed_sequences(batch.token_counts[rows])
        if not computed:
            return None
        # The first one computed: with shared prefixes, the one whose row holds the prefix, so every token is scored.
        i = rows[computed[0]]
        n, start = min(batch.lengths[i], PROBE_TOKENS), int(batch.offsets[i])
        return Probe(self.version, trajectories[i].token_ids[:n], first_pass[start:start + n - 1].tolist())

    def prepare_batch(self, trajectories: list[Trajectory],
                      mini_batches: list[list[int]] | None = None) -> SequenceBatch:
        """Per-sequence tensors plus what stays fixed during the step: reference, values, advantages, proximal.
        The proximal pass computes only the sequences that an optimizer step on one of `mini_batches` will
        (sequences_to_compute); given `mini_batches` (train_step's), it leaves out those the first one computes,
        whose own passes fill them in (proximal_logprobs). By default, the whole batch, every one by the pass."""
        batch = sequence_batch(trajectories).to(self.device)
        if self.reference is not None:
            batch.fields["ref_logprobs"] = self.per_token(self._policy_logprobs(self.reference), batch)
        if self.critic is not None:
            batch.fields["old_values"] = self.per_token(self._values, batch)
        batch.fields.update(ADVANTAGE_ESTIMATORS[self.ppo.adv_estimator](trajectories, batch, self.ppo))
        if self.ppo.mask_void_trajectories:
            # SimpleTIR: out of the loss (and KL, entropy), after their rewards served in their groups' baselines.
            kept = torch.tensor([0.0 if t.void else 1.0 for t in trajectories])
            batch.fields["loss_mask"] = batch.fields["loss_mask"] * batch.per_sequence(kept)
        batch.token_counts = self.count_tokens(batch)
        if self.ppo.decoupled_loss or self.ppo.tis_cap:
            # Decoupled objective: PPO's trust region is around the policy as it is now (proximal), and the
            # behaviour policy that sampled the tokens, possibly versions older, enters as an importance weight.
            # Truncated IS (tis_cap) also takes the ratio against the learner's own logprobs, as verl does.
            self.first_step_fills_proximal = mini_batches is not None
            batch.fields["proximal_logprobs"] = self.proximal_logprobs(
                batch, mini_batches or [list(range(len(batch)))], self.first_step_fills_proximal)
        return batch

    def proximal_logprobs(self, batch: SequenceBatch, mini_batches: list[list[int]], first_fills: bool) -> torch.Tensor:
        """The policy's logprobs now, of the sequences an optimizer step on one of `mini_batches` computes; a
        sequence none computes (a GRPO group that got one reward, for one) keeps its behaviour logprobs, never read.

        With `first_fills`, those the first step computes are left 0: before the step's first update the policy is
        the proximal one, so that step's own forward passes are their proximal logprobs (its PPO ratio is exactly 1)
        and fill them in (mini_batch_gradients). With one mini-batch, the default, that is every sequence: the
        decoupled objective then costs no forward pass more than plain PPO."""
        computed = [{rows[i] for i in computed_sequences(batch.token_counts[rows])} for rows in mini_batches]
        everything = set().union(*computed)
        by_pass = sorted(everything - computed[0] if first_fills else everything)
        proximal = (self.per_token(self._policy_logprobs(self.model), batch, by_pass) if by_pass
                    else torch.zeros(batch.num_tokens + 1, device=batch.device))
        if len(everything) == len(batch):
            return proximal
        is_computed = torch.zeros(len(batch))
        is_computed[sorted(everything)] = 1.0
        return torch.where(batch.per_sequence(is_computed) > 0, proximal, batch.fields["behaviour_logprobs"])

    def pass_fields(self) -> list[str]:
        """The fields a training pass reads (accumulate_gradients): `versions` only while the logprob check is open."""
        return [*PASS_FIELDS, *(() if self.logprob_check.sealed else ("versions",))]

    def optimizer_step(self, mini_batch: SequenceBatch, statistics: bool = True, fills: torch.Tensor | None = None,
                       first_pass: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step on a mini-batch (and one critic step, for gae); without `statistics`, of the loss
        terms' figures only the loss, which decides whether the step is taken. `fills`, `first_pass`: see
        mini_batch_gradients."""
        if not mini_batch.token_counts[:, 0].any():
            # Every trajectory in it is void: no loss, and a step on zero gradients would still move by Adam's momentum.
            return {"grad_norm": 0.0}
        computed = self.sequences_to_compute(mini_batch)
        stats = (self.mini_batch_gradients(mini_batch, computed, statistics, fills, first_pass) if computed
                 else self.zero_gradients(len(mini_batch)))
        # A non-finite loss or gradient skips the step (and is counted) instead of writing NaN weights. The loss
        # is the whole mini-batch's (merged over ranks) and the norm a global one, so every rank decides alike.
        # On one rank nothing is read back here: whether it was taken is read with the step's figures (settle).
        stats["grad_norm"], stepped = clip_and_step(self.optimizer, self.ppo.max_grad_norm, stats.get("loss"))
        stats["lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()  # the schedule counts the updates taken: settle gives a skipped one back
        critic_stepped = True
        if self.critic is not None:
            stats["critic/grad_norm"], critic_stepped = clip_and_step(
                self.critic_optimizer, self.ppo.max_grad_norm, stats.get("critic/value_loss"))
        self.updates.append((stepped, critic_stepped))
        return stats

    def zero_gradients(self, sequences: int) -> dict[str, float]:
        """The gradients of a mini-batch of `sequences` none of which can move the policy (sequences_to_compute), set
        to 0 without a pass: what computing them gives (every term is the advantage times something finite). The
        update on them is still taken, as on any other mini-batch: AdamW's moments and weight decay move the weights,
        and the schedule counts it. Every parameter gets a gradient, as every one of a causal LM's takes part in its
        passes. No loss is computed, so the step has no loss statistics."""
        # Sharded, the root module's parameters may still be gathered from the step's proximal pass (no_grad; the
        # reference and value passes come only with a KL or value term, under which every update computes): with no
        # backward pass to release them, the next update's passes would read them, not the weights this step writes.
        reshard((self.model, self.critic))
        for optimizer in (self.optimizer, self.critic_optimizer):
            for p in [p for group in (optimizer.param_groups if optimizer else ()) for p in group["params"]]:
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
        return {"sequences/skipped_zero_advantage": float(sequences)}

    def sequences_to_compute(self, mini_batch: SequenceBatch) -> list[int]:
        """The sequences of `mini_batch` an update on it computes (computed_sequences): on the host, from the counts
        prepare_batch read back once for the whole batch (count_tokens)."""
        return computed_sequences(mini_batch.token_counts)

    def count_tokens(self, batch: SequenceBatch) -> np.ndarray:
        """[sequences, 2]: each sequence's tokens trained on, and of them those that can move the policy; one read.

        If the loss is the policy term alone (no KL, entropy or value term), a sequence whose every trained token
        has advantage 0 adds 0 to the loss and to every gradient, whatever its ratios, as each sample of a GRPO
        group that got one reward does: it need not be computed (ppo.skip_zero_advantage). Otherwise every
        sequence with a trained token can: one with none (a void one, under ppo.mask_void_trajectories) has 0 weight
        in every term."""
        f = batch.fields
        trained = f["loss_mask"] > 0
        policy_term_alone = self.ppo.loss_is_the_policy_term_alone and self.ppo.skip_zero_advantage != "false"
        live = trained & (f["advantages"] != 0) if policy_term_alone else trained
        counts = torch.zeros(2, len(batch) + 1, device=trained.device).index_add_(
            1, batch.sequence_index, torch.stack([trained, live]).float())
        return counts[:, :-1].T.cpu().numpy()

    def mini_batch_gradients(self, mini_batch: SequenceBatch, computed: list[int] | None = None,
                             statistics: bool = True, fills: torch.Tensor | None = None,
                             first_pass: torch.Tensor | None = None) -> dict[str, float]:
        """Gradients of a mini-batch's loss, accumulated over its micro-batches (on every rank, over its share).

        Each token's loss weight is fixed over the whole mini-batch first (token_loss_weights), so the
        accumulated gradient equals the mini-batch's, however it is split over ranks or packed, and when only the
        sequences `computed` (sequences_to_compute; None: all) are. The statistics are over those computed.
        `fills`: the step's first, before any update: its passes' logprobs are the proximal ones, and are added into
        `fills` (the proximal logprobs in the layout of the batch `mini_batch` was selected from, 0 there).
        `first_pass`, in the same layout and also in the step's first: its passes' logprobs at temperature 1 are added
        into it.
        """
        mask, sequences = mini_batch.fields["loss_mask"], mini_batch.sequence_index
        mini_batch.fields["weights"] = token_loss_weights(mask, sequences, self.ppo.loss_agg_mode)
        skipped = 0
        if computed is not None and len(computed) < len(mini_batch):
            skipped = len(mini_batch) - len(computed)
            mini_batch = mini_batch.select(computed)
            mask, sequences = mini_batch.fields["loss_mask"], mini_batch.sequence_index
        # Each token's share of the computed tokens: the weight of the KL, entropy and value terms and the statistics
        mini_batch.fields["token_share"] = (
            mini_batch.fields["weights"] if not skipped and self.ppo.loss_agg_mode == "token-mean"
            else token_loss_weights(mask, sequences, "token-mean"))
        if self.ppo.importance_sampling_level == "sequence":  # each pass's tokens' sequences, for their mean log-ratio
            mini_batch.fields["sequence_index"] = sequences
        self.optimizer.zero_grad()
        if self.critic is not None:
            self.critic_optimizer.zero_grad()
        totals = StatsAccumulator()
        passes = self.micro_batches(mini_batch)
        filled, scored = (None if field is None else torch.zeros(mini_batch.num_tokens + 1, device=mini_batch.device)
                          for field in (fills, first_pass))
        for n, mb in enumerate(passes):
            # Ranks exchange gradients once, after the last pass, not after each.
            sync_gradients((self.model, self.critic), n == len(passes) - 1)
            stats = self.accumulate_gradients(mb, statistics, filled, scored)
            if mb.indices:  # an empty pass (see micro_batches) has nothing to report
                totals.add(stats)
        for values, field in ((filled, fills), (scored, first_pass)):
            if field is not None:
                # Each rank filled its share's positions: their sum is every rank's.
                mini_batch.write_into(self.ranks.summed(values * mini_batch.predicts), field)
        # One rank's figures stay where they are, read back once a train step (settle); ranks exchange theirs here.
        stats = dict(totals.totals) if self.ranks.world == 1 else StatsAccumulator.merge(
            self.ranks.all_gather(totals.result()))
        stats["sequences/skipped_zero_advantage"] = float(skipped)
        return stats

    def accumulate_gradients(self, mb: MicroBatch, statistics: bool = True, filled: torch.Tensor | None = None,
                             scored: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The micro-batch's part of the mini-batch loss, backpropagated; its statistics if asked, else the loss.
        `filled`: no update has been made yet, so this pass's logprobs are the proximal ones; they go into it.
        `scored`: no update has been made yet either; this pass's logprobs at temperature 1 go into it."""
        f = mb.fields
        # One log-softmax for the logprobs and the entropy: with a real vocabulary it is a pass over [T, V] floats.
        distributions = torch.log_softmax(self._logits(self.model, mb), dim=-1)
        logp = taken_logprobs(distributions, mb.input_ids)
        self.logprob_check.observe(logp, f)
        if scored is not None:
            self.score_first_pass(mb, logp, distributions, scored)
        decoupled = dict(behaviour_logprobs=f["behaviour_logprobs"],
                         imp_weight_cap=self.ppo.behaviour_imp_weight_cap or None) if self.ppo.decoupled_loss else {}
        if filled is not None:
            old_logp = logp.detach()
            mb.scatter(old_logp, filled)
        else:
            old_logp = f["proximal_logprobs"] if "proximal_logprobs" in f else f["behaviour_logprobs"]
        weights = f["weights"]
        if self.ppo.tis_cap:  # against the learner's own logprobs, as verl does
            weights = weights * truncated_importance_weights(old_logp, f["behaviour_logprobs"], f["loss_mask"],
                                                             self.ppo.tis_cap)
        sequence_level = {}
        if self.ppo.importance_sampling_level == "sequence":
            # The mini-batch's sequence numbers (mini_batch_gradients); its padding slot's, one past its last, goes
            # into a bin past this pass's sequences, which holds no trained token.
            bins = max(mb.indices, default=-1) + 2
            sequence_level = dict(sequence_index=f["sequence_index"].clamp(max=bins - 1), sequences=bins)
        loss, stats = ppo_clip_loss(logp, old_logp, f["advantages"], f["loss_mask"], self.ppo.pg_clip,
                                    clip_high=self.ppo.pg_clip_high or None, dual_clip=self.ppo.dual_clip or None,
                                    weights=weights, **sequence_level,
                                    token_share=f["token_share"], statistics=statistics, **decoupled)
        stats["policy_loss"] = loss.detach()
        if statistics or self.ppo.entropy_loss_coef:
            with torch.set_grad_enabled(bool(self.ppo.entropy_loss_coef)):  # a statistic only, unless in the loss
                entropy = (token_entropy(distributions) * f["token_share"]).sum()
            stats["entropy"] = entropy.detach()
            if self.ppo.entropy_loss_coef:
                loss = loss - self.ppo.entropy_loss_coef * entropy
        if self.reference is not None:
            kl_estimate = KL_ESTIMATORS[self.ppo.kl_estimator]
            kl = (kl_estimate(logp, f["ref_logprobs"], f["loss_mask"]) * f["token_share"]).sum()
            loss = loss + self.kl_controller.value * kl
            stats["kl"] = kl.detach()
        stats["loss"] = loss.detach()
        loss.backward()
        if self.critic is not None:
            values = self._values(mb)
            value_loss = (clipped_value_loss(values, f["old_values"], f["returns"], self.ppo.value_clip)
                          * f["token_share"]).sum()
            (self.ppo.value_loss_coef * value_loss).backward()
            stats["critic/value_loss"] = value_loss.detach()
        return stats

    def score_first_pass(self, mb: MicroBatch, logp: torch.Tensor, distributions: torch.Tensor,
                         scored: torch.Tensor) -> None:
        """This pass's logprobs at temperature 1 into `scored`, as the engines score (the probe). At another sampling
        temperature T they are recovered from the pass's: log_softmax(T * log_softmax(z / T)) = log_softmax(z)."""
        with torch.no_grad():
            if self.temperature != 1.0:
                logp = taken_logprobs(torch.log_softmax(self.temperature * distributions, dim=-1), mb.input_ids)
            mb.scatter(logp.detach(), scored)

    def shares(self, batch: SequenceBatch, sequences: list[int] | None = None) -> list[list[int]]:
        """Which of `sequences` of `batch` (all by default) each rank computes: balanced by tokens computed.
        Sequences that share a prefix stay on one rank, so that it is computed once."""
        sequences = list(range(len(batch))) if sequences is None else sequences
        if not (self.share_prefixes and batch.prefix_ids is not None and self.ranks.world > 1):
            parts = balance_by_tokens([batch.lengths[i] for i in sequences], self.ranks.world)
            return [[sequences[i] for i in part] for part in parts]
        members = prefix_groups(batch, sequences)
        tokens = [shared_tokens(batch, group) for group in members]
        return [sorted(i for part in parts for i in members[part])
                for parts in balance_by_tokens(tokens, self.ranks.world)]

    def micro_batches(self, batch: SequenceBatch, sequences: list[int] | None = None) -> list[MicroBatch]:
        """This rank's share of `batch` (of its `sequences`, all by default) in micro-batches, as many on every rank
        (FSDP's passes are collective: a rank with fewer runs empty ones); `indices` are positions in `batch`."""
        share = self.shares(batch, sequences)[self.ranks.rank]
        out = micro_batches(batch, self.micro_batch_tokens, self.packed, self.pad_id, share, self.share_prefixes)
        missing = self.ranks.max(len(out)) - len(out)
        return out + [empty_micro_batch(batch, self.packed, self.pad_id)] * missing if missing else out

    def per_token(self, forward, batch: SequenceBatch, sequences: list[int] | None = None) -> torch.Tensor:
        """forward(micro-batch) -> [R, L-1] values, without gradients, as a field of `batch` ([N + 1]); of
        `sequences` only (all by default), 0 elsewhere."""
        out = torch.zeros(batch.num_tokens + 1, device=batch.device)
        with torch.no_grad():
            for mb in self.micro_batches(batch.select(range(len(batch)), fields=()), sequences):  # reads no field
                mb.scatter(forward(mb), out)
        # Each rank filled its share's positions and left the others 0: their sum is every rank's.
        return self.ranks.summed(out * batch.predicts)

    def _policy_logprobs(self, model):
        return lambda mb: gather_logprobs(self._logits(model, mb), mb.input_ids)

    def _logits(self, model, mb: MicroBatch) -> torch.Tensor:
        with self._autocast():
            return next_token_logits(model, mb.input_ids, self._attention_mask(mb), self.temperature, mb.position_ids)

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        """V of the state before each predicted token: the value head's output at the position predicting it."""
        with self._autocast():
            out = self.critic(input_ids=mb.input_ids, attention_mask=self._attention_mask(mb),
                              position_ids=mb.position_ids, use_cache=False)
        return out.logits[:, :-1, 0].float()

    def _attention_mask(self, mb: MicroBatch) -> torch.Tensor | None:
        """rlsys's attention (learner.attn_implementation=auto) is told where the sequences start, from the host, and
        takes no mask: nothing is built or read back per pass. Another implementation gets the padding mask."""
        if self.settings.attn_implementation != "auto":
            return mb.attention_mask
        known_segment_starts(mb.position_ids, mb.starts, mb.contexts)
        return None

    def _autocast(self):
        """bf16 on one rank; several ranks get it from FSDP's MixedPrecisionPolicy instead."""
        if self.settings.dtype == "bfloat16" and self.ranks.world == 1:
            return torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def temperature(self) -> float:
        return self.config.gen.temperature or 1.0  # greedy (0) rollouts are scored at temperature 1


def packs(setting, device: str, dtype: str, attention: str) -> bool | None:
    """Whether micro-batches are packed rows (ppo.sequence_packing; True/False as set in Python code); None where
    only a measurement can tell (PolicyTrainer.measured_layout)."""
    setting = str(setting).lower()
    if setting != "auto":
        return setting == "true"
    if attention in ("sdpa", "eager"):  # they would attend across a packed row's sequences
        return False
    if device == "cpu":  # per-length attention calls cost less than padding's (BENCHMARKS.md), and prompts are shared
        return True
    # On a GPU in float32 there is no one-call kernel for a packed row: it would take an attention call per
    # sequence length, and a GPU is launch-bound long before padding costs as much (BENCHMARKS.md).
    return None if dtype == "bfloat16" or attention == "flash_attention_2" else False


def synchronize(device: str) -> None:
    """Waits for the device's queued work (a GPU's kernels run ahead of the host's clock)."""
    if device != "cpu":
        torch.cuda.synchronize(device)


def shares_prefixes(setting: str, packed: bool, device: str, attention: str) -> bool:
    """Whether packed rows compute each shared prefix once (ppo.share_prefixes)."""
    if setting == "true" and not (packed and attention == "auto"):
        raise ValueError("ppo.share_prefixes=true needs packed rows under rlsys's attention (learner."
                         "attn_implementation=auto): this learner's micro-batches are "
                         + ("padded" if not packed else f"packed for {attention}"))
    # auto: on a CPU only. On a GPU a packed row is one flash-attention varlen call, which has no form for
    # a prefix attended to by several sequences; the masked sdpa calls that do it are unmeasured there.
    return packed and attention == "auto" and (setting == "true" or (setting == "auto" and device == "cpu"))


def mean_length(trajectories: list[Trajectory]) -> float:
    """The trajectories' mean length, every token counted: the one measure layout_outdated compares between the batch
    the layout was timed on and a step's (a batch's trained lengths leave out the tokens after the last trained one)."""
    return float(np.mean([len(t.token_ids) for t in trajectories]))


def computed_sequences(token_counts: np.ndarray) -> list[int]:
    """From SequenceBatch.token_counts, which sequences an update computes: those that can move the policy; none if
    none can (the update then steps on zero gradients: PolicyTrainer.zero_gradients)."""
    return np.flatnonzero(token_counts[:, 1]).tolist()


def mean_agent_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Averages of the agents' own per-trajectory metrics, each over the trajectories that carry it (in a mixed
    run, `<env>/...` keys over that environment's), prefixed so they never shadow learner stats."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for t in trajectories:
        for key, value in t.metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    return {agent_figure(key): total / counts[key] for key, total in sums.items()}


def batch_stats(trajectories: list[Trajectory], batch: SequenceBatch, version: int) -> dict[str, float]:
    """Reward, advantage, value and staleness statistics of the batch as consumed."""
    masks = batch.fields["loss_mask"] > 0
    advantages = batch.fields["advantages"][masks]
    if advantages.numel() == 0:  # every trajectory kept out of the loss (void)
        advantages = advantages.new_zeros(1)
    versions = batch.fields["versions"]
    generated = versions >= 0  # every token the model produced, trained on or not
    versions = versions[generated].float()
    rewards = torch.tensor([t.reward for t in trajectories])
    advantage = torch.stack([advantages.mean(), advantages.std(unbiased=False), advantages.abs().mean(),
                             advantages.max(), advantages.min(), versions.min(), versions.mean(), versions.max(),
                             generated.sum().float()]).tolist()  # one read back
    stats = {
        BATCH_REWARD: rewards.mean().item(),
        "reward_std": rewards.std(unbiased=False).item(),
        **dict(zip(("advantage_mean", "advantage_std", "advantage_abs_mean", "advantage_max", "advantage_min"),
                   advantage[:5])),
        "response_length": advantage[8] / len(trajectories),
        "void_fraction": sum(t.void for t in trajectories) / len(trajectories),
        "tokens": batch.num_tokens,
        # Versions behind the learner when consumed; AReaL's eta bounds the max.
        STALENESS_MAX: float(version - advantage[5]),
        STALENESS_MEAN: float(version - advantage[6]),
        "newest_version": advantage[7],
    }
    if "returns" in batch.fields:
        values, returns = batch.fields["old_values"][masks], batch.fields["returns"][masks]
        stats["critic/values_mean"] = values.mean().item()
        # 1 - Var(R - V) / Var(R): 1 is a perfect critic, 0 one no better than a constant.
        stats["critic/explained_variance"] = (1 - (returns - values).var() / returns.var().clamp(min=1e-8)).item()
    return stats


def read_back(values: list) -> list[float]:
    """`values` (numbers, 0-d tensors) as floats: one copy to the host per device the tensors are on."""
    out = list(values)
    tensors = [i for i, v in enumerate(out) if isinstance(v, torch.Tensor)]
    for device in {out[i].device for i in tensors}:
        at = [i for i in tensors if out[i].device == device]
        for i, value in zip(at, torch.stack([out[i].detach().float().reshape(()) for i in at]).tolist()):
            out[i] = value
    return [float(v) for v in out]


class StatsAccumulator:
    """Combines micro-batch statistics into the mini-batch's.

    Each micro-batch's statistic is already its part of the mini-batch's: losses, entropy and KL are sums weighted
    over the whole mini-batch's tokens, means (clip fraction, ratios) are weighted by each token's share of them
    (token_share), so they add up; maxima stay maxima. Values may be 0-d tensors (on the model's device):
    `result` reads them back at once (read_back). The ranks' totals combine the same way (merge).
    """

    def __init__(self):
        self.totals: dict = {}

    def add(self, stats: dict) -> None:
        for key, value in stats.items():
            before = self.totals.get(key)
            if before is None:
                self.totals[key] = value
            elif key.endswith("_max"):
                self.totals[key] = (torch.maximum(before, value) if isinstance(value, torch.Tensor)
                                    else largest((before, value)))
            else:
                self.totals[key] = before + value

    def result(self) -> dict[str, float]:
        return dict(zip(self.totals, read_back(list(self.totals.values()))))

    @staticmethod
    def merge(per_rank: list[dict[str, float]]) -> dict[str, float]:
        merged = StatsAccumulator()
        for totals in per_rank:
            merged.add(totals)
        return dict(merged.totals)
