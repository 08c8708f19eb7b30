"""The learner's train_step against a plain training loop on the same tokens, side by side in one run.

    python3 bench/learner_vs_plain.py [--threads 1] [--repeats 5] [--out bench/results/learner_vs_plain.json]
                                      [--random-model 576,1536,30,9,3,49152] [key=value ...]

Both sides train the default task's model (the tiny warm-started one the default run builds, from its cache)
on one batch the size of a default step: 16 prompts x 8 samples, each a real held-out prompt rendered with the
chat template followed by 2..8 seeded generated tokens (max_new_tokens is 8; answers are 2-3 digits and EOS).
"learner" is `PolicyTrainer.train_step` with the default settings (GRPO, PPO clip, 2 epochs of 1 mini-batch,
packed micro-batches, gradient clipping, statistics). "plain" is what a user would write by hand:

    for each of the same epochs and mini-batches:
        model(input_ids, attention_mask, labels).loss.backward(); optimizer.step(); optimizer.zero_grad()

on the same sequences right-padded into one batch (transformers' sdpa, the default attention), with the same
AdamW. Both make the same number of optimizer steps over the same tokens; trained tokens/s counts real tokens
x epochs. Repeats alternate the two so machine noise hits both alike; the median is reported. The last line is
the headline: learner / plain.

Each side's tensor operations in one more step are counted too (views, which compute nothing, left out), and
how many of them its optimizer ran: on a GPU each is a kernel launch and its Python, and a small model's step
is bound by them (BENCHMARKS.md), so the count is the CPU's view of what a GPU step will cost. On a CPU the
plain loop's AdamW runs per tensor (several operations each); CUDA's default (foreach) runs a few in all.

    --random-model 32,64,4,4,2,102 --plain-foreach ppo.sequence_packing=false \
        ppo.max_tokens_per_micro_batch=16384 ppo.batch_size=2 group_size=4

is the CPU's stand-in for the tiny model's step on a GPU: the default model's layers and heads, so narrow and on
so few sequences that both sides are bound by the host's cost per tensor operation, as a GPU step of the tiny model
is bound by its launches, with the GPU's defaults (padded rows in float32, 16,384 tokens a micro-batch, foreach
AdamW in the plain loop).

`--profile FILE` writes, after the timings, torch.profiler's table of one more step of each side: on a GPU by
kernel time, with each side's kernel time against its wall time, to tell a step bound by its kernels from one bound
by the host.

`--random-model` times a randomly initialised model of another shape on the same token ids instead (e.g.
SmolLM2-135M's: hidden 576, MLP 1536, 30 layers, 9 heads, 3 key/value heads, 49,152-token vocabulary), and
`gen.max_new_tokens=N` makes the answers up to N-1 tokens long: launch overheads that dominate a 2.4M-parameter
model on a GPU may not matter at a real size. With `learner.dtype=bfloat16` the plain loop runs under the same
autocast.
"""

import argparse
import contextlib
import functools
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.api import Trajectory  # noqa: E402
from rlsys.assets import prepare_assets  # noqa: E402
from rlsys.cli import parse_config  # noqa: E402
from rlsys.data.dataset import load_rows  # noqa: E402
from rlsys.distributed import Ranks  # noqa: E402
from rlsys.model.tokenizer import build_char_tokenizer, chat_prompt_ids  # noqa: E402
from rlsys.run_files import logs_dir  # noqa: E402
from rlsys.training_step import PolicyTrainer, synchronize  # noqa: E402


def prepared_config(overrides: list[str], tmp: str):
    """The experiment's config with its model and data in place (the cache), logging under `tmp`."""
    config = parse_config(overrides)
    config.logging_dir = str(logs_dir(Path(tmp)))
    prepare_assets(config, log=lambda *a, **k: None)
    return config


def default_step_batch(config, seed: int) -> list[Trajectory]:
    """batch_size prompts x group_size samples shaped like the default task's: real prompts, seeded answers."""
    rng = random.Random(seed)
    tokenizer = build_char_tokenizer()
    rows = load_rows(config.dataset.eval_path, config.dataset.row_format(), list(config.agents))
    digits = tokenizer("0123456789", add_special_tokens=False)["input_ids"]
    batch = []
    for g in range(config.ppo.batch_size):
        prompt = chat_prompt_ids(tokenizer, rows[g]["prompt"])
        for _ in range(config.group_size):
            answer = [rng.choice(digits) for _ in range(rng.randint(1, config.gen.max_new_tokens - 1))]
            answer.append(tokenizer.eos_token_id)
            reward = float(rng.random() < 0.4)
            logprobs = [rng.uniform(-3.0, -0.1) for _ in answer]
            batch.append(one_turn_trajectory(prompt, answer, logprobs, reward, f"g{g}"))
    return batch


def one_turn_trajectory(prompt: list[int], answer: list[int], logprobs: list[float], reward: float,
                        group_id: str) -> Trajectory:
    """A scored one-turn sample: the prompt (not trained on), then the answer with its behaviour logprobs."""
    n, m = len(prompt), len(answer)
    return Trajectory(token_ids=prompt + answer, loss_mask=[0] * n + [1] * m, logprobs=[0.0] * n + logprobs,
                      versions=[-1] * n + [0] * m, turn_ends=[n + m], turn_rewards=[reward], reward=reward,
                      group_id=group_id, stop_reason="stop")


def save_random_model(shape: str, tokenizer_from: str, directory: Path) -> str:
    """A Qwen2 model of `shape` with random weights, saved with the default model's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlsys.model.tokenizer import load_tokenizer

    hidden, mlp, layers, heads, kv_heads, vocab = (int(x) for x in shape.split(","))
    tokenizer = load_tokenizer(tokenizer_from)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


class PlainLoop:
    """model(input_ids, labels).loss.backward(); optimizer.step(), over the learner's epochs and mini-batches."""

    def __init__(self, config, trajectories: list[Trajectory], device: str, foreach: bool | None = None):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(config.seed)
        self.ppo = config.ppo
        self.model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32).to(device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.ppo.lr, weight_decay=self.ppo.weight_decay,
                                           foreach=foreach)
        width = max(len(t.token_ids) for t in trajectories)
        pad = self.model.config.pad_token_id
        self.input_ids = torch.tensor([t.token_ids + [pad] * (width - len(t.token_ids)) for t in trajectories])
        self.attention_mask = torch.tensor([[1] * len(t.token_ids) + [0] * (width - len(t.token_ids))
                                            for t in trajectories])
        self.labels = self.input_ids.masked_fill(self.attention_mask == 0, -100)
        self.input_ids, self.attention_mask, self.labels = (
            t.to(device) for t in (self.input_ids, self.attention_mask, self.labels))

        self.autocast = (functools.partial(torch.autocast, torch.device(device).type, dtype=torch.bfloat16)
                         if config.learner.dtype == "bfloat16" else contextlib.nullcontext)

    def train_step(self) -> None:
        for _ in range(self.ppo.ppo_epochs):
            for rows in torch.randperm(len(self.input_ids)).chunk(self.ppo.num_mini_batches):
                with self.autocast():
                    loss = self.model(input_ids=self.input_ids[rows], attention_mask=self.attention_mask[rows],
                                      labels=self.labels[rows], use_cache=False).loss
                loss.backward()
                self.optimizer.step()
                self.optimizer.zero_grad()


class OperationCount(TorchDispatchMode):
    """Tensor operations dispatched while it is active (not views or detach), and how many an optimizer's step ran."""

    def __init__(self):
        super().__init__()
        self.total = self.optimizer = 0
        self.in_optimizer = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func is not torch.ops.aten.detach.default:
            self.total += 1
            self.optimizer += self.in_optimizer
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        def entered(*_):
            self.in_optimizer = True

        def left(*_):
            self.in_optimizer = False

        self.hooks = [register_optimizer_step_pre_hook(entered),
                      register_optimizer_step_post_hook(left)]
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        return super().__exit__(*exc)


def count_operations(step) -> dict[str, int | None]:
    """One more step under OperationCount. The timings come first and stand alone: an operation the counting mode
    cannot pass through (a device's kernel library, say) leaves the counts empty, with the reason printed."""
    try:
        with OperationCount() as count:
            step()
    except Exception as error:  # noqa: BLE001 - the counts are an addition to the timings, not worth losing them
        print(f"operations not counted: {type(error).__name__}: {error}")
        return {"operations": None, "optimizer_operations": None}
    return {"operations": count.total, "optimizer_operations": count.optimizer}


def write_profiles(sides: dict, device: str, path: Path) -> None:
    """One step of each side under torch.profiler: its busiest operations, and on a GPU the kernels' own time
    against the step's wall time (a step whose kernels fill its wall time is bound by them, one whose kernels
    leave it idle by the host or its waits)."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device != "cpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    sort = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    report = []
    for name, run in sides.items():
        synchronize(device)
        started = time.perf_counter()
        with profile(activities=activities) as profiled:
            run()
            synchronize(device)
        wall = time.perf_counter() - started
        events = profiled.key_averages()
        line = f"== {name}: one step, {wall * 1e3:.1f} ms of wall time under the profiler"
        if on_gpu:
            kernels = sum(e.self_device_time_total for e in events) / 1e3
            line += f"; kernels {kernels:.1f} ms ({kernels / (wall * 1e3):.0%} of it)"
        report += [line, events.table(sort_by=sort, row_limit=25)]
        if on_gpu:  # the host's side: launches, copies and the waits for the device
            report.append(events.table(sort_by="self_cpu_time_total", row_limit=15))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(report))
    print(f"profiles of one step of each side: {path}")


def shown(count: int | None) -> str:
    return "-" if count is None else str(count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both sides (the learner role's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps-per-repeat", type=int, default=3, help="train steps timed together per repeat")
    parser.add_argument("--out", default="bench/results/learner_vs_plain.json")
    parser.add_argument("--random-model", metavar="HIDDEN,MLP,LAYERS,HEADS,KV_HEADS,VOCAB",
                        help="time a randomly initialised Qwen2 model of this shape instead of the default task's")
    parser.add_argument("--plain-foreach", action="store_true",
                        help="the plain loop's AdamW as CUDA runs it by default (foreach: a few operations a step, "
                             "not several per tensor), for a CPU stand-in of a launch-bound GPU step")
    parser.add_argument("--profile", metavar="FILE",
                        help="after the timings, one more step of each side under torch.profiler: write its busiest "
                             "operations (on a GPU, by kernel time, and each side's kernel time against its wall "
                             "time) to FILE")
    parser.add_argument("overrides", nargs="*", help="experiment settings, key=value (e.g. ppo.ppo_epochs=1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        config = prepared_config(args.overrides, tmp)
        if args.random_model:
            config.model.path = save_random_model(args.random_model, config.model.path, Path(tmp) / "model")
        trajectories = default_step_batch(config, seed=0)
        tokens = sum(len(t.token_ids) for t in trajectories)
        learner = PolicyTrainer(config, Ranks(), config.model.path)
        # the learner's device: a GPU where there is one
        plain = PlainLoop(config, trajectories, learner.device, foreach=True if args.plain_foreach else None)
        sides = {"learner": lambda: learner.train_step(trajectories), "plain": plain.train_step}
        # warm-up: allocator, kernels, and the learner's choice of layout where it measures (ppo.sequence_packing)
        measured = {key: value for key, value in (sides["learner"]() or {}).items() if key.startswith("layout/")}
        plain.train_step()
        layout = "packed" if learner.packed else "padded"
        times = {name: [] for name in sides}
        for _ in range(args.repeats):
            for name, run in sides.items():
                started = time.perf_counter()
                for _ in range(args.steps_per_repeat):
                    run()
                synchronize(learner.device)  # a GPU's kernels run ahead of the clock
                times[name].append((time.perf_counter() - started) / args.steps_per_repeat)
        operations = {name: count_operations(run) for name, run in sides.items()}
        if args.profile:
            write_profiles(sides, learner.device, Path(args.profile))

    trained = tokens * config.ppo.ppo_epochs
    rows = {name: {"seconds_per_step": statistics.median(t), "tokens_per_second": trained / statistics.median(t),
                   "seconds": t, **operations[name]} for name, t in times.items()}
    ratio = rows["learner"]["tokens_per_second"] / rows["plain"]["tokens_per_second"]
    device = torch.cuda.get_device_name() if learner.device != "cpu" else f"{args.threads} CPU thread(s)"
    print(f"model {args.random_model or 'default task'}, learner.dtype={config.learner.dtype}, "
          f"{len(trajectories)} sequences ({config.ppo.batch_size} prompts x {config.group_size}), {tokens} tokens, "
          f"{config.ppo.ppo_epochs} epochs x {config.ppo.num_mini_batches} mini-batches, {device}, "
          f"median of {args.repeats} x {args.steps_per_repeat} steps")
    how = ", ".join(f"{key.split('/')[1].split('_')[0]} {value:.4f} s" for key, value in measured.items())
    print(f"learner's rows: {layout} ({f'measured on its first step, a pass: {how}' if measured else 'by rule'})")
    print(f"{'side':<8} {'s/step':>8} {'trained tok/s':>14} {'tensor ops/step':>16} {'of them optimizer':>18}")
    for name, row in rows.items():
        print(f"{name:<8} {row['seconds_per_step']:>8.4f} {row['tokens_per_second']:>14.0f} "
              f"{shown(row['operations']):>16} {shown(row['optimizer_operations']):>18}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "tokens": tokens, "machine": platform.node(),
                                          "device": device, "learner_layout": layout, "layout_measured": measured,
                                          "results": rows, "ratio": ratio}, indent=2))
    print(f"ratio: learner / plain tokens/s = {ratio:.2f}")


if __name__ == "__main__":
    main()
