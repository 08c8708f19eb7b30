"""Which GPUs each role of a single-machine run sees (CUDA_VISIBLE_DEVICES), from the cluster.* settings.

Learner ranks take the first `cluster.learner_gpus` devices, one each; each inference worker then takes
the next `cluster.gpus_per_inference_worker`. A count of 0 leaves that role seeing every GPU, as before
placement existed. With no GPU nothing is assigned and nothing changes. A layout that needs more GPUs than
the machine has is refused, with what would fit.
"""

import os
from pathlib import Path

from rlsys.placement.base import PlacementError

# A GPU driver's control files (NVIDIA's, and ROCm's, whose GPUs torch.cuda counts too); a container is given them
# with its GPUs. Without any there is no GPU to count.
GPU_DRIVER_FILES = ("/dev/nvidiactl", "/dev/kfd")


def gpu_layout(cluster, inference, devices: list[str]) -> dict[tuple[str, int], str]:
    """(role, index) -> CUDA_VISIBLE_DEVICES value for the roles that get their own GPUs; PlacementError
    if the layout does not fit `devices` (the GPUs this machine shows, by their CUDA_VISIBLE_DEVICES names)."""
    per_rank = cluster.learner_gpus // cluster.n_learner_ranks
    per_worker = cluster.gpus_per_inference_worker
    tp = inference.tensor_parallel_size
    if per_worker and tp > per_worker:
        raise PlacementError(f"inference.tensor_parallel_size={tp} needs at least that many GPUs per inference "
                             f"worker; cluster.gpus_per_inference_worker is {per_worker}")
    if not devices:
        if cluster.learner_gpus or per_worker or tp > 1:
            raise PlacementError(
                "this machine has no GPU, but the layout asks for some (cluster.learner_gpus="
                f"{cluster.learner_gpus}, cluster.gpus_per_inference_worker={per_worker}, "
                f"inference.tensor_parallel_size={tp}); on CPU leave them at 0, 0 and 1 "
                "(more inference throughput on CPU: cluster.n_inference_workers)")
        return {}
    needed = cluster.learner_gpus + cluster.n_inference_workers * per_worker
    if needed > len(devices) or tp > len(devices):
        room = len(devices) - cluster.learner_gpus
        fits = (f"the learner's {cluster.learner_gpus} leave {max(room, 0)}: at most "
                f"{max(room, 0) // per_worker} inference workers of {per_worker} GPUs") if per_worker else \
            f"at most {len(devices)} GPUs in all"
        raise PlacementError(f"the layout needs {max(needed, tp)} GPUs (learner {cluster.learner_gpus} + "
                             f"{cluster.n_inference_workers} inference workers x {per_worker}, tensor parallel {tp}), "
                             f"this machine has {len(devices)}: {fits}")
    if cluster.n_learner_ranks > 1 and not per_rank:
        raise PlacementError(f"cluster.n_learner_ranks={cluster.n_learner_ranks} on a GPU machine needs a GPU per "
                             f"rank: set cluster.learner_gpus={cluster.n_learner_ranks}")
    layout = {}
    for rank in range(cluster.n_learner_ranks if per_rank else 0):
        layout[("learner", rank)] = ",".join(devices[rank * per_rank:(rank + 1) * per_rank])
    first = cluster.learner_gpus
    for worker in range(cluster.n_inference_workers if per_worker else 0):
        start = first + worker * per_worker
        layout[("inference", worker)] = ",".join(devices[start:start + per_worker])
    return layout


def visible_devices() -> list[str]:
    """The GPUs this process may use, named as CUDA_VISIBLE_DEVICES names them for child processes. On a machine
    without a GPU driver the launcher does not import torch to count none (a second before any role starts)."""
    if not any(Path(name).exists() for name in GPU_DRIVER_FILES):
        return []
    import torch

    count = torch.cuda.device_count()
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is not None:
        return [d.strip() for d in named.split(",") if d.strip()][:count]
    return [str(i) for i in range(count)]
