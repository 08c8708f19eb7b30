"""An awaitable model over an episode's two queues: `await model.generate(token_ids, gconfig)`.

The queues stay the contract (an agent may still put `(qid, token_ids, gconfig)` on `obs_queue` itself);
this helper owns what every agent otherwise repeats: a request id per call, and handing each reply,
whatever order the inference workers finish in, to the coroutine that asked for it. Routing, batching,
versions and interruption on weight updates are the same as for any request on the queues.
"""

import asyncio
import itertools

from rlsys.api.generation import GenerationConfig, GenerationOutput, ModelRequest
from rlsys.api.messages import parse_generation_config


class Model:
    """Use as `async with Model(obs_queue, act_queue) as model:`; any number of coroutines of one episode
    may `await model.generate(...)` at once."""

    def __init__(self, obs_queue: asyncio.Queue, act_queue: asyncio.Queue):
        self.obs_queue, self.act_queue = obs_queue, act_queue
        self.pending: dict[str, asyncio.Future] = {}
        self.router: asyncio.Task | None = None
        self.request_ids = (f"request-{i}" for i in itertools.count())

    async def __aenter__(self) -> "Model":
        self.router = asyncio.create_task(self._route())
        return self

    async def __aexit__(self, *exc) -> None:
        self.router.cancel()
        for future in self.pending.values():
            future.cancel()

    async def generate(self, token_ids: list[int], gconfig: GenerationConfig) -> GenerationOutput:
        """`gconfig.n` continuations of `token_ids`, with per-token logprobs and versions."""
        return await self.request(next(self.request_ids), token_ids, gconfig)

    async def request(self, qid: str, token_ids: list[int], gconfig: GenerationConfig) -> GenerationOutput:
        """`generate` under an id the caller chose (it comes back as the output's qid). Settings outside the
        bounds every request is held to raise InvalidMessage here, in the caller, naming the field."""
        if self.router is None:
            raise RuntimeError("use the model as `async with Model(obs_queue, act_queue) as model:`")
        if qid in self.pending:
            raise ValueError(f"request {qid!r} is already in flight; qids of concurrent requests must differ")
        parse_generation_config(gconfig.to_dict())
        future = asyncio.get_running_loop().create_future()
        self.pending[qid] = future
        await self.obs_queue.put(ModelRequest(qid, list(token_ids), gconfig))
        return await future

    async def _route(self) -> None:
        while True:
            output: GenerationOutput = await self.act_queue.get()
            future = self.pending.pop(output.qid, None)
            if future is not None and not future.done():
                future.set_result(output)
