"""A stand-in model that answers with chosen token sequences: for CPU contract tests of agents and envs.

It sits behind the real GenerationEngine and inference worker, so an agent under test still goes through
its queues, the episode router, the bus, request fan-out and weight-version tagging; only the model is
replaced. It emits `tokens_per_step` tokens per step, so a weight update can land mid-generation.
"""

from collections.abc import Callable

from rlsys.api import GenerationConfig
from rlsys.engine.backend import GenerationBackend, SamplingSettings, TokenDelta
from rlsys.engine.generation import GenerationEngine

# (prompt token ids, sampling settings, sample index) -> the tokens "the model" produces
Policy = Callable[[list[int], GenerationConfig, int], list[int]]


class ScriptedBackend(GenerationBackend):
    def __init__(self, logprob: float, tokens_per_step: int):
        self.logprob, self.tokens_per_step = logprob, tokens_per_step
        self.scripts: dict[tuple[str, int], tuple[int, list[int]]] = {}  # (rid, sample) -> (prompt length, tokens)
        self.running: dict[str, tuple[list[int], int, SamplingSettings]] = {}  # seq id -> (script, position, settings)
        self.loaded: list[list[str]] = []  # the names of the tensors each load was given, in order

    def add(self, seq_id: str, token_ids: list[int], sampling: SamplingSettings, arrival: float = 0.0) -> None:
        rid, index, _ = seq_id.rsplit("|", 2)
        prompt_length, script = self.scripts[(rid, int(index))]
        produced = len(token_ids) - prompt_length  # a resumed sample goes on where it was interrupted
        self.running[seq_id] = (script[:produced + sampling.max_tokens], produced, sampling)

    def step(self) -> list[TokenDelta]:
        deltas = []
        for seq_id, (script, position, sampling) in list(self.running.items()):
            new = script[position:position + self.tokens_per_step]
            position += len(new)
            finish = None
            if position >= len(script):
                finish = "stop" if script and script[-1] in sampling.stop_token_ids else "length"
                del self.running[seq_id]
            else:
                self.running[seq_id] = (script, position, sampling)
            deltas.append(TokenDelta(seq_id, new, [self.logprob] * len(new), finish))
        return deltas

    def abort(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self.running.pop(seq_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def load_weights(self, weights) -> None:
        self.loaded.append(sorted(weights))


class ScriptedEngine(GenerationEngine):
    """A GenerationEngine whose model follows `policy`; `requests` records every prompt it was asked."""

    def __init__(self, policy: Policy, logprob: float = -0.5, tokens_per_step: int = 1 << 30):
        super().__init__(ScriptedBackend(logprob, tokens_per_step))
        self.policy = policy
        self.requests: list[tuple[list[int], GenerationConfig]] = []

    def add_request(self, rid: str, prompt_ids: list[int], gconfig: GenerationConfig) -> None:
        self.requests.append((list(prompt_ids), gconfig))
        for index in range(gconfig.n):
            script = list(self.policy(list(prompt_ids), gconfig, index))[:gconfig.max_new_tokens]
            self.backend.scripts[(rid, index)] = (len(prompt_ids), script)
        super().add_request(rid, prompt_ids, gconfig)
