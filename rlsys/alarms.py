"""Checks that training is sound, computed as it runs: does the learner score the sampled tokens as the
inference engine did, and does each turn of a multi-turn episode extend the tokens of the turn before?

(The third check, that inference serves the weights the learner published, is rlsys/weight_checksum.py.)
"""

import logging

import torch

from rlsys.supervisor import RunCannotGoOn

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
        self.tokens = 0
        self.abs_sum = self.abs_max = self.kl_sum = 0.0

    def observe(self, learner_logprobs: torch.Tensor, fields: dict) -> None:
        """`fields`: behaviour_logprobs, loss_mask and versions, aligned with `learner_logprobs`."""
        if self.sealed:
            return
        with torch.no_grad():
            same = (fields["loss_mask"] > 0) & (fields["versions"] == self.version)
            if not same.any():
                return
            learner, inference = learner_logprobs.detach()[same].float(), fields["behaviour_logprobs"][same].float()
            diff = inference - learner
            self.tokens += diff.numel()
            self.abs_sum += diff.abs().sum().item()
            self.abs_max = max(self.abs_max, diff.abs().max().item())
            log_r = -diff
            self.kl_sum += (torch.exp(log_r) - 1 - log_r).sum().item()

    def seal(self) -> None:
        """The weights are about to change: later logprobs are no longer those of `version`."""
        self.sealed = True

    def totals(self) -> list[float]:
        """What stats() is made of: several learner ranks each compare their share and add these up (merged)."""
        return [self.tokens, self.abs_sum, self.abs_max, self.kl_sum]

    def stats(self) -> dict[str, float]:
        return LogprobCheck.merged([self.totals()])

    @staticmethod
    def merged(parts: list[list[float]]) -> dict[str, float]:
        tokens = sum(p[0] for p in parts)
        if not tokens:
            return {"alarms/logprob_tokens": 0.0}
        return {"alarms/logprob_abs_diff_mean": sum(p[1] for p in parts) / tokens,
                "alarms/logprob_abs_diff_max": max(p[2] for p in parts),
                "alarms/logprob_kl": sum(p[3] for p in parts) / tokens, "alarms/logprob_tokens": float(tokens)}


def check_logprob_mismatch(stats: dict[str, float], step: int, warn_at: float, stop: bool) -> None:
    """Warns when the mean absolute logprob difference exceeds `warn_at` (0: never); raises if `stop`."""
    mean = stats.get("alarms/logprob_abs_diff_mean")
    if not warn_at or mean is None or mean <= warn_at:
        return
    message = (f"step {step}: inference and learner disagree on the sampled tokens' logprobs (mean |diff| "
               f"{mean:.4f}, max {stats['alarms/logprob_abs_diff_max']:.4f}, KL {stats['alarms/logprob_kl']:.5f}; "
               f"alarms.logprob_diff_warn={warn_at}): check the engine's dtype and the weight sync")
    if stop:
        raise RunCannotGoOn(message + " (alarms.stop_on_logprob_diff=true)")
    log.warning(message)


class PrefixCheck:
    """Multi-turn episodes: each request must begin with exactly the tokens of an earlier turn (its prompt and
    the response sampled for it), or repeat an earlier request's prompt (a new chain from the same start).
    A re-tokenized or re-rendered history breaks that: the model is then trained on tokens other than those
    it was conditioned on. Breaks are counted and warned with the episode id."""

    def __init__(self):
        self.turns: list[list[int]] = []  # prompt + response of each answered request
        self.prompts: set[tuple[int, ...]] = set()
        self.requests = self.breaks = 0

    def request(self, qid: str, token_ids: list[int]) -> None:
        self.requests += 1
        first = not self.prompts
        known = tuple(token_ids) in self.prompts
        self.prompts.add(tuple(token_ids))
        if not first and not known and not any(token_ids[:len(t)] == t for t in self.turns):
            self.breaks += 1
            log.warning("episode %s: request %s does not begin with the tokens of any earlier turn (a prefix break: "
                        "the history was re-tokenized or edited)", qid.split("/")[0], qid)

    def reply(self, token_ids: list[int], outputs: list[list[int]]) -> None:
        self.turns += [list(token_ids) + list(out) for out in outputs]
