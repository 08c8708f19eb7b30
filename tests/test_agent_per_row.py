"""A dataset row may name its agent (`agent_name`, as in verl); rows without one use the experiment's default."""

import dataclasses
import json

import pytest

import rlsys.impl.agent  # noqa: F401  (registers the built-in agents and environments)
import rlsys.impl.env  # noqa: F401
from experiments import AsyncPPOMATHConfig, register_experiment
from rlsys.api import Agent, AgentAbstraction, Trajectory, register_agent
from rlsys.assets import prepare_assets
from rlsys.bus import InProcessBus
from rlsys.data.dataset import DatasetError, load_rows
from rlsys.workers.rollout_worker import RolloutWorker
from tests.helpers import save_random_tiny_model


class EchoAgent(Agent):
    """Answers every prompt with one trajectory whose metrics say which agent played it."""

    def __init__(self, tag: float):
        self.tag = tag

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        return [Trajectory(token_ids=prompt.token_ids, loss_mask=[0] * len(prompt.token_ids),
                           logprobs=[0.0] * len(prompt.token_ids), versions=[-1] * len(prompt.token_ids),
                           turn_ends=[], turn_rewards=[], reward=0.0, group_id=prompt.qid, stop_reason="stop",
                           metrics={"tag": self.tag})]


register_agent("echo-agent", EchoAgent)


@dataclasses.dataclass
class TwoAgentExperiment(AsyncPPOMATHConfig):
    @property
    def agents(self):
        return {**super().agents, "echo": AgentAbstraction("echo-agent", {"tag": 7.0})}


register_experiment("two-agent-test", TwoAgentExperiment)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_rows_choose_their_agent_and_the_rest_use_the_default(tmp_path):
    config = TwoAgentExperiment()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": "4", "agent_name": "echo"}]
    config.dataset.path = config.dataset.eval_path = write_rows(tmp_path / "rows.jsonl", rows)
    worker = RolloutWorker(config, InProcessBus(), 0)
    prompts = list(worker.prompts(load_rows(config.dataset.path), "eval", shuffle=False))
    assert type(worker.agent_for(prompts[0], worker.agents)).__name__ == "MathSingleStepAgent"
    assert worker.agent_for(prompts[1], worker.agents).tag == 7.0
    assert worker.agent_for(prompts[1], worker.eval_agents).tag == 7.0  # evaluation plays rows the same way



def test_a_row_naming_an_unknown_agent_stops_the_run_at_start_with_its_line(tmp_path):
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": "4", "agent_name": "ehco"}]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DatasetError, match=r"rows.jsonl:2: agent_name 'ehco' is not an agent of this experiment; "
                                           r"it has \['echo', 'math-single-step'\]"):
        load_rows(path, agent_names=["math-single-step", "echo"])
    config = TwoAgentExperiment()
    config.dataset.path = config.dataset.eval_path = path
    config.model.cache_dir = str(tmp_path / "cache")
    with pytest.raises(DatasetError, match="rows.jsonl:2: agent_name 'ehco'"):
        prepare_assets(config)  # before any model is built or process started
    assert not (tmp_path / "cache").exists()
