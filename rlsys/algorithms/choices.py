"""The values of the ppo settings that choose an algorithm, without the torch code behind them: the config checks
a run's settings with these in the launcher, before anything imports torch, and the tables that implement them
(estimators.ADVANTAGE_ESTIMATORS, ppo.token_loss_weights, ppo.KL_ESTIMATORS, ppo.ppo_clip_loss) are keyed on the same
names."""

ADVANTAGE_ESTIMATORS = ("grpo", "reinforce", "reinforce_baseline", "gae", "starpo", "gigpo")  # ppo.adv_estimator
NEEDS_CRITIC = frozenset({"gae"})  # estimators that read a value model's predictions
# Estimators whose baseline is the group's mean: a group whose rewards are all equal gets advantage 0 on every token
# (reinforce_baseline's whitening moves it by the batch mean's rounding only) (ppo.filter_uniform_groups).
GROUP_BASELINES = frozenset({"grpo", "reinforce_baseline", "starpo"})
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")  # ppo.loss_agg_mode
KL_ESTIMATORS = ("k1", "k2", "k3")  # ppo.kl_estimator (verl's kl_loss_type names)
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # ppo.importance_sampling_level (AReaL's name; sequence: GSPO)
