"""The unit of training data: one episode's tokens with everything the learner needs."""

import dataclasses
import uuid
from dataclasses import dataclass, field

import msgpack

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

    def __post_init__(self):
        n = len(self.token_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Trajectory.{name} has {len(getattr(self, name))} entries for {n} tokens")
        if len(self.turn_ends) != len(self.turn_rewards):
            raise ValueError("Trajectory needs one turn reward per turn end")

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown Trajectory fields {sorted(unknown)}")
        return cls(**d)

    def to_msgpack(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_msgpack(cls, payload: bytes) -> "Trajectory":
        return cls.from_dict(msgpack.unpackb(payload, raw=False))
