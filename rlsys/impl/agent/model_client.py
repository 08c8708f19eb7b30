"""An episode's side of its two queues when several requests are in flight: replies matched by qid."""

from rlsys.token_continuity import PrefixCheck
from rlsys.api import GenerationConfig, GenerationOutput
from rlsys.api.model import Model


class ModelClient(Model):
    """`await generate(qid, token_ids, gconfig)`: `rlsys.api.Model` with request ids the agent names
    (the built-in agents name them after chain and turn), and the token-prefix check of its turns. Use as
    `async with`."""

    def __init__(self, obs_queue, act_queue):
        super().__init__(obs_queue, act_queue)
        self.prefix = PrefixCheck()  # `prefix.breaks`: requests that did not extend an earlier turn

    async def generate(self, qid: str, token_ids: list[int], gconfig: GenerationConfig) -> GenerationOutput:
        self.prefix.request(qid, token_ids)
        output = await self.request(qid, token_ids, gconfig)
        self.prefix.reply(token_ids, output.output_ids)
        return output
