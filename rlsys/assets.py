"""What a run needs before its roles start: a dataset and a policy checkpoint, generated when not given."""

import contextlib
import fcntl
import functools
import hashlib
import json
import time
from pathlib import Path

from rlsys.data.dataset import load_rows, row_text, rows_fingerprint
from rlsys.data.prompts import no_share
from rlsys.placement.cpu_threads import torch_loaded_with_the_roles_spin, warm_start_threads
from rlsys.workers.env_per_row import check_env_names


class AssetError(ValueError):
    """A dataset or model the run cannot use; the message says what to do."""


def prepare_assets(config, log=functools.partial(print, flush=True)) -> float:
    """Fills in `config.dataset.path`, `config.dataset.eval_path` and `config.model.path`; returns the seconds a
    warm start took (building the tiny model, 0.0 where it was cached or not asked for), which the run reports apart
    from its training time.

    The experiment says what its generated dataset and its warm-start examples are (`generate_dataset`,
    `warm_start_examples`), so each task gets a tiny default model that knows its answer format.
    """
    cache = Path(config.model.cache_dir).expanduser()
    data = config.dataset
    if not data.path:
        train, held_out = config.generate_dataset(cache / "data")
        data.path, data.eval_path = str(train), data.eval_path or str(held_out)
    elif not data.eval_path:
        raise AssetError("dataset.eval_path is required with dataset.path: the run reports held-out accuracy")
    agent_names = list(config.agents)
    train_rows = load_rows(data.path, data.row_format(), agent_names)
    eval_rows = load_rows(data.eval_path, data.row_format(), agent_names)
    trained = set(map(row_text, train_rows))
    if leaked := sum(row_text(row) in trained for row in eval_rows):  # a user's split; the generated ones are disjoint
        log(f"warning: {leaked} of the {len(eval_rows)} held-out rows ({data.eval_path}) are also training rows "
            f"({data.path}): held-out accuracy counts them as if unseen")
    if len(train_rows) < config.cluster.n_rollout_workers:  # refused here, not by rollout workers that die at start
        raise AssetError(f"dataset {data.path}: {no_share(len(train_rows), config.cluster.n_rollout_workers)}")
    for rows, path in ((train_rows, data.path), (eval_rows, data.eval_path)):
        try:
            check_env_names(rows, config, path)
        except ValueError as e:
            raise AssetError(str(e)) from None
        config.check_rows(rows, path)
    given_model = bool(config.model.path) and not config.resume_from_checkpoint
    warm_start_seconds = 0.0
    if config.resume_from_checkpoint:
        check_resumable(config.resume_from_checkpoint)
        config.model.path = resumed_model_path(config.resume_from_checkpoint)
    elif not config.model.path:
        config.model.path, warm_start_seconds = tiny_model(config, train_rows, eval_rows, log)
        if caveat := config.tiny_model_caveat:
            log(f"warning: {caveat}")
    if not Path(config.model.path).exists():
        raise AssetError(f"model.path {config.model.path!r} does not exist; give an HF checkpoint directory "
                         "(written by save_pretrained), or leave model.path empty for the tiny model")
    if not (Path(config.model.path) / "config.json").exists():
        raise AssetError(f"model.path {config.model.path!r} is not an HF checkpoint directory (no config.json); "
                         "give a directory written by save_pretrained, or leave model.path empty for the tiny model")
    positions = (_model_config(config.model.path) or {}).get("max_position_embeddings")
    if given_model and (positions or config.inference.max_model_len):  # a resumed run's rows were checked at its start
        from rlsys.model.tokenizer import load_tokenizer  # the agents load it next (config_checks.check_plugins)

        check_prompt_lengths(config, load_tokenizer(config.model.path), positions, "the model's",
                             {data.path: train_rows, data.eval_path: eval_rows})
    return warm_start_seconds


def check_prompt_lengths(config, tokenizer, positions: int | None, whose: str, rows_at: dict[str, list[dict]]) -> None:
    """AssetError naming the file, row and field of the first prompt, as the rollout worker sends it (chat template,
    system prompt and template included), that leaves no room for an answer within the context inference gives
    (inference.max_model_len, else the model's positions): the engine would refuse every episode of it, after the
    roles, and a warm start, took minutes to start."""
    from rlsys.model.tokenizer import row_prompt_ids

    configured = config.inference.max_model_len
    limit = configured or positions
    context = f"inference.max_model_len={configured}" if configured else f"{whose} context of {limit} positions"
    longer = configured and (positions is None or configured < positions)  # what raising max_model_len would give
    for path, rows in rows_at.items():
        for number, row in enumerate(rows, 1):
            try:
                length = len(row_prompt_ids(tokenizer, row))
            except ValueError as e:  # a tokenizer without a chat template, one that refuses these messages
                raise AssetError(f"{path}: row {number}: the prompt cannot be sent to the model: {e}") from None
            if length >= limit:
                raise AssetError(f"{path}: row {number}: field {config.dataset.prompt_key!r} is a prompt of {length} "
                                 f"tokens as the model is sent it, and {context} leaves room for at most {limit - 1} "
                                 "(one more for the answer): shorten or drop the row"
                                 + (", or raise inference.max_model_len" if longer else ""))


def tiny_model(config, train_rows: list[dict], eval_rows: list[dict], log) -> tuple[str, float]:
    """The tiny default model's directory, taught the rows and cached, and the seconds its warm start took (0.0 where
    it was cached, the wait where another run built it); a warm start that runs again first says what differs from
    the nearest cached model."""
    key = tiny_model_key(config.model, config.seed, rows_key(train_rows, eval_rows), warm_start_key(config))
    directory = tiny_model_dir(config.model, key)
    if (directory / "config.json").exists():
        return str(directory), 0.0
    started = time.monotonic()
    with one_builder(directory, log):
        if (directory / "config.json").exists():  # another run built it while this one waited
            return str(directory), time.monotonic() - started
        _build_tiny_model(config, key, directory, train_rows, eval_rows, log)
    return str(directory), time.monotonic() - started


@contextlib.contextmanager
def one_builder(directory: Path, log):
    """Held while the tiny model for `directory` is built: runs started together (a sweep over ppo.lr, say) warm-start
    it once and the others wait for it, where each warm-started its own on the same cores and they wrote and renamed
    one `.tmp` folder. The system drops the lock of a builder that dies; the next waiter builds."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.with_name(directory.name + ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another run is warm-starting this tiny model ({directory}): waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build_tiny_model(config, key: dict, directory: Path, train_rows: list[dict], eval_rows: list[dict], log) -> None:
    data = config.dataset
    if nearest := nearest_cached_difference(directory.parent, key):
        log(f"no tiny model is cached for these settings; the nearest cached one was built with {nearest}: "
            "building and warm-starting it again")
    torch_loaded_with_the_roles_spin()
    from rlsys.model.tiny import MAX_POSITIONS, prepare_tiny_model  # torch and transformers' models:
    from rlsys.model.tokenizer import build_char_tokenizer  # only to build one

    check_prompt_lengths(config, build_char_tokenizer(), MAX_POSITIONS, "the tiny model's",
                         {data.path: train_rows, data.eval_path: eval_rows})
    examples = functools.partial(config.warm_start_examples, train_rows=train_rows, eval_rows=eval_rows)
    prepare_tiny_model(
        config.model, config.seed, examples, directory, log, batch_size=config.warm_start_batch_size,
        eval_every=config.warm_start_eval_every, max_steps=config.warm_start_max_steps,
        threads=warm_start_threads(config), samples=config.group_size, temperature=config.gen.temperature)
    (directory / CACHE_KEY_FILE).write_text(json.dumps(key, sort_keys=True))


def check_resumable(checkpoint: str) -> None:
    """resume_from_checkpoint names a checkpoint a run saved, with its trainer state, or the run stops here naming
    that key (not model.path, which it fills in)."""
    from rlsys.checkpoint import TRAINER_STATE

    what = "give a checkpoint a run saved (runs/<experiment>/<trial>/checkpoints/step_N), or auto"
    if not Path(checkpoint).is_dir():
        raise AssetError(f"resume_from_checkpoint {checkpoint!r} does not exist; {what}")
    if not (Path(checkpoint) / TRAINER_STATE).is_file():
        weights = (Path(checkpoint) / "config.json").is_file()  # an HF model: a fresh start from it is model.path's
        raise AssetError(f"resume_from_checkpoint {checkpoint!r} is not an rlsys checkpoint (no {TRAINER_STATE}): "
                         + what + (f"; to start from its weights instead, model.path={checkpoint}" if weights else ""))


def resumed_model_path(checkpoint: str) -> str:
    """What a resumed run's roles build their models and tokenizer from; the weights are the checkpoint's, loaded
    over it (the learner) or published (inference). The model the run started from, while it is there with the
    checkpoint's shape: save_total_limit deletes the checkpoint once newer ones of its line are saved, and a role
    restarted after that builds from model.path again. Else the checkpoint's own export."""
    from rlsys.checkpoint import read_trainer_state

    initial, shape = read_trainer_state(Path(checkpoint)).get("initial_model_path"), _model_config(checkpoint)
    return initial if initial and shape is not None and _model_config(initial) == shape else checkpoint


def _model_config(directory: str) -> dict | None:
    """The HF config's fields that give the model its shape (not the versions or dtype it was saved with)."""
    try:
        fields = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return {k: v for k, v in fields.items() if k not in ("transformers_version", "torch_dtype", "dtype",
                                                         "_name_or_path")}


CACHE_KEY_FILE = "rlsys_cache_key.json"  # beside a cached tiny model: what it was built with, to say what differs


def tiny_model_key(cfg, seed: int, data: str, warm_start: dict) -> dict:
    """Everything that changes the tiny model, as JSON reads it back: `data` names the rows it is taught and checked
    on (rows_key), `warm_start` the experiment's own settings."""
    return json.loads(json.dumps({"model": vars(cfg), "seed": seed, "data": data, "warm_start": warm_start},
                                 default=str))


def tiny_model_dir(cfg, key: dict) -> Path:
    """The tiny model's cache directory, named by its key (tiny_model_key)."""
    text = json.dumps(key, sort_keys=True, default=str)
    return Path(cfg.cache_dir).expanduser() / "models" / hashlib.sha256(text.encode()).hexdigest()[:16]


def nearest_cached_difference(models: Path, key: dict) -> str:
    """What sets `key` apart from the cached model whose key differs least, in the settings' names ("" where no
    cached model has its key beside it): a warm start that runs again says why, not only that it runs."""
    cached = []
    for file in models.glob(f"*/{CACHE_KEY_FILE}"):
        try:
            cached.append(key_differences(key, json.loads(file.read_text())))
        except (OSError, ValueError):
            continue  # a model being written, or one a user edited: no figure to compare, nothing to say
    return " and ".join(min(cached, key=len)) if cached else ""


def key_differences(key: dict, other: dict) -> list[str]:
    train, held_out = key["data"].split(":")
    other_train, other_held_out = other.get("data", ":").split(":")
    names = [f"model.{name}" for name, value in key["model"].items() if other.get("model", {}).get(name) != value]
    names += ["seed"] * (key["seed"] != other.get("seed"))
    names += ["another warm-start schedule (the experiment's)"] * (key["warm_start"] != other.get("warm_start"))
    differences = [f"other {', '.join(names)}"] if names else []
    if held_out != other_held_out:  # a warm start is checked on, and stops on, the first held-out rows
        differences.append("other held-out rows (dataset.num_eval, dataset.eval_path: the warm start stops on their "
                           "accuracy)")
    if train != other_train:
        differences.append("other training rows (dataset.path, dataset.num_train; a generated set's also move with "
                           "dataset.num_eval and seed)")
    return differences


def rows_key(train_rows: list[dict], eval_rows: list[dict]) -> str:
    """The rows a warm start is taught and checked on, as the run sends them: the dataset's folder alone kept a model
    taught on other prompts when the file, its keys, dataset.system_prompt or dataset.prompt_template changed."""
    return f"{rows_fingerprint(train_rows)}:{rows_fingerprint(eval_rows)}"


def warm_start_key(config) -> dict:
    """What besides model.*, the seed and the dataset changes the tiny model: the experiment's warm-start schedule,
    and with model.warm_start_reach the group and temperature its reach is sampled at."""
    if not config.model.warm_start_reach:
        return config.warm_start_settings
    return {**config.warm_start_settings, "samples": config.group_size, "temperature": config.gen.temperature}
