"""What multi-turn agents share: the token record of a conversation and the rollout strategies that turn one
prompt into trajectories.

A subclass of MultiTurnAgent says how one turn plays out (`start`, `react`); this module does the rest:

- **chain** (AgentFly's default): the first request asks the group's n responses to the prompt; each then
  goes on as its own chain, with its own copy of the environment, one n=1 request per turn. Chains run
  concurrently, so one episode has several requests in flight, matched to their replies by qid.
- **tree**: as chain, but at turns 2 .. tree_depth+1 each node asks `tree_branching` responses that share its
  prefix (and the environment is forked per branch), so a prompt yields a tree of at most
  n * tree_branching**tree_depth trajectories, one per leaf. Tokens of a shared prefix appear in every
  trajectory below it. Greedy decoding would make every branch identical, so greedy rollouts never branch.
- **single-turn samples** (AReaL's multi-turn math agent): each turn becomes its own trajectory, the history
  as prompt (loss mask 0) and only that turn's response trained, rewarded with its discounted return.
  Greedy rollouts (evaluation) keep whole episodes, so held-out accuracy means the same under every strategy.

History is never re-tokenized: every piece (a response, a feedback message rendered by the chat template)
is appended as token ids. Tokens the model did not produce have loss mask 0 and version NOT_GENERATED.
A turn with neither a complete action nor a final answer (the subclass decides) marks the trajectory void;
the learner can keep void trajectories out of the loss (`ppo.mask_void_trajectories`).
"""

import abc
import asyncio
import dataclasses
import hashlib
import itertools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rlsys.algorithms.returns import discounted_turn_returns
from rlsys.api import NOT_GENERATED, Agent, EnvironmentService, GenerationConfig, GenerationOutput, Prompt, Trajectory
from rlsys.cancellation import cancel_and_wait
from rlsys.impl.agent.model_client import ModelClient
from rlsys.model.tokenizer import load_tokenizer, message_after_ids
from rlsys.token_continuity import PREFIX_BREAKS

ROLLOUT_MODES = ("chain", "tree")
TURNS = "turns"  # among a trajectory's metrics: the turns its episode took (num_turns is the most it may take)
SEED_STRIDE = 7919  # requests of one episode with a fixed seed still draw different random streams


@dataclass
class RolloutStrategy:
    mode: str = "chain"
    """chain: each of the group's first responses goes on as one chain; tree: turns 2..tree_depth+1 branch."""
    tree_branching: int = 2
    """tree: responses per node at a branching turn (a prompt yields <= group_size * tree_branching**tree_depth
    leaves)."""
    tree_depth: int = 1
    """tree: how many turns after the first branch; later turns go on as chains."""
    single_turn_samples: bool = False
    """Train each turn as its own sample: history as prompt, loss on that turn only, reward its discounted return."""

    def __post_init__(self):
        if self.mode not in ROLLOUT_MODES:
            raise ValueError(f"rollout.mode must be one of {ROLLOUT_MODES}, got {self.mode!r}")
        if self.tree_branching < 1 or self.tree_depth < 0:
            raise ValueError(f"rollout.tree_branching must be >= 1 and rollout.tree_depth >= 0, got "
                             f"{self.tree_branching} and {self.tree_depth}")

    def inactive_settings(self) -> dict[str, tuple[bool, str, str]]:
        """The tree's shape, which a chain never reads: refused on the command line when changed (see
        experiments/common.py, refuse_inactive)."""
        tree = (self.mode == "tree", f"with rollout.mode={self.mode} (only a tree branches)", "set rollout.mode=tree")
        return {"tree_branching": tree, "tree_depth": tree}

    def branching(self, turn: int, gconfig: GenerationConfig) -> int:
        """Responses to ask for at `turn` (2, 3, ...) from one node."""
        if self.mode == "tree" and 2 <= turn <= self.tree_depth + 1 and gconfig.temperature > 0:
            return self.tree_branching
        return 1


async def gather_or_cancel(coroutines) -> list:
    """Runs them concurrently; if one fails, the others are cancelled (none is left waiting on a reply)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        await cancel_and_wait(tasks)  # again, those that go on: a library may swallow a cancellation
        raise


def context_limit(model_path: str) -> int:
    """The model's own limit on prompt + response (max_position_embeddings), or none if it does not say."""
    config = Path(model_path) / "config.json"
    if not config.exists():
        return sys.maxsize
    return json.loads(config.read_text()).get("max_position_embeddings", sys.maxsize)


def token_key(token_ids: list[int]) -> str:
    """A short key of a token context: two turns with the same context share it."""
    return hashlib.sha1(str(token_ids).encode()).hexdigest()[:16]


@dataclass
class Reaction:
    """What the environment made of one turn."""

    reward: float
    done: bool  # the episode ended: the task (solved, failed for good), or the env's own step limit
    feedback: str | None  # next user message (after the last turn: a closing message, or None)
    success: bool = False  # the task is solved as of this turn
    state_key: str | None = None  # the state the next turn acts on; None: the token context itself
    void: bool = False  # neither a complete action nor a final answer
    metrics: dict[str, float] = field(default_factory=dict)  # per step; averaged over a trajectory's turns
    truncated: bool = False  # done by the env's step limit, not by the task (gym's truncated)


@dataclass
class Transcript:
    """One conversation's tokens so far, with what each turn produced and earned."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    next_key: str  # the state the next turn acts on
    turn_ends: list[int] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)  # where each turn's response begins
    turn_keys: list[str] = field(default_factory=list)
    reactions: list[Reaction] = field(default_factory=list)
    stop_reasons: list[str] = field(default_factory=list)
    truncated: bool = False  # ended by num_turns, the context budget or the env's step limit, not by the task

    @classmethod
    def from_prompt(cls, prompt_ids: list[int], key: str) -> "Transcript":
        n = len(prompt_ids)
        return cls(list(prompt_ids), [0] * n, [0.0] * n, [NOT_GENERATED] * n, key)

    def add_context(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [NOT_GENERATED] * len(ids)

    def add_response(self, out: GenerationOutput, sample: int) -> None:
        ids = out.output_ids[sample]
        self.turn_starts.append(len(self.token_ids))
        self.turn_keys.append(self.next_key)
        self.token_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += out.logprobs[sample]
        self.versions += out.versions[sample]
        self.turn_ends.append(len(self.token_ids))
        self.stop_reasons.append(out.stop_reasons[sample])

    def branch(self) -> "Transcript":
        return dataclasses.replace(self, **{f.name: list(getattr(self, f.name)) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), list)})

    @property
    def turn_rewards(self) -> list[float]:
        return [r.reward for r in self.reactions]

    def metrics(self) -> dict[str, float]:
        per_step: dict[str, list[float]] = {}
        for reaction in self.reactions:
            for key, value in reaction.metrics.items():
                per_step.setdefault(key, []).append(float(value))
        return {**{key: sum(v) / len(v) for key, v in per_step.items()},
                TURNS: float(len(self.reactions)), "void_turns": float(sum(r.void for r in self.reactions)),
                "success": float(self.reactions[-1].success), "first_turn_success": float(self.reactions[0].success),
                "truncated": float(self.truncated)}

    def trajectory(self, group_id: str, turn_discount: float) -> Trajectory:
        """The whole episode; its reward is the discounted sum of turn rewards, sum_k discount**(k-1) r_k."""
        return Trajectory(
            token_ids=self.token_ids, loss_mask=self.loss_mask, logprobs=self.logprobs, versions=self.versions,
            turn_ends=self.turn_ends, turn_rewards=self.turn_rewards,
            reward=discounted_turn_returns(self.turn_rewards, turn_discount)[0], group_id=group_id,
            stop_reason=self.stop_reasons[-1], metrics=self.metrics(), turn_obs_keys=self.turn_keys,
            void=any(r.void for r in self.reactions))

    def single_turn_samples(self, group_id: str, turn_discount: float) -> list[Trajectory]:
        """One trajectory per turn: the history up to its response as prompt, its discounted return as reward. The
        episode's metrics ride on its last turn's sample alone: the learner averages each over the trajectories that
        carry it, so each episode counts once, as a whole one does (on every sample, an episode of k turns counted k
        times, and a chain that failed three attempts pulled agent/success down three times)."""
        returns = discounted_turn_returns(self.turn_rewards, turn_discount)
        metrics, last = self.metrics(), len(self.turn_ends) - 1
        samples = []
        for k, (start, end) in enumerate(zip(self.turn_starts, self.turn_ends)):
            generated = end - start
            samples.append(Trajectory(
                token_ids=self.token_ids[:end], loss_mask=[0] * start + [1] * generated,
                logprobs=[0.0] * start + self.logprobs[start:end],
                versions=[NOT_GENERATED] * start + self.versions[start:end],
                turn_ends=[end], turn_rewards=[returns[k]], reward=returns[k], group_id=group_id,
                stop_reason=self.stop_reasons[k], metrics=metrics if k == last else {},
                turn_obs_keys=[self.turn_keys[k]], void=self.reactions[k].void))
        return samples


def turn_limit(agent: Agent, num_turns: int | None, max_turns: int | None) -> int:
    """`num_turns`, the most turns an episode takes, checked. Its earlier name `max_turns` is refused rather than
    read, naming the new one: the limit has one name in every agent and every experiment, the seed's."""
    if max_turns is not None:
        raise TypeError(f"{type(agent).__name__}: max_turns is now num_turns (the most turns an episode takes, as "
                        f"the seed and every experiment with turns name it): pass num_turns={max_turns}")
    if num_turns is None:
        raise TypeError(f"{type(agent).__name__} needs num_turns, the most turns an episode takes")
    if num_turns < 1:
        raise ValueError(f"num_turns must be at least 1, got {num_turns}")
    return num_turns


class MultiTurnAgent(Agent):
    """An agent that talks to its environment over several turns; subclasses say how one turn plays out."""

    marks_void = True  # a turn that is neither an action nor an answer

    def __init__(self, gconfig: GenerationConfig, tokenizer_path: str, num_turns: int | None = None,
                 turn_discount: float = 1.0, strategy: RolloutStrategy | dict | None = None,
                 max_context_tokens: int = 0, *, max_turns: int | None = None):
        num_turns = turn_limit(self, num_turns, max_turns)
        if not 0 <= turn_discount <= 1:
            raise ValueError(f"turn_discount must be in [0, 1], got {turn_discount}")
        self.gconfig, self.num_turns, self.turn_discount = gconfig, num_turns, turn_discount
        self.strategy = RolloutStrategy(**strategy) if isinstance(strategy, dict) else strategy or RolloutStrategy()
        # An episode ends before a request could outgrow this; 0: the model's own limit.
        self.max_context_tokens = max_context_tokens or context_limit(tokenizer_path)
        self.tokenizer = load_tokenizer(tokenizer_path)

    @abc.abstractmethod
    async def start(self, env: EnvironmentService, prompt: Prompt) -> str | None:
        """Resets this chain's env; returns the key of the first state (None: the prompt tokens themselves)."""

    @abc.abstractmethod
    async def react(self, env: EnvironmentService, prompt: Prompt, response: str, stop_reason: str) -> Reaction:
        """Hands one decoded response to the env and says what came of it."""

    async def collect_trajectory(self, prompt: Prompt, env: EnvironmentService, obs_queue: asyncio.Queue,
                                 act_queue: asyncio.Queue) -> list[Trajectory]:
        forks: list[EnvironmentService] = []
        numbers = itertools.count(1)

        async def fork(source: EnvironmentService) -> EnvironmentService:
            forks.append(await source.fork())
            return forks[-1]

        async def ask(token_ids: list[int], gconfig: GenerationConfig) -> GenerationOutput:
            number = next(numbers)
            if gconfig.seed is not None:  # a fixed seed still gives each request its own random stream
                gconfig = dataclasses.replace(gconfig, seed=gconfig.seed + SEED_STRIDE * number)
            return await model.generate(f"{prompt.qid}/{number}", token_ids, gconfig)

        try:
            async with ModelClient(obs_queue, act_queue) as model:
                envs = [await fork(env) for _ in range(self.gconfig.n)]  # one per chain, before any reset
                keys = await gather_or_cancel(self.start(e, prompt) for e in envs)
                first = await ask(prompt.token_ids, self.gconfig)
                chains = [self._play(ask, prompt, Transcript.from_prompt(prompt.token_ids, key or token_key(
                    prompt.token_ids)), e, first, i, 1, fork) for i, (e, key) in enumerate(zip(envs, keys))]
                transcripts = [t for leaves in await gather_or_cancel(chains) for t in leaves]
        finally:
            await asyncio.gather(*(f.close() for f in forks), return_exceptions=True)
        if self.strategy.single_turn_samples and self.gconfig.temperature > 0:
            trajectories = [s for t in transcripts for s in t.single_turn_samples(prompt.qid, self.turn_discount)]
        else:
            trajectories = [t.trajectory(prompt.qid, self.turn_discount) for t in transcripts]
        for t in trajectories:  # the episode's count, beside its other metrics (the learner logs the mean)
            if t.metrics:  # not on a single-turn sample of a turn before the last (see single_turn_samples)
                t.metrics[PREFIX_BREAKS] = float(model.prefix.breaks)
        return trajectories

    async def _play(self, ask, prompt: Prompt, transcript: Transcript, env: EnvironmentService,
                    out: GenerationOutput, sample: int, turn: int, fork) -> list[Transcript]:
        """Turn `turn` of one chain (response `sample` of `out`) and everything after it; returns the leaves."""
        transcript.add_response(out, sample)
        response = self.tokenizer.decode(out.output_ids[sample], skip_special_tokens=True)
        reaction = await self.react(env, prompt, response, out.stop_reasons[sample])
        transcript.reactions.append(reaction)
        feedback = [] if reaction.feedback is None else message_after_ids(self.tokenizer, out.output_ids[sample],
                                                                          "user", reaction.feedback)
        if reaction.done:
            transcript.truncated = reaction.truncated
            transcript.add_context(feedback)  # a closing message, if any
            return [transcript]
        next_request = len(transcript.token_ids) + len(feedback) + self.gconfig.max_new_tokens
        if turn >= self.num_turns or next_request > self.max_context_tokens:
            transcript.truncated = True
            return [transcript]
        transcript.add_context(feedback)
        transcript.next_key = reaction.state_key or token_key(transcript.token_ids)
        width = self.strategy.branching(turn + 1, self.gconfig)
        # Every branch starts from this node's state, so copy transcript and env before any branch moves on.
        branches = [(transcript, env)] + [(transcript.branch(), await fork(env)) for _ in range(width - 1)]
        following = await ask(transcript.token_ids, dataclasses.replace(self.gconfig, n=width))
        leaves = await gather_or_cancel(self._play(ask, prompt, t, e, following, i, turn + 1, fork)
                                        for i, (t, e) in enumerate(branches))
        return [t for branch in leaves for t in branch]
