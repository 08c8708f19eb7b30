"""Bad input gets a clear error, and a run that cannot work stops before it starts anything.

Malformed configs, datasets and model outputs here; malformed bus messages (random bytes, wrong schema,
huge payloads) in tests/test_delivery.py, and injected into a live run in tests/test_faults.py.
"""

import asyncio
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from unittest.mock import Mock

import pytest

import rlsys.impl.env  # noqa: F401  (registers the environments)
from experiments import AsyncPPOMATHConfig, register_experiment
from rlsys.api import AgentAbstraction, EnvServiceAbstraction, make_env
from rlsys.bus import EmbeddedRedis
from rlsys.checkpoint import TRAINER_STATE
from rlsys.cli import ConfigError, parse_config, save_config
from rlsys.data.dataset import DatasetError, load_rows, rows_fingerprint
from rlsys.impl.env.math_verifier import close_shared_pool
from rlsys.launcher import launch
from rlsys.run_start import last_checkpoint_note, resolve_resume, run_directory
from rlsys.preflight import StartupError
from tests.helpers import child_pids, held_port, left_behind, save_random_tiny_model

ROOT = Path(__file__).resolve().parents[1]
ENTRY = ROOT / "training" / "main_async_ppo.py"


# ---------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["ppo.lr=fast"], "invalid value for ppo.lr: expected float, got 'fast'"),
    (["group_size=[1,2]"], "group_size"),
    (["ppo.batch_size=1.5"], "ppo.batch_size"),
    (["ppo.batchsize=4"], "unknown key 'ppo.batchsize'; did you mean 'ppo.batch_size'?"),
    (["ppo=3"], "ppo is a group of settings"),
    (["ppo.batch_size=0"], "ppo.batch_size must be at least 1, got 0"),
    (["group_size=0"], "group_size must be at least 1"),
    (["group_size=1"], "group_size must be at least 2 with ppo.adv_estimator=grpo"),
    (["group_size=1", "ppo.adv_estimator=starpo"], "group_size must be at least 2 with ppo.adv_estimator=starpo"),
    (["group_size=1", "ppo.filter_uniform_groups=true"],
     "group_size must be at least 2 with ppo.adv_estimator=grpo and ppo.filter_uniform_groups=true"),
    (["max_concurrent_rollouts=0"], "max_concurrent_rollouts must be at least 1"),
    (["save_steps=-1"], "save_steps must be at least 0"),
    (["eval_steps=-5"], "eval_steps must be at least 0"),
    (["max_steps=0"], "max_steps must be at least 1"),
    (["env_timeout=-1"], "env_timeout must be at least 0"),
    (["cluster.max_threads_left_running=-1"], "cluster.max_threads_left_running must be at least 0, got -1"),
    (["ppo.num_mini_batches=1000"], "ppo.num_mini_batches (1000) is more than the sequences of a step"),
    (["gen.temperature=-1"], "gen.temperature must be at least 0"),
    (["gen.temperature=1e-7"], "gen.temperature 1e-07 is sampled at 0.01 in the engines (vLLM's floor)"),
    (["gen.temperature=0.005"], "gen.temperature 0.005 is sampled at 0.01 in the engines (vLLM's floor) while the "
                                "learner divides by 0.005"),
    (["gen.temperature=2.5"], "gen.temperature=2.5 is more than vLLM takes (2.0 at most: it would refuse every "
                              "rollout's request): lower it, or set inference.engine=transformers"),
    (["gen.top_p=1.5"], "gen.top_p must be in (0, 1]"),
    (["cluster.redis_port=99999"], "cluster.redis_port must be a TCP port"),
    (["inference.tensor_parallel_size=2"], "inference.tensor_parallel_size=2 takes new weights from disk only: set "
                                           "cluster.weights_transport=disk"),
    (["cluster.inference_dead_after=0.3"], "cluster.inference_dead_after must be at least 1 s, got 0.3: inference "
                                           "workers beat every 0.25 s"),
    (["cluster.n_rollout_workers=0"], "cluster.n_rollout_workers must be at least 1"),
    (["cluster.max_message_mb=0"], "cluster.max_message_mb must be positive"),
    (["cluster.max_message_mb=600"], "cluster.max_message_mb must be at most 512 (the largest value Redis takes), "
                                     "got 600"),
    (["cluster.redis_url=localhost:6379"], "cluster.redis_url must look like redis://"),
    (["inference.gpu_memory_utilization=2"], "inference.gpu_memory_utilization must be in (0, 1]"),
    (["model.num_heads=3"], "model.hidden_size (256) must be a multiple of model.num_heads (3)"),
    (["inference.dtype=float33"], "inference.dtype must be one of ('float32', 'bfloat16', 'float16'), got 'float33'"),
    (["ppo.importance_sampling_level=seq"],
     "ppo.importance_sampling_level must be one of ('token', 'sequence'), got 'seq'"),
    (["ppo.init_kl_coef=0.1", "ppo.kl_estimator=low_var_kl"],
     "ppo.kl_estimator must be one of ('k1', 'k2', 'k3'), got 'low_var_kl'"),
    (["ppo.share_prefixes=true", "learner.attn_implementation=sdpa"],
     "ppo.share_prefixes=true needs rlsys's attention"),
    (["alarms.stop_on_logprob_diff=true", "alarms.logprob_diff_warn=0"],
     "alarms.stop_on_logprob_diff=True does nothing with alarms.logprob_diff_warn=0"),
    (["experiment=async-ppo-math-multi-turn", "num_turns=0"], "num_turns must be at least 1, got 0"),
    (["experiment=async-ppo-math-multi-turn", "turn_discount=7"], "turn_discount must be in [0, 1], got 7.0"),
    (["experiment=async-ppo-sokoban", "num_turns=0"], "num_turns must be at least 1, got 0"),
    (["experiment=async-ppo-sokoban", "num_boxes=40"], "a 6x6 room holds 1 to 14 boxes"),
    (["experiment=async-ppo-frozen-lake", "game_size=1"], "game_size must be at least 2, got 1"),
    (["experiment=async-ppo-frozen-lake", "frozen_prob=0"], "frozen_prob must be in (0, 1], got 0.0"),  # it hung
    (["experiment=async-ppo-math-tools", "tools=[calculater]"],
     "tools: unknown tool 'calculater'. Did you mean ['calculator']? Registered tools: ["),
    (["experiment=async-ppo-math-tools", "tool_timeout=-3"], "tool_timeout must be positive, got -3.0"),
    (["cluster.stop_grace_seconds=0"], "cluster.stop_grace_seconds must be positive, got 0.0"),
    # output_dir/experiment_name/trial_name: '.' wrote into the experiment's directory, '..' and a path outside it
    (["trial_name=."], "trial_name must be a single directory name (no '/', not '.' or '..'), got '.'"),
    (["trial_name=../x"], "trial_name must be a single directory name (no '/', not '.' or '..'), got '../x'"),
    (["trial_name=a/b"], "trial_name must be a single directory name"),
    (["experiment_name=/abs/path"], "experiment_name must be a single directory name (no '/', not '.' or '..'), "
                                    "got '/abs/path'"),
    (["experiment_name=.."], "experiment_name must be a single directory name"),
    # The agent refused them too, but only once the assets were ready (a warm start: minutes), naming its own argument
    (["experiment=async-ppo-openai-agent", "agent_timeout=-1"], "agent_timeout must be positive, got -1.0"),
    (["experiment=async-ppo-openai-agent", "max_total_tokens=1"], "max_total_tokens must be at least 2, got 1"),
    (["experiment=async-ppo-math-tools", "max_total_tokens=1"], "max_total_tokens must be at least 2, got 1"),
    (["ppo.mask_void_trajectories=true"],
     "ppo.mask_void_trajectories=True does nothing with agents that never mark a trajectory void "
     "(['math-single-step'])"),
    (["experiment=async-ppo-math-long", "dataset.path=a.jsonl", "dataset.eval_path=b.jsonl", "min_terms=3"],
     "min_terms=3 does nothing with dataset.path set"),
    (["experiment=async-ppo-sokoban", "model.path=/m", "warm_start_hint=0.5"],
     "warm_start_hint=0.5 does nothing with model.path set"),
    (["experiment=async-ppo-mixed-games", "dataset.path=a.jsonl", "dataset.eval_path=b.jsonl", "frozen_lake_share=0.3"],
     "frozen_lake_share=0.3 does nothing with dataset.path set"),
])
def test_a_config_that_cannot_work_names_its_key(args, message):
    with pytest.raises(ConfigError) as error:
        parse_config(args)
    assert message in str(error.value)


@pytest.mark.parametrize("text, message", [
    ("ppo: [unclosed\n", "cannot read config file"),
    ("- just\n- a list\n", "must hold a mapping"),
    ("ppo:\n  lr: {nested: 1}\n", "ppo.lr"),
    ("seed: 1\nseed: 2\n", "cannot read config file"),
    ("\x00\x01binary", "cannot read config file"),
])
def test_a_malformed_yaml_config_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_config(["--config", str(path)])


# ---------------------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------------------

GOOD_ROW = json.dumps({"prompt": "1+1=", "answer": "2"})


@pytest.mark.parametrize("content, message", [
    (f"{GOOD_ROW}\n{{\"prompt\": \"2+2=\", \"answer\": \n", r":2: not valid JSON"),
    (f"{GOOD_ROW}\n{GOOD_ROW}\n{json.dumps({'prompt': '3+3='})}\n", r":3: field 'answer' missing"),
    (f"{json.dumps({'question': '3+3=', 'answer': '6'})}\n",  # verl's column name: the message names the setting
     r":1: field 'prompt' missing \(the row has \['answer', 'question'\]; dataset.prompt_key=FIELD reads another"),
    (f"{json.dumps({'prompt': 7, 'answer': '7'})}\n",
     r":1: field 'prompt' must be a string or a non-empty list of chat messages, got int"),
    (f"{GOOD_ROW}\n[1, 2]\n", r":2: expected a JSON object, got list"),
    ("", r"has no rows"),
    ("\n   \n\n", r"has no rows"),
    ("null\n", r":1: expected a JSON object, got NoneType"),  # datasets' reader crashed the process (a segmentation
    ("\nnull\n  null \n", r":2: expected a JSON object, got NoneType"),  # fault) on a file of nulls
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", r":1: not UTF-8 text|:1: not valid JSON"),
    (GOOD_ROW.encode() + b"\n" + bytes(range(128, 256)), r":2: not UTF-8 text \(byte 0"),
    # readers differ on which value they keep (pyarrow refuses it, Python keeps the last, ujson the first)
    (f'{GOOD_ROW}\n\n{{"prompt": "2+2=", "answer": "4", "prompt": "3+3="}}\n', r":3: key 'prompt' is given twice"),
    (f'{GOOD_ROW}\n{{"prompt": "2+2=", "answer": "4", "meta": {{"id": 1, "id": 2}}}}\n',
     r":2: key 'id' is given twice"),
])
def test_a_malformed_dataset_names_its_line_and_field(tmp_path, content, message):
    path = tmp_path / "data.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DatasetError, match=message) as error:
        load_rows(path)
    assert str(path) in str(error.value)


def test_an_unreadable_dataset_says_why(tmp_path):
    with pytest.raises(DatasetError, match="missing.jsonl: no such file"):
        load_rows(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError, match="cannot read dataset .*; give a JSONL, JSON, Parquet or Arrow file, or a d"):
        load_rows(tmp_path)


# ---------------------------------------------------------------------------------------------------------
# Stops at start: each before any process starts, nothing left behind
# ---------------------------------------------------------------------------------------------------------

def run_config(tmp_path: Path, *overrides: str):
    given = any(o.startswith("dataset.path=") for o in overrides)  # then a generated set's size would be refused
    small = [] if given else ["dataset.num_train=50", "dataset.num_eval=10"]
    return parse_config([f"output_dir={tmp_path / 'runs'}", f"model.cache_dir={tmp_path / 'cache'}", *small,
                         *overrides])


def test_a_learner_or_engine_setting_this_device_cannot_honour_stops_the_run(tmp_path, monkeypatch):
    existing = child_pids()
    monkeypatch.setattr("experiments.common.native_bf16", lambda: False)  # a CPU without bf16 arithmetic
    with pytest.raises(StartupError,
                       match="bfloat16 on a CPU needs bf16 arithmetic in its hardware.*learner.dtype=float32"):
        launch(run_config(tmp_path, "learner.dtype=bfloat16"))
    with pytest.raises(StartupError, match="flash_attention_2 needs a GPU"):
        launch(run_config(tmp_path, "learner.attn_implementation=flash_attention_2"))
    with pytest.raises(StartupError,
                       match="CUDA graphs, which need a GPU.*leave inference.enforce_eager unset or true"):
        launch(run_config(tmp_path, "inference.engine=transformers", "inference.enforce_eager=false"))
    with pytest.raises(StartupError, match="gpu_memory_utilization=0.9 does nothing on a CPU.*inference.kv_cache_gib"):
        launch(run_config(tmp_path, "inference.gpu_memory_utilization=0.9"))
    with pytest.raises(StartupError, match="gpu_memory_utilization=0.9 does nothing on a CPU.*engine runs eagerly"):
        launch(run_config(tmp_path, "inference.engine=transformers", "inference.gpu_memory_utilization=0.9"))
    assert left_behind(tmp_path, existing) == []
    assert not (tmp_path / "cache").exists()  # refused before the dataset and the warm start


@dataclasses.dataclass
class MisspelledEnvArgs(AsyncPPOMATHConfig):
    @property
    def env(self):
        return EnvServiceAbstraction("math-code-single-step", args={"verify_timout": 5})


register_experiment("misspelled-env-args", MisspelledEnvArgs)


@dataclasses.dataclass
class MisspelledAgent(AsyncPPOMATHConfig):
    @property
    def agent(self):
        return AgentAbstraction("math-single-stpe", args=dict(gconfig=None, tokenizer_path=self.model.path))


@dataclasses.dataclass
class MisspelledAgentArgs(AsyncPPOMATHConfig):
    @property
    def agent(self):
        return AgentAbstraction("math-single-step", args=dict(gconfig=None, tokenizer_pth=self.model.path))


register_experiment("misspelled-agent", MisspelledAgent)
register_experiment("misspelled-agent-args", MisspelledAgentArgs)


def test_a_plugin_name_or_argument_that_is_wrong_stops_the_run_before_the_warm_start(tmp_path, monkeypatch):
    """A newcomer's typo in an agent's or environment's name or argument is said in a second, not after the minutes
    of the tiny model's warm start (the agents are built, with the model's tokenizer, only after it)."""
    monkeypatch.setattr("rlsys.assets.prepare_assets", Mock(side_effect=AssertionError("the warm start ran first")))
    with pytest.raises(StartupError, match=re.escape("unknown agent 'math-single-stpe'. Did you mean "
                                                     "['math-single-step']?")):
        launch(run_config(tmp_path, "experiment=misspelled-agent"))
    with pytest.raises(StartupError, match=re.escape("unknown: 'tokenizer_pth' (did you mean 'tokenizer_path'?)")):
        launch(run_config(tmp_path, "experiment=misspelled-agent-args"))
    with pytest.raises(StartupError, match="environment 'math-code-single-step'.*cannot take args.*verify_timeout"):
        launch(run_config(tmp_path, "experiment=misspelled-env-args"))


@dataclasses.dataclass
class RewardModelArgs(AsyncPPOMATHConfig):  # docs/data.md's reward-model plugin
    reward_model_path: str = ""

    @property
    def env(self):
        return EnvServiceAbstraction("reward-model", args=dict(model_path=self.reward_model_path, timeout=60))


register_experiment("bad-input-reward-model", RewardModelArgs)


def test_an_agent_or_environment_that_refuses_its_arguments_stops_the_run_at_start(tmp_path):
    """Built once (agents) or bound to their constructors (environments) before any role starts: a run whose rollout
    worker could never build them stops with their message, not after the worker's restarts, its reason in a log."""
    existing = child_pids()
    rows = tmp_path / "rows.jsonl"
    rows.write_text(GOOD_ROW + "\n")
    given = [f"model.path={save_random_tiny_model(tmp_path / 'model')}", f"dataset.path={rows}",
             f"dataset.eval_path={rows}"]
    with pytest.raises(StartupError, match="agent 'openai-agent' cannot be built: cannot import plugin 'nonexistent'"):
        launch(run_config(tmp_path, "experiment=async-ppo-openai-agent", "agent_function=nonexistent:run", *given))
    with pytest.raises(StartupError, match="environment 'math-code-single-step'.*cannot take args.*verify_timeout"):
        launch(run_config(tmp_path, "experiment=misspelled-env-args", *given))
    # values the environment's check_args refuses, without loading its model: before, every episode failed on them.
    # The environment names its own argument (model_path); the error names the setting the user gave too.
    set_by = re.escape("(the run sets its model_path from reward_model_path)")
    with pytest.raises(StartupError, match="environment 'reward-model': reward-model needs model_path.*" + set_by):
        launch(run_config(tmp_path, "experiment=bad-input-reward-model", *given))
    with pytest.raises(StartupError, match="model_path '/nonexistent/rm' does not exist.*" + set_by):
        launch(run_config(tmp_path, "experiment=bad-input-reward-model", "reward_model_path=/nonexistent/rm", *given))
    with pytest.raises(StartupError, match="is not an HF checkpoint directory.*" + set_by):
        launch(run_config(tmp_path, "experiment=bad-input-reward-model", f"reward_model_path={tmp_path}", *given))
    assert left_behind(tmp_path, existing) == []


def test_a_missing_model_path_stops_the_run(tmp_path):
    existing = child_pids()
    with pytest.raises(StartupError, match="model.path '/nonexistent/model' does not exist; give an HF checkpoint"):
        launch(run_config(tmp_path, "model.path=/nonexistent/model"))
    not_a_checkpoint = tmp_path / "empty"
    not_a_checkpoint.mkdir()
    with pytest.raises(StartupError, match="no config.json"):
        launch(run_config(tmp_path, f"model.path={not_a_checkpoint}"))
    assert left_behind(tmp_path, existing) == []


def test_a_resume_from_what_is_no_checkpoint_names_resume_from_checkpoint(tmp_path):
    """Not model.path, which the resume fills in, and not a FileNotFoundError's traceback from an HF model's
    directory, which has weights and no trainer state."""
    existing = child_pids()
    rows = tmp_path / "rows.jsonl"
    rows.write_text(GOOD_ROW + "\n")
    given = [f"dataset.path={rows}", f"dataset.eval_path={rows}"]
    with pytest.raises(StartupError, match=r"^resume_from_checkpoint '/nonexistent/step_3' does not exist; give a "
                                           r"checkpoint a run saved \(runs/<experiment>/<trial>/checkpoints/step_N\)"):
        launch(run_config(tmp_path, "resume_from_checkpoint=/nonexistent/step_3", *given))
    model = save_random_tiny_model(tmp_path / "model")
    with pytest.raises(StartupError, match=rf"^resume_from_checkpoint '{model}' is not an rlsys checkpoint \(no "
                                           rf"trainer_state.json\): .*; to start from its weights instead, "
                                           rf"model.path={model}$"):
        launch(run_config(tmp_path, f"resume_from_checkpoint={model}", *given))
    assert left_behind(tmp_path, existing) == []


def test_a_malformed_dataset_stops_the_run_naming_line_and_field(tmp_path):
    existing = child_pids()
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text(f"{GOOD_ROW}\n{json.dumps({'prompt': '2+2=', 'answer': [4]})}\n")
    held_out.write_text(f"{GOOD_ROW}\n")
    with pytest.raises(StartupError, match=r"train.jsonl:2: field 'answer' must be a string or a number, got list"):
        launch(run_config(tmp_path, f"dataset.path={train}", f"dataset.eval_path={held_out}"))
    assert left_behind(tmp_path, existing) == []


def test_a_prompt_longer_than_the_models_context_stops_the_run_before_a_warm_start(tmp_path, monkeypatch):
    """The engine refuses a prompt that leaves no room for an answer: every episode of its row failed, after the
    warm start and the roles' start took minutes. Counted as the rollout worker sends it, chat template included."""
    from rlsys.assets import AssetError, prepare_assets
    from rlsys.model import tiny

    built = []
    monkeypatch.setattr(tiny, "prepare_tiny_model", lambda *args, **kwargs: built.append(args))
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text(f"{GOOD_ROW}\n{json.dumps({'prompt': '1+' * 300 + '1=', 'answer': '301'})}\n")
    held_out.write_text(f"{GOOD_ROW}\n")
    config = AsyncPPOMATHConfig()
    config.dataset.path, config.dataset.eval_path = str(train), str(held_out)
    config.model.cache_dir = str(tmp_path / "cache")
    with pytest.raises(AssetError, match=r"train.jsonl: row 2: field 'prompt' is a prompt of 605 tokens as the model "
                                         r"is sent it, and the tiny model's context of 512 positions leaves room for "
                                         r"at most 511 \(one more for the answer\): shorten or drop the row$"):
        prepare_assets(config)
    assert built == []  # no warm start
    # a model of the user's, within inference.max_model_len: "<|user|>" + the prompt + "<|end|><|assistant|>"
    model = save_random_tiny_model(tmp_path / "model")
    held_out.write_text(json.dumps({"prompt": "x" * 60, "answer": "1"}) + "\n")
    config = AsyncPPOMATHConfig()
    config.dataset.path, config.dataset.eval_path = str(held_out), str(held_out)
    config.model.path, config.inference.max_model_len = str(model), 64
    prepare_assets(config)  # 63 tokens fit, with room for one more
    held_out.write_text(json.dumps({"prompt": "x" * 61, "answer": "1"}) + "\n")
    with pytest.raises(AssetError, match=r"eval.jsonl: row 1: field 'prompt' is a prompt of 64 tokens .* "
                                         r"inference.max_model_len=64 leaves room for at most 63 .*: shorten or drop "
                                         r"the row, or raise inference.max_model_len$"):
        prepare_assets(config)


def test_a_chat_row_the_openai_agent_would_cut_to_its_last_message_stops_the_run_at_start(tmp_path):
    """agent_function(base_url, api_key, prompt) is given the prompt's text: the row's last user message. A system
    message or earlier turns never reached the model, though the warm start taught them."""
    from rlsys.assets import prepare_assets

    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    chat = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "2+2="}]
    train.write_text(f"{GOOD_ROW}\n{json.dumps({'prompt': [chat[1]], 'answer': '4'})}\n")  # one user message: text
    held_out.write_text(f"{GOOD_ROW}\n{json.dumps({'prompt': chat, 'answer': '4'})}\n")
    config = parse_config(["experiment=async-ppo-openai-agent", f"dataset.path={train}",
                           f"dataset.eval_path={held_out}", f"model.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(DatasetError, match=r"eval.jsonl: row 2: field 'prompt' is a chat of 2 messages, and "
                                           r"agent_function is given the text of its last user message alone"):
        prepare_assets(config)
    assert not (tmp_path / "cache").exists()  # before any model is built


def test_a_resume_on_other_training_rows_stops_before_anything_starts(tmp_path):
    """Prompts are named by their row's place: resumed on other rows (here two swapped), a run would skip rows it
    never trained and train others twice."""
    existing = child_pids()
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(4)]
    trained_on, now = tmp_path / "train.jsonl", tmp_path / "changed.jsonl"
    trained_on.write_text("".join(json.dumps(row) + "\n" for row in rows))
    now.write_text("".join(json.dumps(row) + "\n" for row in [rows[1], rows[0], *rows[2:]]))
    checkpoint = save_random_tiny_model(tmp_path / "checkpoint")  # the policy a checkpoint holds, and its state
    (checkpoint / TRAINER_STATE).write_text(json.dumps(
        {"step": 1, "version": 1, "dataset": rows_fingerprint(load_rows(trained_on))}))
    resume = [f"dataset.eval_path={trained_on}", f"resume_from_checkpoint={checkpoint}"]
    with pytest.raises(StartupError, match=r"checkpoint was trained on other training rows than dataset.path=.*"
                                           r"changed.jsonl holds now.*Resume with the dataset it was trained on"):
        launch(run_config(tmp_path, "trial_name=t", f"dataset.path={now}", *resume))
    assert not (tmp_path / "runs" / "async-ppo-math" / "t" / "redis").exists()  # nothing was started
    assert rows_fingerprint(load_rows(now)) != rows_fingerprint(load_rows(trained_on))
    assert left_behind(tmp_path, existing) == []


def test_a_fresh_start_where_an_earlier_run_wrote_stops_and_changes_nothing(tmp_path, capsys):
    """A trial_name used twice, or `--config runs/<experiment>/<trial>/config.yaml` again, without resume: it would
    append to that run's logs and leave two runs' checkpoints side by side."""
    existing = child_pids()
    run_dir = tmp_path / "runs" / "async-ppo-math" / "t"
    (run_dir / "logs").mkdir(parents=True)
    earlier = {run_dir / "config.yaml": "trial_name: t\n", run_dir / "logs" / "learner.jsonl": '{"step": 1}\n'}
    for path, text in earlier.items():
        path.write_text(text)
    with pytest.raises(StartupError, match=r"runs/async-ppo-math/t holds an earlier run \(.*learner.jsonl\).*"
                                           r"resume_from_checkpoint=auto.*trial_name=NEW"):
        launch(run_config(tmp_path, "trial_name=t"))
    assert {path: path.read_text() for path in earlier} == earlier
    (run_dir / "logs" / "learner.jsonl").unlink()
    (run_dir / "checkpoints" / "step_2.tmp").mkdir(parents=True)  # a half-written checkpoint: an earlier run too
    with pytest.raises(StartupError, match=r"holds an earlier run \(.*checkpoints\)"):
        launch(run_config(tmp_path, "trial_name=t"))
    assert not (tmp_path / "cache").exists()  # refused before the dataset and the warm start
    # Asked to continue it, the run is not refused (it stops later here, on the model path, before anything starts).
    with pytest.raises(StartupError, match="model.path '/nonexistent/model' does not exist"):
        launch(run_config(tmp_path, "trial_name=t", "resume_from_checkpoint=auto", "model.path=/nonexistent/model"))
    assert "no complete checkpoint in" in capsys.readouterr().out  # a .tmp one never counts
    assert left_behind(tmp_path, existing) == []


def test_a_refused_start_leaves_no_directory_behind(tmp_path):
    """config.yaml was saved before the checks: each refused start left a runs/<experiment>/run-<stamp>/ holding it
    and an empty logs/, one per attempt."""
    logs = tmp_path / "logs"
    with pytest.raises(StartupError, match="model.path '/nonexistent/model' does not exist"):
        launch(run_config(tmp_path, "model.path=/nonexistent/model", f"logging_dir={logs}"))
    assert list((tmp_path / "runs" / "async-ppo-math").iterdir()) == [] and not logs.exists()
    # A trial that held something keeps it as it was: its config.yaml is what its own run asked for.
    run_dir = tmp_path / "runs" / "async-ppo-math" / "t"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("trial_name: t\n")
    with pytest.raises(StartupError, match="model.path '/nonexistent/model' does not exist"):
        launch(run_config(tmp_path, "trial_name=t", "model.path=/nonexistent/model"))
    assert (run_dir / "config.yaml").read_text() == "trial_name: t\n"


def test_a_refused_continuation_leaves_the_trials_records_as_they_were(tmp_path):
    """resume_from_checkpoint=auto moved a killed run's records to *.jsonl.abandoned (where it saved no checkpoint),
    or deleted its summary.json (where it saved one), before the start's checks: a start they refused had changed
    the trial it was asked to continue."""
    run_dir = tmp_path / "runs" / "async-ppo-math" / "t"
    (run_dir / "logs").mkdir(parents=True)
    for path, text in {"config.yaml": "trial_name: t\n", "logs/learner.jsonl": '{"step": 1}\n{"step": 2}\n',
                       "logs/rollout0.jsonl": '{"step": 0}\n{"step": 2}\n', "summary.json": "{}\n"}.items():
        (run_dir / path).write_text(text)

    def trial():
        return {str(path.relative_to(run_dir)): path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}

    with held_port() as port:  # where nothing listens
        refused = ["trial_name=t", "resume_from_checkpoint=auto", "trace.mlflow=true",
                   f"trace.mlflow_tracking_uri=http://127.0.0.1:{port}"]
        earlier = trial()
        with pytest.raises(StartupError, match="no MLflow server answered"):
            launch(run_config(tmp_path, *refused))
        assert trial() == earlier
        (run_dir / "checkpoints" / "step_2").mkdir(parents=True)
        (run_dir / "checkpoints" / "step_2" / TRAINER_STATE).write_text('{"step": 2, "version": 2}')
        earlier = trial()
        with pytest.raises(StartupError, match="no MLflow server answered"):
            launch(run_config(tmp_path, *refused))
        assert trial() == earlier


def killed_trial(tmp_path: Path, checkpoint: bool) -> Path:
    """A trial a killed run left: its records of steps 1-6, the summary of its earlier launch, the weights it
    published (transport=disk) up to version 6 and the one it was writing, and, with `checkpoint`, step_2 and
    step_4's copy, which a save of step 4 again renamed to step_4.old and was killed before it put the new one in."""
    run_dir = tmp_path / "runs" / "async-ppo-math" / "t"
    (run_dir / "logs").mkdir(parents=True)
    steps = "".join(f'{{"step": {step}}}\n' for step in range(1, 7))
    files = {"config.yaml": "trial_name: t\n", "logs/learner.jsonl": steps, "logs/rollout0.jsonl": steps,
             "summary.json": "{}\n", **{f"weights/v{version}/model.safetensors": "" for version in range(1, 7)},
             "weights/v7.tmp/model.safetensors": ""}  # killed as it wrote version 7
    if checkpoint:
        files.update({f"checkpoints/step_2/{TRAINER_STATE}": '{"step": 2, "version": 2, "saved_at": 1.0, '
                                                            '"consumed_prompts": []}',
                      f"checkpoints/step_4.old/{TRAINER_STATE}": '{"step": 4, "version": 4, "saved_at": 2.0, '
                                                                '"consumed_prompts": []}'})
    for path, text in files.items():
        (run_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / path).write_text(text)
    return run_dir


def trial_files(run_dir: Path) -> dict[str, bytes]:
    return {str(path.relative_to(run_dir)): path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}


def test_a_refused_continuation_puts_no_replaced_checkpoint_back(tmp_path):
    """`auto` renamed step_4.old back to step_4 before the start's checks: a start they refused changed the trial."""
    run_dir = killed_trial(tmp_path, checkpoint=True)
    earlier = trial_files(run_dir)
    with held_port() as port:  # where nothing listens
        with pytest.raises(StartupError, match="no MLflow server answered"):
            launch(run_config(tmp_path, "trial_name=t", "resume_from_checkpoint=auto", "trace.mlflow=true",
                              f"trace.mlflow_tracking_uri=http://127.0.0.1:{port}"))
    assert trial_files(run_dir) == earlier


@pytest.mark.parametrize("checkpoint", [True, False])
def test_a_continuation_whose_bus_does_not_start_leaves_the_trial_as_it_found_it(tmp_path, monkeypatch, checkpoint):
    """The checks passed, the resume's moves were made (records to *.jsonl.abandoned, summary.json deleted, a
    replaced checkpoint put back, config.yaml saved), then the embedded Redis could not start: the trial was left
    half continued."""
    run_dir = killed_trial(tmp_path, checkpoint)
    earlier = trial_files(run_dir)
    monkeypatch.setattr("rlsys.launcher.prepare", lambda config: 0.0)  # the checks passed; no assets are needed
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(StartupError, match=f"cluster.redis_port {port} is in use"):
            launch(run_config(tmp_path, "trial_name=t", "resume_from_checkpoint=auto", f"cluster.redis_port={port}",
                              "model.path=/nonexistent/model"))
    assert trial_files(run_dir) == earlier and not (run_dir / "redis").exists()  # nor the server's config and log


@pytest.mark.parametrize("checkpoint", [True, False])
def test_a_continuation_that_starts_removes_the_weights_published_after_where_it_goes_on(tmp_path, monkeypatch,
                                                                                          checkpoint):
    """A resume from step 4 (version 4) left v5 and v6 of the killed run on disk, never loaded; a start from the
    beginning (no checkpoint) left them all."""
    run_dir = killed_trial(tmp_path, checkpoint)
    monkeypatch.setattr("rlsys.launcher.prepare", lambda config: 0.0)
    supervisor = Mock()
    supervisor.return_value.start.side_effect = RuntimeError("the roles would start here")
    monkeypatch.setattr("rlsys.launcher.Supervisor", supervisor)
    with pytest.raises(RuntimeError, match="the roles would start here"):
        launch(run_config(tmp_path, "trial_name=t", "resume_from_checkpoint=auto", "cluster.redis_port=0",
                          "model.path=/nonexistent/model"))
    kept = [1, 2, 3, 4] if checkpoint else []
    assert sorted(d.name for d in (run_dir / "weights").iterdir()) == [f"v{version}" for version in kept]
    if checkpoint:  # the copy `auto` resumed from is back in its place, the roles told so; the last summary gone
        assert sorted(d.name for d in (run_dir / "checkpoints").iterdir()) == ["step_2", "step_4"]
        assert supervisor.call_args.args[0].resume_from_checkpoint == str(run_dir / "checkpoints" / "step_4")
        assert not (run_dir / "summary.json").exists()


def test_a_runs_saved_config_reruns_as_a_new_run_in_a_directory_of_its_own(tmp_path, monkeypatch):
    """`--config runs/<experiment>/<trial>/config.yaml trial_name=`, as the refusal above advises: the file held the
    trial's logs directory, so the new run was refused for the old run's logs, or would have written into them."""
    with monkeypatch.context() as patched:  # a run that passed its checks and saved config.yaml; no role starts
        patched.setattr("rlsys.launcher.prepare", lambda config: None)
        patched.setattr("rlsys.launcher.Supervisor", Mock(side_effect=RuntimeError("the roles would start here")))
        with pytest.raises(RuntimeError, match="the roles would start here"):
            launch(run_config(tmp_path, "trial_name=t", "model.path=/nonexistent/model"))
    saved = tmp_path / "runs" / "async-ppo-math" / "t" / "config.yaml"
    (saved.parent / "logs" / "learner.jsonl").write_text('{"step": 1}\n')  # as if that run had trained
    rerun = parse_config(["--config", str(saved), "trial_name="])
    with pytest.raises(StartupError, match="model.path '/nonexistent/model' does not exist"):  # not the refusal
        launch(rerun)
    assert rerun.trial_name != "t" and Path(rerun.logging_dir) == saved.parents[1] / rerun.trial_name / "logs"


def test_a_runs_saved_config_continues_it_from_another_directory(tmp_path, monkeypatch):
    """config.yaml kept output_dir and a plugin file as given, relative: `--config <it> resume_from_checkpoint=auto`
    from another directory could not find the plugin, and would have started a new run under that directory."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    (here / "model").mkdir(parents=True)
    elsewhere.mkdir()
    (here / "my_plugin.py").write_text("LOADED = True\n")
    monkeypatch.chdir(here)
    with monkeypatch.context() as patched:  # a run that passed its checks and saved config.yaml; no role starts
        patched.setattr("rlsys.launcher.prepare", lambda config: None)
        patched.setattr("rlsys.launcher.Supervisor", Mock(side_effect=RuntimeError("the roles would start here")))
        with pytest.raises(RuntimeError, match="the roles would start here"):
            launch(parse_config(["output_dir=runs", "model.cache_dir=cache", "plugins=[my_plugin.py, json]",
                                 "model.path=model", "trial_name=t", "dataset.num_train=50", "dataset.num_eval=10"]))
    saved = here / "runs" / "async-ppo-math" / "t" / "config.yaml"
    monkeypatch.chdir(elsewhere)
    again = parse_config(["--config", str(saved), "resume_from_checkpoint=auto"])
    assert run_directory(again) == saved.parent
    assert again.plugins == [str(here / "my_plugin.py"), "json"]  # a module's name stays a name
    assert (again.model.path, again.model.cache_dir) == (str(here / "model"), str(here / "cache"))


def test_runs_started_in_one_second_without_a_trial_name_get_a_directory_each(tmp_path, monkeypatch):
    monkeypatch.setattr("rlsys.run_start.time.strftime", lambda _: "run-20261202-000000")
    names = [run_directory(run_config(tmp_path)).name for _ in range(3)]
    assert names == ["run-20261202-000000", "run-20261202-000000-2", "run-20261202-000000-3"]
    assert all((tmp_path / "runs" / "async-ppo-math" / name).is_dir() for name in names)


@pytest.mark.parametrize("replaced", [False, True])
def test_a_failed_runs_note_names_the_command_that_continues_it(tmp_path, replaced):
    """`replaced`: the learner died as it saved step 4 again, between its renames (step_4.old, no step_4): the step
    the command continues from is 4, not 2, and the note names it."""
    config = run_config(tmp_path)  # no trial_name: named by the time it started, which a relaunch would not be
    run_dir = run_directory(config)
    save_config(config, run_dir / "config.yaml")
    for step, name in ((2, "step_2"), (4, "step_4.old" if replaced else "step_4")):
        (run_dir / "checkpoints" / name).mkdir(parents=True)
        (run_dir / "checkpoints" / name / TRAINER_STATE).write_text(f'{{"step": {step}, "saved_at": {step}}}')
    note = last_checkpoint_note(run_dir)
    assert f"is {run_dir / 'checkpoints' / 'step_4'} (step 4" in note
    again = parse_config(note.split("continue with ")[1].split())
    assert run_directory(again) == run_dir
    resolve_resume(again, run_dir)
    assert again.resume_from_checkpoint == str(run_dir / "checkpoints" / name)  # put back as step_4 at its start


@pytest.mark.parametrize("setting", ["output_dir", "logging_dir"])
def test_a_run_directory_that_cannot_be_made_stops_the_run_naming_the_setting(tmp_path, setting):
    """output_dir naming a file ended the launcher with a traceback; logging_dir naming one let the roles start and
    die with tracebacks, then the launcher too."""
    existing = child_pids()
    taken = tmp_path / "a_file"
    taken.write_text("")
    with pytest.raises(StartupError, match=rf"^cannot make the run's directories \(.*{setting}='{taken}'.*\): \[Errno"):
        launch(run_config(tmp_path, f"{setting}={taken}"))
    assert child_pids() == existing


def test_a_taken_redis_port_stops_the_run(tmp_path):
    existing = child_pids()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(StartupError, match=f"cluster.redis_port {port} is in use.*cluster.redis_port=0"):
            launch(run_config(tmp_path, f"cluster.redis_port={port}"))
        # and if it is taken between the check and the server's start, the server's failure says the same
        from rlsys.bus.redis_server import EmbeddedRedisError
        with pytest.raises(EmbeddedRedisError, match=f"cluster.redis_port {port} is in use"):
            EmbeddedRedis(tmp_path / "redis", port=port).start()
    assert left_behind(tmp_path, existing) == []


def test_a_redis_url_nobody_answers_on_stops_the_run(tmp_path):
    existing = child_pids()
    with held_port() as port:  # where nothing listens
        with pytest.raises(StartupError,
                           match=f"nobody answers at redis://:REDACTED@127.0.0.1:{port}/0 .*cluster.redis_url empty"):
            launch(run_config(tmp_path, f"cluster.redis_url=redis://:secret@127.0.0.1:{port}/0"))
    with EmbeddedRedis(tmp_path / "redis") as server:
        with pytest.raises(StartupError, match="refused the credentials") as error:
            launch(run_config(tmp_path, f"cluster.redis_url=redis://:wrong-password@127.0.0.1:{server.port}/0"))
        assert "wrong-password" not in str(error.value)
    assert left_behind(tmp_path, existing) == []


def test_without_redis_server_installed_the_entry_point_says_how_to_get_it(tmp_path):
    existing = child_pids()
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # python, but no /usr/bin/redis-server
    result = subprocess.run([sys.executable, str(ENTRY), f"output_dir={tmp_path}", f"model.cache_dir={tmp_path}"],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: redis-server is not on PATH; install it (Debian/Ubuntu: "
                                    "`sudo apt-get install redis-server`"), result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "data").exists()  # stopped before preparing anything
    assert left_behind(tmp_path, existing) == []


# ---------------------------------------------------------------------------------------------------------
# Model outputs
# ---------------------------------------------------------------------------------------------------------

def test_junk_huge_and_pathological_answers_score_zero_with_a_reason():
    answers = {
        "binary junk": bytes(range(256)).decode("latin-1") + "\x00\ufffd",
        "extremely long": "+".join(["1"] * 200_000),
        "power tower": "\\boxed{9^{9^{9^{9^{9}}}}}",
        "huge factorial": "\\boxed{(10^{100})!}",
        "deep nesting": "(" * 5000 + "57" + ")" * 5000,
        "right": "\\boxed{57}",
    }
    env = make_env(EnvServiceAbstraction("math-code-single-step", {"verify_timeout": 1.0}))

    async def episode():
        await env.reset(options={"prompt": "50+7=", "answer": "57"})
        return await env.step(("q0", list(answers.values())))

    try:
        _, rewards, terminated, _, info = asyncio.run(episode())
    finally:
        close_shared_pool()
    assert terminated and rewards == [0.0] * 5 + [1.0]
    verdicts = dict(zip(answers, zip(info["statuses"], info["reasons"])))
    assert verdicts["binary junk"] == ("unparsable", "answer has no math expression")
    for name in ("extremely long", "power tower", "huge factorial"):
        assert verdicts[name] == ("timeout", "check exceeded 1s; worker killed"), (name, verdicts[name])
    assert verdicts["deep nesting"][0] in ("unparsable", "timeout") and verdicts["deep nesting"][1]
