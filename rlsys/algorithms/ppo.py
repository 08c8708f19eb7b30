"""The PPO clipped policy loss, KL penalty and entropy, on per-token tensors of shape [B, T-1]."""

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


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  clip: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean clipped surrogate over masked tokens; returns the loss and its statistics."""
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip, 1 + clip)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean((clipped > unclipped).float(), mask).item(),
            "importance_ratio": masked_mean(ratio, mask).item(),
        }
    return loss, stats


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1, never negative."""
    delta = ref_logp - logp
    return masked_mean(torch.exp(delta) - delta - 1, mask)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)
