"""`tool-calling`: the model works in turns, calling tools through the environment, until it answers.

Each of the group's `gconfig.n` samples is an independent chain of turns (its own requests, its own
tool state in the environment). A chain's trajectory is the prompt, then per turn exactly the tokens
the model produced (loss mask 1) followed by the observation: the environment's tool responses as a
user message through the chat template (loss mask 0, version NOT_GENERATED). The user role carries
observations, as Qwen's template does for tool results, so any chat template works unchanged. A turn
the model ended without eos (it hit max_new_tokens) is closed with an eos that is not trained on.

A chain ends when the model answers (stop_reason "answer"), after `num_turns` turns ("num_turns"), or
when the next turn would not fit in `max_total_tokens` ("token_budget"). Tokens are never
re-tokenized: new pieces are appended as ids. A chain with a turn that neither calls a tool nor answers
is void (`ppo.mask_void_trajectories` can keep it out of the loss).
"""

import asyncio
import dataclasses
from collections import Counter

from rlsys.api import Agent, EnvironmentService, GenerationConfig, Prompt, Trajectory, register_agent
from rlsys.api.trajectory import Transcript
from rlsys.impl.agent.model_client import ModelClient
from rlsys.impl.agent.multi_turn import SEED_STRIDE, TURNS, context_limit, gather_or_cancel, turn_limit
from rlsys.model.tokenizer import chat_prompt_ids, load_tokenizer, message_after_ids
from rlsys.token_continuity import PREFIX_BREAKS

OBSERVATION_ROLE = "user"
COUNTED = ("tool_calls", "tool_errors", "tool_timeouts", "decode_errors", "void_turns", "answered", "verify_failed")


class ToolCallingAgent(Agent):
    marks_void = True  # a turn that is neither an action nor an answer

    def __init__(self, gconfig: GenerationConfig, tokenizer_path: str, num_turns: int = 4,
                 max_total_tokens: int = 1024, use_instructions: bool = True, *, max_turns: int | None = None):
        num_turns = turn_limit(self, num_turns, max_turns)
        self.gconfig = gconfig
        self.tokenizer = load_tokenizer(tokenizer_path)
        # An episode never outgrows the model: a budget past its positions would fail at the engine instead.
        self.num_turns, self.max_total_tokens = num_turns, min(max_total_tokens, context_limit(tokenizer_path))
        self.use_instructions = use_instructions

    async def collect_trajectory(self, prompt: Prompt, env: EnvironmentService, obs_queue: asyncio.Queue,
                                 act_queue: asyncio.Queue) -> list[Trajectory]:
        instructions, _ = await env.reset(options=prompt.data)
        prompt_ids = self.prompt_ids(prompt, instructions)
        if len(prompt_ids) >= self.max_total_tokens:
            raise ValueError(f"prompt {prompt.qid} is {len(prompt_ids)} tokens, leaving nothing of the "
                             f"{self.max_total_tokens}-token budget (the smallest of max_total_tokens, "
                             "inference.max_model_len and the model's positions): use a model with a longer context "
                             "or set tool_instructions=false")
        async with ModelClient(obs_queue, act_queue) as model:
            chains = [self.run_chain(chain, prompt, prompt_ids, env, model) for chain in range(self.gconfig.n)]
            # a chain that fails fails the episode: the others stop, none left stepping a closed env or awaiting a
            # reply that will never come
            trajectories = await gather_or_cancel(chains)
        for t in trajectories:  # the episode's count, on each of its trajectories (the learner logs the mean)
            t.metrics[PREFIX_BREAKS] = float(model.prefix.breaks)
        return trajectories

    def prompt_ids(self, prompt: Prompt, instructions: str | None) -> list[int]:
        """The row's prompt, its messages (a system prompt, earlier turns) included, with the environment's
        instructions, if there are any, in the system message: after the row's own system prompt."""
        if not (self.use_instructions and instructions):
            return list(prompt.token_ids)
        messages = list(prompt.data.get("messages") or [{"role": "user", "content": prompt.data["prompt"]}])
        if messages[0]["role"] in ("system", "developer"):  # the row's system message, under either name
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{instructions}"}
        else:
            messages.insert(0, {"role": "system", "content": instructions})
        return chat_prompt_ids(self.tokenizer, messages)

    async def run_chain(self, chain: int, prompt: Prompt, prompt_ids: list[int], env: EnvironmentService,
                        model: ModelClient) -> Trajectory:
        transcript = Transcript.of_prompt(prompt_ids)
        turn_ends, turn_rewards, counts = [], [], Counter({key: 0 for key in COUNTED})
        stop_reason = "num_turns"
        for turn in range(self.num_turns):
            output = await model.generate(f"{prompt.qid}:{chain}:{turn}", transcript.token_ids,
                                          self.turn_config(chain, turn, len(transcript.token_ids)))
            transcript.add_generated(output)
            turn_ends.append(len(transcript.token_ids))
            text = self.tokenizer.decode(output.output_ids[0], skip_special_tokens=True)
            observation, reward, terminated, truncated, info = await env.step((chain, text))
            turn_rewards.append(float(reward))
            counts.update({key: info.get(key, 0) for key in COUNTED})
            if terminated or truncated:
                stop_reason = "answer" if terminated else "truncated"
                break
            if turn == self.num_turns - 1:
                break
            piece = message_after_ids(self.tokenizer, output.output_ids[0], OBSERVATION_ROLE, observation or "")
            if len(transcript.token_ids) + len(piece) >= self.max_total_tokens:  # no room left to generate
                stop_reason = "token_budget"
                break
            transcript.add_observation(piece)
        metrics = {key: float(value) for key, value in counts.items()}
        metrics.update({TURNS: float(len(turn_ends))}, success=float(sum(turn_rewards) > 0))
        return Trajectory(token_ids=transcript.token_ids, loss_mask=transcript.loss_mask,
                          logprobs=transcript.logprobs, versions=transcript.versions, turn_ends=turn_ends,
                          turn_rewards=turn_rewards, reward=sum(turn_rewards), group_id=prompt.qid,
                          stop_reason=stop_reason, metrics=metrics, void=counts["void_turns"] > 0)

    def turn_config(self, chain: int, turn: int, used_tokens: int) -> GenerationConfig:
        """One sample; no longer than the budget allows; if seeded at all, a seed of its own per chain and turn (one
        per chain drew every turn from the same random stream)."""
        seed = None if self.gconfig.seed is None else self.gconfig.seed + chain + SEED_STRIDE * turn
        return dataclasses.replace(self.gconfig, n=1, seed=seed,
                                   max_new_tokens=min(self.gconfig.max_new_tokens, self.max_total_tokens - used_tokens))


register_agent("tool-calling", ToolCallingAgent)
