"""The plainest agent on the `openai` client: one chat call per run; the environment scores the answer.

    python3 training/main_async_ppo.py experiment=async-ppo-openai-agent \
        agent_function=rlsys.impl.agent.openai_example:run

Every run shares the rollout worker's HTTP connection pools (`shared_http_client`) and sends its own key: a
client of its own per run would build an SSL context each time, tens of milliseconds of CPU.
"""

import openai

from rlsys.endpoint.http_client import shared_http_client


async def run(base_url: str, api_key: str, prompt: str) -> float | None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                http_client=shared_http_client())
    await client.chat.completions.create(model="rlsys", messages=[{"role": "user", "content": prompt}])
    return None  # the environment scores the last answer
