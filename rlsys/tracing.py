"""Rollout traces: what each recorded episode did, turn by turn, from the agent's call to the gradient.

A rollout worker records a sampled share of its episodes (`trace.sample_rate`, chosen by a hash of the episode id,
so every process agrees which): of training episodes, and of evaluation episodes, whose ids name the held-out row,
so every evaluation traces the same problems and their answers compare before and after. Each trajectory's
messages (prompt, model turns, feedback and tool results, decoded), token counts, tool calls, per-turn
rewards and weight versions, the episode's model calls with their timings, and the stop or failure
reason. The learner adds, for the traced episodes it trains, the step and each trajectory's advantage.
Lines go to `<run dir>/traces/*.jsonl`. Decoding and writing happen on a background thread, off the
episode's path; `bench/rollout_throughput.py` measures what is left of the cost.
"""

import hashlib
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path

from rlsys.api import Trajectory
from rlsys.metrics import STEP, number, strict_json
from rlsys.run_privacy import append_private
from rlsys.tools.call_format import CALL, RESPONSE_OPEN

log = logging.getLogger(__name__)
TRACES_DIR = "traces"
TRAINED_FILE = "trained.jsonl"


def traced(episode_id: str, rate: float) -> bool:
    """Whether `episode_id` is in the sampled share `rate`: a hash, so rollout workers and learner agree."""
    if rate >= 1:
        return True
    return int(hashlib.sha1(episode_id.encode()).hexdigest()[:8], 16) < rate * 2**32


def tool_calls(text: str) -> list[dict]:
    """The `<tool_call>` bodies of a model turn: {"name", "arguments"}, or {"error", "text"} if not JSON."""
    calls = []
    for body in CALL.findall(text):
        try:
            call = json.loads(body)
            calls.append({"name": str(call.get("name")), "arguments": call.get("arguments")}
                         if isinstance(call, dict) else {"error": "not an object", "text": body})
        except json.JSONDecodeError as e:
            calls.append({"error": str(e), "text": body})
    return calls


def trajectory_record(tokenizer, t: Trajectory) -> dict:
    """Messages of one trajectory: runs of prompt/feedback tokens and of each model turn, decoded."""
    cuts = sorted({0, len(t.token_ids), *t.turn_ends,
                   *(i for i in range(1, len(t.loss_mask)) if t.loss_mask[i] != t.loss_mask[i - 1])})
    messages, turn = [], 0
    for start, end in zip(cuts, cuts[1:]):
        text = tokenizer.decode(t.token_ids[start:end], skip_special_tokens=True)
        if t.loss_mask[start]:
            while turn < len(t.turn_ends) - 1 and t.turn_ends[turn] < end:
                turn += 1
            versions = t.versions[start:end]
            messages.append({"role": "assistant", "text": text, "tokens": end - start, "turn": turn,
                             "reward": t.turn_rewards[turn] if turn < len(t.turn_rewards) else None,
                             "versions": [min(versions), max(versions)],
                             "logprob_mean": sum(t.logprobs[start:end]) / (end - start),
                             "tool_calls": tool_calls(text)})
        else:
            role = "prompt" if start == 0 else ("tool" if RESPONSE_OPEN in text else "user")
            messages.append({"role": role, "text": text, "tokens": end - start})
    generated = [v for v, m in zip(t.versions, t.loss_mask) if m]
    return {"traj_id": t.traj_id, "group_id": t.group_id, "reward": t.reward, "turn_rewards": t.turn_rewards,
            "stop_reason": t.stop_reason, "void": t.void, "metrics": t.metrics, "tokens": len(t.token_ids),
            "generated_tokens": len(generated), "versions": [min(generated), max(generated)] if generated else [],
            "messages": messages}


class TraceWriter:
    """Appends episode records to `<run dir>/traces/<name>.jsonl` from a background thread.

    `record` only queues the episode's objects (they are not touched again by the worker); decoding,
    JSON and the file (and frames, if `render_dir`) are the thread's work.
    """

    def __init__(self, run_dir: Path, name: str, tokenizer, sample_rate: float, render_dir: Path | None = None):
        self.sample_rate, self.tokenizer, self.render_dir = sample_rate, tokenizer, render_dir
        directory = Path(run_dir) / TRACES_DIR
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{name}.jsonl"
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._write, name="trace-writer", daemon=True)
        self.thread.start()

    def wants(self, episode_id: str) -> bool:
        # evaluations too: every one of them traced took minutes of MLflow export at the end of a default run
        return traced(episode_id, self.sample_rate)

    def record(self, episode_id: str, tag: str, started: float, trajectories: list[Trajectory] | None,
               failure: tuple[str, str] | None, calls: list[dict]) -> None:
        self.queue.put((episode_id, tag, started, time.time(), trajectories, failure, calls))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()

    def _write(self) -> None:
        with os.fdopen(append_private(self.path), "a", buffering=1 << 16) as file:
            if _ends_mid_line(self.path):  # a predecessor killed mid-record: ours start on a line of their own
                file.write("\n")
            while (item := self.queue.get()) is not None:
                try:
                    record = self._episode(*item)
                    file.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
                    if self.render_dir is not None and record["trajectories"]:
                        from rlsys.frames import render_episode

                        render_episode(record, self.render_dir)
                except Exception:  # a trace is never worth an episode or the run
                    log.warning("could not record the trace of episode %s", item[0], exc_info=True)

    def _episode(self, episode_id, tag, started, ended, trajectories, failure, calls) -> dict:
        return {"episode_id": episode_id, "tag": tag, "started": started, "ended": ended, "seconds": ended - started,
                "failure": None if failure is None else {"reason": failure[0], "detail": failure[1]},
                "calls": calls, "trajectories": [trajectory_record(self.tokenizer, t) for t in trajectories or []]}


def _ends_mid_line(path: Path) -> bool:
    """Whether the file's last record was cut short: its writer was killed with part of its buffer written."""
    with open(path, "rb") as file:
        if file.seek(0, os.SEEK_END) == 0:
            return False
        file.seek(-1, os.SEEK_END)
        return file.read(1) != b"\n"


def _records(path: Path) -> list[dict]:
    """The records of a trace file, but for any a kill cut short (the writer's buffer goes out in pieces)."""
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                log.warning("%s: a record cut short (its writer was killed) is left out", path)
    return records


def write_trained(run_dir: Path, step: int, trajectories: list[Trajectory], advantages: list[float],
                  sample_rate: float) -> None:
    """The learner's part of the traced episodes it just trained: step and mean advantage per trajectory (over its
    tokens with a non-zero advantage). Its rows' step is the records' (a resume takes back the rows after its own)."""
    lines = [json.dumps(strict_json({"traj_id": t.traj_id, "group_id": t.group_id, STEP: step, "advantage": a}),
                        allow_nan=False)
             for t, a in zip(trajectories, advantages) if traced(t.group_id, sample_rate)]
    if lines:
        directory = Path(run_dir) / TRACES_DIR
        directory.mkdir(parents=True, exist_ok=True)
        with os.fdopen(append_private(directory / TRAINED_FILE), "a") as file:
            file.write("\n".join(lines) + "\n")


def read_traces(run_dir: Path) -> list[dict]:
    """Every episode record of a run, its trajectories joined with the step and advantage that trained them."""
    directory = Path(run_dir) / TRACES_DIR
    trained = {}
    if (directory / TRAINED_FILE).exists():
        for row in _records(directory / TRAINED_FILE):
            trained[row["traj_id"]] = {"step": row[STEP], "advantage": number(row["advantage"])}
    episodes = []
    for path in sorted(directory.glob("*.jsonl")) if directory.exists() else []:
        if path.name == TRAINED_FILE:
            continue
        for episode in _records(path):
            for t in episode["trajectories"]:
                _numbers_back(t)
                if t["traj_id"] in trained:
                    t["trained"] = dict(trained[t["traj_id"]])
            episodes.append(episode)
    return episodes


def _numbers_back(trajectory: dict) -> None:
    """A trajectory record's non-finite numbers, which its writer wrote as strings (strict JSON), floats again; only
    where a number stands: a model turn's text may be "NaN" itself."""
    trajectory["reward"] = number(trajectory["reward"])
    trajectory["turn_rewards"] = [number(r) for r in trajectory["turn_rewards"]]
    trajectory["metrics"] = {key: number(value) for key, value in trajectory["metrics"].items()}
    for message in trajectory["messages"]:
        if message["role"] == "assistant":
            message["reward"], message["logprob_mean"] = number(message["reward"]), number(message["logprob_mean"])
