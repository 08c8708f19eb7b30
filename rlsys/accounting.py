"""Where every admitted prompt ends: trained, filtered (with a reason) or failed (with a reason).

The counters live on the bus, only ever grow, and are updated by the role that decides the outcome: the
rollout worker admits prompts and records failed episodes, the learner records trained, filtered and
rejected ones. An admitted prompt joins the in-flight set; recording its outcome removes it and counts the
outcome in one atomic step, so a prompt is counted once even if two roles report it. When the run ends,
what is still in flight (running episodes, groups waiting in the stream or in the learner's unfinished
batch) is counted as filtered with reason `run_ended`, from the set's size rather than by subtraction:
admitted == trained + filtered + failed is then a check that can fail.

These counters are separate from the staleness gate's (protocol.ADMITTED), which goes down again when a
prompt gives its slot back.
"""

from rlsys import protocol

ADMITTED, TRAINED = "admitted", "trained"
FILTER_REASONS = {
    "uniform_reward": "every sample of the group got the same reward (ppo.filter_uniform_groups)",
    "run_ended": "still in flight, or delivered but not yet trained, when the run ended",
    "too_stale": "its oldest generated token was more than max_head_offpolicyness versions behind the policy "
                 "the learner was training",
}
FAILURE_REASONS = {
    "env_error": "the environment (or its reward) raised",
    "env_timeout": "an environment call took longer than env_timeout seconds",
    "agent_error": "the agent raised",
    "agent_timeout": "the agent's function took longer than its timeout",
    "invalid_output": "the agent returned no trajectories, or ones the learner could not take",
    "rejected": "the learner set the group's message aside in the dead-letter stream",
}


def filtered(reason: str) -> str:
    if reason not in FILTER_REASONS:
        raise ValueError(f"unknown filter reason {reason!r}; known: {sorted(FILTER_REASONS)}")
    return f"filtered:{reason}"


def failed(reason: str) -> str:
    if reason not in FAILURE_REASONS:
        raise ValueError(f"unknown failure reason {reason!r}; known: {sorted(FAILURE_REASONS)}")
    return f"failed:{reason}"


def admit(bus, prompt_id: str) -> bool:
    """Counts `prompt_id` as admitted and in flight; False if it is in flight already (nothing counted)."""
    return bus.set_add(protocol.PROMPTS_IN_FLIGHT, prompt_id, counter=protocol.prompt_outcome(ADMITTED))


def settle(bus, prompt_id: str, outcome: str) -> bool:
    """Records the outcome (TRAINED, filtered(reason) or failed(reason)) of an in-flight prompt; False,
    and nothing counted, if the prompt is not in flight (never admitted, or settled already)."""
    return bus.set_remove(protocol.PROMPTS_IN_FLIGHT, prompt_id, counter=protocol.prompt_outcome(outcome))


def settle_untrained(bus, prompt_id: str, outcome: str) -> bool:
    """Records an outcome other than trained and gives the prompt's staleness-gate slot back: the gate
    expects batch_size admitted prompts per step, and one that will never be trained must not hold a slot.
    Only the caller that settles the prompt gives its slot back."""
    if not settle(bus, prompt_id, outcome):
        return False
    bus.incr(protocol.ADMITTED, -1)
    return True


def counts(bus) -> dict:
    """{"admitted", "trained", "filtered": {reason: n}, "failed": {reason: n}, "in_flight"}; zero reasons left out."""
    def by_reason(reasons, key):
        found = {reason: bus.get(protocol.prompt_outcome(key(reason))) or 0 for reason in reasons}
        return {reason: n for reason, n in found.items() if n}

    return {ADMITTED: bus.get(protocol.prompt_outcome(ADMITTED)) or 0,
            TRAINED: bus.get(protocol.prompt_outcome(TRAINED)) or 0,
            "filtered": by_reason(FILTER_REASONS, filtered), "failed": by_reason(FAILURE_REASONS, failed),
            "in_flight": bus.set_size(protocol.PROMPTS_IN_FLIGHT)}


def accounted(c: dict) -> int:
    """Admitted prompts with a known place: an outcome, or still in flight."""
    return c[TRAINED] + sum(c["filtered"].values()) + sum(c["failed"].values()) + c["in_flight"]


def settled_snapshot(bus) -> dict:
    """What a checkpoint keeps: only prompts with an outcome. The in-flight ones are not in the checkpoint's
    consumed prompts, so a run resumed from it admits them again; counted here, they would count twice."""
    c = counts(bus)
    c["in_flight"] = 0
    c[ADMITTED] = accounted(c)
    return c


def restore(bus, snapshot: dict | None) -> None:
    """Before any role starts: the counters of `snapshot` (a resumed run), or all zero (a fresh one)."""
    snapshot = snapshot or {}
    outcomes = [ADMITTED, TRAINED, *map(filtered, FILTER_REASONS), *map(failed, FAILURE_REASONS)]
    bus.delete(protocol.PROMPTS_IN_FLIGHT, *map(protocol.prompt_outcome, outcomes))
    values = {ADMITTED: snapshot.get(ADMITTED, 0), TRAINED: snapshot.get(TRAINED, 0),
              **{filtered(r): n for r, n in snapshot.get("filtered", {}).items()},
              **{failed(r): n for r, n in snapshot.get("failed", {}).items()}}
    for outcome, n in values.items():
        if n:
            bus.set(protocol.prompt_outcome(outcome), n)


def end_run(bus) -> dict:
    """After every role stopped: what is still in flight ends as filtered(run_ended); returns the final counts."""
    unfinished = bus.set_size(protocol.PROMPTS_IN_FLIGHT)
    if unfinished:
        bus.incr(protocol.prompt_outcome(filtered("run_ended")), unfinished)
    bus.delete(protocol.PROMPTS_IN_FLIGHT)
    return counts(bus)


def as_metrics(c: dict) -> dict[str, int]:
    """Flat `prompts/...` metrics for the JSONL and TensorBoard logs."""
    flat = {f"prompts/{ADMITTED}": c[ADMITTED], f"prompts/{TRAINED}": c[TRAINED], "prompts/in_flight": c["in_flight"],
            "prompts/filtered": sum(c["filtered"].values()), "prompts/failed": sum(c["failed"].values())}
    for kind in ("filtered", "failed"):
        flat.update({f"prompts/{kind}/{reason}": n for reason, n in c[kind].items()})
    return flat


def describe(c: dict) -> str:
    """One line: "prompts: 120 admitted = 96 trained + 16 filtered (run_ended 16) + 8 failed (env_error 8)"."""
    def part(kind):
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(c[kind].items()))
        return f"{sum(c[kind].values())} {kind}" + (f" ({reasons})" if reasons else "")

    in_flight = f" + {c['in_flight']} in flight" if c["in_flight"] else ""
    relation = "=" if accounted(c) == c[ADMITTED] else "!="
    return (f"prompts: {c[ADMITTED]} admitted {relation} {c[TRAINED]} trained + {part('filtered')} + "
            f"{part('failed')}{in_flight}")
