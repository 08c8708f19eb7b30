"""Truncated importance sampling between the inference engine and the learner (Yao et al. 2025, "Your efficient
RL framework secretly brings you off-policy RL training"; verl's and slime's `tis`)."""

import torch


def truncated_importance_weights(learner_logprobs: torch.Tensor, inference_logprobs: torch.Tensor,
                                 mask: torch.Tensor, cap: float) -> torch.Tensor:
    """w_t = min(pi_learner(a_t) / pi_inference(a_t), C) = min(exp(logp_learner - logp_inference), C); 0 where
    mask is 0.

    The same weights give two numerically different policies on the same tokens (a sampler in bf16 with its
    own kernels, a learner in fp32): the policy gradient is estimated with samples from pi_inference while
    it differentiates pi_learner, so each token's loss is multiplied by w_t. Truncating at C bounds the
    variance a token the sampler under-represents could add. Detached: a constant of the update.
    """
    if cap <= 1:
        raise ValueError(f"the truncation cap must be > 1, got {cap}")
    with torch.no_grad():
        generated = mask > 0
        ratio = torch.where(generated, torch.exp(learner_logprobs - inference_logprobs), 0.0)
        return ratio.clamp(max=cap)
