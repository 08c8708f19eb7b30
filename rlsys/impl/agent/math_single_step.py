"""`math-single-step`: sample a group of answers to one problem, score them, return one trajectory each."""

import asyncio

from rlsys.api import (NOT_GENERATED, Agent, EnvironmentService, GenerationConfig, GenerationOutput, ModelRequest,
                       Prompt, Trajectory, register_agent)
from rlsys.model.tokenizer import load_tokenizer


def single_turn_trajectory(prompt: Prompt, act: GenerationOutput, sample: int, reward: float,
                           metrics: dict[str, float]) -> Trajectory:
    """Prompt tokens (not trained on) followed by exactly the tokens the model produced."""
    n_prompt, output = len(act.prompt_ids), act.output_ids[sample]
    return Trajectory(
        token_ids=list(act.prompt_ids) + list(output),
        loss_mask=[0] * n_prompt + [1] * len(output),
        logprobs=[0.0] * n_prompt + list(act.logprobs[sample]),
        versions=[NOT_GENERATED] * n_prompt + list(act.versions[sample]),
        turn_ends=[n_prompt + len(output)],
        turn_rewards=[reward],
        reward=reward,
        group_id=prompt.qid,
        stop_reason=act.stop_reasons[sample],
        metrics=metrics,
    )


def answer_rewards(env: EnvironmentService, rewards, n_answers: int) -> list[float]:
    """The reward of each answer the math agents stepped `env` with; a gym-like single reward, or a list of another
    length, is refused naming the environment (it failed deep in the agent, as a float not subscriptable)."""
    if not hasattr(rewards, "__len__") or isinstance(rewards, (str, dict)) or len(rewards) != n_answers:
        raise TypeError(f"{type(env).__name__}.step returned the reward {rewards!r} for {n_answers} answers: the math "
                        "agents step the environment with (qid, [answer, ...]) and need a list of one reward per "
                        "answer")
    return [float(reward) for reward in rewards]


class MathSingleStepAgent(Agent):
    def __init__(self, gconfig: GenerationConfig, tokenizer_path: str):
        self.gconfig = gconfig
        self.tokenizer = load_tokenizer(tokenizer_path)

    async def collect_trajectory(self, prompt: Prompt, env: EnvironmentService, obs_queue: asyncio.Queue,
                                 act_queue: asyncio.Queue) -> list[Trajectory]:
        await env.reset(options=prompt.data)
        await obs_queue.put(ModelRequest(prompt.qid, prompt.token_ids, self.gconfig))
        act: GenerationOutput = await act_queue.get()
        answers = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in act.output_ids]
        _, rewards, _, _, info = await env.step((prompt.qid, answers))
        rewards = answer_rewards(env, rewards, len(answers))
        statuses = info.get("statuses", ["ok"] * len(answers))
        # Whether an answer is right is the environment's to say (a verifier's verdict); one whose reward is a
        # score (a reward model's, TRL reward functions') says nothing, and its episodes have no success.
        successes = info.get("success")
        return [
            single_turn_trajectory(prompt, act, i, rewards[i], {
                "verify_failed": float(statuses[i] in ("timeout", "error")),
                **({"success": float(successes[i])} if successes is not None else {})})
            for i in range(len(answers))
        ]


register_agent("math-single-step", MathSingleStepAgent)
