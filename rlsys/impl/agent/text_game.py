"""`text-game`: plays a text env (frozen-lake, sokoban, webshop) over many turns.

The prompt is the game's first observation. Each turn the model answers with a move, the env applies it,
and the new board comes back as the next user message (loss mask 0), until the game ends or `num_turns`.
Each step's env reward is that turn's reward; the episode reward is their (discounted) sum. The rendered
board is the turn's state key, so GiGPO groups the turns of a group's episodes that saw the same board.
A turn whose response is not a move (the env's `action_is_valid` is false) is void.
"""

from rlsys.api import EnvironmentService, GenerationConfig, Prompt, register_agent
from rlsys.impl.agent.multi_turn import MultiTurnAgent, Reaction, RolloutStrategy


class TextGameAgent(MultiTurnAgent):
    def __init__(self, gconfig: GenerationConfig, tokenizer_path: str, num_turns: int = 8,
                 turn_discount: float = 1.0, strategy: RolloutStrategy | dict | None = None,
                 max_context_tokens: int = 0, *, max_turns: int | None = None):
        super().__init__(gconfig, tokenizer_path, num_turns, turn_discount, strategy, max_context_tokens,
                         max_turns=max_turns)

    async def start(self, env: EnvironmentService, prompt: Prompt) -> str:
        board, _ = await env.reset(options=prompt.data)
        return board

    async def react(self, env: EnvironmentService, prompt: Prompt, response: str, stop_reason: str) -> Reaction:
        board, reward, terminated, truncated, info = await env.step(response)
        done = terminated or truncated
        return Reaction(reward=float(reward), done=done, feedback=None if done else board, success=info["success"],
                        state_key=board, void=not info["action_is_valid"], truncated=truncated and not terminated,
                        metrics={"action_is_valid": float(info["action_is_valid"]),
                                 "action_is_effective": float(info["action_is_effective"])})


register_agent("text-game", TextGameAgent)
