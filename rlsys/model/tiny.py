"""The tiny default policy: a Qwen2-shaped model of a few million parameters, warm-started locally.

No model hub is reachable on our CPU machines, so the default run builds its own model, teaches it
the answer format with a short supervised pass, and stops that pass at a held-out accuracy threshold
so that reinforcement learning has something left to do.
"""

import hashlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlsys.model.tokenizer import build_char_tokenizer, chat_prompt_ids

LOG_EVERY_SECONDS = 15  # a warm start's progress line at most this often: alive, without a line per check
MAX_POSITIONS = 512  # multi-turn games run to a few hundred tokens; RoPE adds no parameters for it


@dataclass
class TaughtSequence:
    """A supervised sequence: its token ids, and 1 for each token the model is taught to produce (0: context)."""

    token_ids: list[int]
    taught: list[int]


@dataclass
class AnswerCheck:
    """A held-out check: a context, and every answer counted right for it (greedy, exact after stripping)."""

    prompt_ids: list[int]
    accepted: tuple[str, ...]


def answer_ids(tokenizer, answer: str) -> list[int]:
    return tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def arithmetic_warm_start(tokenizer, train_rows: list[dict],
                          eval_rows: list[dict]) -> tuple[list[TaughtSequence], list[AnswerCheck]]:
    """Each training prompt, as the rollout worker renders it, followed by its answer; held-out prompts to check."""
    taught = []
    for row in train_rows:
        prompt, answer = chat_prompt_ids(tokenizer, row["prompt"]), answer_ids(tokenizer, row["answer"])
        taught.append(TaughtSequence(prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return taught, [AnswerCheck(chat_prompt_ids(tokenizer, row["prompt"]), (row["answer"],)) for row in eval_rows]


def build_tiny_model(cfg, tokenizer, seed: int):
    """A Qwen2ForCausalLM. transformers' model classes are imported here, not with the module: the launcher and
    the rollout workers import this module for its examples, and the model classes take seconds to import."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=2 * cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    return Qwen2ForCausalLM(config)


def _supervised_batch(tokenizer, examples: list[TaughtSequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids, and labels that score only the taught tokens."""
    sequences = [example.token_ids for example in examples]
    labels = [[t if m else -100 for t, m in zip(example.token_ids, example.taught)] for example in examples]
    width = max(map(len, sequences))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
    lab = torch.tensor([l + [-100] * (width - len(l)) for l in labels])
    return ids, lab


def _length_groups(examples: list[TaughtSequence], ratio: float = 1.5) -> list[list[TaughtSequence]]:
    """The batch in groups of similar length, each at most `ratio` times its shortest. Padded to its longest
    sequence, a batch of arithmetic with a few long retries in it cost as much as a batch of long ones."""
    ordered = sorted(examples, key=lambda example: len(example.token_ids))
    groups = [[ordered[0]]]
    for example in ordered[1:]:
        if len(example.token_ids) > ratio * len(groups[-1][0].token_ids):
            groups.append([])
        groups[-1].append(example)
    return groups


def supervised_backward(model, tokenizer, examples: list[TaughtSequence]) -> None:
    """Gradients of the mean loss over the taught tokens of `examples`, a group of similar lengths at a time."""
    groups = [_supervised_batch(tokenizer, group) for group in _length_groups(examples)]
    counts = [int((labels[:, 1:] != -100).sum()) for _, labels in groups]  # the taught tokens scored
    total = sum(counts)
    for (ids, labels), count in zip(groups, counts):
        if count:  # each group's mean weighted by its share of the taught tokens: the whole batch's mean
            loss = model(input_ids=ids.to(model.device), labels=labels.to(model.device)).loss
            (loss * (count / total)).backward()


@torch.no_grad()
def greedy_accuracy(model, tokenizer, examples: list[AnswerCheck], max_new_tokens: int | None = None) -> float:
    """Fraction of examples whose greedy answer is one they accept, exactly (None: room for the longest one)."""
    if max_new_tokens is None:
        max_new_tokens = max(len(answer_ids(tokenizer, a)) for example in examples for a in example.accepted)
    model.eval()
    prompts = [example.prompt_ids for example in examples]
    correct = 0
    for start in range(0, len(prompts), 256):
        chunk = prompts[start:start + 256]
        width = max(map(len, chunk))
        pad = tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=model.device)
        out = model.generate(ids, attention_mask=(ids != pad).long(), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        # Both sides stripped: a working whose first line is right-aligned starts with spaces.
        correct += sum(text.strip() in {a.strip() for a in example.accepted}
                       for text, example in zip(texts, examples[start:start + 256]))
    model.train()
    return correct / len(examples)


def warm_start(model, tokenizer, train_examples, eval_examples, target_accuracy: float, seed: int,
               max_steps: int = 3000, eval_every: int = 25, lr: float = 1e-3, batch_size: int = 64,
               log=None) -> float:
    """Supervised steps until greedy held-out accuracy reaches `target_accuracy`; returns the accuracy.
    `log(line)`, if given, hears the accuracy of a check at most every LOG_EVERY_SECONDS, so a long warm start shows
    it is moving in a few lines."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)  # one kernel, not a loop over tensors
    model.train()
    accuracy, logged = 0.0, time.monotonic()
    for step in range(1, max_steps + 1):
        optimizer.zero_grad()
        supervised_backward(model, tokenizer, rng.sample(train_examples, batch_size))
        optimizer.step()
        if step % eval_every == 0:
            accuracy = greedy_accuracy(model, tokenizer, eval_examples)
            if accuracy >= target_accuracy:
                break
            if log and time.monotonic() - logged >= LOG_EVERY_SECONDS:
                log(f"warm start step {step}: held-out accuracy {accuracy:.1%} (stops at {target_accuracy:.0%})")
                logged = time.monotonic()
    return accuracy


def tiny_model_dir(cfg, seed: int, dataset_dir: Path, warm_start: dict) -> Path:
    """Cache directory keyed by everything that changes the model (`warm_start`: the experiment's own settings)."""
    fields = {"model": vars(cfg), "seed": seed, "data": str(dataset_dir), "warm_start": warm_start}
    key = json.dumps(fields, sort_keys=True, default=str)
    return Path(cfg.cache_dir).expanduser() / "models" / hashlib.sha256(key.encode()).hexdigest()[:16]


def prepare_tiny_model(cfg, seed: int, examples: Callable[[object], tuple[list, list]], directory: Path,
                       log=print, batch_size: int = 64, eval_every: int = 25, max_steps: int = 3000,
                       threads: int = 0) -> Path:
    """Builds, warm-starts and saves the tiny model (HF format) unless `directory` already holds one.

    `examples(tokenizer)` gives the TaughtSequences and the held-out AnswerChecks; it runs only when a model is built.
    `batch_size` sequences a step, a held-out check every `eval_every` steps, at most `max_steps` steps,
    `threads` torch threads (0: as they are).
    """
    if (directory / "config.json").exists():
        return directory
    started = time.monotonic()
    tokenizer = build_char_tokenizer()
    train_examples, eval_examples = examples(tokenizer)
    # On a GPU where there is one: the long-answer task's warm start takes about 2 hours on 2 CPU cores.
    model = build_tiny_model(cfg, tokenizer, seed).to("cuda" if torch.cuda.is_available() else "cpu")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"building the tiny default model ({n_params / 1e6:.1f}M parameters), warm start to "
        f"{cfg.warm_start_accuracy:.0%} held-out accuracy on the {model.device.type.upper()}")
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        accuracy = warm_start(model, tokenizer, train_examples, eval_examples[:200], cfg.warm_start_accuracy, seed,
                              max_steps=max_steps, eval_every=eval_every, batch_size=batch_size, log=log)
    finally:
        torch.set_num_threads(previous_threads)
    stopped = "" if accuracy >= cfg.warm_start_accuracy else f", at its limit of {max_steps} steps,"
    log(f"warm start reached {accuracy:.1%} on {len(eval_examples[:200])} held-out examples{stopped} "
        f"in {time.monotonic() - started:.0f}s")
    from transformers.utils import logging as hf_logging

    tmp = directory.with_name(directory.name + ".tmp")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-file "Writing model shards" bar says nothing on the console
    try:
        model.to("cpu").save_pretrained(tmp)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(tmp)
    tmp.rename(directory)
    return directory
