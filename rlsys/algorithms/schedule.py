"""Learning-rate schedules as multipliers of the base rate, for torch's LambdaLR."""

import math


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, kind: str) -> float:
    """Linear warm-up from 0 over `warmup_steps`, then constant, linear or cosine decay to 0 at `total_steps`."""
    if step < warmup_steps:
        return step / warmup_steps
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))
