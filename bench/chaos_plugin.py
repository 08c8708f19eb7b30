"""The faults `bench/chaos.py` injects from inside a run: a plugin file (`plugins=[bench/chaos_plugin.py]`).

Registers the experiment `chaos-math`: the default math experiment whose environment and agent misbehave on a
seeded share of the training prompts (never on held-out ones, so both runs are scored alike). Which prompts, and
how, follows from the problem's text and RLSYS_CHAOS_SEED, so two runs with the same seed break on the same problems:

- the environment's step (the reward) raises, or hangs for an hour (past `env_timeout`);
- the agent raises;
- a hostile client: before its episode, the agent opens a session on the rollout worker's OpenAI-compatible
  endpoint and sends it malformed, oversized and out-of-bounds requests under the episode's own key, one valid
  request, and calls under a wrong key and under the key once it is closed. Each reply's status and the field its
  error names go as a JSON line to RLSYS_CHAOS_LOG.
"""

import asyncio
import dataclasses
import hashlib
import json
import os

from experiments import AsyncPPOMATHConfig, register_experiment
from rlsys.api import AgentAbstraction, EnvServiceAbstraction, GenerationConfig, Model, register_agent, \
    register_environment
from rlsys.impl.agent.math_single_step import MathSingleStepAgent
from rlsys.impl.env.math_code_single_step import MathCodeSingleStepEnv

# Each fault's share of the prompts: disjoint slices of [0, 1).
SHARES = {"env_raises": (0.00, 0.02), "env_hangs": (0.02, 0.04), "agent_raises": (0.04, 0.06),
          "hostile_client": (0.06, 0.09)}

CHAT = {"model": "rlsys", "messages": [{"role": "user", "content": "12+34="}], "max_tokens": 4}
# name -> (path, raw body, the status a sound endpoint answers, the field its error names)
HOSTILE = {
    "negative max_tokens": ("/chat/completions", json.dumps({**CHAT, "max_tokens": -5}), 400, "max_tokens"),
    "a million samples": ("/chat/completions", json.dumps({**CHAT, "n": 1_000_000}), 400, "n"),
    "temperature hot": ("/chat/completions", json.dumps({**CHAT, "temperature": "hot"}), 400, "temperature"),
    "NaN temperature": ("/chat/completions", json.dumps({**CHAT, "temperature": float("nan")}), 400, "temperature"),
    "top_p 7": ("/chat/completions", json.dumps({**CHAT, "top_p": 7}), 400, "top_p"),
    "seed 2**70": ("/chat/completions", json.dumps({**CHAT, "seed": 2**70}), 400, "seed"),
    "max_tokens 1e400": ("/chat/completions", json.dumps({**CHAT, "max_tokens": 42}).replace("42", "1e400"), 400,
                         "max_tokens"),
    "20,000 stop strings": ("/chat/completions", json.dumps({**CHAT, "stop": ["x"] * 20_000}), 400, "stop"),
    "tools [1]": ("/chat/completions", json.dumps({**CHAT, "tools": [1]}), 400, "tools[0]"),
    "a dict as content": ("/chat/completions", json.dumps({**CHAT, "messages": [{"role": "user", "content": {}}]}),
                          400, "messages[0].content"),
    "JSON 100,000 deep": ("/chat/completions", '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, None),
    "not JSON": ("/chat/completions", "{'messages': ", 400, None),
    "10 MB": ("/chat/completions", json.dumps({**CHAT, "user": "x" * 10 * 2**20}), 413, None),
}


def share(qid: str, text: str) -> str | None:
    """The fault this training problem gets in this run's chaos, if any."""
    if not qid.startswith("train-"):
        return None
    digest = hashlib.blake2b(f"{os.environ.get('RLSYS_CHAOS_SEED', '0')}:{text}".encode(), digest_size=8).digest()
    u = int.from_bytes(digest, "big") / 2**64
    return next((name for name, (low, high) in SHARES.items() if low <= u < high), None)


class ChaosEnv(MathCodeSingleStepEnv):
    async def reset(self, seed=None, options=None):
        self.problem = options["prompt"]
        return await super().reset(seed, options)

    async def step(self, action):
        fault = share(action[0], self.problem)  # action is (qid, answers)
        if fault == "env_raises":
            raise ConnectionResetError("chaos: the reward service dropped the connection")
        if fault == "env_hangs":
            await asyncio.sleep(3600)
        return await super().step(action)


class ChaosAgent(MathSingleStepAgent):
    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        fault = share(prompt.qid, prompt.data["prompt"])
        if fault == "agent_raises":
            raise RuntimeError("chaos: the agent hit a bug")
        if fault == "hostile_client":
            await self.attack_endpoint(obs_queue, act_queue)
        return await super().collect_trajectory(prompt, env, obs_queue, act_queue)

    async def attack_endpoint(self, obs_queue, act_queue) -> None:
        import httpx

        from rlsys.endpoint.server import shared_endpoint
        from rlsys.endpoint.session import EpisodeSession

        endpoint = await shared_endpoint()
        results = []
        async with Model(obs_queue, act_queue) as model, httpx.AsyncClient(timeout=60) as client:
            defaults = GenerationConfig(**{**self.gconfig.to_dict(), "n": 1})
            key = endpoint.open(EpisodeSession(model, self.tokenizer, defaults, 256, "rlsys"))

            async def post(name, path, body, expected, param, as_key):
                try:
                    response = await client.post(endpoint.base_url + path, content=body.encode(), headers={
                        "Authorization": f"Bearer {as_key}", "Content-Type": "application/json"})
                    status = response.status_code
                    named = response.json().get("error", {}).get("param") if status >= 400 else None
                except (httpx.HTTPError, ValueError) as e:  # no answer, or not JSON: what a sound endpoint never does
                    status, named = 0, f"{type(e).__name__}: {e}"
                results.append({"request": name, "status": status, "expected": expected, "param": named,
                                "expected_param": param})

            for name, (path, body, expected, param) in HOSTILE.items():
                await post(name, path, body, expected, param, key)
            await post("valid", "/chat/completions", json.dumps(CHAT), 200, None, key)
            await post("a wrong key", "/chat/completions", json.dumps(CHAT), 401, None, "rlsys-not-a-key")
            endpoint.close(key)
            await post("the key once closed", "/chat/completions", json.dumps(CHAT), 410, None, key)
        with open(os.environ["RLSYS_CHAOS_LOG"], "a") as log:
            log.writelines(json.dumps(r) + "\n" for r in results)


register_environment("chaos-math-env", ChaosEnv)
register_agent("chaos-math-agent", ChaosAgent)


@dataclasses.dataclass
class ChaosMathExperiment(AsyncPPOMATHConfig):
    @property
    def agent(self):
        return AgentAbstraction("chaos-math-agent", dict(super().agent.args))

    @property
    def env(self):
        return EnvServiceAbstraction("chaos-math-env", dict(super().env.args))


register_experiment("chaos-math", ChaosMathExperiment)
