"""An episode's side of its two queues when several requests are in flight: replies matched by qid."""

from rlsys.api import GenerationConfig, GenerationOutput
from rlsys.api.model import Model


class ModelClient(Model):
    """`await generate(qid, token_ids, gconfig)`: `rlsys.api.Model` with request ids the agent names
    (the built-in agents name them after chain and turn). Use as `async with`."""

    async def generate(self, qid: str, token_ids: list[int], gconfig: GenerationConfig) -> GenerationOutput:
        return await self.request(qid, token_ids, gconfig)
