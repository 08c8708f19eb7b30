"""No setting that does nothing: a value the chosen algorithm never reads is refused, and says what it needs."""

import pytest

from rlsys.cli import ConfigError, parse_config

REFUSED = [  # (overrides, what the message must say)
    (["ppo.whiten_advantages=true"], "ppo.whiten_advantages=True does nothing without ppo.adv_estimator=reinforce or gae"),
    (["ppo.adv_estimator=starpo", "ppo.whiten_advantages=true"], "grpo, starpo and gigpo already normalise each group"),
    (["ppo.adv_estimator=gigpo", "ppo.whiten_advantages=true"], "ppo.whiten_advantages=True does nothing"),
    (["ppo.gamma=0.9"], "ppo.gamma=0.9 does nothing without ppo.adv_estimator=gae"),
    (["ppo.gigpo_step_weight=2"], "ppo.gigpo_step_weight=2.0 does nothing without ppo.adv_estimator=gigpo"),
    (["ppo.adv_estimator=reinforce", "ppo.grpo_scale_by_std=false"], "ppo.adv_estimator=grpo, starpo or gigpo"),
    (["ppo.target_kl=0.01"], "ppo.target_kl=0.01 does nothing without ppo.init_kl_coef > 0"),
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
    ["ppo.decoupled_loss=true", "ppo.behaviour_imp_weight_cap=3"],
])
def test_the_same_settings_are_taken_where_they_act(overrides):
    parse_config(overrides)
