"""Rewards from a model (ROLL's `reward_pretrain`): a Hugging Face sequence-classification model scores
(prompt, response) pairs.

`RewardModelScorer` is the plug-in any environment can use: `await scorer(path).score(prompts, responses,
timeout)` gives one `Verdict`-like `Score` per response. Requests from every episode of the process go to
one queue; a thread of its own takes what has accumulated (up to `batch_size` pairs) and scores it in one
padded forward pass, so the model is loaded once, batches fill across episodes, and the event loop never
waits on torch. A pair that is not scored within `timeout` seconds of being asked gets status "timeout",
one whose batch raised gets "error", both reward 0, as the math check's verdicts do; the episode goes on.
(A thread cannot be killed as the math check's processes are: a forward pass that hangs keeps the
thread, and later pairs time out too, each counted.) `close`, also run at exit, ends the thread once its batch
in progress is scored: a thread still in a forward pass as the interpreter exits aborts the whole process (CPython
ends such a thread inside torch's C++, which calls std::terminate), and with it the rollout role's clean exit.

The score is the model's one logit (`num_labels=1`, as reward models are trained), or with two labels
the probability of label 1. The pair is rendered by the reward model's chat template as a user and an
assistant message when its tokenizer has one, else as a text pair.

`reward-model` is the environment built on it: one step scores a group of answers to one prompt.
"""

import asyncio
import atexit
import contextlib
import logging
import queue
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from rlsys.api import EnvironmentService, register_environment
from rlsys.blocking_calls import settle_from_thread

log = logging.getLogger(__name__)
CLOSE_WAIT_SECONDS = 15.0  # for the batch in progress; within the grace the launcher gives a stopping role


@dataclass(frozen=True)
class Score:
    """One pair's reward; `status` says whether `reward` came from the model ("ok") or is a stand-in 0."""

    reward: float
    status: str  # "ok" | "timeout" | "error"
    reason: str = ""


class RewardModelScorer:
    def __init__(self, path: str, batch_size: int = 16, max_length: int = 1024, num_threads: int = 1):
        import torch
        from transformers import AutoModelForSequenceClassification

        from rlsys.model.tokenizer import load_tokenizer

        self.path, self.batch_size, self.max_length = path, batch_size, max_length
        self.tokenizer = load_tokenizer(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path).eval()
        labels = self.model.config.num_labels
        if labels not in (1, 2):
            raise ValueError(f"reward model {path} has {labels} labels; a reward model has 1 (its score) or 2 "
                             "(the probability of label 1 is the score)")
        if self.tokenizer.pad_token is None:  # the model finds each row's last token by the pad id
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self._torch, self._num_threads = torch, num_threads
        self.closed = False
        self._lock = threading.Lock()  # no request is queued behind close()'s None
        self._requests: queue.SimpleQueue = queue.SimpleQueue()  # (prompt, response, future, loop); None: closed
        self._thread = threading.Thread(target=self._serve, daemon=True, name="reward-model")
        self._thread.start()
        atexit.register(self.close)

    async def score(self, prompts: list[str], responses: list[str], timeout: float) -> list[Score]:
        """One score per (prompt, response), in order; `timeout` (seconds, 0: none) counts from this call."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in responses]
        with self._lock:
            if self.closed:
                raise RuntimeError(f"the scorer of reward model {self.path} is closed")
            for prompt, response, future in zip(prompts, responses, futures, strict=True):
                self._requests.put((prompt, response, future, loop))
        try:
            done, _ = await asyncio.wait(futures, timeout=timeout or None)
        finally:  # timed out or cancelled: the pairs still queued are skipped, not scored for nobody
            for future in futures:
                future.cancel()
        return [f.result() if f in done else Score(0.0, "timeout", f"not scored within {timeout:g}s")
                for f in futures]

    def forward(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Scores of a batch of (prompt, response) pairs: one padded forward pass."""
        torch = self._torch
        if self.tokenizer.chat_template:
            chats = [[{"role": "user", "content": p}, {"role": "assistant", "content": r}] for p, r in pairs]
            texts = [self.tokenizer.apply_chat_template(chat, tokenize=False) for chat in chats]
            batch = self.tokenizer(texts, add_special_tokens=False, padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt")
        else:
            batch = self.tokenizer([p for p, _ in pairs], [r for _, r in pairs], padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt")
        with torch.inference_mode():
            logits = self.model(**batch).logits.float()
        scores = logits[:, 0] if logits.shape[1] == 1 else logits.softmax(-1)[:, 1]
        return scores.tolist()

    def close(self, wait: float = CLOSE_WAIT_SECONDS) -> None:
        """Pairs still queued get "error" at once; the thread ends once it has scored its batch in progress (waited
        for up to `wait` seconds). Idempotent, and also run at exit."""
        queued = []
        with self._lock:
            if self.closed:
                return
            self.closed = True
            with contextlib.suppress(queue.Empty):
                while True:
                    queued.append(self._requests.get_nowait())
            self._requests.put(None)
        for item in queued:
            _answer(item, Score(0.0, "error", "the reward model's scorer was closed"))
        atexit.unregister(self.close)
        self._thread.join(wait)
        if self._thread.is_alive():  # a hung forward pass
            log.warning("reward model %s still scoring %gs after close; the process may abort at exit", self.path,
                        wait)

    def _serve(self) -> None:
        if self._num_threads:
            self._torch.set_num_threads(self._num_threads)
        closing = False
        while not closing:
            batch = [self._requests.get()]
            while batch[-1] is not None and len(batch) < self.batch_size:
                try:
                    batch.append(self._requests.get_nowait())
                except queue.Empty:
                    break
            closing = batch[-1] is None
            batch = [item for item in batch if item is not None and not item[2].done()]  # done: timed out queued
            if not batch:
                continue
            try:
                scores = [Score(s, "ok") for s in self.forward([(p, r) for p, r, _, _ in batch])]
            except Exception as e:  # a bad batch fails its pairs, not the thread
                log.warning("reward model %s failed on a batch of %d: %s", self.path, len(batch), e)
                scores = [Score(0.0, "error", f"{type(e).__name__}: {e}")] * len(batch)
            for item, score in zip(batch, scores):
                _answer(item, score)


def _answer(item: tuple, score: Score) -> None:
    """Resolves a request's future on the loop that asked."""
    _, _, future, loop = item
    settle_from_thread(loop, future, score)


@lru_cache(maxsize=4)
def shared_scorer(path: str, batch_size: int = 16, max_length: int = 1024) -> RewardModelScorer:
    """The process's scorer for `path`: every environment instance of a rollout worker shares one model."""
    return RewardModelScorer(path, batch_size, max_length)


class RewardModelEnv(EnvironmentService):
    """`reset` takes the row (its `prompt`), one `step` scores all answers of the group and ends."""

    @classmethod
    def check_args(cls, model_path: str = "", **_) -> None:
        if not model_path:
            raise ValueError("reward-model needs model_path: an HF sequence-classification checkpoint directory")
        path = Path(model_path).expanduser()
        if path.exists() and not (path / "config.json").is_file():
            raise ValueError(f"reward-model's model_path {model_path!r} is not an HF checkpoint directory (no "
                             "config.json): give a directory written by save_pretrained")
        if not path.exists() and (path.is_absolute() or model_path.startswith((".", "~")) or len(path.parts) > 2):
            raise ValueError(f"reward-model's model_path {model_path!r} does not exist: give an HF "
                             "sequence-classification checkpoint directory")  # `org/name` may be a hub id

    def __init__(self, model_path: str, timeout: float = 60.0, batch_size: int = 16, max_length: int = 1024):
        self.check_args(model_path)
        self.scorer = shared_scorer(model_path, batch_size, max_length)
        self.timeout = timeout
        self.prompt: str | None = None

    async def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        if not options or "prompt" not in options:
            raise KeyError(f"reward-model needs options['prompt'] (the dataset row); got {options!r}")
        self.prompt = str(options["prompt"])
        return None, {}

    async def step(self, action: tuple[Any, list[str]]) -> tuple[Any, list[float], bool, bool, dict]:
        """`action` is (qid, answers); each reward is the model's score (0 where it timed out or failed)."""
        if self.prompt is None:
            raise RuntimeError("step() before reset(): no prompt to score against")
        _qid, answers = action
        scores = await self.scorer.score([self.prompt] * len(answers), answers, self.timeout)
        info = {"statuses": [s.status for s in scores], "reasons": [s.reason for s in scores]}
        return None, [s.reward for s in scores], True, False, info


register_environment("reward-model", RewardModelEnv)
