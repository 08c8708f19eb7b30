"""PPO clipped loss (dual clip, decoupled, aggregation), KL penalty and controllers, entropy; tensors [B, T-1]."""

import math

import torch

from rlsys.algorithms.choices import LOSS_AGG_MODES

# |log-ratio| taken at most, in the PPO ratio, k3 and the behaviour weight (e^20 is finite in float32 and bf16)
LOG_RATIO_BOUND = 20.0


def next_token_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      temperature: float = 1.0, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logits that predict input_ids[:, 1:], divided by the sampling temperature, shape [B, T-1, V].

    A packed row passes position_ids restarting at 0 per sequence and no attention mask; no KV cache is
    built, since a training forward pass never decodes further (and a cache would hide the packing).
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits[:, :-1].float()
    return logits if temperature == 1.0 else logits / temperature  # no [B, T, V] copy at the usual temperature


def gather_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """logp[b, t] = log pi(input_ids[b, t+1] | input_ids[b, :t+1])."""
    return taken_logprobs(torch.log_softmax(logits, dim=-1), input_ids)


def taken_logprobs(distributions: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """gather_logprobs from the log-softmax of the logits, [B, T-1, V], when the caller needs it for more."""
    return distributions.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)



def token_loss_weights(mask: torch.Tensor, sequence_index: torch.Tensor, agg: str = "token-mean") -> torch.Tensor:
    """Per-token weights w with sum(w * l) = the aggregated loss of these sequences' token losses l.

    `mask` and `sequence_index` (which sequence each token belongs to) are flat and aligned. Weights are fixed per
    mini-batch before it is split into micro-batches, so summing each micro-batch's sum(w * l) (gradient
    accumulation) gives exactly the mini-batch's loss, whatever the split or packing. token-mean: m / sum(m);
    seq-mean-token-mean: m / (S * sum_t m); seq-mean-token-sum: m / S, where S counts the sequences that have
    generated tokens. No value is read back to the host.
    """
    if agg not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {LOSS_AGG_MODES}")
    mask = mask if mask.is_floating_point() else mask.float()
    if agg == "token-mean":
        # Every generated token weighs the same, so a sequence counts in proportion to its length (DAPO).
        return mask / mask.sum().clamp(min=1)
    # As many bins as tokens, at least one per sequence, with no read of the largest index back to the host.
    per_sequence = mask.new_zeros(max(sequence_index.numel(), 1)).index_add_(0, sequence_index, mask)
    # A sequence without generated tokens has no loss to contribute; counting it would only shrink the mean.
    sequences = (per_sequence > 0).sum().clamp(min=1)
    if agg == "seq-mean-token-mean":
        return mask / (sequences * per_sequence.clamp(min=1)[sequence_index])  # every sequence weighs the same
    return mask / sequences  # Dr. GRPO up to a constant: no 1/length that lets long wrong answers off


def aggregate_token_loss(token_loss: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean") -> torch.Tensor:
    """token-mean sum(lm)/sum(m); seq-mean-token-mean mean_b[sum_t lm/sum_t m]; seq-mean-token-sum mean_b[sum_t lm]."""
    rows = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
    return (token_loss * token_loss_weights(mask.flatten(), rows.flatten(), agg).view_as(mask)).sum()


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  clip: float, *, clip_high: float | None = None, dual_clip: float | None = None,
                  agg: str = "token-mean",
                  behaviour_logprobs: torch.Tensor | None = None,
                  imp_weight_cap: float | None = None,
                  weights: torch.Tensor | None = None,
                  token_share: torch.Tensor | None = None,
                  sequence_index: torch.Tensor | None = None, sequences: int = 0,
                  statistics: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """l_t = w_t * max(-A r, -A clip(r, 1-clip, 1+clip_high)) [min -A*dual_clip if A<0], r = exp(logp-old_logp); agg(l).
    """
    # clip_high (DAPO's clip-higher; None: clip) moves only the upper bound, which acts on A > 0 alone, as the dual
    # clip acts on A < 0 alone: the two compose without a condition between them.
    # dual_clip=c bounds the loss of a negative-advantage token by -A*c (Ye et al. 2020); None: no bound.
    # behaviour_logprobs switches to AReaL's decoupled objective: old_logp is then the proximal policy's logprob
    # (recomputed by the learner) and w_t = exp(old_logp - behaviour_logprobs), detached; otherwise w_t = 1.
    # imp_weight_cap: tokens with w_t above it contribute 0 but still count in the normaliser, as in AReaL.
    # agg: see aggregate_token_loss; weights (from token_loss_weights over a whole mini-batch) replace it when the
    # tokens are one micro-batch of a larger mini-batch. The statistics are means over the generated tokens, or with
    # `token_share` (token_loss_weights' token-mean over the whole mini-batch) this micro-batch's part of the
    # mini-batch's means, which the micro-batches' add up to; with statistics=False there are none (an empty dict).
    # sequence_index (shaped like mask, values below `sequences`; a row may hold several sequences, packed) makes the
    # ratio GSPO's (Zheng et al. 2025): one per sequence, exp(mean over its trained tokens of logp - old_logp), on
    # each of its tokens, with the gradient through the mean; the clips, weights and aggregation are unchanged.
    if clip_high is not None and clip_high <= 0:
        raise ValueError(f"clip_high must be positive, got {clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if imp_weight_cap is not None and behaviour_logprobs is None:
        raise ValueError("imp_weight_cap needs behaviour_logprobs (the decoupled objective)")
    if imp_weight_cap is not None and imp_weight_cap <= 1:
        raise ValueError(f"imp_weight_cap must be > 1, got {imp_weight_cap}")
    generated = mask > 0
    # The log-ratio is taken on the trained tokens only: elsewhere (prompt, tool output, padding, a sequence's last
    # position) old_logp may be anything an agent recorded, and a logp above it by more than about 88 overflows exp to
    # inf, which the 0 advantage and 0 loss weight there turn into a NaN loss and NaN gradients (0 * inf): every such
    # update would be skipped as non-finite. Zeroed before the exp, those positions have ratio 1 and no gradient.
    # On the trained tokens the log-ratio is clamped to +-LOG_RATIO_BOUND (verl's): a token the policy moved by more
    # than e^88 made the loss or its gradient non-finite (inf, or 0 * inf where the clip had picked the other
    # branch) and the whole update was skipped. Past the bound the clip gives no gradient either, but for a
    # negative advantage without dual_clip, whose huge gradient the gradient-norm clip would scale away anyway.
    log_ratio = torch.where(generated, logp - old_logp, 0.0).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if sequence_index is not None:
        # A token-level ratio weighs each token by a noisy one-sample estimate; GSPO's unit of reward and of
        # clipping is the sequence. Sums over bins on the device: nothing is read back, whatever the packing.
        index = sequence_index.flatten()
        sums = log_ratio.new_zeros(sequences).index_add_(0, index, log_ratio.flatten())
        counts = log_ratio.new_zeros(sequences).index_add_(0, index, generated.flatten().to(log_ratio.dtype))
        log_ratio = torch.where(generated, (sums / counts.clamp(min=1))[sequence_index], 0.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip, 1 + (clip if clip_high is None else clip_high))
    token_loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        # With A < 0 and a ratio far above 1 (a token the policy now likes much more than when it was sampled),
        # max(...) grows without bound in r; the dual clip caps that token's loss, and so its gradient, at -A*c.
        dual_bound = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (dual_bound < token_loss)
        token_loss = torch.where(advantages < 0, torch.minimum(token_loss, dual_bound), token_loss)
    if behaviour_logprobs is not None:
        # Decoupled PPO (AReaL, Fu et al. 2025): the trust region is centred on the proximal policy (old_logp,
        # recomputed by the learner) and the off-policyness of stale rollouts is corrected separately by the
        # behaviour importance weight. It is a constant of the update: detached, no gradient through it.
        with torch.no_grad():
            # torch.where keeps padding (where exp could overflow) out of the weights and the statistics; on the
            # trained tokens the exponent is clamped as the log-ratio is: without a cap, a gap over about 88 gave an
            # inf weight, so an inf (or 0 * inf, NaN) loss, and the whole update was skipped.
            log_weight = (old_logp - behaviour_logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
            raw_weight = torch.where(generated, torch.exp(log_weight), 0.0)
            kept = generated if imp_weight_cap is None else generated & (raw_weight <= imp_weight_cap)
            # AReaL's choice: a token with an extreme weight (very stale or a sampler/learner mismatch) is dropped
            # instead of clipped, since a clipped weight would still push on a token the behaviour policy
            # hardly represents; the normaliser keeps counting it, so capping never up-weights the others.
            weight = torch.where(kept, raw_weight, 0.0)
        token_loss = token_loss * weight
    loss = aggregate_token_loss(token_loss, mask, agg) if weights is None else (token_loss * weights).sum()
    if not statistics:
        return loss, {}
    with torch.no_grad():  # 0-d tensors: the caller reads them back once per optimizer step, not per micro-batch
        share = mask / mask.sum().clamp(min=1) if token_share is None else token_share
        stats = {"clip_fraction": ((clipped > unclipped) * share).sum(), "importance_ratio": (ratio * share).sum()}
        if dual_clip is not None:
            stats["dual_clip_fraction"] = (dual_clipped * share).sum()
        if behaviour_logprobs is not None:
            # Over all generated tokens before the cap, so the max shows how far off-policy the batch really was
            # (raw_weight is 0 off the generated tokens, and positive on them).
            stats["importance_weight_mean"] = (raw_weight * share).sum()
            stats["importance_weight_max"] = raw_weight.max()
            stats["importance_weight_capped_fraction"] = ((generated & ~kept) * share).sum()
    return loss, stats


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1, never negative (Schulman); 0 where
    `mask` (if given) is 0.

    As GRPO uses it, a loss term on the policy's own samples: its value estimates KL(pi || ref) without bias, but its
    gradient, (1 - ref/pi) grad logp, is in expectation -E_ref[grad log pi], that of KL(ref || pi)."""
    delta = ref_logp - logp
    if mask is not None:
        # Off the trained tokens ref_logp is 0 (a sequence's last position, padding) or unconstrained, and a logp below
        # about -88 there overflows exp to inf, which a 0 loss weight turns into a NaN loss and NaN gradients (0 * inf):
        # zeroed before the exp, those positions give 0 and pass no gradient.
        delta = torch.where(mask > 0, delta, 0.0)
    # Clamped as the PPO log-ratio is (verl's bound for k3's exponent): a trained token the policy puts more than
    # about 88 below the reference made the KL, and so the loss, inf. Past the bound it passes no gradient.
    delta = delta.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.exp(delta) - delta - 1


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token k1 estimate of KL(pi || ref): logp - ref; 0 where `mask` (if given) is 0.

    Its value is unbiased, but as a loss on the policy's own samples its gradient, grad logp, is 0 in expectation:
    it adds noise to the update and pulls toward the reference only through an adaptive coefficient's reading."""
    delta = logp - ref_logp
    return delta if mask is None else torch.where(mask > 0, delta, 0.0)


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token k2 estimate of KL(pi || ref): (logp - ref)^2 / 2, never negative; 0 where `mask` (if given) is 0.

    Biased as a value (low variance), but as a loss on the policy's own samples its gradient, (logp - ref) grad logp,
    is in expectation that of KL(pi || ref) itself."""
    return 0.5 * kl_k1(logp, ref_logp, mask).square()


# Keyed on the names rlsys/algorithms/choices.py lists for the config (ppo.kl_estimator).
KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Token-mean KL estimate (KL_ESTIMATORS) over the generated tokens."""
    return masked_mean(KL_ESTIMATORS[estimator](logp, ref_logp, mask), mask)


def token_entropy(distributions: torch.Tensor) -> torch.Tensor:
    """The entropy of each position's next-token distribution, given as its log-softmax [B, T-1, V]."""
    return -(distributions.exp() * distributions).sum(-1)


class FixedKLController:
    """beta stays at kl_coef."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


class AdaptiveKLController:
    """beta <- beta * (1 + clip(KL / target_kl - 1, -0.2, 0.2) * n_steps / horizon) (Ziegler et al. 2019), for
    n_steps up to a horizon; compounded per horizon beyond."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError("target_kl and horizon must be positive")
        self.value, self.target_kl, self.horizon = float(init_kl_coef), float(target_kl), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        # A proportional controller on log(beta): the clip to +-0.2 keeps one noisy KL estimate from moving beta
        # by more than 20% per `horizon` steps; n_steps and horizon share a unit (Ziegler et al. count samples).
        if math.isnan(current_kl):
            # A step whose loss was NaN (its updates skipped, rlsys/algorithms/finite.py) measured no KL; taken in, it
            # would make beta NaN for good, and with it every later loss, so that no update is ever taken again.
            return self.value
        error = min(max(float(current_kl) / self.target_kl - 1, -0.2), 0.2)
        # Ziegler et al.'s linear factor holds for a step of up to a horizon of samples; at 5 horizons and more it
        # would reach 0 or below, and a negative beta rewards moving away from the reference. Each whole horizon
        # moves beta by 1 + error, the 20% at most that the horizon allows.
        horizons, rest = divmod(n_steps, self.horizon)
        self.value *= (1 + error) ** horizons * (1 + error * rest / self.horizon)
        return self.value


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float | None) -> torch.Tensor:
    """Per-token 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = old + clip(V - old, -clip, clip) (PPO2's critic)."""
    loss = (values - returns) ** 2
    if clip:
        # The critic gets the same trust region as the policy: a value may not leave old +- clip in one update.
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * loss
