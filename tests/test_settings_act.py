"""No setting that does nothing: a value the chosen algorithm, or the rest of its group, never reads is refused, and
says what it needs."""

import pytest

from rlsys.api import EXPERIMENTS
from rlsys.cli import ConfigError, parse_config

REFUSED = [  # (overrides, what the message must say)
    (["ppo.whiten_advantages=true"],
     "ppo.whiten_advantages=True does nothing without ppo.adv_estimator=reinforce, reinforce_baseline or gae"),
    (["ppo.adv_estimator=starpo", "ppo.whiten_advantages=true"], "grpo, starpo and gigpo already normalise each group"),
    (["ppo.adv_estimator=gigpo", "ppo.whiten_advantages=true"], "ppo.whiten_advantages=True does nothing"),
    (["ppo.gamma=0.9"], "ppo.gamma=0.9 does nothing without ppo.adv_estimator=gae"),
    (["ppo.gigpo_step_weight=2"], "ppo.gigpo_step_weight=2.0 does nothing without ppo.adv_estimator=gigpo"),
    (["ppo.adv_estimator=reinforce", "ppo.grpo_scale_by_std=false"], "ppo.adv_estimator=grpo, starpo or gigpo"),
    (["ppo.target_kl=0.01"], "ppo.target_kl=0.01 does nothing without ppo.init_kl_coef > 0"),
    (["ppo.kl_estimator=k2"], "ppo.kl_estimator=k2 does nothing without ppo.init_kl_coef > 0"),
    (["ppo.behaviour_imp_weight_cap=3"], "without ppo.decoupled_loss=true"),
]


@pytest.mark.parametrize("overrides,message", REFUSED)
def test_a_setting_the_algorithm_never_reads_is_refused(overrides, message):
    with pytest.raises(ConfigError, match="leave .* at its default") as error:
        parse_config(overrides)
    assert message in str(error.value)


@pytest.mark.parametrize("overrides", [
    ["ppo.adv_estimator=reinforce", "ppo.whiten_advantages=true"],
    ["ppo.adv_estimator=gae", "ppo.whiten_advantages=true", "ppo.gamma=0.9", "ppo.lambd=0.9"],
    ["ppo.adv_estimator=gigpo", "ppo.gigpo_step_weight=2", "ppo.grpo_scale_by_std=false"],
    ["ppo.init_kl_coef=0.1", "ppo.target_kl=0.01", "ppo.kl_horizon=100"],
    ["ppo.init_kl_coef=0.1", "ppo.kl_estimator=k1"],
    ["ppo.init_kl_coef=0.1", "ppo.kl_estimator=k2"],
    ["ppo.decoupled_loss=true", "ppo.behaviour_imp_weight_cap=3"],
])
def test_the_same_settings_are_taken_where_they_act(overrides):
    parse_config(overrides)


# Outside ppo.*: each group's table of settings that the rest of the group makes do nothing (experiments/common.py,
# `inactive_settings`), compared with the experiment's own defaults.
GROUP_REFUSED = [  # (overrides, what the message must say)
    (["cluster.ray_address=auto"], "cluster.ray_address=auto does nothing without cluster.backend=ray"),
    (["cluster.ray_placement_strategy=SPREAD"], "cluster.ray_placement_strategy=SPREAD does nothing without "
                                                "cluster.backend=ray"),
    (["cluster.redis_url=redis://localhost:6379/0", "cluster.redis_port=6390"],
     "cluster.redis_port=6390 does nothing with cluster.redis_url set"),
    (["model.path=/models/qwen", "model.hidden_size=64"], "model.hidden_size=64 does nothing with model.path set"),
    (["model.path=/models/qwen", "model.warm_start_accuracy=0.5"], "model.warm_start_accuracy=0.5 does nothing"),
    (["dataset.path=train.jsonl", "dataset.eval_path=test.jsonl", "dataset.num_train=100"],
     "dataset.num_train=100 does nothing with dataset.path set"),
    (["dataset.path=train.jsonl", "dataset.num_eval=50"], "dataset.num_eval=50 does nothing with dataset.path set"),
    (["trace.mlflow_tracking_uri=sqlite:///m.db"], "trace.mlflow_tracking_uri=sqlite:///m.db does nothing without "
                                                   "trace.mlflow=true"),
    (["inference.engine=transformers", "inference.kv_cache_gib=4"], "inference.kv_cache_gib=4.0 does nothing"),
    (["inference.engine=transformers", "inference.enforce_eager=true", "inference.gpu_memory_utilization=0.9"],
     "inference.gpu_memory_utilization=0.9 does nothing with inference.engine=transformers and enforce_eager=true"),
    (["experiment=async-ppo-sokoban", "rollout.tree_branching=3"],
     "rollout.tree_branching=3 does nothing with rollout.mode=chain"),
    (["experiment=async-ppo-frozen-lake", "rollout.tree_depth=2"],
     "rollout.tree_depth=2 does nothing with rollout.mode=chain"),
    # Greedy rollouts never branch nor split an episode into its turns (MultiTurnAgent); one turn has no second to
    # branch at, to train apart or to discount; a tree of depth 0 or of one branch per node is a chain.
    (["experiment=async-ppo-frozen-lake", "rollout.mode=tree", "gen.temperature=0", "ppo.adv_estimator=reinforce"],
     "rollout.mode=tree does nothing with gen.temperature=0"),
    (["experiment=async-ppo-math-multi-turn", "rollout.single_turn_samples=true", "gen.temperature=0",
      "ppo.adv_estimator=reinforce"], "rollout.single_turn_samples=True does nothing with gen.temperature=0"),
    (["experiment=async-ppo-sokoban", "rollout.mode=tree", "num_turns=1"], "rollout.mode=tree does nothing with "
                                                                           "num_turns=1"),
    (["experiment=async-ppo-webshop", "rollout.single_turn_samples=true", "num_turns=1"],
     "rollout.single_turn_samples=True does nothing with num_turns=1"),
    (["experiment=async-ppo-mixed-games", "rollout.mode=tree", "rollout.tree_depth=0"],
     "rollout.mode=tree does nothing with rollout.tree_depth=0"),
    (["experiment=async-ppo-frozen-lake", "rollout.mode=tree", "rollout.tree_branching=1"],
     "rollout.mode=tree does nothing with rollout.tree_branching=1"),
    (["experiment=async-ppo-math-multi-turn", "num_turns=1", "turn_discount=0.3"],
     "turn_discount=0.3 does nothing with num_turns=1"),
    # GiGPO's step return of a sample of one turn is that turn's reward: nothing to discount
    (["experiment=async-ppo-frozen-lake", "ppo.adv_estimator=gigpo", "rollout.single_turn_samples=true",
      "ppo.gigpo_step_gamma=0.5"], "ppo.gigpo_step_gamma=0.5 does nothing with rollout.single_turn_samples=true"),
    (["experiment=async-ppo-sokoban", "ppo.adv_estimator=gigpo", "num_turns=1", "ppo.gigpo_step_gamma=0.5"],
     "ppo.gigpo_step_gamma=0.5 does nothing with num_turns=1"),
    (["experiment=async-ppo-math-tools", "tools=[calculator]", "sandbox.memory_mb=64"],
     "sandbox.memory_mb=64 does nothing without the python tool (tools=['calculator']); add python to tools"),
    (["experiment=async-ppo-math-tools", "tools=[calculator]", "python_persistent=false"],
     "python_persistent=False does nothing without the python tool"),
    (["experiment=async-ppo-math-tools", "tools=[]", "tool_timeout=5"],
     "tool_timeout=5.0 does nothing without tools (tools=[]); name a tool in tools"),
    # the agent function gets prompt.data["prompt"], the user's text, and writes its own messages: no system message
    (["experiment=async-ppo-openai-agent", "dataset.system_prompt=Be brief."],
     "dataset.system_prompt=Be brief. does nothing with the openai-agent (agent_function gets the prompt's text alone"),
]


@pytest.mark.parametrize("overrides,message", GROUP_REFUSED)
def test_a_setting_the_rest_of_its_group_makes_do_nothing_is_refused(overrides, message):
    with pytest.raises(ValueError, match="leave .* at its default") as error:
        parse_config(overrides)
    assert message in str(error.value)


@pytest.mark.parametrize("overrides", [
    ["cluster.backend=ray", "cluster.ray_address=auto", "cluster.ray_placement_strategy=SPREAD"],
    ["cluster.redis_port=6390"],
    ["cluster.redis_url=redis://localhost:6379/0"],
    ["model.hidden_size=64", "model.num_heads=2", "model.num_kv_heads=1", "model.warm_start_accuracy=0.5"],
    ["dataset.num_train=100", "dataset.num_eval=50"],
    ["trace.mlflow=true", "trace.mlflow_tracking_uri=sqlite:///m.db"],
    ["inference.enforce_eager=false", "inference.kv_cache_gib=4"],
    ["inference.engine=transformers"],
    ["inference.engine=transformers", "inference.enforce_eager=false"],  # its decode step as CUDA graphs
    ["inference.engine=transformers", "inference.enforce_eager=false", "inference.gpu_memory_utilization=0.9"],
    ["inference.engine=transformers", "inference.gpu_memory_utilization=0.9"],  # unset: graphs on a GPU
    ["experiment=async-ppo-sokoban", "rollout.mode=tree", "rollout.tree_branching=3", "rollout.tree_depth=2"],
    ["experiment=async-ppo-math-multi-turn", "rollout.single_turn_samples=true", "ppo.adv_estimator=reinforce"],
    ["experiment=async-ppo-math-multi-turn", "num_turns=1"],  # the experiment's own turn_discount is no request
    ["experiment=async-ppo-frozen-lake", "num_turns=2", "turn_discount=0.9", "rollout.mode=tree"],
    ["experiment=async-ppo-frozen-lake", "ppo.adv_estimator=gigpo", "ppo.gigpo_step_gamma=0.5"],
    ["experiment=async-ppo-math-tools", "sandbox.memory_mb=64", "python_persistent=false",
     "sandbox.allow_unconfined=true"],
    ["experiment=async-ppo-math-tools", "dataset.system_prompt=Be brief."],  # the instructions join it
])
def test_those_settings_are_taken_where_they_act(overrides):
    parse_config(overrides)


@pytest.mark.parametrize("name", [name for name in EXPERIMENTS.names()
                                  if EXPERIMENTS.lookup(name).__module__.startswith("experiments.")])
def test_every_experiment_parses_with_its_defaults_and_with_a_model_and_dataset_of_the_users(name):
    """An experiment's own group defaults (a smaller tiny model, a smaller generated set) are not the user's
    settings: a checkpoint and a dataset given by path replace them without a refusal."""
    parse_config([f"experiment={name}"])
    parse_config([f"experiment={name}", "model.path=/models/qwen", "dataset.path=train.jsonl",
                  "dataset.eval_path=test.jsonl"])


@pytest.mark.parametrize("name", EXPERIMENTS.names())
def test_the_help_of_a_setting_refused_where_it_does_nothing_does_not_call_it_ignored(name):
    """cluster.redis_port's help said "Ignored with redis_url", where it is refused: --help promised what the run
    does not do."""
    from rlsys.cli import describe_fields

    config = parse_config([f"experiment={name}"])
    docs = {info.path: info.doc for info in describe_fields(type(config))}
    refused = [f"{group}.{setting}" for group, value in vars(config).items() if hasattr(value, "inactive_settings")
               for setting in value.inactive_settings()] + list(config.inactive_settings())
    assert refused and [key for key in refused if "ignored" in docs[key].lower()] == []


def test_greedy_sampling_with_an_estimator_that_compares_a_groups_samples_is_refused():
    """At temperature 0 a group's samples are one response n times: in a 3-step run every advantage, the loss and the
    gradient norm were 0 and held-out accuracy moved +0.0 points."""
    for overrides in (["gen.temperature=0"], ["experiment=async-ppo-frozen-lake", "gen.temperature=0"],
                      ["ppo.filter_uniform_groups=true", "gen.temperature=0"]):
        with pytest.raises(ConfigError, match=r"gen.temperature=0 samples every response of a group alike .* nothing "
                                              r"trains .*give a temperature above 0"):
            parse_config(overrides)
    parse_config(["gen.temperature=0.1"])
    parse_config(["ppo.adv_estimator=reinforce", "gen.temperature=0"])  # its baseline is the batch's, not the group's


def test_truncated_importance_sampling_and_the_decoupled_objective_are_not_combined():
    """Both weight each token's loss by p_proximal / p_behaviour (tis_cap truncated, decoupled_loss with tokens over its
    cap dropped): together a token at ratio 1.5 would weigh 1.5 * min(1.5, C) = 2.25, the correction applied twice."""
    with pytest.raises(ConfigError, match="ppo.tis_cap and ppo.decoupled_loss"):
        parse_config(["ppo.decoupled_loss=true", "ppo.tis_cap=2"])
    parse_config(["ppo.decoupled_loss=true"])
    parse_config(["ppo.tis_cap=2"])


@pytest.mark.parametrize("estimator", ["starpo", "gigpo", "gae"])
@pytest.mark.parametrize("experiment", ["async-ppo-math-multi-turn", "async-ppo-frozen-lake", "async-ppo-mixed-games"])
def test_a_turn_discount_the_estimator_never_applies_is_refused(experiment, estimator):
    """turn_discount makes each episode's reward sum_k discount**(k-1) r_k (Trajectory.reward), which grpo and reinforce
    train on; starpo and gigpo's episode part sum the turn rewards undiscounted, and gae discounts them per token by
    ppo.gamma. With those, on whole episodes, a discount other than 1 trains nothing different: on the math retries
    a right second attempt would score as a right first one, which the discount is there to tell apart."""
    with pytest.raises(ConfigError, match=f"turn_discount=0.5 is not applied by ppo.adv_estimator={estimator}"):
        parse_config([f"experiment={experiment}", f"ppo.adv_estimator={estimator}", "turn_discount=0.5"])
    parse_config([f"experiment={experiment}", f"ppo.adv_estimator={estimator}", "turn_discount=1"])
    parse_config([f"experiment={experiment}", "ppo.adv_estimator=grpo", "turn_discount=0.5"])
    # Trained turn by turn, each sample's one turn reward is its discounted return: the discount is applied.
    parse_config([f"experiment={experiment}", f"ppo.adv_estimator={estimator}", "turn_discount=0.5",
                  "rollout.single_turn_samples=true"])


@pytest.mark.parametrize("correction", ["ppo.decoupled_loss=true", "ppo.tis_cap=2"])
@pytest.mark.parametrize("clip", ["ppo.pg_clip=0.3", "ppo.dual_clip=3", "ppo.pg_clip_high=0.28",
                                  "ppo.importance_sampling_level=sequence"])
def test_a_clip_of_a_ratio_that_is_always_1_is_refused(correction, clip):
    """With ppo.decoupled_loss or ppo.tis_cap the PPO ratio is against the policy before the step's first update; with
    one epoch of one mini-batch that update is the only one, so every ratio is exactly 1 and no clip can act."""
    with pytest.raises(ConfigError, match=f"{clip.split('=')[0]}=.* does nothing without a second optimizer step"):
        parse_config([correction, clip, "ppo.ppo_epochs=1"])
    parse_config([correction, clip, "ppo.ppo_epochs=2"])
    parse_config([correction, clip, "ppo.ppo_epochs=1", "ppo.num_mini_batches=2"])
    parse_config([clip, "ppo.ppo_epochs=1"])  # against the behaviour logprobs, which an async run's staleness moves
    parse_config([correction, "ppo.ppo_epochs=1"])  # the defaults are not the user's


@pytest.mark.parametrize("estimator", ["reinforce", "gae", "gigpo"])
def test_filtering_uniform_groups_is_refused_where_they_still_train(estimator):
    """ppo.filter_uniform_groups drops groups whose rewards are all equal: advantage 0 under a group baseline (grpo,
    starpo), not under reinforce (rewards 1, 1 in a batch of mean 0.5 get +0.5 each), gae (the critic's baseline) or
    gigpo (step advantages at shared states). There it threw signal away and biased the update without a word."""
    from rlsys.algorithms.advantages import reinforce_advantages

    assert reinforce_advantages([1.0, 1.0, 0.0, 0.0]).tolist() == [0.5, 0.5, -0.5, -0.5]  # the uniform groups train
    with pytest.raises(ConfigError, match=f"under ppo.adv_estimator={estimator} they have advantages other than 0"):
        parse_config([f"ppo.adv_estimator={estimator}", "ppo.filter_uniform_groups=true"])
    parse_config([f"ppo.adv_estimator={estimator}"])
    parse_config(["ppo.adv_estimator=grpo", "ppo.filter_uniform_groups=true"])
    parse_config(["ppo.adv_estimator=starpo", "ppo.filter_uniform_groups=true"])
    parse_config(["ppo.adv_estimator=reinforce_baseline", "ppo.filter_uniform_groups=true",
                  "ppo.whiten_advantages=true"])
    with pytest.raises(ConfigError, match="grpo_scale_by_std=False does nothing without ppo.adv_estimator=grpo, "):
        parse_config(["ppo.adv_estimator=reinforce_baseline", "ppo.grpo_scale_by_std=false"])


def test_a_value_clip_around_values_that_cannot_have_moved_is_refused():
    """The critic's pre-update values are those of its step's first update: with one epoch of one mini-batch no value
    can leave them, and ppo.value_clip never acts."""
    with pytest.raises(ConfigError, match="ppo.value_clip=0.5 does nothing without a second optimizer step"):
        parse_config(["ppo.adv_estimator=gae", "ppo.value_clip=0.5", "ppo.ppo_epochs=1"])
    parse_config(["ppo.adv_estimator=gae", "ppo.value_clip=0.5", "ppo.ppo_epochs=1", "ppo.num_mini_batches=2"])
    parse_config(["ppo.adv_estimator=gae", "ppo.value_clip=0.5"])
    parse_config(["ppo.adv_estimator=gae", "ppo.ppo_epochs=1"])


def test_clip_higher_is_taken_and_a_negative_one_refused():
    """ppo.pg_clip_high (DAPO's clip-higher) sets the upper clip of the ratio, 1 + pg_clip_high; 0 keeps pg_clip's."""
    config = parse_config(["ppo.pg_clip_high=0.28"])
    assert config.ppo.pg_clip_high == 0.28
    with pytest.raises(ConfigError, match=r"ppo.pg_clip_high must be 0 \(the same as ppo.pg_clip\) or positive"):
        parse_config(["ppo.pg_clip_high=-0.1"])
