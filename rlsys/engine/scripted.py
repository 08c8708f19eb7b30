"""A stand-in engine that answers with chosen token sequences: for CPU contract tests of agents and envs.

It sits behind the real inference worker, so an agent under test still goes through its queues,
the episode router and the bus; only the model is replaced.
"""

from collections.abc import Callable

from rlsys.api import GenerationConfig, GenerationOutput

# (prompt token ids, sampling settings, sample index) -> the tokens "the model" produces
Policy = Callable[[list[int], GenerationConfig, int], list[int]]


class ScriptedEngine:
    def __init__(self, policy: Policy, logprob: float = -0.5):
        self.policy, self.logprob = policy, logprob
        self.version = 0
        self.requests: list[tuple[list[int], GenerationConfig]] = []  # every prompt it was asked, in order

    def generate(self, requests: list[tuple[str, list[int], GenerationConfig]]) -> list[GenerationOutput]:
        outputs = []
        for qid, prompt_ids, gconfig in requests:
            self.requests.append((list(prompt_ids), gconfig))
            samples = [list(self.policy(list(prompt_ids), gconfig, i))[:gconfig.max_new_tokens] for i in range(gconfig.n)]
            outputs.append(GenerationOutput(
                qid=qid, prompt_ids=list(prompt_ids), output_ids=samples,
                logprobs=[[self.logprob] * len(s) for s in samples],
                versions=[[self.version] * len(s) for s in samples],
                stop_reasons=["stop" if s and s[-1] in gconfig.stop_token_ids else "length" for s in samples],
            ))
        return outputs

    def load_weights(self, directory: str, version: int) -> None:
        self.version = version
