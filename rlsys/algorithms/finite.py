"""An optimizer step that happens only when it cannot write non-finite weights.

One bad number (a loss that overflowed, a gradient that is inf or NaN) taken into `optimizer.step()`
makes every weight NaN, and the learner would publish them to inference and checkpoint them. So the
gradient norm ||g||_2 (which is finite iff every gradient entry is) and the loss are checked first:
a step with either non-finite is skipped, and the caller counts it.

A fused optimizer (`AdamW(fused=True)`, the learner's on one rank) is told on the device, as torch's GradScaler
tells it: its kernel skips the whole update (weights, moments, step count) where the `found_inf` flag is 1, so
the check reads nothing back. On a GPU a read back waits for the step's kernels and leaves the GPU idle while
the host queues the next ones: the learner reads once per train step, not once per update. Another optimizer is
checked on the host, one read per step.
"""

import math

import torch


def clip_and_step(optimizer: torch.optim.Optimizer, max_grad_norm: float,
                  loss: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clips the gradients of the optimizer's parameters to `max_grad_norm` and steps it if `loss` and the gradients
    are finite.

    Returns (gradient norm before clipping, whether the optimizer stepped) as 0-d tensors, unread where the optimizer
    is fused. A step skipped on the host zeroes the gradients, so nothing non-finite is left to accumulate into the
    next one; a fused optimizer's are left to the caller, who zeroes them before accumulating the next.
    """
    # The optimizer's own lists: a model's parameters() walks every module, a cost per step as large as the clipping.
    parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm) if parameters else torch.zeros(())
    # FSDP's sharded gradients give a DTensor: its full value is the norm over every rank's shards.
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    finite = torch.isfinite(norm)
    if isinstance(loss, torch.Tensor):
        finite = finite & torch.isfinite(loss)
    elif loss is not None and not math.isfinite(loss):
        finite = torch.zeros_like(finite)
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = (~finite).float()  # read by the fused kernel: no update where it is 1
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif finite.item():
        optimizer.step()
    else:
        optimizer.zero_grad()
    return norm, finite
