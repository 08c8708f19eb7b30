"""What a run's config asks of this machine and of its plugins, checked as the run starts: the roles' devices and
GPU layout, and its agents and environments built once. A config these refuse would otherwise start roles that die
at their start, restarted until they give up, the reason only in their logs.

rlsys/preflight.py holds the other start-up checks, of what a run needs outside itself (the bus, its packages, an
MLflow server). These sit in the entry layer: a refusal names the keys it comes from through rlsys.cli. The device
check reads the placement's GPU layout, and the placement imports preflight (check_reachable, for a Ray head): in
preflight it would close an import circle."""

import contextlib
import copy
import functools

from rlsys.cli import describe_fields, first_line
from rlsys.placement import PlacementError
from rlsys.placement.gpus import gpu_layout, visible_devices
from rlsys.preflight import StartupError


def check_devices(config) -> None:
    """The roles' settings fit the devices each will have, and the GPU layout fits this machine: refused here rather
    than by a role that would die and be restarted."""
    devices = visible_devices()
    if config.cluster.backend == "local":
        try:
            gpu_layout(config.cluster, config.inference, devices)
        except PlacementError as e:
            raise StartupError(str(e)) from None
        if config.cluster.colocate and devices:
            raise StartupError("cluster.colocate=true takes turns on CPU cores; on GPUs it would need vLLM's sleep "
                               "mode and in-memory weight hand-over, which rlsys does not have yet: leave it false")
    device = "cuda" if devices else "cpu"
    # Under Ray a role has a GPU where its bundle has (a role given none sees none), whatever this machine has
    on_ray = config.cluster.backend == "ray"
    learner_device = "cuda" if config.cluster.learner_gpus else "cpu" if on_ray else device
    inference_device = "cuda" if config.cluster.gpus_per_inference_worker else "cpu" if on_ray else device
    try:
        if hasattr(config, "learner"):
            config.learner.check_device(learner_device, config.cluster.n_learner_ranks)
        config.inference.check_device(inference_device)
    except ValueError as e:
        raise StartupError(str(e)) from None


def check_plugin_names(config) -> None:
    """The run's agents and environments looked up by name and their arguments bound to their constructors, nothing
    built: a misspelled name or argument stops the run in a second, before a warm start of minutes."""
    import rlsys.impl.agent  # noqa: F401  (registers the built-in agents and environments, as the roles do)
    import rlsys.impl.env  # noqa: F401
    from rlsys.api import AGENTS, ENVIRONMENTS
    from rlsys.workers.env_per_row import run_environments

    for abstraction in {repr(a): a for a in [config.agent, *config.agents.values()]}.values():
        try:
            AGENTS.check(abstraction.name, abstraction.args)
        except (KeyError, TypeError) as e:
            raise StartupError(f"agent {abstraction.name!r} cannot be built: {first_line(e)}") from None
    for abstraction in run_environments(config):
        try:
            ENVIRONMENTS.check(abstraction.name, abstraction.args)
        except (KeyError, TypeError) as e:
            raise StartupError(first_line(e)) from None


def check_plugins(config) -> None:
    """The run's agents built once and its environments' arguments checked, here, once `check_plugin_names` passed
    and the model is ready (the agents load its tokenizer): an argument or a value they refuse stops the run with
    their message, not a rollout worker restarted until it gives up, the reason in its log. Environments are not
    built here: some load a model (reward-model); their `check_args` refuses what they could never run with."""
    from rlsys.api import ENVIRONMENTS, make_agent
    from rlsys.workers.env_per_row import run_environments

    for abstraction in {repr(a): a for a in [config.agent, *config.agents.values()]}.values():
        try:
            make_agent(abstraction)
        except Exception as e:  # a plugin's constructor may raise anything
            raise StartupError(f"agent {abstraction.name!r} cannot be built: {first_line(e)}") from None
    for abstraction in run_environments(config):
        cls = ENVIRONMENTS.lookup(abstraction.name)
        try:
            getattr(cls, "check_args", lambda **_: None)(**abstraction.args)
        except ValueError as e:
            set_by = "".join(f" (the run sets its {arg} from {key})"
                             for arg, key in settings_behind(config, abstraction.name).items())
            raise StartupError(f"environment {abstraction.name!r}: {first_line(e)}{set_by}") from None


def settings_behind(config, env_name: str) -> dict[str, str]:
    """{argument of the environment `env_name`: the setting it takes its value from}, for string settings. An
    experiment hands its own settings to an environment under the environment's names (reward_model_path as
    model_path): an error in those names alone sends the user looking for a key they never set. Found by giving each
    setting a value of its own, in a copy of the config, and seeing which argument takes it."""
    from rlsys.workers.env_per_row import run_environments

    found = {}
    for field in describe_fields(type(config)):
        *parents, name = field.path.split(".")
        if field.is_group or not isinstance(getattr(functools.reduce(getattr, parents, config), name), str):
            continue
        probe, marker = copy.deepcopy(config), f"<{field.path}>"
        setattr(functools.reduce(getattr, parents, probe), name, marker)
        with contextlib.suppress(Exception):  # an experiment's property that cannot take the marker feeds nothing
            for abstraction in run_environments(probe):
                if abstraction.name == env_name:
                    found.update({arg: field.path for arg, value in abstraction.args.items() if value == marker})
    return found
