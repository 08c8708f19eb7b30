"""Where each role of a run spends its samples, from py-spy: the model's math against the machinery around it.

    py-spy record --subprocesses --format raw --rate 100 -o /tmp/run.txt -- python3 training/main_async_ppo.py ...
    python3 bench/role_profile.py /tmp/run.txt [--top 8] [--out bench/results/role_profile.json]

py-spy's raw format is one line per distinct stack, its frames (process first) and how many samples saw it. A process
is the role whose loop its stacks run: the learner's (`Learner.run`), the inference worker's (`InferenceWorker.run`)
or the rollout worker's (its event loop, `run_to_the_end`). A role's samples are its main thread's inside that loop
(start-up and imports left out) and every sample of its other threads (the rollout worker's bus calls in the thread
pool, heartbeats, transfers).

Each sample is put at its site, the innermost frame of rlsys/ on its stack (the rlsys call that asked for the work),
and is math when its stack is in the model's own computation: a torch module's forward (`Module._call_impl`, the
learner's and vLLM's passes, the probe's too), autograd's backward (`Tensor.backward`) or the clipped optimizer step
(`clip_and_step`). The table lists each role's sites by their samples that are not math, as a share of the role's
samples. Samples whose innermost frame is a wait (WAIT_LEAVES) are counted apart, as waiting: they cost no CPU. The
last line is the headline: the largest such share of any role, and what it is of the three roles' samples together.

py-spy's samples are wall-clock samples of threads it takes for active, and it takes many a blocked thread for
active (hence the waits counted apart, by name); at 100 Hz over several processes it falls behind on 2 cores (it
says so), so the shares are of the samples it took.
"""

import argparse
import collections
import functools
import json
import re
from pathlib import Path

ROLE_LOOPS = {"learner": "Learner.run", "inference": "InferenceWorker.run", "rollout": "run_to_the_end"}
MATH_FRAMES = ("Module._call_impl", "Tensor.backward", "clip_and_step")
# a thread blocked in these is waiting, though py-spy took it for active: an idle pool thread, a sleep, a read of a
# socket for a reply not yet sent, the event loop's select (and, by QUEUE_GET, a line of rlsys/ waiting on a C queue)
WAIT_LEAVES = {"_worker", "Condition.wait", "Event.wait", "EpollSelector.select", "SocketBuffer._read_from_socket",
               "socket.accept", "sleep", "Queue.get"}
MAIN_THREAD = "run_role"  # on the main thread of every role, above its loop
RECORD = re.compile(r"(.*?) (\d+)\n(?=process |\Z)", re.S)  # a command line may hold newlines
FRAME = re.compile(r"([A-Za-z_<>][^;()]*) \(([^():;]+?)(?::(\d+))?\)")
QUEUE_GET = re.compile(r"queue\.get\(\)")  # a line of rlsys that blocks in a C queue's get: py-spy shows no frame below


def stacks(path: Path):
    """(pid, [(function, file, line)], samples) for each line of a py-spy raw file."""
    for stack, count in RECORD.findall(path.read_text()):
        pids = re.findall(r"process (\d+):", stack)
        yield (pids[-1] if pids else "?"), FRAME.findall(stack), int(count)


def roles_of(records) -> dict[str, str]:
    """pid -> role, by the loop its stacks run."""
    found = {}
    for pid, frames, _ in records:
        names = {name for name, _, _ in frames}
        for role, loop in ROLE_LOOPS.items():
            if loop in names:
                found[pid] = role
    return found


def waiting(frames, root: Path) -> bool:
    name, file, line = frames[-1]
    if name in WAIT_LEAVES:
        return True
    if not (file.startswith("rlsys/") and line and (root / file).is_file()):
        return False
    lines = source_lines(root / file)
    return int(line) <= len(lines) and bool(QUEUE_GET.search(lines[int(line) - 1]))


@functools.lru_cache(maxsize=None)
def source_lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def site_of(frames) -> str:
    inner = [f"{name} ({file})" for name, file, _ in frames if file.startswith("rlsys/")]
    return inner[-1] if inner else "(outside rlsys)"


def tally(records, roles: dict[str, str], root: Path):
    """role -> site -> [samples, math samples], role -> samples, and role -> samples waiting (not in the first two)."""
    sites = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0]))
    totals, waits = collections.Counter(), collections.Counter()
    for pid, frames, count in records:
        role = roles.get(pid)
        names = {name for name, _, _ in frames}
        if role is None or not frames or (MAIN_THREAD in names and ROLE_LOOPS[role] not in names):
            continue
        if waiting(frames, root):
            waits[role] += count
            continue
        entry = sites[role][site_of(frames)]
        entry[0] += count
        entry[1] += count if names.intersection(MATH_FRAMES) else 0
        totals[role] += count
    return sites, totals, waits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path, help="py-spy record --subprocesses --format raw output")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the tree the profiled run ran (its lines tell a wait in rlsys/ from work)")
    parser.add_argument("--top", type=int, default=8, help="sites listed a role")
    parser.add_argument("--out", type=Path, default=Path("bench/results/role_profile.json"))
    args = parser.parse_args()
    records = list(stacks(args.profile))
    sites, totals, waits = tally(records, roles_of(records), args.root)
    print("role       active (waiting)  math   site (innermost rlsys frame)                     not math  math")
    rows = []
    for role in ROLE_LOOPS:
        total = totals[role]
        math = sum(m for _, m in sites[role].values()) / max(total, 1)
        ranked = sorted(sites[role].items(), key=lambda item: item[1][1] - item[1][0])[:args.top]
        for rank, (site, (samples, math_samples)) in enumerate(ranked):
            head = f"{role:<10} {total:>6} ({waits[role]:>7}) {math:>5.1%}" if rank == 0 else " " * 33
            print(f"{head}  {site[:48]:<48} {(samples - math_samples) / total:>8.1%} {math_samples / total:>5.1%}")
            rows.append({"role": role, "role_samples": total, "waiting_samples": waits[role], "site": site,
                         "not_math": (samples - math_samples) / total, "math": math_samples / total})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"profile": str(args.profile), "rows": rows}, indent=1))
    top = max(rows, key=lambda row: row["not_math"])
    overall = top["not_math"] * totals[top["role"]] / max(sum(totals.values()), 1)
    print(f"largest cost that is not math: {top['site']} in the {top['role']}, {top['not_math']:.1%} of its samples "
          f"({overall:.1%} of all three roles' active samples)")


if __name__ == "__main__":
    main()
