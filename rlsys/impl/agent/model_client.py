"""An episode's side of its two queues when several requests are in flight: replies matched by qid."""

import asyncio

from rlsys.alarms import PrefixCheck
from rlsys.api import GenerationConfig, GenerationOutput


class ModelClient:
    """`await generate(qid, token_ids, gconfig)` from any number of coroutines of one episode at once.

    Replies come back on the episode's one act_queue in whatever order the inference workers finish;
    one routing task hands each to the coroutine that asked for it. Use as `async with`.
    """

    def __init__(self, obs_queue: asyncio.Queue, act_queue: asyncio.Queue):
        self.obs_queue, self.act_queue = obs_queue, act_queue
        self.pending: dict[str, asyncio.Future] = {}
        self.router: asyncio.Task | None = None
        self.prefix = PrefixCheck()  # `prefix.breaks`: requests that did not extend an earlier turn

    async def __aenter__(self) -> "ModelClient":
        self.router = asyncio.create_task(self._route())
        return self

    async def __aexit__(self, *exc) -> None:
        self.router.cancel()
        for future in self.pending.values():
            future.cancel()

    async def generate(self, qid: str, token_ids: list[int], gconfig: GenerationConfig) -> GenerationOutput:
        if qid in self.pending:
            raise ValueError(f"request {qid!r} is already in flight; qids of concurrent requests must differ")
        future = asyncio.get_running_loop().create_future()
        self.pending[qid] = future
        self.prefix.request(qid, token_ids)
        await self.obs_queue.put((qid, list(token_ids), gconfig))
        output = await future
        self.prefix.reply(token_ids, output.output_ids)
        return output

    async def _route(self) -> None:
        while True:
            output: GenerationOutput = await self.act_queue.get()
            future = self.pending.pop(output.qid, None)
            if future is not None and not future.done():
                future.set_result(output)
