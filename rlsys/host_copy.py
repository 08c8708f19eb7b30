"""Host data onto a device without waiting for it.

A plain `tensor.to("cuda")` from ordinary (pageable) host memory waits until the GPU has finished everything
queued before the copy: one such copy per micro-batch makes the learner wait on every pass. From pinned memory
with `non_blocking=True` the copy joins the queue instead (the pinned buffer is held until it is done).
"""

import numpy as np
import torch


def to_device(data, device, dtype=None) -> torch.Tensor:
    """`data` (a numpy array, list or CPU tensor) on `device`, copied without a wait where it is a GPU."""
    tensor = data if isinstance(data, torch.Tensor) else torch.from_numpy(np.array(data, dtype=dtype))
    if torch.device(device).type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
