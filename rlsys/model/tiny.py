"""The tiny default policy: a Qwen2-shaped model of a few million parameters, warm-started locally.

No model hub is reachable on our CPU machines, so the default run builds its own model, teaches it
the answer format with a short supervised pass, and stops that pass at a held-out accuracy threshold
so that reinforcement learning has something left to do.
"""

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlsys.model.tokenizer import build_char_tokenizer
from rlsys.model.warm_start_examples import AnswerCheck, TaughtSequence, answer_ids

HELD_OUT_CHECKS = 200  # a warm start checks (and stops on) this many of its held-out examples, the first ones
LOG_EVERY_SECONDS = 15  # a warm start's progress line at most this often: alive, without a line per check
MAX_POSITIONS = 512  # multi-turn games run to a few hundred tokens; RoPE adds no parameters for it


def build_tiny_model(cfg, tokenizer, seed: int):
    """A Qwen2ForCausalLM. transformers' model classes are imported here, not with the module: the launcher
    imports this module to find a cached model, and the model classes take seconds to import."""
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
def _answers(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, **sampling) -> list[str]:
    """The model's answer to each prompt, left-padded in chunks of 256 (greedy unless `sampling` says otherwise)."""
    model.eval()
    pad, texts = tokenizer.pad_token_id, []
    for start in range(0, len(prompts), 256):
        chunk = prompts[start:start + 256]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=model.device)
        out = model.generate(ids, attention_mask=(ids != pad).long(), max_new_tokens=max_new_tokens,
                             pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, **sampling)
        texts += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    model.train()
    return texts


def _room(tokenizer, examples: list[AnswerCheck]) -> int:
    """New tokens enough for the longest accepted answer."""
    return max(len(answer_ids(tokenizer, a)) for example in examples for a in example.accepted)


def greedy_accuracy(model, tokenizer, examples: list[AnswerCheck], max_new_tokens: int | None = None) -> float:
    """Fraction of examples whose greedy answer is one they accept, exactly (None: room for the longest one)."""
    texts = _answers(model, tokenizer, [example.prompt_ids for example in examples],
                     max_new_tokens or _room(tokenizer, examples), do_sample=False)
    return sum(example.right(text) for text, example in zip(texts, examples)) / len(examples)


def sampled_reach(model, tokenizer, examples: list[AnswerCheck], samples: int, temperature: float,
                  seed: int) -> float:
    """Fraction of examples with an accepted answer among `samples` answers sampled at `temperature`: the share of
    prompts whose group of that many rollouts holds a right one, the groups GRPO learns from."""
    if temperature == 0:  # every sample is the greedy answer
        return greedy_accuracy(model, tokenizer, examples)
    prompts = [example.prompt_ids for example in examples for _ in range(samples)]
    # Seeded, and the caller's generator left as it was: the same draws at every check of every run.
    with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
        torch.manual_seed(seed)
        texts = _answers(model, tokenizer, prompts, _room(tokenizer, examples), do_sample=True,
                         temperature=temperature, top_k=0, top_p=1.0)
    return sum(any(example.right(text) for text in texts[i * samples:(i + 1) * samples])
               for i, example in enumerate(examples)) / len(examples)


@dataclass
class WarmStartStop:
    """When a warm start may stop: greedy accuracy at least `accuracy`, and, when `reach` is set, at least that share
    of problems with a right answer among `samples` sampled at `temperature` (so RL has groups to learn from)."""

    accuracy: float
    reach: float = 0.0
    samples: int = 8
    temperature: float = 1.0

    def met(self, accuracy: float, reach: float | None) -> bool:
        """Whether a check's greedy accuracy and reach (None: not sampled) are enough to stop."""
        return accuracy >= self.accuracy and (not self.reach or (reach is not None and reach >= self.reach))


def warm_start(model, tokenizer, train_examples, eval_examples, stop: WarmStartStop, seed: int,
               max_steps: int = 3000, eval_every: int = 25, lr: float = 1e-3, batch_size: int = 64,
               log=None) -> tuple[float, float | None]:
    """Supervised steps until `stop` is met on the held-out examples; returns the last check's greedy accuracy and
    reach (None where reach was not measured). `log(line)`, if given, hears a check's figures at most every
    LOG_EVERY_SECONDS, so a long warm start shows it is moving in a few lines."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)  # one kernel, not a loop over tensors
    model.train()
    accuracy, reach, logged = 0.0, None, time.monotonic()
    batch_size = min(batch_size, len(train_examples))  # a dataset smaller than a batch: all of it each step
    for step in range(1, max_steps + 1):
        optimizer.zero_grad()
        supervised_backward(model, tokenizer, rng.sample(train_examples, batch_size))
        optimizer.step()
        if step % eval_every == 0 or step == max_steps:  # the last step's model is the one saved: its figures
            accuracy = greedy_accuracy(model, tokenizer, eval_examples)
            # Sampled only once greedy answers are enough; None otherwise, not an earlier check's figure.
            reach = (sampled_reach(model, tokenizer, eval_examples, stop.samples, stop.temperature, seed)
                     if stop.reach and accuracy >= stop.accuracy else None)
            if stop.met(accuracy, reach):
                break
            if log and time.monotonic() - logged >= LOG_EVERY_SECONDS:
                log(f"warm start step {step}: held-out accuracy {accuracy:.1%}{_reach_text(reach, stop)} "
                    f"(stops at {stop.accuracy:.0%}{f', reach {stop.reach:.0%}' if stop.reach else ''})")
                logged = time.monotonic()
    return accuracy, reach


def _reach_text(reach: float | None, stop: WarmStartStop) -> str:
    return "" if reach is None else f", a right answer among {stop.samples} samples for {reach:.1%}"


def prepare_tiny_model(cfg, seed: int, examples: Callable[[object], tuple[list, list]], directory: Path,
                       log=print, batch_size: int = 64, eval_every: int = 25, max_steps: int = 3000,
                       threads: int = 0, samples: int = 8, temperature: float = 1.0) -> Path:
    """Builds, warm-starts and saves the tiny model (HF format) in `directory` (rlsys/assets.py looks for a cached
    one there first, without importing this module).

    `examples(tokenizer)` gives the TaughtSequences and the held-out AnswerChecks.
    `batch_size` sequences a step, a held-out check every `eval_every` steps, at most `max_steps` steps,
    `threads` torch threads (0: as they are); with `cfg.warm_start_reach`, `samples` answers a problem sampled at
    `temperature` (the run's group and temperature) measure it.
    """
    started = time.monotonic()
    tokenizer = build_char_tokenizer()
    train_examples, eval_examples = examples(tokenizer)
    # On a GPU where there is one: the long-answer task's warm start takes about 2 hours on 2 CPU cores.
    model = build_tiny_model(cfg, tokenizer, seed).to("cuda" if torch.cuda.is_available() else "cpu")
    n_params = sum(p.numel() for p in model.parameters())
    stop = WarmStartStop(cfg.warm_start_accuracy, cfg.warm_start_reach, samples, temperature)
    reach_goal = f" and a right answer among {samples} samples for {stop.reach:.0%}" if stop.reach else ""
    log(f"building the tiny default model ({n_params / 1e6:.1f}M parameters), warm start to "
        f"{stop.accuracy:.0%} held-out accuracy{reach_goal} on the {model.device.type.upper()}")
    checks = eval_examples[:HELD_OUT_CHECKS]
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        accuracy, reach = warm_start(model, tokenizer, train_examples, checks, stop, seed,
                                     max_steps=max_steps, eval_every=eval_every, batch_size=batch_size, log=log)
    finally:
        torch.set_num_threads(previous_threads)
    stopped = "" if stop.met(accuracy, reach) else f", at its limit of {max_steps} steps,"
    log(f"warm start reached {accuracy:.1%}{_reach_text(reach, stop)} on {len(checks)} held-out "
        f"examples{stopped} in {time.monotonic() - started:.0f}s")
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
