"""Checks that training is sound, computed as it runs: does the learner score the sampled tokens as the
inference engine did?

The logprob comparison has two sources. In the batch (LogprobCheck): tokens sampled by the very version the
learner holds, which in an asynchronous run are few or none (they are one or two versions old). And the probe,
every step: the step's first update scores its batch under the version it trains from (its forward passes, before
any weight changes, so no pass of its own), the learner sends one of those sequences with its logprobs along with
the next version, and every inference worker that still holds the scored version scores it before it loads the
next (`probe_totals`); the learner logs what came back, a step later.

(The other checks: that inference serves the weights the learner published is rlsys/weight_checksum.py; that each
turn of a multi-turn episode extends the tokens of the turn before is rlsys/token_continuity.py.)
"""

import dataclasses
import logging
import math

import torch

from rlsys.errors import RunCannotGoOn
from rlsys.learner_figures import LOGPROB_ALARM, PROBE_ALARM

log = logging.getLogger(__name__)


class LogprobCheck:
    """Inference's logprobs against the learner's own on the same tokens, over one step.

    Only tokens sampled by the version the learner holds before its update are compared (older ones were
    sampled by other weights, so their difference is staleness, not a mismatch). Of those tokens:
    mean and max |logp_inf - logp_learner|, and KL(pi_inf || pi_learner) by the k3 estimator
    E[r - 1 - log r], r = pi_learner / pi_inf, which is unbiased and never negative.
    """

    def __init__(self, version: int):
        self.version = version
        self.sealed = False
        self.sums: torch.Tensor | None = None  # [tokens, sum |diff|, max |diff|, sum of KL terms], where they live

    @classmethod
    def of_step(cls, version: int, token_versions: list[list[int]]) -> "LogprobCheck":
        """The check of a step whose sequences' tokens were sampled by `token_versions`: sealed from the start when
        none was sampled by `version` (most steps of an asynchronous run), so that its passes compute nothing for it
        (on a GPU, each of its operations is a launch)."""
        check = cls(version)
        if not any(version in versions for versions in token_versions):
            check.seal()
        return check

    def observe(self, learner_logprobs: torch.Tensor, fields: dict) -> None:
        """`fields`: behaviour_logprobs, loss_mask and versions, aligned with `learner_logprobs`. Nothing is read
        back to the host here (on a GPU that would wait for the micro-batch's kernels)."""
        if self.sealed:
            return
        with torch.no_grad():
            same = (fields["loss_mask"] > 0) & (fields["versions"] == self.version)
            log_r = torch.where(same, learner_logprobs.detach().float() - fields["behaviour_logprobs"].float(), 0.0)
            terms = torch.stack([same.sum().float(), log_r.abs().sum(), log_r.abs().max(),
                                 torch.where(same, torch.exp(log_r) - 1 - log_r, 0.0).clamp(min=0).sum()])
            if self.sums is None:
                self.sums = terms
            else:
                self.sums = torch.stack([self.sums[0] + terms[0], self.sums[1] + terms[1],
                                         torch.maximum(self.sums[2], terms[2]), self.sums[3] + terms[3]])

    def seal(self) -> None:
        """The weights are about to change: later logprobs are no longer those of `version`."""
        self.sealed = True

    def totals(self) -> list[float]:
        """What stats() is made of: several learner ranks each compare their share and add these up (merged)."""
        return [0, 0.0, 0.0, 0.0] if self.sums is None else self.sums.tolist()

    def stats(self) -> dict[str, float]:
        return LogprobCheck.merged([self.totals()])

    @staticmethod
    def merged(parts: list[list[float]], prefix: str = LOGPROB_ALARM) -> dict[str, float]:
        """`parts` (totals of ranks, or of workers' probes) as the logged figures, under `prefix`."""
        tokens = sum(p[0] for p in parts)
        if not tokens:
            return {f"{prefix}_tokens": 0.0}
        return {f"{prefix}_abs_diff_mean": sum(p[1] for p in parts) / tokens,
                f"{prefix}_abs_diff_max": largest(p[2] for p in parts),
                f"{prefix}_kl": sum(p[3] for p in parts) / tokens, f"{prefix}_tokens": float(tokens)}


def largest(values) -> float:
    """The largest of `values`, NaN if any is NaN, as torch.maximum gives it: Python's max keeps or drops a NaN by
    where it stands, so a rank's or worker's NaN after a finite part would be reported as a finite maximum."""
    return max(values, key=lambda v: (math.isnan(v), v))


PROBE_TOKENS = 256  # the probe's first tokens: a weight or numerics mismatch shows in every position's logprob


@dataclasses.dataclass(frozen=True)
class Probe:
    """One sequence of a step's batch and the learner's logprob of each token after the first under `version`, the
    weights the step trained from, at temperature 1 (as the engines score)."""

    version: int
    token_ids: list[int]
    logprobs: list[float]


def difference_totals(inference: torch.Tensor, learner: torch.Tensor) -> list[float]:
    """[tokens, sum |diff|, max |diff|, sum of KL terms] of two aligned logprob tensors: mean and max
    |logp_inf - logp_learner|, and KL(pi_inf || pi_learner) by the k3 estimator E[r - 1 - log r],
    r = pi_learner / pi_inf, which is unbiased and never negative."""
    log_r = learner.float() - inference.float()
    if not log_r.numel():
        return [0, 0.0, 0.0, 0.0]
    return [log_r.numel(), log_r.abs().sum().item(), log_r.abs().max().item(),
            (torch.exp(log_r) - 1 - log_r).clamp(min=0).sum().item()]  # >= 0 in exact arithmetic; rounding


def probe_totals(learner: list[list[float]], scored: list[list[float]]) -> list[float]:
    """An inference worker's side of the probe: its logprobs of the probe sequences against the learner's."""
    flat = [(i, l) for inf, lrn in zip(scored, learner) for i, l in zip(inf, lrn)]
    return difference_totals(torch.tensor([i for i, _ in flat]), torch.tensor([l for _, l in flat]))


def check_logprob_mismatch(stats: dict[str, float], step: int, warn_at: float, stop: bool) -> None:
    """Warns when the mean absolute logprob difference, in the batch or in the probe, exceeds `warn_at` (0: never);
    raises if `stop`."""
    for prefix, what in ((LOGPROB_ALARM, "the sampled tokens"), (PROBE_ALARM, "the probe sequences")):
        mean = stats.get(f"{prefix}_abs_diff_mean")
        if not warn_at or mean is None or mean <= warn_at:
            continue
        message = (f"step {step}: inference and learner disagree on {what}' logprobs (mean |diff| {mean:.4f}, "
                   f"max {stats[f'{prefix}_abs_diff_max']:.4f}, KL {stats[f'{prefix}_kl']:.5f}; "
                   f"alarms.logprob_diff_warn={warn_at}): check the engine's dtype and the weight sync")
        if stop:
            raise RunCannotGoOn(message + " (alarms.stop_on_logprob_diff=true)")
        log.warning(message)
