"""The unit of training data: one episode's tokens with everything the learner needs."""

import dataclasses
import uuid
from dataclasses import dataclass, field

import msgpack

from rlsys.api.generation import GenerationOutput

NOT_GENERATED = -1  # version tag of tokens the model did not produce (prompt, feedback, tool output)


@dataclass
class Prompt:
    """A dataset row handed to an agent: its id, tokenized prompt and the raw row (answer etc.)."""

    qid: str
    token_ids: list[int]
    data: dict  # the dataset row as read, e.g. {"prompt": "12+34=", "answer": "46"}


@dataclass
class Trajectory:
    """Token-level record of one episode. Lists with one entry per token are aligned with `token_ids`."""

    token_ids: list[int]
    loss_mask: list[int]  # 1 for tokens the model produced, 0 for prompt / feedback / tool output
    logprobs: list[float]  # behaviour logprob per token (0.0 where loss_mask is 0)
    versions: list[int]  # weight version per token (NOT_GENERATED where loss_mask is 0)
    turn_ends: list[int]  # exclusive end index of each model turn
    turn_rewards: list[float]  # reward given after each turn
    reward: float  # final episode reward
    group_id: str  # the prompt this answers; advantages are normalised within a group
    stop_reason: str  # "stop", "length", ...
    metrics: dict[str, float] = field(default_factory=dict)
    traj_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Key of the observation (environment state) each turn acted on; turns of one group with equal keys are
    # GiGPO's anchor states. Empty: the agent recorded none (every turn then stands alone).
    turn_obs_keys: list[str] = field(default_factory=list)
    void: bool = False  # a turn had neither a complete action nor a final answer (SimpleTIR's void turn)

    def __post_init__(self):
        n = len(self.token_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Trajectory.{name} has {len(getattr(self, name))} entries for {n} tokens")
        if len(self.turn_ends) != len(self.turn_rewards):
            raise ValueError("Trajectory needs one turn reward per turn end")
        if self.turn_obs_keys and len(self.turn_obs_keys) != len(self.turn_ends):
            raise ValueError(f"Trajectory has {len(self.turn_obs_keys)} turn_obs_keys for {len(self.turn_ends)} turns")

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def to_dict(self) -> dict:
        """Every field, lists and the metrics map copied. Not `dataclasses.asdict`: it recurses into every
        token and costs far more, on the rollout worker's one core."""
        return {name: _copied(getattr(self, name)) for name in _FIELD_NAMES}

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        unknown = set(d) - set(_FIELD_NAMES)
        if unknown:
            raise ValueError(f"unknown Trajectory fields {sorted(unknown)}")
        return cls(**d)

    def to_msgpack(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_msgpack(cls, payload: bytes) -> "Trajectory":
        return cls.from_dict(msgpack.unpackb(payload, raw=False))


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Trajectory))


@dataclass
class Transcript:
    """One chain's tokens so far, with the per-token lists a Trajectory needs: the prompt, then what the model
    generated (loss mask 1) and what it was shown (loss mask 0), appended as ids, never re-tokenized."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]

    @classmethod
    def of_prompt(cls, ids: list[int]) -> "Transcript":
        return cls(list(ids), [0] * len(ids), [0.0] * len(ids), [NOT_GENERATED] * len(ids))

    def add_generated(self, output: GenerationOutput) -> None:
        self.token_ids += output.output_ids[0]
        self.loss_mask += [1] * len(output.output_ids[0])
        self.logprobs += output.logprobs[0]
        self.versions += output.versions[0]

    def add_observation(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [NOT_GENERATED] * len(ids)


def _copied(value):
    """A field's value, with its own copy of a list or map (their items are numbers and strings)."""
    if isinstance(value, list):
        return list(value)
    return dict(value) if isinstance(value, dict) else value
