"""An optimizer step that happens only when it cannot write non-finite weights.

One bad number (a loss that overflowed, a gradient that is inf or NaN) taken into `optimizer.step()`
makes every weight NaN, and the learner would publish them to inference and checkpoint them. So the
gradient norm ||g||_2 (which is finite iff every gradient entry is) and the loss are checked first:
a step with either non-finite is skipped, its gradients dropped, and the caller counts it.
"""

import math

import torch


def clip_and_step(optimizer: torch.optim.Optimizer, max_grad_norm: float,
                  loss: float | None = None) -> tuple[float, bool]:
    """Clips the gradients of the optimizer's parameters to `max_grad_norm` and steps it if `loss` and the gradients
    are finite.

    Returns (gradient norm before clipping, whether the optimizer stepped). A skipped step zeroes the
    gradients, so nothing non-finite is left to accumulate into the next one.
    """
    # The optimizer's own lists: a model's parameters() walks every module, a cost per step as large as the clipping.
    parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm) if parameters else torch.zeros(())
    # FSDP's sharded gradients give a DTensor: its full value is the norm over every rank's shards.
    grad_norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
    if not math.isfinite(grad_norm) or (loss is not None and not math.isfinite(loss)):
        optimizer.zero_grad()
        return grad_norm, False
    optimizer.step()
    return grad_norm, True
