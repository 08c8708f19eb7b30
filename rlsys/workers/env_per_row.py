"""Rows that name their environment (`env_name`), so one run can mix environment types (verl's mixed rows,
ROLL's tags): which environment plays a row, in training and in evaluation (ROLL's val_env_manager), and
metrics kept apart per environment type."""

from rlsys.api import EnvServiceAbstraction, Prompt, Trajectory

ENV_NAME = "env_name"  # the row field


def env_for(config, prompt: Prompt, evaluation: bool) -> EnvServiceAbstraction:
    """The environment the row names (checked when the run started), else the experiment's `env`; evaluation
    takes the experiment's `eval_envs`, which may set the same environments up differently."""
    envs = config.eval_envs if evaluation else config.envs
    name = prompt.data.get(ENV_NAME)
    return envs[name] if name is not None else (envs.get(config.env.name) or config.env)


def run_environments(config) -> list[EnvServiceAbstraction]:
    """Every distinct environment set-up a run's episodes may use, in training and in evaluation."""
    distinct = {repr(env): env for env in [config.env, *config.envs.values(), *config.eval_envs.values()]}
    return list(distinct.values())


def env_type(config, prompt: Prompt) -> str:
    return prompt.data.get(ENV_NAME) or config.env.name


def with_env_type_metrics(trajectories: list[Trajectory], env_name: str) -> list[Trajectory]:
    """Each trajectory's reward and agent metrics again under `<env_name>/`, so the learner's averages (taken
    over the trajectories that carry a key) report every environment type on its own."""
    for t in trajectories:
        t.metrics = {**t.metrics, f"{env_name}/reward": t.reward,
                     **{f"{env_name}/{key}": value for key, value in t.metrics.items()}}
    return trajectories


def check_env_names(rows: list[dict], config, path: str) -> None:
    """ValueError naming the file and row of the first row whose `env_name` the experiment does not offer."""
    offered = sorted(set(config.envs) | set(config.eval_envs))
    for number, row in enumerate(rows, 1):
        name = row.get(ENV_NAME)
        if name is not None and (not isinstance(name, str) or name not in config.envs or name not in config.eval_envs):
            raise ValueError(f"{path}: row {number}: {ENV_NAME} {name!r} is not an environment of this experiment; "
                             f"it has {offered}")
