"""rlsys against TRL's GRPOTrainer on the default task: trained samples/s, held-out accuracy over time, time to +20.

    pip install -e .[dev]      # TRL is a dev extra, never part of the default install
    python3 bench/vs_trl.py [--steps 180] [--snapshot-steps 10] [--task NAME] [--held-out N] [--target-points 20] \
        [--out bench/results/vs_trl.json] [key=value ...]
    python3 bench/vs_trl.py --report bench/results/vs_trl.json --target-points 15

One command, one run after the other on the same machine: TRL 1.16's `GRPOTrainer` (one process, HF `generate`, on
CPU with `--trl-threads` torch threads, by default every core) and then rlsys's default run
(`training/main_async_ppo.py`). Both start from the default run's warm-started tiny model (from the cache,
`model.cache_dir`) and train on the default addition dataset in the same prompt order with the same
hyper-parameters: 16 prompts x 8 samples per batch, 2 optimizer steps over each batch (rlsys `ppo.ppo_epochs=2`, TRL
`num_iterations=2`), AdamW lr 3e-5 constant, clip 0.2, gradient norm clip 1, no KL (beta 0), token-mean loss (TRL
`loss_type="dapo"`, normalised by the batch's tokens), group advantages scaled by the group's std, temperature 1,
the same max new tokens, gradient checkpointing as rlsys's learner has it (off; TRL's own default is on), and its
precision (`learner.dtype=bfloat16`: TRL `bf16=True`). TRL's reward is rlsys's math check (the plain-number
comparison, else math-verify), its prompts are rendered by the same tokenizer and chat template to the same token ids
(checked).

Evaluation is the same for both and outside both clocks: every `--snapshot-steps` batches each side keeps its
weights (TRL: a copy in memory, its time taken out of TRL's clock; rlsys: the version its learner publishes for
inference, fetched from the learner's weight server as an inference worker does, which costs the learner a few
milliseconds), and after both runs every snapshot is scored by one function: greedy HF `generate` on the 500
held-out prompts (or the first `--held-out`), checked by the same math check; each side's samples/s and the
learner's split of a step are printed as soon as it has run, so a time limit that cuts the scoring short leaves
them. A side's clock starts when its training starts (TRL: `on_train_begin`; rlsys: when its rollout worker finished
the initial evaluation and admits the first prompt), so neither side's start-up (loading, vLLM, processes) is in it;
the whole command's time is reported beside it. Trained samples/s counts the batches between the end of batch
`--warmup` and the last one; over the same window each side is charged its CPU seconds (TRL: its process's; rlsys:
every process its run started, sampled each second), printed per trained sample with the cores it kept busy, and the
line above the ratio gives the most samples/s rlsys's CPU per sample allows with every core busy, against TRL's
measured. The last line is `ratio: <TRL time-to-target / rlsys time-to-target>` for `--target-points` (20 unless
told) held-out points over the shared starting accuracy; where only one side got there, the bound its whole run sets.
The table gives the time to half the target too (what a short run shows when a side does not reach it).
`--report FILE` runs nothing: it prints the table and ratio of a run `--out` saved, at `--target-points`.
`--variant NAME:SETTINGS` adds rlsys runs with other settings (e.g. the colocated placement) beside the default.
`--device cuda` puts both sides on one GPU (TRL `use_cpu=False`; rlsys's roles find the GPU themselves, with vLLM
where it is installed, else `inference.engine=transformers`); `--device cpu` (the default) hides any GPU from both.
`--task NAME` puts both sides on another registered one-turn math experiment instead of the default task, e.g.
`async-ppo-math-long` (long answers, as in reasoning RL): its dataset, its warm-started model, its max new tokens
and its math check, with its own hyper-parameters where it changes the default's.
"""

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.launched_runs import launch, learner_rows, parse_run_arguments  # noqa: E402
from rlsys import evaluations  # noqa: E402
from rlsys.learner_figures import COMPUTE, PUBLISH, WAIT_DATA, label  # noqa: E402
from rlsys.metrics import LOGGED_AT, read_jsonl_metrics  # noqa: E402
from rlsys.run_files import SUMMARY_FILE, logs_dir  # noqa: E402

DEFAULT_TASK = "async-ppo-math"
ONE_TURN_MATH = ("math-single-step", "math-code-single-step")  # (agent, env): the episodes TRL's side plays


def correct(answer: str, reference: str) -> bool:
    """rlsys's math check, as its math-code-single-step environment applies it (without the worker pool)."""
    from rlsys.impl.env.math_answers import check_answer, plain_number_verdict

    return (plain_number_verdict(answer, reference) or check_answer(answer, reference)).correct


def held_out_accuracy(model, tokenizer, prompt_ids: list[list[int]], answers: list[str], max_new_tokens: int) -> float:
    """Greedy accuracy of `model` on the held-out prompts; prompts of one length are generated together, so no
    padding can change an answer."""
    import torch

    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(prompt_ids):
        by_length.setdefault(len(ids), []).append(i)
    right = 0
    with torch.no_grad():
        for indices in by_length.values():
            inputs = torch.tensor([prompt_ids[i] for i in indices], device=model.device)
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(out[:, inputs.shape[1]:], skip_special_tokens=True)
            right += sum(correct(text, answers[i]) for text, i in zip(texts, indices))
    return right / len(prompt_ids)


def throughput(side: dict, per_batch: int, warmup: int) -> dict:
    """Trained samples/s, CPU seconds per sample and cores kept busy over a side's batches after `warmup`."""
    times, cpu = side["times"], side["cpu"]  # seconds and CPU seconds since the side's clock started, per batch
    w = min(warmup, len(times) - 1)
    window_s, window_cpu = times[-1] - (times[w - 1] if w else 0.0), cpu[-1] - (cpu[w - 1] if w else 0.0)
    samples = (len(times) - w) * per_batch
    return {"samples_per_second": samples / window_s, "cpu_s_per_sample": window_cpu / samples,
            "cores_busy": window_cpu / window_s}


def task_settings(task: str) -> list[str]:
    """The settings that pick `task` for both sides: none for the default task, so its commands stay as they were."""
    return [] if task == DEFAULT_TASK else [f"experiment={task}"]


def engine_settings(device: str) -> list[str]:
    """rlsys's engine on a GPU machine without vLLM (its wheel is not everywhere): the transformers engine."""
    import importlib.util

    return ["inference.engine=transformers"] if device == "cuda" and importlib.util.find_spec("vllm") is None else []


def prepared_config(overrides: list[str]):
    """The run's config with its dataset and warm-started model ready (built into the cache if absent); refused
    unless its episodes are what TRL's side plays: one answer a prompt, scored by the math check."""
    from rlsys.assets import prepare_assets
    from rlsys.cli import parse_config

    config = parse_config(overrides)
    if (config.agent.name, config.env.name) != ONE_TURN_MATH:
        raise SystemExit(f"vs_trl compares one-turn math tasks (agent {ONE_TURN_MATH[0]}, env {ONE_TURN_MATH[1]}); "
                         f"this one has agent {config.agent.name}, env {config.env.name}")
    prepare_assets(config)
    return config


def trl_dataset(config, tokenizer, train_rows: list[dict], count: int):
    """rlsys's first `count` training prompts in its rollout worker's order, as TRL's dataset (prompt messages and
    answers), checked to render to the same token ids; and the prompts themselves."""
    from datasets import Dataset

    from rlsys.data.prompts import prompt_stream

    stream = prompt_stream(train_rows, tokenizer, "train", seed=config.seed, shuffle=True)
    ordered = [next(stream) for _ in range(count)]
    messages = [p.data.get("messages") or [{"role": "user", "content": p.data["prompt"]}] for p in ordered]
    rendered = tokenizer.apply_chat_template(messages[0], add_generation_prompt=True, tokenize=False)
    if tokenizer(rendered, add_special_tokens=False)["input_ids"] != ordered[0].token_ids:
        raise RuntimeError("TRL would see other prompt tokens than rlsys's")
    return Dataset.from_dict({"prompt": messages, "answer": [str(p.data["answer"]) for p in ordered]}), ordered


def trl_arguments(config, steps: int, out_dir: Path, device: str = "cpu", **changes):
    """GRPOConfig with rlsys's hyper-parameters for `steps` batches (the module docstring lists them)."""
    from trl import GRPOConfig

    ppo, group = config.ppo, config.group_size
    settings = dict(
        output_dir=str(out_dir / "trl"), use_cpu=device == "cpu", report_to="none", save_strategy="no",
        logging_steps=10,
        seed=config.seed, data_seed=config.seed, shuffle_dataset=False, max_steps=steps * ppo.ppo_epochs,
        per_device_train_batch_size=ppo.batch_size * group, gradient_accumulation_steps=1, num_generations=group,
        num_iterations=ppo.ppo_epochs, learning_rate=ppo.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=ppo.weight_decay, max_grad_norm=ppo.max_grad_norm, beta=0.0, epsilon=ppo.pg_clip,
        epsilon_high=ppo.pg_clip_high or ppo.pg_clip, importance_sampling_level=ppo.importance_sampling_level,
        loss_type="dapo", scale_rewards="group", temperature=config.gen.temperature, top_p=config.gen.top_p,
        top_k=max(config.gen.top_k, 0), max_completion_length=config.gen.max_new_tokens,
        bf16=config.learner.dtype == "bfloat16",  # rlsys's mixed precision, as HF's Trainer has it (autocast)
        # TRL's default is on (recomputing activations, about a third more compute per update); rlsys's is off.
        gradient_checkpointing=config.learner.gradient_checkpointing)
    return GRPOConfig(**{**settings, **changes})


def trl_clock(epochs: int, steps: int, snapshot_steps: int = 0):
    """A TrainerCallback: the time and the process's CPU seconds (every thread's) at each batch's last optimizer
    step, less what taking weight snapshots cost (every `snapshot_steps` batches and the last; none if 0)."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.start, self.excluded, self.times, self.snapshots = 0.0, 0.0, [], {}
            self.cpu_start, self.cpu_excluded, self.cpu = 0.0, 0.0, []

        def on_train_begin(self, *_, **__):
            self.start, self.cpu_start = time.monotonic(), time.process_time()

        def on_step_end(self, _args, state, _control, model=None, **__):
            if state.global_step % epochs:
                return
            now, cpu = time.monotonic(), time.process_time()
            self.times.append(now - self.start - self.excluded)
            self.cpu.append(cpu - self.cpu_start - self.cpu_excluded)
            batch = state.global_step // epochs
            if snapshot_steps and (batch % snapshot_steps == 0 or batch == steps):
                self.snapshots[batch] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.excluded += time.monotonic() - now
            self.cpu_excluded += time.process_time() - cpu

    return Clock()


def run_trl(config, train_rows: list[dict], steps: int, snapshot_steps: int, out_dir: Path, threads: int,
            device: str) -> dict:
    """TRL's GRPOTrainer for `steps` batches; (clock at each batch's end, weight snapshots, whole seconds)."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from rlsys.model.tokenizer import load_tokenizer

    started = time.monotonic()
    torch.set_num_threads(threads or os.cpu_count())  # one process: by default each phase gets every core
    tokenizer = load_tokenizer(config.model.path)
    model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32)
    dataset, _ = trl_dataset(config, tokenizer, train_rows, steps * config.ppo.batch_size)

    def math_reward(completions, answer, **_):
        return [float(correct(c[-1]["content"], a)) for c, a in zip(completions, answer)]

    clock = trl_clock(config.ppo.ppo_epochs, steps, snapshot_steps)
    trainer = GRPOTrainer(model=model, reward_funcs=[math_reward], args=trl_arguments(config, steps, out_dir, device),
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    return {"times": clock.times, "cpu": clock.cpu, "snapshots": clock.snapshots, "wall_s": time.monotonic() - started}


class CpuSampler(threading.Thread):
    """The CPU seconds of every process this one started (the run's roles, its Redis server, vLLM's), sampled every
    `period` seconds against the wall clock, so a window of the run can be charged its CPU. Only the whole run's
    processes count, not this one's (the weight keeper)."""

    def __init__(self, period: float = 1.0):
        super().__init__(daemon=True)
        self.period, self.samples, self.done = period, [], threading.Event()  # samples: (time.time(), CPU seconds)

    def run(self) -> None:
        import psutil

        me, seen = psutil.Process(), {}
        while not self.done.wait(self.period):
            for child in me.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    times = child.cpu_times()
                    seen[child.pid] = times.user + times.system  # a process that ended keeps its last sample
            self.samples.append((time.time(), sum(seen.values())))

    def at(self, when: float) -> float:
        """CPU seconds used by `when`, interpolated between the two samples around it."""
        before = max((s for s in self.samples if s[0] <= when), default=self.samples[0])
        after = min((s for s in self.samples if s[0] >= when), default=self.samples[-1])
        if after[0] == before[0]:
            return before[1]
        return before[1] + (after[1] - before[1]) * (when - before[0]) / (after[0] - before[0])


class WeightKeeper(threading.Thread):
    """Keeps the weights rlsys's learner publishes for inference at every `every`-th version and `last`: it reads the
    run's announcements from its Redis and fetches those versions from the learner's weight server as an inference
    worker does. The learner's work is unchanged (its server thread sends one more copy, a few milliseconds for the
    tiny model), so its clock needs no correction."""

    def __init__(self, out_dir: Path, trial: str, every: int, last: int):
        super().__init__(daemon=True)
        self.root, self.trial, self.every, self.last = out_dir, trial, every, last
        self.kept_dir = out_dir / f"{trial}-snapshots"
        self.kept_dir.mkdir(parents=True, exist_ok=True)
        self.kept: dict[int, Path] = {}
        self.done = threading.Event()

    def run(self) -> None:
        import redis

        bus = None
        while not self.done.is_set():
            bus = bus or self.connect()
            if bus is not None:
                with contextlib.suppress(redis.ConnectionError, OSError):  # the run's Redis stopped at its end
                    self.keep_new(bus.get("weights:latest"))
            time.sleep(0.02)

    def connect(self):
        """A client of the run's private Redis, once its config file exists."""
        from rlsys.bus.redis_bus import RedisBus

        conf = next(self.root.glob(f"*/{self.trial}/redis/redis.conf"), None)
        if conf is None:
            return None
        settings = dict(line.split(" ", 1) for line in conf.read_text().splitlines())
        return RedisBus.from_url(f"redis://:{json.loads(settings['requirepass'])}@127.0.0.1:{settings['port']}/0")

    def keep_new(self, announcement) -> None:
        from safetensors.torch import save_file

        from rlsys.api.messages import parse_published_weights
        from rlsys.weight_transport import fetch

        if not announcement:
            return
        published = parse_published_weights(announcement)
        version = published.version
        if version in self.kept or (version % self.every and version != self.last):
            return
        received = fetch(published.address, published.token)
        target = self.kept_dir / f"v{received.version}.safetensors"
        # Tied tensors arrive as one buffer under both names, which safetensors refuses to write: a copy of each.
        save_file({name: tensor.clone() for name, tensor in received.weights.items()}, str(target))
        self.kept[received.version] = target


def run_rlsys(steps: int, snapshot_steps: int, overrides: list[str], out_dir: Path, trial: str) -> dict:
    """rlsys's default run for `steps` batches; (clock at each batch's end, weight files, whole seconds, command)."""
    settings = [f"max_steps={steps}", "eval_steps=0", f"logging_steps={steps}", *overrides]
    linker, cpu = WeightKeeper(out_dir, trial, snapshot_steps, steps), CpuSampler()
    linker.start()
    cpu.start()
    try:
        run_dir, command, wall = launch(settings, out_dir, trial)
    finally:
        linker.done.set()
        cpu.done.set()
        linker.join()
        cpu.join()
    missed = [v for v in range(snapshot_steps, steps + 1, snapshot_steps) if v not in linker.kept]
    if missed:
        raise RuntimeError(f"the weights of versions {missed} were replaced before they could be kept")
    rows = learner_rows(run_dir)
    initial = read_jsonl_metrics(evaluations.records_path(logs_dir(run_dir)))
    # training prompts are admitted from the initial evaluation's end
    start = next(r[LOGGED_AT] for r in initial if evaluations.ACCURACY in evaluations.figures(r))
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    cpu_at_start = cpu.at(start)
    timed = rows[min(2, len(rows) - 1):]  # the learner's own split of a step, its first steps left out
    learner_s = {label(key): sum(r[key] for r in timed) / len(timed) for key in (COMPUTE, PUBLISH, WAIT_DATA)}
    return {"times": [r[LOGGED_AT] - start for r in rows], "cpu": [cpu.at(r[LOGGED_AT]) - cpu_at_start for r in rows],
            "learner_s_per_step": learner_s,
            "snapshots": linker.kept, "wall_s": wall,
            "command": " ".join(command), "own_initial_accuracy": summary["initial_accuracy"],
            "own_final_accuracy": summary["final_accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snapshot-steps", type=int, default=10, help="evaluate both sides every this many batches")
    parser.add_argument("--skip-trl", action="store_true", help="run rlsys only (no ratio)")
    parser.add_argument("--trl-threads", type=int, default=0, help="TRL's torch threads; 0: every core")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where both sides train: the CPU (any GPU hidden) or one GPU")
    parser.add_argument("--held-out", type=int, default=0,
                        help="score the snapshots on the first this many held-out problems; 0: all of them")
    parser.add_argument("--task", default=DEFAULT_TASK, help="registered one-turn math experiment both sides train on")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:SETTINGS",
                        help="one more rlsys run after the default one, e.g. 'colocated:cluster.colocate=true "
                             "max_head_offpolicyness=0' (repeatable); reported beside it, not in the ratio")
    parser.add_argument("--target-points", type=float, default=20.0,
                        help="the ratio's target: this many held-out points over the shared start")
    parser.add_argument("--report", metavar="FILE", default="",
                        help="run nothing: print the table and ratio of a run --out saved, at --target-points")
    args, out_dir = parse_run_arguments(parser, steps=180, out="bench/results/vs_trl.json")
    if args.report:
        if not args.runs_dir:
            out_dir.rmdir()  # the temporary one, unused
        compare(json.loads(Path(args.report).read_text()), args.target_points)
        return
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported, here and in the run's roles
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU here")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlsys.data.dataset import load_rows
    from rlsys.model.tokenizer import load_tokenizer, row_prompt_ids

    overrides = [*task_settings(args.task), *engine_settings(args.device), *args.overrides]
    config = prepared_config(overrides)
    fmt = config.dataset.row_format()
    train_rows, eval_rows = load_rows(config.dataset.path, fmt), load_rows(config.dataset.eval_path, fmt)
    eval_rows = eval_rows[:args.held_out or None]
    tokenizer = load_tokenizer(config.model.path)
    eval_ids = [row_prompt_ids(tokenizer, row) for row in eval_rows]
    answers = [str(row["answer"]) for row in eval_rows]
    per_batch = config.ppo.batch_size * config.group_size

    sides = {}
    if not args.skip_trl:
        load = os.getloadavg()[0]
        sides["trl"] = run_trl(config, train_rows, args.steps, args.snapshot_steps, out_dir, args.trl_threads,
                               args.device)
        sides["trl"]["load_average"] = (load, os.getloadavg()[0])  # this machine is shared: say how busy it was
        print(f"  TRL: {args.steps} batches in {sides['trl']['wall_s']:.0f} s, "
              f"{throughput(sides['trl'], per_batch, args.warmup)['samples_per_second']:.1f} samples/s", flush=True)
    variants = (v.partition(":") for v in args.variant)
    runs = [("rlsys", [])] + [(name, settings.split()) for name, _, settings in variants]
    for name, settings in runs:
        load = os.getloadavg()[0]
        sides[name] = run_rlsys(args.steps, args.snapshot_steps, [*overrides, *settings], out_dir, name)
        sides[name]["load_average"] = (load, os.getloadavg()[0])
        split = sides[name]["learner_s_per_step"]  # printed before the evaluation, which a time limit may cut short
        print(f"  {name}: {args.steps} batches in {sides[name]['wall_s']:.0f} s, "
              f"{throughput(sides[name], per_batch, args.warmup)['samples_per_second']:.1f} samples/s; learner "
              f"compute {split['compute']:.3f} s, publish {split['publish']:.3f}, waiting {split['wait_data']:.3f}",
              flush=True)

    torch.set_num_threads(os.cpu_count())
    model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32).to(args.device).eval()
    evaluate = lambda: held_out_accuracy(model, tokenizer, eval_ids, answers, config.gen.max_new_tokens)  # noqa: E731
    initial = evaluate()
    results = {}
    for name, side in sides.items():
        curve = [(0, 0, 0.0, initial)]
        for batch, snapshot in sorted(side["snapshots"].items()):
            if name != "trl":
                snapshot = load_file(str(snapshot))
            model.load_state_dict({k: v.to(args.device) for k, v in snapshot.items()})
            curve.append((batch, batch * per_batch, side["times"][batch - 1], evaluate()))
        results[name] = {
            **throughput(side, per_batch, args.warmup),
            "curve": [{"batch": b, "samples": n, "seconds": t, "accuracy": a} for b, n, t, a in curve],
            "train_s": side["times"][-1], **{k: v for k, v in side.items() if k not in ("times", "snapshots")}}

    task = "default task" if args.task == DEFAULT_TASK else f"task {args.task}"
    task += f", on {torch.cuda.get_device_name()}" if args.device == "cuda" else f", on {os.cpu_count()} CPU cores"
    print(f"{task}, {args.steps} batches of {config.ppo.batch_size} prompts x {config.group_size} samples, "
          f"{config.ppo.ppo_epochs} optimizer steps each; held-out greedy accuracy on {len(eval_rows)} problems")
    saved = {"args": vars(args), "cores": os.cpu_count(), "initial_accuracy": initial, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(saved, indent=2, default=str))
    compare(saved, args.target_points)


def reaching(curve: list[dict], accuracy: float) -> float | None:
    """Seconds of training to the first snapshot of `curve` at or above `accuracy`; None if none is."""
    # 0.568 is 0.368 + 0.2 give or take a rounding
    return next((p["seconds"] for p in curve if p["accuracy"] >= accuracy - 1e-9), None)


def compare(saved: dict, points: float) -> None:
    """The table of a run (as `--out` saved it), each learner's split of a step, the CPU ceilings and the `ratio:`
    line, with the time to `points` held-out points (and to half of them) over the shared starting accuracy."""
    initial, results, steps = saved["initial_accuracy"], saved["results"], saved["args"]["steps"]
    times = {name: [reaching(r["curve"], initial + share * points / 100) for share in (0.5, 1.0)]
             for name, r in results.items()}
    print(f"start {100 * initial:.1f}%, target {100 * initial + points:.1f}% (+{points:g} points)")
    print(f"{'side':<10} {'samples/s':>9} {'CPU ms/sample':>13} {'cores busy':>10} {'train s':>8} {'whole s':>8} "
          f"{f'to +{points / 2:g}':>8} {f'to +{points:g}':>8} {'load':>9}  "
          "held-out accuracy (batch: accuracy @ seconds of training)")
    for name, r in results.items():
        to_half, to_target = (f"{t:.1f} s" if t is not None else "-" for t in times[name])
        curve = "  ".join(f"{p['batch']}:{100 * p['accuracy']:.1f}%@{p['seconds']:.0f}s" for p in r["curve"])
        print(f"{name:<10} {r['samples_per_second']:>9.1f} {1000 * r['cpu_s_per_sample']:>13.2f} "
              f"{r['cores_busy']:>10.2f} {r['train_s']:>8.1f} {r['wall_s']:>8.1f} {to_half:>8} {to_target:>8} "
              f"{r['load_average'][0]:>4.1f}-{r['load_average'][1]:<4.1f}  {curve}")
    to_target = {name: target for name, (_, target) in times.items()}
    trl_t, rlsys_t = to_target.get("trl"), to_target["rlsys"]
    rlsys_sides = [name for name in results if name != "trl"]
    for name in rlsys_sides[1:]:
        if trl_t is not None and to_target[name] is not None:
            print(f"{name}: TRL time-to-target / {name} time-to-target = {trl_t / to_target[name]:.2f}")
    for name in rlsys_sides:
        split = results[name]["learner_s_per_step"]
        print(f"{name} learner, seconds a step: compute {split['compute']:.3f}, publish {split['publish']:.3f}, "
              f"waiting for data {split['wait_data']:.3f}")
    if "trl" in results:
        # With every core busy a side trains (cores / CPU seconds per sample) samples a second, whatever it overlaps:
        # the most a side could reach on the machine it ran on, against TRL's measured samples/s.
        trl, cores = results["trl"], saved.get("cores")  # not in files saved before 2026-12-02
        for name in rlsys_sides if cores else ():
            ceiling = cores / results[name]["cpu_s_per_sample"]
            print(f"{name}: CPU per sample {results[name]['cpu_s_per_sample'] / trl['cpu_s_per_sample']:.2f}x TRL's; "
                  f"with all {cores} cores busy at most {ceiling:.0f} samples/s, "
                  f"{ceiling / trl['samples_per_second']:.2f}x TRL's measured {trl['samples_per_second']:.0f}")
    if trl_t is not None and rlsys_t is not None:
        print(f"ratio: {trl_t / rlsys_t:.2f} (TRL time-to-target / rlsys time-to-target, +{points:g} held-out points)")
    elif "trl" in results and trl_t is None and rlsys_t is not None:  # TRL would take longer than its whole run
        trl_s = results["trl"]["train_s"]
        print(f"ratio: n/a (TRL did not reach +{points:g} points in {steps} batches, {trl_s:.1f} s of training: more "
              f"than {trl_s / rlsys_t:.2f} times rlsys's {rlsys_t:.1f} s)")
    elif "trl" in results and trl_t is not None:  # rlsys would take longer than its whole run
        rlsys_s = results["rlsys"]["train_s"]
        print(f"ratio: n/a (rlsys did not reach +{points:g} points in {steps} batches, {rlsys_s:.1f} s of training: "
              f"less than {trl_t / rlsys_s:.2f}, TRL took {trl_t:.1f} s)")
    elif "trl" in results:
        print(f"ratio: n/a (neither side reached +{points:g} points in {steps} batches)")
    else:
        reached = f"reached +{points:g} at {rlsys_t:.1f} s" if rlsys_t is not None else f"did not reach +{points:g}"
        print(f"ratio: n/a (no TRL side; in {steps} batches rlsys {reached})")


if __name__ == "__main__":
    main()
