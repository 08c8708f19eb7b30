"""TRL's GRPOTrainer on bench/env_latency_task.py's 3-turn task, for bench/env_latency.py's `--trl` rows.

TRL has no multi-turn environment loop for free text (its `environment_factory` plays tool calls, which the tiny
model cannot write), so the task goes through its `rollout_func` (TRL 1.16, experimental), the way a TRL user
would write it: each batch's 128 conversations play in lockstep. Per turn, one batched HF `generate` for every
conversation (sampled, the run's temperature/top-p/top-k, up to `gen.max_new_tokens`), then every conversation's
environment step at once (`SlowSumsEnv`, the same class rlsys's run uses: one `env_latency` wait per turn for
the whole batch, not one per conversation), then the next user message appended as token ids rendered by rlsys's
own `ChatRenderer`, so the token layout is rlsys's: loss only on the model's tokens (`env_mask`), the
episode's reward the sum of its turns' rewards (rlsys's `turn_discount=1`).
"""

import asyncio
import os
import time
from pathlib import Path

from bench.env_latency_task import SlowSumsEnv
from bench.vs_trl import trl_arguments, trl_clock, trl_dataset


class SumsRollout:
    """TRL's `rollout_func(prompts, trainer)`: plays each prompt's conversation and returns its token record."""

    def __init__(self, config, tokenizer, prompts_by_content: dict):
        from rlsys.impl.agent.multi_turn import ChatRenderer

        self.config, self.tokenizer, self.prompts = config, tokenizer, prompts_by_content
        self.chat = ChatRenderer(tokenizer)

    def __call__(self, prompts: list[list[dict]], trainer) -> dict:
        from trl.models import unwrap_model_for_generation

        # As TRL's own generation does: gradient checkpointing off (it would also turn the KV cache off).
        with unwrap_model_for_generation(
                trainer.model_wrapped, trainer.accelerator,
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs) as model:
            return self.play(model, prompts)

    def play(self, model, prompts: list[list[dict]]) -> dict:
        from rlsys.impl.agent.multi_turn import gather_or_cancel

        turns = self.config.num_turns
        envs = [SlowSumsEnv(turns, self.config.env_latency) for _ in prompts]
        ours = [self.prompts[messages[-1]["content"]] for messages in prompts]  # rlsys's Prompt: ids already checked
        asyncio.run(gather_or_cancel(env.reset(options=p.data) for env, p in zip(envs, ours)))
        prompt_ids = [list(p.token_ids) for p in ours]
        completion, mask, logprobs = ([[] for _ in prompts] for _ in range(3))
        rewards = [0.0] * len(prompts)
        for _ in range(turns):
            responses, response_logprobs = self.generate(model, [p + c for p, c in zip(prompt_ids, completion)])
            texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
            steps = asyncio.run(gather_or_cancel(env.step(text) for env, text in zip(envs, texts)))
            for i, (board, reward, done, _, _) in enumerate(steps):
                rewards[i] += reward
                completion[i] += responses[i]
                mask[i] += [1] * len(responses[i])
                logprobs[i] += response_logprobs[i]
                if not done:
                    feedback = self.chat.message_ids("user", board, responses[i])
                    completion[i] += feedback
                    mask[i] += [0] * len(feedback)
                    logprobs[i] += [0.0] * len(feedback)
        return {"prompt_ids": prompt_ids, "completion_ids": completion, "logprobs": logprobs, "env_mask": mask,
                "env_reward": rewards}

    def generate(self, model, contexts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        """One sampled response per context (left-padded into one batch), cut after its eos, with each token's
        log-probability under the sampling distribution."""
        import torch

        gen, tokenizer = self.config.gen, self.tokenizer
        width = max(map(len, contexts))
        pad = tokenizer.pad_token_id
        inputs = torch.tensor([[pad] * (width - len(c)) + c for c in contexts])
        attention = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
        with torch.no_grad():
            out = model.generate(inputs, attention_mask=attention, do_sample=True, temperature=gen.temperature,
                                 top_p=gen.top_p, top_k=max(gen.top_k, 0) or None, max_new_tokens=gen.max_new_tokens,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=pad, output_scores=True,
                                 return_dict_in_generate=True)
        new = out.sequences[:, width:]
        chosen = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
        chosen = chosen.gather(-1, new.unsqueeze(-1)).squeeze(-1)
        responses, response_logprobs = [], []
        for ids, lps in zip(new.tolist(), chosen.tolist()):
            end = ids.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in ids else len(ids)
            responses.append(ids[:end])
            response_logprobs.append(lps[:end])
        return responses, response_logprobs


def run_trl_multi_turn(config, train_rows: list[dict], steps: int, out_dir: Path, threads: int) -> dict:
    """TRL on the 3-turn task for `steps` batches; (clock at each batch's end, whole seconds)."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from rlsys.model.tokenizer import load_tokenizer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    started = time.monotonic()
    torch.set_num_threads(threads or os.cpu_count())
    tokenizer = load_tokenizer(config.model.path)
    model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32)
    dataset, ordered = trl_dataset(config, tokenizer, train_rows, steps * config.ppo.batch_size)
    by_content = {m[-1]["content"]: p for m, p in zip(dataset["prompt"], ordered)}

    def env_reward(completions, env_reward, **_):
        return env_reward

    # A conversation's completion is its three responses and the two user messages between them.
    longest = config.num_turns * config.gen.max_new_tokens + 64 * (config.num_turns - 1)
    clock = trl_clock(config.ppo.ppo_epochs, steps)
    trainer = GRPOTrainer(model=model, reward_funcs=[env_reward], train_dataset=dataset, processing_class=tokenizer,
                          args=trl_arguments(config, steps, out_dir, max_completion_length=longest),
                          rollout_func=SumsRollout(config, tokenizer, by_content), callbacks=[clock])
    trainer.train()
    return {"times": clock.times, "wall_s": time.monotonic() - started}
