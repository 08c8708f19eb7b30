"""The contract between the generation engine and a model backend: sequences in, token deltas out.

A backend runs many sequences at once and lets new ones join between steps (continuous batching). It
knows nothing of requests, groups or weight versions: `GenerationEngine` builds those on top, so every
backend (vLLM, transformers, the tests' scripted stand-in) gets interruptible weight updates for free.
"""

import abc
from dataclasses import dataclass, field


@dataclass
class SamplingSettings:
    """How one sequence is sampled. Logprobs are of the sampled token after temperature, which is what the
    learner recomputes. With top-p or top-k on, vLLM's logprobs are of the truncated, renormalised
    distribution (vLLM has no mode between), the transformers backend's of the full one: the learner's
    ratio then starts away from 1 on vLLM, and `ppo.decoupled_loss=true` is the objective that fits."""

    max_tokens: int
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's end-of-sequence token
    seed: int | None = None


@dataclass
class TokenDelta:
    """Tokens a sequence produced since the previous step."""

    seq_id: str
    token_ids: list[int]
    logprobs: list[float]
    # None while running; "stop" (eos or stop token, included), "length", or vLLM's "abort" or "error": an engine that
    # aborted or failed the sequence (rlsys asks for neither; its own aborts end sequences no one waits for)
    finish_reason: str | None = None


class GenerationBackend(abc.ABC):
    """One model serving many sequences; not thread-safe (the inference worker drives it from one thread)."""

    @abc.abstractmethod
    def add(self, seq_id: str, token_ids: list[int], sampling: SamplingSettings, arrival: float = 0.0) -> None:
        """Start a sequence; it is generated from the next `step` on. Raises ValueError for one this engine cannot
        take (a prompt that leaves no room within the model's length, a token outside its vocabulary): the inference
        worker answers its request with the reason.

        Sequences wait for a place in the batch in order of `arrival` (a monotonic time): a sequence
        resumed after a weight update keeps its request's place instead of queueing behind newer ones,
        which would make the oldest rollouts the stalest.
        """

    @abc.abstractmethod
    def step(self) -> list[TokenDelta]:
        """One engine iteration over every running sequence; returns what each produced (finished ones last time)."""

    @abc.abstractmethod
    def abort(self, seq_ids: list[str]) -> None:
        """Stop sequences now; tokens they produced since the last step are discarded."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """Whether any added sequence has not finished or been aborted."""

    loads_as_they_arrive = False
    """Whether `load_weights` takes tensors one by one from their `items()` as they arrive (vLLM's layerwise
    reload), so that loading overlaps the transfer; otherwise it is handed a whole dict."""

    loads_from_pinned_memory = False
    """Whether streamed weights should arrive in pinned memory: a GPU engine then copies them without a wait each."""

    @abc.abstractmethod
    def load_weights(self, weights) -> None:
        """Replace the weights in place, from tensors in memory (rlsys/weight_transport.py: a dict, or an object
        whose `items()` yields them as they arrive, for a backend that `loads_as_they_arrive`).

        Called with no sequence running; any cached prefix computed with the old weights is dropped.
        """

    def loaded_weights(self) -> dict | None:
        """The tensors this engine holds, under the learner's names, for the weight checksum
        (rlsys/weight_checksum.py); None for an engine that fuses or renames weights (vLLM: qkv_proj, gate_up_proj)
        and so cannot list its own under the learner's names: what is checked then is what it was given."""
        return None

    def close(self) -> None:
        """Let go of what would outlive the process: the inference role calls it last, before its quick exit."""

    def score(self, token_ids: list[int]) -> list[float]:
        """Logprob of each token after the first given its prefix, at temperature 1 (the weight-sync check); of the
        first ones only, for a sequence longer than the engine scores (vLLM: max_model_len - 1 tokens)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score sequences")

    def score_all(self, sequences: list[list[int]]) -> list[list[float]]:
        """`score` of each sequence; an engine that can score them in one pass overrides it."""
        return [self.score(ids) for ids in sequences]
