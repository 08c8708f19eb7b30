"""PPO clipped loss (dual clip, decoupled, aggregation), KL penalty and controllers, entropy; tensors [B, T-1]."""

import torch


def next_token_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """Logits that predict input_ids[:, 1:], divided by the sampling temperature, shape [B, T-1, V]."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    return logits / temperature


def gather_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """logp[b, t] = log pi(input_ids[b, t+1] | input_ids[b, :t+1])."""
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def aggregate_token_loss(token_loss: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean") -> torch.Tensor:
    """token-mean sum(lm)/sum(m); seq-mean-token-mean mean_b[sum_t lm/sum_t m]; seq-mean-token-sum mean_b[sum_t lm]."""
    if agg == "token-mean":
        # Every generated token weighs the same, so a sequence counts in proportion to its length (DAPO).
        return masked_mean(token_loss, mask)
    tokens = mask.sum(-1)
    summed = (token_loss * mask).sum(-1)
    if agg == "seq-mean-token-mean":
        per_sequence = summed / tokens.clamp(min=1)  # every sequence weighs the same, whatever its length
    elif agg == "seq-mean-token-sum":
        per_sequence = summed  # Dr. GRPO up to a constant: no 1/length that lets long wrong answers off lightly
    else:
        raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {LOSS_AGG_MODES}")
    # A sequence without generated tokens has no loss to contribute; counting it would only shrink the mean.
    has_tokens = (tokens > 0).to(token_loss.dtype)
    return (per_sequence * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  clip: float, *, dual_clip: float | None = None, agg: str = "token-mean",
                  behaviour_logprobs: torch.Tensor | None = None,
                  imp_weight_cap: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """l_t = w_t * max(-A r, -A clip(r, 1-clip, 1+clip)) [min -A*dual_clip if A<0], r = exp(logp-old_logp); agg(l)."""
    # dual_clip=c bounds the loss of a negative-advantage token by -A*c (Ye et al. 2020); None: no bound.
    # behaviour_logprobs switches to AReaL's decoupled objective: old_logp is then the proximal policy's logprob
    # (recomputed by the learner) and w_t = exp(old_logp - behaviour_logprobs), detached; otherwise w_t = 1.
    # imp_weight_cap: tokens with w_t above it contribute 0 but still count in the normaliser, as in AReaL.
    # agg: see aggregate_token_loss; the default "token-mean" is the original behaviour.
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if imp_weight_cap is not None and behaviour_logprobs is None:
        raise ValueError("imp_weight_cap needs behaviour_logprobs (the decoupled objective)")
    if imp_weight_cap is not None and imp_weight_cap <= 1:
        raise ValueError(f"imp_weight_cap must be > 1, got {imp_weight_cap}")
    generated = mask > 0
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip, 1 + clip)
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
            # torch.where keeps padding (where exp could overflow) out of the weights and the statistics.
            raw_weight = torch.where(generated, torch.exp(old_logp - behaviour_logprobs), 0.0)
            kept = generated if imp_weight_cap is None else generated & (raw_weight <= imp_weight_cap)
            # AReaL's choice: a token with an extreme weight (very stale or a sampler/learner mismatch) is dropped
            # instead of clipped, since a clipped weight would still push on a token the behaviour policy
            # hardly represents; the normaliser keeps counting it, so capping never up-weights the others.
            weight = torch.where(kept, raw_weight, 0.0)
        token_loss = token_loss * weight
    loss = aggregate_token_loss(token_loss, mask, agg)
    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean((clipped > unclipped).float(), mask).item(),
            "importance_ratio": masked_mean(ratio, mask).item(),
        }
        if dual_clip is not None:
            stats["dual_clip_fraction"] = masked_mean(dual_clipped.float(), mask).item()
        if behaviour_logprobs is not None:
            # Over all generated tokens before the cap, so the max shows how far off-policy the batch really was.
            stats["importance_weight_mean"] = masked_mean(raw_weight, mask).item()
            stats["importance_weight_max"] = raw_weight.max().item() if generated.any() else 0.0
            stats["importance_weight_capped_fraction"] = masked_mean((generated & ~kept).float(), mask).item()
    return loss, stats


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1, never negative."""
    delta = ref_logp - logp
    return masked_mean(torch.exp(delta) - delta - 1, mask)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


class FixedKLController:
    """beta stays at kl_coef."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


class AdaptiveKLController:
    """beta <- beta * (1 + clip(KL / target_kl - 1, -0.2, 0.2) * n_steps / horizon) (Ziegler et al. 2019)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError("target_kl and horizon must be positive")
        self.value, self.target_kl, self.horizon = float(init_kl_coef), float(target_kl), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        # A proportional controller on log(beta): the clip to +-0.2 keeps one noisy KL estimate from moving beta
        # by more than 20% per `horizon` steps; n_steps and horizon share a unit (Ziegler et al. count samples).
        error = min(max(float(current_kl) / self.target_kl - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon
        return self.value
