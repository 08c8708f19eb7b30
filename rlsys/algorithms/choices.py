"""The values of the ppo settings that choose an algorithm, without the torch code behind them: the config checks
a run's settings with these in the launcher, before anything imports torch, and the tables that implement them
(estimators.ADVANTAGE_ESTIMATORS, ppo.token_loss_weights) are keyed on the same names."""

ADVANTAGE_ESTIMATORS = ("grpo", "reinforce", "gae", "starpo", "gigpo")  # ppo.adv_estimator
NEEDS_CRITIC = frozenset({"gae"})  # estimators that read a value model's predictions
# Estimators that give a group whose rewards are all equal advantage 0 on every token (ppo.filter_uniform_groups).
ZERO_FOR_UNIFORM_GROUPS = frozenset({"grpo", "starpo"})
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")  # ppo.loss_agg_mode
