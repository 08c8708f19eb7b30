"""The sharded learner: N ranks (gloo on CPU, FSDP2) take the same step as one, and checkpoints reshard."""

import contextlib
import faulthandler
import gc
import json
import os
import random
import socket
import time
import types
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rlsys.api import Trajectory
from rlsys.bus import InProcessBus
from rlsys.checkpoint import SHARDED_STATE, read_trainer_state
from rlsys.cli import config_from_dict, config_to_dict, parse_config
from rlsys.launcher import launch
from rlsys.metrics import read_jsonl_metrics
from rlsys.placement.local import LocalPlacement
from rlsys.protocol import RENDEZVOUS_LISTEN_FD, role_name
from rlsys.training_step import read_back
from rlsys.workers.learner import Learner
from tests.helpers import child_pids, held_port, left_behind, small_run_overrides, summing_rank
from tests.test_learner import learner_config, mixed_length_batch

pytestmark = pytest.mark.distributed

SETTINGS = {
    # Packed rows sharing the groups' prompts, a token budget that gives the ranks unequal numbers of micro-batches
    # (empty passes), the reference and proximal passes gathered from both ranks.
    "grpo+kl+decoupled+packed": {"init_kl_coef": 0.1, "decoupled_loss": True, "max_tokens_per_micro_batch": 48},
    # The proximal logprobs the first mini-batch's passes fill in on each rank, gathered for the later mini-batches,
    # whose sequences the ranks split otherwise (padded rows: balanced by sequence, not by group; the third epoch
    # mixes the first's mini-batches).
    "decoupled+padded+6-steps": {"decoupled_loss": True, "sequence_packing": False, "max_tokens_per_micro_batch": 64,
                                 "ppo_epochs": 3, "num_mini_batches": 2},
    # A sharded critic, padded rows, per-sequence aggregation (weights normalised over the whole mini-batch).
    "gae+padded+seq-mean": {"adv_estimator": "gae", "sequence_packing": False, "loss_agg_mode": "seq-mean-token-mean",
                            "entropy_loss_coef": 0.01, "max_tokens_per_micro_batch": 200},
}


def rendezvous() -> socket.socket:
    """Rank 0's rendezvous socket, bound here and handed to the ranks, as LocalPlacement does: a port picked free here
    and bound by rank 0 once spawned, seconds later, could be taken by then (the other test file's servers, the
    ephemeral ports of its connections)."""
    return socket.create_server(("127.0.0.1", 0))


def meet_at(rank: int, listener: socket.socket) -> None:
    """The rendezvous environment of `rank`: rank 0 serves on `listener` (rlsys.distributed.rendezvous_store)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(listener.getsockname()[1]))
    if rank == 0:
        os.environ[RENDEZVOUS_LISTEN_FD] = str(listener.detach())
    else:
        listener.close()


def one_step_at_rank(rank: int, world: int, listener: socket.socket, payload: dict, batch: list[dict], run_dir: str,
                     clock: list[float] | None = None) -> None:
    """A learner rank, built as the learner role builds it: one train step on `batch`, then a checkpoint; rank 0
    writes the gathered weights, each rank its step's figures and each update's (recorded_updates). clock: the first
    step measures the layout (as on a GPU in bfloat16), with a clock that reads these times in turn; each rank then
    writes the layout it kept and the seconds it logged."""
    from rlsys.distributed import full_state_dict, join_ranks, leave_ranks
    from rlsys.roles import freeze_start_up_heap

    faulthandler.enable(all_threads=True)  # a native abort (at teardown, say) shows where each thread was
    meet_at(rank, listener)
    torch.set_num_threads(1)
    gc.disable()  # as the learner role does until it is built: the heap it built is then frozen
    ranks = join_ranks(rank, world)
    config = config_from_dict(payload)
    learner = Learner(config, InProcessBus(), run_dir, ranks)
    freeze_start_up_heap()
    if clock is not None:
        import rlsys.training_step

        learner.measures_layout = True
        rlsys.training_step.time = types.SimpleNamespace(perf_counter=iter(clock).__next__)
    updates = recorded_updates(learner)
    stats = learner.train_step([Trajectory.from_dict(t) for t in batch])
    Path(run_dir, f"figures-{rank}.json").write_text(json.dumps({"step": stats, "updates": updates}))
    if clock is not None:
        Path(run_dir, f"layout-{rank}.json").write_text(json.dumps(
            ["packed" if learner.packed else "padded", {k: v for k, v in stats.items() if k.startswith("layout/")}]))
    learner.step = 1
    learner.save()
    state = full_state_dict(learner.model, ranks)
    if ranks.main:
        torch.save(state, os.path.join(run_dir, "params.pt"))
    del learner, state
    leave_ranks(ranks)
    # The group is gone with its threads: none left to be torn down at interpreter exit, with the peers gone.
    assert not [name for name in native_threads() if "gloo" in name], native_threads()


def recorded_updates(learner: Learner) -> list[dict[str, float]]:
    """Filled in as `learner` takes its optimizer steps: each one's figures, how many sequences its mini-batch held
    and how many of them have a trained token (not void). A train step reports its last update's figures alone."""
    updates, optimizer_step = [], learner.optimizer_step

    def recorded(mini_batch, *args, **kwargs):
        stats = optimizer_step(mini_batch, *args, **kwargs)
        updates.append({"sequences": len(mini_batch), "trained": int(mini_batch.token_counts[:, 0].astype(bool).sum()),
                        **dict(zip(stats, read_back(list(stats.values()))))})
        return stats

    learner.optimizer_step = recorded
    return updates


def on_two_ranks(fn, *args, timeout: float = 300) -> None:
    """fn(rank, 2, rendezvous, *args) on two spawned ranks. Ranks whose collectives do not meet wait on each other
    for ever: past `timeout` they are killed and the test fails, well within pytest's own timeout, which would leave
    them behind. A rank that ends otherwise than with exit code 0 fails the test too (ProcessContext.join raises)."""
    ranks = mp.start_processes(fn, args=(2, rendezvous(), *args), nprocs=2, start_method="spawn", join=False)
    deadline = time.monotonic() + timeout
    while not ranks.join(max(0.0, deadline - time.monotonic())):  # returns as each rank ends
        if time.monotonic() >= deadline:
            for process in ranks.processes:
                process.kill()
                process.join()
            pytest.fail(f"the ranks had not ended after {timeout} s")


def native_threads() -> list[str]:
    """The names of this process's threads, native ones included."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            names.append((task / "comm").read_text().strip())
    return names


@pytest.mark.parametrize("name", SETTINGS)
def test_two_ranks_take_the_single_rank_step_and_their_checkpoint_resumes_on_one(tmp_path, name):
    config = learner_config(tmp_path)
    config.ppo.lr, config.ppo.ppo_epochs, config.ppo.num_mini_batches = 1e-3, 1, 1  # one optimizer step, unless set
    for key, value in SETTINGS[name].items():
        setattr(config.ppo, key, value)
    single = Learner(config, InProcessBus(), tmp_path / "single")
    before = {k: v.clone() for k, v in single.model.state_dict().items()}
    batch = mixed_length_batch(single.model, random.Random(0), groups=3)[:7]  # odd: the ranks get different shares
    assert len(single.micro_batches(single.prepare_batch(batch))) > 1
    single.train_step(batch)

    run_dir = tmp_path / "two"
    run_dir.mkdir()
    on_two_ranks(one_step_at_rank, config_to_dict(config), [t.to_dict() for t in batch], str(run_dir))

    sharded = torch.load(run_dir / "params.pt", weights_only=True)
    assert set(sharded) == set(single.model.state_dict())  # tied weights under both names, as inference loads them
    for key, value in single.model.state_dict().items():
        assert torch.allclose(sharded[key], value, atol=1e-5, rtol=0), key
    assert max((single.model.state_dict()[k] - before[k]).abs().max() for k in before) > 1e-4  # the step moved them

    checkpoint = run_dir / "checkpoints" / "step_1"
    assert read_trainer_state(checkpoint)["step"] == 1
    config.resume_from_checkpoint = str(checkpoint)
    resumed = Learner(config, InProcessBus(), tmp_path / "resumed")  # 2 ranks -> 1
    for key, value in resumed.model.state_dict().items():
        assert torch.equal(value, sharded[key]), key
    for model, optimizer, reference in ((resumed.model, resumed.optimizer, single.optimizer),
                                        (resumed.critic, resumed.critic_optimizer, single.critic_optimizer)):
        if model is None:
            continue
        got, expected = optimizer.state_dict()["state"], reference.state_dict()["state"]
        assert len(got) == len(expected) == len(list(model.parameters()))
        for i in expected:
            assert (got[i]["step"].item() == expected[i]["step"].item()
                    == config.ppo.ppo_epochs * config.ppo.num_mini_batches)
            assert torch.allclose(got[i]["exp_avg"], expected[i]["exp_avg"], atol=1e-7, rtol=1e-4)
            assert torch.allclose(got[i]["exp_avg_sq"], expected[i]["exp_avg_sq"], atol=1e-10, rtol=1e-3)
    assert resumed.scheduler.state_dict()["last_epoch"] == single.scheduler.state_dict()["last_epoch"]


def test_two_ranks_step_alike_through_mini_batches_that_cannot_move_the_policy_and_void_ones(tmp_path):
    """A mini-batch none of whose sequences can move the policy (its group's rewards all equal) takes its step on zero
    gradients without a pass (PolicyTrainer.zero_gradients), one of void trajectories takes none, and one that mixes
    them with sequences that can computes those alone, which may leave a rank no share: every rank must choose alike,
    or their collectives would not meet, and the zero gradients must be sharded as the parameters are. A step on zero
    gradients follows no backward pass: after the no_grad ones (here the proximal pass of the decoupled loss) FSDP
    kept the root module's parameters gathered, and the next update's passes read them without that step's weight
    decay. Small mini-batches over two epochs, so the step takes each kind; weight decay, so that every step taken
    moves."""
    config = learner_config(tmp_path)
    config.ppo.lr, config.ppo.ppo_epochs, config.ppo.weight_decay, config.ppo.decoupled_loss = 1e-3, 2, 0.1, True
    config.ppo.mask_void_trajectories, config.ppo.num_mini_batches = True, 6
    single = Learner(config, InProcessBus(), tmp_path / "single")
    batch = mixed_length_batch(single.model, random.Random(0), groups=3)[:9]  # groups g0 g1 g2, three times
    for t in batch:
        if t.group_id == "g0":  # one reward for the whole group: zero advantage
            t.turn_rewards, t.reward = [0.5, 0.5], 1.0
        if t.group_id == "g1":  # a turn with neither an action nor an answer: out of the loss
            t.void = True
    before = {k: v.clone() for k, v in single.model.state_dict().items()}
    updates = recorded_updates(single)
    stats = single.train_step(batch)

    def kind(update: dict) -> str:
        if not update["trained"]:
            return "void"
        if "loss" not in update:
            return "cannot move"
        return "partly skipped" if update["sequences/skipped_zero_advantage"] else "all computed"

    kinds = [kind(u) for u in updates]
    assert {"void", "cannot move", "partly skipped"} <= set(kinds), kinds
    assert all(u == {"sequences": u["sequences"], "trained": 0, "grad_norm": 0.0} for u in updates if kind(u) == "void")
    assert single.scheduler.state_dict()["last_epoch"] == len(updates) - kinds.count("void")  # those took no step
    # one of zero-advantage sequences alone, none void
    assert any(u["sequences/skipped_zero_advantage"] == u["trained"] == u["sequences"] for u in updates
               if kind(u) == "cannot move"), updates

    run_dir = tmp_path / "two"
    run_dir.mkdir()
    on_two_ranks(one_step_at_rank, config_to_dict(config), [t.to_dict() for t in batch], str(run_dir))
    for rank in (0, 1):
        figures = json.loads((run_dir / f"figures-{rank}.json").read_text())
        # each update's figures, the skipped sequences' counts among them, as one rank's, and the step's
        assert len(figures["updates"]) == len(updates), rank
        for n, (got, expected) in enumerate(zip(figures["updates"], updates)):
            assert got == pytest.approx(expected, rel=1e-4, abs=1e-6), (rank, n)
        assert figures["step"] == pytest.approx(stats, rel=1e-4, abs=1e-6), rank
    sharded = torch.load(run_dir / "params.pt", weights_only=True)
    for key, value in single.model.state_dict().items():
        assert torch.allclose(sharded[key], value, atol=1e-5, rtol=0), key
    assert max((single.model.state_dict()[k] - before[k]).abs().max() for k in before) > 1e-4


def test_two_ranks_measure_the_layout_and_keep_the_same_one_the_faster_on_the_slowest_rank(tmp_path):
    """Where the first step measures the layout (a GPU in bfloat16), every rank keeps the same one: the faster by the
    slowest rank's time, the step's. Here rank 0's clock finds padding faster, rank 1's packing by more; both keep
    packing, and the step is then a packed one."""
    config = learner_config(tmp_path)
    config.ppo.lr, config.ppo.ppo_epochs, config.ppo.num_mini_batches = 1e-3, 1, 1
    config.ppo.share_prefixes, config.ppo.max_tokens_per_micro_batch = "false", 64
    single = Learner(config, InProcessBus(), tmp_path / "single")  # packs on a CPU
    batch = mixed_length_batch(single.model, random.Random(0), groups=3)[:7]
    single.train_step(batch)

    run_dir = tmp_path / "two"
    run_dir.mkdir()
    on_two_ranks(measuring_rank, config_to_dict(config), [t.to_dict() for t in batch], str(run_dir))
    slowest = {"layout/packed_seconds": 1.0, "layout/padded_seconds": 2.0}
    assert [json.loads((run_dir / f"layout-{rank}.json").read_text()) for rank in (0, 1)] == [["packed", slowest]] * 2
    sharded = torch.load(run_dir / "params.pt", weights_only=True)
    for key, value in single.model.state_dict().items():
        assert torch.allclose(sharded[key], value, atol=1e-5, rtol=0), key


# Each rank's clock at the start and end of the four measuring passes (packed, padded, packed, padded); the last two
# count.
CLOCKS = {0: [0, 1, 1, 2, 2, 3, 3, 3.5],  # packed 1.0, padded 0.5
          1: [0, 1, 1, 2, 2, 2.8, 3, 5]}  # packed 0.8, padded 2.0


def measuring_rank(rank: int, world: int, listener: socket.socket, payload: dict, batch: list[dict],
                   run_dir: str) -> None:
    one_step_at_rank(rank, world, listener, payload, batch, run_dir, clock=CLOCKS[rank])


@pytest.mark.slow
def test_the_run_trains_with_two_learner_ranks(cache_dir, tmp_path):
    existing = child_pids()
    config = parse_config(small_run_overrides(cache_dir, tmp_path) + [
        "cluster.n_learner_ranks=2", "max_steps=6", "save_steps=3", "eval_steps=0"])
    summary = launch(config)
    steps = read_jsonl_metrics(Path(config.logging_dir) / "learner.jsonl")  # rank 0 alone logs
    assert [s["step"] for s in steps] == [s["version"] for s in steps] == list(range(1, 7))
    assert all(s["grad_norm"] > 0 for s in steps)
    for step in (3, 6):
        checkpoint = Path(summary["run_dir"]) / "checkpoints" / f"step_{step}"
        assert (checkpoint / SHARDED_STATE / ".metadata").exists() and (checkpoint / "config.json").exists()
    assert summary["prompts_accounted"] and summary["restarts"] == {}
    assert summary["unclean_exits"] == {}  # each rank ended whole: a native abort at exit ends it by SIGABRT
    assert left_behind(tmp_path, existing) == []
    for log in ("learner0.log", "learner1.log"):  # each rank ended whole (faulthandler writes a native abort there)
        assert "Fatal Python error" not in (Path(config.logging_dir) / log).read_text(), log


def rendezvous_listeners_at_rank(rank: int, world: int, port: int, found: str) -> None:
    """Joins the ranks; rank 0 writes where the rendezvous port is listened on."""
    import psutil

    from rlsys.distributed import join_ranks, leave_ranks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ranks = join_ranks(rank, world)
    if rank == 0:
        Path(found).write_text(json.dumps(sorted({c.laddr.ip for c in psutil.Process().net_connections("tcp")
                                                  if c.status == psutil.CONN_LISTEN and c.laddr.port == port})))
    leave_ranks(ranks)


def test_the_ranks_rendezvous_listens_on_the_master_address_alone(tmp_path):
    """torch's env:// rendezvous served its store (no password) on every interface, whatever MASTER_ADDR said: on one
    machine, loopback is where the ranks meet."""
    found = tmp_path / "listeners.json"
    # a port rank 0 binds itself, as where no launcher holds one for it (ranks started by hand); held here meanwhile
    with held_port() as port:
        mp.start_processes(rendezvous_listeners_at_rank, args=(2, port, str(found)), nprocs=2, start_method="spawn")
    assert json.loads(found.read_text()) == ["127.0.0.1"]


def test_the_rendezvous_port_cannot_be_taken_between_the_launcher_s_pick_and_rank_0_s_start(tmp_path):
    """The launcher picked a free port and rank 0 bound it seconds later, once started: another process taking it
    meanwhile failed the group, and every role restarted from the checkpoint. Rank 0's port is held from the pick."""
    placement = LocalPlacement(parse_config(["cluster.n_learner_ranks=2"]), summing_rank)
    try:
        rank0 = placement.start("learner", 0, (str(tmp_path),))
        squatter = None
        with contextlib.suppress(OSError):  # another process, as soon as it could
            squatter = socket.create_server(("127.0.0.1", placement.master_port))
        rank1 = placement.start("learner", 1, (str(tmp_path),))
        for rank in (rank0, rank1):
            rank.join(120)
        assert (rank0.exitcode, rank1.exitcode) == (0, 0)
        assert [(tmp_path / role_name("learner", i)).read_text() for i in range(2)] == ["3.0", "3.0"]
        assert squatter is None
    finally:
        placement.close()
        if squatter is not None:
            squatter.close()
