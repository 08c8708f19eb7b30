"""Text-game datasets (one puzzle per row, by seed) and warm-start transcripts of valid moves, all seeded."""

import copy
import random
from pathlib import Path

from rlsys.data.arithmetic import write_jsonl
from rlsys.data.dataset import DatasetError
from rlsys.impl.env.text_game import MOVES, GridGame, TextGameEnv
from rlsys.model.warm_start_examples import AnswerCheck, TaughtSequence, answer_ids
from rlsys.model.tokenizer import message_after_ids, row_prompt_ids

MAX_DRAWS_PER_ROW = 50  # small boards repeat; give up rather than loop if the options allow too few


def generate_game_dataset(directory: Path, env: TextGameEnv, options: dict, seed: int, num_train: int,
                          num_eval: int) -> tuple[Path, Path]:
    """train.jsonl and eval.jsonl of distinct puzzles (no board in both); rows {"prompt", "answer", "seed", **options}.

    "prompt" is the first observation, "answer" a shortest solution (for reference; rewards come from the env).
    """
    train, held_out = directory / "train.jsonl", directory / "eval.jsonl"
    if train.exists() and held_out.exists():
        return train, held_out
    rng, rows, boards = random.Random(seed), [], set()
    for _ in range(MAX_DRAWS_PER_ROW * (num_train + num_eval)):
        if len(rows) == num_train + num_eval:
            break
        puzzle_seed = rng.randrange(2**31)
        game = env.new_game(puzzle_seed, options)
        if game.render() in boards:
            continue
        boards.add(game.render())
        rows.append({"prompt": env.instruction + game.render(), "answer": game.solution(), "seed": puzzle_seed,
                     **options})
    if len(rows) < num_train + num_eval:
        raise DatasetError(f"only {len(rows)} distinct puzzles with {options}; asked for {num_train} train + "
                           f"{num_eval} eval: lower dataset.num_train and dataset.num_eval to at most {len(rows)} "
                           "together, or make the board larger (game_size)")
    write_jsonl(rows[:num_eval], held_out)
    write_jsonl(rows[num_eval:], train)
    return train, held_out


def check_seeds(rows: list[dict], path: str) -> None:
    """DatasetError naming the file and row of the first row without an integer `seed`: the environment rebuilds each
    row's puzzle (or shop task) from it, so every episode of such a row would fail at reset, and the warm start's
    walks through it raised a KeyError."""
    for number, row in enumerate(rows, 1):
        seed = row.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise DatasetError(f"{path}: row {number}: field 'seed' must be an integer, the seed its puzzle or task is "
                               f"rebuilt from; got {'nothing' if seed is None else repr(seed)[:40]}")


def valid_moves(game: GridGame) -> list[str]:
    """Moves that change the board and do not lose the game (into a hole), in MOVES order."""
    valid = []
    for move in MOVES:
        probe = copy.deepcopy(game)
        _, terminated, effective = probe.move(move)
        if effective and (probe.solved or not terminated):
            valid.append(move)
    return valid


class Walk:
    """A conversation taught to the tiny model: the prompt, then responses (taught, each ending in eos) and the
    observations after them (not taught), tokenized as a multi-turn agent's transcript would be."""

    def __init__(self, tokenizer, row: dict):
        self.tokenizer = tokenizer
        prompt = row_prompt_ids(tokenizer, row)  # as the rollout worker sends it: a system prompt included
        self.sequence, self.last = TaughtSequence(prompt, [0] * len(prompt)), []

    def check(self, accepted: tuple[str, ...]) -> AnswerCheck:
        """A held-out check of the walk as it is now: the next response should be one of `accepted`."""
        return AnswerCheck(list(self.sequence.token_ids), accepted)

    def respond(self, text: str) -> None:
        self.last = answer_ids(self.tokenizer, text)
        self.sequence.token_ids += self.last
        self.sequence.taught += [1] * len(self.last)

    def observe(self, text: str) -> None:
        ids = message_after_ids(self.tokenizer, self.last, "user", text)
        self.sequence.token_ids += ids
        self.sequence.taught += [0] * len(ids)


def random_walks(tokenizer, env: TextGameEnv, rows: list[dict], num_turns: int, seed: int,
                 hint: float) -> tuple[list[TaughtSequence], list[AnswerCheck]]:
    """A walk of valid moves through each row's puzzle, tokenized as the text-game agent's conversation would be.

    With probability `hint` a step takes the first move of a shortest solution, otherwise a random valid move:
    the walks teach the move format and the rules and hint at the goal, and leave finding it to RL. Each walk
    is one taught sequence (every move and its eos taught, the boards not); each state is also a check that
    accepts every valid move there.
    """
    rng = random.Random(seed)
    walks, checks = [], []
    for row in rows:
        game = env.new_game(row["seed"], row)
        walk = Walk(tokenizer, row)
        for turn in range(1, min(num_turns, env.max_steps) + 1):
            moves = valid_moves(game)
            if not moves:
                break
            checks.append(walk.check(tuple(moves)))
            solution = game.solution() if rng.random() < hint else None
            move = solution[0] if solution else rng.choice(moves)
            walk.respond(move)
            _, terminated, _ = game.move(move)
            if terminated or turn == min(num_turns, env.max_steps):
                break  # as the agent does: no board after the last move
            walk.observe(game.render())
        walks.append(walk.sequence)
    rng.shuffle(checks)
    return walks, checks
