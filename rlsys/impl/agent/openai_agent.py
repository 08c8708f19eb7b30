"""`openai-agent`: trains any agent written against an OpenAI-compatible API, token-exact.

The user writes `async def run(base_url, api_key, prompt) -> reward or None` with whatever client they like
(the `openai` client, LangGraph through langchain-openai, ...). Per prompt the agent runs it `gconfig.n`
times at once (the group), each run with an API key of its own on the rollout worker's endpoint
(rlsys/endpoint), and turns what each run's calls recorded into trajectories: the model's ids with loss mask
1 and their versions and logprobs, everything else loss mask 0. The reward is what `run` returns, or, when it
returns None, the environment's verdict on the run's last answer (`env.step((qid, [answer]))`, the math
environments' contract). A run that raises fails the episode (`agent_error`), one that takes longer than
`timeout` seconds fails it with `agent_timeout`; its calls are refused from then on (410) and the run goes on.
"""

import asyncio

from rlsys.api import Agent, EnvironmentService, GenerationConfig, Model, Prompt, Trajectory, register_agent
from rlsys.endpoint.address import listen_address
from rlsys.errors import EpisodeFailed
from rlsys.model.tokenizer import load_tokenizer
from rlsys.plugins import load_function


class OpenAIAgent(Agent):
    def __init__(self, gconfig: GenerationConfig, tokenizer_path: str, run: str, max_total_tokens: int = 256,
                 timeout: float = 300.0, host: str = "127.0.0.1", model_name: str = "rlsys"):
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if max_total_tokens < 2:  # else every call of every run is refused, and each episode fails on it
            raise ValueError(f"max_total_tokens must leave room for a prompt and a reply (2 or more), got "
                             f"{max_total_tokens}")
        listen_address(host)  # a host that cannot be resolved fails here (at start), not in every episode
        self.gconfig, self.run_entry = gconfig, run
        self.run = load_function(run, "agent function", coroutine=True)
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.max_total_tokens, self.timeout, self.host, self.model_name = max_total_tokens, timeout, host, model_name

    async def collect_trajectory(self, prompt: Prompt, env: EnvironmentService, obs_queue: asyncio.Queue,
                                 act_queue: asyncio.Queue) -> list[Trajectory]:
        # Here, not at the top: FastAPI and uvicorn load only where an agent serves.
        from rlsys.endpoint.server import shared_endpoint
        from rlsys.endpoint.session import EpisodeSession

        await env.reset(options=prompt.data)
        endpoint = await shared_endpoint(self.host)
        defaults = GenerationConfig(**{**self.gconfig.to_dict(), "n": 1})  # a request's own n, 1 unless it asks
        async with Model(obs_queue, act_queue) as model:
            sessions = [EpisodeSession(model, self.tokenizer, defaults, self.max_total_tokens, self.model_name)
                        for _ in range(self.gconfig.n)]
            keys = [endpoint.open(session) for session in sessions]
            runs = [asyncio.create_task(self.run_once(endpoint.base_url, key, prompt)) for key in keys]
            try:
                rewards = await asyncio.gather(*runs)
            finally:  # one run failed (the episode fails): the others stop, and no key is served any more
                for run in runs:
                    run.cancel()
                for key in keys:
                    endpoint.close(key)
        return await self.trajectories(prompt, env, sessions, rewards)

    async def trajectories(self, prompt: Prompt, env: EnvironmentService, sessions: list,
                           rewards: list[float | None]) -> list[Trajectory]:
        """Each run's samples, with its reward: the function's, or the env's verdict on its last answer (and, where
        the env says so, the run's success)."""
        trajectories = []
        for session, reward in zip(sessions, rewards):
            success = None
            if reward is None:
                _, verdict, _, _, info = await env.step((prompt.qid, [session.conversation.final_text]))
                reward, success = _first(verdict), info.get("success")
            ours = session.conversation.trajectories(float(reward), prompt.qid)
            for trajectory in ours if success is not None else ():
                trajectory.metrics["success"] = float(_first(success))
            trajectories += ours
        return trajectories

    async def run_once(self, base_url: str, api_key: str, prompt: Prompt) -> float | None:
        try:
            async with asyncio.timeout(self.timeout) as deadline:
                return await self.run(base_url, api_key, prompt.data["prompt"])
        except TimeoutError:
            if not deadline.expired():  # the function's own (an HTTP call's): an agent_error like any other it raises
                raise
            raise EpisodeFailed("agent_timeout", f"{self.run_entry} took longer than {self.timeout:g}s") from None


def _first(value):
    """A one-answer step's figure: environments that score a list of answers give a list."""
    return value[0] if isinstance(value, (list, tuple)) else value


register_agent("openai-agent", OpenAIAgent)
