"""What an agent asks the model for (ModelRequest, with its GenerationConfig) and what it gets back
(GenerationOutput)."""

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

MIN_TEMPERATURE = 1e-2  # vLLM raises a temperature in (0, 1e-2) to this (dividing by less overflows), as the
# transformers engine does: it samples there and its logprobs are at 1e-2
VLLM_MAX_TEMPERATURE = 2.0  # vLLM 0.32 refuses a request of a higher temperature (the transformers engine takes it)
GREEDY_BELOW = 1e-5  # temperatures below this (after that floor: 0 alone) are greedy in both engines, as in vLLM


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


class ModelRequest(NamedTuple):
    """What an agent puts on `obs_queue`. A tuple, so the seed's plain `(qid, token_ids, gconfig)` is the same
    request; the reply, a GenerationOutput on `act_queue`, comes back under the same `qid`."""

    qid: str  # the agent's id for this request, unique among its requests in flight (it may reuse one later)
    token_ids: list[int]  # the whole context: prompt and every turn so far
    gconfig: GenerationConfig


@dataclass
class GenerationOutput:
    """The action for one request: n sampled continuations of the same prompt."""

    qid: str  # the request id the agent put on obs_queue
    prompt_ids: list[int]
    output_ids: list[list[int]]  # [sample][token], exactly the tokens the engine produced
    logprobs: list[list[float]]  # behaviour logprob of each produced token
    versions: list[list[int]]  # weight version that produced each token
    stop_reasons: list[str]  # per sample: "stop" (eos / stop token), "length", or the engine's "abort" or "error"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GenerationOutput":
        return cls(**d)
