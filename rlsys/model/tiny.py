"""The tiny default policy: a Qwen2-shaped model of a few million parameters, warm-started locally.

No model hub is reachable on our CPU machines, so the default run builds its own model, teaches it
the answer format with a short supervised pass, and stops that pass at a held-out accuracy threshold
so that reinforcement learning has something left to do.
"""

import hashlib
import json
import random
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlsys.model.tokenizer import build_char_tokenizer, chat_prompt_ids

MAX_POSITIONS = 256


def build_tiny_model(cfg, tokenizer, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=2 * cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    return Qwen2ForCausalLM(config)


def _supervised_batch(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt+answer+eos ids and labels that score only the answer and eos."""
    sequences, labels = [], []
    for row in rows:
        prompt = chat_prompt_ids(tokenizer, row["prompt"])
        answer = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        sequences.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, sequences))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
    lab = torch.tensor([l + [-100] * (width - len(l)) for l in labels])
    return ids, lab


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int = 4) -> float:
    """Fraction of rows whose greedy answer equals the reference exactly (all prompts share a length)."""
    model.eval()
    prompts = [chat_prompt_ids(tokenizer, row["prompt"]) for row in rows]
    correct = 0
    for start in range(0, len(rows), 256):
        chunk = prompts[start:start + 256]
        width = max(map(len, chunk))
        pad = tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        out = model.generate(ids, attention_mask=(ids != pad).long(), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        correct += sum(text.strip() == row["answer"] for text, row in zip(texts, rows[start:start + 256]))
    model.train()
    return correct / len(rows)


def warm_start(model, tokenizer, train_rows, eval_rows, target_accuracy: float, seed: int,
               max_steps: int = 3000, eval_every: int = 25, lr: float = 1e-3, batch_size: int = 64) -> float:
    """Supervised steps until greedy held-out accuracy reaches `target_accuracy`; returns the accuracy."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    accuracy = 0.0
    for step in range(1, max_steps + 1):
        ids, labels = _supervised_batch(tokenizer, rng.sample(train_rows, batch_size))
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % eval_every == 0:
            accuracy = greedy_accuracy(model, tokenizer, eval_rows)
            if accuracy >= target_accuracy:
                break
    return accuracy


def tiny_model_dir(cfg, seed: int, dataset_dir: Path) -> Path:
    """Cache directory keyed by everything that changes the model."""
    key = json.dumps({"model": vars(cfg), "seed": seed, "data": str(dataset_dir)}, sort_keys=True, default=str)
    return Path(cfg.cache_dir).expanduser() / "models" / hashlib.sha256(key.encode()).hexdigest()[:16]


def prepare_tiny_model(cfg, seed: int, train_rows, eval_rows, directory: Path, log=print) -> Path:
    """Builds, warm-starts and saves the tiny model (HF format) unless `directory` already holds one."""
    if (directory / "config.json").exists():
        return directory
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(cfg, tokenizer, seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"building the tiny default model ({n_params / 1e6:.1f}M parameters), warm start to "
        f"{cfg.warm_start_accuracy:.0%} held-out accuracy")
    accuracy = warm_start(model, tokenizer, train_rows, eval_rows[:200], cfg.warm_start_accuracy, seed)
    log(f"warm start reached {accuracy:.1%} on 200 held-out problems")
    tmp = directory.with_name(directory.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(directory)
    return directory
