"""The learner's ranks: one process each, joined by torch.distributed, the model sharded with FSDP2.

Whoever starts the learner processes sets MASTER_ADDR and MASTER_PORT (the rendezvous); the learner role
with index i is rank i of `cluster.n_learner_ranks`. NCCL joins GPUs, gloo CPUs. Rank 0 alone talks to the
bus and hands every other rank the step's trajectories as msgpack bytes (never pickle). One rank, the
default, initialises nothing and shards nothing.
"""

import gc
import os
import socket

import msgpack
import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from rlsys.protocol import RENDEZVOUS_LISTEN_FD


class Ranks:
    """This process's place among the learner's ranks, and the few collectives the learner needs."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world
        self.mesh = None  # the ranks' device mesh, which the model is sharded over (join_ranks; one rank has none)

    @property
    def main(self) -> bool:
        """Rank 0: reads batches, acknowledges, publishes weights, logs, writes what is not sharded."""
        return self.rank == 0

    @property
    def device(self) -> str:
        """cuda:(rank modulo the GPUs this process sees), so one GPU per process or all of them both work."""
        if not torch.cuda.is_available():
            return "cpu"
        return f"cuda:{self.rank % torch.cuda.device_count()}"

    @property
    def _comm_device(self) -> str:
        return self.device if dist.get_backend() == "nccl" else "cpu"

    def broadcast(self, obj=None):
        """Rank 0's `obj` (anything msgpack packs) on every rank."""
        if self.world == 1:
            return obj
        data = msgpack.packb(obj) if self.main else b""
        size = torch.tensor([len(data)], device=self._comm_device)
        dist.broadcast(size, 0)
        buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._comm_device) if self.main
                  else torch.empty(int(size.item()), dtype=torch.uint8, device=self._comm_device))
        dist.broadcast(buffer, 0)
        return msgpack.unpackb(buffer.cpu().numpy().tobytes(), strict_map_key=False)

    def all_gather(self, obj) -> list:
        """Every rank's `obj` (msgpack), in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        data = msgpack.packb(obj)
        sizes = self._gather_tensor(torch.tensor([len(data)], device=self._comm_device))
        width = max(int(s.item()) for s in sizes)
        mine = torch.zeros(width, dtype=torch.uint8, device=self._comm_device)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return [msgpack.unpackb(part[:int(n.item())].cpu().numpy().tobytes(), strict_map_key=False)
                for part, n in zip(self._gather_tensor(mine), sizes)]

    def max(self, n: int) -> int:
        if self.world == 1:
            return n
        value = torch.tensor([n], device=self._comm_device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    def summed(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `tensor` (same shape on every rank)."""
        if self.world == 1:
            return tensor
        total = tensor.to(self._comm_device)
        dist.all_reduce(total)
        return total.to(tensor.device)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def _gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        dist.all_gather(parts, tensor)
        return parts


def join_ranks(rank: int, world: int) -> Ranks:
    """Joins the process group of `world` learner ranks (MASTER_ADDR/MASTER_PORT rendezvous); one rank joins none."""
    if world == 1:
        return Ranks()
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise RuntimeError(f"learner rank {rank} of {world}: {name} is not set; whoever starts the learner's "
                               "ranks sets MASTER_ADDR and MASTER_PORT so that they can find each other")
    # Imported before the group forms: FSDP and distributed checkpointing import modules that default arguments
    # to `dist.group.WORLD` (torch.distributed.nn.functional, fsdp.sharded_grad_scaler). Imported after, those
    # defaults hold the group, and it outlives destroy_process_group (leave_ranks): its threads and connections are
    # then torn down at interpreter exit, in whatever state the peers are.
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    ranks = Ranks(rank, world)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(ranks.device)
    dist.init_process_group(backend, rank=rank, world_size=world, store=rendezvous_store(rank, world))
    from torch.distributed.device_mesh import init_device_mesh

    ranks.mesh = init_device_mesh("cuda" if backend == "nccl" else "cpu", (world,))
    return ranks


def rendezvous_store(rank: int, world: int) -> "dist.TCPStore":
    """The ranks' rendezvous at MASTER_ADDR:MASTER_PORT, rank 0 its server. It listens on MASTER_ADDR alone (loopback
    on one machine, the node's address under Ray): torch's env:// rendezvous listens on every interface, where whoever
    reaches the machine could read and write the store, which has no password, while the ranks meet in it. Rank 0
    serves on the socket bound for it before its role started, where there is one (RENDEZVOUS_LISTEN_FD: bound by
    the launcher on one machine, by rank 0's own Ray actor as it was placed), so that no other process takes the port
    in between."""
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    listener = None
    if rank == 0 and (held := os.environ.pop(RENDEZVOUS_LISTEN_FD, None)):
        listener = int(held)
    elif rank == 0:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        listener = socket.create_server((address, port), family=family).detach()  # the store owns it from here
    return dist.TCPStore(address, port, world, rank == 0, default_pg_timeout, master_listen_fd=listener)


def leave_ranks(ranks: Ranks, finished: bool = True) -> None:
    """Leaves the process group. finished: every rank got here without an error, so they first meet at a barrier:
    no rank tears down its connections while a peer still has a collective in flight with it (gloo aborts
    the process then, "terminate called without an active exception"). After an error no barrier: the
    peers may never come, and the group is torn down as it is. The group ends here, with its threads, only if
    nothing holds it: the caller drops its sharded tensors (the learner) first."""
    if ranks.world > 1 and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()
        # The mesh holds the group (its `_pg_registry`), and DTensor's caches hold the mesh past the model: torch
        # 2.13's in Python, where they could be emptied, torch 2.11's also where Python cannot reach them. So the
        # mesh lets go of the group, and a collection frees the learner's FSDP states, which hold it too and sit in
        # reference cycles: the group ends with its threads now rather than at interpreter exit. The learner role
        # froze its start-up heap, those states included (roles.freeze_start_up_heap), out of every collection:
        # unfrozen first, or they would stay.
        ranks.mesh._pg_registry.clear()
        ranks.mesh = None
        gc.unfreeze()
        gc.collect()


def shard(model: torch.nn.Module, ranks: Ranks, mixed_precision: bool) -> torch.nn.Module:
    """FSDP2: each decoder layer (the model's `_no_split_modules`) and then the rest, sharded over the ranks' mesh.

    Gradients are summed over the ranks, not averaged: each rank's loss is already its part of the
    mini-batch's loss (token weights normalised over the whole mini-batch), so the sum is the single-rank
    gradient. mixed_precision: forward and backward in bf16, gradients reduced and weights kept in float32.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision
              else MixedPrecisionPolicy())
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=ranks.mesh, mp_policy=policy)
    fully_shard(model, mesh=ranks.mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum
    return model


def sync_gradients(models, enabled: bool) -> None:
    """Whether the next backward pass reduce-scatters the sharded models' gradients (a no-op for unsharded ones)."""
    from torch.distributed.fsdp import FSDPModule

    for model in models:
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(enabled)


def reshard(models) -> None:
    """Registers the sharded models' shards as their parameters again, freeing any gathered copy. FSDP keeps the
    root module's parameters gathered after a forward pass, for the backward pass it expects; after a pass without
    one (no_grad) the copy stays, and the next forward pass reads it, not the shards an optimizer step wrote since."""
    from torch.distributed.fsdp import FSDPModule

    for model in models:
        for module in (model.modules() if model is not None else ()):
            if isinstance(module, FSDPModule):
                module.reshard()


def full_state_dict(model: torch.nn.Module, ranks: Ranks) -> dict[str, torch.Tensor]:
    """The whole model's tensors on rank 0 (on CPU), {} on the others; every rank must call it."""
    if ranks.world == 1:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
