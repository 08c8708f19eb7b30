"""`math-multi-turn`: AReaL's multi-turn math agent. After a wrong answer it is told so and tries again.

Each turn's answer goes to the math env. A wrong one is followed by the user message "Unfortunately your
answer is wrong. Let's try again." (rendered by the chat template, loss mask 0) and another turn, up to
`num_turns`; a right one by "Congratulations! You are correct!", which ends the episode. The turn reward is
1.0 for the right answer, 0.0 otherwise, and the episode reward is discounted per turn: a success at turn k
earns turn_discount**(k-1). The default 0.5 makes a first-try answer worth twice a second-try one, so the
group baseline still separates answers that were right at once from answers found by retrying (with 1.0,
nearly every chain of an easy problem ends with 1.0 and the group carries no signal).

A turn is void when its answer is empty or was cut off by the token limit before its end of sequence.
"""

import random

from rlsys.api import EnvironmentService, GenerationConfig, Prompt, register_agent
from rlsys.impl.agent.math_single_step import answer_rewards
from rlsys.impl.agent.multi_turn import MultiTurnAgent, Reaction, RolloutStrategy
from rlsys.model.warm_start_examples import TaughtSequence, answer_ids
from rlsys.model.tokenizer import message_after_ids, row_prompt_ids

CORRECT_FEEDBACK = "Congratulations! You are correct!"
WRONG_FEEDBACK = "Unfortunately your answer is wrong. Let's try again."


class MathMultiTurnAgent(MultiTurnAgent):
    def __init__(self, gconfig: GenerationConfig, tokenizer_path: str, num_turns: int = 3,
                 turn_discount: float = 0.5, strategy: RolloutStrategy | dict | None = None,
                 max_context_tokens: int = 0):
        super().__init__(gconfig, tokenizer_path, num_turns, turn_discount, strategy, max_context_tokens)

    async def start(self, env: EnvironmentService, prompt: Prompt) -> None:
        await env.reset(options=prompt.data)
        return None  # the state is the conversation so far: chains with equal histories share it

    async def react(self, env: EnvironmentService, prompt: Prompt, response: str, stop_reason: str) -> Reaction:
        _, rewards, _, _, info = await env.step((prompt.qid, [response]))
        correct = answer_rewards(env, rewards, 1)[0] == 1.0
        status = info.get("statuses", ["ok"])[0]
        return Reaction(reward=float(correct), done=correct, feedback=CORRECT_FEEDBACK if correct else WRONG_FEEDBACK,
                        success=correct, void=stop_reason != "stop" or not response.strip(),
                        metrics={"verify_failed": float(status in ("timeout", "error"))})


def retry_sequences(tokenizer, rows: list[dict], seed: int) -> list[TaughtSequence]:
    """Each problem answered wrong once, told so, then answered right, tokenized as this agent's conversation.

    Only the right answer is taught: a warm start on these shows a model what a second attempt looks like.
    """
    rng = random.Random(seed)
    sequences = []
    for row in rows:
        prompt = row_prompt_ids(tokenizer, row)  # as the rollout worker renders it: a system prompt included
        wrong = answer_ids(tokenizer, str(int(row["answer"]) + rng.choice([-10, -1, 1, 10])))
        right = answer_ids(tokenizer, row["answer"])
        context = prompt + wrong + message_after_ids(tokenizer, wrong, "user", WRONG_FEEDBACK)
        sequences.append(TaughtSequence(context + right, [0] * len(context) + [1] * len(right)))
    return sequences


register_agent("math-multi-turn", MathMultiTurnAgent)
