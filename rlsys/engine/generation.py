"""GenerationEngine: requests of n samples on a continuous-batching backend, each token tagged with its weights.

Weight updates interrupt generation instead of waiting for it (AReaL's policy): every unfinished sample is
stopped, the new weights are loaded, and the sample resumes from its prompt plus the tokens it already
has. Tokens keep the version that produced them and the logprob it gave them, so a request that spans an
update is a true record of two policies, which the decoupled loss is built for. Nothing is generated
twice and nothing is dropped; the cost is one prefill of prompt + partial output under the new weights.
"""

import time
from dataclasses import dataclass, field

from rlsys.api import GenerationConfig
from rlsys.api.messages import GenerationReply
from rlsys.engine.backend import GenerationBackend, SamplingSettings

SEGMENT_SEED_STRIDE = 1_000_003  # a resumed sample draws from a fresh, still reproducible, random stream


@dataclass
class _Sample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stop_reason: str | None = None
    segment: int = 0  # how many weight updates interrupted it

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None


@dataclass
class _Request:
    rid: str
    prompt_ids: list[int]
    gconfig: GenerationConfig
    samples: list[_Sample]
    arrival: float = field(default_factory=time.monotonic)


class GenerationEngine:
    """Not thread-safe: one thread adds requests, steps and updates weights, as the inference worker does."""

    def __init__(self, backend: GenerationBackend, version: int = 0):
        self.backend, self.version = backend, version
        self._requests: dict[str, _Request] = {}
        self.interrupted_samples = 0  # samples resumed after a weight update, over the engine's life

    @property
    def in_flight(self) -> int:
        """Requests added and not yet returned."""
        return len(self._requests)

    def is_running(self, rid: str) -> bool:
        return rid in self._requests

    def add_request(self, rid: str, prompt_ids: list[int], gconfig: GenerationConfig) -> None:
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already running")
        if gconfig.n < 1 or gconfig.max_new_tokens < 1:
            raise ValueError(f"request {rid!r} asks for n={gconfig.n}, max_new_tokens={gconfig.max_new_tokens}; "
                             "both must be at least 1")
        request = _Request(rid, list(prompt_ids), gconfig, [_Sample() for _ in range(gconfig.n)])
        self._requests[rid] = request
        for index in range(gconfig.n):
            self._start(request, index)

    def abort_request(self, rid: str) -> None:
        request = self._requests.pop(rid, None)
        if request is not None:
            self.backend.abort([_seq_id(rid, i, s.segment) for i, s in enumerate(request.samples) if not s.finished])

    def step(self) -> list[GenerationReply]:
        """One backend step; returns the requests whose every sample has finished."""
        done = []
        for delta in self.backend.step():
            rid, index, segment = _parse_seq_id(delta.seq_id)
            request = self._requests.get(rid)
            if request is None:
                continue  # aborted
            sample = request.samples[index]
            if segment != sample.segment:
                continue  # cannot happen with a backend that honours abort; never mix two segments' tokens
            sample.token_ids += delta.token_ids
            sample.logprobs += delta.logprobs
            sample.versions += [self.version] * len(delta.token_ids)
            sample.stop_reason = delta.finish_reason
            if delta.finish_reason is not None and all(s.finished for s in request.samples):
                done.append(_reply(self._requests.pop(rid)))
        return done

    def generate(self, requests: list[tuple[str, list[int], GenerationConfig]]) -> list[GenerationReply]:
        """Blocking: every request to completion, replies in the order given."""
        for rid, prompt_ids, gconfig in requests:
            self.add_request(rid, prompt_ids, gconfig)
        finished: dict[str, GenerationReply] = {}
        while len(finished) < len(requests):
            finished.update((reply.rid, reply) for reply in self.step())
        return [finished[rid] for rid, _, _ in requests]

    def update_weights(self, weights, version: int, probe: list[list[int]] = ()) -> tuple[int, list[list[float]]]:
        """Interrupt, score the `probe` sequences under the weights held while nothing runs, load `version` from
        `weights` (tensors: GenerationBackend.load_weights), resume; returns how many samples were
        interrupted and the probe's logprobs."""
        running = [(request, index) for request in self._requests.values()
                   for index, sample in enumerate(request.samples) if not sample.finished]
        self.backend.abort([_seq_id(r.rid, i, r.samples[i].segment) for r, i in running])
        scored = self.backend.score_all([list(ids) for ids in probe]) if probe else []
        self.backend.load_weights(weights)
        self.version = version
        for request, index in running:
            request.samples[index].segment += 1
            self._start(request, index)
        self.interrupted_samples += len(running)
        return len(running), scored

    def _start(self, request: _Request, index: int) -> None:
        g, sample = request.gconfig, request.samples[index]
        seed = None if g.seed is None else g.seed + index + SEGMENT_SEED_STRIDE * sample.segment
        settings = SamplingSettings(max_tokens=g.max_new_tokens - len(sample.token_ids), temperature=g.temperature,
                                    top_p=g.top_p, top_k=g.top_k, stop_token_ids=list(g.stop_token_ids), seed=seed)
        self.backend.add(_seq_id(request.rid, index, sample.segment), request.prompt_ids + sample.token_ids, settings,
                         request.arrival)


def _seq_id(rid: str, index: int, segment: int) -> str:
    return f"{rid}|{index}|{segment}"


def _parse_seq_id(seq_id: str) -> tuple[str, int, int]:
    rid, index, segment = seq_id.rsplit("|", 2)
    return rid, int(index), int(segment)


def _reply(request: _Request) -> GenerationReply:
    samples = request.samples
    return GenerationReply(rid=request.rid, prompt_ids=request.prompt_ids,
                           output_ids=[s.token_ids for s in samples], logprobs=[s.logprobs for s in samples],
                           versions=[s.versions for s in samples], stop_reasons=[s.stop_reason for s in samples])
