"""The whole loop on real parts: embedded Redis, vLLM inference worker, rollout worker, learner."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rlsys.cli import parse_config
from rlsys.launcher import RoleFailed, launch
from rlsys.metrics import read_jsonl_metrics
from tests.helpers import small_run_overrides

ROOT = Path(__file__).resolve().parents[1]
ENTRY = ROOT / "training" / "main_async_ppo.py"


def descendants_and_redis() -> list[psutil.Process]:
    """Processes a run could leave behind: our children, and any redis-server still running."""
    me = psutil.Process()
    leftovers = [p for p in me.children(recursive=True)
                 if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())]
    for p in psutil.process_iter(["name", "status"]):
        if p.info["name"] == "redis-server" and p.info["status"] != psutil.STATUS_ZOMBIE:
            leftovers.append(p)
    return leftovers


def test_async_ppo_raises_held_out_accuracy(cache_dir, tmp_path):
    config = parse_config(small_run_overrides(cache_dir, tmp_path) + ["max_steps=40", "save_steps=20"])
    summary = launch(config)

    before, after = summary["initial_accuracy"], summary["final_accuracy"]
    assert after >= before + 0.08, f"held-out accuracy {before:.1%} -> {after:.1%}: RL did not help"
    run_dir = Path(summary["run_dir"])
    steps = read_jsonl_metrics(run_dir / "logs" / "learner.jsonl")
    assert [s["step"] for s in steps] == list(range(1, 41))
    assert [s["version"] for s in steps] == list(range(1, 41))
    assert all(s["staleness_max"] <= config.max_head_offpolicyness + 1 for s in steps)
    assert all(s["agent/verify_failed"] == 0 for s in steps)
    first, last = steps[:10], steps[-10:]
    assert sum(s["reward"] for s in last) > sum(s["reward"] for s in first), "training reward did not rise"
    for step in (20, 40):  # HF-format checkpoints that transformers loads back
        checkpoint = run_dir / "checkpoints" / f"step_{step}"
        assert (checkpoint / "config.json").exists() and (checkpoint / "tokenizer.json").exists()
    assert (run_dir / "config.yaml").exists()
    assert descendants_and_redis() == []


def test_max_head_offpolicyness_zero_is_on_policy(cache_dir, tmp_path):
    config = parse_config(small_run_overrides(cache_dir, tmp_path) + [
        "max_steps=4", "max_head_offpolicyness=0", "eval_steps=2"])
    launch(config)
    steps = read_jsonl_metrics(Path(config.logging_dir) / "learner.jsonl")
    assert len(steps) == 4
    assert all(s["staleness_max"] == 0 for s in steps), [s["staleness_max"] for s in steps]
    rollout = read_jsonl_metrics(Path(config.logging_dir) / "rollout0.jsonl")
    eval_versions = [r["step"] for r in rollout if "eval/accuracy" in r]
    assert eval_versions[0] == 0 and eval_versions[-1] == 4  # before and after training
    assert any(2 <= v < 4 for v in eval_versions[1:-1]), eval_versions  # and every eval_steps versions
    assert [r["episodes/failed"] for r in rollout if "episodes/failed" in r] == [0]


def test_ctrl_c_stops_every_process(cache_dir, tmp_path):
    args = small_run_overrides(cache_dir, tmp_path) + ["max_steps=100000", "logging_steps=1"]
    proc = subprocess.Popen([sys.executable, str(ENTRY), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp_path)
    try:
        for line in proc.stdout:  # wait until training is really under way
            if line.startswith("step"):
                break
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("redis-server" in " ".join(c.cmdline()) for c in children)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert alive == [], f"left running after Ctrl-C: {[p.cmdline() for p in alive]}"
    assert proc.returncode != 0


def test_bad_key_on_the_command_line_exits_2_with_close_matches(tmp_path):
    result = subprocess.run([sys.executable, str(ENTRY), "ppo.lrr=1e-5"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert "unknown key 'ppo.lrr'; did you mean 'ppo.lr'?" in result.stderr


def test_resume_from_checkpoint_continues_step_and_version(cache_dir, tmp_path):
    first = parse_config(small_run_overrides(cache_dir, tmp_path) + ["max_steps=2", "trial_name=a"])
    launch(first)
    checkpoint = tmp_path / "async-ppo-math" / "a" / "checkpoints" / "step_2"
    second = parse_config(small_run_overrides(cache_dir, tmp_path) + [
        "max_steps=4", "trial_name=b", f"resume_from_checkpoint={checkpoint}"])
    launch(second)
    steps = read_jsonl_metrics(tmp_path / "async-ppo-math" / "b" / "logs" / "learner.jsonl")
    assert [(s["step"], s["version"]) for s in steps] == [(3, 3), (4, 4)]
    # The gate counted the trained prompts as admitted: the resumed run never trains on weights
    # older than its checkpoint, so nothing it trains on is more than eta versions behind.
    assert all(s["staleness_max"] <= second.max_head_offpolicyness for s in steps)
    assert min(s["newest_version"] for s in steps) >= 2


BROKEN_PLUGIN = '''
import dataclasses
from experiments import AsyncPPOMATHConfig, register_experiment
from rlsys.api import Agent, AgentAbstraction, register_agent

class BrokenAgent(Agent):
    def __init__(self):
        raise RuntimeError("this agent cannot start")

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        return []

register_agent("broken-agent", BrokenAgent)

@dataclasses.dataclass
class BrokenExperiment(AsyncPPOMATHConfig):
    @property
    def agent(self):
        return AgentAbstraction("broken-agent")

register_experiment("broken-experiment", BrokenExperiment)
'''


def test_a_role_that_dies_stops_the_run_with_its_name_and_leaves_nothing(cache_dir, tmp_path):
    plugin = tmp_path / "broken_plugin.py"
    plugin.write_text(BROKEN_PLUGIN)
    config = parse_config(small_run_overrides(cache_dir, tmp_path) + [
        "experiment=broken-experiment", f"plugins=[{plugin}]", "max_steps=2"])
    with pytest.raises(RoleFailed, match="rollout0 exited with code 1"):
        launch(config)
    assert descendants_and_redis() == []
