"""What an agent asks the model for (GenerationConfig) and what it gets back (GenerationOutput)."""

import dataclasses
from dataclasses import dataclass, field


@dataclass
class GenerationConfig:
    """Sampling settings sent with each observation."""

    n: int = 1  # samples per request (a group shares one prompt)
    max_new_tokens: int = 16  # generation stops after this many tokens
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus sampling mass
    top_k: int = -1  # -1 disables top-k
    stop_token_ids: list[int] = field(default_factory=list)  # extra tokens that end generation
    seed: int | None = None  # per-request sampling seed, for reproducible tests

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GenerationConfig":
        return cls(**d)


@dataclass
class GenerationOutput:
    """The action for one request: n sampled continuations of the same prompt."""

    qid: str  # the request id the agent put on obs_queue
    prompt_ids: list[int]
    output_ids: list[list[int]]  # [sample][token], exactly the tokens the engine produced
    logprobs: list[list[float]]  # behaviour logprob of each produced token
    versions: list[list[int]]  # weight version that produced each token
    stop_reasons: list[str]  # per sample: "stop" (eos / stop token) or "length"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GenerationOutput":
        return cls(**d)
