"""cluster.backend=ray on a three-node Ray cluster started on this machine (ray.cluster_utils.Cluster).

The learner is pinned to the head node and the inference worker to one of two other nodes by custom
resources; weights travel from the learner's memory over the stream only (the run directory never holds a weight
file). One node is removed mid-run, with the inference worker on it: Ray moves its bundle to the other node,
the supervisor starts a new actor there, the run finishes its steps with every prompt accounted, and every Ray process
is gone at the end. A rollout worker's actor killed on a Ray of the run's own is restarted the same way.
"""

import contextlib
import json
import threading
import time
from pathlib import Path

import psutil
import pytest

from rlsys import protocol
from rlsys.bus import RedisBus
from rlsys.cli import parse_config
from rlsys.launcher import launch
from rlsys.metrics import read_jsonl_metrics
from tests.helpers import child_pids, left_behind, small_run_overrides

pytestmark = pytest.mark.distributed


def run_bus(run_dir: Path) -> RedisBus:
    """A client of the run's private Redis, which listens on the head node's address, not loopback."""
    config = dict(line.split(" ", 1) for line in (run_dir / "redis" / "redis.conf").read_text().splitlines())
    return RedisBus.from_url(f"redis://:{json.loads(config['requirepass'])}@{config['bind']}:{config['port']}/0")


def role_process(name: str) -> psutil.Process | None:
    found = [p for p in psutil.Process().children(recursive=True) if p.name() == name]
    return found[0] if found else None


def node_of(process: psutil.Process, nodes: list):
    """The Ray node whose raylet started `process`."""
    from ray._private import ray_constants

    raylets = {node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid: node for node in nodes}
    (node,) = [raylets[p.pid] for p in process.parents() if p.pid in raylets]
    return node


@pytest.mark.slow
def test_a_run_on_three_ray_nodes_survives_losing_the_inference_node(cache_dir, tmp_path):
    from ray.cluster_utils import Cluster

    ranks = 2  # the learner's ranks on the trainer node, joined over gloo
    existing = child_pids()
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=ranks + 1, resources={"trainer": ranks}, include_dashboard=False))
    head = cluster.head_node
    generators = [cluster.add_node(num_cpus=2, resources={"generator": 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    config = parse_config(small_run_overrides(cache_dir, tmp_path) + [
        "trial_name=ray", "max_steps=6", "inference.engine=transformers", "cluster.inference_dead_after=2",
        "cluster.backend=ray", f"cluster.ray_address={cluster.address}", f"cluster.n_learner_ranks={ranks}",
        "cluster.learner_resources=trainer:1", "cluster.inference_resources=generator:1"])
    run_dir = tmp_path / "async-ppo-math" / "ray"
    seen: dict = {}

    def remove_the_inference_node() -> None:
        """Once the worker served a version it fetched from the learner, the node it runs on goes away."""
        deadline = time.monotonic() + 600
        while not (run_dir / "redis" / "redis.conf").exists():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        with contextlib.closing(run_bus(run_dir)) as bus:
            while (status := bus.get(protocol.inference_status(0)) or {}).get("weights_streamed", 0) < 2:
                assert time.monotonic() < deadline, "the inference worker never received a version over the stream"
                time.sleep(0.2)
            seen["before"] = status
            inference, learner = role_process("inference0"), role_process("learner0")
            seen["nodes"] = node_of(inference, [head, *generators]), node_of(learner, [head])
            cluster.remove_node(seen["nodes"][0], allow_graceful=False)
            while (status := bus.get(protocol.inference_status(0)) or {}).get("epoch", 1) < 2 or \
                    status.get("weights_streamed", 0) < 1:
                assert time.monotonic() < deadline, "no new inference worker received weights after the node was lost"
                time.sleep(0.2)
            seen["after"] = status

    killer = threading.Thread(target=remove_the_inference_node, daemon=True)
    killer.start()
    try:
        summary = launch(config)
        killer.join(timeout=60)
    finally:
        cluster.shutdown()
    assert "after" in seen, "the node was never removed"
    assert seen["nodes"][0] in generators and seen["nodes"][1] is head  # different nodes
    assert seen["before"]["version"] >= 1 and seen["after"]["version"] >= seen["before"]["version"]
    assert not (run_dir / "weights").exists(), "a weight file was written: workers could have read it from disk"
    steps = read_jsonl_metrics(run_dir / "logs" / "learner.jsonl")
    assert [s["step"] for s in steps] == list(range(1, 7))
    assert all(s["staleness_max"] <= config.max_head_offpolicyness for s in steps)
    assert summary["restarts"].get("inference0") == 1, summary["restarts"]
    assert summary["unclean_exits"] == {}, summary["unclean_exits"]  # the roles ended cleanly on their nodes
    assert summary["prompts_accounted"], summary["prompts"]
    assert summary["final_accuracy"] is not None
    assert left_behind(tmp_path, existing) == []


@pytest.mark.long  # 90 s; the slow tier's Ray run restarts a role already (its node lost)
def test_a_rollout_worker_whose_ray_actor_is_killed_is_restarted_and_the_run_loses_no_prompt(cache_dir, tmp_path):
    """A role killed on Ray (its actor's process SIGKILLed: the OOM killer, `ray.kill`) runs no handler of its own:
    the supervisor counts the restart, the successor redoes the unfinished episodes (the summary accounts every prompt,
    none left in flight), and the role's children (its verifier workers) go with it."""
    import signal

    existing = child_pids()
    config = parse_config(small_run_overrides(cache_dir, tmp_path) + [
        "trial_name=killed", "max_steps=20", "inference.engine=transformers", "cluster.backend=ray"])
    run_dir = tmp_path / "async-ppo-math" / "killed"
    seen: dict = {}

    def kill_the_rollout_worker() -> None:
        deadline = time.monotonic() + 600
        steps = run_dir / "logs" / "learner.jsonl"
        while not (steps.exists() and steps.read_text().strip() and role_process("rollout0")):  # mid-training
            assert time.monotonic() < deadline
            time.sleep(0.1)
        worker = role_process("rollout0")
        seen["children"] = worker.children(recursive=True)
        worker.send_signal(signal.SIGKILL)
        seen["killed"] = True

    killer = threading.Thread(target=kill_the_rollout_worker, daemon=True)
    killer.start()
    summary = launch(config)
    killer.join(timeout=60)
    assert seen.get("killed"), "the rollout worker was never killed"
    assert summary["restarts"] == {"rollout0": 1}, summary["restarts"]
    assert summary["prompts_accounted"] and summary["prompts"]["in_flight"] == 0, summary["prompts"]
    alive = [p for p in seen["children"] if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert seen["children"] and not alive, alive
    assert left_behind(tmp_path, existing) == []
