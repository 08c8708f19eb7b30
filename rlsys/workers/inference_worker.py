"""The inference worker: drains generation requests from the bus into batched engine calls."""

import logging
from collections import defaultdict

from rlsys import protocol
from rlsys.api import GenerationConfig

log = logging.getLogger(__name__)


class InferenceWorker:
    def __init__(self, engine, bus, index: int, max_batch_requests: int):
        self.engine, self.bus, self.index = engine, bus, index
        self.max_batch_requests = max_batch_requests
        self.bus.set(protocol.inference_version(index), engine.version)

    def run(self) -> None:
        while not self.bus.get(protocol.STOP):
            self.load_newest_weights()
            requests = self.bus.get_many(protocol.OBSERVATIONS, self.max_batch_requests, timeout=0.05)
            if requests:
                self.serve(requests)

    def load_newest_weights(self) -> None:
        """Between engine calls, so every token of a request comes from one version (and says which)."""
        published = self.bus.get(protocol.WEIGHTS)
        if published and published["version"] > self.engine.version:
            self.engine.update_weights(published["path"], published["version"])
            self.bus.set(protocol.inference_version(self.index), self.engine.version)

    def serve(self, requests: list[dict]) -> None:
        batch = [(r["rid"], r["token_ids"], GenerationConfig.from_dict(r["gconfig"])) for r in requests]
        outputs = self.engine.generate(batch)
        by_reply_queue = defaultdict(list)
        for request, output in zip(requests, outputs):
            by_reply_queue[request["reply_to"]].append(output.to_dict())
        for queue, messages in by_reply_queue.items():
            self.bus.put_many(queue, messages)
