"""The token-continuity alarm of multi-turn episodes: does each turn's request extend the tokens of a turn before?
It runs in the rollout workers, beside the agents, on token ids alone (the logprob alarms are rlsys/alarms.py)."""

import logging

log = logging.getLogger(__name__)

PREFIX_BREAKS = "prefix_breaks"  # an episode's breaks among its trajectories' metrics, as the agents log them


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
